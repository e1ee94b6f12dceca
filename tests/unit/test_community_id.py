"""Community ID v1: the spec's published baseline vectors, and the ``communityid`` package on generated flows."""

from __future__ import annotations

import ipaddress

import communityid
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter.community_id import community_id

# From the spec repository's baseline/baseline_deflt.json (seed 0) and baseline_seed1.json
# (seed 1): (proto, saddr, daddr, sport, dport, expected). For ICMP the "ports" are type and code.
BASELINE_SEED0 = [
    (58, "fe80::200:86ff:fe05:80da", "fe80::260:97ff:fe07:69ea", 135, 136, "1:dGHyGvjMfljg6Bppwm3bg0LO8TY="),
    (58, "fe80::260:97ff:fe07:69ea", "fe80::200:86ff:fe05:80da", 136, 135, "1:dGHyGvjMfljg6Bppwm3bg0LO8TY="),
    (58, "fe80::260:97ff:fe07:69ea", "fe80::200:86ff:fe05:80da", 135, 136, "1:zavyT/cezQr1fmImYCwYnMXbgck="),
    (58, "fe80::200:86ff:fe05:80da", "fe80::260:97ff:fe07:69ea", 136, 135, "1:zavyT/cezQr1fmImYCwYnMXbgck="),
    (58, "3ffe:501:1800:2345::2", "3ffe:507:0:1:200:86ff:fe05:80da", 3, 0, "1:2ObVBgIn28oZvibYZhZMBgh7WdQ="),
    (58, "3ffe:501:410:0:2c0:dfff:fe47:33e", "3ffe:507:0:1:200:86ff:fe05:80da", 1, 4, "1:hLZd0XGWojozrvxqE0dWB1iM6R0="),
    (58, "3ffe:507:0:1:200:86ff:fe05:80da", "3ffe:501:0:1001::2", 128, 129, "1:+TW+HtLHvV1xnGhV1lv7XoJrqQg="),
    (58, "3ffe:501:0:1001::2", "3ffe:507:0:1:200:86ff:fe05:80da", 129, 128, "1:+TW+HtLHvV1xnGhV1lv7XoJrqQg="),
    (58, "fe80::200:86ff:fe05:80da", "ff02::2", 133, 134, "1:hO+sN4H+MG5MY/8hIrXPqc4ZQz0="),
    (58, "fe80::260:97ff:fe07:69ea", "ff02::1", 134, 133, "1:pkvHqCL88/tg1k4cPigmZXUtL00="),
    (1, "192.168.0.89", "192.168.0.1", 8, 0, "1:X0snYXpgwiv9TZtqg64sgzUn6Dk="),
    (1, "192.168.0.1", "192.168.0.89", 0, 8, "1:X0snYXpgwiv9TZtqg64sgzUn6Dk="),
    (1, "10.0.0.1", "10.0.0.2", 11, 0, "1:YHxtAirCG//0OzkcVAukqKQN9xM="),
    (
        6,
        "2001:470:e5bf:dead:4957:2174:e82c:4887",
        "2607:f8b0:400c:c03::1a",
        63943,
        25,
        "1:/qFaeAR+gFe1KYjMzVDsMv+wgU4=",
    ),
    (
        6,
        "2607:f8b0:400c:c03::1a",
        "2001:470:e5bf:dead:4957:2174:e82c:4887",
        25,
        63943,
        "1:/qFaeAR+gFe1KYjMzVDsMv+wgU4=",
    ),
    (132, "192.168.170.8", "192.168.170.56", 7, 7, "1:MP2EtRCAUIZvTw6MxJHLV7N7JDs="),
    (132, "192.168.170.56", "192.168.170.8", 7, 7, "1:MP2EtRCAUIZvTw6MxJHLV7N7JDs="),
    (6, "128.232.110.120", "66.35.250.204", 34855, 80, "1:LQU9qZlK+B5F3KDmev6m5PMibrg="),
    (6, "66.35.250.204", "128.232.110.120", 80, 34855, "1:LQU9qZlK+B5F3KDmev6m5PMibrg="),
    (17, "192.168.1.52", "8.8.8.8", 54585, 53, "1:d/FP5EW3wiY1vCndhwleRRKHowQ="),
    (17, "8.8.8.8", "192.168.1.52", 53, 54585, "1:d/FP5EW3wiY1vCndhwleRRKHowQ="),
    (46, "10.1.12.1", "10.1.12.2", None, None, "1:KHlLkgoJW7ifUTyTSgyVfkFHzKw="),
    (46, "10.1.12.2", "10.1.12.1", None, None, "1:KHlLkgoJW7ifUTyTSgyVfkFHzKw="),
]


def packed(addr: str) -> bytes:
    return ipaddress.ip_address(addr).packed


def test_spec_baseline_vectors() -> None:
    for proto, saddr, daddr, sport, dport, expected in BASELINE_SEED0:
        assert community_id(proto, packed(saddr), packed(daddr), sport, dport) == expected, (saddr, daddr)


def reference(proto: int, saddr: str, daddr: str, sport: int | None, dport: int | None, seed: int) -> str:
    """The ``communityid`` package (Corelight's Python implementation) for the same flow."""
    cid = communityid.CommunityID(seed)
    if proto == 1:
        tpl = communityid.FlowTuple.make_icmp(saddr, daddr, sport, dport)
    elif proto == 58:
        tpl = communityid.FlowTuple.make_icmp6(saddr, daddr, sport, dport)
    elif proto in (6, 17, 132):
        tpl = communityid.FlowTuple(proto, saddr, daddr, sport, dport)
    else:
        tpl = communityid.FlowTuple(proto, saddr, daddr)
    return cid.calc(tpl)


addresses_v4 = st.sampled_from(["10.0.0.1", "10.0.0.2", "192.168.7.9", "255.255.255.255", "0.0.0.0"])
addresses_v6 = st.sampled_from(["fd00::1", "fd00::2", "fe80::1:2", "::1", "ff02::1"])


@settings(max_examples=500, deadline=None)
@given(
    proto=st.sampled_from([6, 17, 132, 1, 58, 47]),
    v6=st.booleans(),
    data=st.data(),
    sport=st.integers(0, 65535),
    dport=st.integers(0, 65535),
    seed=st.integers(0, 65535),
)
def test_agrees_with_the_communityid_package(
    proto: int, v6: bool, data: st.DataObject, sport: int, dport: int, seed: int
) -> None:
    if proto == 1:
        v6 = False
    if proto == 58:
        v6 = True
    addrs = addresses_v6 if v6 else addresses_v4
    saddr, daddr = data.draw(addrs), data.draw(addrs)
    if proto in (1, 58):  # type and code, with the paired types well represented
        sport = data.draw(st.sampled_from([0, 3, 8, 11, 13, 128, 129, 133, 135, 136, 139, 144, 255]))
        dport = data.draw(st.integers(0, 255))
    got = community_id(proto, packed(saddr), packed(daddr), sport, dport, seed)
    assert got == reference(proto, saddr, daddr, sport, dport, seed)
    # Direction does not matter for two-way flows.
    if proto in (6, 17, 132):
        assert got == community_id(proto, packed(daddr), packed(saddr), dport, sport, seed)
