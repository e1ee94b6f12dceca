"""Confluent Schema Registry framing around the hand-written encoder.

Why a wrapper rather than confluent-kafka's ``AvroSerializer``: the serializer wants a
record dict and runs fastavro per record, which is the cost ``flow_exporter.sink.encoder``
exists to avoid. The Confluent wire format is only a fixed 5-byte header (magic byte 0,
then the schema id as a 4-byte big-endian integer) in front of the same bare Avro body,
so the schema is registered once at start and every value is ``header + body``.
tests/unit/test_registry.py proves the bytes equal the serializer's for the same record.

Start-up registration is retried with backoff (tenacity) and every failure is logged
naming the registry and the subject: an unreachable registry or an incompatible schema
(HTTP 409) is something an operator fixes, so the exporter waits for it instead of
exiting into a crash loop, and it never falls back to bare Avro on its own, because
consumers of a registry-framed topic would then misread every value.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import tenacity

from flow_exporter.flow import Export
from flow_exporter.record import schema_path
from flow_exporter.retry import StopWhen, sleep_on
from flow_exporter.settings import DEFAULT_SETTINGS, shown
from flow_exporter.sink.encoder import Encode, Failures, prepare_each, prepare_with

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    from flow_exporter.settings import Settings

log = logging.getLogger(__name__)

MAGIC = 0
HEADER_SIZE = 5
# The schema's full name: the subject Confluent's RecordNameStrategy gives it (one subject for
# every topic). The default strategy is TopicNameStrategy: ``<topic>-value`` per topic.
RECORD_SUBJECT = "io.flowexporter.FlowRecord"
# New consumers' schema must read every older record still on the topic, not only the last version's.
DEFAULT_COMPATIBILITY: str | None = DEFAULT_SETTINGS.schema_registry.compatibility


class RegistryError(RuntimeError):
    """The schema could not be registered; the message names the registry and the subject."""


def header(schema_id: int) -> bytes:
    """The Confluent wire-format prefix for ``schema_id``."""
    if not 0 <= schema_id <= 0xFFFFFFFF:
        raise ValueError(f"schema id {schema_id} does not fit 4 bytes")
    return bytes((MAGIC,)) + schema_id.to_bytes(4, "big")


def split_header(value: bytes) -> tuple[int, bytes]:
    """``(schema_id, avro_body)`` of a Confluent-framed value; ValueError if it is not one."""
    if len(value) < HEADER_SIZE or value[0] != MAGIC:
        raise ValueError("not Confluent-framed (no magic byte 0 and 4-byte schema id)")
    return int.from_bytes(value[1:HEADER_SIZE], "big"), value[HEADER_SIZE:]


class Framed:
    """``encode`` with the 5-byte header in front of every value; a batch is framed in the encoder's own pass."""

    def __init__(self, encode: Encode, schema_id: int) -> None:
        self.schema_id = schema_id
        self.prefix = header(schema_id)
        self._encode = encode

    def __call__(self, export: Export, export_ms: int) -> bytes:
        return self.prefix + self._encode(export, export_ms)

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures:
        return prepare_with(self._encode, exports, export_ms, topic, framing + self.prefix)


def framed(encode: Encode, schema_id: int) -> Framed:
    """``encode`` with the 5-byte header in front of every value."""
    return Framed(encode, schema_id)


def subjects(settings: Settings, topics: Iterable[str]) -> dict[str, str]:
    """The registry subject of each topic the exporter writes to.

    ``schemaRegistry.subject``, when set, names one subject for all of them; otherwise
    ``schemaRegistry.subjectNameStrategy`` decides: ``topic`` (the default, Confluent's
    TopicNameStrategy, what Kafka Connect, ksqlDB and Flink assume) gives ``<topic>-value``,
    ``record`` (RecordNameStrategy) gives the schema's full name for every topic.
    """
    fixed = settings.schema_registry.subject
    if fixed is None and settings.schema_registry.subject_name_strategy == "record":
        fixed = RECORD_SUBJECT
    return {t: fixed or f"{t}-value" for t in sorted(set(topics))}


