"""Kubernetes enrichment at scale: memory per cached pod and cost per enrichment at 50k pods.

Pods are not made up from scratch: a real kube-apiserver (devtools.apiserver) gets
``--real-pods`` pods (with status IPs, labels, managedFields: what a list really returns),
Services and Nodes, and its paginated list responses are recorded. From those recorded shapes,
``--pods`` pods are synthesized by varying names, uids, IPs and nodes, and fed as list pages
through the caches' own relist code (JSON parse + index), so the ingest cost is the real one.

Measured in child processes (so nothing else in this process pollutes them):

* bytes per cached pod: RSS after the list minus RSS before, over N (and the same from
  tracemalloc, which excludes allocator slack);
* ns per enrichment: ``Enricher.__call__`` on connections between random pods, through a
  Service VIP, and to unknown addresses, plus the bare pod-IP lookup.

``--per-object`` measures instead what each cached object costs when the caches list a real
kube-apiserver themselves (no replay): ``--objects`` ReplicaSets (each controlled by a
Deployment), then as many Jobs (each controlled by a CronJob), then as many pods (each
controlled by one of the ReplicaSets, with labels and both IPs) are created on the server, and
after each step fresh caches in a child process list everything, measured as above (RSS in
several children, the median; tracemalloc in one). The bytes per object of a kind are the
step's growth over the step before, divided by the objects added.

Prints JSON; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import machine_line, section_head, update_section, write_json

ROUNDS = 5
LABEL_KEYS = ("app", "app.kubernetes.io/name")


# ------------------------------------------------------------------------------ recording (parent)


def record(real_pods: int, real_services: int, nodes: int, workdir: Path) -> dict[str, Any]:
    """Create real objects on a real API server and keep its list responses (raw JSON pages)."""
    from kubernetes import client

    from devtools.apiserver import ApiServer

    t0 = time.perf_counter()
    with ApiServer(workdir / "apiserver") as srv, srv.api_client() as api:
        core = client.CoreV1Api(api)
        started = time.perf_counter() - t0
        core.create_namespace({"metadata": {"name": "bench"}})
        for n in range(nodes):
            name = f"node-{n}"
            core.create_node({"metadata": {"name": name}, "spec": {"podCIDRs": [f"10.{64 + n // 256}.{n % 256}.0/24"]}})
            core.patch_node_status(
                name, {"status": {"addresses": [{"type": "InternalIP", "address": f"192.168.{n // 256}.{n % 256}"}]}}
            )

        def make(i: int) -> None:
            app = f"app-{i // 20}"
            labels = {
                "app": app,
                "app.kubernetes.io/name": app,
                "app.kubernetes.io/part-of": "shop",
                "pod-template-hash": _h(f"rs{i // 20}", 10),
            }
            body = {
                "metadata": {"name": f"{app}-{_h(f'rs{i // 20}', 10)}-{_h(i, 5)}", "labels": labels},
                "spec": {
                    "nodeName": f"node-{i % nodes}",
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.example/shop/app:1.2.3",
                            "ports": [{"containerPort": 8080, "name": "http"}],
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                        }
                    ],
                },
            }
            core.create_namespaced_pod("bench", body)
            ip4, ip6 = pod_ips(i)
            status = {
                "phase": "Running",
                "hostIP": f"192.168.{(i % nodes) // 256}.{(i % nodes) % 256}",
                "podIP": ip4,
                "podIPs": [{"ip": ip4}, {"ip": ip6}],
                "startTime": "2026-01-01T00:00:00Z",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"}],
            }
            core.patch_namespaced_pod_status(body["metadata"]["name"], "bench", {"status": status})

        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(make, range(real_pods)))
        created = time.perf_counter() - t1
        for s in range(real_services):
            core.create_namespaced_service(
                "bench",
                {
                    "metadata": {"name": f"svc-{s}"},
                    "spec": {
                        "selector": {"app": f"app-{s}"},
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
                    },
                },
            )

        def pages(method: str) -> list[bytes]:
            out, token = [], None
            while True:
                resp = getattr(core, method)(limit=500, _continue=token, _preload_content=False)
                body = resp.data
                out.append(body)
                token = json.loads(body)["metadata"].get("continue")
                if not token:
                    return out

        t2 = time.perf_counter()
        pod_pages = pages("list_pod_for_all_namespaces")
        list_seconds = time.perf_counter() - t2
        return {
            "pods": pod_pages,
            "services": pages("list_service_for_all_namespaces"),
            "nodes": pages("list_node"),
            "server_start_seconds": round(started, 2),
            "create_seconds": round(created, 2),
            "real_list_ms": round(list_seconds * 1000, 1),
            "real_pod_json_bytes": round(sum(map(len, pod_pages)) / real_pods),
        }


def _h(seed: object, n: int) -> str:
    """Stable pseudo-random lowercase name part, like the suffixes controllers generate."""
    return hashlib.blake2b(str(seed).encode(), digest_size=16).hexdigest()[:n]


def pod_ips(i: int) -> tuple[str, str]:
    """The i-th pod's IPv4 and IPv6 addresses (unique for i < 2**22)."""
    return f"10.{128 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}", f"fd00:10::{i:x}"


