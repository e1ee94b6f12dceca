"""Kafka sink: produce serialized records and report each delivery back.

Delivery reports are queued, not applied, inside librdkafka's callback: the app
applies them to the store under its lock, so the producer never re-enters the
store from whatever thread happened to call ``poll()``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tenacity
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from flow_exporter.compiled import load
from flow_exporter.delivery import DeliveryHealth, TopicHealth
from flow_exporter.flow import Export
from flow_exporter.ports import BrokerStats, ClientStats, DeliveryReport, Reports, SinkCounters, Unsent
from flow_exporter.retry import StopWhen
from flow_exporter.settings import DEFAULT_SETTINGS, ConfigError, Route, Settings, shown
from flow_exporter.sink.encoder import Encode, prepare_with

_deliveries = load("deliveries")  # the delivery callbacks and the produce loop, written once (compiled where built)

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger(__name__ + ".rdkafka")

# Defaults chosen for an idempotent, batched, compressed stream; any of them can
# be overridden in the config's kafka.producer map.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 50,
    "compression.type": "lz4",
    "batch.size": 1_000_000,
    "queue.buffering.max.messages": 500_000,
    "message.timeout.ms": 120_000,
    "socket.keepalive.enable": True,
    # Pace reconnects after a refused login or TLS handshake: librdkafka's 100 ms default lets a
    # client with a bad certificate reconnect ~20 times a second. With librdkafka >= 2.10 a client
    # whose only brokers are failing re-bootstraps and retries every reconnect.backoff.ms / 2
    # (at most 1 s), so the cap mostly applies once some broker has been reached.
    "reconnect.backoff.ms": 500,
    "reconnect.backoff.max.ms": 10_000,
    # The client's own statistics (queue depth, broker round-trip times and errors) every 15 s,
    # for metrics; parsed on the expire thread in poll(), a few hundred microseconds each time.
    "statistics.interval.ms": 15_000,
}
_RECONNECT_KEYS = ("reconnect.backoff.ms", "reconnect.backoff.max.ms")


def client_stats(doc: dict[str, Any]) -> ClientStats:
    """The parts of a librdkafka statistics document (STATISTICS.md) the metrics show."""
    brokers = []
    for b in doc.get("brokers", {}).values():
        if b.get("nodeid", -1) < 0:
            continue  # bootstrap and coordinator placeholders: the same brokers again
        brokers.append(
            BrokerStats(
                name=str(b.get("nodename") or b.get("name")),
                rtt_seconds=b.get("rtt", {}).get("avg", 0) / 1e6,
                requests=int(b.get("tx", 0)),
                request_errors=int(b.get("txerrs", 0)),
                retries=int(b.get("txretries", 0)),
                timeouts=int(b.get("req_timeouts", 0)),
                disconnects=int(b.get("disconnects", 0)),
            )
        )
    return ClientStats(int(doc["msg_cnt"]), int(doc["msg_size"]), tuple(sorted(brokers, key=lambda b: b.name)))


def _is_true(value: object) -> bool:
    return str(value).strip().lower() in ("true", "1")


# kafka.producer settings that void the accounting contract (README, "Counting: the contract"):
# a record acknowledged before every in-sync replica has it can be lost after it was counted;
# without idempotence a retry can duplicate or reorder a record; without success reports a
# delivered record is never settled. Refused unless kafka.allowUnsafeProducer says otherwise.
UNSAFE_PRODUCER: dict[str, tuple[Callable[[object], bool], str]] = {
    "acks": (lambda v: str(v).strip().lower() not in ("all", "-1"), "acknowledged before every in-sync replica has it"),
    "request.required.acks": (lambda v: str(v).strip().lower() not in ("all", "-1"), "the same as acks"),
    "enable.idempotence": (lambda v: not _is_true(v), "retries may duplicate or reorder records"),
    "delivery.report.only.error": (_is_true, "delivered records would never be settled"),
}
# librdkafka names some settings by their alias in its errors.
_ALIASES = {
    "queue.buffering.max.ms": "linger.ms",
    "compression.codec": "compression.type",
    "batch.num.messages": "batch.num.messages",
    "queue.buffering.max.messages": "queue.buffering.max.messages",
    "request.required.acks": "acks",
}


def check_config(settings: Settings) -> None:
    """The entry points' loading check (``config.load(checks=...)``): ``kafka.producer`` as librdkafka judges it."""
    check_producer_settings(settings.kafka.producer, allow_unsafe=settings.kafka.allow_unsafe_producer)


