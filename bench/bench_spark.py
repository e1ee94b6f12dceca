"""Throughput of the downstream jobs (downstream/spark_flows.py, downstream/flink_flows.py) in local mode, records/s.

Synthetic but realistic input: connections live for many export rounds (so the per-connection
state and the dedup see repeated keys), records are built by the real store and encoded by the
exporter's encoder, and part-way through every connection is re-exported by a "restarted"
exporter (a fresh store), as after a DaemonSet rollout. Records are produced to a local broker,
then the job runs with ``--available-now`` into Parquet, once per mode, in batches of
``--batch`` records. Reported per mode: the steady rate (records over the busy time of the data
batches after the first, which pays for Python worker start, code generation and JIT), the
rate over all batches, and the process's wall time (JVM start included). The Parquet totals
are checked against the generator's: totals mode must be exact; deltas mode is not, by design
(the restart), and the check shows by how much.

Prints one JSON object. Usage: ``python -m bench.bench_spark --records 200000``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "downstream" / "spark_flows.py"
ACTIVE_S = 5.0


def synthetic_records(
    connections: int,
    rounds: int,
    groups: int,
    *,
    restart_round: int | None = None,
    start_ms: int | None = None,
    net: int = 1,
) -> tuple[list[tuple[bytes, bytes]], dict[tuple[str, str], tuple[int, int]]]:
    """(key, value) records of ``connections`` flows over ``rounds`` export rounds, and expected totals.

    Each round every connection's counters grow and it gets one active-timeout record; at
    ``restart_round`` the store is replaced by a fresh one, like a restarted exporter. Expected:
    per (source, destination) group, (packets, bytes) summed over both directions of the final
    kernel counters. Clients are 10.<net>.x.y, servers 10.<net+1>.x.y:8080.
    """
    from flow_exporter.connection import PROTO_TCP, Connection
    from flow_exporter.sink.encoder import RecordEncoder
    from flow_exporter.store import ConnectionStore, Export
    from flow_exporter.timeouts import Timeouts

    wall0_ms = start_ms if start_ms is not None else time.time_ns() // 1_000_000
    start_ns = (wall0_ms - 1000) * 1_000_000
    conns = []
    for i in range(connections):
        g = i % groups
        client = bytes([10, net, g >> 8, g & 0xFF])
        server = bytes([10, net + 1, g >> 8, g & 0xFF])
        sport = 1024 + (i // groups) % 60000
        conns.append(
            Connection(
                family=socket.AF_INET,
                proto=PROTO_TCP,
                orig_src=client,
                orig_dst=server,
                orig_sport=sport,
                orig_dport=8080,
                reply_src=server,
                reply_dst=client,
                reply_sport=8080,
                reply_dport=sport,
                ct_id=i + 1,
                tcp_state=3,
                start_ns=start_ns,
                status=0x18E,
            )
        )
    enc = RecordEncoder("bench-node").encode
    # Idle timeout out of reach: every connection is due once per round, as a busy one would be.
    timeouts = Timeouts(poll_interval=ACTIVE_S, active=ACTIVE_S, idle=3600.0)
    store = ConnectionStore(timeouts=timeouts)
    out: list[tuple[bytes, bytes]] = []

    def emit(exports: list[Export], now: float, wall_ms: int) -> None:
        for export in exports:
            out.append((export.flow_id.to_bytes(8, "big", signed=True), enc(export, wall_ms)))
            store.acknowledge(export, True, now)

    now, wall_ms = 0.0, wall0_ms
    for r in range(rounds + 1):
        if r == restart_round:
            emit(store.export_all(now), now, wall_ms)  # SIGTERM: forced final records
            store = ConnectionStore(timeouts=timeouts)
        for i, c in enumerate(conns):
            c.orig_packets += 3 + i % 5
            c.orig_bytes += 1500 * (3 + i % 5)
            c.reply_packets += 2 + i % 3
            c.reply_bytes += 900 * (2 + i % 3)
        now = r * ACTIVE_S
        wall_ms = wall0_ms + int(now * 1000)
        store.update(conns, now, wall_ms * 1_000_000)
        emit(store.expire(now, wall_ms * 1_000_000), now, wall_ms)
    emit(store.export_all(now), now, wall_ms)
    # The final (forced) records carry the last counters.
    expected: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for c in conns:
        key = (socket.inet_ntop(socket.AF_INET, c.orig_src), f"{socket.inet_ntop(socket.AF_INET, c.reply_src)}:8080")
        p, b = expected[key]
        expected[key] = (p + c.orig_packets + c.reply_packets, b + c.orig_bytes + c.reply_bytes)
    return out, dict(expected)


def produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]], *, confluent: bool = False) -> float:
    """Seconds to produce and flush ``records``; ``confluent`` prefixes the 5-byte wire header."""
    from confluent_kafka import Producer

    header = b"\x00" + (1).to_bytes(4, "big")  # magic byte, schema id 1
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 50, "compression.type": "lz4", "batch.size": 1 << 20}
    )
    t0 = time.perf_counter()
    for i, (key, value) in enumerate(records):
        while True:
            try:
                producer.produce(topic, header + value if confluent else value, key)
                break
            except BufferError:
                producer.poll(0.05)
        if i & 1023 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} records not delivered")
    return time.perf_counter() - t0


def run_job(bootstrap: str, topic: str, mode: str, out: Path, *extra: str) -> tuple[float, dict[str, Any]]:
    """Run the job with --available-now into Parquet at ``out``; (wall seconds, its summary line)."""
    from devtools.downstream import jar_args

    cmd = [
        sys.executable,
        str(JOB),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--available-now",
        "--mode",
        mode,
        "--output",
        str(out),
        *jar_args("spark"),
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"spark job failed ({proc.returncode}): {proc.stderr[-3000:]}")
    summary = next(json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"spark_flows"'))
    return wall, summary["spark_flows"]


def parquet_totals(out: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """Per group totals of the job's ``flows_by_window`` table (one directory per micro-batch)."""
    import pyarrow.dataset as ds

    sums: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    table = ds.dataset(str(out / "flows_by_window"), format="parquet", partitioning="hive").to_table()
    for row in table.to_pylist():
        key = (row["source"], row["destination"])
        p, b = sums[key]
        sums[key] = (p + row["packets"], b + row["bytes"])
    return dict(sums)


