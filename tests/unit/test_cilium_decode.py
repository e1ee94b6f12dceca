"""The Cilium source's decode (flow_exporter/cilium_ct.py): its compiled build against its interpreted build, on
Cilium-shaped entries and on random bytes, and what it refuses.

The mapping itself is held to Cilium's own listing on real maps (tests/integration/test_cilium_source.py); here
the two builds must give the same Connections, in the same order, and the same counts, for every layout,
lifetime clock and twin answer. The twin lookups go to the ``contains`` callable in both builds (the compiled
build's own bpf(2) call fails on fd -1 with EBADF and then asks it, as it does for any error but ENOENT).
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import cilium_ct as built
from flow_exporter import compiled
from flow_exporter.connection import IPS_DYING, Connection

reference = compiled.reference("cilium_ct")


def conn_fields(c: Connection) -> tuple[Any, ...]:
    return (c.family, c.proto, c.orig_src, c.orig_dst, c.orig_sport, c.orig_dport, c.reply_src, c.reply_dst,
            c.reply_sport, c.reply_dport, c.zone, c.ct_id, c.mark, c.labels, c.status, c.tcp_state, c.orig_packets,
            c.orig_bytes, c.reply_packets, c.reply_bytes, c.start_ns, c.stop_ns, c.icmp_type, c.icmp_code,
            c.icmp_id, c.counted)  # fmt: skip


def run(module: Any, layout: int, now: int, batches: list[tuple[int, bytes, bytes, int]], twins: set[bytes]):
    asked: list[bytes] = []

    def contains(fd: int, key: bytes) -> bool:
        assert fd == -1
        asked.append(key)
        return key in twins

    d = module.CtDecoder(layout, now, contains)
    out = []
    for count, keys, values, key_size in batches:
        out.append([conn_fields(c) for c in d.decode(count, keys, values, key_size, -1)])
    out.append([conn_fields(c) for c in d.joined()])
    return out, (d.entries, d.related, d.service_entries, d.twins, d.empty), asked


def key(daddr: str, saddr: str, dport: int, sport: int, proto: int, flags: int) -> bytes:
    a, b = ipaddress.ip_address(daddr).packed, ipaddress.ip_address(saddr).packed
    return a + b + struct.pack("!HHBB", dport, sport, proto, flags)


def value(counters: tuple[int, int, int, int], lifetime: int, flags: int = 0, rev_nat: int = 0) -> bytes:
    return struct.pack("<4QIHH", *counters, lifetime, flags, rev_nat) + bytes(16)


entry_keys = st.builds(
    key,
    st.sampled_from(["10.0.0.1", "10.0.0.2"]) | st.sampled_from(["fd00::1", "fd00::2"]).map(str),
    st.sampled_from(["10.0.1.1", "10.0.1.2"]) | st.sampled_from(["fd00::3", "fd00::4"]).map(str),
    st.integers(0, 65535), st.integers(0, 65535), st.sampled_from([0, 1, 6, 17, 58, 132, 250]),
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 255]),
)  # fmt: skip
entry_values = st.builds(
    value, st.tuples(*[st.integers(0, 2**64 - 1)] * 4), st.integers(0, 2**32 - 1), st.integers(0, 0xFFFF),
    st.sampled_from([0, 0, 1, 0x0700, 0xFFFF]),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(entry_keys, entry_values), max_size=40),
    st.sampled_from([built.SPLIT, built.COMBINED]),
    st.integers(-1, 2**32),
    st.integers(1, 7),
    st.data(),
)
def test_both_builds_make_the_same_connections(
    entries: list[tuple[bytes, bytes]], layout: int, now: int, per_batch: int, data: st.DataObject
) -> None:
    by_size: dict[int, list[tuple[bytes, bytes]]] = {14: [], 38: []}
    for k, v in entries:
        if len(k) in by_size:  # one address family per batch, as a map is
            by_size[len(k)].append((k, v))
    batches = []
    for size, group in by_size.items():
        for i in range(0, len(group), per_batch):
            part = group[i : i + per_batch]
            batches.append((len(part), b"".join(k for k, _ in part), b"".join(v for _, v in part), size))
    twins = set(data.draw(st.lists(st.sampled_from([k[:-1] + b"\0" for k, _ in entries] or [b""]), max_size=10)))
    assert run(built, layout, now, batches, twins) == run(reference, layout, now, batches, twins)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=14 * 9), st.binary(max_size=56 * 9), st.sampled_from([14, 38]))
def test_random_bytes_decode_alike_or_are_refused_alike(keys: bytes, values: bytes, key_size: int) -> None:
    count = min(len(keys) // key_size, len(values) // 56)
    batches = [(count, keys, values, key_size)]
    assert run(built, built.COMBINED, 5, batches, set()) == run(reference, built.COMBINED, 5, batches, set())


@pytest.mark.parametrize("module", [built, reference], ids=["compiled", "interpreted"])
def test_what_does_not_fit_is_refused_naming_it(module: Any) -> None:
    d = module.CtDecoder(built.COMBINED, 0, lambda fd, k: False)
    with pytest.raises(ValueError, match="3 entries do not fit 28 key and 168 value bytes"):
        d.decode(3, bytes(28), bytes(168), 14, -1)
    with pytest.raises(ValueError, match="a key of 16 bytes"):
        d.decode(1, bytes(16), bytes(56), 16, -1)
    with pytest.raises(ValueError, match="layout 7"):
        module.CtDecoder(7, 0, lambda fd, k: False)


@pytest.mark.parametrize("module", [built, reference], ids=["compiled", "interpreted"])
def test_an_entry_read_by_hand(module: Any) -> None:
    """One OUT entry of each layout, decoded as the README's table says (the arithmetic by hand)."""
    k = key("10.0.0.1", "10.0.1.1", 8080, 40000, 6, 0)
    v = value((1, 2, 3, 4), 100, flags=2)  # tx_closing
    for layout, counters in ((built.SPLIT, (3, 4, 1, 2)), (built.COMBINED, (3, 4, 0, 0))):
        (c,) = module.CtDecoder(layout, 50, lambda fd, key: False).decode(1, k, v, 14, -1)
        assert (c.orig_src, c.orig_sport, c.reply_src, c.reply_sport) == (
            ipaddress.ip_address("10.0.0.1").packed, 40000, ipaddress.ip_address("10.0.1.1").packed, 8080,
        )  # fmt: skip
        assert (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes) == counters
        assert c.status == IPS_DYING and c.counted and c.tcp_state is None
