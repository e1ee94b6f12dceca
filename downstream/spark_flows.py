"""Reference Spark Structured Streaming job: bytes and packets per (source, destination) and time window.

It reads the exporter's topic with Spark's Kafka source, decodes each value with ``from_avro`` and
``schemas/flow_record.avsc`` (bare Avro; ``--confluent`` strips a Confluent wire-format header
first), and writes one row per tumbling event-time window and group, to the console or to Parquet.

Groups. Kubernetes fields are null until enrichment exists, so each side falls back to addresses:

* ``source``: ``sourcePodNamespace/sourcePodName``, else ``sourceAddress``;
* ``destination``: ``destinationService`` (``namespace/name:port/protocol``), else
  ``destinationPodNamespace/destinationPodName``, else ``destinationAddress:destinationPort``
  (``[address]:port`` for IPv6). The address and port are the ones after DNAT (the backend).

Counting (``--mode deltas``, the default) is the README's consumer rule ("Counting: the
contract"): drop duplicate (connectionId, sequence) pairs within the watermark, keeping any copy
(the exporter resends a record only as the same bytes), then sum the ``*DeltaCount`` fields. It
is exact across exporter restarts, resends and races as long as the exporter keeps its
``state.dir``; a record that arrives later than the watermark (an outage longer than it) is
dropped, so set ``--watermark`` above the longest outage to be counted.

``--mode totals`` is the rule for exporters without state (or a state that was lost): their
records of connections found live are flagged adopted and restart under new connectionIds, so
summing deltas would count those twice. The cumulative ``*TotalCount`` fields are the kernel's
own and survive anything, so the job keeps, per connection, the highest totals seen so far (a
Python stateful step, ``applyInPandasWithState``) and emits each record's rise above them. A
connection is identified by kernel values no exporter restart changes: (exporterNode, zone,
protocol, sourceAddress, sourcePort, destinationAddress, destinationPort, ctId, flowStart), plus
the connectionId of records flagged "counters reset" (the totals of such a segment restart from
zero). Increments go to the window of the record that revealed them; summed over all windows they
equal each connection's final kernel totals. Connections are hashed into ``--state-buckets``
state keys (one Python call per key and batch, not per connection). A connection's state is
dropped once the watermark passes its newest record by ``--state-ttl``; a connection silent for
longer and then re-exported by a restarted stateless exporter is counted again.

Output rows (append mode) appear once the watermark (latest event time minus ``--watermark``)
passes a window's end, so an ``--available-now`` run leaves the newest windows in its checkpoint
for the next run to emit. Spark runs in local mode with the connector jars from
``devtools.spark`` in ``spark.jars``: nothing is resolved over the network at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery
    from pyspark.sql.streaming.state import GroupState

_REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMA = _REPO_ROOT / "schemas" / "flow_record.avsc"

TOTALS = ("packetTotalCount", "octetTotalCount", "reversePacketTotalCount", "reverseOctetTotalCount")
DELTAS = ("packetDeltaCount", "octetDeltaCount", "reversePacketDeltaCount", "reverseOctetDeltaCount")
# The record fields the job reads; the others are skipped when decoding.
USED_FIELDS = frozenset(
    {
        "connectionId",
        "sequence",
        "exporterNode",
        "flowStart",
        "flags",
        "exportTime",
        "flowEnd",
        "ipVersion",
        "protocol",
        "zone",
        "ctId",
        "sourceAddress",
        "sourcePort",
        "destinationAddress",
        "destinationPort",
        "sourcePodNamespace",
        "sourcePodName",
        "destinationPodNamespace",
        "destinationPodName",
        "destinationService",
        *TOTALS,
        *DELTAS,
    }
)
# Output counter columns, in the order of TOTALS / DELTAS.
COUNTERS = ("forward_packets", "forward_bytes", "reverse_packets", "reverse_bytes")

_INCREMENT_SCHEMA = "eventTime timestamp, source string, destination string, " + ", ".join(
    f"{c} long" for c in COUNTERS
)
_STATE_SCHEMA = "highWater binary"


def _ensure_repo_on_path() -> None:
    """Run as ``python downstream/spark_flows.py``: make ``flow_exporter`` importable for the jar lookup."""
    root = str(_REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="spark_flows.py", description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--bootstrap-servers", required=True, help="Kafka bootstrap servers, host:port[,...]")
    ap.add_argument("--topic", required=True, help="flow topic (a comma-separated list subscribes to several)")
    ap.add_argument("--starting-offsets", default="earliest", help="earliest, latest or Spark's JSON offsets")
    ap.add_argument("--window", default="1 minute", help="tumbling window length (default: 1 minute)")
    ap.add_argument("--watermark", default="1 minute", help="allowed lateness of event time (default: 1 minute)")
    ap.add_argument("--event-time", choices=("exportTime", "flowEnd"), default="exportTime", help="event-time column")
    ap.add_argument("--mode", choices=("deltas", "totals"), default="deltas", help="see the module docstring")
    ap.add_argument(
        "--state-ttl", default="1 hour", help="totals mode: keep a connection's state this long after its last record"
    )
    ap.add_argument(
        "--state-buckets",
        type=int,
        default=64,
        help="totals mode: connections are hashed into this many state keys (fixed per checkpoint)",
    )
    ap.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA, help="Avro schema file (default: the repo's)")
    ap.add_argument("--confluent", action="store_true", help="values carry the 5-byte Confluent header; strip it")
    ap.add_argument("--parquet", type=Path, metavar="DIR", help="write Parquet here instead of the console")
    ap.add_argument("--checkpoint", type=Path, help="checkpoint dir (default with --parquet: DIR.checkpoint)")
    ap.add_argument("--available-now", action="store_true", help="process what the topic holds now, then stop")
    ap.add_argument("--trigger", default="10 seconds", help="processing-time trigger interval otherwise")
    ap.add_argument("--max-offsets-per-trigger", type=int, help="cap records per micro-batch")
    ap.add_argument("--shuffle-partitions", type=int, default=2, help="also the number of state partitions")
    ap.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    ap.add_argument("--driver-memory", default="2g")
    ap.add_argument(
        "--driver-java-options",
        default="",
        help="extra JVM flags, given as --driver-java-options='-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' "
        "(that pair suits short runs on small machines)",
    )
    return ap.parse_args(argv)


def interval_ms(text: str) -> int:
    """``'1 hour'``, ``'90 seconds'``, ``'500 milliseconds'`` -> milliseconds (Spark's interval words)."""
    units = {"millisecond": 1, "second": 1000, "minute": 60_000, "hour": 3_600_000, "day": 86_400_000}
    parts = text.split()
    if len(parts) != 2:
        raise ValueError(f"not an interval like '10 minutes': {text!r}")
    unit = parts[1].lower().removesuffix("s")
    if unit not in units:
        raise ValueError(f"unknown interval unit in {text!r}")
    return int(float(parts[0]) * units[unit])


def spark_session(
    master: str, jars: list[Path], shuffle_partitions: int, driver_memory: str, java_options: str = ""
) -> SparkSession:
    """A local session whose only extra jars are local files (no Ivy, no network at start)."""
    from pyspark.sql import SparkSession

    # Python workers default to "python3" on PATH; they need this interpreter's pandas and pyarrow.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder
    if master.startswith("local"):
        # Local mode needs no reachable address: keep the driver's ports on loopback instead of
        # whatever the host name resolves to.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
    if java_options:
        builder = builder.config("spark.driver.extraJavaOptions", java_options)
    return (
        builder.master(master)
        .appName("flow-exporter-downstream")
        .config("spark.jars", ",".join(str(j) for j in jars))
        .config("spark.driver.memory", driver_memory)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        # The default 200 would mean 200 state store partitions per stateful step on two cores.
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        # Adaptive execution is off for stateful streaming anyway; saying so spares two warnings.
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        # run_summary reads every batch's progress; Spark keeps only the last 100 by default.
        .config("spark.sql.streaming.numRecentProgressUpdates", "100000")
        # Totals mode chains a Python stateful step and a window aggregation. Spark cannot see
        # that the step only emits its input rows' own event times, and inputs older than the
        # watermark never reach it (event-time timeouts filter them), so none of its rows is
        # late for the aggregation; its conservative check would refuse the query.
        .config("spark.sql.streaming.statefulOperator.checkCorrectness.enabled", "false")
        .getOrCreate()
    )


def read_flows(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    starting_offsets: str,
    schema_json: str,
    *,
    confluent: bool = False,
    max_offsets_per_trigger: int | None = None,
    fields: Collection[str] | None = None,
) -> DataFrame:
    """The topic's records as FlowRecord columns (only ``fields``, if given)."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", starting_offsets)
    )
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    value: Column = F.col("value")
    if confluent:
        # Magic byte 0, 4-byte big-endian schema id, then the bare Avro body. Anything else is a
        # producer misconfiguration: fail loudly rather than decode garbage.
        value = F.when(F.substring(value, 1, 1) == F.lit(b"\x00"), F.expr("substring(value, 6)")).otherwise(
            F.raise_error(F.lit("value does not start with the Confluent magic byte 0"))
        )
    options = {"mode": "FAILFAST"}
    if fields is not None:
        # A reader schema with only these fields: Avro schema resolution skips the others
        # (labels maps, node names, ...) instead of building Spark values for them.
        schema = json.loads(schema_json)
        schema["fields"] = [f for f in schema["fields"] if f["name"] in fields]
        options["avroSchema"] = json.dumps(schema)
    return reader.load().select(from_avro(value, schema_json, options).alias("r")).select("r.*")


def group_columns(df: DataFrame) -> DataFrame:
    """Add ``source`` and ``destination``: Kubernetes names when known, else addresses."""
    from pyspark.sql import functions as F

    endpoint = F.when(
        F.col("ipVersion") == 6,
        F.concat(F.lit("["), F.col("destinationAddress"), F.lit("]:"), F.col("destinationPort").cast("string")),
    ).otherwise(F.concat(F.col("destinationAddress"), F.lit(":"), F.col("destinationPort").cast("string")))
    # concat() is null when any part is null: a half-known pod falls through to the next choice.
    source = F.coalesce(
        F.concat(F.col("sourcePodNamespace"), F.lit("/"), F.col("sourcePodName")), F.col("sourceAddress")
    )
    destination = F.coalesce(
        F.col("destinationService"),
        F.concat(F.col("destinationPodNamespace"), F.lit("/"), F.col("destinationPodName")),
        endpoint,
    )
    return df.withColumn("source", source).withColumn("destination", destination)


class HighWater:
    """Per-connection high-water marks of the four totals, as sorted numpy arrays.

    One instance is the state of one bucket of connections in totals mode. ``ids`` is sorted;
    ``high[i]`` holds the highest (packets, bytes, reverse packets, reverse bytes) totals seen
    for ``ids[i]``, and ``last[i]`` the event time (ms) of its newest record, for expiry.
    """

    def __init__(self, ids: np.ndarray, high: np.ndarray, last: np.ndarray) -> None:
        self.ids, self.high, self.last = ids, high, last

    @classmethod
    def empty(cls) -> HighWater:
        import numpy as np

        return cls(np.zeros(0, np.int64), np.zeros((0, 4), np.int64), np.zeros(0, np.int64))

    @classmethod
    def from_bytes(cls, blob: bytes) -> HighWater:
        import numpy as np

        a = np.frombuffer(blob, dtype=np.int64).reshape(6, -1)
        return cls(a[0].copy(), a[1:5].T.copy(), a[5].copy())

    def to_bytes(self) -> bytes:
        import numpy as np

        return np.vstack([self.ids, self.high.T, self.last]).astype(np.int64).tobytes()

    def __len__(self) -> int:
        return len(self.ids)

    def advance(self, cid: np.ndarray, event_ms: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Take a batch of records; return (order, increments) with ``increments[k]`` for record ``order[k]``.

        A record's increment is how far its totals rise above the highest totals seen before it
        for the same connection (records of one connection taken in event-time order), so
        duplicates, re-exports after an exporter restart and re-sent records add nothing twice.
        """
        import numpy as np
        import pandas as pd

        order = np.lexsort((event_ms, cid))
        cid, event_ms, totals = cid[order], event_ms[order], totals[order]
        pos = np.searchsorted(self.ids, cid)
        found = pos < len(self.ids)
        found[found] = self.ids[pos[found]] == cid[found]
        prior = np.zeros_like(totals)
        prior[found] = self.high[pos[found]]
        # prior is constant per connection, so the running max from it is a per-connection cummax.
        running = pd.DataFrame(np.maximum(totals, prior)).groupby(cid, sort=False).cummax().to_numpy(np.int64)
        first = np.r_[True, cid[1:] != cid[:-1]]
        before = np.vstack([prior[:1], running[:-1]])
        before[first] = prior[first]
        increments = running - before

        ends = np.r_[cid[1:] != cid[:-1], True]
        seg_ids, seg_high, seg_last = cid[ends], running[ends], event_ms[ends]
        seg_found = found[ends]
        old_pos = pos[ends][seg_found]
        seg_last[seg_found] = np.maximum(seg_last[seg_found], self.last[old_pos])
        keep = np.ones(len(self.ids), bool)
        keep[old_pos] = False
        ids = np.concatenate([self.ids[keep], seg_ids])
        merged = np.argsort(ids, kind="stable")
        self.ids = ids[merged]
        self.high = np.concatenate([self.high[keep], seg_high])[merged]
        self.last = np.concatenate([self.last[keep], seg_last])[merged]
        return order, increments

    def expire(self, before_ms: int) -> None:
        """Forget connections whose newest record is older than ``before_ms``."""
        alive = self.last >= before_ms
        self.ids, self.high, self.last = self.ids[alive], self.high[alive], self.last[alive]


COUNTERS_RESET = 2  # record flag: this connectionId continues an entry whose counters went down


def flow_key() -> Column:
    """A connection's identity from kernel values an exporter restart cannot change (see above)."""
    from pyspark.sql import functions as F

    segment = F.when((F.col("flags").bitwiseAND(COUNTERS_RESET)) != 0, F.col("connectionId")).otherwise(F.lit(0))
    return F.xxhash64(
        "exporterNode",
        "zone",
        "protocol",
        "sourceAddress",
        "sourcePort",
        "destinationAddress",
        "destinationPort",
        "ctId",
        "flowStart",
        segment,
    )


def _increments_fn(state_ttl_ms: int) -> Any:
    """The stateful step of totals mode: the function ``applyInPandasWithState`` calls per bucket."""

    def increments(key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        import numpy as np
        import pandas as pd

        marks = HighWater.from_bytes(bytes(state.get[0])) if state.exists else HighWater.empty()
        batch = [f for f in frames if not f.empty]
        if batch:
            frame = pd.concat(batch, ignore_index=True) if len(batch) > 1 else batch[0]
            event_ms = frame["eventTime"].to_numpy("datetime64[ms]").astype(np.int64)
            order, inc = marks.advance(
                frame["flowKey"].to_numpy(np.int64), event_ms, frame[list(TOTALS)].to_numpy(np.int64)
            )
            # One row per record, zero increments included: the window aggregation's watermark
            # comes from these rows' event times, and must move with the input, not with traffic.
            out = pd.DataFrame(
                {
                    "eventTime": frame["eventTime"].to_numpy()[order],
                    "source": frame["source"].to_numpy()[order],
                    "destination": frame["destination"].to_numpy()[order],
                }
            )
            for i, name in enumerate(COUNTERS):
                out[name] = inc[:, i]
            yield out
        watermark = state.getCurrentWatermarkMs()
        if watermark > 0:
            marks.expire(watermark - state_ttl_ms + 1)
        if not len(marks):
            if state.exists:
                state.remove()
            return
        state.update((marks.to_bytes(),))
        # Wake up when the oldest connection is due to expire, even if the bucket gets no data.
        state.setTimeoutTimestamp(int(marks.last.min()) + state_ttl_ms)

    return increments


def aggregate(
    flows: DataFrame,
    *,
    mode: str,
    event_time: str,
    window: str,
    watermark: str,
    state_ttl: str,
    state_buckets: int = 64,
) -> DataFrame:
    """Windowed sums per (source, destination); see the module docstring for the two modes."""
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    df = group_columns(flows).withColumn("eventTime", F.col(event_time)).withWatermark("eventTime", watermark)
    if mode == "deltas":
        counted = df.dropDuplicatesWithinWatermark(["connectionId", "sequence"]).select(
            "eventTime", "source", "destination", *(F.col(d).alias(c) for d, c in zip(DELTAS, COUNTERS, strict=True))
        )
    else:
        counted = (
            df.select(flow_key().alias("flowKey"), "eventTime", "source", "destination", *TOTALS)
            # Buckets of connections, not single connections, as keys: the Python function is
            # called per key and batch, and a call costs milliseconds whatever its size.
            .withColumn("bucket", F.pmod(F.col("flowKey"), F.lit(state_buckets)))
            .groupBy("bucket")
            .applyInPandasWithState(
                _increments_fn(interval_ms(state_ttl)),
                outputStructType=_INCREMENT_SCHEMA,
                stateStructType=_STATE_SCHEMA,
                outputMode="append",
                timeoutConf=GroupStateTimeout.EventTimeTimeout,
            )
            # The Python step's output carries no watermark; the window aggregation needs one.
            .withWatermark("eventTime", watermark)
        )
    sums = [F.sum(c).alias(c) for c in COUNTERS]
    return (
        counted.groupBy(F.window("eventTime", window), "source", "destination")
        .agg(*sums)
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "source",
            "destination",
            (F.col("forward_packets") + F.col("reverse_packets")).alias("packets"),
            (F.col("forward_bytes") + F.col("reverse_bytes")).alias("bytes"),
            *COUNTERS,
        )
        # A group whose records in a window only repeated what was known adds an all-zero row.
        .where((F.col("packets") > 0) | (F.col("bytes") > 0))
    )


def start(result: DataFrame, args: argparse.Namespace) -> StreamingQuery:
    """Start the sink: console, or Parquet with a checkpoint; available-now or periodic trigger."""
    writer = result.writeStream.outputMode("append").queryName("flows_by_window")
    writer = writer.trigger(availableNow=True) if args.available_now else writer.trigger(processingTime=args.trigger)
    checkpoint = args.checkpoint
    if args.parquet is not None:
        checkpoint = checkpoint or args.parquet.with_name(args.parquet.name + ".checkpoint")
        writer = writer.format("parquet").option("path", str(args.parquet))
    else:
        writer = writer.format("console").option("truncate", "false").option("numRows", "1000")
    if checkpoint is None:
        checkpoint = Path(tempfile.mkdtemp(prefix="spark-flows-checkpoint-"))
    return writer.option("checkpointLocation", str(checkpoint)).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _ensure_repo_on_path()
    from devtools.spark import ensure_spark_jars

    schema_json = json.dumps(json.loads(args.schema.read_text()))
    spark = spark_session(
        args.master, ensure_spark_jars(), args.shuffle_partitions, args.driver_memory, args.driver_java_options
    )
    spark.sparkContext.setLogLevel("WARN")
    _quiet_checker(spark)
    flows = read_flows(
        spark,
        args.bootstrap_servers,
        args.topic,
        args.starting_offsets,
        schema_json,
        confluent=args.confluent,
        max_offsets_per_trigger=args.max_offsets_per_trigger,
        fields=USED_FIELDS,
    )
    result = aggregate(
        flows,
        mode=args.mode,
        event_time=args.event_time,
        window=args.window,
        watermark=args.watermark,
        state_ttl=args.state_ttl,
        state_buckets=args.state_buckets,
    )
    query = start(result, args)
    stopping = threading.Event()
    # A signal must not land inside a py4j call (that breaks the gateway): set a flag, and stop
    # the query between short waits. The JVM itself ignores SIGINT (pyspark starts it so).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        while not stopping.is_set() and not query.awaitTermination(1):
            pass
        if stopping.is_set():
            query.stop()
        elif args.available_now:
            print(json.dumps({"spark_flows": run_summary(query)}), flush=True)
    finally:
        spark.stop()
    return 0


def _quiet_checker(spark: SparkSession) -> None:
    """Silence the warning (with stack trace) that the disabled correctness check still logs."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
        "org.apache.spark.sql.catalyst.analysis.UnsupportedOperationChecker",
        jvm.org.apache.logging.log4j.Level.ERROR,
    )


def run_summary(query: StreamingQuery) -> dict[str, Any]:
    """Batches, input rows and busy seconds of a finished run, for benchmarks and scripts.

    Busy time sums each batch's trigger execution, so JVM start and planning are left out.
    """
    progress = query.recentProgress
    per_batch = [(p.numInputRows, p.durationMs.get("triggerExecution", 0)) for p in progress]
    return {
        "batches": len(per_batch),
        "input_rows": sum(rows for rows, _ in per_batch),
        "batch_seconds": round(sum(ms for _, ms in per_batch) / 1000, 3),
        "per_batch": [{"rows": rows, "ms": ms} for rows, ms in per_batch],
    }


if __name__ == "__main__":
    sys.exit(main())
