"""The downstream jobs' shared test harness: run a job over a topic, read its tables, and ground truth from conntrack.

Used by the end-to-end tests of tests/integration (test_downstream_e2e.py, test_two_nodes.py).
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import Producer

from devtools.downstream import jar_args
from devtools.lab import CtEntry
from flow_exporter.record import schema_path
from tests.support.paths import REPO

JOB = REPO / "downstream" / "spark_flows.py"
# What a user copies to run a job outside the repository (README "Run a job outside the repository").
STANDALONE_FILES = (
    REPO / "downstream" / "contract.py",
    REPO / "schemas" / "flow_record.avsc",
    REPO / "schemas" / "completeness_marker.avsc",
)

WINDOW_S = 10

CLOCK_ZONE = "test-clock"  # the zones of the synthetic record that closes Spark's windows

TOP = 2

# Short-run JVM flags: C1 only and the serial GC roughly halve this run's CPU on two cores.
SPARK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

Group = tuple[str, str]
ZonePair = tuple[str | None, str | None]

Counts = tuple[int, int]  # packets, bytes; both directions
Directional = tuple[int, int, int, int]  # forward packets, forward bytes, reverse packets, reverse bytes


def endpoint(addr: str, port: int | None) -> str:
    ip = ipaddress.ip_address(addr)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass(frozen=True)
class Placement:
    """What a test told the API server about the lab's addresses, as the jobs should name them.

    ``names``: address -> the group a pod at it gets (its workload ``namespace/Kind/Name``, or
    ``namespace/pod`` for a bare pod), written out by the test; ``zones``: address -> the zone
    label of the node it is on (or is). Addresses absent are outside the cluster: named by
    themselves, zone null. The empty placement is a run without enrichment.
    """

    names: dict[str, str] = field(default_factory=dict)
    zones: dict[str, str] = field(default_factory=dict)

    def source(self, addr: str) -> str:
        a = str(ipaddress.ip_address(addr))
        return self.names.get(a, a)

    def destination(self, addr: str, port: int | None) -> str:
        return self.names.get(str(ipaddress.ip_address(addr))) or endpoint(addr, port)

    def zone(self, addr: str) -> str | None:
        return self.zones.get(str(ipaddress.ip_address(addr)))


def _counted(e: CtEntry) -> Directional:
    assert e.orig_packets is not None and e.reply_packets is not None, e.raw  # accounting is on
    assert e.orig_bytes is not None and e.reply_bytes is not None, e.raw
    return e.orig_packets, e.orig_bytes, e.reply_packets, e.reply_bytes


def ct_group(e: CtEntry, placement: Placement = Placement()) -> Group:
    """The job's (source, destination) for a conntrack entry: the names the test gave, else addresses.

    The destination is the one reached (the reply's source: after DNAT).
    """
    return placement.source(e.orig_src), placement.destination(e.reply_src, e.reply_sport)


def ct_totals(entries: Iterable[CtEntry], placement: Placement = Placement()) -> dict[Group, Counts]:
    out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
    for e in entries:
        fp, fb, rp, rb = _counted(e)
        p, b = out[ct_group(e, placement)]
        out[ct_group(e, placement)] = (p + fp + rp, b + fb + rb)
    return dict(out)


def ct_zone_totals(entries: Iterable[CtEntry], placement: Placement) -> dict[ZonePair, Directional]:
    """Per (source zone, destination zone) the kernel's counters summed, by the zones the test assigned."""
    out: dict[ZonePair, Directional] = defaultdict(lambda: (0, 0, 0, 0))
    for e in entries:
        key = (placement.zone(e.orig_src), placement.zone(e.reply_src))
        out[key] = add(out[key], _counted(e))
    return dict(out)


def add(a: Directional, b: Directional) -> Directional:
    """Counters summed direction by direction: the zone table is checked per direction, not only in total."""
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]


def _end(r: dict[str, Any], side: str) -> str | None:
    """One end's name by the README's rule, from the record's fields: workload, else pod (None if neither)."""
    ns, pod = r.get(f"{side}PodNamespace"), r.get(f"{side}PodName")
    kind, owner = r.get(f"{side}OwnerKind"), r.get(f"{side}OwnerName")
    if ns is not None and kind is not None and owner is not None and kind != "Pod":
        return f"{ns}/{kind}/{owner}"
    return f"{ns}/{pod}" if ns is not None and pod is not None else None