# ------------------------------------------------------------------------------ synthesis (child)


def synthesize_pod_pages(recorded: list[bytes], n: int, nodes: int, page: int = 500) -> list[bytes]:
    """``n`` pods in the recorded list shape: names, uids, IPs and nodes varied, page by page."""
    items = [it for body in recorded for it in json.loads(body)["items"]]
    head = json.loads(recorded[0])
    out = []
    for start in range(0, n, page):
        batch = []
        for i in range(start, min(start + page, n)):
            t = items[i % len(items)]
            meta = dict(t["metadata"])
            app = f"app-{i // 20}"
            meta["name"] = f"{app}-{_h(f'rs{i // 20}', 10)}-{_h(i, 5)}"
            meta["uid"] = str(uuid.UUID(int=(1 << 64) + i))
            meta["labels"] = {**meta.get("labels", {}), "app": app, "app.kubernetes.io/name": app}
            ip4, ip6 = pod_ips(i)
            status = {**t["status"], "podIP": ip4, "podIPs": [{"ip": ip4}, {"ip": ip6}]}
            batch.append(
                {**t, "metadata": meta, "spec": {**t["spec"], "nodeName": f"node-{i % nodes}"}, "status": status}
            )
        last = start + page >= n
        body = {**head, "metadata": {"resourceVersion": "1000", **({} if last else {"continue": f"c{start}"})}}
        body["items"] = batch
        out.append(json.dumps(body).encode())
    return out


def synthesize_services(recorded: list[bytes], n: int) -> bytes:
    items = [it for body in recorded for it in json.loads(body)["items"] if it["metadata"]["name"].startswith("svc-")]
    out = []
    for s in range(n):
        t = items[s % len(items)]
        meta = {**t["metadata"], "name": f"svc-{s}", "uid": str(uuid.UUID(int=(2 << 64) + s))}
        ip = f"10.96.{s >> 8}.{s & 255}"
        out.append({**t, "metadata": meta, "spec": {**t["spec"], "clusterIP": ip, "clusterIPs": [ip]}})
    return json.dumps({"metadata": {"resourceVersion": "1000"}, "items": out}).encode()


def synthesize_nodes(recorded: list[bytes], n: int) -> bytes:
    items = [it for body in recorded for it in json.loads(body)["items"]]
    out = []
    for k in range(n):
        t = items[k % len(items)]
        meta = {**t["metadata"], "name": f"node-{k}", "uid": str(uuid.UUID(int=(3 << 64) + k))}
        status = {**t["status"], "addresses": [{"type": "InternalIP", "address": f"192.168.{k // 256}.{k % 256}"}]}
        out.append({**t, "metadata": meta, "status": status})
    return json.dumps({"metadata": {"resourceVersion": "1000"}, "items": out}).encode()


class _Resp:
    """A list page or a quiet watch, shaped like the urllib3 response the caches read."""

    def __init__(self, data: bytes = b"", quiet: threading.Event | None = None) -> None:
        self.data = data
        self._quiet = quiet

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Any:
        if self._quiet is not None:
            self._quiet.wait()
        return iter(())

    def release_conn(self) -> None:
        pass


