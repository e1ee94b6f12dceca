"""Checkpoint cost at 250,000 tracked connections: snapshot, journal, load, and the cap's poll cost.

The state directory is what makes restarts exact; this measures what it costs on the path a
user runs: the expire loop's records (store.expire -> encode -> journal) with and without the
journal, a snapshot of every connection plus 100,000 records in flight (limits.maxInFlight), and
a restart's load and restore. No peer has restart-safe deltas to compare with, so the yardstick
is the exporter's own work: encoding the same records, and a poll of the same table.

Also measured here, on the same synthetic table: a store update when the table is 1% larger
than ``limits.maxConnections`` (the thrash the accounting issue found: ~14 s of CPU per poll,
no records) against the same table under a cap that fits it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine_line, plot, tcp_conn, update_section, write_json


def connections(n: int, packets: int) -> list[Any]:
    """``n`` distinct established TCP entries, ``packets`` each way (the same tuples on every call)."""
    return [
        tcp_conn(
            i,
            bytes((10, 1 + (i >> 16) % 250, (i >> 8) & 0xFF, i & 0xFF)),
            bytes((10, 200, (i >> 10) & 0xFF, 1 + i % 200)),
            20000 + i % 40000,
            packets,
            dport=443,
            start_ns=1_700_000_000_000_000_000 + i,
        )
        for i in range(n)
    ]


def measure(n: int) -> dict[str, Any]:
    from unittest import mock

    from flow_exporter import checkpoint, compiled
    from flow_exporter.checkpoint import Checkpoint, Loaded
    from flow_exporter.sink.encoder import RecordEncoder
    from flow_exporter.store import ConnectionStore
    from flow_exporter.timeouts import Timeouts

    enc = RecordEncoder("bench-node")
    store = ConnectionStore(Timeouts(5, 5, 15), adopt=False)
    now, wall = 1000.0, 1_700_000_000_000_000_000
    store.update(connections(n, 1), now, wall)
    now += 5
    store.update(connections(n, 2), now, wall)

    def expire_encode(journal: Checkpoint | None) -> tuple[float, float, list[Any]]:
        """(seconds to build and encode the due records, seconds to journal them, the records)."""
        t0 = time.perf_counter()
        out = store.expire(now, wall)
        for e in out:
            e.value = enc.encode(e, 1)
            e.topic = "flows"
            e.key = b"k"
        t1 = time.perf_counter()
        if journal is not None:
            journal.sent(out)
        return t1 - t0, time.perf_counter() - t1, out

    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    cp = Checkpoint(work / "state", boot=b"b" * 16)
    cp.lock()
    loaded = cp.load()
    cp.begin(Loaded(loaded.lineage, valid=True))

    # Records of one active timeout (every connection); the first builds the cached prefixes.
    _, _, out = expire_encode(None)
    for e in out:
        store.acknowledge(e, True, now)
    now += 5
    store.update(connections(n, 3), now, wall)
    plain_s, journal_s, out = expire_encode(cp)
    journal_bytes = cp.stats.journal_bytes
    t0 = time.perf_counter()
    cp.delivered(out[: n // 2])
    acked_s = time.perf_counter() - t0
    for e in out[: n // 2]:
        store.acknowledge(e, True, now)
    in_flight = len(out) - n // 2  # the other half stays in flight (capped below to maxInFlight)

    snaps = []
    for _ in range(5):
        # Gathering the rows is part of what the exporter pays for a snapshot, so it is timed too.
        t0 = time.perf_counter()
        cp.snapshot(store.reported(), list(store.in_flight())[:100_000])
        snaps.append(time.perf_counter() - t0)
    snap_bytes = cp.stats.last_snapshot_bytes
    # The same snapshot, packed by the interpreted build of the same source (flow_exporter/checkpoint_rows.py).
    interpreted = compiled.interpreted("checkpoint_rows", as_name="bench_interpreted_checkpoint_rows")
    with mock.patch.object(checkpoint, "_rows", interpreted):
        pure_cp = Checkpoint(work / "pure", boot=b"b" * 16)
        pure_cp.lock()
        pure_cp.begin(Loaded(pure_cp.load().lineage, valid=True))
        snaps_pure = []
        for _ in range(5):
            t0 = time.perf_counter()
            pure_cp.snapshot(store.reported(), list(store.in_flight())[:100_000])
            snaps_pure.append(time.perf_counter() - t0)
        assert pure_cp.stats.last_snapshot_bytes == snap_bytes
        pure_cp.close()
    snap_rows_only = []
    for _ in range(5):
        t0 = time.perf_counter()
        cp.snapshot(store.reported(), [])
        snap_rows_only.append(time.perf_counter() - t0)
    rows_bytes = cp.stats.last_snapshot_bytes
    # A journal after the snapshot: one more active timeout of records, half delivered.
    cp.snapshot(store.reported(), list(store.in_flight())[:100_000])
    for e in out[n // 2 :]:
        store.acknowledge(e, True, now)
    now += 5
    store.update(connections(n, 4), now, wall)
    _, _, out2 = expire_encode(cp)
    cp.delivered(out2[: n // 2])
    cp.close()

    loads = []
    for _ in range(5):
        t0 = time.perf_counter()
        got = Checkpoint(work / "state", boot=b"b" * 16).load()
        loads.append(time.perf_counter() - t0)
    assert got.valid and len(got.rows) == n, (got.why, len(got.rows))
    restored = ConnectionStore(Timeouts(5, 5, 15))
    t0 = time.perf_counter()
    restored.restore(got.rows, got.resends)
    restored.update(connections(n, 5), now, wall)
    restore_poll_s = time.perf_counter() - t0
    assert restored.stats.restored == n
    fresh = ConnectionStore(Timeouts(5, 5, 15))
    t0 = time.perf_counter()
    fresh.update(connections(n, 5), now, wall)
    fresh_poll_s = time.perf_counter() - t0

    per_rec_us = journal_s / n * 1e6
    rec_bytes = journal_bytes / n
    rate = n / 5  # records/s at activeTimeout 5 s
    snap_s = statistics.median(snaps)
    snap_period = max(2 * snap_bytes, 8 << 20) / (rec_bytes * rate)
    return {
        "connections": n,
        "expire_encode_s": plain_s,
        "journal_s": journal_s,
        "journal_us_per_record": per_rec_us,
        "journal_bytes_per_record": rec_bytes,
        "ack_journal_us_per_record": acked_s / (n // 2) * 1e6,
        "snapshot_s": snap_s,
        "snapshot_runs_s": snaps,
        "snapshot_bytes": snap_bytes,
        "snapshot_pure_s": statistics.median(snaps_pure),
        "snapshot_records_in_flight": min(in_flight, 100_000),
        "snapshot_rows_only_s": statistics.median(snap_rows_only),
        "snapshot_rows_only_bytes": rows_bytes,
        "load_s": statistics.median(loads),
        "restore_and_first_poll_s": restore_poll_s,
        "fresh_first_poll_s": fresh_poll_s,
        "records_per_s_at_active_5s": rate,
        "snapshot_period_s": snap_period,
        "cpu_share_of_one_core": (per_rec_us * 1e-6 * rate) + snap_s / snap_period,
    }


def cap_polls(n: int, over: float, polls: int) -> dict[str, Any]:
    """Steady store updates of a table ``over`` times the cap, against the same table under a roomy cap."""
    from flow_exporter.store import ConnectionStore
    from flow_exporter.timeouts import Timeouts

    table = int(n * over)
    out: dict[str, Any] = {"cap": n, "table": table}
    for label, cap in (("over_cap", n), ("roomy", table * 2)):
        store = ConnectionStore(Timeouts(5, 5, 15), max_connections=cap)
        now, wall = 1000.0, 1_700_000_000_000_000_000
        times = []
        for p in range(polls):
            conns = connections(table, p + 1)
            t0 = time.process_time()
            store.update(conns, now, wall)
            times.append(time.process_time() - t0)
            out_records = store.expire(now, wall)
            for e in out_records:
                store.acknowledge(e, True, now)
            now += 5
        out[label] = {
            "first_poll_cpu_s": times[0],
            "steady_poll_cpu_s": statistics.median(times[1:]),
            "given_up": dict(store.stats.given_up),
            "tracked": len(store.connections),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=250_000)
    p.add_argument("--polls", type=int, default=5)
    args = p.parse_args(argv)
    r = measure(args.connections)
    print(json.dumps(r, indent=1), flush=True)
    cap = cap_polls(args.connections, 1.01, args.polls)
    print(json.dumps(cap, indent=1), flush=True)
    write_json("checkpoint", {"checkpoint": r, "cap": cap})

    def draw(ax: Any) -> None:
        labels = ["expire+encode", "journal", "snapshot", "load", "restore + 1st poll", "1st poll, no state"]
        vals = [
            r["expire_encode_s"],
            r["journal_s"],
            r["snapshot_s"],
            r["load_s"],
            r["restore_and_first_poll_s"],
            r["fresh_first_poll_s"],
        ]
        ax.bar(labels, vals, color=["#999", "#1f77b4", "#1f77b4", "#1f77b4", "#1f77b4", "#999"])
        ax.set_ylabel(f"seconds at {r['connections']:,} connections")
        ax.tick_params(axis="x", labelrotation=20)

    plot("checkpoint", draw)
    cmd = " ".join(["python -m bench.bench_checkpoint", *(argv if argv is not None else sys.argv[1:])])
    mib = 1 << 20
    lines = [
        "## Checkpoint",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line()}",
        "",
        f"At {r['connections']:,} tracked connections, all reported at least once (in process; the state"
        " directory on the machine's disk):",
        "",
        "| | time | size |",
        "|---|---:|---:|",
        f"| build + encode the records of one active timeout (for scale) | {r['expire_encode_s']:.2f} s | |",
        f"| journal them (one write per batch, before produce) | {r['journal_s']:.2f} s "
        f"({r['journal_us_per_record']:.2f} µs/record) | {r['journal_bytes_per_record']:.0f} B/record |",
        f"| journal of delivery reports | {r['ack_journal_us_per_record']:.2f} µs/record | 16 B/record |",
        f"| snapshot: every row + {r['snapshot_records_in_flight']:,} records in flight "
        "(median of 5, gathering included) "
        f"| {r['snapshot_s']:.2f} s (interpreted build: {r['snapshot_pure_s']:.2f} s) "
        f"| {r['snapshot_bytes'] / mib:.1f} MiB |",
        f"| snapshot: rows only (median of 5) | {r['snapshot_rows_only_s']:.2f} s "
        f"| {r['snapshot_rows_only_bytes'] / mib:.1f} MiB |",
        f"| restart: load snapshot + replay journal | {r['load_s']:.2f} s | |",
        f"| restart: restore + first store update | {r['restore_and_first_poll_s']:.2f} s "
        f"(first update without state: {r['fresh_first_poll_s']:.2f} s) | |",
        "",
        f"At activeTimeout 5 s ({r['records_per_s_at_active_5s']:,.0f} records/s) a snapshot falls due every "
        f"{r['snapshot_period_s']:.1f} s (journal at twice the snapshot); journal and snapshots together take "
        f"{100 * r['cpu_share_of_one_core']:.1f}% of one core.",
        "",
        f"Connection cap: store updates of a table of {cap['table']:,} entries, CPU seconds per poll:",
        "",
        "| cap | first poll | steady poll (median) | given up | tracked |",
        "|---|---:|---:|---:|---:|",
    ]
    for label in ("over_cap", "roomy"):
        c = cap[label]
        cap_value = cap["cap"] if label == "over_cap" else cap["table"] * 2
        lines.append(
            f"| {cap_value:,} | {c['first_poll_cpu_s']:.2f} s | {c['steady_poll_cpu_s']:.2f} s | "
            f"{sum(c['given_up'].values()):,} | {c['tracked']:,} |"
        )
    lines += ["", "![checkpoint](performance/checkpoint.png)"]
    update_section("checkpoint", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
