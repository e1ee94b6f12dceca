"""Poll and expiry timeouts, with Antrea's rules for keeping them consistent."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flow_exporter.settings import DEFAULTS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. Build with :meth:`normalized` so the derived rules apply."""

    poll_interval: float = DEFAULTS["conntrack.pollInterval"]
    active: float = DEFAULTS["expiry.activeTimeout"]
    idle: float = DEFAULTS["expiry.idleTimeout"]
    stale: float = DEFAULTS["expiry.staleTimeout"]

    @classmethod
    def normalized(cls, poll_interval: float, active: float, idle: float, stale: float) -> Timeouts:
        """Apply Antrea's rules, logging every value that had to be raised.

        A timeout shorter than the poll interval could never be observed (the
        counters only move once per poll), so active and idle are raised to it;
        a stale timeout shorter than the larger timeout would delete connections
        that are merely waiting for their next record, so it becomes twice that.
        """
        if active < poll_interval:
            log.warning("active timeout %.3gs raised to the poll interval %.3gs", active, poll_interval)
            active = poll_interval
        if idle < poll_interval:
            log.warning("idle timeout %.3gs raised to the poll interval %.3gs", idle, poll_interval)
            idle = poll_interval
        larger = max(active, idle)
        if stale < larger:
            log.warning("stale timeout %.3gs raised to twice the larger timeout (%.3gs)", stale, 2 * larger)
            stale = 2 * larger
        return cls(poll_interval, active, idle, stale)
