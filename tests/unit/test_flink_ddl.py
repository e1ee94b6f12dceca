"""The Flink job's table definitions, checked without PyFlink (the project's .venv does not have it).

Bare Avro is decoded with the schema Flink derives from the table as the writer schema, so a
column type or order that differs from schemas/flow_record.avsc would misread every record
silently; these tests pin the mapping for every field and the order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import downstream.flink_flows as ff
from downstream import contract

REPO = Path(__file__).resolve().parents[2]
SCHEMA: dict[str, Any] = json.loads((REPO / "schemas" / "flow_record.avsc").read_text())
MARKER_SCHEMA: dict[str, Any] = json.loads((REPO / "schemas" / "completeness_marker.avsc").read_text())


def _expected(avro_type: Any) -> str:
    """The mapping written out independently of flink_type, per shape found in the schema."""
    if isinstance(avro_type, list):
        assert avro_type[0] == "null" and len(avro_type) == 2
        return _expected(avro_type[1]).removesuffix(" NOT NULL")
    if isinstance(avro_type, dict):
        if avro_type["type"] == "map":
            return f"MAP<STRING NOT NULL, {_expected(avro_type['values'])}> NOT NULL"
        assert avro_type.get("logicalType") == "timestamp-millis"
        return _expected(avro_type["type"])
    simple = {"int": "INT", "long": "BIGINT", "double": "DOUBLE", "string": "STRING", "bytes": "BYTES"}
    return simple[avro_type] + " NOT NULL"


def test_pyflink_is_not_needed() -> None:
    assert "pyflink" not in sys.modules


@pytest.mark.parametrize("field", SCHEMA["fields"], ids=[f["name"] for f in SCHEMA["fields"]])
def test_every_field_maps(field: dict[str, Any]) -> None:
    assert ff.flink_type(field["type"]) == _expected(field["type"])


@pytest.mark.parametrize(
    ("avro_type", "flink"),
    [
        ("long", "BIGINT NOT NULL"),
        ("int", "INT NOT NULL"),
        ("string", "STRING NOT NULL"),
        ("bytes", "BYTES NOT NULL"),
        ("boolean", "BOOLEAN NOT NULL"),
        ("double", "DOUBLE NOT NULL"),
        (["null", "string"], "STRING"),
        (["null", "bytes"], "BYTES"),
        # Plain longs on the wire; BIGINT is right whatever timestamp mapping the format uses.
        ({"type": "long", "logicalType": "timestamp-millis"}, "BIGINT NOT NULL"),
        # Flink's derived map schema has non-null values only for NOT NULL value types.
        (["null", {"type": "map", "values": "string"}], "MAP<STRING NOT NULL, STRING NOT NULL>"),
        ({"type": "map", "values": ["null", "long"]}, "MAP<STRING NOT NULL, BIGINT> NOT NULL"),
        ({"type": "array", "items": "int"}, "ARRAY<INT NOT NULL> NOT NULL"),
    ],
)
def test_type_mapping(avro_type: Any, flink: str) -> None:
    assert ff.flink_type(avro_type) == flink


@pytest.mark.parametrize(
    "avro_type",
    [
        ["string", "null"],  # Flink derives ["null", X]: the branch indexes would be swapped
        ["null", "string", "long"],
        {"type": "record", "name": "R", "fields": []},
        {"type": "enum", "name": "E", "symbols": ["A"]},
        {"type": "fixed", "name": "F", "size": 16},
        {"type": "int", "logicalType": "date"},
        "null",
    ],
)
def test_types_flink_would_encode_differently_are_refused(avro_type: Any) -> None:
    with pytest.raises(ValueError):
        ff.flink_type(avro_type)


def _args(*extra: str) -> Any:
    return ff.parse_args(["--bootstrap-servers", "k:9092", "--topic", "flows", *extra])


def _ddl_columns(ddl: str) -> list[str]:
    """Physical column names of a CREATE TABLE, in order (computed column and watermark left out)."""
    body = ddl.split("(\n", 1)[1].split("\n) WITH", 1)[0]
    return [line.strip().split("`")[1] for line in body.splitlines() if line.strip().startswith("`")]


def test_bare_avro_table_is_the_whole_schema_in_order() -> None:
    ddl = ff.source_ddl(SCHEMA, _args("--bounded"))
    assert _ddl_columns(ddl) == [f["name"] for f in SCHEMA["fields"]]
    for field in SCHEMA["fields"]:
        assert f"`{field['name']}` {_expected(field['type'])}," in ddl
    assert "'value.format' = 'avro'" in ddl
    assert "'scan.bounded.mode' = 'latest-offset'" in ddl
    assert "event_time AS TO_TIMESTAMP_LTZ(`exportTime`, 3)" in ddl
    assert "WATERMARK FOR event_time AS event_time - INTERVAL '60' SECOND" in ddl


def test_registry_table_declares_only_the_used_fields_in_schema_order() -> None:
    ddl = ff.source_ddl(
        SCHEMA, _args("--schema-registry", "http://reg:8081", "--registry-basic-auth", "u:p", "--event-time", "flowEnd")
    )
    assert _ddl_columns(ddl) == [f["name"] for f in SCHEMA["fields"] if f["name"] in ff.USED_FIELDS]
    assert "'value.format' = 'avro-confluent'" in ddl
    assert "'value.avro-confluent.url' = 'http://reg:8081'" in ddl
    assert "'value.avro-confluent.basic-auth.user-info' = 'u:p'" in ddl
    assert "TO_TIMESTAMP_LTZ(`flowEnd`, 3)" in ddl
    assert "scan.bounded.mode" not in ddl


def test_used_fields_exist_in_the_schema() -> None:
    assert ff.USED_FIELDS.issubset(f["name"] for f in SCHEMA["fields"])


def test_sasl_uses_the_login_module_shaded_in_the_kafka_connector() -> None:
    args = _args("--security-protocol", "SASL_SSL", "--sasl-username", "alice", "--ssl-ca-location", "ca.pem")
    props = ff.kafka_properties(args, 'p"w')
    assert props["properties.sasl.jaas.config"] == (
        "org.apache.flink.kafka.shaded.org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="alice" password="p\\"w";'
    )
    assert props["properties.sasl.mechanism"] == "SCRAM-SHA-512"
    assert props["properties.ssl.truststore.type"] == "PEM"
    plain = _args("--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "PLAIN", "--sasl-username", "a")
    assert ".plain.PlainLoginModule required" in ff.kafka_properties(plain, "x")["properties.sasl.jaas.config"]


def test_the_password_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOW_SASL_PASSWORD", "s3cret")
    args = _args("--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "alice")
    assert ff.check_args(args) == "s3cret"


@pytest.mark.parametrize(
    "argv",
    [
        ["--window", "0"],
        ["--security-protocol", "SASL_PLAINTEXT"],
        ["--sasl-username", "a"],
        ["--registry-basic-auth", "u:p"],
        ["--schema-registry", "reg:8081"],
        ["--ssl-ca-location", "ca.pem"],
        ["--markers-topic", "markers"],  # window_completeness is batch-only for now
        ["--restarts", "-1"],
        ["--checkpoint-interval", "0"],
        ["--bounded", "--checkpoint", "file:///tmp/c"],  # a batch run takes no checkpoints
    ],
)
def test_bad_combinations_exit_2(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.delenv("FLOW_SASL_PASSWORD", raising=False)
    assert ff.main(["--bootstrap-servers", "k:9092", "--topic", "flows", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flink_flows.py: error: ") and err.count("\n") == 1


def test_views_apply_the_contract() -> None:
    views = ff.view_statements(60, 5)
    assert list(views)[-1] == "connection_totals"
    assert "WHERE NOT (flowType = 2 AND reporter = 2)" in views["flows"]
    assert "GROUP BY window_start, window_end, `exporterNode`, `connectionId`, `sequence`" in views["records_by_window"]
    assert "INTERVAL '60' SECOND" in views["records_by_window"]
    assert "`rank` <= 5" in views["top_talkers"]
    assert "GROUP BY connectionId, exporterNode," in views["connection_totals"]
    assert "GROUP BY connectionId, exporterNode," in views["distinct_records"]


def test_a_connection_id_of_two_nodes_is_two_connections() -> None:
    """Two exporters' connectionIds may collide (by chance, a run of them at once): every per-record
    and per-connection key carries exporterNode, so the same (connectionId, sequence) from two nodes
    is two records, even with the same window and groups."""
    views = ff.view_statements(60, 5)
    dedup = views["records_by_window"].split("GROUP BY ", 1)[1].split(", ")
    assert {"`exporterNode`", "`connectionId`", "`sequence`"} <= set(dedup)
    for view in ("distinct_records", "connection_totals"):
        keys = views[view].split("GROUP BY ", 1)[1].split(", ")
        assert {"exporterNode", "connectionId"} <= set(keys), view


def test_window_tables_estimate_from_each_connections_probability() -> None:
    """The estimates are sums over per-connection rows of count / p, with (1 - p) / p^2 * count^2 under the
    root: the contract's SQL, which the Spark job evaluates too."""
    views = ff.view_statements(60, 5)
    assert "samplingProbability AS p" in views["flows"]
    for table in ("flows_by_window", "bytes_by_zone_pair"):
        sql = views[table]
        assert "SUM((forward_bytes + reverse_bytes + undirected_bytes) / (p)) AS estimated_bytes" in sql
        assert "SUM((forward_packets + reverse_packets + undirected_packets) / (p)) AS estimated_packets" in sql
        y = "(forward_bytes + reverse_bytes + undirected_bytes)"
        assert f"SQRT(SUM((1 - (p)) / ((p) * (p)) * CAST({y} AS DOUBLE) * {y})) AS bytes_se" in sql, table


