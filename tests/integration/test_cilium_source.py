"""The Cilium source (issue 41) against maps Cilium's own code wrote, held to Cilium's own listing.

Entries are written by ``ctwriter`` (Cilium's ``pkg/maps/ctmap``, v1.15.19 and v1.20.2) as the datapath
fills them (tests.support.cilium_entries). What each connection must be is derived here from Cilium's
lister's lines for the same maps, by the README's mapping ("Clusters running Cilium"), never from the
source's decode: one connection per OUT entry or lone IN entry, the originator first; RELATED and
SERVICE entries no connection, a SERVICE entry the original destination of the connection with the
client's address, port and reverse-NAT index; counters per layout; closing or past its lifetime: over.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.cilium import RELEASES, Bpffs, ctwriter, run_ctwriter
from flow_exporter.cilium.source import CiliumSource
from flow_exporter.connection import IPS_DYING, Connection
from tests.support.cilium_entries import IN, OUT, RELATED, SERVICE, Listed, apply, counters, listing, put

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module", params=sorted(RELEASES))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def bpffs(layout: str) -> Iterator[Bpffs]:
    with Bpffs() as fs:
        run_ctwriter(ctwriter(layout), fs, "create")
        yield fs


def source(layout: str, fs: Bpffs, **kw: Any) -> CiliumSource:
    return CiliumSource(str(fs.path), "combined" if layout == "v1.20" else "split", **kw)


def read(src: CiliumSource) -> list[Connection]:
    got: list[Connection] = []
    src.dump_into(got.extend)
    return got


def life(now: int, **extra: Any) -> dict[str, Any]:
    return {"Lifetime": now + 1000, **extra}


def scene(layout: str, now: int) -> list[dict[str, Any]]:
    """A node's maps: every kind of entry the mapping treats apart."""
    c = lambda f, r, flags=OUT: counters(layout, f, r, flags)  # noqa: E731
    return [
        put("10.0.1.5", 40001, "10.0.2.7", 8080, 6, OUT, life(now, **c((10, 1000), (8, 6000)))),  # egress, TCP
        put("10.0.3.9", 50000, "10.0.1.5", 80, 6, IN, life(now, **c((4, 400), (3, 3000), IN))),  # ingress, lone IN
        # one node, both ends: the OUT entry is the connection, its IN twin is skipped
        put("10.0.1.5", 40002, "10.0.1.6", 80, 6, OUT, life(now, **c((5, 500), (5, 5000)))),
        put("10.0.1.5", 40002, "10.0.1.6", 80, 6, IN, life(now, **c((6, 600), (5, 5000), IN))),
        # through a service: its SERVICE entry (client -> VIP) and the connection to the backend, RevNAT 7
        put("10.0.1.5", 40003, "10.96.0.10", 443, 6, SERVICE, life(now, RevNAT=0x0700)),
        put("10.0.1.5", 40003, "10.0.2.8", 8443, 6, OUT, life(now, RevNAT=0x0700, **c((3, 300), (2, 200)))),
        # a service connection whose SERVICE entry is gone: no original destination to give
        put("10.0.1.5", 40004, "10.0.2.9", 8443, 6, OUT, life(now, RevNAT=0x0800, **c((1, 60), (0, 0)))),
        put("10.0.1.5", 0, "10.0.2.7", 0, 1, OUT | RELATED, life(now)),  # an ICMP error's entry
        put("10.0.1.5", 5353, "10.0.0.10", 53, 17, OUT, life(now, **c((1, 70), (1, 120)))),  # UDP
        put("10.0.1.5", 77, "192.0.2.1", 0, 1, OUT, life(now, **c((2, 168), (2, 168)))),  # ICMP echo, id 77
        put("fd00::5", 40000, "fd00:10::1", 8080, 6, OUT, life(now, **c((7, 700), (6, 6000)))),  # IPv6
        put("fd00::9", 6000, "fd00::5", 53, 17, IN, life(now, **c((1, 90), (1, 200), IN))),
        put("fd00::5", 9, "2001:db8::1", 0, 58, OUT, life(now, **c((1, 104), (1, 104)))),  # ICMPv6 echo
        # closing (FIN seen both ways), and past its lifetime: over
        put("10.0.1.5", 40005, "10.0.2.7", 8080, 6, OUT, life(now, Flags=3, **c((9, 900), (9, 900)))),
        put("10.0.1.5", 40006, "10.0.2.7", 8080, 6, OUT, {"Lifetime": now - 100, **c((1, 60), (1, 60))}),
        # created while Cilium's accounting was off: no counters at all
        put("10.0.1.5", 40007, "10.0.2.7", 8080, 6, OUT, life(now)),
    ]


