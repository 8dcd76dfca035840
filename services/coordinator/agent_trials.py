"""Agent workers: a group of multi-turn trials, each a scaffold in its own sandbox and endpoint session.

    Task ──n trials at once (at most grpo.max_concurrent_trials per job)──> for each trial:
        OpenSession(task.files) on the least loaded sandbox worker (a full one is waited out) ── the
            session stays on that worker
        run_scaffold(openai client ─X-Dockyard-Session─> policy endpoint, Toolbox ─> the session), or
        with env.scaffold: POST /v1/sessions (id + key), the session opened with a route to the endpoint
            (and the scaffold's package), run_external: the unchanged program in it, the key as its API key
        score: the answer as env.score scores a completion (expr, program synthesis), or
               ScoreSession (swe: the work folder's diff against the base commit; terminal_bench: the
               task's tests, run in the session after the agent; gdpval: the deliverables, then the checker)
        the recording (endpoint_sessions.py): with the buffer's data plane, the session was opened with where
            to stage and the endpoint stages the trial's tokens itself (a part of the group's payload, assembled
            by staged_payloads.py): metadata only comes here; without one, GET /v1/sessions/{id}/trajectory
            ──trial_tokens, trajectory_message──> Trajectory (loss mask, later segments)
            + the conversation of each segment (messages and tools), which a run keeps for export-sft
        close both sessions

Where they live: in the coordinator process, as asyncio tasks beside the single-turn collector
(docs/architecture.md says why). Guarantees: a trial whose endpoint or replica failed (TrialLost) makes
the whole group be generated again (at most max_regenerations times, counted; then the error
propagates), never trained on half a trajectory; a trial the sandbox could not serve, or the endpoint
refused, becomes an invalid trajectory (ERROR verdict, masked); a trial that ran out of turns, tokens or
time is scored as it stands, and its finish_reason says which budget; both sessions are closed
whatever happens, and a trial's recorded tokens are cut to grpo.max_trial_tokens. An external
scaffold's failure (a non-zero exit, the time limit, garbage output, or no model call: its session
has nothing recorded) is a masked trial of no tokens, its verdict ERROR with SCAFFOLD_ERROR_PREFIX
and Trial.scaffold_error / output_tail saying why; it is counted (scaffold_errors.py), and only too
many of them in a step fail the job (ScaffoldFailing). A trial's staged part is held by its Trial
until the group is assembled; a part no group will take (a trial left without tokens, the finished
trials of a group made again) is deleted here, or, where that fails or its trial was cancelled, expires.
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable

import grpc
import httpx
import openai
import structlog

from dockyard.agents.contract import SESSION_HEADER, SESSION_ID_CHARS, SessionStatus, TrialStaging
from dockyard.agents.external import (
    ScaffoldRun,
    env_scaffold_name,
    run_external,
    session_packages,
)
from dockyard.agents.scaffold import Budget, Outcome, TrialLost, TrialRefused, run_scaffold
from dockyard.agents.session import SandboxSession
from dockyard.agents.tools import Toolbox
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import STATE_SCORED_ENVS, MasterConfig, SamplingConfig
from dockyard.experience.data_plane import DataPlane
from dockyard.rpc.retry import OVERLOADED, PEER_LOST
from dockyard.tasks import swe, verifiers_rows
from dockyard.tasks.task import Task
from services.coordinator.endpoint_sessions import EndpointSessions, discard, staging_for
from services.coordinator.fleet import Fleet, Member
from services.coordinator.scaffold_errors import ScaffoldErrors
from services.coordinator.trials import Trial, invalid, scaffold_error

# A full (RESOURCE_EXHAUSTED) or unreachable sandbox worker frees up or comes back: wait for it.
OPEN_RETRIABLE = OVERLOADED | PEER_LOST

log = structlog.get_logger()

# (task, answer, request id) -> verdict: the collector's scoring, with its retries across workers.
Score = Callable[[Task, str, str], Awaitable[common_pb2.Verdict]]


def endpoint_url(address: str) -> str:
    """host:port (or a URL) -> the endpoint's base URL."""
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


