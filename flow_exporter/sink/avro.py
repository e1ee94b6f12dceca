"""Bare Avro (schemaless) encoding of flow records with fastavro.

The schema file is the contract with consumers; no header or schema id is
written, so a consumer decodes each Kafka value with ``schemas/flow_record.avsc``.
"""

from __future__ import annotations

import io
from typing import Any

import fastavro

from flow_exporter.record import load_schema


class AvroSerializer:
    """Encodes one record dict to Avro binary."""

    def __init__(self, schema: dict[str, Any] | None = None) -> None:
        self.schema = fastavro.parse_schema(schema or load_schema())
        self._buf = io.BytesIO()

    def __call__(self, record: dict[str, Any]) -> bytes:
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()

    def decode(self, data: bytes) -> dict[str, Any]:
        return fastavro.schemaless_reader(io.BytesIO(data), self.schema, self.schema)
