"""Poll and expiry timeouts, with Antrea's rules for keeping them consistent."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flow_exporter.settings import DEFAULT_SETTINGS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. Build with :meth:`normalized` so the derived rules apply."""

    poll_interval: float = DEFAULT_SETTINGS.conntrack.poll_interval
    active: float = DEFAULT_SETTINGS.expiry.active_timeout
    idle: float = DEFAULT_SETTINGS.expiry.idle_timeout

    @classmethod
    def normalized(cls, poll_interval: float, active: float, idle: float) -> Timeouts:
        """Apply Antrea's rules, logging every value that had to be raised.

        A timeout shorter than the poll interval could never be observed (the
        counters only move once per poll), so active and idle are raised to it.
        Antrea's stale timeout has no counterpart: a connection that left the table
        is reported at the poll that misses it (``expiry.staleTimeout`` is parsed
        so that older configs load, and ignored).
        """
        if active < poll_interval:
            log.warning("active timeout %.3gs raised to the poll interval %.3gs", active, poll_interval)
            active = poll_interval
        if idle < poll_interval:
            log.warning("idle timeout %.3gs raised to the poll interval %.3gs", idle, poll_interval)
            idle = poll_interval
        return cls(poll_interval, active, idle)
