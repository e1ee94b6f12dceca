"""The state directory's rows (flow_exporter/checkpoint_rows.py): both builds of the one source, and its formats.

A snapshot packs the store's reported connections straight from its columns (flow.ReportedRows), the
rows it made and the records in flight; the journal packs a batch's SENT rows and ACKs. The compiled and
the interpreted build of the module are given the same rows and records, hostile values included (a
negative start, a zone past 16 bits, an address of another length, a slot past the columns, totals past
64 bits, a topic that cannot be encoded, a bytearray key), and must give the same bytes or raise the
same error. The bytes are also held to the struct formats the checkpoint reads them back with, packed
here by :mod:`struct` from the same values: the layout's other statement.
"""

from __future__ import annotations

import socket
import struct
from array import array
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flow_exporter import checkpoint, compiled
from flow_exporter.checkpoint import Checkpoint
from flow_exporter.connection import PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.flow import ROW_ENDED, Export, ReportedRows, Restored, RowColumns
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts

BUILT = compiled.load("checkpoint_rows")
INTERPRETED = compiled.interpreted("checkpoint_rows", as_name="tests_interpreted_checkpoint_rows")
BUILDS = [pytest.param(BUILT, id="built"), pytest.param(INTERPRETED, id="interpreted")]

U64 = 2**64 - 1
ADDRS = [bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]), b"\xfd" + b"\0" * 14 + b"\x01", b"\x0a\0\0", b"\x0a\0\0\0\0"]
HEADER = 4 + 2 + 8 + 16 + 8 + 8 + 4 + 4 + 2 + 1  # magic, version, id; boot, lineage, time, rows, records; table; flags
COLUMN_TYPES = ("I", "q", "q", "q", "I", "Q", "Q", "Q", "Q")


def packed(module: Any, reported: Any, in_flight: Any) -> tuple[Any, ...]:
    """Checkpoint.pack's rows, records and bytes with this build, or the error it raised (type and message)."""
    with mock.patch.object(checkpoint, "_rows", module):
        cp = Checkpoint("unused")
        try:
            p = cp.pack(reported, in_flight)
        except Exception as exc:  # the error itself is compared
            return (type(exc), str(exc))
    return (p.rows, p.records, bytes(p.data))


def assert_same(reported: ReportedRows, in_flight: list[Export]) -> tuple[Any, ...]:
    interpreted = packed(INTERPRETED, reported, list(in_flight))
    assert packed(BUILT, reported, list(in_flight)) == interpreted
    return interpreted


def test_the_built_module_is_compiled() -> None:
    """make test builds it (tools/setup.sh); the interpreted run (FLOW_EXPORTER_INTERPRETED) loads the source."""
    assert compiled.is_compiled(BUILT) != compiled.forced_interpreted()
    assert not compiled.is_compiled(INTERPRETED)


keys = st.tuples(
    st.sampled_from([0, 7, 0xFFFF, 0x1_0007, -1]),  # zone: & 0xFFFF as the pure packer does
    st.sampled_from([PROTO_TCP, PROTO_UDP, 0, 255]),
    st.sampled_from(ADDRS[:3]),
    st.integers(0, 0xFFFF),
    st.sampled_from(ADDRS[:3]),
    st.integers(0, 0xFFFF),
).filter(lambda k: len(k[2]) == len(k[4]))


@st.composite
def reported_rows(draw: Any) -> ReportedRows:
    """Columns of n slots with any value their arrays hold, some slots reported, and rows already made."""
    n = draw(st.integers(0, 12))
    cols: list[Any] = []
    for code in COLUMN_TYPES:
        big = {"I": 2**32 - 1, "q": 2**63 - 1, "Q": U64}[code]
        low = -(2**63) if code == "q" else 0
        cols.append(array(code, draw(st.lists(st.sampled_from([0, 1, big, low, 12345]), min_size=n, max_size=n))))
    cols.append(bytearray(draw(st.lists(st.integers(0, 255), min_size=n, max_size=n))))
    table = draw(st.lists(keys, min_size=n, max_size=n))
    slots = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []
    rest = [
        Restored(k, 1, 2, 3, 4, 5, (6, 7, 8, 9), ROW_ENDED) for k in draw(st.lists(keys, max_size=2))
    ]  # fmt: skip
    return ReportedRows(slots, table, RowColumns(*cols), rest)


texts = st.sampled_from([None, "", "flows", "flüsse", "\ud800"])
blobs = st.sampled_from([None, b"", b"k", b"\x00" * 300])


@st.composite
def records(draw: Any) -> Export:
    return Export(
        0,
        draw(st.sampled_from([0, 1, U64])),
        draw(st.tuples(*[st.sampled_from([0, 7, U64])] * 4)),
        (0, 0, 0, 0),
        False,
        0,
        draw(st.sampled_from([0, -1, 2**63 - 1, -(2**63)])),
        topic=draw(texts),
        key=draw(blobs),
        value=draw(blobs),
    )


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(reported=reported_rows(), in_flight=st.lists(records(), max_size=4))
def test_the_same_snapshot_bytes(reported: ReportedRows, in_flight: list[Export]) -> None:
    assert_same(reported, in_flight)


