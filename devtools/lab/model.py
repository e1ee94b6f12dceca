"""The lab's vocabulary: the records callers hold (``Pod``, ``Service``, ``Exchange``), ``LabError``
and address canonicalisation.

They sit apart from the rest because every other module needs them: the shell helpers take a
``Pod``, the conntrack parser raises ``LabError`` and compares canonical addresses, and the
topology builds and returns these records. Keeping them here avoids import cycles.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass


class LabError(RuntimeError):
    """A lab command or traffic operation failed; the message carries the tool's stderr.

    ``code`` is the agent's error class (``addrinuse``, ``timeout``, ...) when one applies.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@functools.lru_cache(maxsize=8192)
def _norm(addr: str) -> str:
    """Canonical text of an address, so lookups don't depend on how IPv6 was spelled."""
    return str(ipaddress.ip_address(addr.split("%", 1)[0]))


@dataclass(frozen=True)
class Pod:
    """One pod namespace; ``node_ip4``/``node_ip6`` are its gateway on the node side."""

    name: str
    netns: str
    index: int
    ipv4: str
    ipv6: str
    node_ip4: str
    node_ip6: str
    ifname: str = "eth0"
    node_ifname: str = ""

    def ip(self, family: int = 4) -> str:
        """The pod address for family 4 or 6."""
        return self.ipv4 if family == 4 else self.ipv6


@dataclass(frozen=True)
class Service:
    """A kube-proxy style virtual IP:port DNAT'ed in the node namespace to one backend pod."""

    vip4: str
    port: int
    backend: Pod
    target_port: int
    proto: str = "tcp"
    vip6: str | None = None

    def ip(self, family: int = 4) -> str:
        """The VIP for family 4 or 6."""
        if family == 6:
            if self.vip6 is None:
                raise LabError(f"service {self.vip4}:{self.port} has no IPv6 VIP")
            return self.vip6
        return self.vip4


@dataclass(frozen=True)
class Exchange:
    """What one finished exchange did, enough to find and check its conntrack entry.

    ``server_ip``/``server_port`` are what the client dialled (a VIP for a Service);
    ``backend_ip``/``backend_port`` are where it really landed. Sizes are payload bytes per
    message; UDP sends ``count`` datagrams each way.
    """

    proto: str
    family: int
    client: str
    client_ip: str
    client_port: int
    server_ip: str
    server_port: int
    backend: str
    backend_ip: str
    backend_port: int
    request_bytes: int
    response_bytes: int
    count: int = 1
    hold: float = 0.0
    started: float = 0.0
    finished: float = 0.0

    @property
    def duration(self) -> float:
        """Wall time of the exchange as the lab saw it."""
        return self.finished - self.started

    @property
    def total_request_bytes(self) -> int:
        """Payload bytes client -> server over the whole exchange."""
        return self.request_bytes * self.count

    @property
    def total_response_bytes(self) -> int:
        """Payload bytes server -> client over the whole exchange."""
        return self.response_bytes * self.count
