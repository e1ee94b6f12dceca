"""The probes: what ``/healthz`` and ``/readyz`` answer, and the route table the listener serves.

Kubernetes restarts a container whose liveness probe fails and stops sending it traffic while
its readiness probe fails: liveness is "the loops still turn", readiness is "records can go out
and be counted" (first poll done, caches synced, the broker reached, nothing held back).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flow_exporter.lifecycle import Lifecycle
from flow_exporter.metrics import Metrics


def routes(
    metrics: Metrics, alive: Callable[[], tuple[bool, str]], ready: Callable[[], tuple[bool, str]]
) -> dict[str, Callable[[], tuple[int, bytes, str]]]:
    """What the listener (flow_exporter.listener) serves: /metrics, /healthz (the loops are alive), /readyz."""
    registry = metrics.registry

    def probe(check: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[int, bytes, str]]:
        def answer() -> tuple[int, bytes, str]:
            ok, why = check()
            return (200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")

        return answer

    return {
        "/metrics": lambda: (200, generate_latest(registry), CONTENT_TYPE_LATEST),
        "/healthz": probe(alive),
        "/readyz": probe(ready),
    }


def liveness(lifecycle: Lifecycle, max_silence: float) -> Callable[[], tuple[bool, str]]:
    """Alive while both loops have ticked within ``max_silence`` seconds."""

    def check() -> tuple[bool, str]:
        stale = lifecycle.stalled(max_silence)
        return (False, "stalled: " + ", ".join(stale)) if stale else (True, "ok")

    return check


def readiness(
    lifecycle: Lifecycle,
    kafka_reached: Callable[[], bool],
    caches_ready: Callable[[], bool] | None = None,
    kafka_failed: Callable[[], str | None] = lambda: None,
    kafka_stalled: Callable[[], str | None] | None = None,
    held_back: Callable[[], bool] = lambda: False,
) -> Callable[[], tuple[bool, str]]:
    """Ready once the first poll is done, the caches synced and the producer reached the broker;
    never again after a fatal producer error (the process is about to exit); not while
    ``kafka_stalled`` gives a reason (records waiting for kafka.readyTimeout with no delivery,
    e.g. a topic ACL removed after start: the exporter runs on, but its records reach no one);
    not while ``held_back`` (a read-only state.dir with an old state in it)."""

    def check() -> tuple[bool, str]:
        failed = kafka_failed()
        if failed is not None:
            return (False, "kafka producer failed: " + failed)
        if held_back():  # Exporter.held_back: nothing goes out until a snapshot succeeds
            return (False, "records held back: state.dir cannot be written and holds an old state it cannot delete")
        missing = []
        if not lifecycle.first_poll_done.is_set():
            missing.append("first poll")
        if caches_ready is not None and not caches_ready():
            missing.append("kubernetes caches")
        if not kafka_reached():
            missing.append("kafka")
        if missing:
            return (False, "waiting for: " + ", ".join(missing))
        stalled = kafka_stalled() if kafka_stalled is not None else None
        return (False, stalled) if stalled is not None else (True, "ok")

    return check
