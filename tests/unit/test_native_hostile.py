"""The compiled paths against hostile objects and errors part-way (issue 38, defects 7-8).

An Export with a field deleted (or never set), a class that borrows Export's (or Connection's) field
descriptors, a subclass of Connection and a Connection whose fields a column cannot hold must be handed
back or refused with a Python exception by every compiled entry point, never read as what they are not:
those run in a child process, where a crash fails the test instead of pytest.
A failed allocation in the prefix encoder is a MemoryError, and an error inside the compiled expiry loop
leaves the queue's count as exact as the pure loop leaves it.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flow_exporter import admission, ledger_core
from flow_exporter import compiled as builds
from flow_exporter.connection import Connection
from flow_exporter.flow import Export
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.store_builders import NS, Clock, poll, tcp, udp

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = builds.interpreted("record_bytes", as_name="tests_interpreted_record_bytes")
TIMEOUTS = Timeouts(poll_interval=1, active=5, idle=15)


def record(conn: Any = None, **changes: Any) -> Export:
    """A prepared record of a TCP connection, its connection's fields attached (no prefix cached)."""
    c = tcp() if conn is None else conn
    e = Export(
        2, 3, (1, 100, 1, 200), (1, 100, 1, 200), False, 1001 * NS, 77, 999 * NS,
        (0, 6, bytes([10, 0, 1, 2]), 40000, bytes([10, 0, 2, 2]), 8080), 7, 999 * NS,
        tcp_state=3, conn=c, slot=0, value=b"v", topic="t", key=b"k",
    )  # fmt: skip
    for k, v in changes.items():
        setattr(e, k, v)
    return e


# -- 7: hostile objects: handed back or refused, never read where they have no slot -------------------------


def borrowing(cls: type, name: str) -> type:
    """A class of no slots whose attributes are ``cls``'s field descriptors: its instances are smaller."""
    return type(name, (), {"__slots__": (), **{f.name: cls.__dict__[f.name] for f in fields(cls)}})


def hostile_exports() -> Iterator[tuple[str, Any]]:
    for f in fields(Export):
        e = record()
        delattr(e, f.name)
        yield f"del {f.name}", e
    # no field set: unset slots (the dataclass), or every field None (the compiled Export, which makes its own)
    yield "Export.__new__(Export)", Export.__new__(Export)
    yield "a class borrowing Export's descriptors", borrowing(Export, "Borrowing")()


def outcome(call: Callable[[], Any]) -> str:
    """What a call gave, by type (a record with a field deleted has no repr)."""
    try:
        got = call()
    except Exception as exc:
        return f"raised {type(exc).__name__}"
    if got is NotImplemented or got is None:
        return "fell back"
    if isinstance(got, list):  # prepare's failures: (export, exception) pairs
        return "gave [" + ", ".join(type(x[-1]).__name__ for x in got) + "]"
    return f"gave {type(got).__name__}"


def _settle_delivered(e: Any) -> Any:
    """Settled by ledger_core, or "fell back" to the ledger's own method."""
    slow: list[Any] = []
    store = SimpleNamespace(
        _pending=[e], _prefix=[None], _reason=bytearray(1), _bits=bytearray(b"\x01"), _epoch=array("I", [0])
    )
    ledger_core.settle_delivered(store, [e], 1, slow.append)
    return None if slow else store._prefix[0] or "settled"


RECORD_ENTRIES: dict[str, Callable[[Any], Any]] = {
    "settle_delivered": _settle_delivered,
    "prepare_all": lambda e: RecordEncoder("n").prepare_all([e], 5, "t"),
}


def _run_records(check: Callable[[str, str, Any], None]) -> None:
    """Every entry point that reads an Export's fields, given each hostile object (a copy each: a fallback may set
    a field the next one should miss)."""
    for name, e in hostile_exports():
        # a real Export (the compiled one's deleted or unset fields read as None): a compiled answer is fine
        plain = name.startswith(("del ", "Export.__new__"))
        for entry, call in RECORD_ENTRIES.items():
            check(f"{entry} {name}", outcome(functools.partial(call, copy.copy(e))), plain)
        # what the encoder makes of it: the interpreted build's outcome, whatever it is
        want = outcome(functools.partial(INTERPRETED.RecordEncoder("n").prepare_all, [copy.copy(e)], 5, "t"))
        check(f"prepare_all as interpreted {name}", outcome(functools.partial(RECORD_ENTRIES["prepare_all"], e)), want)


