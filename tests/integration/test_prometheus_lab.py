"""A real Prometheus (3.16, built from the Go module proxy: tools/prometheus/build.sh) scrapes the real
exporter in the namespace lab, with the chart's alert rules rendered with short windows and `for:`
durations (the same template, test values). Two alerts are driven for real and seen firing through
Prometheus's HTTP API, each quiet before its cause: a table past limits.maxConnections
(FlowExporterConnectionsGivenUp) and the broker stopped for longer than the threshold
(FlowExporterDeliveriesFailing, and FlowExporterNotReady with it). Then every alert expression and every
dashboard query evaluates without error, and every series they select is there.

The dashboard's memory and CPU limits come from kube-state-metrics (built from the Go module proxy too),
watching the real test API server, where the exporter's pod stands as the chart renders it (no kubelet
runs it: kube-state-metrics reads limits from the pod spec). Prometheus gives the exporter's target the
namespace and pod labels a PodMonitor would, so the dashboard's join finds that pod.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.apiserver import ApiServer
from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from tests.support.exporter_process import free_port, start_exporter
from tests.support.go_tools import go_tool
from tests.support.monitoring import (
    CHART,
    alert_rules,
    dashboard_queries,
    grafana_to_promql,
    helm,
    load_dashboard,
    prometheus_bin,
    render_rules,
)
from tests.support.waiting import until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.kafka,
    pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain to build prometheus with"),
]

CAP = 40  # limits.maxConnections
WINDOW = "20s"  # prometheusRule.rateWindow for the test (5m in the chart)
FOR = "5s"  # every prometheusRule.for.* for the test
KSM_VERSION = "v2.20.0"
NAMESPACE = "flow-exporter-alerts"
POD = "flow-exporter-lab"


class Prometheus:
    def __init__(self, binary: Path, workdir: Path, scrapes: list[dict[str, Any]], rules: dict[str, Any]) -> None:
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": scrapes,
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [str(binary), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, cwd=workdir,
        )  # fmt: skip
        until(lambda: self.ready(), 60, lambda: "prometheus not ready: " + self.log.read_text()[-3000:])

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        data = urllib.parse.urlencode(params).encode() if params else None
        try:
            with urllib.request.urlopen(url, data=data, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        data = self.api("query", query=promql)
        assert data["resultType"] in ("vector", "scalar"), (promql, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, promql: str, start: float, end: float) -> list[dict[str, Any]]:
        """As Grafana asks for a panel's time range (one point a second)."""
        data = self.api("query_range", query=promql, start=f"{start:.3f}", end=f"{end:.3f}", step="1")
        assert data["resultType"] == "matrix", (promql, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self, state: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == state]

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts("firing") if a["labels"]["alertname"] == name]

    def active(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity of the forms the chart uses ("1Gi", "512Mi", "1", "500m") as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def selectors(node: Any) -> Iterator[str]:
    """Every series selector in a parsed query (Prometheus's /api/v1/parse_query tree), as an instant selector."""
    if isinstance(node, dict):
        if node.get("type") in ("vectorSelector", "matrixSelector"):
            matchers = ", ".join(f"{m['name']}{m['type']}{json.dumps(m['value'])}" for m in node["matchers"])
            yield "{" + matchers + "}"
            return
        for value in node.values():
            yield from selectors(value)
    elif isinstance(node, list):
        for item in node:
            yield from selectors(item)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A broker of the test's own: this test stops it."""
    with KafkaBroker(tmp_path / "kafka") as b:
        yield b


@pytest.fixture(scope="module")
def prometheus_binary() -> Path:
    return prometheus_bin() / "prometheus"


@pytest.fixture
def kube_state_metrics(apiserver: ApiServer, tmp_path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """kube-state-metrics on a free port, watching the exporter's pod as the chart renders it; and that container."""
    binary = go_tool("kube-state-metrics", KSM_VERSION, "k8s.io/kube-state-metrics/v2")
    [daemonset] = [d for d in template_chart() if d["kind"] == "DaemonSet"]
    [container] = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "flow-exporter"]
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NAMESPACE},
        "spec": {"containers": [{k: container[k] for k in ("name", "image", "resources")}]},
    }  # fmt: skip
    apiserver.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}, pod])
    port, telemetry = free_port(), free_port()
    log = tmp_path / "kube-state-metrics.log"
    proc = subprocess.Popen(
        [str(binary), f"--kubeconfig={apiserver.admin_kubeconfig}", "--resources=pods", f"--namespaces={NAMESPACE}",
         "--host=127.0.0.1", f"--port={port}", "--telemetry-host=127.0.0.1", f"--telemetry-port={telemetry}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield port, container
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def template_chart() -> list[dict[str, Any]]:
    out = subprocess.run([str(helm()), "template", "flow-exporter", str(CHART), "--namespace", NAMESPACE],
                         check=True, capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def test_prometheus_scrapes_the_exporter_and_the_alerts_fire_for_real(
    lab: Lab,
    broker: KafkaBroker,
    prometheus_binary: Path,
    kube_state_metrics: tuple[int, dict[str, Any]],
    tmp_path: Path,
) -> None:
    ksm_port, container = kube_state_metrics
    topic = "alerts"
    broker.create_topic(topic)
    p1, p2, p3 = lab.pods
    port = free_port()
    log = tmp_path / "exporter.log"
    proc = start_exporter(
        lab, broker.bootstrap, topic, log,
        "--set", f"limits.maxConnections={CAP}",
        "--set", f"state.dir={tmp_path / 'state'}",  # the checkpoint families, for the checkpoint alerts
        "--set", "kafka.producer={message.timeout.ms: 3000, statistics.interval.ms: 1000}",
        "--set", "kafka.readyTimeout=5s",
        "--set", "shutdown.grace=2s",
        metrics_port=port,
    )  # fmt: skip
    for_values = yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["for"]
    rules = render_rules(f"prometheusRule.rateWindow={WINDOW}", *(f"prometheusRule.for.{k}={FOR}" for k in for_values))
    scrape_configs = [
        # The labels a PodMonitor gives the exporter's target (the pod's namespace and name).
        {"job_name": "flow-exporter",
         "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": NAMESPACE, "pod": POD}}]},
        {"job_name": "kube-state-metrics", "static_configs": [{"targets": [f"127.0.0.1:{ksm_port}"]}]},
    ]  # fmt: skip
    prom = Prometheus(prometheus_binary, tmp_path, scrape_configs, rules)
    start = time.time()
    longs = [lab.open_tcp([p1, p2][i % 2], p3, 7600) for i in range(6)]
    try:

        def traffic() -> None:
            for c in longs:
                c.send(500)

        def delivering() -> bool:
            traffic()
            return bool(prom.query(f"increase(flow_exporter_records_acknowledged_total[{WINDOW}]) > 0"))

        until(delivering, 60, lambda: "no delivery seen by prometheus; " + log.read_text()[-3000:])
        assert prom.firing("FlowExporterConnectionsGivenUp") == []

        # A table past the cap: connections are given up, and the alert fires.
        lab.load_synthetic(2 * CAP, netns=lab.node_ns)
        [given_up] = until(lambda: traffic() or prom.firing("FlowExporterConnectionsGivenUp"), 90,
                           lambda: f"not firing: {prom.api('alerts')}; {log.read_text()[-2000:]}")  # fmt: skip
        assert given_up["labels"] == {
            "alertname": "FlowExporterConnectionsGivenUp", "instance": f"127.0.0.1:{port}", "job": "flow-exporter",
            "namespace": NAMESPACE, "pod": POD, "severity": "warning"}  # fmt: skip
        assert given_up["annotations"]["summary"] == (
            f"The flow exporter on 127.0.0.1:{port} gives connections up at limits.maxConnections.")  # fmt: skip
        assert given_up["annotations"]["description"].endswith("Runbook: FlowExporterConnectionsGivenUp.")
        assert prom.query("flow_exporter_max_connections")[0]["value"][1] == str(CAP)
        assert prom.active("FlowExporterDeliveriesFailing") == []
        assert prom.active("FlowExporterNotReady") == []

        # The broker stopped for longer than the threshold: deliveries fail, the exporter is not ready.
        broker.stop()
        [failing] = until(lambda: traffic() or prom.firing("FlowExporterDeliveriesFailing"), 120,
                          lambda: f"not firing: {prom.api('alerts')}; {log.read_text()[-2000:]}")  # fmt: skip
        assert (failing["labels"]["instance"], failing["labels"]["severity"]) == (f"127.0.0.1:{port}", "critical")
        assert failing["annotations"]["description"].endswith("Runbook: FlowExporterDeliveriesFailing.")
        until(lambda: prom.firing("FlowExporterNotReady"), 60, lambda: f"not firing: {prom.api('alerts')}")
        until(lambda: traffic() or prom.query('flow_exporter_delivery_failures_total{error="_MSG_TIMED_OUT"} > 0'),
              60, lambda: log.read_text()[-2000:])  # fmt: skip

        # Every alert expression evaluates, and every series it selects is there.
        for alert in alert_rules(rules):
            prom.query(alert["expr"])  # no error
            tree = prom.api("parse_query", query=alert["expr"])
            for selector in selectors(tree):
                assert prom.query(selector), f"{alert['alert']}: {selector} selects nothing"
        # Every dashboard query, as Grafana sends it for the test's time range, returns series. A range,
        # not an instant: with the broker down, librdkafka's statistics list no broker, so the round-trip
        # times are there only for the time before.
        end = time.time()
        results = {}
        for title, query in dashboard_queries(load_dashboard()):
            results[query] = prom.query_range(grafana_to_promql(query), start, end)
            assert results[query], f"{title}: {query} returns nothing"
        # The pod's limits, as the chart sets them, reach the memory and CPU panels.
        limits = {q: r for q, r in results.items() if "kube_pod_container_resource_limits" in q}
        memory, cpu = (next(r for q, r in limits.items() if f'resource="{k}"' in q) for k in ("memory", "cpu"))
        assert [(s["metric"]["pod"], float(s["values"][-1][1])) for s in memory] == [
            (POD, parse_quantity(container["resources"]["limits"]["memory"]))]  # fmt: skip
        assert [(s["metric"]["pod"], float(s["values"][-1][1])) for s in cpu] == [
            (POD, parse_quantity(container["resources"]["limits"]["cpu"]))]  # fmt: skip
    finally:
        prom.close()
        proc.kill()
        proc.wait(10)
        for c in longs:
            c.close()