def test_result_tables_have_the_contracts_columns() -> None:
    """Both jobs write contract.COLUMNS; the Flink sinks declare them in that order."""
    assert ff.TABLES == ("flows_by_window", "top_talkers", "bytes_by_zone_pair", "connection_totals")
    for table, columns in contract.COLUMNS.items():
        assert tuple(name for name, _ in ff._RESULT_COLUMNS[table]) == columns, table
    assert contract.COLUMNS["bytes_by_zone_pair"] == (
        "window_start",
        "window_end",
        "source_zone",
        "destination_zone",
        "packets",
        "bytes",
        "forward_packets",
        "forward_bytes",
        "reverse_packets",
        "reverse_bytes",
        "undirected_packets",
        "undirected_bytes",
        "estimated_packets",
        "estimated_bytes",
        "packets_se",
        "bytes_se",
    )


def test_zone_pairs_and_groups_come_from_the_deduplicated_records() -> None:
    views = ff.view_statements(60, 5)
    # One copy per (window, exporterNode, connectionId, sequence): the zones ride along like the groups.
    keys = (
        "window_start, window_end, `exporterNode`, `connectionId`, `sequence`, "
        "source, destination, source_zone, destination_zone"
    )
    assert f"GROUP BY {keys}" in views["records_by_window"]
    # Then one row per connection (the sampled unit) and groups in a window, which the window tables sum.
    per_connection = "GROUP BY window_start, window_end, `exporterNode`, `connectionId`, source, destination"
    assert per_connection in views["connections_by_window"]
    assert "FROM records_by_window" in views["connections_by_window"]
    zones = views["bytes_by_zone_pair"]
    assert "FROM connections_by_window" in zones
    assert "GROUP BY window_start, window_end, source_zone, destination_zone" in zones
    assert "sourceZone AS source_zone, destinationZone AS destination_zone" in views["flows"]
    # The groups are the contract's SQL, the text the Spark job evaluates too.
    assert f"{contract.SOURCE_GROUP} AS source" in views["flows"]
    assert f"{contract.DESTINATION_GROUP} AS destination" in views["flows"]
    # Older writers' records lack the owner and zone fields: the registry's reader schema gives them null.
    fields = {f["name"]: f for f in ff.reader_schema(SCHEMA, ff.USED_FIELDS)["fields"]}
    for name in (*contract.OWNER_FIELDS, *contract.ZONE_FIELDS):
        assert fields[name]["type"] == ["null", "string"] and fields[name]["default"] is None, name


