"""Kubernetes enrichment against a real kube-apiserver, as the exporter's own ServiceAccount.

The exporter's RBAC from ``k8s/`` is applied and the caches run with a token of that account,
so a permission the manifests lack fails here as it would in a cluster. The end-to-end tests
run the exporter as a subprocess on lab traffic (real conntrack, real DNAT for the Service,
real Kafka) and read the records back with the reference Avro decoder.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from devtools.apiserver import ApiServer
from devtools.lab import Lab
from flow_exporter.connection import PROTO_TCP, Connection
from flow_exporter.flow import INTER_NODE, INTRA_NODE
from flow_exporter.k8s.cache import RESOURCES, K8sCaches, load_configuration
from flow_exporter.k8s.enrich import Enricher
from flow_exporter.k8s.index import pack_ip
from flow_exporter.record import META_FIELDS
from tests.support.cluster import controlled_by, create, ensure_node, make_pod, pod_template
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.fakes import NewFlow
from tests.support.paths import REPO
from tests.support.records import by_connection, read_records

K8S_DIR = REPO / "k8s"
EXPORTER_NODE = "lab-node"  # the --node-name start_exporter gives the exporter
OTHER_NODE = "lab-node-b"


# ------------------------------------------------------------------------------ fixtures and helpers


def manifests(*names: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in names:
        docs += [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def sa_kubeconfig(apiserver: ApiServer) -> Path:
    """The exporter's namespace, ServiceAccount and RBAC from k8s/, and a kubeconfig acting as it."""
    apiserver.apply(manifests("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"))
    return apiserver.service_account_kubeconfig("flow-exporter", "flow-exporter")


