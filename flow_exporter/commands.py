"""Tools for people: ``flow-exporter tail`` (read the topic) and ``flow-exporter schema``.

``tail`` exists so that checking what the exporter sends needs no Avro tooling: it reads
the same settings as ``run`` (file, ``FLOW_EXPORTER_*`` environment, flags), so inside
the exporter's pod it needs no arguments at all. It reads bare and Confluent-framed
values alike, and a value it cannot decode costs one warning line, never the session.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO, cast

from flow_exporter.config import ConfigError, add_flags, from_flags
from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_NAMES
from flow_exporter.flow import REASON_NAMES

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    from flow_exporter.settings import Settings

COMMANDS = ("tail", "schema")
_PORTLESS = (PROTO_ICMP, PROTO_ICMPV6)
# Client settings that belong to the connection (kept for tail's consumer); any other
# kafka.producer entry is a producer tuning that a consumer would only warn about.
_CONNECTION_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.")


# ------------------------------------------------------------------- parsers
def add_parsers(sub: Any) -> None:
    """Register ``tail`` and ``schema`` on the CLI's subparsers."""
    tail = sub.add_parser(
        "tail",
        help="print the flow records on the topic as a live table or JSON lines",
        description="Read flow records from Kafka (settings as for run: --config, FLOW_EXPORTER_*, flags).",
    )
    add_flags(tail, ("bootstrap-servers", "topic"), "YAML config file (Kafka and registry settings)")
    tail.add_argument("--from-beginning", action="store_true", help="start at the oldest record, not the newest")
    tail.add_argument("--json", action="store_true", help="JSON lines (ISO 8601 times, bytes as hex)")
    tail.add_argument("--namespace", metavar="NS", help="only flows whose source or destination pod is in NS")
    tail.add_argument("--pod", metavar="POD", help="only flows from or to pod POD (name or namespace/name)")
    tail.add_argument("--service", metavar="SVC", help="only flows to Service SVC (name, namespace/name or full)")
    tail.add_argument("--count", type=int, metavar="N", help="stop after N records")
    tail.add_argument(
        "--confluent",
        action="store_true",
        help="values must be Confluent-framed (magic byte 0 + schema id); default: detected per value",
    )

    schema = sub.add_parser("schema", help="print the FlowRecord Avro schema or its fingerprints")
    g = schema.add_mutually_exclusive_group()
    g.add_argument(
        "--fingerprint",
        action="store_true",
        help="CRC-64-AVRO (Rabin) and SHA-256 of the parsing canonical form",
    )
    g.add_argument("--canonical", action="store_true", help="the parsing canonical form")


def run(args: argparse.Namespace) -> int:
    """Dispatch a tool command; exit codes as for the CLI (0 done, 1 failure, 2 usage)."""
    if args.command == "schema":
        return schema_command(args, sys.stdout)
    # Ctrl-C ends the session between two polls. As a KeyboardInterrupt it could land inside one of
    # librdkafka's callbacks, where the client swallows it and the loop would go on.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    try:
        settings = _load(args)
    except ConfigError as exc:
        print(f"flow-exporter: {exc}", file=sys.stderr)
        return 2
    if args.count is not None and args.count < 1:
        print("flow-exporter tail: --count must be at least 1", file=sys.stderr)
        return 2
    return tail_command(args, settings, sys.stdout, sys.stderr, stop)


def _load(args: argparse.Namespace) -> Settings:
    from flow_exporter.sink.kafka import check_config

    return from_flags(args, checks=(check_config,))