def packed(addr: str) -> bytes:
    return ipaddress.ip_address(addr).packed


def expected(layout: str, listed: list[Listed], now: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The connections Cilium's listing stands for, by the README's mapping, keyed as the store keys them."""
    services = {(e.proto, e.left, e.values["RevNAT"]): e.right for e in listed if e.kind == "SVC"}
    outs = {(e.proto, e.left, e.right) for e in listed if e.kind == "OUT" and not e.related}
    out = {}
    for e in listed:
        if e.related or e.kind == "SVC" or (e.kind == "IN" and (e.proto, e.left, e.right) in outs):
            continue
        v = e.values
        if layout == "v1.20":
            fwd, rev = (v["Packets"], v["Bytes"]), (0, 0)
        elif e.kind == "OUT":
            fwd, rev = (v["TxPackets"], v["TxBytes"]), (v["RxPackets"], v["RxBytes"])
        else:
            fwd, rev = (v["RxPackets"], v["RxBytes"]), (v["TxPackets"], v["TxBytes"])
        icmp = e.proto in (1, 58)
        dst = services.get((e.proto, e.left, v["RevNAT"]), e.right) if v["RevNAT"] else e.right
        request = 8 if e.proto == 1 else 128
        out[(e.proto, packed(e.left[0]), e.left[1], packed(e.right[0]))] = {
            "orig_sport": e.left[1],
            "orig_dst": packed(dst[0]),
            "orig_dport": request << 8 if icmp else dst[1],
            "reply_sport": e.left[1] if icmp else e.right[1],
            "icmp_id": e.left[1] if icmp else None,
            "counters": (*fwd, *rev),
            "counted": any((*fwd, *rev)),
            "over": e.closing or e.expires < now,
        }
    return out


def got(conns: list[Connection]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for c in conns:
        k = (c.proto, c.orig_src, c.orig_sport, c.reply_src)
        assert k not in out, k
        out[k] = {
            "orig_sport": c.orig_sport,
            "orig_dst": c.orig_dst,
            "orig_dport": c.orig_dport,
            "reply_sport": c.reply_sport,
            "icmp_id": c.icmp_id,
            "counters": (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes),
            "counted": c.counted,
            "over": bool(c.status & IPS_DYING),
        }
    return out


def test_each_connection_is_what_ciliums_own_listing_says(layout: str, bpffs: Bpffs) -> None:
    now = int(time.monotonic())
    apply(layout, bpffs, scene(layout, now))
    listed = listing(layout, bpffs)
    assert len(listed) == 16
    truth = expected(layout, listed, now)
    src = source(layout, bpffs)
    conns = read(src)
    assert got(conns) == truth
    # what the scene holds, seen through Cilium's listing: 13 connections; the service one has the VIP
    assert len(truth) == 13
    assert truth[(6, packed("10.0.1.5"), 40003, packed("10.0.2.8"))]["orig_dst"] == packed("10.96.0.10")
    assert [t["over"] for t in truth.values()].count(True) == 2
    assert [t["counted"] for t in truth.values()].count(False) == 1
    assert src.stats.entries == 16 and src.stats.twins == 1 and src.stats.related == 1
    assert src.stats.service_entries == 1
    assert src.count() == 16 and src.max_entries() == 2 * 524_288 + 2 * 262_144


def test_with_the_jiffies_clock_a_lifetime_is_not_compared(layout: str, bpffs: Bpffs) -> None:
    now = int(time.monotonic())
    apply(layout, bpffs, [put("10.0.1.5", 40006, "10.0.2.7", 8080, 6, OUT, {"Lifetime": now - 100})])
    (conn,) = read(source(layout, bpffs, clock="jiffies"))
    assert not conn.status & IPS_DYING
    (conn,) = read(source(layout, bpffs))
    assert conn.status & IPS_DYING


def test_a_missing_map_family_is_skipped_and_no_maps_at_all_is_an_error(layout: str) -> None:
    with Bpffs() as fs:
        with pytest.raises(OSError, match="no Cilium CT map under"):
            CiliumSource(str(fs.path))
