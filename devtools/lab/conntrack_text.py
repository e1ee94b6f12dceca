"""``conntrack -L`` text: parsing it into ``CtEntry``/``CtTable`` and writing synthetic ``conntrack -R`` lines.

Tests check the kernel's table against what the lab sent, so the lab needs an exact reading of
the tool's output (a regex for the common shape, a token walk for everything else) and a way
to fill a table with many unique entries. Pure text handling: no namespaces, no processes.
"""

from __future__ import annotations

import gc
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devtools.lab.model import LabError, _norm

if TYPE_CHECKING:
    from devtools.lab.model import Exchange
    from devtools.lab.topology import LongConnection

_TUPLE_INT_KEYS = frozenset({"sport", "dport", "type", "code", "id", "packets", "bytes"})
_TUPLE_KEYS = _TUPLE_INT_KEYS | {"src", "dst", "srckey", "dstkey", "vtag"}
_TOKEN_RE = re.compile(r"\[[^\]]*\]|\S+")


@dataclass(slots=True)
class CtEntry:
    """One line of ``conntrack -L`` output, parsed.

    Counters are None when accounting was off for the entry (nothing printed), not 0.
    ``orig_extra``/``reply_extra`` hold per-direction keys that are not ports or counters
    (ICMP type/code/id, GRE keys); ``extra`` holds the rest (secctx, helper, labels, ...).
    """

    family: str
    proto: str
    protonum: int
    timeout: int | None
    state: str | None
    orig_src: str
    orig_dst: str
    orig_sport: int | None
    orig_dport: int | None
    reply_src: str
    reply_dst: str
    reply_sport: int | None
    reply_dport: int | None
    orig_packets: int | None = None
    orig_bytes: int | None = None
    reply_packets: int | None = None
    reply_bytes: int | None = None
    flags: frozenset[str] = frozenset()
    mark: int = 0
    zone: int = 0
    use: int | None = None
    ct_id: int | None = None
    delta_time: int | None = None
    orig_extra: dict[str, int | str] = field(default_factory=dict)
    reply_extra: dict[str, int | str] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    raw: str = ""

    @property
    def l3num(self) -> int:
        """Address family number (2 or 10) as conntrack prints it."""
        return socket.AF_INET6 if self.family == "ipv6" else socket.AF_INET

    @property
    def assured(self) -> bool:
        """The kernel saw traffic both ways and keeps the entry under pressure."""
        return "ASSURED" in self.flags

    @property
    def unreplied(self) -> bool:
        """No packet in the reply direction yet."""
        return "UNREPLIED" in self.flags

    def matches(
        self,
        src: str | None = None,
        sport: int | None = None,
        dst: str | None = None,
        dport: int | None = None,
        proto: str | None = None,
        family: int | str | None = None,
        zone: int | None = None,
    ) -> bool:
        """True when every given original-direction field equals this entry's."""
        if proto is not None and self.proto != proto:
            return False
        if family is not None:
            fam = family if isinstance(family, str) else ("ipv6" if family == 6 else "ipv4")
            if self.family != fam:
                return False
        if zone is not None and self.zone != zone:
            return False
        if sport is not None and self.orig_sport != sport:
            return False
        if dport is not None and self.orig_dport != dport:
            return False
        if src is not None and _norm(self.orig_src) != _norm(src):
            return False
        return dst is None or _norm(self.orig_dst) == _norm(dst)


class CtTable(list[CtEntry]):
    """A list of entries with lookups by original tuple."""

    def find_all(self, **match: Any) -> list[CtEntry]:
        """All entries matching the original-direction fields (see ``CtEntry.matches``)."""
        return [e for e in self if e.matches(**match)]

    def find(
        self,
        src: str | None = None,
        sport: int | None = None,
        dst: str | None = None,
        dport: int | None = None,
        proto: str | None = None,
        family: int | str | None = None,
        zone: int | None = None,
    ) -> CtEntry | None:
        """The single entry matching; None if absent, LabError if ambiguous."""
        hits = self.find_all(
            src=src, sport=sport, dst=dst, dport=dport, proto=proto, family=family, zone=zone
        )
        if len(hits) > 1:
            raise LabError(f"{len(hits)} conntrack entries match; narrow the lookup: {hits[0].raw}")
        return hits[0] if hits else None

    def for_exchange(self, ex: Exchange | LongConnection) -> CtEntry | None:
        """The entry an exchange created, by its original tuple."""
        return self.find(
            src=ex.client_ip,
            sport=ex.client_port,
            dst=ex.server_ip,
            dport=ex.server_port,
            proto=ex.proto,
            family=ex.family,
        )


