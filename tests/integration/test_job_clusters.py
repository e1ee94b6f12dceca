"""The reference jobs on real clusters, a worker SIGKILLed mid-run (issue 40).

One pipeline for the module, as production runs it: the exporter writes the lab's traffic to a
topic on the three-broker cluster (devtools.kafka_cluster; 3 partitions, replication 3,
``min.insync.replicas`` 2) while the unchanged jobs of ``downstream/`` consume it, streaming, with
checkpoints: the Spark job on a standalone cluster (a master and two workers, devtools.job_cluster),
the Flink job on a session cluster (a JobManager and two TaskManagers) submitted with ``flink run``.
Mid-way through the traffic one Spark worker (with its executor) and the TaskManager running the
Flink job are SIGKILLed; Spark reruns the lost tasks on the other worker (the state stores load from
the checkpoint), Flink restarts the job from its last checkpoint on the other TaskManager.

After the traffic the exporter stops (its last records out), a record an hour ahead goes into every
partition to close every window, and the jobs' tables are read: per (source, destination) the window
rows, and (Spark) per connection the totals, must equal the counters ``conntrack -L`` showed for the
exchanges, exactly: nothing lost with the worker, nothing counted twice by the replay.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from devtools.downstream import jar_args
from devtools.job_cluster import FlinkCluster, SparkCluster
from devtools.kafka_cluster import KafkaCluster
from devtools.lab import Lab
from tests.support.downstream import (
    CLOCK_ZONE,
    FLINK_JOB,
    JOB,
    SPARK_JVM,
    TOP,
    WINDOW_S,
    Counts,
    Group,
    ct_connection,
    ct_totals,
    produce_synthetic,
    read_json_rows,
    read_parquet_rows,
)
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.traffic import Traffic, ct_counts

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.spark]

TOPIC = "flows"
PARTITIONS = 3
TRAFFIC_S = 12  # seconds of traffic; the workers die after KILL_AFTER_S of it
KILL_AFTER_S = 6
CLOCK: Group = ("test/clock", "test/clock")


def _numbers(directory: Path) -> set[int]:
    return {int(p.name) for p in directory.glob("[0-9]*") if p.name.isdigit()} if directory.exists() else set()


@dataclass
class SparkRun:
    """The Spark job streaming on the standalone cluster; its progress read from its checkpoint."""

    cluster: SparkCluster
    out: Path
    proc: subprocess.Popen[bytes]
    log: Path
    notes: dict[str, Any] = field(default_factory=dict)

    def query(self, name: str) -> Path:
        return self.out / "_checkpoints" / name

    def committed(self, name: str = "flows_by_window") -> set[int]:
        return _numbers(self.query(name) / "commits")

    def started(self, name: str = "flows_by_window") -> set[int]:
        return _numbers(self.query(name) / "offsets")

    def offsets(self, name: str, batch: int) -> dict[int, int]:
        """The end offsets batch ``batch`` of query ``name`` read up to, per partition."""
        last = (self.query(name) / "offsets" / str(batch)).read_text().splitlines()[-1]
        return {int(p): int(o) for p, o in json.loads(last)[TOPIC].items()}

    def caught_up(self, name: str, ends: dict[int, int]) -> int | None:
        """The first committed batch of ``name`` that read every partition up to ``ends``, if any."""
        for batch in sorted(self.committed(name)):
            if self.offsets(name, batch) == ends:
                return batch
        return None

    def at_end(self, name: str, ends: dict[int, int]) -> bool:
        return self.caught_up(name, ends) is not None

    def kill_worker(self) -> None:
        """SIGKILL worker 1 and its executor; note whether a batch was running and how long until one committed."""
        started, committed = max(self.started(), default=-1), max(self.committed(), default=-1)
        self.notes["batch running at the kill"] = started > committed
        self.cluster.kill_worker(1)
        killed = time.monotonic()
        wait_for(lambda: max(self.committed(), default=-1) > started, 120, "a Spark batch after the kill", self.log)
        self.notes["recovered_s"] = round(time.monotonic() - killed, 1)


@dataclass
class FlinkRun:
    """The Flink job streaming on the session cluster, through the cluster's REST API."""

    cluster: FlinkCluster
    out: Path
    proc: subprocess.Popen[bytes]
    log: Path
    notes: dict[str, Any] = field(default_factory=dict)

    def job(self) -> dict[str, Any] | None:
        """The job's overview once submitted (the cluster's only job: a second would be a resubmission)."""
        jobs = self.cluster.rest("/jobs/overview")["jobs"]
        assert len(jobs) <= 1, jobs
        assert self.proc.poll() is None, self.log.read_text()[-4000:]
        return dict(jobs[0]) if jobs else None

    def jid(self) -> str:
        job = self.job()
        assert job is not None
        return str(job["jid"])

    def completed_checkpoints(self) -> int:
        return int(self.cluster.rest(f"/jobs/{self.jid()}/checkpoints")["counts"]["completed"])

    def running(self) -> bool:
        job = self.job()
        if job is None or job["state"] != "RUNNING":
            return False
        vertices = self.cluster.rest(f"/jobs/{job['jid']}")["vertices"]
        return all(v["status"] == "RUNNING" for v in vertices)

    def busy_worker(self) -> int:
        """The TaskManager whose slot runs the job (one slot each, parallelism 1)."""
        by_id = {tm["id"]: tm["freeSlots"] for tm in self.cluster.rest("/taskmanagers")["taskmanagers"]}
        busy = [tm for tm, free in by_id.items() if free == 0]
        assert len(busy) == 1, by_id
        logs = {i: (self.cluster.workdir / f"taskmanager{i}.log").read_text() for i in self.cluster.workers}
        (worker,) = [i for i, text in logs.items() if busy[0].split("-")[0] in text or busy[0] in text]
        return worker

    def kill_worker(self) -> None:
        """SIGKILL the TaskManager running the job (after a checkpoint); time until the job runs again."""
        worker = self.busy_worker()
        self.notes["checkpoints before the kill"] = self.completed_checkpoints()
        killed_ms = time.time_ns() // 1_000_000
        self.cluster.kill_worker(worker)
        killed = time.monotonic()
        wait_for(lambda: not self.running(), 60, "the Flink job noticing the kill", self.log)
        wait_for(self.running, 120, "the Flink job running again", self.log)
        self.notes["recovered_s"] = round(time.monotonic() - killed, 1)
        # The newest checkpoint completed before the kill: the one the restart must restore.
        history = self.cluster.rest(f"/jobs/{self.jid()}/checkpoints")["history"]
        done = [c["id"] for c in history if c["status"] == "COMPLETED" and c["latest_ack_timestamp"] <= killed_ms]
        self.notes["newest checkpoint before the kill"] = max(done, default=None)

    def failures(self) -> int:
        """Failures the JobManager recorded for the job (its exception history)."""
        return len(self.cluster.rest(f"/jobs/{self.jid()}/exceptions")["exceptionHistory"]["entries"])

    def restored(self) -> int | None:
        """The checkpoint the job last restarted from, if it did."""
        restored = self.cluster.rest(f"/jobs/{self.jid()}/checkpoints")["latest"]["restored"]
        return None if restored is None else int(restored["id"])

    def cancel(self) -> None:
        """``flink cancel``, through the REST API: the way a streaming job on a session cluster ends."""
        job = self.job()
        if job is not None and job["state"] == "RUNNING":
            self.cluster.rest(f"/jobs/{job['jid']}?mode=cancel", method="PATCH")


