"""Shared pytest setup: the real Kafka broker fixtures."""

pytest_plugins = ["tests.kafka_fixtures"]
