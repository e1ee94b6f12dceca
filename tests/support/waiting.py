"""Waiting for a condition in tests that drive real processes (a broker, an exporter, Prometheus)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(what: Callable[[], Any], timeout: float, describe: Callable[[], str], interval: float = 0.2) -> Any:
    """Poll ``what`` until it returns something truthy, failing with ``describe()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, describe()
        time.sleep(interval)
