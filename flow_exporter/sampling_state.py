"""The shedding schedule in the state directory (issue 42): what a restarted exporter needs to stamp the connections
it continues with the probability they were kept with.

Adaptive shedding changes the probability new connections are decided at (``sampling.Schedule``); a connection's
records say the probability of its first-seen time. The connections a restarted exporter continues from the
checkpoint were decided under the last process's schedule, so it is kept beside the checkpoint: the file
``sampling``, JSON ``{"lineage": hex, "base": p, "changes": [[t_ns, level], ...]}``, written to a temporary file and
renamed into place before a change takes effect (a change that cannot be written is not made). It belongs to one
lineage: a file of another (the state was dropped) is ignored; one of this lineage that cannot be read makes the
state untrustworthy, and the runner drops it (a new lineage).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flow_exporter.sampling import Schedule

__all__ = ["FILE", "ScheduleError", "load", "save"]

FILE = "sampling"
MAX_BYTES = 16 << 20  # ~500k changes: far beyond one a sampling.adjustInterval for years


class ScheduleError(Exception):
    """The state directory's schedule is this lineage's but cannot be read."""


def load(directory: Path, lineage: bytes, base: float) -> list[tuple[int, int]]:
    """The changes of ``lineage``'s schedule: [] when there is none (never shed, or another lineage's)."""
    path = directory / FILE
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ScheduleError(f"{path}: {exc.strerror}") from None
    try:
        doc = json.loads(data.decode()) if len(data) <= MAX_BYTES else None
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object (or too large)")
        if doc.get("lineage") != lineage.hex():
            return []
        if doc.get("base") != base:
            raise ValueError(f"written for sampling.probability {doc.get('base')!r}, not {base!r}")
        changes = [(int(t), int(level)) for t, level in doc["changes"]]
        Schedule(base, changes)  # in order, levels in range
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise ScheduleError(f"{path}: {exc}") from None
    return changes


def save(directory: Path, lineage: bytes, schedule: Schedule) -> None:
    """Write ``schedule`` for ``lineage`` (OSError when it cannot be: the change is then not made)."""
    tmp = directory / (FILE + ".tmp")
    doc = {"lineage": lineage.hex(), "base": schedule.base, "changes": [list(c) for c in schedule.changes]}
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, directory / FILE)