# The common shape (ported protocol, optional counters, no extras), matched in one go; anything
# else takes the general token walk below. Both must agree (tests compare them).
_FAST_RE = re.compile(
    r"(?:(ipv4|ipv6) +\d+ +)?(tcp|udp|udplite|sctp|dccp) +(\d+) +(\d+) (?:([A-Z_0-9]+) )?"
    r"src=(\S+) dst=(\S+) sport=(\d+) dport=(\d+) (?:packets=(\d+) bytes=(\d+) )?(\[UNREPLIED\] )?"
    r"src=(\S+) dst=(\S+) sport=(\d+) dport=(\d+) (?:packets=(\d+) bytes=(\d+) )?(\[ASSURED\] )?"
    r"mark=(\d+) (?:zone=(\d+) )?(?:delta-time=(\d+) )?use=(\d+)(?: id=(\d+))? *$"
)
_FLAG_SETS = {
    (False, False): frozenset(),
    (True, False): frozenset({"UNREPLIED"}),
    (False, True): frozenset({"ASSURED"}),
    (True, True): frozenset({"UNREPLIED", "ASSURED"}),
}


def _fast_entry(m: re.Match[str], line: str) -> CtEntry:
    (fam, proto, pnum, tmo, state, osrc, odst, osp, odp, opk, oby, unrep,
     rsrc, rdst, rsp, rdp, rpk, rby, assured, mark, zone, dtime, use, ctid) = m.groups()  # fmt: skip
    return CtEntry(
        fam or ("ipv6" if ":" in osrc else "ipv4"),
        proto,
        int(pnum),
        int(tmo),
        state,
        osrc,
        odst,
        int(osp),
        int(odp),
        rsrc,
        rdst,
        int(rsp),
        int(rdp),
        None if opk is None else int(opk),
        None if oby is None else int(oby),
        None if rpk is None else int(rpk),
        None if rby is None else int(rby),
        _FLAG_SETS[unrep is not None, assured is not None],
        int(mark),
        0 if zone is None else int(zone),
        int(use),
        None if ctid is None else int(ctid),
        None if dtime is None else int(dtime),
        {},
        {},
        {},
        line,
    )


def parse_conntrack_line(line: str) -> CtEntry:
    """Parse one ``conntrack -L`` line (plain or ``-o extended[,id,ktimestamp,...]``).

    Layout: ``[ipv4 2] tcp 6 <timeout> [STATE] <orig tuple> [packets= bytes=] [UNREPLIED]
    <reply tuple> [packets= bytes=] [ASSURED] mark= [zone=] [delta-time=] use= [id=]``.
    The second ``src=`` starts the reply tuple; the first key that is not a tuple key ends it,
    which is how ``id=`` (ICMP id inside a tuple, conntrack id after ``use=``) is told apart.
    Addresses are kept exactly as printed. A regex handles the common shape fast (250k-line
    tables must parse in about a second); everything else goes through ``_parse_tokens``.
    """
    line = line.rstrip("\n")
    m = _FAST_RE.match(line)
    if m is not None:
        return _fast_entry(m, line)
    return _parse_tokens(line)