@pytest.fixture
def core(apiserver: ApiServer) -> Iterator[client.CoreV1Api]:
    with apiserver.api_client() as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    """A fresh namespace; its pods are deleted afterwards so their IPs don't linger in later tests."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    with contextlib.suppress(ApiException):
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)


def delete_pod(core: client.CoreV1Api, ns: str, name: str) -> None:
    core.delete_namespaced_pod(name, ns, grace_period_seconds=0)  # no kubelet would confirm a graceful one


def make_service(core: client.CoreV1Api, ns: str, name: str, port: int, target: int) -> tuple[str, str]:
    """A dual-stack Service with ClusterIPs picked by us (so the lab's DNAT can use the same VIPs)."""
    rng = random.Random()
    for _ in range(20):
        v4 = f"10.96.{rng.randint(100, 250)}.{rng.randint(2, 254)}"
        v6 = f"fd10:96::{rng.randint(0x100, 0xFFFF):x}"
        body = {
            "metadata": {"name": name},
            "spec": {
                "ipFamilyPolicy": "RequireDualStack",
                "clusterIP": v4,
                "clusterIPs": [v4, v6],
                "ports": [{"name": "http", "port": port, "targetPort": target}],
            },
        }
        try:
            svc = core.create_namespaced_service(ns, body)
        except ApiException as exc:
            why = exc.body.decode() if isinstance(exc.body, bytes) else str(exc.body)  # bytes before client 36
            if exc.status == 422 and "allocated" in why:  # address taken: pick again
                continue
            raise
        ips = client.ApiClient().sanitize_for_serialization(svc)["spec"]["clusterIPs"]  # stable across versions
        return ips[0], ips[1]
    raise AssertionError("no free ClusterIP found")


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_log(log: Path, text: str, timeout: float = 20.0, count: int = 1) -> None:
    wait_for(lambda: log.read_text().count(text) >= count, timeout, f"{text!r} in the exporter log")


def until_next_poll(log: Path, interval: float) -> float:
    """Seconds to the exporter's next poll: polls tick every ``interval`` from the first one, logged."""
    line = next(x for x in log.read_text().splitlines() if "first poll" in x)
    first = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return interval - (time.time() - first) % interval


def conn_to(src: str, dst: str, start_ns: int) -> NewFlow:
    fam = socket.AF_INET6 if ":" in src else socket.AF_INET
    s, d = pack_ip(src), pack_ip(dst)
    assert s is not None and d is not None
    c = Connection(fam, PROTO_TCP, s, d, 40000, 80, d, s, 80, 40000, start_ns=start_ns)
    return NewFlow(c)


def subnet() -> int:
    """A random third octet for a test's addresses (192.0.2.x belongs to the lab-node Nodes)."""
    return random.randint(3, 250)


# ------------------------------------------------------------------------------ caches as the ServiceAccount


def test_caches_list_and_watch_as_the_exporter_service_account(
    apiserver: ApiServer, sa_kubeconfig: Path, core: client.CoreV1Api, namespace: str
) -> None:
    k = subnet()
    node_a, node_b = f"{namespace}-a", f"{namespace}-b"
    ensure_node(core, node_a, f"192.0.{k}.1", [f"10.250.{k}.0/24"])
    ensure_node(core, node_b, f"192.0.{k}.2", [f"10.251.{k}.0/24"])
    web_ips = [f"10.250.{k}.2", f"fd00:250:{k}::2"]
    make_pod(core, namespace, "web", node_a, web_ips, {"app": "web", "pod-template-hash": "x1"})
    make_pod(core, namespace, "db", node_b, [f"10.251.{k}.3"])
    make_pod(core, namespace, "agent", node_a, [f"192.0.{k}.1"], host_network=True)
    vip4, vip6 = make_service(core, namespace, "web", 80, 8080)

    caches = K8sCaches(
        load_configuration(str(sa_kubeconfig)), label_keys=["app"], backoff_initial=0.1, backoff_max=0.5
    ).start()
    try:
        assert caches.wait_ready(15), caches.stats()
        assert all(s.failures == 0 for s in caches.stats().values()), caches.stats()  # no 403 anywhere
        for a in web_ips:
            info = caches.pods.lookup(pack_ip(a), time.time_ns())
            assert info is not None and (info.name, info.namespace, info.node) == ("web", namespace, node_a)
            assert info.labels == {"app": "web"}
        assert caches.pods.lookup(pack_ip(f"192.0.{k}.1")) is None  # hostNetwork pod: the node's address
        assert caches.nodes.lookup(pack_ip(f"192.0.{k}.1")) == node_a
        web = (f"{namespace}/web:80/TCP", f"{namespace}/web:http")
        assert caches.services.lookup(pack_ip(vip4), 80, PROTO_TCP) == web
        assert caches.services.lookup(pack_ip(vip6), 80, PROTO_TCP) is not None

        # The watch: a deleted pod's IP reused by a new pod, resolved by connection start time.
        before = time.time_ns()
        time.sleep(0.05)
        delete_pod(core, namespace, "web")
        wait_for(lambda: caches.pods.lookup(pack_ip(web_ips[0]), time.time_ns()) is None, what="delete seen")
        make_pod(core, namespace, "web-2", node_a, web_ips)
        wait_for(lambda: caches.pods.lookup(pack_ip(web_ips[0]), time.time_ns()), what="new pod seen")
        after = time.time_ns()
        enrich = Enricher(caches, node_a, ["app"], 4)
        old, new = conn_to(web_ips[0], f"10.251.{k}.3", before), conn_to(web_ips[1], web_ips[1], after)
        enrich(old)
        enrich(new)
        assert old.meta["sourcePodName"] == "web" and old.meta["flowType"] == INTER_NODE
        assert old.meta["destinationPodName"] == "db" and old.meta["destinationNodeName"] == node_b
        assert new.meta["sourcePodName"] == "web-2" and new.meta["flowType"] == INTRA_NODE
    finally:
        caches.stop()

    # Node scope: only this node's pods are listed; another node's pod is known by its pod CIDR.
    local = K8sCaches(load_configuration(str(sa_kubeconfig)), scope="node", node_name=node_a).start()
    try:
        assert local.wait_ready(15)
        assert local.pods.lookup(pack_ip(web_ips[0])).name == "web-2"
        assert local.pods.lookup(pack_ip(f"10.251.{k}.3")) is None
        tr = conn_to(web_ips[0], f"10.251.{k}.3", time.time_ns())
        Enricher(local, node_a, ["app"], 4)(tr)
        assert tr.meta["flowType"] == INTER_NODE and tr.meta["destinationNodeName"] == node_b
        assert tr.meta["destinationPodName"] is None
    finally:
        local.stop()


# ------------------------------------------------------------------------------ RBAC


def test_cluster_role_grants_exactly_what_the_caches_read() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in manifests("rbac.yaml", "serviceaccount.yaml")}
    role = docs[("ClusterRole", "flow-exporter")]
    granted = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}  # no resourceNames, no nonResourceURLs
        assert sorted(rule["verbs"]) == ["list", "watch"]  # list+watch caches never get one object
        granted |= {(group, resource) for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == {(group, name) for name, group, _ in RESOURCES}
    binding = docs[("ClusterRoleBinding", "flow-exporter")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "flow-exporter",
    }
    sa = docs[("ServiceAccount", "flow-exporter")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    ]
    assert set(docs) == {
        ("ClusterRole", "flow-exporter"),
        ("ClusterRoleBinding", "flow-exporter"),
        ("ServiceAccount", "flow-exporter"),
    }


def test_service_account_may_read_and_nothing_more(apiserver: ApiServer, sa_kubeconfig: Path) -> None:
    with apiserver.api_client(sa_kubeconfig) as api:
        core = client.CoreV1Api(api)
        core.list_pod_for_all_namespaces(limit=1)
        core.list_service_for_all_namespaces(limit=1)
        core.list_node(limit=1)
        apps, batch = client.AppsV1Api(api), client.BatchV1Api(api)
        apps.list_replica_set_for_all_namespaces(limit=1)
        batch.list_job_for_all_namespaces(limit=1)
        denied: list[Callable[[], Any]] = [
            lambda: apps.list_deployment_for_all_namespaces(limit=1),  # the ReplicaSet names its Deployment
            lambda: batch.list_cron_job_for_all_namespaces(limit=1),
            lambda: apps.read_namespaced_replica_set("x", "flow-exporter"),
            lambda: core.create_namespaced_pod(
                "flow-exporter",
                {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "pause"}]}},
            ),
            lambda: core.list_secret_for_all_namespaces(limit=1),
            lambda: core.read_namespaced_secret("x", "flow-exporter"),
            lambda: core.list_config_map_for_all_namespaces(limit=1),
            lambda: core.list_namespace(limit=1),
            lambda: core.delete_node("lab-node"),
            lambda: core.patch_namespaced_pod_status("x", "flow-exporter", {"status": {}}),
            lambda: client.DiscoveryV1Api(api).list_endpoint_slice_for_all_namespaces(limit=1),
        ]
        for call in denied:
            with pytest.raises(ApiException) as info:
                call()
            assert info.value.status == 403, info.value.reason


