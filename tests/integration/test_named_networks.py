"""Named networks on real records (issue 42): ``flow-exporter run`` with ``networks.file``, its records read back from
Kafka with the reference decoder, the file changed and broken while it runs.

The node's table is Cilium's maps written by Cilium's own code (tests.support.cilium_entries): a table in a second,
without a lab; which end is named does not depend on the source (``name_ends`` runs on every new connection).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.cilium import Bpffs, ctwriter, run_ctwriter
from tests.support.cilium_entries import OUT, apply, counters, put
from tests.support.exporter_process import free_port, scrape
from tests.support.records import by_connection, read_records
from tests.support.waiting import until

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

LAYOUT = "v1.20"


def entry(src: str, sport: int, dst: str) -> dict[str, Any]:
    return put(src, sport, dst, 443, 6, OUT, {"Lifetime": 2**31, **counters(LAYOUT, (3, 300), (2, 200))})


def metric(port: int, name: str) -> float:
    for line in scrape(port, "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_ends_are_named_by_the_file_as_it_was_when_each_connection_was_new(
    kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    networks = tmp_path / "networks.yaml"
    networks.write_text("backends: [10.0.2.0/24]\nclients: [10.0.1.0/24, 10.0.0.0/8]\nv6-cloud: [fd00:10::/32]\n")
    log, port = tmp_path / "exporter.log", free_port()
    with Bpffs() as fs:
        run_ctwriter(ctwriter(LAYOUT), fs, "create")
        apply(LAYOUT, fs, [entry("10.0.1.5", 41001, "10.0.2.7"), entry("fd00::5", 41002, "fd00:10::1"),
                           entry("192.0.2.1", 41003, "198.51.100.1")])  # fmt: skip
        cmd = [
            sys.executable, "-m", "flow_exporter", "run", "--bootstrap-servers", kafka_broker.bootstrap,
            "--topic", kafka_topic, "--node-name", "n", "--set", "conntrack.source=cilium",
            "--set", f"cilium.bpffs={fs.path}", "--set", "conntrack.pollInterval=0.3s",
            "--set", "expiry.activeTimeout=1s", "--set", f"networks.file={networks}",
            "--set", "networks.reloadInterval=0.2s", "--set", f"metrics.port={port}",
            "--set", "metrics.address=127.0.0.1",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        try:
            until(lambda: "first poll" in log.read_text(), 30, log.read_text)
            networks.write_text("backends-new: [10.0.2.0/24]\n")  # renamed; clients and v6-cloud gone
            until(lambda: metric(port, "flow_exporter_networks_reloads_total") == 1, 10, log.read_text)
            apply(LAYOUT, fs, [entry("10.0.1.6", 41004, "10.0.2.8")])
            until(lambda: metric(port, "flow_exporter_connections_tracked") == 4, 10, log.read_text)
            networks.write_text("backends-new: [10.0.2.1/24]\n")  # a host bit set: refused, the table kept
            until(lambda: metric(port, "flow_exporter_networks_reload_errors_total") == 1, 10, log.read_text)
            apply(LAYOUT, fs, [entry("10.0.1.7", 41005, "10.0.2.9")])
            until(lambda: metric(port, "flow_exporter_connections_tracked") == 5, 10, log.read_text)
            named = metric(port, "flow_exporter_networks_named_total")
            time.sleep(1.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()
    assert "'10.0.2.1/24' is not a CIDR" in log.read_text() and "keeping the 1 prefixes" in log.read_text()
    got = {}
    for recs in by_connection(read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=5)).values():
        assert len({(r["sourceNetwork"], r["destinationNetwork"]) for r in recs}) == 1  # fixed for its life
        got[recs[0]["sourcePort"]] = (recs[0]["sourceNetwork"], recs[0]["destinationNetwork"])
    assert got == {
        41001: ("clients", "backends"),  # the longest prefix: 10.0.1.0/24 over 10.0.0.0/8
        41002: (None, "v6-cloud"),
        41003: (None, None),
        41004: (None, "backends-new"),  # new after the reload
        41005: (None, "backends-new"),  # new after the bad file: the table before it
    }
    assert named == 4
