#!/bin/bash
# Reference solution: run in the work folder.
set -euo pipefail
python3 - <<'PY'
import csv
import json
from decimal import ROUND_HALF_UP, Decimal

cent = Decimal("0.01")
with open("items.csv", newline="") as f:
    items = [(r["item"], int(r["quantity"]), Decimal(r["unit_price"])) for r in csv.DictReader(f)]
subtotal = sum(q * p for _, q, p in items)
tax = (subtotal * Decimal("0.08")).quantize(cent, ROUND_HALF_UP)
total = subtotal + tax
with open("totals.json", "w") as f:
    json.dump({"subtotal": float(subtotal), "tax": float(tax), "total": float(total)}, f)
lines = ["| Item | Quantity | Unit price | Amount |", "| --- | --- | --- | --- |"]
lines += [f"| {i} | {q} | {p:.2f} | {q * p:.2f} |" for i, q, p in items]
with open("invoice.md", "w") as f:
    f.write("\n".join(lines) + f"\n\nTotal: ${total:.2f}\n")
PY
