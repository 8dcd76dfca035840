"""The `dockyard` command line.

    dockyard up [--rollout-replicas N] [--sandbox-workers M] [--<service>-port PORT ...]
                                        the five services on localhost until Ctrl-C (ports: the flags,
                                        else DOCKYARD_<SERVICE>_PORT, else 50051-50055) and the policy
                                        endpoint (HTTP, --endpoint-port, else DOCKYARD_ENDPOINT_PORT, else 8000)
    dockyard submit CONFIG [k=v ...]    submit a job to a running coordinator, print its id
                                        (--wait: then follow it; exit 0 only when it SUCCEEDS)
    dockyard status [JOB]               one job in detail, or every job and the fleet
    dockyard cancel JOB                 cancel a job
    dockyard prepare CONFIG [k=v ...]   build the policy folder a recipe bootstraps (warm start)
    dockyard preflight CONFIG [k=v ...] check what a run needs (model, data, context, Docker, Redis, GPUs,
                                        ports, disk) and say what to fix; exit 2 when something is wrong
    dockyard run CONFIG [k=v ...]       preflight + up + submit + follow, then stop everything
                                        (--prepare: build a missing policy folder with the config's bootstrap);
                                        Ctrl-C: the job's state, run folder, last checkpoint and the command
                                        that goes on
    dockyard export hf CHECKPOINT OUT   a Hugging Face folder from a (sharded) checkpoint
    dockyard export gguf FOLDER OUT --type T [--type T ...]
                                        validated GGUF file(s) of an HF folder (dockyard/export/commands.py)

submit, status and cancel talk to the coordinator at --coordinator, else
DOCKYARD_CLI_COORDINATOR_ADDRESS, else 127.0.0.1:50051 (none answering: a hint how to start one).
A command's k=v overrides may stand before or after its flags (`dockyard run CONFIG --prepare k=v`).

Heavy modules (torch, transformers, grpc, pydantic, even asyncio) load only in the commands that
need them, so `dockyard --help` answers at once, and a config is validated without torch.
A config given on the command line is strict: a key dockyard does not define is an error that
names the closest valid key, unless an override adds it on purpose (`+section.key=value`).

Why one module of this size: every subcommand is a few lines of argument handling around the
library (LocalStack, the coordinator stub, the warm start); the parser and its handlers read
best side by side, and splitting them per command would scatter one `--help` across files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dockyard.rpc.ports import DEFAULT_PORTS, default_address

EXIT_FAILED = 1
EXIT_USAGE = 2
# Named like a service's peer address (DOCKYARD_<SVC>_COORDINATOR_ADDRESS), the CLI being the client.
COORDINATOR_ADDRESS_ENV = "DOCKYARD_CLI_COORDINATOR_ADDRESS"


def _coordinator(address: str):
    from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
    from dockyard.rpc.client import connect

    channel = connect(address, service="dockyard.coordinator.v1.CoordinatorService")
    return channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def _arun(coro):
    import asyncio

    return asyncio.run(coro)


def _load(config: str, overrides: list[str]):
    from dockyard.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides, strict=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if added := cfg.unknown_keys():
        print(f"note: keys added on purpose, kept in the saved config, unused by dockyard: {', '.join(added)}")
    return cfg


def _preflight(cfg, **context) -> None:
    """Run the preflight checks; print them, and exit with status 2 when any fails."""
    from dockyard.preflight import Context, errors, preflight, report

    findings = preflight(cfg, Context(**context))
    failed = errors(findings)
    print(("preflight found problems:\n" if failed else "preflight:\n") + report(findings), flush=True)
    if failed:
        raise SystemExit(EXIT_USAGE)


def _stack(log_dir: Path, **options):
    """A LocalStack, or exit status 2 naming the port setting that is unusable."""
    from dockyard.stack import LocalStack

    try:
        return LocalStack(log_dir, **options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def prepare(cfg) -> None:
    """Run the config's bootstrap when policy.model_name does not exist yet."""
    policy = cfg.policy
    if policy.bootstrap is None or policy.model_name is None:
        return
    out = Path(policy.model_name)
    if (out / "config.json").is_file():
        print(f"{out} exists: kept as it is (prepare builds a missing policy folder only; delete it to build it again)")
        if differences := bootstrap_differences(out, policy):
            print(f"note: {out} was built with other settings than the config's bootstrap: {differences}")
        return
    print(f"{out} does not exist: building it with the config's bootstrap ({policy.bootstrap.recipe} warm start)")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dockyard.recipes.tiny_agent import warm_start_agent
    from dockyard.recipes.tiny_expr import warm_start

    boot = policy.bootstrap
    build = warm_start_agent if boot.recipe == "tiny_agent" else warm_start
    with Progress(
        TextColumn("warm start"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task("sft", total=boot.steps, loss="-")
        build(
            out,
            model=policy.model or {},
            steps=boot.steps,
            lr=boot.lr,
            batch_size=boot.batch_size,
            seed=boot.seed,
            num_threads=boot.num_threads,
            shortcut_rate=boot.shortcut_rate,
            progress=lambda step, loss: bar.update(task, completed=step, loss=f"{loss:.3f}"),
        )
    print(f"policy written to {out}")


def bootstrap_differences(folder: Path, policy) -> str:
    """The settings a warm-start folder was built with (its warm_start.json) that differ from the
    config's bootstrap, as `key: built -> config`; "" when they agree or the folder has no record."""
    meta_path = folder / "warm_start.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return ""
    boot = policy.bootstrap
    wanted = {name: getattr(boot, name) for name in ("recipe", "steps", "lr", "batch_size", "seed", "shortcut_rate")}
    wanted |= {f"model.{k}": v for k, v in (policy.model or {}).items()}
    built = {**meta, **{f"model.{k}": v for k, v in (meta.get("model") or {}).items()}}
    return ", ".join(
        f"{key}: {built[key]!r} -> {value!r}" for key, value in wanted.items() if key in built and built[key] != value
    )


def _job_line(job) -> str:
    from dockyard.jobs import state_name

    reward = job.metrics.get("reward_mean")
    val = job.validation_metrics.get("pass_rate")
    parts = [f"{job.job_id}", state_name(job.state), f"step {job.step}/{job.max_steps}", job.phase]
    if state_name(job.state) == "FAILED" and job.message:  # why it failed, in the list too
        parts.append(f"why: {job.message}")
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if val is not None:
        parts.append(f"val pass {val:.3f}")
    if "buffer_held" in job.metrics:
        parts.append(f"buffer {job.metrics['buffer_held']:.0f} held {job.metrics['buffer_pending']:.0f} pending")
    if "endpoint_queue_depth" in job.metrics:
        parts.append(
            f"endpoint {job.metrics['endpoint_sessions']:.0f} sessions {job.metrics['endpoint_queue_depth']:.0f} queued"
        )
    return "  ".join(parts)


def _print_job(job) -> None:
    from google.protobuf.json_format import MessageToDict

    print(json.dumps(MessageToDict(job, preserving_proto_field_name=True), indent=2, sort_keys=True))
    metrics = dict(job.metrics)
    for line in trainer_summary(metrics) + pipeline_summary(metrics) + fleet_summary(metrics):
        print(line)
    for line in warning_lines(job):
        print(line)


def warning_lines(job) -> list[str]:
    """The failure signatures a job's latest step shows (docs/failure_signatures.md)."""
    return [f"warning: {w}  (see docs/failure_signatures.md)" for w in job.warnings]


# (label, metric, format) of the trainer's last step, one line per group; metrics a step lacks are left out.
_SUMMARY = (
    (
        "loss",
        [
            ("loss", "loss", ".4f"),
            ("pg", "pg_loss", ".4f"),
            ("kl(ref)", "kl", ".4f"),
            ("entropy", "entropy", ".3f"),
            ("clip", "clip_fraction", ".3f"),
            ("dual-clip", "dual_clip_fraction", ".3f"),
        ],
    ),
    (
        "optim",
        [("grad norm", "grad_norm", ".3f"), ("lr", "lr", ".3g"), ("tokens/s", "tokens_per_second", ".0f")],
    ),
    (
        "gen vs train",
        [
            ("|Δlogprob|", "gen_train_logprob_abs_diff", ".4f"),
            ("prob error", "gen_train_prob_error", ".4f"),
            ("kl", "gen_train_kl", ".4f"),
        ],
    ),
    (
        "seconds",
        [
            ("generate+score", "generate_score_seconds", ".2f"),
            ("wait for groups", "wait_for_groups_seconds", ".2f"),
            ("train", "train_step_seconds", ".2f"),
            ("fwd/bwd", "forward_backward_seconds", ".2f"),
            ("optimizer", "optimizer_seconds", ".2f"),
            ("weight sync", "weight_sync_seconds", ".2f"),
            ("step", "step_seconds", ".2f"),
        ],
    ),
)


def fleet_summary(metrics: dict[str, float]) -> list[str]:
    """One line per rollout replica and sandbox worker of a step's metrics, and the fleet's retries."""
    lines = []
    if "endpoint_queue_depth" in metrics:
        lines.append(
            f"{'endpoint:':<14}sessions {metrics['endpoint_sessions']:.0f}  "
            f"admission queue {metrics['endpoint_queue_depth']:.0f}  "
            f"moved {metrics.get('endpoint_moved_sessions', 0):.0f}  "
            f"refused {metrics.get('endpoint_refused_sessions', 0):.0f}"
        )
    if "regenerated_groups" in metrics:
        lines.append(
            f"{'fleet:':<14}regenerated groups {metrics['regenerated_groups']:.0f}  "
            f"sandbox retries {metrics.get('sandbox_retries', 0):.0f}"
        )
    for key in sorted(metrics):
        if key.startswith("replica_") and key.endswith("_groups"):
            name = key.removeprefix("replica_").removesuffix("_groups")
            lines.append(
                f"{name + ':':<14}groups {metrics[key]:.0f}  busy {metrics[f'replica_{name}_busy_seconds']:.2f}s  "
                f"tokens/s {metrics[f'replica_{name}_tokens_per_second']:.0f}"
            )
        if key.startswith("replica_") and key.endswith("_sessions"):
            name = key.removeprefix("replica_").removesuffix("_sessions")
            kv = metrics.get(f"replica_{name}_kv_pressure")
            lines.append(
                f"{name + ':':<14}sessions {metrics[key]:.0f}  "
                f"admission pressure {metrics[f'replica_{name}_admission_pressure']:.2f}"
                + (f"  kv pressure {kv:.2f}" if kv is not None else "")
                + (
                    f"  prefill saved {metrics.get(f'replica_{name}_prefill_tokens_saved', 0):.0f}"
                    f" computed {metrics.get(f'replica_{name}_prefill_tokens_computed', 0):.0f}"
                    f"  evictions {metrics.get(f'replica_{name}_evictions', 0):.0f}"
                    if kv is not None
                    else ""
                )
            )
        if key.startswith("sandbox_") and key.endswith("_queued"):
            name = key.removeprefix("sandbox_").removesuffix("_queued")
            lines.append(f"{name + ':':<14}running {metrics[f'sandbox_{name}_running']:.0f}  queued {metrics[key]:.0f}")
    return lines


def member_line(member) -> str:
    """A fleet member as `dockyard status` lists it."""
    from dockyard.api.coordinator.v1 import coordinator_pb2

    kind = coordinator_pb2.MemberKind.Name(member.kind).removeprefix("MEMBER_KIND_").lower()
    parts = [f"{member.name:<14}", f"{kind:<8}", f"{member.status:<8}", member.address, f"load {member.load}"]
    parts.append(f"in flight {member.in_flight}  seen {member.seconds_since_heartbeat:.1f}s ago")
    if member.kv_pressure:
        parts.append(f"kv pressure {member.kv_pressure:.2f}")
    if member.weight_versions:
        parts.append("versions " + ",".join(f"{j}@{v}" for j, v in sorted(member.weight_versions.items())))
    return "  ".join(parts)


def trainer_summary(metrics: dict[str, float]) -> list[str]:
    """Readable lines of a step's trainer metrics (what `dockyard status JOB` prints under the JSON)."""
    lines = []
    for label, fields in _SUMMARY:
        parts = [f"{name} {metrics[key]:{fmt}}" for name, key, fmt in fields if key in metrics]
        if parts:
            lines.append(f"{label + ':':<14}" + "  ".join(parts))
    return lines


def pipeline_summary(metrics: dict[str, float]) -> list[str]:
    """The pipeline around the step: trained samples by age, the buffer's occupancy, the verdict mix."""
    lines = []
    ages = sorted((int(k.removeprefix("staleness_")), v) for k, v in metrics.items() if k[10:].isdigit())
    if ages:
        histogram = "  ".join(f"age {age}: {count:.0f}" for age, count in ages)
        lines.append(f"{'staleness:':<14}{histogram}  (mean {metrics.get('staleness_mean', 0):.2f})")
    occupancy = (("held", "buffer_held"), ("pending", "buffer_pending"), ("dropped stale", "buffer_dropped_stale"))
    buffer = [f"{name} {metrics[key]:.0f}" for name, key in occupancy if key in metrics]
    if buffer:
        lines.append(f"{'buffer:':<14}" + "  ".join(buffer))
    verdicts = [f"{k.removeprefix('verdict_')} {v:.0f}" for k, v in sorted(metrics.items()) if k.startswith("verdict_")]
    if verdicts:
        lines.append(f"{'verdicts:':<14}" + "  ".join(verdicts))
    return lines


async def _submit(address: str, yaml_text: str) -> str:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    channel, stub = _coordinator(address)
    async with channel:
        reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=yaml_text), timeout=30)
    return reply.job.job_id


