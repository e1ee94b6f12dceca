"""Wiring for ``flow-exporter run``: config in, conntrack source and Kafka sink built, loops run.

Kept apart from :mod:`flow_exporter.app` so the loops stay testable with any source and sink.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import KafkaException

from flow_exporter import compiled, gc_policy, sampling_state
from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.checkpoint import Checkpoint, CheckpointError, Loaded
from flow_exporter.completeness import Completeness
from flow_exporter.config import ConfigError, Settings, this_node
from flow_exporter.conntrack.errors import is_fatal
from flow_exporter.conntrack.events import ConntrackEvents
from flow_exporter.flow import BOTH_DIRECTIONS
from flow_exporter.lifecycle import Lifecycle
from flow_exporter.listener import Listener
from flow_exporter.metrics import Metrics
from flow_exporter.ports import Sink, Source
from flow_exporter.probes import liveness, readiness, routes
from flow_exporter.readings import Readings
from flow_exporter.sampling import Schedule
from flow_exporter.shedding import Budget
from flow_exporter.sink import KafkaSink
from flow_exporter.sink.discard import DiscardSink
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.sink.kafka import redact
from flow_exporter.sink.registry import ensure_registered, with_registry
from flow_exporter.sink.streams import HealthStream, MarkerStream
from flow_exporter.timeouts import Timeouts

log = logging.getLogger(__name__)

# export.prefixCache auto: prefixes are kept when the active timeout is below this. A kept prefix costs memory per
# active connection and saves rebuilding it at each record, which pays only when records are frequent (measured at
# 1M connections, active 60 s, and 250k, active 5 s: docs/performance.md, "Targets", and docs/operations/sizing.md).
PREFIX_CACHE_BELOW = 30.0


def build_sink(settings: Settings, lifecycle: Lifecycle | None = None, schedule: Schedule | None = None) -> KafkaSink:
    lifecycle = lifecycle or Lifecycle()
    routes = settings.kafka.routes
    return KafkaSink(
        # librdkafka's own log lines through Python logging, so --log-format json holds for them too.
        {"logger": logging.getLogger("flow_exporter.rdkafka"), **settings.producer_config()},
        settings.kafka.topic,
        # Confluent framing if a registry is set, a subject per topic.
        with_registry(
            settings,
            RecordEncoder(
                this_node(settings),
                settings.community_id.seed,
                settings.cluster_name,
                dict(settings.record.attributes),
                settings.sampling.probability,
                schedule,
            ),
            [settings.kafka.topic, *(r.topic for r in routes)],
        ),
        routes,
        retry_initial=settings.retry.initial_backoff,
        retry_max=settings.retry.max_backoff,
        stopping=lifecycle.stopping,
        on_wait=partial(lifecycle.beat, "expire"),  # blocked on a full queue is still alive
    )


def timeouts_from(settings: Settings) -> Timeouts:
    return Timeouts.normalized(
        settings.conntrack.poll_interval, settings.expiry.active_timeout, settings.expiry.idle_timeout
    )


def options_from(settings: Settings, *, adopt: bool, source: str = "netfilter") -> ExporterOptions:
    """The loops' settings from the config (``adopt``: no state to continue from; ``source``: the one chosen)."""
    timeouts = timeouts_from(settings)
    cache = settings.export.prefix_cache
    return ExporterOptions(
        timeouts=timeouts,
        node_name=this_node(settings),
        zones=frozenset(settings.conntrack.zones),
        retry_initial=settings.retry.initial_backoff,
        retry_max=settings.retry.max_backoff,
        grace=settings.shutdown.grace,
        max_connections=settings.limits.max_connections,
        max_in_flight=settings.limits.max_in_flight,
        cache_prefixes=timeouts.active < PREFIX_CACHE_BELOW if cache is None else cache,
        adopt=adopt,
        source_flags=BOTH_DIRECTIONS if source == "cilium" and settings.cilium.counters == "combined" else 0,
        source=source,
        sampling_probability=settings.sampling.probability,
        sampling_seed=settings.sampling.seed,
        sampling_budget=budget_from(settings),
        sampling_interval=settings.sampling.adjust_interval,
        sampling_max_level=settings.sampling.max_halvings,
    )


