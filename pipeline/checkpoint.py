"""The exporter's state directory: what has been reported, so a restarted exporter continues exactly.

Why: a DaemonSet rollout, a crash or an OOM kill restarts the exporter while the
kernel's conntrack table lives on. Without state, the new process would report
live connections again from sequence 0, and either give an (id, sequence) pair a
second content or count a connection twice. With it, each connection continues at
its next sequence with deltas from the totals of its last record, and records
whose delivery was never confirmed are sent again as the same bytes.

Two files (plus a lock):

* ``checkpoint``: a snapshot, written to a temporary file and renamed into place:
  the lineage (a random value in every connectionId), the kernel boot id and table
  it belongs to, one row per reported connection (tuple, incarnation, connectionId,
  next sequence, totals of its last record, flags) and every record not yet known
  to be delivered (its bytes, topic and key);
* ``journal``: appended before each batch is produced (the records, as above) and
  after each batch of delivery reports (which ones arrived), so even SIGKILL loses
  nothing: a record reaches Kafka only after its journal entry is written. A new
  snapshot starts a new journal. Entries carry a CRC; a torn tail (killed during a
  write, before the produce that would have followed) is ignored.

A checkpoint from another boot is dropped (the kernel's table is new too); so is
one for another table (``conntrack.netns``) or one that cannot be read: the
exporter then starts a new lineage and flags connections it finds live ADOPTED.
No fsync: a process crash keeps the page cache, and a node crash reboots, which
empties the table the checkpoint describes.

Hand-written binary format (struct, zlib.crc32): the rows are fixed fields and the
values opaque bytes; no serialization library is needed for that, and a
snapshot of 250k connections must be cheap (bench/bench_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.flow import LACK_OF_RESOURCES, Export
from pipeline.store import Restored

log = logging.getLogger(__name__)

MAGIC = b"FXCK"
JOURNAL_MAGIC = b"FXJL"
VERSION = 1
CHECKPOINT = "checkpoint"
JOURNAL = "journal"
LOCK = "lock"
# A new snapshot once the journal outgrows this, or twice the last snapshot: journal writes stay
# within ~3x what was sent, and a restart replays at most that much.
MIN_JOURNAL_BYTES = 8 << 20

_HEAD = struct.Struct("!4sHQ")  # magic, version, snapshot id (both files)
_META = struct.Struct("!16s8sQII")  # boot id, lineage, written at (ns), rows, records
_ROW_KEY = struct.Struct("!BHBHH")  # address length, zone, proto, sport, dport (then src, dst)
_ROW = struct.Struct("!IQQqQQQQQB")  # ct_id, start, first seen, flow id, next seq, base x4, flags
_REC = struct.Struct("!qQHHI")  # flow id, sequence, topic length, key length, value length
_ENTRY = struct.Struct("!BII")  # type, payload length, crc32(payload)
_ACK = struct.Struct("!qQ")
_SENT, _ACKED = 1, 2


class CheckpointError(Exception):
    """The state directory cannot be used (named in the message)."""


@dataclass
class Loaded:
    """What a previous process left: rows to continue, records to resend, and the lineage."""

    lineage: bytes
    rows: list[Restored] = field(default_factory=list)
    resends: list[Export] = field(default_factory=list)
    valid: bool = False  # False: nothing usable, start a new lineage and flag live connections ADOPTED
    why: str = ""


@dataclass
class CheckpointStats:
    snapshots: int = 0
    last_snapshot_seconds: float = 0.0
    last_snapshot_bytes: int = 0
    journal_bytes: int = 0  # of the current journal
    errors: int = 0


def boot_id() -> bytes:
    """The kernel's boot id (16 bytes): a checkpoint from another boot describes a table that is gone."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return bytes.fromhex(text.replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return b"\0" * 16


def _pack_row(
    key: tuple[int, int, bytes, int, bytes, int],
    ct_id: int,
    start_ns: int,
    first_seen_ns: int,
    flow_id: int,
    next_seq: int,
    base: tuple[int, int, int, int],
    flags: int,
) -> bytes:
    zone, proto, src, sport, dst, dport = key
    return b"".join(
        (
            _ROW_KEY.pack(len(src), zone & 0xFFFF, proto, sport, dport),
            src,
            dst,
            _ROW.pack(ct_id & 0xFFFFFFFF, start_ns, first_seen_ns, flow_id, next_seq, *base, flags & 0xFF),
        )
    )


