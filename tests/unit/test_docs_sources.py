"""The documentation's sources: every relative link of the README, CONTRIBUTING, SECURITY and CHANGELOG
reaches a file, and every field of the record schema has its ECS and OpenTelemetry entry (the site's own links and
anchors are checked by MkDocs' strict build and, rendered, by tests/integration/test_docs_site.py)."""

from __future__ import annotations

import json
import re

import yaml

from devtools.docs_site import PAGES, avro_type
from tests.support.paths import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_and_contributing_links_reach_files() -> None:
    for name in ("README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md"):
        targets = [m.group(1) for m in LINK.finditer((REPO / name).read_text()) if "://" not in m.group(1)]
        assert targets or name == "SECURITY.md"
        missing = [t for t in targets if not (REPO / t).exists()]
        assert missing == [], f"{name}: {missing}"


def test_readme_is_a_front_door() -> None:
    """At most ~200 lines, and it routes to each getting-started page and the reference."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for page in ("try-locally", "deploy", "consume"):
        assert f"docs/getting-started/{page}.md" in text


def test_every_record_field_has_its_ecs_and_otel_entry() -> None:
    fields = [f["name"] for f in json.loads((REPO / "schemas" / "flow_record.avsc").read_text())["fields"]]
    names = yaml.safe_load((REPO / "schemas" / "field_names.yaml").read_text())
    assert list(names) == fields
    assert all(set(entry) == {"ecs", "otel"} for entry in names.values())


def test_reference_pages_render_and_avro_types_read_as_words() -> None:
    for render in PAGES.values():
        assert render().startswith("# ")
    assert avro_type(["null", "string"]) == "null or string"
    assert avro_type({"type": "long", "logicalType": "timestamp-millis"}) == "timestamp-millis"
    assert avro_type({"type": "map", "values": "string"}) == "map of string"
    assert avro_type(["null", {"type": "map", "values": "string"}]) == "null or map of string"
