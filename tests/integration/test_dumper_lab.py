"""ConntrackDumper against the real kernel, in network namespaces created (and removed) here.

The table of a fresh namespace is filled with `conntrack -R` (TCP/UDP/ICMP, IPv4/IPv6,
zones 0 and 5, marks, a DNAT-like entry), labelled entries made through pyroute2, and
real loopback traffic inside the namespace (for counters). The dump is then compared
field by field with pyroute2's own `NFCTSocket` dump of the same namespace.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import pytest
from pyroute2 import NFCTSocket
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.conntrack import (
    ConntrackDumper,
    ConntrackError,
    NetnsError,
    enable_accounting,
    read_sysctl,
    run_in_netns,
)
from flow_exporter.conntrack.netns import current_netns_inode
from tests.support.netlink_messages import assert_valid, connection_from_pyroute2
from tests.support.paths import REPO

# Kernel tests; the fake-socket tests (tests/unit/test_dumper.py) need neither root nor namespaces.
lab = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("conntrack")),
    reason="needs root, ip and conntrack for network namespaces",
)

FILE_ENTRIES = 2000
LABELS = (1 << 3) | (1 << 100)
UDP_DATAGRAMS = 5


COUNT = "/proc/sys/net/netfilter/nf_conntrack_count"


def read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def sh(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, check=True).stdout


def ns_exec(ns: str, *args: str, stdin: str | None = None) -> str:
    return sh("ip", "netns", "exec", ns, *args, stdin=stdin)


@contextlib.contextmanager
def fresh_netns() -> Iterator[str]:
    """A new network namespace, deleted on exit even when the test fails."""
    name = f"ctt-{secrets.token_hex(4)}"
    sh("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def entry_lines(n: int) -> list[str]:
    """`conntrack -R` lines: TCP/UDP/ICMP over IPv4/IPv6, zones 0 and 5, marks."""
    lines = []
    for i in range(n):
        a, b = i >> 8 & 0xFF, i & 0xFF
        zone = " --zone 5" if i % 3 == 0 else ""
        mark = f" -m {i}" if i % 2 else ""
        sport = 1024 + i
        kind = i % 6
        if kind == 0:
            lines.append(f"-I -p tcp -s 10.1.{a}.{b} -d 10.2.{a}.{b} --sport {sport} --dport 443 "
                         f"--state ESTABLISHED -u ASSURED,SEEN_REPLY -t 3600{zone}{mark}")
        elif kind == 1:
            lines.append(f"-I -p udp -s 10.1.{a}.{b} -d 10.3.{a}.{b} --sport {sport} --dport 53 -t 3600{zone}{mark}")
        elif kind == 2:
            lines.append(f"-I -p icmp -s 10.1.{a}.{b} -d 10.4.{a}.{b} --icmp-type 8 --icmp-code 0 "
                         f"--icmp-id {i} -t 3600{zone}{mark}")
        elif kind == 3:
            lines.append(f"-I -p tcp -s 2001:db8:1::{i:x} -d 2001:db8:2::{i:x} --sport {sport} --dport 80 "
                         f"--state SYN_SENT -t 3600{zone}{mark}")
        elif kind == 4:
            lines.append(f"-I -p udp -s 2001:db8:1::{i:x} -d 2001:db8:3::{i:x} --sport {sport} --dport 123 "
                         f"-t 3600{zone}{mark}")
        else:
            lines.append(f"-I -p icmpv6 -s 2001:db8:1::{i:x} -d 2001:db8:4::{i:x} --icmpv6-type 128 "
                         f"--icmpv6-code 0 --icmpv6-id {i} -t 3600{zone}{mark}")
    # A DNAT-like entry: reply source is the backend behind a service address.
    lines.append("-I -p tcp -s 10.5.0.1 -d 10.96.0.10 --sport 4000 --dport 80 -r 10.6.0.7 -q 10.5.0.1 "
                 "--reply-port-src 8080 --reply-port-dst 4000 --state ESTABLISHED -u ASSURED -t 3600")
    return lines


def load(ns: str, lines: list[str]) -> None:
    path = f"/tmp/{ns}.ct"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        ns_exec(ns, "conntrack", "-R", path)
    finally:
        os.unlink(path)


def icmp_echo(family: int, dst: str, ident: int) -> None:
    """One echo request on the namespace's loopback (the kernel answers it)."""
    proto = socket.IPPROTO_ICMP if family == socket.AF_INET else socket.IPPROTO_ICMPV6
    kind = 8 if family == socket.AF_INET else 128
    body = struct.pack("!BBHHH", kind, 0, 0, ident, 1) + b"ping"
    if family == socket.AF_INET:
        s = sum(struct.unpack(f"!{len(body) // 2}H", body))
        s = (s >> 16) + (s & 0xFFFF)
        body = body[:2] + struct.pack("!H", ~(s + (s >> 16)) & 0xFFFF) + body[4:]
    with socket.socket(family, socket.SOCK_RAW, proto) as s6:  # the kernel fills the ICMPv6 checksum
        s6.sendto(body, (dst, 0))
        s6.settimeout(2)
        s6.recv(256)


