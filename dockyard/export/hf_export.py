"""A Hugging Face folder out of a trainer checkpoint, sharded or not: `dockyard export hf CHECKPOINT OUT`.

    sharded checkpoint (checkpointing.format=sharded, written by services/trainer/sharded_checkpoint.py):
        step-<N>/config.json, tokenizer files, trainer_state.pt, checkpoint.json
                 dcp/.metadata + __<rank>_0.distcp   {"model": every parameter, "optim": AdamW state}
        ──one process, no process group: every rank's shards read into a model built from config.json,
          in the dtype the shards were saved in──> OUT/ (config.json, model.safetensors, tokenizer)
    HF checkpoint (checkpointing.format=hf): its config, weights and tokenizer are copied to OUT.

Guarantees: every tensor of OUT equals the checkpoint's (same values, same dtype); OUT is written
beside its final name and renamed into place, so a failed export leaves nothing at OUT; trainer state
(optimizer, RNG) never goes into OUT. This module owns the sharded layout's names, which the trainer
imports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHARDS_DIR = "dcp"
MODEL_KEY, OPTIM_KEY = "model", "optim"
# What an HF-format checkpoint holds besides the model (never copied into an export).
TRAINER_FILES = ("trainer_state.pt", "checkpoint.json")


class ExportError(RuntimeError):
    pass


def is_sharded(folder: Path) -> bool:
    return (folder / SHARDS_DIR / ".metadata").is_file()


def _shard_dtype(folder: Path):
    """The dtype the model's parameters were saved in (from the checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder / SHARDS_DIR)).read_metadata()
    dtypes = {
        entry.properties.dtype
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(f"{MODEL_KEY}.") and hasattr(entry, "properties")
    }
    if len(dtypes) != 1:
        raise ExportError(f"{folder}: the model's shards hold {len(dtypes)} dtypes ({dtypes}); expected one")
    return dtypes.pop()


def load_model_state(folder: Path, model) -> None:
    """Fill `model` (built from the checkpoint's config.json) with every rank's shards, in one process."""
    import torch.distributed.checkpoint as dcp

    state = {MODEL_KEY: model.state_dict()}
    dcp.load(state, checkpoint_id=folder / SHARDS_DIR, no_dist=True)
    model.load_state_dict(state[MODEL_KEY])


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's model as a Hugging Face folder at `out` (which must not exist)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    if out.exists():
        raise ExportError(f"{out} exists: name a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if is_sharded(checkpoint):
            _from_shards(checkpoint, tmp)
        else:
            shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns(*TRAINER_FILES, "adapter"))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _from_shards(checkpoint: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_config(config, dtype=_shard_dtype(checkpoint))
    load_model_state(checkpoint, model)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
