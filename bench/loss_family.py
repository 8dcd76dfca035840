"""The policy-gradient family on the tiny recipe: the validation gain of each choice, same seeds and steps.

    LocalStack (five real services) ──CreateJob(choice 1)─> SUCCEEDED ─> validation pass rate at 0 and at the end
                                    ──CreateJob(choice 2)─> ...

Every job is examples/configs/tiny_expr.yaml without its `loss_fn` and `grpo.advantage` lines (so each
`loss_fn.name` preset fills its own knobs), from one warm start (the recipe's bootstrap, built once
under --work when missing), with the recipe's seeds, for --steps steps, validated greedily on its 64
held-out tasks at the start and the end. The start is the same policy for every choice; the gain is
what the choice's training bought in the same budget. One run per choice: on this recipe run-to-run
noise is a few hundredths of pass rate, so differences below that are not differences.

    python bench/loss_family.py --work runs/loss-family [--steps 10] [--only gspo dapo ...] [section.key=value ...]

The recipe takes one optimizer step per step (ρ = 1: no clip or gate acts, the objectives differ by
their reduction and on-policy gradient only); `policy.train_global_batch_size=16` makes four, so three
of them are off-policy.

Prints one Markdown row per choice (choice, start, end, gain, wall seconds) as each job ends, then,
against GRPO's gain in the same run (the baseline; run with it), `gain_minus_grpo_<choice>: D` for each
other choice and last `best_gain_minus_grpo: D` (pass-rate points; > 0: that choice gained more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import yaml

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.cli.prepare import prepare
from dockyard.config import load_config_text
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack

ROOT = Path(__file__).resolve().parents[1]
CHOICES = {
    "grpo": [],
    "dapo": ["loss_fn.name=dapo"],
    "dr-grpo": ["loss_fn.name=dr-grpo"],
    "gspo": ["loss_fn.name=gspo"],
    "gspo-token": ["loss_fn.name=gspo-token"],
    "cispo": ["loss_fn.name=cispo"],
    "sapo": ["loss_fn.name=sapo"],
    "rloo": ["grpo.adv_estimator.name=rloo"],
    "reinforce++": ["grpo.adv_estimator.name=reinforce++"],
    "reinforce++-baseline": ["grpo.adv_estimator.name=reinforce++-baseline"],
}


def recipe_without_loss_knobs() -> str:
    data = yaml.safe_load((ROOT / "examples" / "configs" / "tiny_expr.yaml").read_text())
    del data["loss_fn"], data["grpo"]["advantage"]
    return yaml.safe_dump(data)


async def run_job(address: str, config_yaml: str) -> Path:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml))).job
        while True:
            job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id))).job
            if job.state == coordinator_pb2.JOB_STATE_SUCCEEDED:
                return Path(job.run_dir)
            if job.state in (coordinator_pb2.JOB_STATE_FAILED, coordinator_pb2.JOB_STATE_CANCELLED):
                raise SystemExit(f"job {job.job_id} ended {job.state}: {job.message}")
            await asyncio.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="warm start, runs and logs go here")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps of each job")
    parser.add_argument("--only", nargs="*", choices=sorted(CHOICES), help="run these choices only")
    parser.add_argument("overrides", nargs="*", help="config overrides for every job (section.key=value)")
    args = parser.parse_args()
    text = recipe_without_loss_knobs()
    work = args.work.resolve()
    common = [
        f"policy.model_name={work / 'tiny-expr-sft'}",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.val_period={args.steps}",
        "checkpointing.enabled=false",
        "logger.plot=false",
        f"logger.log_dir={work / 'runs'}",
        *args.overrides,
    ]
    prepare(load_config_text(text, common))  # the recipe's warm start, once
    stack = LocalStack(work / "logs", free_ports=True)
    stack.start()
    print("| choice | validation at 0 | at the end | gain | wall s |\n| --- | --- | --- | --- | --- |", flush=True)
    gains: dict[str, float] = {}
    try:
        for name in args.only or CHOICES:
            config = load_config_text(text, [*common, *CHOICES[name]])
            t0 = time.perf_counter()
            run_dir = asyncio.run(run_job(stack.address("coordinator"), config.resolved_yaml()))
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            val = [r["pass_rate"] for r in records if r["kind"] == "validation"]
            wall = time.perf_counter() - t0
            gains[name] = val[-1] - val[0]
            print(f"| {name} | {val[0]:.3f} | {val[-1]:.3f} | {gains[name]:+.3f} | {wall:.0f} |", flush=True)
    finally:
        stack.stop()
    if "grpo" in gains and len(gains) > 1:
        others = {name: gain - gains["grpo"] for name, gain in gains.items() if name != "grpo"}
        for name, difference in others.items():
            print(f"gain_minus_grpo_{name}: {difference:+.3f}")
        print(f"best_gain_minus_grpo: {max(others.values()):+.3f}")


if __name__ == "__main__":
    main()
