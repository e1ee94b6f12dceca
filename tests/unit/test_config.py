"""Configuration: precedence, durations, and exit code 2 naming the key for every bad value."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flow_exporter.cli import main
from flow_exporter.config import ConfigError, load, parse_overrides
from flow_exporter.settings import (
    BY_KEY,
    SETTINGS,
    RetrySettings,
    Settings,
    format_default,
    parse_duration,
    positive_duration,
)
from tests.support.cli import clean_env, run_cli


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  topic: from-file\n  bootstrapServers: file:9092\nconntrack:\n  pollInterval: 2s\n")
    env = {"FLOW_EXPORTER_KAFKA_TOPIC": "from-env"}
    cfg = load(f, environ=env, overrides={"kafka.bootstrapServers": "flag:9092"})
    assert cfg.kafka.topic == "from-env"
    assert cfg.kafka.bootstrap_servers == "flag:9092"
    assert cfg.conntrack.poll_interval == 2.0
    assert cfg.expiry.idle_timeout == 15.0


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
    assert load(f, environ={}) == load(environ={}) == Settings()  # every key, every default


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


# ----------------------------------------------------------------------------- the rough edges of issue 43


def test_a_file_that_is_not_utf8_exits_2_naming_the_byte(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "c.yaml"
    f.write_bytes(b"kafka:\n  topic: caf\xe9\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8 text (byte 19)" in err and "Traceback" not in err and err.count("\n") == 1


def test_a_huge_file_and_a_huge_value_give_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("kafka:\n  topic: " + "x" * (2 << 20) + "\n")
    assert main(["config", "--print", "--config", str(big)]) == 2
    err = capsys.readouterr().err
    assert "larger than 1 MiB" in err and len(err) < 500
    long = tmp_path / "long.yaml"
    long.write_text("kafka:\n  topic: " + "y" * 500_000 + "\n")
    assert main(["config", "--print", "--config", str(long)]) == 2
    err = capsys.readouterr().err
    assert "kafka.topic" in err and "yyy" in err and len(err) < 500


def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    lines += ["conntrack:", "  zones: *a8"]
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "more than 100,000 values once YAML aliases are expanded" in err and len(err) < 500


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("kafka:\n  topic: a\n  bootstrapServers: b:9092\n  topic: c\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "key 'topic' given twice (lines 2 and 4)" in err and err.count("\n") == 1


def test_a_scalar_for_a_list_is_refused_in_a_file_and_taken_from_a_flag(tmp_path: Path) -> None:
    f = tmp_path / "zones.yaml"
    f.write_text("conntrack:\n  zones: 7\n")
    with pytest.raises(ConfigError, match=r"conntrack\.zones=7: expected a list"):
        load(f, environ={})
    f.write_text("conntrack:\n  zones: [7]\n")
    assert load(f, environ={}).conntrack.zones == (7,)
    assert load(None, environ={}, overrides={"conntrack.zones": "1,7"}).conntrack.zones == (1, 7)
    assert load(None, environ={"FLOW_EXPORTER_CONNTRACK_ZONES": "7"}).conntrack.zones == (7,)


@pytest.mark.parametrize(
    ("where", "wrong", "right"),
    [("file", "kafka:\n  bootstrapServer: k:9092\n", "kafka.bootstrapServers"),
     ("flag", "conntrack.pollIntervall=5s", "conntrack.pollInterval"),
     ("env", "FLOW_EXPORTER_KAFKA_TOPICS", "FLOW_EXPORTER_KAFKA_TOPIC")],
)  # fmt: skip
def test_a_misspelt_key_gets_a_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, where: str, wrong: str, right: str
) -> None:
    args = ["config", "--print"]
    if where == "file":
        f = tmp_path / "c.yaml"
        f.write_text(wrong)
        args += ["--config", str(f)]
    elif where == "flag":
        args += ["--set", wrong]
    else:
        monkeypatch.setenv(wrong, "flows")
    assert main(args) == 2
    assert f"did you mean {right}?" in capsys.readouterr().err


def test_set_takes_one_producer_entry_merged_over_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  producer:\n    linger.ms: 50\n    compression.type: zstd\n")
    cfg = load(f, environ={}, overrides=parse_overrides(["kafka.producer.acks=all", "kafka.producer.linger.ms=20"]))
    assert cfg.kafka.producer == {"linger.ms": 20, "compression.type": "zstd", "acks": "all"}
    assert main(["config", "--print", "--set", "kafka.producer.acks=all"]) == 0
    merged = parse_overrides(["kafka.producer={acks: all, linger.ms: 1}", "kafka.producer.linger.ms=5"])
    assert merged == {"kafka.producer": {"acks": "all", "linger.ms": 5}}
    assert parse_overrides(["kafka.producer=acks=all,linger.ms=1"]) == {"kafka.producer": {"acks": "all",
                                                                                        "linger.ms": "1"}}  # fmt: skip


def test_config_print_runs_the_checks_run_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A bad networks file and enrichment without an API server: exit 2 from `config --print` as from `run`."""
    bad = tmp_path / "networks.yaml"
    bad.write_text("backends: [10.0.2.1/24]\n")  # a host bit set
    assert main(["config", "--print", "--set", f"networks.file={bad}"]) == 2
    err = capsys.readouterr().err
    assert "networks.file" in err and "10.0.2.1/24" in err and err.count("\n") == 1
    good = tmp_path / "good.yaml"
    good.write_text("backends: [10.0.2.0/24]\n")
    assert main(["config", "--print", "--set", f"networks.file={good}"]) == 0
    capsys.readouterr()
    missing = tmp_path / "no-kubeconfig"
    assert main(["config", "--print", "--set", "k8s.enabled=true", "--set", f"k8s.kubeconfig={missing}"]) == 2
    assert "no usable API server configuration" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the typed settings (issue 43)


