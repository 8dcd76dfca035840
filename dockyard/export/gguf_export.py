"""GGUF export of a Hugging Face folder, every output validated with the `gguf` package.

    HF folder ──write (gguf package alone)──> OUT.gguf     f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1
              ──f16 (written here; for other architectures llama.cpp's convert_hf_to_gguf.py, run with this
                interpreter) ──llama.cpp's llama-quantize (DOCKYARD_LLAMA_CPP_DIR)──> OUT.gguf
                                                           any type llama-quantize knows (q4_k_m, q6_k, ...)
    OUT.gguf ──validate──> architecture, every expected tensor present with its shape, float tensors finite

Guarantees: an output that fails validation is deleted and the GgufError names the tensor (or the
key) that failed; nothing half-written is left under the output name (each file is written beside
it and renamed into place), and an existing file is never replaced (GgufError, as `export hf` refuses).
Direct writing covers the decoder families dockyard trains (llama and
mistral as `llama`, qwen2) with the llama.cpp tensor names the `gguf` package maps; 2-D weights are
quantized, 1-D tensors (norms, biases) stay f32, and a matrix whose rows do not fill whole blocks of a
quantized type falls back to f16, as llama.cpp's converter does. The llama architecture stores q/k
projections with the rotary halves interleaved (GGML's layout), so those two are permuted on the way.

This path reads and writes files only: it never loads a model into an inference engine, never calls
vLLM's GGUF dequantization kernel, and dockyard has no GGUF serve mode (docs/export.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Types the gguf package quantizes itself (numpy); anything else needs llama.cpp.
DIRECT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# HF model_type -> GGUF architecture written directly.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
LLAMA_CPP_ENV = "DOCKYARD_LLAMA_CPP_DIR"


class GgufError(RuntimeError):
    """An export that cannot be made or an output that failed validation (the output is gone)."""


@dataclass(frozen=True)
class Expected:
    architecture: str
    shapes: dict[str, tuple[int, ...]]  # GGUF tensor name -> numpy (row-major) shape


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # the `export` extra
        raise GgufError("GGUF export needs the gguf package (a dependency of dockyard): pip install gguf") from exc
    return gguf


def _qtype(name: str):
    gguf = _gguf()
    try:
        return gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        raise GgufError(f"unknown GGUF type {name!r}") from None


def _file_type(name: str) -> int:
    gguf = _gguf()
    key = "ALL_F32" if name == "f32" else f"MOSTLY_{name.upper()}"
    return int(gguf.LlamaFileType[key])


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise GgufError(f"{folder} is not a Hugging Face model folder (no config.json)")
    return json.loads(path.read_text())


def _state_dict(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files, as float32 numpy arrays."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise GgufError(f"{folder} holds no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).float().numpy()
    return tensors


def _interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half layout of a q/k projection -> GGML's interleaved pairs (llama architecture)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _named_tensors(folder: Path, config: dict, arch: str | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """(GGUF architecture, {GGUF name: tensor}) of the folder; `arch` given: that architecture's names
    (a file llama.cpp's converter wrote), else the one this module writes for the model_type."""
    gguf = _gguf()
    model_type = config.get("model_type")
    if arch is None:
        if model_type not in ARCHITECTURES:
            raise GgufError(
                f"direct GGUF export covers {sorted(ARCHITECTURES)}, not model_type {model_type!r}: point "
                f"{LLAMA_CPP_ENV} at a llama.cpp checkout to use its converter"
            )
        arch = ARCHITECTURES[model_type]
    try:
        names = gguf.get_tensor_name_map(
            gguf.MODEL_ARCH[arch.upper().replace("-", "_")], int(config["num_hidden_layers"])
        )
    except KeyError:
        raise GgufError(f"the gguf package knows no architecture {arch!r}") from None
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    out = {}
    for key, value in _state_dict(folder).items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by every runtime from rope.freq_base
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GgufError(f"{folder}: tensor {key!r} has no GGUF name for architecture {arch}")
        if arch == "llama" and key.endswith("q_proj.weight"):
            value = _interleave_rotary(value, heads)
        elif arch == "llama" and key.endswith("k_proj.weight"):
            value = _interleave_rotary(value, kv_heads)
        out[name] = value
    if config.get("tie_word_embeddings") and "output.weight" in out:
        del out["output.weight"]  # runtimes use token_embd for the output of a tied model
    return arch, out


def expected(folder: Path, arch: str | None = None) -> Expected:
    """The architecture and tensors (names, shapes) a GGUF of this HF folder must hold."""
    arch, tensors = _named_tensors(folder, _config(folder), arch)
    return Expected(arch, {name: tuple(t.shape) for name, t in tensors.items()})


def _architecture(path: Path) -> str | None:
    field = _gguf().GGUFReader(path).get_field("general.architecture")
    return None if field is None else field.contents()


def _add_metadata(writer, config: dict, arch: str, type_name: str, name: str) -> None:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(
        float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e4))
    )
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(_file_type(type_name))
    writer.add_quantization_version(_gguf().GGML_QUANT_VERSION)


def _add_vocab(writer, folder: Path, model_type: str) -> None:
    """The tokenizer in id order with its token types and special ids: a BPE tokenizer (one with merges) as
    llama.cpp's BPE vocabulary with its merges; one without merges (word-level) as its SPM vocabulary,
    which needs none (ids and token texts are exact; llama.cpp's own text tokenization of it may differ)."""
    gguf = _gguf()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    size = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [
        gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(size)
    ]
    spec = folder / "tokenizer.json"
    merges = spec.is_file() and bool(json.loads(spec.read_text()).get("model", {}).get("merges"))
    if merges:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre({"qwen2": "qwen2", "llama": "llama-bpe"}.get(model_type, "default"))
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * size)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=merges, n_vocab=size).add_to_gguf(writer, quiet=True)