def one_row(**change: Any) -> ReportedRows:
    cols: list[Any] = [array(code, [5]) for code in COLUMN_TYPES] + [bytearray([3])]
    for name, value in change.items():
        i = ["ct", "start", "first", "fid", "seq", "bp", "bb", "brp", "brb", "flags"].index(name)
        cols[i] = type(cols[i])(cols[i].typecode, [value]) if isinstance(cols[i], array) else bytearray([value])
    return ReportedRows([0], [(0, PROTO_TCP, ADDRS[0], 1, ADDRS[1], 2)], RowColumns(*cols), [])


@pytest.mark.parametrize(
    "reported",
    [
        pytest.param(one_row(), id="plain"),
        pytest.param(one_row(start=-1), id="negative start"),
        pytest.param(one_row(first=-(2**63)), id="negative first seen"),
        pytest.param(one_row(fid=-1), id="negative flow id"),
        pytest.param(one_row(flags=255), id="every flag"),
        pytest.param(ReportedRows([1], [(0, 6, ADDRS[0], 1, ADDRS[1], 2)], one_row().columns, []), id="slot past"),
        pytest.param(ReportedRows([1], one_row().keys * 2, one_row().columns, []), id="slot past the columns"),
        pytest.param(ReportedRows([0], [(0, 6, ADDRS[0], 1, ADDRS[2], 2)], one_row().columns, []), id="mixed sizes"),
        pytest.param(ReportedRows([0], [(0, 6, ADDRS[3], 1, ADDRS[3], 2)], one_row().columns, []), id="3 bytes"),
        pytest.param(ReportedRows([0], [(0, 6, ADDRS[0], 70000, ADDRS[0], 2)], one_row().columns, []), id="port"),
        pytest.param(ReportedRows([0], [(0, 256, ADDRS[0], 1, ADDRS[0], 2)], one_row().columns, []), id="proto"),
        pytest.param(ReportedRows([0], [(2**70, 6, ADDRS[0], 1, ADDRS[0], 2)], one_row().columns, []), id="zone"),
        pytest.param(ReportedRows([0], [(0, True, ADDRS[0], 1, ADDRS[0], 2)], one_row().columns, []), id="bool"),
        pytest.param(ReportedRows([0], [(0, 6, "10.0.0.1", 1, ADDRS[0], 2)], one_row().columns, []), id="str addr"),
        pytest.param(ReportedRows([0], [(0, 6, ADDRS[0], 1)], one_row().columns, []), id="short key"),
        pytest.param(ReportedRows([True], one_row().keys, one_row().columns, []), id="bool slot"),
        pytest.param(ReportedRows([0], one_row().keys, RowColumns(*([5] for _ in range(10))), []), id="lists"),
        pytest.param(ReportedRows([0], one_row().keys, tuple(one_row().columns), []), id="unnamed"),  # type: ignore[arg-type]
        pytest.param(ReportedRows([-1], one_row().keys, one_row().columns, []), id="negative slot"),
        pytest.param(ReportedRows([0], one_row().keys, one_row().columns[:9], []), id="nine columns"),  # type: ignore[arg-type]
    ],
)
def test_a_hostile_row_packs_or_fails_alike(reported: ReportedRows) -> None:
    assert_same(reported, [])


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(Export(0, 1, (1, 2, 3, 2**64), (0,) * 4, False, 0, 1), id="totals past 64 bits"),  # type: ignore[arg-type]
        pytest.param(Export(0, 1, (1, 2, 3), (0,) * 4, False, 0, 1), id="three totals"),  # type: ignore[arg-type]
        pytest.param(Export(0, -1, (1, 2, 3, 4), (0,) * 4, False, 0, 1), id="negative sequence"),
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 2**63), id="flow id past int64"),
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 1, key=b"k" * 70000), id="long key"),
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 1, key=bytearray(b"k")), id="bytearray key"),  # type: ignore[arg-type]
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 1, topic="t" * 70000), id="long topic"),
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 1, topic=b"t"), id="bytes topic"),  # type: ignore[arg-type]
        pytest.param(Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 1, value=b"v" * 100_000), id="long value"),
    ],
)
def test_a_hostile_record_packs_or_fails_alike(record: Export) -> None:
    good = Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 9, topic="t", key=b"k", value=b"v")
    assert_same(one_row(), [good, record, good])


