"""Faults of a three-broker Kafka cluster under real traffic through real conntrack (issue 40).

One cluster (devtools.kafka_cluster: three KRaft voters, each a broker in its own network namespace) serves
the module; every test makes its own topic (3 partitions, replication 3, ``min.insync.replicas`` 2, every
partition led by one broker, the fault's target), runs the exporter against it while the lab's pods talk,
injects one fault, and leaves the cluster healthy again.

What every scenario asserts, read back with the reference Avro decoder and held against the kernel:

* no (connectionId, sequence) pair with two contents: a duplicate is the same bytes;
* every record Kafka acknowledged is on the topic (distinct pairs = the exporter's own account at exit);
* per connectionId, sequences from 0 without a gap, deltas that add up to the totals;
* per exchange, the consumer rule's sums equal what ``conntrack -L`` showed for it, exactly.

Each scenario prints its row of the issue's table (records, duplicates, gaps, lost, time to recover).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devtools.kafka_cluster import SASL_USER, KafkaCluster
from devtools.lab import Lab
from tests.support import contract
from tests.support.exporter_process import free_port, scrape, start_exporter, stop_exporter
from tests.support.records import decode, read_raw_records
from tests.support.traffic import Traffic, ct_counts

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

LEADER = 1  # the broker every test topic's partitions prefer: the fault's target
# Delivery timeouts a fault of ~10 s outlasts, so records in flight fail and are resent
SHORT_TIMEOUTS = ("--set", "kafka.producer={request.timeout.ms: 2000, message.timeout.ms: 5000}")
ACCOUNT = re.compile(r"shutdown: (\d+) records built; Kafka acknowledged (\d+), refused (\d+) for good")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    with KafkaCluster(tmp_path_factory.mktemp("kafka-cluster")) as c:
        yield c


@pytest.fixture
def healthy(cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The cluster with every broker up and every link whole, before and after the test."""
    cluster.restore()
    yield cluster
    cluster.restore()


def metric(port: int, name: str) -> float:
    code, text = scrape(port, "/metrics")
    assert code == 200, text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


@dataclass
class Run:
    """One scenario's handles: the cluster, the traffic and the exporter (its process, metrics port and log)."""

    lab: Lab
    cluster: KafkaCluster
    traffic: Traffic
    topic: str
    tmp_path: Path
    extra: tuple[str, ...]
    bootstrap: str
    port: int = 0
    proc: Any = None
    logs: list[Path] = field(default_factory=list)
    killed: int = 0  # exporter processes SIGKILLed (their account is never written)
    notes: dict[str, Any] = field(default_factory=dict)

    def start_exporter(self, wait: bool = True) -> None:
        self.port = free_port()
        self.logs.append(self.tmp_path / f"exporter{len(self.logs) + 1}.log")
        args = ("--set", "shutdown.grace=90s", *self.extra)
        self.proc = start_exporter(
            self.lab, self.bootstrap, self.topic, self.logs[-1], *args, metrics_port=self.port, wait=wait
        )

    def kill_exporter(self) -> None:
        """SIGKILL the exporter (a node crash): what it had not checkpointed, the next start meets again."""
        self.proc.kill()
        self.proc.wait(10)
        self.killed += 1

    def log_text(self) -> str:
        return self.logs[-1].read_text()[-4000:]

    def restart_broker(self, i: int, traffic_s: float = 2.0) -> None:
        """SIGTERM broker ``i``, traffic while it is away, start it and wait until every replica is in sync."""
        self.cluster.terminate(i)
        self.traffic.during(traffic_s)
        self.cluster.start(i)
        self.cluster.wait_in_sync(self.topic)

    def wait_ready(self, code: int, within: float, traffic: bool = False) -> None:
        """Until /readyz answers ``code`` (with a burst of traffic per try when ``traffic``)."""
        deadline = time.monotonic() + within
        while scrape(self.port, "/readyz")[0] != code:
            if traffic:
                self.traffic.burst()
            assert time.monotonic() < deadline, f"/readyz not {code} within {within:.0f} s"
            time.sleep(0.2)


@dataclass
class Outcome:
    records: int  # on the topic, duplicates included
    duplicates: int  # identical copies of a pair (a differing one fails the test)
    connections: int
    recover_s: float  # from the fault's end until nothing was in flight
    resent: int
    log: str


