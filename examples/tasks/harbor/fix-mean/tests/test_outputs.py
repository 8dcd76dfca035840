import importlib.util

import pytest


def load():
    spec = importlib.util.spec_from_file_location("calc", "/app/calc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("values", "expected"), [([1, 2, 3, 4], 2.5), ([5], 5.0), ([-2, 2], 0.0)])
def test_mean(values, expected):
    assert load().mean(values) == pytest.approx(expected)


def test_mean_of_nothing():
    assert load().mean([]) == 0.0


def test_clamp_unchanged():
    calc = load()
    assert (calc.clamp(5, 0, 3), calc.clamp(-1, 0, 3), calc.clamp(2, 0, 3)) == (3, 0, 2)
