"""The record encoder the sink is handed, and a batch's preparation with any encoder.

:class:`RecordEncoder` is :mod:`flow_exporter.record_bytes`'s (compiled where built: that module says
why and how the FlowRecord's bytes are written); :func:`prepare_each` prepares a batch with any
``encode`` callable (a registry's framing around the record encoder, a test's), :func:`prepare_with`
with the encoder's own batch pass when it has one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from flow_exporter.flow import Export
from flow_exporter.record_bytes import (  # the FlowRecord's bytes, written once (compiled where built)
    Encode,
    Failures,
    RecordEncoder,
    partition_key,
    prepare,
    zigzag_varint,
)

__all__ = [
    "BatchEncoder", "Encode", "Failures", "RecordEncoder", "partition_key", "prepare_each", "prepare_with",
    "zigzag_varint",
]  # fmt: skip


@runtime_checkable
class BatchEncoder(Protocol):
    """An encoder that also prepares a whole batch in one call (``RecordEncoder``, registry framing)."""

    def __call__(self, export: Export, export_ms: int) -> bytes: ...

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures: ...


def prepare_each(
    encode: Encode, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
) -> Failures:
    """Prepare every record not prepared yet with ``encode``: its topic (unless None), then value, key and export
    time; a record whose encoding raises comes back with its exception (record_bytes.prepare)."""
    return prepare(encode, exports, export_ms, topic, framing)


def prepare_with(
    encode: Encode, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
) -> Failures:
    """``encode``'s own batch preparation when it has one, else :func:`prepare_each`."""
    if isinstance(encode, BatchEncoder):
        return encode.prepare_all(exports, export_ms, topic, framing)
    return prepare_each(encode, exports, export_ms, topic, framing)
