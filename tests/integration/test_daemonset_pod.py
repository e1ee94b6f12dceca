"""The DaemonSet's pod, rendered from k8s/ (kustomize) and from the chart (helm), run by a real runtime.

What a user's ``kubectl apply -k k8s/`` or ``helm install`` makes a kubelet run, played with
``podman kube play`` (runc) on the image the session builds: the host network, the privileged init
container that turns conntrack's accounting and timestamps on, the exporter as UID 0 with only
NET_ADMIN, no privilege escalation and a read-only root filesystem, the config file projected
read-only, the state directory on a hostPath, the grace period. The changes a user makes go through
the user's own knobs (a kustomize overlay, ``helm --set``): the image tags (this session's build,
and the stand-in base for the init container's busybox, since no registry is reachable), the
brokers and topic, the hostPath, and ``k8s.enabled=false`` (podman mounts no service-account
token, so there is no API server to enrich from; enrichment has its own tests against a real
one). What podman 4.3 cannot take as rendered is translated by ``devtools.pod_play``, which
says why for each change.

The pod's host network is a lab's node namespace (podman started from inside it), so its
conntrack table holds only the lab's connections, and the init container's sysctls change that
namespace, not the machine's. The session's broker is relayed into it at the same address.
Records are read back with the reference Avro decoder and compared with ``conntrack -L``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from devtools.netns_relay import LoopbackRelay, http_get_in
from devtools.pod_play import PodPlay, daemonset_pod
from flow_exporter.conntrack.sysctl import read_sysctl, write_sysctl
from tests.integration.test_accounting_lab import Traffic, ct_counts, of_client, summed
from tests.integration.test_k8s_manifests import quantity
from tests.support import contract
from tests.support.container_image import base_image
from tests.support.go_tools import go_tool
from tests.support.paths import REPO
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.timeout(2400)]

KUSTOMIZE = ("kustomize", "v5.8.2", "sigs.k8s.io/kustomize/kustomize/v5")
HELM = ("helm", "v4.3.2", "helm.sh/helm/v4/cmd/helm")
NODE = "node-a"
SYSCTLS = ("net.netfilter.nf_conntrack_acct", "net.netfilter.nf_conntrack_timestamp")
CONNECTIONS = 12
SERVER_PORT = 7700


def user_config(broker: str, topic: str) -> dict[str, Any]:
    """What this test's user sets in the config: where Kafka is, and no API server to enrich from."""
    return {"kafka": {"bootstrapServers": broker, "topic": topic}, "k8s": {"enabled": False}}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def render_kustomize(
    workdir: Path,
    image: str,
    state: Path,
    overrides: dict[str, Any],
    components: tuple[str, ...] = (),
    host_paths: dict[str, Path] | None = None,
) -> list[dict[str, Any]]:
    """``kustomize build`` of an overlay over k8s/, as a user points it at their registry and brokers; with the
    ``components`` of k8s/ named (e.g. ``cilium``) and other volumes' host paths (name -> path)."""
    overlay = workdir / "overlay"
    overlay.mkdir()
    config = yaml.safe_load((REPO / "k8s" / "config.yaml").read_text())
    (overlay / "config.yaml").write_text(yaml.safe_dump(merged(config, overrides)))
    name, tag = image.rsplit(":", 1)
    base_name, base_tag = base_image().rsplit(":", 1)
    [ours] = [d for d in yaml.safe_load_all((REPO / "k8s" / "daemonset.yaml").read_text()) if d]
    [written] = [c["image"] for c in ours["spec"]["template"]["spec"]["containers"] if c["name"] == "flow-exporter"]
    volumes = [{"name": "state", "hostPath": {"path": str(state)}}]
    volumes += [{"name": name, "hostPath": {"path": str(path)}} for name, path in (host_paths or {}).items()]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "k8s", overlay)],  # kustomize takes no absolute root
        "components": [os.path.relpath(REPO / "k8s" / c, overlay) for c in components],
        "images": [
            {"name": written.rsplit(":", 1)[0], "newName": name, "newTag": tag},  # k8s/'s image, as the chart has it
            {"name": "docker.io/library/busybox", "newName": base_name, "newTag": base_tag},
        ],
        "configMapGenerator": [
            {"name": "flow-exporter", "namespace": "flow-exporter", "behavior": "replace", "files": ["config.yaml"]}
        ],
        "patches": [
            {
                "target": {"kind": "DaemonSet", "name": "flow-exporter"},
                "patch": yaml.safe_dump(
                    {
                        "apiVersion": "apps/v1",
                        "kind": "DaemonSet",
                        "metadata": {"name": "flow-exporter", "namespace": "flow-exporter"},
                        "spec": {"template": {"spec": {"volumes": volumes}}},
                    }
                ),
            }
        ],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    binary = go_tool(*KUSTOMIZE)
    out = _run([str(binary), "build", str(overlay)])
    return [d for d in yaml.safe_load_all(out) if d]


def render_helm(workdir: Path, image: str, state: Path, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """``helm template`` of the chart with the values a user would set."""
    name, tag = image.rsplit(":", 1)
    values = workdir / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {"repository": name, "tag": tag},
                "sysctlInit": {"image": base_image()},
                "stateHostPath": str(state),
                "config": overrides,
            }
        )
    )
    binary = go_tool(*HELM)
    chart = REPO / "charts" / "flow-exporter"
    out = _run([str(binary), "template", "flow-exporter", str(chart), "-n", "flow-exporter", "-f", str(values)])
    return [d for d in yaml.safe_load_all(out) if d]


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


RENDERERS = {"kustomize": render_kustomize, "helm": render_helm}


