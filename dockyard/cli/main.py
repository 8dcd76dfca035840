"""The `dockyard` parser and its commands; `dockyard run` lives in run.py (the usage is the package's docstring)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from dockyard.cli.common import (
    COORDINATOR_ADDRESS_ENV,
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
from dockyard.cli.run import cmd_run
from dockyard.cli.views import job_line, member_line, print_job, warning_lines
from dockyard.rpc.ports import DEFAULT_PORTS, default_address


def cmd_preflight(args) -> int:
    cfg = load(args.config, args.overrides)
    # A folder the config bootstraps is checked as built: `dockyard prepare` (or run --prepare) builds it.
    run_preflight(cfg, prepare=cfg.policy.bootstrap is not None, local_services=not args.remote)
    return 0


def cmd_up(args) -> int:
    from dockyard.preflight import check_ports

    stack = local_stack(
        Path(args.log_dir),
        rollout_replicas=args.rollout_replicas,
        sandbox_workers=args.sandbox_workers,
        ports=port_flags(args),
        endpoint=True,
        dashboard=True,
    )
    if (ports := check_ports(stack.set_ports, free_when_unset=False)).status == "error":
        print(f"error: ports {ports.message}", file=sys.stderr)
        return EXIT_USAGE
    stack_token(Path(args.log_dir))  # no stack runs without a service token
    interrupt_on_signals()
    try:
        stack.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print_addresses(stack)
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
    cfg = load(args.config, args.overrides)
    if args.prepare:
        prepare(cfg)
    job_id = arun(submit(args.coordinator, cfg.resolved_yaml()))
    print(job_id, flush=True)
    if not args.wait:
        return 0
    from dockyard.api.coordinator.v1 import coordinator_pb2

    state = arun(follow(args.coordinator, job_id))
    return 0 if state == coordinator_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


def cmd_status(args) -> int:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def go() -> int:
        channel, stub = coordinator(args.coordinator)
        async with channel:
            if args.job:
                print_job((await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=args.job))).job)
            else:
                jobs = (await stub.ListJobs(coordinator_pb2.ListJobsRequest())).jobs
                for job in jobs:
                    print(job_line(job))
                    for line in warning_lines(job):
                        print("  " + line)
                if not jobs:
                    print("no jobs")
                members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
                print(f"fleet: {len(members)} member(s)")
                for member in members:
                    print("  " + member_line(member))
        return 0

    return arun(go())


def cmd_cancel(args) -> int:
    from dockyard.api.coordinator.v1 import coordinator_pb2

    async def go() -> int:
        channel, stub = coordinator(args.coordinator)
        async with channel:
            print(job_line((await stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id=args.job))).job))
        return 0

    return arun(go())


def cmd_prepare(args) -> int:
    prepare(load(args.config, args.overrides))
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


def cmd_to_harbor(args) -> int:
    from dockyard.tasks.harbor_convert import convert_task_set

    try:
        written = convert_task_set(args.src, args.dst)
    except (OSError, ValueError) as exc:  # a missing or unreadable task set, a taken name
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {len(written)} Harbor task folders into {args.dst}: {', '.join(written)}")
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
    p = tasks.add_parser("to-harbor", help="write a terminal-bench task set in Harbor's format (task.toml)")
    p.add_argument("src", help="a folder of terminal-bench task folders (each with task.yaml)")
    p.add_argument("dst", help="the folder to write the Harbor task folders into (their names must be free)")
    p.set_defaults(func=cmd_to_harbor)

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
