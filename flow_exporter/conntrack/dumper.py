"""Dump the conntrack table over ctnetlink, optionally of another network namespace.

pyroute2 builds the requests and decodes the (tiny) stats reply; the dump itself is read
with `recv_into` on a plain NETLINK_NETFILTER socket into one reused buffer and fed to
`decode.Decoder` buffer by buffer, so the table never exists as Python message objects.
"""

from __future__ import annotations

import errno
import gc
import socket
import struct
from collections.abc import Callable, Collection
from types import TracebackType
from typing import TypeVar

from pyroute2.netlink import NETLINK_NETFILTER, NLM_F_DUMP, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import (
    IPCTNL_MSG_CT_GET,
    IPCTNL_MSG_CT_GET_STATS,
    IPCTNL_MSG_CT_GET_STATS_CPU,
    nfct_msg,
    nfct_stats,
    nfct_stats_cpu,
)

from flow_exporter.connection import Connection
from flow_exporter.conntrack.decode import NLMSG_ERROR, Decoder, DecodeResult
from flow_exporter.conntrack.errors import ConntrackError, error_from_errno
from flow_exporter.conntrack.netns import run_in_netns

__all__ = ["ConntrackDumper"]

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_STATS_TYPE = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET_STATS
_STATS_CPU_TYPE = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET_STATS_CPU
NLMSG_DONE = 3
_NLMSGHDR = struct.Struct("<IHHI")  # length, type, flags, sequence (the port id is not needed)
_T = TypeVar("_T")
# The per-CPU conntrack statistics the health stream reports (CTA_STATS_*, summed over CPUs):
# what `conntrack -S` prints. Cumulative since the network namespace was created.
KERNEL_STATS = {
    "CTA_STATS_INSERT_FAILED": "insert_failed",
    "CTA_STATS_DROP": "drop",
    "CTA_STATS_EARLY_DROP": "early_drop",
    "CTA_STATS_ERROR": "error",
    "CTA_STATS_INVALID": "invalid",
    "CTA_STATS_SEARCH_RESTART": "search_restart",
    "CTA_STATS_CLASH_RESOLVE": "clash_resolve",
    "CTA_STATS_CHAIN_TOOLONG": "chain_toolong",
}
_MAX_PATH = "/proc/sys/net/netfilter/nf_conntrack_max"
_COUNT_PATH = "/proc/sys/net/netfilter/nf_conntrack_count"


def _request(msg_type: int, flags: int, seq: int, zone: int | None = None) -> bytes:
    """An nfnetlink ctnetlink request (AF_UNSPEC: both IPv4 and IPv6)."""
    msg = nfct_msg.create_from(zone=zone) if zone is not None else nfct_msg()
    msg["header"]["type"] = (NFNL_SUBSYS_CTNETLINK << 8) | msg_type
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg["nfgen_family"] = socket.AF_UNSPEC
    msg.encode()
    return bytes(msg.data)


