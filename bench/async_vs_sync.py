"""Asynchronous against synchronous GRPO: the same recipe and step count, one run, one stack.

    LocalStack (five real services) ──CreateJob(sync)──> SUCCEEDED     wall time T_sync
                                    ──CreateJob(async)─> SUCCEEDED     wall time T_async

Both jobs run the tiny expression recipe on a random-init model with validation and
checkpoints off, so the wall time is the pipeline: generation + scoring + training + weight
sync. Sync mode generates a step's groups, then trains, then syncs; async mode keeps one
step's groups generating while the trainer trains (max_trajectory_age_steps=1, TIS
correction). Wall time is measured from CreateJob to SUCCEEDED; model loading is the same in
both. A one-step sync job warms the services up first (kernels, compiled caches; untimed), then
the sync job runs, then the async one, on the same services.

`--smoke`: 4 steps on CPU (seconds of work per step; the services share the CPU cores, so
the overlap async mode buys is bounded by them). `--gpus 2`: the trainer on GPU 0 and the
rollout on GPU 1 (CUDA_VISIBLE_DEVICES per service), bf16, a Qwen2.5-0.5B-shaped model,
256-token completions (stop strings off), NCCL weight sync.

Prints both wall times, the steps/s of each, the groups each job generated, trained on and
dropped as stale, and last `async_speedup: R` (T_sync / T_async; higher is better, 1.0 is parity).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack

ROOT = Path(__file__).resolve().parents[1]
# Printed from each job's last step: where the time of a step goes, and how old the trained samples were.
PHASES = ("staleness_", "step_seconds", "generate_score_seconds", "wait_for_groups_seconds", "train_step_seconds")
COMMON = [
    "policy.model_name=null",
    "policy.bootstrap=null",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "checkpointing.enabled=false",
    "logger.plot=false",
    "grpo.max_trajectory_age_steps=1",
]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"]
# Qwen2.5-0.5B's shape on the recipe's character tokenizer (its vocabulary is the recipe's).
GPU = [
    "cluster.device=cuda",
    "cluster.weight_sync_backend=nccl",
    "cluster.weight_sync_checksum=false",
    "policy.dtype=bfloat16",
    "policy.model.model_type=qwen2",
    "policy.model.hidden_size=896",
    "policy.model.intermediate_size=4864",
    "policy.model.num_hidden_layers=24",
    "policy.model.num_attention_heads=14",
    "policy.model.num_key_value_heads=2",
    "policy.model.max_position_embeddings=1024",
    "policy.generation.stop_strings=[]",
    "policy.generation.max_new_tokens=256",
    "policy.train_micro_batch_size=16",
]


def group_books(run_dir: Path) -> str:
    """Groups the job generated, trained on and dropped as too old: what async mode wasted."""
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    buffer = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in buffer if r["kind"] == "buffer"][-1]
    return (
        f"groups: {len(groups)} generated, {final['buffer_acked']:.0f} trained, "
        f"{final['buffer_dropped_stale']:.0f} dropped as stale, {final['buffer_held']:.0f} left"
    )


async def run_job(address: str, config_yaml: str) -> tuple[float, dict, Path]:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        t0 = time.perf_counter()
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml))).job
        while True:
            job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id))).job
            if job.state == coordinator_pb2.JOB_STATE_SUCCEEDED:
                return time.perf_counter() - t0, dict(job.metrics), Path(job.run_dir)
            if job.state in (coordinator_pb2.JOB_STATE_FAILED, coordinator_pb2.JOB_STATE_CANCELLED):
                raise SystemExit(f"job {job.job_id} ended {job.state}: {job.message}")
            await asyncio.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="4 steps on CPU")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each job")
    parser.add_argument("--gpus", type=int, choices=(0, 2), default=0, help="2: trainer on GPU 0, rollout on GPU 1")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the services' logs here")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (section.key=value)")
    args = parser.parse_args()
    steps = args.steps or (4 if args.smoke else 10)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*COMMON, f"grpo.max_num_steps={steps}", f"logger.log_dir={tmp}/runs"]
        service_env = {}
        if args.gpus:
            overrides += GPU
            service_env = {"trainer": {"CUDA_VISIBLE_DEVICES": "0"}, "rollout": {"CUDA_VISIBLE_DEVICES": "1"}}
            extra_env = {"DOCKYARD_TRAINER_DEVICE": "cuda", "DOCKYARD_ROLLOUT_DEVICE": "cuda"}
        else:
            extra_env = {}
        stack = LocalStack(
            args.log_dir or Path(tmp) / "logs", free_ports=True, extra_env=extra_env, service_env=service_env
        )
        stack.start()
        try:
            warm = load_config(ROOT / "examples" / "configs" / "tiny_expr.yaml", overrides + args.overrides)
            warm = warm.model_copy(update={"grpo": warm.grpo.model_copy(update={"max_num_steps": 1})})
            asyncio.run(run_job(stack.address("coordinator"), warm.resolved_yaml()))
            walls = {}
            for mode, extra in (("sync", []), ("async", ASYNC)):
                cfg = load_config(ROOT / "examples" / "configs" / "tiny_expr.yaml", overrides + extra + args.overrides)
                wall, metrics, run_dir = asyncio.run(run_job(stack.address("coordinator"), cfg.resolved_yaml()))
                walls[mode] = wall
                shown = {k: round(v, 3) for k, v in metrics.items() if k.startswith(PHASES)}
                rate = f"{steps / wall:.3f} steps/s"
                print(f"{mode:5s}: {steps} steps in {wall:.1f} s ({rate}); last step {json.dumps(shown)}")
                print(f"{mode:5s}: {group_books(run_dir)}")
        finally:
            stack.stop()
    print(f"async_speedup: {walls['sync'] / walls['async']:.3f}")


if __name__ == "__main__":
    main()
