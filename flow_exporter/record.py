"""Flow records: the Avro schema that is the contract with consumers.

Field names and meanings are in ``schemas/flow_record.avsc``; the hand-written encoder
(:mod:`flow_exporter.record_bytes`, with the message key) writes them, and ``tests/support/reference.py`` holds the
plain-dict reference it is tested against.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA_FILE = "flow_record.avsc"

# Keys of the Kubernetes fields the enrichment fills; null until then.
K8S_FIELDS = (
    "sourcePodName",
    "sourcePodNamespace",
    "sourceNodeName",
    "sourcePodLabels",
    "destinationPodName",
    "destinationPodNamespace",
    "destinationNodeName",
    "destinationPodLabels",
    "destinationServicePortName",
    "destinationService",
    "sourceZone",
    "destinationZone",
    "sourceNodeAddress",
    "destinationNodeAddress",
    "sourceOwnerKind",
    "sourceOwnerName",
    "destinationOwnerKind",
    "destinationOwnerName",
)
# The named networks of the ends that are not pods or nodes (flow_exporter.networks): after the Kubernetes fields.
NETWORK_FIELDS = ("sourceNetwork", "destinationNetwork")
# A connection's meta fields (its NewConnection.meta, besides flowType) in the schema's order: the encoder's prefix.
META_FIELDS = (*K8S_FIELDS, *NETWORK_FIELDS)


def schema_path(name: str = SCHEMA_FILE) -> Path:
    """A schema file, as package data (in a checkout, ``flow_exporter/schemas`` links to ``schemas/``)."""
    return Path(str(resources.files("flow_exporter") / "schemas" / name))


@lru_cache(maxsize=4)
def load_schema(name: str = SCHEMA_FILE) -> dict[str, Any]:
    """The parsed JSON of a packaged schema (flow records by default; health and marker records by name)."""
    schema: dict[str, Any] = json.loads(schema_path(name).read_text())
    return schema
