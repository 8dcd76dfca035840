from pathlib import Path

GREETING = Path("/app/greeting.txt")


def test_file_exists():
    assert GREETING.is_file(), f"{GREETING} is missing"


def test_content_is_one_line():
    assert GREETING.read_text() == "hello, terminal\n"


def test_nothing_else_in_app():
    assert sorted(p.name for p in Path("/app").iterdir()) == ["greeting.txt"]
