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


def astuple_head(c) -> tuple:
    """Connection's fields before the counters (family .. tcp_state)."""
    return tuple(getattr(c, f.name) for f in dataclasses.fields(c)[:16])


def astuple_tail(c) -> tuple:
    """Connection's fields after the counters (start_ns .. icmp_id)."""
    return tuple(getattr(c, f.name) for f in dataclasses.fields(c)[20:])


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class MovingTable:
    """The Source port over a table whose counters grow at every dump (new entry objects, as a decoder makes).

    Its own work (making 250k entry objects per dump, standing in for the decoder measured elsewhere)
    is timed on the poll thread's CPU clock, so the loops' share of the process's CPU can be told apart.
    """

    def __init__(self, conns: list, batch: int = 2000) -> None:
        # Every field but the counters, in Connection's field order: a positional call per entry is
        # ~1 us, where dataclasses.replace took ~8 us and made the harness the larger cost.
        self.rows = [
            (astuple_head(c), c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes, astuple_tail(c))
            for c in conns
        ]
        self.batch = batch
        self.skipped = 0
        self.dumps = 0
        self.cpu_s = 0.0  # CPU seconds spent making entries

    def dump_buffers(self, apply, zones=None) -> None:
        return None  # synthetic rows, no netlink bytes: the exporter uses dump_into

    def dump_into(self, consume, zones=None) -> int:
        from flow_exporter.connection import Connection

        self.dumps += 1
        grow = self.dumps
        rows = self.rows
        for i in range(0, len(rows), self.batch):
            t0 = time.thread_time()
            batch = [Connection(*head, op + grow, ob + 1500 * grow, rp, rb, *tail)
                     for head, op, ob, rp, rb, tail in rows[i : i + self.batch]]  # fmt: skip
            self.cpu_s += time.thread_time() - t0
            consume(batch)
        return len(rows)

    def count(self) -> int:
        return len(self.rows)

    def max_entries(self) -> int:
        return 1 << 20

    def kernel_stats(self) -> dict[str, int]:
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_pipeline")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--window", type=float, default=60.0)
    args = ap.parse_args(argv)
    from devtools.kafka import KafkaBroker
    from flow_exporter import gc_policy
    from flow_exporter.app import Exporter, ExporterOptions
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
    table = MovingTable(conns)
    del conns
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker:
        broker.create_topic("pipeline", partitions=3)
        life = Lifecycle()
        sink = KafkaSink({"bootstrap.servers": broker.bootstrap}, "pipeline", RecordEncoder("bench"),
                         stopping=life.stopping)  # fmt: skip
        sink.missing_topics()
        cp = Checkpoint(Path(tmp) / "state")
        cp.lock()
        cp.begin(cp.load())
        rss_table = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the harness's table, before any poll
        exp = Exporter(
            table,
            sink,
            ExporterOptions(
                timeouts=Timeouts(5.0, 5.0, 15.0), node_name="bench", max_connections=250_000, max_in_flight=50_000,
                grace=10.0,
            ),
            lifecycle=life,
            checkpoint=cp,
        )  # fmt: skip
        runner = threading.Thread(target=exp.run)
        t_start = time.monotonic()
        runner.start()
        while sink.counters.acked < 2 * n and time.monotonic() - t_start < 120:  # past the first records
            time.sleep(0.5)
        a0, c0, w0, p0, t0 = sink.counters.acked, cpu(), time.monotonic(), exp.stats.polls, table.cpu_s
        time.sleep(args.window)
        a1, c1, w1, p1, t1 = sink.counters.acked, cpu(), time.monotonic(), exp.stats.polls, table.cpu_s
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
        "table_cpu_cores": (t1 - t0) / wall,
        "loops_cpu_cores": (c1 - c0 - (t1 - t0)) / wall,
        "table_rss_bytes": rss_table,
        "polls": p1 - p0,
        "max_rss_bytes": rss,
        "records_given_up": exp.stats.records_given_up,
        "snapshots": cp.stats.snapshots,
    }
    write_json("pipeline", result)
    print(result)

    title = f"the loops at {n:,} moving connections, poll 5 s, active 5 s"
    plot_load("pipeline", result["loops_cpu_cores"], result["records_per_s"], title)
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
        f"| ... of which the harness's table making entries (stands in for dump+decode) | "
        f"{result['table_cpu_cores']:.2f} cores |",
        f"| CPU of the loops (all threads minus the table) | {result['loops_cpu_cores']:.2f} cores |",
        f"| polls in the window | {result['polls']:.0f} |",
        f"| peak RSS | {rss / 2**20:,.0f} MiB ({rss_table / 2**20:,.0f} MiB of it the harness's table and imports) |",
        "",
        "![pipeline](performance/pipeline.png)",
    ]
    update_section("pipeline", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
