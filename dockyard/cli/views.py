"""How jobs, steps and fleet members read on a terminal (`dockyard status`, the end of `dockyard run`).

Pure formatting of what the coordinator returns: a metric a step lacks is left out, never shown as zero.
"""

from __future__ import annotations

import json


def job_line(job) -> str:
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


def print_job(job) -> None:
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
            ("routing mismatch", "routing_mismatch_fraction", ".4f"),
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
            + (f"  scaffold errors {metrics['scaffold_errors']:.0f}" if "scaffold_errors" in metrics else "")
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
