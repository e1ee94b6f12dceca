"""Connections and a fake clock for driving a ConnectionStore by hand (store and checkpoint unit tests)."""

from __future__ import annotations

import socket
from dataclasses import replace

from flow_exporter.connection import PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.store import ConnectionStore

ESTABLISHED, FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT, CLOSE = 3, 4, 5, 6, 7, 8
NS = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def wall(self) -> int:
        return int(self.now * NS)

    def tick(self, seconds: float) -> None:
        self.now += seconds


def tcp(sport: int = 40000, *, packets: int = 1, state: int = ESTABLISHED, **kw: object) -> Connection:
    base = Connection(
        family=socket.AF_INET,
        proto=PROTO_TCP,
        orig_src=bytes([10, 0, 1, 2]),
        orig_dst=bytes([10, 96, 0, 10]),
        orig_sport=sport,
        orig_dport=80,
        reply_src=bytes([10, 0, 2, 2]),
        reply_dst=bytes([10, 0, 1, 2]),
        reply_sport=8080,
        reply_dport=sport,
        ct_id=7,
        tcp_state=state,
        orig_packets=packets,
        orig_bytes=packets * 100,
        reply_packets=packets,
        reply_bytes=packets * 200,
        start_ns=999 * NS,
    )
    return replace(base, **kw)


def udp(sport: int = 5353, *, packets: int = 1, status: int = 0, **kw: object) -> Connection:
    return replace(tcp(sport, packets=packets), proto=PROTO_UDP, tcp_state=None, status=status, **kw)


def poll(store: ConnectionStore, clock: Clock, *conns: Connection) -> None:
    store.update(list(conns), clock.now, clock.wall())
