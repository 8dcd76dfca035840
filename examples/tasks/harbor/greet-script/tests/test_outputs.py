import subprocess
from pathlib import Path

SCRIPT = Path("/app/greet.sh")


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=10)


def test_script_exists():
    assert SCRIPT.is_file()


def test_greets_the_name():
    assert run("Ada").stdout == "Hello, Ada!\n"


def test_name_with_spaces():
    assert run("Grace Hopper").stdout == "Hello, Grace Hopper!\n"


def test_default_is_world():
    assert run().stdout == "Hello, world!\n"