def wait_for(cond: Callable[[], bool], within: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {within:.0f} s" + (
            "\n" + log.read_text()[-3000:] if log else ""
        )
        time.sleep(0.25)


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ends-{time.time_ns()}"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(PARTITIONS)}
    finally:
        consumer.close()


def job_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "SPARK_LOCAL_IP": "127.0.0.1"}


def start_spark(cluster: SparkCluster, bootstrap: str, work: Path) -> SparkRun:
    out, log = work / "spark" / "tables", work / "spark.log"
    cmd = [
        sys.executable, str(JOB), "--bootstrap-servers", bootstrap, "--topic", TOPIC, *cluster.job_options(),
        "--trigger", "1 second", "--output", str(out), "--window", f"{WINDOW_S} seconds", "--top", str(TOP),
        # Longer than the run: no record is late, whichever partition a batch reads first.
        "--watermark", "5 minutes", f"--driver-java-options={SPARK_JVM}", "--driver-memory", "1g",
        *jar_args("spark"),
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=job_env(), start_new_session=True)
    return SparkRun(cluster, out, proc, log)


def start_flink(cluster: FlinkCluster, bootstrap: str, work: Path) -> FlinkRun:
    out, log = work / "flink" / "tables", work / "flink.log"
    args = [
        "--bootstrap-servers", bootstrap, "--topic", TOPIC, "--output", str(out), "--window", str(WINDOW_S),
        "--top", str(TOP), "--restarts", "3", "--checkpoint-interval", "2",
        "--checkpoint", (work / "flink" / "checkpoints").as_uri(), *jar_args("flink"),
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cluster.run_command(FLINK_JOB, *args),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**job_env(), **cluster.env},
            start_new_session=True,
        )
    return FlinkRun(cluster, out, proc, log)


