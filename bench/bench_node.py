"""The whole node pipeline at 250,000 tracked connections: `flow-exporter run` as a DaemonSet runs it.

Real kernel conntrack entries in a lab namespace (``conntrack -R``), the exporter as a separate
process with the deployment's settings (poll 5 s, active timeout 5 s, events on, a state
directory, metrics on), a local broker. After the first records of every connection have gone
out, CPU (user + system, from /proc), RSS and the records acknowledged (from /metrics) are
measured over a window of steady state. Synthetic entries carry no traffic: after their first
records and the idle timeout they stay quiet, so this is the fixed cost of a 250k table (a full
dump every poll, the store update, events, checkpoint snapshots); the cost per record is measured
by bench_app_export.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import plot_load, section_head, update_section, write_json
from flow_exporter.settings import parse_duration


def proc_cpu(pid: int, which: str = "both") -> float:
    """CPU seconds the process used so far: user and system (``which``: "both", "user" or "system").

    Apart, they tell the exporter's own code (user) from the kernel's work for it (system: the conntrack
    dump, whose cost moves from run to run with the table's layout, and the state directory's writes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system = int(fields[11]), int(fields[12])
    ticks = {"both": user + system, "user": user, "system": system}[which]
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int, field: str = "VmRSS") -> int:
    """Resident memory now (VmRSS), or its peak since the process started (VmHWM), in bytes."""
    m = re.search(field + r":\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def ready(port: int) -> bool:
    from tests.support.exporter_process import scrape

    try:
        return scrape(port, "/readyz")[0] == 200
    except OSError:  # not listening yet
        return False


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def measure(
    ns: str | None,
    broker: Any,
    tmp: Path,
    n: int,
    *,
    active: str,
    idle: str,
    pure: bool,
    window: float,
    topic: str,
    max_in_flight: int = 50_000,
    prefix_cache: str = "auto",
    source_args: tuple[str, ...] = (),
    sampling: str = "1",
) -> dict[str, Any]:
    """Run ``flow-exporter run`` on the ``n`` entries already in ``ns`` and measure its steady state.

    ``ns`` None: the exporter's own namespace; ``source_args``: more settings for the source (e.g. the Cilium
    source's, bench_cilium: then ``n`` is the connections it makes of its maps). ``sampling``:
    sampling.probability (bench_sampling); below 1 the first records awaited are the kept connections'.

    Waits for readiness and for every connection's first record to be acknowledged, then measures
    CPU, RSS and the exporter's own counters over ``window`` seconds; stops the exporter.
    """
    from tests.support.exporter_process import free_port, scrape

    broker.create_topic(topic, partitions=3)
    port = free_port()
    log = tmp / f"{topic}.log"
    cmd = [sys.executable, "-m", "flow_exporter", "run", *(["--netns", ns] if ns else []), *source_args,
           "--bootstrap-servers", broker.bootstrap,
           "--topic", topic, "--node-name", "bench-node", "--set", f"state.dir={tmp}/{topic}-state",
           "--set", f"metrics.port={port}", "--set", "metrics.address=127.0.0.1",
           "--set", f"expiry.activeTimeout={active}", "--set", f"expiry.idleTimeout={idle}",
           # the DaemonSet's limits (k8s/config.yaml), the cap raised to the table when it is larger, the records
           # in flight raised with --max-in-flight
           "--set", f"limits.maxConnections={max(n, 250_000)}",
           "--set", f"limits.maxInFlight={max_in_flight}", "--set", f"export.prefixCache={prefix_cache}",
           "--set", f"sampling.probability={sampling}"]  # fmt: skip
    with open(log, "wb") as out:
        # the interpreted build: chosen once, by the environment (a tree before issue 39 reads the setting)
        pure_env = {**os.environ, "FLOW_EXPORTER_INTERPRETED": "1"} if pure else None
        cmd += ["--set", "conntrack.compiled=false"] if pure else []
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=pure_env)
    try:
        t_start = time.monotonic()
        while not ready(port):
            if proc.poll() is not None or time.monotonic() - t_start > 120:
                raise SystemExit(f"exporter did not become ready:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        ready_s = time.monotonic() - t_start

        def first_records_out() -> bool:
            text = scrape(port, "/metrics")[1]
            want = n if sampling == "1" else metric(text, "flow_exporter_connections_added_total")
            return (
                metric(text, "flow_exporter_polls_total") > 0
                and metric(text, "flow_exporter_records_acknowledged_total") >= want
            )

        while not first_records_out():
            if proc.poll() is not None or time.monotonic() - t_start > 900:
                raise SystemExit(f"first records did not all go out:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        first_all_s = time.monotonic() - t_start
        time.sleep(5)
        m0 = scrape(port, "/metrics")[1]
        c0, u0, w0 = proc_cpu(proc.pid), proc_cpu(proc.pid, "user"), time.monotonic()
        rss = []
        while time.monotonic() - w0 < window:
            time.sleep(1)
            rss.append(proc_rss(proc.pid))
        c1, u1, w1 = proc_cpu(proc.pid), proc_cpu(proc.pid, "user"), time.monotonic()
        m1 = scrape(port, "/metrics")[1]
        peak = proc_rss(proc.pid, "VmHWM")  # first poll, first records and snapshots included
        load = os.getloadavg()[0]
        # SIGTERM as the kubelet sends it: every connection's final record, within limits.maxInFlight.
        proc.terminate()
        t_term, shutdown_peak = time.monotonic(), 0
        while proc.poll() is None and time.monotonic() - t_term < 120:
            shutdown_peak = max(shutdown_peak, proc_rss(proc.pid, "VmHWM"))
            time.sleep(0.1)
        shutdown_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)
    said = [line for line in log.read_text(errors="replace").splitlines() if "shutdown" in line]

    def grew(name: str) -> float:
        return metric(m1, f"flow_exporter_{name}") - metric(m0, f"flow_exporter_{name}")

    acked = grew("records_acknowledged_total")
    polls = grew("polls_total")
    poll_s = grew("poll_duration_seconds_sum")
    wall = w1 - w0
    rss_med = sorted(rss)[len(rss) // 2]
    active_s = parse_duration("active", active)
    # Every entry is due once per active timeout while the idle timeout has not stopped it (quiet
    # synthetic entries leave the queue at their idle timeout): that rate is what the table demands.
    demanded = n / active_s if parse_duration("idle", idle) > w1 - t_start + active_s else None
    return {
        "connections": n,
        "path": "pure" if pure else "compiled",
        "active_timeout": active,
        "idle_timeout": idle,
        "max_in_flight": max_in_flight,
        "prefix_cache": prefix_cache,
        "tracked": metric(m1, "flow_exporter_connections_tracked"),
        "sampling_probability": sampling,
        "sampled_out": metric(m1, "flow_exporter_connections_sampled_out_total"),
        "ready_s": ready_s,
        "first_records_all_acked_s": first_all_s,
        "window_s": wall,
        "cpu_cores": (c1 - c0) / wall,
        "cpu_user_cores": (u1 - u0) / wall,
        "cpu_system_cores": (c1 - c0 - (u1 - u0)) / wall,
        "records_per_s": acked / wall,
        "demanded_per_s": demanded,
        "polls": polls,
        "poll_seconds_mean": poll_s / polls if polls else None,
        "rss_bytes": rss_med,
        "rss_per_connection": rss_med / n,
        "peak_rss_bytes": peak,
        "records_given_up": metric(m1, "flow_exporter_records_given_up_total"),
        "checkpoint_snapshot_seconds": metric(m1, "flow_exporter_checkpoint_last_snapshot_seconds"),
        "load_average_1m": load,
        "shutdown_s": shutdown_s,
        "shutdown_peak_rss_bytes": shutdown_peak,
        "shutdown_exit_code": proc.returncode,
        "shutdown_log": said[-3:],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_node")
    ap.add_argument("--connections", type=int, default=250_000)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    ap.add_argument("--active", default="5s", help="expiry.activeTimeout (production: 60s)")
    ap.add_argument("--idle", default="15s",
                    help="expiry.idleTimeout (default 15s: quiet entries stop after it; 1h keeps every entry due "
                         "once per active timeout, the table's full demand)")  # fmt: skip
    ap.add_argument("--pure", action="store_true", help="the interpreted build (FLOW_EXPORTER_INTERPRETED=1)")
    ap.add_argument("--max-in-flight", type=int, default=50_000,
                    help="limits.maxInFlight (the DaemonSet's 50000: 6 s of records at 500k, active 60s)")  # fmt: skip
    ap.add_argument(
        "--prefix-cache",
        default="auto",
        choices=["auto", "true", "false"],
        help="export.prefixCache (auto: kept when the active timeout is under 30 s)",
    )
    args = ap.parse_args(argv)
    from devtools.kafka import KafkaBroker
    from devtools.lab import Lab

    n = args.connections
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp) / "kafka") as broker, Lab(pods=1) as lab:
        ns = lab.table_ns()
        lab.load_synthetic(n, netns=ns, timeout=3600)
        result = measure(ns, broker, Path(tmp), n, active=args.active, idle=args.idle, pure=args.pure,
                         window=args.window, topic="node", max_in_flight=args.max_in_flight,
                         prefix_cache=args.prefix_cache)  # fmt: skip
    wall = result["window_s"]
    rss_med = result["rss_bytes"]
    peak = result["peak_rss_bytes"]
    demanded = result["demanded_per_s"]
    default = n == 250_000 and not args.pure and args.active == "5s" and args.idle == "15s"
    default = default and args.max_in_flight == 50_000 and args.prefix_cache == "auto"
    idle_tag = "" if args.idle == "15s" else f"_idle{args.idle}"
    idle_tag += "" if args.max_in_flight == 50_000 else f"_inflight{args.max_in_flight}"
    idle_tag += "" if args.prefix_cache == "auto" else f"_prefixcache{args.prefix_cache}"
    name = "node" if default else f"node_{n}_{result['path']}_active{args.active}{idle_tag}"
    write_json(name, result)
    print(result)

    title = f"flow-exporter run, {n:,} connections, poll 5 s, active {args.active}, {result['path']} path"
    plot_load(name, result["cpu_cores"], result["records_per_s"], title)
    if demanded is None:
        traffic = [
            "Synthetic entries",
            "carry no traffic: after their first records and the idle timeout they are quiet, so this is the fixed",
            "cost of the table (a full dump per poll, the store update, events, snapshots); per-record cost: see",
            "the app-path export section (at 50,000 records/s add 50,000 / its steady rate, in cores).",
        ]
    else:
        traffic = [
            f"The idle timeout ({args.idle})",
            "is longer than the run, so every entry is due once per active timeout: the table demands "
            f"{demanded:,.0f} records/s.",
        ]
    lines = [
        *section_head(
            f"The whole node pipeline at {n:,} connections ({result['path']} path, active {args.active}"
            + ("" if demanded is None else f", idle {args.idle}")
            + ")",
            "bench.bench_node",
            argv,
        ),
        f"`flow-exporter run` on {n:,} real conntrack entries (synthetic, `conntrack -R`), poll 5 s, active timeout",
        f"{args.active}, idle timeout {args.idle}, events on, state.dir on, metrics on, the DaemonSet's limits "
        f"(maxConnections {max(n, 250_000):,}, maxInFlight {args.max_in_flight:,}), export.prefixCache "
        f"{args.prefix_cache},"
        " a local broker (3 partitions). Measured over "
        f"{wall:.0f} s of steady state, after every connection's first record was acknowledged "
        f"(load average {result['load_average_1m']:.2f} at its end). " + traffic[0],
        *traffic[1:],
        "",
        "| measure | result |",
        "|---|---:|",
        f"| CPU, user + system | {result['cpu_cores']:.2f} cores |",
        *([] if demanded is None else [f"| records demanded by the table | {demanded:,.0f}/s |"]),
        f"| records acknowledged | {result['records_per_s']:,.0f}/s |",
        f"| poll (dump + store update), mean | {result['poll_seconds_mean'] or 0:.2f} s |",
        f"| RSS | {rss_med / 2**20:,.0f} MiB ({result['rss_per_connection']:,.0f} B per connection) |",
        f"| peak RSS since start (first poll, first records, snapshots) | {peak / 2**20:,.0f} MiB |",
        f"| ready (first poll done) after start | {result['ready_s']:.1f} s |",
        f"| every connection's first record acknowledged after start | {result['first_records_all_acked_s']:.1f} s |",
        f"| SIGTERM to exit (every final record, shutdown.grace 30 s) | {result['shutdown_s']:.1f} s, exit code "
        f"{result['shutdown_exit_code']} |",
        f"| peak RSS at exit (the shutdown's final records included) | "
        f"{result['shutdown_peak_rss_bytes'] / 2**20:,.0f} MiB |",
        "",
        *[f"    {line[-200:]}" for line in result["shutdown_log"]],
        "",
        f"![node](performance/{name}.png)",
    ]
    update_section(name, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
