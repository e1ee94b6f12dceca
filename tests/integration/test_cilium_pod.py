"""The DaemonSet's pod on a Cilium node (issue 41), rendered from the chart and from k8s/ with its cilium
component, played by podman (runc) on the image the session builds.

The node is a network namespace of its own with the session's broker relayed into it, and its Cilium is
a private BPF filesystem whose four global CT maps Cilium's own code (``ctwriter``, v1.20.2) created
and writes. The user's knobs only: ``conntrack.source: cilium`` and ``cilium.bpffs`` (chart), the
component and the bpffs volume's host path (kustomize). The pod must run with CAP_BPF only (no
NET_ADMIN, no sysctl init container), the bpffs mounted read-only, and export exactly what Cilium's
listing says, flagged both-directions.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.cilium import Bpffs, ctwriter, run_ctwriter
from devtools.kafka import KafkaBroker
from devtools.netns_relay import LoopbackRelay, http_get_in
from devtools.pod_play import PodPlay, daemonset_pod
from tests.integration.test_cilium_source import expected, life
from tests.integration.test_daemonset_pod import render_helm, render_kustomize
from tests.support.cilium_entries import OUT, apply, counters, listing, put
from tests.support.records import by_connection, read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.timeout(1200)]

LAYOUT = "v1.20"
CONNECTIONS = 6


@pytest.fixture
def node() -> Iterator[str]:
    """A network namespace with only its loopback up: the pod's host network."""
    name = f"fe-cilium-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def render(renderer: str, tmp: Path, image: str, fs: Bpffs, broker: str, topic: str) -> list[dict[str, Any]]:
    config: dict[str, Any] = {"kafka": {"bootstrapServers": broker, "topic": topic}, "k8s": {"enabled": False},
                              "conntrack": {"pollInterval": "1s"}, "expiry": {"activeTimeout": "2s"}}  # fmt: skip
    if renderer == "helm":
        config["conntrack"]["source"] = "cilium"
        config["cilium"] = {"bpffs": str(fs.path)}
        return render_helm(tmp, image, tmp / "state", config)
    return render_kustomize(tmp, image, tmp / "state", config, components=("cilium",),
                            host_paths={"bpffs": fs.path})  # fmt: skip


def wait_ready(netns: str, port: int, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    status, body = 0, ""
    while time.monotonic() < deadline:
        status, body = http_get_in(netns, "127.0.0.1", port, "/readyz")
        if status == 200:
            return
        time.sleep(0.5)
    raise AssertionError(f"/readyz: {status} {body}\n{log.read_text()[-6000:] if log.exists() else ''}")


@pytest.mark.parametrize("renderer", ["helm", "kustomize"])
def test_the_pod_reads_ciliums_maps_with_only_cap_bpf(
    renderer: str, image: str, node: str, kafka_broker: KafkaBroker, kafka_topic: str, tmp_path: Path
) -> None:
    now = int(time.monotonic())
    conns = [("10.0.1.5", 43000 + i, "10.0.2.7", 8080, 6, OUT) for i in range(CONNECTIONS)]
    with Bpffs() as fs:
        run_ctwriter(ctwriter(LAYOUT), fs, "create")
        apply(LAYOUT, fs, [put(*c, life(now, **counters(LAYOUT, (i + 1, 100 * i + 60), (i, 90 * i)))) for i, c in
                           enumerate(conns)])  # fmt: skip
        docs = render(renderer, tmp_path, image, fs, kafka_broker.bootstrap, kafka_topic)
        pod = daemonset_pod(docs, node_name="node-c", pod_ip="127.0.0.1", projected_dir=tmp_path / "projected")
        assert not pod["spec"].get("initContainers")  # no conntrack sysctls to set
        [exporter] = pod["spec"]["containers"]
        config = yaml.safe_load((tmp_path / "projected" / "config" / "config.yaml").read_text())
        play = PodPlay(pod, node, tmp_path)
        log = tmp_path / "pod.log"
        try:
            with LoopbackRelay(node, kafka_broker.port):
                play.play(log)
                wait_ready(node, config["metrics"]["port"], log)
                host = play.inspect(exporter["name"])["HostConfig"]
                assert host["CapAdd"] == ["CAP_BPF"] and "CAP_NET_RAW" in host["CapDrop"]  # no NET_ADMIN
                assert host["ReadonlyRootfs"] is True
                mount = [m for m in play.inspect(exporter["name"])["Mounts"] if m["Source"] == str(fs.path)]
                assert len(mount) == 1 and mount[0]["RW"] is False, mount
                time.sleep(1.5)
                apply(LAYOUT, fs, [put(*c, life(now, **counters(LAYOUT, (2 * i + 5, 300 * i + 400), (i + 3, 90 * i +
                                                                                                     200))))
                                   for i, c in enumerate(conns)])  # fmt: skip
                truth = {k: v["counters"] for k, v in expected(LAYOUT, listing(LAYOUT, fs), now).items()}
                time.sleep(3)
                play.stop()
                assert play.inspect(exporter["name"])["State"]["ExitCode"] == 0, log.read_text()[-4000:]
        finally:
            play.down()
    assert "Traceback" not in log.read_text()
    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=CONNECTIONS, timeout=60)
    chains = by_connection(records)
    assert len(chains) == CONNECTIONS
    fields = ("packetDeltaCount", "octetDeltaCount", "reversePacketDeltaCount", "reverseOctetDeltaCount")
    for recs in chains.values():
        r0 = recs[0]
        assert [r["sequence"] for r in recs] == list(range(len(recs)))
        key = (r0["protocol"], bytes(map(int, r0["sourceAddress"].split("."))), r0["sourcePort"],
               bytes(map(int, r0["destinationAddress"].split("."))))  # fmt: skip
        assert tuple(sum(r[f] for r in recs) for f in fields) == truth[key]
        # 16: both directions in one counter (Cilium 1.20); 1: found live by a pod with no state to continue from
        assert [r["flags"] for r in recs] == [17] * len(recs) and {r["exporterNode"] for r in recs} == {"node-c"}
