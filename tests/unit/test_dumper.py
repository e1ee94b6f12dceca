"""ConntrackDumper's error handling, with a fake socket behind a real dumper: no root, no namespaces.

The dumps against the real kernel are in tests/integration/test_dumper_lab.py.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from flow_exporter.conntrack import (
    ConntrackDumper,
    ConntrackDumpInterrupted,
    ConntrackError,
    ConntrackOverrun,
    ConntrackPermissionError,
    ConntrackUnavailable,
)
from flow_exporter.conntrack.errors import error_from_errno, is_fatal
from flow_exporter.conntrack.events import grown
from tests.support.netlink_messages import ct_message, done_message, ip4_tuple


class FakeSocket:
    """Replays recv() results: bytes, or an exception to raise."""

    def __init__(self, replies: list[bytes | BaseException]) -> None:
        self.replies = list(replies)
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def recv_into(self, buf: bytearray, nbytes: int = 0, flags: int = 0) -> int:
        item = self.replies.pop(0)
        if isinstance(item, BaseException):
            raise item
        buf[:len(item)] = item
        return len(item)

    def close(self) -> None:
        self.closed = True


def udp_entry(sport: int, zone: int | None = None) -> bytes:
    attrs: list[Any] = [("CTA_TUPLE_ORIG", ip4_tuple("10.0.0.1", "10.0.0.2", sport=sport, dport=53)),
                        ("CTA_TUPLE_REPLY", ip4_tuple("10.0.0.2", "10.0.0.1", sport=53, dport=sport))]
    if zone is not None:
        attrs.append(("CTA_ZONE", zone))
    return ct_message(attrs)


def nlmsg_error(err: int) -> bytes:
    return struct.pack("=IHHIIi", 36, 2, 0, 1, 0, -err) + b"\0" * 16


@contextlib.contextmanager
def fake_dumper(replies: list[bytes | BaseException]) -> Iterator[tuple[ConntrackDumper, FakeSocket]]:
    with ConntrackDumper(timeout=5) as d:
        assert d._sock is not None
        d._sock.close()
        fake = FakeSocket(replies)
        d._sock = fake  # type: ignore[assignment]
        yield d, fake


def test_dump_streams_batches_and_filters_zones() -> None:
    batch1 = udp_entry(1) + udp_entry(2, zone=5)
    batch2 = udp_entry(3, zone=5) + b"\xff" * 20  # a truncated tail: skipped, counted
    with fake_dumper([batch1, batch2, done_message()]) as (d, fake):
        assert [c.orig_sport for c in d.dump()] == [1, 2, 3]
        assert d.last_skipped == 1
    with fake_dumper([batch1 + udp_entry(3, zone=5) + done_message()]) as (d, fake):
        assert [c.orig_sport for c in d.dump(zones={5})] == [2, 3]
        assert d.last_skipped == 0
    request = fake.sent[0]
    assert len(request) == 28 and struct.unpack_from("=HH", request, 20) == (6, 18)  # CTA_ZONE in the request
    assert struct.unpack_from("=HH", request, 4) == ((1 << 8) | 1, 0x301)  # CT_GET, REQUEST|DUMP
    assert request[16] == socket.AF_UNSPEC
    with fake_dumper([udp_entry(1, zone=1) + udp_entry(2, zone=2) + done_message()]) as (d, fake):
        assert [c.orig_sport for c in d.dump(zones={1, 2})] == [1, 2]
    assert len(fake.sent[0]) == 20  # several zones: no kernel filter


@pytest.mark.parametrize(
    ("replies", "exc", "fatal"),
    [
        ([OSError(errno.ENOBUFS, "No buffer space available")], ConntrackOverrun, False),
        ([udp_entry(1), done_message(errno.ENOBUFS)], ConntrackOverrun, False),
        ([OSError(errno.EINTR, "Interrupted")], ConntrackDumpInterrupted, False),
        ([nlmsg_error(errno.EPERM)], ConntrackPermissionError, True),
        ([nlmsg_error(errno.EOPNOTSUPP)], ConntrackUnavailable, True),
        ([nlmsg_error(errno.ENOENT)], ConntrackUnavailable, True),
        ([nlmsg_error(errno.EPROTONOSUPPORT)], ConntrackUnavailable, True),
        ([nlmsg_error(errno.EINVAL)], ConntrackError, False),  # unknown: retried with a backoff
        ([TimeoutError()], ConntrackError, False),
    ],
)
def test_dump_errors(replies: list[bytes | BaseException], exc: type[ConntrackError], fatal: bool) -> None:
    with fake_dumper(replies) as (d, fake):
        with pytest.raises(exc) as info:
            d.dump()
        assert type(info.value) is exc and info.value.fatal is fatal and is_fatal(info.value) is fatal
        assert isinstance(info.value, OSError) and info.value.errno
        assert fake.closed and d._sock is None  # a failed dump never leaves its rest behind


def test_error_messages() -> None:
    assert "needs CAP_NET_ADMIN" in str(error_from_errno(errno.EPERM, "conntrack: dump"))
    assert "conntrack module not loaded" in str(error_from_errno(errno.EOPNOTSUPP, "conntrack: dump"))
    assert "retry" in str(error_from_errno(errno.ENOBUFS, "conntrack: dump"))


def test_interrupted_dump_is_read_to_the_end_then_raises() -> None:
    intr = bytearray(udp_entry(1))
    intr[6] |= 0x10  # NLM_F_DUMP_INTR
    with fake_dumper([bytes(intr), udp_entry(2) + done_message()]) as (d, fake):
        with pytest.raises(ConntrackDumpInterrupted):
            d.dump()
        assert fake.replies == []


def test_stats_reply() -> None:
    stats = struct.pack("=IHHIIBBH", 36, (1 << 8) | 5, 0, 1, 0, 0, 0, 0)
    stats += struct.pack("=HH", 8, 1) + struct.pack(">I", 1234) + struct.pack("=HH", 8, 2) + struct.pack(">I", 65536)
    with fake_dumper([stats, stats[:8] + struct.pack("=I", 2) + stats[12:]]) as (d, _):
        assert d.count() == 1234  # sequence numbers: the first request is 1
        assert d.max_entries() == 65536


@pytest.mark.parametrize(
    ("size", "ceiling", "after"),
    [
        (4096, 32768, 8192),  # doubles
        (20000, 32768, 32768),  # up to the ceiling, not past it
        (32768, 32768, 32768),  # at the ceiling: stays
        (64 << 20, 4096, 64 << 20),  # a ceiling below the buffer: no growth, never shrinks
        (64 << 20, 0, 64 << 20),
    ],
)
def test_event_buffer_growth(size: int, ceiling: int, after: int) -> None:
    assert grown(size, ceiling) == after
