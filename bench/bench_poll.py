"""Poll scaling on real conntrack tables: ours vs stock pyroute2 vs ``conntrack -L``.

For each table size, entries are loaded into a fresh network namespace with
``conntrack -R`` and the same table is read four ways in one run:

* project dump+decode (``ConntrackDumper.dump``),
* project full poll (dump + decode + store update, steady state),
* stock pyroute2 ``NFCTSocket.dump()`` with one ``get_attr`` per entry,
* ``conntrack -L > /dev/null`` (the reference C tool).

Also: RSS per tracked connection at the largest size (measured in a child
process so the other measurements don't pollute it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import machine_line, median_time, plot, time_command, update_section, write_json


def _stock_pyroute2(netns: str) -> int:
    from pyroute2 import NFCTSocket

    sock = NFCTSocket(netns=netns)
    try:
        n = 0
        for msg in sock.dump():
            msg.get_attr("CTA_ID")
            n += 1
        return n
    finally:
        sock.close()


def _poll(store, dumper) -> None:
    """One poll as Exporter.poll_once does it: the dump handed to the store batch by batch, then the sweep."""
    now, wall = time.monotonic(), time.time_ns()
    store.begin_poll(wall)
    dumper.dump_into(lambda batch: store.update_batch(batch, now, wall))
    store.end_poll(now, time.time_ns())


def _memory_child(netns: str) -> None:
    """Runs in a child: RSS before, after the first poll and after five more (steady state), as JSON."""
    import gc

    import psutil

    from flow_exporter import gc_policy
    from flow_exporter.conntrack.dumper import ConntrackDumper
    from flow_exporter.store import ConnectionStore

    gc_policy.tune()  # as flow-exporter run does
    proc = psutil.Process()
    dumper = ConntrackDumper(netns=netns)
    dumper.dump()  # warm the dumper's buffers and imports
    gc.collect()
    before = proc.memory_info().rss
    store = ConnectionStore()
    _poll(store, dumper)
    gc.collect()
    first = proc.memory_info().rss
    for _ in range(5):
        _poll(store, dumper)
    gc.collect()
    steady = proc.memory_info().rss
    print(json.dumps({"n": len(store), "rss_before": before, "rss_after": first, "rss_steady": steady}))


def run(sizes: list[int], repeat: int, stock_max: int) -> dict:
    from devtools.lab import Lab
    from flow_exporter import gc_policy
    from flow_exporter.conntrack.dumper import ConntrackDumper
    from flow_exporter.store import ConnectionStore

    gc_policy.tune()  # as flow-exporter run does
    rows = []
    memory = None
    for n in sizes:
        with Lab(pods=1) as lab:
            ns = lab.table_ns()
            lab.load_synthetic(n, netns=ns)
            dumper = ConntrackDumper(netns=ns)
            assert len(dumper.dump()) == n
            dump_s, _ = median_time(dumper.dump, repeat=repeat)

            first_s, _ = median_time(lambda d=dumper: _poll(ConnectionStore(), d), repeat=repeat, warmup=0)
            store = ConnectionStore()
            _poll(store, dumper)
            poll_s, _ = median_time(lambda s=store, d=dumper: _poll(s, d), repeat=repeat)
            stock_s = None
            if n <= stock_max:
                stock_s, _ = median_time(lambda ns=ns: _stock_pyroute2(ns), repeat=max(1, repeat // 3), warmup=0)
            cli_s, _ = time_command(f"ip netns exec {ns} conntrack -L > /dev/null", repeat=repeat)
            dumper.close()
            row = {
                "entries": n,
                "dump_decode_s": dump_s,
                "first_poll_s": first_s,
                "full_poll_s": poll_s,
                "pyroute2_dump_s": stock_s,
                "conntrack_L_s": cli_s,
                "decode_entries_per_s": n / dump_s,
                "speedup_vs_pyroute2": (stock_s / dump_s) if stock_s else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if n == max(sizes):
                out = subprocess.run(
                    [sys.executable, "-m", "bench.bench_poll", "--memory-child", ns],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                m = json.loads(out.strip().splitlines()[-1])
                memory = {
                    **m,
                    "bytes_per_connection": (m["rss_after"] - m["rss_before"]) / m["n"],
                    "steady_bytes_per_connection": (m["rss_steady"] - m["rss_before"]) / m["n"],
                }
                print(json.dumps(memory), flush=True)
    return {"rows": rows, "memory": memory}


def report(data: dict, cmd: str) -> None:
    rows = data["rows"]

    def draw(ax: object) -> None:
        xs = [r["entries"] for r in rows]
        for key, label in (
            ("dump_decode_s", "flow-exporter dump+decode"),
            ("full_poll_s", "flow-exporter full poll"),
            ("pyroute2_dump_s", "stock pyroute2 dump()"),
            ("conntrack_L_s", "conntrack -L > /dev/null"),
        ):
            pts = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r[key] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)  # type: ignore[attr-defined]
        ax.set_xlabel("conntrack entries")  # type: ignore[attr-defined]
        ax.set_ylabel("seconds (median)")  # type: ignore[attr-defined]
        ax.set_yscale("log")  # type: ignore[attr-defined]
        ax.set_title("Poll time vs table size")  # type: ignore[attr-defined]
        ax.legend()  # type: ignore[attr-defined]
        ax.grid(True, alpha=0.3)  # type: ignore[attr-defined]

    plot("poll", draw)
    lines = [
        "## Poll scaling (real conntrack tables in a network namespace)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line()}",
        "",
        "| entries | dump+decode | first poll (empty store) | steady poll | stock pyroute2 dump() | conntrack -L "
        "| decode entries/s | vs pyroute2 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stock = f"{r['pyroute2_dump_s']:.3f} s" if r["pyroute2_dump_s"] else "not run"
        ratio = f"{r['speedup_vs_pyroute2']:.1f}x" if r["speedup_vs_pyroute2"] else "-"
        lines.append(
            f"| {r['entries']:,} | {r['dump_decode_s']:.3f} s | {r['first_poll_s']:.3f} s | {r['full_poll_s']:.3f} s "
            f"| {stock} | "
            f"{r['conntrack_L_s']:.3f} s | {r['decode_entries_per_s']:,.0f} | {ratio} |"
        )
    m = data.get("memory")
    if m:
        lines += [
            "",
            f"Memory at {m['n']:,} tracked connections: {m['bytes_per_connection']:.0f} bytes of RSS per connection "
            f"after the first poll, {m['steady_bytes_per_connection']:.0f} after five more (steady state) "
            f"(RSS {m['rss_before'] / 2**20:.0f} MiB -> {m['rss_after'] / 2**20:.0f} MiB -> "
            f"{m['rss_steady'] / 2**20:.0f} MiB).",
        ]
    lines += ["", "Medians of repeated runs; all four readers read the same table in the same run. Polls as the",
              "exporter runs them (batch by batch into the store, then the sweep; its GC policy).", "",
              "![poll](performance/poll.png)"]  # fmt: skip
    update_section("poll", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,250000")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--stock-max", type=int, default=100000, help="largest table stock pyroute2 is run on")
    p.add_argument("--memory-child", metavar="NETNS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    data = run(sizes, args.repeat, args.stock_max)
    write_json("poll", {"sizes": sizes, "repeat": args.repeat, **data})
    report(data, "python -m bench.bench_poll " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