@dataclass
class Table:
    ns: str
    accounting_warnings: list[str]
    labels: bool  # labelled entries could be created
    udp_port: int = 0
    tcp_port: int = 0
    sockets: list[socket.socket] = field(default_factory=list)


def traffic(t: Table) -> None:
    """Real flows on the namespace's loopback, so counters and timestamps are non-zero."""

    def run() -> None:
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind(("127.0.0.1", 0))
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(UDP_DATAGRAMS):
            tx.sendto(b"x" * 100, rx.getsockname())
        t.udp_port = rx.getsockname()[1]
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        cli = socket.create_connection(srv.getsockname())
        acc, _ = srv.accept()
        cli.sendall(b"hello")
        acc.recv(5)
        t.tcp_port = srv.getsockname()[1]
        t.sockets += [rx, tx, srv, cli, acc]
        icmp_echo(socket.AF_INET, "127.0.0.1", 4242)
        icmp_echo(socket.AF_INET6, "::1", 4343)

    run_in_netns(t.ns, run)


@pytest.fixture(scope="module")
def table() -> Iterator[Table]:
    with fresh_netns() as ns:
        t = Table(ns, enable_accounting(ns), labels=False)
        try:
            ns_exec(ns, "ip", "link", "set", "lo", "up")
            for proto in ("icmp", "icmpv6", "udp"):  # traffic entries must outlive the module
                ns_exec(ns, "sysctl", "-qw", f"net.netfilter.nf_conntrack_{proto}_timeout=3600")
            # A ct rule makes the namespace track its traffic; `ct label set` also enables
            # the labels extension so entries can carry labels.
            rules = "table inet ctt {{\n chain out {{\n type filter hook output priority 0;\n {}\n }}\n}}\n"
            try:
                ns_exec(ns, "nft", "-f", "-", stdin=rules.format("ct label set 3"))
                t.labels = True
            except (subprocess.CalledProcessError, FileNotFoundError):
                with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
                    ns_exec(ns, "nft", "-f", "-", stdin=rules.format("ct state new accept"))
            load(ns, entry_lines(FILE_ENTRIES))
            if t.labels:
                ct = NFCTSocket(nfgen_family=socket.AF_INET, netns=ns)  # creating needs a family
                try:
                    for i in range(3):
                        orig = NFCTAttrTuple(saddr=f"10.9.0.{i + 1}", daddr="10.9.1.1", proto=PROTO_UDP,
                                             sport=5000 + i, dport=53)
                        ct.entry("add", timeout=3600, tuple_orig=orig, tuple_reply=orig.reverse(),
                                 labels=LABELS, labels_mask=(1 << 128) - 1)
                finally:
                    ct.close()
            traffic(t)
            yield t
        finally:
            for s in t.sockets:
                s.close()


