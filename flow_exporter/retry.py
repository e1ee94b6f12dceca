"""Retry plumbing the loops and edges share: stop when asked, and sleep so that a stop wakes the sleeper.

tenacity takes a stop condition and a sleep function. Waiting on an Event instead of ``time.sleep``
lets a shutdown end a backoff at once; the adapters here give those two the types tenacity declares
(a ``stop`` that reads any ``stopping()`` callable, a ``sleep`` that returns nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tenacity

__all__ = ["StopWhen", "sleep_on"]


class StopWhen(tenacity.stop.stop_base):
    """A tenacity ``stop``: give up (re-raise) once ``stopping()`` is true; combines with ``|`` like tenacity's own."""

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self._stopping = stopping

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._stopping()


def sleep_on(event: threading.Event) -> Callable[[float], None]:
    """A tenacity ``sleep`` that returns early when ``event`` is set."""

    def sleep(seconds: float) -> None:
        event.wait(seconds)

    return sleep
