"""Reference Spark Structured Streaming job: flows per window, top talkers, zone pairs and per-connection totals.

It reads the exporter's topic with Spark's Kafka source (plaintext, TLS, SASL SCRAM or PLAIN) and
decodes each value with ``from_avro``: bare Avro with ``schemas/flow_record.avsc``, or, with
``--schema-registry``, Confluent-framed values whose writer schema is fetched from the registry by
the id in each value (every version registered under the subject, ``<topic>-value`` by default).
It writes four tables (README "Downstream"), the same as ``downstream/flink_flows.py``:

* ``flows_by_window``: one row per tumbling event-time window and (source, destination) group;
* ``top_talkers``: per window, the ``--top`` groups with the most bytes, ranked;
* ``bytes_by_zone_pair``: one row per window and (source zone, destination zone), null zones
  (an end outside the cluster, a node without a zone label, an older exporter) a group of their own;
* ``connection_totals``: one row per connection with its counts so far;
* ``window_completeness`` (with ``--markers-topic``): per window, whether every exporter
  confirmed it had all its records in Kafka, and whether any lost something in it.

Groups are ``contract.SOURCE_GROUP`` and ``contract.DESTINATION_GROUP``, SQL shared with the
Flink job. Each end is named by its workload where the record has it (``namespace/Kind/Name``,
the Deployment, StatefulSet, DaemonSet, CronJob or Job, stable across rollouts), else by its pod
(``namespace/pod``: a bare pod, or a record of an exporter without the owner fields), else by its
address; a destination by the Service addressed first (``namespace/name:port/protocol``), and
its address is the one reached after DNAT, with its port (``[address]:port`` for IPv6).

The window aggregation keeps one row per (window, source, destination, source zone, destination
zone); each closed window's rows are summed into ``flows_by_window`` and ``bytes_by_zone_pair``
in the batch that closes them, so the two tables come from one streaming aggregation and agree.

Records of an inter-node pod-to-pod connection come from both nodes' exporters; the copy of the
destination's node (flowType 2, reporter 2) is dropped first, so each connection counts once.

Counting (``--mode deltas``, the default) is the README's consumer rule ("Counting: the
contract"): drop duplicate (exporterNode, connectionId, sequence) triples within the watermark,
keeping any copy (the exporter resends a record only as the same bytes), then sum the
``*DeltaCount`` fields. A connection is (exporterNode, connectionId), never the connectionId
alone: ids colliding by chance between two nodes' exporters stay two connections. It is exact
across exporter restarts, resends and races as long as the exporter keeps its ``state.dir``; a
record that arrives later than the watermark (an outage longer than it) is dropped, so set
``--watermark`` above the longest outage to be counted.

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
longer and then re-exported by a restarted stateless exporter is counted again. In totals mode
``connection_totals`` is keyed by that kernel identity and holds the highest totals seen.

Window rows (append mode) appear once the watermark (latest event time minus ``--watermark``)
passes a window's end, so an ``--available-now`` run leaves the newest windows in its checkpoint
for the next run to emit; top talkers are ranked within the windows a micro-batch closes (a
window's rows all close together). ``connection_totals`` is a complete-mode aggregation: every
micro-batch rewrites the whole table (it keeps one state row per connection ever seen; for a
long-running job, feed the same aggregation in update mode into a table that merges upserts).
Spark runs in local mode with the connector jars given by ``--jars`` (``spark-sql-kafka-0-10``,
``spark-avro`` and their dependencies, for exactly the installed pyspark's version) in
``spark.jars``: nothing is resolved over the network at run time.

Standalone: this file needs only ``contract.py`` beside it (the rules and names shared with the
Flink job) and the Avro schemas (beside them, or ``--schema`` / ``--marker-schema``).
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

if __package__:  # imported as downstream.spark_flows
    from . import contract
else:  # run as a script: contract.py is beside it (sys.path[0])
    import contract  # type: ignore[no-redef]

# The rules' vocabulary, bound here by value: the totals step is pickled to Spark's Python workers,
# which cannot import the contract module of a job run as a script.
TOTALS, DELTAS, COUNTERS = contract.TOTALS, contract.DELTAS, contract.COUNTERS
BOTH_DIRECTIONS = contract.BOTH_DIRECTIONS
# The counter columns as SQL over a record's deltas, and over its totals (contract.counter_expressions).
COUNTER_EXPRESSIONS = (contract.counter_expressions(DELTAS), contract.counter_expressions(TOTALS))
CONNECTION_FIELDS = contract.CONNECTION_FIELDS
# The record fields the job reads; the others are skipped when decoding.
USED_FIELDS = contract.USED_FIELDS | contract.TOTALS_MODE_FIELDS
INTER_NODE, REPORTER_DESTINATION = contract.INTER_NODE, contract.REPORTER_DESTINATION
COUNTERS_RESET = contract.COUNTERS_RESET
DEDUP_KEY = contract.DEDUP_KEY
SAMPLING = contract.SAMPLING

# The groups carried through totals mode's Python step, beside the event time, the connection and its sampling.
GROUPS = ("source", "destination", "source_zone", "destination_zone")
_INCREMENT_SCHEMA = (
    "eventTime timestamp, flowKey long, samplingProbability double, "
    + ", ".join(f"{g} string" for g in GROUPS) + ", " + ", ".join(f"{c} long" for c in COUNTERS)
)  # fmt: skip
_STATE_SCHEMA = "highWater binary"


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
    ap.add_argument("--top", type=int, default=10, help="top_talkers: groups ranked per window (default: 10)")
    ap.add_argument(
        "--markers-topic",
        help="the exporters' completeness markers (markers.topic): adds the window_completeness table",
    )
    ap.add_argument(
        "--schema",
        type=Path,
        default=contract.schema_file(contract.FLOW_SCHEMA),
        help=f"Avro schema file (default: {contract.FLOW_SCHEMA} beside the job, else the repository's schemas/)",
    )
    ap.add_argument(
        "--marker-schema",
        type=Path,
        default=contract.schema_file(contract.MARKER_SCHEMA),
        help=f"completeness marker schema, for --markers-topic (default: {contract.MARKER_SCHEMA}, found likewise)",
    )
    ap.add_argument(
        "--jars",
        default=os.environ.get("FLOW_SPARK_JARS"),
        metavar="PATH[,PATH...]",
        help="the Spark connector jars (spark-sql-kafka-0-10, spark-avro and their dependencies, for this\n"
        "pyspark's version; a directory stands for its *.jar files) (default: $FLOW_SPARK_JARS)",
    )
    ap.add_argument(
        "--confluent", action="store_true", help="values carry the 5-byte Confluent header; strip it, use --schema"
    )
    ap.add_argument(
        "--schema-registry",
        metavar="URL",
        help="values are Confluent-framed: decode each with the writer schema its id names in this registry",
    )
    ap.add_argument("--subject", help="registry subject whose versions are read (default: <topic>-value)")
    ap.add_argument(
        "--registry-basic-auth",
        default=os.environ.get("FLOW_REGISTRY_BASIC_AUTH"),
        metavar="USER:PASSWORD",
        help="registry credentials (default: $FLOW_REGISTRY_BASIC_AUTH)",
    )
    add_kafka_security_args(ap)
    ap.add_argument(
        "--output", "--parquet", type=Path, metavar="DIR", help="write the tables as Parquet under DIR/<table>"
    )
    ap.add_argument("--checkpoint", type=Path, help="checkpoint dir (default with --output: DIR/_checkpoints)")
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
    args = ap.parse_args(argv)
    if args.schema_registry and args.confluent:
        ap.error("--confluent strips the header and uses --schema; --schema-registry reads the schema by id: pick one")
    if args.top < 1:
        ap.error("--top must be at least 1")
    if args.schema is None or not args.schema.is_file():
        ap.error(
            f"--schema: no such file: {args.schema}"
            if args.schema
            else f"--schema is required: no {contract.FLOW_SCHEMA} beside the job"
        )
    if args.markers_topic and (args.marker_schema is None or not args.marker_schema.is_file()):
        ap.error(
            f"--marker-schema: no such file: {args.marker_schema}"
            if args.marker_schema
            else f"--markers-topic needs --marker-schema: no {contract.MARKER_SCHEMA} beside the job"
        )
    try:
        args.jars = contract.jar_paths(
            args.jars, "--jars", "the Spark connector jars (spark-sql-kafka-0-10, spark-avro)"
        )
    except ValueError as exc:
        ap.error(str(exc))
    return args


def add_kafka_security_args(ap: argparse.ArgumentParser) -> None:
    """The exporter's Kafka security settings, as consumer flags (the same in both downstream jobs)."""
    ap.add_argument("--security-protocol", choices=contract.SECURITY_PROTOCOLS, default="PLAINTEXT")
    ap.add_argument("--sasl-mechanism", choices=contract.SASL_MECHANISMS, default="SCRAM-SHA-512")
    ap.add_argument("--sasl-username")
    ap.add_argument(
        "--sasl-password",
        default=os.environ.get(contract.PASSWORD_ENV),
        help="(default: $FLOW_SASL_PASSWORD; better than the command line, which other users can read)",
    )
    ap.add_argument("--ssl-ca-location", type=Path, metavar="PEM", help="CA certificates to verify the brokers")
    ap.add_argument("--ssl-certificate-location", type=Path, metavar="PEM", help="client certificate (mutual TLS)")
    ap.add_argument("--ssl-key-location", type=Path, metavar="PEM", help="client key, unencrypted PEM (mutual TLS)")


