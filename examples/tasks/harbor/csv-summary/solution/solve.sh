#!/bin/bash
python3 - <<'PY'
import csv
import json
from collections import defaultdict

totals = defaultdict(float)
with open("/app/sales.csv", newline="") as file:
    for row in csv.DictReader(file):
        totals[row["region"]] += float(row["amount"])
with open("/app/summary.json", "w") as out:
    json.dump(dict(sorted(totals.items())), out, indent=2)
PY
