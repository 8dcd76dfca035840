"""What a client's session on the endpoint must come to: a faithful recording, and experience the trainer takes.

    POST /v1/sessions ──open_session──> (session id, its key: the client's API key, as a scaffold gets it)
    GET /v1/sessions/{id}/trajectory ──recording──> TrajectoryDocument, checked: loss mask 1 exactly on the
        trained turns' chosen completions (their ids and logprobs, in order), as many as the client was told
    ──trainable──> the agent trial's path (dockyard.agents.trajectory: trial_tokens, trajectory_message), the
        group's packed payload (dockyard.experience.payload.split), the buffer's check (validate_group), the
        trainer's read (training_group), its rule (checked_groups) and its tensors (build_batch)

Nothing here re-implements a conversion: each step is the code the coordinator, buffer and trainer run.
Only the one-trajectory group around the sample is made here, with a fixed reward (the collector's
rewards and shaping are not what these tests are about).
"""

from __future__ import annotations

import httpx
import pytest

from dockyard.agents.contract import SessionOpened, SessionStatus, TrajectoryDocument
from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.trainable import checked_groups
from dockyard.models.load import load_tokenizer
from services.buffer.validation import validate_group
from services.trainer.batch import build_batch
from services.trainer.requests import training_group
from tests.integration.endpoint_stack import TOKEN, ServedJob

ADMIN = {"authorization": f"Bearer {TOKEN}"}


def open_session(job: ServedJob) -> tuple[str, str]:
    """A new endpoint session: (its id, its key), opened with the service token as an agent worker opens one."""
    reply = httpx.post(f"{job.base}/v1/sessions", headers=ADMIN, timeout=30)
    assert reply.status_code == 200, reply.text
    opened = SessionOpened.parse(reply.content)
    return opened.session_id, opened.api_key


def recording(job: ServedJob, session_id: str, *, turns: int, sampled: int) -> TrajectoryDocument:
    """The session's trajectory, checked: `turns` calls recorded, every trained token one of the sampled
    completions the calls returned (its id and logprob, in order), `sampled` of them in all."""
    reply = httpx.get(f"{job.base}/v1/sessions/{session_id}/trajectory", headers=ADMIN, timeout=30)
    assert reply.status_code == 200, reply.text
    document = TrajectoryDocument.parse(reply.content)
    assert document.status == SessionStatus.OK and document.turns == turns, document
    assert sum(len(s.turns) for s in document.segments) == turns
    for segment in document.segments:
        assert len(segment.token_ids) == len(segment.loss_mask) == len(segment.logprobs)
        trained = [t.completions[t.chosen] for t in segment.turns if t.trained]
        ones = [i for i, m in enumerate(segment.loss_mask) if m == 1]
        assert set(segment.loss_mask) <= {0, 1}
        assert [segment.token_ids[i] for i in ones] == [x for c in trained for x in c.token_ids]
        assert [segment.logprobs[i] for i in ones] == [x for c in trained for x in c.logprobs]
        assert all(lp <= 0 for lp in segment.logprobs)
        assert all(lp == 0.0 for lp, m in zip(segment.logprobs, segment.loss_mask, strict=True) if m == 0)
    assert sum(sum(s.loss_mask) for s in document.segments) == sampled, document
    return document


def trainable(job: ServedJob, document: TrajectoryDocument) -> None:
    """The recording becomes a training sample through the code an agent trial's tokens take to a step."""
    config = job.config
    tokens = trial_tokens(document, config.grpo.max_trial_tokens)
    sampled = sum(sum(s.loss_mask) for s in document.segments)
    assert not tokens.truncated and tokens.sampled_tokens == sampled
    verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=1, tests_total=1)
    trajectory = trajectory_message(
        tokens,
        trajectory_id=f"{document.session_id}/0",
        verdict=verdict,
        reward=1.0,
        valid=True,
        num_turns=document.turns,
        invalid_actions=document.invalid_actions,
    )
    group = common_pb2.Group(
        group_id=document.session_id,
        job_id=job.job_id,
        task_id="client-session",
        prompt="",
        weight_version=trajectory.weight_version,
        trajectories=[trajectory],
    )
    metadata, payload = packed.split(group)  # what the coordinator's put sends (services/coordinator/job_buffer.py)
    validate_group(metadata, payload=payload)  # the buffer's check; InvalidArgument if it would refuse it
    tokenizer = load_tokenizer(config.policy)
    positions = config.policy.model["max_position_embeddings"]
    groups = checked_groups([training_group(metadata, payload)], len(tokenizer), positions)
    batch = build_batch(groups, tokenizer.pad_token_id)
    assert len(batch) == len(tokens.segments) and int(batch.token_mask.sum()) == sampled
    trained = batch.generation_logprobs[batch.token_mask.bool()].tolist()
    recorded = [lp for s in document.segments for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    assert trained == pytest.approx(recorded, abs=1e-6)  # float32 tensors of the recorded float64s
