"""How fast the CLI answers: process start to exit of `dockyard --help` and of a mistyped override,
against `python -c pass` measured in the same run.

    python -c pass                                         baseline: the interpreter alone
    dockyard --help                                        the parser only: no pydantic, grpc, asyncio or torch
    dockyard run CONFIG grpo.max_num_stepz=3               the config is loaded and refused (exit 2),
                                                           without importing torch

Prints each median in milliseconds and `help_vs_python: R`, `config_error_vs_python: R` (command time
/ baseline time; lower is better, 1.0 is the interpreter's own start). The goals: --help under 0.5 s,
and a typo reported in about the time a Python program takes to start.

    .venv/bin/python bench/cli_start.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKYARD = Path(sys.executable).parent / "dockyard"
CONFIG = ROOT / "examples" / "configs" / "tiny_expr.yaml"


def median_seconds(command: list[str], runs: int, expect: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, capture_output=True, stdin=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - start)
        if code != expect:
            raise SystemExit(f"{' '.join(command)} exited {code}, expected {expect}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (the median is reported)")
    args = parser.parse_args()
    # Interleaved rounds, so a load spike on the machine touches every command alike.
    commands = {
        "python": ([sys.executable, "-c", "pass"], 0),
        "help": ([str(DOCKYARD), "--help"], 0),
        "config_error": ([str(DOCKYARD), "run", str(CONFIG), "grpo.max_num_stepz=3"], 2),
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, (command, expect) in commands.items():
            samples[name].append(median_seconds(command, 1, expect))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, seconds in medians.items():
        print(f"{name}: {seconds * 1000:.0f} ms")
    for name in ("help", "config_error"):
        print(f"{name}_vs_python: {medians[name] / medians['python']:.2f}")


if __name__ == "__main__":
    main()
