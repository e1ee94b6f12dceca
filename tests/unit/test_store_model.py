"""The store and its state directory as a whole, against a model kernel: the audit's dimensions.

Random interleavings of kernel activity (incarnations created, counting, destroyed, zeroed,
tuples and conntrack ids reused), polls, events (also read later than any tombstone lives),
deliveries (delivered, never written, written but reported failed, still in flight), a
connection cap, periodic snapshots, graceful restarts and SIGKILL restarts through the real
:class:`~flow_exporter.checkpoint.Checkpoint` in a temporary directory (what the kernel does
while no exporter runs, and the records in flight at the kill either written by the broker or
not), and a state directory that fills up (short writes) or turns read-only.

The invariants are the README's contract, checked on everything "Kafka" received:

* one content per (connectionId, sequence), sequences without gaps, deltas equal to the
  differences of totals (``contract.check``), and a connectionId never spans two incarnations;
* per kernel incarnation, the consumer rule's sum equals the kernel's count, except in the
  README's named cases: under-counted only when the incarnation was given up at the cap, ended
  or was zeroed while no exporter ran, or was killed between its DESTROY (or reset) being read
  and its record being journaled; over-counted only when one of its connectionIds carries flag 1
  (adopted), which the totals rule undoes, or when its DESTROY was read later than any tombstone lives
  (the README's "met again", flagged only when the kernel's stamps can show it).

The suite runs the same 300 examples every time (hypothesis, derandomized), the audit's sequences,
and 300 sequences drawn from this commit's seed (``MODEL_SEED``, printed on a failure, reproduces
them). ``make model-soak`` runs long searches (:mod:`tests.support.model_soak`).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.store_model import fails, random_ops, run_model, shrink

OPS = st.one_of(
    st.tuples(st.just("create"), st.integers(1, 3), st.integers(1, 2)),
    st.tuples(st.just("traffic"), st.integers(1, 3), st.integers(1, 5)),
    st.tuples(st.just("destroy"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("zero"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("poll"), st.just(0), st.just(0)),
    st.tuples(st.just("events"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("export"), st.sampled_from(["ok", "fail", "timeout", "hold"]), st.just(0)),
    st.tuples(st.just("settle"), st.booleans(), st.just(0)),
    st.tuples(st.just("tick"), st.sampled_from([1, 5]), st.just(0)),
    st.tuples(st.just("lag"), st.just(0), st.just(0)),
    st.tuples(st.just("snapshot"), st.just(0), st.just(0)),
    st.tuples(st.just("kill"), st.booleans(), st.just(0)),
    st.tuples(st.just("term"), st.just(0), st.just(0)),
    st.tuples(st.just("start"), st.just(0), st.just(0)),
    st.tuples(st.just("disk"), st.sampled_from(["ok", "full", "ro"]), st.just(0)),
    st.tuples(st.just("wipe"), st.just(0), st.just(0)),
)


@settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "300")),
    derandomize="MODEL_EXAMPLES" not in os.environ,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@example(  # given up at the cap, then a rollout while it lives on: not reported again
    ops=[("create", 1, 1), ("create", 2, 1), ("create", 3, 1), ("traffic", 3, 2), ("poll", 0, 0),
     ("export", "ok", 0), ("tick", 5, 0), ("traffic", 3, 1), ("poll", 0, 0), ("term", 0, 0), ("start", 0, 0),
     ("traffic", 3, 2), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0)],
    cap=2,
)  # fmt: skip
@example(  # a reset, then SIGKILL before the successor's first record
    ops=[("create", 1, 1), ("traffic", 1, 3), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("traffic", 1, 1), ("zero", 1, 0), ("export", "ok", 0), ("kill", True, 0), ("start", 0, 0),
     ("traffic", 1, 2), ("poll", 0, 0)],
    cap=4,
)  # fmt: skip
@example(  # a DESTROY read after the tombstone expired
    ops=[("create", 1, 1), ("traffic", 1, 2), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("traffic", 1, 3), ("destroy", 1, 0), ("lag", 0, 0), ("export", "ok", 0), ("events", 3, 0),
     ("export", "ok", 0)],
    cap=4,
)  # fmt: skip
@example(  # counters reset while no exporter runs
    ops=[("create", 1, 1), ("traffic", 1, 5), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("kill", False, 0), ("zero", 1, 0), ("traffic", 1, 2), ("start", 0, 0), ("poll", 0, 0)],
    cap=4,
)  # fmt: skip
@example(  # a full disk while records are produced, space back, then SIGKILL
    ops=[("create", 1, 1), ("traffic", 1, 2), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("disk", "full", 0),
     ("export", "ok", 0), ("traffic", 1, 2), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("disk", "ok", 0), ("tick", 5, 0), ("export", "ok", 0), ("traffic", 1, 1), ("tick", 5, 0), ("poll", 0, 0),
     ("export", "ok", 0), ("kill", True, 0), ("start", 0, 0), ("traffic", 1, 1), ("poll", 0, 0)],
    cap=4,
)  # fmt: skip
@example(  # a read-only state directory, SIGKILL while it is, restart once it is writable
    ops=[("create", 1, 1), ("traffic", 1, 2), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("disk", "ro", 0), ("traffic", 1, 2), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
     ("kill", True, 0), ("disk", "ok", 0), ("start", 0, 0), ("traffic", 1, 1), ("poll", 0, 0)],
    cap=4,
)  # fmt: skip
@example(  # found by a 200,000-example search: a tuple re-created with the same conntrack id is refused at the
    # cap while the replaced incarnation waits for its DESTROY (the index of replaced incarnations kept one slot
    # per tuple and id, and the DESTROY, unplaced, was given up again over the live incarnation's registry entry)
    ops=[("create", 2, 1), ("poll", 0, 0), ("create", 1, 1), ("destroy", 2, 0), ("create", 2, 1), ("zero", 1, 0)],
    cap=2,
)
@example(  # found by a long search: a given-up entry's DESTROY read after a tombstone's life is met again
    ops=[("create", 2, 1), ("create", 3, 1), ("create", 1, 1), ("zero", 1, 0), ("destroy", 1, 0), ("lag", 0, 0)],
    cap=2,
)
@example(  # found by a long search: a second DESTROY-then-SIGKILL window after an end-of-flow record went out
    ops=[("create", 3, 1), ("traffic", 3, 1), ("destroy", 3, 0), ("events", 1, 0), ("create", 1, 1),
         ("zero", 1, 0), ("export", "ok", 0), ("events", 1, 0), ("kill", False, 0)],
    cap=2,
)  # fmt: skip
@example(  # found by a long search: a NEW read after its tuple was re-created with the same id, then a restart
    ops=[("create", 1, 1), ("destroy", 1, 0), ("create", 1, 1), ("events", 1, 0), ("term", 0, 0)],
    cap=2,
)
@example(  # found by a long search: SIGKILL while the state is deleted for a full disk, after a reset (README)
    ops=[("create", 1, 1), ("traffic", 1, 1), ("zero", 1, 0), ("disk", "full", 0), ("export", "fail", 0),
         ("kill", False, 0)],
    cap=2,
)  # fmt: skip
@example(  # found by a 30-minute search: a NEW read late, of an older incarnation, freed the tuple's given-up entry
    ops=[("create", 1, 2), ("create", 2, 1), ("zero", 1, 0), ("destroy", 1, 0), ("create", 1, 1), ("poll", 0, 0)],
    cap=2,
)
@example(  # found by a long search: a give-up record held back for a read-only state dir dies with its process
    ops=[("term", 0, 0), ("create", 1, 1), ("create", 2, 1), ("start", 0, 0), ("destroy", 1, 0), ("create", 1, 1),
         ("zero", 1, 0), ("disk", "ro", 0), ("term", 0, 0)],
    cap=2,
)  # fmt: skip
@example(  # found by a long search: a stop while the state directory is read-only, after a reset (README)
    ops=[("create", 2, 1), ("disk", "ro", 0), ("traffic", 2, 1), ("zero", 2, 0), ("term", 0, 0)],
    cap=2,
)
@example(  # found by a long search: SIGKILL between reading a DESTROY and journaling its record (README)
    ops=[("create", 1, 1), ("traffic", 1, 1), ("destroy", 1, 0), ("events", 2, 0), ("kill", False, 0)],
    cap=2,
)
@example(  # found by a long search: a DESTROY still unread when the exporter stops is lost with it
    ops=[("create", 1, 1), ("events", 1, 0), ("traffic", 1, 1), ("destroy", 1, 0), ("term", 0, 0), ("events", 1, 0)],
    cap=2,
)
@example(  # found by the model soak (seed 1): a given-up entry's tuple re-created with another conntrack id before
    # its DESTROY was read: the registry kept only the newer incarnation, the DESTROY met the older one as never
    # seen, and the cap gave it up a second time
    ops=[("create", 2, 2), ("term", 0, 0), ("create", 4, 2), ("create", 3, 1), ("start", 0, 0), ("destroy", 3, 0),
         ("create", 3, 2), ("poll", 0, 0)],
    cap=2,
)  # fmt: skip
@example(  # found by the model soak (seed 2): the same, through a SIGKILL and a restart
    ops=[("create", 3, 1), ("snapshot", 0, 0), ("create", 2, 2), ("create", 1, 2), ("kill", False, 0),
         ("start", 0, 0), ("destroy", 1, 0), ("create", 1, 2), ("poll", 0, 0)],
    cap=2,
)  # fmt: skip
@example(  # found by the model soak (seed 7): two resets while the first connectionId's record is in flight owe two
    # forced-end records; the model had counted one (README: a SIGKILL before a reset's record is journaled)
    ops=[("create", 4, 1), ("events", 2, 0), ("lag", 0, 0), ("export", "timeout", 0), ("traffic", 4, 4),
         ("zero", 4, 0), ("traffic", 4, 4), ("zero", 4, 0), ("export", "ok", 0), ("kill", False, 0)],
    cap=3,
)  # fmt: skip
@given(ops=st.lists(OPS, max_size=60), cap=st.integers(2, 4))
def test_model_restarts_cap_late_events_and_a_failing_disk(ops: list[tuple[str, Any, Any]], cap: int) -> None:
    d = tempfile.mkdtemp(prefix="fx-model-")
    try:
        run_model(ops, cap, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# The audit's sequences (issue 38), each a test of its own: each failed before its fix.
AUDIT = {
    # Table._admit deleted the matched restored rows in (ended, index) order, not by index: the ended
    # predecessor before its reset successor raised IndexError at the first poll, every start (a crash loop).
    "reset_then_sigkill_then_restart": (
        [("create", 1, 1), ("traffic", 1, 3), ("poll", 0, 0), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0),
         ("zero", 1, 0), ("traffic", 1, 2), ("tick", 5, 0), ("poll", 0, 0), ("export", "ok", 0), ("kill", True, 0),
         ("start", 0, 0), ("poll", 0, 0)],
        3,
    ),
    # A snapshot between a give-up and its reason-5 record saved the tuple as given up: after SIGKILL it was
    # never reported, and no lack-of-resources record said so.
    "given_up_snapshot_before_its_record": (
        [("create", 2, 1), ("create", 1, 1), ("create", 3, 1), ("kill", False, 0), ("traffic", 3, 1),
         ("start", 0, 0), ("snapshot", 0, 0), ("kill", False, 0)],
        2,
    ),
    # After a state loss, the empty checkpoint begin() writes looked like a valid state: a process that died
    # before its adopted connections' first records left the next one reporting them unflagged.
    "state_loss_then_death_before_the_first_records": (
        [("disk", "full", 0), ("create", 1, 1), ("traffic", 1, 1), ("poll", 0, 0), ("term", 0, 0),
         ("disk", "ok", 0), ("start", 0, 0), ("kill", False, 0)],
        3,
    ),
}  # fmt: skip


# Found by the model soak on this code (make model-soak, seeds in the names); each failed before its fix.
FOUND = {
    # A restored record still failing was held by no connection: the connection's next record was built and
    # delivered past it, and a SIGKILL after the state was deleted for a full disk left a sequence gap.
    "restored_record_in_flight_then_the_next_then_state_loss_seed_3": (
        [("create", 1, 2), ("tick", 5, 0), ("poll", 0, 0), ("export", "fail", 0), ("kill", False, 0), ("start", 0, 0),
         ("export", "fail", 0), ("traffic", 1, 2), ("destroy", 1, 0), ("disk", "full", 0), ("events", 1, 0),
         ("export", "ok", 0), ("kill", False, 0)],
        3,
    ),
    "restored_record_in_flight_then_the_next_then_state_loss_seed_20261206": (
        [("kill", False, 0), ("create", 3, 1), ("start", 0, 0), ("lag", 0, 0), ("export", "fail", 0),
         ("kill", True, 0), ("start", 0, 0), ("export", "hold", 0), ("tick", 5, 0), ("export", "timeout", 0),
         ("kill", False, 0), ("disk", "full", 0), ("start", 0, 0), ("kill", False, 0)],
        4,
    ),
    # An incarnation given up at its own DESTROY (never seen live) left a given-up row for its tuple beside the
    # live incarnation's; the restart kept whichever came last, and gave the live one up a second time.
    "given_up_at_its_destroy_beside_a_given_up_successor_seed_2": (
        [("create", 3, 1), ("create", 1, 2), ("create", 2, 2), ("destroy", 2, 0), ("create", 2, 2), ("snapshot", 0, 0),
         ("poll", 0, 0), ("tick", 5, 0), ("export", "fail", 0), ("kill", False, 0)],
        2,
    ),
    "given_up_at_its_destroy_beside_a_given_up_successor_seed_4": (
        [("create", 3, 1), ("create", 1, 1), ("events", 3, 0), ("create", 4, 1), ("destroy", 4, 0), ("snapshot", 0, 0),
         ("create", 4, 1), ("poll", 0, 0), ("events", 2, 0), ("export", "ok", 0), ("kill", True, 0)],
        2,
    ),
    # The kernel re-created a given-up tuple with the same conntrack id twice before the first DESTROY was read:
    # the replaced incarnations were kept one per (tuple, id), the second replaced the first, and the first's
    # DESTROY was met as never seen and given up again.
    "given_up_tuple_recreated_twice_with_one_id_seed_9": (
        [("create", 3, 2), ("create", 4, 2), ("create", 2, 1), ("tick", 5, 0), ("destroy", 2, 0), ("create", 2, 1),
         ("poll", 0, 0), ("destroy", 2, 0), ("create", 2, 1), ("poll", 0, 0)],
        2,
    ),
    # A reset while the old id's record was in flight (its forced-end record waits for it), the successor's
    # record journaled, SIGKILL: two live rows of one incarnation, and the restart continued the old id, which
    # then counted the successor's packets again.
    "reset_while_a_record_is_in_flight_then_sigkill_seed_10": (
        [("term", 0, 0), ("create", 2, 2), ("start", 0, 0), ("traffic", 2, 4), ("tick", 5, 0), ("export", "hold", 0),
         ("zero", 2, 0), ("traffic", 2, 5), ("lag", 0, 0), ("export", "timeout", 0), ("kill", False, 0)],
        2,
    ),
    "reset_while_a_record_is_in_flight_then_sigkill_seed_12": (
        [("create", 2, 1), ("tick", 5, 0), ("traffic", 2, 1), ("poll", 0, 0), ("export", "fail", 0), ("zero", 2, 0),
         ("traffic", 2, 5), ("lag", 0, 0), ("export", "fail", 0), ("kill", False, 0)],
        3,
    ),
    # Two given-up incarnations of one tuple journaled, SIGKILL: the restart kept one by its stamps (a NEW-read
    # stamp against a kernel start), the dead one, and gave the live one up again. Now it keeps both, and the
    # first dump tells which one is live.
    "two_given_up_incarnations_of_a_tuple_then_sigkill_seed_14": (
        [("create", 4, 1), ("create", 1, 2), ("events", 2, 0), ("create", 3, 1), ("destroy", 3, 0), ("create", 3, 2),
         ("events", 1, 0), ("poll", 0, 0), ("export", "hold", 0), ("kill", False, 0)],
        2,
    ),
    # A connection given up at its NEW event (no start stamp) and a later incarnation of its tuple with the same
    # conntrack id whose kernel start precedes the NEW's reading: after a SIGKILL the live incarnation was taken for
    # the given-up one and never reported. A NEW no longer gives anything up: the dump does, naming it by its start.
    "given_up_from_its_new_then_recreated_with_one_id_seed_23": (
        [("create", 3, 1), ("create", 1, 1), ("tick", 5, 0), ("create", 4, 2), ("destroy", 4, 0), ("create", 4, 2),
         ("events", 1, 0), ("traffic", 4, 4), ("export", "timeout", 0), ("kill", True, 0)],
        2,
    ),
    # The same with a dump between, which showed the successor before the DESTROY was read: with the first fix (a
    # start-less given-up row ambiguous at a restart) the lab's given-up connections, given up at their NEW, were
    # given up again after every restart; learning the start from that dump instead took the successor for them.
    "given_up_from_its_new_then_recreated_then_dumped_before_the_destroy_is_read": (
        [("create", 3, 1), ("create", 1, 1), ("tick", 5, 0), ("create", 4, 2), ("destroy", 4, 0), ("create", 4, 2),
         ("events", 1, 0), ("traffic", 4, 4), ("poll", 0, 0), ("export", "ok", 0), ("snapshot", 0, 0),
         ("kill", True, 0)],
        2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", [*AUDIT, *FOUND])
def test_the_audit_sequences_keep_the_contract(name: str, tmp_path: Path) -> None:
    ops, cap = {**AUDIT, **FOUND}[name]
    run_model(ops, cap, str(tmp_path))


def commit_seed() -> int:
    """MODEL_SEED, else this commit's: every commit searches new sequences, and a failure names its seed."""
    if os.environ.get("MODEL_SEED"):
        return int(os.environ["MODEL_SEED"])
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout
        return int(head[:8], 16)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def test_the_model_with_this_commits_seed(tmp_path: Path) -> None:
    seed = commit_seed()
    rng = random.Random(seed)
    for i in range(int(os.environ.get("MODEL_SEED_EXAMPLES", "300"))):
        ops, cap = random_ops(rng)
        exc = fails(ops, cap, str(tmp_path))
        if exc is not None:
            small = shrink(ops, cap, str(tmp_path))
            pytest.fail(f"MODEL_SEED={seed}, example {i}: {exc!r}; shrunk: ops={small!r}, cap={cap}")
