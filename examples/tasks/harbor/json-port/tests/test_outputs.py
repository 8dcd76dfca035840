import json
from pathlib import Path


def config():
    return json.loads(Path("/app/config.json").read_text())


def test_port():
    assert config()["port"] == 8080


def test_debug_off():
    assert config()["debug"] is False


def test_other_keys_kept():
    assert {k: v for k, v in config().items() if k not in ("port", "debug")} == {"name": "shop", "workers": 2}
