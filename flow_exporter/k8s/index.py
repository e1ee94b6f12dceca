"""Pure in-memory indexes of Pods, Services and Nodes, fed with API objects as JSON dicts.

No I/O and no clock of their own (the caller passes ``now`` in wall-clock ns), so tests drive
them with made-up objects. One writer (the cache thread of the resource) and any number of
readers (the enricher in the poll loop): readers only do single dict lookups and read
attributes, and writers replace whole tuples, so under the GIL a reader sees either the old or
the new state of an entry, never a torn one, and no lock is needed on the lookup path.

Addresses are keys as packed bytes (``socket.inet_pton``) because that is what conntrack
gives us: a lookup costs one dict probe and no text conversion.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

from flow_exporter.k8s.owners import OwnerIndex, controller_of

ALIVE = 1 << 63  # "until" of an entry whose pod still holds the address
_PROTOCOLS = {"TCP": 6, "UDP": 17, "SCTP": 132}
_TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})  # such pods keep status.podIPs but lost the address


def pack_ip(text: object) -> bytes | None:
    """Packed 4- or 16-byte address, or None for anything that is not an IP address."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except OSError:
        return None


def parse_time_ns(ts: object) -> int:
    """An RFC 3339 API timestamp (``2024-05-01T12:00:00Z``) in ns since the epoch; 0 if absent or bad."""
    if not isinstance(ts, str) or not ts:
        return 0
    try:
        return int(datetime.fromisoformat(ts).timestamp() * 1_000_000_000)
    except ValueError:
        return 0


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def object_key(obj: Mapping[str, Any]) -> str:
    """Identity of an object across events: its uid (a recreated pod with the same name is another pod)."""
    m = _meta(obj)
    return m.get("uid") or f"{m.get('namespace', '')}/{m.get('name', '')}"


# ----------------------------------------------------------------------------- pods


class PodInfo:
    """What a record needs about a pod. Shared and read-only once built (``out`` is the enricher's memo)."""

    __slots__ = ("labels", "name", "namespace", "node", "out", "owner", "uid")

    def __init__(
        self,
        uid: str,
        name: str,
        namespace: str,
        node: str | None,
        labels: dict[str, str],
        owner: tuple[str, str] | None = None,
    ) -> None:
        self.uid = uid
        self.name = name
        self.namespace = namespace
        self.node = node
        self.labels = labels
        self.owner = owner  # its controller (kind, name), as the pod names it (owners.workload resolves it)
        self.out: tuple[object, Any] | None = None

    def same(self, other: PodInfo) -> bool:
        return (self.name, self.namespace, self.node, self.labels, self.owner) == (
            other.name,
            other.namespace,
            other.node,
            other.labels,
            other.owner,
        )

    def __repr__(self) -> str:
        return f"PodInfo({self.namespace}/{self.name} on {self.node})"


class IpOwner:
    """One pod's tenure on one address: connections that started in [since, until) belong to it."""

    __slots__ = ("exact", "pod", "since", "until")

    def __init__(self, pod: PodInfo, since: int) -> None:
        self.pod = pod
        self.since = since
        self.until = ALIVE
        self.exact = True  # until is a time we saw the end happen (watch), not a relist's guess

    def __repr__(self) -> str:
        until = "alive" if self.until == ALIVE else self.until
        return f"IpOwner({self.pod!r}, since={self.since}, until={until})"


