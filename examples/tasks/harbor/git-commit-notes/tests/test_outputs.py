import subprocess

REPO = "/app/repo"


def git(*args):
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout


def test_last_commit_message():
    assert git("log", "-1", "--format=%s") == "Add notes\n"


def test_commit_holds_only_notes():
    assert git("show", "--name-only", "--format=", "HEAD") == "notes.txt\n"
    assert git("show", "HEAD:notes.txt") == "remember the milk\n"


def test_on_top_of_history():
    assert git("rev-list", "--count", "HEAD") == "2\n"
    assert git("rev-parse", "--abbrev-ref", "HEAD") == "main\n"


def test_config_change_left_uncommitted():
    assert git("status", "--porcelain") == " M config.ini\n"
