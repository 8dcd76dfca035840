"""The one failure a group may end in without failing its job: GroupUnscorable.

Guarantees: whatever made the group impossible (most trials failing in the sandbox, parts that could not be
assembled after every regeneration, a trial the buffer refuses), the producer counts it as one failed group
and the job goes on, the same in sync and async GRPO and with or without a data plane.
"""

from __future__ import annotations


class GroupUnscorable(Exception):
    """A group that cannot be trained on. `first` names the first failed trajectory and its verdict's error
    (a reward function's: its type and message), or what kept the group from being made."""

    def __init__(self, message: str, first: str = "") -> None:
        super().__init__(message)
        self.first = first
