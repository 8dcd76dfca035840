import json
from pathlib import Path

import pytest

SUMMARY = Path("/app/summary.json")


def test_summary_is_json_object():
    assert isinstance(json.loads(SUMMARY.read_text()), dict)


def test_totals():
    totals = json.loads(SUMMARY.read_text())
    assert totals == {"east": pytest.approx(7.0), "north": pytest.approx(12.75), "south": pytest.approx(5.0)}


def test_keys_sorted():
    assert list(json.loads(SUMMARY.read_text())) == ["east", "north", "south"]