def safe_url(url: str) -> str:
    """The registry URL(s) without any ``user:password@`` part, for logs and errors (settings.shown)."""
    return str(shown("schemaRegistry.url", url))


def make_client(url: str, basic_auth_user_info: str | None = None) -> SchemaRegistryClient:
    """A registry client; ``mock://...`` gives confluent-kafka's in-memory registry (tests)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    conf: dict[str, Any] = {"url": url}
    if basic_auth_user_info:
        conf["basic.auth.user.info"] = basic_auth_user_info
    # One attempt per call: the backoff between attempts is ours, so every failure is logged.
    conf["max.retries"] = 0
    return SchemaRegistryClient.new_client(conf)


def describe_failure(exc: BaseException) -> str:
    """What went wrong, in the operator's terms."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    if isinstance(exc, SchemaRegistryError):
        status = exc.http_status_code
        if status == 409:
            return f"schema incompatible with the subject's existing versions (HTTP 409: {exc.error_message})"
        if status == 422:
            return f"registry rejected the schema or the compatibility level (HTTP 422: {exc.error_message})"
        if status in (401, 403):
            return f"not authorised (HTTP {status}: {exc.error_message}); check schemaRegistry.basicAuthUserInfo"
        return f"HTTP {status}: {exc.error_message}"
    return f"registry not reachable ({type(exc).__name__}: {exc})"


def register(
    client: SchemaRegistryClient,
    subject: str,
    schema_str: str,
    compatibility: str | None = DEFAULT_COMPATIBILITY,
    *,
    initial: float = DEFAULT_SETTINGS.retry.initial_backoff,
    maximum: float = DEFAULT_SETTINGS.retry.max_backoff,
    max_attempts: int | None = None,
    stopping: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
    url: str = "",
) -> int:
    """Set the subject's compatibility level, register the schema under it, return its id.

    The level is set first so the registration itself is checked against it. A registry that
    refuses config changes (HTTP 401/403/404/405, e.g. a managed one) leaves the level as the
    registry has it; that is logged and registration goes on. Everything else is retried with
    exponential backoff until it works, ``max_attempts`` is reached or ``stopping()``; then
    :class:`RegistryError` is raised.
    """
    from confluent_kafka.schema_registry import ConfigCompatibilityLevel, Schema, ServerConfig
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    where = f"schema registry {safe_url(url)}: subject {subject!r}" if url else f"schema registry subject {subject!r}"
    # Stripped as confluent-kafka's own serializer does, so a lookup by its schema finds ours.
    schema = Schema(schema_str.strip(), "AVRO")

    def attempt() -> int:
        if compatibility:
            try:
                client.set_config(subject, ServerConfig(compatibility=ConfigCompatibilityLevel(compatibility)))
            except SchemaRegistryError as exc:
                if exc.http_status_code not in (401, 403, 404, 405):
                    raise
                log.warning(
                    "%s: cannot set compatibility %s (%s); keeping the registry's level",
                    where,
                    compatibility,
                    describe_failure(exc),
                )
        return client.register_schema(subject, schema)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.error(
            "%s: cannot register the schema: %s; retry %d in %.1fs (records wait, none are sent unframed)",
            where,
            describe_failure(exc) if exc else "?",
            state.attempt_number,
            wait,
        )

    stop: tenacity.stop.stop_base = StopWhen(stopping)
    if max_attempts is not None:
        stop = stop | tenacity.stop_after_attempt(max_attempts)
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(Exception),
        wait=tenacity.wait_exponential_jitter(multiplier=initial, max=maximum, jitter=initial),
        stop=stop,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        schema_id = retrying(attempt)
    except Exception as exc:
        raise RegistryError(f"{where}: cannot register the schema: {describe_failure(exc)}") from exc
    log.info("%s: schema registered, id %d, compatibility %s", where, schema_id, compatibility or "(registry's)")
    return schema_id


