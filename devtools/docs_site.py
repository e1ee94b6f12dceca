"""The documentation site's reference pages, generated while MkDocs builds (``hooks:`` in ``mkdocs.yml``).

Every setting, metric and record field is read from the code's own tables at build time: the settings table
(:data:`flow_exporter.settings.SETTINGS`), the metrics the exporter serves (:func:`flow_exporter.metrics.catalogue`),
and the Avro schemas with their ``doc`` strings (plus ``schemas/field_names.yaml`` for the ECS and OpenTelemetry
names). Nothing here is committed as Markdown, so a reference page cannot drift from the code: a new setting or
field is on the site the next time it is built. ``python -m devtools.docs_site DIR`` writes the same pages to a
directory, to read them without building the site.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from flow_exporter import settings as settings_table
from flow_exporter.metrics import catalogue

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "schemas"
GENERATED = "<!-- generated while the site is built (devtools/docs_site.py) from {source}; edit that, not this -->"


def _cell(text: object) -> str:
    """A Markdown table cell: no pipe or newline breaks the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------ settings
def settings_page() -> str:
    """Every setting with its type, default, environment variable and meaning, grouped by its first key part."""
    lines = [
        "# Settings",
        "",
        GENERATED.format(source="flow_exporter/settings.py"),
        "",
        "Every setting the exporter takes, from its settings table. Set one in the YAML file (`--config`), as an",
        "environment variable, or with `--set key=value`, in increasing order of precedence; see",
        "[Configuration](../operations/configuration.md) for the rules and",
        "`flow-exporter config --print-defaults` for the same list as a commented YAML file.",
        "Secrets are shown as `***` wherever the exporter prints settings.",
        "",
    ]
    groups: dict[str, list[settings_table.Setting]] = {}
    for setting in settings_table.SETTINGS:
        head = setting.key.split(".", 1)[0] if "." in setting.key else "general"
        groups.setdefault(head, []).append(setting)
    for head, members in groups.items():
        lines += [
            f"## {head}",
            "",
            "| key | type | default | environment variable | meaning |",
            "|---|---|---|---|---|",
        ]
        for s in members:
            default = settings_table.format_default(s)
            secret = " (secret)" if s.secret else ""
            lines.append(f"| `{s.key}` | {_cell(s.kind)}{secret} | `{_cell(default)}` | `{s.env}` | {_cell(s.doc)} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ metrics
def metrics_page() -> str:
    """Every family ``/metrics`` serves, read from a registry the exporter's own collector fed."""
    lines = [
        "# Metrics",
        "",
        GENERATED.format(source="flow_exporter/metrics.py"),
        "",
        "Every metric family `/metrics` serves, in order, as the exporter's own collector reports it. What they",
        "mean together, and what to alert on: [Metrics and health](../operations/metrics.md) and",
        "[Alerts, dashboard and runbook](../operations/alerts.md).",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, kind, doc, labels in catalogue():
        shown = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {shown} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ record fields
def avro_type(t: Any) -> str:
    """An Avro type in words, as a reader of the table wants it: ``null or string``, ``timestamp-millis``."""
    if isinstance(t, list):
        return " or ".join(avro_type(x) for x in t)
    if isinstance(t, dict):
        if "logicalType" in t:
            return str(t["logicalType"])
        if t.get("type") == "map":
            return f"map of {avro_type(t['values'])}"
        if t.get("type") == "array":
            return f"array of {avro_type(t['items'])}"
        if t.get("type") == "enum":
            return "enum: " + ", ".join(t["symbols"])
        return avro_type(t["type"])
    return str(t)


def _schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{name}.avsc").read_text())
    return loaded


def records_page() -> str:
    """The FlowRecord's fields: type, meaning (the schema's doc), and the ECS and OpenTelemetry names."""
    schema = _schema("flow_record")
    names: dict[str, dict[str, str | None]] = yaml.safe_load((SCHEMAS / "field_names.yaml").read_text())
    lines = [
        "# Record fields",
        "",
        GENERATED.format(source="schemas/flow_record.avsc and schemas/field_names.yaml"),
        "",
        f"Every field of `schemas/flow_record.avsc` ({schema['namespace']}.{schema['name']}), in the order",
        "they are encoded, with the schema's own doc strings. Fields fixed for a connection's life come first.",
        "How to count with them: [Counting: the contract](../concepts/counting.md).",
        "",
        "The ECS and OpenTelemetry columns say what to rename a field to, to load the records next to other",
        "tools' data (ECS: the Elastic Common Schema; OpenTelemetry: its general and `k8s.*` semantic",
        "conventions, which describe one resource, so for a flow they apply to each end separately). A dash:",
        "that schema has no field for it (the field is this exporter's own).",
        "",
        "| field | type | ECS | OpenTelemetry | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in schema["fields"]:
        name = field["name"]
        mapped = names.get(name)
        if mapped is None:
            raise ValueError(f"schemas/field_names.yaml has no entry for the field {name!r}")
        ecs, otel = (mapped.get(k) or "-" for k in ("ecs", "otel"))
        kind, doc = _cell(avro_type(field["type"])), _cell(field.get("doc", ""))
        lines.append(f"| `{name}` | {kind} | {_cell(ecs)} | {_cell(otel)} | {doc} |")
    extra = set(names) - {f["name"] for f in schema["fields"]}
    if extra:
        raise ValueError(f"schemas/field_names.yaml names fields the schema does not have: {sorted(extra)}")
    return "\n".join(lines) + "\n"


def streams_page() -> str:
    """The completeness markers' and the health stream's fields, from their schemas."""
    lines = [
        "# Marker and health fields",
        "",
        GENERATED.format(source="schemas/completeness_marker.avsc and schemas/conntrack_health.avsc"),
        "",
        "The two side streams, each bare Avro on its own topic: what they promise is in",
        "[Counter fidelity, completeness and conntrack health](../concepts/completeness.md).",
        "",
    ]
    for name, title in (("completeness_marker", "Completeness markers"), ("conntrack_health", "Conntrack health")):
        schema = _schema(name)
        lines += [f"## {title}", "", f"`schemas/{name}.avsc` ({schema['namespace']}.{schema['name']}).", ""]
        lines += ["| field | type | meaning |", "|---|---|---|"]
        for field in schema["fields"]:
            lines.append(f"| `{field['name']}` | {_cell(avro_type(field['type']))} | {_cell(field.get('doc', ''))} |")
        lines.append("")
    return "\n".join(lines)


PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page,
    "reference/metrics.md": metrics_page,
    "reference/records.md": records_page,
    "reference/streams.md": streams_page,
}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site's files before the build reads them."""
    from mkdocs.structure.files import File

    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path("site-reference")
    for path, render in PAGES.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render())
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
