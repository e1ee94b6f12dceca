"""``make spark-job`` / ``make flink-job``: a downstream job against the local broker, with real flows in it.

Without ``--bootstrap-servers`` it sets up what production looks like, on this machine: a local
Kafka broker (KRaft) with a SCRAM user, a local Schema Registry (devtools.registry), a namespace
lab with the exporter writing to the SASL listener with registry framing, ``--duration`` seconds
of real traffic (the demo's), and then the job, reading over SCRAM with the registry, runs once
over what the topic holds (Spark ``--available-now``, Flink ``--bounded``) and its four tables
are printed. With ``--bootstrap-servers`` and ``--topic`` it only runs the job against that
broker; any further arguments after ``--`` go to the job unchanged. Either way the connector jars
are resolved here (devtools.spark, devtools.flink) and given to the job with ``--jars``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from devtools.registry import RegistryServer

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"spark": ROOT / "downstream" / "spark_flows.py", "flink": ROOT / "downstream" / "flink_flows.py"}
FLINK_PYTHON = ROOT / ".venv-flink" / "bin" / "python"
TOPIC = "flows"
USER, PASSWORD = "flows", "flows-local-secret"
TABLES = ("flows_by_window", "top_talkers", "bytes_by_zone_pair", "connection_totals")


def _say(msg: str) -> None:
    print(f"downstream: {msg}", flush=True)


def jar_args(job: str) -> list[str]:
    """The arguments that give a job its connector jars (resolved once with Maven into ``.cache``).

    The jobs stand alone: they never look for jars themselves, the harness passes ``--jars`` (and,
    for Flink, ``--log-dir``: Flink's own log beside its jars in the cache).
    """
    if job == "spark":
        from devtools.spark import ensure_spark_jars

        return ["--jars", ",".join(str(j) for j in ensure_spark_jars())]
    from devtools.flink import cache_dir, ensure_flink_jars

    return ["--jars", ",".join(str(j) for j in ensure_flink_jars()), "--log-dir", str(cache_dir() / "log")]


def job_command(job: str, bootstrap: str, topic: str, output: Path, extra: list[str]) -> list[str]:
    """The job's command line for one run over what the topic holds now, tables under ``output``."""
    if job == "spark":
        return [
            sys.executable, str(JOBS["spark"]), "--bootstrap-servers", bootstrap, "--topic", topic,
            "--available-now", "--output", str(output), "--window", "10 seconds",
            "--driver-java-options=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC", *jar_args("spark"), *extra,
        ]  # fmt: skip
    python = str(FLINK_PYTHON) if FLINK_PYTHON.exists() else sys.executable
    return [
        python, str(JOBS["flink"]), "--bootstrap-servers", bootstrap, "--topic", topic,
        "--bounded", "--output", str(output), "--window", "10", *jar_args("flink"), *extra,
    ]  # fmt: skip


def read_table(directory: Path) -> list[dict[str, Any]]:
    """A table the job wrote: Parquet (Spark, one directory per batch) or JSON lines (Flink)."""
    if not directory.exists():
        return []
    parquet = list(directory.rglob("*.parquet"))
    if parquet:
        import pyarrow.dataset as ds

        rows = ds.dataset(str(directory), format="parquet", partitioning="hive").to_table().to_pylist()
        return [{k: v for k, v in r.items() if k != "batch"} for r in rows]
    rows = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return rows


def print_table(name: str, rows: list[dict[str, Any]], columns: list[str], limit: int = 25) -> None:
    print(f"\n{name}: {len(rows)} rows" + (f" (first {limit})" if len(rows) > limit else ""))
    if not rows:
        return
    cells = [[str(r.get(c, "")) for c in columns] for r in rows[:limit]]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def show_tables(output: Path) -> int:
    """Print the four tables; the number of window rows (0 means the job produced nothing)."""
    windows = sorted(read_table(output / "flows_by_window"), key=lambda r: (str(r["window_start"]), -r["bytes"]))
    talkers = sorted(read_table(output / "top_talkers"), key=lambda r: (str(r["window_start"]), r["rank"]))
    zones = sorted(read_table(output / "bytes_by_zone_pair"), key=lambda r: (str(r["window_start"]), -r["bytes"]))
    conns = sorted(read_table(output / "connection_totals"), key=lambda r: -r["bytes"])
    print_table("flows_by_window", windows, ["window_start", "source", "destination", "packets", "bytes"])
    print_table("top_talkers", talkers, ["window_start", "rank", "source", "destination", "bytes"])
    print_table("bytes_by_zone_pair", zones, ["window_start", "source_zone", "destination_zone", "packets", "bytes"])
    print_table(
        "connection_totals",
        conns,
        ["connectionId", "source", "destination", "records", "forward_bytes", "reverse_bytes", "bytes"],
    )
    return len(windows)


def run_job(job: str, bootstrap: str, topic: str, output: Path, extra: list[str], env: dict[str, str]) -> int:
    cmd = job_command(job, bootstrap, topic, output, extra)
    shown = [f"<{len(a.split(','))} jars>" if prev == "--jars" else a for prev, a in itertools.pairwise(cmd)]
    _say(f"running the {job} job: " + " ".join(a for a in shown if PASSWORD not in a))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, check=False)
    _say(f"{job} job exited with {proc.returncode} after {time.monotonic() - t0:.0f}s; tables under {output}")
    if proc.returncode != 0:
        return proc.returncode
    return 0 if show_tables(output) else 1


