"""Kubernetes indexes, enricher and watch protocol on made-up objects and a fake clock (no server).

The real API server tests are in tests/integration/test_k8s_enrich.py; these pin the rules: which address
belongs to which pod at which time, Service keys, label bounds, flowType, and how the watch
loop answers 410 Gone and outages.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import Configuration
from kubernetes.client.rest import ApiException

from flow_exporter.config import ConfigError, load
from flow_exporter.connection import PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.flow import FROM_EXTERNAL, INTER_NODE, INTRA_NODE, TO_EXTERNAL
from flow_exporter.k8s.cache import K8sCaches
from flow_exporter.k8s.enrich import Enricher
from flow_exporter.k8s.index import Indexes, PodIndex, ServiceIndex, pack_ip, parse_time_ns
from flow_exporter.record import K8S_FIELDS
from tests.support.fakes import NewFlow

S = 1_000_000_000  # ns per second
T0 = parse_time_ns("2026-01-01T00:00:00Z")


def ip(text: str) -> bytes:
    packed = pack_ip(text)
    assert packed is not None
    return packed


def ts(ns: int) -> str:
    """An API timestamp (whole seconds, as the server writes them) for a time in ns."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // S))


def pod(
    name: str,
    ips: list[str],
    *,
    node: str = "node-a",
    ns: str = "shop",
    uid: str | None = None,
    labels: dict[str, str] | None = None,
    created: int = T0,
    host_network: bool = False,
    phase: str = "Running",
    owner: tuple[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid or f"uid-{name}",
            "labels": labels if labels is not None else {"app": name.split("-")[0]},
            "creationTimestamp": ts(created),
            "ownerReferences": owned_by(*owner) if owner else [],
        },
        "spec": {"nodeName": node, "hostNetwork": host_network},
        "status": {"phase": phase, "podIP": ips[0] if ips else None, "podIPs": [{"ip": a} for a in ips]},
    }


def owned_by(kind: str, name: str) -> list[dict[str, Any]]:
    """ownerReferences as a controller writes them: its own reference (controller: true), and another that is not."""
    group = {"ReplicaSet": "apps/v1", "Deployment": "apps/v1", "StatefulSet": "apps/v1", "DaemonSet": "apps/v1"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "not-the-controller", "uid": "u0"},
        {"apiVersion": group.get(kind, "batch/v1"), "kind": kind, "name": name, "uid": f"u-{name}", "controller": True},
    ]


def workload_object(kind: str, name: str, owner: tuple[str, str] | None = None, ns: str = "shop") -> dict[str, Any]:
    """A ReplicaSet or Job: only its metadata matters to the owner index."""
    refs = owned_by(*owner) if owner else []
    meta = {"name": name, "namespace": ns, "uid": f"{kind}-{ns}-{name}", "ownerReferences": refs}
    return {"metadata": meta, "spec": {"replicas": 2}, "status": {"readyReplicas": 1}}


def service(name: str, cluster_ips: list[str], ports: list[dict[str, Any]], ns: str = "shop") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"svc-{name}"},
        "spec": {"clusterIP": cluster_ips[0], "clusterIPs": cluster_ips, "ports": ports},
    }


