"""Conntrack events: connections created and deleted between two polls still get final records."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.lab import Lab, run_in
from flow_exporter.conntrack.events import ConntrackEvents
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import by_connection, read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]


@pytest.mark.parametrize("events", [True, False])
def test_flows_deleted_between_polls(kafka_broker: Any, tmp_path: Path, events: bool) -> None:
    topic = f"events-{events}-{time.time_ns()}"
    kafka_broker.create_topic(topic)
    with Lab(pods=2) as lab:
        p1, p2 = lab.pods
        log = tmp_path / "exporter.log"
        proc = start_exporter(
            lab,
            kafka_broker.bootstrap,
            topic,
            log,
            "--set",
            "conntrack.pollInterval=60s",  # no poll between the traffic and its deletion
            "--set",
            "expiry.activeTimeout=60s",
            "--set",
            "expiry.idleTimeout=60s",
            "--set",
            f"conntrack.events={str(events).lower()}",
        )
        try:
            exchanges = [lab.udp_exchange(p1, p2, 5400, 50 + i, 300 + i, family=4 + 2 * (i % 2)) for i in range(20)]
            table = lab.conntrack_entries()
            expected = {(ex.client_ip, ex.client_port): table.for_exchange(ex) for ex in exchanges}
            run_in(lab.node_ns, "conntrack", "-D", "-p", "udp")  # as kube-proxy does with stale UDP entries
            time.sleep(1.5)
            text = stop_exporter(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "Traceback" not in text
    groups = by_connection(read_records(kafka_broker.bootstrap, topic, expect_at_least=20 if events else 0, timeout=15))
    seen = {(recs[0]["sourceAddress"], recs[0]["sourcePort"]): recs for recs in groups.values()}
    if not events:
        # The gap events close: polling alone never saw these flows.
        assert not any(k in seen for k in expected)
        return
    for k, ct in expected.items():
        assert ct is not None
        recs = seen[k]
        last = recs[-1]
        assert last["flowEndReason"] == 3
        assert (
            last["packetTotalCount"],
            last["octetTotalCount"],
            last["reversePacketTotalCount"],
            last["reverseOctetTotalCount"],
        ) == (ct.orig_packets, ct.orig_bytes, ct.reply_packets, ct.reply_bytes)
        assert sum(r["octetDeltaCount"] for r in recs) == ct.orig_bytes


def test_event_buffer_doubles_after_losses_up_to_its_ceiling() -> None:
    """Floods of NEW events overrun a small receive buffer; each loss doubles it until conntrack.eventBufferMax.

    The listener thread is not started: each flood is queued whole before ``drain`` reads it, so the
    overrun is certain, not a race with the reader. Ground truth for the losses is the socket's own
    drop counter; the sizes are what the kernel reports (twice the size asked, its bookkeeping share).
    """
    seen: list[int] = []
    overruns: list[int] = []
    with Lab(pods=1) as lab:
        ns = lab.table_ns()
        events = ConntrackEvents(
            lambda new, destroyed: seen.append(len(new) + len(destroyed)),
            lambda: overruns.append(1),
            netns=ns,
            rcvbuf=4096,
            rcvbuf_max=32768,
        )
        try:
            asked = [events.rcvbuf_requested]
            granted = [events.rcvbuf_granted]
            lost = [events.lost]
            for _ in range(4):
                lab.load_synthetic(2000, netns=ns, proto="udp")
                events.drain()
                asked.append(events.rcvbuf_requested)
                granted.append(events.rcvbuf_granted)
                lost.append(events.lost)
        finally:
            events.stop()
    assert asked == [4096, 8192, 16384, 32768, 32768]
    assert granted == [2 * a for a in asked]
    assert all(b > a for a, b in itertools.pairwise(lost)), lost  # every flood overran
    assert len(overruns) == 4  # one ENOBUFS per overrun socket, answered by one resync request
    assert sum(seen) + lost[-1] == 4 * 2000  # every inserted entry: received, or counted lost
