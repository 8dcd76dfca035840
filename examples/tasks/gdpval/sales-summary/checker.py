"""Checks summary.csv against the figures of the task's sales.csv (kept here: the agent may edit its copy)."""

import csv

EXPECTED = {"east": (100.00, 2), "north": (200.00, 3), "south": (180.00, 2), "west": (75.75, 1)}
number = 0


def check(name, test):
    global number
    number += 1
    try:
        ok, why = bool(test()), ""
    except Exception as exc:  # a malformed deliverable fails the check, never the checker
        ok, why = False, f"{type(exc).__name__}: {exc}"
    print(f"{'ok' if ok else 'not ok'} {number} - {name}" + (f" # {why}" if why else ""))


def rows():
    with open("summary.csv", newline="") as f:
        return list(csv.reader(f))


def body():
    lines = [r for r in rows()[1:] if r]
    assert lines, "no line after the header"
    return lines


check("header is region,total,count", lambda: [c.strip() for c in rows()[0]] == ["region", "total", "count"])
check("one line per region, sorted", lambda: [r[0].strip() for r in body()] == sorted(EXPECTED))
check(
    "totals are the sums of amounts",
    lambda: all(abs(float(r[1]) - EXPECTED[r[0].strip()][0]) < 0.005 for r in body()),
)
check("counts are the numbers of sales", lambda: all(int(r[2]) == EXPECTED[r[0].strip()][1] for r in body()))
check("totals have two decimals", lambda: all(len(r[1].strip().split(".")[-1]) == 2 for r in body()))
