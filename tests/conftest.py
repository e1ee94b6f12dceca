"""Shared pytest setup: the real Kafka broker and Kubernetes API server fixtures."""

pytest_plugins = ["tests.kafka_fixtures", "tests.apiserver_fixtures"]
