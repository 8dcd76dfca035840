"""A step's metrics beyond the trainer's own: what was collected, the buffer, the fleet, phase times.

    CollectStats ─collected()─> groups, invalid_trajectories, dropped_*, uniform_reward_groups,
                                integrity_violations, invalid_action_trajectories, reward_function_errors,
                                verdict_<status>
    JobBuffer.stats ─buffer()─> buffer_held, buffer_pending, ..., buffer_age_<a>, buffer_sent_<kind>_bytes,
                                coordinator_received_<arrays|rollout_staged|trial_arrays|endpoint_staged>_bytes
    collector timeline + fleet ─fleet(step)─> replica_<name>_*, sandbox_<name>_*, regenerated_groups,
                                              scaffold_errors (an external scaffold's failed trials), ...
    agent trials ─trial_metrics─> agent_turns_mean, agent_tokens_mean, agent_masked_fraction, agent_finish_<why>
                                              (each Generate also written as a "generation" record)
    endpoint GET /v1/routing ─routing_metrics─> endpoint_queue_depth, endpoint_sessions, endpoint_moved_sessions,
        replica_<name>_sessions, replica_<name>_kv_pressure, replica_<name>_prefill_tokens_saved, ...

Guarantees: counters that accumulate over the job (regenerated groups, sandbox retries, scaffold
errors: Collector.counters()) are reported per step, as differences since the last call (scaffold_errors
only with an external scaffold);
a buffer that is restarting leaves its counters out of that step instead of
failing it.
"""

from __future__ import annotations

from services.coordinator.collector import CollectionCounters, Collector, CollectStats
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.run_folder import RunFolder

_BUFFER_COUNTERS = ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts", "reclaimed")


def collected(stats: CollectStats) -> dict[str, float]:
    return {
        "groups": float(stats.groups),
        "invalid_trajectories": float(stats.invalid),
        "integrity_violations": float(stats.integrity_violations),
        "invalid_action_trajectories": float(stats.invalid_actions),
        "reward_function_errors": float(stats.reward_function_errors),
        "dropped_uniform_groups": float(stats.dropped_uniform),
        "dropped_stale_on_put": float(stats.dropped_stale),
        "uniform_reward_groups": float(stats.uniform),
        **{f"verdict_{name}": float(count) for name, count in stats.verdicts.items()},
    }


def phase_seconds(first: str, t0: float, t1: float, t2: float, t3: float, transfer: float) -> dict[str, float]:
    """A step's time by phase: `first` (generating or waiting for groups), training, weight sync."""
    return {
        first: t1 - t0,
        "train_step_seconds": t2 - t1,
        "weight_sync_seconds": t3 - t2,
        "weight_sync_transfer_seconds": transfer,
        "step_seconds": t3 - t0,
    }


def trial_metrics(trials: list[dict[str, float | str]]) -> dict[str, float]:
    """Agent trials since the last step: mean turns, tokens and segments, the masked (context) fraction
    of their tokens, and how many ended each way (agent_finish_<reason>)."""
    if not trials:
        return {}
    n = len(trials)
    tokens = sum(float(t["tokens"]) for t in trials)
    metrics = {
        "agent_trials": float(n),
        "agent_turns_mean": sum(float(t["turns"]) for t in trials) / n,
        "agent_turns_max": max(float(t["turns"]) for t in trials),
        "agent_tokens_mean": tokens / n,
        "agent_tokens_max": max(float(t["tokens"]) for t in trials),
        "agent_segments_mean": sum(float(t["segments"]) for t in trials) / n,
        "agent_model_seconds_mean": sum(float(t["model_seconds"]) for t in trials) / n,
        "agent_tool_seconds_mean": sum(float(t["tool_seconds"]) for t in trials) / n,
        "agent_masked_fraction": 1.0 - sum(float(t["sampled_tokens"]) for t in trials) / max(tokens, 1.0),
    }
    for t in trials:
        key = f"agent_finish_{t['finish_reason']}"
        metrics[key] = metrics.get(key, 0.0) + 1.0
    return metrics


_ROUTING_COUNTERS = ("moved_sessions", "retried_calls", "queued_sessions", "refused_sessions")
_REPLICA_COUNTERS = ("prefill_tokens_computed", "prefill_tokens_saved", "evictions")