def node(
    name: str, addresses: list[str], pod_cidrs: list[str] | None = None, zone: str | None = None, uid: str = ""
) -> dict[str, Any]:
    labels = {"topology.kubernetes.io/zone": zone} if zone is not None else {}
    return {
        "metadata": {"name": name, "uid": uid or f"node-{name}", "labels": {"kubernetes.io/os": "linux", **labels}},
        "spec": {"podCIDRs": pod_cidrs or []},
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def tracked(
    src: str,
    dst: str,
    *,
    orig_dst: str | None = None,
    dport: int = 80,
    backend_port: int | None = None,
    proto: int = PROTO_TCP,
    start_ns: int = 0,
) -> NewFlow:
    fam = socket.AF_INET6 if ":" in src else socket.AF_INET
    c = Connection(
        family=fam,
        proto=proto,
        orig_src=ip(src),
        orig_dst=ip(orig_dst or dst),
        orig_sport=40000,
        orig_dport=dport,
        reply_src=ip(dst),
        reply_dst=ip(src),
        reply_sport=backend_port or dport,
        reply_dport=40000,
        start_ns=start_ns,
    )
    return NewFlow(c)


# ------------------------------------------------------------------------------ pods


def test_dual_stack_pod_resolves_by_both_addresses() -> None:
    idx = PodIndex()
    idx.upsert(pod("web-1", ["10.244.1.5", "fd00:10:244:1::5"]), now=T0)
    for a in ("10.244.1.5", "fd00:10:244:1::5"):
        info = idx.lookup(ip(a), T0 + S)
        assert info is not None and (info.name, info.namespace, info.node) == ("web-1", "shop", "node-a")
    assert idx.lookup(ip("10.244.1.6"), T0) is None
    assert len(idx) == 1


def test_pod_ip_only_in_status_pod_ip_and_update_moves_the_address() -> None:
    idx = PodIndex()
    obj = pod("web-1", ["10.244.1.5"])
    del obj["status"]["podIPs"]
    idx.upsert(obj, now=T0)
    assert idx.lookup(ip("10.244.1.5")) is not None
    obj["status"]["podIP"] = "10.244.1.9"
    idx.upsert(obj, now=T0 + 10 * S)
    assert idx.lookup(ip("10.244.1.9"), T0 + 11 * S).name == "web-1"
    # The old address was given up at T0+10s: only connections from before then are the pod's.
    assert idx.lookup(ip("10.244.1.5"), T0 + 5 * S).name == "web-1"
    assert idx.lookup(ip("10.244.1.5"), T0 + 11 * S) is None


def test_host_network_and_finished_pods_are_not_indexed() -> None:
    idx = PodIndex()
    idx.upsert(pod("kube-proxy-x", ["192.0.2.10"], host_network=True), now=T0)
    idx.upsert(pod("job-1", ["10.244.1.7"], phase="Succeeded"), now=T0)
    assert idx.lookup(ip("192.0.2.10"), T0) is None
    assert idx.lookup(ip("10.244.1.7"), T0) is None
    assert len(idx) == 2  # still counted as cached pods

    running = pod("job-2", ["10.244.1.8"])
    idx.upsert(running, now=T0)
    running["status"]["phase"] = "Failed"
    idx.upsert(running, now=T0 + 5 * S)
    assert idx.lookup(ip("10.244.1.8"), T0 + 6 * S) is None
    assert idx.lookup(ip("10.244.1.8"), T0 + 1 * S).name == "job-2"


def test_ip_reuse_resolves_by_connection_start() -> None:
    idx = PodIndex()
    old = pod("web-old", ["10.244.1.5"], created=T0)
    idx.upsert(old, now=T0)
    deleted_at = T0 + 100 * S + 700_000_000  # observed with ns precision
    idx.delete("uid-web-old", now=deleted_at)
    # The new pod's creationTimestamp is floored to the second, i.e. *before* the observed delete.
    idx.upsert(pod("web-new", ["10.244.1.5"], created=T0 + 100 * S), now=deleted_at + 300_000_000)

    assert idx.lookup(ip("10.244.1.5"), T0 + 50 * S).name == "web-old"
    assert idx.lookup(ip("10.244.1.5"), deleted_at - 1).name == "web-old"
    assert idx.lookup(ip("10.244.1.5"), deleted_at + 1).name == "web-new"
    assert idx.lookup(ip("10.244.1.5"), 0).name == "web-new"  # unknown start: the current owner


def test_reuse_seen_before_the_delete_uses_the_new_pods_timestamps() -> None:
    """After a relist the old pod's end was never seen: the new pod's start is the boundary."""
    idx = PodIndex()
    idx.upsert(pod("a", ["10.244.1.5"], created=T0), now=T0)
    idx.upsert(pod("b", ["10.244.1.5"], created=T0 + 60 * S), now=T0 + 90 * S, exact=False)
    idx.delete("uid-a", now=T0 + 95 * S, exact=False)  # relist finds it gone afterwards: no effect
    assert idx.lookup(ip("10.244.1.5"), T0 + 59 * S).name == "a"
    assert idx.lookup(ip("10.244.1.5"), T0 + 61 * S).name == "b"


def test_deleted_pod_retention_expiry() -> None:
    idx = PodIndex(retention_ns=300 * S)
    idx.upsert(pod("gone", ["10.244.1.5"]), now=T0)
    idx.delete("uid-gone", now=T0 + 10 * S)
    assert idx.lookup(ip("10.244.1.5"), T0 + 5 * S).name == "gone"  # started while it lived
    assert idx.lookup(ip("10.244.1.5"), T0 + 11 * S) is None  # started after it was gone
    assert len(idx) == 0
    assert idx.prune(T0 + 309 * S) == 0
    assert idx.lookup(ip("10.244.1.5"), T0 + 5 * S).name == "gone"
    assert idx.prune(T0 + 310 * S) == 1
    assert idx.lookup(ip("10.244.1.5"), T0 + 5 * S) is None
    assert ip("10.244.1.5") not in idx.by_ip


def test_history_is_bounded() -> None:
    idx = PodIndex(history=3)
    for k in range(10):
        idx.upsert(pod(f"p-{k}", ["10.244.1.5"], created=T0 + k * 10 * S), now=T0 + k * 10 * S)
        idx.delete(f"uid-p-{k}", now=T0 + k * 10 * S + 5 * S)
    assert len(idx.by_ip[ip("10.244.1.5")]) == 3
    assert idx.lookup(ip("10.244.1.5"), T0 + 92 * S).name == "p-9"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(2, 50)), min_size=1, max_size=4))
