"""Command-line tools the tests build from the Go module proxy into <repo>/.cache (kustomize, helm,
kube-state-metrics).

`make setup-k8s` (tools/k8s/tools.sh) builds the same versions into the same places first; this
builds one only when a test runs without that step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.paths import REPO


def go_tool(name: str, version: str, package: str, timeout: float = 1500) -> Path:
    """The binary ``name`` of ``package@version``, built with ``go install`` on first use."""
    gobin = REPO / ".cache" / name / version / "bin"
    binary = gobin / name
    if not binary.is_file():
        subprocess.run(
            ["go", "install", f"{package}@{version}"],
            env={**os.environ, "GOBIN": str(gobin)},
            check=True,
            capture_output=True,
            timeout=timeout,
        )
    return binary
