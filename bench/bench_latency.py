"""End-to-end latency: a connection's last packet -> its end-of-flow record readable from the topic.

Real TCP exchanges run in the lab while the exporter (default timeouts except the
poll interval under test) produces to the local broker; a consumer records when
each connection's end-of-flow record arrives. Latency = arrival time minus the
time the exchange's last packet was sent (the lab's ``finished`` stamp).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import machine_line, plot, update_section, write_json


def run_once(poll: str, n: int, broker: object) -> dict:
    import fastavro
    from confluent_kafka import Consumer

    from devtools.lab import Lab
    from flow_exporter.record import load_schema
    from tests.support.exporter_process import start_exporter, stop_exporter

    bootstrap = broker.bootstrap  # type: ignore[attr-defined]
    topic = f"latency-{poll}-{time.time_ns()}"
    broker.create_topic(topic)  # type: ignore[attr-defined]
    schema = fastavro.parse_schema(load_schema())
    arrivals: dict[tuple[str, int], float] = {}
    stop = threading.Event()

    def consume() -> None:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "auto.offset.reset": "earliest"})
        c.subscribe([topic])
        while not stop.is_set():
            m = c.poll(0.05)
            if m is None or m.error():
                continue
            r = fastavro.schemaless_reader(io.BytesIO(m.value()), schema, schema)
            if r["flowEndReason"] == 3:
                arrivals.setdefault((r["sourceAddress"], r["sourcePort"]), time.time())
        c.close()

    th = threading.Thread(target=consume)
    th.start()
    with Lab(pods=2) as lab:
        p1, p2 = lab.pods
        log = Path(tempfile.mkdtemp()) / "exporter.log"
        proc = start_exporter(
            lab, bootstrap, topic, log, "--set", f"conntrack.pollInterval={poll}",
            "--set", "expiry.activeTimeout=5s", "--set", "expiry.idleTimeout=15s",
        )  # fmt: skip
        finished = {}
        try:
            for _ in range(n):
                ex = lab.tcp_exchange(p1, p2, 8000, 300, 3000)
                finished[(ex.client_ip, ex.client_port)] = time.time()
                time.sleep(0.05)
            deadline = time.time() + 30
            while time.time() < deadline and len(arrivals) < n:
                time.sleep(0.1)
            stop_exporter(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
            stop.set()
            th.join()
    lat = sorted(arrivals[k] - t for k, t in finished.items() if k in arrivals)
    return {
        "poll_interval": poll,
        "connections": n,
        "received": len(lat),
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max_s": lat[-1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--polls", default="1s,5s")
    args = p.parse_args(argv)
    from devtools.kafka import KafkaBroker

    rows = []
    with KafkaBroker() as broker:
        for poll in args.polls.split(","):
            row = run_once(poll, args.connections, broker)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json("latency", {"rows": rows})

    def draw(ax: object) -> None:
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["p50_s"] for r in rows], 0.4, label="p50")  # type: ignore[attr-defined]
        ax.bar([x + 0.2 for x in xs], [r["p99_s"] for r in rows], 0.4, label="p99")  # type: ignore[attr-defined]
        ax.set_xticks(list(xs), [f"poll {r['poll_interval']}" for r in rows])  # type: ignore[attr-defined]
        ax.set_ylabel("seconds from last packet to record in Kafka")  # type: ignore[attr-defined]
        ax.legend()  # type: ignore[attr-defined]

    plot("latency", draw)
    cmd = "python -m bench.bench_latency " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## End-to-end latency (last packet -> end-of-flow record readable from the topic)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line()}",
        "",
        "| poll interval | connections | received | p50 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['poll_interval']} | {r['connections']} | {r['received']} | {r['p50_s']:.2f} s | "
            f"{r['p99_s']:.2f} s | {r['max_s']:.2f} s |"
        )
    lines += [
        "",
        "A closed TCP connection is seen as ended at the first poll after its last packet (TIME_WAIT), and its",
        "record goes out at once, so latency is bounded by the poll interval plus the producer's linger.",
        "",
        "![latency](performance/latency.png)",
    ]
    update_section("latency", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
