"""Pytest fixtures for a real Kafka broker (see devtools.kafka).

One broker serves the whole session because a JVM broker takes seconds to start; tests stay
independent by each using a fresh, uniquely named topic. Load with
``pytest_plugins = ["tests.support.kafka_fixtures"]`` in the top-level conftest.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from devtools.kafka import KafkaBroker

__all__ = ["kafka_broker", "kafka_topic"]


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A started single-node broker for the session.

    Its work dir sits under pytest's temp root (kept for the last few runs), so ``broker.log`` can
    be read after a failure.
    """
    with KafkaBroker(tmp_path_factory.mktemp("kafka-broker")) as broker:
        yield broker


@pytest.fixture
def kafka_topic(kafka_broker: KafkaBroker, request: pytest.FixtureRequest) -> str:
    """A new one-partition topic named after the test, with its leader elected."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:160]
    name = f"test-{base}-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(name)
    return name
