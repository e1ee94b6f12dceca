"""The metrics catalogue (what the docs' metrics reference is generated from) follows Prometheus conventions."""

from __future__ import annotations

import re

from flow_exporter.metrics import catalogue


def test_names_follow_prometheus_conventions() -> None:
    names = [name for name, *_ in catalogue()]
    assert len(names) == len(set(names))
    for name, kind, doc, _labels in catalogue():
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name) and doc
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if name.startswith("flow_exporter_"):
            assert not re.search(r"_(ms|milliseconds|kb|mb|mib)(_|$)", name), f"{name}: base units only"
            assert "_bytes_" not in name.removesuffix("_total") or name.endswith("_bytes"), name
    assert "flow_exporter_produced_bytes_total" in names and "flow_exporter_build_info" in names
    assert "process_resident_memory_bytes" in names and "process_cpu_seconds_total" in names
    assert ("flow_exporter_connections_given_up_total", "counter") in [(n, k) for n, k, *_ in catalogue()]
