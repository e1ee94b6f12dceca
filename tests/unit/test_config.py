"""Configuration: precedence, durations, and exit code 2 naming the key for every bad value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flow_exporter.cli import main
from flow_exporter.config import ConfigError, load
from flow_exporter.settings import parse_duration


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  topic: from-file\n  bootstrapServers: file:9092\nconntrack:\n  pollInterval: 2s\n")
    env = {"FLOW_EXPORTER_KAFKA_TOPIC": "from-env"}
    cfg = load(f, environ=env, overrides={"kafka.bootstrapServers": "flag:9092"})
    assert cfg["kafka.topic"] == "from-env"
    assert cfg["kafka.bootstrapServers"] == "flag:9092"
    assert cfg["conntrack.pollInterval"] == 2.0
    assert cfg["expiry.idleTimeout"] == 15.0


@pytest.mark.parametrize(
    ("text", "seconds"), [("5s", 5), ("1m", 60), ("250ms", 0.25), ("1.5h", 5400), (3, 3), ("10", 10)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration("k", text) == seconds


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ("bogus: 1\n", "bogus"),
        ("kafka:\n  topicc: x\n", "kafka.topicc"),
        ("conntrack:\n  pollInterval: fast\n", "conntrack.pollInterval"),
        ("expiry:\n  idleTimeout: -5s\n", "expiry.idleTimeout"),
        ("expiry:\n  activeTimeout: 0s\n", "expiry.activeTimeout"),
        ("conntrack:\n  zones: [70000]\n", "conntrack.zones"),
        ("kafka:\n  topic: 'bad topic'\n", "kafka.topic"),
        ("kafka:\n  routes: [{topic: ended}]\n", "kafka.routes[0]"),
        ("kafka:\n  routes: [{topic: t, endReason: 9}]\n", "kafka.routes[0].endReason"),
        ("log:\n  level: loud\n", "log.level"),
        ("- a\n- b\n", "--config"),
        ("a: [\n", "--config"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, yaml_text: str, key: str, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load(f, environ={})
    assert info.value.key == key
    assert main(["config", "--print", "--config", str(f)]) == 2
    assert key in capsys.readouterr().err


def test_unreadable_file_and_bad_env_exit_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "flow_exporter", "run", "--config", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--config" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "flow_exporter", "config", "--print"],
        capture_output=True,
        text=True,
        env={"FLOW_EXPORTER_EXPIRY_IDLE_TIMEOUT": "soon", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "expiry.idleTimeout" in r.stderr


def test_print_defaults_lists_every_setting(capsys: pytest.CaptureFixture) -> None:
    from flow_exporter.config import SETTINGS

    assert main(["config", "--print-defaults"]) == 0
    out = capsys.readouterr().out
    for s in SETTINGS:
        assert s.key in out and s.env in out


def test_secrets_not_printed(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--print", "--set", "kafka.producer={sasl.password: hunter2}"]) == 0
    assert "hunter2" not in capsys.readouterr().out


def test_help_works() -> None:
    for cmd in (
        [sys.executable, "-m", "flow_exporter", "--help"],
        [str(Path(sys.executable).parent / "flow-exporter"), "--help"],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0 and "run" in r.stdout
