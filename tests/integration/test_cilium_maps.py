"""flow_exporter.cilium.bpf_maps against maps Cilium's own code made and wrote (issue 41, the read layer).

``ctwriter`` (devtools.cilium), built against github.com/cilium/cilium v1.15.19 and v1.20.2, creates and
pins the four global connection-tracking maps on a private bpffs with Cilium's ``pkg/maps/ctmap``
and writes entries with its types; its ``dump`` reads them back with Cilium's ``DumpWithCallback``.
The reader opens the same pins read-only and must return exactly the entries Cilium listed: every
key and value, decoded here field by field from Cilium's headers (``bpf/lib/conntrack_types.h``:
``ipv4_ct_tuple`` daddr, saddr, dport, sport, nexthdr, flags; ``ct_entry`` up to ``lifetime``), by
batch lookup and by the one-key-at-a-time walk alike. The maps' shape is held to Cilium's defaults
(LRU hash, keys 14 and 38 bytes, values 56, 524,288 TCP and 262,144 other entries).
"""

from __future__ import annotations

import ipaddress
import json
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.cilium import RELEASES, Bpffs, ctwriter, run_ctwriter
from flow_exporter.cilium.bpf_maps import BpfMapError, PinnedMap

pytestmark = pytest.mark.lab

LRU_HASH = 9  # BPF_MAP_TYPE_LRU_HASH
# name -> (key size, max entries): Cilium's global CT maps at its default sizes.
SHAPES = {
    "cilium_ct4_global": (14, 524_288),
    "cilium_ct_any4_global": (14, 262_144),
    "cilium_ct6_global": (38, 524_288),
    "cilium_ct_any6_global": (38, 262_144),
}
COUNTERS = {  # the value's first 32 bytes, per layout (Cilium's CtEntry fields, in order)
    "v1.15": ("RxPackets", "RxBytes", "TxPackets", "TxBytes"),
    "v1.20": ("Union0a", "Union0b", "Packets", "Bytes"),
}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def bpffs() -> Iterator[Bpffs]:
    with Bpffs() as fs:
        yield fs


def ops(layout: str, n: int) -> list[dict[str, Any]]:
    """``n`` TCP/IPv4 entries (more than one batch), and UDP, ICMP and IPv6 ones with every tuple flag."""
    out = []
    for i in range(n):
        counters = (
            {"RxPackets": i, "RxBytes": 100 * i, "TxPackets": i + 1, "TxBytes": 90 * i}
            if layout == "v1.15"
            else {"Packets": 2 * i + 1, "Bytes": 190 * i}
        )
        out.append({
            "op": "put", "map": "cilium_ct4_global", "saddr": f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
            "daddr": "10.96.0.10", "sport": 1024 + i % 60000, "dport": 443, "nexthdr": 6, "flags": i % 2,
            "entry": {**counters, "Lifetime": 1000 + i, "Flags": i & 0x7FF, "RevNAT": i & 0xFFFF,
                      "TxFlagsSeen": 0x12, "RxFlagsSeen": 0x10, "SourceSecurityID": 12345, "LastTxReport": i,
                      "LastRxReport": i + 1},
        })  # fmt: skip
    for flags in (0, 1, 2, 4):  # OUT, IN, RELATED, SERVICE
        out.append(
            {
                "op": "put",
                "map": "cilium_ct_any4_global",
                "saddr": "10.0.1.5",
                "daddr": "10.0.2.7",
                "sport": 5353,
                "dport": 53,
                "nexthdr": 17,
                "flags": flags,
                "entry": {"Lifetime": 30 + flags},
            }
        )
        out.append(
            {
                "op": "put",
                "map": "cilium_ct_any4_global",
                "saddr": "10.0.1.5",
                "daddr": "10.0.2.7",
                "sport": 0,
                "dport": 77,
                "nexthdr": 1,
                "flags": flags,
                "entry": {"Lifetime": 40},
            }
        )
        out.append(
            {
                "op": "put",
                "map": "cilium_ct6_global",
                "saddr": "fd00::5",
                "daddr": "fd00:10::1",
                "sport": 40000 + flags,
                "dport": 8080,
                "nexthdr": 6,
                "flags": flags,
                "entry": {"Lifetime": 50},
            }
        )
        out.append({"op": "put", "map": "cilium_ct_any6_global", "saddr": "fd00::5", "daddr": "fd00:10::1",
                    "sport": 6000, "dport": 53, "nexthdr": 17, "flags": flags, "entry": {"Lifetime": 60}})  # fmt: skip
    return out