def _replay_caches(pages_dir: Path) -> Any:
    """K8sCaches whose API answers with the page files in ``pages_dir`` (the relist code path, unchanged).

    Pages are read from disk when asked for, so none of them is in memory before the list starts.
    """
    from kubernetes.client import Configuration

    from flow_exporter.k8s.cache import K8sCaches

    class Replay(K8sCaches):
        def open_list(self, method: str) -> tuple[Any, Any]:
            resource = {
                "list_pod_for_all_namespaces": "pods",
                "list_service_for_all_namespaces": "services",
                "list_node": "nodes",
            }
            # (ReplicaSets and Jobs: no pages written, listed empty)
            queue = sorted(pages_dir.glob(f"{resource.get(method, 'none')}-*.json"))

            def call(**kw: Any) -> _Resp:
                if kw.get("watch"):
                    return _Resp(quiet=self.stop_event)
                if not queue:
                    return _Resp(b'{"metadata": {"resourceVersion": "1"}, "items": []}')
                return _Resp(queue.pop(0).read_bytes())

            return call, lambda: None

    return Replay(Configuration(), label_keys=LABEL_KEYS)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(pages_dir: Path, lookups: int, trace: bool) -> None:
    import gc
    import socket
    import tracemalloc

    from flow_exporter.connection import PROTO_TCP, Connection
    from flow_exporter.k8s.enrich import Enricher
    from flow_exporter.k8s.index import pack_ip
    from tests.support.fakes import NewFlow

    caches = _replay_caches(pages_dir)
    gc.collect()
    if trace:
        tracemalloc.start()
    before_rss = _rss()
    t0 = time.perf_counter()
    caches.start()
    assert caches.wait_ready(600)
    ingest = time.perf_counter() - t0
    gc.collect()
    after_rss = _rss()
    n = len(caches.pods)
    if trace:
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(json.dumps({"n": n, "traced_bytes": traced}))
        caches.stop()
        return

    services = len(caches.services)
    nodes = len(caches.nodes)

    def conn(src: str, dst: str, orig_dst: str | None = None, dport: int = 8080) -> NewFlow:
        s, d, o = pack_ip(src), pack_ip(dst), pack_ip(orig_dst or dst)
        c = Connection(socket.AF_INET, PROTO_TCP, s, o, 40000, dport, d, s, 8080, 40000, start_ns=time.time_ns())
        return NewFlow(c)

    def endpoints(seed: int) -> dict[str, list[tuple[str, str, str | None, int]]]:
        """(source, backend, dialled address, dialled port) per kind of connection."""
        rng = random.Random(seed)
        kinds: dict[str, list[tuple[str, str, str | None, int]]] = {
            "pod_to_pod": [],  # both ends random among all pods: the cache-unfriendly worst case
            "local_pod_to_pod": [],  # one end among this node's ~100 pods, as a node really sees
            "repeated_pairs": [],  # 1,000 distinct pod pairs (clients hitting a few backends): shared metas
            "via_service": [],
            "pod_to_external": [],
        }
        pairs = [(pod_ips(rng.randrange(n))[0], pod_ips(rng.randrange(n))[0]) for _ in range(1000)]
        for _ in range(lookups):
            a, b = pod_ips(rng.randrange(n))[0], pod_ips(rng.randrange(n))[0]
            kinds["pod_to_pod"].append((a, b, None, 8080))
            local = pod_ips(rng.randrange(0, n, nodes))[0]  # node-0's pods: i % nodes == 0
            kinds["local_pod_to_pod"].append((local, b, None, 8080))
            kinds["repeated_pairs"].append((*rng.choice(pairs), None, 8080))
        for _ in range(lookups // 4):
            s = rng.randrange(services)
            a, b = pod_ips(rng.randrange(n))[0], pod_ips(rng.randrange(n))[0]
            kinds["via_service"].append((a, b, f"10.96.{s >> 8}.{s & 255}", 80))
            kinds["pod_to_external"].append((a, f"203.0.{rng.randrange(256)}.{rng.randrange(256)}", None, 8080))
        return kinds

    pn = time.perf_counter_ns
    # What reading the clock twice costs, taken off every timed call below.
    overhead = statistics.median(-pn() + pn() for _ in range(100_000))
    enrich = Enricher(caches, "node-0", LABEL_KEYS, 16)
    for eps in endpoints(0).values():  # warm the label memo, as a running exporter has it
        for ep in eps:
            enrich(conn(*ep))
    rounds: dict[str, list[float]] = {}
    bare_rounds: list[float] = []
    lookup = caches.pods.lookup
    for r in range(ROUNDS):
        for name, eps in endpoints(r + 1).items():
            # Each connection is made just before it is enriched, as the store's _add does before on_new,
            # so its objects are as fresh in the CPU caches as they are in the exporter.
            total = 0
            for ep in eps:
                tr = conn(*ep)
                t = pn()
                enrich(tr)
                total += pn() - t
                assert tr.meta is not None and tr.meta["sourcePodName"]
            rounds.setdefault(name, []).append(total / len(eps) - overhead)
            if name == "pod_to_pod":
                total = 0
                for ep in eps:
                    ip = pack_ip(ep[0])
                    t = pn()
                    lookup(ip, 1)
                    total += pn() - t
                bare_rounds.append(total / len(eps) - overhead)
    assert enrich.stats.errors == 0
    per_call = {k: {"median": statistics.median(v), "best": min(v)} for k, v in rounds.items()}
    bare = {"median": statistics.median(bare_rounds), "best": min(bare_rounds)}
    caches.stop()
    print(
        json.dumps(
            {
                "n": n,
                "services": len(caches.services),
                "nodes": len(caches.nodes),
                "rss_before": before_rss,
                "rss_after": after_rss,
                "ingest_seconds": ingest,
                "enrich_ns": per_call,
                "pod_lookup_ns": bare,
            }
        )
    )


# ------------------------------------------------------------------------------ per object, listed live


def live_child(kubeconfig: Path, trace: bool) -> None:
    """Fresh caches list the real API server: memory before and after, and what they hold (one JSON line)."""
    import gc
    import tracemalloc

    from flow_exporter.k8s.cache import K8sCaches, load_configuration

    caches = K8sCaches(load_configuration(str(kubeconfig)), label_keys=LABEL_KEYS)
    gc.collect()
    if trace:
        tracemalloc.start()
    before = _rss()
    caches.start()
    assert caches.wait_ready(600)
    # Every watcher past its list and into its watch: nothing of a list page is still referenced.
    time.sleep(2)
    gc.collect()
    after = _rss()
    traced = tracemalloc.get_traced_memory()[0] if trace else 0
    counts = caches.synced_counts()
    caches.stop()
    print(json.dumps({"counts": counts, "rss_bytes": after - before, "traced_bytes": traced}))


def _create_owned(api: Any, method: str, count: int, body: Any, threads: int = 4) -> list[dict[str, Any]]:
    """``count`` objects made by ``body(i)`` through the typed client ``method`` in namespace bench; as returned."""

    def one(i: int) -> dict[str, Any]:
        made = getattr(api, method)("bench", body(i))
        out: dict[str, Any] = api.api_client.sanitize_for_serialization(made)
        return out

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(count)))


