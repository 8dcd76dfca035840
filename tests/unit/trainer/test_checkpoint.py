"""Checkpoints: exact resume, Hugging Face loading, atomic saves, top-k retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.config import ConfigError, load_config_text
from dockyard.export.hf_export import ExportError, export_hf
from dockyard.weights import arena
from services.trainer import checkpoint
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.policy import PolicyTrainer

# Dropout on, warmup then cosine, KL on: resuming must restore RNG, scheduler and reference.
CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64,
          attention_dropout: 0.2}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  optimizer: {lr: 0.01, warmup_steps: 2, schedule: cosine, min_lr_ratio: 0.1, weight_decay: 0.01}
loss_fn: {kl_penalty: 0.1}
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4, max_num_steps: 6}
checkpointing: {checkpoint_dir: CKPT, resume: true}
"""


def batch(step: int) -> list[TrainingGroup]:
    gen = torch.Generator().manual_seed(100 + step)
    samples = []
    for i in range(4):
        completion = torch.randint(4, 60, (3 + i,), generator=gen).tolist()
        samples.append(
            Sample(
                trajectory_id=f"s{step}/{i}",
                prompt_ids=torch.randint(4, 60, (6,), generator=gen).tolist(),
                completion_ids=completion,
                generation_logprobs=[-2.0] * len(completion),
                reward=float(torch.rand((), generator=gen)),
                valid=True,
            )
        )
    return [TrainingGroup(group_id=f"s{step}", samples=samples)]


# LoRA with adapter dropout: the adapters, their optimizer state and the RNG must come back exactly.
LORA = ["policy.lora.enabled=true", "policy.lora.rank=4", "policy.lora.dropout=0.1", "policy.optimizer.lr=0.05"]


def trainer(folder: Path, overrides: list[str] | None = None) -> PolicyTrainer:
    return PolicyTrainer(load_config_text(CONFIG.replace("CKPT", str(folder)), overrides), checkpoint_dir=folder)


# torch.distributed.checkpoint shards (one rank here; tests/unit/trainer/test_sharded_ranks.py: two).
SHARDED = ["checkpointing.format=sharded"]
SHARDED_ASYNC = [*SHARDED, "checkpointing.async_save=true"]


# Colocated with its replicas, the trainer keeps its parameters in one arena (weights/arena.py).
COLOCATED = ["cluster.weight_sync_transport=colocated"]


@pytest.mark.parametrize(
    "overrides", [[], LORA, SHARDED, SHARDED_ASYNC, COLOCATED], ids=["full", "lora", "sharded", "async", "colocated"]
)
def test_stop_and_resume_gives_the_uninterrupted_next_step(tmp_path: Path, overrides: list[str]) -> None:
    k = 3
    straight = trainer(tmp_path / "a", overrides)
    assert straight.resumed_from is None
    losses = [straight.train_step(batch(s))["loss"] for s in range(1, k + 3)]

    first = trainer(tmp_path / "b", overrides)
    assert arena.is_packed(first.model) == (overrides == COLOCATED)
    for s in range(1, k + 1):
        assert first.train_step(batch(s))["loss"] == losses[s - 1]
    saved = {name: tensor.clone() for name, tensor in first.named_weights()}
    first.save(tmp_path / "b" / f"step-{k}", {"pass_rate": 0.5}, data_state='{"tasks_drawn": 3}')
    first.train_step(batch(k + 1))  # work after the checkpoint is lost with the process (async: while it is written)
    first.close()  # as the trainer does when the job is unloaded: a save in flight finishes
    del first
    if "checkpointing.format=sharded" in overrides:
        # Shards only, no HF weights; the export is the model as it was at the save, tensor for tensor.
        assert not list((tmp_path / "b" / f"step-{k}").glob("*.safetensors"))
        exported = export_hf(tmp_path / "b" / f"step-{k}", tmp_path / "hf")
        loaded = AutoModelForCausalLM.from_pretrained(exported)
        assert not (exported / "trainer_state.pt").exists()
        assert [name for name, _ in loaded.named_parameters()] == list(saved)
        for name, tensor in loaded.named_parameters():
            assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name

    resumed = trainer(tmp_path / "b", overrides)
    assert resumed.resumed_from == tmp_path / "b" / f"step-{k}"
    assert (resumed.weight_version, resumed.data_state) == (k, '{"tasks_drawn": 3}')
    assert resumed.train_step(batch(k + 1))["loss"] == losses[k]
    # One more: the learning-rate schedule continued from step k too.
    assert resumed.train_step(batch(k + 2))["loss"] == losses[k + 1]
    for (name, a), (_, b) in zip(straight.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(a, b), name
    if overrides == LORA:  # the adapter of the checkpoint must fit the configured one
        with pytest.raises(ConfigError, match="policy.lora"):
            trainer(tmp_path / "b", [*overrides, "policy.lora.rank=8"])


def test_checkpoint_is_a_hugging_face_folder(tmp_path: Path) -> None:
    policy = trainer(tmp_path)
    policy.train_step(batch(1))
    folder = policy.save(tmp_path / "step-1")
    model = AutoModelForCausalLM.from_pretrained(folder)
    mine = dict(policy.named_weights())
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, mine[name]), name
    assert json.loads((folder / checkpoint.META_FILE).read_text())["step"] == 1


