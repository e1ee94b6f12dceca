"""Reference Flink SQL job: bytes and packets per (source, destination) and window, top talkers, zone pairs, totals.

The Flink twin of ``downstream/spark_flows.py``: the same four tables from the exporter's Kafka
topic (and, with ``--bounded``, a fifth from the completeness markers), written with Flink SQL
(windowing table-valued functions) and started from Python (PyFlink's ``TableEnvironment``) in
local mode, a MiniCluster inside PyFlink's gateway JVM.

Setup: ``tools/flink/setup.sh`` (once), then ``.venv-flink/bin/python downstream/flink_flows.py
--bootstrap-servers HOST:PORT --topic flows --jars .cache/flink/2.2.0/jars --bounded --output DIR``
(add ``--markers-topic TOPIC`` for ``window_completeness``). Standalone: this file needs only
``contract.py`` beside it (the rules and names shared with the Spark job) and the Avro schemas
(beside them, or ``--schema`` / ``--marker-schema``).

Versions, a matched set. PyPI ``apache-flink==2.2.0`` (its own virtualenv ``.venv-flink``:
PyFlink pins pyarrow/pandas/numpy ranges the project's ``.venv`` must not be forced into; hashed
lock ``requirements/flink.lock``) with the Maven jars of ``tools/flink/pom.xml``, fetched once by
``devtools/flink.py`` into ``.cache/flink/2.2.0/jars``, given to the job by ``--jars`` and passed
as ``pipeline.jars`` (file URLs, nothing is resolved at run time): ``flink-sql-connector-kafka:5.0.0-2.2`` (the Kafka
connector release built for Flink 2.2) and ``flink-sql-avro-confluent-registry:2.1.0``. The
latter has no 2.2.x release on Maven Central, and the unshaded 2.2.0 artifact needs Confluent's
own repository for the registry client; 2.1.0 is built against the older API and so only calls
what 2.2 still has. That shaded jar also holds the plain ``avro`` format (flink-avro) and the
Confluent registry client, so no ``flink-sql-avro`` jar is added (a second copy of the same
classes from another version would clash). Both formats are checked against fastavro on 2.2.0.

Decoding. Without ``--schema-registry`` the values are bare Avro and Flink's ``avro`` format
uses the Avro schema it derives from the table's columns as the *writer* schema, so the table
must be ``schemas/flow_record.avsc`` field by field, in order, with exactly its types and
nullability: ``flink_type`` maps each Avro type (one function, ``table_columns`` applies it to
the whole file) and refuses what Flink's derived schema would encode differently (a union other
than ``["null", X]``, records, enums, fixed). With ``--schema-registry`` the values are
Confluent-framed (magic byte 0, 4-byte schema id, Avro body); ``avro-confluent`` fetches the
writer schema by id from the registry and uses the table's derived schema as the *reader*, so
the table declares only the fields the job uses (``USED_FIELDS``), which also skips decoding the
label maps. ``timestamp-millis`` longs are declared ``BIGINT`` and converted with
``TO_TIMESTAMP_LTZ(x, 3)``: on the wire they are plain longs, and BIGINT stays right whatever
timestamp mapping (legacy or not) the format applies to TIMESTAMP columns.

Groups are the Spark job's, the same SQL (``contract.SOURCE_GROUP``, ``contract.DESTINATION_GROUP``):
each end's workload (``namespace/Kind/Name``) where the record has it, else its pod
(``namespace/pod``: a bare pod, or a record of an exporter without the owner fields), else its
address; a destination is named by ``destinationService`` first, and its address is
``destinationAddress:destinationPort`` (``[address]:port`` for IPv6), after DNAT.

Records of an inter-node pod-to-pod connection come from both nodes' exporters; the copy of the
destination's node (flowType 2, reporter 2) is dropped first, so each connection counts once
(README: One connection, two nodes), before everything else, in all three tables.

Counting is the README's consumer rule: drop duplicate (exporterNode, connectionId, sequence)
triples (``contract.DEDUP_KEY``; a resent record is the same bytes, so the same event time and
window), then sum the four ``*DeltaCount`` fields. A connection is (exporterNode, connectionId),
never the connectionId alone: ids colliding by chance between two nodes' exporters stay two
connections. Event time is ``--event-time`` (exportTime by default) with a watermark ``--watermark``
seconds behind the newest; the session time zone is UTC, so window bounds and timestamps are UTC.

Tables (one StatementSet, so each topic is read once; the planner merges the scans):

* ``flows_by_window``: window_start, window_end, source, destination, packets, bytes,
  forward_packets, forward_bytes, reverse_packets, reverse_bytes, undirected_packets, undirected_bytes
  (``contract.counter_expressions``: a record flagged 16 counts both directions together, undirected). A
  tumbling-window aggregation
  by (window, exporterNode, connectionId, sequence) drops the duplicates, a cascading window
  aggregation by (window, source, destination) sums; rows with no packets and no bytes are left out.
* ``top_talkers``: window_start, window_end, rank, source, destination, packets, bytes: Window
  Top-N (ROW_NUMBER per window) over ``flows_by_window``, by bytes descending (ties: source,
  then destination, as the Spark job).
* ``bytes_by_zone_pair``: window_start, window_end, source_zone, destination_zone, packets,
  bytes and the six counters: the same deduplicated records summed per window and
  (sourceZone, destinationZone); a null zone (an end outside the cluster, a node without a zone
  label, an exporter older than the field) is a group of its own, as in the Spark job.
* ``connection_totals``: connectionId, exporterNode, protocol, sourceAddress, sourcePort,
  destinationAddress, destinationPort, source, destination, first_seen, last_seen, records
  (distinct sequences), packets, bytes and the six counters; a GROUP BY over all
  time, not windowed. ``source``/``destination`` are the greatest value seen for the connection
  (enrichment can fill pod names in later records). With ``--bounded`` it is a plain batch GROUP
  BY written like the others. In streaming mode it is an updating table (no window ever closes
  it), which the append-only filesystem sink cannot take: it is always printed to stdout as a
  changelog (``+I``, ``-U``, ``+U`` rows), with or without ``--output``. Its state grows with the
  number of connections.
* ``window_completeness`` (``--markers-topic TOPIC``, with ``--bounded`` only): window_start,
  window_end, exporters, confirmed_exporters, lossy_exporters, losses, status; one row per window
  of ``flows_by_window``, from the exporters' completeness markers (``schemas/completeness_marker.avsc``,
  README: Completeness markers). The exporters of a window are those with a marker whose interval
  [since, until) overlaps it or whose upTo reaches its start; one is confirmed when some marker of
  it has upTo at or after the window's end, lossy when an overlapping interval has eventLosses +
  connectionsGivenUp + recordsGivenUp + mapFullReads > 0. ``losses`` sums those over the distinct (exporterNode,
  since, until) intervals overlapping the window: the counts are node-wide and repeated in the
  marker of every partition. status: ``lossy`` if any exporter is, else ``complete`` if there are
  exporters and all confirmed it, else ``unconfirmed`` (also when no marker speaks of the window).
  The markers topic is on the same broker with the same security settings, always bare Avro
  (decoded like the flow topic without a registry: the table is the marker schema field by
  field), read from its earliest offset up to the latest at the start; marker times are
  converted like event time (``TO_TIMESTAMP_LTZ(x, 3)``, UTC). The table is a batch join of the
  windows with the markers. Streaming support is future work: the markers of a window keep
  arriving after it closes (its upTo confirmation comes later still), so a streaming version
  needs its own lateness rule and an updating or delayed result; until then ``--markers-topic``
  without ``--bounded`` is refused (exit 2).

Run modes. ``--bounded`` reads each partition up to its latest offset at the start and runs in
BATCH mode, so every window is emitted at the end, then prints one JSON line
``{"flink_flows": {"input_rows": N, "seconds": S}}``: N is one more sink in the same job,
COUNT(*) of the decoded records (duplicates included), S the job's net runtime from Flink's
JobExecutionResult (excludes JVM start and planning). Without it the job streams until Ctrl-C;
windows are emitted once the watermark passes their end, and ``--output`` files are committed at
checkpoints (every ``--checkpoint-interval`` seconds, 10 by default) as the filesystem sink requires:
a restarted job resumes from its last checkpoint (Kafka offsets and window state), and files of
the attempt that failed are never committed, so nothing is counted twice.

On a session cluster (README "Run the jobs on a cluster"): ``flink run -m HOST:PORT -py
flink_flows.py -pyexec PYTHON -- ARGS``, with ``--restarts N`` so that a TaskManager that dies
restarts the job from its last checkpoint (``--checkpoint URI`` keeps those on a file system
instead of the JobManager's memory); the local-mode settings below are then the cluster's own.

Local mode is sized for a small machine: ``--parallelism`` (default 1) slots, a 1 GiB JVM heap
(``--heap``), 256 MiB managed memory, no web UI, no restarts unless ``--restarts`` (a failure ends the job with its
reason), Flink's own log in ``--log-dir`` (the harness: ``.cache/flink/<version>/log``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyflink.table import StatementSet, TableEnvironment

if __package__:  # imported as downstream.flink_flows
    from . import contract
else:  # run as a script: contract.py is beside it (sys.path[0])
    import contract  # type: ignore[no-redef]

SOURCE_TABLE = "flow_records"
MARKERS_TABLE = "completeness_markers"
TABLES = contract.TABLES
COMPLETENESS_TABLE = contract.COMPLETENESS_TABLE  # only with --markers-topic and --bounded
# A marker's loss counts, one expression so the dedupe, the lossy test and the sum agree.
MARKER_LOSSES = " + ".join(contract.MARKER_LOSS_FIELDS)

DELTAS = contract.DELTAS
COUNTERS = contract.COUNTERS
# The record fields the job reads; with the registry the table declares only these.
USED_FIELDS = contract.USED_FIELDS
INTER_NODE = contract.INTER_NODE
REPORTER_DESTINATION = contract.REPORTER_DESTINATION

# Avro primitive -> Flink SQL type, as Flink's AvroSchemaConverter derives them back.
_PRIMITIVES = {
    "boolean": "BOOLEAN",
    "int": "INT",
    "long": "BIGINT",
    "float": "FLOAT",
    "double": "DOUBLE",
    "bytes": "BYTES",
    "string": "STRING",
}
# Logical types whose Flink column is the underlying primitive (see the module docstring).
_PLAIN_LOGICAL = {"timestamp-millis": "long", "timestamp-micros": "long"}
SASL_MECHANISMS = contract.SASL_MECHANISMS
# Where flink-sql-connector-kafka relocates kafka-clients: the JAAS line names a login module
# class, so the unshaded org.apache.kafka... name would not be found.
SHADED_KAFKA = "org.apache.flink.kafka.shaded.org.apache.kafka"


class UsageError(Exception):
    """A bad argument combination: reported like argparse's own errors (exit 2)."""


