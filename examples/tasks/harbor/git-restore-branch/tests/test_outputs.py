import subprocess
from pathlib import Path

REPO = "/app/repo"


def git(*args):
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout


def test_config_restored():
    assert Path(REPO, "config.ini").read_text() == "[server]\nport = 8000\nhost = localhost\n"


def test_release_branch_at_head():
    assert git("rev-parse", "release") == git("rev-parse", "HEAD")


def test_still_on_main_without_new_commit():
    assert git("rev-parse", "--abbrev-ref", "HEAD") == "main\n"
    assert git("rev-list", "--count", "HEAD") == "1\n"


def test_untracked_notes_kept():
    assert Path(REPO, "notes.txt").read_text() == "remember the milk\n"
