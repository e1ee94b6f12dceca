"""A sink's delivery callbacks and its produce loop, written once (issue 39) in Cython's pure-Python mode.

``Deliveries`` is what :class:`flow_exporter.sink.kafka.KafkaSink` hands librdkafka for each record
(``for_record``: the ``on_delivery`` callable of one record). A delivered record, its partition and its
offset are appended at once to three lists, in report order (:meth:`Deliveries.take` hands them over as
a :class:`~flow_exporter.ports.Reports`); its accounting (the sink's acked count, the topic's health) is
added up while the records delivered in a row go to one topic, and handed to ``on_run(topic, st, count)``
when the topic changes, before a failure's report, and at :meth:`Deliveries.settle` (the sink settles after every
poll and flush, before anyone reads the counts). A failed record goes to ``on_failed(export, topic,
st, err, msg)`` in its turn.

:func:`produce_run` is the sink's produce loop for one run of records to one topic.

Why compiled: bench/bench_app_export.py measured the per-record callable (a ``functools.partial``,
which the garbage collector tracks) and a Python callback as a large part of the record path (measured:
docs/performance.md#the-compiled-record-path-issue-24-before-and-after); the plain confluent-kafka loop it
is compared with pays for one plain function call per record.
Compiled, a ``Delivery`` is a small object the collector does not track (it holds a record, two names
and its owner; nothing refers back to it but librdkafka's queue) and calling it runs no Python frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flow_exporter.export import Export

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # a record's fields read as struct members, once checked to be an Export
    from cython.cimports.flow_exporter.export import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        as_export,
    )
else:
    from flow_exporter.export import as_export

__all__ = ["Deliveries", "Delivery", "produce_run"]


@cython.final
@cython.cclass
class Deliveries:
    """The delivery callbacks of one sink, the answers collected since :meth:`take`, and the run of delivered
    records not yet accounted.

    ``failed``: the records not delivered, each a :class:`~flow_exporter.ports.DeliveryReport`; the sink
    appends to it too (a record refused before it was queued)."""

    on_failed: Callable[[Any, str, Any, Any, Any], None]
    on_run: Callable[[str, Any, int], None]
    reports_type: Callable[..., Any]
    delivered: list[Any]
    partitions: list[Any]
    offsets: list[Any]
    failed: list[Any]
    run_topic: Any
    run_st: Any
    run_n: int

    def __init__(
        self,
        on_failed: Callable[[Any, str, Any, Any, Any], None],
        on_run: Callable[[str, Any, int], None],
        reports_type: Callable[..., Any],
    ) -> None:
        """``reports_type(delivered, partitions, offsets, failed)``: what :meth:`take` hands over
        (:class:`flow_exporter.ports.Reports`)."""
        self.on_failed = on_failed
        self.on_run = on_run
        self.reports_type = reports_type
        self.delivered, self.partitions, self.offsets, self.failed = [], [], [], []
        self.run_topic = None
        self.run_st = None
        self.run_n = 0

    def for_record(self, export: Any, topic: str, st: Any) -> Delivery:
        """The ``on_delivery`` callable of one record."""
        d: Delivery = Delivery.__new__(Delivery)
        d.owner = self
        d.export = export
        d.topic = topic
        d.st = st
        return d

    def take(self) -> Any:
        """The answers collected so far (a ``reports_type``); the next ones are collected afresh."""
        taken = self.reports_type(self.delivered, self.partitions, self.offsets, self.failed)
        self.delivered, self.partitions, self.offsets, self.failed = [], [], [], []
        return taken

    def settle(self) -> None:
        """Hand the delivered records' accounting so far to ``on_run``."""
        if self.run_n:
            topic, st, n = self.run_topic, self.run_st, self.run_n
            self.run_topic = self.run_st = None
            self.run_n = 0
            self.on_run(topic, st, n)


@cython.final
@cython.no_gc  # it refers to no object that refers back to it: librdkafka's queue alone holds it
@cython.cclass
class Delivery:
    """One record's delivery callback (:meth:`Deliveries.for_record`)."""

    owner: Deliveries
    export: Any
    topic: str
    st: Any

    def __call__(self, err: Any, msg: Any) -> None:
        d: Deliveries = self.owner
        if err is not None:
            d.settle()  # the records delivered before it are accounted first, as reported
            d.on_failed(self.export, self.topic, self.st, err, msg)
            return
        if d.run_n and d.run_st is not self.st:
            d.settle()
        partition = msg.partition()  # both asked first: a message that raises leaves the three lists alike
        offset = msg.offset()
        # the record and where it went, on three lists: no object made per record
        d.delivered.append(self.export)
        d.partitions.append(partition)
        d.offsets.append(offset)
        if d.run_n == 0:
            d.run_topic = self.topic
            d.run_st = self.st
        d.run_n += 1


def produce_run(
    exports: list[Export],
    start: cython.Py_ssize_t,
    produce: Callable[..., None],
    for_record: Callable[[Any, str, Any], Any],
    topics: dict[str, Any],
    refused: Any,
) -> tuple[int, int, int, Any, BaseException | None, bool]:
    """The sink's produce loop from ``start``, for one run of records to one topic.

    Each record prepared (value and topic set) whose topic the sink knows (``topics``: name ->
    TopicHealth) is handed to ``produce(topic, value, key, on_delivery=for_record(export, topic, st))``.
    Returns ``(stop, count, size, st, error, slow)``: it stops at ``stop``, the end of the batch, or a
    record of another topic (the caller adds this run's ``count`` records and ``size`` bytes to ``st``'s
    accounting and calls again from there), or a record for the sink's full path (``slow``: not
    prepared, an unknown topic, or a produce that raised one of ``refused``; nothing was queued), or a
    produce that raised anything else (``error``: the caller stops the batch there, after the run so far
    is counted, which is why even an interrupt is taken and handed back rather than raised here).
    """
    i: cython.Py_ssize_t = start
    count: cython.Py_ssize_t = 0
    size: cython.Py_ssize_t = 0
    run_st: Any = None
    error: BaseException | None = None
    slow = False
    while i < len(exports):
        e: Export = as_export(exports[i])
        value = e.value
        topic = e.topic
        st = topics.get(topic) if topic is not None else None
        if value is None or topic is None or st is None:
            slow = True
            break
        if run_st is not None and st is not run_st:
            break  # the next run
        length: cython.Py_ssize_t
        try:
            length = len(value)
            produce(topic, value, e.key, on_delivery=for_record(e, topic, st))
        except refused:
            slow = True
            break
        except BaseException as exc:
            error = exc
            break
        run_st = st
        count += 1
        size += length
        i += 1
    return i, count, size, run_st, error, slow
