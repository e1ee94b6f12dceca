"""When to stop, and whether the loops are alive: shared by the loops, the sink and the health checks.

One object built first by the composition root and handed to each part, so a sink blocked on
a full queue knows when to give up (at the stop signal while running, at the end of the grace
period while shutting down) without any part reaching into another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Lifecycle:
    """The stop signal, the shutdown deadline and the loops' heartbeats."""

    def __init__(self, stop_event: threading.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stop_event = stop_event or threading.Event()
        self.first_poll_done = threading.Event()
        self.heartbeats: dict[str, float] = {}
        self._clock = clock
        self._deadline: float | None = None

    def stopping(self) -> bool:
        """True when waiting must end: the stop signal while running, the grace deadline while shutting down."""
        if self._deadline is not None:
            return self._clock() >= self._deadline
        return self.stop_event.is_set()

    def shutting_down(self, deadline: float) -> None:
        """From now on, waiting may go on until ``deadline`` (the final records still need the producer)."""
        self._deadline = deadline

    def beat(self, loop: str) -> None:
        self.heartbeats[loop] = self._clock()

    def stalled(self, max_silence: float) -> list[str]:
        """Loops whose last heartbeat is older than ``max_silence`` seconds."""
        now = self._clock()
        return sorted(name for name, t in self.heartbeats.items() if now - t > max_silence)
