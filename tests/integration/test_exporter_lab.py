"""The exporter end to end on real parts: lab traffic -> kernel conntrack -> exporter -> real broker.

Records are decoded with the reference Apache ``avro`` package (not fastavro, which
the exporter writes with), and checked against what ``conntrack -L`` reported.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.lab import CtEntry, Lab
from tests.support.exporter_process import free_port, scrape, start_exporter, stop_exporter
from tests.support.records import by_connection, read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

ACTIVE, IDLE, END, FORCED = 2, 1, 3, 4


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def records_of(groups: dict[int, list[dict]], src: str, sport: int, proto: int) -> list[dict]:
    hits = [
        recs
        for recs in groups.values()
        if recs[0]["sourceAddress"] == src and recs[0]["sourcePort"] == sport and recs[0]["protocol"] == proto
    ]
    assert len(hits) == 1, f"{len(hits)} connections from {src}:{sport}/{proto}"
    return hits[0]


def assert_consistent(recs: list[dict], ct: CtEntry) -> None:
    """Totals equal conntrack -L, deltas sum to the totals, sequence numbers have no gaps."""
    assert [r["sequence"] for r in recs] == list(range(len(recs)))
    last = recs[-1]
    assert (
        last["packetTotalCount"],
        last["octetTotalCount"],
        last["reversePacketTotalCount"],
        last["reverseOctetTotalCount"],
    ) == (ct.orig_packets, ct.orig_bytes, ct.reply_packets, ct.reply_bytes), json.dumps(last, default=str)
    for total, delta in (
        ("packetTotalCount", "packetDeltaCount"),
        ("octetTotalCount", "octetDeltaCount"),
        ("reversePacketTotalCount", "reversePacketDeltaCount"),
        ("reverseOctetTotalCount", "reverseOctetDeltaCount"),
    ):
        assert sum(r[delta] for r in recs) == last[total], delta
        assert all(r[delta] >= 0 for r in recs)
    assert last["flowEndReason"] in (END, FORCED)


def test_lab_traffic_reaches_kafka_with_exact_counters(
    lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    p1, p2, p3 = lab.pods
    svc = lab.add_service(lab.vip4(), 80, p3, 8080, vip6=lab.vip6())
    log = tmp_path / "exporter.log"
    port = free_port()
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log, metrics_port=port)
    try:
        long_conn = lab.open_tcp(p1, p3, 7000)
        tcp4 = lab.tcp_exchange(p1, p2, 9000, 1000, 5000, family=4)
        tcp6 = lab.tcp_exchange(p2, p1, 9001, 3000, 700, family=6)
        udp4 = lab.udp_exchange(p2, p3, 5300, 100, 400, family=4, count=3)
        udp6 = lab.udp_exchange(p3, p1, 5301, 60, 1200, family=6)
        via_svc = lab.tcp_exchange(p2, svc, 80, 200, 20_000, family=4)
        for _ in range(8):  # ~8 s of activity: several active-timeout records
            long_conn.send(1500)
            time.sleep(1)
        time.sleep(6)  # > idle timeout for the UDP flows, and end-of-flow for the closed ones
        assert scrape(port, "/healthz") == (200, "ok\n")
        assert scrape(port, "/readyz") == (200, "ok\n")
        code, text = scrape(port, "/metrics")
        assert code == 200
        assert metric(text, "flow_exporter_connections_tracked") >= 6
        assert metric(text, "flow_exporter_conntrack_entries") >= 6
        assert metric(text, "flow_exporter_conntrack_max") > 0
        assert metric(text, "flow_exporter_records_acknowledged") >= 6
        assert metric(text, "flow_exporter_records_failed") == 0
        assert metric(text, "flow_exporter_produced_bytes") > 0
        assert metric(text, "flow_exporter_poll_duration_seconds_count") >= 5
        table = lab.conntrack_entries()
        cts = {
            name: table.for_exchange(ex)
            for name, ex in [("tcp4", tcp4), ("tcp6", tcp6), ("udp4", udp4), ("udp6", udp6), ("svc", via_svc)]
        }
        ct_long = table.for_exchange(long_conn)
        text = stop_exporter(proc, log)  # long_conn still open: it gets a forced final record
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in text
    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=6)
    groups = by_connection(records)

    for name, ex in [("tcp4", tcp4), ("tcp6", tcp6), ("udp4", udp4), ("udp6", udp6), ("svc", via_svc)]:
        ct = cts[name]
        assert ct is not None, name
        recs = records_of(groups, ex.client_ip, ex.client_port, 6 if ex.proto == "tcp" else 17)
        assert_consistent(recs, ct)
        assert recs[0]["exporterNode"] == "lab-node"
        assert recs[0]["ipVersion"] == ex.family
        reasons = [r["flowEndReason"] for r in recs]
        if ex.proto == "tcp":
            assert reasons[-1] == END, (name, reasons)
            assert recs[-1]["tcpState"] in ("TIME_WAIT", "CLOSE")
        else:
            assert IDLE in reasons, (name, reasons)
            assert recs[-1]["tcpState"] is None

    svc_last = records_of(groups, via_svc.client_ip, via_svc.client_port, 6)[-1]
    assert svc_last["originalDestinationAddress"] == svc.vip4 and svc_last["originalDestinationPort"] == 80
    assert svc_last["destinationAddress"] == p3.ipv4 and svc_last["destinationPort"] == 8080
    plain = records_of(groups, tcp4.client_ip, tcp4.client_port, 6)[-1]
    assert plain["originalDestinationAddress"] == plain["destinationAddress"] == p2.ipv4

    long_recs = records_of(groups, long_conn.client_ip, long_conn.client_port, 6)
    reasons = [r["flowEndReason"] for r in long_recs]
    assert reasons.count(ACTIVE) >= 2 and reasons[-1] == FORCED, reasons
    assert ct_long is not None
    assert [r["sequence"] for r in long_recs] == list(range(len(long_recs)))
    for f in ("packetTotalCount", "octetTotalCount"):
        assert sum(r[f.replace("Total", "Delta")] for r in long_recs) == long_recs[-1][f]
        assert long_recs[-1][f] >= getattr(ct_long, "orig_packets" if "packet" in f else "orig_bytes")
    long_conn.close()

    # Every connection the exporter tracked got a final record before it exited.
    for recs in groups.values():
        assert recs[-1]["flowEndReason"] in (END, FORCED), recs[-1]


def test_source_nat_comes_from_the_reply_tuple(lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path) -> None:
    """Masquerade and an SNAT rule on the node: the records carry conntrack's translated source.

    p0 -> p2 is masqueraded and p1 -> p2 SNATed, both to the node's address on p2's link (the port
    is kept while free: the lab's server pairs exchanges by client port, so a rule that forces new
    ports would break the exchange itself; the encoder's property test covers a translated port).
    p2 -> p0 is left alone. The truth is the reply tuple ``conntrack -L`` prints: its destination is
    the translated source.
    """
    p0, p1, p2 = lab.pods
    lab.run_in(
        lab.node_ns,
        "nft", "-f", "-",
        input=f"""table ip fe_snat {{
            chain post {{
                type nat hook postrouting priority srcnat; policy accept;
                ip saddr {p0.ipv4} ip daddr {p2.ipv4} masquerade
                ip saddr {p1.ipv4} ip daddr {p2.ipv4} snat to {p2.node_ip4}
            }}
        }}""",
    )  # fmt: skip
    log = tmp_path / "exporter.log"
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log)
    try:
        exchanges = {
            "masquerade tcp": lab.tcp_exchange(p0, p2, 9100, 300, 2000),
            "masquerade udp": lab.udp_exchange(p0, p2, 9101, 200, 800),
            "snat tcp": lab.tcp_exchange(p1, p2, 9102, 300, 2000),
            "none tcp": lab.tcp_exchange(p2, p0, 9103, 300, 2000),
        }
        time.sleep(1.5)  # polled
        table = lab.conntrack_entries()
        cts = {name: table.for_exchange(ex) for name, ex in exchanges.items()}
        stop_exporter(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text()
    groups = by_connection(read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=len(exchanges)))
    for name, ex in exchanges.items():
        ct = cts[name]
        assert ct is not None, name
        recs = records_of(groups, ex.client_ip, ex.client_port, 6 if ex.proto == "tcp" else 17)
        translated = {(r["translatedSourceAddress"], r["translatedSourcePort"]) for r in recs}
        if name == "none tcp":
            assert (ct.reply_dst, ct.reply_dport) == (ct.orig_src, ct.orig_sport), ct.raw
            assert translated == {(None, None)}, name
        else:
            assert ct.reply_dst == p2.node_ip4 != ct.orig_src, ct.raw
            assert translated == {(ct.reply_dst, ct.reply_dport)}, (name, translated, ct.raw)
            assert recs[0]["sourceAddress"] == ex.client_ip and recs[0]["destinationAddress"] == p2.ipv4