async def _follow(address: str, job_id: str, stack=None) -> int:
    """Show a progress bar until the job finishes; returns the job's final state."""
    import asyncio

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from dockyard.api.coordinator.v1 import coordinator_pb2
    from dockyard.jobs import FINISHED, state_name

    channel, stub = _coordinator(address)
    async with channel:
        with Progress(
            TextColumn("[bold]{task.fields[phase]:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  loss {task.fields[loss]}  val {task.fields[val]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        ) as bar:
            task = bar.add_task("job", total=None, phase="starting", reward="-", loss="-", val="-", tps="-")
            while True:
                job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=10)).job
                m, v = job.metrics, job.validation_metrics
                bar.update(
                    task,
                    total=job.max_steps,
                    completed=job.step,
                    phase=job.phase,
                    reward=f"{m['reward_mean']:.3f}" if "reward_mean" in m else "-",
                    loss=f"{m['loss']:.4f}" if "loss" in m else "-",
                    val=f"{v['pass_rate']:.3f}" if "pass_rate" in v else "-",
                    tps=f"{m['generated_tokens_per_second']:.0f}" if "generated_tokens_per_second" in m else "-",
                )
                if job.state in FINISHED:
                    break
                if stack is not None and (dead := stack.dead()):
                    raise RuntimeError(f"service(s) exited during the job: {', '.join(dead)}; logs in {stack.log_dir}")
                await asyncio.sleep(0.5)
    print(_job_line(job))
    for line in warning_lines(job):
        print(line)
    if job.message and state_name(job.state) != "FAILED":  # a failed job's line says why already
        print(f"message: {job.message}")
    return job.state


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


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the stack is always stopped.

    SIGINT is set explicitly: a shell that starts us in the background ignores it,
    and Python would then never raise KeyboardInterrupt.
    """

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def cmd_preflight(args) -> int:
    cfg = _load(args.config, args.overrides)
    # A folder the config bootstraps is checked as built: `dockyard prepare` (or run --prepare) builds it.
    _preflight(cfg, prepare=cfg.policy.bootstrap is not None, local_services=not args.remote)
    return 0


def cmd_run(args) -> int:
    cfg = _load(args.config, args.overrides)
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
    stack = _stack(
        log_dir,
        free_ports=not args.default_ports,
        extra_env=extra_env,
        rollout_replicas=args.rollout_replicas,
        sandbox_workers=args.sandbox_workers,
        ports=_port_flags(args),
        # agent trials and the hle judge send their model calls through the policy endpoint
        endpoint=cfg.env.agentic or cfg.env.judge.enabled,
        dashboard=True,
    )
    _preflight(
        cfg,
        prepare=args.prepare,
        ports=stack.ports,
        free_ports=not args.default_ports,
        environ={**os.environ, **extra_env},
    )
    if args.prepare:
        prepare(cfg)
    print(f"starting services (logs in {log_dir})")
    _interrupt_on_signals()
    try:
        stack.start()
    except RuntimeError as exc:  # a service exited while starting: its log's last lines say why
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _print_addresses(stack, indent="  ")
    address = stack.address("coordinator")
    job_id, job = None, None
    try:
        job_id = _arun(_submit(address, cfg.resolved_yaml()))
        print(f"job {job_id} submitted")
        state = _arun(_follow(address, job_id, stack))
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


def _last_look(address: str, job_id: str | None):
    """The job as the coordinator has it now (None when there is none, or no answer within seconds)."""
    if job_id is None:
        return None
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def get():
        channel, stub = _coordinator(address)
        async with channel:
            return (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=5)).job

    try:
        return _arun(get())
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


def _port_flags(args) -> dict[str, int]:
    return {
        **{service: getattr(args, f"{service}_port") for service in DEFAULT_PORTS},
        "endpoint": args.endpoint_port,
        "dashboard": args.dashboard_port,
    }


def _print_addresses(stack, indent: str = "") -> None:
    for name in stack.procs:
        print(f"{indent}{name:<12} {stack.address(name)}")
    if "dashboard" in stack.ports:
        print(f"{indent}{'dashboard':<12} http://{stack.address('dashboard')}/")


def cmd_up(args) -> int:
    from dockyard.preflight import check_ports

    stack = _stack(
        Path(args.log_dir),
        rollout_replicas=args.rollout_replicas,
        sandbox_workers=args.sandbox_workers,
        ports=_port_flags(args),
        endpoint=True,
        dashboard=True,
    )
    if (ports := check_ports(stack.ports, free_when_unset=False)).status == "error":
        print(f"error: ports {ports.message}", file=sys.stderr)
        return EXIT_USAGE
    _interrupt_on_signals()
    try:
        stack.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _print_addresses(stack)
    print(f"logs in {args.log_dir}; Ctrl-C stops every service")
    try:
        while not (dead := stack.dead()):
            time.sleep(0.5)
        print(f"service(s) exited: {', '.join(dead)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def cmd_submit(args) -> int:
    cfg = _load(args.config, args.overrides)
    if args.prepare:
        prepare(cfg)
    job_id = _arun(_submit(args.coordinator, cfg.resolved_yaml()))
    print(job_id, flush=True)
    if not args.wait:
        return 0
    from dockyard.api.coordinator.v1 import coordinator_pb2

    state = _arun(_follow(args.coordinator, job_id))
    return 0 if state == coordinator_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


def cmd_status(args) -> int:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def go() -> int:
        channel, stub = _coordinator(args.coordinator)
        async with channel:
            if args.job:
                _print_job((await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=args.job))).job)
            else:
                jobs = (await stub.ListJobs(coordinator_pb2.ListJobsRequest())).jobs
                for job in jobs:
                    print(_job_line(job))
                    for line in warning_lines(job):
                        print("  " + line)
                if not jobs:
                    print("no jobs")
                members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
                print(f"fleet: {len(members)} member(s)")
                for member in members:
                    print("  " + member_line(member))
        return 0

    return _arun(go())


def cmd_cancel(args) -> int:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def go() -> int:
        channel, stub = _coordinator(args.coordinator)
        async with channel:
            print(_job_line((await stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id=args.job))).job))
        return 0

    return _arun(go())


def cmd_prepare(args) -> int:
    prepare(_load(args.config, args.overrides))
    return 0


def cmd_export_sft(args) -> int:
    from dockyard.tasks.demonstrations import export_best_trials

    try:
        count = export_best_trials(args.run_dir, args.out, args.min_reward)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{count} demonstrations (reward >= {args.min_reward:g}) written to {args.out}")
    return 0


def cmd_build_swe(args) -> int:
    # The builder is a sandbox-side tool (it grades with the sandbox's log parser): it runs as its own
    # process, as the services do, so the library never imports it; its parser owns the options.
    builder = [sys.executable, "-m", "services.sandbox.task_builder", "--prog", "dockyard tasks build-swe"]
    return subprocess.run([*builder, *args.builder_args]).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dockyard", description="GRPO post-training against execution-grounded rewards."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="job config YAML")
        p.add_argument("overrides", nargs="*", help="section.key=value (or +section.key=value to add a key)")

    def with_fleet(p: argparse.ArgumentParser) -> None:
        p.add_argument("--rollout-replicas", type=int, default=1, help="rollout processes (rollout-1..N when N > 1)")
        p.add_argument("--sandbox-workers", type=int, default=1, help="sandbox processes (sandbox-1..M when M > 1)")

    def with_coordinator(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--coordinator",
            default=os.environ.get(COORDINATOR_ADDRESS_ENV) or default_address("coordinator"),
            help=f"coordinator host:port (default: ${COORDINATOR_ADDRESS_ENV}, else {default_address('coordinator')})",
        )

    def with_ports(p: argparse.ArgumentParser, unset: str) -> None:
        for service, port in DEFAULT_PORTS.items():
            several = " (N > 1 processes: the first of N consecutive ports; free ports when unset)"
            p.add_argument(
                f"--{service}-port",
                type=int,
                metavar="PORT",
                help=f"port of the {service}: default $DOCKYARD_{service.upper()}_PORT, else {unset.format(port=port)}"
                + (several if service in ("rollout", "sandbox") else ""),
            )
        p.add_argument(
            "--endpoint-port",
            type=int,
            metavar="PORT",
            help="HTTP port of the policy endpoint (OpenAI/Anthropic API): default $DOCKYARD_ENDPOINT_PORT, else "
            + unset.format(port=8000),
        )
        p.add_argument(
            "--dashboard-port",
            type=int,
            metavar="PORT",
            help="HTTP port of the coordinator's web dashboard: default $DOCKYARD_COORDINATOR_DASHBOARD_PORT, else "
            + unset.format(port=8080),
        )

    p = sub.add_parser("run", help="preflight, start the services, run one job to the end, stop them")
    with_config(p)
    p.add_argument(
        "--prepare", action="store_true", help="build a missing policy folder with the config's bootstrap first"
    )
    p.add_argument("--default-ports", action="store_true", help="bind 50051-50055 instead of free ports")
    with_ports(p, "a free port (--default-ports: {port})")
    with_fleet(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("preflight", help="check what a run of the config needs, before starting anything")
    with_config(p)
    p.add_argument(
        "--remote",
        action="store_true",
        help="the services run elsewhere (skip the one-machine GPU layout check)",
    )
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("up", help="run the five services locally until Ctrl-C")
    p.add_argument("--log-dir", default="runs/logs/up", help="service logs go here")
    with_fleet(p)
    with_ports(p, "{port}")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("submit", help="submit a job to a running coordinator")
    with_config(p)
    with_coordinator(p)
    p.add_argument("--wait", action="store_true", help="follow the job; exit 0 only when it succeeds")
    p.add_argument(
        "--prepare", action="store_true", help="build a missing policy folder with the config's bootstrap first"
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="show one job, or list every job")
    p.add_argument("job", nargs="?", help="job id")
    with_coordinator(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job", help="job id")
    with_coordinator(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("prepare", help="build the policy folder that the config bootstraps")
    with_config(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("export-sft", help="write a run's passing trials as an SFT dataset (sft.dataset)")
    p.add_argument("run_dir", help="a run folder, runs/<job-id>: its trials.jsonl (every passing trial)")
    p.add_argument("out", help="the new JSONL to write: {prompt, completion} records, or {messages, tools} for agents")
    p.add_argument("--min-reward", type=float, default=1.0, help="keep trials whose reward is at least this")
    p.set_defaults(func=cmd_export_sft)

    tasks = sub.add_parser("tasks", help="build task sets").add_subparsers(dest="tasks_command", required=True)
    p = tasks.add_parser(
        "build-swe",
        help="SWE-bench-style instances from a PyPI sdist with injected bugs (`dockyard tasks build-swe -h`)",
        add_help=False,
    )
    p.add_argument("builder_args", nargs=argparse.REMAINDER, help="the task builder's arguments")
    p.set_defaults(func=cmd_build_swe)

    from dockyard.export.commands import add_commands

    add_commands(sub)
    return parser


def unreachable_hint(code, address: str | None) -> str:
    """For submit, status and cancel: what to do when no coordinator answers at `address`."""
    import grpc

    if address is None or code != grpc.StatusCode.UNAVAILABLE:
        return ""
    return (
        f"hint: no coordinator answers at {address}: start the services with `dockyard up` (`dockyard run CONFIG` "
        f"starts its own and stops them at the end), or name a running one with --coordinator or "
        f"{COORDINATOR_ADDRESS_ENV}"
    )


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, with a command's k=v overrides taken wherever they stand: after its flags
    too (`dockyard run CONFIG --prepare k=v`), where argparse would stop the overrides at the flag."""
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["tasks", "build-swe"]:  # every argument, -h included, is the builder's
        return cmd_build_swe(argparse.Namespace(builder_args=argv[2:]))
    args = parse_args(build_parser(), argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import grpc

        from dockyard.rpc.auth import AuthConfigError

        if isinstance(exc, AuthConfigError):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(exc, grpc.aio.AioRpcError):
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if hint := unreachable_hint(exc.code(), getattr(args, "coordinator", None)):
                print(hint, file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
