"""The Cilium source (issue 41) at 1,000,000 entries: reading Cilium's CT maps beside bpftool and Cilium's own
lister, and the whole node with this source beside the netfilter source on a table of the same size.

The maps are Cilium's own: ``ctwriter`` (devtools.cilium, built against Cilium v1.20.2) creates the four
global CT maps on a private bpffs and writes the entries with Cilium's ``pkg/maps/ctmap`` code: 500,000 TCP
IPv4, 250,000 UDP IPv4 and 250,000 TCP IPv6 entries, two OUT entries to every lone IN one (a node that
both calls and serves: each IN entry costs the source a lookup of its OUT twin), counters as accounting
keeps them.

Reading, ``--runs`` rounds, interleaved, each reading all four maps:

* ``batch``: the kernel's batch lookup alone (``PinnedMap.batches``: keys and values copied out, nothing
  decoded): the floor the issue's target is set against (at most this plus 0.5 us an entry);
* ``source``: the Cilium source's read (``CiliumSource.dump_into``, compiled build): the batches, the decode
  into Connections, the IN twins' lookups;
* ``bpftool``: ``bpftool map dump pinned ...`` for each map (Debian's bpftool, text output to /dev/null);
* ``cilium``: Cilium's own lister (``ctwriter dump``: Cilium's ``DumpWithCallback`` and the line
  ``cilium-dbg bpf ct list global`` prints for each entry, to /dev/null).

Each as CPU seconds (user + system) of the reading process per entry; wall seconds beside them.

The node (``--node``): ``flow-exporter run`` as bench_node runs it, with ``conntrack.source: cilium`` on the
maps, then with the netfilter source on 1,000,000 synthetic conntrack entries (``conntrack -R`` in a lab
namespace) with the same settings, one after the other in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import plot, section_head, update_section, write_json

LAYOUT = "v1.20"
SHAPE = (("cilium_ct4_global", 500_000, 6, "10"), ("cilium_ct_any4_global", 250_000, 17, "10"),
         ("cilium_ct6_global", 250_000, 6, "fd00"))  # fmt: skip


def _address(prefix: str, i: int) -> str:
    if prefix == "fd00":
        return f"fd00::{i >> 16 & 0xFFFF:x}:{i & 0xFFFF:x}"
    return f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"


def entries(scale: float) -> tuple[list[str], int]:
    """The ``ctwriter apply`` lines, and the connections they are (every entry: no twins, no service entries)."""
    lines = []
    for name, count, proto, prefix in SHAPE:
        for i in range(int(count * scale)):
            flags = 1 if i % 3 == 2 else 0  # IN every third: a lone one (its OUT twin is not there)
            client, server = _address(prefix, i + 1), _address(prefix, 0x7F0000 + i % 4096)
            op = {"op": "put", "map": name, "daddr": client, "saddr": server, "sport": 1024 + i % 60000,
                  "dport": 443 if proto == 6 else 53, "nexthdr": proto, "flags": flags,
                  "entry": {"Packets": 10 + i % 100, "Bytes": 1500 * (10 + i % 100), "Lifetime": 2**31,
                            "SourceSecurityID": 12345}}  # fmt: skip
            lines.append(json.dumps(op))
    return lines, len(lines)


def cpu_of(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of this process and its children, wall seconds) of ``fn``."""
    s0, c0, w0 = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        time.perf_counter(),
    )
    fn()
    s1, c1, w1 = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        time.perf_counter(),
    )
    cpu = (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) + (
        c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    )
    return cpu, w1 - w0