class JobError(Exception):
    """An expected failure (broker or registry unreachable, job failed): one line, exit 1."""


# --------------------------------------------------------------------------- DDL (no pyflink)


def quote_ident(name: str) -> str:
    """A Flink SQL identifier in backticks (field names like ``sequence`` are keywords)."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(value: str) -> str:
    """A Flink SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def flink_type(avro_type: Any) -> str:
    """The Flink SQL type (with ``NOT NULL`` where Avro has no null) whose derived Avro schema is ``avro_type``.

    Exactness matters because the bare ``avro`` format decodes with the table-derived schema as
    the writer schema: Flink derives ``["null", X]`` for a nullable column and ``X`` for a
    NOT NULL one, maps without null values for ``MAP<STRING NOT NULL, V NOT NULL>``, so anything
    else (``[X, "null"]``, multi-type unions, records, enums, fixed) would be read with the
    wrong branch indexes or layout and is refused here instead.
    """
    if isinstance(avro_type, list):
        others = [t for t in avro_type if t != "null"]
        if len(avro_type) != 2 or avro_type[0] != "null" or len(others) != 1:
            raise ValueError(f'unsupported union {avro_type!r}: only ["null", X] matches Flink\'s derived schema')
        return flink_type(others[0]).removesuffix(" NOT NULL")
    if isinstance(avro_type, dict):
        kind = avro_type.get("type")
        logical = avro_type.get("logicalType")
        if kind == "map":
            return f"MAP<STRING NOT NULL, {flink_type(avro_type['values'])}> NOT NULL"
        if kind == "array":
            return f"ARRAY<{flink_type(avro_type['items'])}> NOT NULL"
        if isinstance(kind, str) and kind in _PRIMITIVES:
            if logical is not None and _PLAIN_LOGICAL.get(logical) != kind:
                raise ValueError(f"unsupported logical type {logical!r} on {kind!r}")
            return flink_type(kind)
        raise ValueError(f"unsupported Avro type {avro_type!r}")
    if avro_type in _PRIMITIVES:
        return f"{_PRIMITIVES[avro_type]} NOT NULL"
    raise ValueError(f"unsupported Avro type {avro_type!r}")