def with_registry(
    settings: Settings, encode: Encode, topics: Iterable[str] = (), client: SchemaRegistryClient | None = None
) -> Encode:
    """``encode`` as a :class:`RegistryFraming` when ``schemaRegistry.url`` is set, else unchanged.

    ``topics`` are the topics the sink writes to (``kafka.topic`` when empty). Nothing is
    registered yet: the runner calls :func:`ensure_registered` once the health listener is up,
    so a pod that waits for its registry stays alive (and not ready) instead of being
    restarted by its liveness probe.
    """
    if not settings.schema_registry.url:
        return encode
    return RegistryFraming(settings, encode, topics or (settings.kafka.topic,), client)


class RegistryFraming:
    """The sink's encode callable with a registry: registers the schema at start, then frames every value.

    The schema is registered under each topic's subject (:func:`subjects`). Confluent's
    registry gives one schema one id whatever the subject, and then every value gets the same
    header; a registry that numbers per subject gets each topic's own id, looked up from the
    record's topic (the sink routes before it encodes).
    """

    def __init__(
        self, settings: Settings, encode: Encode, topics: Iterable[str], client: SchemaRegistryClient | None = None
    ) -> None:
        registry = settings.schema_registry
        if registry.url is None:
            raise ValueError("RegistryFraming needs schemaRegistry.url (with_registry checks it)")
        self.url: str = registry.url
        self.subjects = subjects(settings, topics)
        self.compatibility: str | None = registry.compatibility
        self._auth: str | None = registry.basic_auth_user_info
        self._backoff = (settings.retry.initial_backoff, settings.retry.max_backoff)
        self._client = client
        self._encode = encode
        self._call: Encode = self._unregistered
        self.schema_ids: dict[str, int] = {}  # by topic

    @property
    def schema_id(self) -> int | None:
        """The id every value carries, or None before registration (or when topics' ids differ)."""
        ids = set(self.schema_ids.values())
        return ids.pop() if len(ids) == 1 and len(self.schema_ids) == len(self.subjects) else None

    def register(self, stop: threading.Event | None = None) -> bool:
        """Register under every subject (retrying with backoff), then frame; False if ``stop`` was set first."""
        stop = stop or threading.Event()
        if self._client is None:
            self._client = make_client(self.url, self._auth)
        text = schema_path().read_text()
        ids: dict[str, int] = {}
        for topic, subject in self.subjects.items():
            try:
                ids[topic] = register(
                    self._client,
                    subject,
                    text,
                    self.compatibility,
                    initial=self._backoff[0],
                    maximum=self._backoff[1],
                    stopping=stop.is_set,
                    sleep=sleep_on(stop),
                    url=self.url,
                )
            except RegistryError:
                if stop.is_set():
                    return False
                raise
        self.schema_ids = ids
        if len(set(ids.values())) == 1:
            self._call = framed(self._encode, next(iter(ids.values())))
        else:
            self._call = self._framed_by_topic({t: header(i) for t, i in ids.items()})
        return True

    def _framed_by_topic(self, headers: dict[str, bytes]) -> Encode:
        encode = self._encode

        def encode_framed(export: Export, export_ms: int) -> bytes:
            prefix = headers.get(export.topic or "")
            if prefix is None:
                raise RegistryError(f"topic {export.topic!r} has no registered schema id")
            return prefix + encode(export, export_ms)

        return encode_framed

    def __call__(self, export: Export, export_ms: int) -> bytes:
        return self._call(export, export_ms)

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures:
        """One header for every topic: the encoder's batch pass; per-topic headers or none yet: record by record."""
        call = self._call
        if isinstance(call, Framed):
            return call.prepare_all(exports, export_ms, topic, framing)
        return prepare_each(call, exports, export_ms, topic, framing)

    def _unregistered(self, export: Export, export_ms: int) -> bytes:
        names = ", ".join(repr(s) for s in sorted(set(self.subjects.values())))
        raise RegistryError(f"schema registry subject {names}: no schema id yet (register() first)")


def ensure_registered(encode: Encode, stop: threading.Event) -> bool:
    """Register the schema if ``encode`` frames for a registry; False if ``stop`` came first."""
    if isinstance(encode, RegistryFraming) and not encode.schema_ids:
        return encode.register(stop)
    return True