class AgentTrials:
    def __init__(
        self,
        job_id: str,
        config: MasterConfig,
        fleet: Fleet,
        score: Score,
        limits: sandbox_pb2.Limits,
        *,
        endpoint_address: str,
        token: str,
        max_regenerations: int,
        wait_timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,  # the endpoint's session reads; None: the network
        plane: Callable[[], DataPlane | None] = lambda: None,  # the buffer's data plane: trials stage there
    ) -> None:
        self.job_id, self.config, self.fleet = job_id, config, fleet
        self._score, self._limits = score, limits
        self._base = endpoint_url(endpoint_address).rstrip("/")
        self._token = token or "none"
        self._sessions = EndpointSessions(self._base, self._token, transport)
        self._plane = plane
        self._max_regenerations = max_regenerations
        self._wait_timeout = wait_timeout
        self._slots = asyncio.Semaphore(config.grpo.max_concurrent_trials)
        self._client: openai.AsyncOpenAI | None = None
        self.regenerated_groups = 0
        scaffold, grpo = config.env.scaffold, config.grpo
        per_step = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
        # The external scaffold's failures: counted, and the job's end when too many (None: built-in scaffold).
        self.scaffold_errors = (
            ScaffoldErrors(env_scaffold_name(config.env), scaffold.max_error_fraction, per_step) if scaffold else None
        )
        # Figures of finished trials since the last take_stats: turns, tokens, masked fraction, budgets hit.
        self._stats: list[dict[str, float | str]] = []

    def _openai(self) -> openai.AsyncOpenAI:
        """Model calls go through the openai client, as any scaffold makes them (session calls: EndpointSessions)."""
        if self._client is None:
            timeout = self.config.grpo.max_trial_seconds + 60.0
            self._client = openai.AsyncOpenAI(
                base_url=f"{self._base}/v1", api_key=self._token, max_retries=0, timeout=timeout
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        self._client = None
        await self._sessions.close()

    async def routing(self) -> dict | None:
        """The endpoint's routing state; None when it does not answer (the step goes without those figures)."""
        return await self._sessions.routing()

    def take_stats(self) -> list[dict[str, float | str]]:
        stats, self._stats = self._stats, []
        return stats

    async def group(self, task: Task, group_id: str, seed: int, n: int, sampling: SamplingConfig) -> list[Trial]:
        """n scored trials of `task`; the whole group again when a trial lost its endpoint or replica."""
        for attempt in range(self._max_regenerations + 1):
            trials = [
                asyncio.create_task(self.trial(task, f"{group_id}/{i}", seed * 1_000 + i, sampling, stage=True))
                for i in range(n)
            ]
            try:
                finished = list(await asyncio.gather(*trials))
            except TrialLost as exc:
                for t in trials:
                    t.cancel()
                ended = await asyncio.gather(*trials, return_exceptions=True)
                # The trials that finished staged parts no group will take (a cancelled one's expires).
                await discard(self._plane(), [t.part for t in ended if isinstance(t, Trial)])
                if attempt == self._max_regenerations:
                    raise
                self.regenerated_groups += 1
                log.warning(
                    "a trial lost its endpoint or replica; generating the group again", group=group_id, error=str(exc)
                )
                continue
            if self.scaffold_errors is not None:  # ScaffoldFailing when a step's worth holds too many
                self.scaffold_errors.count([t.error_line() for t in finished])
            return finished
        raise AssertionError("unreachable")

    async def validation_trial(self, task: Task, request_id: str, sampling: SamplingConfig) -> common_pb2.Trajectory:
        """One trial, tried again (at most max_regenerations times, counted) when it lost its endpoint."""
        for attempt in range(self._max_regenerations + 1):
            try:
                return (await self.trial(task, request_id, None, sampling)).trajectory
            except TrialLost as exc:
                if attempt == self._max_regenerations:
                    raise
                self.regenerated_groups += 1
                log.warning("a validation trial lost its endpoint or replica; trying it again", error=str(exc))
        raise AssertionError("unreachable")

    async def trial(
        self, task: Task, trajectory_id: str, seed: int | None, sampling: SamplingConfig, stage: bool = False
    ) -> Trial:
        """One scored trial, its tokens staged in the buffer's data plane by the endpoint when `stage` and
        there is one; TrialLost when the endpoint or its replica failed."""
        async with self._slots:
            session_id = f"{re.sub(f'[^{SESSION_ID_CHARS}]', '.', trajectory_id)[-90:]}.{uuid.uuid4().hex[:12]}"
            api_key = ""
            plane = self._plane() if stage else None  # validation trials are never put: nothing to stage
            staging = staging_for(plane, self.job_id, trajectory_id, self.config.grpo.max_trial_tokens)
            if self.config.env.scaffold is not None or staging is not None:
                # An unchanged client sends no session header: the session's own key binds its calls.
                # A validation trial's session is opened greedy: the scaffold holds only the key and
                # cannot ask for (or undo) greedy decoding itself; training sessions keep the job's law.
                # Where to stage is said here, by the service token, and nowhere else.
                session_id, api_key = await self._sessions.open(sampling.temperature == 0, staging)
            opened = await self._open(task, session_id)
            if isinstance(opened, str):
                await self._sessions.forget(session_id)
                return Trial(invalid(trajectory_id, opened))
            worker, sandbox = opened
            with self.fleet.calling(worker):
                try:
                    trial = await self._run(task, trajectory_id, seed, sampling, sandbox, session_id, api_key, staging)
                    await discard(self._plane(), [trial.recorded_part])  # a part no group will take (or None)
                    return trial
                finally:
                    await sandbox.close()
                    await self._sessions.forget(session_id)

    async def _run(
        self,
        task: Task,
        trajectory_id: str,
        seed,
        sampling,
        sandbox: SandboxSession,
        session_id: str,
        api_key: str,
        staging: TrialStaging | None,
    ) -> Trial:
        grpo, tools = self.config.grpo, self.config.env.tools
        seconds = min(grpo.max_trial_seconds, task.max_seconds or grpo.max_trial_seconds)  # the task's own limit
        budget = Budget(grpo.max_rollout_turns, grpo.max_trial_tokens, seconds)
        run: ScaffoldRun | None = None
        try:
            if self.config.env.scaffold is not None:
                run = await self._external(task, sandbox, api_key, budget, sampling)
                outcome = run.outcome
            else:
                client = self._openai().with_options(default_headers={SESSION_HEADER: session_id})
                toolbox = Toolbox(tools, sandbox, max_output_chars=self.config.env.sandbox.max_output_bytes or 4096)
                outcome = await run_scaffold(client, self.job_id, task.prompt, tools, toolbox, sampling, budget, seed)
        except TrialRefused as exc:
            return Trial(invalid(trajectory_id, str(exc)))
        except grpc.aio.AioRpcError as exc:
            return Trial(invalid(trajectory_id, f"the sandbox session failed: {exc.code().name}: {exc.details()}"))
        # The session was opened before the scaffold ran: a 404 here means the endpoint lost it (TrialLost).
        recorded = await self._sessions.recording(session_id, grpo.max_trial_tokens, staged=staging is not None)
        if recorded.status != SessionStatus.OK:
            raise TrialLost(f"trial {trajectory_id}: {recorded.error or 'the endpoint session ended'}")
        if run is not None:
            error = run.error or (
                "" if recorded.sampled else "made no model call (the endpoint recorded no sampled token)"
            )
            if not error and self.config.env.name == "verifiers":  # the rubric's failure is the environment's
                error = verifiers_rows.result_error(run.outcome.answer)
            if error:
                return scaffold_error(trajectory_id, run, error, env_scaffold_name(self.config.env), recorded)
            outcome.turns = recorded.turns  # the endpoint counted the scaffold's calls
        if not recorded.segments:
            return Trial(invalid(trajectory_id, "the trial recorded no sampled token"))
        verdict, scored_text = await self._verdict(task, outcome, sandbox, trajectory_id)
        self._stats.append(
            {
                "turns": float(outcome.turns),
                "tokens": float(recorded.total_tokens),
                "sampled_tokens": float(recorded.sampled_tokens),
                "segments": float(recorded.segments),
                "model_seconds": outcome.model_seconds,
                "tool_seconds": outcome.tool_seconds,
                "finish_reason": "tokens" if recorded.truncated else outcome.finish_reason,
            }
        )
        trajectory = recorded.message(
            trajectory_id=trajectory_id,
            completion_text=scored_text,
            verdict=verdict,
            finish_reason="tokens" if recorded.truncated else outcome.finish_reason,
            num_turns=outcome.turns,
            # Trained turns the endpoint found malformed (unparsable tool call, unclosed thinking block),
            # plus replies the scaffold dropped (docs/agents.md, "Trained tokens").
            invalid_actions=recorded.invalid_actions,
        )
        return Trial(trajectory, recorded.conversation, part=recorded.part, received_bytes=recorded.received_bytes)

    async def _external(
        self, task: Task, sandbox: SandboxSession, api_key: str, budget: Budget, sampling: SamplingConfig
    ) -> ScaffoldRun:
        """The configured scaffold, unchanged, in the session; a container that died is TrialRefused (masked)."""
        scaffold = self.config.env.scaffold
        assert scaffold is not None
        if not sandbox.endpoint_url:
            raise TrialRefused("the sandbox session has no route to the policy endpoint")
        run = await run_external(
            sandbox,
            scaffold,
            endpoint_url=sandbox.endpoint_url,
            api_key=api_key,
            model=self.job_id,
            prompt=task.prompt,
            budget=budget,
            max_new=sampling.max_new_tokens,
            extra=verifiers_rows.runner_environment(verifiers, task)
            if (verifiers := self.config.env.verifiers)
            else None,
        )
        return run

    def _endpoint_address(self) -> str:
        """host:port the sandbox routes a session's calls to: the address this coordinator calls."""
        return urllib.parse.urlsplit(self._base).netloc

    async def _verdict(
        self, task: Task, outcome: Outcome, sandbox: SandboxSession, request_id: str
    ) -> tuple[common_pb2.Verdict, str]:
        """(the verdict, the text it scored): the answer, or for a task session the sandbox's own scoring
        of it (swe: the session's diff against the base commit, with the held-out tests applied after it,
        whatever the answer said; terminal_bench: the task's tests run in the session)."""
        if self.config.env.name in STATE_SCORED_ENVS:
            try:
                scored = await sandbox.score(self._limits)
            except grpc.aio.AioRpcError as exc:
                error = f"ScoreSession: {exc.code().name}: {exc.details()}"
                return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message=error), ""
            return scored.score.verdict, scored.patch
        # No answer (a budget ran out first): scored as it stands, an empty answer.
        answer = outcome.answer or ""
        return await self._score(task, answer, request_id), answer

    async def _open(self, task: Task, session_id: str) -> tuple[Member, SandboxSession] | str:
        """A session on the least loaded worker; a full or unreachable worker is waited out (other
        workers tried first) up to the fleet wait timeout. The error, as text, when none opened one."""
        in_task_set = self.config.env.name in STATE_SCORED_ENVS
        task_set, instance_id = swe.split_task_id(task.task_id) if in_task_set else ("", "")
        scaffold = self.config.env.scaffold
        loop = asyncio.get_running_loop()
        deadline, pause, error = loop.time() + self._wait_timeout, 0.05, "no sandbox worker is alive"
        while True:
            worker = self.fleet.pick_sandbox()
            if worker is not None:
                try:
                    with self.fleet.calling(worker):
                        sandbox = await SandboxSession.open(
                            worker.stub,
                            session_id,
                            files=dict(task.files),
                            limits=self._limits,
                            task_set=task_set,
                            instance_id=instance_id,
                            idle_timeout_seconds=min(self.config.grpo.max_trial_seconds + 120.0, 3600.0),
                            endpoint_address=self._endpoint_address() if scaffold else "",
                            packages=session_packages(self.config.env),
                        )
                    return worker, sandbox
                except grpc.aio.AioRpcError as exc:
                    error = f"opening a sandbox session on {worker.name}: {exc.code().name}: {exc.details()}"
                    if exc.code() not in OPEN_RETRIABLE:
                        return error
                    if exc.code() in PEER_LOST:
                        self.fleet.mark_failed(worker)
            if loop.time() > deadline:
                return f"{error} (waited {self._wait_timeout:.0f} s)"
            await asyncio.sleep(pause)  # sessions close as trials end
            pause = min(pause * 2, 1.0)
