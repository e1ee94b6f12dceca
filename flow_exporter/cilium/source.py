"""The Cilium source: Cilium's four global CT maps read into the store, as the netfilter source's dump is.

It is a :class:`flow_exporter.ports.Source`: the poll loop calls ``dump_into`` and applies each batch
with ``Table.update_batch``, the same rule the netfilter source's rows go through, so the counting
contract holds unchanged. What is Cilium's own is the decode (``flow_exporter.cilium_ct``: which entry
is a connection, which counter is which direction) and what cannot be seen (README, "Clusters running
Cilium"): there are no NEW/DESTROY events, so a connection that began and ended between two reads is
never seen, and an entry Cilium's LRU maps evict to make room is gone without its last counts. The maps
keep no count of their evictions; what the source can tell is a map found full at a read (LRU evicts
only then): ``kernel_stats`` counts those reads.

The pins are opened again at every read, read-only: a map Cilium unpinned and created again (its
upgrade path) is a new map with a new id, and reading the old one by a kept descriptor would show a
table that no longer changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from flow_exporter.cilium.bpf_maps import BpfMapError, PinnedMap, map_contains
from flow_exporter.cilium_ct import COMBINED, SPLIT, CtDecoder
from flow_exporter.connection import Connection

log = logging.getLogger("flow_exporter.cilium")

__all__ = ["GLOBAL_MAPS", "CiliumSource", "maps_pinned"]

# Cilium's global CT maps under <bpffs>/tc/globals: (name, key size), TCP then the rest, IPv4 then IPv6.
GLOBAL_MAPS = (
    ("cilium_ct4_global", 14),
    ("cilium_ct_any4_global", 14),
    ("cilium_ct6_global", 38),
    ("cilium_ct_any6_global", 38),
)
_VALUE_SIZE = 56  # struct ct_entry, in every layout
_LRU_HASH = 9
# A map this close to its capacity is full: the kernel's LRU keeps free entries on per-CPU lists and evicts before
# the last of them are used (Cilium's 524,288-entry TCP map held 524,160 when written past its size).
FULL = 0.99


def globals_dir(bpffs: str) -> str:
    return os.path.join(bpffs, "tc", "globals")


def maps_pinned(bpffs: str) -> bool:
    """Whether Cilium's IPv4 TCP map is pinned under ``bpffs`` (``conntrack.source: auto`` picks Cilium then)."""
    return os.path.exists(os.path.join(globals_dir(bpffs), GLOBAL_MAPS[0][0]))


@dataclass(slots=True)
class ReadStats:
    """What the reads so far found (cumulative), for metrics and the log."""

    reads: int = 0
    entries: int = 0  # every entry of the last read
    related: int = 0  # RELATED entries skipped (ICMP errors riding on a connection)
    service_entries: int = 0  # SERVICE entries (each the original destination of a connection through a service)
    twins: int = 0  # IN entries skipped for their OUT twin
    full_reads: int = 0  # a map found at its capacity: LRU eviction may have dropped live entries


class CiliumSource:
    """Cilium's global CT maps, read-only, as the poll loop's source."""

    def __init__(self, bpffs: str, counters: str = "combined", clock: str = "ktime", batch: int = 4096) -> None:
        self.bpffs = bpffs
        self.layout = COMBINED if counters == "combined" else SPLIT
        self.compare_lifetimes = clock == "ktime"
        self.batch = batch
        self.skipped = 0  # the Source port's: nothing is malformed in a map of fixed-size entries
        self.stats = ReadStats()
        self._ids: dict[str, int] = {}
        self._capacity = 0
        self._last_count = 0
        self._check()

    def _check(self) -> None:
        """The pins are there and are what Cilium makes (fail at start, naming the map, not at the first poll)."""
        found = 0
        for name, key_size in GLOBAL_MAPS:
            path = os.path.join(globals_dir(self.bpffs), name)
            if not os.path.exists(path):
                continue
            with PinnedMap(path) as m:
                self._expect(m, key_size)
                self._ids[name] = m.info.id
                self._capacity += m.info.max_entries
                found += 1
        if not found:
            raise BpfMapError(
                2, f"no Cilium CT map under {globals_dir(self.bpffs)} (cilium_ct4_global ...): is Cilium running on "
                "this node, and cilium.bpffs its BPF filesystem, mounted into the pod?",
            )  # fmt: skip

    @staticmethod
    def _expect(m: PinnedMap, key_size: int) -> None:
        i = m.info
        if i.type != _LRU_HASH or i.key_size != key_size or i.value_size != _VALUE_SIZE:
            raise BpfMapError(
                22, f"{m.path}: type {i.type}, key {i.key_size} B, value {i.value_size} B; Cilium's CT maps are "
                f"LRU hashes (type {_LRU_HASH}) with {key_size} B keys and {_VALUE_SIZE} B values",
            )  # fmt: skip

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        """Every map read in batches, each batch's connections handed to ``consume`` as it is decoded; the
        connections through a service last, once every ``SERVICE`` entry is read. Returns how many were handed."""
        now = int(time.monotonic()) if self.compare_lifetimes else -1
        decoder = CtDecoder(self.layout, now, map_contains)
        handed = 0
        capacity = 0
        for name, key_size in GLOBAL_MAPS:
            path = os.path.join(globals_dir(self.bpffs), name)
            try:
                m = PinnedMap(path)
            except BpfMapError as exc:
                if exc.errno == 2 and name not in self._ids:
                    continue  # never there (Cilium without IPv6): not an error
                raise
            with m:
                self._expect(m, key_size)
                if self._ids.get(name, m.info.id) != m.info.id:
                    log.warning("%s was created again (map id %d, was %d): Cilium restarted its table", path,
                                m.info.id, self._ids[name])  # fmt: skip
                self._ids[name] = m.info.id
                capacity += m.info.max_entries
                before = decoder.entries
                for count, keys, values in m.batches(self.batch):
                    batch = decoder.decode(count, keys, values, key_size, m.fd)
                    if batch:
                        consume(batch)
                        handed += len(batch)
                if decoder.entries - before >= FULL * m.info.max_entries:
                    self.stats.full_reads += 1
        held = decoder.joined()
        if held:
            consume(held)
            handed += len(held)
        s = self.stats
        s.reads += 1
        s.entries = decoder.entries
        s.related += decoder.related
        s.service_entries += decoder.service_entries
        s.twins += decoder.twins
        self._capacity = capacity
        self._last_count = decoder.entries
        return handed

    def dump_buffers(self, apply: Callable[[memoryview], Any], zones: Collection[int] | None = None) -> int | None:
        return None  # no netlink bytes: the poll loop uses dump_into

    def count(self) -> int:
        """Entries in the maps at the last read (a BPF hash map keeps no count the kernel would tell)."""
        return self._last_count

    def max_entries(self) -> int:
        return self._capacity

    def kernel_stats(self) -> dict[str, int]:
        """What the reads tell of what the maps lost: ``cilium_full_reads``, reads that found a map at its
        capacity (LRU eviction drops live entries then, unseen)."""
        return {"cilium_full_reads": self.stats.full_reads}

    def close(self) -> None:
        pass  # nothing kept open between reads
