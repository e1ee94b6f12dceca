"""Repeated exchanges between a lab's pods, each with the last counters conntrack showed for it.

The ground truth of the three-broker tests (tests/integration/test_kafka_cluster.py) and of the
job-cluster tests (tests/integration/test_job_clusters.py): every exchange ends before
:meth:`Traffic.burst` returns, so the entry read right after it holds its final counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from devtools.lab import CtEntry, Exchange, Lab
from tests.support import contract


def ct_counts(e: CtEntry) -> contract.Counts:
    """An entry's four counters (forward packets, bytes, reverse packets, bytes); accounting must be on."""
    assert None not in (e.orig_packets, e.orig_bytes, e.reply_packets, e.reply_bytes), e.raw
    return (e.orig_packets, e.orig_bytes, e.reply_packets, e.reply_bytes)  # type: ignore[return-value]


@dataclass
class Traffic:
    """Exchanges between the lab's pods, each with the last counters conntrack showed for it."""

    lab: Lab
    exchanges: list[Exchange] = field(default_factory=list)
    truth: dict[tuple[str, int, int], CtEntry] = field(default_factory=dict)

    def burst(self) -> None:
        """Three TCP and two UDP exchanges (finished when this returns: their counters are final)."""
        p1, p2, p3 = self.lab.pods
        made = [
            self.lab.tcp_exchange(p1, p2, 8400, 700, 7000),
            self.lab.tcp_exchange(p2, p3, 8401, 300, 3000),
            self.lab.tcp_exchange(p3, p1, 8402, 100, 10000),
            self.lab.udp_exchange(p1, p3, 5400, 80, 800),
            self.lab.udp_exchange(p2, p1, 5401, 60, 600, count=3),
        ]
        self.exchanges += made
        table = self.lab.conntrack_entries()
        for ex in made:
            ct = table.for_exchange(ex)
            assert ct is not None, ex
            self.truth[(ex.client_ip, ex.client_port, ex.server_port)] = ct

    def during(self, seconds: float) -> None:
        """Bursts for ``seconds``, about one a second."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.burst()
            time.sleep(max(0.0, min(1.0, end - time.monotonic())))
