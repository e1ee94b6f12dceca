"""The Cilium source (issue 41) against maps Cilium's own code wrote, held to Cilium's own listing.

Entries are written by ``ctwriter`` (Cilium's ``pkg/maps/ctmap``, v1.15.19 and v1.20.2) as the datapath
fills them (tests.support.cilium_entries). What each connection must be is derived here from Cilium's
lister's lines for the same maps, by the README's mapping ("Clusters running Cilium"), never from the
source's decode: one connection per OUT entry or lone IN entry, the originator first; RELATED and
SERVICE entries no connection, a SERVICE entry's service the original destination of the connections with
its reverse-NAT index; counters per layout; closing or past its lifetime: over.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.cilium import RELEASES, Bpffs, ctwriter, run_ctwriter
from flow_exporter.cilium.source import CiliumSource
from flow_exporter.connection import IPS_DYING, Connection
from tests.support.cilium_entries import IN, OUT, RELATED, SERVICE, Listed, apply, counters, listing, put
from tests.support.records import by_connection, read_records
from tests.support.waiting import until

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
        # another client of the first service, its own SERVICE entry gone: the index still names the service
        put("10.0.1.7", 40008, "10.0.2.8", 8443, 6, OUT, life(now, RevNAT=0x0700, **c((2, 120), (1, 60)))),
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
    # A reverse-NAT index names one service frontend (Cilium's lb reverse-NAT map): any SVC entry with it gives it.
    services = {(":" in e.left[0], e.proto, e.values["RevNAT"]): e.right for e in listed if e.kind == "SVC"}
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
        dst = services.get((":" in e.left[0], e.proto, v["RevNAT"]), e.right) if v["RevNAT"] else e.right
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
    assert len(listed) == 17
    truth = expected(layout, listed, now)
    src = source(layout, bpffs)
    conns = read(src)
    assert got(conns) == truth
    # what the scene holds, seen through Cilium's listing: 14 connections; both service ones have the VIP
    assert len(truth) == 14
    assert truth[(6, packed("10.0.1.5"), 40003, packed("10.0.2.8"))]["orig_dst"] == packed("10.96.0.10")
    assert truth[(6, packed("10.0.1.7"), 40008, packed("10.0.2.8"))]["orig_dst"] == packed("10.96.0.10")
    assert truth[(6, packed("10.0.1.5"), 40004, packed("10.0.2.9"))]["orig_dst"] == packed("10.0.2.9")
    assert [t["over"] for t in truth.values()].count(True) == 2
    assert [t["counted"] for t in truth.values()].count(False) == 1
    assert src.stats.entries == 17 and src.stats.twins == 1 and src.stats.related == 1
    assert src.stats.service_entries == 1
    assert src.count() == 17 and src.max_entries() == 2 * 524_288 + 2 * 262_144


def test_with_the_jiffies_clock_a_lifetime_is_not_compared(layout: str, bpffs: Bpffs) -> None:
    now = int(time.monotonic())
    apply(layout, bpffs, [put("10.0.1.5", 40006, "10.0.2.7", 8080, 6, OUT, {"Lifetime": now - 100})])
    (conn,) = read(source(layout, bpffs, clock="jiffies"))
    assert not conn.status & IPS_DYING
    (conn,) = read(source(layout, bpffs))
    assert conn.status & IPS_DYING


def test_a_missing_map_family_is_skipped_and_no_maps_at_all_is_an_error(layout: str) -> None:
    with Bpffs() as fs, pytest.raises(OSError, match="no Cilium CT map under"):
        CiliumSource(str(fs.path))


# ---------------------------------------------------------------- the whole exporter, to Kafka and back
def run_exporter(fs: Bpffs, layout: str, bootstrap: str, topic: str, state: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "flow_exporter", "run", "--bootstrap-servers", bootstrap, "--topic", topic,
        "--node-name", "cilium-node", "--set", "conntrack.source=cilium", "--set", f"cilium.bpffs={fs.path}",
        "--set", f"cilium.counters={'combined' if layout == 'v1.20' else 'split'}",
        "--set", "conntrack.pollInterval=0.5s", "--set", "expiry.activeTimeout=1s", "--set", "expiry.idleTimeout=30s",
        "--set", f"state.dir={state}", "--set", "metrics.port=0",
        "--set", "record.attributes={team: net, environment: lab}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    until(lambda: log.read_text().count("first poll") == log.read_text().count("flow-exporter starting"), 30,
             lambda: log.read_text())  # fmt: skip
    return proc


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()


def totals(layout: str, fs: Bpffs) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """Each connection's counters as Cilium's listing gives them now (by the README's mapping)."""
    return {k: v["counters"] for k, v in expected(layout, listing(layout, fs), int(time.monotonic())).items()}


def record_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["protocol"], packed(r["sourceAddress"]), r["sourcePort"], packed(r["destinationAddress"]))


