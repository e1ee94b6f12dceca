"""A FlowRecord's bytes (flow_exporter/record_bytes.py): the compiled build against the interpreted one.

On the same batch of records, ``RecordEncoder.prepare_all`` of the compiled build and of the interpreted
build of the same source give every record the same value, key, topic, export time and cached prefix,
and fail the same records with the same errors; ``Checkpoint.sent`` and ``delivered`` write the same
journal bytes with either build of ``checkpoint_rows``. (Both builds are held to fastavro's bytes in
tests/unit/test_encoder.py.) The batches mix generated records
with hostile ones: integers past 64 bits, negative values, reasons and TCP states out of range, missing keys,
prefixes that cannot be built, records prepared before, resends, odd topics.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flow_exporter import checkpoint, compiled
from flow_exporter.checkpoint import Checkpoint
from flow_exporter.flow import ROW_ENDED, ROW_GIVEN_UP, Export
from tests.support.strategies import exports

BUILT = compiled.load("record_bytes")
INTERPRETED = compiled.interpreted("record_bytes", as_name="tests_interpreted_record_bytes")

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# (field, value): each makes one record something both builds must encode alike, or fail alike.
Change = tuple[str, Any]
HOSTILE: list[Change] = [
    ("sequence", -1),
    ("sequence", 2**63),
    ("sequence", 2**64 - 1),
    ("sequence", 2**64),
    ("totals", (2**63, 0, 0, 0)),
    ("totals", (0, -5, 0, 0)),
    ("totals", (0, 0, 2**64, 1)),
    ("totals", (1, 2, 3)),
    ("deltas", (0, 0, 0, 2**70)),
    ("deltas", [1, 2, 3, 4]),
    ("reason", 0),
    ("reason", 63),
    ("reason", 64),
    ("reason", -1),
    ("reason", True),
    ("tcp_state", -1),
    ("tcp_state", 10),
    ("tcp_state", 2**70),
    ("tcp_state", "ESTABLISHED"),
    ("tcp_state", 3),  # on any protocol: named only for TCP
    ("flow_end_ns", -(10**15) - 1),
    ("flow_end_ns", 2**64),
    ("flow_end_ns", None),
    ("first_seen_ns", 2**63),
    ("conn_key", None),
    ("flow_id", 2**63),
    ("ct_id", -1),
    ("start_ns", -1),
    ("flags", 2**40 + 7),
    ("flags", -1),
    ("flags", 0x35),  # only the low four bits are record flags
    ("row_kind", ROW_ENDED),
    ("row_kind", ROW_GIVEN_UP | ROW_ENDED),
    ("row_kind", 256),
    ("ended", 2),
    ("ended", True),
    ("attempts", 1),
    ("topic", "flows-ü"),
    ("topic", None),
    ("value", b"prepared before"),
    ("key", b"k" * 70000),
]


def pairs(e: Export) -> list[list[Change]]:
    """Two changes at once: an end before the epoch and a first-seen before it too (floor division)."""
    return [[("flow_end_ns", -(10**15) - 1), ("first_seen_ns", -3)], [("flow_end_ns", -1), ("first_seen_ns", -5)]]


def keys(e: Export) -> list[Change]:
    """Odd connection keys: a port or protocol out of range, addresses of two lengths, a wrong shape."""
    assert e.conn_key is not None
    zone, proto, src, sport, dst, dport = e.conn_key
    return [
        ("conn_key", (zone, proto, src, 70000, dst, dport)),
        ("conn_key", (zone, 300, src, sport, dst, dport)),
        ("conn_key", (zone, proto, src, sport, dst + b"\x00", dport)),
        ("conn_key", (zone, proto, src, sport, dst[:1], dport)),
        ("conn_key", (zone, proto, src, sport, src, sport)),
        ("conn_key", (2**20, proto, src, sport, dst, dport)),
        ("conn_key", (zone, proto, src)),
        ("conn_key", (zone, 6, src, sport, dst, dport)),
    ]


@st.composite
def batches(draw: st.DrawFn) -> list[Export]:
    """Records as the store builds them, some with their prefix cached, at most one made hostile.

    One: a hostile record that makes the whole journal batch raise would hide the others.
    """
    out = draw(st.lists(exports(), min_size=1, max_size=8))
    encoder = INTERPRETED.RecordEncoder("cache")
    for e in out:
        if draw(st.booleans()):
            encoder.static(e)  # the store's cached prefix
    e = out[draw(st.integers(0, len(out) - 1))]
    how = draw(st.integers(0, 9))
    if how == 0:
        e.prefix = None
        e.conn = None  # no prefix and nothing to build it from: static() fails, the record is given up
    elif how <= 7:
        apply(e, draw(st.sampled_from(changes(e))))
    return out


def changes(e: Export) -> list[list[Change]]:
    return [[c] for c in HOSTILE + keys(e)] + pairs(e)


def apply(e: Export, change: list[Change]) -> None:
    for name, value in change:
        setattr(e, name, value)


# Every hostile change, each on its own (the random batches above may draw some rarely).
EVERY = range(len(HOSTILE) + 8 + 2)


def copy(batch: list[Export]) -> list[Export]:
    return [replace(e) for e in batch]


def outcome(batch: list[Export], failures: list[tuple[Export, Exception]]) -> tuple[Any, ...]:
    index = {id(e): i for i, e in enumerate(batch)}
    return (
        [(e.value, e.key, e.topic, e.export_ms, e.prefix) for e in batch],
        [(index[id(e)], type(exc), str(exc)) for e, exc in failures],
    )


def test_the_built_module_is_compiled() -> None:
    if compiled.forced_interpreted():
        pytest.skip("FLOW_EXPORTER_INTERPRETED is set: this run is the interpreted build's")
    assert compiled.is_compiled(BUILT), BUILT.__file__
    assert not compiled.is_compiled(INTERPRETED)


@SETTINGS
@given(
    batches(),
    st.integers(0, 2**45) | st.sampled_from([-1, 2**63 - 1]),
    st.none() | st.sampled_from(["flows", "flows-é"]),
    st.sampled_from([b"", b"\x00\x00\x00\x00\x07"]),
    st.sampled_from(["node-a", "ñode"]),
)
def test_prepare_all_equals_interpreted(
    batch: list[Export], export_ms: int, topic: str | None, framing: bytes, node: str
) -> None:
    pure, fast = copy(batch), copy(batch)
    want = INTERPRETED.RecordEncoder(node, 7, "c1").prepare_all(pure, export_ms, topic, framing)
    got = BUILT.RecordEncoder(node, 7, "c1").prepare_all(fast, export_ms, topic, framing)
    assert outcome(fast, got) == outcome(pure, want)


@settings(max_examples=20, deadline=None)
@given(exports())
def test_a_record_past_64_bits_fails_alike(e: Export) -> None:
    """An Avro long is 64 bits: a value past them is no record (both builds refuse it, with one error)."""
    e.sequence = 2**64
    for build in (INTERPRETED, BUILT):
        batch = copy([e])
        ((failed, exc),) = build.RecordEncoder("n").prepare_all(batch, 5, "t")
        assert failed is batch[0] and failed.value is None
        assert (type(exc), str(exc)) == (OverflowError, f"{2**64} does not fit 64 signed bits")


@settings(max_examples=5, deadline=None)
@given(exports())
def test_keyboard_interrupt_is_not_a_failed_record(e: Export) -> None:
    """Only an Exception fails a record; an interrupt stops the batch as it would in Python."""

    def interrupting(export: Export, export_ms: int) -> bytes:
        raise KeyboardInterrupt

    for build in (INTERPRETED, BUILT):
        with pytest.raises(KeyboardInterrupt):
            build.prepare(interrupting, copy([e]), 5, "t")


ROWS = {  # checkpoint_rows' two builds (one source): the journal's bytes
    True: compiled.load("checkpoint_rows"),
    False: compiled.interpreted("checkpoint_rows", as_name="tests_interpreted_checkpoint_rows"),
}


def journal(tmp: Path, compiled_path: bool, batch: list[Export]) -> tuple[list[bytes], BaseException | None]:
    """What ``sent`` writes to the journal (after the snapshot that starts it), or the error it raises."""
    with mock.patch.object(checkpoint, "_rows", ROWS[compiled_path]):
        return _journal(tmp, batch)


def _journal(tmp: Path, batch: list[Export]) -> tuple[list[bytes], BaseException | None]:
    written: list[bytes] = []

    def write(fd: int, data: bytes) -> int:
        if fd == cp._journal:
            written.append(bytes(data))
        return os.write(fd, data)

    cp = Checkpoint(tmp, boot=b"b" * 16, write=write)
    assert cp.lock()
    cp.begin(cp.load())
    written.clear()
    try:
        cp.sent(batch)
        cp.delivered(batch)
    except Exception as exc:  # the pure packer's errors: the compiled path must raise the same
        return written, exc
    finally:
        cp.close()
    return written, None


@SETTINGS
@given(batches(), st.booleans())
def test_journal_rows_equal_interpreted(
    tmp_path_factory: pytest.TempPathFactory, batch: list[Export], encode: bool
) -> None:
    if encode:
        INTERPRETED.RecordEncoder("n").prepare_all(batch, 1, "flows")
    pure_bytes, pure_err = journal(tmp_path_factory.mktemp("pure"), False, copy(batch))
    fast_bytes, fast_err = journal(tmp_path_factory.mktemp("fast"), True, copy(batch))
    assert fast_bytes == pure_bytes
    assert (type(fast_err), str(fast_err)) == (type(pure_err), str(pure_err))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(exports(), min_size=1, max_size=3), st.booleans())
@pytest.mark.parametrize("which", EVERY)
def test_every_hostile_change_prepares_and_journals_alike(
    tmp_path_factory: pytest.TempPathFactory, which: int, batch: list[Export], cached: bool
) -> None:
    if cached:
        INTERPRETED.RecordEncoder("cache").static(batch[0])
    all_changes = changes(batch[-1])
    assert len(all_changes) == len(EVERY)
    apply(batch[-1], all_changes[which])
    pure, fast = copy(batch), copy(batch)
    want = INTERPRETED.RecordEncoder("n").prepare_all(pure, 3, "flows")
    got = BUILT.RecordEncoder("n").prepare_all(fast, 3, "flows")
    assert outcome(fast, got) == outcome(pure, want)
    for sent in (batch, pure):  # unprepared, and prepared
        pure_bytes, pure_err = journal(tmp_path_factory.mktemp("pure"), False, copy(sent))
        fast_bytes, fast_err = journal(tmp_path_factory.mktemp("fast"), True, copy(sent))
        assert fast_bytes == pure_bytes
        assert (type(fast_err), str(fast_err)) == (type(pure_err), str(pure_err))
