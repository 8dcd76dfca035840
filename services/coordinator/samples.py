"""A few completions per step for people to read: a uniform sample of the groups put since the last step.

    Collector.deliver(group put) ─SampleReservoir.offer─> k kept (reservoir sampling, seeded)
    Collector (every scaffold error of an external scaffold) ─scaffold_error()─> kept, each
    JobRunner end of step ─take()─> [{group_id, prompt, completion, reward, verdict}] ─> RunFolder.record_samples
        a scaffold error's row: verdict "scaffold_error", `error` (what failed) and `scaffold_output` (the
        tail of its stderr, its stdout when stderr is empty), whether its group was put or not

Guarantees: at most k sampled rows per step, each put trajectory (scaffold errors aside) of the step
equally likely to be among them whatever the step's size; memory is k rows; k = 0 keeps nothing sampled.
Every scaffold error of the step gets its own row too, at most MAX_SCAFFOLD_ERROR_ROWS of them.
"""

from __future__ import annotations

import random

from dockyard.agents.external import is_scaffold_error
from dockyard.api.common.v1 import common_pb2

# Scaffold errors written per step: enough to read why, bounded when every trial fails.
MAX_SCAFFOLD_ERROR_ROWS = 64


class SampleReservoir:
    def __init__(self, k: int, seed: int) -> None:
        self.k = k
        self._rng = random.Random(seed)
        self._kept: list[dict] = []
        self._seen = 0
        self._errors: list[dict] = []

    def offer(self, group: common_pb2.Group) -> None:
        for t in group.trajectories:
            if is_scaffold_error(t):  # its row, with the scaffold's output, came through scaffold_error
                continue
            self._seen += 1
            slot = len(self._kept) if len(self._kept) < self.k else self._rng.randrange(self._seen)
            if slot < self.k:
                row = {
                    "group_id": group.group_id,
                    "prompt": group.prompt,
                    "completion": t.completion_text,
                    "reward": t.reward,
                    "verdict": common_pb2.VerdictStatus.Name(t.verdict.status).removeprefix("VERDICT_STATUS_").lower(),
                }
                if slot == len(self._kept):
                    self._kept.append(row)
                else:
                    self._kept[slot] = row

    def scaffold_error(self, group_id: str, prompt: str, trajectory_id: str, error: str, output: str) -> None:
        """A trial whose external scaffold failed: kept whole (up to MAX_SCAFFOLD_ERROR_ROWS a step)."""
        if len(self._errors) < MAX_SCAFFOLD_ERROR_ROWS:
            self._errors.append(
                {
                    "group_id": group_id,
                    "trajectory_id": trajectory_id,
                    "prompt": prompt,
                    "completion": "",
                    "reward": 0.0,
                    "verdict": "scaffold_error",
                    "error": error,
                    "scaffold_output": output,
                }
            )

    def take(self) -> list[dict]:
        """The rows kept since the last call: the sampled ones, then every scaffold error's."""
        kept, self._kept, self._seen = self._kept + self._errors, [], 0
        self._errors = []
        return kept