def test_the_exporter_counts_ciliums_entries_exactly_through_resets_deletes_and_a_restart(
    layout: str, bpffs: Bpffs, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    """``flow-exporter run`` on the maps: every connection's records sum to what Cilium's listing said last,
    an entry overwritten with lower counters (a stale entry re-created in place) ends its connectionId and goes
    on under one flagged counters-reset, a deleted or closing entry ends with an end-of-flow record, and a
    restart on the state directory continues each connectionId's sequence."""
    now = int(time.monotonic())
    c = lambda f, r: counters(layout, f, r)  # noqa: E731
    a = ("10.0.1.5", 41001, "10.0.2.7", 8080, 6, OUT)
    b = ("10.0.1.5", 41002, "10.0.2.8", 8080, 6, OUT)
    gone = ("10.0.1.5", 41003, "10.0.2.9", 53, 17, OUT)
    closing = ("fd00::5", 41004, "fd00:10::1", 443, 6, OUT)
    apply(layout, bpffs, [
        put(*a, life(now, **c((10, 1000), (8, 6000)))),
        put(*b, life(now, **c((50, 5000), (40, 4000)))),
        put(*gone, life(now, **c((1, 70), (1, 120)))),
        put(*closing, life(now, **c((3, 300), (2, 200)))),
    ])  # fmt: skip
    last = dict(totals(layout, bpffs))
    before_reset = last[(6, packed(b[0]), b[1], packed(b[2]))]
    log, state = tmp_path / "exporter.log", tmp_path / "state"
    proc = run_exporter(bpffs, layout, kafka_broker.bootstrap, kafka_topic, state, log)
    try:
        time.sleep(1.5)
        apply(layout, bpffs, [put(*a, life(now, **c((20, 2000), (16, 12000)))),  # grew
                              put(*b, life(now, **c((2, 120), (1, 60)))),  # re-created in place: lower
                              put(*gone, {}, op="delete"),
                              put(*closing, life(now, Flags=3, **c((5, 500), (4, 400))))])  # fmt: skip
        last.update(totals(layout, bpffs))
        time.sleep(2.5)
    finally:
        stop(proc, log)
    proc = run_exporter(bpffs, layout, kafka_broker.bootstrap, kafka_topic, state, log)
    try:
        apply(layout, bpffs, [put(*a, life(now, **c((30, 3000), (24, 18000))))])
        last.update(totals(layout, bpffs))
        time.sleep(2.5)
    finally:
        stop(proc, log)

    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=8)
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for r in records:
        assert seen.setdefault((r["connectionId"], r["sequence"]), r) == r  # one content per (id, sequence)
    chains = by_connection(list(seen.values()))
    per_key: dict[tuple[Any, ...], list[int]] = {}
    for cid, recs in chains.items():
        assert [r["sequence"] for r in recs] == list(range(len(recs))), cid  # no gaps
        assert {record_key(r) for r in recs} == {record_key(recs[0])}
        assert all(r["flags"] & 16 == (16 if layout == "v1.20" else 0) for r in recs)
        assert all(r["attributes"] == {"team": "net", "environment": "lab"} for r in recs)  # record.attributes
        per_key.setdefault(record_key(recs[0]), []).append(cid)

    def sums(cid: int) -> tuple[int, ...]:
        fields = ("packetDeltaCount", "octetDeltaCount", "reversePacketDeltaCount", "reverseOctetDeltaCount")
        return tuple(sum(r[f] for r in chains[cid]) for f in fields)

    key = lambda t: (t[4], packed(t[0]), t[1], packed(t[2]))  # noqa: E731
    (a_id,) = per_key[key(a)]  # one connectionId across the restart
    assert sums(a_id) == last[key(a)]
    assert len({r["exporterNode"] for r in chains[a_id]}) == 1
    old_b, new_b = sorted(per_key[key(b)], key=lambda cid: chains[cid][0]["flags"] & 2)
    assert sums(old_b) == before_reset and chains[old_b][-1]["flowEndReason"] == 4
    assert chains[new_b][0]["flags"] & 2 and sums(new_b) == last[key(b)]
    (gone_id,) = per_key[key(gone)]
    assert sums(gone_id) == last[key(gone)] and chains[gone_id][-1]["flowEndReason"] == 3
    (closing_id,) = per_key[key(closing)]
    assert sums(closing_id) == last[key(closing)]
    assert 3 in {r["flowEndReason"] for r in chains[closing_id]}


