"""The store and its state directory as a whole, against a model kernel: the world the model tests run.

One node: the kernel (:class:`~tests.support.kernel_model.Kernel`), at most one exporter process on it
(a :class:`~flow_exporter.store.ConnectionStore` and a real
:class:`~flow_exporter.checkpoint.Checkpoint` in a temporary directory), its disk, and the broker's
log. :func:`run_model` plays a sequence of operations and checks the README's contract on what
"Kafka" received; :func:`random_ops` draws sequences for long searches (``make model-soak``,
:mod:`tests.support.model_soak`) and :func:`shrink` cuts a failing one down.

The invariants are the README's contract, checked on everything "Kafka" received:

* one content per (connectionId, sequence), sequences without gaps, deltas equal to the
  differences of totals (``contract.check``), and a connectionId never spans two incarnations;
* per kernel incarnation, the consumer rule's sum equals the kernel's count, except in the
  README's named cases: under-counted only when the incarnation was given up at the cap, ended
  or was zeroed while no exporter ran, was killed between its DESTROY (or reset) being read
  and its record being journaled, or had records built and not yet in Kafka when the state
  directory was lost; over-counted only when one of its connectionIds carries flag 1 (adopted),
  which the totals rule undoes, or when its DESTROY was read later than any tombstone lives (the
  README's "met again", flagged only when the kernel's stamps can show it).
"""

from __future__ import annotations

import errno
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flow_exporter.checkpoint import Checkpoint
from flow_exporter.flow import ADOPTED, FORCED_END, LACK_OF_RESOURCES, Export
from flow_exporter.store import RETRY_DELAY, ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support import contract
from tests.support.kernel_model import Kernel
from tests.support.store_builders import Clock

Op = tuple[str, Any, Any]

BOOT = b"B" * 16
TIMEOUTS = Timeouts(poll_interval=1, active=5, idle=15)
Inc = tuple[int, int]  # (port, serial): one kernel incarnation


