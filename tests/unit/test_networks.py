"""Named networks (flow_exporter/networks.py, network_file.py): longest prefix, both families, the file's errors,
reloads that keep the old table when the new file is bad, and which ends are named."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter.network_file import NetworkFile, name_ends
from flow_exporter.networks import NetworkError, parse_networks
from tests.support.store_builders import tcp


def packed(a: str) -> bytes:
    return ipaddress.ip_address(a).packed


TABLE = {
    "everything-v4": ["0.0.0.0/0"],
    "vpc": ["10.0.0.0/8"],
    "s3-eu-west-1": ["52.218.0.0/17", "3.5.64.0/21"],
    "one-host": ["10.1.2.3/32"],
    "v6-cloud": ["2600:1f00::/24"],
    "v6-host": ["2600:1f00::1/128"],
}


def test_the_longest_prefix_wins_in_both_families() -> None:
    t = parse_networks(TABLE, 100)
    assert (t.prefixes, t.names) == (7, 6)
    assert t.lookup(packed("10.1.2.3")) == "one-host"
    assert t.lookup(packed("10.1.2.4")) == "vpc"
    assert t.lookup(packed("52.218.127.255")) == "s3-eu-west-1"
    assert t.lookup(packed("52.218.128.0")) == "everything-v4"
    assert t.lookup(packed("3.5.71.9")) == "s3-eu-west-1"
    assert t.lookup(packed("2600:1f00::1")) == "v6-host"
    assert t.lookup(packed("2600:1fff::1")) == "v6-cloud"
    assert t.lookup(packed("2601::1")) is None  # no v6 default route listed
    assert t.lookup(b"\x01\x02") is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "expected a map of names to lists of CIDRs"),
        ({"a": "10.0.0.1/8"}, "'10.0.0.1/8' is not a CIDR"),  # host bits set: refused, not widened
        ({"a": ["300.0.0.0/8"]}, "'300.0.0.0/8' is not a CIDR"),
        ({"a": {"b": 1}}, "a: expected a list of CIDRs, not dict"),
        ({"a": ["10.0.0.0/8"], "b": ["10.0.0.0/8"]}, "10.0.0.0/8 is listed under both 'a' and 'b'"),
        ({"": ["10.0.0.0/8"]}, "network name ''"),
        ({"x" * 200: ["10.0.0.0/8"]}, "a non-empty string of at most 128"),
        ({"a": [f"10.0.{i}.0/24" for i in range(11)]}, "more than 10 prefixes"),
    ],
)
def test_a_bad_table_is_refused_naming_the_entry(data: object, message: str) -> None:
    with pytest.raises(NetworkError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_networks(data, 10)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 32)), max_size=30),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
)
def test_lookup_is_the_longest_matching_prefix_by_brute_force(
    prefixes: list[tuple[int, int]], probes: list[int]
) -> None:
    nets = {ipaddress.ip_network((addr, length), strict=False) for addr, length in prefixes}
    table = parse_networks({f"n{i}": [str(n)] for i, n in enumerate(sorted(nets))}, 100)
    names = {n: f"n{i}" for i, n in enumerate(sorted(nets))}
    for probe in probes:
        ip = ipaddress.ip_address(probe)
        holding = [n for n in nets if ip in n]
        want = names[max(holding, key=lambda n: n.prefixlen)] if holding else None
        assert table.lookup(ip.packed) == want


def test_a_changed_file_is_read_again_and_a_bad_one_keeps_the_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "networks.yaml"
    path.write_text("s3: [52.218.0.0/17]\n")
    nf = NetworkFile(str(path), 100)
    assert nf.table.lookup(packed("52.218.1.1")) == "s3" and not nf.check()  # unchanged: not read again
    path.write_text("s3: [52.218.0.0/17]\nvpc: [10.0.0.0/8]\n")
    os.utime(path, ns=(1, 10**18))
    assert nf.check() and nf.table.lookup(packed("10.9.9.9")) == "vpc" and nf.reloads == 1
    path.write_text("vpc: [10.0.0.1/8]\n")  # a host bit set
    os.utime(path, ns=(1, 2 * 10**18))
    assert not nf.check() and nf.reload_errors == 1
    assert nf.table.lookup(packed("10.9.9.9")) == "vpc"  # the old table
    assert "'10.0.0.1/8' is not a CIDR" in caplog.text and "keeping the 2 prefixes" in caplog.text
    path.unlink()
    assert not nf.check() and nf.reload_errors == 2 and nf.table.lookup(packed("52.218.1.1")) == "s3"
    path.write_text("a: [\n")
    assert not nf.check() and nf.reload_errors == 3 and "not YAML at line" in caplog.text


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "n.yaml"
    path.write_bytes(b"s3: [52.218.0.0/17]\n\xc3\x28: x\n")  # an invalid UTF-8 sequence
    with pytest.raises(NetworkError, match="not UTF-8"):
        NetworkFile(str(path), 100)
    with pytest.raises(OSError):
        NetworkFile(str(tmp_path / "missing.yaml"), 100)


def test_only_ends_that_are_not_pods_or_nodes_are_named() -> None:
    table = parse_networks({"ext": ["192.0.2.0/24"], "vpc": ["10.0.0.0/8"]}, 10)
    conn = tcp(orig_src=packed("10.0.0.5"), reply_src=packed("192.0.2.7"))
    shared = {"sourcePodName": "web-0", "sourceNodeName": "n1", "flowType": 3}
    named = name_ends(shared, conn, table)
    assert named == {**shared, "sourceNetwork": None, "destinationNetwork": "ext"}
    assert shared == {"sourcePodName": "web-0", "sourceNodeName": "n1", "flowType": 3}  # never mutated
    assert name_ends(None, conn, table) == {"sourceNetwork": "vpc", "destinationNetwork": "ext"}
    inside = tcp(orig_src=packed("172.16.0.1"), reply_src=packed("172.16.0.2"))
    assert name_ends(shared, inside, table) is shared  # nothing named: the same dict