def _unpack_row(buf: memoryview, off: int) -> tuple[Restored, int]:
    alen, zone, proto, sport, dport = _ROW_KEY.unpack_from(buf, off)
    if alen not in (4, 16):
        raise ValueError(f"address length {alen}")
    off += _ROW_KEY.size
    src = bytes(buf[off : off + alen])
    dst = bytes(buf[off + alen : off + 2 * alen])
    off += 2 * alen
    ct_id, start, first, flow_id, next_seq, b0, b1, b2, b3, flags = _ROW.unpack_from(buf, off)
    key = (zone, proto, src, sport, dst, dport)
    return Restored(key, ct_id, start, first, flow_id, next_seq, (b0, b1, b2, b3), flags), off + _ROW.size


def _pack_record(e: Export) -> bytes:
    topic = (e.topic or "").encode()
    key = e.key or b""
    value = e.value or b""
    totals = struct.pack("!QQQQ", *e.totals)
    return b"".join((_REC.pack(e.flow_id, e.sequence, len(topic), len(key), len(value)), totals, topic, key, value))


def _unpack_record(buf: memoryview, off: int) -> tuple[Export, int]:
    flow_id, seq, tlen, klen, vlen = _REC.unpack_from(buf, off)
    off += _REC.size
    totals = struct.unpack_from("!QQQQ", buf, off)
    off += 32
    end = off + tlen + klen + vlen
    if end > len(buf):
        raise ValueError("record past the end")
    topic = bytes(buf[off : off + tlen]).decode()
    key = bytes(buf[off + tlen : off + tlen + klen])
    value = bytes(buf[off + tlen + klen : end])
    e = Export(None, 0, seq, totals, (0, 0, 0, 0), False, 0, flow_id, value=value, topic=topic, key=key)
    return e, end


def _row_bytes(r: Restored) -> bytes:
    return _pack_row(r.key, r.ct_id, r.start_ns, r.first_seen_ns, r.flow_id, r.next_seq, r.base, r.flags)