def test_a_crash_mid_save_leaves_the_previous_latest(tmp_path: Path) -> None:
    policy = trainer(tmp_path)
    policy.save(tmp_path / "step-0")

    def crash(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.write_atomically(tmp_path / "step-1", crash, {"step": 1})
    assert checkpoint.latest(tmp_path).step == 0
    assert trainer(tmp_path).resumed_from == tmp_path / "step-0"


def crash_mid_delete(monkeypatch) -> None:
    """shutil.rmtree that deletes the weights file first and then dies."""

    def rmtree(path, ignore_errors=False):
        weights = Path(path) / "model.safetensors"
        if weights.exists():
            weights.unlink()
            raise OSError("killed mid-delete")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)


def with_weights(tmp: Path) -> None:
    assert tmp.is_dir() and not any(tmp.iterdir())  # a fresh, empty staging folder
    (tmp / "model.safetensors").write_bytes(b"weights")


def test_a_crash_deleting_a_checkpoint_never_leaves_a_partial_one_that_counts(tmp_path: Path, monkeypatch) -> None:
    for step in (1, 2):
        checkpoint.write_atomically(tmp_path / f"step-{step}", with_weights, {"step": step})
    crash_mid_delete(monkeypatch)
    # The same step saved again: the crash hits deleting the old copy, after the new one is in place.
    with pytest.raises(OSError):
        checkpoint.write_atomically(tmp_path / "step-2", with_weights, {"step": 2, "again": True})
    # Retiring an old checkpoint dies halfway through deleting it.
    with pytest.raises(OSError):
        checkpoint.retain(tmp_path, 0, "pass_rate", higher_is_better=True)
    found = checkpoint.complete_checkpoints(tmp_path)
    assert [c.step for c in found] == [2] and found[0].meta["again"] is True
    assert all((c.path / "model.safetensors").exists() for c in found)


