"""Checks totals.json's figures and invoice.md's table and total line."""

import json
import re

ITEMS = [("USB-C cable", 4, 9.99), ("Laptop stand", 2, 34.50), ("Keyboard", 1, 79.00), ("Monitor arm", 3, 45.25)]
SUBTOTAL, TAX, TOTAL = 323.71, 25.90, 349.61
number = 0


def check(name, test):
    global number
    number += 1
    try:
        ok, why = bool(test()), ""
    except Exception as exc:  # a malformed deliverable fails the check, never the checker
        ok, why = False, f"{type(exc).__name__}: {exc}"
    print(f"{'ok' if ok else 'not ok'} {number} - {name}" + (f" # {why}" if why else ""))


def totals():
    with open("totals.json", encoding="utf-8") as f:
        return json.load(f)


def rows():
    with open("invoice.md", encoding="utf-8") as f:
        cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in f if line.strip().startswith("|")]
    return [r for r in cells[1:] if not set("".join(r)) <= set("-: ")]  # past the header and its rule


def near(value, expected):
    return abs(float(value) - expected) < 0.005


check("subtotal", lambda: near(totals()["subtotal"], SUBTOTAL))
check("tax is 8% of the subtotal, in cents", lambda: near(totals()["tax"], TAX))
check("total", lambda: near(totals()["total"], TOTAL))
check("one table row per item, in order", lambda: [r[0] for r in rows()] == [i for i, _, _ in ITEMS])
check(
    "amounts are quantity times unit price",
    lambda: (
        len(rows()) == len(ITEMS)
        and all(near(r[3].lstrip("$"), q * p) for r, (_, q, p) in zip(rows(), ITEMS, strict=True))
    ),
)
check("the total line", lambda: re.search(r"^Total: \$349\.61\s*$", open("invoice.md").read(), flags=re.MULTILINE))
