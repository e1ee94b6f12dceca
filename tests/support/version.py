"""The version a build of this checkout gets: setuptools-scm's reading of its git tags (pyproject.toml).

Not ``flow_exporter.__version__``: that is what the editable install wrote into ``flow_exporter/_version.py`` when it
last ran, and commits since then move the checkout's version on. The image build (tools/image/build.sh) and the
packaging tests build with this one.
"""

from __future__ import annotations

import functools
import subprocess
import sys

from tests.support.paths import REPO

__all__ = ["checkout_version"]


@functools.cache
def checkout_version() -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "setuptools_scm"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout.strip()