def test_reuse_property_each_tenure_keeps_its_connections(tenures: list[tuple[int, int]]) -> None:
    """Pods hold one address in turn (gap, then lifetime, in seconds): a connection started
    strictly inside a tenure (not in its first second, which the API's timestamps blur) is that pod's."""
    idx = PodIndex(history=4)
    t = T0
    spans = []
    for k, (gap, life) in enumerate(tenures):
        created = t + gap * S + 123_456_789
        idx.upsert(pod(f"p-{k}", ["10.244.1.5"], created=created), now=created + 50_000_000)
        ended = created + life * S
        idx.delete(f"uid-p-{k}", now=ended)
        spans.append((created + S, ended - 1, f"p-{k}"))
        t = ended
    for lo, hi, name in spans:
        for when in (lo, (lo + hi) // 2, hi):
            got = idx.lookup(ip("10.244.1.5"), when)
            assert got is not None and got.name == name


# ------------------------------------------------------------------------------ services and nodes


def test_service_lookup_by_cluster_ip_port_and_protocol() -> None:
    idx = ServiceIndex()
    ports = [
        {"name": "http", "port": 80, "targetPort": 8080},
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"port": 9000, "protocol": "TCP"},
    ]
    idx.upsert(service("web", ["10.96.0.10", "fd10:96::10"], ports))
    assert idx.lookup(ip("10.96.0.10"), 80, PROTO_TCP) == ("shop/web:80/TCP", "shop/web:http")
    assert idx.lookup(ip("fd10:96::10"), 80, PROTO_TCP) == ("shop/web:80/TCP", "shop/web:http")
    assert idx.lookup(ip("10.96.0.10"), 53, PROTO_UDP) == ("shop/web:53/UDP", "shop/web:dns")
    assert idx.lookup(ip("10.96.0.10"), 53, PROTO_TCP) is None
    assert idx.lookup(ip("10.96.0.10"), 81, PROTO_TCP) is None
    assert idx.lookup(ip("10.96.0.10"), 9000, PROTO_TCP) == ("shop/web:9000/TCP", "shop/web:")

    idx.upsert(service("web", ["10.96.0.10", "fd10:96::10"], [{"name": "https", "port": 443}]))
    assert idx.lookup(ip("10.96.0.10"), 80, PROTO_TCP) is None
    assert idx.lookup(ip("10.96.0.10"), 443, PROTO_TCP) == ("shop/web:443/TCP", "shop/web:https")
    idx.delete("svc-web")
    assert not idx.by_key and not idx.ips and len(idx) == 0


def test_headless_and_external_name_services_have_no_keys() -> None:
    idx = ServiceIndex()
    idx.upsert(service("db", ["None"], [{"port": 5432}]))
    idx.upsert({"metadata": {"name": "ext", "namespace": "shop", "uid": "x"}, "spec": {"type": "ExternalName"}})
    assert not idx.by_key and len(idx) == 2


def test_node_addresses_and_pod_cidrs() -> None:
    ix = Indexes()
    ix.nodes.upsert(node("node-a", ["192.0.2.1", "2001:db8::1"], ["10.244.1.0/24", "fd00:10:244:1::/64"]))
    ix.nodes.upsert(node("node-b", ["192.0.2.2"], ["10.244.2.0/24"]))
    assert ix.nodes.lookup(ip("192.0.2.1")) == "node-a"
    assert ix.nodes.lookup(ip("2001:db8::1")) == "node-a"
    assert ix.nodes.pod_cidr_node(ip("10.244.2.77")) == "node-b"
    assert ix.nodes.pod_cidr_node(ip("fd00:10:244:1::99")) == "node-a"
    assert ix.nodes.pod_cidr_node(ip("10.245.0.1")) is None
    ix.nodes.delete("node-node-b")
    assert ix.nodes.pod_cidr_node(ip("10.244.2.77")) is None
    assert ix.synced_counts() == {"pods": 0, "services": 0, "nodes": 1, "replicasets": 0, "jobs": 0}


# ------------------------------------------------------------------------------ enricher


