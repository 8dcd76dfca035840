"""Checks report.md: its sections, its timeline, its impact figure, its follow-ups."""

import re

SECTIONS = ["Summary", "Timeline", "Impact", "Follow-ups"]
TIMES = ["21:04", "21:09", "21:17", "21:26", "21:31"]
number = 0


def check(name, test):
    global number
    number += 1
    try:
        ok, why = bool(test()), ""
    except Exception as exc:  # a malformed deliverable fails the check, never the checker
        ok, why = False, f"{type(exc).__name__}: {exc}"
    print(f"{'ok' if ok else 'not ok'} {number} - {name}" + (f" # {why}" if why else ""))


def text():
    with open("report.md", encoding="utf-8") as f:
        return f.read()


def section(title):
    parts = re.split(r"^## +", text(), flags=re.MULTILINE)
    found = [p for p in parts[1:] if p.splitlines()[0].strip().lower() == title.lower()]
    assert found, f"no '## {title}' section"
    return found[0]


def headings():
    return [h.strip() for h in re.findall(r"^## +(.+)$", text(), flags=re.MULTILINE)]


check("the four sections, in order", lambda: headings() == SECTIONS)
check("the summary is not empty", lambda: len(section("Summary").split()) >= 6)
check(
    "the timeline lists every timestamp as a bullet, in order",
    lambda: re.findall(r"^\s*[-*] .*?(\d\d:\d\d)", section("Timeline"), flags=re.MULTILINE) == TIMES,
)
check("the impact states 27 minutes", lambda: re.search(r"\b27\s*(?:minutes|min)\b", section("Impact")))
check(
    "at least two follow-up bullets",
    lambda: len(re.findall(r"^\s*[-*] \S", section("Follow-ups"), flags=re.MULTILINE)) >= 2,
)
