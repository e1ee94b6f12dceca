"""``make try-pod``: the DaemonSet's pod from k8s/, run here under podman, for someone without a cluster.

What ``kubectl apply -k k8s/`` makes a kubelet run on a node, run the way the pod tests run it
(devtools.pod_play says what podman 4.3 is given differently from a kubelet, and why): the image ``make image``
builds, the privileged init container that turns conntrack's accounting and timestamps on, the exporter as
UID 0 with NET_ADMIN only, no privilege escalation, a read-only root filesystem, the config projected
read-only, the state directory on a hostPath, the memory limit, and at the end the grace period.

The node is a network-namespace lab (devtools.lab: a routed "node" namespace and three "pods" exchanging
TCP and UDP traffic over IPv4 and IPv6), so the pod's host network is that namespace's: its conntrack table
holds only the lab's connections, and the init container's sysctls change that namespace, not this
machine's. The broker is a local Apache Kafka started as ``make demo`` starts it (devtools.kafka), relayed
into the namespace at the same loopback address (devtools.netns_relay).

What differs from k8s/, as a user's overlay would change it: the image (the local build), the init
container's image (the stand-in base the build uses: a shell, like busybox, with no registry to pull from),
the state hostPath (a temporary directory, not /var/lib/flow-exporter of this machine), and in the config
file the brokers and topic, ``k8s.enabled: false`` (no API server to enrich from) and shorter intervals
(:data:`CONFIG`) so records show within seconds rather than a minute.

Shown: the pod's log (each JSON log line as its level and message), then every record as
``flow-exporter tail`` prints it, read back from the topic by that command. Ctrl-C (or ``--duration``) stops
the pod as a kubelet does (SIGTERM, then the grace period): its final records are shown too, then the pod,
the lab and the broker are removed. Needs root (namespaces, rootful podman), as ``make demo`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from devtools.kafka import KafkaBroker
from devtools.lab import Lab, LabError
from devtools.netns_relay import LoopbackRelay, http_get_in
from devtools.pod_play import PodPlay, PodPlayError, daemonset_pod
from devtools.podman import REPO, base_image, engine_env, image_exists, podman
from flow_exporter.commands import table_header

IMAGE = "localhost/flow-exporter:dev"  # what `make image` builds (the Makefile's IMAGE)
TOPIC = "flows"
NODE = "try-pod-node"
K8S = REPO / "k8s"
# The config keys changed from k8s/config.yaml (besides the brokers and topic): no API server here, and
# records within seconds (the lab's exchanges end at once; every entry is polled every 2 s).
CONFIG: dict[str, Any] = {
    "k8s": {"enabled": False},
    "conntrack": {"pollInterval": "2s"},
    "expiry": {"activeTimeout": "10s", "idleTimeout": "5s"},
}
SERVER_PORTS = {"tcp": 8000, "udp": 5353}


class TryPodError(RuntimeError):
    """A step failed; its message says which and where to look."""


def _say(msg: str) -> None:
    print(f"try-pod: {msg}", flush=True)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base.get(k) or {}, v) if isinstance(v, dict) else v
    return out


# ------------------------------------------------------------------------------ the image


def ensure_image(tag: str, rebuild: bool) -> None:
    """The image ``make image`` builds, built when missing (or asked for: the build's layer cache makes an
    unchanged tree quick)."""
    if image_exists(tag) and not rebuild:
        created = podman("image", "inspect", "--format", "{{.Created}}", tag).stdout.strip()
        _say(f"image {tag} (built {created[:19]}); --build rebuilds it from this tree")
        return
    _say(f"building the image {tag} (tools/image/build.sh, what make image runs: minutes when cold)")
    started = time.monotonic()
    proc = subprocess.run(["bash", "tools/image/build.sh", tag], cwd=REPO, env=engine_env(), check=False)
    if proc.returncode != 0:
        raise TryPodError(f"the image build failed (exit {proc.returncode}); its output is above")
    _say(f"image built in {time.monotonic() - started:.0f} s")


# ------------------------------------------------------------------------------ k8s/, as kubectl apply -k makes it


def render(image: str, init_image: str, state: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects of k8s/ (its kustomization's resources and generated ConfigMap; the ConfigMap under its plain
    name, since the pod is played from these objects, not from an API server), with this run's image, init
    image, state directory and config keys."""
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "configMapGenerator"}
    if unknown:
        raise TryPodError(f"k8s/kustomization.yaml uses {sorted(unknown)}, which try-pod does not apply")
    docs = [d for name in k["resources"] for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        data = {f: yaml.safe_dump(_merged(yaml.safe_load((K8S / f).read_text()), config)) for f in gen["files"]}
        meta = {"name": gen["name"], "namespace": gen.get("namespace", "default")}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for doc in docs:
        if doc["kind"] != "DaemonSet":
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in spec["containers"]:
            c["image"] = image
        for c in spec.get("initContainers", []):
            c["image"] = init_image
        for volume in spec["volumes"]:
            if volume["name"] == "state":
                volume["hostPath"]["path"] = str(state)
    return docs


# ------------------------------------------------------------------------------ what is shown


def _log_line(line: str) -> str:
    """A k8s-file log line (``<time> <stream> <F|P> <text>``) as the exporter's level and message."""
    parts = line.rstrip("\n").split(" ", 3)
    text = parts[3] if len(parts) == 4 else line.rstrip("\n")
    try:
        rec = json.loads(text)
    except ValueError:
        return text
    if not isinstance(rec, dict):
        return text
    level, msg = rec.pop("level", ""), rec.pop("message", rec.pop("msg", ""))
    for k in ("time", "timestamp", "ts", "logger", "name"):
        rec.pop(k, None)
    extra = " ".join(f"{k}={v}" for k, v in rec.items())
    return f"{str(level).lower():<7} {msg}{'  ' + extra if extra else ''}"


def _follow(path: Path, prefix: str, stop: threading.Event) -> None:
    """Print the lines appended to ``path`` (the pod's log) until ``stop``, then the rest."""
    while not path.exists() and not stop.is_set():
        time.sleep(0.2)
    if not path.exists():
        return
    with path.open() as f:
        while True:
            line = f.readline()
            if line:
                print(f"{prefix}{_log_line(line)}", flush=True)
            elif stop.is_set():
                return
            else:
                time.sleep(0.2)


class Records:
    """``flow-exporter tail`` over the topic, each line printed as it comes; counts the records."""

    def __init__(self, bootstrap: str) -> None:
        self.count = 0
        self.last = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flow_exporter", "tail", "--bootstrap-servers", bootstrap, "--topic", TOPIC,
             "--from-beginning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,  # not Ctrl-C'd
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        header = table_header()
        for line in self.proc.stdout:
            if line.rstrip() != header and not line.startswith("flow-exporter tail:"):
                self.count += 1
                self.last = time.monotonic()
            print(f"record | {line.rstrip()}", flush=True)

    def drain(self, quiet: float = 3.0, timeout: float = 30.0) -> None:
        """Wait until no record came for ``quiet`` seconds (the final ones read), then stop reading."""
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last < quiet and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self._thread.join(timeout=5)


def _traffic(lab: Lab, stop: threading.Event, errors: list[str]) -> int:
    """Exchanges between the lab's pods until ``stop``: TCP and UDP, IPv4 and IPv6, about one a second."""
    rnd = random.Random(43)
    count = 0
    while not stop.is_set():
        client, server = rnd.sample(lab.pods, 2)
        family = rnd.choice((4, 6))
        try:
            if rnd.random() < 0.6:
                lab.tcp_exchange(client, server, SERVER_PORTS["tcp"], rnd.randint(200, 800),
                                 rnd.randint(2_000, 60_000), family=family)  # fmt: skip
            else:
                lab.udp_exchange(client, server, SERVER_PORTS["udp"], rnd.randint(40, 80), rnd.randint(100, 500),
                                 family=family)  # fmt: skip
            count += 1
        except (LabError, OSError) as exc:
            errors.append(str(exc))
        stop.wait(rnd.uniform(0.5, 1.5))
    return count


def _wait_ready(netns: str, address: str, port: int, play: PodPlay, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    status, body = 0, ""
    while time.monotonic() < deadline:
        status, body = http_get_in(netns, address, port, "/readyz")
        if status == 200:
            return
        state = play.inspect("flow-exporter")["State"]
        if state.get("Status") == "exited":
            raise TryPodError(f"the exporter exited with code {state.get('ExitCode')}; its log is above")
        time.sleep(0.5)
    raise TryPodError(f"/readyz still answers {status} {body.strip()} after {timeout:.0f} s; the pod's log is above")


# ------------------------------------------------------------------------------ the run


def run(image: str, duration: float | None, rebuild: bool) -> int:
    if os.geteuid() != 0:
        _say("needs root: network namespaces and rootful podman, as make demo")
        return 2
    if shutil.which("podman") is None:
        _say("podman is not installed: make setup-image installs it (Debian's)")
        return 2
    started = time.monotonic()
    ensure_image(image, rebuild)
    work = Path(tempfile.mkdtemp(prefix="flow-exporter-try-pod-"))
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not stop.is_set():
            print(flush=True)
            _say("stopping (the pod gets SIGTERM and its grace period; Ctrl-C again does not hurry it)")
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(image, duration, work, stop, started)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(image: str, duration: float | None, work: Path, stop: threading.Event, started: float) -> int:
    _say("starting the Kafka broker (KRaft, one node, as make demo)")
    with KafkaBroker(work / "kafka") as broker:
        broker.create_topic(TOPIC, partitions=1)
        with Lab(pods=3) as lab, LoopbackRelay(lab.node_ns, broker.port):
            pod_ip = lab.pods[0].node_ip4  # a hostNetwork pod's IP is its node's
            kafka = {"kafka": {"bootstrapServers": broker.bootstrap, "topic": TOPIC}}
            docs = render(image, base_image(), work / "state", _merged(CONFIG, kafka))
            pod = daemonset_pod(docs, node_name=NODE, pod_ip=pod_ip, projected_dir=work / "projected")
            config = yaml.safe_load((work / "projected" / "config" / "config.yaml").read_text())
            port = int(config["metrics"]["port"])
            play = PodPlay(pod, lab.node_ns, work)
            _say(f"broker {broker.bootstrap}; node namespace {lab.node_ns} ({pod_ip}); pods "
                 + ", ".join(f"{p.name} {p.ipv4}" for p in lab.pods) + f"; work directory {work}")  # fmt: skip
            _say(f"playing the pod {play.name} from k8s/ (podman kube play; the file played: {play.kube_file})")
            log = work / "pod.log"
            log_stop = threading.Event()
            follower = threading.Thread(target=_follow, args=(log, "pod    | ", log_stop), daemon=True)
            traffic_stop = threading.Event()
            errors: list[str] = []
            exchanges: list[int] = []
            traffic = threading.Thread(target=lambda: exchanges.append(_traffic(lab, traffic_stop, errors)))
            records: Records | None = None
            try:
                play.play(log)
                follower.start()
                _wait_ready(lab.node_ns, pod_ip, port, play)
                _say(f"ready in {time.monotonic() - started:.0f} s since make try-pod started; metrics: ip netns exec "
                     f"{lab.node_ns} curl -s http://{pod_ip}:{port}/metrics")  # fmt: skip
                _say(
                    "traffic between the pods now; records below as `flow-exporter tail` prints them. "
                    + ("Ctrl-C stops." if duration is None else f"Stopping after {duration:.0f} s (or Ctrl-C).")
                )
                records = Records(broker.bootstrap)
                traffic.start()
                stop.wait(duration)
            finally:
                traffic_stop.set()
                if traffic.is_alive():
                    traffic.join(timeout=60)
                code = _stop_pod(play)
                if records is not None:
                    records.drain()
                log_stop.set()
                follower.join(timeout=10)
                play.down()
    count = records.count if records is not None else 0
    _say(f"{exchanges[0] if exchanges else 0} exchanges ({len(errors)} failed), {count} records read back; "
         f"the exporter exited with code {code}; {time.monotonic() - started:.0f} s in all")  # fmt: skip
    _say(f"kept: the pod's log {work / 'pod.log'} and the Pod played {work / 'pod.yaml'}")
    return 0 if code == 0 and count > 0 else 1


def _stop_pod(play: PodPlay) -> int | None:
    """SIGTERM, SIGKILL after the grace period, as a kubelet; the exporter's exit code (None if unknown)."""
    _say(f"stopping the pod as a kubelet does: SIGTERM, SIGKILL after {play.grace} s")
    try:
        took = play.stop()
        state = play.inspect("flow-exporter")["State"]
    except PodPlayError as exc:
        _say(f"stopping failed: {exc}")
        return None
    _say(f"the exporter exited with code {state.get('ExitCode')} {took:.1f} s after SIGTERM")
    code = state.get("ExitCode")
    return code if isinstance(code, int) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devtools.try_pod",
        description="the DaemonSet's pod from k8s/ under podman, a local broker, a namespace lab (make try-pod)",
    )
    ap.add_argument("--image", default=IMAGE, help=f"the exporter's image tag (default {IMAGE}, make image's)")
    ap.add_argument("--build", action="store_true", help="build the image even if it exists")
    ap.add_argument("--duration", type=float, default=None, help="seconds of traffic, then stop (default: Ctrl-C)")
    args = ap.parse_args(argv)
    try:
        return run(args.image, args.duration, args.build)
    except (TryPodError, PodPlayError) as exc:
        _say(str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