def pyroute2_dump(ns: str) -> list[Connection]:
    ct = NFCTSocket(nfgen_family=socket.AF_UNSPEC, netns=ns)
    try:
        return [connection_from_pyroute2(m) for m in ct.dump()]
    finally:
        ct.close()


def by_id(conns: list[Connection]) -> dict[int, Connection]:
    table = {c.ct_id: c for c in conns}
    assert len(table) == len(conns), "CTA_ID not unique"
    return table


@pytest.mark.lab
@lab
def test_accounting_enabled_in_netns(table: Table) -> None:
    assert table.accounting_warnings == []
    for name in ("nf_conntrack_acct", "nf_conntrack_timestamp"):
        assert ns_exec(table.ns, "sysctl", "-n", f"net.netfilter.{name}").strip() == "1"
        assert read_sysctl(f"net.netfilter.{name}", table.ns) == "1"


@pytest.mark.lab
@lab
def test_dump_matches_pyroute2_field_by_field(table: Table) -> None:
    with ConntrackDumper(netns=table.ns) as d:
        mine = by_id(d.dump())
        assert d.last_skipped == 0
    theirs = by_id(pyroute2_dump(table.ns))
    assert len(mine) >= FILE_ENTRIES + 1
    assert mine.keys() == theirs.keys()
    for ct_id, c in mine.items():
        assert_valid(c)
        ref = theirs[ct_id]
        diff = {f.name: (getattr(c, f.name), getattr(ref, f.name)) for f in fields(Connection)
                if getattr(c, f.name) != getattr(ref, f.name)}
        assert not diff, f"entry {ct_id}: (ours, pyroute2) {diff}"


@pytest.mark.lab
@lab
def test_dump_content(table: Table) -> None:
    with ConntrackDumper(netns=table.ns) as d:
        conns = d.dump()
    families = {(c.family, c.proto) for c in conns}
    assert {(socket.AF_INET, PROTO_TCP), (socket.AF_INET, PROTO_UDP), (socket.AF_INET, PROTO_ICMP),
            (socket.AF_INET6, PROTO_TCP), (socket.AF_INET6, PROTO_UDP), (socket.AF_INET6, PROTO_ICMPV6)} <= families
    assert {c.zone for c in conns} == {0, 5}
    assert {c.mark for c in conns if c.ct_id} >= {1, 3, 5}
    lo = socket.inet_aton("127.0.0.1")
    udp = [c for c in conns if c.proto == PROTO_UDP and c.orig_dst == lo and c.orig_dport == table.udp_port]
    assert len(udp) == 1 and udp[0].orig_packets == UDP_DATAGRAMS and udp[0].orig_bytes == UDP_DATAGRAMS * 128
    assert abs(udp[0].start_ns - time.time_ns()) < 600e9
    tcp = [c for c in conns if c.proto == PROTO_TCP and c.orig_dst == lo and c.orig_dport == table.tcp_port]
    assert len(tcp) == 1 and tcp[0].tcp_state == 3 and tcp[0].reply_packets > 0
    echo = [c for c in conns if c.proto == PROTO_ICMP and c.icmp_id == 4242]
    assert len(echo) == 1 and (echo[0].icmp_type, echo[0].orig_dport, echo[0].reply_dport) == (8, 8 << 8, 0)
    assert echo[0].reply_packets == 1
    echo6 = [c for c in conns if c.proto == PROTO_ICMPV6 and c.icmp_id == 4343]
    assert len(echo6) == 1 and echo6[0].orig_dport == 128 << 8 and echo6[0].reply_dport == 129 << 8
    dnat = [c for c in conns if c.orig_dst == socket.inet_aton("10.96.0.10")]
    assert len(dnat) == 1 and dnat[0].reply_src == socket.inet_aton("10.6.0.7") and dnat[0].reply_sport == 8080
    assert dnat[0].key[4] == socket.inet_aton("10.6.0.7") and dnat[0].key[5] == 8080
    if table.labels:
        labelled = [c for c in conns if c.labels is not None and c.orig_src.startswith(b"\x0a\x09")]
        assert len(labelled) == 3
        assert all(int.from_bytes(c.labels, "little") & LABELS == LABELS for c in labelled)


