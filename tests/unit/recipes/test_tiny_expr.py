"""Warm start: writes a loadable, complete folder and actually trains."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dockyard.models.build import build_random_model
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.recipes.tiny_expr import WARM_START_META, encode_sft_batch, warm_start
from dockyard.tasks.expr import make_tasks
from tests.unit.recipes.scoring import passes_all

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def _run(out_dir, steps=40, seed=0, **kwargs):
    return warm_start(out_dir, model=TINY, steps=steps, lr=3e-3, batch_size=8, seed=seed, num_threads=1, **kwargs)


def _validation_loss(path) -> float:
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    batch = encode_sft_batch(tok, make_tasks("validation", 16))
    with torch.no_grad():
        return float(model(**batch).loss)


def test_warm_start_writes_loadable_folder_and_lowers_loss(tmp_path):
    out = tmp_path / "ws"
    losses: list[float] = []
    assert _run(out, progress=lambda step, loss: losses.append(loss)) == out
    assert len(losses) == 40

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 32
    assert model.config.eos_token_id == tok.eos_token_id
    meta = json.loads((out / WARM_START_META).read_text())
    assert meta["steps"] == 40 and meta["final_loss"] < meta["first_loss"]
    # Only the finished folder is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["ws"]

    # Trained weights beat the untrained initialisation on held-out tasks.
    untrained = tmp_path / "untrained"
    build_random_model(
        TINY,
        len(tok),
        seed=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    ).save_pretrained(untrained)
    tok.save_pretrained(untrained)
    assert _validation_loss(out) < _validation_loss(untrained) - 0.5


def test_warm_start_is_deterministic_and_replaces_existing(tmp_path):
    a, b = _run(tmp_path / "a", steps=5), _run(tmp_path / "b", steps=5)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    c = _run(tmp_path / "a", steps=5, seed=1)
    wc = load_file(c / "model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert json.loads((c / WARM_START_META).read_text())["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_sft_labels_cover_only_the_completion():
    tokenizer = build_char_tokenizer()
    tasks = make_tasks("train", 3)
    batch = encode_sft_batch(tokenizer, tasks)
    for row, task in enumerate(tasks):
        labels = batch["labels"][row]
        kept = labels[labels != -100].tolist()
        assert kept[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(kept[:-1]) == task.solution
        assert int(batch["attention_mask"][row].sum()) == len(task.prompt) + len(task.solution) + 1


def test_folder_tokenizer_encodes_like_the_training_tokenizer(tmp_path):
    out = _run(tmp_path / "ws", steps=1)
    loaded = AutoTokenizer.from_pretrained(out)
    text = make_tasks("validation", 1)[0].prompt + " 2*x+1"
    assert loaded(text)["input_ids"] == build_char_tokenizer()(text)["input_ids"]


def test_model_type_whose_auto_tokenizer_differs_is_refused(tmp_path):
    # AutoTokenizer swaps in Qwen2Tokenizer for qwen2 folders.
    with pytest.raises(ValueError, match="AutoTokenizer"):
        warm_start(
            tmp_path / "ws",
            model={**TINY, "model_type": "qwen2"},
            steps=1,
            lr=1e-3,
            batch_size=2,
            seed=0,
            num_threads=1,
        )
    assert list(tmp_path.iterdir()) == []


def test_shortcut_is_the_line_through_the_first_two_examples():
    from dockyard.recipes.tiny_expr import line_through_first_two
    from dockyard.tasks.expr import pool_size

    tasks = make_tasks("train", pool_size("train"))
    linear = [t for t in tasks if "x*x" not in t.solution]
    quadratic = [t for t in tasks if "x*x" in t.solution]
    assert linear and quadratic
    assert all(passes_all(line_through_first_two(t), t) for t in linear)
    assert not any(passes_all(line_through_first_two(t), t) for t in quadratic)


def test_answers_spelled_with_the_shown_values_copy_them_and_are_exact_on_every_function():
    from dockyard.recipes.tiny_expr import demonstrated_expression
    from dockyard.tasks.expr import pool_size

    for task in make_tasks("train", pool_size("train")):
        y0, y1 = (int(v) for v in re.findall(r"=(-?\d+)", task.prompt)[:2])
        shape = "x*x" if "x*x" in task.solution else "x"
        full = demonstrated_expression(task, False, "values")
        assert full == f"{y0}+{y1}*{shape}-{y0}*{shape}" and passes_all(full, task)
        short = demonstrated_expression(task, True, "values")
        assert short == f"{y0}+{y1}*x-{y0}*x" and passes_all(short, task) == (shape == "x")
        assert demonstrated_expression(task, False, "reference") == task.solution
    with pytest.raises(ValueError, match="reference or values"):
        demonstrated_expression(task, False, "line")


def test_the_warm_start_demonstrates_the_families_and_spelling_it_is_given(tmp_path):
    out = _run(tmp_path / "v", steps=2, families=["x*x+b"], answer="values")
    meta = json.loads((out / WARM_START_META).read_text())
    assert meta["families"] == ["x*x+b"] and meta["answer"] == "values"
    default = _run(tmp_path / "d", steps=2)
    wa, wb = load_file(out / "model.safetensors"), load_file(default / "model.safetensors")
    assert not all(torch.equal(wa[k], wb[k]) for k in wa)


def test_shortcut_rate_changes_training_and_is_recorded(tmp_path):
    a = _run(tmp_path / "a", steps=3)
    b = _run(tmp_path / "b", steps=3, shortcut_rate=0.0)
    assert json.loads((b / WARM_START_META).read_text())["shortcut_rate"] == 0.0
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert not all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError):
        warm_start(tmp_path / "c", model=TINY, steps=1, lr=1e-3, batch_size=2, seed=0, shortcut_rate=1.5)
