"""Reading the hashed lockfiles (requirements/*.lock) the image and CI install from."""

from __future__ import annotations

import re
from pathlib import Path


def locked(lockfile: Path) -> dict[str, str]:
    """``name==version`` pins of a lockfile (names normalized), hashes and comments left out."""
    pins = {}
    for line in lockfile.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^]]*\])?==([^\s;\\]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def locked_hashes(lockfile: Path) -> dict[str, set[str]]:
    """The sha256 hashes each pin of a lockfile accepts (one per distribution file), by normalized name."""
    hashes: dict[str, set[str]] = {}
    current = None
    for line in lockfile.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^]]*\])?==", line)
        if m:
            current = hashes.setdefault(re.sub(r"[-_.]+", "-", m.group(1)).lower(), set())
        elif current is not None and (h := re.fullmatch(r"\s+--hash=sha256:([0-9a-f]{64})\s*\\?", line)):
            current.add(h.group(1))
    return hashes
