"""The base of every config section, the error a bad config raises, and the integer bounds fields share.

Guarantees: every section accepts extra keys (kept in `model_extra`, never read) and validates on
assignment; each bound here is the one every field of its kind uses (steps, batches, groups,
tokens, seeds), so a value beyond it is refused naming the field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MAX_STEPS = 10_000_000
MAX_BATCH = 1_000_000
MAX_GROUP = 10_000
MAX_TOKENS = 10_000_000
MAX_SEED = 2**32 - 1  # numpy's seed range, the narrowest of the generators seeded


class ConfigError(ValueError):
    """A job config that cannot run; the message names the field(s)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True)
