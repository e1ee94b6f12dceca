"""The DaemonSet's pod, as rendered, played by podman (``podman kube play``, runc) in a lab's node namespace.

Shared by the pod tests (tests/integration/test_daemonset_pod.py, test_cilium_pod.py) and ``make try-pod``
(devtools.try_pod), so what a newcomer runs without a cluster is what the tests hold to a kubelet's behaviour.

podman 4.3 (Debian bookworm's) plays Pods, not DaemonSets, and is not a kubelet. ``daemonset_pod``
turns the rendered DaemonSet into the Pod a kubelet would run and changes only what podman 4.3
cannot take as written, each for a reason checked on podman 4.3.1:

* ``kind``: the pod template becomes a Pod named after the DaemonSet (podman has no DaemonSet kind), with a
  random suffix as a kubelet's pods have one (podman's names are the machine's: see :class:`PodPlay`).
* ``projected`` volume: podman plays only hostPath, configMap, emptyDir and PVC volumes ("HostPath,
  ConfigMap, EmptyDir, and PersistentVolumeClaim are currently the only supported VolumeSource").
  The files the kubelet would project (the ConfigMap's items; an optional Secret that does not
  exist projects nothing) are written to a directory, with the modes the volume gives, and that
  directory is the volume (a hostPath, mounted read-only as written).
* downward-API env (``spec.nodeName``, ``status.podIP``): podman refuses them ("fieldPath
  spec.nodeName is either not valid or not supported"); the values the kubelet would set are given.
* ``ports`` of a hostNetwork container: podman turns them into port mappings and then refuses them
  on the host network ("PortMappings can only be used with Bridge or slirp4netns networking"). They
  are dropped and the probes' named port is resolved to its number, as the kubelet resolves it.
  (podman 4.3 runs probes through systemd timers, absent here; the tests call /healthz and /readyz.)
* ``restartPolicy``: a DaemonSet's pods restart Always; podman 4.3 applies that to init containers
  too and reruns the finished init container for about 20 s. OnFailure runs it once, as the kubelet does.
* ``seccompProfile: RuntimeDefault`` means the runtime's default profile. podman 4.3's (containers-common,
  /usr/share/containers/seccomp.json) allows ``bpf(2)`` only to a container with CAP_SYS_ADMIN;
  containerd's and moby's defaults also allow it with CAP_BPF, which is what a pod reading Cilium's maps
  is given. The pod is played with podman's own default profile changed in that one respect (its refusal
  of ``bpf`` to containers without CAP_SYS_ADMIN spares CAP_BPF, and a rule allows ``bpf`` with CAP_BPF),
  so RuntimeDefault means here what it means on a containerd node; nothing else changes.

Everything else (host network, init container, security contexts, resources, the hostPath and
emptyDir volumes, the grace period) goes to podman as rendered. ``podman kube down`` of 4.3 kills
the containers at once (no SIGTERM, checked with a trapping shell), so ``PodPlay.stop`` does what the
kubelet does: ``podman pod stop`` with the pod's ``terminationGracePeriodSeconds`` (SIGTERM, then
SIGKILL when the grace runs out), then ``kube down`` removes what is left.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from devtools.podman import CONTAINERS_CONF, engine_env, podman

__all__ = ["PodPlay", "PodPlayError", "daemonset_pod"]


class PodPlayError(RuntimeError):
    """The rendered objects are not what a kubelet could run, or podman refused a step (its output says why)."""


def _find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any] | None:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) > 1:
        raise PodPlayError(f"{len(found)} {kind} named {name}")
    return found[0] if found else None


def _project(docs: list[dict[str, Any]], projected: dict[str, Any], into: Path) -> None:
    """Write the files a kubelet would project into ``into``."""
    default_mode = projected.get("defaultMode", 0o644)
    for source in projected["sources"]:
        (kind, ref), *_ = [(k, v) for k, v in source.items() if k in ("configMap", "secret")]
        obj = _find(docs, "ConfigMap" if kind == "configMap" else "Secret", ref["name"])
        if obj is None:
            if not ref.get("optional"):
                raise PodPlayError(f"{kind} {ref['name']} is not rendered and not optional")
            continue  # an optional source that does not exist projects nothing
        if kind != "configMap":
            raise PodPlayError("a rendered Secret would need decoding (none is rendered)")
        for item in ref.get("items") or [{"key": k, "path": k} for k in obj["data"]]:
            path = into / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(obj["data"][item["key"]])
            path.chmod(item.get("mode", default_mode))


def daemonset_pod(docs: list[dict[str, Any]], *, node_name: str, pod_ip: str, projected_dir: Path) -> dict[str, Any]:
    """The DaemonSet in ``docs`` as the Pod podman 4.3 plays (see the module's docstring for each change)."""
    ds = _find(docs, "DaemonSet")
    if ds is None:
        raise PodPlayError("no DaemonSet rendered")
    template = copy.deepcopy(ds["spec"]["template"])
    spec = template["spec"]
    downward = {"spec.nodeName": node_name, "status.podIP": pod_ip, "status.hostIP": pod_ip}
    for volume in spec["volumes"]:
        if "projected" in volume:
            target = projected_dir / volume["name"]
            target.mkdir(parents=True)
            _project(docs, volume.pop("projected"), target)
            volume["hostPath"] = {"path": str(target), "type": "Directory"}
    for container in spec.get("initContainers", []) + spec["containers"]:
        for env in container.get("env", []):
            field = env.get("valueFrom", {}).get("fieldRef")
            if field is not None:
                del env["valueFrom"]
                env["value"] = downward[field["fieldPath"]]
        if spec.get("hostNetwork"):
            ports = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                get = container.get(probe, {}).get("httpGet")
                if get is not None and isinstance(get["port"], str):
                    get["port"] = ports[get["port"]]
    spec["restartPolicy"] = "OnFailure"
    metadata = {"name": ds["metadata"]["name"], **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")


def _runtime_default(workdir: Path) -> Path:
    """The engine's settings with RuntimeDefault as containerd's: podman's default seccomp profile plus ``bpf``
    allowed with CAP_BPF (see the module's docstring). Returns the containers.conf to play with."""
    profile = json.loads(DEFAULT_SECCOMP.read_text())
    for rule in profile["syscalls"]:  # its refusal of bpf to containers without CAP_SYS_ADMIN spares CAP_BPF too
        if "bpf" in rule["names"] and rule["action"] == "SCMP_ACT_ERRNO":
            rule.setdefault("excludes", {}).setdefault("caps", []).append("CAP_BPF")
    profile["syscalls"].append({"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_BPF"]}})
    seccomp = workdir / "seccomp-runtime-default.json"
    seccomp.write_text(json.dumps(profile))
    conf = workdir / "containers.conf"
    conf.write_text(
        CONTAINERS_CONF.read_text().replace("[containers]\n", f'[containers]\nseccomp_profile = "{seccomp}"\n', 1)
    )
    return conf


