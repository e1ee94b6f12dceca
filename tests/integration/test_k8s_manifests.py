"""The manifests in k8s/: accepted by a real kube-apiserver, and holding the DaemonSet's promises.

The kustomization is rendered here with PyYAML (its resources, labels and images), so no
kustomize binary is needed; when a Go toolchain is there, ``kustomize build`` itself is run
too and must render the same objects.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.apiserver import ApiServer
from flow_exporter.config import BY_KEY, ENV_PREFIX, SETTINGS, Settings, load, this_node
from flow_exporter.sink.kafka import check_config
from tests.support.go_tools import go_tool
from tests.support.paths import REPO

K8S = REPO / "k8s"
NAMESPACE = "flow-exporter"
# Not applied by the kustomization: an example the operator replaces with a real Secret.
EXAMPLES = {"secret-example.yaml"}
# Not a manifest: the values the chart renders k8s/ with (devtools.manifests).
VALUES = {"values.yaml"}
REQUIRED = {"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "daemonset.yaml"}
# kustomize names a generated ConfigMap <name>-<10-character hash of its content>; render() writes this
# in its place, and the comparison with kustomize's own output puts it back (the hash is kustomize's).
HASH = "hhhhhhhhhh"
_HASHED = re.compile(r"\b(flow-exporter)-[a-z0-9]{10}\b")
KUSTOMIZE_VERSION = "v5.8.2"  # the newest that builds with the Go toolchain here (v5.8.3 needs Go 1.27)
# docs/performance.md: RSS per tracked connection and at start (used if its line cannot be parsed).
BYTES_PER_CONNECTION = 1300
BASELINE_RSS = 38 * 2**20
# Kubernetes' resource.Quantity suffixes this test needs.
_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3}


# ------------------------------------------------------------------------------ rendering


def _load_docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _image_name(image: str) -> str:
    """``registry:5000/a/b:tag@sha256:...`` -> ``registry:5000/a/b``."""
    image = image.split("@", 1)[0]
    head, sep, tail = image.rpartition(":")
    return head if sep and "/" not in tail else image


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    template = doc.get("spec", {}).get("template")
    return template.get("spec") if isinstance(template, dict) else None


def render() -> list[dict[str, Any]]:
    """What ``kustomize build k8s/`` yields, for the features the kustomization uses."""
    k = kustomization()
    unsupported = set(k) - {"apiVersion", "kind", "resources", "labels", "images", "configMapGenerator"}
    assert not unsupported, f"render() does not implement kustomization fields {sorted(unsupported)}"
    docs = [doc for name in k["resources"] for doc in _load_docs(name)]
    for gen in k.get("configMapGenerator", []):
        name = f"{gen['name']}-{HASH}"
        docs.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": gen["namespace"], "labels": dict(gen["options"]["labels"])},
            "data": {f: (K8S / f).read_text() for f in gen["files"]},
        })  # fmt: skip
        for doc in docs:
            for volume in (_pod_spec(doc) or {}).get("volumes", []):
                sources = [volume, *volume.get("projected", {}).get("sources", [])]
                for ref in [s["configMap"] for s in sources if "configMap" in s]:
                    if ref.get("name") == gen["name"]:
                        ref["name"] = name
    for entry in k.get("labels", []):
        assert not entry.get("includeSelectors", False), "selectors are immutable: keep includeSelectors false"
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
            template = doc.get("spec", {}).get("template")
            if entry.get("includeTemplates") and isinstance(template, dict):
                template.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for rule in k.get("images", []):
        for doc in docs:
            spec = _pod_spec(doc)
            for c in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
                if _image_name(c["image"]) == rule["name"]:
                    c["image"] = f"{rule.get('newName', rule['name'])}:{rule['newTag']}"
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str = "flow-exporter") -> dict[str, Any]:
    if kind == "ConfigMap":
        name = f"{name}-{HASH}"
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = _pod_spec(find(docs, "DaemonSet"))
    assert spec is not None
    return spec


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    [c] = [c for c in pod["containers"] if c["name"] == "flow-exporter"]
    return c


@pytest.fixture(scope="module")
def config(docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, container: dict[str, Any]) -> Settings:
    """The ConfigMap's config.yaml, loaded as the exporter loads it, with the DaemonSet's plain env."""
    path = tmp_path_factory.mktemp("configmap") / "config.yaml"
    path.write_text(find(docs, "ConfigMap")["data"]["config.yaml"])
    return load(path, environ=pod_env(container), checks=(check_config,))


def pod_env(container: dict[str, Any], secret: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it, with ``secret`` as the Secret's data."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = "node-a"
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if secret is not None and ref["key"] in secret:
                env[var["name"]] = secret[ref["key"]]
            else:
                assert ref.get("optional") is True, f"{var['name']}: a missing Secret would block the pod"
        else:
            pytest.fail(f"unexpected env source {source}")
    return env


def quantity(value: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-zA-Z]*)", str(value))
    assert m and m.group(2) in _QUANTITY, f"unexpected quantity {value!r}"
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def bytes_per_connection() -> int:
    m = re.search(r"(\d+) bytes of RSS per tracked connection", (REPO / "docs" / "performance.md").read_text())
    return int(m.group(1)) if m else BYTES_PER_CONNECTION


# ------------------------------------------------------------------------------ the resource list


def test_kustomization_lists_every_manifest() -> None:
    k = kustomization()
    listed = k["resources"]
    generated = {f for gen in k["configMapGenerator"] for f in gen["files"]}
    assert generated == {"config.yaml"}
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - EXAMPLES - VALUES - generated
    assert len(listed) == len(set(listed))
    assert set(listed) == on_disk
    assert set(listed) >= REQUIRED


def test_every_object_is_namespaced_and_labelled(docs: list[dict[str, Any]]) -> None:
    labels = {k: v for entry in kustomization().get("labels", []) for k, v in entry["pairs"].items()}
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert meta.get("namespace") == NAMESPACE, f"{doc['kind']}/{meta['name']}"
        assert meta["labels"].items() >= labels.items()
        assert meta["labels"]["app.kubernetes.io/name"] == "flow-exporter"


def test_manifests_pass_server_side_dry_run(apiserver: ApiServer, docs: list[dict[str, Any]]) -> None:
    # Admission refuses even a dry-run create in a missing namespace, so the Namespace is applied
    # for real (as tests/integration/test_k8s_enrich.py does); everything else only goes through validation.
    apiserver.apply([find(docs, "Namespace")])
    example = [d for name in sorted(EXAMPLES) for d in _load_docs(name)]
    results = apiserver.dry_run_apply([*docs, *example])
    assert [(r["kind"], r["metadata"]["name"]) for r in results] == [
        (d["kind"], d["metadata"]["name"]) for d in [*docs, *example]
    ]
    served = next(r for r in results if r["kind"] == "DaemonSet")
    ctx = served["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}


def kustomize_build(directory: Path) -> str:
    binary = go_tool("kustomize", KUSTOMIZE_VERSION, "sigs.k8s.io/kustomize/kustomize/v5")
    return subprocess.run(
        [str(binary), "build", str(directory)], check=True, capture_output=True, text=True, timeout=120
    ).stdout


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain to build kustomize with")
def test_kustomize_build_renders_the_same(docs: list[dict[str, Any]]) -> None:
    out = _HASHED.sub(rf"\1-{HASH}", kustomize_build(K8S))
    built = [d for d in yaml.safe_load_all(out) if d]

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    assert sorted(built, key=key) == sorted(docs, key=key)


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain to build kustomize with")
def test_a_config_change_rolls_the_pods(tmp_path: Path) -> None:
    """kubectl apply -k after an edit of config.yaml changes the pod template, so the DaemonSet rolls."""

    def pod_template(directory: Path) -> dict[str, Any]:
        docs = [d for d in yaml.safe_load_all(kustomize_build(directory)) if d]
        return next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]

    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    before = pod_template(copy)
    assert before == pod_template(copy)  # the same content, the same template: no needless rollout
    config_file = copy / "config.yaml"
    config_file.write_text(config_file.read_text().replace("pollInterval: 5s", "pollInterval: 10s"))
    after = pod_template(copy)
    assert after != before

    def config_map(template: dict[str, Any]) -> str:
        [name] = re.findall(r"'name': '(flow-exporter-[a-z0-9]{10})'", repr(template["spec"]["volumes"]))
        return name

    assert config_map(before) != config_map(after)


# ------------------------------------------------------------------------------ the DaemonSet


def test_daemonset_container_security(pod: dict[str, Any], container: dict[str, Any], config: Settings) -> None:
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    for host_ns in ("hostPID", "hostIPC"):
        assert not pod.get(host_ns)
    # One hostPath: the state directory, a directory of its own on the node, mounted where the config says.
    (state,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert state["hostPath"] == {"path": "/var/lib/flow-exporter", "type": "DirectoryOrCreate"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[state["name"]]["mountPath"] == config.state.dir
    ctx = container["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx.get("privileged", False) is False
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # UID 0 is the documented choice (Dockerfile): NET_ADMIN cannot reach a non-root process.
    assert ctx["runAsUser"] == 0
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_only_the_sysctl_init_container_is_privileged(pod: dict[str, Any]) -> None:
    """The privileged init container writes the two conntrack sysctls and nothing else."""
    for init in pod.get("initContainers", []):
        assert "flow-exporter" not in init["image"]  # a minimal image: the privileged step runs no Python
        assert not init.get("volumeMounts") and not init.get("env") and not init.get("envFrom")
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        script = " ".join(init["command"])
        assert set(re.findall(r"nf_conntrack_\w+", script)) == {"nf_conntrack_acct", "nf_conntrack_timestamp"}
        assert re.findall(r"/\S+", script.replace('"$file"', "")) == ["/bin/sh", "/proc/sys/net/netfilter/$name"]


def test_daemonset_scheduling_and_lifecycle(docs: list[dict[str, Any]], pod: dict[str, Any], config: Settings) -> None:
    ds = find(docs, "DaemonSet")
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}  # tolerating everything, but only Linux nodes
    assert pod["priorityClassName"] == "system-node-critical"
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] in (1, "10%")
    selector = ds["spec"]["selector"]["matchLabels"]
    assert ds["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    # The kubelet's SIGKILL must not cut the final records short (see the comment in daemonset.yaml).
    assert pod["terminationGracePeriodSeconds"] >= config.shutdown.grace + 5


def test_daemonset_identity_matches_rbac(docs: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    sa = find(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == "flow-exporter"
    binding = find(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flow-exporter", "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == find(docs, "ClusterRole")["metadata"]["name"]


def test_daemonset_probes_env_and_scraping(
    docs: list[dict[str, Any]], container: dict[str, Any], config: Settings
) -> None:
    port = config.metrics.port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == port
    [node] = [v for v in container["env"] if v["name"] == "NODE_NAME"]
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    [address] = [v for v in container["env"] if v["name"] == "FLOW_EXPORTER_METRICS_ADDRESS"]
    assert address["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # not every node interface
    file_metrics = yaml.safe_load(find(docs, "ConfigMap")["data"]["config.yaml"])["metrics"]
    assert "address" not in file_metrics and file_metrics["port"] == port
    annotations = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_daemonset_mounts_config_and_optional_kafka_secret(
    docs: list[dict[str, Any]], pod: dict[str, Any], container: dict[str, Any]
) -> None:
    args = container["args"]
    config_path = args[args.index("--config") + 1]
    assert config_path == "/etc/flow-exporter/config.yaml"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/etc/flow-exporter"]["name"])
    sources = volume["projected"]["sources"]
    [cm] = [s["configMap"] for s in sources if "configMap" in s]
    assert cm["name"] == find(docs, "ConfigMap")["metadata"]["name"]
    assert {i["key"]: i["path"] for i in cm["items"]} == {"config.yaml": "config.yaml"}
    [secret] = [s["secret"] for s in sources if "secret" in s]
    assert secret["name"] == "flow-exporter-kafka" and secret["optional"] is True
    assert all(i["path"].startswith("kafka/") for i in secret["items"])
    refs = [v["valueFrom"]["secretKeyRef"] for v in container["env"] if "secretKeyRef" in v.get("valueFrom", {})]
    assert {r["name"] for r in refs} == {"flow-exporter-kafka"} and all(r["optional"] for r in refs)
    env_names = {v["name"] for v in container["env"]}
    assert BY_KEY["kafka.sasl.password"].env in env_names
    # The example Secret has exactly the keys the DaemonSet reads.
    [example] = _load_docs("secret-example.yaml")
    used = {r["key"] for r in refs} | {i["key"] for i in secret["items"]}
    assert set(example["stringData"]) <= used


def test_daemonset_env_names_are_settings(container: dict[str, Any]) -> None:
    """An unknown FLOW_EXPORTER_* variable makes the exporter exit 2."""
    known = {s.env for s in SETTINGS}
    ours = {v["name"] for v in container["env"] if v["name"].startswith(ENV_PREFIX)}
    assert ours <= known, sorted(ours - known)


def test_daemonset_resources_fit_the_benchmarks(container: dict[str, Any], config: Settings) -> None:
    res = container["resources"]
    for section in ("requests", "limits"):
        assert set(res[section]) >= {"cpu", "memory"}
    assert quantity(res["requests"]["memory"]) <= quantity(res["limits"]["memory"])
    assert quantity(res["requests"]["cpu"]) <= quantity(res["limits"]["cpu"])
    # The store full at limits.maxConnections must fit, with limits.maxInFlight records in flight on top
    # (~1.1 KB each, measured): also at shutdown, whose final records go out in rounds within that cap.
    store = config.limits.max_connections * bytes_per_connection()
    in_flight = config.limits.max_in_flight * 1100
    assert quantity(res["limits"]["memory"]) >= BASELINE_RSS + store + in_flight
    # A full poll at the cap must fit in a poll interval: ~0.3 s of one core per 100k entries with the
    # compiled paths the image always has (bench_compiled: 2.35 s at 1M; bench_node: 1.34 s at 500k).
    poll_cores = config.limits.max_connections / 100_000 * 0.3 / config.conntrack.poll_interval
    assert quantity(res["limits"]["cpu"]) >= poll_cores


# ------------------------------------------------------------------------------ ConfigMap and RBAC


def test_configmap_config_loads(config: Settings, container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.k8s.enabled is True
    assert config.kafka.topic == "flows"
    assert config.metrics.port == 9690
    # nodeName is empty, so records carry NODE_NAME, which the downward API sets.
    monkeypatch.setenv("NODE_NAME", pod_env(container)["NODE_NAME"])
    assert this_node(config) == "node-a"


def test_configmap_config_with_sasl_credentials_from_the_secret(
    docs: list[dict[str, Any]], container: dict[str, Any], tmp_path: Path
) -> None:
    """The documented SASL_SSL setup: protocol and mechanism in the file, credentials from the Secret."""
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap")["data"]["config.yaml"])
    env = pod_env(container, {"sasl-username": "flow-exporter", "sasl-password": "s3cret"})
    cfg = load(
        path, environ=env, overrides={"kafka.securityProtocol": "SASL_SSL", "kafka.sasl.mechanism": "SCRAM-SHA-512"}
    )
    producer = cfg.producer_config()
    assert producer["sasl.username"] == "flow-exporter"
    assert producer["sasl.password"] == "s3cret"
    assert producer["security.protocol"] == "SASL_SSL"


def test_clusterrole_grants_only_reads(docs: list[dict[str, Any]]) -> None:
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert [r["metadata"]["name"] for r in roles] == ["flow-exporter"]
    readable = {"": {"pods", "services", "nodes"}, "apps": {"replicasets"}, "batch": {"jobs"}}
    for rule in roles[0]["rules"]:
        assert set(rule["verbs"]) <= {"list", "watch"}
        assert len(rule["apiGroups"]) == 1 and set(rule["resources"]) <= readable[rule["apiGroups"][0]]
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
