"""A local Schema Registry for tests and ``make`` targets: the Confluent REST API subset clients use.

Why not the real one: Confluent's Schema Registry is not published on Maven Central and
Karapace is not on PyPI, so neither can be installed here. Clients only ever call a handful of
endpoints, and those are what this server implements, with the registry's semantics:

* ids are global and given per distinct schema text (normalised JSON), so the same schema
  registered under ``flows-value`` and ``io.flowexporter.FlowRecord`` has one id, as in
  Confluent's registry; versions count per subject from 1;
* ``POST /subjects/{s}/versions`` registers (idempotent), ``POST /subjects/{s}`` looks up,
  ``GET /schemas/ids/{id}`` fetches by id (what deserializers do: confluent-kafka, Flink's
  ``avro-confluent``, the Spark job), ``GET /subjects``, ``GET /subjects/{s}/versions[/{v}|/latest]``,
  ``PUT``/``GET /config[/{s}]``;
* optional HTTP basic auth: every request without the right ``Authorization`` gets 401.

No compatibility checking: ``tests/unit/test_schema_evolution.py`` checks the committed
schema versions itself. Python's ``ThreadingHTTPServer`` on loopback, a thread per request.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["RegistryServer"]

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def _normal(schema: str) -> str:
    """The text a schema is identified by: compact JSON (whitespace never changes identity)."""
    try:
        return json.dumps(json.loads(schema), separators=(",", ":"), sort_keys=True)
    except ValueError:
        return schema.strip()


class RegistryServer(ThreadingHTTPServer):
    """A started-on-enter registry on ``127.0.0.1:<free port>``; ``url`` says where."""

    daemon_threads = True

    def __init__(self, basic_auth: tuple[str, str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.schemas: list[str] = []  # id - 1 -> schema text as first registered
        self.ids: dict[str, int] = {}  # normalised text -> id
        self.subjects: dict[str, list[int]] = {}  # subject -> ids by version - 1
        self.config: dict[str, str] = {"": "BACKWARD"}
        self.requests: list[tuple[str, str]] = []  # (method, path), for tests that look
        self._auth = (
            "Basic " + base64.b64encode(f"{basic_auth[0]}:{basic_auth[1]}".encode()).decode() if basic_auth else None
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> RegistryServer:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True, name="registry")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5)
            self._thread = None
        self.server_close()

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the model
    def register(self, subject: str, schema: str) -> int:
        """Register ``schema`` under ``subject`` (idempotent); its global id."""
        with self.lock:
            key = _normal(schema)
            sid = self.ids.get(key)
            if sid is None:
                self.schemas.append(schema)
                sid = self.ids[key] = len(self.schemas)
            versions = self.subjects.setdefault(subject, [])
            if sid not in versions:
                versions.append(sid)
            return sid

    def authorised(self, header: str | None) -> bool:
        return self._auth is None or header == self._auth


def _version_body(subject: str, version: int, sid: int, schema: str) -> dict[str, Any]:
    return {"subject": subject, "version": version, "id": sid, "schema": schema}


class _Handler(BaseHTTPRequestHandler):
    server: RegistryServer
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", _CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: int, message: str) -> None:
        self._reply(status, {"error_code": code, "message": message})

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {}

    def _parts(self) -> list[str]:
        return [unquote(p) for p in urlsplit(self.path).path.split("/") if p]

    def _handle(self) -> None:
        server = self.server
        body = self._body() if self.command in ("POST", "PUT") else {}
        with server.lock:
            server.requests.append((self.command, self.path))
        if not server.authorised(self.headers.get("Authorization")):
            self._error(401, 401, "Unauthorized")
            return
        parts, method = self._parts(), self.command
        if parts[:2] == ["schemas", "ids"] and len(parts) == 3 and method == "GET":
            sid = int(parts[2]) if parts[2].isdigit() else 0
            if not 0 < sid <= len(server.schemas):
                self._error(404, 40403, f"Schema {parts[2]} not found")
            elif urlsplit(self.path).path.endswith("/schema"):
                self._reply(200, json.loads(server.schemas[sid - 1]))
            else:
                self._reply(200, {"schema": server.schemas[sid - 1]})
        elif parts == ["subjects"] and method == "GET":
            self._reply(200, sorted(server.subjects))
        elif parts[:1] == ["subjects"] and len(parts) >= 2:
            self._subject(parts[1], parts[2:], method, body)
        elif parts[:1] == ["config"] and len(parts) <= 2:
            subject = parts[1] if len(parts) == 2 else ""
            if method == "PUT":
                level = str(body.get("compatibility") or body.get("compatibilityLevel") or "")
                server.config[subject] = level
                self._reply(200, {"compatibility": level})
            elif method == "GET":
                level = server.config.get(subject) or server.config[""]
                self._reply(200, {"compatibilityLevel": level})
            else:
                self._error(405, 405, "Method not allowed")
        else:
            self._error(404, 404, f"no such endpoint: {method} {urlsplit(self.path).path}")

    def _subject(self, subject: str, rest: list[str], method: str, body: dict[str, Any]) -> None:
        server = self.server
        versions = server.subjects.get(subject)
        if rest == ["versions"] and method == "POST":
            schema = body.get("schema")
            if not isinstance(schema, str) or body.get("schemaType", "AVRO") != "AVRO":
                self._error(422, 42201, "Invalid schema")
                return
            self._reply(200, {"id": server.register(subject, schema)})
        elif not rest and method == "POST":
            schema = body.get("schema")
            sid = server.ids.get(_normal(schema)) if isinstance(schema, str) else None
            if versions is None:
                self._error(404, 40401, f"Subject '{subject}' not found.")
            elif sid is None or sid not in versions:
                self._error(404, 40403, "Schema not found")
            else:
                self._reply(200, _version_body(subject, versions.index(sid) + 1, sid, server.schemas[sid - 1]))
        elif versions is None:
            self._error(404, 40401, f"Subject '{subject}' not found.")
        elif rest == ["versions"] and method == "GET":
            self._reply(200, list(range(1, len(versions) + 1)))
        elif len(rest) == 2 and rest[0] == "versions" and method == "GET":
            which = rest[1]
            index = len(versions) if which in ("latest", "-1") else int(which) if which.isdigit() else 0
            if not 0 < index <= len(versions):
                self._error(404, 40402, f"Version {which} not found.")
                return
            sid = versions[index - 1]
            self._reply(200, _version_body(subject, index, sid, server.schemas[sid - 1]))
        else:
            self._error(405, 405, "Method not allowed")

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:
        pass
