"""Conntrack event listener (NEW and DESTROY groups) for what polling cannot see.

A connection deleted between two polls (kube-proxy flushing stale UDP entries,
``conntrack -D``, early drop under table pressure, a short UDP exchange) never
appears in a dump. Its DESTROY event carries the final counters and the stop
timestamp, so the store can still give it an end-of-flow record. UPDATE is not
subscribed: it fires on every state change and floods the socket.

The poll loop stays the source of truth: events only add connections and final
counters. Lost events (ENOBUFS) are counted and answered by asking the poll loop
for an immediate full dump.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Collection

from pyroute2.netlink import NETLINK_NETFILTER

from pipeline.connection import Connection
from pipeline.conntrack.decode import Decoder
from pipeline.conntrack.errors import error_from_errno
from pipeline.conntrack.netns import run_in_netns

log = logging.getLogger(__name__)

NFNLGRP_CONNTRACK_NEW = 1
NFNLGRP_CONNTRACK_DESTROY = 3
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1


class ConntrackEvents:
    """Reads NEW/DESTROY events of one network namespace on a background thread.

    ``on_events(new, destroyed)`` is called with the decoded connections of each
    receive buffer; ``on_overrun()`` when the kernel dropped events (ENOBUFS).
    """

    def __init__(
        self,
        on_events: Callable[[list[Connection], list[Connection]], None],
        on_overrun: Callable[[], None],
        *,
        netns: str | None = None,
        zones: Collection[int] | None = None,
        rcvbuf: int = 64 << 20,
        bufsize: int = 1 << 20,
    ) -> None:
        self.netns = netns
        self.zones = frozenset(zones) if zones else None
        self.on_events = on_events
        self.on_overrun = on_overrun
        self.events = 0
        self.overruns = 0
        self.skipped = 0
        self.rcvbuf_granted = 0
        self._decoder = Decoder()
        self._buf = bytearray(bufsize)
        self._stop = threading.Event()
        self._sock = self._open(rcvbuf)
        self._thread = threading.Thread(target=self._run, name="ct-events", daemon=True)

    def _open(self, rcvbuf: int) -> socket.socket:
        where = f"conntrack events in netns {self.netns}" if self.netns else "conntrack events"

        def create() -> socket.socket:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

        try:
            sock = run_in_netns(self.netns, create)
            try:
                # Bursts of thousands of deletions must fit: force past rmem_max where allowed.
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.rcvbuf_granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            sock.bind((0, 0))
            for group in (NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_DESTROY):
                sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
            sock.settimeout(0.2)  # so stop() is noticed quickly
        except OSError as e:
            raise error_from_errno(e.errno or errno.EIO, where) from e
        return sock

    def start(self) -> None:
        self._thread.start()
        log.info("conntrack events on (NEW, DESTROY), receive buffer %d KiB", self.rcvbuf_granted // 1024)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._sock.close()

    def _run(self) -> None:
        sock = self._sock
        buf = self._buf
        view = memoryview(buf)
        decode = self._decoder.decode_batch
        while not self._stop.is_set():
            try:
                n = sock.recv_into(buf)
            except TimeoutError:
                continue
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.overruns += 1
                    log.warning("conntrack events lost (receive buffer overrun); resyncing with a full dump")
                    self.on_overrun()
                    continue
                if self._stop.is_set():
                    return
                log.error("conntrack events: %s; listener stopped, polling continues", e)
                return
            new: list[Connection] = []
            destroyed: list[Connection] = []
            res = decode(view[:n], new, self.zones, destroyed)
            self.skipped += res.skipped
            if new or destroyed:
                self.events += len(new) + len(destroyed)
                try:
                    self.on_events(new, destroyed)
                except Exception:  # never let a bad event kill the listener
                    log.exception("conntrack events: applying a batch failed")
