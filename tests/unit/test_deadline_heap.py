"""The expiry queue's heap, one source in two builds (issue 39): compiled by Cython and interpreted.

Both builds of ``flow_exporter/deadline_heap.py`` and a :mod:`heapq` list of the same ``ms << 32 | slot``
ints are driven through the same pushes and pops; they must hold the same entries in the same places
(heapq is the specification: the ints' order, its algorithm). Milliseconds past 2^31 (a node up more
than 24.8 days) and past 2^32 are drawn on purpose: ``ms << 32`` no longer fits an int64 there.
"""

from __future__ import annotations

import heapq
import math
import os
import subprocess
import sys
from array import array
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled

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
        "admission", "checkpoint_rows", "cilium_ct", "column_views", "community_id", "connection", "ctnetlink",
        "deadline_heap", "deliveries", "dying", "export", "flow_ids", "fused_poll", "ledger_core", "poll_core",
        "record_bytes", "sampling", "slot_static",
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


@pytest.mark.parametrize("build", BUILDS)
def test_the_due_loop_refuses_what_is_not_a_heap(build: ModuleType) -> None:
    """DueSlots (the due loop's pop) takes the queue's DeadlineHeap and nothing else, in both builds."""
    with pytest.raises(TypeError, match="DeadlineHeap"):
        build.DueSlots([], bytearray(1), array("d", [0.0]), array("d", [0.0]), 1.0)


def _model_due(
    heap: list[int], queued: bytearray, active: list[float], idle: list[float], now: float, requeue: dict[int, float]
) -> list[int]:
    """The queue's pop rule as it was stated over a heapq list (before issue 39): every due slot, earliest first;
    an entry of a slot no longer queued, or whose deadline moved to another millisecond, is dropped; a live one
    of now's millisecond due later than now goes back; ``requeue[slot]``: queued again at that active deadline."""
    taken, early = [], []
    limit = (math.floor(now * 1000.0) + 1) << 32
    while heap and heap[0] < limit:
        entry = heapq.heappop(heap)
        slot = entry & 0xFFFFFFFF
        deadline = min(active[slot], idle[slot])
        if not queued[slot] or math.floor(deadline * 1000.0) != entry >> 32:
            continue
        if deadline > now:
            early.append(entry)
            continue
        queued[slot] = 0
        taken.append(slot)
        if slot in requeue:
            active[slot] = requeue.pop(slot)
            queued[slot] = 1
            heapq.heappush(heap, math.floor(min(active[slot], idle[slot]) * 1000.0) << 32 | slot)
    for entry in early:
        heapq.heappush(heap, entry)
    return taken


deadlines = st.floats(0.0, 3.0).map(lambda x: round(x, 4))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(deadlines, deadlines, st.booleans()), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 39), deadlines), max_size=20),
    st.floats(0.0, 3.0).map(lambda x: round(x, 4)),
    st.dictionaries(st.integers(0, 39), st.floats(3.001, 9.0)),
)
def test_due_slots_takes_what_the_queue_rule_says_in_both_builds(
    slots: list[tuple[float, float, bool]], moves: list[tuple[int, float]], now: float, requeue: dict[int, float]
) -> None:
    """Queued slots with their heap entries, some made stale by later moves (the queue updates lazily), popped at
    ``now`` with some queued again: both builds take the model's slots in its order and leave its heap."""
    n = len(slots)
    active = [a for a, _, _ in slots]
    idle = [i for _, i, _ in slots]
    queued = bytearray(int(q) for _, _, q in slots)
    entries = [math.floor(min(active[s], idle[s]) * 1000.0) << 32 | s for s in range(n)]
    for s, d in moves:  # a move: the active deadline changes, a new entry, the old one stale
        if s < n:
            active[s] = d
            entries.append(math.floor(min(d, idle[s]) * 1000.0) << 32 | s)
    model_heap = list(entries)
    heapq.heapify(model_heap)
    m_queued, m_active = bytearray(queued), list(active)
    want = _model_due(model_heap, m_queued, m_active, list(idle), now, dict(requeue))
    for build in (BUILT, INTERPRETED):
        heap = build.DeadlineHeap(entries)
        q, act, idl = bytearray(queued), array("d", active), array("d", idle)
        due = build.DueSlots(heap, q, act, idl, now)
        got, again = [], dict(requeue)
        try:
            while (s := due.take()) >= 0:
                got.append(s)
                if s in again:
                    due.requeue(s, again.pop(s), idl[s])
        finally:
            due.close()
        assert got == want
        assert heap.tolist() == model_heap and q == m_queued and list(act) == m_active
        assert due.change == -len(got) + len(requeue) - len(again)  # taken off, queued again


def test_the_environment_variable_forces_the_interpreted_build() -> None:
    env = {**os.environ, compiled.INTERPRETED_ENV: "1"}
    code = (
        "from flow_exporter import compiled, expiry, fused_poll;"
        "print(compiled.COMPILED, compiled.is_compiled(compiled.load('deadline_heap')),"
        " compiled.is_compiled(fused_poll),"
        " expiry.ExpiryQueue()._heap.__class__.__module__, compiled.describe())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().split(maxsplit=4) == [
        "False", "False", "False", "flow_exporter.deadline_heap", "interpreted (FLOW_EXPORTER_INTERPRETED=1)",
    ]  # fmt: skip
