"""The exporter's two loops and its lifecycle.

The poll loop dumps conntrack and updates the store; the expire loop turns due
connections into records and hands them to the sink. They share the store under
one lock, held only for in-memory work: dumping, encoding and producing happen
outside it, so a slow broker never delays a poll and a big dump never delays
delivery reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

import tenacity

from flow_exporter.connection import Connection
from flow_exporter.flow import FORCED_END, Export, NewConnection, Restored
from flow_exporter.lifecycle import Lifecycle
from flow_exporter.ports import (
    DecodeResult,
    DeliveryObserver,
    EventSource,
    Journal,
    NoJournal,
    NoObserver,
    Sink,
    Source,
    Unsent,
)
from flow_exporter.readings import Readings, Timings
from flow_exporter.retry import sleep_on
from flow_exporter.sampling import Sampler, Schedule
from flow_exporter.settings import DEFAULT_SETTINGS
from flow_exporter.shedding import Budget, Shedder
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts

log = logging.getLogger(__name__)


@dataclass
class LoopStats:
    polls: int = 0
    poll_errors: int = 0
    table_count: int = 0
    table_max: int = 0
    records_given_up: int = 0  # deliveries Kafka refused for good (e.g. too large): counts lost
    resyncs: int = 0
    barrier_timeouts: int = 0  # polls whose sweep ran before the event listener caught up
    expire_errors: int = 0  # turns of the expire loop that raised (logged, retried after a backoff)
    states_dropped: int = 0  # restored states that raised while applied: dropped for a new lineage
    zone_entries: dict[int, int] = field(default_factory=dict)  # entries per zone in the last full dump
    kernel: dict[str, int] = field(default_factory=dict)  # conntrack's own statistics (conntrack -S)
    last_poll_seconds: float = 0.0
    sampling_changes: int = 0  # adaptive shedding's level changes (each logged)
    sampling_save_errors: int = 0  # changes not made because the state directory could not keep them


@dataclass
class ShutdownOutcome:
    """How the last records went at shutdown (logged; the metrics endpoint is gone by then)."""

    final_records: int = 0  # final records built (flowEndReason 4)
    kept: int = 0  # undelivered, kept in the state directory for the next start
    lost: int = 0  # undelivered and no state directory: their counts are lost


# C-level attribute read: counting zones adds no Python call per dumped entry.
_zone = attrgetter("zone")


@dataclass(frozen=True, slots=True)
class ExporterOptions:
    """The loops' settings in one value: the runner builds it from the config (``runner.options_from``).

    The collaborators (source, sink, journal, observers, clocks) are passed to :class:`Exporter`
    beside it; these are plain values.
    """

    timeouts: Timeouts = field(default_factory=Timeouts)
    node_name: str = ""
    zones: frozenset[int] = frozenset()  # empty: every zone
    retry_initial: float = DEFAULT_SETTINGS.retry.initial_backoff
    retry_max: float = DEFAULT_SETTINGS.retry.max_backoff
    grace: float = DEFAULT_SETTINGS.shutdown.grace
    max_connections: int = DEFAULT_SETTINGS.limits.max_connections
    max_in_flight: int = DEFAULT_SETTINGS.limits.max_in_flight
    compiled: bool = True  # the compiled poll path, when built (a test seam: the build is chosen once)
    cache_prefixes: bool = True  # keep active connections' record prefixes (export.prefixCache, resolved)
    adopt: bool = True  # no state to continue from: connections found live are flagged adopted
    source_flags: int = 0  # record flags every connection of the source has (flow.BOTH_DIRECTIONS: Cilium >= 1.16)
    source: str = "netfilter"  # conntrack.source as chosen (the health stream and the markers name it)
    sampling_probability: float = 1.0  # sampling.probability: 1 keeps every connection (no sampler)
    sampling_seed: str = ""  # sampling.seed (a secret: never logged)
    sampling_budget: Budget = field(default_factory=Budget)  # sampling.budget.*: adaptive shedding when set
    sampling_interval: float = DEFAULT_SETTINGS.sampling.adjust_interval
    sampling_max_level: int = DEFAULT_SETTINGS.sampling.max_halvings


class Exporter:
    """Runs the poll and expire loops against a :class:`Source` and a :class:`Sink`."""

    def __init__(
        self,
        source: Source,
        sink: Sink,
        options: ExporterOptions,
        *,
        lifecycle: Lifecycle | None = None,
        on_new: Callable[[NewConnection], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ns: Callable[[], int] = time.time_ns,
        is_fatal: Callable[[BaseException], bool] = lambda e: False,  # the runner knows the real source's errors
        checkpoint: Journal | None = None,
        timings: Timings | None = None,
        completeness: DeliveryObserver | None = None,
        schedule: Schedule | None = None,
        save_schedule: Callable[[Schedule], None] | None = None,
    ) -> None:
        self.source = source
        self.completeness: DeliveryObserver = completeness if completeness is not None else NoObserver()
        self.sink = sink
        self.options = options
        self.lifecycle = lifecycle or Lifecycle()
        self.timeouts = options.timeouts
        self.node_name = options.node_name
        self.zones = frozenset(options.zones)
        self.grace = options.grace
        self.clock = clock
        self.wall_ns = wall_ns
        self._on_new = on_new
        # One sampler for the process (its count of dropped connections is a counter), shared by every store. With
        # a budget, adaptive shedding: a schedule of levels (the state directory's, when continued) and its shedder.
        p = options.sampling_probability
        if schedule is None and options.sampling_budget.enabled:
            schedule = Schedule(p)
        self.schedule = schedule
        self.sampler = Sampler(p, options.sampling_seed, schedule) if p < 1 or schedule is not None else None
        self.shedder = (
            Shedder(options.sampling_budget, options.sampling_interval, options.sampling_max_level)
            if schedule is not None
            else None
        )
        self._save_schedule = save_schedule
        self.store = self._new_store(options.adopt)
        # A restored state until the first poll after it is complete (see _drop_state), and a dropped one whose
        # new lineage the expire thread, the journal's only writer, has still to start.
        self._restoring = False
        self._lineage_due = False
        # The state on disk says "still adopting" (a lost state, no complete poll since): once a poll completes, a
        # snapshot says otherwise (_snapshot_due), or every restart until the journal outgrows the snapshot would
        # flag what it finds live.
        self._adopting = options.adopt
        self._snapshot_due = False
        self.checkpoint: Journal = checkpoint if checkpoint is not None else NoJournal()
        self.events: EventSource | None = None
        self._given_up_logged_at = float("-inf")
        self.max_in_flight = options.max_in_flight
        self.lock = threading.Lock()
        self.stop_event = self.lifecycle.stop_event
        self.stats = LoopStats()
        self.outcome = ShutdownOutcome()
        self.fatal: BaseException | None = None
        self._is_fatal = is_fatal
        self._retry_initial = options.retry_initial
        self._retry_max = options.retry_max
        self._timings = timings
        self._resync = threading.Event()

    def stop(self) -> None:
        """Ask the loops to stop; ``run`` then shuts down (final records within the grace period)."""
        self.stop_event.set()

    def _new_store(self, adopt: bool) -> ConnectionStore:
        o = self.options
        return ConnectionStore(
            o.timeouts,
            on_new=self._on_new,
            max_connections=o.max_connections,
            adopt=adopt,
            compiled=o.compiled,
            cache_prefixes=o.cache_prefixes,
            source_flags=o.source_flags,
            sampler=self.sampler,
        )

    def restore(self, rows: list[Restored], resends: list[Export], *, adopting: bool = False) -> None:
        """Continue from a previous process's checkpoint (call before ``run``)."""
        with self.lock:
            try:
                self.store.restore(rows, resends, adopting=adopting)
            except Exception as exc:
                self._drop_state(exc)
                return
            self._restoring = True
            self._adopting = adopting

    def _drop_state(self, exc: Exception) -> None:
        """Applying the restored state raised: drop it for a new lineage, never exit (call with the lock held).

        Any exception of the store while it restores rows or meets them in the first poll after a
        restart is one the next start would meet again, with the same state: exiting would be a crash
        loop. So the state goes, as a damaged one does: a fresh store flags what it finds live as
        adopted (README, "Counting: the contract"). Records already built keep their bytes and go out.
        Bugs elsewhere stay fatal.
        """
        try:
            keep = [e for e in self.store.in_flight() if e.value is not None]
        except Exception:  # the store that raised may not even list its records: they go with it
            keep = []
        self.store = self._new_store(adopt=True)
        self.store.restore([], keep, adopting=True)
        self._restoring = False
        self._lineage_due = True
        self._adopting = True
        self.stats.states_dropped += 1
        log.error(
            "the restored state could not be applied (%r): dropped; new lineage, live connections flagged adopted "
            "(flow_exporter_states_dropped_total; please report this with the log)",
            exc,
        )

    def _start_lineage(self) -> None:
        """A dropped state's new lineage (an empty snapshot that still adopts), and the snapshot that ends adopting."""
        if self._lineage_due:
            self._lineage_due = False
            self.checkpoint.new_lineage()
            self.snapshot()
            if self._save_schedule is not None and self.schedule is not None and self.schedule.changes:
                try:  # the new lineage's rows were kept under the same schedule
                    self._save_schedule(self.schedule)
                except OSError as exc:
                    log.error("sampling: the schedule could not be kept for the new lineage: %s", exc)
        if self._snapshot_due:
            self._snapshot_due = False
            self.snapshot()

    def attach_events(self, events: EventSource) -> None:
        """The event listener: its ``caught_up`` lets the sweep wait for DESTROY events queued until then."""
        self.events = events

    # ------------------------------------------------------------------ poll
    def _table_count(self) -> int:
        try:
            return self.source.count()
        except OSError:
            return 0

    def poll_once(self) -> int:
        """One dump and store update; returns the number of entries dumped.

        The first one after a restore is guarded: what the restored state makes it raise drops that state
        (:meth:`_drop_state`) and the poll starts over on the fresh store.
        """
        if not self._restoring:
            return self._poll()
        try:
            n = self._poll()
        except OSError:
            raise
        except Exception as exc:
            with self.lock:
                self._drop_state(exc)
            return self._poll()
        self._restoring = False
        return n

    def _poll(self) -> int:
        t0 = time.perf_counter()
        zones = self.zones or None
        store = self.store
        lock = self.lock
        # Room for the table as the kernel counts it, in one step (the last poll's count; before the first, read
        # now): not when zones filter it, as the count is every zone's.
        expected = 0 if zones else self.stats.table_count if self.stats.polls else self._table_count()
        with lock:
            if expected:
                store.reserve(min(expected, store.max_connections))
            store.begin_poll(self.wall_ns())

        zone_counts: Counter[int] = Counter()

        # Batch by batch, so the table never exists twice in memory.
        def consume(batch: list[Connection]) -> None:
            zone_counts.update(map(_zone, batch))  # table fill per zone, for the health stream
            with lock:
                store.update_batch(batch, self.clock(), self.wall_ns())

        def apply(buf: memoryview) -> DecodeResult:  # the compiled path: decoded and applied in one pass
            with lock:
                return store.apply_dump_buffer(buf, zones, self.clock(), self.wall_ns(), zone_counts)

        n = self.source.dump_buffers(apply, zones) if store.fused else None
        if n is None:
            n = self.source.dump_into(consume, zones)
        # An entry missing from the dump was deleted before the dump passed it, and the kernel sends
        # its DESTROY before deleting it: once the listener has drained its socket after now, every
        # such DESTROY is applied and the sweep ends those connections with their real final counters.
        events = self.events
        if events is not None and not events.caught_up(time.monotonic(), min(2.0, self.timeouts.poll_interval)):
            self.stats.barrier_timeouts += 1
        with lock:
            store.end_poll(self.clock(), self.wall_ns())
            if self._adopting and not self.store.adopt:  # a first complete poll: what it found is flagged
                self._adopting = False
                self._snapshot_due = True
        elapsed = time.perf_counter() - t0
        if self._timings is not None:
            self._timings.observe_poll(elapsed)
        s = self.stats
        s.polls += 1
        s.last_poll_seconds = elapsed
        s.zone_entries = dict(zone_counts)
        try:
            s.table_count = self.source.count()
            s.table_max = self.source.max_entries()
            s.kernel = self.source.kernel_stats()
        except OSError as exc:
            log.debug("conntrack count unavailable: %s", exc)
        if s.polls == 1:
            log.info("first poll: %s connections in %.2fs", f"{n:,}", elapsed)
            self.lifecycle.first_poll_done.set()
        if self.shedder is not None:
            self._shed()
        return n

    def _shed(self) -> None:
        """Adaptive shedding after a poll: a new level for new connections when the shedder calls for one.

        The change is kept in the state directory before it takes effect (a restart stamps the connections it
        continues from it); one that cannot be written is not made. It takes effect after every first-seen time
        the store has given, so each connection's level is the one of its first-seen time.
        """
        assert self.shedder is not None and self.schedule is not None and self.sampler is not None
        schedule = self.schedule
        with self.lock:
            rows = self.store.table.rows_by_level()
            built = self.store.stats.records_built
        change = self.shedder.observe(self.clock(), schedule.level, rows, built)
        if change is None:
            return
        with self.lock:
            t = max(self.wall_ns(), self.store.table._last_stamp + 1)
            was = schedule.probability_at(t)
            if self._save_schedule is not None:
                try:
                    self._save_schedule(Schedule(schedule.base, [*schedule.changes, (t, change.level)]))
                except OSError as exc:
                    self.stats.sampling_save_errors += 1
                    log.error("sampling: not changed to level %d: state.dir cannot keep it (%s)", change.level, exc)
                    return
            schedule.change(t, change.level)
            self.sampler.rescheduled()
        self.stats.sampling_changes += 1
        log.warning(
            "sampling: new connections now kept with probability %g (was %g): projected load %.2f of "
            "sampling.budget (%.0f connections, %.0f records/s at the current probability); change at %d ns",
            schedule.probability_at(t), was, change.load, change.rows, change.records_per_second, t,
        )  # fmt: skip

    def _last_poll(self) -> None:
        """One more dump before the final records, when there was a poll before (one attempt, never fatal)."""
        if not self.stats.polls:
            return  # stopped before the first poll (a broker never reached): nothing was tracked from a dump
        try:
            self.poll_once()
        except Exception as exc:
            log.warning("shutdown: the last dump failed (%s); final records carry the counts last polled", exc)

    def _poll_with_retry(self) -> None:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.stats.poll_errors += 1
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "conntrack dump failed (%s), retry %d in %.2fs",
                exc,
                state.attempt_number,
                state.next_action.sleep if state.next_action else 0,
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, OSError) and not self._is_fatal(e)),
            wait=tenacity.wait_exponential_jitter(multiplier=self._retry_initial, max=self._retry_max),
            stop=tenacity.stop_when_event_set(self.stop_event),
            sleep=sleep_on(self.stop_event),
            before_sleep=before_sleep,
            reraise=True,
        )
        retrying(self.poll_once)

    def poll_loop(self) -> None:
        interval = self.timeouts.poll_interval
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            self.lifecycle.beat("poll")
            try:
                self._poll_with_retry()
            except BaseException as exc:
                if self.stop_event.is_set() and not self._is_fatal(exc):
                    break
                self.fatal = exc
                self.stop_event.set()
                break
            next_tick += interval
            if time.monotonic() > next_tick:  # a poll longer than the interval: go on now, don't pile up
                next_tick = time.monotonic()
            while not self.stop_event.is_set():
                delay = next_tick - time.monotonic()
                if delay <= 0:
                    break
                if self._resync.wait(min(delay, 0.5)):
                    self._resync.clear()
                    self.stats.resyncs += 1
                    next_tick = time.monotonic()
                    break

    def apply_events(self, new: list[Connection], destroyed: list[Connection]) -> None:
        """Conntrack NEW/DESTROY events, from the event listener's thread (guarded as the first poll is)."""
        with self.lock:
            if not self._restoring:
                self.store.apply_events(new, destroyed, self.clock(), self.wall_ns())
                return
            try:
                self.store.apply_events(new, destroyed, self.clock(), self.wall_ns())
            except Exception as exc:
                self._drop_state(exc)
                self.store.apply_events(new, destroyed, self.clock(), self.wall_ns())

    def request_resync(self) -> None:
        """Events were lost: dump the whole table now rather than at the next tick."""
        self._resync.set()

    # ---------------------------------------------------------------- expire
    def _apply_reports(self) -> int:
        """Settle the sink's delivery reports in the store; returns how many records settled for good."""
        reports = self.sink.take_reports()
        if not reports:
            return 0
        now = self.clock()
        delivered = reports.delivered
        given_up: list[Export] = []
        store = self.store
        with self.lock:
            done = self.completeness
            done.settled_all(reports)
            # Each record touches only its connection's state: settling the delivered ones after the
            # others is the same as settling in report order.
            for r in reports.failed:
                if r.permanent:
                    given_up.append(r.export)
                    self._given_up(r.export, r.error)
                else:
                    log.debug("record not delivered (%s); the same record goes again", r.error)
                store.acknowledge(r.export, False, now, permanent=r.permanent)
            store.acknowledge_delivered(delivered, now)
        settled = delivered + given_up if given_up else delivered
        if settled:
            self.checkpoint.delivered(settled)
        return len(settled)

    def _given_up(self, export: Export, error: str | None) -> None:
        self.stats.records_given_up += 1
        now = time.monotonic()
        if now - self._given_up_logged_at >= 60.0:
            self._given_up_logged_at = now
            log.error(
                "a record was given up for good (%s): connectionId %d sequence %d is lost "
                "(counted in flow_exporter_records_given_up_total; logged at most once a minute)",
                error,
                export.flow_id,
                export.sequence,
            )

    def _send(self, exports: list[Export]) -> None:
        """Encode, journal, then produce: a record reaches Kafka only after the checkpoint knows it.

        Every record the store built is settled one way or another, so no connection waits
        forever on a record that never left: one that cannot be encoded is given up (counted,
        like a record Kafka refuses for good); if producing raises, the rest go again later.
        """
        sink = self.sink
        failures = sink.prepare_all(exports, self.wall_ns() // 1_000_000)  # one call for the batch
        ready = exports
        if failures:
            unencodable = {id(e) for e, _ in failures}
            ready = [e for e in exports if id(e) not in unencodable]
            for e, exc in failures:
                self._unencodable(e, exc)
        cp = self.checkpoint
        cp.sent(ready)
        if cp.stale:  # this journal write failed, and the old state could not be deleted: hold them back
            now = self.clock()
            with self.lock:
                for e in ready:
                    self.store.acknowledge(e, False, now)  # kept as built; the fresh snapshot will hold them
            return
        self.completeness.produced_all(ready)  # before produce: a delivery report may come at once
        try:
            sink.produce_all(ready)
        except Unsent as stop:
            now = self.clock()
            with self.lock:
                for rest in ready[stop.index :]:
                    self.store.acknowledge(rest, False, now)  # resent as the same bytes after a backoff
            raise (stop.__cause__ or stop) from None

    def _unencodable(self, export: Export, exc: Exception) -> None:
        self._given_up(export, f"cannot encode: {exc!r}")
        with self.lock:
            self.store.acknowledge(export, False, self.clock(), permanent=True)

    def snapshot(self) -> None:
        """Write the checkpoint (from the expire thread, which is also the journal's only writer)."""
        if not self.checkpoint.keeps:
            return  # nothing kept: no pass over the store
        with self.lock:  # the state of one moment, packed as it is read; written after
            packed = self.checkpoint.pack(self.store.reported(), self.store.in_flight())
        self.checkpoint.write(packed)

    def held_back(self) -> bool:
        """Records may not be produced: the state directory holds an old state it could not delete
        (a read-only volume), and one more record would make it lie. Until a snapshot succeeds."""
        return self.checkpoint.stale

    def expire_once(self) -> int:
        """Export everything that is due; returns the number of records produced."""
        self._start_lineage()
        self._apply_reports()
        if self.held_back():
            return 0  # as when Kafka is behind: due connections wait, coalescing, until a snapshot succeeds
        room = self.max_in_flight - self.sink.in_flight()
        if room <= 0:
            return 0  # Kafka is behind: due connections wait, coalescing, instead of piling up
        with self.lock:
            exports = self.store.expire(self.clock(), self.wall_ns(), limit=room)
        if exports:
            t0 = time.perf_counter()
            self._send(exports)
            if self._timings is not None:
                self._timings.observe_export(time.perf_counter() - t0)
        return len(exports)

    def expire_loop(self) -> None:
        """Export, snapshot and serve deliveries until stopped.

        Guarded: an unexpected error in one turn (a bug in encoding, say) is logged, counted and
        retried after a growing backoff, so export does not silently die while polling goes on;
        the records already built stay in the store and go out once a turn succeeds. A fatal
        producer error ends the loop: nothing could be delivered again, so the exporter turns
        not ready, flushes, keeps its state and exits non-zero for the DaemonSet to restart it.
        """
        cp = self.checkpoint
        backoff = 0.0
        while not self.stop_event.is_set():
            self.lifecycle.beat("expire")
            try:
                self.expire_once()
                if cp.due():
                    self.snapshot()
                with self.lock:
                    deadline = self.store.next_deadline()
                wait = 0.2 if deadline is None else min(max(deadline - self.clock(), 0.0), 0.2)
                self.sink.poll(wait)  # serves delivery callbacks while waiting
                backoff = 0.0
            except Exception:
                self.stats.expire_errors += 1
                backoff = min(max(backoff * 2, self._retry_initial), self._retry_max)
                log.exception("expire loop failed (%d so far); retrying in %.1f s", self.stats.expire_errors, backoff)
                self.stop_event.wait(backoff)
            fatal = self.sink.counters.fatal
            if fatal is not None and self.fatal is None:
                self.fatal = RuntimeError(f"kafka producer fatal error, exiting (state kept for the restart): {fatal}")
                self.stop_event.set()

    # ------------------------------------------------------------- readings
    def readings(self, extra: dict[str, float] | None = None) -> Readings:
        """Every counter, copied at one moment (for the metrics endpoint, from its thread)."""
        s = self.stats
        st = self.store.stats
        sc = self.sink.counters
        ev = self.events
        return Readings(
            table_count=s.table_count,
            table_max=s.table_max,
            zone_entries=dict(s.zone_entries),
            conntrack_kernel=dict(s.kernel),
            last_poll_seconds=s.last_poll_seconds,
            polls=s.polls,
            poll_errors=s.poll_errors,
            expire_errors=s.expire_errors,
            states_dropped=s.states_dropped,
            resyncs=s.resyncs,
            barrier_timeouts=s.barrier_timeouts,
            decode_skipped=self.source.skipped + (ev.skipped if ev is not None else 0),
            events_received=ev.received if ev is not None else 0,
            event_losses=ev.lost if ev is not None else 0,
            event_buffer_bytes=ev.rcvbuf_granted if ev is not None else 0,
            connections_tracked=len(self.store),
            connections_added=st.added,
            connections_added_from_events=st.added_from_events,
            connections_deleted=st.deleted,
            tuples_reused=st.reused_tuples,
            destroy_events=st.destroyed_events,
            late_events_continued=st.resurrected,
            late_destroys_dropped=st.late_destroys_dropped,
            counter_resets=st.counter_resets,
            connections_restored=st.restored,
            connections_restored_gone=st.restored_gone,
            connections_readmitted=st.readmitted,
            tombstones_dropped_early=st.tombstones_dropped_early,
            unreported_ends=st.unreported_ends,
            given_up=dict(st.given_up),
            records_built=st.records_built,
            records_resent=st.resends,
            records_in_flight=self.sink.in_flight(),
            records_produced=sc.produced,
            records_acknowledged=sc.acked,
            records_failed=sc.failed,
            records_given_up=s.records_given_up,
            bytes_produced=sc.bytes_produced,
            checkpoint=self.checkpoint.readings(),
            kafka_client=sc.client,
            delivery_failures=dict(sc.failures_by_error),
            extra=extra or {},
            source=self.options.source,
            sampling_probability=(
                self.schedule.probability if self.schedule is not None else self.options.sampling_probability
            ),
            sampling_changes=self.stats.sampling_changes,
            connections_sampled_out=self.sampler.dropped if self.sampler is not None else 0,
        )

    # ------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Run until ``stop_event`` is set, then shut down; returns the exit code."""
        threads = [
            threading.Thread(target=self.poll_loop, name="poll", daemon=True),
            threading.Thread(target=self.expire_loop, name="expire", daemon=True),
        ]
        for t in threads:
            t.start()
        self.stop_event.wait()
        # The grace period runs from the signal, not from when the loops have wound down;
        # a second of it is kept for the process to exit.
        deadline = time.monotonic() + max(self.grace - 1.0, self.grace / 2)
        for t in threads:
            t.join()
        self._start_lineage()
        if self.fatal is not None:
            log.error("%s", self.fatal)
            self.sink.flush(min(5.0, max(deadline - time.monotonic(), 0)))
            self._apply_reports()
            self.snapshot()  # what was built is kept for the next start
            return 1
        return self.shutdown(deadline)

    def shutdown(self, deadline: float | None = None) -> int:
        """Final records (flowEndReason 4) for every connection, delivered within the grace period.

        A last dump comes first (:meth:`_last_poll`): the final records carry the counts of now, not of
        the last poll, and every connection known only from its NEW event learns the kernel's start,
        so the checkpoint row its final record leaves names its incarnation and the next process
        continues it instead of meeting it as new (README, "met again").
        """
        if deadline is None:
            deadline = time.monotonic() + self.grace
        self.lifecycle.shutting_down(deadline)
        self._last_poll()
        # Connections with a record in flight get their final one once it settles,
        # so no counts are sent twice.
        sent = 0
        cp = self.checkpoint
        while True:
            if cp.stale and cp.due():
                self.snapshot()  # held back until one succeeds (the records built so far are in it)
            # Within limits.maxInFlight, as the expire loop: a large table's final records in rounds.
            room = max(self.max_in_flight - self.sink.in_flight(), 0)
            with self.lock:
                exports = self.store.export_all(self.clock(), FORCED_END, limit=room) if room else []
            if exports:
                sent += sum(1 for e in exports if e.attempts == 0)  # resends are not new records
                self._send(exports)
            remaining = max(deadline - time.monotonic(), 0)
            # The cap cut this round: more final records are waiting. Serve deliveries briefly and build again,
            # so the producer's queue stays full (a full drain per round was slower; the final records' time at 1M,
            # measured: docs/performance.md#targets-issue-24-a-million-connections-the-hot-path-compiled).
            more = room > 0 and len(exports) >= room
            self.sink.flush(min(remaining, 0.05 if more else 1.0))
            delivered = self._apply_reports() > 0  # settled for good (a sink that discards counts no acks)
            if more and delivered and time.monotonic() < deadline:
                continue
            with self.lock:
                left = self.store.unfinished()
            if left == 0 or time.monotonic() >= deadline:
                break
            if exports and not delivered and not self.sink.in_flight():
                # Every record came straight back failed (a broker that refuses at once):
                # pause before sending the same bytes again rather than spin.
                time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        self.sink.flush(0)
        self._apply_reports()
        with self.lock:
            left = self.store.unfinished()
        if left:
            self.sink.purge()  # so closing the producer does not wait on a broker that is gone
            self._apply_reports()  # purged records come back as failed: they stay in the store
        self.outcome.final_records = sent
        self.snapshot()  # also when a write failed before: the disk may have room again
        if cp.stale:
            self.outcome.kept = left
            log.error(
                "shutdown: state.dir could not be written, %d records held back (not produced); the next start "
                "continues every connection exactly from the old state there",
                left,
            )
        elif cp.keeps and not cp.broken:
            self.outcome.kept = left
            if left:
                log.warning(
                    "shutdown: grace period over, %d records not delivered; kept in the state directory, "
                    "the next start sends them",
                    left,
                )
            else:
                log.info("shutdown: %d final records delivered", sent)
        elif left:
            self.outcome.lost = left
            log.error("shutdown: grace period over, %d connections' final records were not delivered", left)
        else:
            log.info("shutdown: %d final records delivered", sent)
        sc = self.sink.counters
        # The process's whole account, the one line a user can hold the topic against after exit (the metrics
        # endpoint is gone by then): every acknowledged record is on the topic, once per (connectionId, sequence).
        log.info(
            "shutdown: %d records built; Kafka acknowledged %d, refused %d for good; %d deliveries failed and were "
            "resent", self.store.stats.records_built, sc.acked, self.stats.records_given_up, self.store.stats.resends,
        )  # fmt: skip
        return 0
