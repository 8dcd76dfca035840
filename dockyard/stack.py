"""The five services as local processes on loopback: what `dockyard up` and `dockyard run` start.

Guarantees: every child is in the parent's care: it gets SIGTERM when the
parent dies (PARENT_PID_ENV asks the service to set PR_SET_PDEATHSIG itself;
a preexec_fn would run Python between fork and exec, which crashes a parent
that already holds gRPC threads), `stop()` SIGTERMs all children and
SIGKILLs any that outlive the grace period, so no service is left orphaned;
each child's log goes to its own file, and `pids.json` beside the logs names
every child's pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dockyard.rpc.client import wait_until_serving
from dockyard.rpc.launch import PARENT_PID_ENV
from dockyard.rpc.settings import DEFAULT_PORTS

SERVICES = ("buffer", "sandbox", "rollout", "trainer", "coordinator")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    def __init__(
        self,
        log_dir: Path,
        *,
        free_ports: bool = False,
        extra_env: dict[str, str] | None = None,
        service_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.ports = {name: (_free_port() if free_ports else DEFAULT_PORTS[name]) for name in SERVICES}
        self.extra_env = extra_env or {}
        # Per service, on top of extra_env: e.g. CUDA_VISIBLE_DEVICES to put trainer and rollout on two GPUs.
        self.service_env = service_env or {}
        self.procs: dict[str, subprocess.Popen] = {}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _env(self, name: str) -> dict[str, str]:
        env = {
            **os.environ,
            **self.extra_env,
            **self.service_env.get(name, {}),
            f"DOCKYARD_{name.upper()}_PORT": str(self.ports[name]),
            PARENT_PID_ENV: str(os.getpid()),
        }
        # Each service reads only the peer addresses it needs; the rest are ignored.
        for peer in SERVICES:
            if peer != name:
                env.setdefault(f"DOCKYARD_{name.upper()}_{peer.upper()}_ADDRESS", self.address(peer))
        return env

    def _spawn(self, name: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                env=self._env(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        (self.log_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def start(self, timeout: float = 120.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in SERVICES:
            self._spawn(name)
        try:
            asyncio.run(self._wait(SERVICES, timeout))
        except BaseException:
            self.stop()
            raise

    def kill(self, name: str) -> None:
        """SIGKILL one service, as a crash would: no drain, no cleanup."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start a service that died (or was killed) again, on the same port, and wait until it serves."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running; kill it first")
        self._spawn(name)
        asyncio.run(self._wait((name,), timeout))

    async def _wait(self, names, timeout: float) -> None:
        async def one(name: str) -> None:
            task = asyncio.ensure_future(wait_until_serving(self.address(name), timeout))
            while not task.done():
                if self.procs[name].poll() is not None:
                    task.cancel()
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with code {self.procs[name].returncode}:\n{tail}")
                await asyncio.sleep(0.1)
            task.result()

        await asyncio.gather(*(one(name) for name in names))

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def stop(self, grace: float = 15.0) -> dict[str, int]:
        # The coordinator first, so no job drives services that are going away.
        for name in reversed(SERVICES):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}
