"""The container engine the image tests use (podman, with tools/image/containers.conf) and the image it builds.

The image is built once per test session (the ``image`` fixture), with what ``make image`` runs:
``tools/image/setup.sh`` (the engine and the stand-in base from Debian's packages, cached) and
``tools/image/build.sh`` (the Dockerfile, with BASE set to that stand-in). Both the image tests
and the DaemonSet pod test use it. Its version (the wheel's and the label's) is the checkout's
(tests/support/version.py), passed to the build as VERSION. Load with ``pytest_plugins`` in the top-level conftest.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from devtools.podman import base_image, engine_env, podman
from tests.support.paths import REPO
from tests.support.version import checkout_version

__all__ = ["BUILD_TIMEOUT", "TAG", "base_image", "engine_env", "image", "podman"]

TAG = "localhost/flow-exporter:pytest"
# A cold build (the stand-in base from Debian's packages, then every wheel) takes minutes on a busy
# machine; the first test using the image waits for it.
BUILD_TIMEOUT = 1800


@pytest.fixture(scope="session")
def image() -> Iterator[str]:
    """The Dockerfile built with podman on the stand-in base, once per session: its tag."""
    started = time.monotonic()
    env = {**engine_env(), "VERSION": checkout_version()}
    for step in (["bash", "tools/image/setup.sh"], ["bash", "tools/image/build.sh", TAG]):
        proc = subprocess.run(
            step, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False
        )
        assert proc.returncode == 0, (
            f"{' '.join(step)}: exit {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    print(f"image {TAG} built in {time.monotonic() - started:.1f}s")
    yield TAG