def budget_from(settings: Settings) -> Budget:
    """sampling.budget.*: adaptive shedding when either is set."""
    return Budget(settings.sampling.budget.connections, settings.sampling.budget.records_per_second)


def chosen_source(settings: Settings) -> str:
    """``conntrack.source`` resolved: ``auto`` is cilium when Cilium's maps are pinned under ``cilium.bpffs``."""
    from flow_exporter.cilium.source import maps_pinned

    kind = settings.conntrack.source
    if kind == "auto":
        kind = "cilium" if maps_pinned(settings.cilium.bpffs) else "netfilter"
        log.info("conntrack.source auto: %s (Cilium's CT maps %s under %s)", kind,
                 "pinned" if kind == "cilium" else "not pinned", settings.cilium.bpffs)  # fmt: skip
    return kind


ATTEMPT_TIMEOUT = 10.0  # how long one metadata request may wait for a broker (the log says how long it took)


def stopped_before_kafka(exporter: Exporter, kept: bool) -> int:
    """Stopped while waiting for Kafka: no record was sent. Say what that leaves, in one closing line (exit 0).

    Events were applied meanwhile: the connections still live are reported by the next start (``kept``: the state
    directory continues the lineage; else they are found live, as after any restart without one); the ones that
    ended meanwhile are not, and are counted here."""
    with exporter.lock:
        tracked = len(exporter.store)
        ended = exporter.store.stats.destroyed_events
    exporter.snapshot()
    where = "the state directory is kept" if kept else "no state.dir"
    log.warning(
        "stopped before Kafka answered: no flow record was sent; %d connections known (the live ones are reported "
        "by the next start: %s), %d of them ended meanwhile and are not reported",
        tracked, where, ended,
    )  # fmt: skip
    return 0


def check_topics(sink: KafkaSink, stop: threading.Event, initial: float, maximum: float) -> bool:
    """Wait (with backoff) until the broker answers and every topic exists and is usable; False if stopped first.

    A missing topic, or one an ACL hides from this client, is an operator's mistake, not a crash: it is
    reported clearly (which of the two) and retried, so the pod does not crash-loop while someone fixes it.
    """
    delay = initial
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            unusable = sink.unusable_topics(timeout=ATTEMPT_TIMEOUT)
        except KafkaException as exc:
            log.warning("kafka not reachable after %.1f s (%s); next attempt in %.1f s", time.monotonic() - t0,
                        exc.args[0], delay)  # fmt: skip
        else:
            if not unusable:
                log.info("broker reachable, topics present: %s", ", ".join(sorted(sink.topics())))
                return True
            missing = sorted(t for t, why in unusable.items() if why == "missing")
            refused = sorted(f"{t}: {why}" for t, why in unusable.items() if why != "missing")
            if missing:
                log.error(
                    "kafka topic(s) missing: %s (create them, or enable auto-creation); retrying in %.1fs",
                    ", ".join(missing),
                    delay,
                )
            if refused:
                log.error(
                    "kafka topic(s) not usable: %s (check the ACLs of this client's principal); retrying in %.1fs",
                    ", ".join(refused),
                    delay,
                )
        stop.wait(delay)
        delay = min(delay * 2, maximum)
    return False


