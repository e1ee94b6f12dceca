"""The traffic agent: runs INSIDE a pod namespace and serves and opens TCP/UDP connections on request.

The lab starts one per pod as ``python -I -S <this file>`` under ``ip netns exec`` and talks
to it over JSON lines on stdin/stdout (see ``devtools.lab.topology._Agent``), so an exchange
costs a couple of pipe round trips instead of process spawns. Because it runs as a plain,
isolated script, this module must import only the standard library and nothing relative.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# How long a server agent waits for the lab to announce an incoming connection.
_SPEC_WAIT = 10.0

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


def main() -> int:
    """Serve requests from stdin until it closes (then the process exits)."""
    _AgentMain().main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
