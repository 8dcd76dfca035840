"""Task files read line by line, with errors that name the file, the line and the field.

    bytes (.jsonl, or gzip-compressed) ──read_records(fields)──> [(line number, record), ...]

Guarantees: every record returned is a JSON object holding every required field; anything else is
a ValueError saying `<file>:<line>: ...` and which fields the format needs, so a bad dataset fails
at `dockyard preflight` rather than minutes into a job.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence


def read_records(raw: bytes, origin: str, fields: Sequence[str]) -> list[tuple[int, dict]]:
    """The JSON objects of a JSONL text (blank lines skipped), each checked for `fields`."""
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    need = ", ".join(fields)
    records = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{origin}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{origin}:{number}: a record is a JSON object with {need}")
        missing = [f for f in fields if f not in item]
        if missing:
            raise ValueError(f"{origin}:{number}: missing field {missing[0]!r} (this format needs {need})")
        records.append((number, item))
    return records
