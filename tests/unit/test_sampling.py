"""Consistent connection sampling (flow_exporter/sampling.py) against independent statements of its rule.

The hash is held to the ``siphash24`` package (a C implementation of SipHash-2-4, independent of ours) on the
40 bytes the README says are hashed, built here from the addresses with ``ipaddress``; the decision to that hash below
floor(p * 2**64). Both builds of the sampler (compiled and interpreted) are held to it, and the fused poll's
decision (read from the dump's bytes) to the Connections' (test_native's lockstep, sampled). The estimator a
consumer applies (sum of count / p) is shown unbiased over many seeds, with the variance the README states.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import struct
from fractions import Fraction
from typing import Any

import pytest
import siphash24
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flow_exporter import compiled
from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.settings import ConfigError, parse_probability
from tests.unit.test_native import OPS, Lockstep, walk_in_lockstep

BUILDS = [compiled.load("sampling"), compiled.reference("sampling")]
IDS = ["chosen", "interpreted"]
PROBABILITIES = [0.5, 0.25, 1 / 16, 0.1, 2**-20]


def key_bytes(seed: str) -> bytes:
    """SipHash's 16-byte key for a seed, as the README states it: BLAKE2b-128 of the seed's UTF-8."""
    import hashlib

    return hashlib.blake2b(seed.encode(), digest_size=16).digest()


def reference_hash(seed: str, family: int, proto: int, src: str, sport: int, dst: str, dport: int) -> int:
    """SipHash-2-4 (the package) of the README's 40 bytes: each end as (address as a 128-bit big-endian number,
    port), the smaller end first; two words per address, then sport<<48 | dport<<32 | proto<<8 | family."""
    a = (int(ipaddress.ip_address(src)), sport)
    b = (int(ipaddress.ip_address(dst)), dport)
    (x, xp), (y, yp) = sorted([a, b])
    last = (xp << 48) | (yp << 32) | (proto << 8) | family
    msg = struct.pack("<5Q", x >> 64, x & (2**64 - 1), y >> 64, y & (2**64 - 1), last)
    return int.from_bytes(siphash24.siphash24(msg, key=key_bytes(seed)).digest(), "little")


def kept(seed: str, p: float, family: int, proto: int, src: str, sport: int, dst: str, dport: int) -> bool:
    return reference_hash(seed, family, proto, src, sport, dst, dport) < math.floor(Fraction(p) * 2**64)


WORD = st.integers(0, 2**64 - 1)


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=20), st.tuples(WORD, WORD, WORD, WORD, WORD))
@example("", (0, 0, 0, 0, 0))
def test_the_hash_is_siphash_2_4_of_the_words(build: Any, seed: str, words: tuple[int, ...]) -> None:
    sampler = build.Sampler(0.5, seed)
    want = int.from_bytes(siphash24.siphash24(struct.pack("<5Q", *words), key=key_bytes(seed)).digest(), "little")
    assert sampler.hash_words(*words) == want


V4 = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
V6 = st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n)))
PORT = st.integers(0, 65535)


@st.composite
def connections(draw: st.DrawFn) -> tuple[Connection, tuple[int, int, str, int, str, int]]:
    """A Connection (with DNAT: the original destination differs from the one reached) and the tuple the rule
    hashes: (family 4/6, protocol, source, sport, destination reached, its port)."""
    v6 = draw(st.booleans())
    addr = V6 if v6 else V4
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    src, vip, dst, snat = draw(addr), draw(addr), draw(addr), draw(addr)
    proto = draw(st.sampled_from([PROTO_TCP, PROTO_UDP, PROTO_ICMPV6 if v6 else PROTO_ICMP, 132, 47]))

    def p(a: str) -> bytes:
        return socket.inet_pton(fam, a)

    if proto in (PROTO_ICMP, PROTO_ICMPV6):
        ident = draw(PORT)
        t = 128 if v6 else 8
        conn = Connection(fam, proto, p(src), p(vip), ident, t << 8, p(dst), p(snat), ident, 0,
                          icmp_type=t, icmp_code=0, icmp_id=ident, ct_id=draw(st.integers(0, 2**32 - 1)))  # fmt: skip
        return conn, (6 if v6 else 4, proto, src, ident, dst, ident)
    ports = proto in (PROTO_TCP, PROTO_UDP, 132)
    sport, vport, dport, nport = (draw(PORT) for _ in range(4)) if ports else (0, 0, 0, 0)
    conn = Connection(fam, proto, p(src), p(vip), sport, vport, p(dst), p(snat), dport, nport,
                      ct_id=draw(st.integers(0, 2**32 - 1)))  # fmt: skip
    return conn, (6 if v6 else 4, proto, src, sport, dst, dport)


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(connections(), st.sampled_from(PROBABILITIES), st.sampled_from(["", "cluster-a", "cluster-b"]))
def test_a_connection_is_kept_as_the_readme_says(
    build: Any, drawn: tuple[Connection, tuple[int, int, str, int, str, int]], p: float, seed: str
) -> None:
    conn, tup = drawn
    sampler = build.Sampler(p, seed)
    want = kept(seed, p, *tup)
    assert sampler.keeps(conn) == want
    # the other node, or the same connection in the other direction: the same choice
    if conn.proto not in (PROTO_ICMP, PROTO_ICMPV6):  # as a conntrack that saw the reply first holds it
        c = conn
        rev = Connection(c.family, c.proto, c.reply_src, c.orig_src, c.reply_sport, c.orig_sport, c.orig_src,
                         c.reply_src, c.orig_sport, c.reply_sport, ct_id=c.ct_id)  # fmt: skip
        assert sampler.keeps(rev) == want
    assert sampler.dropped == (0 if want else 1)


def test_probabilities_and_their_bounds() -> None:
    sampling = compiled.load("sampling")
    assert sampling.threshold_of(1.0) == 2**64
    assert sampling.threshold_of(1 / 16) == 2**60
    assert sampling.threshold_of(0.1) == math.floor(Fraction(0.1) * 2**64)
    with pytest.raises(ValueError, match="needs no sampler"):
        sampling.Sampler(1.0, "")
    for bad in (0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError):
            sampling.threshold_of(bad)
    assert parse_probability("sampling.probability", "1/16") == 1 / 16
    assert parse_probability("sampling.probability", 0.25) == 0.25
    for bad in ("0", "1/0", "half", True, 2, "-1/4", 2.0**-33, ".nan"):
        with pytest.raises(ConfigError, match=r"sampling\.probability"):
            parse_probability("sampling.probability", bad)


def udp(n: int, ct_id: int) -> Connection:
    src = socket.inet_pton(socket.AF_INET, f"10.1.{n // 250}.{n % 250 + 1}")
    dst = socket.inet_pton(socket.AF_INET, "10.2.0.1")
    return Connection(socket.AF_INET, PROTO_UDP, src, dst, 1000 + n, 53, dst, src, 53, 1000 + n, ct_id=ct_id)


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
def test_a_dropped_connection_is_counted_once_and_forgotten_a_dump_after_it_is_gone(build: Any) -> None:
    sampler = build.Sampler(0.5, "count")
    conns = [udp(n, n + 1) for n in range(400)]
    kept_now = sampler.select(conns)
    dropped = [c for c in conns if c not in kept_now]
    assert 150 < len(dropped) < 250 and sampler.dropped == len(dropped)
    sampler.dump_done()
    for _ in range(3):  # the same table, dump after dump (and an event for one of them): no new count
        assert sampler.select(conns) == kept_now
        assert sampler.select(dropped[:1]) == []
        sampler.dump_done()
    assert sampler.dropped == len(dropped)
    sampler.select(conns[:100])  # the rest are gone from the table: remembered one more dump
    sampler.dump_done()
    sampler.dump_done()
    gone = [c for c in dropped if c not in conns[:100]]
    sampler.select(gone[:10])  # back, as new entries of the same tuples: counted again
    assert sampler.dropped == len(dropped) + 10
    sampler.select([udp(0, 999_999)] if udp(0, 1) in dropped else [])  # a reused tuple (a new conntrack id)
    assert sampler.dropped == len(dropped) + 10 + (udp(0, 1) in dropped)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    st.lists(st.tuples(OPS, st.integers(0, 5), st.integers(0, 15)), min_size=5, max_size=80),
    st.integers(2, 12),
    st.sampled_from(["a", "b", "c", "d"]),
)
@example([("create", i, 0) for i in range(6)] + [("poll", 1, 0), ("destroy", 2, 1), ("poll", 3, 0)], 8, "a")
def test_the_fused_poll_samples_as_the_connections_path(ops: list[tuple[str, int, int]], cap: int, seed: str) -> None:
    """test_native's lockstep with both stores sampled: the same rows kept and dropped, the same counts."""
    walk_in_lockstep(Lockstep(cap, None, sampling=(0.5, seed)), ops)


