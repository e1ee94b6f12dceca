"""``make demo``: a real broker, a real API server, a namespace lab, a minute of traffic, the exporter, the records.

Everything is real: the Kafka broker is the Apache one started from the cached
jars, the kube-apiserver (built from the Go module proxy) holds Pods and a Service
whose addresses are the lab's, the exporter reads it with the ServiceAccount and
ClusterRole of k8s/ (list and watch only), the traffic crosses a routed "node"
namespace whose kernel conntrack the exporter reads, and the records shown are
decoded from the topic, one row per connection in the columns of
``flow-exporter tail``.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastavro
import yaml
from confluent_kafka import Consumer

from devtools.apiserver import ApiServer
from devtools.kafka import KafkaBroker
from devtools.lab import Lab, LabError, Pod
from flow_exporter.commands import table_header, table_row
from flow_exporter.record import load_schema

TOPIC = "flows"


def _say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def _traffic(lab: Lab, duration: float, errors: list[str]) -> int:
    """Mixed real traffic for ``duration`` seconds; returns the number of exchanges."""
    pods = lab.pods
    svc = lab.add_service(SERVICE_VIPS[0], 80, pods[2], 8080, vip6=SERVICE_VIPS[1])  # the Service shop/web
    rnd = random.Random(7)
    end = time.monotonic() + duration
    long_conn = lab.open_tcp(pods[0], pods[1], 7000)
    count = 0

    def pair() -> tuple[Pod, Pod]:
        a, b = rnd.sample(pods, 2)
        return a, b

    actions: list[Callable[[], object]] = [
        # HTTP-like: small request, larger response, over IPv4 and IPv6.
        lambda: lab.tcp_exchange(*pair(), 8000, rnd.randint(200, 800), rnd.randint(2_000, 60_000), family=4),
        lambda: lab.tcp_exchange(*pair(), 8000, rnd.randint(200, 800), rnd.randint(2_000, 60_000), family=6),
        # DNS-like UDP request/response.
        lambda: lab.udp_exchange(*pair(), 5353, rnd.randint(40, 80), rnd.randint(100, 500), family=4),
        lambda: lab.udp_exchange(*pair(), 5353, rnd.randint(40, 80), rnd.randint(100, 500), family=6),
        # A client of the "Service": DNAT'd by the node to its backend.
        lambda: lab.tcp_exchange(pods[rnd.choice((0, 1))], svc, 80, 300, rnd.randint(1_000, 20_000)),
    ]
    next_long = time.monotonic()
    while time.monotonic() < end:
        try:
            rnd.choice(actions)()
            count += 1
            if time.monotonic() >= next_long:
                long_conn.send(4096)
                next_long += 2.0
        except (LabError, OSError) as exc:
            errors.append(str(exc))
        time.sleep(rnd.uniform(0.1, 0.5))
    long_conn.close()
    return count


def _read_back(bootstrap: str, min_records: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    schema = fastavro.parse_schema(load_schema())
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "demo", "auto.offset.reset": "earliest"})
    consumer.subscribe([TOPIC])
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    quiet = 0.0
    try:
        while time.monotonic() < deadline and quiet < 3.0:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                quiet += 0.5 if len(out) >= min_records else 0.0
                continue
            quiet = 0.0
            out.append(fastavro.schemaless_reader(io.BytesIO(msg.value()), schema, schema))
    finally:
        consumer.close()
    return out


def _connections(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per connection, as a consumer counts it: duplicates dropped, deltas summed, the last reason."""
    by_id: dict[int, dict[int, dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["connectionId"], {})[r["sequence"]] = r
    rows = []
    for seqs in by_id.values():
        ordered = [seqs[k] for k in sorted(seqs)]
        row = dict(ordered[-1])
        row["exportTime"] = ordered[0]["exportTime"]
        row["octetDeltaCount"] = sum(r["octetDeltaCount"] for r in ordered)
        row["reverseOctetDeltaCount"] = sum(r["reverseOctetDeltaCount"] for r in ordered)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["exportTime"], r["connectionId"]))


def _print_table(records: list[dict[str, Any]]) -> None:
    print(table_header())
    for row in _connections(records):
        print(table_row(row))


# The demo cluster: three pods of a "shop" on the demo node, and a Service in front of one of them.
POD_NAMES = ("frontend", "cart", "web")
SERVICE_VIPS = ("10.96.0.80", "fd10:96::80")  # in the API server's default Service ranges