def check_producer_settings(settings: Mapping[str, Any], *, allow_unsafe: bool) -> None:
    """Validate ``kafka.producer`` at startup, naming the setting (a ConfigError, exit code 2).

    librdkafka is the only complete judge of its settings (names, types, ranges, combinations),
    so a throwaway producer is built from them, with no bootstrap servers so nothing connects.
    Settings that would void the accounting are refused first, unless ``allow_unsafe``.
    """
    for name, value in settings.items():
        rule = UNSAFE_PRODUCER.get(name)
        if rule is not None and rule[0](value) and not allow_unsafe:
            raise ConfigError(
                f"kafka.producer.{name}",
                value,
                f"voids the delivery accounting ({rule[1]}); set kafka.allowUnsafeProducer: true to accept that",
            )
    conf = {k: v for k, v in {**PRODUCER_DEFAULTS, **settings}.items() if k != "bootstrap.servers"}
    try:
        Producer({**conf, "log_level": 0})
    except KafkaException as exc:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        text = (err.str() if err is not None else str(exc)).strip()
        named = [k for k in settings if f'"{k}"' in text or f"`{k}`" in text]
        named += [_ALIASES[a] for a in _ALIASES if f'"{a}"' in text and _ALIASES[a] in settings]
        key = f"kafka.producer.{named[0]}" if named else "kafka.producer"
        raise ConfigError(key, settings.get(named[0]) if named else settings, f"librdkafka: {text}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError("kafka.producer", settings, f"librdkafka: {exc}") from None


ERROR_LOG_INTERVAL = 10.0  # seconds between two log lines for the same kind of client error
# Errors no retry fixes without the operator: logged as errors with what to check.
_SECURITY_HINTS = {
    "auth": "authentication failed; check kafka.sasl.mechanism, username and password",
    "tls": "TLS failed; check kafka.tls.caFile, certFile, keyFile and verifyHostname",
}


def _security_failure(err: KafkaError) -> str | None:
    """Which setting group a refused login ("auth") or handshake ("tls") points at, else None.

    librdkafka reports some handshake failures as transport errors, so OpenSSL's wording counts too.
    """
    if err.code() == KafkaError._AUTHENTICATION:
        return "auth"
    if err.code() == KafkaError._SSL or "SSL routines" in err.str():
        return "tls"
    return None


class SinkError(RuntimeError):
    """A problem with the sink that the operator must see (missing topic, fatal producer error)."""


# Delivery errors no resend can fix: the record is given up (counted) instead of resent forever.
PERMANENT_ERRORS = frozenset(
    {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD}
)


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a client config that is safe to log (settings.shown: the one masking rule)."""
    return {k: shown(k, v) for k, v in config.items()}


class _LibrdkafkaLog:
    """librdkafka's own log lines, into Python logging (one format, JSON too) instead of raw stderr.

    Connection failures (facility FAIL) repeat at every reconnect and also reach ``error_cb``,
    which logs them rate-limited; here they go to DEBUG, or a refused login would log twice a second.
    """

    def __init__(self, target: Any) -> None:
        self.target = target  # a logging.Logger, or anything with its log(level, fmt, *args)

    def log(self, level: int, fmt: str, *args: Any) -> None:
        self.target.log(logging.DEBUG if args and args[0] == "FAIL" else level, fmt, *args)


# What librdkafka refuses to queue (a full queue, a refusal): produce() then waits, or reports it.
_REFUSED = (BufferError, KafkaException)
# confluent-kafka's on_delivery: (error or None, message).
OnDelivery = Callable[[KafkaError | None, Any], None]


class KafkaSink:
    """Produces records to Kafka topics; one producer for all of them (the :class:`~flow_exporter.ports.Sink`).

    ``stopping`` says when a produce blocked on a full local queue must give up (the
    composition root passes :meth:`Lifecycle.stopping`); ``on_wait`` is called while it waits,
    so the expire loop's heartbeat goes on. ``health`` (a :class:`~flow_exporter.delivery.DeliveryHealth`
    on ``clock``) counts failures by error code, warns about them rate-limited and tells the
    readiness check whether records still get delivered.
    """

    def __init__(
        self,
        producer_config: dict[str, Any],
        topic: str,
        encode: Encode,
        routes: Sequence[Route] = (),
        retry_initial: float = DEFAULT_SETTINGS.retry.initial_backoff,
        retry_max: float = DEFAULT_SETTINGS.retry.max_backoff,
        stopping: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self.routes = tuple(routes)
        self.encode = encode
        self.config = {**PRODUCER_DEFAULTS, **producer_config}
        self.config.setdefault("error_cb", self._on_error)
        self.config.setdefault("stats_cb", self._on_stats)
        self.config["logger"] = _LibrdkafkaLog(self.config.get("logger") or _rdkafka_log)
        self._producer = Producer(self.config)
        self.counters = SinkCounters()
        self.health = DeliveryHealth(self.topics(), clock, self.counters.failures_by_error)
        # The delivery callbacks (flow_exporter/deliveries.py, compiled where built): the answers collected
        # (take_reports), the accounting per run of records to one topic, settled after every poll and flush
        # (_settle).
        #
        # ``_callback(export, topic, st)`` makes one record's delivery callback. Not a closure over six names
        # made per record: bench/bench_app_export.py measured the closure as a large part of a produce, and a
        # partial (tracked by the garbage collector) as costlier than a plain function; the compiled one is neither
        # tracked nor a Python frame when it runs (measured:
        # docs/performance.md#the-compiled-record-path-issue-24-before-and-after).
        self._deliveries = _deliveries.Deliveries(self._on_failed, self._on_run, Reports)
        self._callback: Callable[[Export, str, TopicHealth], OnDelivery] = self._deliveries.for_record
        self._produce_run = _deliveries.produce_run
        self._last_error_log: dict[str | None, float] = {}  # by _security_failure(); None: other errors
        self._on_wait = on_wait
        self._retry = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(BufferError),
            wait=tenacity.wait_exponential_jitter(multiplier=retry_initial, max=retry_max),
            stop=StopWhen(stopping),
            sleep=self._serve_while_waiting,
            reraise=True,
        )

    # ---------------------------------------------------------------- topics
    def topics(self) -> set[str]:
        return {self.topic, *(r.topic for r in self.routes)}

    def unusable_topics(self, timeout: float = 10.0) -> dict[str, str]:
        """Topics this sink writes to that it cannot use, with why (raises if the cluster is unreachable).

        ``missing`` when the cluster does not have the topic; otherwise the broker's own error for it, so
        that an ACL refusing this client's principal (``Broker: Topic authorization failed``) is named as
        such instead of passing for a missing topic.
        """
        admin = AdminClient({k: v for k, v in self.config.items() if _is_admin_key(k)})
        try:
            md = admin.list_topics(timeout=timeout)
        finally:
            admin.poll(0)  # serve error_cb: a refused login says so, not just "transport failure"
        self.counters.connected = True
        out: dict[str, str] = {}
        for topic in self.topics():
            meta = md.topics.get(topic)
            error = None if meta is None else meta.error
            if meta is None or (error is not None and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                out[topic] = "missing"
            elif error is not None:
                out[topic] = error.str()
        return out

    # --------------------------------------------------------------- produce
    def route(self, export: Export) -> str:
        if self.routes:
            meta = export.meta
            flow_type = meta.get("flowType", 0) if meta else 0
            for r in self.routes:
                if r.matches(flow_type, export.reason):
                    return r.topic
        return self.topic

    def prepare_all(self, exports: list[Export], export_ms: int) -> list[tuple[Export, Exception]]:
        """Encode records once: bytes, topic and key are kept on each, so a resend is the same message.

        Routed first: with a registry, the topic picks the schema id. Returns the records that
        could not be encoded, with why.
        """
        topic: str | None = self.topic
        if self.routes:
            route = self.route
            for e in exports:
                if e.value is None:
                    e.topic = route(e)
            topic = None
        return prepare_with(self.encode, exports, export_ms, topic)

    def send(self, export: Export, export_ms: int) -> None:
        """Encode (first time only) and produce one record."""
        for _, exc in self.prepare_all([export], export_ms):
            raise exc
        self.produce(export)

    def produce(self, export: Export) -> None:
        """Hand a prepared record to librdkafka, waiting (with backoff) while its queue is full."""
        value = export.value
        topic = export.topic
        key = export.key
        assert value is not None and topic is not None, "produce() before prepare()"
        failed = self._deliveries.failed
        counters = self.counters
        health = self.health
        st = health.topic(topic)
        on_delivery = self._callback(export, topic, st)
        produce = self._producer.produce
        try:
            try:
                produce(topic, value, key, on_delivery=on_delivery)
            except BufferError:
                self._retry(produce, topic, value, key, on_delivery=on_delivery)
        except BufferError:
            # Only when stopping: the record never entered the queue.
            failed.append(DeliveryReport(export, False, "local queue full during shutdown"))
            counters.failed += 1
            health.failed(topic, st, "_QUEUE_FULL", "local queue full during shutdown", pending=False, permanent=False)
            return
        except KafkaException as exc:
            # E.g. TOPIC_AUTHORIZATION_FAILED once librdkafka's metadata says so: refused before queueing.
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            permanent = err is not None and err.code() in PERMANENT_ERRORS
            failed.append(DeliveryReport(export, False, str(exc), permanent))
            counters.failed += 1
            code, reason = (err.name(), err.str()) if err is not None else ("UNKNOWN", str(exc))
            health.failed(topic, st, code, reason, pending=False, permanent=permanent)
            return
        self._produced(st, 1, len(value))

    def produce_all(self, exports: list[Export]) -> None:
        """:meth:`produce` each record, in order, with the per-record work hoisted out of the loop.

        The common case (librdkafka takes the record) is done here, its accounting added up once
        per run of records to one topic; anything else (a full queue, a refusal, a record not
        prepared, a topic the sink was not built with) goes through :meth:`produce`, after the
        accounting so far is added (produce may serve delivery callbacks while it waits). An error
        produce does not handle stops the batch with :class:`Unsent`, naming the first record not
        handed over.
        """
        produce = self._producer.produce
        topics = self.health.topics
        callback = self._callback
        produce_run = self._produce_run
        i, n = 0, len(exports)
        while i < n:
            stop, count, size, st, error, slow = produce_run(exports, i, produce, callback, topics, _REFUSED)
            if count and st is not None:
                self._produced(st, count, size)
            if error is not None:
                if isinstance(error, Exception):
                    raise Unsent(stop) from error
                raise error
            if slow:
                try:
                    self.produce(exports[stop])
                except Exception as exc:
                    raise Unsent(stop) from exc
                stop += 1
            i = stop

    def _produced(self, st: TopicHealth, count: int, size: int) -> None:
        """``count`` records of ``size`` bytes in all handed to librdkafka for one topic: the accounting."""
        counters = self.counters
        counters.produced += count
        counters.bytes_produced += size
        self.health.produced(st, count)

    def _on_run(self, topic: str, st: TopicHealth, count: int) -> None:
        """``count`` records delivered in a row to ``topic``: the sink's and the topic's accounting."""
        counters = self.counters
        counters.acked += count
        counters.connected = True
        self.health.delivered(topic, st, count)

    def _on_failed(self, export: Export, topic: str, st: TopicHealth, err: KafkaError, msg: Any) -> None:
        self.counters.failed += 1
        permanent = err.code() in PERMANENT_ERRORS
        self.health.failed(topic, st, err.name(), err.str(), pending=True, permanent=permanent)
        self._deliveries.failed.append(DeliveryReport(export, False, err.str(), permanent))

    def _settle(self) -> None:
        """The delivery callbacks' accounting of delivered records, added before anyone reads it."""
        self._deliveries.settle()

    def take_reports(self) -> Reports:
        """The delivery reports collected by ``poll``/``flush`` since the last call (one thread serves the
        producer and takes them: nothing lands in between)."""
        reports: Reports = self._deliveries.take()
        return reports

    def in_flight(self) -> int:
        """Records handed to librdkafka and not yet reported."""
        return len(self._producer)

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks (the only place they run)."""
        try:
            return self._producer.poll(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return 0
        finally:
            self._settle()

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for everything in flight; returns how many are still undelivered."""
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return len(self._producer)
        finally:
            self._settle()

    def _raised(self, exc: KafkaException) -> None:
        """A fatal error that poll/flush raised instead of handing it to ``error_cb``: the same ending.

        Seen on a real cluster (a producer id refused: CLUSTER_AUTHORIZATION_FAILED): librdkafka's
        fatal error came out of ``poll()`` as an exception and never reached ``error_cb``, so the
        expire loop logged a traceback and went on forever with a producer that can never deliver.
        Anything else is re-raised (the loop's own retry handles it).
        """
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is None or not err.fatal():
            raise exc
        self._fatal(err)

    def _fatal(self, err: KafkaError) -> None:
        # E.g. an idempotence epoch error, or a producer id refused: every later record would fail.
        # The expire loop sees this, the exporter turns not ready, flushes, keeps its state and exits.
        if self.counters.fatal is None:
            log.error("kafka producer fatal error: %s", err.str())
            self.counters.fatal = err.str()

    def purge(self) -> None:
        """Drop everything still queued (shutdown after the grace period)."""
        self._producer.purge(in_queue=True, in_flight=True, blocking=False)
        self.poll(0)

    def close(self) -> None:
        self.flush(0)

    # -------------------------------------------------------------- internals
    def _serve_while_waiting(self, seconds: float) -> None:
        self._on_wait()
        self.poll(seconds)

    def _on_stats(self, text: str) -> None:
        try:
            self.counters.client = client_stats(json.loads(text))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.debug("kafka statistics not understood: %s", exc)

    def _on_error(self, err: KafkaError) -> None:
        # librdkafka's error strings name the broker and the reason, never the configured secrets.
        if err.fatal():
            self._fatal(err)
            return
        kind = _security_failure(err)  # its own rate limit: not drowned out by "brokers are down"
        now = time.monotonic()
        if now - self._last_error_log.get(kind, -ERROR_LOG_INTERVAL) < ERROR_LOG_INTERVAL:
            return  # broker-down and login errors repeat at every reconnect
        self._last_error_log[kind] = now
        if kind:
            log.error("kafka %s: %s", _SECURITY_HINTS[kind], err.str())
        else:
            log.warning("kafka: %s", err.str())


def _is_admin_key(key: str) -> bool:
    # The admin client needs only connection and security settings.
    if key in _RECONNECT_KEYS:
        return True
    return key not in PRODUCER_DEFAULTS and key not in ("delivery.timeout.ms", "batch.num.messages")
