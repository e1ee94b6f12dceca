"""What the two reference jobs share: the record fields they read, the rules, the tables, the schemas, the jars.

``spark_flows.py`` and ``flink_flows.py`` import this module, and nothing else of the repository:
copied elsewhere, a job needs only this file beside it (and the Avro schemas, see
:func:`schema_file`). Standard library only, so it loads in either job's interpreter.

The rules (README "Downstream", "Counting: the contract"), in the order the jobs apply them:

1. drop the destination node's copy of an inter-node pod-to-pod connection
   (``flowType`` = :data:`INTER_NODE` and ``reporter`` = :data:`REPORTER_DESTINATION`);
2. drop duplicate :data:`DEDUP_KEY` triples (a resent record is the same bytes); per-connection
   state and groups are keyed by :data:`CONNECTION_KEY`, never by ``connectionId`` alone;
3. sum the :data:`DELTAS` into the :data:`COUNTERS` columns;
4. estimate each window group's packets and bytes over every connection, kept by the exporters' sampling
   or not, as the sum over its connections of count / ``samplingProbability``, with its standard error
   (:data:`ESTIMATES`, :func:`estimate_expressions`); at probability 1 the estimate is the sum, its error 0.

Groups (:data:`SOURCE_GROUP`, :data:`DESTINATION_GROUP`) name each end by its workload, the one
name that outlives a rollout (``namespace/Kind/Name``: ``shop/Deployment/web``), else by its pod
(``namespace/pod``: a pod no controller manages, whose owner kind is ``Pod``, or a record of an
exporter older than the owner fields), else by its named network (``networks.file``: ``s3-eu-west-1``),
else by its address; a destination reached through a
Service is named by the Service first. Zones (:data:`ZONE_FIELDS`) stay null when unknown: a null
zone is a group of its own in ``bytes_by_zone_pair``, in both jobs.
"""

from __future__ import annotations

from pathlib import Path

# --------------------------------------------------------------------------- record fields

DELTAS = ("packetDeltaCount", "octetDeltaCount", "reversePacketDeltaCount", "reverseOctetDeltaCount")
TOTALS = ("packetTotalCount", "octetTotalCount", "reversePacketTotalCount", "reverseOctetTotalCount")
# Output counter columns: forward (original direction) and reverse (reply direction) as a record's DELTAS / TOTALS
# give them, and undirected: the counts of a record flagged BOTH_DIRECTIONS, whose forward fields hold both
# directions together (Cilium 1.16 and later), so that forward and reverse stay what their names say.
COUNTERS = (
    "forward_packets", "forward_bytes", "reverse_packets", "reverse_bytes", "undirected_packets", "undirected_bytes",
)  # fmt: skip
PACKETS = ("forward_packets", "reverse_packets", "undirected_packets")  # summed: a row's packets, both directions
BYTES = ("forward_bytes", "reverse_bytes", "undirected_bytes")
BOTH_DIRECTIONS = 16  # record flag: one pair of counters for both directions, the split unknown
# The window tables' estimates over all connections from a sample (README: Sampling): Horvitz-Thompson sums and
# their standard errors. A connection is the sampled unit, so they are computed from per-connection rows.
ESTIMATES = ("estimated_packets", "estimated_bytes", "packets_se", "bytes_se")
SAMPLING = "samplingProbability"  # the record field: the probability its connection was kept with

# The fields that identify a connection in connection_totals (and lead its columns): CONNECTION_KEY
# and the tuple, which is the same in every record of a connection.
CONNECTION_FIELDS = (
    "connectionId",
    "exporterNode",
    "protocol",
    "sourceAddress",
    "sourcePort",
    "destinationAddress",
    "destinationPort",
)
# Workload owners of each end (kind, name; in the pod's namespace) and zones of each end's node.
OWNER_FIELDS = ("sourceOwnerKind", "sourceOwnerName", "destinationOwnerKind", "destinationOwnerName")
ZONE_FIELDS = ("sourceZone", "destinationZone")
# The record fields both jobs read (the others are skipped when decoding): the rules, the event
# time, the groups and the counters.
USED_FIELDS = frozenset(
    {
        *CONNECTION_FIELDS,
        "sequence",
        "exportTime",
        "flowEnd",
        "ipVersion",
        "sourcePodNamespace",
        "sourcePodName",
        "destinationPodNamespace",
        "destinationPodName",
        "destinationService",
        *OWNER_FIELDS,
        *ZONE_FIELDS,
        "sourceNetwork",
        "destinationNetwork",
        "flowType",
        "reporter",
        "flags",
        SAMPLING,
        *DELTAS,
    }
)
# The totals rule (Spark's --mode totals) also needs the kernel identity of a connection.
KERNEL_IDENTITY = (
    "exporterNode",
    "zone",
    "protocol",
    "sourceAddress",
    "sourcePort",
    "destinationAddress",
    "destinationPort",
    "ctId",
    "flowStart",
)
TOTALS_MODE_FIELDS = frozenset({*KERNEL_IDENTITY, "flags", SAMPLING, *TOTALS})

