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

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from flow_exporter import flow_ids
from flow_exporter.connection import Connection, ConnectionKey

# flowEndReason codes (IPFIX; README, "Record codes").
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

# flowType codes (README, "Record fields"): where the destination is, as enrichment sees it; 0 unknown.
INTRA_NODE = 1  # pod to pod on this node
INTER_NODE = 2  # pod to pod across nodes
TO_EXTERNAL = 3  # pod to something outside the cluster's pods
FROM_EXTERNAL = 4  # something outside the cluster's pods to a pod

# Why a connection was given up at the cap (the label of flow_exporter_connections_given_up_total).
GIVE_UP_REFUSED = "cap_refused"  # a new connection found the store full
GIVE_UP_IDLE = "cap_idle"  # an idle, fully reported connection made room for a new one
GIVE_UP_REASONS = (GIVE_UP_REFUSED, GIVE_UP_IDLE)

# Record ``flags`` bits: facts about the connectionId. ADOPTED and COUNTERS_RESET are the same in
# all of its records; NO_COUNTERS and OFFLOADED are set from the first record that shows them; BOTH_DIRECTIONS is a
# property of the source, in every record.
ADOPTED = 1
"""First seen already live by an exporter with no state to continue from, or met again after the
store forgot it (the kernel's stamps show it lived through a dump): the first record's deltas
include counts from before, which an earlier exporter, or an earlier connectionId, may have reported."""
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

BOTH_DIRECTIONS = 16
"""The source counts both directions in one pair of counters (Cilium 1.16 and later keeps one packets and one
bytes counter per entry): the totals and deltas are in the forward (non-reverse) fields, the reverse ones are 0,
and how the traffic splits between the two directions is unknown. Set in every record of the connectionId."""

# Row kinds a checkpoint keeps besides live connections, in the high bits of a row's flags byte
# (record flags use the low four): what the store must remember across a restart so that it
# never meets a reported incarnation as new.
ROW_ENDED = 0x80
"""Its end was reported and its entry may still be met (swept, not destroyed): a dump row of it continues it."""
ROW_GIVEN_UP = 0x40
"""Given up at the cap: not taken back while its entry lasts."""
ROW_RESET = 0x20
"""With ROW_ENDED: ended by a counter reset; its entry goes on under a successor connectionId."""
RECORD_FLAGS = 0x1F

Totals = tuple[int, int, int, int]  # packets, bytes, reverse packets, reverse bytes
ZERO: Totals = (0, 0, 0, 0)

# One record on its way out (compiled where built: flow_exporter/export.py says why).
from flow_exporter.export import Export as Export  # noqa: E402  (after Totals, which export.py names)


class IdAllocator:
    """Hands out connectionIds: each one once, never computed again from a connection's fields.

    Why allocated and not derived: an id that is a function of the connection (tuple,
    conntrack id, start) comes out the same whenever the store meets an incarnation it
    had forgotten (given up at the cap, swept, restored and dropped), and the connection
    then starts over at sequence 0 under its old id, giving one (connectionId, sequence)
    a second content. An allocated id cannot be met again: a forgotten incarnation seen
    again gets a new id, and at worst is counted twice under two ids (README, "Counting:
    the contract"), never twice under one pair.

    The ids of one allocator are a Weyl sequence (a random start, an odd step, modulo
    2**64) passed through SplitMix64's finalizer, a bijection on 64-bit values: within one
    process no two ids are equal, and they look random (Kafka keys, Spark partitions).
    Every process starts from fresh random bits, so no counter has to be journaled: the
    ids a restarted process continues come from the checkpoint's rows. The step is the same
    everywhere, so two processes' ids collide only where their runs overlap: about
    (n1 + n2) / 2**64 for n1 and n2 ids, and then a whole stretch at once; consumers key a
    connection by (exporterNode, connectionId) (README, "Counting: the contract").
    Written by hand: a few integer operations per new connection, cheaper than a hash call
    on the first poll's hot path (bench/bench_poll.py).
    """

    __slots__ = ("_next", "allocated")

    def __init__(self, seed: bytes | None = None) -> None:
        self._next = int.from_bytes(seed if seed is not None else os.urandom(8), "big") & _MASK64
        self.allocated = 0

    def __call__(self) -> int:
        """A new signed 64-bit id (fits Avro ``long``)."""
        self.allocated += 1
        self._next = flow_ids.step(self._next)
        return flow_ids.id_at(self._next)

    @property
    def sequence(self) -> int:
        """The sequence's position: where a batch of allocations made elsewhere starts (flow_exporter/admission.py)."""
        return self._next

    def advanced(self, sequence: int, count: int) -> None:
        """``count`` ids were allocated elsewhere from :attr:`sequence`, which is now ``sequence``."""
        self._next = sequence & _MASK64
        self.allocated += count


_MASK64 = (1 << 64) - 1


class NewConnection(Protocol):
    """What the store hands its ``on_new`` hook (enrichment) for each connection it starts tracking.

    ``meta`` may be assigned at any time (a late enrichment); it reaches the connection's
    next record. ``settled`` tells a late enricher the connection has nothing left to report.
    """

    conn: Connection
    meta: dict[str, Any] | None

    @property
    def settled(self) -> bool: ...


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


class RowColumns(NamedTuple):
    """The store's columns a checkpoint row is read from, by name, each indexed by slot."""

    ct: Sequence[int]
    start: Sequence[int]
    first: Sequence[int]  # first-seen stamp
    fid: Sequence[int]  # connectionId
    seq: Sequence[int]  # next sequence
    bp: Sequence[int]  # base totals: packets, bytes, reverse packets, reverse bytes
    bb: Sequence[int]
    brp: Sequence[int]
    brb: Sequence[int]
    flags: Sequence[int]


@dataclass(frozen=True, slots=True)
class ReportedRows:
    """What a checkpoint keeps, as the store holds it: slots into its columns, then rows already made.

    Iterating gives the Restored rows (the reference). The snapshot packer reads the columns
    instead (``flow_exporter/checkpoint_rows.py``): a snapshot packs every tracked connection every few
    seconds at 50k records/s, and making a Restored for each cost more than packing it.
    """

    slots: list[int]
    keys: Sequence[ConnectionKey | None]  # indexed by slot (None: a free slot, never among the slots)
    columns: RowColumns
    rest: Iterable[Restored]  # given-up, restored and ended rows, made as they are
    adopting: bool = False  # connections found live are still flagged ADOPTED (checkpoint.Loaded.adopting)

    def __iter__(self) -> Iterator[Restored]:
        new = tuple.__new__  # a NamedTuple without its __new__ overhead
        keys = self.keys
        c = self.columns
        ct, start, first, fid, seq, flags = c.ct, c.start, c.first, c.fid, c.seq, c.flags
        bp, bb, brp, brb = c.bp, c.bb, c.brp, c.brb
        for s in self.slots:
            yield new(Restored, (keys[s], ct[s], start[s], first[s], fid[s], seq[s], (bp[s], bb[s], brp[s], brb[s]),
                                 flags[s]))  # fmt: skip
        yield from self.rest
