#!/bin/bash
python3 - <<'PY'
import json

with open("/app/config.json") as file:
    config = json.load(file)
config.update(port=8080, debug=False)
with open("/app/config.json", "w") as file:
    json.dump(config, file, indent=2)
PY
