"""Conntrack events: connections created and deleted between two polls still get final records."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from devtools.lab import Lab, run_in
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