# ------------------------------------------------------------------------------ end to end


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(pods=4) as lab:
        yield lab


def k8s_flags(kubeconfig: Path) -> list[str]:
    return [
        *("--set", "k8s.enabled=true", "--set", f"k8s.kubeconfig={kubeconfig}", "--set", "retry.maxBackoff=1s"),
        *("--set", "metrics.port=0"),  # other exporters may run on this machine meanwhile
    ]


def first_of(groups: dict[int, list[dict]], client_ip: str, client_port: int) -> dict:
    hits = [r for r in groups.values() if r[0]["sourceAddress"] == client_ip and r[0]["sourcePort"] == client_port]
    assert len(hits) == 1, f"{len(hits)} connections from {client_ip}:{client_port}"
    recs = hits[0]
    for r in recs[1:]:  # every record of a connection carries the same metadata
        assert all(r[k] == recs[0][k] for k in (*META_FIELDS, "flowType")), (r, recs[0])
    return recs[0]


@pytest.mark.lab
@pytest.mark.kafka
def test_records_carry_pods_services_nodes_and_flow_type(
    apiserver: ApiServer,
    sa_kubeconfig: Path,
    core: client.CoreV1Api,
    namespace: str,
    lab: Lab,
    kafka_broker: Any,
    kafka_topic: str,
    tmp_path: Path,
) -> None:
    p0, p1, p2, p3 = lab.pods  # p3 is no pod of the cluster: "outside"
    ensure_node(core, EXPORTER_NODE, "192.0.2.1", zone="zone-a")
    ensure_node(core, OTHER_NODE, "192.0.2.2", zone="zone-b")
    make_pod(core, namespace, "client", EXPORTER_NODE, [p0.ipv4, p0.ipv6])
    make_pod(core, namespace, "web", EXPORTER_NODE, [p1.ipv4, p1.ipv6], {"app": "web", "tier": "front"})
    make_pod(core, namespace, "db-old", OTHER_NODE, [p2.ipv4, p2.ipv6], {"app": "db"})
    vip4, vip6 = make_service(core, namespace, "web", 80, 8080)
    svc = lab.add_service(vip4, 80, p1, 8080, vip6=vip6)

    log = tmp_path / "exporter.log"
    # No conntrack events and a slower poll: connections are first seen at a poll, after the pod swap
    # below, so their pods must come from the IP history by start time.
    flags = [*k8s_flags(sa_kubeconfig), "--set", "conntrack.events=false", "--set", "conntrack.pollInterval=4s"]
    flags += ["--set", "clusterName=lab-cluster"]
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log, *flags)
    try:
        wait_log(log, "API server synced")
        if until_next_poll(log, 4.0) < 3.0:  # what follows takes ~1.5 s: all of it between two polls
            time.sleep(until_next_poll(log, 4.0) + 0.3)
        intra4 = lab.tcp_exchange(p0, p1, 9000, 300, 3000, family=4)
        intra6 = lab.tcp_exchange(p0, p1, 9000, 300, 3000, family=6)
        inter = lab.tcp_exchange(p0, p2, 9001, 100, 100)
        outside = lab.tcp_exchange(p0, p3, 9002, 100, 100)
        inbound = lab.tcp_exchange(p3, p1, 9003, 100, 100)
        via_svc4 = lab.tcp_exchange(p0, svc, 80, 200, 2000, family=4)
        via_svc6 = lab.tcp_exchange(p0, svc, 80, 200, 2000, family=6)
        old_long = lab.open_tcp(p0, p2, 7000)  # db-old's, started before it is deleted
        old_long.send(100)

        delete_pod(core, namespace, "db-old")
        make_pod(core, namespace, "db-new", EXPORTER_NODE, [p2.ipv4, p2.ipv6], {"app": "db"})
        time.sleep(0.5)  # the watch delivers both events
        reused = lab.tcp_exchange(p0, p2, 9001, 100, 100)  # the same address, now db-new's
        old_long.send(100)
        time.sleep(until_next_poll(log, 4.0) + 0.5)  # one poll sees them all; shutdown sends the rest
        old_long.close()
        text = stop_exporter(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in text
    assert "API server unreachable" not in text
    groups = by_connection(read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=9))
    ns = namespace

    for ex in (intra4, intra6):
        r = first_of(groups, ex.client_ip, ex.client_port)
        assert (r["sourcePodName"], r["sourcePodNamespace"], r["sourceNodeName"]) == ("client", ns, EXPORTER_NODE)
        assert (r["destinationPodName"], r["destinationPodNamespace"]) == ("web", ns)
        assert r["destinationNodeName"] == EXPORTER_NODE
        assert r["sourcePodLabels"] == {"app": "client"} and r["destinationPodLabels"] == {"app": "web"}
        assert r["destinationService"] is None and r["flowType"] == 1
        assert (r["sourceZone"], r["destinationZone"]) == ("zone-a", "zone-a")
        assert (r["sourceNodeAddress"], r["destinationNodeAddress"]) == ("192.0.2.1", "192.0.2.1")
        assert r["clusterName"] == "lab-cluster"

    r = first_of(groups, inter.client_ip, inter.client_port)
    assert (r["destinationPodName"], r["destinationNodeName"], r["flowType"]) == ("db-old", OTHER_NODE, 2)
    assert (r["sourceZone"], r["destinationZone"]) == ("zone-a", "zone-b")  # an inter-zone connection
    assert (r["sourceNodeAddress"], r["destinationNodeAddress"]) == ("192.0.2.1", "192.0.2.2")

    r = first_of(groups, outside.client_ip, outside.client_port)
    assert (r["sourcePodName"], r["destinationPodName"], r["destinationNodeName"], r["flowType"]) == (
        "client",
        None,
        None,
        3,
    )
    assert (r["sourceZone"], r["destinationZone"], r["destinationNodeAddress"]) == ("zone-a", None, None)
    r = first_of(groups, inbound.client_ip, inbound.client_port)
    assert (r["sourcePodName"], r["destinationPodName"], r["flowType"]) == (None, "web", 4)

    for ex, vip in ((via_svc4, vip4), (via_svc6, vip6)):
        r = first_of(groups, ex.client_ip, ex.client_port)
        assert r["originalDestinationAddress"] == vip
        assert r["destinationService"] == f"{ns}/web:80/TCP"
        assert r["destinationServicePortName"] == f"{ns}/web:http"
        assert (r["destinationPodName"], r["destinationPort"], r["flowType"]) == ("web", 8080, 1)

    r = first_of(groups, old_long.client_ip, old_long.client_port)
    assert (r["destinationPodName"], r["destinationNodeName"], r["flowType"]) == ("db-old", OTHER_NODE, 2)
    r = first_of(groups, reused.client_ip, reused.client_port)
    assert (r["destinationPodName"], r["destinationNodeName"], r["flowType"]) == ("db-new", EXPORTER_NODE, 1)


