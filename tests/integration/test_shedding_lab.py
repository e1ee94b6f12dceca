"""Adaptive shedding under real churn: the probability falls over the budget, rises back after, kept connections
keep theirs, and the health stream counts every change.

One lab node, its UDP conntrack timeouts at 1 s (as bench_events sets them) so the table follows the rate; the
churn generator makes 600 short UDP flows a second for 10 s, then nothing. The exporter has
``sampling.budget.connections`` 400 (the churn holds well over a thousand), ``sampling.adjustInterval`` 2 s and
``sampling.probability`` 1. The schedule is read from the exporter's log (each change logs its time in ns); the
rule is checked against it with the ``siphash24`` package (test_sampling's ``reference_hash``), not the exporter's
code: every record's samplingProbability is the level of its connection's first-seen time, its hash is below that
probability times 2**64, a connectionId's records all say the same, and the health stream's last record counts the
changes the log shows and every flow the generator made.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from bisect import bisect_right
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from devtools.churn import build_churn
from devtools.kafka import KafkaBroker
from devtools.lab import Lab, run_in
from tests.integration.test_sampling_lab import read_health
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records
from tests.unit.test_sampling import reference_hash

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

SEED = "shedding-lab"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RATE, SECONDS, BUDGET = 600, 10, 400
CHANGE = re.compile(r"sampling: new connections now kept with probability (\S+) \(was (\S+)\).* change at (\d+) ns")


def test_shedding_follows_the_load_and_never_changes_a_kept_connection(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    topic, health = f"shed-{uuid.uuid4().hex[:8]}", f"shed-health-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    kafka_broker.create_topic(health, partitions=1)
    tool = build_churn()
    log = tmp_path / "exporter.log"
    with Lab("shedlab", pods=2) as lab:
        p1, p2 = lab.pods
        for key in ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
            run_in(lab.node_ns, "sysctl", "-q", "-w", f"net.netfilter.{key}=1")
        proc = start_exporter(
            lab, kafka_broker.bootstrap, topic, log,
            "--set", f"sampling.budget.connections={BUDGET}", "--set", "sampling.adjustInterval=2s",
            "--set", f"sampling.seed={SEED}", "--set", f"health.topic={health}", "--set", "health.interval=60s",
        )  # fmt: skip
        server = subprocess.Popen(["ip", "netns", "exec", p2.netns, str(tool), "server", p2.ipv4, "6000", "1"])
        try:
            time.sleep(0.5)
            out = subprocess.run(
                ["ip", "netns", "exec", p1.netns, str(tool), "client", p1.ipv4, p2.ipv4, "6000", "1", str(RATE),
                 str(SECONDS), "20000", "59999", str(tmp_path / "status")],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            sent = int(out.stdout.split()[0])
            deadline = time.monotonic() + 40  # quiet: the table empties and the probability comes back to 1
            while "now kept with probability 1 " not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            server.terminate()
            server.wait(10)
            if proc.poll() is None:
                stop_exporter(proc, log)
    text = log.read_text()
    assert "Traceback" not in text
    changes = [(int(t), float(p), float(was)) for p, was, t in CHANGE.findall(text)]
    assert changes, text[-3000:]
    probabilities = [1.0] + [p for _, p, _ in changes]
    assert min(probabilities) < 1 and probabilities[-1] == 1.0, probabilities  # fell, and came back
    for (_, p, was), before in zip(changes, probabilities, strict=False):
        assert was == before and p in (was / 2, was * 2)  # one halving or doubling a step
    times = [t for t, _, _ in changes]

    def p_at(t_ns: int) -> float:
        i = bisect_right(times, t_ns)
        return probabilities[i]

    records = read_records(kafka_broker.bootstrap, topic, expect_at_least=50)
    by_id: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_id[r["connectionId"]].append(r)
    checked = 0
    for rs in by_id.values():
        ps = {r["samplingProbability"] for r in rs}
        assert len(ps) == 1, rs  # a kept connection's records never change probability
        (p,) = ps
        r = rs[0]
        h = reference_hash(SEED, 4, r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"],
                           r["destinationPort"])  # fmt: skip
        assert h < Fraction(p) * 2**64, r  # kept by the rule at its probability
        start_ns = (r["flowStart"] - EPOCH) // timedelta(milliseconds=1) * 1_000_000
        if all(abs(start_ns - t) > 1_000_000 for t in times):  # not within the millisecond of a change
            assert p == p_at(start_ns), (r, changes)
            checked += 1
    assert checked > 100
    (last,) = [h for h in read_health(kafka_broker.bootstrap, health) if h["samplingProbability"] == 1.0][-1:]
    assert last["samplingChanges"] == len(changes)
    assert last["connectionsSelected"] == len(by_id)
    assert last["eventLosses"] == 0  # the premise of the next: every flow met, in a dump or an event
    assert last["connectionsObserved"] == sent
    timeline = ", ".join(f"{p:g} at +{(t - times[0]) / 1e9:.1f} s" for t, p, _ in changes)
    print(f"{sent} flows at {RATE}/s; kept {len(by_id)}; budget {BUDGET} connections; probability {timeline}")
