"""The state directory: snapshot, journal, replay, and every way it can be unusable.

Files only (a temporary directory), no root, no broker: the store supplies rows and
records, a second Checkpoint reads them back as a restarted process would.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import struct
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import fastavro
import pytest

from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.checkpoint import CHECKPOINT, JOURNAL, Checkpoint, CheckpointError, Loaded
from flow_exporter.flow import ADOPTED, Export, Restored
from flow_exporter.probes import readiness
from flow_exporter.record import load_schema
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.store import ConnectionStore
from flow_exporter.store.table import Table
from flow_exporter.timeouts import Timeouts
from tests.support import contract
from tests.support.fakes import FakeBroker, FakeTable
from tests.support.store_builders import Clock, poll, tcp

BOOT = b"B" * 16
SCHEMA = fastavro.parse_schema(load_schema())


def decode_record(value: bytes) -> dict[str, Any]:
    return fastavro.schemaless_reader(io.BytesIO(value), SCHEMA, SCHEMA)  # type: ignore[return-value]


def store_with_records(clock: Clock, lineage: bytes, n: int = 3) -> tuple[ConnectionStore, list[Export]]:
    store = ConnectionStore(Timeouts(), adopt=False)
    poll(store, clock, *(tcp(1000 + i, packets=2) for i in range(n)))
    clock.tick(5)
    poll(store, clock, *(tcp(1000 + i, packets=3) for i in range(n)))
    out = store.expire(clock.now, clock.wall())
    for e in out:  # as the sink prepares them
        e.value, e.topic, e.key = f"value-{e.flow_id}".encode(), "flows", b"k" + bytes([e.conn_key[3] & 0xFF])  # type: ignore[index]
    return store, out


def opened(path: Path, table: str = "", boot: bytes = BOOT) -> tuple[Checkpoint, object]:
    cp = Checkpoint(path, table=table, boot=boot)
    assert cp.lock()
    loaded = cp.load()
    cp.begin(loaded)
    return cp, loaded


def test_first_start_has_nothing_to_continue(tmp_path: Path) -> None:
    cp, loaded = opened(tmp_path)
    assert not loaded.valid and "first start" in loaded.why  # type: ignore[attr-defined]
    assert len(loaded.lineage) == 8 and cp.lineage == loaded.lineage  # type: ignore[attr-defined]
    cp.close()
    cp2, again = opened(tmp_path)  # begin() wrote an empty snapshot: now there is one to continue
    assert again.valid and again.lineage == loaded.lineage and again.rows == []  # type: ignore[attr-defined]
    cp2.close()


def test_journal_replay_gives_rows_and_undelivered_records(tmp_path: Path) -> None:
    clock = Clock()
    cp, _loaded = opened(tmp_path)
    _store, out = store_with_records(clock, cp.lineage)
    cp.sent(out)
    cp.delivered(out[:1])  # the others' delivery reports never came: the process was killed
    # no close(): as after SIGKILL
    cp2 = Checkpoint(tmp_path, boot=BOOT)
    got = cp2.load()
    assert got.valid and got.lineage == cp.lineage
    rows = {r.flow_id: r for r in got.rows}
    for e in out:
        r = rows[e.flow_id]
        assert (r.next_seq, r.base, r.key, r.ct_id, r.start_ns) == (
            e.sequence + 1,
            e.totals,
            e.conn_key,
            e.ct_id,
            e.start_ns,
        )
    assert sorted((e.flow_id, e.sequence, e.value, e.topic, e.key, e.totals) for e in got.resends) == sorted(
        (e.flow_id, e.sequence, e.value, e.topic, e.key, e.totals) for e in out[1:]
    )


def test_snapshot_then_journal_then_snapshot(tmp_path: Path) -> None:
    clock = Clock()
    cp, _ = opened(tmp_path)
    store, out = store_with_records(clock, cp.lineage)
    cp.sent(out)
    cp.snapshot(store.reported(), store.in_flight())  # all three still in flight
    assert cp.stats.snapshots == 2 and cp.stats.last_snapshot_bytes > 0
    for e in out:
        store.acknowledge(e, True, clock.now)
    cp.delivered(out)
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.resends == [] and len(got.rows) == 3
    restored = ConnectionStore(Timeouts())
    restored.restore(got.rows, got.resends)
    poll(restored, clock, *(tcp(1000 + i, packets=7) for i in range(3)))
    clock.tick(5)
    again = restored.expire(clock.now, clock.wall())
    assert sorted((e.sequence, e.deltas[0]) for e in again) == [(1, 4)] * 3


def test_torn_journal_tail_is_ignored(tmp_path: Path) -> None:
    clock = Clock()
    cp, _ = opened(tmp_path)
    _, out = store_with_records(clock, cp.lineage)
    cp.sent(out[:1])
    cp.sent(out[1:])
    size = (tmp_path / JOURNAL).stat().st_size
    os.truncate(tmp_path / JOURNAL, size - 7)  # killed in the middle of the second write
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid and "torn" in got.why
    assert [e.flow_id for e in got.resends] == [out[0].flow_id]  # the second batch was never produced


def test_checkpoint_from_another_boot_or_table_is_not_continued(tmp_path: Path) -> None:
    cp, first = opened(tmp_path, table="node-a")
    cp.close()
    other_boot = Checkpoint(tmp_path, table="node-a", boot=b"C" * 16).load()
    assert not other_boot.valid and "earlier boot" in other_boot.why
    assert other_boot.lineage != first.lineage  # type: ignore[attr-defined]
    other_table = Checkpoint(tmp_path, table="node-b", boot=BOOT).load()
    assert not other_table.valid and "another conntrack table" in other_table.why


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_damaged_checkpoint_is_reported_and_not_used(tmp_path: Path, damage: str) -> None:
    clock = Clock()
    cp, _ = opened(tmp_path)
    store, _out = store_with_records(clock, cp.lineage)
    cp.snapshot(store.reported(), store.in_flight())
    cp.close()
    path = tmp_path / CHECKPOINT
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"not a checkpoint at all" * 10)
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert not got.valid and ("damaged" in got.why or "unreadable" in got.why), got.why
    assert got.rows == [] and got.resends == []


def test_second_process_waits_for_the_lock(tmp_path: Path) -> None:
    cp, _ = opened(tmp_path)
    stop = threading.Event()
    other = Checkpoint(tmp_path, boot=BOOT)
    timer = threading.Timer(0.6, stop.set)
    timer.start()
    assert other.lock(stop, log_every=0.1) is False  # still held when told to stop
    cp.close()
    assert other.lock(threading.Event()) is True
    other.close()


def test_unwritable_state_drops_the_state_instead_of_leaving_a_stale_one(tmp_path: Path) -> None:
    clock = Clock()
    cp, _ = opened(tmp_path)
    _, out = store_with_records(clock, cp.lineage)
    cp.sent(out)
    assert cp._journal is not None
    os.dup2(os.open("/dev/full", os.O_WRONLY), cp._journal)  # the disk is full: the next write fails
    cp.sent([replace(e, sequence=e.sequence + 1) for e in out])
    assert cp.broken and cp.stats.errors == 1
    assert not (tmp_path / CHECKPOINT).exists() and not (tmp_path / JOURNAL).exists()
    cp.sent(out)  # a broken state writes nothing more, and says so once
    assert cp.stats.errors == 1
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert not got.valid  # a restart starts a new lineage rather than continue from a stale state


def test_state_dir_that_cannot_be_created_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"state\.dir"):
        Checkpoint(tmp_path / "file" / "state", boot=BOOT).lock()


def test_rows_round_trip_ipv6_and_unknown_start(tmp_path: Path) -> None:
    cp, _ = opened(tmp_path)
    v6 = (7, 17, bytes(range(16)), 53, bytes(range(16, 32)), 5353)
    rows = [
        Restored(v6, 2**32 - 1, 0, 123, -(2**63), 2**40, (1, 2**63, 3, 4), 3),
        Restored((0, 6, b"\x0a\0\0\1", 1, b"\x0a\0\0\2", 2), 5, 9, 9, 2**63 - 1, 1, (0, 0, 0, 0), 0),
    ]
    cp.snapshot(rows, [])
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert sorted(got.rows, key=lambda r: r.flow_id) == sorted(rows, key=lambda r: r.flow_id)


# ------------------------------------------------- a full disk, a read-only volume (issue 22, items 3 and 6)


class Disk:
    """The state directory's disk, through the checkpoint's two ports (``write``, ``unlink``).

    ``mode``: "ok"; "full" (ENOSPC); "short" (a write stops half-way and says so only by its
    count, as os.write does when the disk fills during it); "ro" (EROFS: nothing is written,
    nothing can be deleted).
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.undeletable: set[str] = set()  # names whose unlink fails (EPERM), whatever the mode

    def write(self, fd: int, data: bytes) -> int:
        if self.mode in ("full", "ro"):
            code = errno.ENOSPC if self.mode == "full" else errno.EROFS
            raise OSError(code, os.strerror(code))
        if self.mode == "short":
            return os.write(fd, data[: len(data) // 2])
        return os.write(fd, data)

    def unlink(self, path: Path) -> None:
        if self.mode == "ro" or path.name in self.undeletable:
            code = errno.EROFS if self.mode == "ro" else errno.EPERM
            raise OSError(code, os.strerror(code))
        os.unlink(path)


def on_disk(path: Path, disk: Disk, clock: Clock) -> tuple[Checkpoint, Loaded]:
    cp = Checkpoint(path, boot=BOOT, write=disk.write, unlink=disk.unlink, clock=lambda: clock.now)
    assert cp.lock()
    loaded = cp.load()
    cp.begin(loaded)
    return cp, loaded


@pytest.mark.parametrize("mode", ["short", "full"])
def test_a_short_or_failed_journal_write_deletes_the_state(tmp_path: Path, mode: str) -> None:
    clock, disk = Clock(), Disk()
    cp, _ = on_disk(tmp_path, disk, clock)
    _, out = store_with_records(clock, cp.lineage)
    cp.sent(out[:1])
    disk.mode = mode
    cp.sent(out[1:])  # a short count raises nothing: it must still count as a failure
    assert cp.broken and not cp.stale and cp.stats.errors == 1
    assert sorted(os.listdir(tmp_path)) == ["lock"]
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert not got.valid and got.why.startswith("no checkpoint")  # a restart: a new lineage, never reused sequences


@pytest.mark.parametrize("mode", ["short", "full"])
def test_a_failed_snapshot_leaves_no_tmp_file_holding_space(tmp_path: Path, mode: str) -> None:
    clock, disk = Clock(), Disk()
    cp, _ = on_disk(tmp_path, disk, clock)
    store, _ = store_with_records(clock, cp.lineage)
    disk.mode = mode
    cp.snapshot(store.reported(), store.in_flight())
    assert cp.broken and not cp.stale and cp.stats.errors == 1
    assert sorted(os.listdir(tmp_path)) == ["lock"]


@pytest.mark.parametrize("failing", ["journal write", "snapshot"])
def test_a_state_that_cannot_be_deleted_is_stale_and_kept_whole(tmp_path: Path, failing: str) -> None:
    """Read-only volume: nothing is deleted, the old state stays loadable and the checkpoint says it is stale."""
    clock, disk = Clock(), Disk()
    cp, _ = on_disk(tmp_path, disk, clock)
    store, out = store_with_records(clock, cp.lineage)
    cp.sent(out[:1])
    disk.mode = "ro"
    if failing == "snapshot":
        cp.snapshot(store.reported(), store.in_flight())
    else:
        cp.sent(out[1:])
    assert cp.broken and cp.stale and cp.stats.errors == 1
    got = Checkpoint(tmp_path, boot=BOOT).load()  # what a restart would continue from: what was journaled
    assert got.valid and got.lineage == cp.lineage and [e.flow_id for e in got.resends] == [out[0].flow_id]


def test_a_checkpoint_that_cannot_be_deleted_keeps_its_journal(tmp_path: Path) -> None:
    """Without its journal the checkpoint would be older than what was produced: both stay, or both go."""
    clock, disk = Clock(), Disk()
    cp, _ = on_disk(tmp_path, disk, clock)
    _, out = store_with_records(clock, cp.lineage)
    cp.sent(out[:1])
    disk.mode, disk.undeletable = "full", {CHECKPOINT}
    cp.sent(out[1:])
    assert cp.stale and sorted(os.listdir(tmp_path)) == ["checkpoint", "journal", "lock"]
    assert [e.flow_id for e in Checkpoint(tmp_path, boot=BOOT).load().resends] == [out[0].flow_id]
    disk.undeletable = set()
    clock.tick(1)
    assert cp.due()
    cp.snapshot([], [])  # still full, but now the old state can go: no longer stale, records may go out
    assert cp.broken and not cp.stale and sorted(os.listdir(tmp_path)) == ["lock"]


def journal_entries(path: Path) -> tuple[bytes, list[bytes]]:
    """The journal's header and its entries, as written (version 2: a 13-byte entry header)."""
    data = (path / JOURNAL).read_bytes()
    off, entries = 14, []  # magic, version, snapshot id
    while off < len(data):
        (length,) = struct.unpack_from("!I", data, off + 1)
        entries.append(data[off : off + 13 + length])
        off += 13 + length
    return data[:14], entries


def as_version_1(path: Path) -> None:
    """Rewrite a state directory as the previous release wrote it: no flags byte in the snapshot, and
    journal entries whose header (type, length, payload CRC) has no CRC of its own."""
    snap = bytearray((path / CHECKPOINT).read_bytes()[:-4])
    (tlen,) = struct.unpack_from("!H", snap, 14 + 40)
    del snap[14 + 40 + 2 + tlen]  # the flags byte after the table's name
    struct.pack_into("!H", snap, 4, 1)
    (path / CHECKPOINT).write_bytes(bytes(snap) + struct.pack("!I", zlib.crc32(snap)))
    head, entries = journal_entries(path)
    head = head[:4] + struct.pack("!H", 1) + head[6:]
    (path / JOURNAL).write_bytes(head + b"".join(e[:9] + e[13:] for e in entries))


@pytest.mark.parametrize(
    "damage, valid",
    [
        ("header cut by the end", True),
        ("payload cut by the end", True),
        ("torn, then more entries", False),  # what a full disk, then room again, left before the fix
        ("last entry whole, bad checksum", False),
        ("middle entry, bad checksum", False),
        ("unknown entry type in the middle", False),
        ("middle entry, damaged length", False),  # read as a torn tail before version 2: e3 silently dropped
        ("last entry, damaged length", False),
        ("middle entry, damaged header checksum", False),
    ],
)
def test_only_a_torn_tail_is_ignored_any_other_bad_entry_drops_the_state(
    tmp_path: Path, damage: str, valid: bool
) -> None:
    clock = Clock()
    cp, _ = opened(tmp_path)
    _, out = store_with_records(clock, cp.lineage, n=3)
    for e in out:
        cp.sent([e])
    head, (e1, e2, e3) = journal_entries(tmp_path)
    assert len(e3) >= len(e2) - len(e2) // 2  # torn e2 then e3: e2's declared length fits in the file
    flip = lambda b, i: b[:i] + bytes([b[i] ^ 0x40]) + b[i + 1 :]  # noqa: E731
    body = {
        "header cut by the end": e1 + e2 + e3[:5],
        "payload cut by the end": e1 + e2 + e3[:-3],
        "torn, then more entries": e1 + e2[: len(e2) // 2] + e3,
        "last entry whole, bad checksum": e1 + e2 + flip(e3, 40),
        "middle entry, bad checksum": e1 + flip(e2, 40) + e3,
        "unknown entry type in the middle": e1 + bytes([9]) + e2[1:] + e3,
        "middle entry, damaged length": e1 + flip(e2, 2) + e3,
        "last entry, damaged length": e1 + e2 + flip(e3, 2),
        "middle entry, damaged header checksum": e1 + flip(e2, 11) + e3,
    }[damage]
    (tmp_path / JOURNAL).write_bytes(head + body)
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid is valid, got.why
    if valid:
        assert "torn" in got.why and [e.flow_id for e in got.resends] == [e.flow_id for e in out[:2]]
    else:
        assert "journal damaged" in got.why and got.rows == [] and got.lineage != cp.lineage


def test_a_snapshot_is_retried_with_backoff_and_the_state_is_whole_again(tmp_path: Path) -> None:
    clock, disk = Clock(), Disk()
    cp, _ = on_disk(tmp_path, disk, clock)
    store, out = store_with_records(clock, cp.lineage)
    disk.mode = "full"
    cp.sent(out)  # fails: the state is deleted, the records still go out
    assert cp.broken and not cp.stale and not cp.due()
    retries = []
    for _ in range(16):  # one second at a time: a snapshot when due(), failing while the disk is full
        clock.tick(1)
        if cp.due():
            retries.append(clock.now)
            cp.snapshot(store.reported(), store.in_flight())
    assert [t - retries[0] for t in retries] == [0, 2, 6, 14]  # 1 s after the failure, then 2, 4, 8, 8 ...
    assert cp.stats.errors == 5 and cp.broken
    for e in out[:1]:
        store.acknowledge(e, True, clock.now)  # delivered meanwhile: the journal could not say so
    disk.mode = "ok"
    while not cp.due():
        clock.tick(1)
    cp.snapshot(store.reported(), store.in_flight())
    assert not cp.broken and not cp.due() and cp.stats.snapshots == 2
    cp.delivered(out[1:2])  # the journal goes on after the fresh snapshot
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid and got.lineage == cp.lineage
    assert sorted((r.flow_id, r.next_seq, r.base) for r in got.rows) == sorted(
        (e.flow_id, e.sequence + 1, e.totals) for e in out
    )
    assert [(e.flow_id, e.value) for e in got.resends] == [(e.flow_id, e.value) for e in out[2:]]


# The expire loop's turn, as Exporter.expire_loop runs it: export, snapshot when due, serve deliveries.
def turn(exp: Exporter, broker: FakeBroker, clock: Clock, table: FakeTable, packets: int) -> None:
    clock.tick(1)
    table.entries = [tcp(46000 + i, packets=packets + i) for i in range(3)]
    exp.poll_once()
    exp.expire_once()
    cp = exp.checkpoint
    assert cp is not None
    if cp.due():
        exp.snapshot()
    broker.poll(0)


def continues_exactly(path: Path, broker: FakeBroker) -> None:
    """A restart from what is on disk now: every connection at the sequence after its last record produced,
    with that record's totals as its base; records awaiting delivery are ones produced, as the same bytes."""
    got = Checkpoint(path, boot=BOOT).load()
    assert got.valid, got.why
    last: dict[int, tuple[int, tuple[int, ...]]] = {}
    for a in broker.accepted:
        r = decode_record(a.value)
        totals = tuple(r[f] for f in contract.TOTALS)
        last[a.flow_id] = max(last.get(a.flow_id, (-1, ())), (a.sequence, totals))
    assert {r.flow_id: (r.next_seq - 1, r.base) for r in got.rows} == last
    sent = {(a.flow_id, a.sequence): a.value for a in broker.accepted}
    assert all(sent[(e.flow_id, e.sequence)] == e.value for e in got.resends)


def exporter_on(path: Path, disk: Disk, clock: Clock) -> tuple[Exporter, FakeTable, FakeBroker]:
    cp, loaded = on_disk(path, disk, clock)
    table, broker = FakeTable(), FakeBroker(RecordEncoder("node-a").encode)
    exp = Exporter(
        table,
        broker,
        ExporterOptions(
            timeouts=Timeouts(poll_interval=1.0, active=5.0, idle=15.0), node_name="node-a", adopt=not loaded.valid
        ),
        clock=lambda: clock.now,
        wall_ns=clock.wall,
        checkpoint=cp,
    )  # fmt: skip
    return exp, table, broker


@pytest.mark.parametrize("mode", ["full", "ro"])
def test_the_exporter_while_its_state_dir_cannot_be_written(tmp_path: Path, mode: str) -> None:
    """Full disk: records go on, the state is deleted. Read-only: records are held back, /readyz 503,
    a restart continues from the old state. Then room again: a fresh snapshot, and nothing lost."""
    clock, disk = Clock(), Disk()
    exp, table, broker = exporter_on(tmp_path, disk, clock)
    ready = readiness(exp.lifecycle, lambda: True, held_back=exp.held_back)
    packets = 1
    for _ in range(8):
        packets += 2
        turn(exp, broker, clock, table, packets)
    before = len(broker.accepted)
    assert before == 3 and ready() == (True, "ok")
    disk.mode = mode
    for _ in range(8):  # past the next active timeout: a journal write fails
        packets += 2
        turn(exp, broker, clock, table, packets)
    r = exp.readings().checkpoint
    assert r is not None and (r.broken, r.stale) == (1, int(mode == "ro"))
    if mode == "ro":
        assert len(broker.accepted) == before < exp.store.stats.records_built  # held back, kept in the store
        assert ready()[0] is False and "held back" in ready()[1]
        continues_exactly(tmp_path, broker)  # the old state still tells the truth
    else:
        assert len(broker.accepted) == exp.store.stats.records_built > before  # still produced; the state is gone
        assert ready() == (True, "ok") and sorted(os.listdir(tmp_path)) == ["lock"]
    disk.mode = "ok"
    for _ in range(10):
        packets += 2
        turn(exp, broker, clock, table, packets)
    r = exp.readings().checkpoint
    assert r is not None and (r.broken, r.stale) == (0, 0) and ready() == (True, "ok")
    continues_exactly(tmp_path, broker)  # the fresh snapshot and its journal: a restart continues exactly
    exp.shutdown()
    recs = [decode_record(a.value) for a in broker.accepted]
    groups = contract.check(recs)
    final = {46000 + i: (packets + i, (packets + i) * 100, packets + i, (packets + i) * 200) for i in range(3)}
    assert {rs[0]["sourcePort"]: contract.consumer_sum(rs) for rs in groups.values()} == final


def test_shutdown_while_stale_produces_nothing_and_the_old_state_continues(tmp_path: Path) -> None:
    clock, disk = Clock(), Disk()
    exp, table, broker = exporter_on(tmp_path, disk, clock)
    for packets in range(8):
        turn(exp, broker, clock, table, packets + 1)
    disk.mode = "ro"
    for packets in range(8, 16):
        turn(exp, broker, clock, table, packets + 1)
    assert exp.held_back()
    before = len(broker.accepted)
    assert exp.shutdown(time.monotonic() + 0.3) == 0
    assert len(broker.accepted) == before  # no final record either: the old state would no longer be true
    assert dataclasses.astuple(exp.outcome) == (0, 3, 0)  # three records held back, none lost
    continues_exactly(tmp_path, broker)


def loaded_view(got: Loaded) -> tuple[Any, ...]:
    return (
        got.valid, got.adopting, got.lineage, sorted(got.rows),
        sorted((e.flow_id, e.sequence, e.value, e.topic, e.key, e.totals) for e in got.resends),
    )  # fmt: skip


def test_a_version_1_state_directory_still_loads(tmp_path: Path) -> None:
    """A state directory the previous release wrote (snapshot and journal of version 1) loads as it did."""
    clock = Clock()
    cp, _ = opened(tmp_path)
    store, out = store_with_records(clock, cp.lineage)
    cp.snapshot(store.reported(), [])
    cp.sent(out)
    cp.delivered(out[:1])
    want = Checkpoint(tmp_path, boot=BOOT).load()
    assert want.valid and len(want.rows) == 3 and len(want.resends) == 2
    as_version_1(tmp_path)
    assert (tmp_path / JOURNAL).read_bytes()[4:6] == b"\0\1"
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert "journal: 2 entries replayed" in got.why
    assert loaded_view(got) == loaded_view(want)


def test_a_damaged_length_in_a_version_1_journal_still_reads_as_a_torn_tail(tmp_path: Path) -> None:
    """What version 2 closes: in version 1 a length is outside the CRC, so nothing can tell it from a cut."""
    clock = Clock()
    cp, _ = opened(tmp_path)
    _, out = store_with_records(clock, cp.lineage)
    for e in out:
        cp.sent([e])
    as_version_1(tmp_path)
    data = bytearray((tmp_path / JOURNAL).read_bytes())
    (first,) = struct.unpack_from("!I", data, 14 + 1)
    data[14 + 9 + first + 2] ^= 0x40  # the second entry's length
    (tmp_path / JOURNAL).write_bytes(bytes(data))
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid and "torn" in got.why and len(got.resends) == 1


def rewrite_snapshot(path: Path, change: Any) -> None:
    """Change a snapshot's body and give it a valid CRC again: damage no checksum can see."""
    snap = bytearray((path / CHECKPOINT).read_bytes()[:-4])
    change(snap)
    (path / CHECKPOINT).write_bytes(bytes(snap) + struct.pack("!I", zlib.crc32(snap)))


def rewrite_entry(path: Path, i: int, change: Any) -> None:
    """Change journal entry ``i``'s payload and give it a valid header and CRCs again."""
    head, entries = journal_entries(path)
    e = entries[i]
    payload = bytearray(e[13:])
    change(payload)
    h = struct.pack("!BII", e[0], len(payload), zlib.crc32(payload))
    entries[i] = h + struct.pack("!I", zlib.crc32(h)) + bytes(payload)
    (path / JOURNAL).write_bytes(head + b"".join(entries))


@pytest.mark.parametrize(
    "damage",
    [
        "journal entry announces more rows than it holds",
        "journal entry holds more than it announces",
        "journal row with an address length of 7",
        "snapshot announces more rows than it holds",
        "snapshot announces more records than it holds",
        "snapshot with an unknown version",
    ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_a_crc_valid_but_inconsistent_state_is_dropped_never_raised(tmp_path: Path, damage: str, version: int) -> None:
    """Files whose checksums hold but whose contents contradict themselves: a new lineage, not an exception at
    every start (load() raised IndexError for the first: a crash loop). Also in the previous release's format."""
    clock = Clock()
    cp, _ = opened(tmp_path)
    store, out = store_with_records(clock, cp.lineage)
    cp.snapshot(store.reported(), out[:1])
    cp.sent(out[1:])
    assert Checkpoint(tmp_path, boot=BOOT).load().valid
    rows_at = 14 + 40 - 8  # the snapshot header's row count (after boot id, lineage, written at)
    change = {
        "journal entry announces more rows than it holds": lambda: rewrite_entry(
            tmp_path, 0, lambda p: struct.pack_into("!I", p, 0, 3)
        ),
        "journal entry holds more than it announces": lambda: rewrite_entry(
            tmp_path, 0, lambda p: struct.pack_into("!I", p, 0, 1)
        ),
        "journal row with an address length of 7": lambda: rewrite_entry(tmp_path, 0, lambda p: p.__setitem__(4, 7)),
        "snapshot announces more rows than it holds": lambda: rewrite_snapshot(
            tmp_path, lambda b: struct.pack_into("!I", b, rows_at, 4)
        ),
        "snapshot announces more records than it holds": lambda: rewrite_snapshot(
            tmp_path, lambda b: struct.pack_into("!I", b, rows_at + 4, 2)
        ),
        "snapshot with an unknown version": lambda: rewrite_snapshot(
            tmp_path, lambda b: struct.pack_into("!H", b, 4, 3)
        ),
    }[damage]
    change()
    if version == 1 and damage != "snapshot with an unknown version":
        as_version_1(tmp_path)
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert not got.valid and "damaged" in got.why, got.why
    assert got.rows == [] and got.resends == [] and got.lineage != cp.lineage


def test_a_state_loss_is_carried_until_a_snapshot_after_the_first_complete_poll(tmp_path: Path) -> None:
    """After a lost state, begin() writes a valid empty checkpoint before the first poll: it must say that
    connections found live are still to be flagged adopted, or a process dying before their first records
    leaves the next one reporting them from sequence 0, unflagged (the consumer rule would double-count)."""
    clock = Clock()
    cp, loaded = opened(tmp_path)
    assert not loaded.valid  # type: ignore[attr-defined]
    cp.close()
    again = Checkpoint(tmp_path, boot=BOOT)
    got = again.load()
    assert got.valid and got.adopting and got.rows == []
    again.begin(got)  # a second process that also dies before its first poll: still adopting
    again.close()
    third = Checkpoint(tmp_path, boot=BOOT)
    got = third.load()
    assert got.valid and got.adopting
    third.begin(got)
    store = ConnectionStore(Timeouts(), adopt=True)
    store.restore(got.rows, got.resends, adopting=got.adopting)
    poll(store, clock, tcp(1000, packets=2))
    [row] = store.reported()  # adopted, no record yet: kept, flagged
    assert row.next_seq == 0 and row.flags & ADOPTED
    third.snapshot(store.reported(), store.in_flight())
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid and not got.adopting and [r.flags & ADOPTED for r in got.rows] == [ADOPTED]


@pytest.mark.parametrize("where", ["restore", "first poll", "events"])
def test_a_restored_state_that_raises_is_dropped_for_a_new_lineage_not_a_crash_loop(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception of the store while it restores or first meets the restored rows would come back at every
    start with the same state (before, the poll loop took it as fatal: CrashLoopBackOff, once per bad row).
    The state is dropped instead: a new lineage, live connections flagged adopted, a metric, an error log.
    The same exception outside that window stays fatal."""
    clock, disk = Clock(), Disk()
    exp, table, broker = exporter_on(tmp_path, disk, clock)
    for packets in (3, 5, 7, 9, 11, 13):
        turn(exp, broker, clock, table, packets)
    exp.snapshot()
    before = {(a.flow_id, a.sequence): a.value for a in broker.accepted}
    old_lineage = exp.checkpoint.lineage  # type: ignore[attr-defined]
    exp.checkpoint.close()  # type: ignore[attr-defined]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("a bug in the restart code")

    exp2, table, broker2 = exporter_on(tmp_path, disk, clock)
    got = Checkpoint(tmp_path, boot=BOOT).load()
    assert got.valid and len(got.rows) == 3
    table.entries = [tcp(46000 + i, packets=20 + i) for i in range(3)]
    rows = got.rows
    if where == "restore":  # a row the store cannot take (no flags)
        rows = [rows[0]._replace(flags=None), *rows[1:]]
    with monkeypatch.context() as m:  # only applying the restored state is broken: the fresh store works
        if where != "restore":
            m.setattr(Table, "_continue", broken)
        exp2.restore(rows, got.resends)
        if where == "first poll":
            exp2.poll_once()
        elif where == "events":  # the DESTROY of a restored connection, read before the first poll
            gone = table.entries.pop(0)
            exp2.apply_events([], [replace(gone, stop_ns=clock.wall())])
    assert exp2.stats.states_dropped == 1 and exp2.readings().states_dropped == 1
    exp2.poll_once()
    clock.tick(6)
    exp2.poll_once()
    exp2.expire_once()
    broker2.poll(0)
    assert exp2.checkpoint.lineage != old_lineage  # type: ignore[attr-defined]
    new = [decode_record(a.value) for a in broker2.accepted if (a.flow_id, a.sequence) not in before]
    resent = [a for a in broker2.accepted if (a.flow_id, a.sequence) in before]
    assert all(before[(a.flow_id, a.sequence)] == a.value for a in resent)  # the old lineage's records: same bytes
    assert len(new) == 3 and not {r["connectionId"] for r in new} & {f for f, _ in before}
    assert all(r["flags"] & ADOPTED and r["sequence"] == 0 for r in new)  # flagged: counted before
    assert sorted(r["packetTotalCount"] for r in new) == [20, 21, 22]
    exp2.snapshot()
    again = Checkpoint(tmp_path, boot=BOOT).load()
    assert again.valid and not again.adopting and again.lineage == exp2.checkpoint.lineage  # type: ignore[attr-defined]
    assert len(again.rows) == 3
    # Past the first poll the same exception is a bug like any other: fatal, as before.
    table.entries.append(tcp(47000, packets=1))
    with monkeypatch.context() as m:
        m.setattr(Table, "_track", broken)
        with pytest.raises(KeyError):
            exp2.poll_once()


def test_a_connection_known_only_from_its_new_event_at_sigterm_continues_under_its_id(tmp_path: Path) -> None:
    """Seen only through its NEW event (no start stamp) when SIGTERM comes: the shutdown's last dump learns the
    kernel's start before the final record is built, so the checkpoint row names the incarnation and the next
    process continues its connectionId (before: the row had no start, the next dump's start made it ambiguous,
    and the entry went on under a new id flagged adopted: a double count for the consumer rule)."""
    clock, disk = Clock(), Disk()
    exp, table, broker = exporter_on(tmp_path, disk, clock)
    exp.poll_once()  # the table is empty
    clock.tick(0.5)
    entry = tcp(46100, packets=4, start_ns=clock.wall() - 1_000_000)
    exp.apply_events([replace(entry, start_ns=0, orig_packets=0, orig_bytes=0)], [])  # NEW events carry no start
    table.entries = [entry]
    clock.tick(0.2)
    exp.stop()
    assert exp.shutdown(time.monotonic() + 5) == 0
    broker.poll(0)
    [final] = [decode_record(a.value) for a in broker.accepted]
    assert (final["flowEndReason"], final["sequence"], final["packetTotalCount"]) == (4, 0, 4)
    exp.checkpoint.close()  # type: ignore[attr-defined]
    exp2, table2, broker2 = exporter_on(tmp_path, disk, clock)
    got = Checkpoint(tmp_path, boot=BOOT).load()
    exp2.restore(got.rows, got.resends)
    table2.entries = [replace(entry, orig_packets=9, orig_bytes=900)]
    exp2.poll_once()
    clock.tick(6)
    exp2.poll_once()
    exp2.expire_once()
    broker2.poll(0)
    [later] = [decode_record(a.value) for a in broker2.accepted]
    assert (later["connectionId"], later["sequence"], later["flags"]) == (final["connectionId"], 1, 0)
    assert later["packetDeltaCount"] == 5 and exp2.readings().connections_restored == 1


def test_adopting_on_disk_ends_with_a_snapshot_after_the_first_complete_poll(tmp_path: Path) -> None:
    """A first start (or a lost state) writes "still adopting"; the expire loop's turn after the first complete
    poll writes a snapshot that says otherwise, or a SIGKILL before the journal outgrew the snapshot would have
    the next start flag every connection it finds that no row names (found by the lab's SIGKILL restart test)."""
    clock, disk = Clock(), Disk()
    exp, table, _ = exporter_on(tmp_path, disk, clock)
    assert Checkpoint(tmp_path, boot=BOOT).load().adopting
    exp.expire_once()  # before any poll: still adopting
    assert Checkpoint(tmp_path, boot=BOOT).load().adopting
    table.entries = [tcp(46200, packets=3)]
    exp.poll_once()
    exp.expire_once()
    got = Checkpoint(tmp_path, boot=BOOT).load()  # no close(): as after SIGKILL
    assert got.valid and not got.adopting
    assert [r.flags & ADOPTED for r in got.rows] == [ADOPTED]  # found live by the first poll: flagged, kept