def _run_types(check: Callable[[str, str, Any], None]) -> None:
    """The entry points that fill or read objects of a type they are given."""
    conn_b = borrowing(Connection, "BorrowingConnection")
    store = ConnectionStore(TIMEOUTS, compiled=True)
    clock = Clock()
    poll(store, clock, tcp(1))
    clock.tick(TIMEOUTS.active + 1)
    sub = type("SubConnection", (Connection,), {"__slots__": ()})
    rows = {
        "a borrowing type": conn_b(),
        "a subclass": sub(*[getattr(udp(), f.name) for f in fields(Connection)]),
        "Connection.__new__": Connection.__new__(Connection),
        "a float counter": replace(udp(), orig_bytes=1.5),
        "a negative counter": replace(udp(), reply_packets=-1),
        "a counter past 64 bits": replace(udp(), orig_packets=1 << 64),
        "a port past 16 bits": replace(udp(), reply_sport=1 << 16),
        "an id past 32 bits": replace(udp(), ct_id=1 << 32),
        "a TCP state past a byte": replace(udp(), tcp_state=300),
        "str labels": replace(udp(), labels="x"),
        "an int counted": replace(udp(), counted=1),
    }
    for name, row in rows.items():  # 0: it stopped at the row, which is the Python path's (None: "fell back")
        got = outcome(lambda r=row: admission.admit_rows(store, [r], 0, clock.now, clock.wall(), None) or None)
        check(f"admit_rows of {name}", got, False)
    assert len(store.connections) == 1, "nothing admitted"
    for name, conn in [("borrowing", conn_b()), ("Connection.__new__", Connection.__new__(Connection))]:
        want = outcome(lambda c=conn: INTERPRETED.RecordEncoder("n").static(record(conn=c)))
        check(f"static of a {name} connection", outcome(lambda c=conn: RecordEncoder("n").static(record(conn=c))), want)


def run_hostile(which: str) -> None:
    """In a child process: print each case's outcome; exit 1 if one is a compiled answer where none may be."""
    bad = []

    def check(case: str, got: str, allowed: Any) -> None:
        print(f"{case}: {got}", flush=True)
        ok = got == allowed if isinstance(allowed, str) else allowed or got.startswith(("raised", "fell back"))
        if not ok:
            bad.append(f"{case}: {got} (expected {allowed or 'a fallback or an exception'})")

    {"records": _run_records, "types": _run_types}[which](check)
    if bad:
        print("\n".join(["FAILED:", *bad]), flush=True)
        sys.exit(1)


@pytest.mark.parametrize("which", ["records", "types"])
def test_hostile_objects_are_handed_back_or_refused(which: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = f"from tests.unit.test_native_hostile import run_hostile; run_hostile({which!r})"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    last = child.stdout.strip().splitlines()[-1:] or ["(nothing)"]
    assert child.returncode == 0, f"exit {child.returncode} after {last[0]}\n{child.stdout}\n{child.stderr[-3000:]}"


# -- 8: a failed allocation, an error part-way ------------------------------------------------------------


def run_prefix_without_memory() -> None:
    """In a child process: the compiled prefix with each of its allocations failing in turn; print what each gave."""
    import _testcapi

    e = record(conn=replace(tcp(), labels=b"\x01" * 3000))  # past the encoder's 512 bytes: its buffer grows
    want = INTERPRETED.RecordEncoder("n").static(copy.copy(e))
    assert RecordEncoder("n").static(copy.copy(e)) == want  # caches warm: what fails is the encoding
    for i in range(2000):
        enc, one = RecordEncoder("n"), copy.copy(e)
        _testcapi.set_nomemory(i, i + 1)
        try:
            got: Any = enc.static(one)
        except BaseException as exc:  # the type is the answer
            got = type(exc)
        finally:
            _testcapi.remove_mem_hooks()
        print(i, got if isinstance(got, type) else "bytes", flush=True)
        if isinstance(got, bytes):
            assert got == want
            return
    raise AssertionError("never encoded")


def test_a_failed_allocation_in_the_prefix_is_a_memory_error() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "from tests.unit.test_native_hostile import run_prefix_without_memory as r; r()"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    seen = {line.split(" ", 1)[1] for line in child.stdout.splitlines()}
    assert "<class 'MemoryError'>" in seen and "bytes" in seen
    assert seen <= {"<class 'MemoryError'>", "bytes"}, seen


class Boom(Exception):
    pass


class Exploding:
    """A protocol number that refuses to be compared (the pure loop) or converted (the compiled one)."""

    def __eq__(self, other: object) -> bool:
        raise Boom

    def __index__(self) -> int:
        raise Boom

    def __int__(self) -> int:
        raise Boom

    __hash__ = object.__hash__


def test_an_error_in_the_due_loop_leaves_the_queue_count_exact() -> None:
    """A key whose protocol cannot be read stops the due loop (ledger_core.due) where it is, in both builds; the
    queue counts what is left queued."""
    got = []
    for compiled in (False, True):
        store = ConnectionStore(TIMEOUTS, compiled=compiled, id_seed=b"S" * 8)
        clock = Clock()
        poll(store, clock, *[udp(5000 + k) for k in range(4)])
        clock.tick(TIMEOUTS.active + 1)  # every one due for its active timeout, in slot order
        s = sorted(store.connections.values())[1]
        k = store.table._keys[s]
        assert k is not None
        store.table._keys[s] = (k[0], Exploding(), *k[2:])
        with pytest.raises(Boom):
            store.expire(clock.now, clock.wall())
        queued = store.queue.parts()[1]
        got.append((len(store.queue), queued.count(1)))
    assert got[0][0] == got[0][1] == 3  # the first requeued, the second taken off
    assert got[1] == got[0]