def kafka_security_options(args: argparse.Namespace, login_package: str = "org.apache.kafka") -> dict[str, str]:
    """Kafka client properties for the security flags (without the ``kafka.`` / ``properties.`` prefix).

    ``login_package`` is where the client's classes live: Flink's SQL connector shades them.
    Raises ValueError naming the flag that is missing.
    """
    protocol = args.security_protocol
    props = {"security.protocol": protocol}
    if protocol.startswith("SASL_"):
        if not args.sasl_username or args.sasl_password is None:
            raise ValueError(f"--security-protocol {protocol} needs --sasl-username and --sasl-password")
        props["sasl.mechanism"] = args.sasl_mechanism
        props["sasl.jaas.config"] = contract.jaas_config(
            args.sasl_mechanism, args.sasl_username, args.sasl_password, login_package
        )
    if protocol in ("SSL", "SASL_SSL"):
        if args.ssl_ca_location is not None:
            props["ssl.truststore.type"] = "PEM"
            props["ssl.truststore.location"] = str(args.ssl_ca_location)
        if args.ssl_certificate_location is not None:
            if args.ssl_key_location is None:
                raise ValueError("--ssl-certificate-location needs --ssl-key-location")
            # The Java client takes PEM key and chain as values of a PEM key store.
            props["ssl.keystore.type"] = "PEM"
            props["ssl.keystore.certificate.chain"] = args.ssl_certificate_location.read_text()
            props["ssl.keystore.key"] = args.ssl_key_location.read_text()
    return props


