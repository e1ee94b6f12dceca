"""The downstream jobs end to end: lab traffic -> exporter -> real broker -> Spark / Flink -> tables.

The exporters write as in production: over the broker's SASL_PLAINTEXT listener (SCRAM-SHA-512)
and Confluent-framed, the schema registered under ``<topic>-value`` in a local registry
(devtools.registry). One scenario, one topic, then one run per job and mode (JVM start
dominates), checked by several tests:

* plain: connections that one exporter process saw from start to end;
* restart: connections alive across exporter restarts with a state directory (SIGKILL mid-way,
  start, SIGTERM, start), which the restarted processes continue at their next sequence; a
  connection also starts and ends while no exporter runs;
* Kubernetes names, windows and top talkers; per-connection totals;
* zones: ``bytes_by_zone_pair`` against the kernel's counters summed by the zones the test gave.

The exporters enrich from a real kube-apiserver, where the test made what a user and the
controllers would: the lab's first pod belongs to a Deployment (through its ReplicaSet), the
second is a bare pod, both on the exporter's node in zone ``zone-a``; the third address is the
InternalIP of a second node, in ``zone-b`` (a node, not a pod: a pod there would be another
node's to report for the connections it serves). So groups are workloads, pods and addresses,
each end has a zone, and no record is the destination node's copy the jobs drop.

The Spark deltas run reads over SCRAM with the registry; the totals run over the plaintext
listener, stripping the header and using the local schema (``--confluent``). Each job also runs
once more as a user outside the repository would run it: the job file, ``contract.py`` and the
schemas copied into a temporary directory, run from there with a clean environment (no
PYTHONPATH, cwd that directory) and the jars passed by ``--jars``; its tables must equal the
in-repository run's.

The conntrack table is flushed between the two phases, so the restarted exporter does not see
the plain phase's connections. Every run must give, per (source, destination), per zone pair and
per connection, the packet and byte totals ``conntrack -L`` reported just before the exporter
stopped. A few synthetic records check the naming of a Service, a workload and the pod fallback
(a record without owner fields, as an older exporter writes, and a bare pod) and that null zones
are one group; a last one, an hour ahead, moves the watermark past every window so that an
available-now Spark run emits them all. The last test
checks the Spark job's per-connection arithmetic alone, without Spark.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from devtools.apiserver import ApiServer
from devtools.kafka import KafkaBroker
from devtools.lab import CtTable, Lab
from devtools.registry import RegistryServer
from downstream.spark_flows import HighWater
from tests.support.cluster import controlled_by, create, ensure_node, make_pod, pod_template
from tests.support.downstream import (
    CLOCK_ZONE,
    SAMPLED_GROUP,
    SAMPLED_P,
    TOP,
    WINDOW_S,
    Counts,
    Directional,
    Group,
    JobRun,
    Placement,
    ZonePair,
    ct_connection,
    ct_totals,
    ct_zone_totals,
    produce_synthetic,
    readme_rule,
    run_flink,
    run_spark,
)
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = pytest.mark.spark

SCRAM_USER, SCRAM_PASSWORD = "flows", "flows-secret"
SCRAM = (
    "--security-protocol",
    "SASL_PLAINTEXT",
    "--sasl-mechanism",
    "SCRAM-SHA-512",
    "--sasl-username",
    SCRAM_USER,
)


# --------------------------------------------------------------------------- synthetic records

K8S_GROUPS: dict[Group, Counts] = {
    # The workload names the source; destinationService wins over the destination pod.
    ("shop/Deployment/web", "shop/cart:80/TCP"): (7 + 5, 700 + 500),
    # No owner fields (an older exporter), and a bare pod (owner kind Pod): the pods name both ends.
    ("shop/web-0", "shop/db-0"): (3 + 2, 300 + 200),
    # A Cilium node's record (flag 16): both directions in one pair, counted as undirected.
    ("shop/api-0", "shop/db-1"): (9, 900),
    # A sampling node's two connections (sampled_records): what was sent, exactly; the estimates apart.
    SAMPLED_GROUP: (10 + 3, 1000 + 300),
}
UNDIRECTED_GROUP: Group = ("shop/api-0", "shop/db-1")
# Their zones are null (not known, or an older exporter): one group of their own.
K8S_ZONES: dict[ZonePair, Directional] = {
    (None, None): (7 + 3 + 10 + 2, 700 + 300 + 1000 + 200, 5 + 2 + 1, 500 + 200 + 100)
}
CLOCK_GROUP: Group = ("test/clock", "test/clock")
CLOCK_ZONES: ZonePair = (CLOCK_ZONE, CLOCK_ZONE)
EXPORTER_NODE = "lab-node"  # the --node-name start_exporter gives the exporter


# --------------------------------------------------------------------------- the scenario


@dataclass
class Scenario:
    plain: CtTable
    restart: CtTable
    records: list[dict[str, Any]]
    # "spark-deltas" and "flink" (SCRAM, registry); "spark-totals" (plaintext, --confluent);
    # "spark-standalone" and "flink-standalone": the first and the last, run from copies outside the repo
    runs: dict[str, JobRun]
    long_b: Any  # the LongConnection that spans the restarts
    placement: Placement  # the names and zones the test gave the lab's addresses
    namespace: str  # of the pods the test made

    @property
    def plain_ct(self) -> dict[Group, Counts]:
        return ct_totals(self.plain, self.placement)

    @property
    def restart_ct(self) -> dict[Group, Counts]:
        return ct_totals(self.restart, self.placement)


def quiet_then_snapshot(lab: Lab) -> CtTable:
    """Let the exporter poll the final counters (1 s poll interval), then read the table."""
    time.sleep(2.5)
    return lab.conntrack_entries()


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with KafkaBroker(tmp_path_factory.mktemp("downstream-broker"), scram_users={SCRAM_USER: SCRAM_PASSWORD}) as b:
        yield b


def place(apiserver: ApiServer, lab: Lab, ns: str, other_node: str) -> Placement:
    """The cluster the exporters enrich from: a Deployment's pod and a bare pod on the exporter's node
    (zone-a), a second node (zone-b) at the third address; the names and zones the jobs should give them."""
    p1, p2, p3 = lab.pods
    with apiserver.api_client() as api:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        core.create_namespace({"metadata": {"name": ns}})
        ensure_node(core, EXPORTER_NODE, "192.0.2.1", zone="zone-a")
        ensure_node(core, other_node, p3.ipv4, zone="zone-b")
        selector = {"matchLabels": {"app": "web"}}
        web = create(apps, "create_namespaced_deployment", ns, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"selector": selector, "template": pod_template("web")},
        })  # fmt: skip
        rs = create(apps, "create_namespaced_replica_set", ns, {
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "web-6d4cf", "ownerReferences": [controlled_by(web)]},
            "spec": {"selector": selector, "template": pod_template("web")},
        })  # fmt: skip
        make_pod(core, ns, "web-6d4cf-x7k2p", EXPORTER_NODE, [p1.ipv4, p1.ipv6], owner=rs)
        make_pod(core, ns, "probe", EXPORTER_NODE, [p2.ipv4, p2.ipv6])  # no controller: its own workload
    names = {p1.ipv4: f"{ns}/Deployment/web", p1.ipv6: f"{ns}/Deployment/web", p2.ipv4: f"{ns}/probe"}
    names[p2.ipv6] = f"{ns}/probe"
    zones = {p1.ipv4: "zone-a", p1.ipv6: "zone-a", p2.ipv4: "zone-a", p2.ipv6: "zone-a", p3.ipv4: "zone-b"}
    return Placement(names, zones)


def unplace(apiserver: ApiServer, ns: str, other_node: str) -> None:
    """Remove what would confuse later tests of the session: pods and a node at the lab's addresses."""
    with apiserver.api_client() as api:
        core = client.CoreV1Api(api)
        with contextlib.suppress(ApiException):
            core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        with contextlib.suppress(ApiException):
            core.delete_node(other_node)


