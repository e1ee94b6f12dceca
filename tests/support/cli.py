"""The ``flow-exporter`` command line as a person runs it: a subprocess in the repository.

NODE and EXPORT_MS are the node name and export time the tests write records with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from typing import Any

from tests.support.paths import REPO

NODE = "node-tools"
EXPORT_MS = 1_767_225_600_123  # 2026-01-01T00:00:00.123Z
TIME_FIELDS = ("flowStart", "flowEnd", "exportTime")


def clean_env() -> dict[str, str]:
    """The test's environment without FLOW_EXPORTER_* settings (the cache location is kept)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_EXPORTER_") or k == "FLOW_EXPORTER_CACHE"}
    env["PYTHONPATH"] = str(REPO)
    return env


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flow_exporter", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_tail(bootstrap: str, topic: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``flow-exporter tail`` from the beginning of ``topic``, as a subprocess."""
    return run_cli(
        "tail", "--bootstrap-servers", bootstrap, "--topic", topic, "--from-beginning", *args, timeout=timeout
    )


def json_run_command(bootstrap: str, topic: str, **settings: str) -> list[str]:
    """``flow-exporter run --log-format json`` in the own network namespace, with ``--set key=value`` each.

    Keys are given with ``__`` for the dots (``conntrack__events="false"``).
    """
    cmd = [sys.executable, "-m", "flow_exporter", "run", "--log-format", "json", "--bootstrap-servers", bootstrap,
           "--topic", topic, "--node-name", NODE]  # fmt: skip
    for key, value in settings.items():
        cmd += ["--set", f"{key.replace('__', '.')}={value}"]
    return cmd


def from_json(line: str) -> dict[str, Any]:
    """A tail --json line back to build_record's form (epoch ms, raw bytes)."""
    rec = json.loads(line)
    for name in TIME_FIELDS:
        rec[name] = round(datetime.fromisoformat(rec[name].replace("Z", "+00:00")).timestamp() * 1000)
    if rec["ctLabels"] is not None:
        rec["ctLabels"] = bytes.fromhex(rec["ctLabels"])
    return rec


def settings_missing_from(defaults_yaml: str) -> list[str]:
    """The settings ``config --print-defaults`` output (a YAML config file) does not hold."""
    import yaml

    from flow_exporter.settings import SETTINGS

    doc = yaml.safe_load(defaults_yaml)
    missing = []
    for setting in SETTINGS:
        node = doc
        for part in setting.key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError:
            missing.append(setting.key)
    return missing
