"""Soak: ~250k tracked connections, 2,000 new ones per second, for 10 minutes; RSS sampled every 10 s.

Entries are real kernel conntrack entries in a lab namespace (``conntrack -R``),
each with a kernel timeout, so the table holds a steady ~250k while 2k/s arrive
and 2k/s expire. The exporter runs in this process (real dumper, real producer
to the local broker, default timeouts). The RSS curve must be flat after warm-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import machine_line, plot, update_section, write_json


class Feeder:
    """Writes batches of unique ``conntrack -I`` lines and loads them with ``conntrack -R``."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self.n = 0
        self.dir = Path(tempfile.mkdtemp(prefix="soak-"))

    def load(self, count: int, timeout_of: object) -> None:
        lines = []
        for _ in range(count):
            i = self.n
            self.n += 1
            src = f"10.{64 + (i >> 16) % 64}.{(i >> 8) & 255}.{i & 255}"
            t = timeout_of(i) if callable(timeout_of) else timeout_of
            lines.append(
                f"-I -s {src} -d 192.168.{i % 200}.1 -p tcp --sport {1024 + (i >> 22)} --dport 443 "
                f"--state ESTABLISHED --timeout {t} -u SEEN_REPLY"
            )
        path = self.dir / "batch.txt"
        path.write_text("\n".join(lines) + "\n")
        subprocess.run(["ip", "netns", "exec", self.netns, "conntrack", "-R", str(path)], check=True,
                       capture_output=True)  # fmt: skip


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=int, default=2000)
    p.add_argument("--lifetime", type=int, default=125, help="kernel timeout of each entry, seconds")
    args = p.parse_args(argv)

    from devtools.kafka import KafkaBroker
    from devtools.lab import Lab
    from flow_exporter.app import Exporter, ExporterOptions
    from flow_exporter.conntrack.dumper import ConntrackDumper
    from flow_exporter.sink import KafkaSink
    from flow_exporter.sink.encoder import RecordEncoder
    from flow_exporter.timeouts import Timeouts

    samples: list[tuple[float, int, int, int]] = []
    with KafkaBroker() as broker, Lab(pods=1) as lab:
        broker.create_topic("soak", partitions=3)
        ns = lab.table_ns()
        feeder = Feeder(ns)
        steady = args.rate * args.lifetime
        feeder.load(steady, lambda i: 1 + (i * args.lifetime) // steady)  # staggered expiry: steady state at once
        sink = KafkaSink({"bootstrap.servers": broker.bootstrap}, "soak", RecordEncoder("soak"))
        exp = Exporter(ConntrackDumper(netns=ns), sink, ExporterOptions(timeouts=Timeouts(), node_name="soak"))
        th = threading.Thread(target=exp.run)
        th.start()
        t0 = time.monotonic()
        next_sample = t0
        while time.monotonic() - t0 < args.minutes * 60:
            tick = time.monotonic()
            feeder.load(args.rate, args.lifetime)
            if tick >= next_sample:
                with exp.lock:
                    tracked = len(exp.store)
                samples.append((round(tick - t0, 1), rss(), tracked, sink.counters.acked))
                print(json.dumps({"t": samples[-1][0], "rss_mib": samples[-1][1] / 2**20, "tracked": tracked,
                                  "acked": sink.counters.acked}), flush=True)  # fmt: skip
                next_sample += 10
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        exp.stop_event.set()
        th.join(60)
    warm = [s for s in samples if s[0] >= 120] or samples
    start_mib, end_mib = warm[0][1] / 2**20, samples[-1][1] / 2**20
    data = {
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "lifetime_s": args.lifetime,
        "samples": samples,
        "rss_after_warmup_mib": start_mib,
        "rss_end_mib": end_mib,
        "max_tracked": max(s[2] for s in samples),
        "records_acknowledged": samples[-1][3],
    }
    write_json("soak", data)

    def draw(ax: object) -> None:
        ax.plot([s[0] for s in samples], [s[1] / 2**20 for s in samples], marker=".", label="RSS (MiB)")  # type: ignore[attr-defined]
        ax2 = ax.twinx()  # type: ignore[attr-defined]
        ax2.plot([s[0] for s in samples], [s[2] / 1000 for s in samples], color="#ff7f0e", label="tracked (k)")
        ax.set_xlabel("seconds")  # type: ignore[attr-defined]
        ax.set_ylabel("RSS (MiB)")  # type: ignore[attr-defined]
        ax2.set_ylabel("tracked connections (thousands)")
        ax.set_title(f"Soak: ~{steady:,} tracked, {args.rate:,} new/s")  # type: ignore[attr-defined]

    plot("soak", draw)
    cmd = "python -m bench.bench_soak " + " ".join(argv if argv is not None else sys.argv[1:])
    md = f"""## Soak: ~{steady:,} tracked connections, {args.rate:,} new per second, {args.minutes:g} minutes

Command: `{cmd}`
Machine: {machine_line()}

RSS after warm-up (2 min): {start_mib:.0f} MiB; at the end: {end_mib:.0f} MiB
({end_mib - start_mib:+.0f} MiB). Peak tracked: {data["max_tracked"]:,}; records acknowledged:
{data["records_acknowledged"]:,}.

![soak](performance/soak.png)
"""
    update_section("soak", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
