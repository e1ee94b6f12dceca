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
import sys
import tempfile
from pathlib import Path

from bench.bench_app_export import plain_loop
from bench.bench_node import measure
from bench.common import section_head, update_section, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cluster")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    ap.add_argument("--active", default="5s")
    ap.add_argument("--idle", default="1h")
    ap.add_argument("--plain", type=int, default=500_000, help="records the plain loop sends")
    args = ap.parse_args(argv)
    from devtools.kafka_cluster import KafkaCluster
    from devtools.lab import Lab
    from flow_exporter.sink.kafka import PRODUCER_DEFAULTS

    n = args.connections
    with tempfile.TemporaryDirectory() as tmp, KafkaCluster(Path(tmp) / "cluster") as cluster, Lab(pods=1) as lab:
        ns = lab.table_ns()
        lab.load_synthetic(n, netns=ns, timeout=3600)
        node = measure(ns, cluster, Path(tmp), n, active=args.active, idle=args.idle, pure=False,
                       window=args.window, topic="node")  # fmt: skip
        cluster.create_topic("plain", partitions=3)
        size = 157  # the benchmark's records (bench_app_export: record_bytes)
        payloads = [("plain", i.to_bytes(13, "big"), bytes(size)) for i in range(args.plain)]
        config = {k: v for k, v in PRODUCER_DEFAULTS.items() if k != "statistics.interval.ms"}
        plain_rate, plain_cpu = plain_loop(cluster.bootstrap, config, payloads)
    result = {
        "connections": n,
        "active_timeout": args.active,
        "idle_timeout": args.idle,
        "brokers": 3,
        "replication": 3,
        "min_insync_replicas": 2,
        "exporter_cpu_cores": node["cpu_cores"],
        "exporter_records_per_s": node["records_per_s"],
        "demanded_per_s": node["demanded_per_s"],
        "exporter_peak_rss_bytes": node["peak_rss_bytes"],
        "first_records_all_acked_s": node["first_records_all_acked_s"],
        "plain_loop_records": args.plain,
        "plain_loop_records_per_s": plain_rate,
        "plain_loop_cpu_cores": plain_cpu,
        "load_average_1m": node["load_average_1m"],
    }
    write_json("cluster", result)
    print(result)
    demanded = node["demanded_per_s"]
    lines = [
        *section_head(
            f"The node pipeline against a three-broker cluster ({n:,} connections, active {args.active})",
            "bench.bench_cluster",
            argv,
        ),
        f"`flow-exporter run` on {n:,} synthetic conntrack entries (poll 5 s, active {args.active}, idle "
        f"{args.idle}, events, state.dir and metrics on), producing to a topic on three KRaft brokers in network "
        "namespaces of this machine (3 partitions, replication 3, min.insync.replicas 2, acks=all); then, in the "
        f"same run, a plain confluent-kafka loop with the exporter's producer settings sends {args.plain:,} "
        "records of 157 bytes to a topic like it, until the last is acknowledged. The three brokers share the "
        "2 cores with both.",
        "",
        "| measure | result |",
        "|---|---:|",
        f"| exporter CPU, user + system | {node['cpu_cores']:.2f} cores |",
        *([] if demanded is None else [f"| records demanded by the table | {demanded:,.0f}/s |"]),
        f"| exporter records acknowledged | {node['records_per_s']:,.0f}/s |",
        f"| exporter peak RSS | {node['peak_rss_bytes'] / 2**20:,.0f} MiB |",
        f"| every connection's first record acknowledged after start | {node['first_records_all_acked_s']:.1f} s |",
        f"| plain loop, records acknowledged | {plain_rate:,.0f}/s ({plain_cpu:.2f} cores) |",
        f"| load average (1 min) at the window's end | {node['load_average_1m']:.2f} |",
    ]
    update_section("cluster", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
