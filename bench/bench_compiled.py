"""The poll's cost, pure Python against the compiled path, beside the kernel's own cost and the peers (issue 24).

    sudo .venv/bin/python -m bench.bench_compiled [--sizes 100000,250000,500000,1000000] [--runs 3]

Per size, one network namespace loaded with ``conntrack -R`` (bench_decode_quick's busy-node table:
TCP/UDP/ICMP, IPv4 and IPv6, a zone), and in the same run, medians of ``--runs``:

* the kernel's own cost: a raw netlink dump that walks only the message headers and discards the bytes;
* dump + decode into Connections (``ConntrackDumper.dump``): the pure decoder, the compiled one;
* Antrea's Go library (github.com/ti-mo/conntrack, ``bench/go_conntrack``) dumping the same table;
* ``conntrack -L > /dev/null``;
* the poll as ``flow-exporter run`` does it (dump, decode, store update, sweep): the first poll into an
  empty store and a steady poll (every entry known, nothing moved), pure and compiled, as CPU seconds of
  this process (user + system) and wall seconds;
* at the largest size, peak RSS of a child process that does a first poll and five steady ones, pure and
  compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_decode_quick import netns_socket, recv_dump, table_lines
from bench.common import ROOT, machine_line, plot, section_head, update_section, write_json

GO_DIR = ROOT / "bench" / "go_conntrack"


def _poll(store: Any, dumper: Any, compiled: bool) -> None:
    """One poll as Exporter.poll_once does it (the fused path when compiled)."""
    now, wall = time.monotonic(), time.time_ns()
    store.reserve(min(dumper.count(), store.max_connections))  # as poll_once: room for the table in one step
    store.begin_poll(wall)
    if compiled:
        counts: dict[int, int] = {}
        dumper.dump_buffers(lambda buf: store.apply_dump_buffer(buf, None, now, wall, counts))
    else:
        dumper.dump_into(lambda batch: store.update_batch(batch, now, wall))
    store.end_poll(now, time.time_ns())


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _measure(fn: Any, runs: int) -> dict[str, float]:
    """Median CPU and wall seconds of ``fn`` over ``runs`` calls."""
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = _cpu(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(_cpu() - c0)
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}


def _memory_child(netns: str, compiled: bool) -> None:
    """In a child: peak RSS after a first poll and five steady ones (what the pod's limit meets)."""
    from flow_exporter import gc_policy
    from flow_exporter.conntrack.dumper import ConntrackDumper
    from flow_exporter.store import ConnectionStore

    gc_policy.tune()
    dumper = ConntrackDumper(netns=netns, compiled=compiled)
    store = ConnectionStore(compiled=compiled, max_connections=2_000_000)
    for _ in range(6):
        _poll(store, dumper, compiled)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"n": len(store), "peak_rss": peak}))


def _go_peer(runs: int) -> str | None:
    """Builds the Go peer once (the Go module proxy); None when go is missing."""
    if shutil.which("go") is None:
        return None
    out = ROOT / ".cache" / "bench" / "go-conntrack-dump"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(out), "."], cwd=GO_DIR, check=True)
    return str(out)