def test_the_job_reads_the_repos_schemas() -> None:
    assert contract.schema_file(contract.MARKER_SCHEMA) == REPO / "schemas" / "completeness_marker.avsc"
    args = _args("--bounded", "--markers-topic", "markers")
    assert args.schema == REPO / "schemas" / "flow_record.avsc"
    assert args.marker_schema == REPO / "schemas" / "completeness_marker.avsc"


def test_markers_table_is_the_whole_marker_schema_in_order() -> None:
    """Markers are bare Avro: a column out of order or of another type would misread every marker."""
    args = _args("--bounded", "--markers-topic", "markers", "--starting-offsets", "latest")
    assert ff.check_args(args) is None
    ddl = ff.markers_ddl(MARKER_SCHEMA, args)
    assert ddl.startswith("CREATE TEMPORARY TABLE completeness_markers (\n")
    assert _ddl_columns(ddl) == [f["name"] for f in MARKER_SCHEMA["fields"]]
    for field in MARKER_SCHEMA["fields"]:
        assert f"`{field['name']}` {_expected(field['type'])}" in ddl
    assert "`since` BIGINT NOT NULL" in ddl and "`upTo` BIGINT NOT NULL" in ddl
    assert "'topic' = 'markers'" in ddl
    assert "'value.format' = 'avro'" in ddl
    # From the start of the topic whatever --starting-offsets says; bounded like the flow topic.
    assert "'scan.startup.mode' = 'earliest-offset'" in ddl
    assert "'scan.bounded.mode' = 'latest-offset'" in ddl
    assert "WATERMARK" not in ddl


