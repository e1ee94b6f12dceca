"""Pytest fixture for a real kube-apiserver + etcd (see devtools.apiserver).

One server serves the whole session because it takes seconds to start (and minutes to build the
first time); tests stay independent by each using its own namespace. Load with
``pytest_plugins = ["tests.support.apiserver_fixtures"]`` in the top-level conftest.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.apiserver import ApiServer, ApiServerError

__all__ = ["apiserver"]


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A started API server for the session, with an admin kubeconfig.

    Its work dir sits under pytest's temp root (kept for the last few runs), so ``apiserver.log``
    and ``etcd.log`` can be read after a failure. A test that stops it must start it again.
    """
    server = ApiServer(tmp_path_factory.mktemp("kube-apiserver"))
    try:
        server.start()
    except ApiServerError as exc:
        # Fail rather than skip: a missing toolchain or proxy must not pass silently in CI.
        pytest.fail(f"cannot start the test API server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.close()
