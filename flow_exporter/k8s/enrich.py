"""The Enricher: the store's ``on_new`` hook that fills a connection's Kubernetes fields.

It runs once per new connection inside the poll loop's lock, so it only does dict lookups on
the indexes (no API calls, no text conversion of addresses) and never lets an exception out:
a failure is counted and leaves ``meta`` None, and the record goes out unenriched.

flowType (schemas/flow_record.avsc), with "pod" meaning a known pod or an address inside a
node's pod CIDR (how node scope, which only lists this node's pods, still tells a pod on another
node from the outside world):

* 1 intra-node: both ends are pods on this exporter's node;
* 2 inter-node: both ends are pods, on different nodes;
* 3 to-external: source is a pod, destination is neither a pod nor a node nor a Service IP;
* 4 from-external: source is neither a pod nor a node, destination is a pod;
* 0 otherwise (node traffic, both ends outside, or two pods of the same other node).

In node scope without pod CIDRs (CNIs that do their own IPAM) an unknown address may be a pod
on another node, so 3 and 4 are not claimed there: such flows stay 0 rather than mislabelled.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flow_exporter.connection import Connection
from flow_exporter.flow import FROM_EXTERNAL, INTER_NODE, INTRA_NODE, TO_EXTERNAL, NewConnection
from flow_exporter.k8s.index import NodeIndex, PodIndex, PodInfo, ServiceIndex
from flow_exporter.k8s.owners import OwnerIndex, workload

log = logging.getLogger(__name__)

_UNPLACED: tuple[None, None] = (None, None)  # an end with no node, or a node not (yet) in the cache
DEFAULT_LABEL_KEYS = ("app", "app.kubernetes.io/name")
MAX_LABEL_VALUE = 63  # the API server's own limit on label values


class IndexSource(Protocol):
    """What the enricher reads (a :class:`~flow_exporter.k8s.cache.K8sCaches` or a hand-filled Indexes)."""

    pods: PodIndex
    services: ServiceIndex
    nodes: NodeIndex
    replicasets: OwnerIndex
    jobs: OwnerIndex
    scope: str

    @property
    def ready(self) -> Any: ...  # a threading.Event


@dataclass
class EnrichStats:
    lookups: int = 0  # connections enriched
    misses: int = 0  # connections with at least one end neither pod, node nor Service
    source_misses: int = 0
    destination_misses: int = 0
    errors: int = 0  # exceptions caught (meta left None)
    truncated_labels: int = 0  # label values cut to max_value_len (counted once per pod)
    reenriched: int = 0  # connections seen before the caches synced, enriched again after
    pending_dropped: int = 0


class Enricher:
    """Callable ``enricher(new)``: sets ``new.meta`` to the dict of K8S fields and flowType.

    ``label_keys`` are the pod labels copied into records, at most ``max_labels`` of them, each
    value cut to ``max_value_len``. Connections seen before the caches' first full sync are kept
    (up to ``pending_limit``) and enriched again on the first call after it, so a restart of the
    exporter does not leave its first poll's connections unenriched for their whole life.

    Connections with the same ends (same pod objects, nodes, Service, flowType) share one meta
    dict, never mutated: it saves building an 11-key dict per connection (the larger part of the
    cost) and that dict's memory for every tracked connection. Each connection still gets its ``meta``
    assigned, and a changed pod is a new PodInfo, hence a new dict.
    """

    def __init__(
        self,
        caches: IndexSource,
        node_name: str,
        label_keys: Sequence[str] = DEFAULT_LABEL_KEYS,
        max_labels: int = 8,
        *,
        max_value_len: int = MAX_LABEL_VALUE,
        pending_limit: int = 65536,
        shared_limit: int = 16384,
    ) -> None:
        self.caches = caches
        self.node_name = node_name
        keys = list(dict.fromkeys(label_keys))
        if len(keys) > max_labels:
            log.warning("k8s: %d pod label keys configured, only the first %d are copied", len(keys), max_labels)
        self.label_keys = tuple(keys[:max_labels])
        self.max_value_len = max_value_len
        self.stats = EnrichStats()
        self._pending: deque[NewConnection] = deque()
        self._pending_limit = pending_limit
        self._synced = False
        self._label_dicts: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
        self._token = object()  # tags this enricher's memo on PodInfo.out
        self._shared: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._shared_limit = shared_limit
        # What else names a connection's ends (the named networks, flow_exporter.network_file), applied to the
        # meta of every connection enriched, again after the caches synced too; it never mutates a shared dict.
        self.decorate: Callable[[dict[str, Any] | None, Connection], dict[str, Any] | None] | None = None

    def _meta(self, c: Connection) -> dict[str, Any] | None:
        meta = self.meta_for(c)
        return meta if self.decorate is None else self.decorate(meta, c)

    def __call__(self, tr: NewConnection) -> None:
        try:
            if not self._synced:
                self._before_sync(tr)
            tr.meta = self._meta(tr.conn)
        except Exception:
            self.stats.errors += 1
            if self.stats.errors == 1:
                log.exception("k8s enrichment failed (counted, logged once)")

    def _before_sync(self, tr: NewConnection) -> None:
        if not self.caches.ready.is_set():
            if len(self._pending) < self._pending_limit:
                self._pending.append(tr)
            else:
                self.stats.pending_dropped += 1
            return
        self._synced = True
        while self._pending:
            old = self._pending.popleft()
            if not old.settled:
                old.meta = self._meta(old.conn)
                self.stats.reenriched += 1

    def meta_for(self, c: Connection) -> dict[str, Any] | None:
        """The K8S fields of a connection (None when nothing about either end is known)."""
        caches = self.caches
        pods = caches.pods
        services = caches.services
        node_ips = caches.nodes.by_ip
        start = c.start_ns
        stats = self.stats
        stats.lookups += 1

        src = pods.lookup(c.orig_src, start)
        dst = pods.lookup(c.reply_src, start)
        svc = services.by_key.get((c.orig_dst, c.orig_dport, c.proto))
        if svc is None and c.orig_dst in node_ips:
            svc = services.node_ports.get((c.orig_dport, c.proto))

        if src is not None and dst is not None:  # the common case, pod to pod
            src_node = src.node
            dst_node = dst.node
            flow_type = self._pod_to_pod(src_node, dst_node)
        else:
            src_node, dst_node, flow_type = self._classify(c, src, dst)
            if src is None and dst is None and src_node is None and dst_node is None and svc is None:
                return None  # every field null and flowType 0: the encoder's shared default

        versions = (caches.nodes.version, caches.replicasets.version, caches.jobs.version)
        key = (src, dst, src_node, dst_node, svc, flow_type, versions)
        meta = self._shared.get(key)
        if meta is None:
            if len(self._shared) >= self._shared_limit:
                self._shared.clear()  # also lets go of replaced PodInfos
            meta = self._shared[key] = self._build(src, dst, src_node, dst_node, svc, flow_type)
        return meta

    def _pod_to_pod(self, src_node: str | None, dst_node: str | None) -> int:
        """flowType of a connection between two pods, from their nodes."""
        if src_node != dst_node:
            return INTER_NODE
        return INTRA_NODE if src_node == self.node_name else 0

    def _classify(self, c: Any, src: PodInfo | None, dst: PodInfo | None) -> tuple[str | None, str | None, int]:
        """Nodes and flowType when at least one end is not a known pod; counts the misses."""
        caches = self.caches
        nodes = caches.nodes

        def end(pod: PodInfo | None, addr: bytes) -> tuple[str | None, bool]:
            """(node, is a pod) of one end: a known pod, a node's address, or an address in a node's pod CIDR."""
            if pod is not None:
                return pod.node, True
            node = nodes.by_ip.get(addr)
            if node is not None:
                return node, False
            node = nodes.pod_cidr_node(addr)
            return node, node is not None

        src_node, src_pod = end(src, c.orig_src)
        dst_node, dst_pod = end(dst, c.reply_src)
        src_known = src_pod or src_node is not None
        dst_known = dst_pod or dst_node is not None or c.reply_src in caches.services.ips
        # Unknown means outside the cluster only if every pod address could be known.
        blind = caches.scope == "node" and not nodes.has_pod_cidrs

        if src_pod and dst_pod:
            flow_type = self._pod_to_pod(src_node, dst_node)
        elif src_pod and not dst_known and not blind:
            flow_type = TO_EXTERNAL
        elif dst_pod and not src_known and not blind:
            flow_type = FROM_EXTERNAL
        else:
            flow_type = 0

        if not (src_known and dst_known):
            stats = self.stats
            stats.misses += 1
            if not src_known:
                stats.source_misses += 1
            if not dst_known:
                stats.destination_misses += 1
        return src_node, dst_node, flow_type

    def _build(
        self,
        src: PodInfo | None,
        dst: PodInfo | None,
        src_node: str | None,
        dst_node: str | None,
        svc: tuple[str, str] | None,
        flow_type: int,
    ) -> dict[str, Any]:
        placed = self.caches.nodes.placed
        src_zone, src_address = placed.get(src_node, _UNPLACED) if src_node is not None else _UNPLACED
        dst_zone, dst_address = placed.get(dst_node, _UNPLACED) if dst_node is not None else _UNPLACED
        src_owner = self._workload(src)
        dst_owner = self._workload(dst)
        return {
            "sourcePodName": src.name if src is not None else None,
            "sourcePodNamespace": src.namespace if src is not None else None,
            "sourceNodeName": src_node,
            "sourcePodLabels": self._labels(src) if src is not None else None,
            "destinationPodName": dst.name if dst is not None else None,
            "destinationPodNamespace": dst.namespace if dst is not None else None,
            "destinationNodeName": dst_node,
            "destinationPodLabels": self._labels(dst) if dst is not None else None,
            "destinationServicePortName": svc[1] if svc is not None else None,
            "destinationService": svc[0] if svc is not None else None,
            "sourceZone": src_zone,
            "destinationZone": dst_zone,
            "sourceNodeAddress": src_address,
            "destinationNodeAddress": dst_address,
            "sourceOwnerKind": src_owner[0],
            "sourceOwnerName": src_owner[1],
            "destinationOwnerKind": dst_owner[0],
            "destinationOwnerName": dst_owner[1],
            "flowType": flow_type,
        }

    def _workload(self, pod: PodInfo | None) -> tuple[str | None, str | None]:
        if pod is None:
            return _UNPLACED
        caches = self.caches
        return workload(pod.namespace, pod.name, pod.owner, caches.replicasets, caches.jobs)

    def _labels(self, pod: PodInfo) -> dict[str, str]:
        """The pod's configured labels, memoized on the pod (shared dicts: never mutate them)."""
        out = pod.out
        if out is not None and out[0] is self._token:
            memo: dict[str, str] = out[1]
            return memo
        labels = pod.labels
        n = self.max_value_len
        items = []
        for k in self.label_keys:
            v = labels.get(k)
            if v is None:
                continue
            if len(v) > n:
                v = v[:n]
                self.stats.truncated_labels += 1
            items.append((k, v))
        key = tuple(items)
        selected = self._label_dicts.get(key)
        if selected is None:
            if len(self._label_dicts) > 65536:
                self._label_dicts.clear()
            selected = self._label_dicts[key] = dict(items)
        pod.out = (self._token, selected)
        return selected
