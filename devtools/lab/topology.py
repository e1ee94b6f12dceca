"""The lab itself: namespaces, veths, routes, nft rules, Services and the traffic that crosses them.

``Lab`` builds and tears down one isolated lab, drives exchanges through the pod agents (the
client side of the agent protocol is ``_Agent`` here; the agent is ``devtools.lab.agent``) and
reads the node's conntrack table back.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from devtools.lab.conntrack_text import CtEntry, CtTable, _synthetic_lines, parse_conntrack_output
from devtools.lab.model import Exchange, LabError, Pod, Service, _norm
from devtools.lab.shell import _sysctl_w, run, run_in

# Client source ports the lab hands out; below the kernel's default ephemeral range start
# (32768) so they rarely collide with anything the kernel picks on its own.
CLIENT_PORT_MIN = 20000
CLIENT_PORT_MAX = 60999
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_MAX_UDP_PAYLOAD = 65507
# The agent runs as a plain script (stdlib only), started by path inside each pod namespace.
_AGENT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")


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
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-I", "-S", _AGENT_FILE]
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
        self._peers: list[Lab] = []  # labs whose node this lab's node is linked to (link())
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

    def link(self, other: Lab) -> None:
        """Cable this lab's node to ``other``'s node, like two Kubernetes nodes of one cluster network.

        A veth pair joins the two node namespaces; each node routes the other's pod ranges over it.
        Traffic between their pods then crosses both nodes' forward hooks, so each node's own
        conntrack table holds the connection (with counts of the same packets). Exchanges can
        name the other lab's pods as servers. The cable goes with the namespaces.
        """
        a, b = self, other
        if a.x == b.x:
            raise LabError(f"labs {a.name} and {b.name} share the address range 10.{a.x}: pick other names")
        here, there = f"to-{b.name}", f"to-{a.name}"
        link4, link6 = f"10.{a.x}.250", _norm(f"fd00:{a.x}:250::")
        run("ip", "-n", a.node_ns, "link", "add", here, "type", "veth", "peer", "name", there, "netns", b.node_ns)
        self._ip_batch(
            a.node_ns,
            [
                f"addr add {link4}.1/24 dev {here}",
                f"addr add {link6}1/64 dev {here} nodad",
                f"link set {here} up",
                f"route add 10.{b.x}.0.0/16 via {link4}.2",
                f"route add fd00:{b.x}::/32 via {link6}2",
            ],
        )
        self._ip_batch(
            b.node_ns,
            [
                f"addr add {link4}.2/24 dev {there}",
                f"addr add {link6}2/64 dev {there} nodad",
                f"link set {there} up",
                f"route add 10.{a.x}.0.0/16 via {link4}.1",
                f"route add fd00:{a.x}::/32 via {link6}1",
            ],
        )
        a._peers.append(b)
        b._peers.append(a)

    def _agent(self, pod: Pod) -> _Agent:
        for lab in (self, *self._peers):
            agent = lab._agents.get(pod.name)
            if agent is not None and agent.netns == pod.netns:
                return agent
        raise LabError(f"no agent for pod {pod.name} (lab not started or closed)")

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
        key = (pod.netns, proto, port)
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
