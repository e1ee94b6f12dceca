"""The plain manifests in ``k8s/``, generated from the Helm chart: ``python -m devtools.manifests``.

Why generated: ``k8s/`` (``kubectl apply -k``) and ``charts/flow-exporter`` were written twice, and a test
had to hold them together field by field; now the chart is the one source and ``k8s/`` is its output, as
Antrea generates its plain manifests from its chart. What this does:

* ``helm template flow-exporter charts/flow-exporter --namespace flow-exporter -f k8s/values.yaml``;
* each template's objects go to a file of their own (``serviceaccount.yaml``, ``rbac.yaml``,
  ``daemonset.yaml``), as Helm wrote them, the templates' comments kept, under a header that says how to
  write them again;
* the ConfigMap's ``config.yaml`` becomes ``k8s/config.yaml``, which the kustomization's
  ``configMapGenerator`` makes into the ConfigMap ``flow-exporter-<hash of the file>``: an edited config is a
  new name in the pod template, so ``kubectl apply -k`` rolls the pods. The DaemonSet's ``checksum/config``
  annotation, Helm's way of doing the same, is dropped (it would be stale after such an edit);
* the two labels that say Helm manages an object (``app.kubernetes.io/managed-by: Helm``,
  ``helm.sh/chart``) are dropped: kubectl manages these. Every other label stays, selector included;
* ``k8s/cilium``, the Cilium variant, is a kustomize Component over ``k8s/``: the DaemonSet rendered with
  ``k8s/cilium/values.yaml`` on top, as a strategic-merge patch of the one above (what the chart adds,
  removes or changes for ``conntrack.source: cilium``). A config key the two renders set differently becomes
  its ``FLOW_EXPORTER_*`` variable in the patch (it wins over ``config.yaml``): a component cannot change one
  key of the base's config file, and the user's own ``config.yaml`` edits must still reach the variant.

Every text edit of Helm's output is checked against the same edit made on the parsed objects, so a chart
change that this cannot express fails here, not in a cluster. Not generated: ``namespace.yaml`` (the chart
does not create its namespace; it carries the Pod Security label the pods need), ``secret-example.yaml``
and the two values files. ``--check`` writes nothing and exits 1 naming every file that is not what the
chart renders (tests/unit/test_manifests.py asserts the same). Helm: ``make setup-k8s`` builds it into
``.cache/helm/<version>/bin``; this builds it there too when missing (a Go toolchain, the Go module proxy).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from flow_exporter.settings import SETTINGS

__all__ = [
    "CHART", "HAND_WRITTEN", "HELM_VERSION", "K8S", "NAMESPACE", "RELEASE", "ManifestError", "helm",
    "render", "stale", "write",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "flow-exporter"
K8S = REPO / "k8s"
VALUES = K8S / "values.yaml"
CILIUM_VALUES = K8S / "cilium" / "values.yaml"
RELEASE = "flow-exporter"  # object names: the chart names them after the release
NAMESPACE = "flow-exporter"
HELM_VERSION = "v4.3.2"  # what tools/k8s/tools.sh (make setup-k8s) builds
HELM_PACKAGE = "helm.sh/helm/v4/cmd/helm"
# The files of k8s/ written by hand (paths relative to k8s/); every other file there is generated.
HAND_WRITTEN = frozenset({"namespace.yaml", "secret-example.yaml", "values.yaml", "cilium/values.yaml"})
# Labels and annotations that only mean something to a Helm release.
HELM_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")
HELM_ANNOTATIONS = ("checksum/config",)
# The list fields a strategic-merge patch of a pod spec merges by a key, and that key (Kubernetes' API types);
# every other list is replaced whole.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "env": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "ports": "containerPort",
    "imagePullSecrets": "name", "hostAliases": "ip",
}  # fmt: skip

HEADER = """\
# Generated from charts/flow-exporter by `python -m devtools.manifests` (helm template with k8s/values.yaml{extra}).
# Do not edit: change the chart or the values file, then run that again (docs/operations/manifests.md).
"""
CONFIG_HEADER = """\
# The exporter's config file, the chart's `config` value. The kustomization makes it the ConfigMap
# flow-exporter-<hash of this file>, mounted at /etc/flow-exporter/config.yaml: a changed file is a new name in
# the pod template, so `kubectl apply -k` rolls the pods onto it. Every key is a setting
# (`flow-exporter config --print-defaults`, docs/reference/); an unknown key or a bad value makes the exporter
# exit with code 2. FLOW_EXPORTER_* variables in the DaemonSet win over it. Set your own values (the brokers
# below are a placeholder) in an overlay: docs/operations/manifests.md.
"""
KUSTOMIZATION_NOTE = """\
# kubectl apply -k k8s/ (the namespace first: kustomize orders it so). secret-example.yaml is deliberately not
# listed: create the Secret flow-exporter-kafka yourself when the brokers need credentials (see that file).
# Your registry, brokers and other changes go in an overlay of this directory: docs/operations/manifests.md.
"""
CILIUM_NOTE = """\
# Clusters running Cilium (docs/operations/cilium.md): the exporter reads Cilium's BPF connection-tracking
# maps instead of the kernel's conntrack. Add it to an overlay of k8s/:
#
#   resources: [<path to>/k8s]
#   components: [<path to>/k8s/cilium]
#
# What the chart renders for conntrack.source cilium, as a patch of k8s/daemonset.yaml: the node's BPF
# filesystem mounted read-only, CAP_BPF instead of NET_ADMIN, no conntrack sysctl init container (netfilter's
# accounting is not what is read), and the source as an environment variable (it wins over config.yaml).
# For conntrack.source auto (Cilium's maps where they are pinned, conntrack elsewhere) use the chart.
"""


class ManifestError(RuntimeError):
    """The chart renders something the plain manifests cannot say as they are laid out, or helm failed."""


# ------------------------------------------------------------------------------ helm


def helm() -> Path:
    """The helm binary ``make setup-k8s`` builds (built here, with ``go install``, when it is missing)."""
    gobin = REPO / ".cache" / "helm" / HELM_VERSION / "bin"
    binary = gobin / "helm"
    if binary.is_file():
        return binary
    if shutil.which("go") is None:
        raise ManifestError(f"no helm at {binary.relative_to(REPO)} and no Go toolchain to build it: make setup-k8s")
    print(f"manifests: building helm {HELM_VERSION} from the Go module proxy (once)", file=sys.stderr)
    subprocess.run(
        ["go", "install", f"{HELM_PACKAGE}@{HELM_VERSION}"], env={**os.environ, "GOBIN": str(gobin)}, check=True,
        capture_output=True, timeout=1500,
    )  # fmt: skip
    return binary


def helm_template(*values: Path) -> str:
    argv = [str(helm()), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for v in values:
        argv += ["-f", str(v)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise ManifestError(f"helm template failed: {proc.stderr.strip()}")
    return proc.stdout


# ------------------------------------------------------------------------------ Helm's output, by template

_SOURCE = re.compile(r"^# Source: [^/]+/templates/(?P<name>\S+)$")
_HELM_LINE = re.compile(r"^\s*(?:" + "|".join(re.escape(k) for k in (*HELM_LABELS, *HELM_ANNOTATIONS)) + r"): .*$")


def by_template(text: str) -> dict[str, list[str]]:
    """Helm's output as {template file name: [its documents' text, without the ``# Source`` line]}."""
    out: dict[str, list[str]] = {}
    for doc in re.split(r"^---\s*$", text, flags=re.MULTILINE):
        lines = doc.strip("\n").splitlines()
        if not lines:
            continue
        m = _SOURCE.match(lines[0])
        if m is None:
            raise ManifestError(f"a document of helm's output without its '# Source' line: {lines[0]!r}")
        out.setdefault(m["name"], []).append("\n".join(lines[1:]).rstrip() + "\n")
    return out


