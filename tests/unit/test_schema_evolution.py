"""Every version of schemas/flow_record.avsc reads the records every earlier version wrote.

Consumers decode with the newest schema while the topic still holds records of older
ones (and a registry subject is kept BACKWARD_TRANSITIVE for the same reason), so a schema
change that breaks Avro schema resolution must fail here, before it reaches them. The
versions are the file's commits plus the working tree when it differs from HEAD; random
records are generated for each writer schema and read with each later reader schema, by
fastavro and by the ``avro`` package, and the ``avro`` package's compatibility checker
must agree.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import zlib
from datetime import datetime
from typing import Any

import avro.io
import avro.schema
import fastavro
import pytest
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType
from fastavro.read import SchemaResolutionError

from tests.support.paths import REPO

SCHEMA = "schemas/flow_record.avsc"
RECORDS_PER_PAIR = 200


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def schema_versions() -> list[tuple[str, str]]:
    """``(label, schema text)`` oldest first: each commit of the file, then the working tree if changed."""
    try:
        revs = _git("log", "--format=%H", "--", SCHEMA).split()
    except (OSError, subprocess.CalledProcessError):
        revs = []
    versions = [(rev[:7], _git("show", f"{rev}:{SCHEMA}")) for rev in reversed(revs)]
    current = (REPO / SCHEMA).read_text()
    if not versions or json.loads(versions[-1][1]) != json.loads(current):
        versions.append(("worktree", current))
    return versions


VERSIONS = schema_versions()
PAIRS = [(VERSIONS[i], VERSIONS[j]) for i in range(len(VERSIONS)) for j in range(i, len(VERSIONS))]


# ------------------------------------------------------- records for any schema
_INT = (-(2**31), -1, 0, 1, 63, 64, 8191, 8192, 2**31 - 1)
_LONG = (*_INT, -(2**63), 2**63 - 1, 2**35)
_TEXT = ("", "a", "é", "10.0.0.1", "fe80::1", "kube-system/coredns:53/UDP", "名前", "x" * 300)


def random_datum(schema: Any, rng: random.Random, named: dict[str, Any]) -> Any:
    """A value valid for ``schema`` (parsed JSON): edge values mixed with random ones."""
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, list):
        return random_datum(rng.choice(schema), rng, named)
    if isinstance(schema, dict):
        t = schema["type"]
        if t in ("record", "error"):
            named[schema["name"]] = schema
            if "namespace" in schema:
                named[f"{schema['namespace']}.{schema['name']}"] = schema
            return {f["name"]: random_datum(f["type"], rng, named) for f in schema["fields"]}
        if t == "enum":
            named[schema["name"]] = schema
            return rng.choice(schema["symbols"])
        if t == "fixed":
            named[schema["name"]] = schema
            return rng.randbytes(schema["size"])
        if t == "array":
            return [random_datum(schema["items"], rng, named) for _ in range(rng.randint(0, 3))]
        if t == "map":
            return {
                rng.choice(_TEXT) + str(i): random_datum(schema["values"], rng, named) for i in range(rng.randint(0, 3))
            }
        if schema.get("logicalType") in ("timestamp-millis", "timestamp-micros", "local-timestamp-millis"):
            # Within years 1970-2100, where the readers' datetime conversion is defined.
            scale = 1000 if schema["logicalType"] == "timestamp-micros" else 1
            return rng.randint(0, 4_102_444_800_000) * scale
        if schema.get("logicalType") == "date":
            return rng.randint(0, 47_482)
        return random_datum(t, rng, named)
    if schema == "null":
        return None
    if schema == "boolean":
        return rng.random() < 0.5
    if schema == "int":
        return rng.choice(_INT) if rng.random() < 0.3 else rng.randint(-(2**31), 2**31 - 1)
    if schema == "long":
        return rng.choice(_LONG) if rng.random() < 0.3 else rng.randint(-(2**40), 2**40)
    if schema in ("float", "double"):
        return rng.choice((0.0, -1.5, 1e10)) if rng.random() < 0.3 else rng.uniform(-1e6, 1e6)
    if schema == "bytes":
        return rng.randbytes(rng.choice((0, 1, 16, 40)))
    if schema == "string":
        return rng.choice(_TEXT) if rng.random() < 0.5 else "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(8))
    raise AssertionError(f"no generator for {schema!r}")


def _fields(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in schema["fields"]}


def _writer_name(reader_field: dict[str, Any], writer_fields: dict[str, Any]) -> str | None:
    for name in (reader_field["name"], *reader_field.get("aliases", ())):
        if name in writer_fields:
            return name
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal after Avro's promotions (int to long/float/double, string to and from bytes)."""
    if isinstance(a, str) and isinstance(b, bytes):
        return a.encode() == b
    if isinstance(a, bytes) and isinstance(b, str):
        return a == b.encode()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= 1e-6 * max(1.0, abs(a))
    return a == b