def table_columns(schema: dict[str, Any], fields: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """(name, Flink type) for each field of the record schema, in schema order (only ``fields`` if given)."""
    if schema.get("type") != "record":
        raise ValueError("the Avro schema is not a record")
    wanted = None if fields is None else set(fields)
    columns = [(f["name"], flink_type(f["type"])) for f in schema["fields"] if wanted is None or f["name"] in wanted]
    if wanted is not None:
        missing = wanted - {name for name, _ in columns}
        if missing:
            raise ValueError(f"the schema has no field(s) {', '.join(sorted(missing))}")
    return columns


def reader_schema(schema: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The registry mode's reader schema: ``fields`` of the schema, with their defaults, in schema order.

    Flink requires it to match the table's columns: timestamp-millis become plain longs, as the
    BIGINT columns are (Avro resolution ignores logical types, so any writer version still resolves).
    """
    wanted = set(fields)

    def plain(t: Any) -> Any:
        if isinstance(t, dict) and t.get("logicalType") == "timestamp-millis":
            return t["type"]
        if isinstance(t, list):
            return [plain(x) for x in t]
        return t

    return dict(schema, fields=[dict(f, type=plain(f["type"])) for f in schema["fields"] if f["name"] in wanted])


def kafka_properties(args: argparse.Namespace, sasl_password: str | None) -> dict[str, str]:
    """The Kafka client settings (``properties.*`` options) for the chosen security protocol."""
    props = {"properties.bootstrap.servers": args.bootstrap_servers}
    if args.security_protocol != "PLAINTEXT":
        props["properties.security.protocol"] = args.security_protocol
    if args.security_protocol.startswith("SASL"):
        props["properties.sasl.mechanism"] = args.sasl_mechanism
        props["properties.sasl.jaas.config"] = contract.jaas_config(
            args.sasl_mechanism, args.sasl_username, sasl_password or "", SHADED_KAFKA
        )
    if args.ssl_ca_location is not None:
        # The Java client reads a PEM CA file directly when told its type.
        props["properties.ssl.truststore.type"] = "PEM"
        props["properties.ssl.truststore.location"] = str(args.ssl_ca_location.resolve())
    return props


def source_ddl(schema: dict[str, Any], args: argparse.Namespace, sasl_password: str | None = None) -> str:
    """``CREATE TEMPORARY TABLE flow_records``: the Kafka source, its event time and watermark."""
    registry = args.schema_registry is not None
    columns = table_columns(schema, USED_FIELDS if registry else None)
    lines = [f"  {quote_ident(name)} {sql_type}" for name, sql_type in columns]
    lines.append(f"  event_time AS TO_TIMESTAMP_LTZ({quote_ident(args.event_time)}, 3)")
    lines.append(f"  WATERMARK FOR event_time AS event_time - INTERVAL '{int(args.watermark)}' SECOND")
    options = {
        "connector": "kafka",
        "topic": args.topic,
        "scan.startup.mode": f"{args.starting_offsets}-offset",
        # The key (a binary connection id) is not read: no key.format, the value is the whole row.
        "value.format": "avro-confluent" if registry else "avro",
        **kafka_properties(args, sasl_password),
    }
    if args.bounded:
        options["scan.bounded.mode"] = "latest-offset"
    if registry:
        options["value.avro-confluent.url"] = args.schema_registry
        # The reader schema: without it Flink derives one from the columns, with no defaults, and a
        # record of an older writer version (without a field added since) fails to resolve.
        options["value.avro-confluent.schema"] = json.dumps(reader_schema(schema, USED_FIELDS))
        if args.registry_basic_auth is not None:
            options["value.avro-confluent.basic-auth.credentials-source"] = "USER_INFO"
            options["value.avro-confluent.basic-auth.user-info"] = args.registry_basic_auth
    return _create_table(SOURCE_TABLE, lines, options)


def _create_table(name: str, lines: Sequence[str], options: dict[str, str]) -> str:
    """``CREATE TEMPORARY TABLE name (lines) WITH (options)``, one column or option a line."""
    body = ",\n".join(lines)
    opts = ",\n".join(f"  {sql_string(k)} = {sql_string(v)}" for k, v in options.items())
    return f"CREATE TEMPORARY TABLE {name} (\n{body}\n) WITH (\n{opts}\n)"


def markers_ddl(schema: dict[str, Any], args: argparse.Namespace, sasl_password: str | None = None) -> str:
    """``CREATE TEMPORARY TABLE completeness_markers``: the markers topic, bounded, from its earliest offset.

    Markers are always bare Avro (the exporter never frames them for a registry), so the table is
    the whole marker schema field by field, as for the flow topic without a registry. It reads
    from the earliest offset whatever ``--starting-offsets`` says: a marker written before the
    first flow record read can still cover its window (a long interval, or an upTo), and the
    topic is small (a few markers per exporter, partition and minute). Bounded like the flow
    topic (the table exists with ``--bounded`` only); no event time or watermark, it is joined
    in batch mode.
    """
    lines = [f"  {quote_ident(name)} {sql_type}" for name, sql_type in table_columns(schema)]
    options = {
        "connector": "kafka",
        "topic": args.markers_topic,
        "scan.startup.mode": "earliest-offset",
        "scan.bounded.mode": "latest-offset",
        "value.format": "avro",
        **kafka_properties(args, sasl_password),
    }
    return _create_table(MARKERS_TABLE, lines, options)


def _sum(column: str) -> str:
    return f"SUM({column})"


def view_statements(window_seconds: int, top: int) -> dict[str, str]:
    """The views, by name, in creation order: the enriched records, then the four result tables."""
    packets = " + ".join(_sum(c) for c in contract.PACKETS)
    octets = " + ".join(_sum(c) for c in contract.BYTES)
    counters = ", ".join(f"{_sum(c)} AS {c}" for c in COUNTERS)
    ids = ", ".join(contract.CONNECTION_FIELDS)  # the connection (contract.CONNECTION_KEY) and its tuple
    dedup = ", ".join(quote_ident(c) for c in contract.DEDUP_KEY)  # one record content
    # A record's groups: the same in every copy of it, so grouping by them keeps one copy.
    groups = "source, destination, source_zone, destination_zone"
    unit_packets = " + ".join(contract.PACKETS)
    unit_octets = " + ".join(contract.BYTES)
    estimates = ", ".join(
        f"{e} AS {c}"
        for e, c in zip(contract.estimate_expressions(unit_packets, unit_octets, "p"), contract.ESTIMATES, strict=True)
    )
    connection = ", ".join(quote_ident(c) for c in contract.CONNECTION_KEY)
    return {
        "flows": f"""
SELECT {ids}, `sequence`, event_time,
  {contract.SOURCE_GROUP} AS source,
  {contract.DESTINATION_GROUP} AS destination,
  sourceZone AS source_zone, destinationZone AS destination_zone, {contract.SAMPLING} AS p,
  {", ".join(f"{e} AS {c}" for e, c in zip(contract.counter_expressions(DELTAS), COUNTERS, strict=True))}
FROM {SOURCE_TABLE}
WHERE NOT (flowType = {INTER_NODE} AND reporter = {REPORTER_DESTINATION})""",
        # A resent record is the same bytes: same window, same groups, same counts, so one row
        # per (window, exporterNode, connectionId, sequence) keeps exactly one copy of each.
        "records_by_window": f"""
SELECT window_start, window_end, {dedup}, {groups}, MAX(p) AS p,
  {", ".join(f"MAX({c}) AS {c}" for c in COUNTERS)}
FROM TABLE(TUMBLE(TABLE flows, DESCRIPTOR(event_time), INTERVAL '{window_seconds}' SECOND))
GROUP BY window_start, window_end, {dedup}, {groups}""",
        # One row per connection and group in a window: the unit a sample's standard error sums over.
        "connections_by_window": f"""
SELECT window_start, window_end, {connection}, {groups}, MAX(p) AS p, {counters}
FROM records_by_window
GROUP BY window_start, window_end, {connection}, {groups}""",
        "flows_by_window": f"""
SELECT window_start, window_end, source, destination,
  {packets} AS packets, {octets} AS `bytes`, {counters}, {estimates}
FROM connections_by_window
GROUP BY window_start, window_end, source, destination
HAVING {packets} > 0 OR {octets} > 0""",
        "top_talkers": f"""
SELECT window_start, window_end, `rank`, source, destination, packets, `bytes`
FROM (
  SELECT window_start, window_end, source, destination, packets, `bytes`,
    ROW_NUMBER() OVER (
      PARTITION BY window_start, window_end ORDER BY `bytes` DESC, source, destination
    ) AS `rank`
  FROM flows_by_window
)
WHERE `rank` <= {top}""",
        # The same deduplicated records as flows_by_window; GROUP BY puts null zones in one group.
        contract.ZONE_TABLE: f"""
SELECT window_start, window_end, source_zone, destination_zone,
  {packets} AS packets, {octets} AS `bytes`, {counters}, {estimates}
FROM connections_by_window
GROUP BY window_start, window_end, source_zone, destination_zone
HAVING {packets} > 0 OR {octets} > 0""",
        "distinct_records": f"""
SELECT {ids}, `sequence`, MAX(source) AS source, MAX(destination) AS destination,
  MIN(event_time) AS event_time, {", ".join(f"MAX({c}) AS {c}" for c in COUNTERS)}
FROM flows
GROUP BY {ids}, `sequence`""",
        "connection_totals": f"""
SELECT {ids}, MAX(source) AS source, MAX(destination) AS destination,
  CAST(MIN(event_time) AS TIMESTAMP(3)) AS first_seen, CAST(MAX(event_time) AS TIMESTAMP(3)) AS last_seen,
  COUNT(*) AS records, {packets} AS packets, {octets} AS `bytes`, {counters}
FROM distinct_records
GROUP BY {ids}""",
    }


def completeness_statements(topics: Iterable[str] = ()) -> dict[str, str]:
    """The views of ``window_completeness``, by name, in creation order (BATCH mode: plain joins).

    Windows are those of ``flows_by_window``. Marker times become TIMESTAMP(3) the way event
    time does (TO_TIMESTAMP_LTZ, then the UTC session time zone), so they compare with the
    window bounds. An interval's losses are node-wide and repeated in the marker of every
    partition, so intervals are deduplicated by (exporterNode, since, until) first (MAX: the
    copies are equal). An exporter belongs to a window when one of its intervals overlaps the
    window or its newest upTo reaches the window's start, and is confirmed when that upTo
    reaches the window's end (every record exported before it is in Kafka); ``MAX(upTo)`` stands
    for "some marker's upTo" in both tests.
    """
    ts = "CAST(TO_TIMESTAMP_LTZ({}, 3) AS TIMESTAMP(3))"
    overlaps = "i.since_time < w.window_end AND i.until_time > w.window_start"
    # Only markers about the flow topics read here: other exporters may share the markers topic.
    names = sorted(set(topics))
    where = f"WHERE topic IN ({', '.join(sql_string(t) for t in names)})" if names else ""
    return {
        "completeness_windows": "SELECT DISTINCT window_start, window_end FROM flows_by_window",
        "marker_intervals": f"""
SELECT exporterNode, {ts.format("`since`")} AS since_time, {ts.format("`until`")} AS until_time,
  MAX({MARKER_LOSSES}) AS losses
FROM {MARKERS_TABLE} {where}
GROUP BY exporterNode, `since`, `until`""",
        "marker_progress": f"""
SELECT exporterNode, {ts.format("MAX(upTo)")} AS up_to
FROM {MARKERS_TABLE} {where}
GROUP BY exporterNode""",
        # One row per (window, exporter of that window); losses 0 when only its upTo made it one.
        "window_exporters": f"""
SELECT e.window_start, e.window_end, e.exporterNode, SUM(e.losses) AS losses,
  MAX(CASE WHEN e.losses > 0 THEN 1 ELSE 0 END) AS lossy,
  MAX(CASE WHEN p.up_to >= e.window_end THEN 1 ELSE 0 END) AS confirmed
FROM (
  SELECT w.window_start, w.window_end, i.exporterNode, i.losses
  FROM completeness_windows AS w JOIN marker_intervals AS i ON {overlaps}
  UNION ALL
  SELECT w.window_start, w.window_end, p.exporterNode, CAST(0 AS BIGINT) AS losses
  FROM completeness_windows AS w JOIN marker_progress AS p ON p.up_to >= w.window_start
) AS e
JOIN marker_progress AS p ON p.exporterNode = e.exporterNode
GROUP BY e.window_start, e.window_end, e.exporterNode""",
        "window_completeness_counts": """
SELECT w.window_start, w.window_end,
  COUNT(e.exporterNode) AS exporters,
  CAST(COALESCE(SUM(e.confirmed), 0) AS BIGINT) AS confirmed_exporters,
  CAST(COALESCE(SUM(e.lossy), 0) AS BIGINT) AS lossy_exporters,
  CAST(COALESCE(SUM(e.losses), 0) AS BIGINT) AS losses
FROM completeness_windows AS w
LEFT JOIN window_exporters AS e ON e.window_start = w.window_start AND e.window_end = w.window_end
GROUP BY w.window_start, w.window_end""",
        COMPLETENESS_TABLE: """
SELECT window_start, window_end, exporters, confirmed_exporters, lossy_exporters, losses,
  CASE
    WHEN lossy_exporters > 0 THEN 'lossy'
    WHEN exporters > 0 AND confirmed_exporters = exporters THEN 'complete'
    ELSE 'unconfirmed'
  END AS status
FROM window_completeness_counts""",
    }


_RESULT_COLUMNS = {
    "flows_by_window": [
        ("window_start", "TIMESTAMP(3)"),
        ("window_end", "TIMESTAMP(3)"),
        ("source", "STRING"),
        ("destination", "STRING"),
        ("packets", "BIGINT"),
        ("bytes", "BIGINT"),
        *((c, "BIGINT") for c in COUNTERS),
        *((c, "DOUBLE") for c in contract.ESTIMATES),
    ],
    "top_talkers": [
        ("window_start", "TIMESTAMP(3)"),
        ("window_end", "TIMESTAMP(3)"),
        ("rank", "BIGINT"),
        ("source", "STRING"),
        ("destination", "STRING"),
        ("packets", "BIGINT"),
        ("bytes", "BIGINT"),
    ],
    contract.ZONE_TABLE: [
        ("window_start", "TIMESTAMP(3)"),
        ("window_end", "TIMESTAMP(3)"),
        ("source_zone", "STRING"),
        ("destination_zone", "STRING"),
        ("packets", "BIGINT"),
        ("bytes", "BIGINT"),
        *((c, "BIGINT") for c in COUNTERS),
        *((c, "DOUBLE") for c in contract.ESTIMATES),
    ],
    "connection_totals": [
        ("connectionId", "BIGINT"),
        ("exporterNode", "STRING"),
        ("protocol", "INT"),
        ("sourceAddress", "STRING"),
        ("sourcePort", "INT"),
        ("destinationAddress", "STRING"),
        ("destinationPort", "INT"),
        ("source", "STRING"),
        ("destination", "STRING"),
        ("first_seen", "TIMESTAMP(3)"),
        ("last_seen", "TIMESTAMP(3)"),
        ("records", "BIGINT"),
        ("packets", "BIGINT"),
        ("bytes", "BIGINT"),
        *((c, "BIGINT") for c in COUNTERS),
    ],
    COMPLETENESS_TABLE: [
        ("window_start", "TIMESTAMP(3)"),
        ("window_end", "TIMESTAMP(3)"),
        ("exporters", "BIGINT"),
        ("confirmed_exporters", "BIGINT"),
        ("lossy_exporters", "BIGINT"),
        ("losses", "BIGINT"),
        ("status", "STRING"),
    ],
    "input_rows": [("input_rows", "BIGINT")],
}


def sink_ddl(table: str, options: dict[str, str]) -> str:
    """``CREATE TEMPORARY TABLE sink_<table>`` with the result columns of ``table``."""
    cols = ",\n".join(f"  {quote_ident(n)} {t}" for n, t in _RESULT_COLUMNS[table])
    opts = ",\n".join(f"  {sql_string(k)} = {sql_string(v)}" for k, v in options.items())
    return f"CREATE TEMPORARY TABLE sink_{table} (\n{cols}\n) WITH (\n{opts}\n)"


def json_files_options(directory: Path) -> dict[str, str]:
    """A filesystem sink of JSON lines; timestamps as ISO-8601 (UTC, the session time zone)."""
    return {
        "connector": "filesystem",
        "path": directory.resolve().as_uri(),
        "format": "json",
        "json.timestamp-format.standard": "ISO-8601",
    }


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; combinations argparse cannot express are checked in ``check_args``."""
    ap = argparse.ArgumentParser(
        prog="flink_flows.py", description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--bootstrap-servers", required=True, help="Kafka bootstrap servers, host:port[,...]")
    ap.add_argument("--topic", required=True, help="flow topic (a semicolon-separated list reads several)")
    ap.add_argument("--starting-offsets", choices=("earliest", "latest"), default="earliest")
    ap.add_argument("--window", type=int, default=60, metavar="SECONDS", help="tumbling window length (default: 60)")
    ap.add_argument("--event-time", choices=("exportTime", "flowEnd"), default="exportTime", help="event-time field")
    ap.add_argument(
        "--watermark", type=int, default=60, metavar="SECONDS", help="allowed lateness of event time (default: 60)"
    )
    ap.add_argument("--top", type=int, default=10, metavar="N", help="rows per window in top_talkers (default: 10)")
    ap.add_argument(
        "--schema-registry",
        metavar="URL",
        help="values are Confluent-framed; decode with the registry's writer schema\n"
        "(default: bare Avro with schemas/flow_record.avsc)",
    )
    ap.add_argument("--registry-basic-auth", metavar="USER:PASSWORD", help="registry HTTP basic auth")
    ap.add_argument(
        "--markers-topic",
        metavar="TOPIC",
        help="the exporters' completeness markers (bare Avro, same broker and security):\n"
        "adds the window_completeness table (needs --bounded)",
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
        default=os.environ.get("FLOW_FLINK_JARS"),
        metavar="PATH[,PATH...]",
        help="the Flink connector jars (flink-sql-connector-kafka, flink-sql-avro-confluent-registry;\n"
        "a directory stands for its *.jar files) (default: $FLOW_FLINK_JARS)",
    )
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=Path(os.environ.get("FLINK_LOG_DIR") or Path(tempfile.gettempdir()) / "flink_flows-log"),
        help="Flink's own log (default: $FLINK_LOG_DIR, else flink_flows-log in the temporary directory)",
    )
    ap.add_argument("--security-protocol", choices=contract.SECURITY_PROTOCOLS, default="PLAINTEXT")
    ap.add_argument("--sasl-mechanism", choices=SASL_MECHANISMS, default="SCRAM-SHA-512")
    ap.add_argument("--sasl-username")
    ap.add_argument("--sasl-password", help="prefer the environment variable FLOW_SASL_PASSWORD")
    ap.add_argument("--ssl-ca-location", type=Path, metavar="PEM", help="CA certificate(s) to trust (PEM)")
    ap.add_argument("--bounded", action="store_true", help="read up to the offsets at start, then finish (BATCH)")
    ap.add_argument("--output", type=Path, metavar="DIR", help="write JSON lines under DIR/<table>/ (default: stdout)")
    ap.add_argument("--parallelism", type=int, default=1)
    ap.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart a failed job up to N times (1 s apart) from its last checkpoint; on a cluster, where a\n"
        "TaskManager can die, give it some (default: 0, a failure ends the job with its reason)",
    )
    ap.add_argument(
        "--checkpoint-interval",
        type=int,
        default=10,
        metavar="SECONDS",
        help="streaming: checkpoint (and commit --output files) this often (default: 10)",
    )
    ap.add_argument(
        "--checkpoint",
        metavar="URI",
        help="streaming: keep checkpoints under this URI (file:///..., s3://...; default: the JobManager's memory)",
    )
    ap.add_argument("--heap", default="1g", help="JVM heap (-Xmx) of the local Flink (default: 1g)")
    ap.add_argument("--explain", action="store_true", help="print the plan instead of running")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> str | None:
    """Validate combinations; return the SASL password (from the flag or FLOW_SASL_PASSWORD)."""
    for name in ("window", "top", "parallelism", "checkpoint_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.restarts < 0:
        raise UsageError("--restarts must not be negative")
    if args.checkpoint is not None and args.bounded:
        raise UsageError("--checkpoint is for streaming runs; a --bounded run takes no checkpoints")
    if args.watermark < 0:
        raise UsageError("--watermark must not be negative")
    if args.schema is None:
        raise UsageError(f"--schema is required: no {contract.FLOW_SCHEMA} beside the job")
    if not args.schema.is_file():
        raise UsageError(f"--schema: no such file: {args.schema}")
    password = args.sasl_password or os.environ.get(contract.PASSWORD_ENV)
    if args.security_protocol.startswith("SASL"):
        if not args.sasl_username or not password:
            raise UsageError(
                f"{args.security_protocol} needs --sasl-username and FLOW_SASL_PASSWORD (or --sasl-password)"
            )
    elif args.sasl_username or args.sasl_password:
        raise UsageError("--sasl-username/--sasl-password need --security-protocol SASL_PLAINTEXT or SASL_SSL")
    if args.ssl_ca_location is not None:
        if not args.security_protocol.endswith("SSL"):
            raise UsageError("--ssl-ca-location needs --security-protocol SSL or SASL_SSL")
        if not args.ssl_ca_location.is_file():
            raise UsageError(f"--ssl-ca-location: no such file: {args.ssl_ca_location}")
    if args.registry_basic_auth is not None:
        if args.schema_registry is None:
            raise UsageError("--registry-basic-auth needs --schema-registry")
        if ":" not in args.registry_basic_auth:
            raise UsageError("--registry-basic-auth must be USER:PASSWORD")
    if args.schema_registry is not None and not args.schema_registry.startswith(("http://", "https://")):
        raise UsageError("--schema-registry must be an http:// or https:// URL")
    if args.markers_topic is not None and not args.bounded:
        raise UsageError("--markers-topic needs --bounded (the window_completeness table is batch-only for now)")
    if args.markers_topic is not None:
        if args.marker_schema is None:
            raise UsageError(f"--markers-topic needs --marker-schema: no {contract.MARKER_SCHEMA} beside the job")
        if not args.marker_schema.is_file():
            raise UsageError(f"--marker-schema: no such file: {args.marker_schema}")
    return password


# --------------------------------------------------------------------------- reachability


def _check_brokers(bootstrap: str, timeout: float = 5.0) -> None:
    """Fail fast, in one line, when no bootstrap server accepts a TCP connection (contract.unreachable_brokers)."""
    why = contract.unreachable_brokers(bootstrap, timeout)
    if why is not None:
        raise JobError(why)


def _check_registry(url: str, basic_auth: str | None, timeout: float = 5.0) -> None:
    """Fail fast when the schema registry does not answer ``GET /subjects``."""
    request = urllib.request.Request(url.rstrip("/") + "/subjects")
    if basic_auth:
        request.add_header("Authorization", "Basic " + b64encode(basic_auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        raise JobError(f"the schema registry at {url} answered HTTP {exc.code} to GET /subjects") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise JobError(f"cannot reach the schema registry at {url}: {reason}") from None


# --------------------------------------------------------------------------- Flink (lazy pyflink)


def jar_urls(jars: Sequence[Path]) -> str:
    """``pipeline.jars``'s value: ``file://`` URLs separated by ``;``."""
    return ";".join(j.resolve().as_uri() for j in jars)


def _prepare_jvm(heap: str, log_dir: Path) -> None:
    """Environment for PyFlink's gateway JVM, read when it starts (the first pyflink call).

    JVM_ARGS goes before Flink's own options; the log goes to ``--log-dir`` rather than into the
    installed package, at INFO so a failure can be investigated from it.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["JVM_ARGS"] = f"-Xmx{heap} -Xss1m -XX:+UseParallelGC -XX:ParallelGCThreads=2"
    os.environ.setdefault("FLINK_LOG_DIR", str(log_dir))
    os.environ.setdefault("ROOT_LOG_LEVEL", "INFO")


def table_environment(args: argparse.Namespace, jar_urls: str) -> TableEnvironment:
    """A local TableEnvironment, BATCH for ``--bounded`` else STREAMING, small and quiet."""
    from pyflink.common import Configuration
    from pyflink.table import EnvironmentSettings, TableEnvironment

    conf = Configuration()
    settings = {
        "pipeline.name": "flink_flows",
        "pipeline.jars": jar_urls,
        "parallelism.default": str(args.parallelism),
        "taskmanager.numberOfTaskSlots": str(args.parallelism),
        "taskmanager.memory.managed.size": "256m",
        "taskmanager.memory.network.min": "64m",
        "taskmanager.memory.network.max": "64m",
        # By default a failure (bad record, lost broker) ends the job with its reason instead of
        # looping; on a cluster --restarts lets it resume from its last checkpoint.
        "restart-strategy.type": "fixed-delay" if args.restarts else "none",
        "table.local-time-zone": "UTC",
        # Sort-based batch shuffles spill less than hash ones on a small heap.
        "table.exec.resource.default-parallelism": str(args.parallelism),
    }
    if args.restarts:
        settings["restart-strategy.fixed-delay.attempts"] = str(args.restarts)
        settings["restart-strategy.fixed-delay.delay"] = "1 s"
    if not args.bounded and (args.output is not None or args.checkpoint is not None):
        # The streaming filesystem sink commits files at checkpoints only.
        settings["execution.checkpointing.interval"] = f"{args.checkpoint_interval} s"
    if args.checkpoint is not None:
        settings["execution.checkpointing.storage"] = "filesystem"
        settings["execution.checkpointing.dir"] = args.checkpoint
    for key, value in settings.items():
        conf.set_string(key, value)
    builder = EnvironmentSettings.new_instance().with_configuration(conf)
    builder = builder.in_batch_mode() if args.bounded else builder.in_streaming_mode()
    t_env = TableEnvironment.create(builder.build())
    # Set again through TableConfig: PyFlink then also puts the jars on the gateway's class
    # loader, which the planner uses to find the format and connector factories.
    t_env.get_config().set("pipeline.jars", jar_urls)
    return t_env


def build_statements(
    t_env: TableEnvironment,
    args: argparse.Namespace,
    schema: dict[str, Any],
    sasl_password: str | None,
    count_dir: Path | None,
    marker_schema: dict[str, Any] | None = None,
) -> StatementSet:
    """Create the sources, views and sinks; return the StatementSet of the INSERTs.

    With ``marker_schema`` (``--markers-topic``, bounded only) the markers table and the
    ``window_completeness`` views and sink are added to the same set, so the flow topic is
    still read once and the completeness windows reuse the ``flows_by_window`` plan.
    """
    t_env.execute_sql(source_ddl(schema, args, sasl_password))
    views = view_statements(args.window, args.top)
    tables: tuple[str, ...] = TABLES
    if marker_schema is not None:
        t_env.execute_sql(markers_ddl(marker_schema, args, sasl_password))
        views.update(completeness_statements(args.topic.split(";")))
        tables = (*TABLES, COMPLETENESS_TABLE)
    for name, query in views.items():
        t_env.execute_sql(f"CREATE TEMPORARY VIEW {name} AS {query}")
    statements = t_env.create_statement_set()
    for table in tables:
        changelog = table == "connection_totals" and not args.bounded
        if args.output is not None and not changelog:
            options = json_files_options(args.output / table)
            if not args.bounded:
                # Row-format part files are committed at a checkpoint only once rolled; roll
                # them at the checkpoint interval so results appear within about 20 s.
                interval = args.checkpoint_interval
                options["sink.rolling-policy.rollover-interval"] = f"{interval} s"
                options["sink.rolling-policy.check-interval"] = f"{max(1, interval // 2)} s"
        else:
            options = {"connector": "print", "print-identifier": table}
        t_env.execute_sql(sink_ddl(table, options))
        statements.add_insert_sql(f"INSERT INTO sink_{table} SELECT * FROM {table}")
    if count_dir is not None:
        t_env.execute_sql(sink_ddl("input_rows", json_files_options(count_dir)))
        statements.add_insert_sql(f"INSERT INTO sink_input_rows SELECT COUNT(*) FROM {SOURCE_TABLE}")
    return statements


def _read_count(count_dir: Path) -> int:
    """The single ``input_rows`` value the count sink wrote (0 when the job read nothing)."""
    total = 0
    for path in count_dir.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            for line in path.read_text().splitlines():
                if line.strip():
                    total += int(json.loads(line)["input_rows"])
    return total


def _java_reason(exc: BaseException) -> str:
    """The innermost Java cause of a Py4J error, as one line."""
    java = getattr(exc, "java_exception", None)
    if java is None:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
    reasons = []
    while java is not None:
        reasons.append(f"{java.getClass().getName()}: {java.getMessage()}")
        cause = java.getCause()
        java = None if cause is None or cause.equals(java) else cause
    interesting = [r for r in reasons if "JobExecutionException" not in r and "CompletionException" not in r]
    return (interesting or reasons)[-1].replace("\n", " ")


def _wait(client: Any) -> float | None:
    """Wait for the job to end; return its net runtime in seconds, None when a signal cancelled it.

    A signal must not raise inside a Py4J call: that breaks the gateway connection, and the
    gateway JVM then shuts the MiniCluster down under the job. So SIGINT/SIGTERM only set a
    flag, checked between short calls, and the job is cancelled through the gateway (the gateway
    JVM ignores SIGINT itself). The calls go to the job's result future, which outlives the
    per-job MiniCluster (that shuts down as soon as the job ends, so a job status request could
    find it gone). ``result()`` raises the job's failure.
    """
    from py4j.protocol import Py4JError

    future = client.get_job_execution_result()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not future.done():
            if stop.wait(0.5):
                with contextlib.suppress(Py4JError):  # the job may be ending by itself meanwhile
                    client.cancel().result()
                return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        return future.result().get_net_runtime() / 1000
    except Py4JError as exc:
        # Cancelled from outside (``flink cancel``, the web UI): an ending, not a failure.
        if "JobCancellationException" in _java_reason(exc):
            return None
        raise


def run(args: argparse.Namespace, password: str | None) -> int:
    """Plan and run the job; with ``--bounded`` print the summary line at the end."""
    try:
        jars = contract.jar_paths(
            args.jars,
            "--jars",
            "the Flink connector jars (flink-sql-connector-kafka, flink-sql-avro-confluent-registry)",
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    schema = json.loads(args.schema.read_text())
    try:
        source_ddl(schema, args)  # an unsupported schema fails here, before the JVM starts
    except ValueError as exc:
        raise UsageError(f"--schema: {exc}") from None
    marker_schema = json.loads(args.marker_schema.read_text()) if args.markers_topic is not None else None
    if not args.explain:
        _check_brokers(args.bootstrap_servers)
        if args.schema_registry is not None:
            _check_registry(args.schema_registry, args.registry_basic_auth)
    log_dir = args.log_dir
    _prepare_jvm(args.heap, log_dir)
    from py4j.protocol import Py4JError

    count_dir = Path(tempfile.mkdtemp(prefix="flink-flows-count-")) if args.bounded else None
    try:
        t_env = table_environment(args, jar_urls(jars))
        statements = build_statements(t_env, args, schema, password, count_dir, marker_schema)
        if args.explain:
            print(statements.explain())
            return 0
        result = statements.execute()
        seconds = _wait(result.get_job_client())
        if seconds is None:
            print("flink_flows.py: stopped (job cancelled)", file=sys.stderr)
            return 130
        if count_dir is not None:
            summary = {"input_rows": _read_count(count_dir), "seconds": round(seconds, 3)}
            print(json.dumps({"flink_flows": summary}), flush=True)
        return 0
    except Py4JError as exc:
        raise JobError(f"the Flink job failed: {_java_reason(exc)} (Flink log: {log_dir})") from None
    finally:
        if count_dir is not None:
            shutil.rmtree(count_dir, ignore_errors=True)


def _scrub(text: str, secrets: Iterable[str | None]) -> str:
    """Replace secrets in a message (Flink may quote table options in its errors)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate, run; expected failures print one line (exit 2 for usage, 1 otherwise)."""
    args = parse_args(argv)
    password: str | None = None
    try:
        password = check_args(args)
        return run(args, password)
    except UsageError as exc:
        print(f"flink_flows.py: error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        basic = args.registry_basic_auth.partition(":")[2] if args.registry_basic_auth else None
        print(f"flink_flows.py: {_scrub(str(exc), (password, basic))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout piped into head and closed: nothing left to say
        sys.stderr.close()
        return 1


if __name__ == "__main__":
    sys.exit(main())
