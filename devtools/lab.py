"""Network-namespace lab: a routed "node" namespace with pods, Services and conntrack.

Tests and the demo need real kernel conntrack entries with known tuples and byte counts,
without touching the host's own network. The lab builds, per instance:

* ``<prefix>-node``: routes between pods (IPv4 and IPv6 forwarding), runs an nft table whose
  rules use conntrack (so the netns registers conntrack hooks), with accounting and timestamps
  switched on *in that namespace* (those sysctls are per netns);
* ``<prefix>-p<i>``: pods, each joined to the node by a veth pair and routed via the node,
  like a routed CNI;
* ``<prefix>-tbl`` (on demand): an empty namespace that only holds synthetic conntrack entries.

Traffic is driven by one persistent agent per pod (this file run with ``agent``), spoken to
over a JSON-lines pipe, so an exchange costs a couple of pipe round trips instead of process
spawns. Only the standard library is used; ``ip``, ``nft`` and ``conntrack`` are shelled out to.

Command line: ``python -m devtools.lab up`` (keep a lab until Ctrl-C) and
``python -m devtools.lab cleanup PREFIX`` (remove a leftover lab's namespaces).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import errno
import functools
import gc
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CtEntry",
    "CtTable",
    "Exchange",
    "Lab",
    "LabError",
    "LongConnection",
    "Pod",
    "Service",
    "parse_conntrack_line",
    "parse_conntrack_output",
    "run",
    "run_in",
]

# Client source ports the lab hands out; below the kernel's default ephemeral range start
# (32768) so they rarely collide with anything the kernel picks on its own.
CLIENT_PORT_MIN = 20000
CLIENT_PORT_MAX = 60999
# How long a server agent waits for the lab to announce an incoming connection.
_SPEC_WAIT = 10.0
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_MAX_UDP_PAYLOAD = 65507
_AGENT_FILE = os.path.abspath(__file__)


class LabError(RuntimeError):
    """A lab command or traffic operation failed; the message carries the tool's stderr.

    ``code`` is the agent's error class (``addrinuse``, ``timeout``, ...) when one applies.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- commands


