"""Export along the whole app path, against a plain confluent-kafka loop with the same payloads, in one run.

The app path is what the expire loop does for every record: ``store.expire`` builds it, the sink
encodes and produces it, librdkafka delivers it, the delivery report comes back through
``poll`` and ``store.acknowledge`` settles it. Timed from the moment records fall due until the
last one is acknowledged by the broker (acks=all, the exporter's producer settings), twice: the
connections' first records (cold: each connection's fixed prefix is encoded then) and the next
active timeout's (steady state: counters moved, prefix cached). The peer is the loop from
confluent-kafka-python's examples (produce, poll every 1,000, flush) sending the very bytes and
keys the exporter produced, with the same producer settings. The source is an in-memory table
(the Source port): conntrack is measured in the poll benchmark. The journal is on (a state directory,
as the chart runs it): every record's SENT row is written before it is produced, its ACKED row after
its delivery report; ``--no-state`` measures without it.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine_line, plot, tcp_conn, update_section, write_json


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def app_round(exp, sink, clock: list[float], n: int) -> tuple[float, float, list[tuple[str, bytes, bytes]]]:
    """Records/s and CPU s per s of wall time, from due to all acknowledged; the (topic, key, value) sent."""
    sink.sent = []
    acked0 = sink.counters.acked
    clock[0] += exp.timeouts.active  # everything falls due now
    t0, c0 = time.perf_counter(), cpu()
    while sink.counters.acked - acked0 < n:
        if exp.expire_once() == 0:
            sink.poll(0.005)  # what the expire loop does while nothing is due: serve deliveries
        else:
            sink.poll(0)
    exp.expire_once()  # applies the last reports, as the loop's next turn would
    wall = time.perf_counter() - t0
    return n / wall, (cpu() - c0) / wall, [(e.topic, e.key, e.value) for batch in sink.sent for e in batch]


def plain_loop(bootstrap: str, config: dict, payloads: list[tuple[str, bytes, bytes]]) -> tuple[float, float]:
    from confluent_kafka import Producer

    settings = {k: v for k, v in config.items() if k not in ("logger", "error_cb")}
    p = Producer(settings | {"bootstrap.servers": bootstrap})
    p.list_topics(timeout=10)
    acked = [0]

    def on_delivery(err, _msg) -> None:
        if err is None:
            acked[0] += 1

    t0, c0 = time.perf_counter(), cpu()
    for i, (topic, key, value) in enumerate(payloads):
        while True:
            try:
                p.produce(topic, value, key, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(120)
    wall = time.perf_counter() - t0
    assert acked[0] == len(payloads), f"plain loop: {acked[0]} of {len(payloads)} acknowledged"
    return len(payloads) / wall, (cpu() - c0) / wall


def recording_sink():
    from flow_exporter.sink import KafkaSink

    class RecordingSink(KafkaSink):
        """Keeps each record produced, for the plain loop to send the same bytes.

        Only each batch's list (one append, outside the app path's own cost): the records' topic, key
        and value are read after the round's clock stops.
        """

        sent: list

        def produce_all(self, exports):
            self.sent.append(exports)
            super().produce_all(exports)

    return RecordingSink


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_app_export")
    ap.add_argument("--connections", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3, help="steady-state rounds after the first records")
    ap.add_argument("--no-state", action="store_true", help="no state directory: no journal")
    args = ap.parse_args(argv)
    import dataclasses

    from devtools.kafka import KafkaBroker
    from flow_exporter.app import Exporter, ExporterOptions
    from flow_exporter.checkpoint import Checkpoint
    from flow_exporter.lifecycle import Lifecycle
    from flow_exporter.sink.encoder import RecordEncoder
    from flow_exporter.timeouts import Timeouts
    from tests.support.fakes import FakeTable

    RecordingSink = recording_sink()

    from flow_exporter import gc_policy

    gc_policy.tune()  # as flow-exporter run does
    n = args.connections
    start = time.time_ns() - 10**9
    conns = [
        tcp_conn(i, bytes([10, 1, (i >> 8) & 0xFF, i & 0xFF]), bytes([10, 2, (i >> 16) & 0xFF, (i >> 4) & 0xFF]),
                 1024 + i % 60000, 10 + i, start_ns=start)
        for i in range(n)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp)) as broker:
        broker.create_topic("app")
        broker.create_topic("plain")
        clock = [1000.0]
        life = Lifecycle()
        sink = RecordingSink({"bootstrap.servers": broker.bootstrap}, "app", RecordEncoder("bench"),
                             stopping=life.stopping)  # fmt: skip
        sink.missing_topics()  # connected before timing
        table = FakeTable(batch=2000)
        table.entries = conns
        checkpoint = None
        if not args.no_state:
            checkpoint = Checkpoint(Path(tmp) / "state")
            assert checkpoint.lock()
            checkpoint.begin(checkpoint.load())
        exp = Exporter(
            table,
            sink,
            ExporterOptions(timeouts=Timeouts(5.0, 5.0, 15.0), node_name="bench", max_in_flight=n),
            lifecycle=life,
            clock=lambda: clock[0],
            checkpoint=checkpoint,
        )  # fmt: skip
        exp.poll_once()
        first, first_cpu, payloads = app_round(exp, sink, clock, n)
        steady, steady_cpu = [], []
        for r in range(args.rounds):
            table.entries = [dataclasses.replace(c, orig_packets=c.orig_packets + r + 1) for c in conns]
            exp.poll_once()
            rate, load, payloads = app_round(exp, sink, clock, n)
            steady.append(rate)
            steady_cpu.append(load)
        plain = [plain_loop(broker.bootstrap, sink.config, [("plain", k, v) for _, k, v in payloads])
                 for _ in range(args.rounds)]  # fmt: skip
    steady_med = sorted(steady)[len(steady) // 2]
    plain_rates = sorted(p[0] for p in plain)
    plain_med = plain_rates[len(plain_rates) // 2]
    result = {
        "connections": n,
        "journal": not args.no_state,
        "record_bytes": len(payloads[0][2]),
        "first_records_per_s": first,
        "first_cpu_cores": first_cpu,
        "steady_records_per_s": steady,
        "steady_cpu_cores": steady_cpu,
        "steady_median": steady_med,
        "plain_loop_records_per_s": [p[0] for p in plain],
        "plain_loop_cpu_cores": [p[1] for p in plain],
        "plain_median": plain_med,
        "ratio_steady_to_plain": steady_med / plain_med,
        "ratio_first_to_plain": first / plain_med,
    }
    write_json("app_export", result)
    print(result)

    def draw(ax) -> None:
        labels = ["app path, first records", "app path, steady", "plain confluent-kafka loop"]
        ax.bar(labels, [first, steady_med, plain_med], color=["#ff7f0e", "#1f77b4", "#7f7f7f"])
        ax.set_ylabel("records/s, produced to acknowledged")

    plot("app_export", draw)
    cmd = " ".join(["python -m bench.bench_app_export", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "## Export along the whole app path",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line()}",
        "",
        f"{n:,} connections due at once; store.expire -> encode -> produce -> delivery report -> acknowledge, to the",
        "local broker (acks=all, the exporter's producer settings), until the last is acknowledged. The plain loop",
        "produces the same keys and values with the same settings (produce, poll every 1,000, flush).",
        "Journal: " + ("off." if args.no_state else "on (a state directory: SENT and ACKED rows for every record)."),
        "",
        "| path | records/s (median) | CPU (cores) | vs plain loop |",
        "|---|---:|---:|---:|",
        f"| app path, first records | {first:,.0f} | {first_cpu:.2f} | {first / plain_med:.2f} |",
        f"| app path, steady state (median of {len(steady)}) | {steady_med:,.0f} | "
        f"{sorted(steady_cpu)[len(steady_cpu) // 2]:.2f} | {steady_med / plain_med:.2f} |",
        f"| plain confluent-kafka loop (median of {len(plain)}) | {plain_med:,.0f} | "
        f"{sorted(p[1] for p in plain)[len(plain) // 2]:.2f} | 1.00 |",
        "",
        "![app_export](performance/app_export.png)",
    ]
    update_section("app_export", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
