"""Checks config.json: valid JSON, exactly the asked keys, each value as the request states it."""

import json

ORIGINS = ["https://admin.example.com", "https://app.example.com", "https://reports.example.com"]
KEYS = {"service", "port", "replicas", "tls", "allowed_origins", "memory_mb"}
number = 0


def check(name, test):
    global number
    number += 1
    try:
        ok, why = bool(test()), ""
    except Exception as exc:  # a malformed deliverable fails the check, never the checker
        ok, why = False, f"{type(exc).__name__}: {exc}"
    print(f"{'ok' if ok else 'not ok'} {number} - {name}" + (f" # {why}" if why else ""))


def config():
    with open("config.json", encoding="utf-8") as f:
        value = json.load(f)
    assert isinstance(value, dict), "config.json is not a JSON object"
    return value


def exactly(key, value):
    return lambda: type(config()[key]) is type(value) and config()[key] == value


check("exactly the asked keys", lambda: set(config()) == KEYS)
check("service is ledger", exactly("service", "ledger"))
check("port is 8443", exactly("port", 8443))
check("replicas is 3", exactly("replicas", 3))
check("tls is true", exactly("tls", True))
check("allowed_origins: the three origins, sorted", exactly("allowed_origins", ORIGINS))
check("memory_mb is 1536", exactly("memory_mb", 1536))