def check_pair(writer_text: str, reader_text: str, seed: int, n: int = RECORDS_PER_PAIR) -> None:
    """Write ``n`` random records with the writer schema; read each with the reader schema, two ways."""
    writer_json, reader_json = json.loads(writer_text), json.loads(reader_text)
    writer, reader = fastavro.parse_schema(writer_json), fastavro.parse_schema(reader_json)
    avro_reader = avro.io.DatumReader(avro.schema.parse(writer_text), avro.schema.parse(reader_text))
    writer_fields, reader_fields = _fields(writer_json), _fields(reader_json)
    rng = random.Random(seed)
    for i in range(n):
        datum = random_datum(writer_json, rng, {})
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, writer, datum)
        data = buf.getvalue()
        as_written = fastavro.schemaless_reader(io.BytesIO(data), writer, writer)
        src = io.BytesIO(data)
        got = fastavro.schemaless_reader(src, writer, reader)
        assert src.tell() == len(data), f"record {i}: reader left {len(data) - src.tell()} bytes"
        for name, field in reader_fields.items():
            source = _writer_name(field, writer_fields)
            if source is not None:
                assert _same(got[name], as_written[source]), f"record {i}: field {name} changed in resolution"
            else:
                assert "default" in field, f"field {name} is new in the reader schema and has no default"
                assert _same(got[name], field["default"]), f"record {i}: new field {name} did not get its default"
        via_avro = avro_reader.read(avro.io.BinaryDecoder(io.BytesIO(data)))
        assert _same(_plain(via_avro), _plain(got)), f"record {i}: avro and fastavro disagree"


def _plain(v: Any) -> Any:
    """Datetimes as epoch milliseconds, so both libraries' timezone objects compare equal."""
    if isinstance(v, datetime):
        return round(v.timestamp() * 1000)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


# ------------------------------------------------------------------------ tests
def test_versions_found() -> None:
    assert VERSIONS, "no version of the schema"
    assert json.loads(VERSIONS[-1][1]) == json.loads((REPO / SCHEMA).read_text()), "newest version is the file's"


@pytest.mark.parametrize(("writer", "reader"), PAIRS, ids=[f"{w[0]}->{r[0]}" for w, r in PAIRS])
def test_newer_schema_reads_older_records(writer: tuple[str, str], reader: tuple[str, str]) -> None:
    checker = ReaderWriterCompatibilityChecker()
    result = checker.get_compatibility(avro.schema.parse(reader[1]), avro.schema.parse(writer[1]))
    assert result.compatibility is SchemaCompatibilityType.compatible, (
        f"schema {reader[0]} cannot read records of {writer[0]}: {result.messages}"
    )
    check_pair(writer[1], reader[1], seed=zlib.crc32(f"{writer[0]}->{reader[0]}".encode()))


def test_an_incompatible_change_is_caught() -> None:
    """The check above must fail for a breaking change: a new field without a default."""
    current = json.loads(VERSIONS[-1][1])
    broken = dict(current, fields=[*current["fields"], {"name": "newRequired", "type": "long"}])
    with pytest.raises(SchemaResolutionError, match="newRequired"):
        check_pair(VERSIONS[-1][1], json.dumps(broken), seed=1, n=1)
    result = ReaderWriterCompatibilityChecker().get_compatibility(
        avro.schema.parse(json.dumps(broken)), avro.schema.parse(VERSIONS[-1][1])
    )
    assert result.compatibility is SchemaCompatibilityType.incompatible


def test_a_new_optional_field_is_fine() -> None:
    """Adding a field with a default (the way to grow the schema) reads old records with the default."""
    current = json.loads(VERSIONS[-1][1])
    grown = dict(current, fields=[*current["fields"], {"name": "extra", "type": ["null", "string"], "default": None}])
    check_pair(VERSIONS[-1][1], json.dumps(grown), seed=2, n=20)