def cilium_says(layout: str, fs: Bpffs) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """Cilium's own dump, as (map, saddr, daddr, sport, dport, nexthdr, flags) -> value fields."""
    out = {}
    for line in run_ctwriter(ctwriter(layout), fs, "dump").splitlines():
        r = json.loads(line)
        e = r["entry"]
        first = (*e["Union0"], e["Packets"], e["Bytes"]) if layout == "v1.20" else tuple(e[k] for k in COUNTERS[layout])
        key = (r["map"], r["saddr"], r["daddr"], r["sport"], r["dport"], r["nexthdr"], r["flags"])
        out[key] = (*first, e["Lifetime"], e["Flags"], e["RevNAT"], e["TxFlagsSeen"], e["RxFlagsSeen"],
                    e["SourceSecurityID"], e["LastTxReport"], e["LastRxReport"])  # fmt: skip
    return out


def decode(name: str, key: bytes, value: bytes) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """One entry decoded by Cilium's headers: ipv4/ipv6_ct_tuple (addresses, then ports big-endian) and ct_entry."""
    width = 4 if len(key) == 14 else 16
    daddr = ipaddress.ip_address(key[:width])
    saddr = ipaddress.ip_address(key[width : 2 * width])
    dport, sport = struct.unpack_from("!HH", key, 2 * width)
    nexthdr, flags = key[2 * width + 4], key[2 * width + 5]
    a, b, c, d, lifetime, ct_flags, rev_nat = struct.unpack_from("=4QIHH", value, 0)
    # rev_nat_index (or ifindex before), then tx_flags_seen, rx_flags_seen, src_sec_id, last_tx/rx_report
    _, tx_seen, rx_seen, sec_id, last_tx, last_rx = struct.unpack_from("=HBBIII", value, 40)
    fields = (a, b, c, d, lifetime, ct_flags, rev_nat, tx_seen, rx_seen, sec_id, last_tx, last_rx)
    return (name, str(saddr), str(daddr), sport, dport, nexthdr, flags), fields


def read_all(fs: Bpffs, *, walk: bool = False, batch: int = 4096) -> dict[tuple[Any, ...], tuple[int, ...]]:
    out = {}
    for name in SHAPES:
        with PinnedMap(str(fs.globals / name)) as m:
            for key, value in m.items(batch, walk=walk):
                k, v = decode(name, key, value)
                assert k not in out, k
                out[k] = v
    return out


def test_the_reader_returns_exactly_what_cilium_wrote_by_batch_and_by_walk(layout: str, bpffs: Bpffs) -> None:
    binary = ctwriter(layout)
    run_ctwriter(binary, bpffs, "create")
    written = ops(layout, 5000)
    assert run_ctwriter(binary, bpffs, "apply", stdin="".join(json.dumps(o) + "\n" for o in written)).strip() == str(
        len(written)
    )
    truth = cilium_says(layout, bpffs)
    assert len(truth) == len(written)
    for name, (key_size, max_entries) in SHAPES.items():
        with PinnedMap(str(bpffs.globals / name)) as m:
            assert (m.info.type, m.info.key_size, m.info.value_size, m.info.max_entries) == (
                LRU_HASH, key_size, 56, max_entries,
            )  # fmt: skip
            assert name.startswith(m.info.name)
    assert read_all(bpffs) == truth
    assert read_all(bpffs, batch=7) == truth  # many small batches (and a bucket fuller than one: ENOSPC)
    assert read_all(bpffs, walk=True) == truth


