"""The coordinator's dashboard in a real headless browser (Debian's Chromium, driven by Playwright).

A LocalStack with the dashboard runs a short GRPO job; the page, opened once, lists the job, draws its
reward curve and, without a reload, draws more points as the job trains; a screenshot is kept. With a
service token the page refuses a visit without it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT, missing

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Where the screenshot is kept (the run's output, so it can be looked at after the suite).
SCREENSHOT = REPO_ROOT / "runs" / "dashboard.png"


def _chromium():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (the dev extra)")
    if not Path(CHROMIUM).exists():
        missing("Chromium is not installed (apt-get install chromium)")
    return sync_playwright


def _submit(stack: LocalStack, runs: Path, steps: int) -> str:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        ["policy.model_name=null", "policy.bootstrap=null", f"grpo.max_num_steps={steps}", "grpo.val_period=0",
         "grpo.val_at_start=false", "checkpointing.enabled=false", f"logger.log_dir={runs}"],
    )  # fmt: skip

    async def create() -> str:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))
            return reply.job.job_id

    return asyncio.run(create())


def _wait_finished(stack: LocalStack, job_id: str, timeout: float = 300) -> None:
    async def wait() -> None:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            deadline = time.monotonic() + timeout
            while True:
                job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id))).job
                if job.state == coordinator_pb2.JOB_STATE_SUCCEEDED:
                    return
                assert (
                    job.state == coordinator_pb2.JOB_STATE_RUNNING or job.state == coordinator_pb2.JOB_STATE_PENDING
                ), f"the first job ended {job.state}: {job.message}"
                assert time.monotonic() < deadline, f"the first job did not finish in {timeout} s"
                await asyncio.sleep(0.5)

    asyncio.run(wait())


def _points(page) -> int:
    path = page.locator('path.series[data-name="reward_mean"]')
    return int(path.get_attribute("data-points")) if path.count() else 0


def test_the_dashboard_shows_a_running_job_and_updates_without_a_reload(tmp_path: Path) -> None:
    sync_playwright = _chromium()
    stack = LocalStack(tmp_path / "logs", free_ports=True, dashboard=True)
    stack.start()
    try:
        # A coordinator usually holds finished jobs too (its store survives restarts): the page must
        # follow the running one, not an older one whose curve never grows.
        finished = _submit(stack, tmp_path / "old-runs", steps=1)
        _wait_finished(stack, finished)
        # Long enough to be still running when the page first draws (a quiet machine trains 12 steps in
        # well under a minute); the stack stops it once the page has drawn a new step.
        job_id = _submit(stack, tmp_path / "runs", steps=200)
        url = f"http://{stack.address('dashboard')}/"
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url)
            page.wait_for_selector(f'tr[data-job="{job_id}"].sel', timeout=30_000)  # followed, unclicked
            deadline = time.monotonic() + 300
            while (first := _points(page)) < 1:
                assert time.monotonic() < deadline, "no reward point drawn"
                page.wait_for_timeout(1000)
            # The same page, never reloaded: its polling draws the steps trained since.
            while (later := _points(page)) <= first:
                assert time.monotonic() < deadline, f"the curve stayed at {first} point(s)"
                page.wait_for_timeout(1000)
            titles = page.locator(".chart").evaluate_all("charts => charts.map(c => c.dataset.title)")
            assert {"reward", "loss", "entropy", "clip fraction", "tokens/s"} <= set(titles)
            assert page.locator("#fleet tbody tr").count() >= 2  # a rollout replica and a sandbox worker
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
        assert later > first and SCREENSHOT.stat().st_size > 10_000
    finally:
        stack.stop()


def test_with_a_service_token_the_dashboard_needs_it(tmp_path: Path) -> None:
    token = "dashboard-test-token"
    os.environ["DOCKYARD_AUTH_TOKEN"] = token
    try:
        stack = LocalStack(tmp_path / "logs", free_ports=True, dashboard=True)
        stack.start()
    finally:
        del os.environ["DOCKYARD_AUTH_TOKEN"]
    try:
        base = f"http://{stack.address('dashboard')}"
        assert httpx.get(f"{base}/api/state", timeout=10).status_code == 401
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        # Members register with the coordinator on their own (retrying until it serves): wait for both.
        deadline = time.monotonic() + 60
        while True:
            reply = httpx.get(f"{base}/api/state", headers={"authorization": f"Bearer {token}"}, timeout=10)
            assert reply.status_code == 200
            if {m["kind"] for m in reply.json()["fleet"]} >= {"rollout", "sandbox"}:
                break
            assert time.monotonic() < deadline, f"the fleet never showed a rollout and a sandbox: {reply.json()}"
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=10) as browser_like:  # ?token= once, then the cookie
            assert browser_like.get(f"/?token={token}").status_code == 200
            assert browser_like.get("/api/state").status_code == 200
        assert httpx.post(f"{base}/api/state", headers={"authorization": f"Bearer {token}"}).status_code == 405
    finally:
        stack.stop()