def routing_metrics(now: dict, last: dict) -> dict[str, float]:
    """The endpoint's routing state (services/endpoint/routing.py snapshot) as step metrics: gauges as they
    are, counters as differences from `last` (the previous step's snapshot)."""
    metrics = {
        "endpoint_queue_depth": float(now["admission"]["queue_depth"]),
        "endpoint_sessions": float(now["sessions"]),
    }
    for key in _ROUTING_COUNTERS:
        metrics[f"endpoint_{key}"] = float(now[key] - last.get(key, 0))
    before = last.get("replicas", {})
    for name, replica in now["replicas"].items():
        metrics[f"replica_{name}_sessions"] = float(replica["sessions"])
        metrics[f"replica_{name}_admission_pressure"] = float(replica["admission_pressure"])
        if replica["kv_pressure"] is None:
            continue
        metrics[f"replica_{name}_kv_pressure"] = float(replica["kv_pressure"])
        for key in _REPLICA_COUNTERS:
            metrics[f"replica_{name}_{key}"] = float(replica[key] - (before.get(name, {}).get(key) or 0))
    return metrics


class StepMetrics:
    def __init__(self, fleet: Fleet, collector: Collector, buffer: JobBuffer, folder: RunFolder) -> None:
        self._fleet, self._collector, self._buffer, self._folder = fleet, collector, buffer, folder
        # The collector's running totals at the last step's end.
        self._counts = CollectionCounters(0, 0)
        self._routing: dict = {}  # the endpoint's routing snapshot at the last step's end

    async def endpoint(self) -> dict[str, float]:
        """Admission queue, sessions and KV pressure per replica from the policy endpoint (agent jobs only)."""
        now = await self._collector.endpoint_routing()
        if now is None:
            return {}
        metrics = routing_metrics(now, self._routing)
        self._routing = now
        return metrics

    async def buffer(self) -> dict[str, float]:
        stats = await self._buffer.stats()
        if stats is None:
            return {}  # the buffer is restarting: this step goes without its counters
        metrics = {f"buffer_{name}": float(getattr(stats, name)) for name in _BUFFER_COUNTERS}
        metrics["buffer_put_rate"] = stats.put_rate
        metrics["buffer_sample_rate"] = stats.sample_rate
        metrics.update({f"buffer_age_{age}": float(count) for age, count in sorted(stats.age_histogram.items())})
        # Bytes this job's writer sent so far: through the buffer service (metadata, payload) and to the data plane.
        metrics.update({f"buffer_sent_{kind}_bytes": float(n) for kind, n in self._buffer.sent().items()})
        # Payload bytes the replicas sent this coordinator: ~0 while they stage payloads in the data plane.
        metrics.update(
            {f"coordinator_received_{kind}_bytes": float(n) for kind, n in self._collector.received().items()}
        )
        return metrics

    def fleet(self, step: int) -> dict[str, float]:
        """Per-replica generation records since the last call (written as "generation" records) and
        their totals, plus each sandbox worker's last reported queue."""
        timeline = self._collector.take_timeline()
        metrics: dict[str, float] = {}
        for entry in timeline:
            self._folder.append("generation", step, entry)
            name = entry["replica"]
            busy = entry["end"] - entry["start"]
            metrics[f"replica_{name}_busy_seconds"] = metrics.get(f"replica_{name}_busy_seconds", 0.0) + busy
            metrics[f"replica_{name}_groups"] = metrics.get(f"replica_{name}_groups", 0.0) + 1
            metrics[f"replica_{name}_tokens"] = metrics.get(f"replica_{name}_tokens", 0.0) + entry["tokens"]
        for name in {e["replica"] for e in timeline}:
            busy = metrics[f"replica_{name}_busy_seconds"]
            metrics[f"replica_{name}_tokens_per_second"] = metrics[f"replica_{name}_tokens"] / max(busy, 1e-9)
        for worker in self._fleet.members(SANDBOX):
            metrics[f"sandbox_{worker.name}_running"] = float(worker.running)
            metrics[f"sandbox_{worker.name}_queued"] = float(worker.queued)
        metrics.update(trial_metrics(self._collector.take_trial_stats()))
        counts = self._collector.counters()
        metrics["regenerated_groups"] = float(counts.regenerated_groups - self._counts.regenerated_groups)
        metrics["sandbox_retries"] = float(counts.sandbox_retries - self._counts.sandbox_retries)
        if counts.scaffold_errors is not None:
            metrics["scaffold_errors"] = float(counts.scaffold_errors - (self._counts.scaffold_errors or 0))
        self._counts = counts
        metrics["fleet_rollout_alive"] = float(len(self._fleet.alive(ROLLOUT)))
        metrics["fleet_sandbox_alive"] = float(len(self._fleet.alive(SANDBOX)))
        return metrics
