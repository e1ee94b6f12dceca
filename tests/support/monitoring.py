"""The chart's alert rules and dashboard, as the tests read them, and the tools that check them.

``charts/flow-exporter/monitoring/alerts.yaml`` is the PrometheusRule's rule groups rendered with the
chart's default values; after changing the template or its values, write it again with
``.venv/bin/python -m tests.support.monitoring``. Prometheus and promtool come from
tools/prometheus/build.sh (the Go module proxy, cached in .cache/prometheus).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.go_tools import go_tool
from tests.support.paths import REPO

CHART = REPO / "charts" / "flow-exporter"
ALERTS = CHART / "monitoring" / "alerts.yaml"
DASHBOARD = CHART / "monitoring" / "dashboard.json"
HELM_VERSION = "v4.3.2"
PROMETHEUS_RELEASE = "3.16.0"
HEADER = (
    "# The flow exporter's alert rules, a plain Prometheus rules file: the chart's PrometheusRule\n"
    '# (templates/_alerts.tpl) rendered with the default values. Runbook: the README\'s "Runbook".\n'
    "# Do not edit: change the template or values.yaml, then .venv/bin/python -m tests.support.monitoring\n"
)


def helm() -> Path:
    return go_tool("helm", HELM_VERSION, "helm.sh/helm/v4/cmd/helm")


def prometheus_bin() -> Path:
    """The directory holding prometheus and promtool, built on first use."""
    subprocess.run(["bash", str(REPO / "tools" / "prometheus" / "build.sh")], check=True, timeout=3000)
    return REPO / ".cache" / "prometheus" / PROMETHEUS_RELEASE / "bin"


def render_rules(*sets: str) -> dict[str, Any]:
    """The PrometheusRule's spec (a rules file's content) rendered with ``--set`` values."""
    args = [str(helm()), "template", "flow-exporter", str(CHART), "--set", "prometheusRule.enabled=true"]
    args += ["--show-only", "templates/prometheusrule.yaml"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout
    spec: dict[str, Any] = yaml.safe_load(out)["spec"]
    return spec


def rules_text(spec: dict[str, Any]) -> str:
    return HEADER + yaml.safe_dump(spec, sort_keys=False, width=120)


def alert_rules(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in spec["groups"] for r in g["rules"] if "alert" in r]


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, query) of every target of every panel, and of the template variables."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert m, var
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def grafana_to_promql(query: str, rate_interval: str = "1m") -> str:
    """A dashboard query with its Grafana variables as Grafana fills them in (every value of $job and $instance)."""
    return query.replace("$__rate_interval", rate_interval).replace("$job", ".*").replace("$instance", ".*")


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


UNIT_TESTS = REPO / "tests" / "promtool" / "alerts_test.yaml"


def unit_test_files(rules: dict[str, Any], directory: Path) -> Path:
    """The promtool unit tests ready to run in ``directory``: the rules without annotations (promtool test rules
    compares them too; their text is checked apart) as the file the tests name, and the tests beside it."""
    bare = {"groups": [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
                       for g in rules["groups"]]}  # fmt: skip
    (directory / "alerts-conditions.yaml").write_text(yaml.safe_dump(bare, sort_keys=False))
    test_file = directory / UNIT_TESTS.name
    test_file.write_text(UNIT_TESTS.read_text())
    return test_file


def check_alerts() -> int:
    """``make check-alerts``: promtool check rules on the rules file, then its unit tests; promtool's exit code."""
    import tempfile

    promtool = str(prometheus_bin() / "promtool")
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], check=False)
    if r.returncode:
        return r.returncode
    with tempfile.TemporaryDirectory() as tmp:
        test_file = unit_test_files(yaml.safe_load(ALERTS.read_text()), Path(tmp))
        return subprocess.run([promtool, "test", "rules", str(test_file)], check=False).returncode


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        sys.exit(check_alerts())
    ALERTS.write_text(rules_text(render_rules()))
    print(f"wrote {ALERTS.relative_to(REPO)}", file=sys.stderr)