@pytest.mark.lab
@lab
def test_main_namespace_unchanged(table: Table) -> None:
    before = (os.stat("/proc/self/ns/net").st_ino, current_netns_inode())
    with ConntrackDumper(netns=table.ns) as d:
        n = len(d.dump())
        assert d.count() == n
    assert (os.stat("/proc/self/ns/net").st_ino, current_netns_inode()) == before
    # /proc/sys/net follows the reading thread's namespace: in the netns thread it is the netns' count.
    assert int(read_sysctl("net.netfilter.nf_conntrack_count", table.ns)) == n
    assert read_sysctl("net.netfilter.nf_conntrack_count") == read_int(COUNT).__str__()


@pytest.mark.lab
@lab
def test_zone_filter(table: Table) -> None:
    with ConntrackDumper(netns=table.ns) as d:
        everything = d.dump()
        five = d.dump(zones={5})
        zero = d.dump(zones={0})
        both = d.dump(zones=[0, 5])
        none = d.dump(zones=set())
    assert five and {c.zone for c in five} == {5}
    assert by_id(five).keys() == {c.ct_id for c in everything if c.zone == 5}
    assert zero and by_id(zero).keys() == {c.ct_id for c in everything if c.zone == 0}
    assert by_id(both).keys() == by_id(everything).keys()
    assert none == []


@pytest.mark.lab
@lab
def test_count_equals_loaded_and_max() -> None:
    with fresh_netns() as ns:
        load(ns, entry_lines(300))
        with ConntrackDumper(netns=ns) as d:
            assert d.count() == 301
            assert len(d.dump()) == 301
            assert d.max_entries() == read_int("/proc/sys/net/netfilter/nf_conntrack_max")


@pytest.mark.lab
@lab
def test_reopens_after_failure(table: Table) -> None:
    with ConntrackDumper(netns=table.ns) as d:
        n = len(d.dump())
        assert d._sock is not None
        d._sock.close()  # simulate a broken socket
        with pytest.raises(ConntrackError):
            d.dump()
        assert len(d.dump()) == n


@pytest.mark.lab
@lab
def test_missing_netns() -> None:
    with pytest.raises(NetnsError):
        ConntrackDumper(netns=f"ctt-missing-{secrets.token_hex(4)}")
    warnings = enable_accounting(f"ctt-missing-{secrets.token_hex(4)}")
    assert len(warnings) == 2
    assert "counters will be 0" in warnings[0] and "exporter's clock" in warnings[1]


@pytest.mark.lab
@lab
def test_own_namespace_dump_works() -> None:
    """netns=None dumps this process' namespace (whatever is in it)."""
    with ConntrackDumper() as d:
        conns = d.dump()
        assert d.count() >= 0
    for c in conns:
        assert_valid(c)


@pytest.mark.lab
@lab
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_without_cap_net_admin_is_a_permission_error() -> None:
    code = (
        "from flow_exporter.conntrack import ConntrackDumper, ConntrackPermissionError\n"
        "d = ConntrackDumper()\n"
        "for op in (d.dump, d.count):\n"
        "    try:\n"
        "        op()\n"
        "    except ConntrackPermissionError as e:\n"
        "        print(e.errno, e)\n"
    )
    # Still root, without CAP_NET_ADMIN only: the child reads the checkout and the venv whatever their modes
    # (a checkout in a 0700 directory is unreadable to another user), and lacks exactly the capability at stake.
    out = subprocess.run(
        ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", sys.executable, "-c", code],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.splitlines()
    assert len(out) == 2 and all(line.startswith("1 ") and "needs CAP_NET_ADMIN" in line for line in out)
