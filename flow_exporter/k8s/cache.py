"""Watch-backed caches of Pods, Services and Nodes, kept by one daemon thread per resource.

Each thread lists its resource (paginated, so 50k pods never sit in memory as one response),
then watches from the list's resourceVersion with bookmarks, applying events to a pure index
(:mod:`flow_exporter.k8s.index`). A watch that expires (HTTP 410, or an ERROR event with code 410)
is answered by a relist; any other failure (connection refused, TLS, timeouts, 5xx, even 403)
by a reconnect with exponential backoff and jitter. The threads never give up and never touch
the exporter: with the API server down, records are enriched from what the caches hold, and
one warning is logged per outage (not per retry), one info line when it is over.

Objects are read as raw JSON (``_preload_content=False``) rather than the client's models:
building a V1Pod costs far more than the few fields the indexes keep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import tenacity
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.rest import ApiException

from flow_exporter.k8s.index import Indexes, NodeIndex, PodIndex, ServiceIndex
from flow_exporter.k8s.owners import OwnerIndex
from flow_exporter.retry import sleep_on
from flow_exporter.settings import DEFAULT_SETTINGS

log = logging.getLogger(__name__)

# What the caches read, as (resource, API group, list method). k8s/rbac.yaml grants list and watch
# on exactly these (tests/integration/test_k8s_enrich.py holds the two together).
RESOURCES: tuple[tuple[str, str, str], ...] = (
    ("pods", "", "list_pod_for_all_namespaces"),
    ("services", "", "list_service_for_all_namespaces"),
    ("nodes", "", "list_node"),
    ("replicasets", "apps", "list_replica_set_for_all_namespaces"),  # a pod's Deployment
    ("jobs", "batch", "list_job_for_all_namespaces"),  # a pod's CronJob
)
_APIS = {"": client.CoreV1Api, "apps": client.AppsV1Api, "batch": client.BatchV1Api}
_GROUP_OF = {method: group for _, group, method in RESOURCES}
SCOPES = ("cluster", "node")


class _ClosedEarly(Exception):
    """A watch the server ended at once with nothing in it: back off instead of spinning."""


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """Client settings: the given kubeconfig, else in-cluster (ServiceAccount), else ``~/.kube/config``.

    Raises ``kubernetes.config.ConfigException`` when none of them works.
    """
    cfg = client.Configuration()
    if kubeconfig:
        kube_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            kube_config.load_incluster_config(client_configuration=cfg)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=cfg)
    # Our own backoff retries; urllib3's would retry (and log a warning) three times per attempt.
    cfg.retries = False
    return cfg


@dataclass
class WatchStats:
    lists: int = 0
    watches: int = 0
    events: int = 0
    expired: int = 0  # 410s answered by a relist
    failures: int = 0  # errors answered by a backoff
    bad_objects: int = 0


class K8sCaches(Indexes):
    """Pods, Services, Nodes, ReplicaSets and Jobs from the API server, for the Enricher (k8s.enrich).

    ``scope="node"`` lists only pods with ``spec.nodeName=<node_name>`` (a DaemonSet at scale
    should not hold every pod of the cluster on every node); Services and Nodes are always
    cluster-wide, and node pod CIDRs then classify addresses of other nodes' pods.
    ``ready`` is set once the first list of every resource is in; it stays set through outages.
    """

    def __init__(
        self,
        configuration: client.Configuration,
        *,
        scope: str = DEFAULT_SETTINGS.k8s.scope,
        node_name: str = "",
        retention: float = DEFAULT_SETTINGS.k8s.deleted_pod_retention,
        label_keys: Collection[str] | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        watch_timeout: float = 300.0,
        page_size: int = 500,
        connect_timeout: float = 10.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        if scope == "node" and not node_name:
            raise ValueError("node scope needs the node name")
        super().__init__(PodIndex(int(retention * 1e9), keep_labels=label_keys))
        self.configuration = configuration
        self.scope = scope
        self.node_name = node_name
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self.connect_timeout = connect_timeout
        self.clock = clock
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._listed: set[str] = set()
        self._down: dict[str, str] = {}
        self.outages = 0
        indexes = self.by_resource()
        pod_selector = f"spec.nodeName={node_name}" if scope == "node" else None
        self.watchers = [
            _Watcher(self, name, method, indexes[name], pod_selector if name == "pods" else None)
            for name, _, method in RESOURCES
        ]
        self._threads: list[threading.Thread] = []

    def open_list(self, method: str) -> tuple[Callable[..., Any], Callable[[], None]]:
        """A list method of its API group on an ApiClient of its own (one per thread), and its closer."""
        api = client.ApiClient(self.configuration)
        return getattr(_APIS[_GROUP_OF[method]](api), method), api.close

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> K8sCaches:
        """Start the three threads; returns at once (``ready`` tells when the first lists are in)."""
        if not self._threads:
            for w in self.watchers:
                t = threading.Thread(target=w.run, name=f"k8s-{w.resource}", daemon=True)
                self._threads.append(t)
                t.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads, closing their open watches (a lingering one would hold the server)."""
        self.stop_event.set()
        for w in self.watchers:
            w.interrupt()
        for t in self._threads:
            t.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready.wait(timeout)

    @property
    def healthy(self) -> bool:
        """Every watch is connected (False during an outage)."""
        with self._lock:
            return self.ready.is_set() and not self._down

    def stats(self) -> dict[str, WatchStats]:
        return {w.resource: w.stats for w in self.watchers}

    def status_line(self) -> str:
        return ", ".join(f"{n:,} {name}" for name, n in self.synced_counts().items())

    # ------------------------------------------------------------------ called by the watchers
    def _on_listed(self, resource: str) -> None:
        with self._lock:
            first = resource not in self._listed
            self._listed.add(resource)
            now_ready = first and len(self._listed) == len(self.watchers)
        if now_ready:
            self.ready.set()
            log.info("API server synced: %s (scope %s)", self.status_line(), self.scope)
        elif not first:
            log.info("API server relisted %s: %s", resource, self.status_line())

    def _on_reachable(self, resource: str) -> None:
        with self._lock:
            if resource not in self._down:
                return
            del self._down[resource]
            over = not self._down
        if over:
            log.info("API server reachable again; caches resuming (%s so far)", self.status_line())

    def _on_failure(self, resource: str, exc: BaseException) -> None:
        with self._lock:
            started = not self._down
            self._down.setdefault(resource, _describe(exc))
            if started:
                self.outages += 1
        if not started:
            return
        if isinstance(exc, ApiException) and exc.status in (401, 403):
            log.error(
                "API server refused to list %s (%s): check the ServiceAccount's RBAC (k8s/rbac.yaml); retrying",
                resource,
                _describe(exc),
            )
            return
        log.warning(
            "API server unreachable (%s: %s); records are enriched from cached data (%s), "
            "retrying with backoff up to %.0fs",
            resource,
            _describe(exc),
            self.status_line(),
            self.backoff_max,
        )


