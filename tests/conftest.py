"""Shared pytest setup: the real Kafka broker, Kubernetes API server and image fixtures, and the stub Schema Registry.

The helpers in tests/support assert like tests do; they are rewritten so a failing assert shows its values.
"""

import pytest

pytest.register_assert_rewrite("tests.support")

pytest_plugins = [
    "tests.support.kafka_fixtures",
    "tests.support.apiserver_fixtures",
    "tests.support.schema_registry",
    "tests.support.container_image",
]
