"""`dockyard run`: preflight, start the local stack, submit the job, follow it, stop every service.

An interrupted run (Ctrl-C, SIGTERM) stops the services all the same and says what it leaves: the job's
state and step, its run folder, the last complete checkpoint and the command that goes on from it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dockyard.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    arun,
    coordinator,
    follow,
    interrupt_on_signals,
    load,
    local_stack,
    port_flags,
    print_addresses,
    run_preflight,
    stack_token,
    submit,
)
from dockyard.cli.prepare import prepare


def cmd_run(args) -> int:
    cfg = load(args.config, args.overrides)
    from dockyard.api.coordinator.v1 import coordinator_pb2

    log_dir = Path(cfg.logger.log_dir) / "logs" / time.strftime("%Y%m%d-%H%M%S")
    from dockyard.tasks.envs import sandbox_env

    try:
        extra_env = sandbox_env(cfg)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Trainer and rollout run where cluster.device says, unless the environment deploys them itself.
    for variable in ("DOCKYARD_TRAINER_DEVICE", "DOCKYARD_ROLLOUT_DEVICE"):
        if variable not in os.environ:
            extra_env[variable] = cfg.cluster.device
    # The job's state (job.json) goes to its run folder unless the environment says otherwise.
    if "DOCKYARD_COORDINATOR_STATE_DIR" not in os.environ:
        extra_env["DOCKYARD_COORDINATOR_STATE_DIR"] = str(Path(cfg.logger.log_dir).resolve())
    stack = local_stack(
        log_dir,
        free_ports=not args.default_ports,
        extra_env=extra_env,
        rollout_replicas=args.rollout_replicas,
        sandbox_workers=args.sandbox_workers,
        ports=port_flags(args),
        # agent trials and the hle judge send their model calls through the policy endpoint
        endpoint=cfg.env.agentic or cfg.env.judge.enabled,
        dashboard=True,
    )
    run_preflight(
        cfg,
        prepare=args.prepare,
        ports=stack.set_ports,
        free_ports=not args.default_ports,
        environ={**os.environ, **extra_env},
    )
    if args.prepare:
        prepare(cfg)
    stack_token(log_dir)  # no stack runs without a service token
    print(f"starting services (logs in {log_dir})")
    interrupt_on_signals()
    try:
        stack.start()
    except RuntimeError as exc:  # a service exited while starting: its log's last lines say why
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print_addresses(stack, indent="  ")
    address = stack.address("coordinator")
    job_id, job = None, None
    try:
        job_id = arun(submit(address, cfg.resolved_yaml()))
        print(f"job {job_id} submitted")
        state = arun(follow(address, job_id, stack))
    except KeyboardInterrupt:
        print("\ninterrupted: stopping services", file=sys.stderr)
        state = None
        job = _last_look(address, job_id)
    finally:
        codes = stack.stop()
        bad = {name: code for name, code in codes.items() if code not in (0, -15)}
        if bad:
            print(f"services exited uncleanly: {bad}; logs in {log_dir}", file=sys.stderr)
    if state is None:
        for line in interrupted_lines(cfg, args, job_id, job):
            print(line, file=sys.stderr)
        return 130
    _summary(Path(cfg.logger.log_dir) / job_id, cfg)
    return 0 if state == coordinator_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


# What a run folder may hold, in the order the run's last line names them.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "groups.jsonl",
    "samples.jsonl",
    "trials.jsonl",
    "curves.png",
    "checkpoints",
    "tensorboard",
    "wandb",
    "mlruns",
    "swanlog",
)


def _summary(run_dir: Path, cfg) -> None:
    path = run_dir / "metrics.jsonl"
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        val = [r for r in records if r["kind"] == "validation"]
        if len(val) >= 2:
            print(
                f"validation pass rate: {val[0]['pass_rate']:.3f} at step {val[0]['step']} -> "
                f"{val[-1]['pass_rate']:.3f} at step {val[-1]['step']}"
            )
    print(run_folder_line(run_dir, cfg.checkpoint_folder(run_dir.name)))


def run_folder_line(run_dir: Path, checkpoints: Path) -> str:
    """The run's last line: its folder and what it holds (a folder with a slash), checkpoints elsewhere named."""
    held = [name + "/" * (run_dir / name).is_dir() for name in RUN_FILES if (run_dir / name).exists()]
    line = f"run folder: {run_dir}  ({', '.join(held) or 'empty'})"
    if checkpoints.exists() and checkpoints.resolve() != (run_dir / "checkpoints").resolve():
        line += f"; checkpoints in {checkpoints}"
    return line


def _last_look(address: str, job_id: str | None):
    """The job as the coordinator has it now (None when there is none, or no answer within seconds)."""
    if job_id is None:
        return None
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def get():
        channel, stub = coordinator(address)
        async with channel:
            return (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=5)).job

    try:
        return arun(get())
    except Exception:  # noqa: BLE001 - an interrupt's report goes on with what is known
        return None


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint (step-<N> with its checkpoint.json) under `folder`."""
    found = [
        (int(child.name.removeprefix("step-")), child)
        for child in (folder.iterdir() if folder.is_dir() else [])
        if child.name.removeprefix("step-").isdigit() and (child / "checkpoint.json").is_file()
    ]
    return max(found, default=None)


def interrupted_lines(cfg, args, job_id: str | None, job) -> list[str]:
    """What an interrupted `dockyard run` leaves: the job's state and step, its run folder, the last
    checkpoint (or that there is none, and what is lost) and the command that goes on from it."""
    import shlex

    from dockyard.jobs import state_name

    if job_id is None:
        return ["no job was submitted yet: nothing to resume"]
    lines = []
    if job is not None:
        lines.append(f"job {job_id} was {state_name(job.state)} at step {job.step}/{job.max_steps} ({job.phase})")
    else:
        lines.append(f"job {job_id}: the coordinator did not say its state")
    lines.append(f"run folder: {Path(cfg.logger.log_dir) / job_id}")
    folder = cfg.checkpoint_folder(job_id)
    kept = [
        o
        for o in args.overrides
        if not o.lstrip("+").startswith(("checkpointing.resume=", "checkpointing.checkpoint_dir="))
    ]
    rerun = ["dockyard", "run", args.config, *kept]
    if (latest := latest_checkpoint(folder)) is None:
        ckpt = cfg.checkpointing
        lost = f": the {job.step} step(s) done are lost" if job is not None and job.step else ""
        if not ckpt.enabled:
            why = "checkpointing.enabled=false saves none"
        elif ckpt.save_period == 0:
            why = "checkpointing.save_period=0 saves only after the last step"
        else:
            why = f"the first save comes at step {ckpt.save_period}"
        lines.append(f"last checkpoint: none in {folder} ({why}){lost}")
        extra = ([] if ckpt.enabled else ["checkpointing.enabled=true"]) + (
            ["checkpointing.save_period=10"] if ckpt.save_period == 0 or not ckpt.enabled else []
        )
        lines.append(f"start again{' (saving every 10 steps)' if extra else ''}: {shlex.join([*rerun, *extra])}")
        return lines
    step, path = latest
    lines.append(f"last checkpoint: {path} (step {step})")
    resume = [*rerun, "checkpointing.resume=true", f"checkpointing.checkpoint_dir={folder}"]
    lines.append(f"resume from it: {shlex.join(resume)}")
    return lines