def run(sizes: list[int], runs: int) -> dict[str, Any]:
    from flow_exporter import gc_policy
    from flow_exporter.conntrack import ConntrackDumper, enable_accounting
    from flow_exporter.store import ConnectionStore

    gc_policy.tune()  # as flow-exporter run does
    go = _go_peer(runs)
    rows = []
    memory: dict[str, Any] = {}
    Path("/proc/sys/net/netfilter/nf_conntrack_max").write_text(str(max(sizes) + 100_000))
    for n in sizes:
        ns = f"ctcomp-{os.getpid()}-{n}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            for warning in enable_accounting(ns):
                print("warning:", warning)
            path = Path(f"/tmp/{ns}.ct")
            path.write_text("\n".join(table_lines(n)) + "\n")
            subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-R", str(path)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            path.unlink()
            load0 = os.getloadavg()[0]
            row: dict[str, Any] = {"entries": n}
            sock = netns_socket(ns)
            try:
                recv_dump(sock, None)
                row["kernel"] = _measure(lambda s=sock: recv_dump(s, None), runs)
            finally:
                sock.close()
            for compiled in (False, True):
                name = "compiled" if compiled else "pure"
                with ConntrackDumper(netns=ns, compiled=compiled) as dumper:
                    got = len(dumper.dump())
                    assert got == n, (got, n)
                    row[f"dump_decode_{name}"] = _measure(dumper.dump, runs)
                    firsts = []
                    for _ in range(runs):
                        store = ConnectionStore(compiled=compiled, max_connections=2_000_000)
                        firsts.append(_measure(lambda st=store, d=dumper, c=compiled: _poll(st, d, c), 1))
                    row[f"first_poll_{name}"] = {
                        k: statistics.median(f[k] for f in firsts) for k in ("cpu_s", "wall_s")
                    }
                    _poll(store, dumper, compiled)
                    row[f"steady_poll_{name}"] = _measure(lambda st=store, d=dumper, c=compiled: _poll(st, d, c), runs)
                    assert len(store) == n
                    del store
            if go is not None:
                out = subprocess.run(["ip", "netns", "exec", ns, go, "-runs", str(runs)], check=True,
                                     capture_output=True, text=True).stdout  # fmt: skip
                g = json.loads(out)
                assert g["entries"] == n, g
                row["go_ti_mo_conntrack"] = {"wall_s": statistics.median(g["seconds"])}
            t = []
            for _ in range(runs):
                t0 = time.perf_counter()
                subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L"], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                t.append(time.perf_counter() - t0)
            row["conntrack_L"] = {"wall_s": statistics.median(t)}
            row["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            if n == max(sizes):
                for compiled in (False, True):
                    out = subprocess.run(
                        [sys.executable, "-m", "bench.bench_compiled", "--memory-child", ns]
                        + (["--compiled"] if compiled else []),
                        check=True, capture_output=True, text=True, cwd=ROOT,
                    ).stdout  # fmt: skip
                    memory["compiled" if compiled else "pure"] = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
    return {"rows": rows, "memory": memory}


def report(data: dict[str, Any], argv: list[str]) -> None:
    rows = data["rows"]

    def us(row: dict[str, Any], key: str, what: str = "cpu_s") -> str:
        v = row.get(key)
        return "" if v is None else f"{v[what]:.3f}"

    lines = section_head("Compiled poll path against the pure one (issue 24)", "bench.bench_compiled", argv)
    lines += [
        "Seconds per dump or poll (medians); CPU is this process's user + system time. The kernel row is a raw",
        "netlink dump that walks only message headers and throws the bytes away: the floor any decoder sits on.",
        "The rows are measured one after another on a shared machine, so the kernel's own figure moves between",
        "them too: a cost above the kernel's shown as 0.00 µs means the poll came within that noise.",
        "",
        "| entries | kernel (wall) | dump+decode pure | dump+decode compiled | Go ti-mo/conntrack (wall) | "
        "conntrack -L (wall) | first poll pure CPU | first poll compiled CPU | steady poll pure CPU | "
        "steady poll compiled CPU | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['entries']:,} | {us(r, 'kernel', 'wall_s')} | {us(r, 'dump_decode_pure', 'wall_s')} | "
            f"{us(r, 'dump_decode_compiled', 'wall_s')} | {us(r, 'go_ti_mo_conntrack', 'wall_s')} | "
            f"{us(r, 'conntrack_L', 'wall_s')} | {us(r, 'first_poll_pure')} | {us(r, 'first_poll_compiled')} | "
            f"{us(r, 'steady_poll_pure')} | {us(r, 'steady_poll_compiled')} | "
            f"{r['load_average'][0]}-{r['load_average'][1]} |"
        )
    lines.append("")
    for r in rows:
        n = r["entries"]
        k = r["kernel"]["wall_s"]
        c = r["dump_decode_compiled"]["wall_s"]
        go = r.get("go_ti_mo_conntrack", {}).get("wall_s")
        sp, sc = r["steady_poll_pure"]["cpu_s"], r["steady_poll_compiled"]["cpu_s"]

        def above(x: float, k: float = k, n: int = n) -> str:
            return f"{1e6 * max(x - k, 0.0) / n:.2f} µs"

        lines.append(
            f"- {n:,}: steady poll {sp / sc:.1f}x less CPU ({sc / k:.2f}x the kernel's own dump; our cost above the "
            f"kernel's {above(sc)} per entry, pure {above(sp)}); dump+decode into Connections {c / k:.2f}x the "
            f"kernel's" + (f", {go / c:.2f}x faster than ti-mo/conntrack's dump, {go / sc:.2f}x for the whole "
                           "steady poll" if go else "")
            + f"; first poll {r['first_poll_pure']['cpu_s'] / r['first_poll_compiled']['cpu_s']:.2f}x less CPU."
        )
    mem = data.get("memory") or {}
    if mem:
        lines.append("")
        lines.append(
            "Peak RSS of a process that polls the largest table six times (first poll + five steady), no state "
            "directory: " + ", ".join(f"{k} {v['peak_rss'] / 2**20:.0f} MiB ({v['n']:,} connections)"
                                      for k, v in mem.items()) + "."
        )

    def draw(ax: Any) -> None:
        xs = [r["entries"] for r in rows]
        for key, label in (
            ("steady_poll_pure", "steady poll, pure (CPU)"),
            ("steady_poll_compiled", "steady poll, compiled (CPU)"),
            ("first_poll_pure", "first poll, pure (CPU)"),
            ("first_poll_compiled", "first poll, compiled (CPU)"),
            ("kernel", "kernel dump alone (wall)"),
        ):
            what = "wall_s" if key == "kernel" else "cpu_s"
            ax.plot(xs, [r[key][what] for r in rows], marker="o", label=label)
        ax.set_xlabel("conntrack entries")
        ax.set_ylabel("seconds per poll (median)")
        ax.set_title("Poll cost against table size")
        ax.legend()
        ax.grid(True, alpha=0.3)

    png = plot("compiled", draw)
    if png is not None:
        lines += ["", f"![poll cost against table size](performance/{png.name})"]
    update_section("compiled", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,250000,500000,1000000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--memory-child", metavar="NETNS", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child, args.compiled)
        return 0
    print(machine_line(), flush=True)
    data = run([int(s) for s in args.sizes.split(",")], args.runs)
    write_json("compiled", data)
    report(data, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