def _controlled_by(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"],
        "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


def _template(app: str, restart: str = "Always") -> dict[str, Any]:
    labels = {"app": app, "app.kubernetes.io/name": app}
    container = {
        "name": "main",
        "image": "shop/app:1.2.3",
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
    }
    return {"metadata": {"labels": labels}, "spec": {"containers": [container], "restartPolicy": restart}}


def per_object(objects: int, children: int, workdir: Path) -> dict[str, Any]:
    """Memory per cached ReplicaSet, Job and pod, from caches listing objects made on a real API server."""
    from kubernetes import client

    from devtools.apiserver import ApiServer

    owners = max(objects // 10, 1)  # ten ReplicaSets per Deployment: the default revision history
    steps: list[dict[str, Any]] = []
    with ApiServer(workdir / "apiserver") as srv, srv.api_client() as api:
        core, apps, batch = client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api)
        core.create_namespace({"metadata": {"name": "bench"}})
        for n in range(10):
            zone = {"topology.kubernetes.io/zone": f"zone-{n % 3}"}
            core.create_node({"metadata": {"name": f"node-{n}", "labels": zone}})
            core.patch_node_status(
                f"node-{n}", {"status": {"addresses": [{"type": "InternalIP", "address": f"192.168.0.{n}"}]}}
            )

        def measure(step: str, created_seconds: float) -> None:
            rss = [_run_live_child(srv.admin_kubeconfig, False) for _ in range(children)]
            traced = _run_live_child(srv.admin_kubeconfig, True)
            steps.append(
                {
                    "step": step,
                    "counts": traced["counts"],
                    "rss_bytes": statistics.median(r["rss_bytes"] for r in rss),
                    "traced_bytes": traced["traced_bytes"],
                    "create_seconds": round(created_seconds, 1),
                }
            )

        measure("baseline", 0.0)
        t0 = time.perf_counter()
        deployments = _create_owned(apps, "create_namespaced_deployment", owners, lambda i: {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"app-{i}"},
            "spec": {"selector": {"matchLabels": {"app": f"app-{i}"}}, "template": _template(f"app-{i}")},
        })  # fmt: skip
        replicasets = _create_owned(apps, "create_namespaced_replica_set", objects, lambda i: {
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {
                "name": f"app-{i // 10}-{_h(f'rs{i}', 10)}", "ownerReferences": [_controlled_by(deployments[i // 10])],
                "labels": {"app": f"app-{i // 10}", "pod-template-hash": _h(f"rs{i}", 10)},
            },
            "spec": {
                "replicas": 1, "selector": {"matchLabels": {"app": f"app-{i // 10}"}},
                "template": _template(f"app-{i // 10}"),
            },
        })  # fmt: skip
        measure("replicasets", time.perf_counter() - t0)
        t0 = time.perf_counter()
        cronjobs = _create_owned(batch, "create_namespaced_cron_job", owners, lambda i: {
            "apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": f"task-{i}"},
            "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": _template(f"task-{i}", "Never")}}},
        })  # fmt: skip
        _create_owned(batch, "create_namespaced_job", objects, lambda i: {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {
                "name": f"task-{i // 10}-{29145000 + i}", "ownerReferences": [_controlled_by(cronjobs[i // 10])],
            },
            "spec": {"template": _template(f"task-{i // 10}", "Never")},
        })  # fmt: skip
        measure("jobs", time.perf_counter() - t0)
        t0 = time.perf_counter()

        def pod(i: int) -> dict[str, Any]:
            rs = replicasets[i]
            body = _template(rs["metadata"]["labels"]["app"])
            body["metadata"] = {
                "name": f"{rs['metadata']['name']}-{_h(i, 5)}",
                "labels": {
                    **body["metadata"]["labels"],
                    "pod-template-hash": rs["metadata"]["labels"]["pod-template-hash"],
                },
                "ownerReferences": [_controlled_by(rs)],
            }
            body["spec"]["nodeName"] = f"node-{i % 10}"
            return body

        made = _create_owned(core, "create_namespaced_pod", objects, pod)

        def status(i: int) -> None:
            ip4, ip6 = pod_ips(i)
            body = {"status": {"phase": "Running", "podIP": ip4, "podIPs": [{"ip": ip4}, {"ip": ip6}]}}
            core.patch_namespaced_pod_status(made[i]["metadata"]["name"], "bench", body)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(status, range(objects)))
        measure("pods", time.perf_counter() - t0)

    per: dict[str, Any] = {}
    for prev, step in itertools.pairwise(steps):
        kind = step["step"]
        added = step["counts"][kind] - prev["counts"][kind]
        assert added == objects, (kind, step["counts"], prev["counts"])
        per[kind.removesuffix("s")] = {
            "bytes_rss": round((step["rss_bytes"] - prev["rss_bytes"]) / added),
            "bytes_traced": round((step["traced_bytes"] - prev["traced_bytes"]) / added),
        }
    return {
        "machine": machine_line(),
        "objects_per_kind": objects,
        "rss_children": children,
        "per_object": per,
        "steps": steps,
    }


def report_per_object(result: dict[str, Any], argv: list[str] | None) -> None:
    """docs/performance.md's ``k8s_objects`` section and ``docs/performance/k8s_objects.json``."""
    write_json("k8s_objects", result)
    per, n = result["per_object"], result["objects_per_kind"]
    what = {
        "replicaset": "ReplicaSet (controlled by a Deployment): its controller reference",
        "job": "Job (controlled by a CronJob): its controller reference",
        "pod": "pod (controlled by a ReplicaSet; 2 IPs, 2 of its 3 labels kept): name, node, owner, labels, IP index",
    }
    lines = section_head("Kubernetes caches: memory per cached object, listed live", "bench.bench_k8s", argv)
    lines += [
        f"Each step creates {n:,} objects of one kind on a real kube-apiserver (the Deployments and CronJobs that",
        "own them too, one per ten), then fresh caches in child processes list everything as the exporter does;",
        "a kind's cost is the step's growth over the step before, per object added. tracemalloc counts the",
        f"Python objects the caches keep; RSS (median of {result['rss_children']} children) adds allocator slack and",
        "what the allocator keeps after parsing the list pages (500 objects a page, the five resources at once):",
        "a fixed amount spread over the objects, so the RSS figures fall as `--objects` grows, the tracemalloc",
        "ones do not.",
        "",
        "| object | bytes, tracemalloc | bytes, RSS |",
        "|---|---:|---:|",
    ]
    for kind in ("pod", "replicaset", "job"):
        lines.append(f"| {what[kind]} | {per[kind]['bytes_traced']:,} | {per[kind]['bytes_rss']:,} |")
    update_section("k8s_objects", "\n".join(lines))


def _run_live_child(kubeconfig: Path, trace: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_k8s", "--live-child", str(kubeconfig), "1" if trace else "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------ driver


def run(pods: int, real_pods: int, services: int, lookups: int) -> dict[str, Any]:
    nodes = max(pods // 100, 1)
    with tempfile.TemporaryDirectory(prefix="bench-k8s-") as tmp:
        work = Path(tmp)
        rec = record(real_pods, min(services, 100), min(nodes, 50), work)
        pages = work / "pages"
        pages.mkdir()
        pod_pages = synthesize_pod_pages(rec["pods"], pods, nodes)
        for k, body in enumerate(pod_pages):
            (pages / f"pods-{k:05d}.json").write_bytes(body)
        list_bytes = sum(map(len, pod_pages))
        del pod_pages
        (pages / "services-00000.json").write_bytes(synthesize_services(rec["services"], services))
        (pages / "nodes-00000.json").write_bytes(synthesize_nodes(rec["nodes"], nodes))
        main = _run_child([str(pages), str(lookups), "0"])
        traced = _run_child([str(pages), str(lookups), "1"])
    n = main["n"]
    return {
        "machine": machine_line(),
        "pods": n,
        "services": main["services"],
        "nodes": main["nodes"],
        "recorded_from_real_api_server": {
            "pods": real_pods,
            "avg_pod_json_bytes": rec["real_pod_json_bytes"],
            "create_seconds": rec["create_seconds"],
            "list_ms": rec["real_list_ms"],
        },
        "bytes_per_pod_rss": round((main["rss_after"] - main["rss_before"]) / n),
        "bytes_per_pod_traced": round(traced["traced_bytes"] / traced["n"]),
        "list_json_mib": round(list_bytes / 2**20, 1),
        "ingest_seconds": round(main["ingest_seconds"], 2),
        "ingest_us_per_pod": round(main["ingest_seconds"] / n * 1e6, 1),
        "enrich_ns_per_connection": {k: {m: round(x) for m, x in v.items()} for k, v in main["enrich_ns"].items()},
        "pod_ip_lookup_ns": {m: round(x) for m, x in main["pod_lookup_ns"].items()},
        "lookups_timed": lookups,
    }


def _run_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_k8s", "--child", *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=50_000)
    ap.add_argument("--real-pods", type=int, default=500)
    ap.add_argument("--services", type=int, default=5_000)
    ap.add_argument("--lookups", type=int, default=200_000)
    ap.add_argument("--per-object", action="store_true", help="memory per cached ReplicaSet, Job and pod, listed live")
    ap.add_argument("--objects", type=int, default=5_000, help="--per-object: objects created per kind")
    ap.add_argument("--rss-children", type=int, default=3, help="--per-object: RSS children per step (median)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--live-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        pages, lookups, trace = args.child
        child(Path(pages), int(lookups), trace == "1")
        return 0
    if args.live_child:
        live_child(Path(args.live_child[0]), args.live_child[1] == "1")
        return 0
    if args.per_object:
        with tempfile.TemporaryDirectory(prefix="bench-k8s-") as tmp:
            result = per_object(args.objects, args.rss_children, Path(tmp))
        report_per_object(result, argv)
    else:
        result = run(args.pods, args.real_pods, args.services, args.lookups)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
