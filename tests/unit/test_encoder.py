"""The hand-written Avro encoder writes exactly the bytes fastavro writes, for any record."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter.flow import Export, NewConnection
from flow_exporter.sink.encoder import RecordEncoder, zigzag_varint
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.reference import AvroSerializer, build_record
from tests.support.store_builders import Clock, poll, tcp
from tests.support.strategies import exports

SER = AvroSerializer()


ATTRIBUTES = st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=20), max_size=4)
PROBABILITIES = st.sampled_from([1.0, 0.5, 1 / 16, 0.1, 2**-20])


@settings(max_examples=600, deadline=None)
@given(
    exports(), st.text(min_size=1, max_size=30), st.integers(0, 2**45), st.sampled_from(["", "prod-eu-1"]), ATTRIBUTES,
    PROBABILITIES,
)  # fmt: skip
def test_encoder_is_byte_identical_to_fastavro(
    export: Export, node: str, export_ms: int, cluster: str, attributes: dict[str, str], p: float
) -> None:
    expected = SER(build_record(export, node, export_ms, cluster, attributes, p))
    enc = RecordEncoder(node, cluster=cluster, attributes=attributes, sampling_probability=p)
    assert enc.encode(export, export_ms) == expected
    # A record in flight keeps its prefix, not the connection's fields (memory: every record in flight).
    assert export.prefix is not None and export.conn is None
    assert enc.encode(export, export_ms) == expected  # from the cached prefix
    assert SER.decode(expected)["connectionId"] == export.flow_id
    assert SER.decode(expected)["attributes"] == attributes
    assert SER.decode(expected)["samplingProbability"] == p


def test_store_keeps_the_prefix_while_active_and_drops_it_when_it_would_change() -> None:
    """The encoded prefix is cached by the store; a mark, labels or metadata change must not reuse it."""
    clock = Clock()
    handles: list[NewConnection] = []
    store = ConnectionStore(Timeouts(poll_interval=5, active=5, idle=15), on_new=handles.append)
    enc = RecordEncoder("n")

    cached: list[bool] = []

    def export_one(**kw: object) -> dict[str, object]:
        poll(store, clock, tcp(**kw))
        clock.tick(5)
        (e,) = store.expire(clock.now, clock.wall())
        cached.append(e.prefix is not None)
        rec = SER.decode(enc.encode(e, 1))
        store.acknowledge(e, True, clock.now)
        return rec

    assert export_one(packets=2, mark=1)["ctMark"] == 1
    rec = export_one(packets=3, mark=1)
    assert rec["sequence"] == 1 and rec["ctMark"] == 1 and rec["sourcePodName"] is None
    assert export_one(packets=4, mark=2)["ctMark"] == 2
    assert export_one(packets=5, mark=2, labels=bytes(range(16)))["ctLabels"] == bytes(range(16))
    (h,) = handles
    h.meta = {"sourcePodName": "p", "flowType": 1}  # a late enrichment
    rec = export_one(packets=6, mark=2, labels=bytes(range(16)))
    assert rec["sourcePodName"] == "p" and rec["flowType"] == 1 and rec["sequence"] == 4
    assert export_one(packets=7, mark=2, labels=bytes(range(16)))["sourcePodName"] == "p"
    assert cached == [False, True, False, False, False, True]


@given(st.integers(-(2**63), 2**63 - 1))
def test_zigzag_matches_fastavro(n: int) -> None:
    import io

    import fastavro

    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, {"type": "long"}, n)
    assert zigzag_varint(n) == buf.getvalue()