class Checkpoint:
    """One exporter's state directory (locked for the life of the process)."""

    def __init__(self, directory: str | os.PathLike[str], table: str = "", boot: bytes | None = None) -> None:
        self.dir = Path(directory)
        self.table = table  # which conntrack table: the netns name, "" for the exporter's own
        self.boot = boot if boot is not None else boot_id()
        self.stats = CheckpointStats()
        self.lineage = b""
        self.broken = False  # a write failed: state is dropped and no longer kept
        self._snapshot_id = 0
        self._journal: int | None = None
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ open
    def lock(self, stop: threading.Event | None = None, log_every: float = 10.0) -> bool:
        """Take the directory's lock, waiting while another process holds it; False if stopped first."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CheckpointError(f"state.dir {self.dir}: {exc.strerror}") from None
        last_log = float("-inf")
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise CheckpointError(f"state.dir {self.dir}: cannot lock: {exc.strerror}") from None
            if time.monotonic() - last_log >= log_every:
                last_log = time.monotonic()
                log.warning("state.dir %s is locked by another exporter process; waiting for it to exit", self.dir)
            if stop is not None and stop.wait(0.5):
                os.close(fd)
                return False
            if stop is None:
                time.sleep(0.5)

    def load(self) -> Loaded:
        """Read the snapshot and replay the journal; start a new lineage when there is nothing to continue."""
        loaded = self._read()
        if not loaded.valid:
            loaded.lineage = os.urandom(8)
            loaded.rows = []
            loaded.resends = []
        self.lineage = loaded.lineage
        return loaded

    def _read(self) -> Loaded:
        path = self.dir / CHECKPOINT
        try:
            data = memoryview(path.read_bytes())
        except FileNotFoundError:
            return Loaded(b"", why="no checkpoint yet (first start with this state directory)")
        except OSError as exc:
            return Loaded(b"", why=f"checkpoint unreadable: {exc.strerror}")
        try:
            snap_id, meta, rows, records = self._parse_snapshot(data)
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            return Loaded(b"", why=f"checkpoint damaged ({exc}); ignored")
        boot, lineage, _written, _nrows, _nrecs, table = meta
        if boot != self.boot:
            return Loaded(b"", why="checkpoint from an earlier boot (the conntrack table is new too)")
        if table != self.table:
            return Loaded(b"", why=f"checkpoint of another conntrack table ({table or 'the host'}); ignored")
        by_id = {r.flow_id: r for r in rows}
        pending = {(e.flow_id, e.sequence): e for e in records}
        replayed, torn = self._replay(snap_id, by_id, pending)
        why = f"checkpoint: {len(rows):,} connections, {len(records):,} records awaiting delivery"
        if replayed:
            why += f"; journal: {replayed:,} entries replayed"
        if torn:
            why += f" ({torn})"
        return Loaded(lineage, list(by_id.values()), list(pending.values()), True, why)

    def _parse_snapshot(
        self, data: memoryview
    ) -> tuple[int, tuple[bytes, bytes, int, int, int, str], list[Restored], list[Export]]:
        if len(data) < _HEAD.size + _META.size + 6:
            raise ValueError("too short")
        body, crc = data[:-4], struct.unpack_from("!I", data, len(data) - 4)[0]
        if zlib.crc32(body) != crc:
            raise ValueError("checksum mismatch")
        magic, version, snap_id = _HEAD.unpack_from(data, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a version {VERSION} checkpoint")
        off = _HEAD.size
        boot, lineage, written, nrows, nrecs = _META.unpack_from(data, off)
        off += _META.size
        (tlen,) = struct.unpack_from("!H", data, off)
        table = bytes(data[off + 2 : off + 2 + tlen]).decode()
        off += 2 + tlen
        rows = []
        for _ in range(nrows):
            row, off = _unpack_row(body, off)
            rows.append(row)
        records = []
        for _ in range(nrecs):
            rec, off = _unpack_record(body, off)
            records.append(rec)
        if off != len(body):
            raise ValueError("trailing bytes")
        return snap_id, (boot, lineage, written, nrows, nrecs, table), rows, records

    def _replay(
        self, snap_id: int, rows: dict[int, Restored], pending: dict[tuple[int, int], Export]
    ) -> tuple[int, str]:
        """Apply the journal written after snapshot ``snap_id``; returns (entries applied, note on a bad tail)."""
        try:
            data = memoryview((self.dir / JOURNAL).read_bytes())
        except OSError:
            return 0, ""
        if len(data) < _HEAD.size:
            return 0, ""
        magic, version, jid = _HEAD.unpack_from(data, 0)
        if magic != JOURNAL_MAGIC or version != VERSION or jid != snap_id:
            return 0, "journal of another snapshot ignored"
        off = _HEAD.size
        applied = 0
        while off < len(data):
            if off + _ENTRY.size > len(data):
                return applied, "torn journal tail ignored"
            kind, length, crc = _ENTRY.unpack_from(data, off)
            payload = data[off + _ENTRY.size : off + _ENTRY.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                return applied, "torn journal tail ignored"
            try:
                if kind == _SENT:
                    self._apply_sent(payload, rows, pending)
                elif kind == _ACKED:
                    for i in range(0, length, _ACK.size):
                        pending.pop(_ACK.unpack_from(payload, i), None)
            except (ValueError, struct.error, UnicodeDecodeError) as exc:
                return applied, f"journal entry damaged ({exc}); the rest ignored"
            applied += 1
            off += _ENTRY.size + length
        return applied, ""

    @staticmethod
    def _apply_sent(payload: memoryview, rows: dict[int, Restored], pending: dict[tuple[int, int], Export]) -> None:
        off = 0
        (count,) = struct.unpack_from("!I", payload, off)
        off += 4
        for _ in range(count):
            row, off = _unpack_row(payload, off)
            ended = payload[off]
            off += 1
            rec, off = _unpack_record(payload, off)
            if ended:
                rows.pop(row.flow_id, None)  # it left the table: only its record matters now
            else:
                old = rows.get(row.flow_id)
                if old is None or old.next_seq <= row.next_seq:
                    rows[row.flow_id] = row
            pending[(rec.flow_id, rec.sequence)] = rec

    # ----------------------------------------------------------------- write
    def sent(self, exports: Iterable[Export]) -> None:
        """Journal records about to be produced (first sends only: a resend is already journaled)."""
        if self._journal is None or self.broken:
            return
        parts = []
        n = 0
        for e in exports:
            if e.attempts or e.tracked is None:
                continue
            tr = e.tracked
            c = tr.conn
            ended = tr.end_reason != 0 and tr.end_reason != LACK_OF_RESOURCES and e.final
            parts.append(
                _pack_row(tr.key, c.ct_id, c.start_ns, tr.first_seen_ns, e.flow_id, e.sequence + 1, e.totals, tr.flags)
            )
            parts.append(b"\x01" if ended else b"\x00")
            parts.append(_pack_record(e))
            n += 1
        if n:
            self._append(_SENT, struct.pack("!I", n) + b"".join(parts))

    def delivered(self, exports: Iterable[Export]) -> None:
        """Journal records whose delivery is settled (delivered, or given up for good)."""
        if self._journal is None or self.broken:
            return
        payload = b"".join(_ACK.pack(e.flow_id, e.sequence) for e in exports)
        if payload:
            self._append(_ACKED, payload)

    def _append(self, kind: int, payload: bytes) -> None:
        assert self._journal is not None
        entry = _ENTRY.pack(kind, len(payload), zlib.crc32(payload)) + payload
        try:
            os.write(self._journal, entry)
        except OSError as exc:
            self._fail(f"journal write failed: {exc.strerror}")
            return
        self.stats.journal_bytes += len(entry)

    def due(self) -> bool:
        """Time for a new snapshot (the journal outgrew the last one)."""
        st = self.stats
        return not self.broken and st.journal_bytes >= max(MIN_JOURNAL_BYTES, 2 * st.last_snapshot_bytes)

    def begin(self, loaded: Loaded) -> None:
        """Start this process's journal on a snapshot of what was loaded (so every entry follows a snapshot)."""
        self.snapshot(loaded.rows, loaded.resends)

    def snapshot(self, reported: Iterable[Restored], in_flight: Iterable[Export]) -> None:
        """Write a new snapshot and start an empty journal after it.

        Callers pass the store's reported connections and records in flight as of one
        moment, from the thread that journals (so no entry falls between the two).
        """
        if self.broken:
            return
        t0 = time.perf_counter()
        rows = [_row_bytes(r) for r in reported]
        records = [_pack_record(e) for e in in_flight]
        snap_id = time.time_ns()
        table = self.table.encode()
        body = b"".join(
            (
                _HEAD.pack(MAGIC, VERSION, snap_id),
                _META.pack(self.boot, self.lineage, snap_id, len(rows), len(records)),
                struct.pack("!H", len(table)),
                table,
                *rows,
                *records,
            )
        )
        data = body + struct.pack("!I", zlib.crc32(body))
        tmp = self.dir / (CHECKPOINT + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dir / CHECKPOINT)
            self._open_journal(snap_id)
        except OSError as exc:
            self._fail(f"snapshot write failed: {exc.strerror}")
            return
        self._snapshot_id = snap_id
        st = self.stats
        st.snapshots += 1
        st.last_snapshot_bytes = len(data)
        st.last_snapshot_seconds = time.perf_counter() - t0

    def _open_journal(self, snap_id: int) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        fd = os.open(self.dir / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        os.write(fd, _HEAD.pack(JOURNAL_MAGIC, VERSION, snap_id))
        self._journal = fd
        self.stats.journal_bytes = _HEAD.size

    def _fail(self, why: str) -> None:
        """Writing failed: drop the state rather than leave one that a restart would misread."""
        self.stats.errors += 1
        self.broken = True
        log.error(
            "state.dir %s: %s; exporter state is no longer kept (a restart will start a new lineage)", self.dir, why
        )
        for name in (CHECKPOINT, JOURNAL):
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
        if self._journal is not None:
            with contextlib.suppress(OSError):
                os.close(self._journal)
            self._journal = None

    def close(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