@pytest.fixture
def cluster() -> Indexes:
    ix = Indexes()
    ix.load(
        "pods",
        [
            pod("client-1", ["10.244.1.2", "fd00:1::2"], labels={"app": "client", "tier": "front", "team": "x"}),
            pod("web-1", ["10.244.1.3", "fd00:1::3"]),
            pod("db-1", ["10.244.2.4"], node="node-b"),
        ],
        now=T0,
    )
    ix.load("services", [service("web", ["10.96.0.10"], [{"name": "http", "port": 80, "targetPort": 8080}])], T0)
    ix.load(
        "nodes",
        [node("node-a", ["192.0.2.1"], zone="eu-1a"), node("node-b", ["192.0.2.2"], ["10.244.2.0/24"], zone="eu-1b")],
        T0,
    )
    ix.ready.set()
    return ix


def test_meta_fields_for_a_service_connection(cluster: Indexes) -> None:
    e = Enricher(cluster, "node-a", ["app"], 4)
    tr = tracked("10.244.1.2", "10.244.1.3", orig_dst="10.96.0.10", dport=80, backend_port=8080)
    e(tr)
    assert tr.meta == {
        "sourcePodName": "client-1",
        "sourcePodNamespace": "shop",
        "sourceNodeName": "node-a",
        "sourcePodLabels": {"app": "client"},
        "destinationPodName": "web-1",
        "destinationPodNamespace": "shop",
        "destinationNodeName": "node-a",
        "destinationPodLabels": {"app": "web"},
        "destinationServicePortName": "shop/web:http",
        "destinationService": "shop/web:80/TCP",
        "sourceZone": "eu-1a",
        "destinationZone": "eu-1a",
        "sourceNodeAddress": "192.0.2.1",
        "destinationNodeAddress": "192.0.2.1",
        "sourceOwnerKind": "Pod",  # no controller: the pod is its own workload
        "sourceOwnerName": "client-1",
        "destinationOwnerKind": "Pod",
        "destinationOwnerName": "web-1",
        "flowType": INTRA_NODE,
    }
    assert set(tr.meta) == {*K8S_FIELDS, "flowType"}
    assert e.stats.lookups == 1 and e.stats.misses == 0


@pytest.mark.parametrize(
    ("src", "dst", "flow_type", "src_pod", "dst_pod", "dst_node"),
    [
        ("10.244.1.2", "10.244.1.3", INTRA_NODE, "client-1", "web-1", "node-a"),
        ("fd00:1::2", "fd00:1::3", INTRA_NODE, "client-1", "web-1", "node-a"),
        ("10.244.1.2", "10.244.2.4", INTER_NODE, "client-1", "db-1", "node-b"),
        ("10.244.1.2", "10.244.2.99", INTER_NODE, "client-1", None, "node-b"),  # by node-b's pod CIDR
        ("10.244.1.2", "203.0.113.9", TO_EXTERNAL, "client-1", None, None),
        ("203.0.113.9", "10.244.1.3", FROM_EXTERNAL, None, "web-1", "node-a"),
        ("192.0.2.1", "10.244.1.3", 0, None, "web-1", "node-a"),  # node to pod
        ("10.244.1.2", "192.0.2.2", 0, "client-1", None, "node-b"),  # pod to node
        ("10.244.1.2", "10.96.0.10", 0, "client-1", None, None),  # to a Service IP nothing DNAT'ed
    ],
)
def test_flow_type_rules(
    cluster: Indexes,
    src: str,
    dst: str,
    flow_type: int,
    src_pod: str | None,
    dst_pod: str | None,
    dst_node: str | None,
) -> None:
    tr = tracked(src, dst)
    Enricher(cluster, "node-a", ["app"], 4)(tr)
    assert tr.meta is not None
    assert (tr.meta["flowType"], tr.meta["sourcePodName"], tr.meta["destinationPodName"]) == (
        flow_type,
        src_pod,
        dst_pod,
    )
    assert tr.meta["destinationNodeName"] == dst_node


def test_two_pods_of_another_node_are_unspecified(cluster: Indexes) -> None:
    cluster.pods.upsert(pod("db-2", ["10.244.2.5"], node="node-b"), T0)
    tr = tracked("10.244.2.4", "10.244.2.5")
    Enricher(cluster, "node-a", ["app"], 4)(tr)
    assert tr.meta is not None and tr.meta["flowType"] == 0


def test_node_scope_without_pod_cidrs_does_not_claim_external(cluster: Indexes) -> None:
    """Only this node's pods are cached: an unknown address may be another node's pod."""
    cluster.scope = "node"
    e = Enricher(cluster, "node-a", ["app"], 4)
    with_cidrs = tracked("10.244.1.2", "203.0.113.9")
    e(with_cidrs)
    assert with_cidrs.meta["flowType"] == TO_EXTERNAL  # node-b's pod CIDR is known: outside it is outside
    cluster.nodes.upsert(node("node-b", ["192.0.2.2"]))  # the CIDR goes
    blind = tracked("10.244.1.2", "203.0.113.9")
    e(blind)
    assert blind.meta["flowType"] == 0 and blind.meta["sourcePodName"] == "client-1"


