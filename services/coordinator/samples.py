"""A few completions per step for people to read: a uniform sample of the groups put since the last step.

    Collector.deliver(group put) ─SampleReservoir.offer─> k kept (reservoir sampling, seeded)
    JobRunner end of step ─take()─> [{group_id, prompt, completion, reward, verdict}] ─> RunFolder.record_samples

Guarantees: at most k rows per step, each trajectory of the step equally likely to be
among them whatever the step's size; memory is k rows; k = 0 keeps nothing.
"""

from __future__ import annotations

import random

from dockyard.api.common.v1 import common_pb2


class SampleReservoir:
    def __init__(self, k: int, seed: int) -> None:
        self.k = k
        self._rng = random.Random(seed)
        self._kept: list[dict] = []
        self._seen = 0

    def offer(self, group: common_pb2.Group) -> None:
        for t in group.trajectories:
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

    def take(self) -> list[dict]:
        """The rows kept since the last call."""
        kept, self._kept, self._seen = self._kept, [], 0
        return kept