def test_a_pin_that_is_not_there_is_named(bpffs: Bpffs) -> None:
    with pytest.raises(BpfMapError) as info:
        PinnedMap(str(bpffs.globals / "cilium_ct4_global"))
    assert str(bpffs.globals / "cilium_ct4_global") in str(info.value)
    assert "No such file or directory" in str(info.value)


def _put(i: int) -> dict[str, Any]:
    return {"op": "put", "map": "cilium_ct4_global", "saddr": f"10.1.{i >> 8 & 255}.{i & 255}", "daddr": "10.96.0.10",
            "sport": 2000 + i, "dport": 443, "nexthdr": 6, "flags": 0, "entry": {"Lifetime": i}}  # fmt: skip


def _apply(fs: Bpffs, ops_: list[dict[str, Any]]) -> None:
    run_ctwriter(ctwriter("v1.20"), fs, "apply", stdin="".join(json.dumps(o) + "\n" for o in ops_))


def _sport(key: bytes) -> int:
    return int(struct.unpack_from("!H", key, 10)[0])


@pytest.mark.parametrize("walk", [False, True], ids=["batch", "walk"])
def test_entries_changed_during_a_read_are_never_returned_twice(bpffs: Bpffs, walk: bool) -> None:
    """Cilium deletes and adds entries between two steps of a read (driven here between two batches, or two keys
    of the walk, including the very key the walk stands on): each entry present throughout is returned exactly
    once, a deleted one not yet read never, an added one at most once."""
    run_ctwriter(ctwriter("v1.20"), bpffs, "create")
    _apply(bpffs, [_put(i) for i in range(300)])
    with PinnedMap(str(bpffs.globals / "cilium_ct4_global")) as m:
        ks = m.info.key_size
        batches = m.batches(7, walk=walk)
        first: list[bytes] = []  # the keys fetched from the kernel so far (whole batches)
        while len(first) < 40:
            count, keys, _ = next(batches)
            first += [keys[i * ks : (i + 1) * ks] for i in range(count)]
        read_first = {_sport(k) - 2000 for k in first}
        unread = [i for i in range(300) if i not in read_first]
        deleted = set(unread[:50])
        if walk:
            deleted.add(_sport(first[-1]) - 2000)  # the key the walk stands on: it starts over
        _apply(bpffs, [{**_put(i), "op": "delete"} for i in sorted(deleted)] + [_put(i) for i in range(300, 360)])
        rest = [keys[i * ks : (i + 1) * ks] for count, keys, _ in batches for i in range(count)]
    got = [_sport(k) - 2000 for k in first + rest]
    assert len(got) == len(set(got)), "an entry returned twice"
    throughout = set(range(300)) - deleted
    assert throughout <= set(got)
    assert not (deleted - read_first) & set(got)
    assert set(got) <= set(range(360))


def test_a_pin_recreated_empty_is_a_new_map(bpffs: Bpffs) -> None:
    """Cilium's upgrade path unpins a map and creates it anew: a reader that opened the old pin still sees the old
    map; opening the pin again gives the new one, empty, with another id (how the source tells them apart)."""
    binary = ctwriter("v1.20")
    run_ctwriter(binary, bpffs, "create")
    _apply(bpffs, [_put(i) for i in range(10)])
    pin = bpffs.globals / "cilium_ct4_global"
    with PinnedMap(str(pin)) as old:
        pin.unlink()
        run_ctwriter(binary, bpffs, "create")
        with PinnedMap(str(pin)) as new:
            assert new.info.id != old.info.id
            assert list(new.items()) == []
        assert len(list(old.items())) == 10
