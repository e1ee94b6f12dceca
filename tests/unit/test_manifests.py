"""k8s/ is what the chart renders (devtools.manifests), and the generator's own rules.

The first test runs helm (``make setup-k8s`` builds it into .cache/helm; without it the generator builds it
with the Go toolchain, as the chart's integration tests do). tests/integration/test_helm_chart.py holds
``kustomize build`` of k8s/, with and without its Cilium component, to the chart's own render.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from devtools import manifests
from devtools.manifests import ManifestError, config_env, plain_text, strategic_patch, without_helm

HELM_MISSING = not (manifests.REPO / ".cache" / "helm" / manifests.HELM_VERSION / "bin" / "helm").is_file()


@pytest.mark.skipif(HELM_MISSING and shutil.which("go") is None, reason="no helm and no Go toolchain to build it")
def test_k8s_is_what_the_chart_renders() -> None:
    files = manifests.render()
    on_disk = {p.relative_to(manifests.K8S).as_posix() for p in manifests.K8S.rglob("*") if p.is_file()}
    assert on_disk == set(files) | manifests.HAND_WRITTEN, "run: .venv/bin/python -m devtools.manifests"
    for name, text in files.items():
        assert (manifests.K8S / name).read_text() == text, f"k8s/{name}: run .venv/bin/python -m devtools.manifests"
    assert manifests.stale(files=files) == []


def test_helm_only_labels_and_annotations_are_dropped_everywhere() -> None:
    doc = {
        "metadata": {"name": "x", "labels": {"a": "1", "helm.sh/chart": "c-1", "app.kubernetes.io/managed-by": "Helm"}},
        "spec": {"template": {"metadata": {"labels": {"helm.sh/chart": "c-1"},
                                           "annotations": {"checksum/config": "ab", "keep": "me"}}}},
    }  # fmt: skip
    assert without_helm(doc) == {
        "metadata": {"name": "x", "labels": {"a": "1"}},
        "spec": {"template": {"metadata": {"annotations": {"keep": "me"}}}},
    }


def test_the_text_edit_is_held_to_the_object_edit() -> None:
    text = "kind: ConfigMap\nmetadata:\n  name: x\n  labels:\n    helm.sh/chart: c-1\n    a: b\n"
    assert plain_text(text) == "kind: ConfigMap\nmetadata:\n  name: x\n  labels:\n    a: b\n"
    # A line that looks like the label inside a block of data is data: dropping it would change the object.
    inside = "kind: ConfigMap\nmetadata:\n  name: x\ndata:\n  notes: |\n    helm.sh/chart: c-1\n"
    with pytest.raises(ManifestError, match="changed more"):
        plain_text(inside)


def test_strategic_patch_of_a_pod_spec() -> None:
    base: dict[str, Any] = {
        "initContainers": [{"name": "init", "image": "busybox"}],
        "containers": [{"name": "c", "image": "i", "env": [{"name": "A", "value": "1"}],
                        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}}}],
        "volumes": [{"name": "v", "emptyDir": {}}],
        "hostNetwork": True,
    }  # fmt: skip
    target: dict[str, Any] = {
        "containers": [{"name": "c", "image": "i", "env": [{"name": "A", "value": "1"}],
                        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["BPF"]}},
                        "volumeMounts": [{"name": "b", "mountPath": "/sys/fs/bpf"}]}],
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "b", "hostPath": {"path": "/sys/fs/bpf"}}],
        "hostNetwork": True,
    }  # fmt: skip
    assert strategic_patch(base, target) == {
        "initContainers": None,  # gone from the target: a null deletes the field
        "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["BPF"]}},
                        "volumeMounts": [{"name": "b", "mountPath": "/sys/fs/bpf"}]}],
        "volumes": [{"name": "b", "hostPath": {"path": "/sys/fs/bpf"}}],
    }  # fmt: skip
    fewer = {**target, "initContainers": [{"name": "other", "image": "x"}]}
    assert strategic_patch(base, fewer)["initContainers"] == [
        {"name": "init", "$patch": "delete"},
        {"name": "other", "image": "x"},
    ]


def test_strategic_patch_refuses_a_reordered_merged_list() -> None:
    base = {"volumes": [{"name": "a"}, {"name": "b"}]}
    with pytest.raises(ManifestError, match="order"):
        strategic_patch(base, {"volumes": [{"name": "b"}, {"name": "a"}]})


def test_config_differences_become_their_variables() -> None:
    base = {"conntrack": {"source": "netfilter", "events": True}, "kafka": {"topic": "flows"}}
    target = {"conntrack": {"source": "cilium", "events": False}, "kafka": {"topic": "flows"}}
    assert config_env(base, target) == [
        {"name": "FLOW_EXPORTER_CONNTRACK_SOURCE", "value": "cilium"},
        {"name": "FLOW_EXPORTER_CONNTRACK_EVENTS", "value": "false"},
    ]
    with pytest.raises(ManifestError, match="only one variant"):
        config_env(base, {**target, "clusterName": "c"})
    with pytest.raises(ManifestError, match="no setting"):
        config_env({"conntrack": {"sauce": 1}}, {"conntrack": {"sauce": 2}})
    with pytest.raises(ManifestError, match="not one env value"):
        config_env({"conntrack": {"zones": [1]}}, {"conntrack": {"zones": [1, 2]}})