@example(n=0)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 40))
def test_a_store_snapshot_is_the_same_bytes(n: int) -> None:
    """A real store's reported rows and records in flight (built, not yet delivered), both ways."""
    store = ConnectionStore(Timeouts(poll_interval=1, active=5, idle=15))
    v6 = (ADDRS[2], ADDRS[2][:-1] + b"\x02")
    conns = [  # IPv4 and IPv6 (every third) rows: the packer sizes its buffer for each row's own length
        Connection(socket.AF_INET6 if i % 3 == 0 else socket.AF_INET, PROTO_TCP, a, b, 1000 + i, 80, b, a, 80,
                   1000 + i, ct_id=i + 1, orig_packets=i, orig_bytes=10 * i, start_ns=1 + i)
        for i in range(n)
        for a, b in [v6 if i % 3 == 0 else (ADDRS[0], ADDRS[1])]
    ]  # fmt: skip
    store.update_batch(conns, now=0.0, wall_ns=1)
    exports = store.expire(6.0, 6 * 10**9)
    for e in exports[: n // 2]:
        store.acknowledge(e, True, 6.0)
    got = assert_same(store.reported(), list(store.in_flight()))
    assert got[:2] == (n, n - n // 2)
    # The rows again, by struct from the Restored rows (the reference iteration of ReportedRows) and the records.
    want = bytearray(HEADER)
    for key, ct, start, first, fid, seq, base, flags in store.reported():
        zone, proto, src, sport, dst, dport = key
        want += checkpoint._ROW[len(src)].pack(len(src), zone, proto, sport, dport, src, dst, ct, start, first, fid,
                                               seq, *base, flags)  # fmt: skip
    for e in store.in_flight():
        topic, key_b, value = (e.topic or "").encode(), e.key or b"", e.value or b""
        want += checkpoint._REC.pack(e.flow_id, e.sequence, *e.totals, len(topic), len(key_b), len(value))
        want += topic + key_b + value
    assert got[2] == bytes(want)  # the header's room is zeros until write() fills it


@pytest.mark.parametrize("module", BUILDS)
@settings(max_examples=200, deadline=None)
@given(
    key=keys.filter(lambda k: 0 <= k[0] <= 0xFFFF),
    values=st.tuples(
        st.integers(0, 2**32 - 1),  # ct_id
        *[st.integers(0, U64)] * 2,  # start, first seen
        st.integers(-(2**63), 2**63 - 1),  # flow id
        *[st.integers(0, U64)] * 5,  # next sequence, base totals
        st.integers(0, 255),  # flags
    ),
    topic=st.text(max_size=5),
    blobs=st.tuples(st.binary(max_size=40), st.binary(max_size=300)),
    ended=st.booleans(),
)
def test_each_writer_is_its_struct_format(
    module: Any, key: Any, values: tuple[int, ...], topic: str, blobs: tuple[bytes, bytes], ended: bool
) -> None:
    """ROW, SENT_ROW, RECORD and ACK: what the writers write is what the reader's struct formats pack."""
    zone, proto, src, sport, dst, dport = key
    ct, start, first, fid, seq, b0, b1, b2, b3, flags = values
    head = (len(src), zone, proto, sport, dport, src, dst, ct, start, first, fid, seq, b0, b1, b2, b3)
    out = bytearray(b"before")
    assert module.pack_restored([Restored(key, ct, start, first, fid, seq, (b0, b1, b2, b3), flags)], out) == 1
    assert out == b"before" + module.ROW[len(src)].pack(*head, flags)

    e = Export(0, seq - 1 if seq else 0, (b0, b1, b2, b3), (0,) * 4, False, 0, fid, first, key, ct, start,
               flags & 0x0F, ended, topic=topic, key=blobs[0], value=blobs[1], row_kind=flags & 0xF0)  # fmt: skip
    t, (k, v) = topic.encode(), blobs
    sent = module.journal_sent([e], {})
    row = module.SENT_ROW[len(src)].pack(*head[:11], e.sequence + 1, b0, b1, b2, b3, flags, ended, len(t), len(k),
                                         len(v))  # fmt: skip
    assert sent == (1).to_bytes(4, "big") + row + t + k + v
    out = bytearray()
    assert module.pack_records([e], out) == 1
    assert out == module.RECORD.pack(fid, e.sequence, b0, b1, b2, b3, len(t), len(k), len(v)) + t + k + v
    assert module.journal_acked([e, e]) == module.ACK.pack(fid, e.sequence) * 2
    assert module.journal_sent([], {}) == b""  # no entry for nothing


def test_a_resend_and_a_restored_record_are_not_journaled_again() -> None:
    e = Export(0, 1, (1, 2, 3, 4), (0,) * 4, False, 0, 9, conn_key=(0, 6, ADDRS[0], 1, ADDRS[1], 2))
    for module in (BUILT, INTERPRETED):
        assert module.journal_sent([replace(e, attempts=1), replace(e, conn_key=None)], {}) == b""
        assert struct.unpack_from("!I", module.journal_sent([e, replace(e, attempts=2)], {}))[0] == 1
