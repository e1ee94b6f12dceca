"""Named networks: the user's CIDRs with names ("s3-eu-west-1", "partner-vpn"), longest prefix first (issue 42).

An end of a connection that is not a pod or a node gets the name of the most specific listed network holding
its address (``sourceNetwork``, ``destinationNetwork``), so that external traffic can be grouped by what it
reaches ("how much do we send to S3?"). The table is the user's file (``networks.file``: a map of names to
lists of CIDRs, IPv4 and IPv6, a ConfigMap's key as it is), read at start (a bad file exits 2, naming the
entry) and again when it changes (a bad file then keeps the old table, logged and counted).

Pure: parsing and lookup, no file access (:mod:`flow_exporter.network_file` reads and watches the file).

Lookup: one dict per (family, prefix length) present, from the longest length down, the address masked to
each. A table of 100,000 prefixes has a few dozen lengths, so a lookup is a few dozen dict probes at most;
it runs once per new connection, not per record. Written by hand: the standard library's ``ipaddress`` has
no longest-prefix table, and the tries on PyPI (pytricia, py-radix) are C extensions the image would build
for two architectures, for a lookup made once per connection (bench/bench_networks.py measures it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["MAX_NAME", "NetworkError", "NetworkTable", "parse_networks"]

MAX_NAME = 128  # a name goes into records of every connection it names


class NetworkError(ValueError):
    """A networks file that cannot be used; the message names the entry."""


@dataclass(slots=True)
class _Family:
    """One address family's prefixes: prefix length -> {network address as an int: name}, longest first."""

    bits: int
    by_length: dict[int, dict[int, str]] = field(default_factory=dict)
    lengths: tuple[int, ...] = ()

    def add(self, address: int, length: int, name: str) -> None:
        self.by_length.setdefault(length, {})[address] = name

    def freeze(self) -> None:
        self.lengths = tuple(sorted(self.by_length, reverse=True))

    def lookup(self, address: int) -> str | None:
        bits = self.bits
        by_length = self.by_length
        for length in self.lengths:
            name = by_length[length].get(address >> (bits - length) << (bits - length) if length else 0)
            if name is not None:
                return name
        return None


class NetworkTable:
    """The named networks, IPv4 and IPv6: ``lookup(packed address)`` gives the most specific one's name."""

    def __init__(self, entries: Mapping[str, list[ipaddress.IPv4Network | ipaddress.IPv6Network]]) -> None:
        self._v4 = _Family(32)
        self._v6 = _Family(128)
        self.prefixes = 0
        for name, networks in entries.items():
            for net in networks:
                fam = self._v4 if net.version == 4 else self._v6
                fam.add(int(net.network_address), net.prefixlen, name)
                self.prefixes += 1
        self._v4.freeze()
        self._v6.freeze()
        self.names = len(entries)

    def lookup(self, address: bytes) -> str | None:
        """The name of the longest listed prefix holding ``address`` (4 or 16 packed bytes), or None."""
        if len(address) == 4:
            return self._v4.lookup(int.from_bytes(address, "big"))
        if len(address) == 16:
            return self._v6.lookup(int.from_bytes(address, "big"))
        return None


def parse_networks(data: object, max_prefixes: int, where: str = "networks.file") -> NetworkTable:
    """The table of a parsed file (a map of names to lists of CIDRs); :class:`NetworkError` names what is wrong.

    A CIDR with host bits set (``10.0.0.1/8``) is refused rather than silently widened; one prefix listed
    under two names is refused too (which name it has would depend on the file's order).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise NetworkError(f"{where}: expected a map of names to lists of CIDRs, e.g. s3: [52.218.0.0/17]")
    entries: dict[str, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {}
    seen: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, str] = {}
    count = 0
    for name, cidrs in data.items():
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
            raise NetworkError(f"{where}: network name {str(name)[:60]!r}: a non-empty string of at most {MAX_NAME}")
        if isinstance(cidrs, str):
            cidrs = [cidrs]
        if not isinstance(cidrs, list):
            raise NetworkError(f"{where}: {name}: expected a list of CIDRs, not {type(cidrs).__name__}")
        nets = entries.setdefault(name, [])
        for cidr in cidrs:
            count += 1
            if count > max_prefixes:
                raise NetworkError(f"{where}: more than {max_prefixes} prefixes (networks.maxPrefixes)")
            try:
                net = ipaddress.ip_network(str(cidr).strip(), strict=True)
            except ValueError as exc:
                raise NetworkError(f"{where}: {name}: {str(cidr)[:60]!r} is not a CIDR ({exc})") from None
            other = seen.get(net)
            if other is not None and other != name:
                raise NetworkError(f"{where}: {net} is listed under both {other!r} and {name!r}")
            seen[net] = name
            nets.append(net)
    return NetworkTable(entries)
