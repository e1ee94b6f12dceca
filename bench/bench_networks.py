"""Named networks (issue 42) at 100,000 prefixes: reading the file, the table's memory, and one lookup.

A file of ``--prefixes`` random networks (IPv4 /8 to /32 and IPv6 /32 to /128, nine in ten IPv4, one name per
hundred prefixes) is written as YAML and read by ``NetworkFile`` as the exporter reads it (libyaml's loader
when built, then the table); the table's memory is tracemalloc's difference over building it. A lookup is timed
over ``--probes`` random addresses, half of them inside a listed prefix, ``--runs`` times; the median run's
cost per lookup is reported with every run. A lookup is made once per new connection and end (not per record).
"""

from __future__ import annotations

import argparse
import ipaddress
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.common import plot, section_head, update_section, write_json


def networks(n: int, rng: random.Random) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    seen: set[Any] = set()
    while len(seen) < n:
        if rng.random() < 0.9:
            net: Any = ipaddress.ip_network((rng.getrandbits(32), rng.randint(8, 32)), strict=False)
        else:
            net = ipaddress.ip_network((rng.getrandbits(128), rng.randint(32, 128)), strict=False)
        if net in seen:
            continue
        seen.add(net)
        out.setdefault(f"net-{len(seen) // 100}", []).append(str(net))
    return out