def test_a_map_cilium_created_again_is_read_as_the_new_one(
    layout: str, bpffs: Bpffs, caplog: pytest.LogCaptureFixture
) -> None:
    """Cilium's upgrade path: the pin removed and the map created again, empty. The source opens the pins at every
    read, so it reads the new map (a descriptor kept from before would show the old table, frozen) and says so."""
    now = int(time.monotonic())
    old = put("10.0.1.5", 42001, "10.0.2.7", 8080, 6, OUT, life(now, **counters(layout, (4, 400), (4, 400))))
    apply(layout, bpffs, [old])
    src = source(layout, bpffs)
    assert [c.orig_sport for c in read(src)] == [42001]
    (bpffs.globals / "cilium_ct4_global").unlink()
    run_ctwriter(ctwriter(layout), bpffs, "create")
    new = put("10.0.1.5", 42002, "10.0.2.7", 8080, 6, OUT, life(now, **counters(layout, (1, 60), (0, 0))))
    apply(layout, bpffs, [new])
    assert [c.orig_sport for c in read(src)] == [42002]
    assert "cilium_ct4_global was created again" in caplog.text


def test_a_million_entries_with_one_map_written_past_its_capacity() -> None:
    """1,100,000 entries written by Cilium v1.20.2's code, 600,000 of them into the 524,288-entry TCP map, whose
    LRU evicts: the source makes one connection of every entry Cilium's own lister still lists, their counters
    sum to the listing's, and the full map is counted (``cilium_full_reads``), the others not."""
    layout = "v1.20"
    shape = (("10", "cilium_ct4_global", 6, 600_000), ("10", "cilium_ct_any4_global", 17, 250_000),
             ("fd00", "cilium_ct6_global", 6, 250_000))  # fmt: skip
    lines = []
    for prefix, name, proto, n in shape:
        for i in range(n):
            addr = f"fd00::{i >> 16:x}:{i & 0xFFFF:x}" if prefix == "fd00" else f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}"
            entry = {"Packets": 1 + i % 7, "Bytes": 60 * (1 + i % 7), "Lifetime": 2**31}
            op = {"op": "put", "map": name, "daddr": addr, "saddr": addr, "sport": 1024 + i % 50000, "dport": 443,
                  "nexthdr": proto, "flags": 0, "entry": entry}  # fmt: skip
            lines.append(json.dumps(op))
    with Bpffs() as fs:
        binary = ctwriter(layout)
        run_ctwriter(binary, fs, "create")
        run_ctwriter(binary, fs, "apply", stdin="\n".join(lines) + "\n", timeout=900)
        del lines
        packets = 0
        per_map = {name: 0 for _, name, _, _ in shape}
        for line in run_ctwriter(binary, fs, "dump", timeout=900).splitlines():
            r = json.loads(line)
            per_map[r["map"]] += 1
            packets += r["entry"]["Packets"]
        listed = sum(per_map.values())
        assert per_map["cilium_ct_any4_global"] == 250_000 and per_map["cilium_ct6_global"] == 250_000
        assert 500_000 < per_map["cilium_ct4_global"] <= 524_288  # the LRU kept what fits
        src = source(layout, fs)
        count = total = 0

        def consume(batch: list[Connection]) -> None:
            nonlocal count, total
            count += len(batch)
            total += sum(c.orig_packets for c in batch)

        assert src.dump_into(consume) == listed == count
        assert total == packets
        assert src.kernel_stats() == {"cilium_full_reads": 1}
