"""The metrics/health listener against idle, slow, oversized and vanishing clients (real sockets, loopback)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from flow_exporter.listener import Listener


def fetch(port: int, request: bytes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture
def listener() -> Iterator[Listener]:
    calls = {"n": 0}

    def metrics() -> tuple[int, bytes, str]:
        calls["n"] += 1
        return (200, b"up 1\n", "text/plain")

    lst = Listener(
        {"/metrics": metrics, "/readyz": lambda: (503, b"waiting for: kafka\n", "text/plain")},
        "127.0.0.1",
        0,
        max_clients=64,
        request_timeout=1.0,
    )
    lst.start()
    yield lst
    lst.stop()


def test_answers_get_and_head_and_refuses_the_rest(listener: Listener) -> None:
    ok = fetch(listener.port)
    assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and ok.endswith(b"\r\n\r\nup 1\n")
    assert b"Content-Length: 5\r\n" in ok and b"Connection: close\r\n" in ok
    head = fetch(listener.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")  # no body
    assert fetch(listener.port, b"GET /readyz?verbose HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503 ")
    assert fetch(listener.port, b"GET /nothing HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert fetch(listener.port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert fetch(listener.port, b"\x16\x03\x01garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")  # e.g. TLS to plain HTTP
    big = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n"
    assert fetch(listener.port, big).startswith(b"HTTP/1.1 400 ")
    assert (listener.stats.served, listener.stats.rejected) == (4, 3)


def test_500_idle_clients_neither_starve_metrics_nor_add_threads() -> None:
    # A long deadline, so no idle client times out during the flood however slow the machine is:
    # every one of them is pushed out by the cap or closed by us, and every scrape is answered.
    listener = Listener({"/metrics": lambda: (200, b"up 1\n", "text/plain")}, "127.0.0.1", 0, max_clients=64,
                        request_timeout=60.0)  # fmt: skip
    listener.start()
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(500):
            idle.append(socket.create_connection(("127.0.0.1", listener.port), timeout=5))
        for _ in range(20):  # a scrape at every moment of the flood
            assert fetch(listener.port).startswith(b"HTTP/1.1 200 OK")
        assert threading.active_count() == threads_before
        assert listener.open_clients() <= listener.max_clients
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while listener.open_clients() and time.monotonic() < deadline:
        time.sleep(0.05)
    st = listener.stats
    assert (st.served, st.timed_out, st.evicted + st.dropped) == (20, 0, 500)
    assert st.evicted >= 1  # the cap did its work: 500 clients never fit in 64
    listener.stop()


def test_a_slow_client_is_cut_off_at_the_request_deadline(listener: Listener) -> None:
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
        t0 = time.monotonic()
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\n":  # one byte every 0.2 s: never a whole request in 1 s
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
        assert closed and time.monotonic() - t0 < 3.0
    assert listener.stats.timed_out == 1
    assert fetch(listener.port).startswith(b"HTTP/1.1 200 OK")


def test_a_client_that_vanishes_mid_request_prints_nothing(
    listener: Listener, capfd: pytest.CaptureFixture[str]
) -> None:
    for _ in range(10):
        s = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        s.sendall(b"GET /metr")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.close()
    deadline = time.monotonic() + 5
    while listener.stats.dropped < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.stats.dropped == 10
    assert fetch(listener.port).startswith(b"HTTP/1.1 200 OK")
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_a_taken_port_raises_oserror_for_the_runner_to_name() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            Listener({}, "127.0.0.1", taken.getsockname()[1])