class Disk:
    """The state directory's device: writes succeed, come back short (full), or fail (read-only)."""

    def __init__(self) -> None:
        self.mode = "ok"

    def write(self, fd: int, data: bytes) -> int:
        if self.mode == "full":
            if len(data) > 1:
                return os.write(fd, bytes(data)[: len(data) // 2])  # a short write: part of the entry lands
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.mode == "ro":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return os.write(fd, data)

    def unlink(self, path: Path) -> None:
        if self.mode == "ro":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        os.unlink(path)


class World:
    """One node: the kernel, at most one exporter process on it, its state directory and the broker's log."""

    def __init__(self, directory: str, cap: int) -> None:
        self.clock = Clock()
        self.kern = Kernel(self.clock)
        self.dir = directory
        self.cap = cap
        self.disk = Disk()
        self.log: list[dict[str, Any]] = []
        self.flagged: set[Inc] = set()  # incarnations with an adopted connectionId
        # DESTROYs read later than any tombstone lives: met again, counted twice, flagged only when the
        # kernel's stamps show a dump saw them more than the margin after they started (README)
        self.late: set[Inc] = set()
        self.excused: set[Inc] = set()  # incarnations the README lets be under-counted
        self.given_up: set[Inc] = set()
        self.final_built: set[Inc] = set()
        # zeroed while up: how many of its forced-end records are not built yet (each reset owes one; two resets
        # in a row while the first connectionId's record is in flight owe two)
        self.zeroed_open: dict[Inc, int] = {}
        self.zeroed_here: set[Inc] = set()  # zeroed while an exporter ran
        self.ended: list[Any] = []
        self.held: list[Export] = []  # produced, delivery not yet reported
        self.snapshot_due = False
        self.built: dict[tuple[int, int], Inc] = {}  # (connectionId, sequence) of every record built -> incarnation
        self.store: ConnectionStore | None = None
        self.cp: Checkpoint | None = None
        self.start()

    # -------------------------------------------------------------- processes
    def lose_events(self) -> None:
        """Events no listener reads (the process stopped, or none ran yet) are gone for good."""
        for kind, c in self.kern.events:
            if kind == "destroy":
                self.ended.append(c)
                self.excused.add((c.orig_sport, c.mark))  # it ended unread: its last counts are lost
        self.kern.events.clear()

    def start(self) -> None:
        self.lose_events()  # the new process's listener only hears what happens after it subscribed
        disk = self.disk
        cp = Checkpoint(self.dir, boot=BOOT, write=disk.write, unlink=disk.unlink, clock=lambda: self.clock.now)
        assert cp.lock()
        loaded = cp.load()
        store = ConnectionStore(TIMEOUTS, max_connections=self.cap, adopt=not loaded.valid or loaded.adopting)
        if loaded.valid:
            store.restore(loaded.rows, loaded.resends, adopting=loaded.adopting)
        cp.begin(loaded)
        self.store, self.cp = store, cp
        self.poll()  # the exporter's first poll comes at once: it adopts only what lived before it
        # Adopting on disk: the expire loop's next turn writes the snapshot that ends it (Exporter._start_lineage).
        self.snapshot_due = not loaded.valid or loaded.adopting

    def stop(self, graceful: bool, written: bool) -> None:
        """SIGTERM (final records delivered, a snapshot) or SIGKILL (records in flight written or not)."""
        store, cp = self.store, self.cp
        assert store is not None and cp is not None
        if graceful:
            self.settle(True)
            for _ in range(20):
                if cp.stale and cp.due():  # as the app's shutdown: held back until a snapshot succeeds
                    cp.snapshot(store.reported(), store.in_flight())
                self.produce(store.export_all(self.clock.now), "ok")
                self.clock.tick(RETRY_DELAY * 2)
                if store.unfinished() == 0:
                    break
            cp.snapshot(store.reported(), store.in_flight())
        if not graceful or cp.stale:  # SIGKILL, or a stop holding records back for a read-only state dir
            if written and not graceful:
                self.log.extend(self.content(e) for e in self.held)
            self.held = []
            for inc, owed in self.zeroed_open.items():
                if not owed:
                    continue
                self.excused.add(inc)  # the reset was seen, its record not yet journaled
            lost_state = cp.stale or cp.broken  # held back, or the state deleted for a full disk
            for c in self.ended:
                if (c.orig_sport, c.mark) not in self.final_built or lost_state:
                    self.excused.add((c.orig_sport, c.mark))  # its DESTROY was read, its record not yet journaled
            if lost_state:  # what was built since is on no disk, and maybe not in Kafka either
                self.excused |= self.zeroed_here
                logged = {tuple(r["_incarnation"]) for r in self.log if r["flowEndReason"] == LACK_OF_RESOURCES}
                self.excused |= self.given_up - logged  # its give-up record died held back
        self.lose_events()  # a stopping exporter reads no more events: its final records carry what it knew
        cp.close()
        self.store = self.cp = None

    # -------------------------------------------------------------- exporter
    def read(self, n: int | None = None) -> None:
        if self.store is None:
            self.lose_events()
            return
        events = self.kern.events
        take = events[: len(events) if n is None else n]
        del events[: len(take)]
        for kind, c in take:
            if kind == "destroy":
                self.ended.append(c)
                self.final_built.discard((c.orig_sport, c.mark))  # what it reports is still to be built
            if self.store is not None:
                new, gone = ([c], []) if kind == "new" else ([], [c])
                self.store.apply_events(new, gone, self.clock.now, self.clock.wall())

    def poll(self) -> None:
        if self.store is not None:
            self.store.update(list(self.kern.live.values()), self.clock.now, self.clock.wall())

    def content(self, e: Export) -> dict[str, Any]:
        assert e.value is not None
        return json.loads(e.value)

    def encode(self, e: Export) -> None:
        """What the sink does once per record: its bytes, reused by every resend."""
        if e.value is not None:
            return
        assert e.conn is not None and e.conn_key is not None
        inc = (e.conn_key[3], e.conn.mark)
        r = {
            "_incarnation": list(inc),
            "connectionId": e.flow_id,
            "sequence": e.sequence,
            "flowEndReason": e.reason,
            "flags": e.flags,
            **dict(zip(contract.TOTALS, e.totals, strict=True)),
            **dict(zip(contract.DELTAS, e.deltas, strict=True)),
        }
        e.value, e.topic, e.key = json.dumps(r).encode(), "flows", b""
        self.built[(e.flow_id, e.sequence)] = inc
        if e.flags & ADOPTED:
            self.flagged.add(inc)
        if e.reason == LACK_OF_RESOURCES:
            self.given_up.add(inc)
        if e.final:
            self.final_built.add(inc)
            if e.reason == FORCED_END:
                self.zeroed_open[inc] = max(self.zeroed_open.get(inc, 0) - 1, 0)

    def produce(self, out: list[Export], outcome: str) -> None:
        store, cp = self.store, self.cp
        assert store is not None and cp is not None
        for e in out:
            self.encode(e)
        cp.sent(out)
        if cp.stale:
            # The state on disk can no longer be brought up to date: the app holds records back.
            for e in out:
                store.acknowledge(e, False, self.clock.now)
            return
        delivered = []
        for e in out:
            if outcome == "hold":
                self.held.append(e)
                continue
            if outcome in ("ok", "timeout"):
                self.log.append(self.content(e))
            store.acknowledge(e, outcome == "ok", self.clock.now)
            if outcome == "ok":
                delivered.append(e)
        cp.delivered(delivered)

    def settle(self, ok: bool) -> None:
        """Delivery reports of the records in flight arrive."""
        store, cp = self.store, self.cp
        if store is None or cp is None:
            return
        held, self.held = self.held, []
        if ok:
            self.log.extend(self.content(e) for e in held)
        for e in held:
            store.acknowledge(e, ok, self.clock.now)
        if ok:
            cp.delivered(held)

    def export(self, outcome: str) -> None:
        if self.store is None or self.cp is None:
            return
        if self.snapshot_due:
            self.snapshot_due = False
            self.cp.snapshot(self.store.reported(), self.store.in_flight())
        self.produce(self.store.expire(self.clock.now, self.clock.wall()), outcome)
        if self.cp.due():
            self.cp.snapshot(self.store.reported(), self.store.in_flight())

    # -------------------------------------------------------------- kernel
    def zero(self, port: int) -> None:
        c = self.kern.live.get(port)
        if c is None:
            return
        if self.store is None:
            self.excused.add((port, c.mark))  # counts since the last record are lost with the reset
            self.kern.zero(port)
            return
        self.poll()  # polls around it: a reset hidden by newer counts, or counts between the
        self.kern.zero(port)  # last poll and a reset, cannot be seen
        self.zeroed_open[(port, c.mark)] = self.zeroed_open.get((port, c.mark), 0) + 1
        self.zeroed_here.add((port, c.mark))
        self.poll()

    def wipe(self) -> None:
        """The state directory is lost while no exporter runs (a new emptyDir, a volume replaced).

        Records built and not in Kafka by then (in flight at a kill, or waiting to be resent) go with it:
        their counts are lost (README: a lost state). What the next process finds live it flags adopted.
        """
        if self.store is not None:
            return
        for name in os.listdir(self.dir):
            if name != "lock":
                os.unlink(os.path.join(self.dir, name))
        logged = {(r["connectionId"], r["sequence"]) for r in self.log}
        self.excused |= {inc for pair, inc in self.built.items() if pair not in logged}

    def destroy(self, port: int) -> None:
        c = self.kern.live.get(port)
        if c is not None and self.store is None:
            self.excused.add((port, c.mark))  # ended while no exporter ran
        self.kern.destroy(port)


def run_model(ops: list[tuple[str, Any, Any]], cap: int, directory: str) -> None:
    w = World(directory, cap)
    clock, kern = w.clock, w.kern
    for op, a, b in ops:
        clock.tick(0.001)  # a real clock moves on between any two things
        up = w.store is not None
        if op == "create":
            kern.create(a, b)
        elif op == "traffic":
            kern.traffic(a, b)
        elif op == "destroy":
            w.destroy(a)
        elif op == "zero":
            w.zero(a)
        elif op == "poll":
            w.poll()
        elif op == "events":
            w.read(a)
        elif op == "export":
            w.export(a)
        elif op == "settle":
            w.settle(a)
        elif op == "tick":
            w.read()  # the listener keeps up within a tombstone's lifetime
            clock.tick(a)
        elif op == "lag":  # the listener falls behind for longer than any tombstone lives
            w.late |= {(c.orig_sport, c.mark) for kind, c in kern.events if kind == "destroy"}
            clock.tick(TIMEOUTS.poll_interval * 4 + 61)
            w.poll()
        elif op == "snapshot" and up:
            assert w.cp is not None and w.store is not None
            w.cp.snapshot(w.store.reported(), w.store.in_flight())
        elif op == "kill" and up:
            w.stop(graceful=False, written=a)
        elif op == "term" and up:
            w.stop(graceful=True, written=True)
        elif op == "start" and not up:
            w.start()
        elif op == "disk":
            w.disk.mode = a
        elif op == "wipe":
            w.wipe()
    # The end: the disk is fine again, an exporter runs, and everything is delivered.
    w.disk.mode = "ok"
    if w.store is None:
        w.start()
    w.settle(True)
    w.read()
    w.poll()
    store, cp = w.store, w.cp
    assert store is not None and cp is not None
    for _ in range(100):
        clock.tick(RETRY_DELAY * 2)
        if cp.due():
            cp.snapshot(store.reported(), store.in_flight())
        w.export("ok")
        w.poll()
        deadline = store.next_deadline()
        if not cp.stale and not cp.broken and (deadline is None or deadline > clock.now + 60):
            break
    w.stop(graceful=True, written=True)

    groups = contract.check(w.log)  # one content per pair, no gaps, deltas add up
    counted: dict[Inc, int] = {}
    for rs in groups.values():
        inc = tuple(rs[0]["_incarnation"])
        assert all(tuple(r["_incarnation"]) == inc for r in rs), "a connectionId spans two incarnations"
        counted[inc] = counted.get(inc, 0) + contract.consumer_sum(rs)[0]  # type: ignore[index]
    for inc in w.given_up - w.flagged - w.late:  # given up once, and not taken back while its entry lasts
        gave = [rs for rs in groups.values() if tuple(rs[0]["_incarnation"]) == inc]
        given = sum(r["flowEndReason"] == LACK_OF_RESOURCES for rs in gave for r in rs)
        # exactly once; none only if its record never left a process that died holding it back
        assert given == 1 or (given == 0 and inc in w.excused), gave
    truth = {(c.orig_sport, c.mark): c.orig_packets + kern.zeroed.get(c.mark, 0) for c in [*w.ended, *kern.live.values()]}  # noqa: E501
    for inc in set(truth) | set(counted):
        got, want = counted.get(inc, 0), truth.get(inc, 0)
        if got == want:
            continue
        if got > want:
            assert inc in w.flagged | w.late, f"{inc}: over-counted ({got} > {want}) without the adopted flag"
        else:
            under = w.excused | w.given_up
            assert inc in under, f"{inc}: under-counted ({got} < {want}) outside the README's named cases"




# Every operation run_model knows, with what it takes; weights favour the restart path (kills, snapshots,
# starts, resets, give-ups at the cap, state loss) over the steady state the derandomized examples cover.
_KINDS: list[tuple[str, int, Callable[[random.Random], tuple[Any, Any]]]] = [
    ("create", 6, lambda r: (r.randint(1, 4), r.randint(1, 2))),
    ("traffic", 6, lambda r: (r.randint(1, 4), r.randint(1, 5))),
    ("destroy", 3, lambda r: (r.randint(1, 4), 0)),
    ("zero", 3, lambda r: (r.randint(1, 4), 0)),
    ("poll", 6, lambda r: (0, 0)),
    ("events", 4, lambda r: (r.randint(0, 3), 0)),
    ("export", 6, lambda r: (r.choice(["ok", "ok", "fail", "timeout", "hold"]), 0)),
    ("settle", 2, lambda r: (r.random() < 0.7, 0)),
    ("tick", 5, lambda r: (r.choice([1, 5]), 0)),
    ("lag", 1, lambda r: (0, 0)),
    ("snapshot", 4, lambda r: (0, 0)),
    ("kill", 4, lambda r: (r.random() < 0.5, 0)),
    ("term", 2, lambda r: (0, 0)),
    ("start", 6, lambda r: (0, 0)),
    ("disk", 2, lambda r: (r.choice(["ok", "ok", "full", "ro"]), 0)),
    ("wipe", 1, lambda r: (0, 0)),
]
_NAMES = [k for k, _, _ in _KINDS]
_WEIGHTS = [w for _, w, _ in _KINDS]
_ARGS = {k: f for k, _, f in _KINDS}


def random_ops(rng: random.Random, max_ops: int = 120) -> tuple[list[Op], int]:
    """One random sequence (1 to ``max_ops`` operations) and a connection cap (2 to 4)."""
    n = rng.randint(1, max_ops)
    ops: list[Op] = []
    for name in rng.choices(_NAMES, _WEIGHTS, k=n):
        a, b = _ARGS[name](rng)
        ops.append((name, a, b))
    return ops, rng.randint(2, 4)


def fails(ops: list[Op], cap: int, directory: str) -> BaseException | None:
    """What ``run_model`` raises for this sequence, in a directory of its own (None: the contract held)."""
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    try:
        run_model(ops, cap, directory)
    except Exception as exc:
        return exc
    return None


def shrink(ops: list[Op], cap: int, directory: str) -> list[Op]:
    """A shorter sequence that still fails: greedy, chunks of operations taken out while it keeps failing."""
    chunk = max(len(ops) // 2, 1)
    while chunk >= 1:
        i = 0
        while i < len(ops):
            candidate = ops[:i] + ops[i + chunk :]
            if candidate and fails(candidate, cap, directory) is not None:
                ops = candidate
            else:
                i += chunk
        chunk //= 2
    return ops
