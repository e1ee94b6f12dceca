"""Adaptive shedding (issue 42): the probability new connections are kept with, halved while the node is over its
budget and doubled back when it is well under; never a connection already kept.

The load is projected, not only measured: a connection kept at level l (probability p0 / 2**l) stands, once the
table has turned over, for 2**(l - L) connections at the current level L. So the rows the store would hold at
the current level are the sum over its rows of 2**(l - L), and the records per second the measured rate scaled
by the same ratio. A halving shows in the projection at once, so the controller does not halve again and again
while long-lived connections kept earlier are still there (they stay: the cap, limits.maxConnections, is the
last resort). Hysteresis: a level is lowered (the probability doubled) only when the projected load is under
:data:`LOWER_BELOW` of the budget, so the doubled one stays under 80 %; one step per ``sampling.adjustInterval``
at most. Pure: the poll loop feeds it the store's rows by level and the records built so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LOWER_BELOW", "Budget", "Change", "Shedder"]

LOWER_BELOW = 0.4  # the projected load under which the probability is doubled (it then stays under 0.8)


@dataclass(frozen=True)
class Budget:
    """sampling.budget: store rows, records per second (0: not limited)."""

    connections: int = 0
    records_per_second: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.connections or self.records_per_second)


@dataclass(frozen=True)
class Change:
    """A new level for new connections, and why: the projected load (1 = the budget) and what it was of."""

    level: int
    load: float
    rows: float  # projected store rows at the current level
    records_per_second: float  # projected


class Shedder:
    """Chooses the level (the probability's halvings) from the budget, at most once per ``interval`` seconds."""

    def __init__(self, budget: Budget, interval: float, max_level: int) -> None:
        self.budget = budget
        self.interval = interval
        self.max_level = max_level
        self._since: float | None = None  # the start of the interval being measured (monotonic seconds)
        self._records = 0  # records built at its start

    def observe(self, now: float, level: int, rows_by_level: Mapping[int, int], records_built: int) -> Change | None:
        """At the end of a poll: the new level if the last interval calls for one (else None)."""
        if self._since is None:
            self._since, self._records = now, records_built
            return None
        elapsed = now - self._since
        if elapsed < self.interval:
            return None
        rate = (records_built - self._records) / elapsed
        self._since, self._records = now, records_built
        rows = sum(rows_by_level.values())
        projected = sum(n * 2.0 ** (lv - level) for lv, n in rows_by_level.items())
        projected_rate = rate * projected / rows if rows else 0.0
        loads = []
        if self.budget.connections:
            loads.append(projected / self.budget.connections)
        if self.budget.records_per_second:
            loads.append(projected_rate / self.budget.records_per_second)
        load = max(loads, default=0.0)
        if load > 1 and level < self.max_level:
            return Change(level + 1, load, projected, projected_rate)
        if load < LOWER_BELOW and level > 0:
            return Change(level - 1, load, projected, projected_rate)
        return None
