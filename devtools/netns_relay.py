"""Reach a loopback service of this namespace from inside another network namespace, and back (the pod tests
and ``make try-pod``).

A pod on the host network of a lab's node namespace sees that namespace's loopback, not the test
process's: the session's Kafka broker (127.0.0.1 here) is out of its reach, and its own metrics
listener is out of ours. ``LoopbackRelay`` listens on 127.0.0.1:PORT *inside* the namespace and
forwards every connection to 127.0.0.1:PORT here, so a broker that advertises 127.0.0.1:PORT is
reached at that same address from both sides. ``http_get_in`` is one HTTP GET over a socket made
inside the namespace. A socket keeps the namespace it was created in, so only the creation runs
there (``run_in_netns``, a short-lived thread); the relaying threads stay here.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading

from flow_exporter.conntrack.netns import run_in_netns

__all__ = ["LoopbackRelay", "http_get_in"]


class LoopbackRelay:
    """127.0.0.1:``port`` inside ``netns`` forwarded to 127.0.0.1:``port`` in this namespace."""

    def __init__(self, netns: str, port: int) -> None:
        self.port = port
        self._listener = run_in_netns(netns, lambda: socket.create_server(("127.0.0.1", port)))
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"relay-{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                inside, _ = self._listener.accept()
            except OSError:
                continue  # closed (the loop ends) or a connection reset before it was accepted
            try:
                outside = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError:
                inside.close()  # as a refused connection looks from inside
                continue
            outside.settimeout(None)
            with self._lock:
                self._sockets += [inside, outside]
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()

    def __enter__(self) -> LoopbackRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def http_get_in(netns: str, address: str, port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET http://address:port/path from inside ``netns``: (status, body); (0, reason) when nothing answers."""
    try:
        sock = run_in_netns(netns, lambda: socket.create_connection((address, port), timeout=timeout))
    except OSError as e:
        return 0, str(e)
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    except OSError as e:
        return 0, str(e)
    finally:
        conn.close()
