"""export.prefixCache: a store that keeps no record prefix sends the same bytes, and holds none between records.

The cache trades memory (~160 bytes per active connection) for CPU (the prefix is not rebuilt at each record);
it must change nothing a consumer sees. Both stores see the same connections, polls and deliveries, on the
pure and the compiled paths, and their records are encoded by the same encoder.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flow_exporter.config import ConfigError, load
from flow_exporter.runner import options_from
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.store_builders import NS, tcp, udp

PATHS = [False, True]  # the reference store, and the one with the fused poll and the bulk admission
TIMEOUTS = Timeouts(active=5.0, idle=15.0)


@pytest.mark.parametrize("compiled", PATHS, ids=lambda c: "compiled" if c else "pure")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["traffic", "mark", "labels", "tick", "poll", "expire", "fail"]),
            st.integers(0, 3),
            st.integers(1, 9),
        ),
        min_size=3,
        max_size=40,
    )
)
def test_no_cache_sends_the_same_bytes_and_keeps_no_prefix(compiled: bool, ops: list[tuple[str, int, int]]) -> None:
    stores = [
        ConnectionStore(TIMEOUTS, id_seed=b"P" * 8, compiled=compiled, cache_prefixes=cache) for cache in (True, False)
    ]
    encoder = RecordEncoder("node-a", cluster="c1")
    conns = {i: (tcp(10 + i) if i % 2 else udp(20 + i)) for i in range(4)}
    now = 1000.0
    sent: list[list[bytes]] = [[], []]
    kept = [0, 0]

    def poll() -> None:
        for store in stores:
            store.begin_poll(int(now * NS))
            store.update_batch(list(conns.values()), now, int(now * NS))
            store.end_poll(now, int(now * NS))

    def expire(fail: int) -> None:
        for k, store in enumerate(stores):
            out = store.expire(now, int(now * NS))
            sent[k].extend(encoder.encode(e, 1_700_000_000_000) for e in out)
            for j, e in enumerate(out):
                store.acknowledge(e, j % 3 != fail, now)
            kept[k] += sum(p is not None for p in store.table._prefix)

    poll()
    for op, i, arg in ops:
        c = conns[i]
        if op == "traffic":
            conns[i] = replace(c, orig_packets=c.orig_packets + arg, orig_bytes=c.orig_bytes + 100 * arg)
        elif op == "mark":  # the prefix holds the mark: a cached one goes
            conns[i] = replace(c, mark=arg)
        elif op == "labels":
            conns[i] = replace(c, labels=bytes([arg]) * 16)
        elif op == "tick":
            now += arg
        elif op == "poll":
            poll()
        else:
            expire(1 if op == "fail" else -1)
    for _ in range(3):  # every connection active again, every record delivered (resends too)
        conns = {i: replace(c, orig_packets=c.orig_packets + 1) for i, c in conns.items()}
        now += 61
        poll()
        expire(-1)
    assert sent[0] == sent[1]
    assert kept[1] == 0 and all(p is None for p in stores[1].table._prefix)
    assert kept[0] > 0  # the caching store did keep prefixes: the two differ only in that


def test_auto_keeps_prefixes_only_while_records_are_frequent() -> None:
    def resolved(**values: str) -> bool:
        cfg = load(environ={f"FLOW_EXPORTER_{k}": v for k, v in values.items()})
        return options_from(cfg, adopt=True).cache_prefixes

    assert resolved() is True  # the default active timeout, 5 s
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="29s") is True
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="30s") is False
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="60s") is False  # the DaemonSet's
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="60s", EXPORT_PREFIX_CACHE="true") is True
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="5s", EXPORT_PREFIX_CACHE="off") is False
    assert resolved(EXPIRY_ACTIVE_TIMEOUT="60s", EXPORT_PREFIX_CACHE="auto") is False


def test_a_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"export\.prefixCache.*'sometimes'.*auto, true or false"):
        load(environ={"FLOW_EXPORTER_EXPORT_PREFIX_CACHE": "sometimes"})