def test_the_loaded_settings_are_typed_sections() -> None:
    settings = load(None, environ={"FLOW_EXPORTER_KAFKA_TLS_VERIFY_HOSTNAME": "no"},
                    overrides={"sampling.budget.recordsPerSecond": "5_000", "k8s.podLabels": "app,tier"})  # fmt: skip
    assert settings.kafka.tls.verify_hostname is False
    assert settings.sampling.budget.records_per_second == 5000
    assert settings.k8s.pod_labels == ("app", "tier")
    assert settings.conntrack.poll_interval == 5.0 and settings.kafka.topic == "flows"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.kafka.topic = "other"  # type: ignore[misc]


def test_env_names_follow_the_keys() -> None:
    """The variable names the manifests and users set: the key's words, upper case, joined by underscores."""
    expected = {
        "nodeName": "FLOW_EXPORTER_NODE_NAME",
        "communityId.seed": "FLOW_EXPORTER_COMMUNITY_ID_SEED",
        "sampling.budget.recordsPerSecond": "FLOW_EXPORTER_SAMPLING_BUDGET_RECORDS_PER_SECOND",
        "kafka.tls.keyPasswordFile": "FLOW_EXPORTER_KAFKA_TLS_KEY_PASSWORD_FILE",
        "schemaRegistry.basicAuthUserInfo": "FLOW_EXPORTER_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO",
        "k8s.podLabels": "FLOW_EXPORTER_K8S_POD_LABELS",
    }
    assert {key: BY_KEY[key].env for key in expected} == expected
    assert len({s.env for s in SETTINGS}) == len({s.key for s in SETTINGS}) == len(SETTINGS) == 71


def test_the_declarations_for_the_reference() -> None:
    """What the docs generator reads of each setting (key, env, default, doc, kind, secret) and format_default."""
    assert {s.key for s in SETTINGS if s.secret} == {
        "sampling.seed", "kafka.sasl.password", "schemaRegistry.basicAuthUserInfo"
    }  # fmt: skip
    shown = {key: (BY_KEY[key].kind, format_default(BY_KEY[key])) for key in (
        "conntrack.pollInterval", "kafka.readyTimeout", "conntrack.zones", "k8s.podLabels", "kafka.producer",
        "kafka.routes", "sampling.probability", "conntrack.eventBuffer", "export.prefixCache", "kafka.topic",
        "log.level", "networks.file",
    )}  # fmt: skip
    assert shown == {
        "conntrack.pollInterval": ("duration > 0", "5s"),
        "kafka.readyTimeout": ("duration", "120s"),
        "conntrack.zones": ("list of zones", "[]"),
        "k8s.podLabels": ("list of label keys", '["app", "app.kubernetes.io/name"]'),
        "kafka.producer": ("map", "{}"),
        "kafka.routes": ("list of routes", "[]"),
        "sampling.probability": ("probability", "1.0"),
        "conntrack.eventBuffer": ("whole number >= 4096", "67108864"),
        "export.prefixCache": ("bool or auto", "null"),
        "kafka.topic": ("topic name", '"flows"'),
        "log.level": ("one of debug, info, warning, error", '"info"'),
        "networks.file": ("path", "null"),
    }
    for s in SETTINGS:  # each default, read back by YAML and the setting's own parser, is the default
        assert s.doc and s.kind
        assert s.parse(s.key, yaml.safe_load(format_default(s))) == s.default, s.key


def test_what_spans_a_section_is_checked_where_it_is_declared() -> None:
    with pytest.raises(ConfigError, match=r"config retry\.maxBackoff=30\.0: must be >= retry\.initialBackoff"):
        RetrySettings(initial_backoff=60.0)
    with pytest.raises(ConfigError, match=r"retry\.maxBackoff"):
        load(None, environ={}, overrides={"retry.initialBackoff": "1m"})


def test_a_deep_halving_is_judged_not_a_traceback(capsys: pytest.CaptureFixture) -> None:
    """2**2000 does not fit a float: the depth check once died on it (OverflowError, exit 1)."""
    assert main(["config", "--print", "--set", "sampling.maxHalvings=2000"]) == 0
    capsys.readouterr()
    args = ["config", "--print", "--set", "sampling.maxHalvings=2000", "--set", "sampling.budget.connections=10"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "config sampling.maxHalvings=2000: sampling.probability halved that often is below 2**-32" in err


def test_secrets_stay_hidden_in_a_repr_and_routes_print_as_written(capsys: pytest.CaptureFixture) -> None:
    settings = load(None, environ={}, overrides={
        "sampling.seed": "seed-s3cr3t", "kafka.producer": {"sasl.password": "pw-s3cr3t", "linger.ms": 5},
        "kafka.routes": [{"topic": "ended", "endReason": 3}, {"topic": "pods", "flowType": 1}],
    })  # fmt: skip
    text = repr(settings) + repr(settings.sampling) + repr(settings.kafka)
    assert "s3cr3t" not in text and "linger.ms" in text and "***" in text
    args = ["config", "--print", "--set", "kafka.routes=[{topic: ended, endReason: 3}, {topic: pods, flowType: 1}]"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kafka.routes"] == [{"topic": "ended", "endReason": 3}, {"topic": "pods", "flowType": 1}]