def poll_beside_reloads(path: str, prefixes: int, rows: int = 200_000, runs: int = 5) -> dict[str, Any]:
    """A steady poll's wall time alone, and while another thread reloads the networks file again and again: what
    the GIL a reload holds costs the poll loop."""
    import threading
    from collections import Counter

    from bench.bench_sampling import rows as connections
    from flow_exporter.network_file import NetworkFile
    from flow_exporter.store import ConnectionStore
    from flow_exporter.timeouts import Timeouts
    from tests.support.netlink_messages import encode_connection

    msgs = [encode_connection(c) for c in connections(rows)]
    buffers = [b"".join(msgs[k : k + 200]) for k in range(0, rows, 200)]
    store = ConnectionStore(Timeouts(poll_interval=5, active=3600, idle=3600), max_connections=rows)

    def poll(i: int) -> float:
        t0 = time.perf_counter()
        store.begin_poll(1)
        for b in buffers:
            store.apply_dump_buffer(memoryview(b), None, 100.0 + i, 10**18 + i, Counter())
        store.end_poll(100.0 + i, 10**18 + i)
        return time.perf_counter() - t0

    poll(0)
    poll(1)
    alone = [poll(2 + i) for i in range(runs)]
    stop = threading.Event()
    reloads = 0

    def reload() -> None:
        nonlocal reloads
        while not stop.is_set():
            NetworkFile(path, prefixes)
            reloads += 1

    thread = threading.Thread(target=reload)
    thread.start()
    time.sleep(0.2)  # the reload under way
    during = [poll(10 + i) for i in range(runs)]
    stop.set()
    thread.join()
    return {
        "poll_rows": rows,
        "poll_alone_runs": alone,
        "poll_during_reload_runs": during,
        "poll_alone_s": statistics.median(alone),
        "poll_during_reload_s": statistics.median(during),
        "reloads_during": reloads,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_networks")
    ap.add_argument("--prefixes", type=int, default=100_000)
    ap.add_argument("--probes", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    import yaml

    from flow_exporter.network_file import NetworkFile

    rng = random.Random(42)
    table_data = networks(args.prefixes, rng)
    flat = [ipaddress.ip_network(c) for cidrs in table_data.values() for c in cidrs]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "networks.yaml"
        path.write_text(yaml.safe_dump(table_data, default_flow_style=None))
        size = path.stat().st_size
        t0 = time.perf_counter()
        NetworkFile(str(path), args.prefixes)
        read_s = time.perf_counter() - t0  # without tracemalloc, which slows every allocation
        tracemalloc.start()
        nf = NetworkFile(str(path), args.prefixes)
        _, peak = tracemalloc.get_traced_memory()
        held = tracemalloc.take_snapshot()
        tracemalloc.stop()
        table_bytes = sum(s.size for s in held.statistics("filename"))
        gil = poll_beside_reloads(str(path), args.prefixes)
    table = nf.table
    probes = []
    for i in range(args.probes):
        if i % 2:
            net = flat[rng.randrange(len(flat))]
            probes.append((net.network_address + rng.randrange(net.num_addresses)).packed)
        else:
            probes.append(
                rng.getrandbits(32).to_bytes(4, "big")
                if rng.random() < 0.9
                else rng.getrandbits(128).to_bytes(16, "big")
            )
    lookup = table.lookup
    runs = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        hits = sum(1 for p in probes if lookup(p) is not None)
        runs.append((time.perf_counter() - t0) / len(probes))
    result = {
        "prefixes": table.prefixes,
        "names": table.names,
        "file_bytes": size,
        "read_s": read_s,
        "read_peak_bytes": peak,
        "table_bytes": table_bytes,
        "lookup_us_runs": [1e6 * r for r in runs],
        "lookup_us_median": 1e6 * statistics.median(runs),
        "hits": hits,
        "probes": len(probes),
        "lengths_v4": len(table._v4.lengths),
        "lengths_v6": len(table._v6.lengths),
        **gil,
    }
    write_json("networks", result)

    def draw(ax: Any) -> None:
        ax.bar(range(len(runs)), result["lookup_us_runs"], color="#1f77b4")
        ax.set_xlabel("run")
        ax.set_ylabel("µs per lookup")
        ax.set_title(f"Named-network lookup, {table.prefixes:,} prefixes")

    plot("networks", draw)
    lines = [
        *section_head(f"Named networks: {table.prefixes:,} prefixes", "bench.bench_networks", argv),
        f"A networks file of {table.prefixes:,} random prefixes ({result['lengths_v4']} IPv4 and "
        f"{result['lengths_v6']} IPv6 prefix lengths, {table.names:,} names, {size / 2**20:.1f} MiB of YAML), read as "
        f"the exporter reads it; {len(probes):,} random addresses looked up per run, half inside a listed prefix.",
        "",
        "| measure | result |",
        "|---|---:|",
        f"| reading the file (YAML, then the table) | {read_s:.2f} s (peak {peak / 2**20:.0f} MiB while reading) |",
        f"| the table's memory, held | {table_bytes / 2**20:.1f} MiB "
        f"({table_bytes / table.prefixes:.0f} B per prefix) |",
        f"| one lookup, median of {len(runs)} runs | {result['lookup_us_median']:.2f} µs |",
        f"| every run | {', '.join(f'{x:.2f}' for x in result['lookup_us_runs'])} µs |",
        "",
        "A lookup is made once per new connection and end: at 20,000 new connections a second, two ends each, "
        f"that is {2 * 20_000 * result['lookup_us_median'] / 1e6:.3f} cores.",
        "",
        "A reload holds the GIL while it parses and builds (Python code), so it shares the interpreter with the "
        f"loops: a steady poll of {gil['poll_rows']:,} rows (the fused walk, compiled) took "
        f"{gil['poll_alone_s']:.3f} s alone and {gil['poll_during_reload_s']:.3f} s while another thread reloaded "
        f"this file ({gil['reloads_during']} reload(s) during the polls; medians of {len(gil['poll_alone_runs'])}; "
        f"alone: {', '.join(f'{x:.3f}' for x in gil['poll_alone_runs'])}; during: "
        f"{', '.join(f'{x:.3f}' for x in gil['poll_during_reload_runs'])} s): the worst poll took "
        f"{max(gil['poll_during_reload_runs']):.2f} s, so a reload can hold the loops back for most of a second "
        "(not measured apart: which part of the reload does it). A reload happens when the file changes (checked "
        "every networks.reloadInterval), not per poll.",
        "",
        "![networks](performance/networks.png)",
    ]
    update_section("networks", "\n".join(lines))
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
