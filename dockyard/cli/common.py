"""What the commands share: loading a config strictly, preflight, the local stack, the coordinator stub,
submitting and following a job. Heavy modules are imported inside the functions that need them."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from dockyard.cli.views import job_line, warning_lines
from dockyard.rpc.ports import DEFAULT_PORTS

EXIT_FAILED = 1
EXIT_USAGE = 2
# Named like a service's peer address (DOCKYARD_<SVC>_COORDINATOR_ADDRESS), the CLI being the client.
COORDINATOR_ADDRESS_ENV = "DOCKYARD_CLI_COORDINATOR_ADDRESS"


def coordinator(address: str):
    from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
    from dockyard.rpc.client import connect

    channel = connect(address, service="dockyard.coordinator.v1.CoordinatorService")
    return channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def arun(coro):
    import asyncio

    return asyncio.run(coro)


def load(config: str, overrides: list[str]):
    from dockyard.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides, strict=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if added := cfg.unknown_keys():
        print(f"note: keys added on purpose, kept in the saved config, unused by dockyard: {', '.join(added)}")
    return cfg


def run_preflight(cfg, **context) -> None:
    """Run the preflight checks; print them, and exit with status 2 when any fails."""
    from dockyard.preflight import Context, errors, preflight, report

    findings = preflight(cfg, Context(**context))
    failed = errors(findings)
    print(("preflight found problems:\n" if failed else "preflight:\n") + report(findings), flush=True)
    if failed:
        raise SystemExit(EXIT_USAGE)


def stack_token(folder: Path) -> None:
    """A service token for the stack about to start, unless DOCKYARD_AUTH_TOKEN(_FILE) sets one: created in
    `folder` (dockyard/stack.py: ensure_service_token), its path and use shown, the token itself never."""
    from dockyard.stack import ensure_service_token

    path = ensure_service_token(folder)
    if path is None:
        return
    print(f"service token: {path} (new, random, mode 0600; every service requires it)")
    print(f"  dockyard status/submit/cancel: export DOCKYARD_AUTH_TOKEN_FILE={path}")
    print(f'  HTTP (endpoint, dashboard): -H "Authorization: Bearer $(cat {path})", or the dashboard\'s ?token= once')


def local_stack(log_dir: Path, **options):
    """A LocalStack, or exit status 2 naming the port setting that is unusable."""
    from dockyard.stack import LocalStack

    try:
        return LocalStack(log_dir, **options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


async def submit(address: str, yaml_text: str) -> str:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    channel, stub = coordinator(address)
    async with channel:
        reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=yaml_text), timeout=30)
    return reply.job.job_id


async def follow(address: str, job_id: str, stack=None) -> int:
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

    channel, stub = coordinator(address)
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
    print(job_line(job))
    for line in warning_lines(job):
        print(line)
    if job.message and state_name(job.state) != "FAILED":  # a failed job's line says why already
        print(f"message: {job.message}")
    return job.state


def port_flags(args) -> dict[str, int]:
    return {
        **{service: getattr(args, f"{service}_port") for service in DEFAULT_PORTS},
        "endpoint": args.endpoint_port,
        "dashboard": args.dashboard_port,
    }


def print_addresses(stack, indent: str = "") -> None:
    for name in stack.procs:
        print(f"{indent}{name:<12} {stack.address(name)}")
    if "dashboard" in stack.ports:
        print(f"{indent}{'dashboard':<12} http://{stack.address('dashboard')}/")


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the stack is always stopped.

    SIGINT is set explicitly: a shell that starts us in the background ignores it,
    and Python would then never raise KeyboardInterrupt.
    """

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
