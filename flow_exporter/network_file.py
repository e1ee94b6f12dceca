"""The named-networks file (``networks.file``): read at start, read again when it changes, and the hook that names
the ends of new connections (issue 42; the table and its rules: :mod:`flow_exporter.networks`).

A Kubernetes ConfigMap mounted as a volume changes by a symlink swap: the file is watched by its stat
(inode, size, modification time, following links) every ``networks.reloadInterval``. A file that does not
parse at start is a config error (exit 2); one that does not parse later leaves the table as it was, logged
and counted (``flow_exporter_networks_reload_errors_total``), and is tried again when it changes again.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import yaml

from flow_exporter.connection import Connection
from flow_exporter.flow import NewConnection
from flow_exporter.networks import NetworkError, NetworkTable, parse_networks

log = logging.getLogger("flow_exporter.networks")

__all__ = ["NetworkFile", "NetworkNamer", "name_ends"]

# libyaml's loader, when built (reading 100k prefixes, measured: docs/performance.md#named-networks-100000-prefixes)
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _stat(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class NetworkFile:
    """The file's current table (swapped whole on a reload), and what the reloads did."""

    def __init__(self, path: str, max_prefixes: int, interval: float = 10.0) -> None:
        self.path = path
        self.max_prefixes = max_prefixes
        self.interval = interval
        self.reloads = 0
        self.reload_errors = 0
        self._seen = _stat(path)  # OSError: the caller's config error
        self.table = self._read()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> NetworkTable:
        try:
            with open(self.path, "rb") as fh:
                data = yaml.load(fh, Loader=_Loader)  # a safe loader: CSafeLoader or SafeLoader
        except (yaml.reader.ReaderError, UnicodeDecodeError):
            raise NetworkError(f"networks.file {self.path}: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise NetworkError(f"networks.file {self.path}: not YAML{where}") from None
        return parse_networks(data, self.max_prefixes, f"networks.file {self.path}")

    def check(self) -> bool:
        """Read the file again if it changed; True when a new table was taken."""
        try:
            seen = _stat(self.path)
        except OSError as exc:
            if self._seen != (0, 0, 0):
                self._seen = (0, 0, 0)
                self.reload_errors += 1
                log.error("networks.file %s: %s; keeping the %d prefixes read before", self.path, exc,
                          self.table.prefixes)  # fmt: skip
            return False
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            table = self._read()
        except (NetworkError, OSError) as exc:
            self.reload_errors += 1
            log.error("%s; keeping the %d prefixes read before", exc, self.table.prefixes)
            return False
        self.table = table
        self.reloads += 1
        log.info("networks.file %s: %d prefixes, %d names", self.path, table.prefixes, table.names)
        return True

    def start(self) -> NetworkFile:
        self._thread = threading.Thread(target=self._run, name="networks", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def name_ends(meta: dict[str, Any] | None, conn: Connection, table: NetworkTable) -> dict[str, Any] | None:
    """``meta`` with the networks of the ends that are not a known pod or node (a new dict: Kubernetes
    enrichment shares its dicts between connections); ``meta`` itself when neither end is named."""
    m = meta or {}
    src = None if m.get("sourcePodName") or m.get("sourceNodeName") else table.lookup(conn.orig_src)
    dst = None if m.get("destinationPodName") or m.get("destinationNodeName") else table.lookup(conn.reply_src)
    if src is None and dst is None:
        return meta
    return {**m, "sourceNetwork": src, "destinationNetwork": dst}


class NetworkNamer:
    """Names the ends of a connection's meta: the new-connection hook without Kubernetes enrichment, and the
    Kubernetes enricher's ``decorate`` with it (so a connection it enriches again after its caches synced keeps
    its networks)."""

    def __init__(self, networks: NetworkFile) -> None:
        self.networks = networks
        self.named = 0  # connections with at least one end named

    def decorate(self, meta: dict[str, Any] | None, conn: Connection) -> dict[str, Any] | None:
        named = name_ends(meta, conn, self.networks.table)
        if named is not meta:
            self.named += 1
        return named

    def __call__(self, tr: NewConnection) -> None:
        tr.meta = self.decorate(tr.meta, tr.conn)