def test_the_lockstep_really_samples() -> None:
    """The lockstep above meets kept and dropped rows: over its seeds, the tuples of test_native split."""
    from tests.unit.test_native import base

    sampling = compiled.load("sampling")
    choices = {seed: [sampling.Sampler(0.5, seed).keeps(base(i % 5, i)) for i in range(6)] for seed in "abcd"}
    assert all(any(c) and not all(c) for c in choices.values()), choices


# ----------------------------------------------------------------------------- the consumer's estimator


def test_sum_over_p_is_unbiased_and_its_variance_is_the_readmes() -> None:
    """Over 2,000 seeds, the estimate of a population's bytes (sum of bytes / p over kept connections) averages
    to the true total, and its spread is sqrt(sum (1-p)/p * y^2) as the README states (the seeds are fixed:
    deterministic). The per-sample standard error estimate sqrt(sum (1-p)/p^2 * y^2) averages to that variance."""
    sampling = compiled.load("sampling")
    p = 1 / 16
    conns = [udp(n, n + 1) for n in range(600)]
    sizes = [((n * 7919) % 1000 + 1) * (50 if n % 37 == 0 else 1) for n in range(600)]  # heavy-tailed
    truth = sum(sizes)
    true_var = sum((1 - p) / p * y * y for y in sizes)
    estimates, var_estimates = [], []
    for seed in range(2000):
        s = sampling.Sampler(p, f"seed-{seed}")
        picked = [y for c, y in zip(conns, sizes, strict=True) if s.keeps(c)]
        estimates.append(sum(y / p for y in picked))
        var_estimates.append(sum((1 - p) / (p * p) * y * y for y in picked))
    k = len(estimates)
    mean = sum(estimates) / k
    sd = math.sqrt(true_var)
    assert abs(mean - truth) < 4 * sd / math.sqrt(k), (mean, truth, sd)
    spread = math.sqrt(sum((e - mean) ** 2 for e in estimates) / (k - 1))
    assert 0.9 * sd < spread < 1.1 * sd, (spread, sd)
    assert 0.9 * true_var < sum(var_estimates) / k < 1.1 * true_var