class _Watcher:
    """List-then-watch of one resource into one index, forever, on its own thread."""

    def __init__(
        self,
        caches: K8sCaches,
        resource: str,
        method: str,
        index: PodIndex | ServiceIndex | NodeIndex | OwnerIndex,
        field_selector: str | None,
    ) -> None:
        self.caches = caches
        self.resource = resource
        self.method = method
        self.index = index
        self.field_selector = field_selector
        self.resource_version: str | None = None
        self.stats = WatchStats()
        self._list: Callable[..., Any] | None = None
        self._resp: Any = None
        self._last_prune = 0

    def run(self) -> None:
        caches = self.caches
        stop = caches.stop_event
        self._list, close = caches.open_list(self.method)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Exception),
            wait=tenacity.wait_exponential_jitter(multiplier=caches.backoff_initial, max=caches.backoff_max),
            stop=tenacity.stop_when_event_set(stop),
            sleep=sleep_on(stop),
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            while not stop.is_set():
                try:
                    retrying(self._session)  # a fresh Retrying call per session: backoff restarts after success
                except Exception as exc:
                    if not stop.is_set():  # only reachable if tenacity itself misbehaves
                        log.exception("k8s %s cache: unexpected %s", self.resource, exc)
                        stop.wait(caches.backoff_max)
        finally:
            close()

    def interrupt(self) -> None:
        """Unblock a watch read (used by stop())."""
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if exc is None or isinstance(exc, _ClosedEarly):
            return
        self.stats.failures += 1
        self.caches._on_failure(self.resource, exc)
        log.debug("k8s %s cache: %s; retry %d", self.resource, _describe(exc), state.attempt_number)

    def _session(self) -> None:
        """One relist-if-needed plus one watch; returns when the watch ends normally or expired."""
        self._prune(self.caches.clock(), force=True)
        try:
            if self.resource_version is None:
                self._relist()
            self._watch()
        except ApiException as exc:
            if exc.status != 410:
                raise
            self._expired()

    def _expired(self) -> None:
        self.stats.expired += 1
        self.resource_version = None
        log.info("k8s %s watch expired (410 Gone); relisting", self.resource)

    def _relist(self) -> None:
        assert self._list is not None
        caches = self.caches
        index = self.index
        seen: set[str] = set()
        token: str | None = None
        meta: dict[str, Any] = {}
        now = caches.clock()
        while True:
            try:
                resp = self._list(
                    limit=caches.page_size,
                    _continue=token,
                    field_selector=self.field_selector,
                    _preload_content=False,
                    _request_timeout=(caches.connect_timeout, 120.0),
                )
            except ApiException as exc:
                if exc.status == 410 and token:  # continue token expired mid-list: start over
                    seen.clear()
                    token = None
                    continue
                raise
            try:
                data = json.loads(resp.data)
            finally:
                resp.release_conn()
            caches._on_reachable(self.resource)
            now = caches.clock()
            for item in data.get("items") or ():
                try:
                    seen.add(index.upsert(item, now, exact=False))
                except Exception:
                    self.stats.bad_objects += 1
            meta = data.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                break
        for key in index.keys() - seen:
            index.delete(key, now, exact=False)
        self.resource_version = meta.get("resourceVersion") or None
        self.stats.lists += 1
        caches._on_listed(self.resource)

    def _watch(self) -> None:
        assert self._list is not None
        caches = self.caches
        index = self.index
        timeout = max(int(caches.watch_timeout * random.uniform(0.8, 1.0)), 1)
        started = time.monotonic()
        resp = self._list(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            field_selector=self.field_selector,
            _preload_content=False,
            _request_timeout=(caches.connect_timeout, timeout + 30.0),
        )
        self._resp = resp
        self.stats.watches += 1
        caches._on_reachable(self.resource)
        events = 0
        try:
            if caches.stop_event.is_set():  # stop() came before _resp was set: it could not interrupt us
                return
            for line in _lines(resp):
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        self._expired()
                        return
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                now = caches.clock()
                if kind != "BOOKMARK":
                    events += 1
                    self.stats.events += 1
                    try:
                        index.apply(kind, obj, now)
                    except Exception:
                        self.stats.bad_objects += 1
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                self._prune(now)
        finally:
            self._resp = None
            resp.release_conn()
        if not events and time.monotonic() - started < 1.0 and not caches.stop_event.is_set():
            raise _ClosedEarly(self.resource)

    def _prune(self, now: int, force: bool = False) -> None:
        if force or now - self._last_prune > 5_000_000_000:
            self._last_prune = now
            self.index.prune(now)


def _lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited JSON events from a streaming response, as they arrive."""
    buf = b""
    for chunk in resp.stream(None, decode_content=True):
        if b"\n" not in chunk:
            buf += chunk
            continue
        parts = (buf + chunk).split(b"\n")
        buf = parts.pop()
        for part in parts:
            if part.strip():
                yield part
    if buf.strip():
        yield buf


def _describe(exc: BaseException) -> str:
    """A one-line reason (urllib3 wraps the useful part of a connection error deep inside)."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}".strip()
    reason = getattr(exc, "reason", None)
    text = str(reason if reason is not None else exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