def readers(fs: Any, binary: Path) -> dict[str, Callable[[], int]]:
    from devtools.cilium import run_ctwriter
    from flow_exporter.cilium.bpf_maps import PinnedMap
    from flow_exporter.cilium.source import GLOBAL_MAPS, CiliumSource

    paths = [str(fs.globals / name) for name, _ in GLOBAL_MAPS]

    def batch() -> int:
        n = 0
        for path in paths:
            with PinnedMap(path) as m:
                for count, _k, _v in m.batches():
                    n += count
        return n

    source = CiliumSource(str(fs.path), "combined")

    def ours() -> int:
        source.dump_into(lambda batch: None)
        return source.count()

    def bpftool() -> int:
        for path in paths:
            subprocess.run(["bpftool", "map", "dump", "pinned", path], stdout=subprocess.DEVNULL, check=True)
        return 0

    def cilium() -> int:
        out = run_ctwriter(binary, fs, "dump")
        return out.count("\n")

    return {"batch": batch, "source": ours, "bpftool": bpftool, "cilium": cilium}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cilium")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1,000,000 entries (quick runs)")
    ap.add_argument("--node", action="store_true", help="also the whole node, Cilium source beside netfilter")
    ap.add_argument("--window", type=float, default=60.0, help="the node's seconds of steady state measured")
    ap.add_argument("--report", action="store_true", help="only write the section again from the last results")
    args = ap.parse_args(argv)
    if args.report:
        from bench.common import RESULTS

        last = json.loads((RESULTS / "cilium.json").read_text())
        report(last, last["command"].split()[2:])  # "python bench/bench_cilium.py ARGS"
        return 0
    from devtools.cilium import Bpffs, ctwriter, run_ctwriter

    if shutil.which("bpftool") is None:  # the peer: Debian's package (a benchmark's need, not the tests')
        print("bench cilium: installing bpftool (apt-get install bpftool)", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "bpftool"], check=True, stdout=subprocess.DEVNULL)
    binary = ctwriter(LAYOUT)
    lines, n = entries(args.scale)
    result: dict[str, Any] = {"entries": n, "runs": {}}
    with Bpffs() as fs:
        run_ctwriter(binary, fs, "create")
        t0 = time.monotonic()
        run_ctwriter(binary, fs, "apply", stdin="\n".join(lines) + "\n", timeout=3600)
        result["write_s"] = time.monotonic() - t0
        del lines
        fns = readers(fs, binary)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
        counted = fns["batch"]()
        assert counted == n, f"the maps hold {counted} entries, {n} written"
        for _ in range(args.runs):
            for name, fn in fns.items():  # interleaved: each round reads with every reader
                runs[name].append(cpu_of(fn))
        result["runs"] = {k: [{"cpu_s": c, "wall_s": w} for c, w in v] for k, v in runs.items()}
        med = {k: statistics.median(c for c, _ in v) for k, v in runs.items()}
        wall = {k: statistics.median(w for _, w in v) for k, v in runs.items()}
        result["median_cpu_us_per_entry"] = {k: 1e6 * v / n for k, v in med.items()}
        result["median_wall_us_per_entry"] = {k: 1e6 * v / n for k, v in wall.items()}
        result["source_over_batch_us"] = 1e6 * (med["source"] - med["batch"]) / n
        result["bpftool_version"] = subprocess.run(
            ["bpftool", "--version"], capture_output=True, text=True
        ).stdout.split("\n")[0]
        if args.node:
            result["node"] = node(fs, n, args.window)
    write_json("cilium", result)
    report(result, argv)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


def node(fs: Any, n: int, window: float) -> dict[str, Any]:
    """The Cilium source's node beside the netfilter source's, production settings (active 60 s), same run."""
    from bench.bench_node import measure
    from devtools.kafka import KafkaBroker
    from devtools.lab import Lab

    out = {}
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker:
        out["cilium"] = measure(None, broker, Path(tmp), n, active="60s", idle="15s", pure=False, window=window,
                                topic="cilium", source_args=("--set", "conntrack.source=cilium",
                                                             "--set", f"cilium.bpffs={fs.path}"))  # fmt: skip
        with Lab(pods=1) as lab:
            ns = lab.table_ns()
            lab.load_synthetic(n, netns=ns, timeout=3600)
            out["netfilter"] = measure(ns, broker, Path(tmp), n, active="60s", idle="15s", pure=False,
                                       window=window, topic="netfilter")  # fmt: skip
    return out


