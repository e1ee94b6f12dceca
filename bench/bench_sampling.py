"""Consistent sampling (issue 42): what deciding costs per row, and a 1M-entry node at p = 1/16 beside p = 1.

Deciding: ``--rows`` conntrack rows as dump bytes (the kernel's netlink messages), applied to a store by the
fused poll as a steady poll does (third poll of the same table, medians of ``--runs``): every row known and
unmoved at p = 1 (the fast path: no decision at all), against every row dropped (p = 2**-32: walked, hashed,
remembered in the dropped set; never a store row). The difference is the cost of deciding for a dropped
connection. Beside them, ``Sampler.select`` on Connections (the events' and the Cilium source's path).

``--node``: ``flow-exporter run`` on ``--connections`` real conntrack entries (``conntrack -R``) with production
settings (poll 5 s, active 60 s, state dir, events, metrics), at sampling.probability 1 and then 1/16 on the
same table in the same run, each measured over ``--window`` seconds of steady state (bench_node.measure).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import plot, section_head, update_section, write_json


def rows(n: int) -> list[Any]:
    from flow_exporter.connection import PROTO_TCP, Connection

    out = []
    for k in range(n):
        src = bytes([10, 1 + (k >> 16) % 200, (k >> 8) & 255, k & 255])
        dst = bytes([192, 168, k % 200, 1])
        out.append(Connection(socket.AF_INET, PROTO_TCP, src, dst, 1024 + k % 60000, 443, dst, src, 443,
                              1024 + k % 60000, ct_id=k + 1, tcp_state=3, orig_packets=5, orig_bytes=500,
                              reply_packets=4, reply_bytes=400, start_ns=1))  # fmt: skip
    return out


def poll_ns(store: Any, buffers: list[bytes], n: int, runs: int) -> tuple[float, list[float]]:
    """ns per row of a steady poll: two polls first, then ``runs`` timed ones."""
    from collections import Counter

    times = []
    for i in range(2 + runs):
        t0 = time.perf_counter()
        store.begin_poll(1)
        for b in buffers:
            store.apply_dump_buffer(memoryview(b), None, 100.0 + i, 10**18 + i, Counter())
        store.end_poll(100.0 + i, 10**18 + i)
        if i >= 2:
            times.append((time.perf_counter() - t0) / n * 1e9)
    return statistics.median(times), times


def decide(n: int, runs: int) -> dict[str, Any]:
    from flow_exporter import compiled
    from flow_exporter.sampling import Sampler
    from flow_exporter.store import ConnectionStore
    from flow_exporter.timeouts import Timeouts
    from tests.support.netlink_messages import encode_connection

    conns = rows(n)
    msgs = [encode_connection(c) for c in conns]
    buffers = [b"".join(msgs[k : k + 200]) for k in range(0, n, 200)]  # ~32 KiB: a receive buffer's worth
    timeouts = Timeouts(poll_interval=5, active=3600, idle=3600)
    kept_med, kept_runs = poll_ns(ConnectionStore(timeouts, max_connections=n), buffers, n, runs)
    sampler = Sampler(2.0**-32, "bench")
    dropped_med, dropped_runs = poll_ns(ConnectionStore(timeouts, max_connections=n, sampler=sampler), buffers, n, runs)
    assert sampler.dropped == n, sampler.dropped  # every row dropped, each counted once
    # The dropped set's memory per dropped connection, at its fullest: in a dump, the last dump's set beside this one's.
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    s = Sampler(2.0**-32, "bench")
    s.select(conns)
    s.dump_done()
    s.select(conns)
    memory = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    select = []
    for _ in range(runs):
        s = Sampler(2.0**-32, "bench")
        t0 = time.perf_counter()
        s.select(conns)
        select.append((time.perf_counter() - t0) / n * 1e9)
    return {
        "rows": n,
        "build": compiled.describe(),
        "known_row_p1_ns": kept_med,
        "known_row_p1_runs": kept_runs,
        "dropped_row_ns": dropped_med,
        "dropped_row_runs": dropped_runs,
        "deciding_ns": dropped_med - kept_med,
        "select_connection_ns": statistics.median(select),
        "select_connection_runs": select,
        "dropped_set_bytes_per_connection": memory,
    }


def node(n: int, window: float, idle: str) -> dict[str, Any]:
    from bench.bench_node import measure
    from devtools.kafka import KafkaBroker
    from devtools.lab import Lab

    out = {}
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker, Lab(pods=1) as lab:
        ns = lab.table_ns()
        lab.load_synthetic(n, netns=ns, timeout=3600)
        for name, p in (("p1", "1"), ("p16", "1/16")):
            out[name] = measure(ns, broker, Path(tmp), n, active="60s", idle=idle, pure=False, window=window,
                                topic=f"sampling-{name}", sampling=p)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_sampling")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--node", action="store_true", help="also the whole node at p = 1 and 1/16")
    ap.add_argument("--connections", type=int, default=1_000_000)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--idle", action="append",
                    help="expiry.idleTimeout of a node run (repeatable; default 15s, a quiet table, and 1h, every "
                         "entry due once per active timeout: the table's full record demand)")  # fmt: skip
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"decide": decide(args.rows, args.runs)}
    if args.node:
        result["node"] = {idle: node(args.connections, args.window, idle) for idle in args.idle or ["15s", "1h"]}
    write_json("sampling", result)
    print(result)
    report(result, argv)
    return 0


def report(r: dict[str, Any], argv: list[str] | None) -> None:
    d = r["decide"]
    lines = [
        *section_head("Sampling: deciding, and a node at p = 1/16", "bench.bench_sampling", argv),
        f"Deciding ({d['rows']:,} rows of dump bytes, a steady poll through the fused walk, {d['build']} build, "
        "median of the runs, ns per row):",
        "",
        "| row | ns per row | runs |",
        "|---|---:|---|",
        f"| known and unmoved, p = 1 (no decision) | {d['known_row_p1_ns']:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in d['known_row_p1_runs'])} |",
        f"| dropped (walked, hashed, kept in the dropped set) | {d['dropped_row_ns']:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in d['dropped_row_runs'])} |",
        f"| `Sampler.select`, a Connection (events, the Cilium source) | {d['select_connection_ns']:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in d['select_connection_runs'])} |",
        "",
        f"Deciding for a dropped connection costs {d['deciding_ns']:+.0f} ns per row per poll against a known row "
        f"at p = 1. The dropped set holds {d['dropped_set_bytes_per_connection']:.0f} bytes per dropped connection at "
        "its fullest (during a dump: the last dump's keys beside this one's; tracemalloc).",
    ]
    for idle, runs in r.get("node", {}).items():
        a, b = runs["p1"], runs["p16"]
        demand = "a quiet table (synthetic entries carry no traffic: after the idle timeout nothing is due)"
        if a.get("demanded_per_s"):
            demand = f"every entry due once per active timeout ({a['demanded_per_s']:,.0f} records/s demanded at p = 1)"
        lines += [
            "",
            f"The node, idle timeout {idle}: `flow-exporter run` on {a['connections']:,} real conntrack entries, "
            "production settings (poll 5 s, active 60 s, state dir, events, metrics), the same table, one run after "
            f"the other; {demand}; load average {a['load_average_1m']:.2f} and {b['load_average_1m']:.2f} at their "
            "ends (one run each).",
            "",
            "| measure | p = 1 | p = 1/16 | ratio |",
            "|---|---:|---:|---:|",
        ]
        rows_ = [
            ("connections kept (tracked)", "tracked", "{:,.0f}"),
            ("CPU, user + system, cores", "cpu_cores", "{:.2f}"),
            ("CPU, user, cores", "cpu_user_cores", "{:.2f}"),
            ("CPU, system (the kernel's dump, the state dir), cores", "cpu_system_cores", "{:.2f}"),
            ("poll, mean, s", "poll_seconds_mean", "{:.2f}"),
            ("records acknowledged, /s", "records_per_s", "{:,.0f}"),
            ("RSS, MiB", "rss_bytes", "{:,.0f}"),
            ("peak RSS, MiB", "peak_rss_bytes", "{:,.0f}"),
        ]
        for label, key, fmt in rows_:
            va, vb = a[key] or 0, b[key] or 0
            if key.endswith("bytes"):
                va, vb = va / 2**20, vb / 2**20
            lines.append(f"| {label} | {fmt.format(va)} | {fmt.format(vb)} | {vb / va if va else 0:.2f} |")
    if "node" in r:
        runs_by_idle = r["node"]

        def draw(ax: Any) -> None:
            labels, ones, sixteenths = [], [], []
            for idle, runs in runs_by_idle.items():
                labels += [f"CPU, cores\nidle {idle}", f"RSS, GiB\nidle {idle}"]
                ones += [runs["p1"]["cpu_cores"], runs["p1"]["rss_bytes"] / 2**30]
                sixteenths += [runs["p16"]["cpu_cores"], runs["p16"]["rss_bytes"] / 2**30]
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], ones, 0.4, label="p = 1")
            ax.bar([x + 0.2 for x in xs], sixteenths, 0.4, label="p = 1/16")
            ax.set_xticks(list(xs), labels)
            ax.legend()
            ax.set_title("flow-exporter run, 1M conntrack entries, active 60 s: p = 1 beside p = 1/16")

        plot("sampling", draw)
        lines += ["", "![sampling](performance/sampling.png)"]
    update_section("sampling", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
