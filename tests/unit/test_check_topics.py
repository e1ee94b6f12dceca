"""runner.check_topics: a missing topic and one an ACL hides are told apart, and both are retried (no crash loop)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from flow_exporter.runner import check_topics


class _Sink:
    """The two calls check_topics makes, answering from a script of cluster replies."""

    def __init__(self, replies: list[dict[str, str]]) -> None:
        self.replies = replies

    def unusable_topics(self, timeout: float = 10.0) -> dict[str, str]:
        return self.replies.pop(0)

    def topics(self) -> list[str]:
        return ["flows", "markers"]


def test_an_authorization_error_is_named_apart_from_a_missing_topic(caplog: pytest.LogCaptureFixture) -> None:
    sink: Any = _Sink([{"flows": "Broker: Topic authorization failed", "markers": "missing"}, {}])
    with caplog.at_level(logging.INFO, logger="flow_exporter.runner"):
        assert check_topics(sink, threading.Event(), 0.0, 0.0) is True
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "kafka topic(s) missing: markers (create them, or enable auto-creation); retrying in 0.0s"
    assert messages[1] == (
        "kafka topic(s) not usable: flows: Broker: Topic authorization failed (check the ACLs of this client's "
        "principal); retrying in 0.0s"
    )
    assert messages[2] == "broker reachable, topics present: flows, markers"
    assert sink.replies == []
