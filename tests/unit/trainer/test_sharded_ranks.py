"""Sharded checkpoints across 2 ranks (torchrun, gloo, CPU, FSDP2): each rank writes its own shards in the
background, a 2-rank resume continues exactly, and `dockyard export hf` of the shards is the model.

The test runs this file under torchrun twice. Run "save": a step, an asynchronous sharded save, one more
step while it is written, then the gathered weights after that step. Run "resume": the same 2 ranks
resume from the checkpoint and take the same second step; its weights must be the first run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dockyard.config import load_config_text
from dockyard.export.hf_export import export_hf
from tests.conftest import REPO_ROOT, free_port
from tests.unit.trainer.test_ranks import CONFIG, groups

SHARDED = CONFIG + "checkpointing: {checkpoint_dir: CKPT, resume: true, format: sharded, async_save: true}\n"


def gathered(policy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in policy.named_weights()}


def main(out: Path, mode: str) -> None:
    import torch.distributed as dist

    from services.trainer.policy import PolicyTrainer

    dist.init_process_group("gloo")
    policy = PolicyTrainer(load_config_text(SHARDED.replace("CKPT", str(out / "ckpt"))), checkpoint_dir=out / "ckpt")
    assert policy.world == 2
    if mode == "save":
        policy.train_step(groups())
        saved = gathered(policy)
        policy.save(out / "ckpt" / "step-1")
        policy.train_step(groups())  # while the shards are written
    else:
        assert policy.resumed_from == out / "ckpt" / "step-1" and policy.weight_version == 1
        policy.train_step(groups())
    after = gathered(policy)
    policy.close()
    if dist.get_rank() == 0:
        torch.save({"after": after, **({"saved": saved} if mode == "save" else {})}, out / f"{mode}.pt")
    dist.destroy_process_group()


def torchrun(out: Path, mode: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += ["-m", "tests.unit.trainer.test_sharded_ranks", str(out), mode]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_write_their_shards_resume_exactly_and_export(tmp_path: Path) -> None:
    torchrun(tmp_path, "save")
    step = tmp_path / "ckpt" / "step-1"
    # Each rank wrote its own shard file; no rank wrote HF weights.
    assert sorted(p.name for p in (step / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(step.glob("*.safetensors"))
    torchrun(tmp_path, "resume")

    first, resumed = torch.load(tmp_path / "save.pt"), torch.load(tmp_path / "resume.pt")
    assert list(first["after"]) == list(resumed["after"])
    for name, tensor in first["after"].items():
        assert torch.equal(resumed["after"][name], tensor), name

    loaded = AutoModelForCausalLM.from_pretrained(export_hf(step, tmp_path / "hf"))
    for name, tensor in loaded.named_parameters():
        assert torch.equal(tensor, first["saved"][name]), name


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