def start_synced(lab: Lab, bootstrap: str, topic: str, log: Path, *flags: str) -> Any:
    """An exporter whose caches have listed the API server, so its first records are enriched."""
    proc = start_exporter(lab, bootstrap, topic, log, *flags)
    deadline = time.monotonic() + 20
    while "API server synced" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def scenario(
    secure_broker: KafkaBroker, apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenario]:
    ns = f"downstream-{uuid.uuid4().hex[:8]}"
    other_node = f"{ns}-b"
    try:
        yield run_scenario(secure_broker, apiserver, tmp_path_factory.mktemp("downstream-e2e"), ns, other_node)
    finally:
        unplace(apiserver, ns, other_node)


def run_scenario(secure_broker: KafkaBroker, apiserver: ApiServer, work: Path, ns: str, other_node: str) -> Scenario:
    """The traffic, the exporters, the synthetic records and the job runs (see the module docstring)."""
    topic = f"downstream-e2e-{uuid.uuid4().hex[:8]}"
    secure_broker.create_topic(topic, partitions=2)
    assert secure_broker.sasl_bootstrap is not None
    with RegistryServer() as registry, Lab(pods=3) as lab:
        # As in production: SCRAM over the SASL listener, values framed for the registry, enrichment on.
        production = (
            *("--set", "kafka.securityProtocol=SASL_PLAINTEXT"),
            *("--set", "kafka.sasl.mechanism=SCRAM-SHA-512"),
            *("--set", f"kafka.sasl.username={SCRAM_USER}"),
            *("--set", f"kafka.sasl.password={SCRAM_PASSWORD}"),
            *("--set", f"schemaRegistry.url={registry.url}"),
            *("--set", "k8s.enabled=true", "--set", f"k8s.kubeconfig={apiserver.admin_kubeconfig}"),
            *("--set", "retry.maxBackoff=1s"),
        )
        sasl = secure_broker.sasl_bootstrap
        p1, p2, p3 = lab.pods
        svc = lab.add_service(lab.vip4(), 80, p3, 8080)
        placement = place(apiserver, lab, ns, other_node)

        # Plain: one exporter process from the first packet to the last.
        exporter = start_synced(lab, sasl, topic, work / "exporter-1.log", *production)
        try:
            long_a = lab.open_tcp(p1, p3, 7000)
            lab.tcp_exchange(p1, p2, 9000, 1000, 5000)
            lab.tcp_exchange(p2, p1, 9001, 3000, 700, family=6)
            lab.udp_exchange(p2, p3, 5300, 100, 400, count=3)
            lab.tcp_exchange(p2, svc, 80, 200, 20_000)
            lab.tcp_exchange(p2, svc, 80, 300, 1_000)  # a second connection in the same group
            for _ in range(3):
                long_a.send(1500)
                time.sleep(1)
            plain = quiet_then_snapshot(lab)
            stop_exporter(exporter, work / "exporter-1.log")  # long_a gets a forced final record
        finally:
            if exporter.poll() is None:
                exporter.kill()
        long_a.close()
        time.sleep(0.5)  # the last ACK of the close, before the flush
        for _ in range(20):
            lab.flush_conntrack()
            if lab.conntrack_count() == 0:
                break
            time.sleep(0.1)
        assert lab.conntrack_count() == 0

        # Restarts: connections alive across exporter restarts that keep a state directory.
        state = (*production, "--set", f"state.dir={work / 'state'}")
        exporter = start_synced(lab, sasl, topic, work / "exporter-2.log", *state)
        try:
            long_b = lab.open_tcp(p3, p1, 7100)
            lab.tcp_exchange(p2, p3, 9100, 2000, 3000)  # ended; still in the table (TIME_WAIT) at restart
            lab.udp_exchange(p3, p2, 5400, 80, 160, count=4)
            for _ in range(4):  # several active-timeout records (2 s) before the restart
                long_b.send(1000)
                time.sleep(1)
            time.sleep(1.5)
            exporter.kill()  # SIGKILL, records in flight
            exporter.wait(10)
            # No exporter: a connection that starts and ends unseen, and more bytes on long_b.
            lab.tcp_exchange(p2, p3, 9100, 500, 500)
            long_b.send(2000)
            exporter = start_synced(lab, sasl, topic, work / "exporter-3.log", *state)
            lab.udp_exchange(p3, p2, 5400, 80, 160, count=2)
            for _ in range(3):
                long_b.send(1000)
                time.sleep(1)
            stop_exporter(exporter, work / "exporter-3.log")  # SIGTERM
            long_b.send(500)
            exporter = start_synced(lab, sasl, topic, work / "exporter-4.log", *state)
            long_b.send(700)
            restart = quiet_then_snapshot(lab)
            stop_exporter(exporter, work / "exporter-4.log")
        finally:
            if exporter.poll() is None:
                exporter.kill()
        long_b.close()

        # The exporters registered the schema under the topic's subject (TopicNameStrategy).
        assert list(registry.subjects) == [f"{topic}-value"]
        (schema_id,) = registry.subjects[f"{topic}-value"]
        bootstrap = secure_broker.bootstrap
        produce_synthetic(bootstrap, topic, b"\x00" + schema_id.to_bytes(4, "big"))
        records = read_records(bootstrap, topic, expect_at_least=10, framed=True)
        secure = (*SCRAM, "--schema-registry", registry.url)
        password = {"FLOW_SASL_PASSWORD": SCRAM_PASSWORD}
        runs = {
            "spark-deltas": run_spark(sasl, topic, work / "spark-deltas", *secure, env=password),
            "spark-totals": run_spark(bootstrap, topic, work / "spark-totals", "--mode", "totals", "--confluent"),
            "flink": run_flink(sasl, topic, work / "flink", *secure, env=password),
            "spark-standalone": run_spark(
                sasl, topic, work / "spark-standalone", *secure, env=password, standalone=True
            ),
            "flink-standalone": run_flink(
                sasl, topic, work / "flink-standalone", *secure, env=password, standalone=True
            ),
        }
    return Scenario(plain, restart, records, runs, long_b, placement, ns)


