"""Configuration: precedence, durations, and exit code 2 naming the key for every bad value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flow_exporter.cli import main
from flow_exporter.config import ConfigError, load
from flow_exporter.settings import SETTINGS, parse_duration, positive_duration
from tests.support.cli import clean_env, run_cli


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
        ("conntrack:\n  source: ebpf\n", "conntrack.source"),
        ("record:\n  attributes: {region: 1}\n", "record.attributes"),  # not a string
        ("record:\n  attributes: [a, b]\n", "record.attributes"),
        ("record:\n  attributes: {'1x': a}\n", "record.attributes"),
        ("record:\n  attributes: {" + ", ".join(f"a{i}: x" for i in range(17)) + "}\n", "record.attributes"),
        ("cilium:\n  counters: both\n", "cilium.counters"),
        ("cilium:\n  clock: tsc\n", "cilium.clock"),
        ("conntrack:\n  source: cilium\n  zones: [1]\n", "conntrack.zones"),  # Cilium's maps have no zones
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


def test_print_defaults_is_a_config_file_to_start_from(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from flow_exporter.config import SETTINGS

    assert main(["config", "--print-defaults"]) == 0
    out = capsys.readouterr().out
    for s in SETTINGS:
        assert s.env in out
    f = tmp_path / "defaults.yaml"
    f.write_text(out)
    assert dict(load(f, environ={}).values) == dict(load(environ={}).values)  # every key, every default


DURATIONS = [s.key for s in SETTINGS if s.parse in (parse_duration, positive_duration)]


@pytest.mark.parametrize("key", DURATIONS)
@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf", "1e400", "400d", "9000h"])
def test_durations_are_finite_and_sane(tmp_path: Path, key: str, value: str) -> None:
    f = tmp_path / "c.yaml"
    *path, leaf = key.split(".")
    f.write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(path)) + f"{'  ' * len(path)}{leaf}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load(f, environ={})
    assert info.value.key == key


@pytest.mark.parametrize(
    ("producer", "key", "why"),
    [
        ("{linger.mss: 5}", "kafka.producer.linger.mss", "No such configuration property"),
        ("{linger.ms: soon}", "kafka.producer.linger.ms", "Invalid value"),
        ("{batch.size: 1000000000000}", "kafka.producer.batch.size", "outside allowed range"),
        ("{acks: 1}", "kafka.producer.acks", "voids the delivery accounting"),
        ("{request.required.acks: 0}", "kafka.producer.request.required.acks", "voids the delivery accounting"),
        ("{enable.idempotence: false}", "kafka.producer.enable.idempotence", "voids the delivery accounting"),
        ("{delivery.report.only.error: true}", "kafka.producer.delivery.report.only.error", "voids"),
    ],
)
def test_producer_settings_are_checked_by_librdkafka_at_start(
    producer: str, key: str, why: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["config", "--print", "--set", f"kafka.producer={producer}"]) == 2
    err = capsys.readouterr().err
    assert f"config {key}=" in err and why in err and "Traceback" not in err


def test_unsafe_producer_settings_need_the_explicit_override(capsys: pytest.CaptureFixture) -> None:
    args = ["config", "--print", "--set", "kafka.producer={enable.idempotence: false, acks: 1}"]
    assert main(args) == 2
    assert main([*args, "--set", "kafka.allowUnsafeProducer=true"]) == 0
    assert '"acks": 1' in capsys.readouterr().out


SECRET = "hunter2-s3cr3t"


@pytest.mark.parametrize(
    "setting",
    [
        f"kafka.sasl.password={SECRET}",
        f"schemaRegistry.basicAuthUserInfo=user:{SECRET}",
        f"schemaRegistry.url=https://user:{SECRET}@registry.example:8081",
        f"kafka.producer={{sasl.password: {SECRET}}}",
        f"kafka.producer={{ssl.key.pem: {SECRET}}}",
        f"kafka.producer={{ssl.key.password: {SECRET}}}",
        f"kafka.producer={{ssl.keystore.password: {SECRET}}}",
        f"kafka.producer={{sasl.oauthbearer.config: 'principal=x secret={SECRET}'}}",
        f"kafka.producer={{sasl.oauthbearer.client.secret: {SECRET}}}",
    ],
)
def test_config_print_and_errors_never_show_a_secret(setting: str) -> None:
    r = run_cli("config", "--print", "--set", setting)
    assert SECRET not in r.stdout + r.stderr and "Traceback" not in r.stderr
    bad = run_cli("config", "--print", "--set", setting, "--set", "kafka.producer.linger.mss=1")
    assert bad.returncode == 2 and SECRET not in bad.stdout + bad.stderr


def test_config_print_into_a_closed_pipe_is_quiet() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flow_exporter", "config", "--print-defaults"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0 and err == ""


def test_k8s_enabled_without_an_api_server_configuration_exits_2(tmp_path: Path) -> None:
    r = run_cli("run", "--set", "k8s.enabled=true", "--set", f"k8s.kubeconfig={tmp_path / 'missing'}")
    assert r.returncode == 2 and "config k8s.kubeconfig=" in r.stderr and "Traceback" not in r.stderr


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