def with_local_flows(job: str, duration: float, extra: list[str]) -> int:
    """Broker, registry, lab, exporter, traffic; then the job over SCRAM with the registry."""
    from devtools.demo import _traffic

    work = Path(tempfile.mkdtemp(prefix=f"flow-exporter-{job}-"))
    _say("starting the Kafka broker (KRaft) with a SCRAM user, and a local Schema Registry")
    with KafkaBroker(work / "kafka", scram_users={USER: PASSWORD}) as broker, RegistryServer() as registry:
        assert broker.sasl_bootstrap is not None
        broker.create_topic(TOPIC, partitions=2)
        with Lab(pods=3) as lab:
            log_path = work / "exporter.log"
            cmd = [
                sys.executable, "-m", "flow_exporter", "run", "--netns", lab.node_ns,
                "--bootstrap-servers", broker.sasl_bootstrap, "--topic", TOPIC, "--node-name", "local-node",
                "--set", "conntrack.pollInterval=1s", "--set", "expiry.activeTimeout=5s",
                "--set", "metrics.port=0", "--set", "kafka.securityProtocol=SASL_PLAINTEXT",
                "--set", "kafka.sasl.mechanism=SCRAM-SHA-512", "--set", f"kafka.sasl.username={USER}",
                "--set", f"schemaRegistry.url={registry.url}",
            ]  # fmt: skip
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLOW_EXPORTER_KAFKA_SASL_PASSWORD": PASSWORD}
            with log_path.open("wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                _say(f"exporter running (log: {log_path}); {duration:.0f}s of traffic")
                errors: list[str] = []
                worker = threading.Thread(target=_traffic, args=(lab, duration, errors))
                worker.start()
                worker.join()
                time.sleep(2.0)
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
            if rc != 0:
                print(log_path.read_text(), file=sys.stderr)
                _say(f"exporter exited with {rc}")
                return 1
        security = ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "SCRAM-SHA-512"]
        security += ["--sasl-username", USER, "--schema-registry", registry.url]
        if job == "spark":
            # The traffic is over: no lateness to wait for. Spark emits a window once the
            # watermark passes its end, so the newest window stays in the checkpoint.
            security += ["--watermark", "0 seconds"]
        return run_job(
            job, broker.sasl_bootstrap, TOPIC, work / "tables", [*security, *extra], {"FLOW_SASL_PASSWORD": PASSWORD}
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.downstream", description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=sorted(JOBS))
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of lab traffic (local flows only)")
    ap.add_argument("--bootstrap-servers", help="run against this broker instead of a local one with lab flows")
    ap.add_argument("--topic", default=TOPIC)
    ap.add_argument("--output", type=Path, help="tables directory (default: a new temporary one)")
    ap.add_argument("extra", nargs="*", help="after --: more arguments for the job")
    args = ap.parse_args(argv)
    if args.bootstrap_servers:
        output = args.output or Path(tempfile.mkdtemp(prefix=f"flow-exporter-{args.job}-")) / "tables"
        return run_job(args.job, args.bootstrap_servers, args.topic, output, args.extra, {})
    if os.geteuid() != 0:
        print("downstream: the local lab needs root (network namespaces); or give --bootstrap-servers", file=sys.stderr)
        return 2
    return with_local_flows(args.job, args.duration, args.extra)


if __name__ == "__main__":
    sys.exit(main())
