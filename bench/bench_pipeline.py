"""The exporter's two loops at 250,000 connections whose counters all move: 50,000 records/s for a minute.

``Exporter.run`` as `flow-exporter run` drives it (poll and expire threads, a state directory, the
real Kafka sink and a local broker, the process's GC policy), fed by an in-memory table (the
Source port) whose every entry has new counters at every poll, so every connection is due at
every active timeout. What this leaves out is the kernel dump and its decoding, measured on a
real 250k table by bench_node (its poll) and bench_poll; their sum is the node's whole cost.
CPU is the process's (all threads, librdkafka's included), per second of wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import plot_load, section_head, tcp_conn, update_section, write_json


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class MovingTable:
    """The Source port over a table whose counters grow at every dump (new entry objects, as a decoder makes)."""

    def __init__(self, conns: list, batch: int = 2000) -> None:
        self.conns = conns
        self.batch = batch
        self.skipped = 0
        self.dumps = 0

    def dump_into(self, consume, zones=None) -> int:
        self.dumps += 1
        grow = self.dumps
        replace = dataclasses.replace
        conns = self.conns
        for i in range(0, len(conns), self.batch):
            consume([replace(c, orig_packets=c.orig_packets + grow, orig_bytes=c.orig_bytes + 1500 * grow)
                     for c in conns[i : i + self.batch]])  # fmt: skip
        return len(conns)

    def count(self) -> int:
        return len(self.conns)

    def max_entries(self) -> int:
        return 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_pipeline")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--window", type=float, default=60.0)
    args = ap.parse_args(argv)
    from devtools.kafka import KafkaBroker
    from flow_exporter import gc_policy
    from flow_exporter.app import Exporter
    from flow_exporter.checkpoint import Checkpoint
    from flow_exporter.lifecycle import Lifecycle
    from flow_exporter.sink import KafkaSink
    from flow_exporter.sink.encoder import RecordEncoder
    from flow_exporter.timeouts import Timeouts

    gc_policy.tune()
    n = args.connections
    start = time.time_ns() - 10**9
    conns = [
        tcp_conn(i, bytes([10, 1 + (i >> 16), (i >> 8) & 0xFF, i & 0xFF]), bytes([10, 200, (i >> 8) & 0x3F, 1]),
                 1024 + i % 60000, 10, start_ns=start)
        for i in range(n)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker:
        broker.create_topic("pipeline", partitions=3)
        life = Lifecycle()
        sink = KafkaSink({"bootstrap.servers": broker.bootstrap}, "pipeline", RecordEncoder("bench").encode,
                         stopping=life.stopping)  # fmt: skip
        sink.missing_topics()
        cp = Checkpoint(Path(tmp) / "state")
        cp.lock()
        cp.begin(cp.load())
        table = MovingTable(conns)
        exp = Exporter(table, sink, timeouts=Timeouts(5.0, 5.0, 15.0, 300.0), node_name="bench", lifecycle=life,
                       checkpoint=cp, max_connections=250_000, max_in_flight=50_000,  # the DaemonSet's limits
                       grace=10.0)  # fmt: skip
        runner = threading.Thread(target=exp.run)
        t_start = time.monotonic()
        runner.start()
        while sink.counters.acked < 2 * n and time.monotonic() - t_start < 120:  # past the first records
            time.sleep(0.5)
        a0, c0, w0, p0 = sink.counters.acked, cpu(), time.monotonic(), exp.stats.polls
        time.sleep(args.window)
        a1, c1, w1, p1 = sink.counters.acked, cpu(), time.monotonic(), exp.stats.polls
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        exp.stop()
        runner.join(60)
        cp.close()
    wall = w1 - w0
    result = {
        "connections": n,
        "window_s": wall,
        "records_per_s": (a1 - a0) / wall,
        "cpu_cores": (c1 - c0) / wall,
        "polls": p1 - p0,
        "max_rss_bytes": rss,
        "records_given_up": exp.stats.records_given_up,
        "snapshots": cp.stats.snapshots,
    }
    write_json("pipeline", result)
    print(result)

    title = f"the loops at {n:,} moving connections, poll 5 s, active 5 s"
    plot_load("pipeline", result["cpu_cores"], result["records_per_s"], title)
    lines = [
        *section_head("The loops at 250k moving connections (50,000 records/s due)", "bench.bench_pipeline", argv),
        "`Exporter.run` (poll and expire threads, state directory, the Kafka sink, a local broker with 3 partitions)",
        f"over an in-memory table of {n:,} connections whose counters all move at every poll (poll 5 s, active",
        f"timeout 5 s): every connection is due every 5 s. Measured over {wall:.0f} s after the first records.",
        "The kernel dump and decode are not in this figure: add the poll of bench_node (same table size).",
        "",
        "| measure | result |",
        "|---|---:|",
        f"| records acknowledged | {result['records_per_s']:,.0f}/s |",
        f"| CPU, all threads | {result['cpu_cores']:.2f} cores |",
        f"| polls in the window | {result['polls']:.0f} |",
        f"| peak RSS | {rss / 2**20:,.0f} MiB |",
        "",
        "![pipeline](bench/results/pipeline.png)",
    ]
    update_section("pipeline", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
