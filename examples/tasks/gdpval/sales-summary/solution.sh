#!/bin/bash
# Reference solution: run in the work folder.
set -euo pipefail
python3 - <<'PY'
import csv
from collections import defaultdict
totals, counts = defaultdict(float), defaultdict(int)
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += float(row["amount"])
        counts[row["region"]] += 1
with open("summary.csv", "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["region", "total", "count"])
    for region in sorted(totals):
        out.writerow([region, f"{totals[region]:.2f}", counts[region]])
PY
