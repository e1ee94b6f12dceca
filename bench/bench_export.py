"""Export throughput: records built, Avro-encoded and produced to the local broker, delivery confirmed.

Compared in the same run, against the same broker, with Kafka's own
``org.apache.kafka.tools.ProducerPerformance`` sending records of the same size
with the same acks/linger/compression settings.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from bench.common import machine_line, plot, tcp_conn, update_section, write_json


def synthetic_exports(n: int) -> list:
    """``n`` due exports from a real store, as the expire loop would produce them."""
    from flow_exporter.store import ConnectionStore

    start = time.time_ns() - 10**9
    conns = [
        tcp_conn(
            i,
            bytes([10, 1, (i >> 8) & 0xFF, i & 0xFF]),
            bytes([10, 2, (i >> 16) & 0xFF, (i >> 4) & 0xFF]),
            1024 + i % 60000,
            10 + i,
            orig_dst=bytes([10, 96, 0, 10]),
            start_ns=start,
        )
        for i in range(n)
    ]
    store = ConnectionStore()
    now = time.monotonic()
    store.update(conns, now, time.time_ns())
    return store.expire(now + 3600, time.time_ns())


def encode_only(exports: list) -> tuple[float, float]:
    """Records/s of the exporter's encoder: a connection's first record (cold), then a repeat (warm).

    Active connections get a record every active timeout, so in steady state most
    records are repeats, whose per-connection prefix is already encoded.
    """
    from flow_exporter.sink.encoder import RecordEncoder

    enc = RecordEncoder("bench-node").encode
    rates = []
    for _ in range(2):
        ms = time.time_ns() // 1_000_000
        t0 = time.perf_counter()
        for e in exports:
            enc(e, ms)
        rates.append(len(exports) / (time.perf_counter() - t0))
    return rates[0], rates[1]


def fastavro_only(exports: list) -> float:
    """Records/s of build_record + fastavro.schemaless_writer: the library path, for comparison."""
    from tests.support.reference import AvroSerializer, build_record

    ser = AvroSerializer()
    ms = time.time_ns() // 1_000_000
    t0 = time.perf_counter()
    for e in exports:
        ser(build_record(e, "bench-node", ms))
    return len(exports) / (time.perf_counter() - t0)


def produce(exports: list, bootstrap: str, topic: str) -> tuple[float, int, int]:
    """Records/s from first produce to last delivery report; returns (rate, acked, record size)."""
    from flow_exporter.sink import KafkaSink
    from flow_exporter.sink.encoder import RecordEncoder

    enc = RecordEncoder("bench-node").encode
    sink = KafkaSink({"bootstrap.servers": bootstrap}, topic, enc)
    sink.missing_topics()  # connect before timing
    ms = time.time_ns() // 1_000_000
    for e in exports:  # steady state: repeat records of known connections
        enc(e, ms)
    size = len(enc(exports[0], ms))
    t0 = time.perf_counter()
    for i, e in enumerate(exports):
        sink.send(e, ms)
        if i & 1023 == 0:
            sink.poll(0)
    sink.flush(120)
    elapsed = time.perf_counter() - t0
    return len(exports) / elapsed, sink.counters.acked, size


def producer_performance(bootstrap: str, topic: str, n: int, size: int) -> float:
    from devtools.kafka import ensure_jars
    from flow_exporter.sink.kafka import PRODUCER_DEFAULTS

    lib = ensure_jars()
    props = [
        f"bootstrap.servers={bootstrap}",
        "acks=all",
        "enable.idempotence=true",
        f"linger.ms={PRODUCER_DEFAULTS['linger.ms']}",
        f"compression.type={PRODUCER_DEFAULTS['compression.type']}",
        f"batch.size={PRODUCER_DEFAULTS['batch.size']}",
    ]
    cmd = [
        "java",
        "-cp",
        f"{lib}/*",
        "org.apache.kafka.tools.ProducerPerformance",
        "--topic",
        topic,
        "--num-records",
        str(n),
        "--record-size",
        str(size),
        "--throughput",
        "-1",
        "--producer-props",
        *props,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.findall(r"(\d+) records sent, ([\d.]+) records/sec", out)
    if not m:
        raise RuntimeError(f"unexpected ProducerPerformance output: {out[-500:]}")
    return float(m[-1][1])


def run(n: int, repeat: int) -> dict:
    from devtools.kafka import KafkaBroker

    exports = synthetic_exports(n)
    views = [e.conn for e in exports]

    def cold() -> list:
        """The exports as built, before encoding (which keeps the prefix and lets go of the connection's fields)."""
        for e, v in zip(exports, views, strict=True):
            e.prefix, e.conn = None, v
        return exports

    both = [encode_only(cold()) for _ in range(repeat)]
    cold_rates = [b[0] for b in both]
    enc_rates = [b[1] for b in both]
    fastavro_rates = [fastavro_only(cold()) for _ in range(repeat)]
    with KafkaBroker() as broker:
        broker.create_topic("bench-ours", partitions=3)
        broker.create_topic("bench-pp", partitions=3)
        ours, pp = [], []
        size = 0
        for _ in range(repeat):
            rate, acked, size = produce(exports, broker.bootstrap, "bench-ours")
            assert acked == n, f"only {acked} of {n} acknowledged"
            ours.append(rate)
            pp.append(producer_performance(broker.bootstrap, "bench-pp", n, size))
            print(json.dumps({"ours": rate, "producer_performance": pp[-1], "record_size": size}), flush=True)
    med = sorted(ours)[len(ours) // 2]
    med_pp = sorted(pp)[len(pp) // 2]
    return {
        "records": n,
        "record_size": size,
        "encode_records_per_s": sorted(enc_rates)[len(enc_rates) // 2],
        "encode_cold_records_per_s": sorted(cold_rates)[len(cold_rates) // 2],
        "fastavro_records_per_s": sorted(fastavro_rates)[len(fastavro_rates) // 2],
        "produce_records_per_s": med,
        "producer_performance_records_per_s": med_pp,
        "ratio_vs_producer_performance": med / med_pp,
        "runs": {"ours": ours, "producer_performance": pp, "encode": enc_rates, "fastavro": fastavro_rates},
    }


def report(d: dict, cmd: str) -> None:
    def draw(ax: object) -> None:
        labels = ["fastavro\nencode", "our encoder", "flow-exporter\nproduce, acked", "ProducerPerf.\n(same size)"]
        vals = [
            d["fastavro_records_per_s"],
            d["encode_records_per_s"],
            d["produce_records_per_s"],
            d["producer_performance_records_per_s"],
        ]
        ax.bar(labels, vals, color=["#bbb", "#888", "#1f77b4", "#ff7f0e"])  # type: ignore[attr-defined]
        ax.set_ylabel("records/s (median)")  # type: ignore[attr-defined]
        title = f"Export throughput, {d['records']:,} records of {d['record_size']} bytes"
        ax.set_title(title)  # type: ignore[attr-defined]

    plot("export", draw)
    pp = d["producer_performance_records_per_s"]
    cold = d["encode_cold_records_per_s"]
    md = f"""## Export throughput (local broker, delivery confirmed)

Command: `{cmd}`
Machine: {machine_line()}

| | records/s (median) |
|---|---:|
| encode only, fastavro (build_record + schemaless_writer), one core | {d["fastavro_records_per_s"]:,.0f} |
| encode only, the exporter's encoder, a connection's first record (prefix not cached) | {cold:,.0f} |
| encode only, the exporter's encoder, repeat records (steady state), one core | {d["encode_records_per_s"]:,.0f} |
| flow-exporter: build + encode + produce, every delivery acknowledged | {d["produce_records_per_s"]:,.0f} |
| Kafka ProducerPerformance, {d["record_size"]}-byte records, same broker and settings | {pp:,.0f} |

Ratio flow-exporter / ProducerPerformance: {d["ratio_vs_producer_performance"]:.2f}
(acks=all, idempotence on, lz4, linger.ms 50; {d["records"]:,} records per run).

![export](performance/export.png)
"""
    update_section("export", md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    d = run(args.records, args.repeat)
    write_json("export", d)
    report(d, "python -m bench.bench_export " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
