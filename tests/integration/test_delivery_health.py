"""A topic's write ACL removed after start, on a real broker with an authorizer: the exporter warns
naming TOPIC_AUTHORIZATION_FAILED, counts it by code, answers /readyz 503 once kafka.readyTimeout
passes with no delivery, and 200 again once the ACL is back (the records waiting go out).

The exporter runs in this process as ``flow-exporter run`` wires it (``build_sink``,
``start_listener``, the real loops), over SASL as a user whose only right is that ACL; the
conntrack table is an in-memory one whose counters keep moving, so records keep coming.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from devtools.kafka import KafkaBroker
from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.config import load, this_node
from flow_exporter.lifecycle import Lifecycle
from flow_exporter.metrics import Metrics
from flow_exporter.runner import build_sink, start_listener, timeouts_from
from tests.support.exporter_process import scrape
from tests.support.fakes import FakeTable
from tests.support.store_builders import tcp
from tests.support.waiting import until

pytestmark = pytest.mark.kafka

USER, PASSWORD = "writer", "writer-pw-K4p8"
READY_TIMEOUT = 4.0
AUTH = "TOPIC_AUTHORIZATION_FAILED"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A broker that checks ACLs; the PLAINTEXT listeners (setup, controller) are the super user."""
    props = {
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": "User:ANONYMOUS",
    }
    with KafkaBroker(tmp_path_factory.mktemp("acl-broker"), scram_users={USER: PASSWORD}, extra_props=props) as b:
        yield b


def write_acl(topic: str) -> AclBinding:
    return AclBinding(
        ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{USER}", "*",
        AclOperation.WRITE, AclPermissionType.ALLOW,
    )  # fmt: skip


def grant(admin: AdminClient, topic: str) -> None:
    for future in admin.create_acls([write_acl(topic)]).values():
        future.result()


def revoke(admin: AdminClient, topic: str) -> None:
    every = AclBindingFilter(
        ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{USER}", "*",
        AclOperation.ANY, AclPermissionType.ANY,
    )  # fmt: skip
    for future in admin.delete_acls([every]).values():
        assert future.result(), "no ACL was removed"


def test_a_revoked_write_acl_warns_then_not_ready_then_ready_again(
    broker: KafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"acl-{time.time_ns()}"
    broker.create_topic(topic)
    admin = AdminClient(broker.client_config())
    grant(admin, topic)
    cfg = load(
        environ={},
        overrides={
            "nodeName": "acl-node",
            "kafka.topic": topic,
            "kafka.bootstrapServers": broker.sasl_bootstrap,
            "kafka.securityProtocol": "SASL_PLAINTEXT",
            "kafka.sasl.mechanism": "SCRAM-SHA-256",
            "kafka.sasl.username": USER,
            "kafka.sasl.password": PASSWORD,
            "kafka.readyTimeout": f"{READY_TIMEOUT}s",
            "conntrack.pollInterval": "1s",
            "expiry.activeTimeout": "1s",
            "shutdown.grace": "2s",
            "metrics.port": 0,  # any free port: the listener says which
        },
    )
    lifecycle = Lifecycle()
    table = FakeTable()
    exporter = Exporter(
        table,
        build_sink(cfg, lifecycle),
        ExporterOptions(timeouts=timeouts_from(cfg), node_name=this_node(cfg), grace=cfg.shutdown.grace),
        lifecycle=lifecycle,
    )  # fmt: skip
    http = start_listener(cfg, Metrics(), exporter)
    assert http is not None
    moving = threading.Event()

    def traffic() -> None:
        """Two connections whose counters keep rising: a record each every active timeout."""
        n = 1
        while not moving.wait(0.3):
            n += 1
            table.entries = [tcp(41000, packets=n), tcp(41001, packets=n)]

    threads = [threading.Thread(target=traffic), threading.Thread(target=exporter.run)]
    with caplog.at_level(logging.INFO, logger="flow_exporter"):
        for t in threads:
            t.start()
        try:

            def readyz() -> tuple[int, str]:
                return scrape(http.port, "/readyz")

            def seen() -> str:
                return f"/readyz {readyz()}, failures {exporter.sink.counters.failures_by_error}\n{caplog.text[-3000:]}"

            until(lambda: readyz() == (200, "ok\n"), 60, seen)
            assert exporter.sink.counters.acked > 0

            revoke(admin, topic)
            _status, body = until(lambda: (r := readyz())[0] == 503 and r, 60, seen)
            assert f"no record delivered to topic {topic}" in body and f"last error: {AUTH}" in body, body
            warnings = [r.getMessage() for r in caplog.records if r.name == "flow_exporter.delivery"]
            assert any(AUTH in m and f"topic {topic}:" in m and "record(s) failed" in m for m in warnings), warnings
            metrics = scrape(http.port, "/metrics")[1]
            assert f'flow_exporter_delivery_failures_total{{error="{AUTH}"}}' in metrics
            acked = exporter.sink.counters.acked

            grant(admin, topic)  # the records kept waiting go out at their next resend (backoff up to 30 s)
            until(lambda: readyz() == (200, "ok\n"), 90, seen)
            assert exporter.sink.counters.acked > acked
            assert any("succeeds again" in r.getMessage() and topic in r.getMessage() for r in caplog.records)
        finally:
            moving.set()
            exporter.stop()
            for t in threads:
                t.join(30)
            http.stop()
