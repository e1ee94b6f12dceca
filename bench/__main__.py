"""``make bench``: every benchmark in turn; each updates its own section of docs/performance.md.

``python -m bench [NAME ...]`` runs only the named ones (poll, export, app_export, node, capture, events,
checkpoint, latency, k8s, spark: the Spark and Flink downstream jobs on one input, pipeline, decode: dump and
decode against the kernel's own recv loop, compiled: the poll pure and compiled from 100k to 1M beside the
kernel's dump, ti-mo/conntrack and conntrack -L, scaling: `flow-exporter run`'s CPU and
records/s against table size, pure and compiled, encoder: one enriched record's encode cost, cluster: the node
pipeline against three brokers beside a plain loop on them, cilium: the Cilium source reading 1M entries of
Cilium's maps beside bpftool and Cilium's lister, and its node beside the netfilter one, networks: the named-network
table at 100k prefixes, sampling: deciding per row and a 1M node at p = 1/16 beside p = 1, soak: 10 minutes at 250k).
"""

from __future__ import annotations

import importlib
import sys

SUITE = {
    "poll": ("bench.bench_poll", []),
    "export": ("bench.bench_export", []),
    "app_export": ("bench.bench_app_export", []),
    "node": ("bench.bench_node", []),
    "capture": ("bench.bench_capture", []),
    "events": ("bench.bench_events", []),
    "checkpoint": ("bench.bench_checkpoint", []),
    "latency": ("bench.bench_latency", []),
    "k8s": ("bench.bench_k8s", []),
    "spark": ("bench.bench_spark", []),
    "pipeline": ("bench.bench_pipeline", []),
    "decode": ("bench.bench_decode_quick", ["--skip-pyroute2"]),
    "compiled": ("bench.bench_compiled", []),
    "scaling": ("bench.bench_scaling", []),
    "encoder": ("bench.bench_encoder", []),
    "cluster": ("bench.bench_cluster", []),
    "cilium": ("bench.bench_cilium", ["--node"]),
    "networks": ("bench.bench_networks", []),
    "sampling": ("bench.bench_sampling", ["--node"]),
    "soak": ("bench.bench_soak", []),  # 10 minutes: last
}


def main(argv: list[str]) -> int:
    names = argv or list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(SUITE)}", file=sys.stderr)
        return 2
    for name in names:
        module, args = SUITE[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            print(f"bench {name}: skipped ({exc})", file=sys.stderr)
            continue
        print(f"== bench {name}", flush=True)
        rc = mod.main(args)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