def _parse_tokens(line: str) -> CtEntry:
    """The general parser: walks key=value tokens, handles any protocol and extra fields."""
    # Only ktimestamp output has bracketed groups with spaces ("[start=Wed Dec  2 ...]").
    toks = _TOKEN_RE.findall(line) if "[st" in line else line.split()
    if len(toks) < 3:
        raise ValueError(f"not a conntrack line: {line!r}")
    i = 0
    family = ""
    if toks[0] in ("ipv4", "ipv6", "unknown") and toks[1].isdigit():
        family = toks[0]
        i = 2
    try:
        proto, protonum = toks[i], int(toks[i + 1])
    except (IndexError, ValueError):
        raise ValueError(f"not a conntrack line: {line!r}") from None
    i += 2
    timeout: int | None = None
    if i < len(toks) and toks[i].isdigit():
        timeout = int(toks[i])
        i += 1
    state: str | None = None
    if i < len(toks) and "=" not in toks[i] and toks[i][0] != "[":
        state = toks[i]
        i += 1

    orig: dict[str, Any] = {}
    reply: dict[str, Any] = {}
    top: dict[str, str] = {}
    flags: list[str] = []
    cur: dict[str, Any] | None = None  # orig, reply, or top once past the tuples
    tuple_keys = _TUPLE_KEYS
    for tok in toks[i:]:
        if tok[0] == "[":
            k, sep, v = tok[1:-1].partition("=")
            if sep:
                top[k] = v
            else:
                flags.append(k)
            continue
        k, sep, v = tok.partition("=")
        if not sep:
            top["_words"] = f"{top.get('_words', '')} {tok}".strip()
            continue
        if k == "src" and cur is not top and cur is not reply:
            cur = orig if cur is None else reply
        elif cur is not top and k not in tuple_keys:
            cur = top
        if cur is None:
            top[k] = v
        else:
            cur[k] = v
    if "src" not in orig or "src" not in reply:
        raise ValueError(f"conntrack line without both tuples: {line!r}")
    if not family:
        family = "ipv6" if ":" in orig["src"] else "ipv4"

    def num(d: dict[str, Any], k: str) -> int | None:
        v = d.pop(k, None)
        return None if v is None else int(v)

    entry = CtEntry(
        family,
        proto,
        protonum,
        timeout,
        state,
        orig.pop("src"),
        orig.pop("dst", ""),
        num(orig, "sport"),
        num(orig, "dport"),
        reply.pop("src"),
        reply.pop("dst", ""),
        num(reply, "sport"),
        num(reply, "dport"),
        num(orig, "packets"),
        num(orig, "bytes"),
        num(reply, "packets"),
        num(reply, "bytes"),
        frozenset(flags),
        num(top, "mark") or 0,
        num(top, "zone") or 0,
        num(top, "use"),
        num(top, "id"),
        num(top, "delta-time"),
        {k: int(v) if k in _TUPLE_INT_KEYS else v for k, v in orig.items()} if orig else {},
        {k: int(v) if k in _TUPLE_INT_KEYS else v for k, v in reply.items()} if reply else {},
        top,
        line,
    )
    return entry


def parse_conntrack_output(text: str) -> CtTable:
    """Parse all entry lines of ``conntrack -L`` stdout (the summary goes to stderr)."""
    out = CtTable()
    # Hundreds of thousands of small objects: cyclic GC passes would dominate the run time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for line in text.splitlines():
            if line and not line.startswith("conntrack v") and not line.isspace():
                out.append(parse_conntrack_line(line))
    finally:
        if was_enabled:
            gc.enable()
    return out


def _synthetic_lines(
    first: int, count: int, zone: int, proto: str, family: int, timeout: int
) -> Iterable[str]:
    """``conntrack -R`` lines with unique original tuples for sequence numbers first..first+count."""
    ports = (80, 443, 53, 5432, 6379, 8080, 9092)
    zone_arg = f" -w {zone}" if zone else ""
    base4 = int(ipaddress.IPv4Address("172.16.0.0"))
    base6 = int(ipaddress.IPv6Address("fd02::"))
    for seq in range(first, first + count):
        host, rnd = seq % (1 << 19), seq >> 19
        k = seq % 200
        if family == 6:
            src = str(ipaddress.IPv6Address(base6 + host + 1))
            dst = f"fd03::{k + 1:x}"
        else:
            src = str(ipaddress.IPv4Address(base4 + host + 1))
            dst = f"192.168.{k // 100}.{k % 100 + 1}"
        sport = 1024 + (rnd * 7919 + seq) % 60000 if proto != "icmp" else 0
        dport = ports[seq % len(ports)]
        if proto == "tcp":
            l4 = f"-p tcp --sport {sport} --dport {dport} --state ESTABLISHED -u SEEN_REPLY,ASSURED"
        elif proto == "udp":
            l4 = f"-p udp --sport {sport} --dport {dport} -u SEEN_REPLY"
        elif family == 6:
            l4 = f"-p icmpv6 --icmpv6-type 128 --icmpv6-code 0 --icmpv6-id {rnd & 0xFFFF} -u SEEN_REPLY"
        else:
            l4 = f"-p icmp --icmp-type 8 --icmp-code 0 --icmp-id {rnd & 0xFFFF} -u SEEN_REPLY"
        yield f"-I -s {src} -d {dst} {l4} --timeout {timeout}{zone_arg}\n"
