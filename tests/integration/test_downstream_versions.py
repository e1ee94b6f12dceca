"""Both downstream jobs read a topic holding records of an older schema version beside current ones.

After an exporter upgrade the topic still holds records written before a field was added
(here: communityId and reporter, and the owner and zone fields the groups and the zone pairs
read). With the registry, each value names its writer schema, and the jobs' reader schemas (the
current file's fields, with their defaults) must resolve them all: an older record is grouped by
its pod and counted in the null zone pair, a current one by its workload and its zones.

Also on synthetic records: two exporters whose connectionIds collide (by chance, README "Counting:
the contract") are two connections in both jobs, even in the same window and group.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections import defaultdict
from pathlib import Path

import fastavro
import pytest
from confluent_kafka import Producer

from devtools.kafka import KafkaBroker
from devtools.registry import RegistryServer
from flow_exporter.record import schema_path
from tests.support.downstream import CLOCK_ZONE, run_flink, run_spark, synthetic_record

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

OWNERS_AND_ZONES = {
    "sourceOwnerKind": "Deployment",
    "sourceOwnerName": "web",
    "destinationOwnerKind": "StatefulSet",
    "destinationOwnerName": "db",
    "sourceZone": "zone-a",
    "destinationZone": "zone-b",
}
ADDED_SINCE = ("communityId", "reporter", *OWNERS_AND_ZONES)


@pytest.mark.parametrize("job", ["spark", "flink"])
def test_older_writer_versions_resolve(kafka_broker: KafkaBroker, tmp_path: Path, job: str) -> None:
    current = json.loads(schema_path().read_text())
    older = dict(current, fields=[f for f in current["fields"] if f["name"] not in ADDED_SINCE])
    topic = f"versions-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic)
    with RegistryServer() as registry:
        old_id = registry.register(f"{topic}-value", json.dumps(older))
        new_id = registry.register(f"{topic}-value", json.dumps(current))
        assert old_id != new_id
        now_ms = time.time_ns() // 1_000_000
        producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        expected = {}
        for i, (schema, sid) in enumerate([(older, old_id), (current, new_id), (older, old_id)]):
            rec = synthetic_record(40100 + i, ("ns", "a"), ("ns", "b"), None, now_ms, (i + 1, 100 * (i + 1), 2, 20))
            if schema is current:
                rec.update(communityId="1:test", reporter=1, **OWNERS_AND_ZONES)
            rec = {f["name"]: rec.get(f["name"], f.get("default")) for f in schema["fields"]}
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), rec)
            producer.produce(topic, b"\x00" + sid.to_bytes(4, "big") + buf.getvalue())
            expected[rec["sourcePort"]] = (i + 1 + 2, 100 * (i + 1) + 20)
        # Spark emits a window once a later record moves the watermark past it: one an hour ahead.
        clock = synthetic_record(40199, ("t", "c"), ("t", "c"), None, now_ms + 3_600_000, (1, 1, 0, 0))
        clock.update(communityId="", reporter=0, sourceZone=CLOCK_ZONE, destinationZone=CLOCK_ZONE)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(current), clock)
        producer.produce(topic, b"\x00" + new_id.to_bytes(4, "big") + buf.getvalue())
        assert producer.flush(30) == 0
        run = (run_spark if job == "spark" else run_flink)(
            kafka_broker.bootstrap,
            topic,
            tmp_path,
            "--schema-registry",
            registry.url,
            **({"min_batches": 1} if job == "spark" else {}),
        )
    got = {r["sourcePort"]: (r["packets"], r["bytes"]) for r in run.connections if r["sourcePort"] in expected}
    assert got == expected
    # Records 0 and 2 (older) by their pods, record 1 (current) by its workloads.
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for r in run.windows:
        groups[(r["source"], r["destination"])] += r["packets"]
    assert {g: groups.get(g) for g in [("ns/a", "ns/b"), ("ns/Deployment/web", "ns/StatefulSet/db")]} == {
        ("ns/a", "ns/b"): expected[40100][0] + expected[40102][0],
        ("ns/Deployment/web", "ns/StatefulSet/db"): expected[40101][0],
    }
    zones: dict[tuple[str | None, str | None], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for r in run.zones:
        p, b = zones[(r["source_zone"], r["destination_zone"])]
        zones[(r["source_zone"], r["destination_zone"])] = (p + r["packets"], b + r["bytes"])
    zones.pop((CLOCK_ZONE, CLOCK_ZONE), None)  # its window closes in Flink only
    older = (expected[40100][0] + expected[40102][0], expected[40100][1] + expected[40102][1])
    assert dict(zones) == {(None, None): older, ("zone-a", "zone-b"): expected[40101]}


@pytest.mark.parametrize("job", ["spark", "flink"])
def test_connection_ids_colliding_across_nodes_are_two_connections(
    kafka_broker: KafkaBroker, tmp_path: Path, job: str
) -> None:
    """The same (connectionId, sequence) from two nodes, different contents, same window and group:
    both count, each its own row of connection_totals; a resent copy of one counts once."""
    topic = f"collide-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic)
    schema = fastavro.parse_schema(json.loads(schema_path().read_text()))
    now_ms = time.time_ns() // 1_000_000
    cid = uuid.uuid4().int >> 65
    pods = (("ns", "a"), ("ns", "b"), None, now_ms)
    a = synthetic_record(40201, *pods, (3, 300, 2, 20), exporterNode="node-a", connectionId=cid)
    b = synthetic_record(40202, *pods, (5, 500, 1, 10), exporterNode="node-b", connectionId=cid)
    # Spark emits a window once a later record moves the watermark past it: one an hour ahead.
    clock = synthetic_record(40299, ("t", "c"), ("t", "c"), None, now_ms + 3_600_000, (1, 1, 0, 0))
    clock.update(sourceZone=CLOCK_ZONE, destinationZone=CLOCK_ZONE)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for rec in (a, b, a, clock):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, rec)
        producer.produce(topic, buf.getvalue())
    assert producer.flush(30) == 0
    if job == "spark":
        run = run_spark(kafka_broker.bootstrap, topic, tmp_path, min_batches=1)
    else:
        run = run_flink(kafka_broker.bootstrap, topic, tmp_path)
    got = {
        (r["exporterNode"], r["connectionId"]): (r["records"], r["packets"], r["bytes"])
        for r in run.connections
        if r["connectionId"] == cid
    }
    assert got == {("node-a", cid): (1, 3 + 2, 300 + 20), ("node-b", cid): (1, 5 + 1, 500 + 10)}
    assert run.group_totals().get(("ns/a", "ns/b")) == (3 + 2 + 5 + 1, 300 + 20 + 500 + 10)