def test_unknown_ends_leave_meta_none_and_count_misses(cluster: Indexes) -> None:
    e = Enricher(cluster, "node-a", ["app"], 4)
    tr = tracked("198.51.100.1", "203.0.113.9")
    e(tr)
    assert tr.meta is None
    e(tracked("10.244.1.2", "203.0.113.9"))
    assert (e.stats.lookups, e.stats.misses, e.stats.source_misses, e.stats.destination_misses) == (2, 2, 1, 2)


def test_reused_ip_resolved_by_the_connections_start(cluster: Indexes) -> None:
    deleted = T0 + 100 * S
    cluster.pods.delete("uid-web-1", deleted)
    cluster.pods.upsert(pod("web-2", ["10.244.1.3"], created=deleted), deleted + S)
    e = Enricher(cluster, "node-a", ["app"], 4)
    old, new = tracked("10.244.1.2", "10.244.1.3", start_ns=deleted - S), tracked("10.244.1.2", "10.244.1.3")
    new.conn.start_ns = deleted + 2 * S
    e(old)
    e(new)
    assert old.meta["destinationPodName"] == "web-1"
    assert new.meta["destinationPodName"] == "web-2"


def test_labels_bounded_truncated_and_shared(cluster: Indexes) -> None:
    cluster.pods.upsert(pod("client-2", ["10.244.1.9"], labels={"app": "client", "tier": "front"}), T0)
    e = Enricher(cluster, "node-a", ["tier", "app", "team"], max_labels=2, max_value_len=4)
    assert e.label_keys == ("tier", "app")
    a, b = tracked("10.244.1.2", "10.244.1.3"), tracked("10.244.1.9", "10.244.1.3")
    e(a)
    e(b)
    assert a.meta["sourcePodLabels"] == {"tier": "fron", "app": "clie"}
    assert a.meta["destinationPodLabels"] == {"app": "web"}
    assert a.meta["sourcePodLabels"] is b.meta["sourcePodLabels"]  # one dict per distinct label set
    assert e.stats.truncated_labels == 4  # counted once per pod, not per record
    e(tracked("10.244.1.2", "10.244.1.3"))
    assert e.stats.truncated_labels == 4


def test_pod_index_keeps_only_wanted_label_keys() -> None:
    idx = PodIndex(keep_labels={"app"})
    idx.upsert(pod("a-1", ["10.244.1.2"], labels={"app": "a", "pod-template-hash": "abc", "x": "y"}), T0)
    idx.upsert(pod("a-2", ["10.244.1.3"], labels={"app": "a", "pod-template-hash": "def"}), T0)
    one, two = idx.lookup(ip("10.244.1.2")), idx.lookup(ip("10.244.1.3"))
    assert one.labels == {"app": "a"} and one.labels is two.labels


def test_meta_dicts_are_shared_never_mutated_and_errors_stay_inside(cluster: Indexes) -> None:
    e = Enricher(cluster, "node-a", ["app"], 4)
    a, b = tracked("10.244.1.2", "10.244.1.3"), tracked("10.244.1.2", "10.244.1.3")
    b.conn.orig_sport = 40001
    e(a)
    e(b)
    assert a.meta is b.meta  # same ends: one shared dict
    before = dict(a.meta)
    cluster.pods.upsert(pod("web-1", ["10.244.1.3", "fd00:1::3"], labels={"app": "web2"}), T0 + S)
    c = tracked("10.244.1.2", "10.244.1.3")
    e(c)
    assert c.meta is not a.meta and c.meta["destinationPodLabels"] == {"app": "web2"}
    assert a.meta == before  # what records already point to never changes (the encoder caches by id)

    class Broken:
        ready = cluster.ready
        scope = "cluster"
        services = cluster.services
        nodes = cluster.nodes
        pods = property(lambda self: 1 / 0)

    bad = Enricher(Broken(), "node-a", ["app"], 4)  # type: ignore[arg-type]
    tr2 = tracked("10.244.1.2", "10.244.1.3")
    bad(tr2)
    assert tr2.meta is None and bad.stats.errors == 1


def test_connections_seen_before_sync_are_enriched_again(cluster: Indexes) -> None:
    cluster.ready.clear()
    e = Enricher(cluster, "node-a", ["app"], 4)
    early = tracked("10.244.1.2", "10.244.2.99")
    e(early)
    cluster.pods.upsert(pod("db-9", ["10.244.2.99"], node="node-b"), T0)
    cluster.ready.set()
    e(tracked("10.244.1.2", "10.244.1.3"))
    assert early.meta["destinationPodName"] == "db-9"
    assert e.stats.reenriched == 1


# ------------------------------------------------------------------------------ config


