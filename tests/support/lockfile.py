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
