"""Start-up as a newcomer meets it (issue 43): a pod without CAP_NET_ADMIN, and a broker nobody answers on.

Real parts: the kernel's nfnetlink (which asks CAP_NET_ADMIN of every message: the capability is dropped with
util-linux's ``setpriv`` for the exporter process only) and a lab node namespace whose connections the exporter
follows by their events while it waits for Kafka; the broker address is a port nothing listens on.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.lab import Lab
from tests.support.cli import clean_env
from tests.support.paths import REPO

pytestmark = pytest.mark.lab

DEAD = "127.0.0.1:9"  # the discard port: nothing listens


def test_without_cap_net_admin_the_start_fails_at_once_with_exit_2() -> None:
    """Not a warning and a wait for Kafka: exit 2 before anything waits, the missing capability named."""
    r = subprocess.run(
        ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", "--", sys.executable, "-m", "flow_exporter",
         "run", "--bootstrap-servers", DEAD, "--set", "metrics.port=0", "--set", "conntrack.setSysctls=false"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "needs CAP_NET_ADMIN" in r.stderr and "Traceback" not in r.stderr
    assert "kafka not reachable" not in r.stderr  # it never got as far as waiting for the broker


def test_sigterm_while_kafka_is_unreachable_says_what_it_leaves(tmp_path: Path) -> None:
    """The retry log says how long an attempt waited; SIGTERM during the wait exits 0 with a closing line that counts
    the connections seen meanwhile (none sent), instead of vanishing silently."""
    log = tmp_path / "exporter.log"
    with Lab("startup", pods=2) as lab, log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flow_exporter", "run", "--netns", lab.node_ns, "--bootstrap-servers", DEAD,
             "--node-name", "startup", "--set", "metrics.port=0", "--set", "conntrack.pollInterval=1s",
             "--set", "retry.initialBackoff=200ms"],
            cwd=REPO, env={**clean_env(), "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while "kafka not reachable" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            a, b = lab.pods
            for port in (7001, 7002, 7003):
                lab.udp_exchange(a, b, port, 10, 10)
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    attempt = re.search(r"kafka not reachable after (\d+\.\d) s \(.*\); next attempt in (\d+\.\d) s", text)
    assert attempt is not None, text
    closing = re.search(r"stopped before Kafka answered: no flow record was sent; (\d+) connections known .*no "
                        r"state\.dir\), (\d+) of them ended meanwhile", text)  # fmt: skip
    assert closing is not None, text
    assert int(closing.group(1)) == 3, text  # the three exchanges, met by their NEW events
    assert "Traceback" not in text
