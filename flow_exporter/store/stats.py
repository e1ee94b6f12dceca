"""What the store counts about itself (read by the loops for metrics; never written back)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StoreStats:
    added: int = 0
    deleted: int = 0
    reused_tuples: int = 0
    records_built: int = 0
    added_from_events: int = 0
    destroyed_events: int = 0
    resurrected: int = 0  # continued from a tombstone by a late event or row
    late_destroys_dropped: int = 0  # late DESTROY events with nothing new to report
    counter_resets: int = 0
    restored: int = 0  # continued from the checkpoint
    restored_gone: int = 0  # in the checkpoint, no longer in the table: ended while no exporter ran
    tombstones_dropped_early: int = 0  # forgotten before their time to make room (limits.maxConnections)
    readmitted: int = 0  # an incarnation met again after it was forgotten: a new id, flagged adopted
    resends: int = 0  # records scheduled again after a failed delivery
    given_up: dict[str, int] = field(default_factory=dict)  # by reason
    unreported_ends: int = 0  # final counters the store could not report (given up, or no known connection)