EVENT_TIMES = ("exportTime", "flowEnd")  # --event-time choices; the first is the default

# --------------------------------------------------------------------------- rules

INTER_NODE = 2  # flowType: pod to pod across nodes
REPORTER_DESTINATION = 2  # reporter: the exporter on the destination pod's node
# connectionIds are allocated per exporter process, from a random start: two exporters' ids collide
# only by chance, and then for a run of ids at once. With exporterNode in every key such a
# collision cannot merge two nodes' connections (README, "Counting: the contract").
CONNECTION_KEY = ("exporterNode", "connectionId")
DEDUP_KEY = (*CONNECTION_KEY, "sequence")
COUNTERS_RESET = 2  # record flag: this connectionId continues an entry whose counters went down

# A completeness marker's loss counts: a round is lossy when their sum is above 0 (mapFullReads: the Cilium source's
# polls that found a map full, where Cilium's LRU eviction drops live entries unseen).
MARKER_LOSS_FIELDS = ("eventLosses", "connectionsGivenUp", "recordsGivenUp", "mapFullReads")
STATUSES = ("lossy", "complete", "unconfirmed")  # window_completeness.status, in order of precedence


def counter_expressions(counts: tuple[str, ...]) -> tuple[str, ...]:
    """Each of :data:`COUNTERS` as one SQL expression over a record's four counters (``counts``: :data:`DELTAS` or
    :data:`TOTALS`) and its ``flags``, read alike by Spark SQL and Flink SQL: a record flagged
    :data:`BOTH_DIRECTIONS` counts into the undirected columns, any other into forward and reverse."""
    packets, octets, reverse_packets, reverse_octets = counts
    both = f"MOD(FLOOR(flags / {BOTH_DIRECTIONS}), 2) = 1"
    return (
        f"CASE WHEN {both} THEN 0 ELSE {packets} END", f"CASE WHEN {both} THEN 0 ELSE {octets} END",
        reverse_packets, reverse_octets,
        f"CASE WHEN {both} THEN {packets} ELSE 0 END", f"CASE WHEN {both} THEN {octets} ELSE 0 END",
    )  # fmt: skip


def estimate_expressions(packets: str, octets: str, probability: str) -> tuple[str, ...]:
    """:data:`ESTIMATES` as SQL aggregates over rows of one connection each (its ``packets`` and ``octets`` in a
    window and group, and the ``probability`` it was kept with), read alike by Spark SQL and Flink SQL.

    Each connection is kept independently with its probability p (a keyed hash: as good as a coin per
    connection), so sum(y / p) is unbiased for the total over all connections, with variance
    sum((1 - p) / p * y^2) over all of them; sum((1 - p) / p^2 * y^2) over the kept ones estimates it without
    bias. The unit is the connection, not the record: the records of a connection are kept or dropped together.
    """

    p = f"({probability})"

    def err(y: str) -> str:
        return f"SQRT(SUM((1 - {p}) / ({p} * {p}) * CAST(({y}) AS DOUBLE) * ({y})))"

    return f"SUM(({packets}) / {p})", f"SUM(({octets}) / {p})", err(packets), err(octets)


# --------------------------------------------------------------------------- groups

# The owner kind of a pod no controller manages: such a pod is its own workload and keeps its
# pod label, so records of older exporters (no owner fields) and newer ones name it alike.
BARE_POD = "Pod"
# Each end's group, as one SQL expression that Spark SQL and Flink SQL read alike (``||`` and
# CASE give null when a part is null, so a half-known name falls through to the next choice).
# The rule, in order: the workload (``namespace/Kind/Name``) unless the pod is its own workload,
# the pod (``namespace/pod``), the named network an external end is in, the address. A destination is named
# by the Service the client
# addressed first (``destinationService``, ``namespace/name:port/protocol``), and its address
# is the one reached, after DNAT, with the port (``[address]:port`` for IPv6).
SOURCE_GROUP = f"""COALESCE(
  CASE WHEN sourceOwnerKind <> '{BARE_POD}'
    THEN sourcePodNamespace || '/' || sourceOwnerKind || '/' || sourceOwnerName END,
  sourcePodNamespace || '/' || sourcePodName,
  sourceNetwork,
  sourceAddress)"""