def registry_schemas(url: str, subject: str, basic_auth: str | None = None) -> dict[int, str]:
    """``{schema id: schema text}`` of every version registered under ``subject`` (Confluent REST API).

    The job decodes a value with the schema its id names; a value with an id not listed here
    fails the query (restart the job after registering a new version). Raises RuntimeError with
    one line naming the registry and the subject.
    """
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    base = url.split(",")[0].rstrip("/")
    headers = {"Accept": "application/vnd.schemaregistry.v1+json"}
    if basic_auth:
        headers["Authorization"] = "Basic " + base64.b64encode(basic_auth.encode()).decode()
    quoted = urllib.parse.quote(subject, safe="")

    def get(path: str) -> Any:
        request = urllib.request.Request(base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"schema registry {base}: subject {subject!r}: HTTP {exc.code} {exc.reason}") from None
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"schema registry {base} not reachable: {exc}") from None

    out = {}
    for version in get(f"/subjects/{quoted}/versions"):
        body = get(f"/subjects/{quoted}/versions/{version}")
        if body.get("schemaType", "AVRO") == "AVRO":
            out[int(body["id"])] = body["schema"]
    if not out:
        raise RuntimeError(f"schema registry {base}: subject {subject!r} has no Avro schema")
    return out


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
    writer_schemas: dict[int, str] | None = None,
    kafka_options: dict[str, str] | None = None,
    max_offsets_per_trigger: int | None = None,
    fields: Collection[str] | None = None,
) -> DataFrame:
    """The topic's records as FlowRecord columns (only ``fields``, if given).

    ``schema_json`` is the reader schema. Values are bare Avro written with it, or with
    ``confluent`` the same after the 5-byte header, or, with ``writer_schemas`` (schema id ->
    writer schema, from the registry), Confluent-framed values each decoded with the writer
    schema of its id and resolved into the reader schema.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", starting_offsets)
    )
    for key, option in (kafka_options or {}).items():
        reader = reader.option(f"kafka.{key}", option)
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    reader_schema = json.loads(schema_json)
    if fields is not None:
        # A reader schema with only these fields: Avro schema resolution skips the others
        # (labels maps, node names, ...) instead of building Spark values for them.
        reader_schema["fields"] = [f for f in reader_schema["fields"] if f["name"] in fields]
    options = {"mode": "FAILFAST", "avroSchema": json.dumps(reader_schema)}
    value: Column = F.col("value")
    if not (confluent or writer_schemas):
        return reader.load().select(from_avro(value, schema_json, options).alias("r")).select("r.*")
    # Magic byte 0, 4-byte big-endian schema id, then the bare Avro body. Anything else is a
    # producer misconfiguration: fail loudly rather than decode garbage.
    framed = F.substring(value, 1, 1) == F.lit(b"\x00")
    body = F.expr("substring(value, 6)")
    if not writer_schemas:
        decoded = F.when(framed, from_avro(body, schema_json, options)).otherwise(
            F.raise_error(F.lit("value does not start with the Confluent magic byte 0"))
        )
        return reader.load().select(decoded.alias("r")).select("r.*")
    schema_id = F.conv(F.hex(F.substring(value, 2, 4)), 16, 10).cast("long")
    decoded = F.when(~framed, F.raise_error(F.lit("value does not start with the Confluent magic byte 0")))
    for sid, writer in sorted(writer_schemas.items()):
        decoded = decoded.when(schema_id == sid, from_avro(body, writer, options))
    known = ", ".join(str(i) for i in sorted(writer_schemas))
    decoded = decoded.otherwise(
        F.raise_error(F.concat(F.lit("schema id "), schema_id.cast("string"), F.lit(f" is not one of {known}")))
    )
    return reader.load().select(decoded.alias("r")).select("r.*")


def one_observation(flows: DataFrame) -> DataFrame:
    """Drop the destination node's copy of inter-node pod-to-pod connections (README: One connection, two nodes)."""
    from pyspark.sql import functions as F

    return flows.where(~((F.col("flowType") == INTER_NODE) & (F.col("reporter") == REPORTER_DESTINATION)))