def record_group(r: dict[str, Any]) -> Group:
    source = _end(r, "source") or r["sourceAddress"]
    destination = (
        r.get("destinationService") or _end(r, "destination") or endpoint(r["destinationAddress"], r["destinationPort"])
    )
    return source, destination


def readme_rule(records: list[dict[str, Any]]) -> dict[Group, Counts]:
    """The README's consumer rule: drop the destination node's copy of an inter-node pod-to-pod connection,
    drop duplicates by (exporterNode, connectionId, sequence), sum the deltas."""
    seen: set[tuple[str, int, int]] = set()
    out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
    for r in records:
        key = (r["exporterNode"], r["connectionId"], r["sequence"])
        if key in seen or (r.get("flowType"), r.get("reporter")) == (2, 2):
            continue
        seen.add(key)
        p, b = out[record_group(r)]
        out[record_group(r)] = (
            p + r["packetDeltaCount"] + r["reversePacketDeltaCount"],
            b + r["octetDeltaCount"] + r["reverseOctetDeltaCount"],
        )
    return dict(out)


def synthetic_record(
    port: int,
    source_pod: tuple[str, str],
    dest_pod: tuple[str, str],
    service: str | None,
    export_ms: int,
    totals: tuple[int, int, int, int],
    **fields: Any,
) -> dict[str, Any]:
    """A complete FlowRecord with Kubernetes fields, as enrichment fills them; ``fields`` set more (owners, zones).

    Without ``fields`` the owner and zone fields are absent, as in a record of an exporter older than them.
    """
    record = {
        "connectionId": uuid.uuid4().int >> 65,
        "exporterNode": "synthetic",
        "flowStart": export_ms - 1000,
        "ipVersion": 4,
        "protocol": 6,
        "sourceAddress": "10.250.0.1",
        "sourcePort": port,
        "destinationAddress": "10.250.0.2",
        "destinationPort": 8080,
        "originalDestinationAddress": "10.250.0.2",
        "originalDestinationPort": 8080,
        "zone": 0,
        "ctId": port,
        "ctMark": 0,
        "sourcePodName": source_pod[1],
        "sourcePodNamespace": source_pod[0],
        "destinationPodName": dest_pod[1],
        "destinationPodNamespace": dest_pod[0],
        "destinationService": service,
        "sequence": 0,
        "exportTime": export_ms,
        "flowEnd": export_ms,
        "flowEndReason": 3,
        "flags": 0,
        "packetTotalCount": totals[0],
        "octetTotalCount": totals[1],
        "reversePacketTotalCount": totals[2],
        "reverseOctetTotalCount": totals[3],
        "packetDeltaCount": totals[0],
        "octetDeltaCount": totals[1],
        "reversePacketDeltaCount": totals[2],
        "reverseOctetDeltaCount": totals[3],
    }
    return record | fields


SAMPLED_GROUP = ("shop/api-1", "shop/db-2")
SAMPLED_P = 0.25


def sampled_records(now_ms: int) -> list[dict[str, Any]]:
    """Records of a node that keeps connections with probability 1/4: connection A (4 then 6 more packets,
    400 then 600 bytes) and connection B (2 and 1 packets, 200 and 100 bytes), one window, one group."""
    ends = (("shop", "api-1"), ("shop", "db-2"), None, now_ms)
    common = {"samplingProbability": SAMPLED_P, "exporterNode": "sampling-node", "flowStart": now_ms - 5000}
    a = synthetic_record(40005, *ends, (4, 400, 0, 0), **common)
    a2 = a | {"sequence": 1, "packetTotalCount": 10, "octetTotalCount": 1000, "packetDeltaCount": 6,
              "octetDeltaCount": 600}  # fmt: skip
    b = synthetic_record(40006, *ends, (2, 200, 1, 100), **common)
    return [a, a2, b]


