"""Two nodes, two exporters, one count: Community ID, reporter and the consumer rule on real parts.

Two labs are two "nodes": each node namespace has its own conntrack table and its own exporter
process (``--node-name node-a`` / ``node-b``, enrichment from a real kube-apiserver where the
pods run on those nodes), and a cable between the nodes routes each one's pod range to the
other (``Lab.link``). Traffic between pods of different nodes passes both tables, so both
exporters report it; traffic inside one node is in one table only.

Ground truth is ``conntrack -L`` of both nodes. The checks: both exporters report each
inter-node connection with the same Community ID (equal to the ``communityid`` package's for the
tuple) and reporter 1 on the source's node, 2 on the destination's; the Spark job, applying the
README's rule, has each connection once, with the kernel's counters, and per pod pair the sum of
the connections once, not twice.
"""

from __future__ import annotations

import ipaddress
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import communityid
import pytest
import yaml
from kubernetes import client

from devtools.apiserver import ApiServer
from devtools.kafka import KafkaBroker
from devtools.lab import CtEntry, Lab, Pod
from tests.support.downstream import JobRun, ct_connection, produce_synthetic, run_spark
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.paths import REPO
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.spark]

NS = "two"
NODES = ("node-a", "node-b")


def pod_name(node: str, pod: Pod) -> str:
    return f"{node[-1]}-{pod.name}"  # a-p0, b-p1, ...


def cluster(api: ApiServer, labs: dict[str, Lab]) -> Path:
    """Nodes, and pods with the labs' addresses on them; the exporter's RBAC from k8s/; its kubeconfig."""
    manifests = REPO / "k8s"
    api.apply(
        d for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml")
        for d in yaml.safe_load_all((manifests / name).read_text())
    )  # fmt: skip
    core = client.CoreV1Api(api.api_client())
    core.create_namespace({"metadata": {"name": NS}})
    for node, lab in labs.items():
        core.create_node({"metadata": {"name": node}})
        for pod in lab.pods:
            name = pod_name(node, pod)
            spec = {"nodeName": node, "containers": [{"name": "c", "image": "registry.example/app:1"}]}
            core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": spec})
            status = {"phase": "Running", "podIP": pod.ipv4, "podIPs": [{"ip": pod.ipv4}, {"ip": pod.ipv6}]}
            core.patch_namespaced_pod_status(name, NS, {"status": status})
    return api.service_account_kubeconfig("flow-exporter", "flow-exporter")


def wait_for_log(path: Path, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in {path}:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)


@dataclass
class TwoNodes:
    tables: dict[str, list[CtEntry]]  # node -> conntrack -L just before its exporter stopped
    pods: dict[str, str]  # pod address -> two/<pod name>
    records: list[dict[str, Any]]
    job: JobRun
    inter: list[tuple[int, str, int, str, int]]  # the connections between nodes (ct_connection keys)

    def truth(self) -> dict[tuple[int, str, int, str, int], CtEntry]:
        """Every connection once: the entry of the node it started on (the same counts as the other's)."""
        out: dict[tuple[int, str, int, str, int], CtEntry] = {}
        for node in NODES:
            for e in self.tables[node]:
                out.setdefault(ct_connection(e), e)
        return out