def test_retention_keeps_the_best_k_and_the_latest(tmp_path: Path) -> None:
    for step, rate in [(1, 0.2), (2, 0.9), (3, None), (4, 0.5), (5, 0.1)]:
        metrics = {} if rate is None else {"pass_rate": rate}
        checkpoint.write_atomically(tmp_path / f"step-{step}", lambda tmp: None, {"metrics": metrics})
    removed = checkpoint.retain(tmp_path, 2, "pass_rate", higher_is_better=True)
    assert sorted(p.name for p in removed) == ["step-1", "step-3"]
    assert [c.step for c in checkpoint.complete_checkpoints(tmp_path)] == [2, 4, 5]
    checkpoint.retain(tmp_path, 1, "pass_rate", higher_is_better=False)
    assert [c.step for c in checkpoint.complete_checkpoints(tmp_path)] == [5]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("checkpointing.resume=true", ["checkpointing.resume", "checkpoint_dir"]),
        ("policy.sequence_packing=true", ["sequence_packing", "max_tokens_per_micro_batch"]),
        ("policy.optimizer.schedule=linear", ["policy.optimizer.schedule"]),
        ("policy.max_tokens_per_micro_batch=0", ["policy.max_tokens_per_micro_batch"]),
    ],
)
def test_trainer_config_refusals_name_the_field(override: str, words: list[str]) -> None:
    from dockyard.config import ConfigError

    text = CONFIG.replace("checkpointing: {checkpoint_dir: CKPT, resume: true}", "")
    with pytest.raises(ConfigError) as info:
        load_config_text(text, [override])
    for word in words:
        assert word in str(info.value)


def test_packing_needs_token_reduction() -> None:
    from dockyard.config import ConfigError

    text = CONFIG.replace("checkpointing: {checkpoint_dir: CKPT, resume: true}", "")
    overrides = ["policy.max_tokens_per_micro_batch=64", "policy.sequence_packing=true", "loss_fn.reduction=sequence"]
    with pytest.raises(ConfigError, match="reduction=token"):
        load_config_text(text, overrides)


def test_an_async_save_goes_through_async_save_and_is_published_on_close(tmp_path: Path, monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    policy = trainer(tmp_path, SHARDED_ASYNC)
    policy.train_step(batch(1))
    written = []
    real = dcp.async_save

    def recorded(state, **kwargs):  # the background path, not dcp.save, wrote the shards
        future = real(state, **kwargs)
        written.append(future)
        return future

    monkeypatch.setattr(dcp, "async_save", recorded)
    policy.save(tmp_path / "step-1")
    policy.close()
    assert written and checkpoint.latest(tmp_path).step == 1
    with pytest.raises(ExportError, match="exists"):
        export_hf(tmp_path / "step-1", tmp_path)
    with pytest.raises(ExportError, match="no config.json"):
        export_hf(tmp_path / "nothing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_async_write_is_raised_and_never_counts(tmp_path: Path, monkeypatch) -> None:
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    def failing(state, **kwargs):
        future = Future()
        future.set_exception(OSError("disk full"))
        return future

    policy = trainer(tmp_path, SHARDED_ASYNC)
    policy.train_step(batch(1))
    monkeypatch.setattr(dcp, "async_save", failing)
    policy.save(tmp_path / "step-1")
    with pytest.raises(RuntimeError, match="disk full"):
        policy.close()
    assert checkpoint.latest(tmp_path) is None  # only the staging folder, which nothing reads


def test_a_trainer_in_one_arena_trains_exactly_as_one_with_its_own_tensors(tmp_path: Path) -> None:
    runs = []
    for name, overrides in (("plain", []), ("packed", COLOCATED)):  # one after the other: dropout's RNG
        policy = trainer(tmp_path / name, overrides)
        assert arena.is_packed(policy.model) == (name == "packed")
        before = list(policy.named_weights())
        steps = [policy.train_step(batch(s)) for s in range(1, 4)]
        after = list(policy.named_weights())
        # Packed, a sync gets the same alias objects every time (stepped in place: compared below).
        assert all(a is b for (_, a), (_, b) in zip(before, after, strict=True)) == (name == "packed")
        runs.append(([(m["loss"], m["grad_norm"], m["entropy"]) for m in steps], dict(after)))
    (plain, plain_weights), (packed, packed_weights) = runs
    assert packed == plain
    assert packed_weights.keys() == plain_weights.keys()
    for name, tensor in plain_weights.items():
        assert torch.equal(packed_weights[name], tensor), name
