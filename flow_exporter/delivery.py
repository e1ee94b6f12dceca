"""Delivery health: failures by Kafka error code, rate-limited warnings, and whether deliveries still succeed.

A failed delivery that is not permanent (a topic ACL removed after start, a broker that times
out) is not lost: the store sends the same record again, forever. That is right for the counts,
but it used to be silent (one debug line per record) and ``/readyz`` stayed 200 while nothing
reached Kafka. This module makes it visible, without flooding the log:

- every failure is counted by its error code (``KafkaError.name()``, e.g. ``TOPIC_AUTHORIZATION_FAILED``),
  for ``flow_exporter_delivery_failures_total{error}``;
- a WARNING names the code, the topic(s) and how many records failed with that code since the
  previous warning, at most once per :data:`WARN_INTERVAL` per code (a dead topic fails every
  record, a thousand a second);
- per topic, the time since records started waiting with no successful delivery: the readiness
  rule (``kafka.readyTimeout``) reads it. An exporter with nothing to send has nothing waiting,
  so it stays ready however long ago its last delivery was.

Pure (no Kafka import: codes arrive as names) and driven by an injected clock, so the unit
tests run the rate limit and the readiness rule with a fake one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WARN_INTERVAL = 60.0  # seconds between two warnings for the same error code
# Failures the exporter caused itself at shutdown (records purged, or never queued, after the
# grace period): counted, but the shutdown summary already says what was not delivered.
QUIET_CODES = frozenset({"_PURGE_QUEUE", "_PURGE_INFLIGHT", "_QUEUE_FULL"})


def duration_text(seconds: float) -> str:
    """``42s``, ``2m05s``, ``1h03m``: short enough for a probe answer and a log line."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass(slots=True)
class TopicHealth:
    """One topic's deliveries. ``since`` is when records began waiting with no success after it, else None."""

    pending: int = 0  # records handed to the producer and not yet reported
    since: float | None = None
    last_error: str | None = None  # code of the last failure since the last success
    warned: bool = False  # a warning named this topic since its last success (then recovery is logged)


@dataclass(slots=True)
class _CodeWarnings:
    """The rate limit of one error code: failures since its last warning, and on which topics."""

    last: float = float("-inf")
    count: int = 0
    topics: set[str] = field(default_factory=set)


class DeliveryHealth:
    """Per-topic delivery progress and per-code failure counts (kept by the sink, on the producer's thread).

    ``failures`` is updated in place (the sink hands in its counters' dict, which the metrics read).
    The readiness check runs on the listener's thread: it only reads, and the topic table is
    built up front, so it never sees a dictionary change size.
    """

    def __init__(
        self,
        topics: Iterable[str],
        clock: Callable[[], float] = time.monotonic,
        failures: dict[str, int] | None = None,
        warn_interval: float = WARN_INTERVAL,
    ) -> None:
        self.clock = clock
        self.failures: dict[str, int] = {} if failures is None else failures
        self.warn_interval = warn_interval
        self.topics: dict[str, TopicHealth] = {t: TopicHealth() for t in topics}
        self._warnings: dict[str, _CodeWarnings] = {}

    def topic(self, name: str) -> TopicHealth:
        """The state of ``name`` (the sink looks it up once per record and keeps it for the report)."""
        st = self.topics.get(name)
        if st is None:  # a topic the sink was not built with: not expected, but never a KeyError
            st = self.topics[name] = TopicHealth()
        return st

    # ------------------------------------------------------------ the sink's side
    def produced(self, st: TopicHealth, count: int = 1) -> None:
        """Records went to the producer: they wait from now, unless older ones already wait."""
        st.pending += count
        if st.since is None:
            st.since = self.clock()

    def delivered(self, name: str, st: TopicHealth, count: int = 1) -> None:
        """Kafka took ``count`` records in a row: the topic works. What is still pending waits from now on."""
        st.pending -= count
        if st.warned:
            log.info(
                "kafka delivery to topic %s succeeds again (after %s, %s without a successful delivery)",
                name,
                st.last_error,
                duration_text(self.clock() - st.since) if st.since is not None else "0s",
            )
            st.warned = False
        st.last_error = None
        st.since = self.clock() if st.pending > 0 else None

    def failed(self, name: str, st: TopicHealth, code: str, reason: str, *, pending: bool, permanent: bool) -> None:
        """A record was not delivered (``pending``: it had been handed to the producer).

        Not permanent: the store sends it again, so the topic keeps waiting since its first
        unanswered record; permanent: the record is given up (logged by the loops as an error),
        which settles it as a success would, or a topic that refuses one oversized record
        would be not ready until the next delivery.
        """
        if pending:
            st.pending -= 1
        self.failures[code] = self.failures.get(code, 0) + 1
        if permanent:
            if st.last_error is None:  # nothing else on the topic is failing: settled as a success would be
                st.since = self.clock() if st.pending > 0 else None
            return
        st.last_error = code
        if st.since is None:  # refused before it was queued (e.g. by librdkafka's metadata): waits from now
            st.since = self.clock()
        if code in QUIET_CODES:
            return
        w = self._warnings.get(code)
        if w is None:
            w = self._warnings[code] = _CodeWarnings()
        w.count += 1
        w.topics.add(name)
        now = self.clock()
        if now - w.last < self.warn_interval:
            return
        log.warning(
            "kafka delivery failing with %s (%s) on topic %s: %d record(s) failed with it since %s; they are "
            "kept and sent again (flow_exporter_delivery_failures_total; this warning at most once every %gs "
            "per error code)",
            code,
            reason,
            ", ".join(sorted(w.topics)),
            w.count,
            "the last such warning" if w.last > float("-inf") else "start",
            self.warn_interval,
        )
        for t in w.topics:
            self.topic(t).warned = True
        w.last, w.count = now, 0
        w.topics.clear()

    # ------------------------------------------------------------ readiness
    def stalled(self, timeout: float) -> str | None:
        """Why the exporter is not ready: a topic whose records have waited ``timeout`` seconds with
        no successful delivery (None when every topic delivers, or has nothing to deliver; always
        None with ``timeout`` 0, which turns the rule off)."""
        if timeout <= 0:
            return None
        now = self.clock()
        for name, st in list(self.topics.items()):
            since = st.since
            if since is not None and now - since >= timeout:
                why = f"last error: {st.last_error}" if st.last_error else "no delivery report yet"
                return (
                    f"kafka: no record delivered to topic {name} for {duration_text(now - since)} "
                    f"(kafka.readyTimeout {duration_text(timeout)}; {why})"
                )
        return None
