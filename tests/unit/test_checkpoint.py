"""The state directory: snapshot, journal, replay, and every way it can be unusable.

Files only (a temporary directory), no root, no broker: the store supplies rows and
records, a second Checkpoint reads them back as a restarted process would.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from flow_exporter.checkpoint import CHECKPOINT, JOURNAL, Checkpoint, CheckpointError
from flow_exporter.flow import Export, Restored
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.store_builders import Clock, poll, tcp

BOOT = b"B" * 16


def store_with_records(clock: Clock, lineage: bytes, n: int = 3) -> tuple[ConnectionStore, list[Export]]:
    store = ConnectionStore(Timeouts(), lineage=lineage, adopt=False)
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
    restored = ConnectionStore(Timeouts(), lineage=got.lineage)
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
