"""Schema Registry framing: byte-identical to confluent-kafka's AvroSerializer, registration retried.

No real registry can be run here (Confluent's is not on Maven Central, and Apicurio's app
modules there are incomplete), so the registry is confluent-kafka's own in-memory one
(``mock://``), shared by our code and by the reference serializer. The HTTP path of the
real client (basic auth, the compatibility PUT, HTTP 409) is checked against a small stub
server that answers those three calls the way the registry's REST API documents them.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from typing import Any

import pytest
from confluent_kafka.schema_registry import record_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer
from hypothesis import given, settings

from bench.bench_export import synthetic_exports
from flow_exporter.commands import ValueDecoder
from flow_exporter.config import ConfigError, load, this_node
from flow_exporter.flow import Export
from flow_exporter.runner import build_sink
from flow_exporter.sink import registry
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.sink.registry import RECORD_SUBJECT, RegistryError, framed, register, split_header
from tests.support.cli import EXPORT_MS, NODE
from tests.support.reference import build_record
from tests.support.schema_registry import (
    CTX,
    INCOMPATIBLE,
    SCHEMA_TEXT,
    StubRegistry,
    closed_port,
    mock_client,
    reference,
)
from tests.support.strategies import exports as any_export

_CLIENT = mock_client()
_ID = register(_CLIENT, RECORD_SUBJECT, SCHEMA_TEXT)
_REFERENCE = reference(_CLIENT)
_ENCODE = framed(RecordEncoder(NODE).encode, _ID)


# ----------------------------------------------------------- byte identity
@settings(max_examples=400, deadline=None)
@given(any_export())
def test_framed_values_equal_the_confluent_serializer(export: Export) -> None:
    """Any export: header + hand-written body == AvroSerializer(build_record(...))."""
    ms = 1_700_000_000_000
    want = _REFERENCE(build_record(export, NODE, ms), CTX)  # first: encoding lets go of export.conn
    assert _ENCODE(export, ms) == want


def test_header_layout_and_deserializer() -> None:
    client = mock_client()
    client.register_schema("other-subject", registry_schema('{"type": "string"}'))  # so ours is not id 1
    schema_id = register(client, RECORD_SUBJECT, SCHEMA_TEXT)
    assert schema_id == 2
    encode = framed(RecordEncoder(NODE).encode, schema_id)
    deser = AvroDeserializer(client)
    for e in synthetic_exports(20):
        want = build_record(e, NODE, EXPORT_MS)  # first: encoding lets go of e.conn (its prefix holds it)
        value = encode(e, EXPORT_MS)
        assert value[0] == 0 and int.from_bytes(value[1:5], "big") == schema_id
        assert split_header(value) == (schema_id, RecordEncoder(NODE).encode(e, EXPORT_MS))
        got = deser(value, CTX)
        for name in ("flowStart", "flowEnd", "exportTime"):
            got[name] = round(got[name].timestamp() * 1000)
        assert got == want
    assert registry.header(0x01020304) == b"\x00\x01\x02\x03\x04"
    with pytest.raises(ValueError):
        registry.header(2**32)


def test_subjects_follow_the_topic_name_strategy_by_default() -> None:
    """``<topic>-value`` per topic (Confluent's TopicNameStrategy); ``record``: the schema's full name."""
    from confluent_kafka.schema_registry import topic_subject_name_strategy
    from confluent_kafka.serialization import MessageField, SerializationContext

    topics = ["flows", "flows-ended", "flows"]
    default = registry.subjects(load(environ={}), topics)
    assert default == {
        t: topic_subject_name_strategy(SerializationContext(t, MessageField.VALUE), "ignored") for t in topics
    }
    assert default == {"flows": "flows-value", "flows-ended": "flows-ended-value"}
    record = registry.subjects(load(environ={}, overrides={"schemaRegistry.subjectNameStrategy": "RECORD"}), topics)
    assert record == {t: record_subject_name_strategy(CTX, "io.flowexporter.FlowRecord") for t in topics}
    assert f"{json.loads(SCHEMA_TEXT)['namespace']}.{json.loads(SCHEMA_TEXT)['name']}" == RECORD_SUBJECT
    fixed = registry.subjects(load(environ={}, overrides={"schemaRegistry.subject": "flows-all"}), topics)
    assert fixed == {"flows": "flows-all", "flows-ended": "flows-all"}
    assert load(environ={}).schema_registry.compatibility == "BACKWARD_TRANSITIVE"


def test_framing_registers_a_subject_per_topic_and_frames_with_its_id() -> None:
    """Confluent gives one schema one id across subjects; a registry that numbers per subject
    (confluent-kafka's mock does) still gets each topic's own id in its values."""
    from devtools.registry import RegistryServer

    cfg = load(environ={}, overrides={"schemaRegistry.url": "http://127.0.0.1:9", "kafka.topic": "flows"})
    e = synthetic_exports(1)[0]
    with RegistryServer() as server:
        server.register("flows-value", '{"type": "string"}')  # so ours is not id 1
        client = registry.make_client(server.url)
        framing = registry.with_registry(cfg, RecordEncoder(NODE).encode, ["flows", "other"], client)
        assert isinstance(framing, registry.RegistryFraming) and framing.register()
        assert sorted(server.subjects) == ["flows-value", "other-value"]
        assert framing.schema_ids == {"flows": 2, "other": 2} and framing.schema_id == 2
        e.topic = "other"
        assert split_header(framing(e, EXPORT_MS)) == (2, RecordEncoder(NODE).encode(e, EXPORT_MS))

    client = mock_client()
    client.register_schema("flows-value", registry_schema('{"type": "string"}'))
    framing = registry.with_registry(cfg, RecordEncoder(NODE).encode, ["flows", "other"], client)
    assert isinstance(framing, registry.RegistryFraming) and framing.register()
    for topic in ("flows", "other"):
        e.topic = topic
        expected = client.lookup_schema(f"{topic}-value", registry_schema(SCHEMA_TEXT.strip())).schema_id
        assert split_header(framing(e, EXPORT_MS))[0] == expected
    e.topic = "unknown"
    if framing.schema_id is None:  # ids differ: the record's topic must have one
        with pytest.raises(RegistryError, match="unknown"):
            framing(e, EXPORT_MS)


# ----------------------------------------------------------- sink and tail
def test_build_sink_without_registry_stays_bare() -> None:
    cfg = load(environ={}, overrides={"kafka.bootstrapServers": "127.0.0.1:9", "kafka.producer": {"log_level": 0}})
    sink = build_sink(cfg)
    e = synthetic_exports(1)[0]
    assert sink.encode(e, EXPORT_MS) == RecordEncoder(this_node(cfg)).encode(e, EXPORT_MS)


def test_tail_reads_an_older_writer_schema_from_the_registry() -> None:
    """A framed value written with another schema version resolves into the current one."""
    import io

    import fastavro

    current = json.loads(SCHEMA_TEXT)
    older = dict(current, fields=[*reversed(current["fields"]), {"name": "legacy", "type": "string", "default": ""}])
    client = mock_client()
    older_id = client.register_schema("io.flowexporter.FlowRecord", registry_schema(json.dumps(older)))
    rec = build_record(synthetic_exports(1)[0], NODE, EXPORT_MS) | {"legacy": "gone"}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(older), rec)
    value = registry.header(older_id) + buf.getvalue()
    got, schema_id = ValueDecoder(registry=client).decode(value)
    assert schema_id == older_id and "legacy" not in got
    assert got["connectionId"] == rec["connectionId"] and got["reverseOctetDeltaCount"] == rec["reverseOctetDeltaCount"]
    # Without the registry the local schema is used, and the bytes do not fit it.
    with pytest.raises(ValueError):
        ValueDecoder().decode(value)


def registry_schema(text: str) -> Any:
    from confluent_kafka.schema_registry import Schema

    return Schema(text, "AVRO")


# --------------------------------------------------- failures and retries
def test_registry_down_is_a_clear_error_after_retries(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    client = registry.make_client(url)
    with caplog.at_level(logging.ERROR, logger="flow_exporter.sink.registry"), pytest.raises(RegistryError) as info:
        register(client, RECORD_SUBJECT, SCHEMA_TEXT, initial=0.01, maximum=0.02, max_attempts=3, url=url)
    message = str(info.value)
    assert RECORD_SUBJECT in message and url in message and "not reachable" in message
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 2 and all(RECORD_SUBJECT in m and "retry" in m for m in retries)


def test_stopping_ends_the_wait() -> None:
    """SIGTERM while the registry is down: the wait ends at once, and nothing is ever sent unframed."""
    url = f"http://127.0.0.1:{closed_port()}"
    cfg = load(environ={}, overrides={"schemaRegistry.url": url, "retry.initialBackoff": "5s"})
    encode = registry.with_registry(cfg, RecordEncoder(NODE).encode)
    e = synthetic_exports(1)[0]
    with pytest.raises(RegistryError, match="no schema id yet"):
        encode(e, EXPORT_MS)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    assert registry.ensure_registered(encode, stop) is False
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(RegistryError):
        encode(e, EXPORT_MS)


def test_with_registry_sets_compatibility_then_registers_with_basic_auth(stub: StubRegistry) -> None:
    cfg = load(
        environ={},
        overrides={
            "schemaRegistry.url": stub.url,
            "schemaRegistry.basicAuthUserInfo": "flows:s3cret",
            "nodeName": NODE,
        },
    )
    encode = registry.with_registry(cfg, RecordEncoder(NODE).encode)
    assert stub.requests == []  # nothing happens before the runner asks
    assert registry.ensure_registered(encode, threading.Event())
    e = synthetic_exports(1)[0]
    assert encode(e, EXPORT_MS) == b"\x00\x00\x00\x00\x07" + RecordEncoder(NODE).encode(e, EXPORT_MS)
    (put, put_path, put_body, auth), (post, post_path, post_body, _) = stub.requests
    subject = "flows-value"  # kafka.topic's default, by the topic name strategy
    assert (put, put_path, put_body) == ("PUT", f"/config/{subject}", {"compatibility": "BACKWARD_TRANSITIVE"})
    assert (post, post_path.split("?")[0]) == ("POST", f"/subjects/{subject}/versions")
    assert json.loads(post_body["schema"]) == json.loads(SCHEMA_TEXT)
    assert auth == "Basic " + base64.b64encode(b"flows:s3cret").decode()


def test_incompatible_schema_is_retried_and_named(stub: StubRegistry, caplog: pytest.LogCaptureFixture) -> None:
    stub.answers = [INCOMPATIBLE, INCOMPATIBLE]
    client = registry.make_client(stub.url)
    with caplog.at_level(logging.ERROR, logger="flow_exporter.sink.registry"):
        schema_id = register(client, "flows-subject", SCHEMA_TEXT, initial=0.01, maximum=0.02, url=stub.url)
    assert schema_id == 7
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 2
    assert all("'flows-subject'" in m and "incompatible" in m and "HTTP 409" in m for m in errors)


def test_incompatible_schema_for_good_is_an_error(stub: StubRegistry) -> None:
    stub.answers = [INCOMPATIBLE] * 3
    with pytest.raises(RegistryError, match=r"subject 'flows-subject'.*incompatible.*409"):
        register(registry.make_client(stub.url), "flows-subject", SCHEMA_TEXT, initial=0.01, max_attempts=3)


def test_compatibility_refused_keeps_registering(stub: StubRegistry, caplog: pytest.LogCaptureFixture) -> None:
    stub.config_status = 403
    with caplog.at_level(logging.WARNING, logger="flow_exporter.sink.registry"):
        assert register(registry.make_client(stub.url), "s", SCHEMA_TEXT, max_attempts=1) == 7
    assert any("cannot set compatibility" in r.getMessage() for r in caplog.records)
    stub.requests.clear()
    assert register(registry.make_client(stub.url), "s", SCHEMA_TEXT, compatibility=None) == 7
    assert [r[0] for r in stub.requests] == ["POST"]  # empty level: the subject's is left alone


# ----------------------------------------------------------------- config
def test_registry_settings() -> None:
    env = {
        "FLOW_EXPORTER_SCHEMA_REGISTRY_URL": "https://registry.example:8081",
        "FLOW_EXPORTER_SCHEMA_REGISTRY_SUBJECT": "flows-value",
        "FLOW_EXPORTER_SCHEMA_REGISTRY_SUBJECT_NAME_STRATEGY": "record",
        "FLOW_EXPORTER_SCHEMA_REGISTRY_COMPATIBILITY": "full_transitive",
        "FLOW_EXPORTER_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO": "user:pw",
    }
    cfg = load(environ=env)
    assert cfg.schema_registry.url == "https://registry.example:8081"
    assert cfg.schema_registry.subject == "flows-value"
    assert cfg.schema_registry.subject_name_strategy == "record"
    assert load(environ={}, overrides={"schemaRegistry.subject": ""}).schema_registry.subject is None
    assert cfg.schema_registry.compatibility == "FULL_TRANSITIVE"
    assert cfg.masked()["schemaRegistry.basicAuthUserInfo"] == "***"
    assert "user:pw" not in repr(cfg)
    assert load(environ={}).schema_registry.url is None
    assert load(environ={}, overrides={"schemaRegistry.compatibility": ""}).schema_registry.compatibility is None
    for key, bad in (
        ("schemaRegistry.url", "registry:8081"),
        ("schemaRegistry.compatibility", "SOMETIMES"),
        ("schemaRegistry.subject", " "),
        ("schemaRegistry.subjectNameStrategy", "topicname"),
    ):
        with pytest.raises(ConfigError) as info:
            load(environ={}, overrides={key: bad})
        assert info.value.key == key
    with pytest.raises(ConfigError) as info:
        load(environ={}, overrides={"schemaRegistry.basicAuthUserInfo": "no-colon-secret"})
    assert "no-colon-secret" not in str(info.value) and "***" in str(info.value)


def test_config_print_masks_the_user_info(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from flow_exporter.cli import main

    monkeypatch.setenv("FLOW_EXPORTER_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO", "flows:hunter2")
    assert main(["config", "--print"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and json.loads(out)["schemaRegistry.basicAuthUserInfo"] == "***"


def test_safe_url_hides_credentials() -> None:
    assert registry.safe_url("https://u:p@reg.example:8081/x,http://b:1") == "https://***@reg.example:8081/x,http://b:1"