def test_k8s_settings_defaults_and_parsing() -> None:
    cfg = load(environ={})
    assert cfg.k8s.enabled is False
    assert cfg.k8s.kubeconfig is None
    assert cfg.k8s.scope == "cluster"
    assert cfg.k8s.pod_labels == ("app", "app.kubernetes.io/name")
    assert cfg.k8s.deleted_pod_retention == 300.0
    cfg = load(
        environ={"FLOW_EXPORTER_K8S_POD_LABELS": "app, tier,example.com/team", "FLOW_EXPORTER_K8S_SCOPE": "Node"},
        overrides={"k8s.enabled": True, "k8s.deletedPodRetention": "90s"},
    )
    assert cfg.k8s.pod_labels == ("app", "tier", "example.com/team")
    assert (cfg.k8s.scope, cfg.k8s.enabled, cfg.k8s.deleted_pod_retention) == ("node", True, 90.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("k8s.scope", "everywhere"),
        ("k8s.podLabels", ["ok", "bad key"]),
        ("k8s.podLabels", ["Bad_Prefix.com/x"]),
        ("k8s.podLabels", [f"k{i}" for i in range(17)]),
        ("k8s.podLabels", 5),
        ("k8s.deletedPodRetention", "-1m"),
        ("k8s.enabled", "maybe"),
    ],
)
def test_bad_k8s_settings_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load(environ={}, overrides={key: value})
    assert info.value.key == key


# ------------------------------------------------------------------------------ watch protocol (fake API)


class FakeResponse:
    def __init__(
        self, body: bytes = b"", lines: list[dict[str, Any]] | None = None, hang: threading.Event | None = None
    ) -> None:
        self.data = body
        self._lines = lines or []
        self._hang = hang

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        blob = b"".join(json.dumps(ev).encode() + b"\n" for ev in self._lines)
        for k in range(0, len(blob), 7):  # split mid-line, as chunked transfer may
            yield blob[k : k + 7]
        if self._hang is not None:
            self._hang.wait(5)  # a quiet watch, until the test stops the caches

    def release_conn(self) -> None:
        pass