def _encode(tensor: np.ndarray, type_name: str):
    """(data, raw GGML type or None) of one tensor for `type_name`: 1-D stays f32; ragged rows -> f16."""
    gguf = _gguf()
    if tensor.ndim < 2 or type_name == "f32":
        return tensor.astype(np.float32), None
    if type_name == "f16":
        return tensor.astype(np.float16), None
    qtype = _qtype(type_name)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if tensor.shape[-1] % block:
        return tensor.astype(np.float16), None
    return gguf.quants.quantize(tensor, qtype), qtype


def write_direct(folder: Path, out: Path, type_name: str) -> None:
    """Write `out` from the HF folder with the gguf package alone (type_name in DIRECT_TYPES)."""
    gguf = _gguf()
    config = _config(folder)
    arch, tensors = _named_tensors(folder, config)
    writer = gguf.GGUFWriter(out, arch)
    _add_metadata(writer, config, arch, type_name, folder.name)
    _add_vocab(writer, folder, config["model_type"])
    for name, tensor in tensors.items():
        data, raw = _encode(tensor, type_name)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_with_llama_cpp(folder: Path, out: Path, type_name: str, llama_cpp: Path) -> None:
    """An f16 GGUF, then llama.cpp's llama-quantize to `type_name`. The f16 file is this module's own for the
    architectures it writes, else llama.cpp's convert_hf_to_gguf.py's (run with this interpreter)."""
    quantize = next((p for p in _quantize_candidates(llama_cpp) if p.is_file()), None)
    if quantize is None:
        raise GgufError(f"no llama-quantize under {llama_cpp} (build it: cmake -B build && cmake --build build)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        f16 = Path(tmp) / "f16.gguf"
        if _config(folder).get("model_type") in ARCHITECTURES:
            write_direct(folder, f16, "f16")
        else:
            convert = llama_cpp / "convert_hf_to_gguf.py"
            if not convert.is_file():
                raise GgufError(f"{llama_cpp} has no convert_hf_to_gguf.py: {LLAMA_CPP_ENV} names a llama.cpp checkout")
            _run([sys.executable, str(convert), str(folder), "--outfile", str(f16), "--outtype", "f16"], "convert")
        _run([str(quantize), str(f16), str(out), type_name.upper()], "llama-quantize")


def _quantize_candidates(llama_cpp: Path) -> Iterable[Path]:
    yield llama_cpp / "build" / "bin" / "llama-quantize"
    yield llama_cpp / "llama-quantize"


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise GgufError(f"{what} failed (exit {result.returncode}): " + " | ".join(tail))


def validate(path: Path, want: Expected) -> list[str]:
    """Check `path` against `want`; raise GgufError naming the first tensor or key that is wrong.
    Returns notes on what could not be checked (a type the gguf package cannot dequantize)."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch != want.architecture:
        raise GgufError(f"{path}: general.architecture is {arch!r}, expected {want.architecture!r}")
    found = {t.name: t for t in reader.tensors}
    notes = []
    for name, shape in want.shapes.items():
        tensor = found.get(name)
        if tensor is None:
            raise GgufError(f"{path}: tensor {name} is missing")
        got = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
        if got != shape:
            raise GgufError(f"{path}: tensor {name} has shape {got}, expected {shape}")
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            notes.append(f"{name}: {tensor.tensor_type.name} values not checked (the gguf package cannot read them)")
            continue
        if not np.isfinite(values).all():
            raise GgufError(f"{path}: tensor {name} holds non-finite values")
    return notes


def export(folder: str | Path, out: str | Path, type_name: str, llama_cpp: str | Path | None = None) -> list[str]:
    """Write and validate one GGUF file at `out`, which must not exist; returns validation notes. On any
    failure nothing is left at `out`.
    A type the gguf package writes is always written directly; others need llama.cpp (`llama_cpp` or
    DOCKYARD_LLAMA_CPP_DIR), whose output is checked against the architecture it declares."""
    folder, out = Path(folder), Path(out)
    if out.exists():  # as `export hf`: an export never replaces what is there
        raise GgufError(f"{out} exists: name a new file")
    type_name = type_name.lower()
    llama_cpp = llama_cpp or os.environ.get(LLAMA_CPP_ENV) or None
    if type_name not in DIRECT_TYPES and llama_cpp is None:
        raise GgufError(
            f"{type_name} needs llama.cpp's llama-quantize: set {LLAMA_CPP_ENV} (direct: {', '.join(DIRECT_TYPES)})"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        if type_name in DIRECT_TYPES:
            want = expected(folder)
            write_direct(folder, partial, type_name)
        else:
            write_with_llama_cpp(folder, partial, type_name, Path(llama_cpp))
            want = expected(folder, _architecture(partial))
        notes = validate(partial, want)
        partial.replace(out)
        return notes
    finally:
        partial.unlink(missing_ok=True)


def export_many(folder: str | Path, out_dir: str | Path, types: list[str], llama_cpp: str | Path | None = None) -> dict:
    """One validated GGUF per type, named <folder name>.<type>.gguf under out_dir: {type: (path, notes)};
    refused before anything is written when one of those files exists."""
    folder, out_dir = Path(folder), Path(out_dir)
    paths = {type_name: out_dir / f"{folder.name}.{type_name.lower()}.gguf" for type_name in types}
    if there := [str(path) for path in paths.values() if path.exists()]:  # refused before any is written
        raise GgufError(f"{', '.join(there)} exist(s): name a new folder")
    return {type_name: (path, export(folder, path, type_name, llama_cpp)) for type_name, path in paths.items()}
