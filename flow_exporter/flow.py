"""The flow vocabulary: record codes, the identity of a connection, and the two objects the loops pass around.

Kept apart from the store so the sink, the encoder, enrichment and the checkpoint can
speak of tracked connections and records without importing the store's logic.

The accounting contract these types carry (README, "Counting: the contract"):

* a ``connectionId`` names one conntrack incarnation (and one counter segment of it) for
  its whole life, the same after an exporter restart that keeps its state directory;
* its records are numbered 0, 1, 2, ... and each (connectionId, sequence) has exactly one
  content: a record is frozen (and encoded) once, and every resend is the same bytes;
* the deltas of record n are its totals minus the totals of record n - 1, so summing the
  deltas of the distinct sequences gives the totals of the last one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from flow_exporter.connection import Connection, ConnectionKey

# flowEndReason codes (IPFIX, REFERENCE.md section 2).
IDLE_TIMEOUT = 1
ACTIVE_TIMEOUT = 2
END_OF_FLOW = 3
FORCED_END = 4
LACK_OF_RESOURCES = 5

REASON_NAMES = {
    IDLE_TIMEOUT: "idle",
    ACTIVE_TIMEOUT: "active",
    END_OF_FLOW: "end",
    FORCED_END: "forced",
    LACK_OF_RESOURCES: "resources",
}

# Record ``flags`` bits: facts about the connectionId, the same in all of its records.
ADOPTED = 1
"""First seen already live by an exporter with no state to continue from: the first record's
deltas include counts from before, which an earlier exporter on this node may have reported."""
COUNTERS_RESET = 2
"""The kernel counters of this conntrack entry went down (``conntrack -Z``): this connectionId
continues the entry from the reset, its predecessor ended with a forced-end record."""

Totals = tuple[int, int, int, int]  # packets, bytes, reverse packets, reverse bytes
ZERO: Totals = (0, 0, 0, 0)


def connection_id(lineage: bytes, key: ConnectionKey, ct_id: int, start_ns: int, first_seen_ns: int = 0) -> int:
    """A signed 64-bit id (fits Avro ``long``) for one incarnation of a conntrack entry.

    ``start_ns`` is the kernel's start timestamp; when it is unknown (timestamps off, or a
    NEW event, which carries none) the time the exporter first saw the entry stands in:
    the kernel reuses conntrack ids for a re-created tuple, so tuple and id alone do not
    tell two incarnations apart. ``lineage`` is a random value kept
    in the exporter's state directory (a new one per process without one): an exporter that
    lost its state can never reuse an id, and so never give an old (id, sequence) new content.
    """
    zone, proto, src, sport, dst, dport = key
    # One hash call over the concatenation: the same digest as feeding the parts one by one, at
    # half the cost (every new connection pays it; bench/bench_poll.py, first poll).
    if start_ns:
        tail = _TAIL(sport, dport, ct_id & 0xFFFFFFFF, start_ns & 0xFFFFFFFFFFFFFFFF, 1)
    else:  # never equal to a start-stamped id: the last byte tells the two kinds apart
        tail = _TAIL(sport, dport, ct_id & 0xFFFFFFFF, first_seen_ns & 0xFFFFFFFFFFFFFFFF, 0)
    digest = _blake2b(b"".join((lineage, _HEAD(zone & 0xFFFF, proto), src, dst, tail)), digest_size=8).digest()
    return _from_bytes(digest, "big", signed=True)


_HEAD = struct.Struct("!HB").pack
_TAIL = struct.Struct("!HHIQB").pack
_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def next_segment_id(flow_id: int) -> int:
    """The connectionId that continues an entry whose counters were reset (derived, so no state is needed)."""
    h = hashlib.blake2b(b"counters-reset", digest_size=8)
    h.update(flow_id.to_bytes(8, "big", signed=True))
    return int.from_bytes(h.digest(), "big", signed=True)


@dataclass(slots=True)
class Tracked:
    """A connection in the store plus what the exporter has reported of it.

    ``base`` holds the totals of the last record *built*, not the last one acknowledged: a
    built record is a promise that is kept by resending its bytes until Kafka takes them
    (or, at shutdown, by the checkpoint for the next process), so the next record's deltas
    start where it ended.
    """

    key: ConnectionKey
    conn: Connection
    flow_id: int
    first_seen_ns: int
    last_active_ns: int
    last_export: float  # monotonic time of the last record built
    seen: int = 0  # generation of the last dump that contained it

    present: bool = True  # in the kernel's table, as far as the last dump or event tells
    active: bool = True  # False once an idle record went out, until the counters move again
    destroyed: bool = False  # a DESTROY event gave its final counters: dump rows of it are stale
    end_reason: int = 0  # why it ended for the exporter (0: it has not)
    final_due: bool = False  # a record must still go out for the end
    closed: bool = False  # shutdown: its forced-end record was built
    orphan: bool = False  # out of the keyed table: replaced, reset or given up; settles on its own
    next_seq: int = 0
    base: tuple[int, int, int, int] = ZERO
    flags: int = 0
    pending: Export | None = None  # the record in flight: at most one per connection
    meta: dict[str, Any] | None = None
    avro_prefix: bytes | None = None  # the record's per-connection prefix (sink.encoder), cached
    avro_stamp: tuple[Any, ...] | None = None

    @property
    def totals(self) -> tuple[int, int, int, int]:
        c = self.conn
        return (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)

    @property
    def settled(self) -> bool:
        """Ended, reported to the last byte, nothing in flight: safe to forget."""
        return (
            self.end_reason != 0
            and self.pending is None
            and not self.final_due
            and self.next_seq > 0
            and self.totals == self.base
        )


@dataclass(slots=True)
class Export:
    """One record: frozen when built, encoded once, resent as the same bytes until delivered.

    ``tracked`` is None for a record restored from a checkpoint (a previous process built it;
    only its bytes are left). ``value``, ``topic`` and ``key`` are set by the sink's first
    encoding and reused by every resend.
    """

    tracked: Tracked | None
    reason: int
    sequence: int
    totals: tuple[int, int, int, int]
    deltas: tuple[int, int, int, int]
    final: bool
    flow_end_ns: int
    flow_id: int
    value: bytes | None = None
    topic: str | None = None
    key: bytes | None = None
    attempts: int = 0


class Restored(NamedTuple):
    """What a checkpoint keeps of a connection, and gives back to a restarted process.

    A named tuple: a snapshot writes one per reported connection and a restart reads them
    all back, so it must be cheap to make (bench/bench_checkpoint.py).
    """

    key: ConnectionKey
    ct_id: int
    start_ns: int
    first_seen_ns: int
    flow_id: int
    next_seq: int
    base: tuple[int, int, int, int]
    flags: int
