"""Loopback ports for the harness's servers (the broker, the API server and etcd)."""

from __future__ import annotations

import socket

__all__ = ["free_ports"]


def free_ports(count: int) -> list[int]:
    """Distinct ports the kernel hands out on 127.0.0.1 (held open together while picking, so they differ)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()