class FakeApi:
    """Scripted answers for one resource's list and watch calls, recording what was asked."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.calls: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.stop = threading.Event()

    def __call__(self, **kw: Any) -> FakeResponse:
        self.calls.append(kw)
        if not self.script:
            self.done.set()
            return FakeResponse(hang=self.stop)
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


def list_body(items: list[dict[str, Any]], rv: str, cont: str | None = None) -> FakeResponse:
    return FakeResponse(json.dumps({"metadata": {"resourceVersion": rv, "continue": cont}, "items": items}).encode())


class FakeCaches(K8sCaches):
    def __init__(self, apis: dict[str, FakeApi], **kw: Any) -> None:
        super().__init__(Configuration(), backoff_initial=0.01, backoff_max=0.05, **kw)
        self.apis = apis
        for api in apis.values():
            api.stop = self.stop_event

    def open_list(self, method: str) -> tuple[Any, Any]:
        resource = {name: name for name in self.apis} | {
            "list_pod_for_all_namespaces": "pods",
            "list_service_for_all_namespaces": "services",
            "list_node": "nodes",
            "list_replica_set_for_all_namespaces": "replicasets",
            "list_job_for_all_namespaces": "jobs",
        }
        return self.apis[resource[method]], lambda: None


def run_fake(pods: list[Any], caplog: pytest.LogCaptureFixture, **kw: Any) -> tuple[FakeCaches, FakeApi]:
    api = FakeApi(pods)
    quiet = ("services", "nodes", "replicasets", "jobs")
    apis = {"pods": api} | {name: FakeApi([list_body([], "1")]) for name in quiet}
    caches = FakeCaches(apis, **kw)
    with caplog.at_level(logging.INFO, logger="flow_exporter.k8s.cache"):
        caches.start()
        for each in apis.values():  # every script played to its end (a quiet watch)
            assert each.done.wait(10), each.calls
        caches.stop()
    return caches, api


def test_watch_follows_events_bookmarks_and_relists_on_410_event(caplog: pytest.LogCaptureFixture) -> None:
    a, b = pod("a", ["10.244.1.2"]), pod("b", ["10.244.1.3"])
    script = [
        list_body([a], "10", cont="page2"),
        list_body([b], "10"),
        FakeResponse(
            lines=[
                {"type": "DELETED", "object": {**a, "metadata": {**a["metadata"], "resourceVersion": "11"}}},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
                {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}},
            ]
        ),
        list_body([b, pod("c", ["10.244.1.4"])], "20"),
    ]
    caches, api = run_fake(script, caplog, node_name="node-a", scope="node")
    lists = [c for c in api.calls if not c.get("watch")]
    watches = [c for c in api.calls if c.get("watch")]
    assert [c["_continue"] for c in lists] == [None, "page2", None]
    assert all(c["field_selector"] == "spec.nodeName=node-a" for c in api.calls)
    assert watches[0]["resource_version"] == "10" and watches[0]["allow_watch_bookmarks"] is True
    assert watches[1]["resource_version"] == "20"
    assert caches.ready.is_set() and len(caches.pods) == 2
    assert caches.pods.lookup(ip("10.244.1.4")).name == "c"
    assert caches.stats()["pods"].expired == 1
    assert "API server synced: " in caplog.text and "0 services, 0 nodes" in caplog.text


def test_410_response_relists_and_outage_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    refused = ConnectionRefusedError(111, "Connection refused")
    script = [
        list_body([pod("a", ["10.244.1.2"])], "10"),
        refused,
        refused,
        refused,
        ApiException(status=410, reason="Gone"),
        list_body([pod("a", ["10.244.1.2"])], "30"),
    ]
    caches, api = run_fake(script, caplog)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "API server unreachable" in warnings[0].getMessage()
    assert "reachable again" in caplog.text
    assert caches.outages == 1 and caches.stats()["pods"].failures == 3
    assert [c.get("resource_version") for c in api.calls if c.get("watch")][-1] == "30"


def test_forbidden_is_logged_as_an_rbac_error_once(caplog: pytest.LogCaptureFixture) -> None:
    forbidden = ApiException(status=403, reason="Forbidden")
    caches, _ = run_fake([forbidden, forbidden, list_body([], "5")], caplog)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "RBAC" in errors[0] and "pods" in errors[0]
    assert caches.ready.is_set()


@pytest.mark.parametrize(
    ("src", "dst", "zones", "addresses"),
    [
        ("10.244.1.2", "10.244.2.4", ("eu-1a", "eu-1b"), ("192.0.2.1", "192.0.2.2")),  # pod to pod across zones
        ("10.244.1.2", "10.244.2.99", ("eu-1a", "eu-1b"), ("192.0.2.1", "192.0.2.2")),  # by node-b's pod CIDR
        ("192.0.2.2", "10.244.1.3", ("eu-1b", "eu-1a"), ("192.0.2.2", "192.0.2.1")),  # a node's own address
        ("10.244.1.2", "203.0.113.9", ("eu-1a", None), ("192.0.2.1", None)),  # outside: no node
    ],
)
def test_zones_and_node_addresses_of_each_end(
    cluster: Indexes, src: str, dst: str, zones: tuple[str | None, str | None], addresses: tuple[str | None, str | None]
) -> None:
    e = Enricher(cluster, "node-a")
    tr = tracked(src, dst)
    e(tr)
    assert tr.meta is not None
    assert (tr.meta["sourceZone"], tr.meta["destinationZone"]) == zones
    assert (tr.meta["sourceNodeAddress"], tr.meta["destinationNodeAddress"]) == addresses


def test_a_node_relabelled_or_recreated_gives_new_fields_to_new_connections(cluster: Indexes) -> None:
    """The shared meta dicts are never changed: a new zone shows in connections met after the change."""
    e = Enricher(cluster, "node-a")
    first = tracked("10.244.1.2", "10.244.2.4")
    e(first)
    cluster.nodes.upsert(node("node-b", ["192.0.2.2"], ["10.244.2.0/24"], zone="eu-1c"))
    second = tracked("10.244.1.2", "10.244.2.4")
    e(second)
    assert first.meta is not None and second.meta is not None
    assert (first.meta["destinationZone"], second.meta["destinationZone"]) == ("eu-1b", "eu-1c")
    # Recreated under its name (a new uid) before the old object's DELETED is read: the new one stays.
    cluster.nodes.upsert(node("node-b", ["192.0.2.7"], ["10.244.2.0/24"], zone="eu-1a", uid="node-b-2"))
    cluster.nodes.delete("node-node-b")
    assert cluster.nodes.placed["node-b"] == ("eu-1a", "192.0.2.7")
    cluster.nodes.delete("node-b-2")
    assert "node-b" not in cluster.nodes.placed
    third = tracked("10.244.1.2", "10.244.2.4")
    e(third)
    assert third.meta is not None and third.meta["destinationZone"] is None


# ------------------------------------------------------------------------------ workload owners


@pytest.mark.parametrize(
    ("owner", "objects", "expected"),
    [
        (("ReplicaSet", "web-7d9f"), [("replicasets", "web-7d9f", ("Deployment", "web"))], ("Deployment", "web")),
        (("ReplicaSet", "bare"), [("replicasets", "bare", None)], ("ReplicaSet", "bare")),  # no Deployment
        (("ReplicaSet", "unseen"), [], ("ReplicaSet", "unseen")),  # its ReplicaSet not listed (yet)
        (("Job", "backup-29001"), [("jobs", "backup-29001", ("CronJob", "backup"))], ("CronJob", "backup")),
        (("Job", "once"), [("jobs", "once", None)], ("Job", "once")),
        (("StatefulSet", "db"), [], ("StatefulSet", "db")),
        (("DaemonSet", "agent"), [], ("DaemonSet", "agent")),
        (("Rollout", "canary"), [], ("Rollout", "canary")),  # another controller's kind, as it names itself
        (None, [], ("Pod", "web-1")),
    ],
)
def test_workload_of_a_pod(
    owner: tuple[str, str] | None, objects: list[tuple[str, str, tuple[str, str] | None]], expected: tuple[str, str]
) -> None:
    ix = Indexes()
    for kind, name, up in objects:
        ix.load(kind, [workload_object("ReplicaSet" if kind == "replicasets" else "Job", name, up)], T0)
    ix.load("pods", [pod("web-1", ["10.244.1.3"], owner=owner)], T0)
    ix.load("pods", [pod("client-1", ["10.244.1.2"])], T0)
    ix.ready.set()
    tr = tracked("10.244.1.2", "10.244.1.3")
    Enricher(ix, "node-a")(tr)
    assert tr.meta is not None
    assert (tr.meta["destinationOwnerKind"], tr.meta["destinationOwnerName"]) == expected
    assert (tr.meta["sourceOwnerKind"], tr.meta["sourceOwnerName"]) == ("Pod", "client-1")


def test_a_rollout_keeps_the_owner_and_a_late_replicaset_is_resolved() -> None:
    """A new ReplicaSet of the same Deployment gives its pods the same owner; a pod met before its
    ReplicaSet was listed is attributed to the ReplicaSet, and connections met after that to the Deployment."""
    ix = Indexes()
    ix.load("pods", [pod("client-1", ["10.244.1.2"])], T0)
    ix.load("pods", [pod("web-aaa-1", ["10.244.1.3"], owner=("ReplicaSet", "web-aaa"))], T0)
    ix.ready.set()
    e = Enricher(ix, "node-a")
    early = tracked("10.244.1.2", "10.244.1.3")
    e(early)
    ix.load("replicasets", [workload_object("ReplicaSet", "web-aaa", ("Deployment", "web"))], T0)
    later = tracked("10.244.1.2", "10.244.1.3")
    e(later)
    # the rollout: a new ReplicaSet, its pod takes the address over
    ix.load("replicasets", [workload_object("ReplicaSet", "web-bbb", ("Deployment", "web"))], T0)
    ix.pods.delete("uid-web-aaa-1", T0 + 10**9)
    ix.load("pods", [pod("web-bbb-1", ["10.244.1.3"], owner=("ReplicaSet", "web-bbb"), created=T0 + 2)], T0 + 2 * 10**9)
    rolled = tracked("10.244.1.2", "10.244.1.3", start_ns=T0 + 3 * 10**9)
    e(rolled)
    metas = [t.meta for t in (early, later, rolled) if t.meta is not None]
    owners = [(m["destinationOwnerKind"], m["destinationOwnerName"]) for m in metas]
    assert owners == [("ReplicaSet", "web-aaa"), ("Deployment", "web"), ("Deployment", "web")]
    assert rolled.meta is not None and rolled.meta["destinationPodName"] == "web-bbb-1"


def test_owner_index_keeps_only_the_controller_and_counts_changes() -> None:
    ix = Indexes()
    rs = workload_object("ReplicaSet", "web-aaa", ("Deployment", "web"))
    ix.replicasets.apply("ADDED", rs, T0)
    v = ix.replicasets.version
    ix.replicasets.apply("MODIFIED", {**rs, "status": {"readyReplicas": 2}}, T0)  # a status update
    assert ix.replicasets.version == v and ix.replicasets.get("shop", "web-aaa") == ("Deployment", "web")
    ix.replicasets.apply("DELETED", rs, T0)
    assert ix.replicasets.get("shop", "web-aaa") is None and ix.replicasets.version == v + 1
    assert len(ix.replicasets) == 0 and not ix.replicasets.owners
    # Recreated under its name (a new uid) before the old object's DELETED is read: the new one stays.
    ix.replicasets.apply("ADDED", rs, T0)
    again = workload_object("ReplicaSet", "web-aaa", ("Deployment", "web-v2"))
    again["metadata"]["uid"] = "ReplicaSet-shop-web-aaa-2"
    ix.replicasets.apply("ADDED", again, T0)
    ix.replicasets.apply("DELETED", rs, T0)
    assert ix.replicasets.get("shop", "web-aaa") == ("Deployment", "web-v2") and len(ix.replicasets) == 1