class PodIndex:
    """Pod IP -> pod, with a short per-address history so a reused IP resolves by connection start.

    Each address maps to its pod directly while that pod is its first and only owner (nearly
    always: one object less per address, one memory access less per lookup), else to a tuple of
    :class:`IpOwner`, oldest first. A pod that is deleted (or
    reaches a terminal phase, or drops the address) keeps its entry, closed at the time the cache
    saw that happen, for ``retention_ns``; a connection is attributed to the owner whose tenure
    contains its start time. The first owner of an address starts at 0 (any earlier connection is
    its); a later owner starts at ``max(creationTimestamp, status.startTime, previous owner's
    end)``, because API timestamps have one-second resolution while the end we observed is exact.

    hostNetwork pods are not indexed: their address is the node's, shared by every such pod.
    """

    def __init__(
        self,
        retention_ns: int = 300 * 1_000_000_000,
        keep_labels: Collection[str] | None = None,
        history: int = 4,
    ) -> None:
        self.retention_ns = retention_ns
        self.keep_labels = frozenset(keep_labels) if keep_labels is not None else None
        self.history = max(history, 2)
        self.by_ip: dict[bytes, PodInfo | tuple[IpOwner, ...]] = {}
        self._pods: dict[str, tuple[PodInfo, tuple[bytes, ...]]] = {}
        self._ended: deque[tuple[int, bytes, IpOwner]] = deque()
        self._label_sets: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def keys(self) -> set[str]:
        return set(self._pods)

    def get(self, key: str) -> PodInfo | None:
        hit = self._pods.get(key)
        return hit[0] if hit else None

    # -------------------------------------------------------------- lookups
    def lookup(self, ip: bytes, start_ns: int = 0) -> PodInfo | None:
        """The pod that held ``ip`` when a connection started at ``start_ns`` (0: unknown, the latest)."""
        hist = self.by_ip.get(ip)
        if hist is None or isinstance(hist, PodInfo):
            return hist
        owner = hist[-1]
        if not start_ns:
            return owner.pod
        if start_ns >= owner.since:  # the common case: the current (or last) owner
            return owner.pod if start_ns < owner.until else None
        for owner in hist[-2::-1]:
            if start_ns >= owner.since:
                return owner.pod if start_ns < owner.until else None
        return None

    # -------------------------------------------------------------- updates
    def apply(self, event: str, obj: Mapping[str, Any], now: int) -> None:
        """A watch event (ADDED, MODIFIED, DELETED)."""
        if event == "DELETED":
            self.delete(object_key(obj), now)
        else:
            self.upsert(obj, now)

    def upsert(self, obj: Mapping[str, Any], now: int, exact: bool = True) -> str:
        """Add or update a pod from its API object; returns its key."""
        key = object_key(obj)
        m = _meta(obj)
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        info = PodInfo(
            key,
            m.get("name") or "",
            sys.intern(m.get("namespace") or ""),
            sys.intern(spec["nodeName"]) if spec.get("nodeName") else None,
            self._labels(m.get("labels")),
            controller_of(m),
        )
        ips: tuple[bytes, ...] = ()
        if not spec.get("hostNetwork") and status.get("phase") not in _TERMINAL_PHASES:
            listed = [p.get("ip") for p in status.get("podIPs") or () if isinstance(p, Mapping)]
            if not listed and status.get("podIP"):
                listed = [status["podIP"]]
            ips = tuple(dict.fromkeys(ip for ip in map(pack_ip, listed) if ip is not None))
        old = self._pods.get(key)
        if old is not None:
            if old[0].same(info):
                info = old[0]  # keeps the enricher's memo and the objects records already point to
            for ip in old[1]:
                if ip not in ips:
                    self._end(ip, key, now, exact)
        for ip in ips:
            self._claim(ip, info, m, status, now)
        self._pods[key] = (info, ips)
        return key

    def delete(self, key: str, now: int, exact: bool = True) -> None:
        old = self._pods.pop(key, None)
        if old is not None:
            for ip in old[1]:
                self._end(ip, key, now, exact)

    def prune(self, now: int) -> int:
        """Forget ended tenures older than the retention; returns how many went."""
        n = 0
        ended = self._ended
        while ended and ended[0][0] + self.retention_ns <= now:
            _, ip, owner = ended.popleft()
            hist = self._owners(ip)
            if owner.until == ALIVE or not any(o is owner for o in hist):
                continue
            self._store(ip, tuple(o for o in hist if o is not owner))
            n += 1
        return n

    def _owners(self, ip: bytes) -> tuple[IpOwner, ...]:
        h = self.by_ip.get(ip)
        if h is None:
            return ()
        if isinstance(h, PodInfo):
            return (IpOwner(h, 0),)
        return h

    def _store(self, ip: bytes, owners: tuple[IpOwner, ...]) -> None:
        if not owners:
            self.by_ip.pop(ip, None)
        elif len(owners) == 1 and owners[0].since == 0 and owners[0].until == ALIVE:
            self.by_ip[ip] = owners[0].pod
        else:
            self.by_ip[ip] = owners

    def _claim(self, ip: bytes, info: PodInfo, meta: Mapping[str, Any], status: Mapping[str, Any], now: int) -> None:
        hist = self._owners(ip)
        for owner in hist:
            if owner.pod.uid == info.uid and owner.until == ALIVE:
                owner.pod = info  # same tenure, fresher details
                self._store(ip, hist)
                return
        if not hist:
            since = 0
        else:
            # Parsed only here, for the rare new owner of a known address: relists stay cheap.
            lower = max(parse_time_ns(meta.get("creationTimestamp")), parse_time_ns(status.get("startTime")))
            last = hist[-1]
            if last.until != ALIVE and last.exact:
                since = min(max(lower, last.until), now)
            else:
                # The previous owner's end was missed (relist, or events out of order): the new pod's
                # own timestamps are the best boundary we have.
                since = min(max(lower, last.since + 1), now)
                if last.until == ALIVE:
                    self._ended.append((now, ip, last))
                last.until = min(last.until, since)
                last.exact = False
        self._store(ip, (*hist, IpOwner(info, since))[-self.history :])

    def _end(self, ip: bytes, key: str, now: int, exact: bool) -> None:
        hist = self._owners(ip)
        for owner in hist:
            if owner.pod.uid == key and owner.until == ALIVE:
                owner.until = now
                owner.exact = exact
                self._ended.append((now, ip, owner))
                self._store(ip, hist)

    def _labels(self, labels: object) -> dict[str, str]:
        """The pod's labels (only ``keep_labels`` if set), interned: pods of one workload share one dict."""
        if not isinstance(labels, Mapping) or not labels:
            items: tuple[tuple[str, str], ...] = ()
        else:
            keep = self.keep_labels
            items = tuple(sorted((str(k), str(v)) for k, v in labels.items() if keep is None or k in keep))
        hit = self._label_sets.get(items)
        if hit is None:
            if len(self._label_sets) > 4 * len(self._pods) + 1024:
                self._label_sets.clear()  # churned workloads left unused sets behind
            hit = self._label_sets[items] = dict(items)
        return hit