@pytest.fixture(scope="module")
def two_nodes(
    kafka_broker: KafkaBroker, apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoNodes]:
    work = tmp_path_factory.mktemp("two-nodes")
    topic = f"two-nodes-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    with Lab("nodea", pods=2) as lab_a, Lab("nodeb", pods=2) as lab_b:
        lab_a.link(lab_b)
        labs = {"node-a": lab_a, "node-b": lab_b}
        kubeconfig = cluster(apiserver, labs)
        exporters = {}
        try:
            for node, lab in labs.items():
                log = work / f"exporter-{node}.log"
                exporters[node] = (
                    start_exporter(
                        lab, kafka_broker.bootstrap, topic, log,
                        "--node-name", node, "--set", "k8s.enabled=true", "--set", f"k8s.kubeconfig={kubeconfig}",
                    ),
                    log,
                )  # fmt: skip
            for _, log in exporters.values():
                wait_for_log(log, "API server synced")
            (a0, a1), (b0, b1) = lab_a.pods, lab_b.pods
            # Between nodes, both ways, TCP over IPv4 and IPv6, UDP; within each node.
            lab_a.tcp_exchange(a0, b0, 9000, 1200, 30_000)
            lab_b.tcp_exchange(b1, a1, 9001, 800, 4_000, family=6)
            lab_a.udp_exchange(a1, b1, 5300, 100, 300, count=3)
            long_ab = lab_a.open_tcp(a1, b0, 7000)
            for _ in range(3):
                long_ab.send(2000)
                time.sleep(1)
            lab_a.tcp_exchange(a0, a1, 9002, 500, 700)
            lab_b.tcp_exchange(b0, b1, 9003, 600, 900)
            long_ab.close()
            time.sleep(2.5)  # a poll after the last packet
            tables = {node: list(lab.conntrack_entries()) for node, lab in labs.items()}
        finally:
            for proc, log in exporters.values():
                if proc.poll() is None:
                    stop_exporter(proc, log)
        inter = [ct_connection(e) for e in tables["node-a"]]
        inter = [k for k in inter if k in {ct_connection(e) for e in tables["node-b"]}]
        pods = {}
        for node, lab in labs.items():
            for pod in lab.pods:
                pods[pod.ipv4] = pods[pod.ipv6] = f"{NS}/{pod_name(node, pod)}"
    produce_synthetic(kafka_broker.bootstrap, topic, clock_only=True)
    records = [r for r in read_records(kafka_broker.bootstrap, topic, expect_at_least=8) if r["exporterNode"] in NODES]
    job = run_spark(kafka_broker.bootstrap, topic, work / "spark", min_batches=2)
    yield TwoNodes(tables, pods, records, job, inter)


def record_connection(r: dict[str, Any]) -> tuple[int, str, int, str, int]:
    return (r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"], r["destinationPort"])


def test_both_nodes_report_inter_node_connections_with_one_community_id(two_nodes: TwoNodes) -> None:
    """The premise of the rule: two reports per inter-node connection, told apart by reporter, joined by ID."""
    assert len(two_nodes.inter) == 4, two_nodes.inter  # a0->b0, b1->a1, a1->b1 (UDP), a1->b0
    by_conn: dict[tuple[int, str, int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in two_nodes.records:
        by_conn[record_connection(r)].append(r)
    for key in two_nodes.inter:
        recs = by_conn[key]
        proto, src, sport, dst, dport = key
        reference = communityid.CommunityID().calc(communityid.FlowTuple(proto, src, dst, sport, dport))
        assert {r["communityId"] for r in recs} == {reference}
        assert {r["flowType"] for r in recs} == {2}
        source_node = "node-a" if two_nodes.pods[src].startswith(f"{NS}/a-") else "node-b"
        roles = {(r["exporterNode"], r["reporter"]) for r in recs}
        dest_node = NODES[1 - NODES.index(source_node)]
        assert roles == {(source_node, 1), (dest_node, 2)}, roles
        assert len({r["connectionId"] for r in recs}) == 2  # one per exporter
    intra = [k for k in two_nodes.truth() if k not in two_nodes.inter]
    assert len(intra) == 2
    for key in intra:
        assert {(r["flowType"], r["reporter"]) for r in by_conn[key]} == {(1, 3)}


def test_spark_counts_each_connection_once(two_nodes: TwoNodes) -> None:
    truth = two_nodes.truth()
    rows: dict[tuple[int, str, int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in two_nodes.job.connections:
        if row["exporterNode"] in NODES:
            rows[record_connection(row)].append(row)
    assert set(rows) == set(truth)
    for key, e in truth.items():
        (row,) = rows[key]  # once, not twice
        assert (row["forward_packets"], row["forward_bytes"]) == (e.orig_packets, e.orig_bytes), e.raw
        assert (row["reverse_packets"], row["reverse_bytes"]) == (e.reply_packets, e.reply_bytes), e.raw
    # Per pod pair (the windows, summed): the connections' counts once.
    expected: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for e in truth.values():
        src = two_nodes.pods[str(ipaddress.ip_address(e.orig_src))]
        dst = two_nodes.pods[str(ipaddress.ip_address(e.reply_src))]
        p, b = expected[(src, dst)]
        assert e.orig_packets is not None and e.reply_packets is not None
        assert e.orig_bytes is not None and e.reply_bytes is not None
        expected[(src, dst)] = (p + e.orig_packets + e.reply_packets, b + e.orig_bytes + e.reply_bytes)
    got = {k: v for k, v in two_nodes.job.group_totals().items() if k[0].startswith(f"{NS}/")}
    assert got == dict(expected)