def run(
    *cmd: str, input: str | None = None, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run a command, raising LabError with its stderr so failures are readable in tests."""
    try:
        proc = subprocess.run(
            list(cmd), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(cmd)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def run_in(
    netns: str | Pod, *cmd: str, input: str | None = None, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run a command inside a network namespace (``ip netns exec``)."""
    ns = netns.netns if isinstance(netns, Pod) else netns
    return run("ip", "netns", "exec", ns, *cmd, input=input, check=check, timeout=timeout)


def _sysctl_w(netns: str, settings: dict[str, str | int]) -> None:
    """Set sysctls inside a namespace and read them back, because many are per netns."""
    args = [f"{k}={v}" for k, v in settings.items()]
    run_in(netns, "sysctl", "-q", "-w", *args)
    got = run_in(netns, "sysctl", "-n", *settings).stdout.split()
    want = [str(v) for v in settings.values()]
    if got != want:
        raise LabError(f"sysctls in {netns} did not stick: wanted {want}, read {got}")


@functools.lru_cache(maxsize=8192)
def _norm(addr: str) -> str:
    """Canonical text of an address, so lookups don't depend on how IPv6 was spelled."""
    return str(ipaddress.ip_address(addr.split("%", 1)[0]))


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Pod:
    """One pod namespace; ``node_ip4``/``node_ip6`` are its gateway on the node side."""

    name: str
    netns: str
    index: int
    ipv4: str
    ipv6: str
    node_ip4: str
    node_ip6: str
    ifname: str = "eth0"
    node_ifname: str = ""

    def ip(self, family: int = 4) -> str:
        """The pod address for family 4 or 6."""
        return self.ipv4 if family == 4 else self.ipv6


@dataclass(frozen=True)
class Service:
    """A kube-proxy style virtual IP:port DNAT'ed in the node namespace to one backend pod."""

    vip4: str
    port: int
    backend: Pod
    target_port: int
    proto: str = "tcp"
    vip6: str | None = None

    def ip(self, family: int = 4) -> str:
        """The VIP for family 4 or 6."""
        if family == 6:
            if self.vip6 is None:
                raise LabError(f"service {self.vip4}:{self.port} has no IPv6 VIP")
            return self.vip6
        return self.vip4


@dataclass(frozen=True)
class Exchange:
    """What one finished exchange did, enough to find and check its conntrack entry.

    ``server_ip``/``server_port`` are what the client dialled (a VIP for a Service);
    ``backend_ip``/``backend_port`` are where it really landed. Sizes are payload bytes per
    message; UDP sends ``count`` datagrams each way.
    """

    proto: str
    family: int
    client: str
    client_ip: str
    client_port: int
    server_ip: str
    server_port: int
    backend: str
    backend_ip: str
    backend_port: int
    request_bytes: int
    response_bytes: int
    count: int = 1
    hold: float = 0.0
    started: float = 0.0
    finished: float = 0.0

    @property
    def duration(self) -> float:
        """Wall time of the exchange as the lab saw it."""
        return self.finished - self.started

    @property
    def total_request_bytes(self) -> int:
        """Payload bytes client -> server over the whole exchange."""
        return self.request_bytes * self.count

    @property
    def total_response_bytes(self) -> int:
        """Payload bytes server -> client over the whole exchange."""
        return self.response_bytes * self.count


# --------------------------------------------------------------------------- conntrack parsing

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


# --------------------------------------------------------------------------- agent client side


class _Agent:
    """The lab's handle on one pod agent: JSON requests out, futures resolved by a reader thread."""

    def __init__(self, netns: str, log_path: str) -> None:
        self.netns = netns
        self.log_path = log_path
        self._lock = threading.Lock()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._next = 1
        self._dead: str | None = None
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-I", "-S", _AGENT_FILE, "agent"]
        # Own session: a terminal Ctrl-C goes to the lab process, which then stops agents in
        # order; an agent whose lab died anyway exits on stdin EOF.
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"lab-agent-{netns}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                fut = self._pending.pop(msg.get("id", -1), None)
            if fut is not None:
                fut.set_result(msg)
        with self._lock:
            self._dead = f"agent in {self.netns} exited; log: {self._tail()}"
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(LabError(self._dead))

    def _tail(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read()[-2000:].decode(errors="replace").strip() or "(empty)"
        except OSError:
            return "(unreadable)"

    def request(self, op: str, **args: Any) -> Future[dict[str, Any]]:
        """Send one request; the future resolves to the agent's reply dict."""
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._dead:
                raise LabError(self._dead)
            rid = self._next
            self._next += 1
            self._pending[rid] = fut
            data = json.dumps({"id": rid, "op": op, **args}).encode() + b"\n"
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
            except OSError as exc:
                self._pending.pop(rid, None)
                raise LabError(f"agent in {self.netns} is gone: {exc}") from exc
        return fut

    @staticmethod
    def wait(fut: Future[dict[str, Any]], timeout: float, what: str) -> dict[str, Any]:
        """Wait for a reply and turn an agent-side error into LabError."""
        try:
            msg = fut.result(timeout)
        except TimeoutError as exc:
            raise LabError(f"{what}: no reply from agent within {timeout:.1f}s") from exc
        if not msg.get("ok"):
            raise LabError(f"{what}: {msg.get('error')}", code=msg.get("code"))
        return msg

    def call(self, op: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        """Request and wait."""
        return self.wait(self.request(op, **args), timeout, f"{op} in {self.netns}")

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the agent to quit (stdin EOF), then kill it if it lingers."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class LongConnection:
    """A TCP connection held open by the client pod; ``send(n)`` pushes n payload bytes.

    In ``echo`` mode the server returns every byte and ``send`` waits for the echo, so both
    directions' payload totals are known after each call; in ``sink`` mode nothing comes back.
    """

    proto = "tcp"

    def __init__(
        self,
        lab: Lab,
        client: Pod,
        backend: Pod,
        family: int,
        server_ip: str,
        server_port: int,
        backend_port: int,
        mode: str,
        info: dict[str, Any],
        server_fut: Future[dict[str, Any]],
    ) -> None:
        self._lab = lab
        self.client = client.name
        self.backend = backend.name
        self.family = family
        self.client_ip = _norm(info["src"])
        self.client_port = int(info["sport"])
        self.server_ip = server_ip
        self.server_port = server_port
        self.backend_ip = backend.ip(family)
        self.backend_port = backend_port
        self.mode = mode
        self.handle = int(info["handle"])
        self.sent = 0
        self.received = 0
        self.closed = False
        self._agent = lab._agent(client)
        self._server_fut = server_fut
        self._lock = threading.Lock()

    def send(self, n: int, timeout: float = 30.0) -> None:
        """Send n payload bytes (and read the n-byte echo in echo mode)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        with self._lock:
            if self.closed:
                raise LabError("connection is closed")
            echo = n if self.mode == "echo" else 0
            self._agent.call("send", timeout=timeout, handle=self.handle, n=n, expect=echo)
            self.sent += n
            self.received += echo

    def close(self, timeout: float = 30.0) -> None:
        """Close from the client side and wait until the server side has closed too."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._agent.call("close", timeout=timeout, handle=self.handle)
            self._lab._release_port(self.client_port)
            res = _Agent.wait(self._server_fut, timeout, f"server side of {self.client_port}")
            if int(res.get("received", -1)) != self.sent:
                raise LabError(f"server received {res.get('received')} bytes, client sent {self.sent}")

    def __enter__(self) -> LongConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- the lab


def _exchange_result(
    proto: str,
    client: Pod,
    cres: dict[str, Any],
    sport: int,
    dst: str,
    dport: int,
    backend: Pod,
    bport: int,
    request_bytes: int,
    response_bytes: int,
    started: float,
    **extra: Any,
) -> Exchange:
    """The Exchange record of a finished TCP or UDP exchange (``extra``: hold or count)."""
    fam = 6 if ":" in dst else 4
    return Exchange(
        proto=proto,
        family=fam,
        client=client.name,
        client_ip=_norm(cres["src"]),
        client_port=sport,
        server_ip=dst,
        server_port=dport,
        backend=backend.name,
        backend_ip=backend.ip(fam),
        backend_port=bport,
        request_bytes=request_bytes,
        response_bytes=response_bytes,
        started=started,
        finished=time.time(),
        **extra,
    )


class Lab:
    """Namespaces, routes, nft rules and traffic agents for one isolated lab.

    Use as a context manager: ``__exit__`` (and an atexit hook, as a safety net) tears down
    everything the lab created, also when the body or the setup itself failed.
    """

    def __init__(self, name: str | None = None, pods: int = 3) -> None:
        if name is None:
            name = "fe" + secrets.token_hex(2)
        if not _NAME_RE.match(name):
            raise ValueError(f"lab name {name!r}: 1-8 chars, [a-z][a-z0-9]*, so netns names stay short")
        if not 1 <= pods <= 200:
            raise ValueError("pods must be 1..200")
        self.name = name
        self.pod_count = pods
        # An even second octet per lab (16..214); VIPs use the odd one above it. Addresses only
        # exist inside this lab's namespaces, so the hash is for readability, not isolation.
        self.x = 16 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 * 2
        self.node_ns = f"{name}-node"
        self.tbl_ns: str | None = None
        self.pods: list[Pod] = []
        self.services: list[Service] = []
        self.setup_seconds = 0.0
        self._namespaces: list[str] = []
        self._agents: dict[str, _Agent] = {}
        self._listening: set[tuple[str, str, int]] = set()
        self._lock = threading.RLock()
        self._port_lock = threading.Lock()
        self._next_port = CLIENT_PORT_MIN
        self._ports_in_use: set[int] = set()
        self._synthetic_seq = 0
        self._saved_ct_max: int | None = None
        self._raised_ct_max: int | None = None
        self._tmpdir: str | None = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Lab:
        """Build the namespaces and start the agents; on any failure, undo what was done."""
        if self._started:
            return self
        self._started = True
        atexit.register(self.close)
        t0 = time.monotonic()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def _build(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix=f"lab-{self.name}-")
        x = self.x
        for i in range(self.pod_count):
            self.pods.append(
                Pod(
                    name=f"p{i}",
                    netns=f"{self.name}-p{i}",
                    index=i,
                    ipv4=f"10.{x}.{i}.2",
                    ipv6=_norm(f"fd00:{x}:{i}::2"),
                    node_ip4=f"10.{x}.{i}.1",
                    node_ip6=_norm(f"fd00:{x}:{i}::1"),
                    node_ifname=f"veth-p{i}",
                )
            )
        for ns in [self.node_ns, *(p.netns for p in self.pods)]:
            self._add_netns(ns)

        no_dad = {
            "net.ipv6.conf.all.accept_dad": 0,
            "net.ipv6.conf.default.accept_dad": 0,
        }
        _sysctl_w(
            self.node_ns,
            {
                "net.ipv4.ip_forward": 1,
                "net.ipv6.conf.all.forwarding": 1,
                "net.netfilter.nf_conntrack_acct": 1,
                "net.netfilter.nf_conntrack_timestamp": 1,
                **no_dad,
            },
        )
        for p in self.pods:
            # tw_reuse: the lab binds explicit client ports, which cycle; let connect() reuse
            # a port whose old connection is still in TIME_WAIT.
            _sysctl_w(p.netns, {**no_dad, "net.ipv4.tcp_tw_reuse": 1})

        node_cmds = ["link set lo up"]
        for p in self.pods:
            node_cmds += [
                f"link add {p.node_ifname} type veth peer name {p.ifname} netns {p.netns}",
                f"addr add {p.node_ip4}/24 dev {p.node_ifname}",
                f"addr add {p.node_ip6}/64 dev {p.node_ifname} nodad",
                f"link set {p.node_ifname} up",
            ]
        self._ip_batch(self.node_ns, node_cmds)
        for p in self.pods:
            self._ip_batch(
                p.netns,
                [
                    "link set lo up",
                    f"addr add {p.ipv4}/24 dev {p.ifname}",
                    f"addr add {p.ipv6}/64 dev {p.ifname} nodad",
                    f"link set {p.ifname} up",
                    f"route add default via {p.node_ip4} dev {p.ifname}",
                    f"route add default via {p.node_ip6} dev {p.ifname}",
                ],
            )
        run_in(self.node_ns, "nft", "-f", "-", input=self._ruleset())

        assert self._tmpdir is not None
        for p in self.pods:
            self._agents[p.name] = _Agent(p.netns, os.path.join(self._tmpdir, f"agent-{p.name}.log"))
        futs = [(a, a.request("ping")) for a in self._agents.values()]
        for agent, fut in futs:
            _Agent.wait(fut, 15.0, f"agent start in {agent.netns}")

    def _ruleset(self) -> str:
        """nft table for the node: a forward chain whose ct rule registers conntrack hooks,
        DNAT for Services, and hairpin masquerade for a pod reaching itself via a VIP."""
        hairpin = []
        for p in self.pods:
            hairpin.append(f"ct status dnat ip saddr {p.ipv4} ip daddr {p.ipv4} masquerade")
            hairpin.append(f"ct status dnat ip6 saddr {p.ipv6} ip6 daddr {p.ipv6} masquerade")
        body = "\n        ".join(hairpin)
        return f"""
table inet lab {{
    chain flows {{
        type filter hook forward priority filter; policy accept;
        ct state new counter accept
        ct state established,related counter accept
    }}
    chain svc_dnat {{
        type nat hook prerouting priority dstnat; policy accept;
    }}
    chain svc_snat {{
        type nat hook postrouting priority srcnat; policy accept;
        {body}
    }}
}}
"""

    def _add_netns(self, ns: str) -> None:
        proc = run("ip", "netns", "add", ns, check=False)
        if proc.returncode != 0:
            hint = ""
            if "exists" in proc.stderr:
                hint = f" (leftover lab? python -m devtools.lab cleanup {self.name})"
            raise LabError(f"ip netns add {ns}: {proc.stderr.strip()}{hint}")
        self._namespaces.append(ns)

    @staticmethod
    def _ip_batch(netns: str, cmds: list[str]) -> None:
        run("ip", "-n", netns, "-b", "-", input="\n".join(cmds) + "\n")

    def close(self) -> None:
        """Tear everything down; safe to call repeatedly and after a failed start.

        Each step is idempotent and retried if a Ctrl-C lands in the middle of it, so an
        impatient second interrupt cannot leak namespaces; the interrupt is re-raised after.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        interrupted: BaseException | None = None
        for step in (self._stop_agents, self._delete_namespaces, self._restore_ct_max, self._remove_tmpdir):
            for _ in range(5):
                try:
                    step()
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
                except Exception:
                    break
        if interrupted is not None:
            raise interrupted

    def _stop_agents(self) -> None:
        for key, agent in list(self._agents.items()):
            with contextlib.suppress(Exception):
                agent.stop()
            self._agents.pop(key, None)

    def _delete_namespaces(self) -> None:
        if not self._namespaces:
            return
        batch = "".join(f"netns del {ns}\n" for ns in reversed(self._namespaces))
        run("ip", "-force", "-b", "-", input=batch, check=False)
        for ns in list(self._namespaces):
            if os.path.exists(f"/run/netns/{ns}"):
                run("ip", "netns", "del", ns, check=False)
            if not os.path.exists(f"/run/netns/{ns}"):
                self._namespaces.remove(ns)
        if self._namespaces:
            raise LabError(f"could not delete namespaces {self._namespaces}")

    def _remove_tmpdir(self) -> None:
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def agent_pids(self) -> list[int]:
        """Process ids of the running pod agents (for leak checks)."""
        return [a.proc.pid for a in self._agents.values()]

    @property
    def namespaces(self) -> list[str]:
        """Names of the namespaces this lab created and still owns."""
        return list(self._namespaces)

    def run_in(self, netns: str | Pod, *cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        """``run_in`` for a namespace name or a Pod."""
        return run_in(netns, *cmd, **kw)

    def pod(self, name: str | int) -> Pod:
        """A pod by index or name (``p0``)."""
        if isinstance(name, int):
            return self.pods[name]
        for p in self.pods:
            if name in (p.name, p.netns):
                return p
        raise KeyError(name)

    # ------------------------------------------------------------------ services

    def vip4(self, k: int = 0) -> str:
        """The k-th Service IPv4 VIP in this lab's VIP range."""
        return f"10.{self.x + 1}.0.{10 + k}"

    def vip6(self, k: int = 0) -> str:
        """The k-th Service IPv6 VIP in this lab's VIP range."""
        return _norm(f"fd01:{self.x}::{10 + k}")

    def add_service(
        self,
        vip4: str,
        port: int,
        backend: Pod,
        target_port: int,
        proto: str = "tcp",
        vip6: str | None = None,
    ) -> Service:
        """DNAT vip:port to backend:target_port in the node's prerouting, as kube-proxy does."""
        if proto not in ("tcp", "udp"):
            raise ValueError("proto must be tcp or udp")
        vip4 = _norm(vip4)
        vip6 = _norm(vip6) if vip6 else None
        rules = [f"ip daddr {vip4} {proto} dport {port} dnat ip to {backend.ipv4}:{target_port}"]
        if vip6:
            rules.append(f"ip6 daddr {vip6} {proto} dport {port} dnat ip6 to [{backend.ipv6}]:{target_port}")
        script = "".join(f"add rule inet lab svc_dnat {r}\n" for r in rules)
        run_in(self.node_ns, "nft", "-f", "-", input=script)
        svc = Service(vip4=vip4, port=port, backend=backend, target_port=target_port, proto=proto, vip6=vip6)
        with self._lock:
            self.services.append(svc)
        return svc

    # ------------------------------------------------------------------ traffic

    def _agent(self, pod: Pod) -> _Agent:
        try:
            return self._agents[pod.name]
        except KeyError:
            raise LabError(f"no agent for pod {pod.name} (lab not started or closed)") from None

    def _resolve(
        self, server: Pod | Service | str, port: int | None, family: int, proto: str
    ) -> tuple[str, int, Pod, int]:
        """(dialled ip, dialled port, backend pod, backend port) for a server target."""
        if family not in (4, 6):
            raise ValueError("family must be 4 or 6")
        if isinstance(server, str):
            addr = _norm(server)
            for p in self.pods:
                if addr in (p.ipv4, p.ipv6):
                    server = p
                    break
            else:
                for s in self.services:
                    if addr in (s.vip4, s.vip6) and s.proto == proto and port in (None, s.port):
                        server = s
                        break
                else:
                    raise LabError(f"{server} is neither a pod nor a {proto} service of this lab")
            family = 6 if ":" in addr else 4
        if isinstance(server, Service):
            if server.proto != proto:
                raise LabError(f"service {server.vip4}:{server.port} is {server.proto}, not {proto}")
            if port not in (None, server.port):
                raise LabError(f"service {server.vip4} listens on {server.port}, not {port}")
            return server.ip(family), server.port, server.backend, server.target_port
        if port is None:
            raise ValueError("port is required for a pod server")
        return server.ip(family), port, server, port

    def _ensure_listener(self, pod: Pod, proto: str, port: int) -> None:
        key = (pod.name, proto, port)
        with self._lock:
            if key in self._listening:
                return
            self._agent(pod).call("listen", proto=proto, port=port)
            self._listening.add(key)

    def _take_port(self) -> int:
        """A client source port unique across the lab's in-flight exchanges."""
        with self._lock:
            listen_ports = {k[2] for k in self._listening}
        with self._port_lock:
            span = CLIENT_PORT_MAX - CLIENT_PORT_MIN + 1
            for _ in range(span):
                port = self._next_port
                self._next_port = CLIENT_PORT_MIN + (port + 1 - CLIENT_PORT_MIN) % span
                if port not in self._ports_in_use and port not in listen_ports:
                    self._ports_in_use.add(port)
                    return port
        raise LabError("no free client ports")

    def _release_port(self, port: int) -> None:
        with self._port_lock:
            self._ports_in_use.discard(port)

    def _exchange(
        self,
        proto: str,
        client: Pod,
        server: Pod | Service | str,
        port: int | None,
        family: int,
        client_op: str,
        client_args: dict[str, Any],
        server_args: dict[str, Any],
        timeout: float,
        keep: bool = False,
        sport: int | None = None,
    ) -> tuple[dict[str, Any], Future[dict[str, Any]], str, int, Pod, int, int]:
        """Announce the connection to the server agent, run the client op, retry on port clash.

        ``sport``: use this client port (no retry with another one on a clash).
        """
        if isinstance(server, str):
            family = 6 if ":" in server else 4
        dst, dport, backend, bport = self._resolve(server, port, family, proto)
        self._ensure_listener(backend, proto, bport)
        cagent, sagent = self._agent(client), self._agent(backend)
        last: LabError | None = None
        fixed = sport
        for _ in range(1 if fixed else 8):
            sport = fixed or self._take_port()
            sfut = sagent.request(
                "expect", proto=proto, port=bport, sport=sport, timeout=timeout, **server_args
            )
            try:
                cres = _Agent.wait(
                    cagent.request(
                        client_op,
                        family=family,
                        dst=dst,
                        dport=dport,
                        sport=sport,
                        timeout=timeout,
                        **client_args,
                    ),
                    timeout + float(client_args.get("hold", 0.0)) + 5.0,
                    f"{proto} {client.name} -> {dst}:{dport}",
                )
            except LabError as exc:
                with contextlib.suppress(LabError):
                    sagent.request("unexpect", proto=proto, port=bport, sport=sport)
                if not fixed:
                    self._release_port(sport)
                if exc.code == "addrinuse":
                    last = exc
                    continue
                raise
            if not keep and not fixed:
                self._release_port(sport)
            return cres, sfut, dst, dport, backend, bport, sport
        raise LabError(f"could not bind a client port: {last}")

    def tcp_exchange(
        self,
        client: Pod,
        server: Pod | Service | str,
        port: int | None,
        request_bytes: int,
        response_bytes: int,
        family: int = 4,
        hold: float = 0.0,
        timeout: float = 30.0,
    ) -> Exchange:
        """One TCP connection: client sends request_bytes, server answers response_bytes.

        The client then holds the connection ``hold`` seconds and closes first; the call
        returns after both sides closed, so the conntrack entry is in TIME_WAIT by then.
        """
        if request_bytes < 0 or response_bytes < 0:
            raise ValueError("sizes must be >= 0")
        started = time.time()
        cres, sfut, dst, dport, backend, bport, sport = self._exchange(
            "tcp",
            client,
            server,
            port,
            family,
            "tcp",
            {"request": request_bytes, "response": response_bytes, "hold": hold},
            {"mode": "exchange", "request": request_bytes, "response": response_bytes},
            timeout,
        )
        sres = _Agent.wait(sfut, timeout, f"tcp server side in {backend.name}")
        if sres["received"] != request_bytes:
            raise LabError(f"server got {sres['received']} bytes, expected {request_bytes}")
        return _exchange_result(
            "tcp", client, cres, sport, dst, dport, backend, bport, request_bytes, response_bytes, started, hold=hold
        )

    def udp_exchange(
        self,
        client: Pod,
        server: Pod | Service | str,
        port: int | None,
        request_bytes: int,
        response_bytes: int,
        family: int = 4,
        count: int = 1,
        timeout: float = 10.0,
        sport: int | None = None,
    ) -> Exchange:
        """``count`` request/response datagram pairs from one client port (one conntrack entry).

        ``sport`` fixes the client port (a re-created tuple, like DNS or VXLAN traffic).
        """
        for n in (request_bytes, response_bytes):
            if not 0 <= n <= _MAX_UDP_PAYLOAD:
                raise ValueError(f"UDP payload must be 0..{_MAX_UDP_PAYLOAD}")
        if count < 1:
            raise ValueError("count must be >= 1")
        started = time.time()
        cres, sfut, dst, dport, backend, bport, sport = self._exchange(
            "udp",
            client,
            server,
            port,
            family,
            "udp",
            {"request": request_bytes, "response": response_bytes, "count": count},
            {"mode": "exchange", "request": request_bytes, "response": response_bytes, "count": count},
            timeout,
            sport=sport,
        )
        _Agent.wait(sfut, timeout, f"udp server side in {backend.name}")
        return _exchange_result(
            "udp", client, cres, sport, dst, dport, backend, bport, request_bytes, response_bytes, started, count=count
        )

    def open_tcp(
        self,
        client: Pod,
        server: Pod | Service | str,
        port: int | None,
        family: int = 4,
        mode: str = "echo",
        timeout: float = 30.0,
    ) -> LongConnection:
        """A long-lived TCP connection; see LongConnection for ``echo``/``sink`` modes."""
        if mode not in ("echo", "sink"):
            raise ValueError("mode must be echo or sink")
        cres, sfut, dst, dport, backend, bport, _ = self._exchange(
            "tcp", client, server, port, family, "open", {}, {"mode": mode}, timeout, keep=True
        )
        fam = 6 if ":" in dst else 4
        return LongConnection(self, client, backend, fam, dst, dport, bport, mode, cres, sfut)

    # ------------------------------------------------------------------ conntrack

    def conntrack_entries(self, netns: str | None = None, output: str = "extended") -> CtTable:
        """``conntrack -L -o <output>`` in the node (or given) namespace, parsed."""
        ns = netns or self.node_ns
        args = ["conntrack", "-L", *(["-o", output] if output else [])]
        return parse_conntrack_output(run_in(ns, *args).stdout)

    def wait_entry(
        self,
        ex: Exchange | LongConnection,
        predicate: Callable[[CtEntry], bool] | None = None,
        timeout: float = 3.0,
        netns: str | None = None,
    ) -> CtEntry:
        """Poll until the exchange's entry exists (and satisfies predicate); LabError if not."""
        deadline = time.monotonic() + timeout
        last: CtEntry | None = None
        while True:
            last = self.conntrack_entries(netns).for_exchange(ex)
            if last is not None and (predicate is None or predicate(last)):
                return last
            if time.monotonic() >= deadline:
                raise LabError(f"no matching conntrack entry for {ex}; last seen: {last}")
            time.sleep(0.02)

    def conntrack_count(self, netns: str | None = None) -> int:
        """``conntrack -C`` in the node (or given) namespace."""
        return int(run_in(netns or self.node_ns, "conntrack", "-C").stdout.strip())

    def flush_conntrack(self, netns: str | None = None) -> None:
        """Drop all entries in the node (or given) namespace."""
        run_in(netns or self.node_ns, "conntrack", "-F", check=False)

    def table_ns(self) -> str:
        """The synthetic-entry namespace, created on first use."""
        with self._lock:
            if self.tbl_ns is None:
                ns = f"{self.name}-tbl"
                self._add_netns(ns)
                _sysctl_w(
                    ns, {"net.netfilter.nf_conntrack_acct": 1, "net.netfilter.nf_conntrack_timestamp": 1}
                )
                self.tbl_ns = ns
            return self.tbl_ns

    def load_synthetic(
        self,
        count: int,
        netns: str | None = None,
        zone: int = 0,
        proto: str = "tcp",
        family: int = 4,
        timeout: int = 600,
    ) -> None:
        """Insert ``count`` unique synthetic entries with ``conntrack -R`` and verify ``-C``.

        Sources walk 172.16.0.0/13 (fd02::/64 for IPv6) and sports, destinations cycle over
        200 addresses in 192.168.0.0/16 (fd03::/64) and a few service ports, so tuples never
        repeat, also across calls.
        """
        if count < 0:
            raise ValueError("count must be >= 0")
        if proto not in ("tcp", "udp", "icmp"):
            raise ValueError("proto must be tcp, udp or icmp")
        ns = netns or self.table_ns()
        if count == 0:
            return
        before = self.conntrack_count(ns)
        self._ensure_ct_max(before + count)
        with self._lock:
            first = self._synthetic_seq
            self._synthetic_seq += count
        assert self._tmpdir is not None
        path = os.path.join(self._tmpdir, f"synthetic-{first}.ct")
        with open(path, "w") as fh:
            fh.writelines(_synthetic_lines(first, count, zone, proto, family, timeout))
        try:
            run_in(ns, "conntrack", "-R", path, timeout=600)
        finally:
            os.unlink(path)
        after = self.conntrack_count(ns)
        if after != before + count:
            raise LabError(f"conntrack -C in {ns} is {after}, expected {before} + {count}")

    def _ensure_ct_max(self, needed: int) -> None:
        """nf_conntrack_max is global (read-only in child netns); raise it, restored at close."""
        path = "/proc/sys/net/netfilter/nf_conntrack_max"
        with open(path) as fh:
            cur = int(fh.read())
        want = needed + 1024
        if cur >= want:
            return
        want = (want + 65535) // 65536 * 65536
        with open(path, "w") as fh:
            fh.write(str(want))
        if self._saved_ct_max is None:
            self._saved_ct_max = cur
        self._raised_ct_max = want

    def _restore_ct_max(self) -> None:
        if self._saved_ct_max is None:
            return
        path = "/proc/sys/net/netfilter/nf_conntrack_max"
        with contextlib.suppress(OSError, ValueError), open(path, "r+") as fh:
            # Only undo our own change; someone else may have moved it since.
            if int(fh.read()) == self._raised_ct_max:
                fh.seek(0)
                fh.write(str(self._saved_ct_max))
        self._saved_ct_max = None


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


# --------------------------------------------------------------------------- agent side


_BUF = memoryview(b"\xa5" * 65536)


def _send_n(sock: socket.socket, n: int) -> None:
    while n > 0:
        k = min(n, len(_BUF))
        sock.sendall(_BUF[:k])
        n -= k


def _recv_exact(sock: socket.socket, n: int) -> None:
    buf = bytearray(min(max(n, 1), 65536))
    got = 0
    while got < n:
        k = sock.recv_into(buf, min(len(buf), n - got))
        if k == 0:
            raise EOFError(f"peer closed after {got} of {n} bytes")
        got += k


def _drain(sock: socket.socket) -> int:
    """Read until EOF; returns how many (unexpected) bytes came."""
    buf = bytearray(65536)
    extra = 0
    while True:
        k = sock.recv_into(buf)
        if k == 0:
            return extra
        extra += k


class _AgentMain:
    """Runs inside a pod namespace: servers on request, client exchanges on request.

    The lab announces each incoming connection (``expect``, keyed by the client source port,
    which the lab allocates) so servers know the sizes without any framing in the payload.
    """

    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.out_lock = threading.Lock()
        self.cond = threading.Condition()
        self.specs: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.udp_pending: dict[tuple[str, int, int], list[tuple[float, int, Any]]] = {}
        self.listeners: dict[tuple[str, int], socket.socket] = {}
        self.handles: dict[int, socket.socket] = {}
        self.next_handle = 1

    def reply(self, rid: int, ok: bool = True, **kw: Any) -> None:
        data = json.dumps({"id": rid, "ok": ok, **kw}).encode() + b"\n"
        with self.out_lock:
            self.out.write(data)
            self.out.flush()

    def fail(self, rid: int, exc: BaseException) -> None:
        code = "error"
        if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            code = "addrinuse"
        elif isinstance(exc, TimeoutError):
            code = "timeout"
        self.reply(rid, False, code=code, error=f"{type(exc).__name__}: {exc}")

    def main(self) -> None:
        threading.Thread(target=self.reaper, daemon=True).start()
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            msg = json.loads(line)
            op = msg.pop("op")
            rid = msg.pop("id")
            handler = getattr(self, f"op_{op}", None)
            if handler is None:
                self.reply(rid, False, code="error", error=f"unknown op {op}")
            elif op in ("ping", "listen", "expect", "unexpect"):
                self.guarded(handler, rid, msg)
            else:
                threading.Thread(target=self.guarded, args=(handler, rid, msg), daemon=True).start()
        os._exit(0)

    def guarded(self, handler: Callable[..., None], rid: int, msg: dict[str, Any]) -> None:
        try:
            handler(rid, **msg)
        except BaseException as exc:
            self.fail(rid, exc)

    def reaper(self) -> None:
        """Fail announced connections that never arrived, drop stray datagrams."""
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            expired = []
            with self.cond:
                for key, spec in list(self.specs.items()):
                    if spec["deadline"] < now:
                        expired.append(self.specs.pop(key))
                for key, items in list(self.udp_pending.items()):
                    if items[0][0] < now - _SPEC_WAIT:
                        del self.udp_pending[key]
            for spec in expired:
                self.reply(spec["rid"], False, code="timeout", error="client never connected")

    # -- control

    def op_ping(self, rid: int) -> None:
        self.reply(rid, pid=os.getpid())

    def op_listen(self, rid: int, proto: str, port: int) -> None:
        if (proto, port) not in self.listeners:
            kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
            sock = socket.socket(socket.AF_INET6, kind)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", port))
            if proto == "tcp":
                sock.listen(1024)
                target: Callable[..., None] = self.tcp_accept_loop
            else:
                target = self.udp_loop
            self.listeners[(proto, port)] = sock
            threading.Thread(target=target, args=(sock, port), daemon=True).start()
        self.reply(rid)

    def op_expect(
        self,
        rid: int,
        proto: str,
        port: int,
        sport: int,
        mode: str,
        timeout: float,
        request: int = 0,
        response: int = 0,
        count: int = 1,
    ) -> None:
        key = (proto, port, sport)
        spec = {
            "rid": rid,
            "mode": mode,
            "timeout": timeout,
            "request": request,
            "response": response,
            "count": count,
            "done": 0,
            "received": 0,
            "deadline": time.monotonic() + timeout,
        }
        with self.cond:
            self.specs[key] = spec
            self.cond.notify_all()
            pending = self.udp_pending.pop(key, [])
            for _, n, peer in pending:
                self.udp_datagram(self.listeners[("udp", port)], key, n, peer)

    def op_unexpect(self, rid: int, proto: str, port: int, sport: int) -> None:
        with self.cond:
            spec = self.specs.pop((proto, port, sport), None)
        if spec is not None:
            self.reply(spec["rid"], False, code="cancelled", error="cancelled")
        self.reply(rid)

    # -- servers

    def take_spec(self, key: tuple[str, int, int]) -> dict[str, Any] | None:
        deadline = time.monotonic() + _SPEC_WAIT
        with self.cond:
            while key not in self.specs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.specs.pop(key)

    def tcp_accept_loop(self, sock: socket.socket, port: int) -> None:
        while True:
            conn, peer = sock.accept()
            threading.Thread(target=self.tcp_conn, args=(conn, peer, port), daemon=True).start()

    def tcp_conn(self, conn: socket.socket, peer: Any, port: int) -> None:
        with conn:
            spec = self.take_spec(("tcp", port, peer[1]))
            if spec is None:
                print(f"unannounced connection from {peer}", file=sys.stderr, flush=True)
                return
            rid = spec["rid"]
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if spec["mode"] == "exchange":
                    conn.settimeout(spec["timeout"])
                    _recv_exact(conn, spec["request"])
                    _send_n(conn, spec["response"])
                    extra = _drain(conn)
                    self.reply(rid, received=spec["request"] + extra, sent=spec["response"])
                    return
                received = 0
                buf = bytearray(65536)
                while True:
                    k = conn.recv_into(buf)
                    if k == 0:
                        break
                    received += k
                    if spec["mode"] == "echo":
                        conn.sendall(memoryview(buf)[:k])
                self.reply(rid, received=received)
            except BaseException as exc:
                self.fail(rid, exc)

    def udp_loop(self, sock: socket.socket, port: int) -> None:
        while True:
            data, peer = sock.recvfrom(65536)
            key = ("udp", port, peer[1])
            with self.cond:
                if key in self.specs:
                    self.udp_datagram(sock, key, len(data), peer)
                else:
                    self.udp_pending.setdefault(key, []).append((time.monotonic(), len(data), peer))

    def udp_datagram(self, sock: socket.socket, key: tuple[str, int, int], n: int, peer: Any) -> None:
        """Answer one datagram; caller holds self.cond."""
        spec = self.specs[key]
        sock.sendto(_BUF[: spec["response"]], peer)
        spec["received"] += n
        spec["done"] += 1
        if spec["done"] >= spec["count"]:
            del self.specs[key]
            self.reply(spec["rid"], received=spec["received"])

    # -- clients

    @staticmethod
    def client_socket(family: int, kind: int, sport: int) -> socket.socket:
        fam = socket.AF_INET6 if family == 6 else socket.AF_INET
        sock = socket.socket(fam, kind)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if family == 6 else "0.0.0.0", sport))
        except BaseException:
            sock.close()
            raise
        return sock

    def op_tcp(
        self,
        rid: int,
        family: int,
        dst: str,
        dport: int,
        sport: int,
        request: int,
        response: int,
        hold: float,
        timeout: float,
    ) -> None:
        with self.client_socket(family, socket.SOCK_STREAM, sport) as sock:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect((dst, dport))
            src = sock.getsockname()[0]
            _send_n(sock, request)
            _recv_exact(sock, response)
            if hold > 0:
                time.sleep(hold)
            sock.shutdown(socket.SHUT_WR)
            extra = _drain(sock)
        self.reply(rid, src=src, sport=sport, extra=extra)

    def op_udp(
        self,
        rid: int,
        family: int,
        dst: str,
        dport: int,
        sport: int,
        request: int,
        response: int,
        count: int,
        timeout: float,
    ) -> None:
        with self.client_socket(family, socket.SOCK_DGRAM, sport) as sock:
            sock.settimeout(timeout)
            sock.connect((dst, dport))
            src = sock.getsockname()[0]
            for i in range(count):
                sock.send(_BUF[:request])
                data = sock.recv(65536)
                if len(data) != response:
                    raise OSError(f"datagram {i}: got {len(data)} bytes, expected {response}")
        self.reply(rid, src=src, sport=sport)

    def op_open(self, rid: int, family: int, dst: str, dport: int, sport: int, timeout: float) -> None:
        sock = self.client_socket(family, socket.SOCK_STREAM, sport)
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect((dst, dport))
        except BaseException:
            sock.close()
            raise
        with self.cond:
            handle = self.next_handle
            self.next_handle += 1
            self.handles[handle] = sock
        self.reply(rid, handle=handle, src=sock.getsockname()[0], sport=sport)

    def op_send(self, rid: int, handle: int, n: int, expect: int) -> None:
        sock = self.handles[handle]
        _send_n(sock, n)
        _recv_exact(sock, expect)
        self.reply(rid)

    def op_close(self, rid: int, handle: int) -> None:
        with self.cond:
            sock = self.handles.pop(handle)
        with sock:
            sock.shutdown(socket.SHUT_WR)
            extra = _drain(sock)
        self.reply(rid, extra=extra)


# --------------------------------------------------------------------------- command line


def _cleanup(prefix: str) -> list[str]:
    """Delete namespaces that look like they belong to lab ``prefix``."""
    pat = re.compile(rf"^{re.escape(prefix)}-(node|tbl|p\d+)$")
    names = [ln.split()[0] for ln in run("ip", "netns", "list").stdout.splitlines() if ln.strip()]
    gone = [n for n in names if pat.match(n)]
    for n in gone:
        run("ip", "netns", "del", n, check=False)
    return gone


def main(argv: list[str] | None = None) -> int:
    """``agent`` (internal), ``up`` (hold a lab until Ctrl-C), ``cleanup PREFIX``."""
    ap = argparse.ArgumentParser(prog="python -m devtools.lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("agent", help="internal: run the traffic agent in the current netns")
    up = sub.add_parser("up", help="create a lab and keep it until interrupted")
    up.add_argument("--name")
    up.add_argument("--pods", type=int, default=3)
    cl = sub.add_parser("cleanup", help="delete a leftover lab's namespaces")
    cl.add_argument("prefix")
    args = ap.parse_args(argv)
    if args.cmd == "agent":
        _AgentMain().main()
        return 0
    if args.cmd == "cleanup":
        print("\n".join(_cleanup(args.prefix)) or "nothing to delete")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Lab(args.name, args.pods) as lab:
        info = {
            "name": lab.name,
            "node": lab.node_ns,
            "pods": [dataclasses.asdict(p) for p in lab.pods],
            "setup_seconds": round(lab.setup_seconds, 3),
        }
        print(json.dumps(info, indent=2), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
