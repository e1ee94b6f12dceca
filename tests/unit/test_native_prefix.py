"""The compiled record prefix (flow_exporter/_prefix.c) against the pure encoder it must equal.

``RecordEncoder.static`` with the compiled module and ``RecordEncoder.pure_static`` give the same
prefix bytes for generated connections (IPv4/IPv6, every protocol, source NAT or not, Kubernetes
metadata or none, the node's own pods or not), and for hostile values the compiled code must hand
back to the pure one: the same bytes, or the same exception. Generated values must be encoded by the
compiled code itself (not handed back), or these tests would compare the pure encoder with itself.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, Connection
from flow_exporter.flow import Export
from flow_exporter.sink.encoder import RecordEncoder
from tests.support.strategies import exports

NODE = "node-a"


class Str(str):
    """A str subclass whose encode() differs: the compiled code must hand it back, not read its characters."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"<" + str(self).encode(encoding, errors) + b">"


# (where, field, value): "conn" changes the connection, "export" the record, "meta" one metadata key.
HOSTILE: list[tuple[str, str, Any]] = [
    ("conn", "family", 99),
    ("conn", "family", 10**20),
    ("conn", "proto", 256),
    ("conn", "proto", -1),
    ("conn", "proto", 70000),
    ("conn", "proto", 0),
    ("conn", "proto", 47),  # a protocol without ports: the Community ID hashes addresses only
    ("conn", "orig_sport", -1),
    ("conn", "orig_sport", 65536),
    ("conn", "orig_sport", None),
    ("conn", "orig_dport", 2**64),
    ("conn", "reply_sport", -3),
    ("conn", "reply_dport", 65536),
    ("conn", "reply_dport", "80"),
    ("conn", "zone", 65536),
    ("conn", "zone", -1),
    ("conn", "ct_id", 2**64),
    ("conn", "ct_id", -(2**63)),
    ("conn", "mark", -1),
    ("conn", "labels", bytearray(16)),
    ("conn", "labels", "labels"),
    ("conn", "labels", b""),
    ("conn", "orig_src", "10.0.0.1"),
    ("conn", "orig_src", b"\x0a\x00\x00"),
    ("conn", "reply_src", b"\x00" * 17),
    ("conn", "reply_dst", b"\x01\x02\x03\x04\x05"),
    ("conn", "reply_dst", None),
    ("conn", "orig_dst", memoryview(b"\x01\x02\x03\x04")),
    ("conn", "icmp_type", None),
    ("conn", "icmp_type", 70000),
    ("conn", "icmp_type", -1),
    ("conn", "icmp_code", None),
    ("conn", "icmp_code", 65536),
    ("export", "flow_id", 2**64),
    ("export", "flow_id", -(2**63) - 1),
    ("export", "first_seen_ns", -1),  # floor division: -1 ms
    ("export", "first_seen_ns", -(2**63)),
    ("export", "first_seen_ns", 1.5),
    ("export", "first_seen_ns", 2**63),
    ("export", "flags", -1),
    ("export", "flags", 2**64),
    ("export", "flags", True),
    ("export", "conn", None),
    ("export", "meta", {}),
    ("export", "meta", []),
    ("export", "meta", "not a dict"),
    ("meta", "sourcePodLabels", {}),
    ("meta", "sourcePodLabels", ""),
    ("meta", "sourcePodLabels", {"app": 1}),
    ("meta", "sourcePodLabels", {2: "x"}),
    ("meta", "sourcePodLabels", {"app": Str("x")}),
    ("meta", "sourcePodLabels", [("app", "x")]),
    ("meta", "destinationPodName", "\ud800"),  # a lone surrogate: no UTF-8, encode() raises
    ("meta", "destinationPodName", 7),
    ("meta", "destinationPodName", Str("pod")),
    ("meta", "destinationPodName", ""),
    ("meta", "clusterName", "ignored: not a Kubernetes field"),
    ("meta", "flowType", 2**64),
    ("meta", "flowType", -5),
    ("meta", "flowType", None),
    ("meta", "sourceNodeName", NODE),
    ("meta", "destinationNodeName", NODE),
    ("meta", "sourceNodeName", 5),
    ("meta", "destinationNodeName", Str(NODE)),
    ("meta", "destinationNodeName", "node-b"),
]


