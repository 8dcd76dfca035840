from pathlib import Path


def test_count():
    assert Path("/app/error_count.txt").read_text() == "3\n"


def test_distinct_messages():
    assert Path("/app/error_messages.txt").read_text() == "disk sda1 full\nnetwork down\n"


def test_log_untouched():
    assert len(Path("/app/data/log.txt").read_text().splitlines()) == 8
