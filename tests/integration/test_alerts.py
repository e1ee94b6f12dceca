"""The alert rules and the dashboard, checked by promtool (built from the Go module proxy with Prometheus,
tools/prometheus/build.sh): the rules file is valid and is what the chart renders, each alert fires on its
condition and stays quiet without it (tests/promtool/alerts_test.yaml), each names its runbook entry, and
the thresholds are chart values. The rules and the dashboard against a real Prometheus scraping the real
exporter: test_prometheus_lab.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.monitoring import (
    ALERTS,
    UNIT_TESTS,
    alert_rules,
    dashboard_queries,
    grafana_to_promql,
    load_dashboard,
    prometheus_bin,
    render_rules,
    rules_text,
    unit_test_files,
)
from tests.support.paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain to build promtool and helm with")


@pytest.fixture(scope="module")
def promtool() -> Path:
    return prometheus_bin() / "promtool"


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return spec


def test_the_plain_rules_file_is_the_chart_rendered_with_its_defaults(rules: dict[str, Any]) -> None:
    rendered = render_rules()
    assert rendered == rules, "run: .venv/bin/python -m tests.support.monitoring"
    assert ALERTS.read_text() == rules_text(rendered)


def test_promtool_check_rules(promtool: Path, rules: dict[str, Any]) -> None:
    r = subprocess.run([str(promtool), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules(rules))} rules found" in r.stdout


def test_promtool_unit_tests_fire_and_stay_quiet_for_every_alert(
    promtool: Path, rules: dict[str, Any], tmp_path: Path
) -> None:
    """promtool test rules compares annotations too: it runs on the rules without them (their text is
    checked below and, rendered, in the lab test), so the tests here are about when an alert fires."""
    test_file = unit_test_files(rules, tmp_path)
    r = subprocess.run([str(promtool), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # Every alert is tested, each with a series that fires and one, in the same test, that stays quiet.
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    covered = {}
    for t in tests:
        instances = {re.search(r'instance="(\w+)"', s["series"]).group(1) for s in t["input_series"]}  # type: ignore[union-attr]
        for case in t["alert_rule_test"]:
            fired = {a["exp_labels"]["instance"] for a in case["exp_alerts"]}
            if fired:
                assert instances - fired, f"{t['name']}: no series stays quiet"
                covered[case["alertname"]] = True
    assert sorted(covered) == sorted(a["alert"] for a in alert_rules(rules))


def test_every_alert_has_a_summary_a_severity_and_a_runbook_entry(rules: dict[str, Any]) -> None:
    page = (REPO / "docs" / "operations" / "alerts.md").read_text()
    runbook = page[page.index("\n## Runbook\n") :]
    end = runbook.find("\n## ", 1)
    runbook = runbook if end < 0 else runbook[:end]
    entries = re.findall(r"^### (\w+)$", runbook, re.M)
    names = [a["alert"] for a in alert_rules(rules)]
    assert entries == names  # one entry per alert, in the rules' order
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| .* \| (\w+) \|$", runbook, re.M)
    assert rows == [(a["alert"], a["labels"]["severity"], a["for"]) for a in alert_rules(rules)]  # the table
    for a in alert_rules(rules):
        assert a["labels"]["severity"] in ("critical", "warning"), a["alert"]
        assert "{{ $labels.instance }}" in a["annotations"]["summary"], a["alert"]
        assert a["annotations"]["description"].endswith(f"Runbook: {a['alert']}."), a["alert"]


def test_thresholds_and_durations_are_chart_values() -> None:
    spec = render_rules(
        "prometheusRule.thresholds.tableRatio=0.5", "prometheusRule.for.down=1m", "prometheusRule.rateWindow=2m",
        "prometheusRule.upSelector=job=\"fe\"", "prometheusRule.thresholds.pollSlowRatio=2",
    )  # fmt: skip
    by_name = {a["alert"]: a for a in alert_rules(spec)}
    assert by_name["FlowExporterConntrackTableNearFull"]["expr"] == (
        "flow_exporter_conntrack_entries / flow_exporter_conntrack_max > 0.5 and flow_exporter_conntrack_max > 0"
    )
    assert (by_name["FlowExporterDown"]["expr"], by_name["FlowExporterDown"]["for"]) == ('up{job="fe"} == 0', "1m")
    assert by_name["FlowExporterEventsLost"]["expr"] == "rate(flow_exporter_event_losses_total[2m]) > 0"
    assert by_name["FlowExporterPollSlow"]["expr"].endswith("/ flow_exporter_poll_interval_seconds > 2")


def test_the_dashboard_queries_parse(promtool: Path, tmp_path: Path) -> None:
    """Each query of each panel, as Grafana sends it (variables filled in), is valid PromQL: promtool checks
    it as the expression of a recording rule. Against a real Prometheus: test_prometheus_lab.py."""
    queries = dashboard_queries(load_dashboard())
    group = {"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": grafana_to_promql(q)} for i, (_, q) in enumerate(queries)]}  # fmt: skip
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [group]}))
    r = subprocess.run([str(promtool), "check", "rules", str(tmp_path / "queries.yaml")], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_make_check_alerts_passes_as_the_docs_say(promtool: Path) -> None:
    """The docs' command (`make check-alerts`, which runs tests.support.monitoring's check) on the repository."""
    r = subprocess.run(
        [sys.executable, "-m", "tests.support.monitoring", "check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == 2, r.stdout
    assert (
        "check-alerts:" in (REPO / "Makefile").read_text()
        and "make check-alerts" in (REPO / "docs" / "operations" / "alerts.md").read_text()
    )