@dataclass
class Pipeline:
    traffic: Traffic
    spark: SparkRun
    flink: FlinkRun
    ends: dict[int, int]


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM the job's own process if it still runs (the Spark job stops its queries; its JVM must not get the
    signal first); then its log must hold no Python traceback."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    work = tmp_path_factory.mktemp("job-clusters")
    with (
        KafkaCluster(work / "kafka") as kafka,
        SparkCluster(work / "spark-cluster") as spark_cluster,
        FlinkCluster(work / "flink-cluster") as flink_cluster,
        Lab(pods=3) as lab,
    ):
        kafka.create_topic(TOPIC, partitions=PARTITIONS)
        spark = start_spark(spark_cluster, kafka.bootstrap, work)
        flink = start_flink(flink_cluster, kafka.bootstrap, work)
        try:
            wait_for(lambda: bool(spark.started()), 180, "the Spark job's first batch", spark.log)
            wait_for(lambda: flink.running() and flink.completed_checkpoints() > 0, 180, "Flink running", flink.log)
            traffic = Traffic(lab)
            log = work / "exporter.log"
            exporter = start_exporter(lab, kafka.bootstrap, TOPIC, log)
            try:
                traffic.during(KILL_AFTER_S)
                spark.kill_worker()
                flink.kill_worker()
                traffic.during(TRAFFIC_S - KILL_AFTER_S)
                stop_exporter(exporter, log)
            finally:
                if exporter.poll() is None:
                    exporter.kill()
            # Every window closed: a record an hour ahead, in every partition (Flink's watermark is per partition).
            produce_synthetic(kafka.bootstrap, TOPIC, clock_only=True, partitions=PARTITIONS)
            ends = end_offsets(kafka.bootstrap, TOPIC)
            # Spark: both queries read to the end, and the windows query one batch more (the one that emits).
            for name in ("flows_by_window", "connection_totals"):
                wait_for(partial(spark.at_end, name, ends), 180, f"Spark's {name} at the end", spark.log)
            last = spark.caught_up("flows_by_window", ends)
            assert last is not None
            wait_for(lambda: max(spark.committed()) > last, 120, "Spark's closing batch", spark.log)
            # Flink: the windows' files are committed at a checkpoint after the watermark passed them.
            seen = flink.completed_checkpoints()
            wait_for(lambda: flink.completed_checkpoints() >= seen + 3, 120, "three Flink checkpoints", flink.log)
            yield Pipeline(traffic, spark, flink, ends)
        finally:
            stop(spark.proc, spark.log)
            flink.cancel()
            with contextlib.suppress(subprocess.TimeoutExpired):
                flink.proc.wait(60)  # the client returns once the job is cancelled
            stop(flink.proc, flink.log)


def truth(pipeline: Pipeline) -> dict[Group, Counts]:
    return ct_totals(pipeline.traffic.truth.values())


def windows_totals(rows: list[dict[str, Any]]) -> dict[Group, Counts]:
    out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
    for row in rows:
        key = (row["source"], row["destination"])
        p, b = out[key]
        out[key] = (p + row["packets"], b + row["bytes"])
    out.pop(CLOCK, None)
    return dict(out)


def test_spark_standalone_with_a_worker_killed_equals_conntrack(pipeline: Pipeline) -> None:
    spark = pipeline.spark
    print(f"\nspark standalone: worker 1 SIGKILLed after {KILL_AFTER_S} s of traffic: {spark.notes}")
    # The driver lost that worker's executor, once, and went on with the other.
    assert spark.log.read_text().count("Lost executor") == 1, spark.log.read_text()[-4000:]
    windows = read_parquet_rows(spark.out / "flows_by_window")
    assert windows_totals(windows) == truth(pipeline)
    zones = read_parquet_rows(spark.out / "bytes_by_zone_pair")
    assert sum(r["bytes"] for r in zones if r["source_zone"] != CLOCK_ZONE) == sum(
        b for _, b in truth(pipeline).values()
    )
    rows = read_parquet_rows(spark.out / "connection_totals")
    by_connection = {
        (r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"], r["destinationPort"]): r
        for r in rows
        if r["source"] != CLOCK[0]
    }
    assert len(by_connection) == len(rows) - 1 == len(pipeline.traffic.truth)
    for e in pipeline.traffic.truth.values():
        r = by_connection[ct_connection(e)]
        got = (r["forward_packets"], r["forward_bytes"], r["reverse_packets"], r["reverse_bytes"])
        assert got == ct_counts(e), e.raw


def test_flink_session_cluster_with_a_taskmanager_killed_equals_conntrack(pipeline: Pipeline) -> None:
    flink = pipeline.flink
    print(f"\nflink session cluster: the job's TaskManager SIGKILLed after {KILL_AFTER_S} s of traffic: {flink.notes}")
    # One failure (the TaskManager), and the job restarted from a checkpoint taken before it.
    assert flink.failures() == 1
    restored = flink.restored()
    assert restored is not None and restored == flink.notes["newest checkpoint before the kill"]
    print(f"restored from checkpoint {restored}")
    windows = read_json_rows(flink.out / "flows_by_window")
    assert windows_totals(windows) == truth(pipeline)
    zones = read_json_rows(flink.out / "bytes_by_zone_pair")
    assert sum(r["bytes"] for r in zones if r["source_zone"] != CLOCK_ZONE) == sum(
        b for _, b in truth(pipeline).values()
    )
