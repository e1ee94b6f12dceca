"""The accounting contract as a consumer checks it (README, "Counting: the contract").

Used by the store's unit tests (on records built from exports) and by the tests on
real parts (on records decoded from Kafka with the reference Avro implementation),
so both hold the exporter to the same rule a user applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TOTALS = ("packetTotalCount", "octetTotalCount", "reversePacketTotalCount", "reverseOctetTotalCount")
DELTAS = ("packetDeltaCount", "octetDeltaCount", "reversePacketDeltaCount", "reverseOctetDeltaCount")
Counts = tuple[int, int, int, int]


def dedup(records: Iterable[dict[str, Any]]) -> tuple[dict[int, list[dict[str, Any]]], int]:
    """Records per connectionId, duplicate (exporterNode, connectionId, sequence) triples dropped; and how many.

    Asserts the contract's first half: a triple seen twice has the same content both times
    (keys starting with ``_`` are test annotations, not content). A record without exporterNode
    (built from an export by a unit test) is one exporter's. The groups are keyed by connectionId
    alone, for callers checking one exporter's stream: a connectionId of two nodes fails here.
    """
    seen: dict[tuple[str | None, int, int], dict[str, Any]] = {}
    dups = 0
    for r in records:
        k = (r.get("exporterNode"), r["connectionId"], r["sequence"])
        first = seen.get(k)
        if first is not None:
            assert _content(first) == _content(r), (
                f"(exporterNode, connectionId, sequence) {k} carries two contents:\n{first}\n{r}"
            )
            dups += 1
            continue
        seen[k] = r
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in seen.values():
        rs = groups.setdefault(r["connectionId"], [])
        assert not rs or rs[0].get("exporterNode") == r.get("exporterNode"), (
            f"connectionId {r['connectionId']} of two exporterNodes: two connections, not one stream's"
        )
        rs.append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["sequence"])
    return groups, dups


def check(records: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Assert the contract on a complete stream; returns the deduplicated records per connectionId.

    Per connectionId: sequences 0..n without gaps, deltas never negative, and the deltas of
    each record equal its totals minus the previous record's, so they sum to the last totals.
    """
    groups, _ = dedup(records)
    for cid, rs in groups.items():
        seqs = [r["sequence"] for r in rs]
        assert seqs == list(range(len(rs))), f"{cid}: sequence gaps {seqs}"
        prev = (0, 0, 0, 0)
        for r in rs:
            tot = tuple(r[f] for f in TOTALS)
            delta = tuple(r[f] for f in DELTAS)
            assert min(delta) >= 0, (cid, r)
            assert tuple(t - p for t, p in zip(tot, prev, strict=True)) == delta, (cid, r["sequence"], prev, tot, delta)
            prev = tot
    return groups


def consumer_sum(rs: list[dict[str, Any]]) -> Counts:
    """The README's rule for one connectionId's deduplicated records: the sum of the deltas."""
    return tuple(sum(r[f] for r in rs) for f in DELTAS)  # type: ignore[return-value]


def totals_of(r: dict[str, Any]) -> Counts:
    return tuple(r[f] for f in TOTALS)  # type: ignore[return-value]


def _content(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}
