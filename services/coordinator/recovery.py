"""Where a job goes on from: a resumed trainer, a restarted trainer, a restarted coordinator.

    resume(loaded)        the trainer's LoadPolicy reply at the start ─> the step to go on from:
                          0, or the checkpoint's step (a resume), or the trainer's version (a coordinator
                          restart: the task stream, group index and run number come from the stored cursor)
    recover_trainer()     a trainer that lost the policy mid-job (TrainerRestarted, whichever call found it:
                          TrainStep, the weight sync, SaveCheckpoint) ─> LoadPolicy from the latest checkpoint
                          ─> buffer clock rewound ─> a new weight-sync group epoch ─> weights synced ─> go on
    mark_cursor(step)     the task cursor, stored with the job before each step trains

Guarantees: the step goes on from is the trainer's weight_version as LoadPolicy
reports it, never the persisted step (a TrainStep whose reply was lost is not
trained again); the task stream stands where the checkpoint (or the cursor)
says, so a resumed job draws the same tasks an uninterrupted one would; when
the trainer may have gone back to a checkpoint, group ids take a new run
number (`<job>/r<n>/...`) so the resumed run never collides with acked ids,
and the buffer's clock is rewound to the trainer's version. The cursor is
stored before each TrainStep, so it always names the step the trainer stands
at or the one after. A trainer that keeps restarting fails the job after
recovery_timeout seconds; one that restarted in a job without checkpoints
fails it at once, saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import structlog

from dockyard.api.trainer.v1 import trainer_pb2
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.jobs import JobRecord
from services.coordinator.producer import GroupIds
from services.coordinator.run_folder import RunFolder
from services.coordinator.task_stream import TaskStream
from services.coordinator.trainer_client import TrainerClient, TrainerRestarted
from services.coordinator.weight_sync import WeightSync

log = structlog.get_logger()

# How long a step waits for its cursor to be stored; a store that is down delays, never stops, a job.
CURSOR_FLUSH_SECONDS = 5.0


class Recovery:
    def __init__(
        self,
        record: JobRecord,
        trainer: TrainerClient,
        buffer: JobBuffer,
        weights: WeightSync,
        tasks: TaskStream,
        ids: GroupIds,
        folder: RunFolder,
        *,
        recovering: bool,
        checkpointing: bool,
        recovery_timeout: float,
        flush: Callable[[float], Awaitable[bool]] | None = None,
        phase: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.record, self.trainer, self.buffer, self.weights = record, trainer, buffer, weights
        self.tasks, self.ids, self.folder = tasks, ids, folder
        self.recovering = recovering  # started by a restarted coordinator for a job it had
        self._checkpointing = checkpointing
        self._recovery_timeout = recovery_timeout
        self._flush = flush
        self._phase = phase
        self.rewind = False  # recovering onto a trainer that went back to an older checkpoint

    async def resume(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """The step the trainer stands at; on a resume, move the task stream to where it was."""
        if self.recovering:
            drawn = self.tasks_drawn_at(loaded)
        elif not loaded.resumed_from:
            return 0
        else:
            drawn = _checkpoint_tasks_drawn(loaded)
        self.tasks.skip(drawn)
        # The buffer's clock (age bound, puts from the future) starts at the resumed version.
        if self.rewind:
            await self.buffer.open(rewind_to=loaded.weight_version)
        else:
            await self.buffer.set_clock(loaded.weight_version)
        kind = "recover" if self.recovering else "resume"
        self.folder.append(kind, loaded.weight_version, {"tasks_drawn": float(drawn)})
        log.info(
            kind,
            checkpoint=loaded.resumed_from,
            step=loaded.weight_version,
            stored_step=self.record.step,
            tasks_drawn=drawn,
        )
        self.record.touch(step=loaded.weight_version, weight_version=loaded.weight_version)
        self.trainer.resumed_at(loaded.weight_version)
        return loaded.weight_version

    def tasks_drawn_at(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """Tasks drawn before step weight_version + 1, from the persisted cursor or the checkpoint;
        the group index and run number of the cursor are restored with it."""
        version, cursor = loaded.weight_version, self.record.cursor
        self.ids.restore(int(cursor.get("run_number", 0)), int(cursor.get("next_group_index", 0)))
        if loaded.resumed_from:
            # The trainer may have come back from a checkpoint (its reply cannot say whether it
            # restarted): steps after it may have acked their groups, so this run takes new group
            # ids, and the buffer's clock goes back to the trainer's version.
            self.ids.restore(self.ids.run_number + 1, 0)
            self.rewind = True
        if cursor.get("step") in (version, version + 1):
            return int(cursor["tasks_drawn_before" if cursor["step"] == version + 1 else "tasks_drawn_after"])
        if loaded.resumed_from:
            return _checkpoint_tasks_drawn(loaded)
        if not cursor:  # no step was collected before the restart
            return 0
        raise RuntimeError(
            f"the trainer stands at step {version}, but the stored task cursor is at step {cursor.get('step')} "
            "and no checkpoint says where the task stream was (the trainer lost the job and the job keeps "
            "no checkpoint to resume from)"
        )

    async def recover_trainer(self, cause: TrainerRestarted) -> None:
        """A restarted trainer: load the policy from the job's latest checkpoint and go on from its
        step. A trainer that restarts again meanwhile is recovered in turn, up to recovery_timeout."""
        self._phase("recovering trainer")
        deadline = time.monotonic() + self._recovery_timeout
        while True:
            log.warning("the trainer restarted; recovering", found_by=str(cause), step=self.record.step)
            try:
                await self._resume_trainer()
                return
            except TrainerRestarted as again:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer kept restarting for {self._recovery_timeout:.0f} s") from again
                cause = again

    async def _resume_trainer(self) -> None:
        record, trained_to = self.record, self.trainer.trained_to
        self.ids.new_run()
        loaded = await self.trainer.load(resume=True)
        version = loaded.weight_version
        if not self._checkpointing and version != trained_to:
            raise RuntimeError(
                f"the trainer restarted and lost the policy of step {trained_to}; the job keeps no "
                "checkpoints (checkpointing.enabled=false), so there is nothing to resume from"
            )
        # The versions after the checkpoint were lost: the resumed weights generate at `version`.
        await self.buffer.open(rewind_to=version)
        self.weights.reform_group()
        await self.weights.sync(version)
        lost = max(trained_to, record.step) - version
        self.folder.append("recovery", version, {"steps_lost": float(lost), "run_number": float(self.ids.run_number)})
        log.warning("trainer restarted; resumed", checkpoint=loaded.resumed_from, step=version, steps_lost=lost)
        record.touch(step=version, weight_version=version)
        self.trainer.resumed_at(version)

    async def mark_cursor(self, step: int, drawn_before: int) -> None:
        """Where the task stream stands around `step`; stored before the step trains."""
        cursor = {
            "step": step,
            "tasks_drawn_before": drawn_before,
            "tasks_drawn_after": self.tasks.drawn,
            "next_group_index": self.ids.next_index,
            "run_number": self.ids.run_number,
        }
        self.record.touch(cursor=cursor)
        if self._flush is not None and not await self._flush(CURSOR_FLUSH_SECONDS):
            log.error("the task cursor is not stored yet; a coordinator restart now could misplace it", step=step)


def _checkpoint_tasks_drawn(loaded: trainer_pb2.LoadPolicyResponse) -> int:
    return int(json.loads(loaded.data_state or "{}").get("tasks_drawn", 0))