def _total(columns: tuple[str, ...]) -> Column:
    """The sum of ``columns`` (a row's packets or bytes: forward, reverse and undirected)."""
    from pyspark.sql import functions as F

    return sum((F.col(c) for c in columns[1:]), F.col(columns[0]))


def group_columns(df: DataFrame) -> DataFrame:
    """Add the :data:`GROUPS`: workload, pod or address of each end (the contract's SQL), and each end's zone."""
    from pyspark.sql import functions as F

    return (
        df.withColumn("source", F.expr(contract.SOURCE_GROUP))
        .withColumn("destination", F.expr(contract.DESTINATION_GROUP))
        .withColumn("source_zone", F.col("sourceZone"))
        .withColumn("destination_zone", F.col("destinationZone"))
    )


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
            out = pd.DataFrame({"eventTime": frame["eventTime"].to_numpy()[order]})
            for name in ("flowKey", SAMPLING, *GROUPS):
                out[name] = frame[name].to_numpy()[order]
            # A connection flagged BOTH_DIRECTIONS (every record of it is) counts into the undirected columns.
            both = (frame["flags"].to_numpy(np.int64)[order] & BOTH_DIRECTIONS) != 0
            fp, fb, rp, rb = (inc[:, i] for i in range(4))
            for name, column in zip(COUNTERS, (np.where(both, 0, fp), np.where(both, 0, fb), rp, rb,
                                               np.where(both, fp, 0), np.where(both, fb, 0)), strict=True):  # fmt: skip
                out[name] = column
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


