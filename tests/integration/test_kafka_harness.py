"""The Kafka harness behaves like a real broker: data survives restarts and crashes, SASL works.

Other tests trust the harness to tell "the exporter lost data" from "the broker lost data", so
these check the broker side on its own, with plain confluent-kafka clients.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from devtools.kafka import KafkaBroker, KafkaBrokerError

pytestmark = pytest.mark.kafka

ALICE = {"alice": "alice-secret"}


def produce(conf: dict[str, Any], topic: str, *values: bytes) -> None:
    """Produce with acks=all and fail unless every message is acknowledged."""
    failures: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    producer = Producer({"acks": "all", "message.timeout.ms": 15000, **conf})
    for value in values:
        producer.produce(topic, value, on_delivery=on_delivery)
    assert producer.flush(20) == 0, "messages still queued after 20 s"
    assert not failures, failures


def consume(bootstrap: str, topic: str, group: str, count: int, timeout: float = 30.0) -> list[bytes]:
    """Read ``count`` messages as consumer group ``group`` (from the earliest offset if it has none).

    Polls briefly past ``count`` so an unexpected extra message shows up in the result, then
    commits, so a later read by the same group starts after what this one saw.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    values: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while len(values) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            values.append(msg.value())
        extra = consumer.poll(0.5)
        if extra is not None and not extra.error():
            values.append(extra.value())
        if values:
            consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return values


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A broker just for these tests, since they restart and kill it under the shared one's feet."""
    with KafkaBroker(tmp_path_factory.mktemp("own-broker")) as broker:
        yield broker


def test_messages_and_offsets_survive_a_clean_restart(own_broker: KafkaBroker) -> None:
    topic = "restart-" + uuid.uuid4().hex[:8]
    own_broker.create_topic(topic)
    first, fresh = group(), group()
    produce({"bootstrap.servers": own_broker.bootstrap}, topic, b"before")
    assert consume(own_broker.bootstrap, topic, first, 1) == [b"before"]

    old_pid, address = own_broker.pid, own_broker.bootstrap
    own_broker.restart()
    assert own_broker.pid != old_pid
    assert own_broker.bootstrap == address

    produce({"bootstrap.servers": own_broker.bootstrap}, topic, b"after")
    # The committed offset of the first group survived too: it sees only the new message.
    assert consume(own_broker.bootstrap, topic, first, 1) == [b"after"]
    assert consume(own_broker.bootstrap, topic, fresh, 2) == [b"before", b"after"]


def test_acknowledged_messages_survive_kill_and_start(own_broker: KafkaBroker) -> None:
    topic = "crash-" + uuid.uuid4().hex[:8]
    own_broker.create_topic(topic)
    produce({"bootstrap.servers": own_broker.bootstrap}, topic, b"one", b"two")
    pid = own_broker.pid
    assert pid is not None

    own_broker.kill()
    assert own_broker.pid is None
    assert process_gone(pid)
    own_broker.start()

    assert consume(own_broker.bootstrap, topic, group(), 2) == [b"one", b"two"]
    produce({"bootstrap.servers": own_broker.bootstrap}, topic, b"three")
    assert consume(own_broker.bootstrap, topic, group(), 3) == [b"one", b"two", b"three"]


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    with KafkaBroker(tmp_path_factory.mktemp("sasl-broker"), scram_users=ALICE) as broker:
        yield broker


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"])
def test_sasl_listener_accepts_the_right_password(sasl_broker: KafkaBroker, mechanism: str) -> None:
    topic = f"sasl-{mechanism.lower()}-{uuid.uuid4().hex[:6]}"
    sasl_broker.create_topic(topic)
    produce(sasl_broker.sasl_client_config("alice", mechanism), topic, mechanism.encode())
    assert consume(sasl_broker.bootstrap, topic, group(), 1) == [mechanism.encode()]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"])
def test_sasl_listener_rejects_a_wrong_password(sasl_broker: KafkaBroker, mechanism: str) -> None:
    errors: list[KafkaError] = []
    producer = Producer(sasl_broker.sasl_client_config("alice", mechanism, "wrong", error_cb=errors.append))
    with pytest.raises(KafkaException):
        producer.list_topics(timeout=1)
    deadline = time.monotonic() + 10
    while not any(e.code() == KafkaError._AUTHENTICATION for e in errors) and time.monotonic() < deadline:
        producer.poll(0.2)
    auth = [e for e in errors if e.code() == KafkaError._AUTHENTICATION]
    assert auth, f"no authentication error reported; got {errors}"
    assert "Authentication failed" in auth[0].str()


def test_broker_log_goes_to_the_workdir(own_broker: KafkaBroker) -> None:
    text = own_broker.log_path.read_text()
    assert own_broker.log_path == own_broker.workdir / "broker.log"
    assert " INFO " in text
    assert "Kafka Server started" in text


def test_shared_fixtures_give_a_ready_topic(kafka_broker: KafkaBroker, kafka_topic: str) -> None:
    produce({"bootstrap.servers": kafka_broker.bootstrap}, kafka_topic, b"hello")
    assert consume(kafka_broker.bootstrap, kafka_topic, group(), 1) == [b"hello"]


def test_sasl_user_names_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="bad name"):
        KafkaBroker(scram_users={"bad name": "x"})


def test_owned_temp_workdir_is_removed_on_close() -> None:
    broker = KafkaBroker()
    workdir: Path = broker.workdir
    assert workdir.is_dir()
    broker.close()
    assert not workdir.exists()


def test_a_bad_config_fails_with_a_readable_error(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path, extra_props={"num.partitions": "many"})
    with pytest.raises(KafkaBrokerError, match=r"num\.partitions"):
        broker.start(timeout=60)
    assert broker.pid is None