@pytest.mark.lab
@pytest.mark.kafka
def test_export_survives_api_server_outage_and_caches_catch_up(
    apiserver: ApiServer,
    sa_kubeconfig: Path,
    core: client.CoreV1Api,
    namespace: str,
    lab: Lab,
    kafka_broker: Any,
    kafka_topic: str,
    tmp_path: Path,
) -> None:
    p0, p1, _, p3 = lab.pods
    ensure_node(core, EXPORTER_NODE, "192.0.2.1")
    make_pod(core, namespace, "client", EXPORTER_NODE, [p0.ipv4, p0.ipv6])
    make_pod(core, namespace, "web", EXPORTER_NODE, [p1.ipv4, p1.ipv6])
    log = tmp_path / "exporter.log"
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log, *k8s_flags(sa_kubeconfig))
    try:
        wait_log(log, "API server synced")
        before = lab.tcp_exchange(p0, p1, 9000, 100, 100)
        apiserver.stop(timeout=2)  # a kill, in effect: it would wait for our open watches otherwise
        try:
            wait_log(log, "API server unreachable")
            during = [lab.tcp_exchange(p0, p1, 9000, 100, 100) for _ in range(3)]
            time.sleep(2)  # several reconnect attempts (backoff up to 1 s), still one warning
        finally:
            apiserver.start()
        wait_log(log, "API server reachable again")
        make_pod(core, namespace, "late", EXPORTER_NODE, [p3.ipv4, p3.ipv6])
        time.sleep(1)  # the resumed watch (or relist) brings it in
        after = lab.tcp_exchange(p0, p3, 9001, 100, 100)
        time.sleep(1.5)  # a poll or the DESTROY event; shutdown sends what is left
        text = stop_exporter(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in text
    assert text.count("API server unreachable") == 1, text
    groups = by_connection(read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=5))
    for ex in (before, *during):
        r = first_of(groups, ex.client_ip, ex.client_port)
        assert (r["sourcePodName"], r["destinationPodName"], r["flowType"]) == ("client", "web", 1)
    r = first_of(groups, after.client_ip, after.client_port)
    assert (r["destinationPodName"], r["destinationPodNamespace"], r["flowType"]) == ("late", namespace, 1)


