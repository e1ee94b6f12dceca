"""The poll paths of two trees side by side on one kernel table (issue 39's gate for the poll's ports).

    sudo .venv/bin/python -m bench.bench_poll_trees --label L --before <tree> --after <tree> \
        [--entries 1000000] [--rounds 3]

One network namespace loaded with ``conntrack -R`` (bench_decode_quick's busy-node table: TCP/UDP/ICMP, IPv4
and IPv6, a zone), then per round a child process from each tree (built in place; which goes first
alternates) that measures, as CPU seconds of that process (user + system, kernel side of the dump included):

* dump + decode into Connections (``ConntrackDumper.dump``), the median of five after one warm-up;
* the first poll into an empty store and the median of five steady polls (every entry known, nothing moved),
  as ``flow-exporter run`` polls (bench_compiled's ``_poll``: the fused path).

The section lists every round, the medians and after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_decode_quick import table_lines
from bench.common import plot, section_head, update_section, write_json
from flow_exporter.conntrack import enable_accounting

MEASURES = (("dump_decode", "dump + decode (s CPU)"), ("first_poll", "first poll (s CPU)"),
            ("steady_poll", "steady poll (s CPU)"))  # fmt: skip

CHILD = r"""
import json, os, statistics, sys
from flow_exporter.conntrack import ConntrackDumper
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from bench.bench_compiled import _poll

def cpu():
    t = os.times()
    return t.user + t.system

def timed(fn):
    c = cpu()
    fn()
    return cpu() - c

out = {}
with ConntrackDumper(netns=sys.argv[1]) as dumper:
    dumper.dump()
    out["entries"] = len(dumper.dump())
    out["dump_decode"] = statistics.median(timed(dumper.dump) for _ in range(5))
    store = ConnectionStore(Timeouts(poll_interval=5, active=60, idle=3600), max_connections=2 * out["entries"])
    out["first_poll"] = timed(lambda: _poll(store, dumper, True))
    out["steady_poll"] = statistics.median(timed(lambda: _poll(store, dumper, True)) for _ in range(5))
print(json.dumps(out))
"""


def _child(tree: Path, ns: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", CHILD, ns], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_poll_trees: the child of {tree} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _rev(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="the port this gates (names the section and the files)")
    ap.add_argument("--before", type=Path, required=True, help="the tree before the port (built in place)")
    ap.add_argument("--after", type=Path, required=True, help="the tree after it (built in place)")
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    revs = {k: _rev(v) for k, v in trees.items()}
    shown = list(argv if argv is not None else sys.argv[1:])  # the command, without this machine's paths
    for label, tree in (("before", args.before), ("after", args.after)):
        shown = [f"<checkout of {revs[label]}>" if a == str(tree) else a for a in shown]
    Path("/proc/sys/net/netfilter/nf_conntrack_max").write_text(str(args.entries + 100_000))
    ns = f"polltrees-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    try:
        for warning in enable_accounting(ns):
            print("warning:", warning)
        table = Path(f"/tmp/{ns}.ct")
        table.write_text("\n".join(table_lines(args.entries)) + "\n")
        subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-R", str(table)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        table.unlink()
        for r in range(args.rounds):
            for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
                got = _child(trees[which], ns)
                got["load"] = os.getloadavg()[0]
                runs[which].append(got)
                print(f"round {r} {which}: {got}", flush=True)
                time.sleep(2)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    med = {w: {k: statistics.median(x[k] for x in runs[w]) for k, _ in MEASURES} for w in runs}
    name = f"poll_trees_{args.label}"
    command = " ".join(["python -m bench.bench_poll_trees", *shown])  # without this machine's paths
    write_json(name, {"command": command, "revs": revs, "entries": args.entries, "runs": runs, "medians": med})

    def draw(ax: Any) -> None:
        xs = range(len(MEASURES))
        ax.bar(
            [x - 0.2 for x in xs], [med["before"][k] for k, _ in MEASURES], width=0.4, label=f"before {revs['before']}"
        )
        ax.bar([x + 0.2 for x in xs], [med["after"][k] for k, _ in MEASURES], width=0.4, label=f"after {revs['after']}")
        for w, dx in (("before", -0.2), ("after", 0.2)):
            for i, (k, _) in enumerate(MEASURES):
                ax.plot([i + dx] * len(runs[w]), [x[k] for x in runs[w]], "k.", markersize=4)
        ax.set_xticks(list(xs), [label for _, label in MEASURES])
        ax.set_ylabel("CPU seconds")
        ax.set_title(f"{args.entries:,} entries: every round (dots), medians (bars)")
        ax.legend()

    plot(name, draw)
    header = "| | " + " | ".join(label for _, label in MEASURES) + " | load (1 min) |"
    lines = [
        *section_head(
            f"Issue 39 gate: the poll of two trees, {args.label} ({args.entries:,} entries)",
            "bench.bench_poll_trees",
            shown,
        ),
        f"Before: {revs['before']}; after: {revs['after']}; {args.rounds} rounds, interleaved (which goes first "
        "alternates), one table; CPU seconds of the child process (user + system).",
        "",
        header,
        "|---" * (len(MEASURES) + 2) + "|",
    ]
    for w in ("before", "after"):
        for i, x in enumerate(runs[w]):
            lines.append(
                f"| {w}, round {i} | " + " | ".join(f"{x[k]:.3f}" for k, _ in MEASURES) + f" | {x['load']:.2f} |"
            )
    for w in ("before", "after"):
        lines.append(f"| **{w}, median** | " + " | ".join(f"**{med[w][k]:.3f}**" for k, _ in MEASURES) + " | |")
    lines.append("| after / before | " + " | ".join(f"{med['after'][k] / med['before'][k]:.3f}" for k, _ in MEASURES)
                 + " | |")  # fmt: skip
    lines += ["", f"![every round](performance/{name}.png)"]
    update_section(name, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
