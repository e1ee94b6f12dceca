"""Network-namespace lab: a routed "node" namespace with pods, Services and conntrack.

Tests and the demo need real kernel conntrack entries with known tuples and byte counts,
without touching the host's own network. The lab builds, per instance:

* ``<prefix>-node``: routes between pods (IPv4 and IPv6 forwarding), runs an nft table whose
  rules use conntrack (so the netns registers conntrack hooks), with accounting and timestamps
  switched on *in that namespace* (those sysctls are per netns);
* ``<prefix>-p<i>``: pods, each joined to the node by a veth pair and routed via the node,
  like a routed CNI;
* ``<prefix>-tbl`` (on demand): an empty namespace that only holds synthetic conntrack entries.

Traffic is driven by one persistent agent per pod (``agent.py`` run as a script), spoken to
over a JSON-lines pipe, so an exchange costs a couple of pipe round trips instead of process
spawns. Only the standard library is used; ``ip``, ``nft`` and ``conntrack`` are shelled out to.

Modules: ``model`` (records, ``LabError``), ``shell`` (commands, sysctls), ``conntrack_text``
(parsing ``conntrack -L``, synthetic entries), ``agent`` (runs inside a pod), ``topology``
(``Lab``), ``__main__`` (command line). This package re-exports what tests, bench and the demo
import, so ``from devtools.lab import X`` keeps working.

Command line: ``python -m devtools.lab up`` (keep a lab until Ctrl-C) and
``python -m devtools.lab cleanup PREFIX`` (remove a leftover lab's namespaces).
"""

from __future__ import annotations

# Besides __all__, the names other code imported from the old single module stay importable:
# the port-range constants and the private helpers the tests use (``X as X`` marks a re-export).
from devtools.lab.conntrack_text import CtEntry, CtTable, parse_conntrack_line, parse_conntrack_output
from devtools.lab.conntrack_text import _parse_tokens as _parse_tokens
from devtools.lab.conntrack_text import _synthetic_lines as _synthetic_lines
from devtools.lab.model import Exchange, LabError, Pod, Service
from devtools.lab.shell import run, run_in
from devtools.lab.topology import CLIENT_PORT_MAX as CLIENT_PORT_MAX
from devtools.lab.topology import CLIENT_PORT_MIN as CLIENT_PORT_MIN
from devtools.lab.topology import Lab, LongConnection

__all__ = [
    "CtEntry",
    "CtTable",
    "Exchange",
    "Lab",
    "LabError",
    "LongConnection",
    "Pod",
    "Service",
    "parse_conntrack_line",
    "parse_conntrack_output",
    "run",
    "run_in",
]