def produce_synthetic(
    bootstrap: str, topic: str, header: bytes = b"", *, clock_only: bool = False, partitions: int = 0
) -> None:
    """The synthetic records, framed like the exporter's (``header``: magic byte and schema id).

    ``clock_only``: just the record an hour ahead that closes every window of a Spark run.
    ``partitions``: that record into each of partitions 0..N-1 (the same bytes: one pair), so that a
    watermark taken per partition (Flink's) passes too; by default into one partition.
    """
    schema = fastavro.parse_schema(json.loads(schema_path().read_text()))
    now_ms = time.time_ns() // 1_000_000
    web = {"sourceOwnerKind": "Deployment", "sourceOwnerName": "web"}
    records = [
        # A workload's pod to a Service: the Service names the destination.
        synthetic_record(
            40001, ("shop", "web-0"), ("shop", "cart-7"), "shop/cart:80/TCP", now_ms, (7, 700, 5, 500), **web
        ),
        # No owner fields (an older exporter) to a bare pod (kind Pod): both ends named by their pods.
        synthetic_record(
            40002,
            ("shop", "web-0"),
            ("shop", "db-0"),
            None,
            now_ms,
            (3, 300, 2, 200),
            destinationOwnerKind="Pod",
            destinationOwnerName="db-0",
        ),
        # A Cilium node's connection (Cilium 1.16+): one counter pair for both directions, flag 16: undirected.
        synthetic_record(
            40004,
            ("shop", "api-0"),
            ("shop", "db-1"),
            None,
            now_ms,
            (9, 900, 0, 0),
            flags=16,
            exporterNode="cilium-node",
        ),
        # Two connections of a node sampling at 1/4 (README: Sampling), one with two records: the jobs' estimates.
        *sampled_records(now_ms),
        # The clock: an hour ahead, so the watermark passes every real window. Its zones tell its row apart.
        synthetic_record(
            40003,
            ("test", "clock"),
            ("test", "clock"),
            "test/clock",
            now_ms + 3_600_000,
            (1, 1, 0, 0),
            sourceZone=CLOCK_ZONE,
            destinationZone=CLOCK_ZONE,
        ),
    ]
    producer = Producer({"bootstrap.servers": bootstrap})
    for r in records[-1:] if clock_only else records:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, r)
        if partitions and r is records[-1]:
            for p in range(partitions):
                producer.produce(topic, header + buf.getvalue(), partition=p)
        else:
            producer.produce(topic, header + buf.getvalue())
    assert producer.flush(30) == 0


@dataclass
class JobRun:
    """One job run's four tables, as lists of rows."""

    windows: list[dict[str, Any]]
    talkers: list[dict[str, Any]]
    connections: list[dict[str, Any]]
    seconds: float
    zones: list[dict[str, Any]] = field(default_factory=list)

    def group_totals(self) -> dict[Group, Counts]:
        out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
        for row in self.windows:
            key = (row["source"], row["destination"])
            p, b = out[key]
            out[key] = (p + row["packets"], b + row["bytes"])
        return dict(out)

    def zone_totals(self) -> dict[ZonePair, Directional]:
        """bytes_by_zone_pair summed over the windows, per (source_zone, destination_zone)."""
        out: dict[ZonePair, Directional] = defaultdict(lambda: (0, 0, 0, 0))
        for row in self.zones:
            key = (row["source_zone"], row["destination_zone"])
            out[key] = add(
                out[key], (row["forward_packets"], row["forward_bytes"], row["reverse_packets"], row["reverse_bytes"])
            )
        return dict(out)


def read_parquet_rows(directory: Path) -> list[dict[str, Any]]:
    import pyarrow.dataset as ds

    if not directory.exists():
        return []
    table = ds.dataset(str(directory), format="parquet", partitioning="hive").to_table()
    return [{k: v for k, v in row.items() if k != "batch"} for row in table.to_pylist()]


