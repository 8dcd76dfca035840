from pathlib import Path

DOCS = Path("/app/docs")


def test_no_txt_left():
    assert not list(DOCS.rglob("*.txt"))


def test_renamed_with_content():
    assert (DOCS / "a.md").read_text() == "alpha\n"
    assert (DOCS / "b.md").read_text() == "beta\n"
    assert (DOCS / "sub" / "c.md").read_text() == "gamma\n"


def test_other_files_kept():
    assert (DOCS / "readme.rst").read_text() == "keep me\n"
    assert sorted(p.name for p in DOCS.rglob("*") if p.is_file()) == ["a.md", "b.md", "c.md", "readme.rst"]