def _cluster(api: ApiServer, lab: Lab) -> Path:
    """Pods with the lab pods' addresses, the Service ``shop/web``, and the exporter's RBAC from k8s/.

    Returns a kubeconfig of the exporter's ServiceAccount (so the demo also shows the ClusterRole suffices).
    """
    from kubernetes import client

    manifests = Path(__file__).resolve().parent.parent / "k8s"
    api.apply(
        d for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml")
        for d in yaml.safe_load_all((manifests / name).read_text())
    )  # fmt: skip
    core = client.CoreV1Api(api.api_client())
    core.create_namespace({"metadata": {"name": "shop"}})
    core.create_node({"metadata": {"name": "demo-node"}})
    core.patch_node_status("demo-node", {"status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}})
    for name, pod in zip(POD_NAMES, lab.pods, strict=True):
        spec = {"nodeName": "demo-node", "containers": [{"name": "app", "image": "registry.example/shop:1"}]}
        core.create_namespaced_pod("shop", {"metadata": {"name": name, "labels": {"app": name}}, "spec": spec})
        status = {"phase": "Running", "podIP": pod.ipv4, "podIPs": [{"ip": pod.ipv4}, {"ip": pod.ipv6}]}
        core.patch_namespaced_pod_status(name, "shop", {"status": status})
    core.create_namespaced_service("shop", {
        "metadata": {"name": "web"},
        "spec": {"ipFamilyPolicy": "RequireDualStack", "clusterIP": SERVICE_VIPS[0], "clusterIPs": list(SERVICE_VIPS),
                 "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    })  # fmt: skip
    return api.service_account_kubeconfig("flow-exporter", "flow-exporter")


def run_demo(duration: float = 60.0) -> int:
    work = Path(tempfile.mkdtemp(prefix="flow-exporter-demo-"))
    _say("starting the Kafka broker (KRaft, single node)")
    t0 = time.monotonic()
    with KafkaBroker(work / "kafka") as broker:
        _say(f"broker up at {broker.bootstrap} in {time.monotonic() - t0:.1f}s; log: {broker.log_path}")
        broker.create_topic(TOPIC, partitions=3)
        _say("starting the Kubernetes API server (etcd + kube-apiserver)")
        with Lab(pods=3) as lab, ApiServer(work / "kube-apiserver") as api:
            _say(f"lab up: node namespace {lab.node_ns}, pods " + ", ".join(p.ipv4 for p in lab.pods))
            kubeconfig = _cluster(api, lab)
            _say("cluster: pods shop/" + ", shop/".join(POD_NAMES) + ", Service shop/web on " + SERVICE_VIPS[0])
            log_path = work / "exporter.log"
            cmd = [
                sys.executable, "-m", "flow_exporter", "run",
                "--netns", lab.node_ns,
                "--bootstrap-servers", broker.bootstrap,
                "--topic", TOPIC,
                "--node-name", "demo-node",
                "--set", "conntrack.pollInterval=1s",
                "--set", "expiry.activeTimeout=5s",
                "--set", "expiry.idleTimeout=10s",
                "--set", "metrics.port=0",
                "--set", "k8s.enabled=true",
                "--set", f"k8s.kubeconfig={kubeconfig}",
            ]  # fmt: skip
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                )
            try:
                _wait_for(log_path, "first poll", proc, 30.0)
                _wait_for(log_path, "API server synced", proc, 30.0)
                _say(f"exporter running (log: {log_path}); generating {duration:.0f}s of traffic")
                errors: list[str] = []
                result: list[int] = []
                worker = threading.Thread(target=lambda: result.append(_traffic(lab, duration, errors)))
                worker.start()
                worker.join()
                _say(f"{result[0] if result else 0} exchanges done ({len(errors)} errors); stopping the exporter")
                time.sleep(2.0)
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
            if rc != 0:
                print(log_path.read_text(), file=sys.stderr)
                _say(f"exporter exited with {rc}")
                return 1
        records = _read_back(broker.bootstrap, 1)
        _say("one row per connection: its records' deltas summed as a consumer does (SENT/RECEIVED: bytes "
             "from the source's view; REASON: its last record's)")  # fmt: skip
        _print_table(records)
        conns = {r["connectionId"] for r in records}
        total = sum(r["octetDeltaCount"] + r["reverseOctetDeltaCount"] for r in records)
        named = sum(1 for r in records if r.get("sourcePodName") or r.get("destinationPodName"))
        print(
            f"\n{len(conns)} connections, {len(records)} records ({named} with pod names), {total:,} bytes "
            f"(both directions); exporter log: {log_path}"
        )
        return 0 if records else 1


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(path.read_text(), file=sys.stderr)
            raise SystemExit("demo: the exporter did not start")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devtools.demo",
        description="local broker + namespace lab + exporter, then the records read back from Kafka (make demo)",
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of generated traffic")
    return run_demo(duration=ap.parse_args(argv).duration)


if __name__ == "__main__":
    sys.exit(main())