class ConntrackDumper:
    """Dumps the conntrack table of this or another (named) network namespace.

    The netlink socket is created inside `netns` by a short-lived thread, so the process
    stays in its own namespace. After any failed operation the socket is discarded (it may
    hold the rest of an aborted dump) and reopened on next use.
    """

    def __init__(
        self,
        netns: str | None = None,
        rcvbuf: int = 8 << 20,
        bufsize: int = 1 << 20,
        timeout: float = 30.0,
        decoder: Decoder | None = None,
        compiled: bool = True,
    ) -> None:
        self.netns = netns
        self.rcvbuf = rcvbuf
        self.timeout = timeout
        self.decoder = decoder if decoder is not None else Decoder(compiled=compiled)
        self.last_skipped = 0  # malformed messages in the last dump
        self.skipped = 0  # ... in every dump so far (the Source port's counter)
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._seq = 0
        self._sock: socket.socket | None = None
        self._sock = self._open()  # fail early on a missing netns or missing permission

    # -- socket ---------------------------------------------------------------------------
    def _where(self) -> str:
        return f"conntrack in netns {self.netns}" if self.netns else "conntrack"

    def _open(self) -> socket.socket:
        def create() -> socket.socket:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

        try:
            sock = run_in_netns(self.netns, create)
        except ConntrackError:
            raise
        except OSError as e:
            raise error_from_errno(e.errno or errno.EIO, f"{self._where()}: netlink socket") from e
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
            except OSError:  # no CAP_NET_ADMIN: capped by net.core.rmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.bind((0, 0))
            sock.settimeout(self.timeout)
        except OSError as e:
            sock.close()
            raise error_from_errno(e.errno or errno.EIO, f"{self._where()}: netlink socket") from e
        return sock

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    def _discard(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _recv(self, sock: socket.socket, what: str) -> memoryview:
        try:
            # MSG_TRUNC: netlink then returns the datagram's full length, so truncation shows.
            n = sock.recv_into(self._buf, 0, socket.MSG_TRUNC)
        except TimeoutError as e:
            raise ConntrackError(errno.ETIMEDOUT, f"{what}: no reply within {self.timeout}s") from e
        except OSError as e:
            raise error_from_errno(e.errno or errno.EIO, what) from e
        if n > len(self._buf):
            raise ConntrackError(errno.EMSGSIZE, f"{what}: {n}-byte message exceeds the {len(self._buf)}-byte buffer")
        return self._view[:n]

    # -- operations -----------------------------------------------------------------------
    def dump(self, zones: Collection[int] | None = None) -> list[Connection]:
        """All entries (IPv4 and IPv6), only those in `zones` if given.

        With exactly one zone, CTA_ZONE goes into the request (kernels >= 6.8 filter; older
        ones ignore it); the result is always filtered here as well.
        Raises ConntrackOverrun / ConntrackDumpInterrupted (retry), ConntrackError otherwise.
        """
        out: list[Connection] = []
        self.dump_into(out.extend, zones)
        return out

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        """Like `dump`, but hands each receive buffer's entries to `consume` as they arrive.

        The poll loop uses this so the table never exists twice in memory (the store's
        copy plus a full new dump), which would raise the peak RSS by a whole dump's objects.
        Returns the number of entries passed on. Errors as for `dump`; entries of a dump
        that fails midway have been consumed already (they are real, current values).
        """
        zone_set = frozenset(zones) if zones is not None else None
        decode = self.decoder.decode_batch

        def handle(buf: memoryview) -> DecodeResult:
            batch: list[Connection] = []
            res = decode(buf, batch, zone_set)
            if batch and not res.errno:  # an error in the buffer: raised by _dump, nothing of it consumed
                consume(batch)
            return res

        return self._dump(handle, zone_set)

    def dump_buffers(
        self, apply: Callable[[memoryview], DecodeResult], zones: Collection[int] | None = None
    ) -> int | None:
        """Like `dump_into`, but hands each receive buffer to ``apply`` undecoded (the compiled poll path).

        ``apply`` decodes and keeps what it wants (only entries in ``zones``, if given) and returns
        what the buffer held; the returned count is the entries it kept. Errors as for `dump`.
        """
        return self._dump(apply, frozenset(zones) if zones is not None else None)

    def _dump(self, handle: Callable[[memoryview], DecodeResult], zone_set: frozenset[int] | None) -> int:
        """One dump request; each receive buffer to ``handle``, until NLMSG_DONE."""
        zone = next(iter(zone_set)) if zone_set is not None and len(zone_set) == 1 else None
        what = f"{self._where()}: dump"
        if zone_set is not None and not zone_set:
            self.last_skipped = 0
            return 0
        sock = self._socket()
        skipped = 0
        total = 0
        interrupted = False
        ok = False
        # 100k new objects would trigger ~140 collections that rescan the growing list;
        # one collection afterwards is far cheaper.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            sock.send(_request(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, self._next_seq(), zone))
            while True:
                res = handle(self._recv(sock, what))
                skipped += res.skipped
                interrupted = interrupted or res.interrupted
                if res.errno:
                    raise error_from_errno(res.errno, what)
                total += res.kept
                if res.done:
                    break
            ok = True
        except OSError as e:
            if isinstance(e, ConntrackError):
                raise
            raise error_from_errno(e.errno or errno.EIO, what) from e
        finally:
            if gc_was_enabled:
                gc.enable()
            self.last_skipped = skipped
            self.skipped += skipped
            if not ok:
                self._discard()
        if interrupted:
            raise error_from_errno(errno.EINTR, what)
        return total

    def _query(self, msg_type: int, flags: int, what: str, answer: Callable[[int, bytes], _T | None]) -> _T:
        """Send one ctnetlink request; feed each answer (type, whole message) to ``answer`` until it returns a result.

        An NLMSG_ERROR with an error raises it; a bare acknowledgement is skipped. The stats
        queries share this; the dump has its own loop (it decodes in place, batch by batch).
        """
        sock = self._socket()
        seq = self._next_seq()
        ok = False
        try:
            sock.send(_request(msg_type, flags, seq))
            while True:
                data = self._recv(sock, what)
                off = 0
                while off + 16 <= len(data):
                    mlen, mtype, _, mseq = _NLMSGHDR.unpack_from(data, off)
                    if mlen < 16 or off + mlen > len(data):
                        break
                    if mseq == seq:
                        if mtype == NLMSG_ERROR and mlen >= 20:
                            err = int.from_bytes(data[off + 16 : off + 20], "little", signed=True)
                            if err:
                                raise error_from_errno(-err, what)
                        else:
                            result = answer(mtype, bytes(data[off : off + mlen]))
                            if result is not None:
                                ok = True
                                return result
                    off += (mlen + 3) & ~3
        except OSError as e:
            if isinstance(e, ConntrackError):
                raise
            raise error_from_errno(e.errno or errno.EIO, what) from e
        finally:
            if not ok:
                self._discard()

    def _stats(self) -> tuple[int | None, int | None]:
        """(entries, max entries) from IPCTNL_MSG_CT_GET_STATS, answered for the socket's netns."""

        def answer(mtype: int, data: bytes) -> tuple[int | None, int | None] | None:
            if mtype != _STATS_TYPE:
                return None
            msg = nfct_stats(data)
            msg.decode()
            return (msg.get_attr("CTA_STATS_GLOBAL_ENTRIES"), msg.get_attr("CTA_STATS_GLOBAL_MAX_ENTRIES"))

        return self._query(IPCTNL_MSG_CT_GET_STATS, NLM_F_REQUEST, f"{self._where()}: stats", answer)

    def kernel_stats(self) -> dict[str, int]:
        """The namespace's conntrack statistics summed over CPUs (``conntrack -S``; KERNEL_STATS names).

        One dump request of IPCTNL_MSG_CT_GET_STATS_CPU: a message per CPU, then NLMSG_DONE.
        A statistic the kernel does not send (older kernels) is absent from the result.
        """
        totals: dict[str, int] = {}

        def answer(mtype: int, data: bytes) -> dict[str, int] | None:
            if mtype == NLMSG_DONE:
                return totals
            if mtype == _STATS_CPU_TYPE:
                msg = nfct_stats_cpu(data)
                msg.decode()
                for attr, name in KERNEL_STATS.items():
                    value = msg.get_attr(attr)
                    if value is not None:
                        totals[name] = totals.get(name, 0) + value
            return None

        what = f"{self._where()}: per-CPU stats"
        return self._query(IPCTNL_MSG_CT_GET_STATS_CPU, NLM_F_REQUEST | NLM_F_DUMP, what, answer)

    def count(self) -> int:
        """Entries in the namespace's table (nf_conntrack_count of that netns)."""
        entries, _ = self._stats()
        if entries is None:  # kernels before CTA_STATS_GLOBAL_ENTRIES: the netns' sysctl
            entries = int(run_in_netns(self.netns, lambda: _read_int(_COUNT_PATH)))
        return entries

    def max_entries(self) -> int:
        """nf_conntrack_max (global: one limit for all namespaces)."""
        _, maximum = self._stats()
        return maximum if maximum is not None else _read_int(_MAX_PATH)

    def close(self) -> None:
        self._discard()

    def __enter__(self) -> ConntrackDumper:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())
