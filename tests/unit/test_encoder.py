"""The hand-written Avro encoder writes exactly the bytes fastavro writes, for any record."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter.sink.encoder import RecordEncoder, zigzag_varint
from flow_exporter.store import Export
from tests.support.reference import AvroSerializer, build_record
from tests.support.strategies import exports

SER = AvroSerializer()


@settings(max_examples=600, deadline=None)
@given(exports(), st.text(min_size=1, max_size=30), st.integers(0, 2**45))
def test_encoder_is_byte_identical_to_fastavro(export: Export, node: str, export_ms: int) -> None:
    expected = SER(build_record(export, node, export_ms))
    enc = RecordEncoder(node)
    assert enc.encode(export, export_ms) == expected
    assert enc.encode(export, export_ms) == expected  # from the cached prefix
    assert SER.decode(expected)["connectionId"] == export.tracked.flow_id


@settings(max_examples=300, deadline=None)
@given(exports())
def test_cached_prefix_follows_mark_and_metadata_changes(export: Export) -> None:
    enc = RecordEncoder("n")
    enc.encode(export, 1)
    tr = export.tracked
    tr.conn.mark = (tr.conn.mark + 1) & 0xFFFFFFFF
    tr.meta = {"sourcePodName": "p", "flowType": 1}
    assert enc.encode(export, 1) == SER(build_record(export, "n", 1))
    tr.flags ^= 1
    assert enc.encode(export, 1) == SER(build_record(export, "n", 1))


@given(st.integers(-(2**63), 2**63 - 1))
def test_zigzag_matches_fastavro(n: int) -> None:
    import io

    import fastavro

    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, {"type": "long"}, n)
    assert zigzag_varint(n) == buf.getvalue()