def start_listener(
    settings: Settings, metrics: Metrics | None, exporter: Exporter, enricher: Any = None, namer: Any = None
) -> Listener | None:
    """/metrics, /healthz and /readyz, unless metrics.port is 0 (then ``metrics`` is None)."""
    if metrics is None:
        return None
    caches_ready: Callable[[], bool] | None = None
    if enricher is not None:
        caches_ready = enricher.caches.ready.is_set

    def read() -> Readings:
        extra: dict[str, float] = {}
        if enricher is not None:
            st = enricher.stats
            extra.update(enrichment_lookups=st.lookups, enrichment_misses=st.misses, enrichment_errors=st.errors,
                         labels_truncated=st.truncated_labels)  # fmt: skip
        if namer is not None:
            nf = namer.networks
            extra.update(networks_named=namer.named, networks_reloads=nf.reloads,
                         networks_reload_errors=nf.reload_errors)  # fmt: skip
        return exporter.readings(extra)

    metrics.bind(read)
    sink = exporter.sink
    # Records waiting kafka.readyTimeout with no delivery (a topic ACL removed, say): not ready; 0 turns it off.
    ready_timeout = settings.kafka.ready_timeout
    stalled = partial(sink.health.stalled, ready_timeout) if isinstance(sink, KafkaSink) and ready_timeout else None
    # A poll may wait out the longest retry backoff; only silence beyond that is a hang.
    silence = max(3 * settings.conntrack.poll_interval, 60.0) + settings.retry.max_backoff
    ready = readiness(
        exporter.lifecycle,
        lambda: sink.counters.connected,
        caches_ready,
        lambda: sink.counters.fatal,
        stalled,
        held_back=exporter.held_back,
    )
    metrics.bind_ready(lambda: ready()[0])  # flow_exporter_ready: what /readyz answers, for the alerts
    try:
        server = Listener(
            routes(metrics, liveness(exporter.lifecycle, silence), ready),
            settings.metrics.address,
            settings.metrics.port,
        )
    except OSError as exc:
        log.error(
            "config metrics.address=%s metrics.port=%d: cannot listen: %s",
            settings.metrics.address, settings.metrics.port, exc.strerror or exc,
        )  # fmt: skip
        raise SystemExit(2) from None
    server.start()
    log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.metrics.address, server.port)
    return server


def start_health_stream(settings: Settings, exporter: Exporter) -> HealthStream | None:
    """ConntrackHealth records (flow_exporter.conntrack_health) on a producer of their own, when health.topic is set."""
    topic = settings.health.topic
    if not topic:
        return None
    return HealthStream(
        settings.producer_config(), exporter.readings, topic,
        node=this_node(settings), interval=settings.health.interval, flows=settings.export.flows,
    )  # fmt: skip


def start_markers(settings: Settings, exporter: Exporter, completeness: Completeness | None) -> MarkerStream | None:
    """Completeness markers every markers.interval, when markers.topic is set and flows are exported."""
    topic = settings.markers.topic
    if completeness is None or not topic:
        return None
    return MarkerStream(
        settings.producer_config(), exporter.readings, completeness, topic,
        node=this_node(settings), interval=settings.markers.interval,
    )  # fmt: skip


def start_events(settings: Settings, exporter: Exporter, source: str = "netfilter") -> ConntrackEvents | None:
    """The NEW/DESTROY listener, when on (netfilter only: Cilium's maps have no events); polling alone goes on if it
    cannot start."""
    if not settings.conntrack.events or source != "netfilter":
        return None
    try:
        events = ConntrackEvents(
            exporter.apply_events,
            exporter.request_resync,
            netns=settings.conntrack.netns,
            zones=settings.conntrack.zones or None,
            rcvbuf=settings.conntrack.event_buffer,
            rcvbuf_max=settings.conntrack.event_buffer_max,
        )
    except OSError as exc:
        log.warning("conntrack events unavailable (%s); short-lived flows may be missed", exc)
        return None
    events.start()
    exporter.attach_events(events)
    return events


def table_name(settings: Settings, source: str) -> str:
    """The table a state directory continues: a state written from another table (another netns, or the other
    source) is not continued. Nor is one written under other sampling: its rows were kept by another rule, and
    their records would carry a probability they were not kept with (the seed shows as a digest, never itself)."""
    name = "cilium:" + settings.cilium.bpffs if source == "cilium" else settings.conntrack.netns or ""
    p = settings.sampling.probability
    if p < 1:
        seed = hashlib.blake2b(settings.sampling.seed.encode(), digest_size=6, person=b"state-dir").hexdigest()
        name += f" sampled:{p!r}:{seed}"
    return name


def save_schedule(checkpoint: Checkpoint, schedule: Schedule) -> None:
    """Adaptive shedding's schedule into the state directory, for the checkpoint's lineage (sampling_state)."""
    sampling_state.save(checkpoint.dir, checkpoint.lineage, schedule)


