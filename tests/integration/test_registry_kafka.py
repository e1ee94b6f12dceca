"""Schema Registry framing on the real broker: what ``run`` and ``tail`` do with a registry.

The registry is confluent-kafka's in-memory one or the stub REST server (tests/support/schema_registry.py);
the pure framing and registration tests are in tests/unit/test_registry.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import topic_subject_name_strategy
from confluent_kafka.serialization import MessageField, SerializationContext

from bench.bench_export import synthetic_exports
from devtools.kafka import KafkaBroker
from flow_exporter.config import load
from flow_exporter.runner import build_sink
from flow_exporter.sink import registry
from tests.support.cli import EXPORT_MS, NODE, clean_env, from_json, json_run_command, run_tail
from tests.support.paths import REPO
from tests.support.reference import build_record
from tests.support.schema_registry import INCOMPATIBLE, StubRegistry, closed_port, mock_client, reference


def consume_values(bootstrap: str, topic: str, n: int, timeout: float = 30.0) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g{time.time_ns()}", "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and m.error() is None:
                out.append(m.value())
    finally:
        c.close()
    return out


@pytest.mark.kafka
def test_build_sink_writes_what_the_serializer_writes(
    kafka_broker: KafkaBroker, kafka_topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = mock_client()
    monkeypatch.setattr(registry, "make_client", lambda url, auth=None: client)
    cfg = load(
        environ={},
        overrides={
            "kafka.bootstrapServers": kafka_broker.bootstrap,
            "kafka.topic": kafka_topic,
            "nodeName": NODE,
            "schemaRegistry.url": "mock://shared",
        },
    )
    sink = build_sink(cfg)
    assert registry.ensure_registered(sink.encode, threading.Event())  # as run_exporter does, after /healthz is up
    exports = synthetic_exports(25)
    records = [build_record(e, NODE, EXPORT_MS) for e in exports]  # first: encoding lets go of e.conn
    for e in exports:
        sink.send(e, EXPORT_MS)
    assert sink.flush(30) == 0 and sink.counters.acked == len(exports)
    values = consume_values(kafka_broker.bootstrap, kafka_topic, len(exports))
    # The default subject is the topic's (TopicNameStrategy), as the serializer names it.
    ser = reference(client, topic_subject_name_strategy)
    ctx = SerializationContext(kafka_topic, MessageField.VALUE)
    assert values == [ser(r, ctx) for r in records]
    # tail finds the framing by itself and decodes the same records.
    proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--count", str(len(exports)))
    assert proc.returncode == 0, proc.stderr
    assert [from_json(line) for line in proc.stdout.splitlines()] == records
    proc = run_tail(kafka_broker.bootstrap, kafka_topic, "--json", "--confluent", "--count", "1")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc.stderr


@pytest.mark.kafka
@pytest.mark.skipif(os.geteuid() != 0, reason="reading conntrack needs root")
def test_run_waits_alive_for_the_registry_then_registers(
    kafka_broker: KafkaBroker, kafka_topic: str, stub: StubRegistry
) -> None:
    """``run`` with a registry refusing the schema: /healthz answers while it retries, then it registers.

    (The own network namespace has no conntrack entries here, so the framed values themselves
    are checked by test_build_sink_writes_what_the_serializer_writes.)
    """
    stub.answers = [INCOMPATIBLE] * 4
    port = closed_port()
    proc = subprocess.Popen(
        json_run_command(
            kafka_broker.bootstrap,
            kafka_topic,
            schemaRegistry__url=stub.url,
            metrics__address="127.0.0.1",
            metrics__port=str(port),
            conntrack__events="false",
            conntrack__setSysctls="false",
            conntrack__pollInterval="1s",
            expiry__activeTimeout="1s",
            retry__initialBackoff="0.3s",
            retry__maxBackoff="1s",
        ),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        alive_while_waiting = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stub.answers:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    alive_while_waiting = alive_while_waiting or (resp.status == 200 and bool(stub.answers))
            except OSError:
                pass
            time.sleep(0.2)
        assert alive_while_waiting, "no /healthz answer while the registry refused the schema"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(stub.requests) < 10:  # 5 compatibility PUTs + 5 POSTs
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    messages = [json.loads(line)["message"] for line in err.splitlines() if line.strip()]
    refused = [m for m in messages if "cannot register" in m]
    assert len(refused) == 4 and all(f"'{kafka_topic}-value'" in m and "HTTP 409" in m for m in refused)
    assert any("schema registered, id 7" in m for m in messages)
