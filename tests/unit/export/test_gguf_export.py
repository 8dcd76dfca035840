"""GGUF export: every direct type written with the gguf package, read back and checked against the HF
folder (values, shapes, the llama q/k layout), and validation that deletes a bad output naming the tensor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from dockyard.export import gguf_export
from dockyard.export.gguf_export import DIRECT_TYPES, Expected, GgufError, export, validate
from dockyard.models.build import build_random_model
from dockyard.models.tokenizer import build_char_tokenizer
from tests.conftest import REPO_ROOT

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256}  # fmt: skip


def hf_folder(root: Path, model_type: str, **extra) -> Path:
    tok = build_char_tokenizer()
    model = build_random_model(
        {"model_type": model_type, **SHAPE, **extra}, len(tok), 0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    folder = root / model_type
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": hf_folder(root, "llama", tie_word_embeddings=False),
        "qwen2": hf_folder(root, "qwen2", tie_word_embeddings=True),
    }


def read(path: Path) -> tuple[gguf.GGUFReader, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    values = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return reader, values


# Worst-case error per element of each type on weights of this scale (init std 0.02).
TOLERANCE = {
    "f32": 0.0,
    "f16": 1e-4,
    "bf16": 1e-3,
    "q8_0": 2e-3,
    "q5_0": 1e-2,
    "q5_1": 1e-2,
    "q4_0": 2e-2,
    "q4_1": 2e-2,
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("type_name", DIRECT_TYPES)
def test_each_direct_type_holds_the_model(folders, tmp_path: Path, model_type: str, type_name: str) -> None:
    folder = folders[model_type]
    out = tmp_path / f"m.{type_name}.gguf"
    assert export(folder, out, type_name) == []
    reader, values = read(out)
    assert reader.get_field("general.architecture").contents() == model_type
    assert reader.get_field("general.file_type").contents() == gguf_export._file_type(type_name)
    assert reader.get_field(f"{model_type}.block_count").contents() == 2
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert tokens == [t for t, _ in sorted(build_char_tokenizer().get_vocab().items(), key=lambda kv: kv[1])]
    hf = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    # Spot checks of the name map and the layouts, against the HF tensors themselves.
    embed = values["token_embd.weight"]
    assert np.abs(embed - hf["model.embed_tokens.weight"]).max() <= TOLERANCE[type_name]
    q = values["blk.1.attn_q.weight"]
    if model_type == "llama":  # GGML's interleaved rotary pairs: undo them to compare
        heads = SHAPE["num_attention_heads"]
        q = q.reshape(heads, q.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(q.shape)
        assert "output.weight" in values
    else:  # tied: the output is the token embedding; qwen2 keeps its q/k/v biases (f32)
        assert "output.weight" not in values
        assert values["blk.0.attn_q.bias"].dtype == np.float32
    assert np.abs(q - hf["model.layers.1.self_attn.q_proj.weight"]).max() <= TOLERANCE[type_name]
    norms = [t for t in reader.tensors if t.name.endswith("_norm.weight")]
    assert norms and all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in norms)


def test_a_non_finite_weight_fails_validation_and_leaves_nothing(folders, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folders["qwen2"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "bad.gguf"
    with pytest.raises(GgufError, match="blk.0.ffn_down.weight holds non-finite values"):
        export(bad, out, "f16")
    assert not out.exists() and not list(tmp_path.glob(".bad.gguf*"))


def test_validation_names_a_missing_tensor_or_a_wrong_shape(folders, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    export(folders["llama"], out, "f32")
    want = gguf_export.expected(folders["llama"])
    with pytest.raises(GgufError, match="tensor blk.9.attn_q.weight is missing"):
        validate(out, Expected(want.architecture, {**want.shapes, "blk.9.attn_q.weight": (64, 64)}))
    with pytest.raises(GgufError, match=r"tensor output_norm.weight has shape \(64,\), expected \(65,\)"):
        validate(out, Expected(want.architecture, {**want.shapes, "output_norm.weight": (65,)}))
    with pytest.raises(GgufError, match="general.architecture is 'llama', expected 'qwen2'"):
        validate(out, Expected("qwen2", want.shapes))


def test_types_and_models_it_cannot_write_are_refused_clearly(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(gguf_export.LLAMA_CPP_ENV, raising=False)
    folder = hf_folder(tmp_path, "llama")
    with pytest.raises(GgufError, match="q4_k_m needs llama.cpp's llama-quantize: set DOCKYARD_LLAMA_CPP_DIR"):
        export(folder, tmp_path / "x.gguf", "q4_k_m")
    with pytest.raises(GgufError, match="no llama-quantize under"):
        export(folder, tmp_path / "x.gguf", "q4_k_m", llama_cpp=tmp_path)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(GgufError, match="not model_type 'gpt2'"):
        export(gpt2, tmp_path / "x.gguf", "f16")
    assert not list(tmp_path.glob("*.gguf"))


def test_the_command_writes_several_types_at_once(folders, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dockyard.cli", "export", "gguf", str(folders["qwen2"]), str(tmp_path / "out")]
    done = subprocess.run([*cmd, "--type", "f16,q8_0", "--type", "bf16"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["qwen2.bf16.gguf", "qwen2.f16.gguf", "qwen2.q8_0.gguf"]
    assert done.stdout.count("validated") == 3
    refused = subprocess.run(
        [*cmd[:-1], str(tmp_path / "x.gguf"), "--type", "q6_k"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 1 and "DOCKYARD_LLAMA_CPP_DIR" in refused.stderr


def test_an_existing_output_is_refused_as_export_hf_refuses(tmp_path: Path) -> None:
    folder = tmp_path / "qwen2"  # never read: the refusal comes first
    there = tmp_path / "m.gguf"
    there.write_bytes(b"kept")
    with pytest.raises(GgufError, match="m.gguf exists: name a new file"):
        export(folder, there, "f16")
    out = tmp_path / "out"
    out.mkdir()
    (out / "qwen2.q8_0.gguf").write_bytes(b"kept")
    with pytest.raises(GgufError, match=r"qwen2.q8_0.gguf exist\(s\)"):
        gguf_export.export_many(folder, out, ["f16", "q8_0"])
    assert there.read_bytes() == b"kept" and sorted(p.name for p in out.iterdir()) == ["qwen2.q8_0.gguf"]
