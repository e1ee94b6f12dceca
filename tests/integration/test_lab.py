"""The namespace lab: real exchanges show up in the node's conntrack table with exact tuples and
plausible counters, Services DNAT, synthetic tables load, and teardown never leaks namespaces.

The parser tests at the top need nothing; the rest need root, ``ip``, ``nft`` and ``conntrack``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from devtools.lab import (
    CtEntry,
    CtTable,
    Exchange,
    Lab,
    LabError,
    _parse_tokens,
    parse_conntrack_line,
    parse_conntrack_output,
    run_in,
)

_MISSING = [t for t in ("ip", "nft", "conntrack") if shutil.which(t) is None]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_MISSING),
    reason=f"lab needs root and ip/nft/conntrack (euid={os.geteuid()}, missing={_MISSING})",
)

# Lines as conntrack v1.4.7 printed them on kernel 6.18 with nf_conntrack_acct=1 and
# nf_conntrack_timestamp=1 in the namespace.
TCP4 = (
    "ipv4     2 tcp      6 119 TIME_WAIT src=10.250.1.2 dst=10.250.0.2 sport=40001 dport=8080 "
    "packets=5 bytes=368 src=10.250.0.2 dst=10.250.1.2 sport=8080 dport=40001 packets=5 bytes=468 "
    "[ASSURED] mark=0 delta-time=0 use=1"
)
UDP4 = (
    "ipv4     2 udp      17 29 src=10.250.1.2 dst=10.250.0.2 sport=40002 dport=9090 packets=1 bytes=58 "
    "src=10.250.0.2 dst=10.250.1.2 sport=9090 dport=40002 packets=1 bytes=78 mark=0 delta-time=0 use=1"
)
ICMP4_ID = (
    "ipv4     2 icmp     1 29 src=10.250.1.2 dst=10.250.0.2 type=8 code=0 id=1 packets=1 bytes=28 "
    "src=10.250.0.2 dst=10.250.1.2 type=0 code=0 id=1 packets=1 bytes=28 mark=0 delta-time=0 use=1 "
    "id=2809381749"
)
ICMP6 = (
    "ipv6     10 icmpv6   58 29 src=fd00:250:1::2 dst=fd00:250::2 type=128 code=0 id=1 packets=1 bytes=48 "
    "src=fd00:250::2 dst=fd00:250:1::2 type=129 code=0 id=1 packets=1 bytes=48 mark=0 delta-time=0 use=1"
)
TCP6_DNAT = (
    "ipv6     10 tcp      6 119 TIME_WAIT src=fd00:250:1::2 dst=fd01:250::10 sport=40011 dport=80 "
    "packets=5 bytes=468 src=fd00:250::2 dst=fd00:250:1::2 sport=8080 dport=40011 packets=5 bytes=568 "
    "[ASSURED] mark=0 delta-time=0 use=1"
)
UDP_ZONE_UNREPLIED_KTS = (
    "ipv4     2 udp      17 94 src=10.200.0.8 dst=10.201.0.1 sport=1000 dport=80 packets=0 bytes=0 "
    "[UNREPLIED] src=10.201.0.1 dst=10.200.0.8 sport=80 dport=1000 packets=0 bytes=0 mark=5 zone=3 "
    "delta-time=6 [start=Wed Dec  2 13:20:04 2026] use=1 id=2146125278"
)
PLAIN_NO_ACCT = (
    "tcp      6 447 ESTABLISHED src=10.200.0.2 dst=10.201.0.1 sport=1000 dport=80 src=10.201.0.1 "
    "dst=10.200.0.2 sport=80 dport=1000 mark=0 zone=7 use=1"
)
ALL_LINES = [TCP4, UDP4, ICMP4_ID, ICMP6, TCP6_DNAT, UDP_ZONE_UNREPLIED_KTS, PLAIN_NO_ACCT]


# --------------------------------------------------------------------------- parser (no root)


def test_parse_tcp_with_counters() -> None:
    e = parse_conntrack_line(TCP4)
    assert (e.family, e.l3num, e.proto, e.protonum, e.timeout, e.state) == (
        "ipv4",
        2,
        "tcp",
        6,
        119,
        "TIME_WAIT",
    )
    assert (e.orig_src, e.orig_dst, e.orig_sport, e.orig_dport) == ("10.250.1.2", "10.250.0.2", 40001, 8080)
    assert (e.reply_src, e.reply_dst, e.reply_sport, e.reply_dport) == (
        "10.250.0.2",
        "10.250.1.2",
        8080,
        40001,
    )
    assert (e.orig_packets, e.orig_bytes, e.reply_packets, e.reply_bytes) == (5, 368, 5, 468)
    assert e.assured and not e.unreplied
    assert (e.mark, e.zone, e.use, e.delta_time, e.ct_id) == (0, 0, 1, 0, None)


def test_parse_icmp_tells_tuple_id_from_conntrack_id() -> None:
    e = parse_conntrack_line(ICMP4_ID)
    assert e.orig_sport is None and e.orig_dport is None
    assert e.orig_extra == {"type": 8, "code": 0, "id": 1}
    assert e.reply_extra == {"type": 0, "code": 0, "id": 1}
    assert e.ct_id == 2809381749
    assert e.state is None


def test_parse_ipv6_icmpv6_and_udp() -> None:
    e = parse_conntrack_line(ICMP6)
    assert (e.family, e.l3num, e.proto, e.protonum) == ("ipv6", 10, "icmpv6", 58)
    assert e.orig_dst == "fd00:250::2" and e.reply_packets == 1 and e.reply_bytes == 48
    u = parse_conntrack_line(UDP4)
    assert (u.proto, u.state, u.orig_bytes, u.reply_bytes) == ("udp", None, 58, 78)
    assert not u.assured


def test_parse_zone_unreplied_ktimestamp() -> None:
    e = parse_conntrack_line(UDP_ZONE_UNREPLIED_KTS)
    assert e.unreplied and e.zone == 3 and e.mark == 5 and e.ct_id == 2146125278
    assert e.extra["start"] == "Wed Dec  2 13:20:04 2026"
    assert e.reply_src == "10.201.0.1" and e.reply_dport == 1000


def test_parse_plain_output_without_acct() -> None:
    e = parse_conntrack_line(PLAIN_NO_ACCT)
    assert e.family == "ipv4" and e.zone == 7 and e.state == "ESTABLISHED"
    assert e.orig_packets is None and e.reply_bytes is None  # not printed: acct was off


@pytest.mark.parametrize("line", ALL_LINES)
def test_fast_and_general_parsers_agree(line: str) -> None:
    assert parse_conntrack_line(line) == _parse_tokens(line)


def test_output_skips_summary_and_find() -> None:
    table = parse_conntrack_output(
        "\n".join([*ALL_LINES, "conntrack v1.4.7 (conntrack-tools): 7 flow entries"])
    )
    assert isinstance(table, CtTable) and len(table) == 7
    hit = table.find(src="fd00:250:1:0::2", sport=40011, proto="tcp")  # spelling does not matter
    assert hit is not None and hit.orig_dst == "fd01:250::10" and hit.reply_src == "fd00:250::2"
    assert table.find(src="10.250.1.2", sport=1) is None
    with pytest.raises(LabError):
        table.find(src="10.250.1.2")  # three entries: ambiguous
    assert len(table.find_all(family=6)) == 2


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_conntrack_line("nonsense")


# --------------------------------------------------------------------------- live lab


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    if os.geteuid() != 0 or _MISSING:
        pytest.skip(f"lab needs root and ip/nft/conntrack (euid={os.geteuid()}, missing={_MISSING})")
    with Lab(pods=3) as lab:
        yield lab


def _closed(e: CtEntry) -> bool:
    return e.state in ("TIME_WAIT", "CLOSE")


def _check_tcp(lab: Lab, ex: Exchange, min_hdr: int, max_hdr: int) -> CtEntry:
    """Tuples exact; each counted packet carries at least/at most a plausible IP+TCP header."""
    e = lab.wait_entry(ex, _closed)
    assert (e.proto, e.family) == ("tcp", "ipv4" if ex.family == 4 else "ipv6")
    assert (e.orig_src, e.orig_sport, e.orig_dst, e.orig_dport) == (
        ex.client_ip,
        ex.client_port,
        ex.server_ip,
        ex.server_port,
    )
    assert (e.reply_src, e.reply_sport, e.reply_dst, e.reply_dport) == (
        ex.backend_ip,
        ex.backend_port,
        ex.client_ip,
        ex.client_port,
    )
    assert e.orig_packets is not None and e.orig_bytes is not None
    assert e.reply_packets is not None and e.reply_bytes is not None
    assert e.orig_packets >= 3 and e.reply_packets >= 3  # SYN / data / FIN at the least
    assert (
        ex.request_bytes + min_hdr * e.orig_packets
        <= e.orig_bytes
        <= ex.request_bytes + max_hdr * e.orig_packets
    )
    assert (
        ex.response_bytes + min_hdr * e.reply_packets
        <= e.reply_bytes
        <= ex.response_bytes + max_hdr * e.reply_packets
    )
    assert e.assured and e.zone == 0 and e.mark == 0
    return e


@needs_root
def test_sysctls_are_per_netns(lab: Lab) -> None:
    node = run_in(
        lab.node_ns, "sysctl", "-n", "net.netfilter.nf_conntrack_acct", "net.netfilter.nf_conntrack_timestamp"
    )
    assert node.stdout.split() == ["1", "1"]
    pod = run_in(lab.pods[0], "sysctl", "-n", "net.netfilter.nf_conntrack_acct", "net.ipv6.conf.all.forwarding")
    # Fresh namespaces start from defaults, not the node's. (Not net.ipv4.ip_forward: a new namespace
    # inherits the host's IPv4 settings, and a container engine on the host may have turned it on.)
    assert pod.stdout.split() == ["0", "0"]
    fwd = run_in(lab.node_ns, "sysctl", "-n", "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding")
    assert fwd.stdout.split() == ["1", "1"]


@needs_root
def test_tcp_ipv4_exchange_in_node_conntrack(lab: Lab) -> None:
    p0, p1 = lab.pods[0], lab.pods[1]
    ex = lab.tcp_exchange(p0, p1, 8080, request_bytes=1000, response_bytes=5000)
    assert ex.client_ip == p0.ipv4 and ex.server_ip == p1.ipv4 and ex.backend_ip == p1.ipv4
    e = _check_tcp(lab, ex, min_hdr=40, max_hdr=80)
    assert e.state == "TIME_WAIT"  # client closed first, both FINs acked before the call returned


@needs_root
def test_tcp_ipv6_exchange_in_node_conntrack(lab: Lab) -> None:
    p1, p2 = lab.pods[1], lab.pods[2]
    ex = lab.tcp_exchange(p1, p2, 8443, request_bytes=3000, response_bytes=70000, family=6)
    assert ex.client_ip == p1.ipv6 and ex.server_ip == p2.ipv6
    _check_tcp(lab, ex, min_hdr=60, max_hdr=100)


@needs_root
def test_tcp_hold_keeps_entry_established(lab: Lab) -> None:
    p0, p2 = lab.pods[0], lab.pods[2]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lab.tcp_exchange, p0, p2, 8081, 10, 20, 4, 1.0)
        # While held, the entry exists and is ESTABLISHED (the sport is only known afterwards,
        # so look it up by destination).
        seen = None
        for _ in range(40):
            hits = lab.conntrack_entries().find_all(dst=p2.ipv4, dport=8081)
            if hits:
                seen = hits[0]
                break
            time.sleep(0.02)
        ex = fut.result()
    assert seen is not None and seen.state == "ESTABLISHED"
    assert ex.duration >= 1.0
    assert lab.wait_entry(ex, _closed).orig_sport == seen.orig_sport


@needs_root
@pytest.mark.parametrize("family", [4, 6])
def test_udp_exchange_exact_bytes(lab: Lab, family: int) -> None:
    p0, p2 = lab.pods[0], lab.pods[2]
    ex = lab.udp_exchange(p0, p2, 5353, request_bytes=100, response_bytes=300, family=family, count=3)
    e = lab.wait_entry(ex)
    hdr = 28 if family == 4 else 48  # IP + UDP headers, no options
    assert (e.proto, e.state) == ("udp", None)
    assert (e.orig_src, e.orig_sport, e.orig_dst, e.orig_dport) == (
        ex.client_ip,
        ex.client_port,
        p2.ip(family),
        5353,
    )
    assert (e.reply_src, e.reply_sport) == (p2.ip(family), 5353)
    assert (e.orig_packets, e.reply_packets) == (3, 3)
    assert e.orig_bytes == 3 * (100 + hdr) and e.reply_bytes == 3 * (300 + hdr)
    assert not e.unreplied


@needs_root
@pytest.mark.parametrize("family", [4, 6])
def test_service_dnat(lab: Lab, family: int) -> None:
    p0, p1 = lab.pods[0], lab.pods[1]
    k = 1 if family == 4 else 2
    svc = lab.add_service(lab.vip4(k), 80, p1, 9376, vip6=lab.vip6(k))
    ex = lab.tcp_exchange(p0, svc, 80, request_bytes=200, response_bytes=1200, family=family)
    assert ex.server_ip == svc.ip(family) and ex.server_port == 80
    assert ex.backend_ip == p1.ip(family) and ex.backend_port == 9376
    e = _check_tcp(lab, ex, min_hdr=40 if family == 4 else 60, max_hdr=80 if family == 4 else 100)
    assert e.orig_dst == svc.ip(family) and e.orig_dport == 80  # the VIP the client dialled
    assert e.reply_src == p1.ip(family) and e.reply_sport == 9376  # the backend that answered


@needs_root
def test_service_hairpin_and_udp_service(lab: Lab) -> None:
    p1 = lab.pods[1]
    svc = lab.add_service(lab.vip4(3), 53, p1, 5300, proto="udp")
    ex = lab.udp_exchange(p1, svc, None, 40, 80)
    e = lab.wait_entry(ex)
    assert e.orig_dst == svc.vip4 and e.reply_src == p1.ipv4
    assert e.reply_dst == p1.node_ip4  # masqueraded so the backend's answer comes back via the node


@needs_root
def test_long_connection_counts_grow(lab: Lab) -> None:
    p0, p2 = lab.pods[0], lab.pods[2]
    with lab.open_tcp(p0, p2, 7000, family=6) as conn:
        conn.send(1000)
        first = lab.wait_entry(conn, lambda e: (e.orig_bytes or 0) >= 1000)
        conn.send(50000)
        conn.send(0)
        later = lab.wait_entry(conn, lambda e: (e.orig_bytes or 0) >= 51000 and (e.reply_bytes or 0) >= 51000)
        assert first.state == later.state == "ESTABLISHED"
        assert later.orig_packets is not None and first.orig_packets is not None
        assert later.orig_packets > first.orig_packets
    assert (conn.sent, conn.received) == (51000, 51000)
    assert lab.wait_entry(conn, _closed).reply_sport == 7000


@needs_root
def test_many_parallel_exchanges_all_tracked(lab: Lab) -> None:
    pods = lab.pods

    def one(i: int) -> Exchange:
        c, s = pods[i % 3], pods[(i + 1) % 3]
        if i % 3 == 0:
            return lab.udp_exchange(c, s, 6000, i, 2 * i, family=4 if i % 2 else 6)
        return lab.tcp_exchange(c, s, 6001, i, 3 * i, family=4 if i % 2 else 6)

    with ThreadPoolExecutor(8) as pool:
        exs = list(pool.map(one, range(150)))
    table = lab.conntrack_entries()
    for ex in exs:
        e = table.for_exchange(ex)
        assert e is not None, ex
        assert e.orig_bytes is not None and e.orig_bytes >= ex.total_request_bytes


@needs_root
def test_flush_conntrack(lab: Lab) -> None:
    lab.tcp_exchange(lab.pods[0], lab.pods[1], 8080, 1, 1)
    assert lab.conntrack_count() > 0
    lab.flush_conntrack()
    assert lab.conntrack_count() == 0


@needs_root
def test_load_synthetic(lab: Lab) -> None:
    lab.load_synthetic(10000)
    ns = lab.tbl_ns
    assert ns == f"{lab.name}-tbl"
    assert int(run_in(ns, "conntrack", "-C").stdout) == 10000
    table = lab.conntrack_entries(ns)
    assert len(table) == 10000
    assert len({(e.orig_src, e.orig_sport, e.orig_dst, e.orig_dport) for e in table}) == 10000
    assert all(e.proto == "tcp" and e.state == "ESTABLISHED" and e.assured for e in table)
    # More in another zone and protocol: still unique, counts add up, zone is visible.
    lab.load_synthetic(500, zone=7, proto="udp", family=6)
    assert lab.conntrack_count(ns) == 10500
    zoned = lab.conntrack_entries(ns).find_all(zone=7)
    assert len(zoned) == 500 and all(e.family == "ipv6" and e.proto == "udp" for e in zoned)
    assert lab.conntrack_count() < 10000  # the node's own table is separate


# --------------------------------------------------------------------------- teardown


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_root
def test_teardown_on_exception_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab(pods=2) as lab:
        lab.load_synthetic(10)
        lab.tcp_exchange(lab.pods[0], lab.pods[1], 8080, 10, 10)
        names = set(lab.namespaces)
        pids = lab.agent_pids
        assert names == {f"{lab.name}-node", f"{lab.name}-p0", f"{lab.name}-p1", f"{lab.name}-tbl"}
        assert names <= _netns_names()
        raise RuntimeError("boom")
    assert not names & _netns_names()
    assert not [pid for pid in pids if _alive(pid)]
    lab.close()  # idempotent


@needs_root
def test_failed_setup_cleans_up_only_its_own_namespaces() -> None:
    name = "lt" + os.urandom(2).hex()
    squatter = f"{name}-p1"
    subprocess.run(["ip", "netns", "add", squatter], check=True)
    try:
        with pytest.raises(LabError, match="exists"), Lab(name=name, pods=2):
            pass
        left = {n for n in _netns_names() if n.startswith(name)}
        assert left == {squatter}  # node and p0 were ours and are gone; the squatter is not ours
    finally:
        subprocess.run(["ip", "netns", "del", squatter], check=False)