def without_helm(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without the labels and annotations that only a Helm release has (at every level: the pod
    template's too)."""
    doc = copy.deepcopy(doc)
    for meta in _metadatas(doc):
        for field, keys in (("labels", HELM_LABELS), ("annotations", HELM_ANNOTATIONS)):
            got = meta.get(field)
            if isinstance(got, dict):
                for k in keys:
                    got.pop(k, None)
                if not got:
                    del meta[field]
    return doc


def _metadatas(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "metadata" and isinstance(v, dict):
                yield v
            yield from _metadatas(v)
    elif isinstance(node, list):
        for v in node:
            yield from _metadatas(v)


def plain_text(doc_text: str) -> str:
    """One rendered document without the Helm-only lines, checked against the same edit of its objects."""
    kept = "\n".join(line for line in doc_text.splitlines() if not _HELM_LINE.match(line)) + "\n"
    if yaml.safe_load(kept) != without_helm(yaml.safe_load(doc_text)):
        raise ManifestError("dropping the Helm-only lines changed more than those labels and annotations")
    return kept


# ------------------------------------------------------------------------------ the Cilium patch


def _keyed(items: list[Any], key: str) -> dict[Any, Any] | None:
    """A merged list by its merge key, or None when an item lacks it (then it is replaced whole)."""
    if not all(isinstance(i, dict) and key in i for i in items):
        return None
    return {i[key]: i for i in items}


def strategic_patch(base: Any, target: Any, field: str = "") -> Any:
    """The strategic-merge patch that turns ``base`` into ``target`` (kustomize applies it as kubectl does)."""
    if isinstance(base, dict) and isinstance(target, dict):
        out: dict[str, Any] = {}
        for k in [*base, *(k for k in target if k not in base)]:
            if k not in target:
                out[k] = None  # a null deletes the field
            elif k not in base:
                out[k] = target[k]
            elif base[k] != target[k]:
                out[k] = strategic_patch(base[k], target[k], k)
        return out
    key = MERGE_KEYS.get(field)
    if key is not None and isinstance(base, list) and isinstance(target, list):
        was, now = _keyed(base, key), _keyed(target, key)
        if was is not None and now is not None:
            if [k for k in now if k in was] != [k for k in was if k in now]:
                raise ManifestError(f"{field}: the kept items change order, which a patch cannot say")
            items: list[Any] = [{key: k, "$patch": "delete"} for k in was if k not in now]
            for k, item in now.items():
                if k not in was:
                    items.append(item)
                elif item != was[k]:
                    items.append({key: k, **strategic_patch(was[k], item)})
            return items
    return target  # scalars, and lists without a merge key: replaced


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _env_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ManifestError(f"config {key}: {value!r} differs in the Cilium variant and is not one env value")


def config_env(base: dict[str, Any], target: dict[str, Any]) -> list[dict[str, str]]:
    """The ``FLOW_EXPORTER_*`` variables that turn the config ``base`` into ``target``, in setting order."""
    was, now = _flat(base), _flat(target)
    if set(was) != set(now):
        raise ManifestError(f"config keys set in only one variant: {sorted(set(was) ^ set(now))}")
    changed = {k for k in was if was[k] != now[k]}
    env = {s.key: s.env for s in SETTINGS}
    unknown = changed - set(env)
    if unknown:
        raise ManifestError(f"config keys that are no setting: {sorted(unknown)}")
    return [{"name": env[k], "value": _env_value(k, now[k])} for k in env if k in changed]


def cilium_patch(base_docs: list[dict[str, Any]], cilium_docs: list[dict[str, Any]]) -> dict[str, Any]:
    """k8s/cilium/daemonset.yaml: the Cilium render's DaemonSet as a patch of the base one."""

    def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        [doc] = [without_helm(d) for d in docs if d["kind"] == kind]
        return doc

    base, target = one(base_docs, "DaemonSet"), one(cilium_docs, "DaemonSet")
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        if [d for d in base_docs if d["kind"] == kind] != [d for d in cilium_docs if d["kind"] == kind]:
            raise ManifestError(f"the Cilium variant changes the {kind}, which k8s/cilium does not patch")
    if {k: v for k, v in base.items() if k != "spec"} != {k: v for k, v in target.items() if k != "spec"}:
        raise ManifestError("the Cilium variant changes the DaemonSet's metadata")
    env = config_env(*(yaml.safe_load(one(d, "ConfigMap")["data"]["config.yaml"]) for d in (base_docs, cilium_docs)))
    patch = strategic_patch(base["spec"], target["spec"])
    if env:
        containers = patch.setdefault("template", {}).setdefault("spec", {}).setdefault("containers", [])
        name = base["spec"]["template"]["spec"]["containers"][0]["name"]
        entry = next((c for c in containers if c.get("name") == name), None)
        if entry is None:
            entry = {"name": name}
            containers.append(entry)
        entry["env"] = [*entry.get("env", []), *env]
    meta = {"name": base["metadata"]["name"], "namespace": base["metadata"]["namespace"]}
    return {"apiVersion": base["apiVersion"], "kind": base["kind"], "metadata": meta, "spec": patch}


# ------------------------------------------------------------------------------ the files


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render() -> dict[str, str]:
    """Every generated file of k8s/: {path relative to k8s/: its text}."""
    base_text = helm_template(VALUES)
    cilium_text = helm_template(VALUES, CILIUM_VALUES)
    header = HEADER.format(extra="")
    files: dict[str, str] = {}
    resources = ["namespace.yaml"]
    generator: dict[str, Any] | None = None
    for template, docs in by_template(base_text).items():
        if template == "configmap.yaml":
            [cm] = [without_helm(yaml.safe_load(d)) for d in docs]
            files["config.yaml"] = header + CONFIG_HEADER + cm["data"]["config.yaml"]
            meta = cm["metadata"]
            generator = {"name": meta["name"], "namespace": meta["namespace"], "files": ["config.yaml"]}
            generator["options"] = {"labels": meta["labels"]}
            continue
        if template in files or template in HAND_WRITTEN or "/" in template:
            raise ManifestError(f"templates/{template} cannot become k8s/{template}")
        files[template] = header + "---\n".join(plain_text(d) for d in docs)
        resources.append(template)
    if generator is None:
        raise ManifestError("the chart rendered no ConfigMap")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
        "configMapGenerator": [generator],
    }
    files["kustomization.yaml"] = header + KUSTOMIZATION_NOTE + _dump(kustomization)
    cilium_header = HEADER.format(extra="\n# and k8s/cilium/values.yaml on top")
    patch = cilium_patch(_docs(base_text), _docs(cilium_text))
    files["cilium/daemonset.yaml"] = cilium_header + _dump(patch)
    component = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
                 "patches": [{"path": "daemonset.yaml"}]}  # fmt: skip
    files["cilium/kustomization.yaml"] = cilium_header + CILIUM_NOTE + _dump(component)
    return files


def _on_disk(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def stale(root: Path = K8S, files: dict[str, str] | None = None) -> list[str]:
    """The files under ``root`` that are not what the chart renders: differing, missing, or left over."""
    files = render() if files is None else files
    differ = [n for n, text in files.items() if not (root / n).is_file() or (root / n).read_text() != text]
    extra = _on_disk(root) - set(files) - HAND_WRITTEN
    return sorted([*differ, *extra])


def write(root: Path = K8S) -> list[str]:
    """Write every generated file and remove the generated files the chart no longer renders; returns what
    changed."""
    files = render()
    changed = stale(root, files)
    for name in changed:
        path = root / name
        if name in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[name])
        else:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devtools.manifests",
        description="write k8s/ from the Helm chart (helm template with k8s/values.yaml; k8s/cilium with "
        "k8s/cilium/values.yaml on top)",
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files not current")
    args = ap.parse_args(argv)
    try:
        if args.check:
            bad = stale()
            for name in bad:
                print(f"k8s/{name}: not what the chart renders (run: python -m devtools.manifests)", file=sys.stderr)
            return 1 if bad else 0
        for name in write():
            print(f"wrote k8s/{name}", file=sys.stderr)
    except ManifestError as e:
        print(f"manifests: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