# --------------------------------------------------------------------------- checks

RUNS = ["spark-deltas", "spark-totals", "flink"]
STANDALONE = {"spark-standalone": "spark-deltas", "flink-standalone": "flink"}


def _rows(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted(tuple(sorted(r.items())) for r in rows)


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", sorted(STANDALONE))
def test_standalone_copy_gives_the_same_tables(scenario: Scenario, run: str) -> None:
    """A job copied out of the repository (with contract.py and the schemas) gives the in-repo run's tables."""
    copy, original = scenario.runs[run], scenario.runs[STANDALONE[run]]
    assert len(original.windows) >= 5 and len(original.connections) >= 8
    assert _rows(copy.windows) == _rows(original.windows)
    assert _rows(copy.talkers) == _rows(original.talkers)
    assert _rows(copy.connections) == _rows(original.connections)
    assert _rows(copy.zones) == _rows(original.zones)


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_plain_totals_equal_conntrack(scenario: Scenario, run: str) -> None:
    got = scenario.runs[run].group_totals()
    expected = scenario.plain_ct
    assert len(expected) >= 5, expected
    assert {g: got.get(g) for g in expected} == expected
    # The README's rule, computed here without a job, agrees.
    rule = readme_rule(scenario.records)
    assert {g: rule.get(g) for g in expected} == expected


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_restart_totals_equal_conntrack(scenario: Scenario, run: str) -> None:
    got = scenario.runs[run].group_totals()
    expected = scenario.restart_ct
    assert len(expected) >= 3, expected
    assert not set(expected) & set(scenario.plain_ct), "the two phases must not share groups"
    assert {g: got.get(g) for g in expected} == expected
    rule = readme_rule(scenario.records)
    assert {g: rule.get(g) for g in expected} == expected

    # The premise: long_b lived through a SIGKILL and a SIGTERM, and its records are one connectionId
    # whose sequences continued across the three processes (no second sequence 0).
    lb = scenario.long_b
    recs = [r for r in scenario.records if r["sourceAddress"] == lb.client_ip and r["sourcePort"] == lb.client_port]
    assert len({r["connectionId"] for r in recs}) == 1
    assert len({r["exporterNode"] for r in recs}) == 1
    assert sorted({r["sequence"] for r in recs}) == list(range(len({r["sequence"] for r in recs})))
    assert len({r["sequence"] for r in recs}) >= 5


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_connection_totals_equal_conntrack(scenario: Scenario, run: str) -> None:
    """Per connection: the job's totals row equals the kernel's counters, once (one row, one connectionId)."""
    rows: dict[tuple[int, str, int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in scenario.runs[run].connections:
        key = (
            row["protocol"],
            row["sourceAddress"],
            row["sourcePort"],
            row["destinationAddress"],
            row["destinationPort"],
        )
        rows[key].append(row)
    entries = [*scenario.plain, *scenario.restart]
    assert len(entries) >= 8
    for e in entries:
        assert e.orig_packets is not None and e.reply_packets is not None and e.orig_bytes is not None
        (row,) = rows[ct_connection(e)]
        assert (row["forward_packets"], row["forward_bytes"]) == (e.orig_packets, e.orig_bytes), e.raw
        assert (row["reverse_packets"], row["reverse_bytes"]) == (e.reply_packets, e.reply_bytes), e.raw
        assert row["packets"] == e.orig_packets + e.reply_packets and row["bytes"] == e.orig_bytes + e.reply_bytes
        assert row["first_seen"] <= row["last_seen"] and row["exporterNode"] == "lab-node"
    # The connection that lived across three exporter processes is one connectionId with all its records.
    lb = scenario.long_b
    (lb_row,) = [
        r
        for r in scenario.runs[run].connections
        if (r["sourceAddress"], r["sourcePort"]) == (lb.client_ip, lb.client_port)
    ]
    lb_records = [r for r in scenario.records if r["connectionId"] == lb_row["connectionId"]]
    # The consumer rule counts distinct sequences (duplicates dropped); totals mode every record read.
    distinct = len({r["sequence"] for r in lb_records})
    assert lb_row["records"] == (len(lb_records) if run == "spark-totals" else distinct)


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_kubernetes_names_windows_and_top_talkers(scenario: Scenario, run: str) -> None:
    job = scenario.runs[run]
    got = job.group_totals()
    for group, counts in K8S_GROUPS.items():
        assert got.get(group) == counts, group
    # Every real window is closed, and only real groups are output (the clock's window stays open in Spark).
    got.pop(CLOCK_GROUP, None)
    assert set(got) == set(scenario.plain_ct) | set(scenario.restart_ct) | set(K8S_GROUPS)
    by_window: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in job.windows:
        start, end = row["window_start"], row["window_end"]
        assert (end - start).total_seconds() == WINDOW_S
        assert start.timestamp() % WINDOW_S == 0
        assert row["packets"] == row["forward_packets"] + row["reverse_packets"] + row["undirected_packets"]
        assert row["bytes"] == row["forward_bytes"] + row["reverse_bytes"] + row["undirected_bytes"]
        directions = (row["forward_packets"], row["forward_bytes"], row["reverse_packets"], row["reverse_bytes"])
        undirected = (row["undirected_packets"], row["undirected_bytes"])
        if (row["source"], row["destination"]) == UNDIRECTED_GROUP:
            assert directions == (0, 0, 0, 0) and undirected == (9, 900), row
        else:
            assert undirected == (0, 0), row
        by_window[start].append(row)
    # long_b's bytes spread over several windows, and still add up (checked above).
    lb = scenario.long_b
    lb_group = (scenario.placement.source(lb.client_ip), scenario.placement.destination(lb.backend_ip, lb.backend_port))
    assert sum(1 for r in job.windows if (r["source"], r["destination"]) == lb_group) >= 2
    # Top talkers: per window, the TOP groups by bytes (ties by name), ranked from 1.
    talkers: dict[Any, list[tuple[int, str, str, int, int]]] = defaultdict(list)
    for t in job.talkers:
        talkers[t["window_start"]].append((t["rank"], t["source"], t["destination"], t["packets"], t["bytes"]))
    expected = {}
    for start, rows in by_window.items():
        ranked = sorted(rows, key=lambda r: (-r["bytes"], r["source"], r["destination"]))[:TOP]
        expected[start] = [
            (i + 1, r["source"], r["destination"], r["packets"], r["bytes"]) for i, r in enumerate(ranked)
        ]
    assert {w: sorted(v) for w, v in talkers.items()} == expected
    assert any(len(rows) > TOP for rows in by_window.values()), "no window has more groups than the cut"


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_window_estimates_scale_each_connection_by_its_probability(scenario: Scenario, run: str) -> None:
    """Every window row's estimates (README: Sampling): at probability 1 (the exporters' records) the counts
    themselves with a standard error of 0; the sampling node's group (p = 1/4, two connections of 10 and 3
    packets, 1,000 and 300 bytes) is sum(y / p) = 52 and 5,200, with the error sqrt(sum((1 - p) / p^2 * y^2))
    over its connections, not its records."""
    job = scenario.runs[run]
    sampled = [r for r in job.windows if (r["source"], r["destination"]) == SAMPLED_GROUP]
    (row,) = sampled
    p = SAMPLED_P
    k = (1 - p) / (p * p)
    assert (row["packets"], row["bytes"]) == (13, 1300)
    assert row["estimated_packets"] == pytest.approx(13 / p, rel=1e-12)
    assert row["estimated_bytes"] == pytest.approx(1300 / p, rel=1e-12)
    assert row["packets_se"] == pytest.approx(math.sqrt(k * (10**2 + 3**2)), rel=1e-12)
    assert row["bytes_se"] == pytest.approx(math.sqrt(k * (1000**2 + 300**2)), rel=1e-12)
    for table in (job.windows, job.zones):
        for r in table:
            if r is row:
                continue
            if table is job.zones and (r["source_zone"], r["destination_zone"]) == (None, None):
                continue  # the sampled group's zone pair: checked below
            assert (r["estimated_packets"], r["estimated_bytes"]) == (r["packets"], r["bytes"]), r
            assert (r["packets_se"], r["bytes_se"]) == (0, 0), r
    # The null zone pair holds the sampled connections beside unsampled records: only the sampled ones scale.
    (nulls,) = [r for r in job.zones if (r["source_zone"], r["destination_zone"]) == (None, None)]
    assert nulls["estimated_packets"] == pytest.approx(nulls["packets"] - 13 + 13 / p, rel=1e-12)
    assert nulls["estimated_bytes"] == pytest.approx(nulls["bytes"] - 1300 + 1300 / p, rel=1e-12)
    assert nulls["bytes_se"] == pytest.approx(row["bytes_se"], rel=1e-12)


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_zone_pairs_equal_conntrack_by_the_zones_assigned(scenario: Scenario, run: str) -> None:
    """bytes_by_zone_pair, summed over the windows: the kernel's counters per pair of the zones the test gave."""
    job = scenario.runs[run]
    got = job.zone_totals()
    got.pop(CLOCK_ZONES, None)  # the clock's window stays open in Spark, closes in Flink
    expected = ct_zone_totals([*scenario.plain, *scenario.restart], scenario.placement)
    # Both zones, in all four pairs but b -> b (the second node is one address).
    assert set(expected) == {("zone-a", "zone-a"), ("zone-a", "zone-b"), ("zone-b", "zone-a")}, expected
    expected.update(K8S_ZONES)  # the synthetic records: null zones, one group
    assert got == expected
    undirected: dict[ZonePair, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for row in job.zones:
        p, b = undirected[(row["source_zone"], row["destination_zone"])]
        undirected[(row["source_zone"], row["destination_zone"])] = (p + row["undirected_packets"],
                                                                     b + row["undirected_bytes"])  # fmt: skip
    assert {k: v for k, v in undirected.items() if v != (0, 0)} == {(None, None): (9, 900)}  # the flag-16 record
    # The same records as flows_by_window: per window, the two tables hold the same counts.
    per_window: dict[Any, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for row in job.zones:
        assert row["packets"] == row["forward_packets"] + row["reverse_packets"] + row["undirected_packets"]
        assert row["bytes"] == row["forward_bytes"] + row["reverse_bytes"] + row["undirected_bytes"]
        p, b = per_window[row["window_start"]]
        per_window[row["window_start"]] = (p + row["packets"], b + row["bytes"])
    flows: dict[Any, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for row in job.windows:
        p, b = flows[row["window_start"]]
        flows[row["window_start"]] = (p + row["packets"], b + row["bytes"])
    assert dict(per_window) == dict(flows)


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("run", RUNS)
def test_groups_are_workloads_then_pods_then_addresses(scenario: Scenario, run: str) -> None:
    """The Deployment's pod is grouped under its Deployment, the bare pod under its own name, the node by address."""
    ns = scenario.namespace
    web, probe = f"{ns}/Deployment/web", f"{ns}/probe"
    # The premise: the exporter resolved the pod's ReplicaSet to its Deployment; the bare pod is its own
    # workload; the second node's address is no pod.
    lab = [r for r in scenario.records if r["exporterNode"] == EXPORTER_NODE]
    assert {(r["sourcePodName"], r["sourceOwnerKind"], r["sourceOwnerName"]) for r in lab} == {
        ("web-6d4cf-x7k2p", "Deployment", "web"),
        ("probe", "Pod", "probe"),
        (None, None, None),
    }
    got = scenario.runs[run].group_totals()
    # The cluster's names among the groups: the Deployment and the bare pod, never the Deployment's pod.
    assert {name for group in got for name in group if name.startswith(f"{ns}/")} == {web, probe}
    # Every connection of the Deployment's pod, in either direction, counts under the Deployment.
    expected = {g: c for g, c in {**scenario.plain_ct, **scenario.restart_ct}.items() if web in g}
    assert len(expected) == 4, expected  # to probe, from probe, to the node's address, from it
    assert {g: got.get(g) for g in expected} == expected


# --------------------------------------------------------------------------- the stateful step alone


def test_high_water_increments_survive_restart_and_resend() -> None:
    """The per-connection arithmetic of totals mode, without Spark (numpy and pandas only)."""
    import numpy as np

    def batch(marks: HighWater, rows: list[tuple[int, int, int]]) -> list[int]:
        """rows: (connection, event ms, packets); returns each row's packet increment, in row order."""
        cid = np.array([r[0] for r in rows], np.int64)
        ms = np.array([r[1] for r in rows], np.int64)
        totals = np.array([[r[2], r[2] * 100, 0, 0] for r in rows], np.int64)
        order, inc = marks.advance(cid, ms, totals)
        out = [0] * len(rows)
        for k, i in enumerate(order):
            out[i] = int(inc[k, 0])
            assert inc[k, 1] == 100 * inc[k, 0] and (inc[k] >= 0).all()
        return out

    marks = HighWater.empty()
    # Connection 7 grows 5 -> 9; connection -3 (ids are signed) appears; rows arrive out of order.
    assert batch(marks, [(7, 2000, 9), (7, 1000, 5), (-3, 1500, 4)]) == [4, 5, 4]
    marks = HighWater.from_bytes(marks.to_bytes())  # state as Spark stores it between batches
    # A restarted exporter re-exports 7 with its full totals (nothing new), then 2 more packets;
    # a redelivered duplicate adds nothing; a re-sent record with more packets adds the difference.
    assert batch(marks, [(7, 3000, 9), (7, 4000, 11), (7, 4000, 11), (-3, 3500, 6), (-3, 3500, 7)]) == [0, 2, 0, 2, 1]
    assert list(marks.ids) == [-3, 7] and [int(h[0]) for h in marks.high] == [7, 11]
    assert list(marks.last) == [3500, 4000]
    marks.expire(3600)  # -3's newest record is older: forgotten
    assert list(marks.ids) == [7]

    rng = np.random.default_rng(5)
    marks, seen = HighWater.empty(), {}
    for _ in range(20):
        n = int(rng.integers(1, 40))
        cid = rng.integers(-4, 4, n).astype(np.int64)
        ms = rng.integers(0, 10_000, n).astype(np.int64)
        totals = rng.integers(0, 1000, (n, 4)).astype(np.int64)
        order, inc = marks.advance(cid, ms, totals)
        for k, i in enumerate(order):  # brute force, in the order advance() took the rows
            high = seen.get(int(cid[i]), np.zeros(4, np.int64))
            assert (inc[k] == np.maximum(high, totals[i]) - high).all()
            seen[int(cid[i])] = np.maximum(high, totals[i])
    assert sorted(seen) == list(marks.ids)
    assert all((marks.high[j] == seen[int(c)]).all() for j, c in enumerate(marks.ids))
