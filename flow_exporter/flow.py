"""The flow vocabulary: record codes, the identity of a connection, and the objects the loops pass around.

Kept apart from the store so the sink, the encoder, enrichment and the checkpoint can
speak of connections and records without importing the store's logic.

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
from typing import Any, NamedTuple, Protocol

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

# Record ``flags`` bits: facts about the connectionId. ADOPTED and COUNTERS_RESET are the same in
# all of its records; NO_COUNTERS and OFFLOADED are set from the first record that shows them.
ADOPTED = 1
"""First seen already live by an exporter with no state to continue from: the first record's
deltas include counts from before, which an earlier exporter on this node may have reported."""
COUNTERS_RESET = 2
"""The kernel counters of this conntrack entry went down (``conntrack -Z``): this connectionId
continues the entry from the reset, its predecessor ended with a forced-end record."""
NO_COUNTERS = 4
"""The kernel keeps no packet and byte counters for this entry (``nf_conntrack_acct`` was off
when it was created): its zeros mean "not counted", not "no traffic". Set from the first
record whose counters are all zero (with accounting, the packet that created an entry is
already counted) and kept."""
OFFLOADED = 8
"""The kernel offloaded this entry to a flowtable (software or hardware, status bits
IPS_OFFLOAD / IPS_HW_OFFLOAD): packets forwarded by the flowtable reach conntrack's counters
only in batches (software) or not at all (hardware), so the counters may trail the traffic.
Set from the first record after the offload and kept."""

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


class NewConnection(Protocol):
    """What the store hands its ``on_new`` hook (enrichment) for each connection it starts tracking.

    ``meta`` may be assigned at any time (a late enrichment); it reaches the connection's
    next record. ``settled`` tells a late enricher the connection has nothing left to report.
    """

    conn: Connection
    meta: dict[str, Any] | None

    @property
    def settled(self) -> bool: ...


@dataclass(slots=True)
class Export:
    """One record: frozen when built, encoded once, resent as the same bytes until delivered.

    It carries what the sink, the encoder and the checkpoint need of its connection, so
    nothing downstream reaches into the store: the store keeps connections in columns,
    not objects (store.py). ``slot`` is -1 for a record restored from a checkpoint (a
    previous process built it; only its bytes are left). ``prefix`` is the encoded
    connection-lifetime part of the record (sink.encoder) when the store has it cached;
    otherwise ``conn`` holds the static fields to encode it from, and the store keeps
    the prefix the encoder leaves here once the record is delivered. ``value``, ``topic``
    and ``key`` are set by the sink's first encoding and reused by every resend.
    """

    reason: int
    sequence: int
    totals: Totals
    deltas: Totals
    final: bool
    flow_end_ns: int
    flow_id: int
    first_seen_ns: int = 0
    conn_key: ConnectionKey | None = None
    ct_id: int = 0
    start_ns: int = 0
    flags: int = 0
    ended: bool = False  # the connection's end (not a give-up at the cap) is reported by this record
    tcp_state: int | None = None
    meta: dict[str, Any] | None = None
    conn: Connection | None = None
    prefix: bytes | None = None
    slot: int = -1
    epoch: int = 0  # the store's prefix-cache stamp of the slot when built
    value: bytes | None = None
    topic: str | None = None
    key: bytes | None = None
    attempts: int = 0
    export_ms: int = 0  # the exportTime written into ``value`` (0: unknown, a record restored from a checkpoint)


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