def report(r: dict[str, Any], argv: list[str] | None) -> None:
    n = r["entries"]
    cpu, wall = r["median_cpu_us_per_entry"], r["median_wall_us_per_entry"]
    names = {"batch": "batch lookup alone (`PinnedMap.batches`, nothing decoded)",
             "source": "the Cilium source (`CiliumSource.dump_into`, compiled)",
             "bpftool": f"`bpftool map dump pinned` ({r['bpftool_version']})",
             "cilium": "Cilium's own lister (`ctwriter dump`: DumpWithCallback, cilium-dbg's line)"}  # fmt: skip

    def draw(ax: Any) -> None:
        keys = list(names)
        ax.bar(keys, [cpu[k] for k in keys], color=["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"])
        for i, k in enumerate(keys):
            ax.scatter([i] * len(r["runs"][k]), [1e6 * x["cpu_s"] / n for x in r["runs"][k]], color="black", s=8)
        ax.set_ylabel("CPU µs per entry")
        ax.set_title(f"Reading Cilium's four CT maps, {n:,} entries (median of {len(r['runs']['batch'])} runs)")

    plot("cilium", draw)

    def every(k: str) -> str:
        return ", ".join(f"{1e6 * x['cpu_s'] / n:.2f}" for x in r["runs"][k])

    lines = [
        *section_head(f"The Cilium source: reading {n:,} entries of Cilium's CT maps", "bench.bench_cilium", argv),
        f"Cilium's four global CT maps on a private bpffs, written by Cilium v1.20.2's own code (`ctwriter`): "
        f"{n:,} entries (TCP and UDP IPv4, TCP IPv6; every third an IN entry whose OUT twin the source looks up). "
        f"Writing them took {r['write_s']:.0f} s. Each reader read all four maps in each of "
        f"{len(r['runs']['batch'])} interleaved rounds; CPU is user + system of the reading process.",
        "",
        "| reader | CPU µs per entry (median) | wall µs per entry | every run (CPU µs per entry) |",
        "|---|---:|---:|---|",
        *[f"| {names[k]} | {cpu[k]:.2f} | {wall[k]:.2f} | {every(k)} |" for k in names],
        "",
        f"The source costs {r['source_over_batch_us']:.2f} µs per entry over the batch lookup alone (target: at most "
        f"0.5), {cpu['bpftool'] / cpu['source']:.1f}x less CPU than bpftool and {cpu['cilium'] / cpu['source']:.1f}x "
        "less than Cilium's own lister.",
        "",
        "![cilium](performance/cilium.png)",
    ]
    if "node" in r:
        c, f = r["node"]["cilium"], r["node"]["netfilter"]
        lines += [
            "",
            f"The whole node, `flow-exporter run` at {n:,} connections, poll 5 s, active timeout 60 s, idle 15 s, "
            "state.dir on, a local broker; the Cilium source on the maps above, then the netfilter source on "
            f"{n:,} synthetic conntrack entries, same settings, same run, {c['window_s']:.0f} s of steady state each.",
            "",
            "| measure | Cilium source | netfilter source |",
            "|---|---:|---:|",
            f"| CPU, user + system | {c['cpu_cores']:.2f} cores | {f['cpu_cores']:.2f} cores |",
            f"| of it user (the exporter's code) | {c['cpu_user_cores']:.2f} cores | {f['cpu_user_cores']:.2f} cores |",
            f"| of it system (the kernel: map reads, the conntrack dump) | {c['cpu_system_cores']:.2f} cores | "
            f"{f['cpu_system_cores']:.2f} cores |",
            f"| poll, mean | {c['poll_seconds_mean'] or 0:.2f} s | {f['poll_seconds_mean'] or 0:.2f} s |",
            f"| RSS | {c['rss_bytes'] / 2**20:,.0f} MiB | {f['rss_bytes'] / 2**20:,.0f} MiB |",
            f"| peak RSS since start | {c['peak_rss_bytes'] / 2**20:,.0f} MiB | "
            f"{f['peak_rss_bytes'] / 2**20:,.0f} MiB |",
            f"| every first record acknowledged after start | {c['first_records_all_acked_s']:.0f} s | "
            f"{f['first_records_all_acked_s']:.0f} s |",
            f"| load average (1 min) at the end | {c['load_average_1m']:.2f} | {f['load_average_1m']:.2f} |",
        ]
        lines += [
            "",
            "The netfilter source applies an unchanged row to the store in place, without a Python object (the fused "
            "poll); the Cilium source makes a Connection of every entry and applies it with `update_batch`: that is "
            "its higher user CPU.",
        ]
    update_section("cilium", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
