"""The exporter as a subprocess against a namespace lab, and its HTTP endpoints.

Used by the lab tests on real parts and by the capture, events and latency benchmarks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from devtools.lab import Lab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start_exporter(
    lab: Lab, bootstrap: str, topic: str, log: Path, *extra: str, metrics_port: int = 0, wait: bool = True
) -> subprocess.Popen[bytes]:
    """The exporter on the lab's node namespace, writing to ``topic``; with ``wait``, once it logged its first poll."""
    cmd = [
        sys.executable,
        "-m",
        "flow_exporter",
        "run",
        "--netns",
        lab.node_ns,
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--node-name",
        "lab-node",
        "--set",
        "conntrack.pollInterval=1s",
        "--set",
        "expiry.activeTimeout=2s",
        "--set",
        "expiry.idleTimeout=4s",
        "--set",
        "shutdown.grace=15s",
        "--set",
        f"metrics.port={metrics_port}",
        "--set",
        "metrics.address=127.0.0.1",
        *extra,
    ]
    fh = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 20
    while wait and "first poll" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def stop_exporter(proc: subprocess.Popen[bytes], log: Path, grace: float = 15.0) -> str:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=grace + 5)
    text = log.read_text()
    assert rc == 0, text
    assert time.monotonic() - t0 <= grace, text
    return text
