"""``flow-exporter tail`` and ``schema`` as a person runs them: subprocesses against the real broker."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer

from bench.bench_export import synthetic_exports
from devtools.kafka import KafkaBroker
from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.commands import ValueDecoder, matches, table_header, table_row
from flow_exporter.flow import Export
from flow_exporter.record import load_schema
from flow_exporter.sink import KafkaSink
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.sink.registry import header
from flow_exporter.timeouts import Timeouts
from tests.support.cli import EXPORT_MS, NODE, clean_env, from_json, json_run_command, run_cli, run_tail
from tests.support.paths import REPO
from tests.support.reference import build_record


# ------------------------------------------------------------------- helpers
def produce(bootstrap: str, topic: str, exports: Sequence[Export], encode: Any = None) -> list[dict[str, Any]]:
    """Send ``exports`` through a KafkaSink; their record dicts, in order."""
    sink = KafkaSink({"bootstrap.servers": bootstrap}, topic, encode or RecordEncoder(NODE).encode)
    expected = [build_record(e, NODE, EXPORT_MS) for e in exports]  # first: encoding lets go of e.conn
    for e in exports:
        sink.send(e, EXPORT_MS)
    assert sink.flush(30) == 0 and sink.counters.acked == len(exports)
    return expected


def produce_raw(bootstrap: str, topic: str, values: Sequence[bytes | None]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for v in values:
        p.produce(topic, v)
    assert p.flush(30) == 0


POD_META = [
    {
        "sourcePodNamespace": "shop",
        "sourcePodName": "web-1",
        "destinationPodNamespace": "db",
        "destinationPodName": "pg-0",
        "destinationService": "db/postgres:5432/TCP",
        "sourcePodLabels": {"app": "web"},
        "flowType": 2,
    },
    {
        "sourcePodNamespace": "ops",
        "sourcePodName": "probe",
        "destinationPodNamespace": "shop",
        "destinationPodName": "web-2",
        "flowType": 1,
    },
]


def exports_with_pods(n: int) -> list[Export]:
    """``n`` exports; every third has pod metadata (alternating the two in POD_META), the rest none."""
    exports = synthetic_exports(n)
    for i, e in enumerate(exports):
        e.meta = dict(POD_META[(i // 3) % 2]) if i % 3 == 2 else None
    return exports


# -------------------------------------------------------------------- schema
def test_schema_fingerprint_matches_fastavro() -> None:
    proc = run_cli("schema", "--fingerprint")
    assert proc.returncode == 0, proc.stderr
    canonical = fastavro.schema.to_parsing_canonical_form(load_schema())
    assert proc.stdout.splitlines() == [
        f"CRC-64-AVRO {fastavro.schema.fingerprint(canonical, 'CRC-64-AVRO')}",
        f"SHA-256 {fastavro.schema.fingerprint(canonical, 'SHA-256')}",
    ]
    printed = run_cli("schema")
    assert json.loads(printed.stdout) == load_schema()
    assert run_cli("schema", "--canonical").stdout.strip() == canonical


# ---------------------------------------------------------------------- tail
@pytest.mark.kafka
def test_tail_json_gives_back_the_records(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    exports = exports_with_pods(6)
    exports[0].conn.labels = bytes(range(16))  # type: ignore[union-attr]  # bytes fields come out as hex
    expected = produce(kafka_broker.bootstrap, kafka_topic, exports)
    proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--count", "6")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [from_json(line) for line in lines] == expected
    first = json.loads(lines[0])
    assert first["exportTime"] == "2026-01-01T00:00:00.123Z"


@pytest.mark.kafka
def test_tail_filters(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    # Records 2, 8 have POD_META[0] (shop -> db, Service db/postgres); 5, 11 have POD_META[1] (ops -> shop).
    expected = produce(kafka_broker.bootstrap, kafka_topic, exports_with_pods(12))
    cases = {
        ("--namespace", "shop"): [2, 5, 8, 11],
        ("--namespace", "db"): [2, 8],
        ("--pod", "web-2"): [5, 11],
        ("--pod", "shop/web-1"): [2, 8],
        ("--service", "postgres"): [2, 8],
        ("--service", "db/postgres"): [2, 8],
        ("--service", "db/postgres:5432/TCP"): [2, 8],
        ("--namespace", "shop", "--pod", "probe"): [5, 11],
    }
    for args, want in cases.items():
        # --count stops at the last wanted record, so a wrongly passed one would take a place.
        proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--count", str(len(want)), *args)
        assert proc.returncode == 0, (args, proc.stderr)
        got = [from_json(line) for line in proc.stdout.splitlines()]
        assert got == [expected[i] for i in want], args


@pytest.mark.kafka
def test_tail_warns_on_malformed_values_and_goes_on(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    exports = synthetic_exports(3)
    first = produce(kafka_broker.bootstrap, kafka_topic, exports[:1])
    produce_raw(
        kafka_broker.bootstrap, kafka_topic, [b"not avro at all \xff\xfe", b"", None, b"\x00\x00\x00\x00\x01\xff"]
    )
    good = RecordEncoder(NODE).encode(replace(exports[1]), EXPORT_MS)  # a copy: encoding lets go of its conn
    produce_raw(kafka_broker.bootstrap, kafka_topic, [good[:-3], good + b"\x00\x01"])  # truncated; trailing bytes
    rest = produce(kafka_broker.bootstrap, kafka_topic, exports[1:])
    proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--count", "3")
    assert proc.returncode == 0, proc.stderr
    assert [from_json(line) for line in proc.stdout.splitlines()] == first + rest
    warnings = [line for line in proc.stderr.splitlines() if "skipped a value" in line]
    assert len(warnings) == 6, proc.stderr
    assert all(line.startswith("flow-exporter tail: warning: ") for line in warnings)
    assert "Traceback" not in proc.stderr
    # --confluent: every bare value is malformed then, and the framed one at the end is read.
    produce_raw(kafka_broker.bootstrap, kafka_topic, [header(1) + good])
    strict = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--confluent", "--count", "1")
    assert strict.returncode == 0, strict.stderr
    assert [from_json(line) for line in strict.stdout.splitlines()] == rest[:1]
    assert strict.stderr.count("not Confluent-framed") == 6, strict.stderr  # 3 bare records, 3 bad ones
    assert "Traceback" not in strict.stderr


@pytest.mark.kafka
def test_tail_table(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    produce(kafka_broker.bootstrap, kafka_topic, exports_with_pods(3))
    proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--count", "3")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["TIME", "PROTO", "SOURCE", "DESTINATION", "SERVICE", "SENT", "RECEIVED", "REASON"]
    assert len(rows) == 3
    assert "shop/web-1" in rows[2] and "db/pg-0" in rows[2] and "db/postgres:5432/TCP" in rows[2]
    assert rows[0].split()[1] == "tcp"


@pytest.mark.kafka
def test_tail_stops_on_ctrl_c(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flow_exporter",
            "tail",
            "--bootstrap-servers",
            kafka_broker.bootstrap,
            "--topic",
            kafka_topic,
        ],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.kafka
def test_tail_missing_topic_and_bad_usage(kafka_broker: KafkaBroker) -> None:
    proc = run_tail(kafka_broker.bootstrap, "no-such-topic-here", timeout=40)
    assert proc.returncode == 1 and "no-such-topic-here" in proc.stderr and "Traceback" not in proc.stderr
    assert run_tail(kafka_broker.bootstrap, "t", "--count", "0").returncode == 2


# ------------------------------------------------------------- in-process parts
def test_decoder_reads_connection_id_zero_bare() -> None:
    """A bare record whose connectionId is 0 starts with byte 0 too: auto-detection still reads it."""
    e = synthetic_exports(1)[0]
    e.flow_id = 0
    value = RecordEncoder(NODE).encode(e, EXPORT_MS)
    assert value[0] == 0
    rec, schema_id = ValueDecoder().decode(value)
    assert schema_id is None and rec["connectionId"] == 0


def test_filters_and_row_formatting() -> None:
    rec = {
        "sourcePodNamespace": "a",
        "sourcePodName": "p1",
        "destinationPodNamespace": None,
        "destinationPodName": None,
        "destinationService": "kube-system/kube-dns:53/UDP",
    }
    assert matches(rec, "a", None, None) and not matches(rec, "b", None, None)
    assert matches(rec, None, "a/p1", None) and not matches(rec, None, "b/p1", None)
    assert matches(rec, None, None, "kube-dns") and not matches(rec, None, None, "dns")
    decoded, _ = ValueDecoder().decode(RecordEncoder(NODE).encode(synthetic_exports(1)[0], EXPORT_MS))
    decoded["octetDeltaCount"] = 1234567
    row = table_row(decoded)
    assert "1,234,567" in row and row.split()[1] == "tcp"
    assert len(table_header().split()) == 8


# -------------------------------------------------------------- status lines
def test_first_poll_line_has_thousands_separators(caplog: pytest.LogCaptureFixture) -> None:
    conns = [e.conn for e in synthetic_exports(12_345)]

    class Source:
        skipped = 0

        def dump_buffers(self, apply: Any, zones: object = None) -> None:
            return None

        def dump_into(self, consume: Any, zones: object = None) -> int:
            consume(conns)
            return len(conns)

        def count(self) -> int:
            return len(conns)

        def max_entries(self) -> int:
            return 262_144

        def kernel_stats(self) -> dict[str, int]:
            return {}

    # Never connects (nothing is produced); log_level 0 keeps librdkafka's connect errors out of the output.
    sink = KafkaSink({"bootstrap.servers": "127.0.0.1:9", "log_level": 0}, "t", RecordEncoder(NODE).encode)
    exp = Exporter(Source(), sink, ExporterOptions(timeouts=Timeouts(1.0, 5.0, 15.0), node_name=NODE))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="flow_exporter.app"):
        exp.poll_once()
    assert any("first poll: 12,345 connections in" in r.getMessage() for r in caplog.records)


@pytest.mark.kafka
@pytest.mark.skipif(os.geteuid() != 0, reason="reading conntrack needs root")
def test_run_with_json_logs(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    """``run --log-format json``: every stderr line is a JSON object, start-up status lines included."""
    proc = subprocess.Popen(
        json_run_command(
            kafka_broker.bootstrap,
            kafka_topic,
            metrics__port="0",
            conntrack__events="false",
            conntrack__setSysctls="false",
            conntrack__pollInterval="1s",
            shutdown__grace="5s",
        ),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "first poll:" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
        lines += rest.splitlines(keepends=True)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines)
    docs = [json.loads(line) for line in lines if line.strip()]
    assert all({"time", "level", "logger", "message"} <= d.keys() for d in docs)
    messages = [d["message"] for d in docs]
    assert any(m.startswith("broker reachable") for m in messages), messages
    assert any(m.startswith("first poll: ") and " connections in " in m for m in messages), messages
