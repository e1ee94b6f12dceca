"""A record on its way out (flow_exporter/export.py): the compiled and the interpreted build of the one source.

Compiled, ``Export`` is an extension type whose fields are struct members; interpreted, a dataclass. Code
outside the compiled loops uses it as a dataclass (made with positional and keyword arguments, compared,
copied, ``dataclasses.replace``d, its fields listed), so both builds must answer those the same way, and
``as_export`` (the check a compiled loop makes before it reads the members) must refuse the same objects.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled
from flow_exporter.flow import Export

BUILDS = {
    "built": compiled.load("export"),
    "interpreted": compiled.interpreted("export", as_name="tests_interpreted_export"),
}
REQUIRED = ("reason", "sequence", "totals", "deltas", "final", "flow_end_ns", "flow_id")
FIELDS = (
    *REQUIRED, "first_seen_ns", "conn_key", "ct_id", "start_ns", "flags", "ended", "tcp_state", "meta", "conn",
    "prefix", "slot", "epoch", "value", "topic", "key", "attempts", "export_ms", "row_kind",
)  # fmt: skip
DEFAULTS = {"first_seen_ns": 0, "conn_key": None, "ct_id": 0, "start_ns": 0, "flags": 0, "ended": False,
            "tcp_state": None, "meta": None, "conn": None, "prefix": None, "slot": -1, "epoch": 0, "value": None,
            "topic": None, "key": None, "attempts": 0, "export_ms": 0, "row_kind": 0}  # fmt: skip


def test_the_flow_module_hands_out_the_build_that_runs() -> None:
    assert Export is BUILDS["built"].Export
    assert compiled.is_compiled(BUILDS["built"]) == (compiled.COMPILED and not compiled.forced_interpreted())
    assert not compiled.is_compiled(BUILDS["interpreted"])


@pytest.mark.parametrize("build", list(BUILDS))
def test_fields_in_order_with_their_defaults(build: str) -> None:
    cls = BUILDS[build].Export
    assert tuple(f.name for f in dataclasses.fields(cls)) == FIELDS
    e = cls(2, 3, (1, 2, 3, 4), (0, 0, 0, 0), False, 10, 7)
    assert {name: getattr(e, name) for name in DEFAULTS} == DEFAULTS
    assert [getattr(e, name) for name in REQUIRED] == [2, 3, (1, 2, 3, 4), (0, 0, 0, 0), False, 10, 7]
    with pytest.raises(TypeError):
        cls(2, 3)  # the required fields are required


values = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.binary(max_size=8), st.text(max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=len(FIELDS), max_size=len(FIELDS)), st.sampled_from(FIELDS), values)
def test_both_builds_behave_as_one_dataclass(vals: list[Any], field: str, other: Any) -> None:
    """Made from the same values, both builds hold them, compare, copy, replace and print alike."""
    made = {build: m.Export(*vals) for build, m in BUILDS.items()}
    for e in made.values():
        assert [getattr(e, name) for name in FIELDS] == vals
        assert e == copy.copy(e)
        changed = dataclasses.replace(e, **{field: other})
        assert getattr(changed, field) == other
        assert (changed == e) == (other == getattr(e, field))
        setattr(e, field, other)  # mutable: the sink sets value, topic and key on its first encoding
        assert getattr(e, field) == other
    shown = {build: repr(e).split("(", 1)[1] for build, e in made.items()}
    assert shown["built"] == shown["interpreted"]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("thing", [None, 5, (1, 2), object()], ids=["None", "int", "tuple", "object"])
def test_as_export_refuses_what_is_not_a_record(build: str, thing: Any) -> None:
    with pytest.raises(TypeError, match=f"a record is an Export, not {type(thing).__name__}"):
        BUILDS[build].as_export(thing)


@pytest.mark.parametrize("build", list(BUILDS))
def test_as_export_hands_a_record_back(build: str) -> None:
    m = BUILDS[build]
    e = m.Export(2, 3, (1, 2, 3, 4), (0, 0, 0, 0), False, 10, 7)
    assert m.as_export(e) is e