def wait_ready(lab: Lab, address: str, port: int, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    status, body = 0, ""
    while time.monotonic() < deadline:
        status, body = http_get_in(lab.node_ns, address, port, "/readyz")
        if status == 200:
            return
        time.sleep(0.5)
    text = log.read_text() if log.exists() else "(no log)"
    raise AssertionError(f"/readyz on {address}:{port}: {status} {body}\n{text[-6000:]}")


def truth(lab: Lab, conns: list[Any]) -> dict[tuple[str, int], contract.Counts]:
    table = lab.conntrack_entries()
    out = {}
    for c in conns:
        entry = table.for_exchange(c)
        assert entry is not None, (c.client_ip, c.client_port)
        out[(c.client_ip, c.client_port)] = ct_counts(entry)
    return out


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
def test_daemonset_pod_exports_exactly_and_continues_on_its_host_path(
    renderer: str, image: str, lab: Lab, kafka_broker: KafkaBroker, kafka_topic: str, tmp_path: Path
) -> None:
    """Played twice on one hostPath: every connection's records equal conntrack's counters, under one connectionId.

    The first pod is stopped as the kubelet stops it (SIGTERM, its grace period): it sends a
    final record per connection within that grace. The connections keep sending while no pod
    runs; the second pod, on the same hostPath, continues each at the next sequence.
    """
    state = tmp_path / "state"
    docs = RENDERERS[renderer](tmp_path, image, state, user_config(kafka_broker.bootstrap, kafka_topic))
    pod_ip = lab.pods[0].node_ip4  # the node's address: a hostNetwork pod's IP is its node's
    pod = daemonset_pod(docs, node_name=NODE, pod_ip=pod_ip, projected_dir=tmp_path / "projected")
    [exporter] = pod["spec"]["containers"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["conntrack-sysctls"]
    config = yaml.safe_load((tmp_path / "projected" / "config" / "config.yaml").read_text())
    metrics_port = config["metrics"]["port"]
    poll = float(config["conntrack"]["pollInterval"].rstrip("s"))
    play = PodPlay(pod, lab.node_ns, tmp_path)
    for name in SYSCTLS:  # the lab turned them on; the init container must do it
        write_sysctl(name, "0", lab.node_ns)
    p0, p1, p2 = lab.pods
    traffic: Traffic | None = None
    logs = [tmp_path / "pod1.log", tmp_path / "pod2.log"]
    try:
        with LoopbackRelay(lab.node_ns, kafka_broker.port):
            # ----------------------------------------------------------------- first pod
            play.play(logs[0])
            wait_ready(lab, pod_ip, metrics_port, logs[0])
            assert [read_sysctl(n, lab.node_ns) for n in SYSCTLS] == ["1", "1"], "the init container's sysctls"
            status, _ = http_get_in(lab.node_ns, pod_ip, metrics_port, "/healthz")
            assert status == 200
            running = play.inspect(exporter["name"])
            host = running["HostConfig"]
            assert running["Config"]["User"] in ("0", "0:0") and host["NetworkMode"] == "host"
            assert host["ReadonlyRootfs"] is True and "no-new-privileges" in host["SecurityOpt"]
            assert host["CapAdd"] == ["CAP_NET_ADMIN"] and "CAP_NET_RAW" in host["CapDrop"]
            assert host["Memory"] == quantity(exporter["resources"]["limits"]["memory"])  # the manifest's limit
            conns = [lab.open_tcp([p0, p1][i % 2], p2, SERVER_PORT) for i in range(CONNECTIONS)]
            traffic = Traffic(conns, size=300, every=0.25)
            time.sleep(2 * poll)
            traffic.stop()
            time.sleep(poll + 1.5)  # the last bytes polled
            first = truth(lab, conns)
            took = play.stop()
            stopped = play.inspect(exporter["name"])
            assert stopped["State"]["ExitCode"] == 0, logs[0].read_text()[-4000:]
            assert took < play.grace, f"stopping took {took:.1f}s, grace {play.grace}s"
            assert "received SIGTERM" in logs[0].read_text()
            play.down()

            # ----------------------------------------------------------------- no pod
            for c in conns:
                c.send(1000)  # counted by conntrack while nothing exports

            # ----------------------------------------------------------------- second pod
            play.play(logs[1])
            wait_ready(lab, pod_ip, metrics_port, logs[1])
            assert "continuing: checkpoint" in logs[1].read_text()
            traffic = Traffic(conns, size=500, every=0.25)
            time.sleep(2 * poll)
            traffic.stop()
            time.sleep(poll + 1.5)
            second = truth(lab, conns)
            took = play.stop()
            assert play.inspect(exporter["name"])["State"]["ExitCode"] == 0, logs[1].read_text()[-4000:]
            assert took < play.grace
    finally:
        if traffic is not None:
            traffic.stop()
        play.down()
    text = "".join(log.read_text() for log in logs)
    assert "Traceback" not in text

    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=2 * CONNECTIONS, timeout=60)
    groups = contract.check(records)
    for (ip, port), counts in second.items():
        mine = of_client(groups, ip, port)
        assert len(mine) == 1, f"{ip}:{port}: {len(mine)} connectionIds across the two pods"
        (rs,) = mine.values()
        assert [r["sequence"] for r in rs] == [0, 1], (ip, port, rs)  # one final record per pod
        assert contract.consumer_sum(rs[:1]) == first[(ip, port)], (ip, port)
        assert summed(mine) == counts, (ip, port)
        assert {r["exporterNode"] for r in rs} == {NODE}
        assert all(r["flags"] == 0 for r in rs), rs  # opened while the first pod ran: not adopted
    for c in conns:
        c.close()
