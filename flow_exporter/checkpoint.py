"""The exporter's state directory: what has been reported, so a restarted exporter continues exactly.

Why: a DaemonSet rollout, a crash or an OOM kill restarts the exporter while the
kernel's conntrack table lives on. Without state, the new process would report
live connections again from sequence 0, and either give an (id, sequence) pair a
second content or count a connection twice. With it, each connection continues at
its next sequence with deltas from the totals of its last record, and records
whose delivery was never confirmed are sent again as the same bytes.

Two files (plus a lock):

* ``checkpoint``: a snapshot, written to a temporary file and renamed into place:
  the lineage (a random value naming this run of the state), the kernel boot id and table
  it belongs to, one row per reported connection (tuple, incarnation, connectionId,
  next sequence, totals of its last record, flags) and every record not yet known
  to be delivered (its bytes, topic and key);
* ``journal``: appended before each batch is produced (the records, as above) and
  after each batch of delivery reports (which ones arrived), so even SIGKILL loses
  nothing: a record reaches Kafka only after its journal entry is written. A new
  snapshot starts a new journal. Entries carry a CRC; a torn tail (an entry cut by
  the end of the file: killed during a write, before the produce that would have
  followed) is ignored. Any other bad entry (whole but failing its CRC, or
  followed by more entries) means the journal cannot be trusted: the whole state
  is dropped and a new lineage starts.

A write that fails (or writes less than asked: a full disk) drops the state: the
checkpoint, the journal and a half-written ``checkpoint.tmp`` are deleted, so a
restart starts a new lineage instead of reusing sequences. The memory state is
intact, so the exporter writes a fresh snapshot as soon as one succeeds again
(``due`` asks for one every few seconds, with backoff, while ``broken``). If the
old checkpoint cannot be deleted (a read-only volume), the state is ``stale``: it
stays true only while nothing more is produced, so the exporter holds records back
until a snapshot succeeds.

A checkpoint from another boot is dropped (the kernel's table is new too); so is
one for another table (``conntrack.netns``) or one that cannot be read: the
exporter then starts a new lineage and flags connections it finds live ADOPTED.
No fsync: a process crash keeps the page cache, and a node crash reboots, which
empties the table the checkpoint describes.

Hand-written binary format (struct, zlib.crc32): the rows are fixed fields and the
values opaque bytes; no serialization library is needed for that, and a
snapshot of 250k connections must be cheap (bench/bench_checkpoint.py). The rows'
bytes are written by ``checkpoint_rows`` (compiled where built), which also holds
the struct formats this module reads them back with.

Format version 2 (this one): a flags byte after the table's name (ADOPTING), and journal entry
headers with a checksum of their own, so a damaged length is told from a torn tail. Version 1
files (earlier releases) still load, read as they always were.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flow_exporter import gc_policy
from flow_exporter.compiled import load
from flow_exporter.flow import ROW_ENDED, Export, ReportedRows, Restored
from flow_exporter.ports import PackedState
from flow_exporter.readings import CheckpointReadings

_rows = load("checkpoint_rows")  # the rows' bytes, written once (compiled where built)

log = logging.getLogger(__name__)

MAGIC = b"FXCK"
JOURNAL_MAGIC = b"FXJL"
# Version 2: a flags byte after the table's name (ADOPTING), and journal entries whose header (type, length,
# payload CRC) has a CRC of its own. Version 1 files (no flags, headers without a CRC) still load.
VERSION = 2
READABLE = (1, 2)
ADOPTING = 0x01  # snapshot flag: written before a first complete poll after a state loss (see Loaded.adopting)
CHECKPOINT = "checkpoint"
JOURNAL = "journal"
LOCK = "lock"
# A new snapshot once the journal outgrows this, or twice the last snapshot: journal writes stay
# within ~3x what was sent, and a restart replays at most that much.
MIN_JOURNAL_BYTES = 8 << 20
# While the state directory cannot be written: a fresh snapshot is tried after 1 s, doubling to 8 s.
RETRY_INITIAL = 1.0
RETRY_MAX = 8.0

_HEAD = struct.Struct("!4sHQ")  # magic, version, snapshot id (both files)
_META = struct.Struct("!16s8sQII")  # boot id, lineage, written at (ns), rows, records
# The rows' layouts (ROW, SENT_ROW, RECORD, ACK) live with their writers in checkpoint_rows.
_ROW, _SENT_ROW, _REC, _ACK = _rows.ROW, _rows.SENT_ROW, _rows.RECORD, _rows.ACK
_ENTRY_V1 = struct.Struct("!BII")  # type, payload length, crc32(payload)
# type, payload length, crc32(payload), crc32 of those nine bytes: a damaged length is told from a torn tail
_ENTRY = struct.Struct("!BIII")
_ENTRY_HEAD = struct.Struct("!BII")
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
    # Valid, but written before the first complete poll after a state loss: the connections found live that
    # no row names must still be flagged ADOPTED (a process that died before their first records left no
    # trace of them, and an earlier lineage may have reported their counts).
    adopting: bool = False
    # Adaptive shedding's schedule kept beside it (flow_exporter/sampling_state.py): the levels its rows were kept at.
    sampling_changes: list[tuple[int, int]] = field(default_factory=list)


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


def _row_struct(buf: memoryview, off: int, table: dict[int, struct.Struct]) -> struct.Struct:
    if off >= len(buf):
        raise ValueError("a row announced past the end")
    s = table.get(buf[off])
    if s is None:
        raise ValueError(f"address length {buf[off]}")
    return s


def _restored(f: tuple[Any, ...]) -> Restored:
    return _new_restored(
        (Restored, ((f[1], f[2], f[5], f[3], f[6], f[4]), f[7], f[8], f[9], f[10], f[11], f[12:16], f[16]))
    )


def _new_restored(args: tuple[type[Restored], tuple[Any, ...]]) -> Restored:
    return tuple.__new__(*args)  # a NamedTuple without its __new__ overhead


def _record(
    buf: memoryview, off: int, flow_id: int, seq: int, totals: tuple[int, ...], tlen: int, klen: int, vlen: int
) -> Export:
    end = off + tlen + klen + vlen
    if end > len(buf):
        raise ValueError("record past the end")
    return Export(
        0,
        seq,
        tuple(totals),  # type: ignore[arg-type]
        (0, 0, 0, 0),
        False,
        0,
        flow_id,
        value=bytes(buf[off + tlen + klen : end]),
        topic=bytes(buf[off : off + tlen]).decode(),
        key=bytes(buf[off + tlen : off + tlen + klen]),
    )


class Checkpoint:
    """One exporter's state directory (locked for the life of the process).

    ``write`` and ``unlink`` are the two file operations that can fail under a full disk or a
    read-only volume (``os.write``, ``os.unlink``); tests pass their own, as they pass ``clock``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str = "",
        boot: bytes | None = None,
        *,
        write: Callable[[int, bytes | bytearray], int] = os.write,
        unlink: Callable[[Path], None] = os.unlink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dir = Path(directory)
        self.table = table  # which conntrack table: the netns name, "" for the exporter's own
        self.boot = boot if boot is not None else boot_id()
        self.stats = CheckpointStats()
        self.lineage = b""
        self.broken = False  # a write failed: the state on disk is not kept up to date (see stale)
        self._stale = False  # ... and the old checkpoint could not be deleted
        self._write = write
        self._unlink = unlink
        self._clock = clock
        self._retry_at = 0.0
        self._retry_delay = RETRY_INITIAL
        self._snapshot_id = 0
        self._journal: int | None = None
        self._lock_fd: int | None = None
        self._topics: dict[str | None, bytes] = {}

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
        # Hundreds of thousands of small tuples and no cycles among them: the cyclic collector would
        # scan the growing heap again and again (it doubled the load time at 250k rows).
        with gc_policy.paused():
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
        # Parsing is pure code over bytes: whatever it raises (also an error of ours that a CRC-valid but
        # inconsistent file reaches) means the state cannot be read. Raising instead would repeat at every
        # start: a crash loop (README, "The state directory").
        try:
            snap_id, meta, rows, records = self._parse_snapshot(data)
        except Exception as exc:
            return Loaded(b"", why=f"checkpoint damaged ({exc!r}); ignored")
        boot, lineage, _written, _nrows, _nrecs, table, flags = meta
        if boot != self.boot:
            return Loaded(b"", why="checkpoint from an earlier boot (the conntrack table is new too)")
        if table != self.table:
            return Loaded(b"", why=f"checkpoint of another conntrack table ({table or 'the host'}); ignored")
        by_id: dict[int, Any] = {f[10]: f for f in rows}
        pending: dict[tuple[int, int], Any] = {(r[2], r[3]): r for r in records}
        try:
            replayed, torn = self._replay(snap_id, by_id, pending)
            # Rows and records stay raw (unpacked fields, offsets) until here: many are superseded.
            restored = [_restored(f) for f in by_id.values()]
            resends = [_record(*r) for r in pending.values()]
        except Exception as exc:  # as above: never an exception at every start
            return Loaded(b"", why=f"journal damaged ({exc!r}); the state is not used")
        why = f"checkpoint: {len(restored):,} connections, {len(resends):,} records awaiting delivery"
        if replayed:
            why += f"; journal: {replayed:,} entries replayed"
        if torn:
            why += f" ({torn})"
        adopting = bool(flags & ADOPTING)
        if adopting:
            why += "; still adopting (no complete poll since the state was lost): connections found live are flagged"
        return Loaded(lineage, restored, resends, True, why, adopting)

    def _parse_snapshot(
        self, data: memoryview
    ) -> tuple[int, tuple[bytes, bytes, int, int, int, str, int], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        if len(data) < _HEAD.size + _META.size + 6:
            raise ValueError("too short")
        body, crc = data[:-4], struct.unpack_from("!I", data, len(data) - 4)[0]
        if zlib.crc32(body) != crc:
            raise ValueError("checksum mismatch")
        magic, version, snap_id = _HEAD.unpack_from(data, 0)
        if magic != MAGIC or version not in READABLE:
            raise ValueError(f"not a checkpoint of version {' or '.join(map(str, READABLE))}")
        off = _HEAD.size
        boot, lineage, written, nrows, nrecs = _META.unpack_from(data, off)
        off += _META.size
        (tlen,) = struct.unpack_from("!H", data, off)
        table = bytes(data[off + 2 : off + 2 + tlen]).decode()
        off += 2 + tlen
        flags = 0
        if version >= 2:
            (flags,) = struct.unpack_from("!B", body, off)
            off += 1
        rows = []  # unpacked fields, made Restored once the journal has had its say
        for _ in range(nrows):
            st = _row_struct(body, off, _ROW)
            rows.append(st.unpack_from(body, off))
            off += st.size
        records = []  # (buffer, offset, fields): copied out only if still undelivered after the journal
        for _ in range(nrecs):
            flow_id, seq, t0, t1, t2, t3, tlen, klen, vlen = _REC.unpack_from(body, off)
            off += _REC.size
            if off + tlen + klen + vlen > len(body):
                raise ValueError("record past the end")
            records.append((body, off, flow_id, seq, (t0, t1, t2, t3), tlen, klen, vlen))
            off += tlen + klen + vlen
        if off != len(body):
            raise ValueError("trailing bytes")
        return snap_id, (boot, lineage, written, nrows, nrecs, table, flags), rows, records

    def _replay(self, snap_id: int, rows: dict[int, Any], pending: dict[tuple[int, int], Any]) -> tuple[int, str]:
        """Apply the journal written after snapshot ``snap_id``; returns (entries applied, note on a torn tail).

        Only an entry cut by the end of the file is a torn tail (its records were never produced).
        An entry that is whole yet fails its CRC or cannot be read raises ValueError: entries were
        written after a damaged one (a disk that was full, then not), so the state cannot be trusted.
        """
        try:
            data = memoryview((self.dir / JOURNAL).read_bytes())
        except OSError:
            return 0, ""
        if len(data) < _HEAD.size:
            return 0, ""
        magic, version, jid = _HEAD.unpack_from(data, 0)
        if magic != JOURNAL_MAGIC or version not in READABLE or jid != snap_id:
            return 0, "journal of another snapshot ignored"
        entry = _ENTRY if version >= 2 else _ENTRY_V1
        off = _HEAD.size
        applied = 0
        while off < len(data):
            end = off + entry.size
            if end > len(data):
                return applied, "torn journal tail ignored"
            if version >= 2:
                kind, length, crc, head_crc = _ENTRY.unpack_from(data, off)
                if zlib.crc32(data[off : off + _ENTRY_HEAD.size]) != head_crc:
                    # A write is cut, never garbled: a whole header that fails its CRC is damage, and its
                    # length cannot be trusted to say where the entry (or the file) ends.
                    raise ValueError(f"entry {applied + 1}: header checksum mismatch")
            else:  # version 1: a damaged length reads as a torn tail (the reason for version 2)
                kind, length, crc = _ENTRY_V1.unpack_from(data, off)
            if end + length > len(data):
                return applied, "torn journal tail ignored"
            payload = data[end : end + length]
            where = f"entry {applied + 1}, {len(data) - end - length:,} bytes after it"
            if zlib.crc32(payload) != crc:
                raise ValueError(f"{where}: checksum mismatch")
            try:
                if kind == _SENT:
                    self._apply_sent(payload, rows, pending)
                elif kind == _ACKED and length % _ACK.size == 0:
                    for i in range(0, length, _ACK.size):
                        pending.pop(_ACK.unpack_from(payload, i), None)
                else:
                    raise ValueError(f"entry type {kind}, {length} bytes")
            except (ValueError, struct.error, UnicodeDecodeError) as exc:
                raise ValueError(f"{where}: {exc}") from None
            applied += 1
            off = end + length
        return applied, ""

    @staticmethod
    def _apply_sent(payload: memoryview, rows: dict[int, Any], pending: dict[tuple[int, int], Any]) -> None:
        (count,) = struct.unpack_from("!I", payload, 0)
        off = 4
        for _ in range(count):
            st = _row_struct(payload, off, _SENT_ROW)
            f = st.unpack_from(payload, off)
            off += st.size
            flow_id = f[10]
            tlen, klen, vlen = f[18], f[19], f[20]
            if f[17] and not f[16] & ROW_ENDED:
                rows.pop(flow_id, None)  # destroyed: only its record matters now
            else:
                # Live, given up, or ended but still to be recognised (flow.ROW_*); moved to the end, so rows stay
                # in the order they were last written (a restart takes the latest of one incarnation's live rows).
                rows.pop(flow_id, None)
                rows[flow_id] = f[:17]
            pending[(flow_id, f[11] - 1)] = (payload, off, flow_id, f[11] - 1, f[12:16], tlen, klen, vlen)
            off += tlen + klen + vlen
            if off > len(payload):
                raise ValueError("record past the end")
        if off != len(payload):
            raise ValueError(f"{len(payload) - off} bytes after the {count} rows the entry announced")

    keeps = True  # the Journal port: a state directory keeps the state

    def readings(self) -> CheckpointReadings:
        """Its counters for the metrics endpoint."""
        st = self.stats
        return CheckpointReadings(
            st.snapshots, st.errors, st.last_snapshot_bytes, st.last_snapshot_seconds, st.journal_bytes,
            int(self.broken), int(self._stale),
        )  # fmt: skip

    # ----------------------------------------------------------------- write
    def sent(self, exports: Iterable[Export]) -> None:
        """Journal records about to be produced (first sends only: a resend is already journaled)."""
        if self._journal is None or self.broken:
            return
        payload = _rows.journal_sent(exports, self._topics)
        if payload:
            self._append(_SENT, payload)

    def delivered(self, exports: Iterable[Export]) -> None:
        """Journal records whose delivery is settled (delivered, or given up for good)."""
        if self._journal is None or self.broken:
            return
        payload = _rows.journal_acked(exports)
        if payload:
            self._append(_ACKED, payload)

    def _append(self, kind: int, payload: bytes) -> None:
        assert self._journal is not None
        head = _ENTRY_HEAD.pack(kind, len(payload), zlib.crc32(payload))
        entry = head + struct.pack("!I", zlib.crc32(head)) + payload
        try:
            self._write_all(self._journal, entry)
        except OSError as exc:
            self._fail(f"journal write failed: {exc.strerror}")
            return
        self.stats.journal_bytes += len(entry)

    def _write_all(self, fd: int, data: bytes | bytearray) -> None:
        """One write of all of ``data``: a short count (a full disk) is a failure like an OSError.

        Not retried for the rest: the entry would be torn in the middle of the journal, and every
        entry after it would be lost at the next replay (or, with the fix there, the whole state).
        """
        n = self._write(fd, data)
        if n != len(data):
            raise OSError(errno.ENOSPC, f"short write, {n:,} of {len(data):,} bytes (disk full)")

    @property
    def stale(self) -> bool:
        """A write failed and the old checkpoint could not be deleted (a read-only volume).

        It still describes every record produced so far; one more would make it lie (a restart
        would build that sequence again with other counts), so none may go out until a snapshot
        succeeds and clears this.
        """
        return self._stale

    def due(self) -> bool:
        """Time for a new snapshot: the journal outgrew the last one, or a write failed and the retry is due."""
        if self.broken:
            return self._clock() >= self._retry_at
        st = self.stats
        return st.journal_bytes >= max(MIN_JOURNAL_BYTES, 2 * st.last_snapshot_bytes)

    def begin(self, loaded: Loaded) -> None:
        """Start this process's journal on a snapshot of what was loaded (so every entry follows a snapshot).

        After a state loss the snapshot says so (adopting) until the store's first complete poll is behind a
        later one: a process that dies before then must leave the next one flagging what it finds live.
        """
        self.snapshot(loaded.rows, loaded.resends, adopting=loaded.adopting or not loaded.valid)

    def snapshot(
        self, reported: Iterable[Restored], in_flight: Iterable[Export], *, adopting: bool | None = None
    ) -> None:
        """Write a new snapshot and start an empty journal after it.

        Callers pass the store's reported connections and records in flight as of one
        moment, from the thread that journals (so no entry falls between the two).
        """
        self.write(self.pack(reported, in_flight, adopting=adopting))

    def pack(
        self, reported: Iterable[Restored], in_flight: Iterable[Export], *, adopting: bool | None = None
    ) -> PackedState:
        """The snapshot's rows and records, packed one at a time into one buffer after room for its header.

        The loops call this under their lock (the state of one moment) and :meth:`write` after it.
        ``adopting`` None: the store's word (:attr:`ReportedRows.adopting`), else False.
        """
        if adopting is None:
            adopting = isinstance(reported, ReportedRows) and reported.adopting
        t0 = time.perf_counter()
        data = bytearray(_HEAD.size + _META.size + 3 + len(self.table.encode()))  # the header, filled in by write
        with gc_policy.paused():  # see load(): no cycles here, and the collector would rescan the heap repeatedly
            rows = _rows.pack_reported(reported, data)
            records = _rows.pack_records(in_flight, data)
        return PackedState(rows, records, data, time.perf_counter() - t0, adopting)

    def write(self, packed: PackedState) -> None:
        """Write a packed state as the new snapshot (its header and checksum filled in here) and start the journal.

        A packed state is written once: its buffer becomes the file's bytes.
        """
        t0 = time.perf_counter()
        snap_id = time.time_ns()
        table = self.table.encode()
        data = packed.data
        start = _HEAD.size + _META.size + 2  # the table's name after the header, its flags, then rows and records
        if len(data) < start + len(table) + 1:
            raise ValueError("a packed state without room for its header")
        _HEAD.pack_into(data, 0, MAGIC, VERSION, snap_id)
        _META.pack_into(data, _HEAD.size, self.boot, self.lineage, snap_id, packed.rows, packed.records)
        struct.pack_into("!H", data, _HEAD.size + _META.size, len(table))
        data[start : start + len(table)] = table
        data[start + len(table)] = ADOPTING if packed.adopting else 0
        data += struct.pack("!I", zlib.crc32(data))
        tmp = self.dir / (CHECKPOINT + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                self._write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.dir / CHECKPOINT)
            self._open_journal(snap_id)
        except OSError as exc:
            self._fail(f"snapshot write failed: {exc.strerror}")
            return
        self._snapshot_id = snap_id
        st = self.stats
        st.snapshots += 1
        st.last_snapshot_bytes = len(data)
        st.last_snapshot_seconds = packed.seconds + time.perf_counter() - t0
        self._retry_delay = RETRY_INITIAL
        if self.broken:
            self.broken = self._stale = False
            log.warning(
                "state.dir %s: written again: a fresh snapshot holds the whole state (%s connections, %s records "
                "awaiting delivery); records go out, and a restart continues every connection exactly",
                self.dir,
                f"{packed.rows:,}",
                f"{packed.records:,}",
            )

    def new_lineage(self) -> None:
        """The loaded state was dropped (it could not be applied): the next snapshot starts a new lineage."""
        self.lineage = os.urandom(8)

    def _open_journal(self, snap_id: int) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        fd = os.open(self.dir / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            self._write_all(fd, _HEAD.pack(JOURNAL_MAGIC, VERSION, snap_id))
        except OSError:
            os.close(fd)
            raise
        self._journal = fd
        self.stats.journal_bytes = _HEAD.size

    def _fail(self, why: str) -> None:
        """Writing failed: delete the state rather than leave one that a restart would misread.

        The checkpoint goes first, and the journal only once it is gone: a checkpoint kept
        without its journal would be older than what was produced. If it cannot be deleted (a
        read-only volume), the state is ``stale``. Either way the memory state is intact, and a
        fresh snapshot is tried again with backoff (``due``); logged once per change, not per try.
        """
        self.stats.errors += 1
        if self._journal is not None:
            with contextlib.suppress(OSError):
                os.close(self._journal)
            self._journal = None
        kept = ""
        for name in (CHECKPOINT + ".tmp", CHECKPOINT, JOURNAL):
            try:
                self._unlink(self.dir / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if name == CHECKPOINT:
                    kept = exc.strerror or str(exc)
                    break
        was_broken, was_stale = self.broken, self._stale
        self.broken, self._stale = True, bool(kept)
        self._retry_at = self._clock() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)
        if was_broken and was_stale == self._stale:
            log.debug("state.dir %s: still cannot be written: %s", self.dir, why)
        elif self._stale:
            log.error(
                "state.dir %s: %s; the old checkpoint cannot be deleted (%s), so records are held back (not produced; "
                "connections coalesce) until a fresh snapshot succeeds, tried every %.0f s at most; a restart "
                "meanwhile continues from the old state, exactly",
                self.dir, why, kept, RETRY_MAX,
            )  # fmt: skip
        else:
            log.error(
                "state.dir %s: %s; the state is deleted: records still go out, a restart now starts a new lineage; "
                "a fresh snapshot is tried every %.0f s at most",
                self.dir, why, RETRY_MAX,
            )  # fmt: skip

    def close(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