def open_state(
    settings: Settings, stop: threading.Event, source: str = "netfilter"
) -> tuple[Checkpoint | None, Loaded | None]:
    """The state directory, locked and loaded; (None, None) without one, or when stopped while waiting."""
    directory = settings.state.dir
    if not directory:
        log.warning(
            "no state.dir: after a restart, connections found live are reported again under new "
            "connectionIds, flagged adopted (see README, Counting: the contract)"
        )
        return None, None
    cp = Checkpoint(directory, table=table_name(settings, source))
    if not cp.lock(stop):
        return None, None
    loaded = cp.load()
    if loaded.valid and budget_from(settings).enabled:
        try:
            loaded.sampling_changes = sampling_state.load(cp.dir, loaded.lineage, settings.sampling.probability)
        except sampling_state.ScheduleError as exc:
            why = f"the sampling schedule beside it cannot be read ({exc}): its connections' probabilities are unknown"
            loaded = Loaded(os.urandom(8), why=why)
            cp.lineage = loaded.lineage
    if loaded.valid:
        log.info("state.dir %s: continuing: %s", directory, loaded.why)
    else:
        log.warning(
            "state.dir %s: nothing to continue (%s); new lineage, live connections flagged adopted",
            directory,
            loaded.why,
        )
    cp.begin(loaded)
    return cp, loaded


def preflight(settings: Settings) -> tuple[Any, Any]:
    """What ``run`` checks before anything starts, beyond the settings themselves (``config --print`` runs it too):
    the API server configuration when enrichment is on, and the networks file. (API configuration or None,
    NetworkFile or None); ConfigError (exit 2) naming the setting."""
    api = None
    if settings.k8s.enabled:  # no API server configuration is a config error
        from flow_exporter.k8s import api_configuration

        api = api_configuration(settings)
    networks = None
    path = settings.networks.file
    if path:  # a bad file is a config error
        from flow_exporter.network_file import NetworkFile
        from flow_exporter.networks import NetworkError

        try:
            networks = NetworkFile(path, settings.networks.max_prefixes, settings.networks.reload_interval)
        except NetworkError as exc:
            reason = str(exc).removeprefix(f"networks.file {path}: ")
            raise ConfigError("networks.file", path, reason) from None
        except OSError as exc:
            raise ConfigError("networks.file", path, exc.strerror or str(exc)) from None
    return api, networks


