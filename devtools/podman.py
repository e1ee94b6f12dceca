"""The container engine the harness uses: podman, with tools/image/containers.conf, and the stand-in base image.

One place for what ``make image``, ``make try-pod`` (devtools.try_pod) and the image and pod tests
(tests/support/container_image.py, devtools.pod_play) run podman with: the engine's settings are the
repository's ``tools/image/containers.conf`` (passed as ``CONTAINERS_CONF``; nothing in /etc is changed), and
the base the Dockerfile is built on here is the stand-in ``tools/image/base.sh`` makes from Debian's packages
(no container registry is reachable where the tests run), which also stands in for the init container's busybox.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["CONTAINERS_CONF", "REPO", "base_image", "engine_env", "image_exists", "podman"]

REPO = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = REPO / "tools" / "image" / "containers.conf"


def engine_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag).returncode == 0


def base_image() -> str:
    """The stand-in base's tag (what the build passed as BASE): a Debian image with a shell and python3."""
    proc = subprocess.run(
        ["bash", "tools/image/base.sh", "--tag"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout.strip()
