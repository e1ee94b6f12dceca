"""Connection-tracking entries as Cilium's datapath writes them, and Cilium's own listing of them, parsed.

The tests of the Cilium source (issue 41) write entries with Cilium's code (``ctwriter``, devtools.cilium)
and hold the source's connections against what Cilium's own lister prints for the same maps
(``ctwriter dump``'s ``cilium`` field: ``cilium-dbg bpf ct list global``'s line). Nothing here reads
the maps or uses the source's decode.

How the datapath fills a key (Cilium's ``bpf/lib/conntrack.h``, ``bpf/lib/lb.h``), in the Go field names
``ctwriter`` takes (``DestAddr`` is the C ``daddr``, ``SourcePort`` the C ``sport``, ...):

* ``OUT`` and ``IN`` entries of a connection from A:a to B:b: DestAddr A, SourceAddr B, SourcePort a,
  DestPort b (addresses named for the reply direction, ports for the original one);
* a ``SERVICE`` entry of a client C:c reaching a service V:v: SourceAddr C, DestPort c, DestAddr V,
  SourcePort v (the packet's own fields before the load balancer);
* an ICMP echo from A with identifier i to B: DestAddr A, SourceAddr B, SourcePort i, DestPort 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from devtools.cilium import Bpffs, ctwriter, run_ctwriter

OUT, IN, RELATED, SERVICE = 0, 1, 2, 4
PROTO = {"TCP": 6, "UDP": 17, "ICMP": 1, "ICMPv6": 58, "SCTP": 132}


def tcp_map(addr: str) -> str:
    return "cilium_ct6_global" if ":" in addr else "cilium_ct4_global"


def any_map(addr: str) -> str:
    return "cilium_ct_any6_global" if ":" in addr else "cilium_ct_any4_global"


def put(
    src: str, sport: int, dst: str, dport: int, proto: int, flags: int, entry: dict[str, Any], op: str = "put"
) -> dict[str, Any]:
    """A connection's entry from ``src:sport`` to ``dst:dport`` (or a service entry, with ``flags`` SERVICE: the
    client, then the service), placed in the key's fields as the datapath places them."""
    name = tcp_map(src) if proto == 6 else any_map(src)
    if flags & SERVICE:
        key = {"saddr": src, "dport": sport, "daddr": dst, "sport": dport}
    else:
        key = {"daddr": src, "sport": sport, "saddr": dst, "dport": dport}
    return {"op": op, "map": name, "nexthdr": proto, "flags": flags, **key, "entry": entry}


def counters(layout: str, forward: tuple[int, int], reverse: tuple[int, int], flags: int = OUT) -> dict[str, int]:
    """The counter fields of an entry whose originator sent ``forward`` (packets, bytes) and got ``reverse``.

    v1.15: the endpoint's own view, rx and tx: an OUT entry's endpoint sent the forward packets (tx), an IN
    entry's received them (rx). v1.20: one pair for both.
    """
    if layout == "v1.20":
        return {"Packets": forward[0] + reverse[0], "Bytes": forward[1] + reverse[1]}
    sent, got = (forward, reverse) if not flags & IN else (reverse, forward)
    return {"TxPackets": sent[0], "TxBytes": sent[1], "RxPackets": got[0], "RxBytes": got[1]}


def apply(layout: str, fs: Bpffs, ops: list[dict[str, Any]]) -> None:
    out = run_ctwriter(ctwriter(layout), fs, "apply", stdin="".join(json.dumps(o) + "\n" for o in ops))
    assert out.strip() == str(len(ops)), out


@dataclass(frozen=True)
class Listed:
    """One line of Cilium's listing, parsed (the key as ``cilium-dbg bpf ct list global`` prints it)."""

    proto: int
    kind: str  # OUT, IN or SVC
    related: bool
    left: tuple[str, int]  # OUT/IN: the originator; SVC: the client
    right: tuple[str, int]  # OUT/IN: the responder; SVC: the service
    expires: int
    values: dict[str, int]  # Packets, Bytes (v1.20) or RxPackets, RxBytes, TxPackets, TxBytes (v1.15); RevNAT
    closing: bool


_LINE = re.compile(r"^(\S+) (OUT|IN|SVC) (\S+) -> (\S+) (related )?expires=(\d+) (.*)$", re.S)


def _end(s: str) -> tuple[str, int]:
    addr, port = s.rsplit(":", 1)
    return addr, int(port)


def listing(layout: str, fs: Bpffs) -> list[Listed]:
    """Every entry of the four maps as Cilium's lister prints it."""
    out = []
    for line in run_ctwriter(ctwriter(layout), fs, "dump").splitlines():
        shown = json.loads(line)["cilium"].strip()
        m = _LINE.match(shown)
        assert m, shown
        proto, kind, left, right, related, expires, rest = m.groups()
        values = {k: int(v) for k, v in re.findall(r"\b(\w+)=(\d+)\b", rest)}
        flags = re.search(r"Flags=\S+ \[ ([^\]]*)\]", rest)
        assert flags, shown
        closing = "RxClosing" in flags.group(1) or "TxClosing" in flags.group(1)
        out.append(Listed(PROTO[proto], kind, bool(related), _end(left), _end(right), int(expires), values, closing))
    return out
