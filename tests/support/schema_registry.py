"""Schema Registry stand-ins: confluent-kafka's in-memory client and a stub of the REST API on loopback.

``stub`` is a fixture (loaded by tests/conftest.py) giving a started StubRegistry.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient, record_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from flow_exporter.record import schema_path

__all__ = [
    "CTX",
    "INCOMPATIBLE",
    "SCHEMA_TEXT",
    "StubRegistry",
    "closed_port",
    "mock_client",
    "reference",
    "stub",
]

SCHEMA_TEXT = schema_path().read_text()
CTX = SerializationContext("flows", MessageField.VALUE)


def mock_client() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://flow-{time.time_ns()}"})


def reference(
    client: SchemaRegistryClient, strategy: Callable[..., Any] = record_subject_name_strategy
) -> AvroSerializer:
    """confluent-kafka's serializer, told to find (not register) the schema under the strategy's subject."""
    return AvroSerializer(
        client,
        SCHEMA_TEXT,
        conf={"auto.register.schemas": False, "subject.name.strategy": strategy},
    )


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class StubRegistry(ThreadingHTTPServer):
    """Answers PUT /config/{subject} and POST /subjects/{subject}/versions like the registry's REST API.

    ``answers`` holds the (status, body) to give to successive registrations; after them, id 7.
    Not a registry: it only lets the test see what the real client sends.
    """

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.requests: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.config_status = 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StubHandler(BaseHTTPRequestHandler):
    server: StubRegistry

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict[str, Any]:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.requests.append((self.command, self.path, body, self.headers.get("Authorization")))
        return body

    def do_PUT(self) -> None:
        body = self._record()
        if self.server.config_status != 200:
            self._reply(self.server.config_status, {"error_code": 40301, "message": "User is denied operation"})
        else:
            self._reply(200, body)

    def do_POST(self) -> None:
        self._record()
        if self.server.answers:
            self._reply(*self.server.answers.pop(0))
        else:
            self._reply(200, {"id": 7})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[StubRegistry]:
    server = StubRegistry()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


INCOMPATIBLE = (409, {"error_code": 409, "message": "Schema being registered is incompatible with an earlier schema"})