# -------------------------------------------------------------------- schema
def fingerprints(schema: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Fingerprints of the schema's parsing canonical form, as hex.

    CRC-64-AVRO is given as its 8 bytes little-endian, as the Java library and Avro's
    single-object encoding write it.
    """
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    from flow_exporter.record import load_schema

    canonical = to_parsing_canonical_form(dict(schema or load_schema()))
    return {alg: fingerprint(canonical, alg) for alg in ("CRC-64-AVRO", "SHA-256")}


def schema_command(args: argparse.Namespace, out: TextIO) -> int:
    from fastavro.schema import to_parsing_canonical_form

    from flow_exporter.record import load_schema, schema_path

    if args.fingerprint:
        for alg, value in fingerprints().items():
            out.write(f"{alg} {value}\n")
    elif args.canonical:
        out.write(to_parsing_canonical_form(load_schema()) + "\n")
    else:
        out.write(schema_path().read_text())
    return 0


# ------------------------------------------------------------------ decoding
class MalformedValue(ValueError):
    """A Kafka value that is not a FlowRecord."""


class ValueDecoder:
    """Bare or Confluent-framed FlowRecord values to record dicts.

    A value starting with byte 0 is taken as framed: a bare FlowRecord starts with the
    connectionId varint, which is a 0 byte only for connection id 0, and for that case the
    bare reading is tried when the framed one fails. Framed values are read with the writer
    schema from the registry when one is configured (so records of an older or newer schema
    version resolve into this one), else with the local schema.
    """

    def __init__(self, require_framing: bool = False, registry: SchemaRegistryClient | None = None) -> None:
        import fastavro

        from flow_exporter.record import load_schema

        self.reader = fastavro.parse_schema(load_schema())
        self.require_framing = require_framing
        self.registry = registry
        self._writers: dict[int, Any] = {}
        self.warnings: list[str] = []  # one-off notes (a schema id the registry did not give)

    def decode(self, value: bytes | None) -> tuple[dict[str, Any], int | None]:
        """``(record, schema_id or None)``; raises :class:`MalformedValue`."""
        from flow_exporter.sink.registry import split_header

        if not value:
            raise MalformedValue("empty value")
        if not (self.require_framing or value[0] == 0):
            return self._read(value, self.reader), None
        try:
            schema_id, body = split_header(value)
            return self._read(body, self._writer(schema_id)), schema_id
        except ValueError as framed_exc:  # MalformedValue is one too
            if self.require_framing:
                raise MalformedValue(str(framed_exc)) from None
            try:
                return self._read(value, self.reader), None
            except MalformedValue:
                raise MalformedValue(f"framed value: {framed_exc}") from None

    def _writer(self, schema_id: int) -> Any:
        if schema_id in self._writers:
            return self._writers[schema_id]
        writer = self.reader
        if self.registry is not None:
            import fastavro

            try:
                text = self.registry.get_schema(schema_id).schema_str
                if text is None:
                    raise LookupError("the registry returned no schema text")
                writer = fastavro.parse_schema(json.loads(text))
            except Exception as exc:
                self.warnings.append(f"schema id {schema_id} not in the registry ({exc}); using the local schema")
        self._writers[schema_id] = writer
        return writer

    def _read(self, body: bytes, writer: Any) -> dict[str, Any]:
        import fastavro

        try:
            buf = io.BytesIO(body)
            raw = cast(dict[str, Any], fastavro.schemaless_reader(buf, writer, writer))
            # fastavro reads short strings and negative lengths without complaint: only bytes
            # that re-encode to exactly themselves are a record.
            again = io.BytesIO()
            fastavro.schemaless_writer(again, writer, raw)
            if again.getvalue() != body:
                extra = len(body) - buf.tell()
                raise MalformedValue(f"{extra} bytes after the record" if extra > 0 else "truncated or corrupt record")
            if writer is self.reader:
                return raw
            return cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(body), writer, self.reader))
        except MalformedValue:
            raise
        except Exception as exc:
            raise MalformedValue(f"not a FlowRecord ({type(exc).__name__}: {exc})") from None


# ----------------------------------------------------------------- filtering
def matches(rec: Mapping[str, Any], namespace: str | None, pod: str | None, service: str | None) -> bool:
    """Filters of ``tail``: all given ones must match (source or destination for pods)."""
    if namespace is not None and namespace not in (rec.get("sourcePodNamespace"), rec.get("destinationPodNamespace")):
        return False
    if pod is not None:
        ns, _, name = pod.rpartition("/")
        ends = (
            (rec.get("sourcePodNamespace"), rec.get("sourcePodName")),
            (rec.get("destinationPodNamespace"), rec.get("destinationPodName")),
        )
        if not any(n == name and (not ns or s == ns) for s, n in ends):
            return False
    if service is not None:
        svc = rec.get("destinationService")
        if svc is None:
            return False
        ns_name = svc.split(":", 1)[0]  # namespace/name:port/protocol
        if service not in (svc, ns_name, ns_name.rpartition("/")[2]):
            return False
    return True


# ------------------------------------------------------------------ printing
def to_json(rec: Mapping[str, Any]) -> str:
    """One JSON line: timestamps ISO 8601 UTC with milliseconds, bytes as hex."""
    return json.dumps({k: _jsonable(v) for k, v in rec.items()}, separators=(",", ":"))


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC, like ``2026-01-31T12:00:00.123Z``."""
    return _iso(datetime.fromtimestamp(ms / 1000, UTC))


def _iso(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(v: Any) -> Any:
    if isinstance(v, datetime):
        return _iso(v)
    if isinstance(v, bytes):
        return v.hex()
    return v


COLUMNS = (
    ("TIME", 12),
    ("PROTO", 9),
    ("SOURCE", 34),
    ("DESTINATION", 34),
    ("SERVICE", 26),
    ("SENT", 13),
    ("RECEIVED", 13),
    ("REASON", 0),
)
_RIGHT = ("SENT", "RECEIVED")


def table_header() -> str:
    return _cells((name for name, _ in COLUMNS))


def _cells(values: Iterator[str] | tuple[str, ...]) -> str:
    cells = [v.rjust(w) if name in _RIGHT else v.ljust(w) for (name, w), v in zip(COLUMNS, values, strict=True)]
    return " ".join(cells).rstrip()


def table_row(rec: Mapping[str, Any]) -> str:
    """One record as a table row; SENT/RECEIVED are the bytes of this record's delta, from the source's view."""
    t = rec.get("exportTime")
    when = t.astimezone().strftime("%H:%M:%S.%f")[:12] if isinstance(t, datetime) else str(t)
    proto_num = rec.get("protocol")
    proto = (PROTO_NAMES.get(proto_num) if isinstance(proto_num, int) else None) or str(proto_num)
    proto = proto.lower()
    if proto_num in _PORTLESS and rec.get("icmpType") is not None:
        proto += f" {rec['icmpType']}/{rec.get('icmpCode')}"
    portless = proto_num in _PORTLESS
    src = _endpoint(
        rec["sourceAddress"],
        None if portless else rec["sourcePort"],
        rec.get("sourcePodNamespace"),
        rec.get("sourcePodName"),
    )
    dst = _endpoint(
        rec["destinationAddress"],
        None if portless else rec["destinationPort"],
        rec.get("destinationPodNamespace"),
        rec.get("destinationPodName"),
    )
    reason = rec["flowEndReason"]
    return _cells(
        (
            when,
            proto,
            src,
            dst,
            rec.get("destinationService") or "-",
            f"{rec['octetDeltaCount']:,}",
            f"{rec['reverseOctetDeltaCount']:,}",
            REASON_NAMES.get(reason, str(reason)),
        )
    )


def _endpoint(addr: str, port: int | None, ns: str | None, pod: str | None) -> str:
    text = addr if port is None else (f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}")
    if pod:
        text += f" {ns}/{pod}" if ns else f" {pod}"
    return text


# ---------------------------------------------------------------------- tail
def consumer_config(settings: Settings) -> dict[str, Any]:
    """The exporter's connection settings (brokers, TLS, SASL) for a throw-away, non-committing consumer."""
    passthrough = settings.kafka.producer
    conf = {
        k: v
        for k, v in settings.producer_config().items()
        if k not in passthrough or k.startswith(_CONNECTION_PREFIXES)
    }
    conf.update(
        {
            "group.id": f"flow-exporter-tail-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
    )
    return conf


def tail_command(
    args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO, stop: threading.Event | None = None
) -> int:
    """Read, filter and print records until Ctrl-C or ``--count``."""
    from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

    topic = settings.kafka.topic
    registry = None
    if settings.schema_registry.url:
        from flow_exporter.sink.registry import make_client

        registry = make_client(settings.schema_registry.url, settings.schema_registry.basic_auth_user_info)
    decoder = ValueDecoder(require_framing=args.confluent, registry=registry)
    consumer = Consumer({**consumer_config(settings), "logger": _QUIET, "error_cb": _ErrorLine(err)})
    try:
        try:
            md = consumer.list_topics(topic, timeout=15.0)
        except KafkaException as exc:
            consumer.poll(0)  # the error_cb lines that say why come first
            reason = exc.args[0].str() if hasattr(exc.args[0], "str") else exc.args[0]
            servers = settings.kafka.bootstrap_servers
            print(f"flow-exporter tail: kafka {servers} not reachable: {reason}", file=err)
            return 1
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            print(f"flow-exporter tail: topic {topic!r} not found ({tmd.error if tmd else 'no metadata'})", file=err)
            return 1
        stop = stop if stop is not None else threading.Event()
        if stop.is_set():
            return 0
        start = OFFSET_BEGINNING if args.from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for p in sorted(tmd.partitions)])
        printer = _Printer(out, args.json)
        shown = 0
        for msg in _messages(consumer, stop):
            if msg.error() is not None:
                if msg.error().fatal():
                    print(f"flow-exporter tail: {msg.error().str()}", file=err)
                    return 1
                _warn(err, f"kafka: {msg.error().str()}")
                continue
            try:
                rec, _schema_id = decoder.decode(msg.value())
            except MalformedValue as exc:
                size = len(msg.value() or b"")
                _warn(err, f"{topic}[{msg.partition()}]@{msg.offset()}: skipped a value ({size} bytes): {exc}")
                continue
            finally:
                while decoder.warnings:
                    _warn(err, decoder.warnings.pop(0))
            if not matches(rec, args.namespace, args.pod, args.service):
                continue
            printer.print(rec)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
        return 0
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python's exit flush quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        return 0
    finally:
        with contextlib.suppress(KafkaException, RuntimeError, KeyboardInterrupt):
            consumer.close()


def _messages(consumer: Any, stop: threading.Event, timeout: float = 0.5) -> Iterator[Any]:
    while not stop.is_set():
        msg = consumer.poll(timeout)
        if msg is not None:
            yield msg


# librdkafka's log repeats every reconnect attempt; its errors come through error_cb instead.
_QUIET = logging.getLogger("flow_exporter.commands.rdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class _ErrorLine:
    """Kafka client errors as one-line warnings, each distinct one at most every 30 s."""

    def __init__(self, err: TextIO, every: float = 30.0) -> None:
        self.err = err
        self.every = every
        self.last: dict[str, float] = {}

    def __call__(self, error: Any) -> None:
        text = error.str()
        key = re.sub(r" \(after \d+ms[^)]*\)", "", text)  # the same error, however long the attempt took
        now = time.monotonic()
        if now - self.last.get(key, -self.every) >= self.every:
            self.last[key] = now
            _warn(self.err, f"kafka: {text}")


def _warn(err: TextIO, text: str) -> None:
    print(f"flow-exporter tail: warning: {text}", file=err, flush=True)


class _Printer:
    """Table rows (header again every 40 rows on a terminal) or JSON lines, flushed per record."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.rows = 0
        isatty: Callable[[], bool] = getattr(out, "isatty", lambda: False)
        self.repeat_header = isatty()

    def print(self, rec: Mapping[str, Any]) -> None:
        if self.as_json:
            self.out.write(to_json(rec) + "\n")
        else:
            if self.rows == 0 or (self.repeat_header and self.rows % 40 == 0):
                self.out.write(table_header() + "\n")
            self.out.write(table_row(rec) + "\n")
        self.rows += 1
        self.out.flush()