DESTINATION_GROUP = f"""COALESCE(
  destinationService,
  CASE WHEN destinationOwnerKind <> '{BARE_POD}'
    THEN destinationPodNamespace || '/' || destinationOwnerKind || '/' || destinationOwnerName END,
  destinationPodNamespace || '/' || destinationPodName,
  destinationNetwork,
  CASE WHEN ipVersion = 6 THEN '[' || destinationAddress || ']' ELSE destinationAddress END
    || ':' || CAST(destinationPort AS STRING))"""


# --------------------------------------------------------------------------- tables and columns

ZONE_TABLE = "bytes_by_zone_pair"
TABLES = ("flows_by_window", "top_talkers", ZONE_TABLE, "connection_totals")
COMPLETENESS_TABLE = "window_completeness"  # only with --markers-topic
COLUMNS = {
    "flows_by_window": (
        "window_start",
        "window_end",
        "source",
        "destination",
        "packets",
        "bytes",
        *COUNTERS,
        *ESTIMATES,
    ),
    "top_talkers": ("window_start", "window_end", "rank", "source", "destination", "packets", "bytes"),
    ZONE_TABLE: (
        "window_start",
        "window_end",
        "source_zone",
        "destination_zone",
        "packets",
        "bytes",
        *COUNTERS,
        *ESTIMATES,
    ),
    "connection_totals": (
        *CONNECTION_FIELDS,
        "source",
        "destination",
        "first_seen",
        "last_seen",
        "records",
        "packets",
        "bytes",
        *COUNTERS,
    ),
    COMPLETENESS_TABLE: (
        "window_start",
        "window_end",
        "exporters",
        "confirmed_exporters",
        "lossy_exporters",
        "losses",
        "status",
    ),
}

# --------------------------------------------------------------------------- Kafka security

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
PASSWORD_ENV = "FLOW_SASL_PASSWORD"


def jaas_config(mechanism: str, username: str, password: str, package: str = "org.apache.kafka") -> str:
    """``sasl.jaas.config`` for the mechanism; ``package`` is where the Kafka client's classes live
    (Flink's SQL connector relocates them)."""

    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    module = "plain.PlainLoginModule" if mechanism == "PLAIN" else "scram.ScramLoginModule"
    return f"{package}.common.security.{module} required username={quote(username)} password={quote(password)};"


def unreachable_brokers(bootstrap: str, timeout: float = 5.0) -> str | None:
    """Why no bootstrap server of ``bootstrap`` accepts a TCP connection, in one line; None when one does.

    Both jobs ask before starting: their Kafka sources would otherwise retry metadata requests for a minute or
    more and end in a stack trace (Spark's: 190 s and 818 lines)."""
    import socket

    tried = []
    for server in (s.strip() for s in bootstrap.split(",") if s.strip()):
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return None
        except (OSError, ValueError) as exc:
            tried.append(f"{server} ({exc.__class__.__name__}: {exc})")
    return f"cannot reach any Kafka bootstrap server: {'; '.join(tried) or repr(bootstrap)}"


# --------------------------------------------------------------------------- schemas

FLOW_SCHEMA = "flow_record.avsc"
MARKER_SCHEMA = "completeness_marker.avsc"


def schema_file(name: str) -> Path | None:
    """The Avro schema ``name``: beside this module (a copy of the jobs), else in the repository's ``schemas/``.

    None when neither has it; the jobs then need the file named on their command line.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / "schemas" / name):
        if candidate.is_file():
            return candidate
    return None


# --------------------------------------------------------------------------- connector jars


def jar_paths(text: str | None, flag: str = "--jars", what: str = "the connector jars") -> list[Path]:
    """The jars a ``--jars PATH[,PATH...]`` value names; a directory stands for the ``*.jar`` files in it.

    Raises ValueError with one line naming ``flag`` when the value is missing or names nothing usable.
    """
    if not text or not text.strip():
        raise ValueError(f"{flag} PATH[,PATH...] is required: {what}")
    jars: list[Path] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.jar"))
            if not found:
                raise ValueError(f"{flag}: no *.jar in directory {path}")
            jars.extend(found)
        elif path.is_file():
            jars.append(path)
        else:
            raise ValueError(f"{flag}: no such file or directory: {path}")
    if not jars:
        raise ValueError(f"{flag} PATH[,PATH...] is required: {what}")
    return [j.resolve() for j in jars]