class PodPlay:
    """One Pod played with ``podman kube play`` from inside a network namespace (its host network).

    The Pod is played under its name plus a random suffix: podman's pod and container names are the machine's,
    and a second play of the same name (a test in another session, ``make try-pod`` beside a test) would replace
    this one (``--replace``), as a kubelet never does to another node's pod.
    """

    def __init__(self, pod: dict[str, Any], netns: str, workdir: Path) -> None:
        self.name: str = f"{pod['metadata']['name']}-{uuid.uuid4().hex[:6]}"
        self.pod = {**pod, "metadata": {**pod["metadata"], "name": self.name}}
        self.netns = netns
        self.grace: int = pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.kube_file = workdir / "pod.yaml"
        self.kube_file.write_text(yaml.safe_dump(self.pod))
        self.workdir = workdir
        self.conf = _runtime_default(workdir)

    def container(self, name: str) -> str:
        return f"{self.name}-{name}"  # how podman names a played pod's containers

    def play(self, log: Path) -> None:
        """Create and start the pod; every container's output goes to ``log``."""
        proc = subprocess.run(
            [
                "nsenter", f"--net=/var/run/netns/{self.netns}",  # not `ip netns exec`: it hides the cgroup mounts
                "podman", "kube", "play", "--replace", "--log-driver", "k8s-file", "--log-opt", f"path={log}",
                str(self.kube_file),
            ],
            env={**engine_env(), "CONTAINERS_CONF": str(self.conf)}, capture_output=True, text=True, timeout=180,
            check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if proc.returncode != 0:
            raise PodPlayError(f"podman kube play: {proc.stdout}{proc.stderr}")

    def inspect(self, container: str) -> dict[str, Any]:
        proc = podman("container", "inspect", self.container(container))
        if proc.returncode != 0:
            raise PodPlayError(f"podman container inspect: {proc.stderr}")
        out: dict[str, Any] = json.loads(proc.stdout)[0]
        return out

    def stop(self) -> float:
        """SIGTERM, SIGKILL after the pod's grace period (what the kubelet does): the seconds it took."""
        started = time.monotonic()
        proc = podman("pod", "stop", "--time", str(self.grace), self.name, timeout=self.grace + 60)
        if proc.returncode != 0:
            raise PodPlayError(f"podman pod stop: {proc.stderr}")
        return time.monotonic() - started

    def down(self) -> None:
        """Remove the pod (``podman kube down``); idempotent."""
        podman("kube", "down", str(self.kube_file))
        podman("pod", "rm", "--force", "--ignore", self.name)