def counted_records(flows: DataFrame, *, event_time: str, watermark: str) -> DataFrame:
    """Records with groups and event time, duplicate :data:`DEDUP_KEY` triples dropped (deltas mode)."""
    from pyspark.sql import functions as F

    df = group_columns(flows).withColumn("eventTime", F.col(event_time)).withWatermark("eventTime", watermark)
    return df.dropDuplicatesWithinWatermark(list(DEDUP_KEY))


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
    """Windowed sums per (source, destination, source_zone, destination_zone) and connection, with the
    probability the connection was kept with; rows without counts left out.

    The two modes are the module docstring's. :func:`flows_by_window` and :func:`bytes_by_zone_pair`
    sum a batch of these rows (every row of a window closes in the same batch) into the tables; a row per
    connection, not per group, because a sample's standard error is a sum over connections.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    if mode == "deltas":
        counted = counted_records(flows, event_time=event_time, watermark=watermark).select(
            "eventTime", *contract.CONNECTION_KEY, SAMPLING, *GROUPS,
            *(F.expr(e).alias(c) for e, c in zip(COUNTER_EXPRESSIONS[0], COUNTERS, strict=True)),
        )  # fmt: skip
        unit = list(contract.CONNECTION_KEY)
    else:
        df = group_columns(flows).withColumn("eventTime", F.col(event_time)).withWatermark("eventTime", watermark)
        counted = (
            df.select(flow_key().alias("flowKey"), "eventTime", SAMPLING, *GROUPS, "flags", *TOTALS)
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
        unit = ["flowKey"]
    sums = [F.sum(c).alias(c) for c in COUNTERS]
    return (
        counted.groupBy(F.window("eventTime", window), *GROUPS, *unit)
        .agg(*sums, F.max(SAMPLING).alias(SAMPLING))  # (the same in every record of a connection)
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            *GROUPS,
            SAMPLING,
            *COUNTERS,
        )
        # A group whose records in a window only repeated what was known adds an all-zero row.
        .where((_total(contract.PACKETS) > 0) | (_total(contract.BYTES) > 0))
    )


def _window_sums(groups: DataFrame, table: str, keys: tuple[str, ...]) -> DataFrame:
    """The window rows of :func:`aggregate` (one per connection) summed per window and ``keys``, in ``table``'s
    columns: the counters, and the estimates over every connection from the sampled ones (the contract's SQL)."""
    from pyspark.sql import functions as F

    estimates = contract.estimate_expressions("unit_packets", "unit_bytes", SAMPLING)
    return (
        groups.withColumn("unit_packets", _total(contract.PACKETS))
        .withColumn("unit_bytes", _total(contract.BYTES))
        .groupBy("window_start", "window_end", *keys)
        .agg(
            *(F.sum(c).alias(c) for c in COUNTERS),
            *(F.expr(e).alias(c) for e, c in zip(estimates, contract.ESTIMATES, strict=True)),
        )
        .withColumn("packets", _total(contract.PACKETS))
        .withColumn("bytes", _total(contract.BYTES))
        .select(*contract.COLUMNS[table])
    )


def flows_by_window(groups: DataFrame) -> DataFrame:
    """``flows_by_window``: per window and (source, destination), from the rows of :func:`aggregate`."""
    return _window_sums(groups, "flows_by_window", ("source", "destination"))


def bytes_by_zone_pair(groups: DataFrame) -> DataFrame:
    """``bytes_by_zone_pair``: per window and (source zone, destination zone); null zones group together."""
    return _window_sums(groups, contract.ZONE_TABLE, ("source_zone", "destination_zone"))


def connection_totals(flows: DataFrame, *, mode: str, event_time: str, watermark: str) -> DataFrame:
    """``connection_totals``: one row per connection, its counts so far.

    deltas mode: per (exporterNode, connectionId), the deduplicated deltas summed (the consumer rule). totals
    mode: per kernel identity (:func:`flow_key`), the highest cumulative totals seen, which is
    right whatever the exporters' restarts did (``connectionId`` is then the highest seen).
    ``source`` and ``destination`` are the greatest seen (they change only when enrichment
    learns a name after the connection's first record), the same rule as the Flink job's.
    """
    from pyspark.sql import functions as F

    if mode == "deltas":
        df = counted_records(flows, event_time=event_time, watermark=watermark)
        keys = [F.col(c) for c in CONNECTION_FIELDS]
        counters = [F.sum(F.expr(e)).alias(c) for e, c in zip(COUNTER_EXPRESSIONS[0], COUNTERS, strict=True)]
        extra = [F.count(F.lit(1)).alias("records")]
    else:
        df = group_columns(flows).withColumn("eventTime", F.col(event_time))
        keys = [flow_key().alias("flowKey"), *(F.col(c) for c in CONNECTION_FIELDS[1:])]
        # the flag is the same in every record of a connection: the largest counts, put in their columns
        counters = [F.max(F.expr(e)).alias(c) for e, c in zip(COUNTER_EXPRESSIONS[1], COUNTERS, strict=True)]
        extra = [F.max("connectionId").alias("connectionId"), F.count(F.lit(1)).alias("records")]
    return (
        df.groupBy(*keys)
        .agg(
            F.max("source").alias("source"),
            F.max("destination").alias("destination"),
            F.min("eventTime").alias("first_seen"),
            F.max("eventTime").alias("last_seen"),
            *extra,
            *counters,
        )
        .select(
            *CONNECTION_FIELDS,
            "source",
            "destination",
            "first_seen",
            "last_seen",
            "records",
            _total(contract.PACKETS).alias("packets"),
            _total(contract.BYTES).alias("bytes"),
            *COUNTERS,
        )
    )


def top_talkers(windows: DataFrame, top: int) -> DataFrame:
    """The ``top`` groups by bytes in each window of ``windows`` (rank 1 = most bytes; ties by name)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy("window_start", "window_end").orderBy(
        F.col("bytes").desc(), F.col("source"), F.col("destination")
    )
    return (
        windows.withColumn("rank", F.row_number().over(order))
        .where(F.col("rank") <= top)
        .select("window_start", "window_end", "rank", "source", "destination", "packets", "bytes")
    )


# Clock skew allowed between the exporters' markers (Kafka timestamps) and the windows' event times.
MARKER_SKEW_MS = 10 * 60 * 1000


def read_markers(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    kafka_options: dict[str, str],
    since_ms: int = 0,
    schema_file: Path | None = None,
) -> DataFrame:
    """The completeness markers on ``topic`` produced since ``since_ms`` (a batch read).

    A marker that matters to a window was built after the window started (its ``until`` is past the
    window's start, and its confirming ``upTo`` past its end), so reading from the oldest window's
    start, less ``MARKER_SKEW_MS``, finds them all without rereading the topic's whole history.
    """
    from pyspark.sql.avro.functions import from_avro

    reader = spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
    for key, option in kafka_options.items():
        reader = reader.option(f"kafka.{key}", option)
    if since_ms > MARKER_SKEW_MS:
        # A partition with nothing that recent starts at its end rather than failing the batch.
        reader = reader.option("startingTimestamp", str(since_ms - MARKER_SKEW_MS)).option(
            "startingOffsetsByTimestampStrategy", "latest"
        )
    else:
        reader = reader.option("startingOffsets", "earliest")
    schema_file = schema_file or contract.schema_file(contract.MARKER_SCHEMA)
    if schema_file is None:
        raise FileNotFoundError(contract.MARKER_SCHEMA)
    schema = json.dumps(json.loads(schema_file.read_text()))
    return reader.load().select(from_avro("value", schema, {"mode": "FAILFAST"}).alias("m")).select("m.*")


def window_completeness(windows: DataFrame, markers: DataFrame, topics: Collection[str] = ()) -> DataFrame:
    """``window_completeness``: per window, which exporters confirmed it and which lost something in it.

    The README's rule ("Completeness markers"): the exporters of a window are those with a marker
    whose interval [since, until) overlaps it, or whose upTo reaches its start; one is confirmed
    when some marker of it has upTo at or after the window's end; a marker interval with losses
    that overlaps the window makes it lossy (losses counted once per exporter and interval: the
    markers of each partition repeat them). Status: lossy, else complete when every exporter
    confirmed it, else unconfirmed (yet).
    """
    from pyspark.sql import functions as F

    if topics:  # exporters writing other flow topics may share the markers topic
        markers = markers.where(F.col("topic").isin(list(topics)))
    w = windows.select("window_start", "window_end").distinct()
    # One row per exporter and interval: the markers of each partition repeat its node-wide losses.
    m = markers.groupBy("exporterNode", "since", "until").agg(
        F.max("upTo").alias("upTo"),
        F.max(sum((F.col(c) for c in contract.MARKER_LOSS_FIELDS), F.lit(0))).alias("lost"),
    )
    overlaps = (F.col("since") < F.col("window_end")) & (F.col("until") > F.col("window_start"))
    joined = w.join(m, overlaps | (F.col("upTo") >= F.col("window_start")), "left")
    per_exporter = joined.groupBy("window_start", "window_end", "exporterNode").agg(
        F.max(F.col("upTo") >= F.col("window_end")).alias("confirmed"),
        F.sum(F.when(overlaps, F.col("lost")).otherwise(F.lit(0))).alias("losses"),
    )
    return (
        per_exporter.groupBy("window_start", "window_end")
        .agg(
            F.count("exporterNode").alias("exporters"),
            F.count(F.when(F.col("confirmed"), True)).alias("confirmed_exporters"),
            F.count(F.when(F.col("losses") > 0, True)).alias("lossy_exporters"),
            F.coalesce(F.sum("losses"), F.lit(0)).cast("long").alias("losses"),
        )
        .withColumn(
            "status",
            F.when(F.col("lossy_exporters") > 0, "lossy")
            .when((F.col("exporters") > 0) & (F.col("confirmed_exporters") == F.col("exporters")), "complete")
            .otherwise("unconfirmed"),
        )
    )


class _TableWriter:
    """The foreachBatch sinks: Parquet under ``output/<table>`` (one directory per batch), or the console.

    Each batch writes ``batch=<id>`` with overwrite, so a batch Spark replays after a crash
    replaces its own files instead of adding them twice. ``connection_totals`` (complete mode)
    is rewritten whole. With ``markers`` (a callable reading the markers topic), the windows a
    batch closes get their ``window_completeness`` rows, from the markers on the topic then.
    """

    def __init__(self, output: Path | None, top: int, markers: Any = None, topics: Collection[str] = ()) -> None:
        self.output, self.top, self.markers, self.topics = output, top, markers, topics

    def _write(self, df: DataFrame, table: str, batch_id: int | None = None) -> None:
        if self.output is None:
            print(f"-- {table}" + (f" (batch {batch_id})" if batch_id is not None else ""), flush=True)
            df.show(n=1000, truncate=False)
            return
        path = self.output / table if batch_id is None else self.output / table / f"batch={batch_id:06d}"
        df.write.mode("overwrite").parquet(str(path))

    def windows(self, df: DataFrame, batch_id: int) -> None:
        """The windows this batch closed (rows of :func:`aggregate`): every table made of windows."""
        if df.isEmpty():
            return
        df.persist()
        flows = flows_by_window(df).persist()
        try:
            self._write(flows, "flows_by_window", batch_id)
            self._write(top_talkers(flows, self.top), "top_talkers", batch_id)
            self._write(bytes_by_zone_pair(df), contract.ZONE_TABLE, batch_id)
            if self.markers is not None:
                from pyspark.sql import functions as F

                oldest = df.select(F.min("window_start").cast("long")).first()[0]
                table = window_completeness(flows, self.markers(int(oldest) * 1000), self.topics)
                self._write(table, "window_completeness", batch_id)
        finally:
            flows.unpersist()
            df.unpersist()

    def connections(self, df: DataFrame, batch_id: int) -> None:
        self._write(df, "connection_totals")


def start(windows: DataFrame, connections: DataFrame, args: argparse.Namespace) -> list[StreamingQuery]:
    """Start both queries: windows (append) and connection totals (complete), each with its checkpoint."""
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = args.output / "_checkpoints" if args.output is not None else None
    if checkpoint is None:
        checkpoint = Path(tempfile.mkdtemp(prefix="spark-flows-checkpoint-"))
    markers = None
    if args.markers_topic:
        spark, options = windows.sparkSession, kafka_security_options(args)

        def markers(since_ms: int) -> DataFrame:
            return read_markers(
                spark, args.bootstrap_servers, args.markers_topic, options, since_ms, args.marker_schema
            )

    sink = _TableWriter(args.output, args.top, markers, args.topic.split(","))
    queries = []
    for name, df, mode, batch in (
        ("flows_by_window", windows, "append", sink.windows),
        ("connection_totals", connections, "complete", sink.connections),
    ):
        writer = df.writeStream.outputMode(mode).queryName(name).foreachBatch(batch)
        if args.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=args.trigger)
        queries.append(writer.option("checkpointLocation", str(checkpoint / name)).start())
    return queries


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kafka_options = kafka_security_options(args)
        writer_schemas = None
        unreachable = contract.unreachable_brokers(args.bootstrap_servers)
        if unreachable is not None:  # before the JVM: Spark's source would retry for minutes, then trace
            raise RuntimeError(unreachable)
        if args.schema_registry:
            subject = args.subject or f"{args.topic.split(',')[0]}-value"
            writer_schemas = registry_schemas(args.schema_registry, subject, args.registry_basic_auth)
    except ValueError as exc:
        print(f"spark_flows.py: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"spark_flows.py: {exc}", file=sys.stderr)
        return 1
    schema_json = json.dumps(json.loads(args.schema.read_text()))
    spark = spark_session(args.master, args.jars, args.shuffle_partitions, args.driver_memory, args.driver_java_options)
    spark.sparkContext.setLogLevel("WARN")
    _quiet_checker(spark)
    flows = read_flows(
        spark,
        args.bootstrap_servers,
        args.topic,
        args.starting_offsets,
        schema_json,
        confluent=args.confluent,
        writer_schemas=writer_schemas,
        kafka_options=kafka_options,
        max_offsets_per_trigger=args.max_offsets_per_trigger,
        fields=USED_FIELDS,
    )
    flows = one_observation(flows)
    windows = aggregate(
        flows,
        mode=args.mode,
        event_time=args.event_time,
        window=args.window,
        watermark=args.watermark,
        state_ttl=args.state_ttl,
        state_buckets=args.state_buckets,
    )
    connections = connection_totals(flows, mode=args.mode, event_time=args.event_time, watermark=args.watermark)
    queries = start(windows, connections, args)
    stopping = threading.Event()
    # A signal must not land inside a py4j call (that breaks the gateway): set a flag, and stop
    # the queries between short waits. The JVM itself ignores SIGINT (pyspark starts it so).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        for query in queries:
            while not stopping.is_set() and not query.awaitTermination(1):
                pass
        if stopping.is_set():
            for query in queries:
                query.stop()
        elif args.available_now:
            print(json.dumps({"spark_flows": run_summary(*queries)}), flush=True)
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


def run_summary(query: StreamingQuery, *others: StreamingQuery) -> dict[str, Any]:
    """Batches, input rows and busy seconds of a finished run, for benchmarks and scripts.

    Busy time sums each batch's trigger execution of ``query`` (the windows query), so JVM start
    and planning are left out. ``span_seconds`` runs from the first batch's start to the last
    batch's end over all queries: the time the job needed for every table, the queries sharing
    the cores as they ran.
    """
    from datetime import datetime

    progress = query.recentProgress
    per_batch = [(p.numInputRows, p.durationMs.get("triggerExecution", 0)) for p in progress]
    spans = []
    for q in (query, *others):
        for p in q.recentProgress:
            start = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp()
            spans.append((start, start + p.durationMs.get("triggerExecution", 0) / 1000))
    return {
        "batches": len(per_batch),
        "input_rows": sum(rows for rows, _ in per_batch),
        "batch_seconds": round(sum(ms for _, ms in per_batch) / 1000, 3),
        "span_seconds": round(max(e for _, e in spans) - min(s for s, _ in spans), 3) if spans else 0.0,
        "per_batch": [{"rows": rows, "ms": ms} for rows, ms in per_batch],
    }


if __name__ == "__main__":
    sys.exit(main())