# ----------------------------------------------------------------------------- services


class ServiceIndex:
    """(Service IP, port, protocol) -> (``namespace/name:port/PROTO``, ``namespace/name:portName``).

    IPs are spec.clusterIPs (headless "None" skipped), spec.externalIPs and load-balancer ingress
    IPs; NodePorts are kept apart, keyed by (port, protocol), for a destination that is a node IP.
    """

    def __init__(self) -> None:
        self.by_key: dict[tuple[bytes, int, int], tuple[str, str]] = {}
        self.node_ports: dict[tuple[int, int], tuple[str, str]] = {}
        self.ips: dict[bytes, int] = {}  # every Service IP, with how many services use it
        self._svcs: dict[str, tuple[tuple[tuple[bytes, int, int], ...], tuple[tuple[int, int], ...]]] = {}

    def __len__(self) -> int:
        return len(self._svcs)

    def keys(self) -> set[str]:
        return set(self._svcs)

    def lookup(self, ip: bytes, port: int, proto: int) -> tuple[str, str] | None:
        return self.by_key.get((ip, port, proto))

    def apply(self, event: str, obj: Mapping[str, Any], now: int) -> None:
        if event == "DELETED":
            self.delete(object_key(obj), now)
        else:
            self.upsert(obj, now)

    def upsert(self, obj: Mapping[str, Any], now: int = 0, exact: bool = True) -> str:
        key = object_key(obj)
        m = _meta(obj)
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        name = f"{m.get('namespace', '')}/{m.get('name', '')}"
        texts = list(spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else []))
        texts += spec.get("externalIPs") or []
        texts += [i.get("ip") for i in (status.get("loadBalancer") or {}).get("ingress") or () if i.get("ip")]
        ips = [ip for ip in map(pack_ip, texts) if ip is not None]  # "None" (headless) packs to None
        ports: list[tuple[int, int, int | None, tuple[str, str]]] = []
        for p in spec.get("ports") or ():
            proto_name = p.get("protocol") or "TCP"
            proto = _PROTOCOLS.get(proto_name)
            port = p.get("port")
            if proto is None or not isinstance(port, int):
                continue
            value = (sys.intern(f"{name}:{port}/{proto_name}"), sys.intern(f"{name}:{p.get('name') or ''}"))
            node_port = p.get("nodePort")
            ports.append((port, proto, node_port if isinstance(node_port, int) else None, value))
        keys = tuple((ip, port, proto) for ip in ips for port, proto, _, _ in ports)
        node_keys = tuple((np, proto) for _, proto, np, _ in ports if np is not None)
        # New entries first, stale ones after: a concurrent lookup never sees the service missing.
        for ip in ips:
            for port, proto, _, value in ports:
                self.by_key[(ip, port, proto)] = value
        for _, proto, np, value in ports:
            if np is not None:
                self.node_ports[(np, proto)] = value
        for ip in set(ips):
            self.ips[ip] = self.ips.get(ip, 0) + 1
        old = self._svcs.get(key)
        self._svcs[key] = (keys, node_keys)
        if old is not None:
            self._drop(old, keep=set(keys), keep_nodes=set(node_keys))
        return key

    def delete(self, key: str, now: int = 0, exact: bool = True) -> None:
        old = self._svcs.pop(key, None)
        if old is not None:
            self._drop(old, set(), set())

    def _drop(
        self,
        old: tuple[tuple[tuple[bytes, int, int], ...], tuple[tuple[int, int], ...]],
        keep: set[tuple[bytes, int, int]],
        keep_nodes: set[tuple[int, int]],
    ) -> None:
        keys, node_keys = old
        for k in keys:
            if k not in keep:
                self.by_key.pop(k, None)
        for nk in node_keys:
            if nk not in keep_nodes:
                self.node_ports.pop(nk, None)
        for ip in {k[0] for k in keys}:
            n = self.ips.get(ip, 0) - 1
            if n > 0:
                self.ips[ip] = n
            else:
                self.ips.pop(ip, None)

    def prune(self, now: int) -> int:
        return 0


