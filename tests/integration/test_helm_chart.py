"""The Helm chart: `helm lint`, `helm template` validated by a real kube-apiserver (server-side dry-run),
the Prometheus Operator's own PodMonitor CRD, config changes that roll the pods, and k8s/ as its render.

Helm is built from the Go module proxy (helm.sh/helm/v4) into .cache/helm on first use; the PodMonitor
CRD comes from the prometheus-operator module (the newest version served here), through `go mod download`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools import manifests
from devtools.apiserver import ApiServer
from flow_exporter.config import load
from flow_exporter.settings import SETTINGS
from flow_exporter.sink.kafka import check_config
from tests.integration.test_k8s_manifests import kustomize_build
from tests.support.go_tools import go_tool
from tests.support.paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain to build helm with")

CHART = REPO / "charts" / "flow-exporter"
HELM_VERSION = "v4.3.2"
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
NAMESPACE = "flow-exporter-helm"


@pytest.fixture(scope="module")
def helm() -> Path:
    return go_tool("helm", HELM_VERSION, "helm.sh/helm/v4/cmd/helm")


def template(helm: Path, *sets: str, release: str = "flow-exporter") -> list[dict[str, Any]]:
    args = [str(helm), "template", release, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def test_helm_lint_is_clean(helm: Path) -> None:
    r = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rendered_chart_passes_server_side_dry_run(helm: Path, apiserver: ApiServer) -> None:
    docs = template(helm)
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "ServiceAccount"]  # fmt: skip
    results = apiserver.dry_run_apply(docs)
    assert [(r["kind"], r["metadata"]["name"]) for r in results] == [(d["kind"], d["metadata"]["name"]) for d in docs]


def operator_crd(apiserver: ApiServer, plural: str) -> None:
    """The Prometheus Operator's own CRD for ``plural``, created in the API server."""
    info = subprocess.run(
        ["go", "mod", "download", "-json", PROMETHEUS_OPERATOR], check=True, capture_output=True, text=True,
        timeout=600, cwd=REPO / "tools" / "k8s" / "apiserver",
    )  # fmt: skip
    crds = Path(json.loads(info.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    crd_file = crds / f"monitoring.coreos.com_{plural}.yaml"
    apiserver.apply([yaml.safe_load(crd_file.read_text())])


def dry_run_custom(apiserver: ApiServer, doc: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:  # the CRD is established a moment after it is created
        try:
            [served] = apiserver.dry_run_apply([doc])
            return served
        except Exception:
            if time.monotonic() > deadline:
                raise
            apiserver.forget_discovery()  # the new kind is not in the cached discovery yet
            time.sleep(0.5)


def test_podmonitor_against_the_prometheus_operator_crd(helm: Path, apiserver: ApiServer) -> None:
    operator_crd(apiserver, "podmonitors")
    docs = template(helm, "podMonitor.enabled=true", "podMonitor.interval=15s", "podMonitor.labels.release=prom")
    monitor = find(docs, "PodMonitor")
    served = dry_run_custom(apiserver, monitor)
    assert served["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    selector = served["spec"]["selector"]["matchLabels"]
    assert find(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_alert_rules_and_dashboard_against_the_api_server(helm: Path, apiserver: ApiServer) -> None:
    """The PrometheusRule against the operator's own CRD, and the dashboard's ConfigMap, as the API server
    takes them; their content is the chart's plain files (monitoring/alerts.yaml, monitoring/dashboard.json)."""
    operator_crd(apiserver, "prometheusrules")
    docs = template(helm, "prometheusRule.enabled=true", "prometheusRule.labels.release=prom",
                    "grafanaDashboard.enabled=true", "grafanaDashboard.annotations.grafana_folder=Network")  # fmt: skip
    served = dry_run_custom(apiserver, find(docs, "PrometheusRule"))
    assert served["spec"] == yaml.safe_load((CHART / "monitoring" / "alerts.yaml").read_text())
    assert served["metadata"]["labels"]["release"] == "prom"
    [dashboard] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    [cm] = apiserver.dry_run_apply([dashboard])
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Network"}
    plain = json.loads((CHART / "monitoring" / "dashboard.json").read_text())
    assert json.loads(cm["data"]["flow-exporter.json"]) == plain


def test_helm_lint_with_alerts_and_dashboard_on(helm: Path) -> None:
    sets = ["--set", "prometheusRule.enabled=true", "--set", "grafanaDashboard.enabled=true"]
    r = subprocess.run([str(helm), "lint", "--strict", str(CHART), *sets], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_config_change_rolls_the_pods(helm: Path) -> None:
    def annotations(*sets: str) -> dict[str, str]:
        return dict(find(template(helm, *sets), "DaemonSet")["spec"]["template"]["metadata"]["annotations"])

    base = annotations()
    assert base == annotations()  # the same values, the same pod template: no needless rollout
    changed = annotations("config.conntrack.pollInterval=10s")
    assert changed["checksum/config"] != base["checksum/config"]
    assert annotations("resources.limits.cpu=2")["checksum/config"] == base["checksum/config"]


def test_values_reach_the_daemonset(helm: Path) -> None:
    docs = template(
        helm,
        "image.repository=registry.example/fe", "image.tag=9.9.9",
        "nodeSelector.pool=net", "tolerations[0].key=dedicated", "tolerations[0].operator=Exists",
        "resources.limits.memory=2Gi", "sysctlInit.enabled=false", "config.metrics.port=9777",
        release="prod",
    )  # fmt: skip
    spec = pod_spec(docs)
    [c] = spec["containers"]
    assert c["image"] == "registry.example/fe:9.9.9"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "net"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert c["resources"]["limits"]["memory"] == "2Gi" and "initContainers" not in spec
    assert c["ports"] == [{"name": "metrics", "containerPort": 9777, "protocol": "TCP"}]
    annotations = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9777"
    assert find(docs, "DaemonSet")["metadata"]["name"] == "prod-flow-exporter"
    assert find(docs, "ClusterRoleBinding")["subjects"][0]["name"] == spec["serviceAccountName"]


def _objects(docs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Objects by (kind, name), as far as a cluster would tell them apart: kustomize's hash suffix of the ConfigMap's
    name taken off, the config file parsed (its header comments are not settings), and the lists a
    strategic-merge patch merges sorted by their key (kustomize puts an item a patch adds first, Helm where the
    template has it; neither order means anything to the kubelet)."""
    out = {}
    for doc in docs:
        doc = yaml.safe_load(re.sub(r"\bflow-exporter-[a-z0-9]{10}\b", "flow-exporter", yaml.safe_dump(doc)))
        if doc["kind"] == "ConfigMap":
            doc["data"] = {k: yaml.safe_load(v) for k, v in doc["data"].items()}
        out[(doc["kind"], doc["metadata"]["name"])] = _sorted(doc)
    return out


def _sorted(node: Any, field: str = "") -> Any:
    if isinstance(node, dict):
        return {k: _sorted(v, k) for k, v in node.items()}
    if isinstance(node, list):
        items = [_sorted(v) for v in node]
        key = manifests.MERGE_KEYS.get(field)
        return sorted(items, key=lambda i: str(i[key])) if key and all(key in i for i in items) else items
    return node


def test_kustomize_build_of_k8s_is_the_charts_render(tmp_path: Path) -> None:
    """k8s/ is the chart's render (devtools.manifests): ``kustomize build`` of it makes the objects ``helm template``
    makes with k8s/values.yaml, but for the labels and annotation only a Helm release has; with the component
    k8s/cilium, the objects of k8s/cilium/values.yaml on top, the source given as its variable."""
    chart = _objects(manifests.without_helm(d) for d in yaml.safe_load_all(manifests.helm_template(manifests.VALUES)))
    built = _objects(d for d in yaml.safe_load_all(kustomize_build(REPO / "k8s")) if d)
    namespace = built.pop(("Namespace", "flow-exporter"))
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert built == chart
    assert "checksum/config" not in repr(built) and "helm.sh/chart" not in repr(built)

    cilium_values = manifests.helm_template(manifests.VALUES, manifests.CILIUM_VALUES)
    cilium = _objects(manifests.without_helm(d) for d in yaml.safe_load_all(cilium_values))
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(REPO / "k8s", overlay)],
        "components": [os.path.relpath(REPO / "k8s" / "cilium", overlay)],
    }))  # fmt: skip
    built = _objects(d for d in yaml.safe_load_all(kustomize_build(overlay)) if d)
    assert built.pop(("Namespace", "flow-exporter")) == namespace
    config = ("ConfigMap", "flow-exporter")
    assert cilium[config]["data"]["config.yaml"]["conntrack"]["source"] == "cilium"
    assert built[config] == chart[config]  # the base's config file, the source as a variable instead:
    cilium[config] = chart[config]
    [container] = cilium[("DaemonSet", "flow-exporter")]["spec"]["template"]["spec"]["containers"]
    container["env"] = _sorted(
        [*container["env"], {"name": "FLOW_EXPORTER_CONNTRACK_SOURCE", "value": "cilium"}], "env"
    )
    assert built == cilium
    # The variable is that setting's, and the config with it loads as the exporter loads it (bad input would raise).
    assert {s.env: s.key for s in SETTINGS}["FLOW_EXPORTER_CONNTRACK_SOURCE"] == "conntrack.source"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(chart[config]["data"]["config.yaml"]))
    load(path, environ={"FLOW_EXPORTER_CONNTRACK_SOURCE": "cilium"}, checks=(check_config,))


def test_values_schema_is_generated_from_the_settings() -> None:
    from tests.support import chart_schema

    assert chart_schema.SCHEMA.read_text() == chart_schema.text(), "run: .venv/bin/python -m tests.support.chart_schema"


@pytest.mark.parametrize(
    ("value", "said"),
    [("config.kafka.topicc=flows", "additional properties 'topicc' not allowed"),
     ("config.conntrack.events=maybe", "got string, want boolean"),
     ("config.sampling.budget.connectionz=5", "additional properties 'connectionz' not allowed"),
     ("image.pullPolicy=Sometimes", "pullPolicy"),
     ("terminationGracePeriodSeconds=0", "terminationGracePeriodSeconds")],
)  # fmt: skip
def test_a_bad_value_is_refused_by_helm_naming_it(helm: Path, value: str, said: str) -> None:
    """values.schema.json: a bad value fails `helm template` (and install, upgrade, lint) instead of rendering a
    config the pods crash-loop on."""
    r = subprocess.run([str(helm), "template", "x", str(CHART), "--set", value], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode != 0 and said in r.stderr, r.stderr


def test_enrichment_off_gets_no_token_and_no_rbac(helm: Path) -> None:
    on = template(helm)
    assert pod_spec(on)["automountServiceAccountToken"] is True
    assert {d["kind"] for d in on} >= {"ClusterRole", "ClusterRoleBinding", "ServiceAccount"}
    off = template(helm, "config.k8s.enabled=false")
    assert pod_spec(off)["automountServiceAccountToken"] is False
    assert not {d["kind"] for d in off} & {"ClusterRole", "ClusterRoleBinding"}
    own = template(helm, "rbac.create=false")  # enrichment on, the RBAC the user's own
    assert not {d["kind"] for d in own} & {"ClusterRole", "ClusterRoleBinding"}
    assert pod_spec(own)["automountServiceAccountToken"] is True