@pytest.mark.lab
@pytest.mark.kafka
def test_records_carry_workload_owners_across_a_rollout(
    apiserver: ApiServer,
    sa_kubeconfig: Path,
    core: client.CoreV1Api,
    namespace: str,
    lab: Lab,
    kafka_broker: Any,
    kafka_topic: str,
    tmp_path: Path,
) -> None:
    """A Deployment (through its ReplicaSet), a StatefulSet, a DaemonSet, a CronJob (through its Job) and a
    bare pod, made as their controllers would make them (no controller runs here); then a rollout: a new
    ReplicaSet of the same Deployment whose pod takes the address over. Records name the workloads."""
    p0, p1, p2, p3 = lab.pods
    ensure_node(core, EXPORTER_NODE, "192.0.2.1", zone="zone-a")
    with apiserver.api_client() as api_client:
        apps, batch = client.AppsV1Api(api_client), client.BatchV1Api(api_client)
        ns = namespace
        selector = {"matchLabels": {"app": "web"}}
        web = create(apps, "create_namespaced_deployment", ns, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"selector": selector, "template": pod_template("web")},
        })  # fmt: skip

        def replica_set(name: str) -> dict[str, Any]:
            return create(apps, "create_namespaced_replica_set", ns, {
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": name, "ownerReferences": [controlled_by(web)]},
                "spec": {"selector": selector, "template": pod_template("web")},
            })  # fmt: skip

        rs_old = replica_set("web-7c5d8")
        db = create(apps, "create_namespaced_stateful_set", ns, {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db"},
            "spec": {"selector": {"matchLabels": {"app": "db"}}, "serviceName": "db", "template": pod_template("db")},
        })  # fmt: skip
        agent = create(apps, "create_namespaced_daemon_set", ns, {
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
            "spec": {"selector": {"matchLabels": {"app": "agent"}}, "template": pod_template("agent")},
        })  # fmt: skip
        cron = create(batch, "create_namespaced_cron_job", ns, {
            "apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "backup"},
            "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": pod_template("backup", "Never")}}},
        })  # fmt: skip
        job = create(batch, "create_namespaced_job", ns, {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "backup-29145", "ownerReferences": [controlled_by(cron)]},
            "spec": {"template": pod_template("backup", "Never")},
        })  # fmt: skip
        make_pod(core, ns, "client", EXPORTER_NODE, [p0.ipv4, p0.ipv6])  # a bare pod: its own workload
        make_pod(core, ns, "web-7c5d8-x1", EXPORTER_NODE, [p1.ipv4], owner=rs_old)
        make_pod(core, ns, "db-0", EXPORTER_NODE, [p2.ipv4], owner=db)
        make_pod(core, ns, "agent-q7", EXPORTER_NODE, [p3.ipv6], owner=agent)
        make_pod(core, ns, "backup-29145-abcde", EXPORTER_NODE, [p3.ipv4], owner=job)

        log = tmp_path / "exporter.log"
        proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log, *k8s_flags(sa_kubeconfig))
        try:
            wait_log(log, "API server synced")
            to_web = lab.tcp_exchange(p0, p1, 9000, 100, 100)
            to_db = lab.tcp_exchange(p0, p2, 9001, 100, 100)
            to_job = lab.tcp_exchange(p0, p3, 9002, 100, 100)
            from_agent = lab.tcp_exchange(p3, p0, 9003, 100, 100, family=6)
            # The rollout: a new ReplicaSet; its pod takes the old one's address.
            rs_new = replica_set("web-59b6f")
            delete_pod(core, ns, "web-7c5d8-x1")
            make_pod(core, ns, "web-59b6f-y2", EXPORTER_NODE, [p1.ipv4], owner=rs_new)
            time.sleep(1.0)  # the watches deliver the rollout
            to_rolled = lab.tcp_exchange(p0, p1, 9004, 100, 100)
            time.sleep(1.5)  # polled
            text = stop_exporter(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "Traceback" not in text
    groups = by_connection(read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=5))

    def workloads(ex: Any) -> tuple[tuple[str, str], tuple[str, str]]:
        r = first_of(groups, ex.client_ip, ex.client_port)
        return (r["sourceOwnerKind"], r["sourceOwnerName"]), (r["destinationOwnerKind"], r["destinationOwnerName"])

    assert workloads(to_web) == (("Pod", "client"), ("Deployment", "web"))
    assert workloads(to_db) == (("Pod", "client"), ("StatefulSet", "db"))
    assert workloads(to_job) == (("Pod", "client"), ("CronJob", "backup"))
    assert workloads(from_agent) == (("DaemonSet", "agent"), ("Pod", "client"))
    assert workloads(to_rolled) == (("Pod", "client"), ("Deployment", "web"))  # the same name after the rollout
    r = first_of(groups, to_rolled.client_ip, to_rolled.client_port)
    assert r["destinationPodName"] == "web-59b6f-y2"