# ----------------------------------------------------------------------------- nodes


ZONE_LABEL = "topology.kubernetes.io/zone"


class NodeIndex:
    """Node InternalIP/ExternalIP -> node name, spec.podCIDRs -> node name, and node name -> zone and address.

    Pod CIDRs let flowType tell "a pod on another node" from "outside the cluster" for addresses
    the pod index does not know (node scope, or a pod not seen yet). They exist only where the
    cluster allocates per-node ranges (kube-controller-manager --allocate-node-cidrs); without
    them such addresses stay unknown.

    ``placed`` gives a node's zone (its ``topology.kubernetes.io/zone`` label) and address (its
    first InternalIP, in text) for the records' ``*Zone`` and ``*NodeAddress`` fields: two strings
    per node, nothing else of the object is kept. ``version`` grows whenever one changes, so
    memoized record fields built from them can tell they are stale.
    """

    def __init__(self) -> None:
        self.placed: dict[str, tuple[str | None, str | None]] = {}
        self.version = 0
        self._names: dict[str, str] = {}  # object key -> node name
        self._placer: dict[str, str] = {}  # node name -> the object key whose values ``placed`` holds
        self.by_ip: dict[bytes, str] = {}
        # address length in bytes -> ((prefix length, {network number >> host bits: node}), ...);
        # the tuple is replaced, never changed, so a lookup can walk it while the cache thread writes.
        self._cidrs: dict[int, tuple[tuple[int, dict[int, str]], ...]] = {4: (), 16: ()}
        self._nodes: dict[str, tuple[tuple[bytes, ...], tuple[tuple[int, int, int], ...]]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def keys(self) -> set[str]:
        return set(self._nodes)

    def lookup(self, ip: bytes) -> str | None:
        return self.by_ip.get(ip)

    @property
    def has_pod_cidrs(self) -> bool:
        return bool(self._cidrs[4] or self._cidrs[16])

    def pod_cidr_node(self, ip: bytes) -> str | None:
        """The node whose pod CIDR contains ``ip``."""
        tables = self._cidrs[len(ip)]
        if not tables:
            return None
        n = int.from_bytes(ip, "big")
        bits = len(ip) * 8
        for plen, nets in tables:
            hit = nets.get(n >> (bits - plen))
            if hit is not None:
                return hit
        return None

    def apply(self, event: str, obj: Mapping[str, Any], now: int) -> None:
        if event == "DELETED":
            self.delete(object_key(obj), now)
        else:
            self.upsert(obj, now)

    def upsert(self, obj: Mapping[str, Any], now: int = 0, exact: bool = True) -> str:
        key = object_key(obj)
        name = sys.intern(_meta(obj).get("name") or "")
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        ips = tuple(
            ip
            for ip in (
                pack_ip(a.get("address"))
                for a in status.get("addresses") or ()
                if a.get("type") in ("InternalIP", "ExternalIP")
            )
            if ip is not None
        )
        cidrs = []
        for text in spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else []):
            net = _parse_cidr(text)
            if net is not None:
                cidrs.append(net)
        for ip in ips:
            self.by_ip[ip] = name
        for size, plen, number in cidrs:
            self._nets(size, plen)[number] = name
        zone = ((_meta(obj).get("labels") or {}).get(ZONE_LABEL) or None) if name else None
        internal = [a.get("address") for a in status.get("addresses") or () if a.get("type") == "InternalIP"]
        placed = (sys.intern(zone) if isinstance(zone, str) else None, internal[0] if internal else None)
        if name and self.placed.get(name) != placed:
            self.placed[name] = placed
            self.version += 1
        self._names[key] = name
        self._placer[name] = key
        old = self._nodes.get(key)
        self._nodes[key] = (ips, tuple(cidrs))
        if old is not None:
            self._drop(old, set(ips), set(cidrs))
        return key

    def delete(self, key: str, now: int = 0, exact: bool = True) -> None:
        old = self._nodes.pop(key, None)
        if old is not None:
            self._drop(old, set(), set())
        name = self._names.pop(key, None)
        # only its own values: a node recreated under its name (new uid) may be upserted before this DELETED
        if name is not None and self._placer.get(name) == key:
            del self._placer[name]
            if self.placed.pop(name, None) is not None:
                self.version += 1

    def _drop(
        self,
        old: tuple[tuple[bytes, ...], tuple[tuple[int, int, int], ...]],
        keep_ips: set[bytes],
        keep_cidrs: set[tuple[int, int, int]],
    ) -> None:
        for ip in old[0]:
            if ip not in keep_ips:
                self.by_ip.pop(ip, None)
        for cidr in old[1]:
            if cidr in keep_cidrs:
                continue
            size, plen, net = cidr
            nets = self._nets(size, plen)
            nets.pop(net, None)
            if not nets:
                self._cidrs[size] = tuple(t for t in self._cidrs[size] if t[0] != plen)

    def _nets(self, size: int, plen: int) -> dict[int, str]:
        for p, nets in self._cidrs[size]:
            if p == plen:
                return nets
        nets = {}
        self._cidrs[size] = (*self._cidrs[size], (plen, nets))
        return nets

    def prune(self, now: int) -> int:
        return 0


