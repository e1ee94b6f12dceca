"""The expiry queue's heap, one source in two builds (issue 39): compiled by Cython and interpreted.

Both builds of ``flow_exporter/deadline_heap.py`` and a :mod:`heapq` list of the same ``ms << 32 | slot``
ints are driven through the same pushes and pops; they must hold the same entries in the same places
(heapq is the specification: the ints' order, its algorithm). Milliseconds past 2^31 (a node up more
than 24.8 days) and past 2^32 are drawn on purpose: ``ms << 32`` no longer fits an int64 there.
"""

from __future__ import annotations

import heapq
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled, native

BUILT = compiled.load("deadline_heap")
INTERPRETED = compiled.interpreted("deadline_heap", as_name="tests_interpreted_deadline_heap")
BUILDS = [pytest.param(BUILT, id="compiled" if compiled.is_compiled(BUILT) else "loaded"),
          pytest.param(INTERPRETED, id="interpreted")]  # fmt: skip

entries = st.builds(
    lambda ms, slot: ms << 32 | slot,
    st.one_of(st.integers(0, 2**20), st.integers(2**31 - 50, 2**31 + 50), st.integers(2**32, 2**40)),
    st.integers(0, 2**32 - 1),
)
ops = st.lists(st.one_of(st.tuples(st.just("push"), entries), st.just(("pop", 0))), max_size=300)


def test_the_compiled_build_is_the_one_that_runs_here() -> None:
    """`make test` builds the compiled modules: the suite must not pass on the interpreted ones unnoticed."""
    if compiled.forced_interpreted():
        pytest.skip("FLOW_EXPORTER_INTERPRETED is set: this run is the interpreted build's")
    assert compiled.is_compiled(BUILT), BUILT.__file__
    assert compiled.COMPILED
    # the .pxd files, found
    assert compiled.MODULES == (
        "checkpoint_rows", "community_id", "deadline_heap", "deliveries", "export", "ledger_core", "record_bytes",
    )  # fmt: skip
    assert compiled.describe() == "compiled"  # the start-up line's build=
    assert not compiled.is_compiled(INTERPRETED)


@pytest.mark.parametrize("build", BUILDS)
@settings(max_examples=300, deadline=None)
@given(initial=st.lists(entries, max_size=200), steps=ops)
def test_the_heap_holds_what_a_heapq_list_holds(build: ModuleType, initial: list[int], steps: list[Any]) -> None:
    heap = build.DeadlineHeap(initial)
    ref = list(initial)
    heapq.heapify(ref)
    assert heap.tolist() == ref
    for op, entry in steps:
        if op == "push":
            heap.push(entry)
            heapq.heappush(ref, entry)
        elif ref:
            assert heap.pop() == heapq.heappop(ref)
        else:
            with pytest.raises(IndexError):
                heap.pop()
        assert len(heap) == len(ref)
        assert (heap[0] if ref else None) == (ref[0] if ref else None)
    assert heap.tolist() == ref


@pytest.mark.parametrize("build", BUILDS)
def test_it_grows_past_its_first_room_and_empties_in_order(build: ModuleType) -> None:
    """Thousands of pushes (the arrays grow many times, the views let go and are taken again), then every pop."""
    heap = build.DeadlineHeap()
    pushed = [(i * 7919 % 5003) << 32 | (i * 104729 % 65521) for i in range(5000)]
    for e in pushed:
        heap.push(e)
    assert [heap.pop() for _ in range(len(pushed))] == sorted(pushed)
    with pytest.raises(IndexError):
        heap[0]


def test_the_compiled_loops_refuse_what_is_not_a_heap() -> None:
    """The C (due_slots, the admission) takes the heap through its C interface: anything else is a TypeError."""
    nat = native.compiled()
    if nat is None:
        pytest.skip("the hand-written C is not built in this run (interpreted build)")
    with pytest.raises(TypeError, match="DeadlineHeap"):
        nat.due_slots([], (), 0.0, 5.0, 10, [], bytearray(), [], set(), [], [], {}, None, ())


def test_the_environment_variable_forces_the_interpreted_build() -> None:
    env = {**os.environ, compiled.INTERPRETED_ENV: "1"}
    code = (
        "from flow_exporter import compiled, native, expiry;"
        "print(compiled.COMPILED, compiled.is_compiled(compiled.load('deadline_heap')), native.compiled() is None,"
        " expiry.ExpiryQueue()._heap.__class__.__module__, compiled.describe())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().split(maxsplit=4) == [
        "False", "False", "True", "flow_exporter.deadline_heap", "interpreted (FLOW_EXPORTER_INTERPRETED=1)",
    ]  # fmt: skip
