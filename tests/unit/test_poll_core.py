"""The poll's rules over the store's columns (flow_exporter/poll_core.py), both builds of the one source.

The sweep's scan is held to the comprehension it replaced (the slots of the key index, in its order, that
the dump of this generation did not show and that are present and not destroyed).
"""

from __future__ import annotations

from array import array
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled
from flow_exporter.slot_state import DESTROYED, PRESENT

BUILT = compiled.load("poll_core")
INTERPRETED = compiled.interpreted("poll_core", as_name="tests_interpreted_poll_core")
BUILDS = [pytest.param(BUILT, id="compiled" if compiled.is_compiled(BUILT) else "loaded"),
          pytest.param(INTERPRETED, id="interpreted")]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 255)), min_size=1, max_size=60),
    st.data(),
    st.integers(0, 3),
)
def test_swept_is_the_comprehension_in_both_builds(slots: list[tuple[int, int]], data: st.DataObject, gen: int) -> None:
    seen = array("I", [s for s, _ in slots])
    bits = bytearray(b for _, b in slots)
    keyed = data.draw(st.permutations(range(len(slots))))
    keyed = keyed[: data.draw(st.integers(0, len(keyed)))]
    index = {("key", s): s for s in keyed}  # the key index's order is the scan's
    want = [s for s in index.values() if seen[s] != gen and bits[s] & PRESENT and not bits[s] & DESTROYED]
    for build in (BUILT, INTERPRETED):
        assert build.swept(index, seen, bits, gen) == want


@pytest.mark.parametrize("build", BUILDS)
def test_swept_refuses_a_slot_past_the_columns(build: ModuleType) -> None:
    with pytest.raises(IndexError, match="past the columns"):
        build.swept({"a": 0, "b": 2}, array("I", [0, 0]), bytearray([PRESENT, PRESENT]), 1)