def scenario(
    lab: Lab,
    cluster: KafkaCluster,
    tmp_path: Path,
    name: str,
    fault: Callable[[Run], None],
    *extra: str,
    bootstrap: str | None = None,
) -> Outcome:
    """Traffic before, during and after ``fault`` (which injects it, drives traffic while it lasts and ends it),
    then the exporter stopped and the topic held against the kernel (module docstring). ``bootstrap``: where the
    exporter connects (the cluster's PLAINTEXT listeners by default)."""
    topic = f"cluster-{name}-{uuid.uuid4().hex[:6]}"
    cluster.create_topic(topic, partitions=3, leader=LEADER)
    run = Run(lab, cluster, Traffic(lab), topic, tmp_path, extra, bootstrap or cluster.bootstrap)
    run.start_exporter()
    traffic = run.traffic
    try:
        traffic.burst()
        time.sleep(3)  # the first records delivered before the fault
        fault(run)
        ended = time.monotonic()
        traffic.burst()
        deadline = ended + 180
        while metric(run.port, "flow_exporter_records_in_flight") > 0 or metric(
            run.port, "flow_exporter_records_built_total"
        ) > metric(run.port, "flow_exporter_records_acknowledged_total"):
            assert run.proc.poll() is None, run.log_text()
            assert time.monotonic() < deadline, "in flight 180 s after the fault\n" + run.log_text()
            time.sleep(0.2)
        recover_s = time.monotonic() - ended
        resent = int(metric(run.port, "flow_exporter_records_resent_total"))
        # No wait for the last exchanges' end-of-flow records: the shutdown's final records carry the same counts.
        text = stop_exporter(run.proc, run.logs[-1], grace=90)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    logs = "".join(p.read_text() for p in run.logs)
    assert "Traceback" not in logs, logs[-4000:]
    account = ACCOUNT.search(text)
    assert account, text[-4000:]
    built, acked, refused = (int(g) for g in account.groups())
    assert refused == 0, account.group(0)
    if not run.killed:  # (a process after a SIGKILL also acknowledges what the killed one built)
        assert built == acked, account.group(0)
    cluster.wait_agreed(topic)  # no broker left that still believes in the partitions' old leaders
    raw = read_raw_records(cluster.bootstrap, topic, timeout=90)
    # Duplicates only as the same bytes of one pair.
    by_pair: dict[tuple[int, int], bytes] = {}
    records = []
    dups = 0
    for _, _, value in raw:
        r = decode(value)
        pair = (r["connectionId"], r["sequence"])
        first = by_pair.setdefault(pair, value)
        if first is not value:
            assert first == value, f"{pair} carries two contents"
            dups += 1
            continue
        records.append(r)
    if not run.killed:  # one process's whole account: every record it had acknowledged is there, once
        ends = {p: o for p, o, _ in raw}
        assert len(by_pair) == acked, f"{acked} acknowledged, {len(by_pair)} distinct pairs (last offsets {ends})"
    groups = contract.check(records)  # sequences gap-free, deltas add up
    for (ip, cport, sport), ct in traffic.truth.items():
        mine = [rs for rs in groups.values() if rs[0]["sourceAddress"] == ip and rs[0]["sourcePort"] == cport]
        assert mine and all(rs[0]["destinationPort"] == sport for rs in mine), (ip, cport)
        summed = tuple(sum(x) for x in zip(*(contract.consumer_sum(rs) for rs in mine), strict=True))
        assert summed == ct_counts(ct), (ip, cport, summed, ct.raw)
    out = Outcome(len(raw), dups, len(traffic.truth), recover_s, resent, logs)
    print(
        f"\n{name}: {out.records} records, {dups} identical duplicates, 0 differing, 0 gaps, 0 lost, "
        f"{out.connections} exchanges exact, recovered in {recover_s:.1f} s ({resent} resent) {run.notes}"
    )
    return out


# --------------------------------------------------------------------------- the leader's process


