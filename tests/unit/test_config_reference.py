"""docs/configuration.md's field rows are copies of the fields' descriptions (dockyard.config.reference)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from dockyard.config.reference import doc_problems, leaves, main, tables

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


class Inner(BaseModel):
    depth: int = Field(3, description="How deep.")


class Tiny(BaseModel):
    name: str = Field("x", description="A name.")
    undocumented: int = 0
    inner: Inner = Field(default_factory=Inner)


def test_every_leaf_key_has_a_description_and_a_row_that_equals_it() -> None:
    problems = doc_problems(DOC.read_text(encoding="utf-8"))
    assert not problems, "docs/configuration.md differs from the fields:\n" + "\n".join(problems)
    assert len(leaves()) > 200  # the walk reaches every section, lists and optional ones included


def test_the_check_catches_a_missing_description_a_missing_row_and_a_changed_text() -> None:
    doc = (
        "| `name` | `x` | A name, said otherwise. |\n"
        "| `inner.depth` | `3` | How deep. |\n"
        "| `inner.gone` | `1` | Old. |\n"
    )
    problems = doc_problems(doc, Tiny)
    assert any(p.startswith("undocumented: the field has no description") for p in problems)
    assert any(p.startswith("undocumented: no row in the doc") for p in problems)
    assert any(p.startswith("name: the doc says 'A name, said otherwise.'") for p in problems)
    assert "inner.gone: a doc row for a key the code lacks" in problems
    assert not any(p.startswith("inner.depth") for p in problems)


def test_the_check_catches_a_wrong_default() -> None:
    problems = doc_problems("| `depth` | `4` | How deep. |\n", Inner)
    assert problems == ["depth: the doc's default is `4`, the code's `3`"]


def test_the_printed_tables_pass_the_check(capsys) -> None:
    assert doc_problems(tables()) == []
    assert main([]) == 0
    assert "| `policy.generation.temperature` | `1.0` |" in capsys.readouterr().out
    assert main([str(DOC)]) == 0