def run_flink(
    bootstrap: str, topic: str, out: Path, expected: dict[tuple[str, str], tuple[int, int]], confluent: bool
) -> dict[str, Any]:
    """The Flink job, bounded, on the same topic: wall time, its net job time, records/s, and its totals' check.

    With ``--confluent`` the values carry a header naming schema id 1, which the Flink job can only
    read through a registry: not measured then.
    """
    if confluent:
        return {"skipped": "the Flink job reads framed values only through a registry"}
    from devtools.downstream import jar_args

    cmd = [
        str(ROOT / ".venv-flink" / "bin" / "python"),
        str(ROOT / "downstream" / "flink_flows.py"),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--bounded",
        "--output",
        str(out),
        *jar_args("flink"),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"flink job failed ({proc.returncode}): {proc.stderr[-3000:]}")
    summary = next(json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"flink_flows"'))["flink_flows"]
    sums: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for path in (out / "flows_by_window").rglob("*"):
        if path.is_file() and not path.name.startswith((".", "_")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                key = (row["source"], row["destination"])
                sums[key] = (sums[key][0] + row["packets"], sums[key][1] + row["bytes"])
    want_bytes = sum(b for _, b in expected.values())
    got_bytes = sum(sums.get(k, (0, 0))[1] for k in expected)
    return {
        "wall_s": round(wall, 2),
        "job_seconds": summary["seconds"],
        "input_rows": summary["input_rows"],
        "records_per_s_job": round(summary["input_rows"] / summary["seconds"]) if summary["seconds"] else None,
        "records_per_s_wall": round(summary["input_rows"] / wall),
        "totals_equal_expected": all(sums.get(k) == v for k, v in expected.items()),
        "bytes_vs_expected": round(got_bytes / want_bytes, 4),
    }


def rates(summary: dict[str, Any]) -> dict[str, Any]:
    """Records/s overall and in steady state (data batches after the first)."""
    batches = [b for b in summary["per_batch"] if b["rows"] > 0]
    steady = batches[1:]
    steady_ms = sum(b["ms"] for b in steady)
    return {
        "records_per_s_all_batches": round(summary["input_rows"] / summary["batch_seconds"]),
        "records_per_s_steady": round(sum(b["rows"] for b in steady) / steady_ms * 1000) if steady_ms else None,
        "first_batch_s": round(batches[0]["ms"] / 1000, 2) if batches else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000, help="about this many records")
    ap.add_argument("--connections", type=int, default=5_000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--batch", type=int, default=40_000, help="records per micro-batch (maxOffsetsPerTrigger)")
    ap.add_argument("--modes", default="totals,deltas,flink", help="Spark modes, and flink for the Flink job")
    ap.add_argument("--confluent", action="store_true", help="values with the Confluent header (job --confluent)")
    ap.add_argument("--driver-java-options", default="", help="passed to the job")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from devtools.kafka import KafkaBroker
    from devtools.spark import ensure_spark_jars, spark_version

    ensure_spark_jars()
    rounds = max(1, args.records // args.connections - 2)  # two forced rounds come on top
    t0 = time.perf_counter()
    # Event times 1 h in the past, then one clock record 1 h ahead: every window closes.
    start_ms = time.time_ns() // 1_000_000 - 3_600_000
    records, expected = synthetic_records(
        args.connections, rounds, args.groups, restart_round=rounds // 2 + 1, start_ms=start_ms
    )
    clock, _ = synthetic_records(1, 1, 1, start_ms=time.time_ns() // 1_000_000 + 3_600_000, net=200)
    build_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "benchmark": "spark",
        "spark_version": spark_version(),
        "master": "local[2]",
        "cores": os.cpu_count(),
        "records": len(records),
        "connections": args.connections,
        "groups": args.groups,
        "partitions": args.partitions,
        "records_per_batch": args.batch,
        "confluent": args.confluent,
        "driver_java_options": args.driver_java_options,
        "build_records_s": round(build_s, 2),
        "modes": {},
    }
    extra = ["--max-offsets-per-trigger", str(args.batch)]
    if args.confluent:
        extra.append("--confluent")
    if args.driver_java_options:
        extra.append(f"--driver-java-options={args.driver_java_options}")
    with KafkaBroker() as broker, tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp:
        broker.create_topic("flows", partitions=args.partitions)
        result["produce_s"] = round(produce(broker.bootstrap, "flows", records + clock, confluent=args.confluent), 2)
        for mode in args.modes.split(","):
            out = Path(tmp) / mode
            if mode == "flink":
                result["modes"][mode] = run_flink(broker.bootstrap, "flows", out, expected, args.confluent)
                print(json.dumps({mode: result["modes"][mode]}), file=sys.stderr, flush=True)
                continue
            wall, summary = run_job(broker.bootstrap, "flows", mode, out, *extra)
            got = parquet_totals(out)
            want_bytes = sum(b for _, b in expected.values())
            got_bytes = sum(got.get(k, (0, 0))[1] for k in expected)
            result["modes"][mode] = {
                "wall_s": round(wall, 2),
                "batches": summary["batches"],
                "batch_seconds": summary["batch_seconds"],
                **rates(summary),
                "input_rows": summary["input_rows"],
                "totals_equal_expected": all(got.get(k) == v for k, v in expected.items()),
                "bytes_vs_expected": round(got_bytes / want_bytes, 4),
            }
            print(json.dumps({mode: result["modes"][mode]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