def test_markers_table_uses_the_flow_topics_kafka_security() -> None:
    args = _args(
        "--bounded",
        "--markers-topic",
        "markers",
        "--security-protocol",
        "SASL_PLAINTEXT",
        "--sasl-username",
        "alice",
        "--schema-registry",
        "http://reg:8081",
    )
    ddl = ff.markers_ddl(MARKER_SCHEMA, args, "pw")
    for key, value in ff.kafka_properties(args, "pw").items():
        assert f"'{key}' = '{value}'" in ddl
    assert "'value.format' = 'avro'" in ddl  # never Confluent-framed, even with a registry for the flows
    assert "avro-confluent" not in ddl


def test_window_completeness_columns() -> None:
    assert [name for name, _ in ff._RESULT_COLUMNS["window_completeness"]] == [
        "window_start",
        "window_end",
        "exporters",
        "confirmed_exporters",
        "lossy_exporters",
        "losses",
        "status",
    ]
    assert "window_completeness" not in ff.TABLES  # added only with --markers-topic


def test_completeness_views_apply_the_marker_rules() -> None:
    views = ff.completeness_statements()
    assert list(views)[-1] == "window_completeness"
    assert "FROM flows_by_window" in views["completeness_windows"]
    # Per-partition copies of an interval are one interval.
    assert "GROUP BY exporterNode, `since`, `until`" in views["marker_intervals"]
    assert "MAX(eventLosses + connectionsGivenUp + recordsGivenUp + mapFullReads)" in views["marker_intervals"]
    # Marker times converted as event time is (TO_TIMESTAMP_LTZ, then the UTC session zone).
    assert "CAST(TO_TIMESTAMP_LTZ(`since`, 3) AS TIMESTAMP(3))" in views["marker_intervals"]
    assert "CAST(TO_TIMESTAMP_LTZ(MAX(upTo), 3) AS TIMESTAMP(3))" in views["marker_progress"]
    exporters = views["window_exporters"]
    assert "i.since_time < w.window_end AND i.until_time > w.window_start" in exporters
    assert "p.up_to >= w.window_start" in exporters
    assert "p.up_to >= e.window_end" in exporters
    # Every window of flows_by_window gets a row, with or without markers.
    assert "LEFT JOIN window_exporters" in views["window_completeness_counts"]
    status = views["window_completeness"]
    assert status.index("'lossy'") < status.index("'complete'") < status.index("'unconfirmed'")
    assert "exporters > 0 AND confirmed_exporters = exporters" in status
    assert not set(views) & set(ff.view_statements(60, 5))  # no view is redefined
