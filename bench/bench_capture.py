"""Capture: connections created and deleted between two polls, with conntrack events on and off.

Real UDP exchanges cross the lab's node namespace, their entries are read with
``conntrack -L`` (the reference), then deleted with ``conntrack -D`` before the
exporter's next poll. Counted: connections whose end-of-flow record reached Kafka
with exactly the final counters conntrack showed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import machine_line, plot, update_section, write_json


def run_once(n: int, events: bool, broker: object) -> dict:
    from devtools.lab import Lab, run_in
    from tests.support.exporter_process import start_exporter, stop_exporter
    from tests.support.records import by_connection, read_records

    topic = f"capture-{events}-{time.time_ns()}"
    broker.create_topic(topic, partitions=3)  # type: ignore[attr-defined]
    with Lab(pods=4) as lab:
        log = Path(tempfile.mkdtemp()) / "exporter.log"
        proc = start_exporter(
            lab,
            broker.bootstrap,  # type: ignore[attr-defined]
            topic,
            log,
            "--set",
            "conntrack.pollInterval=600s",
            "--set",
            "expiry.activeTimeout=600s",
            "--set",
            "expiry.idleTimeout=600s",
            "--set",
            f"conntrack.events={str(events).lower()}",
            "--set",
            "shutdown.grace=60s",
        )
        pods = lab.pods
        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                exs = list(
                    pool.map(
                        lambda i: lab.udp_exchange(pods[i % 4], pods[(i + 1) % 4], 5500, 40 + i % 50, 200 + i % 300),
                        range(n),
                    )
                )
            traffic_s = time.monotonic() - t0
            table = lab.conntrack_entries()
            by_src = {(c.orig_src, c.orig_sport): c for c in table if c.proto == "udp"}
            expected = {(e.client_ip, e.client_port): by_src.get((e.client_ip, e.client_port)) for e in exs}
            run_in(lab.node_ns, "conntrack", "-D", "-p", "udp")
            time.sleep(3)
            stop_exporter(proc, log, grace=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    bootstrap = broker.bootstrap  # type: ignore[attr-defined]
    groups = by_connection(read_records(bootstrap, topic, expect_at_least=0, timeout=60))
    seen = {(r[0]["sourceAddress"], r[0]["sourcePort"]): r for r in groups.values()}
    exact = 0
    for k, ct in expected.items():
        recs = seen.get(k)
        if not recs or ct is None:
            continue
        last = recs[-1]
        if last["flowEndReason"] == 3 and (
            last["packetTotalCount"],
            last["octetTotalCount"],
            last["reversePacketTotalCount"],
            last["reverseOctetTotalCount"],
        ) == (ct.orig_packets, ct.orig_bytes, ct.reply_packets, ct.reply_bytes):
            exact += 1
    return {"events": events, "connections": n, "exported_exact": exact, "traffic_s": traffic_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=10_000)
    args = p.parse_args(argv)
    from devtools.kafka import KafkaBroker

    rows = []
    with KafkaBroker() as broker:
        for events in (True, False):
            row = run_once(args.connections, events, broker)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json("capture", {"rows": rows})

    def draw(ax: object) -> None:
        ax.bar(  # type: ignore[attr-defined]
            ["events on", "events off (polling only)"],
            [100 * r["exported_exact"] / r["connections"] for r in rows],
            color=["#1f77b4", "#999"],
        )
        ax.set_ylabel("% exported with exact final counters")  # type: ignore[attr-defined]
        ax.set_ylim(0, 105)  # type: ignore[attr-defined]

    plot("capture", draw)
    cmd = "python -m bench.bench_capture " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## Capture: connections created and deleted between two polls",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line()}",
        "",
        "| conntrack events | connections | end-of-flow records with exact final counters |",
        "|---|---:|---:|",
    ]
    for r in rows:
        pct = 100 * r["exported_exact"] / r["connections"]
        on = "on" if r["events"] else "off"
        lines.append(f"| {on} | {r['connections']:,} | {r['exported_exact']:,} ({pct:.1f}%) |")
    lines += ["", "![capture](performance/capture.png)"]
    update_section("capture", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