def apply(e: Export, where: str, field: str, value: Any) -> None:
    if where == "export":
        setattr(e, field, value)
    elif where == "conn":
        assert e.conn is not None
        e.conn = replace(e.conn)
        setattr(e.conn, field, value)
    else:
        e.meta = dict(e.meta or {"sourcePodName": "p"})
        if value is None:
            e.meta.pop(field, None)
        else:
            e.meta[field] = value


def outcome(encoder: RecordEncoder, e: Export, pure: bool) -> tuple[Any, ...]:
    try:
        got: Any = encoder.pure_static(e) if pure else encoder.static(e)
    except Exception as exc:
        got = (type(exc), str(exc))
    return got, e.prefix


def same(e: Export, node: str = NODE, seed: int = 7) -> None:
    fast, pure = replace(e), replace(e)
    want = outcome(RecordEncoder(node, seed, "c1", compiled_path=False), pure, pure=True)
    assert outcome(RecordEncoder(node, seed, "c1"), fast, pure=False) == want


def test_the_prefix_is_built() -> None:
    assert RecordEncoder(NODE)._native is not None, "flow_exporter._native is not built"


@settings(max_examples=1000, deadline=None)
@given(exports(), st.sampled_from([0, 7, 65535]), st.sampled_from([NODE, "ñode-é"]), st.integers(0, 3))
def test_generated_prefixes_are_compiled_and_equal_pure(e: Export, seed: int, node: str, here: int) -> None:
    if e.meta is not None:
        for bit, name in ((1, "sourceNodeName"), (2, "destinationNodeName")):
            if here & bit:
                e.meta[name] = node  # this node's pods: the reporter field
    encoder = RecordEncoder(node, seed, "c1")
    assert encoder._native is not None
    got = encoder._native.encode_prefix(replace(e), encoder._prefix_context)
    assert got is not NotImplemented, "a generated record must be encoded by the compiled code"
    assert got == RecordEncoder(node, seed, "c1", compiled_path=False).pure_static(replace(e))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exports())
@pytest.mark.parametrize("change", HOSTILE, ids=[f"{w}.{f}={v!r}" for w, f, v in HOSTILE])
def test_every_hostile_value_gives_the_pure_outcome(change: tuple[str, str, Any], e: Export) -> None:
    apply(e, *change)
    same(e)


@pytest.mark.parametrize("seed", [-1, 65536, 2**70])
@settings(max_examples=5, deadline=None)
@given(e=exports())
def test_a_seed_out_of_range_gives_the_pure_outcome(seed: int, e: Export) -> None:
    same(e, seed=seed)


# Every paired type of ICMP and ICMPv6, and unpaired ones (one-way: never reordered).
ICMP_TYPES = [0, 8, 9, 10, 13, 14, 15, 16, 17, 18, 3, 11, 255]
ICMP_TYPES += [128, 129, 130, 131, 133, 134, 135, 136, 139, 140, 144, 145]


@pytest.mark.parametrize("proto", [PROTO_ICMP, PROTO_ICMPV6])
@pytest.mark.parametrize("icmp_type", ICMP_TYPES)
@settings(max_examples=4, deadline=None)
@given(e=exports(), code=st.none() | st.integers(0, 255), swap=st.booleans())
def test_icmp_pairs_and_one_way_types(proto: int, icmp_type: int, e: Export, code: int | None, swap: bool) -> None:
    """Every request/reply pair of the Community ID's table, in both address orders, and unpaired types."""
    assert e.conn is not None
    c = e.conn = replace(e.conn, proto=proto, icmp_type=icmp_type, icmp_code=code)
    if swap:
        c.orig_src, c.reply_src = c.reply_src, c.orig_src
    encoder = RecordEncoder(NODE, 3)
    assert encoder._native is not None
    got = encoder._native.encode_prefix(replace(e), encoder._prefix_context)
    assert got is not NotImplemented
    assert got == RecordEncoder(NODE, 3, compiled_path=False).pure_static(replace(e))


def test_equal_addresses_order_by_port() -> None:
    """Two equal addresses: the Community ID orders the endpoints by port, both ways round."""
    a = b"\x0a\x00\x00\x01"
    for sport, dport in ((80, 40000), (40000, 80), (5, 5)):
        c = Connection(socket.AF_INET, 6, a, a, sport, dport, a, a, dport, sport)
        same(Export(1, 0, (0,) * 4, (0,) * 4, False, 1, 1, 1, c.key, conn=c))