def test_leader_sigterm(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        assert run.cluster.leader(run.topic) == LEADER
        run.cluster.terminate(LEADER)  # a controlled shutdown: leaderships move first
        run.traffic.during(8)
        run.notes["new leader"] = run.cluster.leader(run.topic)
        assert run.notes["new leader"] != LEADER
        run.cluster.start(LEADER)

    scenario(lab, healthy, tmp_path, "sigterm", fault)


def test_leader_sigkill(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        run.cluster.kill(LEADER)  # no handover: the controller fences it after broker.session.timeout.ms
        run.traffic.during(8)
        run.cluster.start(LEADER)

    scenario(lab, healthy, tmp_path, "sigkill", fault)


def test_leader_bounced_five_times(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        for _ in range(5):
            run.restart_broker(run.cluster.leader(run.topic))

    scenario(lab, healthy, tmp_path, "bounce", fault)


def test_active_controller_sigkill(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        active = run.cluster.active_controller()
        run.notes["killed controller"] = active
        run.cluster.kill(active)
        run.traffic.during(8)
        run.notes["new controller"] = run.cluster.active_controller()
        assert run.notes["new controller"] != active
        run.cluster.start(active)

    scenario(lab, healthy, tmp_path, "controller", fault)


def test_leader_paused_past_the_delivery_timeout(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    """SIGSTOP past request.timeout.ms and message.timeout.ms: records that timed out may have been written;
    they come back as the same bytes, never as new content."""

    def fault(run: Run) -> None:
        run.cluster.pause(LEADER)
        run.traffic.during(12)
        run.cluster.resume(LEADER)
        run.notes["failed deliveries"] = int(
            metric(run.port, "flow_exporter_records_failed_total")
        )  # timed out while it slept
        assert run.notes["failed deliveries"] > 0

    scenario(
        lab, healthy, tmp_path, "sigstop", fault,
        *SHORT_TIMEOUTS,
    )  # fmt: skip


def test_two_brokers_down_coalesces_and_recovers_exactly(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    """One in-sync replica left of three, under min.insync.replicas 2: NOT_ENOUGH_REPLICAS, /readyz 503 after
    kafka.readyTimeout, and everything delivered once a second broker is back."""

    def fault(run: Run) -> None:
        run.cluster.kill(2)
        run.cluster.kill(3)
        run.wait_ready(503, within=60, traffic=True)  # kafka.readyTimeout (5 s) with records waiting
        run.notes["readyz"] = scrape(run.port, "/readyz")[1].strip()
        run.traffic.during(3)
        run.cluster.start(2, timeout=120)
        back = time.monotonic()
        run.wait_ready(200, within=60)
        run.notes["ready again after"] = f"{time.monotonic() - back:.1f} s"

    scenario(lab, healthy, tmp_path, "two-down", fault, "--set", "kafka.readyTimeout=5s")


def test_rolling_restart_of_all_three(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        for i in run.cluster.brokers:
            run.restart_broker(i)

    scenario(lab, healthy, tmp_path, "rolling", fault)


# --------------------------------------------------------------------------- the leader's links


def test_leader_cut_off_from_the_exporter_only(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    """The leader stays the leader (its peers and the quorum see it) while the exporter cannot reach it: records
    time out (message.timeout.ms 5 s) and go again as the same bytes once the link is back."""

    def fault(run: Run) -> None:
        run.cluster.cut(LEADER, "clients")
        run.traffic.during(10)
        run.notes["leader during the cut"] = run.cluster.leader(run.topic)
        run.cluster.heal(LEADER)

    scenario(
        lab, healthy, tmp_path, "cut-clients", fault,
        *SHORT_TIMEOUTS,
    )  # fmt: skip


def test_leader_cut_off_from_its_followers_only(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    """The leader loses its followers and the quorum (combined nodes: the peers are the controllers too) while the
    exporter still reaches it: it can neither commit (acks=all) nor shrink its ISR, the controller fences it and
    moves the leadership; what it took and could not commit is truncated when it rejoins, and the exporter's
    resends (the same bytes) land on the new leader."""

    def fault(run: Run) -> None:
        run.cluster.cut(LEADER, "peers")
        run.traffic.during(12)
        run.notes["leader during the cut"] = run.cluster.leader(run.topic)
        run.cluster.heal(LEADER)
        run.cluster.wait_in_sync(run.topic, timeout=120)

    scenario(
        lab, healthy, tmp_path, "cut-peers", fault,
        *SHORT_TIMEOUTS,
    )  # fmt: skip


# --------------------------------------------------------------------------- operations under load


def test_reassignment_and_preferred_leader_election_under_load(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        parts = sorted(run.cluster.partitions(run.topic))
        moves = {
            "version": 1,
            "partitions": [{"topic": run.topic, "partition": p, "replicas": [2, 3, 1]} for p in parts],
        }
        plan = run.tmp_path / "reassign.json"
        plan.write_text(json.dumps(moves))
        run.cluster.tool("org.apache.kafka.tools.reassign.ReassignPartitionsCommand", "--execute",
                         "--reassignment-json-file", str(plan))  # fmt: skip
        deadline = time.monotonic() + 120
        while "is still in progress" in run.cluster.tool(
            "org.apache.kafka.tools.reassign.ReassignPartitionsCommand", "--verify", "--reassignment-json-file",
            str(plan),
        ):  # fmt: skip
            run.traffic.burst()
            assert time.monotonic() < deadline, "reassignment not done in 120 s"
        run.cluster.tool(
            "org.apache.kafka.tools.LeaderElectionCommand", "--election-type", "PREFERRED", "--all-topic-partitions"
        )
        run.traffic.during(3)
        leaders = {p: run.cluster.leader(run.topic, p) for p in parts}
        run.notes["leaders after"] = leaders
        assert set(leaders.values()) == {2}, leaders

    scenario(lab, healthy, tmp_path, "reassign", fault)


# --------------------------------------------------------------------------- the exporter itself


def test_exporter_sigkilled_during_a_leader_failover(lab: Lab, healthy: KafkaCluster, tmp_path: Path) -> None:
    """SIGKILL the exporter while the leader is down (its records in flight, unacknowledged); the next start on
    the state dir sends them again as the same bytes and continues every connection."""

    def fault(run: Run) -> None:
        run.cluster.kill(LEADER)
        run.traffic.during(2)
        run.kill_exporter()
        run.traffic.burst()
        run.start_exporter()
        run.traffic.during(4)
        run.cluster.start(LEADER)

    state = tmp_path / "state"
    scenario(lab, healthy, tmp_path, "exporter-kill", fault, "--set", f"state.dir={state}")


def test_latency_above_the_delivery_timeout_on_the_exporters_link(
    lab: Lab, healthy: KafkaCluster, tmp_path: Path
) -> None:
    """Every byte between the exporter and the brokers held 7 s, past message.timeout.ms (5 s): the records time
    out in the client but reach the brokers later and are written; the resends are the same bytes."""

    def fault(run: Run) -> None:
        run.cluster.delay(7000)
        try:
            run.traffic.during(15)
        finally:
            run.cluster.delay(0)
        run.notes["failed deliveries"] = int(metric(run.port, "flow_exporter_records_failed_total"))
        assert run.notes["failed deliveries"] > 0

    scenario(
        lab, healthy, tmp_path, "latency", fault,
        *SHORT_TIMEOUTS,
        bootstrap=healthy.slow_bootstrap,
    )  # fmt: skip


def test_fatal_idempotence_error_keeps_the_state_and_the_next_start_resends(
    lab: Lab, healthy: KafkaCluster, tmp_path: Path
) -> None:
    """A fatal idempotence error from a real cluster: ACLs refuse the exporter's user a producer id, which
    librdkafka raises as fatal (CLUSTER_AUTHORIZATION_FAILED on InitProducerId). It comes while the state dir
    holds records Kafka never acknowledged (the exporter before was SIGKILLed with its leader cut off): the
    exporter says what happened, keeps its state, exits 1; once the ACLs are fixed the next start sends them as
    the same bytes. The exporter writes as User:flows over the brokers' SASL listeners (ACLs need a principal
    other than the brokers' own)."""

    def fault(run: Run) -> None:
        run.cluster.cut(LEADER, "clients")
        run.traffic.during(3)  # records for the leader's partitions wait, unacknowledged
        run.kill_exporter()
        run.cluster.heal(LEADER)
        run.cluster.refuse_producer_ids()
        try:
            run.traffic.burst()
            run.start_exporter(wait=False)
            rc = run.proc.wait(60)
        finally:
            run.cluster.allow_producer_ids()
        text = run.logs[-1].read_text()
        assert rc == 1, text[-4000:]
        assert "kafka producer fatal error, exiting (state kept for the restart)" in text, text[-4000:]
        assert "Cluster authorization failed" in text, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        run.notes["fatal exit"] = rc
        run.traffic.burst()
        run.start_exporter()
        run.traffic.during(2)

    user, password = SASL_USER
    sasl = ("kafka.securityProtocol=SASL_PLAINTEXT", "kafka.sasl.mechanism=PLAIN", f"kafka.sasl.username={user}")
    flags = [a for setting in (*sasl, f"kafka.sasl.password={password}") for a in ("--set", setting)]
    state = tmp_path / "state"
    scenario(
        lab, healthy, tmp_path, "fatal-idempotence", fault, "--set", f"state.dir={state}", *flags,
        bootstrap=healthy.sasl_bootstrap,
    )  # fmt: skip
