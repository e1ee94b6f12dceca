"""Issue 39's gate: `flow-exporter run` from the tree before a port and the tree after it, interleaved.

One lab table and one broker; each round runs the exporter of each tree once (which goes first alternates),
as bench_node measures it (steady-state CPU, peak RSS, records/s; every connection's first record acked
first). The trees are checkouts with their compiled modules built in place; the exporter imports the one
its PYTHONPATH names (checked and recorded per run). Every run, the medians and the ratios go to
docs/performance.md (section ``gate_<label>``) and docs/performance/gate_<label>.json, with a plot.

    python -m bench.bench_gate --label heap --before ../old --after . --connections 250000 --active 5s --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import plot, section_head, update_section, write_json

METRICS = [  # (key, label, format, better)
    ("cpu_cores", "CPU, steady state (cores)", "{:.3f}", "lower"),
    ("cpu_user_cores", "of which user", "{:.3f}", "lower"),
    ("cpu_system_cores", "of which system", "{:.3f}", "lower"),
    ("peak_rss_bytes", "peak RSS (MiB)", "{:.0f}", "lower"),
    ("records_per_s", "records/s acknowledged", "{:,.0f}", "higher"),
    ("poll_seconds_mean", "poll, mean (s)", "{:.3f}", "lower"),
    ("first_records_all_acked_s", "start to every first record acked (s)", "{:.1f}", "lower"),
]


def imported_from(tree: Path) -> str:
    """Where `python -m flow_exporter` run as the gate runs it imports the package from, and whether compiled."""
    code = (  # a tree of issue 39 and after says so in flow_exporter.compiled; one before, in flow_exporter.native
        "import flow_exporter, importlib.util as u\n"
        "if u.find_spec('flow_exporter.compiled'):\n"
        "    from flow_exporter import compiled as c; built = c.COMPILED\n"
        "else:\n"
        "    from flow_exporter import native as n; built = n.compiled() is not None\n"
        "print(flow_exporter.__file__, built)"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, check=True)
    path, compiled = out.stdout.split()
    if not Path(path).resolve().is_relative_to(tree.resolve()) or compiled != "True":
        raise SystemExit(f"{tree}: flow_exporter imports from {path} (compiled: {compiled}), not the tree's build")
    return path


def commit(tree: Path) -> str:
    """The tree's commit (what the results name it by: never a path of the machine that ran them)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def value(run: dict[str, Any], key: str) -> float:
    v = float(run[key] or 0)
    return v / 2**20 if key.endswith("_bytes") else v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_gate", description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="the port this gates (names the section and the files)")
    ap.add_argument("--before", type=Path, required=True, help="the tree before the port (built in place)")
    ap.add_argument("--after", type=Path, required=True, help="the tree after it (built in place)")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--active", default="5s")
    ap.add_argument("--idle", default="15s")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=3, help="rounds; each runs both trees once")
    args = ap.parse_args(argv)
    from bench.bench_node import measure
    from devtools.kafka import KafkaBroker
    from devtools.lab import Lab
    from tests.support import exporter_process  # noqa: F401  (imported before the working directory moves)

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for tree in trees.values():
        imported_from(tree)
    commits = {label: commit(tree) for label, tree in trees.items()}
    shown = list(argv if argv is not None else sys.argv[1:])
    for label, tree in (("before", args.before), ("after", args.after)):
        for i, a in enumerate(shown):
            if a == str(tree):
                shown[i] = f"<checkout of {commits[label]}>"
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    n = args.connections
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker, Lab(pods=1) as lab:
        ns = lab.table_ns()
        lab.load_synthetic(n, netns=ns, timeout=3600)
        for r in range(args.runs):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for label in order:
                os.environ["PYTHONPATH"] = str(trees[label])
                os.chdir("/")  # `python -m` puts the working directory first on sys.path
                try:
                    res = measure(ns, broker, Path(tmp), n, active=args.active, idle=args.idle, pure=False,
                                  window=args.window, topic=f"gate-{label}-{r}", max_in_flight=50_000,
                                  prefix_cache="auto")  # fmt: skip
                finally:
                    os.chdir(here)
                    os.environ.pop("PYTHONPATH", None)
                res["round"], res["order"] = r, order.index(label)
                runs[label].append(res)
                print(f"round {r} {label}: " + ", ".join(f"{k} {value(res, k):.4g}" for k, *_ in METRICS), flush=True)
    medians = {lab: {k: statistics.median(value(x, k) for x in rs) for k, *_ in METRICS} for lab, rs in runs.items()}
    name = f"gate_{args.label}"
    command = " ".join(["python -m bench.bench_gate", *shown])  # without this machine's paths
    write_json(name, {"command": command, "label": args.label, "connections": n, "active": args.active,
                      "idle": args.idle, "window_s": args.window, "commits": commits, "runs": runs,
                      "medians": medians})  # fmt: skip

    def draw(ax: Any) -> None:
        for i, (k, *_) in enumerate(METRICS[:5]):
            for j, label in enumerate(("before", "after")):
                ys = [value(x, k) / medians["before"][k] for x in runs[label]]
                ax.scatter([i + (j - 0.5) * 0.3] * len(ys), ys, color=("#1f77b4", "#ff7f0e")[j],
                           label=label if i == 0 else None)  # fmt: skip
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_xticks(range(5), [t for _, t, *_ in METRICS[:5]], rotation=15)
        ax.set_ylabel("each run / median before")
        ax.set_title(f"{args.label}: {n:,} connections, active {args.active}, every run")
        ax.legend()

    plot(name, draw)
    lines = [
        *section_head(
            f"Issue 39 gate: {args.label} ({n:,} connections, active {args.active}, idle {args.idle})",
            "bench.bench_gate",
            shown,
        ),
        f"`flow-exporter run` from the tree before the port ({commits['before']}) and from the tree after it "
        f"({commits['after']}), {args.runs} rounds, "
        f"interleaved (which goes first alternates), on one table of {n:,} synthetic conntrack entries and one "
        f"local broker; each run measured as [the node pipeline](#the-whole-node-pipeline-at-250000-connections-"
        f"compiled-path-active-5s) measures it ({args.window:.0f} s of steady state).",
        "",
        "| | " + " | ".join(t for _, t, *_ in METRICS) + " |",
        "|---|" + "---|" * len(METRICS),
    ]
    for label in ("before", "after"):
        for x in runs[label]:
            cells = [fmt.format(value(x, k)) for k, _, fmt, _ in METRICS]
            lines.append(f"| {label}, round {x['round']} | " + " | ".join(cells) + " |")
    for label in ("before", "after"):
        lines.append(f"| **{label}, median** | " + " | ".join(
            f"**{fmt.format(medians[label][k])}**" for k, _, fmt, _ in METRICS) + " |")  # fmt: skip
    lines.append("| after / before | " + " | ".join(
        f"{medians['after'][k] / medians['before'][k]:.3f}" if medians["before"][k] else "-" for k, *_ in METRICS
    ) + " |")  # fmt: skip
    lines += ["", f"![every run](performance/{name}.png)", ""]
    update_section(name, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
