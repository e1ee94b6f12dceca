"""The node pipeline against a three-broker cluster (acks=all, replication 3), beside a plain loop on it.

`flow-exporter run` on a table of synthetic conntrack entries, measured as bench_node measures it, but producing
to a topic on devtools.kafka_cluster's three KRaft brokers (3 partitions, replication 3, min.insync.replicas 2)
instead of one broker; then, in the same run and on the same cluster, a plain confluent-kafka loop with the
exporter's producer settings sends as many records of the same size as fast as it can, until the last is
acknowledged. On one 2-core machine the three brokers share the cores with the exporter and the loop: the
figures are the cluster's cost on that machine, not a cluster's capacity.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.bench_app_export import plain_loop
from bench.bench_node import measure
from bench.common import plot, section_head, update_section, write_json


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cluster")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    ap.add_argument("--active", default="5s")
    ap.add_argument("--idle", default="1h")
    ap.add_argument("--plain", type=int, default=500_000, help="records the plain loop sends")
    ap.add_argument("--runs", type=int, default=3, help="runs, each the cluster then the single broker")
    args = ap.parse_args(argv)
    from devtools.kafka import KafkaBroker
    from devtools.kafka_cluster import KafkaCluster
    from devtools.lab import Lab
    from flow_exporter.sink.kafka import PRODUCER_DEFAULTS

    n = args.connections
    size = 157  # the benchmark's records (bench_app_export: record_bytes)
    config = {k: v for k, v in PRODUCER_DEFAULTS.items() if k != "statistics.interval.ms"}
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        KafkaCluster(Path(tmp) / "cluster") as cluster,
        KafkaBroker(Path(tmp) / "single") as single,
        Lab(pods=1) as lab,
    ):
        ns = lab.table_ns()
        lab.load_synthetic(n, netns=ns, timeout=3600)
        for r in range(args.runs):
            # Interleaved, so that a drift of the machine over the runs touches both alike.
            run: dict[str, Any] = {}
            for name, target in (("cluster", cluster), ("single", single)):
                node = measure(ns, target, Path(tmp), n, active=args.active, idle=args.idle, pure=False,
                               window=args.window, topic=f"node-{name}-{r}")  # fmt: skip
                target.create_topic(f"plain-{name}-{r}", partitions=3)
                payloads = [(f"plain-{name}-{r}", i.to_bytes(13, "big"), bytes(size)) for i in range(args.plain)]
                rate, cpu = plain_loop(target.bootstrap, config, payloads)
                run[name] = {
                    "exporter_cpu_cores": node["cpu_cores"],
                    "exporter_records_per_s": node["records_per_s"],
                    "demanded_per_s": node["demanded_per_s"],
                    "exporter_peak_rss_bytes": node["peak_rss_bytes"],
                    "first_records_all_acked_s": node["first_records_all_acked_s"],
                    "plain_loop_records_per_s": rate,
                    "plain_loop_cpu_cores": cpu,
                    "load_average_1m": node["load_average_1m"],
                }
                print(r, name, run[name], flush=True)
            runs.append(run)

    def med(where: str, key: str) -> float:
        return _median([float(run[where][key]) for run in runs])

    keys = ("exporter_cpu_cores", "exporter_records_per_s", "exporter_peak_rss_bytes", "first_records_all_acked_s",
            "plain_loop_records_per_s", "plain_loop_cpu_cores")  # fmt: skip
    medians = {where: {k: med(where, k) for k in keys} for where in ("cluster", "single")}
    result = {
        "connections": n, "active_timeout": args.active, "idle_timeout": args.idle, "window_s": args.window,
        "cluster": {"brokers": 3, "replication": 3, "min_insync_replicas": 2, "partitions": 3},
        "single": {"brokers": 1, "replication": 1, "partitions": 3},
        "runs": runs, "medians": medians,
        "ratios_cluster_over_single": {k: medians["cluster"][k] / medians["single"][k] for k in keys},
    }  # fmt: skip
    write_json("cluster", result)
    print(json.dumps(result["medians"]))
    _plot(runs)
    demanded = runs[0]["cluster"]["demanded_per_s"]
    c, s1 = medians["cluster"], medians["single"]

    def every(where: str, key: str, fmt: str) -> str:
        return ", ".join(format(run[where][key], fmt) for run in runs)

    lines = [
        *section_head(
            f"The node pipeline against a three-broker cluster ({n:,} connections, active {args.active})",
            "bench.bench_cluster",
            argv,
        ),
        f"`flow-exporter run` on {n:,} synthetic conntrack entries (poll 5 s, active {args.active}, idle "
        f"{args.idle}, events, state.dir and metrics on), {args.window:.0f} s of steady state, producing to a topic "
        "on three KRaft brokers in network namespaces of this machine (3 partitions, replication 3, "
        "min.insync.replicas 2, acks=all), then the same to one broker (3 partitions, replication 1), "
        f"{args.runs} runs interleaved; after each, on the same brokers, a plain confluent-kafka loop with the "
        f"exporter's producer settings sends {args.plain:,} records of 157 bytes until the last is acknowledged. "
        "The brokers share the 2 cores with the exporter and the loop: the figures are the cluster's cost on "
        "this machine, not a cluster's capacity."
        + ("" if demanded is None else f" The table demands {demanded:,.0f} records/s."),
        "",
        "| measure (median; every run) | three brokers, RF 3 | one broker | ratio |",
        "|---|---:|---:|---:|",
        f"| exporter CPU, user + system (cores) | {c['exporter_cpu_cores']:.2f} "
        f"({every('cluster', 'exporter_cpu_cores', '.2f')}) | {s1['exporter_cpu_cores']:.2f} "
        f"({every('single', 'exporter_cpu_cores', '.2f')}) | "
        f"{c['exporter_cpu_cores'] / s1['exporter_cpu_cores']:.2f} |",
        f"| exporter records acknowledged (/s) | {c['exporter_records_per_s']:,.0f} "
        f"({every('cluster', 'exporter_records_per_s', ',.0f')}) | {s1['exporter_records_per_s']:,.0f} "
        f"({every('single', 'exporter_records_per_s', ',.0f')}) | "
        f"{c['exporter_records_per_s'] / s1['exporter_records_per_s']:.3f} |",
        f"| exporter peak RSS (MiB) | {c['exporter_peak_rss_bytes'] / 2**20:,.0f} | "
        f"{s1['exporter_peak_rss_bytes'] / 2**20:,.0f} | "
        f"{c['exporter_peak_rss_bytes'] / s1['exporter_peak_rss_bytes']:.2f} |",
        f"| every connection's first record acknowledged after start (s) | {c['first_records_all_acked_s']:.1f} "
        f"({every('cluster', 'first_records_all_acked_s', '.1f')}) | {s1['first_records_all_acked_s']:.1f} "
        f"({every('single', 'first_records_all_acked_s', '.1f')}) | "
        f"{c['first_records_all_acked_s'] / s1['first_records_all_acked_s']:.2f} |",
        f"| plain loop, records acknowledged (/s) | {c['plain_loop_records_per_s']:,.0f} "
        f"({every('cluster', 'plain_loop_records_per_s', ',.0f')}) | {s1['plain_loop_records_per_s']:,.0f} "
        f"({every('single', 'plain_loop_records_per_s', ',.0f')}) | "
        f"{c['plain_loop_records_per_s'] / s1['plain_loop_records_per_s']:.2f} |",
        f"| plain loop CPU (cores) | {c['plain_loop_cpu_cores']:.2f} | {s1['plain_loop_cpu_cores']:.2f} | "
        f"{c['plain_loop_cpu_cores'] / s1['plain_loop_cpu_cores']:.2f} |",
        "",
        "Load average (1 min) at each window's end, cluster / single: "
        + "; ".join(f"{run['cluster']['load_average_1m']:.2f} / {run['single']['load_average_1m']:.2f}" for run in runs)
        + ".",
        "",
        "![exporter CPU per run, and the plain loop's rate](performance/cluster.png)",
    ]
    update_section("cluster", "\n".join(lines))
    return 0


def _plot(runs: list[dict[str, Any]]) -> None:
    """Per run: the exporter's CPU on the cluster and on one broker; the plain loop's rate on each (right axis)."""

    def draw(ax: Any) -> None:
        x = list(range(1, len(runs) + 1))
        ax.bar(
            [i - 0.2 for i in x], [r["cluster"]["exporter_cpu_cores"] for r in runs], 0.4, label="exporter, 3 brokers"
        )
        ax.bar([i + 0.2 for i in x], [r["single"]["exporter_cpu_cores"] for r in runs], 0.4, label="exporter, 1 broker")
        ax.set_xlabel("run")
        ax.set_ylabel("exporter CPU (cores)")
        ax.set_xticks(x)
        right = ax.twinx()
        right.plot(x, [r["cluster"]["plain_loop_records_per_s"] for r in runs], "o-", color="black",
                   label="plain loop, 3 brokers")  # fmt: skip
        right.plot(x, [r["single"]["plain_loop_records_per_s"] for r in runs], "s--", color="grey",
                   label="plain loop, 1 broker")  # fmt: skip
        right.set_ylabel("plain loop records/s")
        right.set_ylim(bottom=0)
        ax.legend(loc="lower left")
        right.legend(loc="lower right")
        ax.set_title("250k connections, active 5 s: the exporter on three brokers (RF 3) and on one")

    plot("cluster", draw)


if __name__ == "__main__":
    sys.exit(main())
