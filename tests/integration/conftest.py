"""The lab most integration tests run on: a node namespace routing three pods (devtools.lab).

A module that needs another shape (more pods, one lab for the module) defines its own ``lab``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.lab import Lab


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(pods=3) as lab:
        yield lab
