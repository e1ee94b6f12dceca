"""A conntrack table for model-based tests: incarnations with counters, and the events it emits.

Its clock moves forward as a real one does: every incarnation starts at the wall time it
is created, later than everything before it, so start stamps order incarnations the way
the kernel's do.
"""

from __future__ import annotations

from dataclasses import replace

from flow_exporter.connection import Connection
from tests.support.store_builders import Clock, udp


class Kernel:
    """A conntrack table: incarnations with counters, and the event stream it emits."""

    def __init__(self, clock: Clock) -> None:
        self.wall = clock.wall  # the kernel's CLOCK_REALTIME is the exporter's clock
        self.live: dict[int, Connection] = {}
        self.events: list[tuple[str, Connection]] = []
        self.zeroed: dict[int, int] = {}  # packets counted before a reset, per incarnation
        self.clock = 0

    def create(self, port: int, ct_id: int) -> None:
        if port in self.live:
            return
        self.clock += 1  # also the incarnation's serial, kept in the mark (the store ignores it)
        c = udp(port, packets=0, ct_id=ct_id, start_ns=self.wall(), mark=self.clock)
        self.live[port] = c
        self.events.append(("new", replace(c, start_ns=0)))  # NEW events carry no start time

    def traffic(self, port: int, n: int) -> None:
        c = self.live.get(port)
        if c is not None:
            self.live[port] = replace(c, orig_packets=c.orig_packets + n, orig_bytes=c.orig_bytes + 100 * n)

    def destroy(self, port: int) -> None:
        c = self.live.pop(port, None)
        if c is not None:
            self.events.append(("destroy", replace(c, stop_ns=self.wall())))

    def zero(self, port: int) -> None:
        """conntrack -Z: the counters restart from zero (the lifetime count is kept for the truth)."""
        c = self.live.get(port)
        if c is not None:
            self.zeroed[c.mark] = self.zeroed.get(c.mark, 0) + c.orig_packets
            self.live[port] = replace(c, orig_packets=0, orig_bytes=0)
