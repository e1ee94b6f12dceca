"""What the broker and Spark jar fetchers share: running ``mvn`` and saying in one line why it failed."""

from __future__ import annotations

import re
from pathlib import Path

MVN_TIMEOUT = 900.0
# Signs in Maven's output that Maven Central could not be reached (as opposed to a bad pom).
NETWORK_HINTS = (
    "Could not transfer",
    "UnknownHostException",
    "Connection refused",
    "Connect timed out",
    "Network is unreachable",
    "No route to host",
    "Temporary failure in name resolution",
    "Could not resolve host",
    "transfer failed",
)
# Maven 3.8 colours its output even with -B.
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def mvn_failure(output: str, log: Path, what: str) -> str:
    """A one-line reason for a failed ``mvn`` run fetching ``what``, telling a network problem from the rest."""
    lines = [ln.strip() for ln in output.splitlines()]
    errors = [ln.removeprefix("[ERROR]").strip() for ln in lines if ln.startswith("[ERROR]")]
    first = next((e for e in errors if e), lines[-1] if lines else "no output")[:300]
    if any(hint in output for hint in NETWORK_HINTS):
        return f"cannot reach Maven Central to fetch {what} ({first}); log: {log}"
    return f"mvn could not resolve {what} ({first}); log: {log}"