def _parse_cidr(text: object) -> tuple[int, int, int] | None:
    """(address bytes, prefix length, network number shifted right by the host bits), or None."""
    if not isinstance(text, str) or "/" not in text:
        return None
    addr, _, plen_text = text.partition("/")
    ip = pack_ip(addr)
    if ip is None or not plen_text.isdigit():
        return None
    bits = len(ip) * 8
    plen = int(plen_text)
    if not 0 < plen <= bits:
        return None
    return len(ip), plen, int.from_bytes(ip, "big") >> (bits - plen)


class Indexes:
    """The indexes plus a readiness flag: what the :class:`~flow_exporter.k8s.enrich.Enricher` reads.

    :class:`~flow_exporter.k8s.cache.K8sCaches` fills one from the API server; tests fill one by hand.
    """

    scope = "cluster"  # "node": pods of other nodes are not in ``pods``

    def __init__(self, pods: PodIndex | None = None) -> None:
        self.pods = pods if pods is not None else PodIndex()
        self.services = ServiceIndex()
        self.nodes = NodeIndex()
        self.replicasets = OwnerIndex()
        self.jobs = OwnerIndex()
        self.ready = threading.Event()

    def by_resource(self) -> dict[str, PodIndex | ServiceIndex | NodeIndex | OwnerIndex]:
        return {
            "pods": self.pods,
            "services": self.services,
            "nodes": self.nodes,
            "replicasets": self.replicasets,
            "jobs": self.jobs,
        }

    def synced_counts(self) -> dict[str, int]:
        return {name: len(index) for name, index in self.by_resource().items()}

    def load(self, kind: str, objs: Iterable[Mapping[str, Any]], now: int) -> None:
        """Upsert objects of one kind (``pods``, ``services``, ``nodes``, ``replicasets``, ``jobs``) by hand."""
        index = self.by_resource()[kind]
        for obj in objs:
            index.upsert(obj, now)