def run_exporter(settings: Settings, install_signals: Callable[[threading.Event], None] | None = None) -> int:
    from flow_exporter.conntrack.dumper import ConntrackDumper
    from flow_exporter.conntrack.errors import ConntrackError, ConntrackPermissionError
    from flow_exporter.conntrack.sysctl import enable_accounting

    gc_policy.tune()
    try:
        api, networks = preflight(settings)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    netns = settings.conntrack.netns
    log.info(
        "flow-exporter starting: node=%s netns=%s kafka=%s (%s) topic=%s build=%s",
        this_node(settings),
        netns or "(own)",
        redact(settings.producer_config()).get("bootstrap.servers"),
        settings.kafka.security_protocol,
        settings.kafka.topic,
        compiled.describe(),
    )
    if not settings.conntrack.compiled:
        log.warning(
            "conntrack.compiled: false has no effect: the build is chosen once, at start (build=%s above); "
            "FLOW_EXPORTER_INTERPRETED=1 runs the interpreted one",
            compiled.describe(),
        )
    if networks is not None:
        log.info("networks.file %s: %d prefixes, %d names", networks.path, networks.table.prefixes,
                 networks.table.names)  # fmt: skip
    kind = chosen_source(settings)
    source: Source
    if kind == "cilium":
        from flow_exporter.cilium.bpf_maps import BpfMapError
        from flow_exporter.cilium.source import CiliumSource

        try:
            source = CiliumSource(settings.cilium.bpffs, settings.cilium.counters, settings.cilium.clock)
        except BpfMapError as exc:
            log.error("cannot read Cilium's CT maps: %s", exc)
            return 1
        log.info("source: Cilium's CT maps under %s (counters %s, clock %s); no events: a connection that starts "
                 "and ends between two polls is not seen", settings.cilium.bpffs, settings.cilium.counters,
                 settings.cilium.clock)  # fmt: skip
    else:
        if settings.conntrack.set_sysctls:
            for warning in enable_accounting(netns):
                log.warning("%s", warning)
        try:
            source = ConntrackDumper(netns=netns)
        except ConntrackError as exc:
            log.error("cannot open conntrack: %s", exc)
            return 1
        try:  # nfnetlink asks CAP_NET_ADMIN of every message: a pod without it stops now, not after Kafka answers
            source.count()
        except ConntrackPermissionError as exc:
            source.close()
            log.error("cannot read conntrack (%s): the exporter needs CAP_NET_ADMIN in the node's network namespace "
                      "(k8s/daemonset.yaml; README, Run it on a cluster)", exc)  # fmt: skip
            return 2
    # Every service registers its stop as it starts; they stop in the reverse order, however this ends.
    with contextlib.ExitStack() as services:
        services.callback(source.close)
        lifecycle = Lifecycle()
        stop = lifecycle.stop_event
        if install_signals is not None:
            install_signals(stop)
        try:
            checkpoint, loaded = open_state(settings, stop, kind)
        except CheckpointError as exc:
            log.error("%s", exc)
            return 2
        if checkpoint is not None:
            services.callback(checkpoint.close)
        if stop.is_set():
            return 0
        flows = settings.export.flows
        schedule = None  # adaptive shedding's levels: the state directory's, when continued
        if budget_from(settings).enabled:
            schedule = Schedule(settings.sampling.probability, loaded.sampling_changes if loaded else [])
        sink: Sink = build_sink(settings, lifecycle, schedule) if flows else DiscardSink()
        metrics = Metrics(settings) if settings.metrics.port else None
        markers_topic = settings.markers.topic if flows else None
        completeness = Completeness(settings.kafka.topic, time.time_ns() // 1_000_000) if markers_topic else None
        enricher = None
        if api is not None:  # caches fill in the background; records go out meanwhile
            from flow_exporter.k8s import start_enricher

            enricher = start_enricher(settings, api)
        namer = None
        on_new: Any = enricher
        if networks is not None:
            from flow_exporter.network_file import NetworkNamer

            namer = NetworkNamer(networks)
            if enricher is not None:
                enricher.decorate = namer.decorate
            else:
                on_new = namer
            services.callback(networks.start().stop)
        exporter = Exporter(
            source,
            sink,
            options_from(settings, adopt=not (loaded and loaded.valid) or loaded.adopting, source=kind),
            is_fatal=is_fatal,
            on_new=on_new,
            checkpoint=checkpoint,
            lifecycle=lifecycle,
            timings=metrics,
            completeness=completeness,
            schedule=schedule,
            save_schedule=None if checkpoint is None else partial(save_schedule, checkpoint),
        )
        if loaded is not None and loaded.valid:
            exporter.restore(loaded.rows, loaded.resends, adopting=loaded.adopting)
        for start in (
            partial(start_listener, settings, metrics, exporter, enricher, namer),
            partial(start_events, settings, exporter, kind),
            partial(start_health_stream, settings, exporter),
            partial(start_markers, settings, exporter, completeness),
        ):
            service = start()  # registered before the next one starts: a failure stops those before it
            if service is not None:
                services.callback(service.stop)
        if isinstance(sink, KafkaSink):
            if settings.kafka.check_topics and not check_topics(
                sink, exporter.stop_event, settings.retry.initial_backoff, settings.retry.max_backoff
            ):
                return stopped_before_kafka(exporter, checkpoint is not None)
            if not ensure_registered(sink.encode, exporter.stop_event):  # after /healthz is up: waiting is not dying
                return stopped_before_kafka(exporter, checkpoint is not None)
        else:
            log.info("flow export off (export.flows=false): connections are tracked, no flow record is sent")
        return exporter.run()