def run_spark(
    bootstrap: str,
    topic: str,
    workdir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    min_batches: int = 3,
    standalone: bool = False,
) -> JobRun:
    """The Spark job, available-now, into Parquet under ``workdir``; its tables.

    ``min_batches``: the data must span several micro-batches (state carried over), plus the one
    that closes the windows. ``standalone``: a copy of the job (:func:`standalone_copy`) under
    ``workdir``, run from there with a clean environment (:func:`_run_job`).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "tables"
    job = standalone_copy(JOB, workdir / "job") if standalone else JOB
    cmd = [
        sys.executable,
        str(job),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--available-now",
        "--output",
        str(out),
        "--window",
        f"{WINDOW_S} seconds",
        "--top",
        str(TOP),
        # Small batches: the per-connection state must carry over from batch to batch. A
        # watermark longer than the scenario keeps records of the two partitions from being late.
        "--max-offsets-per-trigger",
        "10",
        "--watermark",
        "5 minutes",
        f"--driver-java-options={SPARK_JVM}",
        *jar_args("spark"),
        *extra,
    ]
    summary, elapsed = _run_job(cmd, workdir / "spark.log", "spark_flows", env, job.parent if standalone else None)
    assert summary["batches"] >= min_batches, summary
    return JobRun(
        read_parquet_rows(out / "flows_by_window"),
        read_parquet_rows(out / "top_talkers"),
        read_parquet_rows(out / "connection_totals"),
        elapsed,
        read_parquet_rows(out / "bytes_by_zone_pair"),
    )


def standalone_copy(job: Path, directory: Path) -> Path:
    """``job`` and :data:`STANDALONE_FILES` copied into ``directory`` (outside the repository); the copy's path."""
    directory.mkdir(parents=True, exist_ok=True)
    assert not directory.resolve().is_relative_to(REPO)
    for path in (job, *STANDALONE_FILES):
        shutil.copy2(path, directory / path.name)
    return directory / job.name


def clean_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """A user's environment: PATH, HOME, locale and Java only; nothing that points at the repository."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "JAVA_HOME")
    base = {k: v for k, v in os.environ.items() if k in keep}
    base["PATH"] = os.pathsep.join(
        p for p in base.get("PATH", "").split(os.pathsep) if not Path(p).is_relative_to(REPO)
    )
    return {**base, "PYTHONUNBUFFERED": "1", **(env or {})}


def _run_job(
    cmd: list[str], log: Path, name: str, env: dict[str, str] | None, cwd: Path | None = None
) -> tuple[dict[str, Any], float]:
    """Run a job to its end; (its summary line's ``name`` object, wall seconds). Its output goes to ``log``.

    With ``cwd`` (a standalone copy's directory) the job runs there with :func:`clean_environment`.
    """
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
        env=clean_environment(env) if cwd is not None else {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    elapsed = time.monotonic() - t0
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith(f'{{"{name}"')))[name]
    assert summary["input_rows"] > 0
    return summary, elapsed


def ct_connection(e: CtEntry) -> tuple[int, str, int, str, int]:
    """A conntrack entry as the record fields name it: protocol, source, destination after DNAT."""
    return (
        e.protonum,
        str(ipaddress.ip_address(e.orig_src)),
        e.orig_sport or 0,
        str(ipaddress.ip_address(e.reply_src)),
        e.reply_sport or 0,
    )


FLINK_JOB = REPO / "downstream" / "flink_flows.py"
FLINK_PYTHON = REPO / ".venv-flink" / "bin" / "python"
_TIMESTAMPS = ("window_start", "window_end", "first_seen", "last_seen")


def read_json_rows(directory: Path) -> list[dict[str, Any]]:
    """A table the Flink job wrote (JSON lines, UTC timestamps without a zone), timestamps as aware datetimes."""
    from datetime import UTC, datetime

    rows: list[dict[str, Any]] = []
    if not directory.exists():
        return rows
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                for name in _TIMESTAMPS:
                    if name in row:
                        row[name] = datetime.fromisoformat(row[name]).replace(tzinfo=UTC)
                rows.append(row)
    return rows


def run_flink(
    bootstrap: str, topic: str, workdir: Path, *extra: str, env: dict[str, str] | None = None, standalone: bool = False
) -> JobRun:
    """The Flink job, bounded (up to the offsets at its start, every window emitted), into JSON under ``workdir``.

    ``standalone``: as for :func:`run_spark`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "tables"
    job = standalone_copy(FLINK_JOB, workdir / "job") if standalone else FLINK_JOB
    cmd = [
        str(FLINK_PYTHON),
        str(job),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--bounded",
        "--output",
        str(out),
        "--window",
        str(WINDOW_S),
        "--top",
        str(TOP),
        *jar_args("flink"),
        *extra,
    ]
    _, elapsed = _run_job(cmd, workdir / "flink.log", "flink_flows", env, job.parent if standalone else None)
    return JobRun(
        read_json_rows(out / "flows_by_window"),
        read_json_rows(out / "top_talkers"),
        read_json_rows(out / "connection_totals"),
        elapsed,
        read_json_rows(out / "bytes_by_zone_pair"),
    )
