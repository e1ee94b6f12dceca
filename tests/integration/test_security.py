"""Kafka TLS and SASL against a real broker: the exporter's settings reach librdkafka, bad
credentials fail clearly and at a paced rate, and no secret ever reaches a log line or an error.

One broker (SASL_PLAINTEXT, SSL with required client certificates, SASL_SSL) serves the module;
each test writes to its own topic. Failing clients run side by side so their waits overlap.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError

from devtools.kafka import KafkaBroker, make_ca
from devtools.lab import Lab
from flow_exporter.cli import main
from flow_exporter.config import ConfigError, Settings, load
from flow_exporter.connection import PROTO_TCP, Connection
from flow_exporter.runner import build_sink
from flow_exporter.sink import KafkaSink
from flow_exporter.store import ConnectionStore

pytestmark = pytest.mark.kafka

# Distinctive strings, so a leak anywhere in the output is found by a plain substring search.
USERS = {"alice": "alice-pw-Q7v2x9", "bob": "bob-pw-M3k8z1"}
WRONG = "wrong-pw-Z5n4c6"
KEY_PASSPHRASE = "key-pass-R2d9"
SECRETS = (*USERS.values(), WRONG, KEY_PASSPHRASE)
PASSWORD_ENV = "FLOW_EXPORTER_KAFKA_SASL_PASSWORD"
FAIL_WINDOW = 5.0  # seconds a failing client is watched
# At reconnect.backoff.ms=500, librdkafka retries a failing bootstrap broker about every 0.25-0.5 s;
# at its 100 ms default a refused TLS client retries ~20 times a second (~100 in the window).
MAX_FAILURES_IN_WINDOW = 25


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    with KafkaBroker(tmp_path_factory.mktemp("secure-broker"), scram_users=USERS, tls=True) as b:
        yield b


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEM files for the settings checks: a CA, a certificate and its key (plain and encrypted),
    another certificate's key, and passphrase files."""
    d = tmp_path_factory.mktemp("pem")
    for name in ("ca", "client", "other"):
        make_ca(d, name, f"/CN={name}")
    (d / "key.pass").write_text(KEY_PASSPHRASE + "\n")
    (d / "wrong.pass").write_text(WRONG + "\n")
    encrypt = ["openssl", "pkey", "-in", str(d / "client.key"), "-aes256", "-out", str(d / "client.enc.key")]
    subprocess.run([*encrypt, "-passout", f"file:{d / 'key.pass'}"], check=True, capture_output=True)
    names = {"ca": "ca.pem", "cert": "client.pem", "key": "client.key", "enc_key": "client.enc.key"}
    names |= {"other_key": "other.key", "key_pass": "key.pass", "wrong_pass": "wrong.pass"}
    return {k: d / v for k, v in names.items()}


@pytest.fixture
def topic(broker: KafkaBroker) -> str:
    name = f"sec-{uuid.uuid4().hex[:10]}"
    broker.create_topic(name)
    return name


@pytest.fixture
def client_errors(monkeypatch: pytest.MonkeyPatch) -> list[tuple[KafkaSink, KafkaError]]:
    """Every error librdkafka reports to a sink made from now on (the sink still handles it)."""
    seen: list[tuple[KafkaSink, KafkaError]] = []
    original = KafkaSink._on_error

    def spy(self: KafkaSink, err: KafkaError) -> None:
        seen.append((self, err))
        original(self, err)

    monkeypatch.setattr(KafkaSink, "_on_error", spy)
    return seen


def config(topic: str, environ: dict[str, str] | None = None, **settings: Any) -> Settings:
    return load(environ=environ or {}, overrides={"kafka.topic": topic, "nodeName": "sec-node", **settings})


def sasl(broker: KafkaBroker, mechanism: str, user: str = "alice", tls: bool = False, **more: Any) -> dict[str, Any]:
    settings = {
        "kafka.bootstrapServers": broker.sasl_ssl_bootstrap if tls else broker.sasl_bootstrap,
        "kafka.securityProtocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
        "kafka.sasl.mechanism": mechanism,
        "kafka.sasl.username": user,
        **more,
    }
    if tls:
        settings["kafka.tls.caFile"] = str(broker.ca_path)
    return settings


def mtls(broker: KafkaBroker, **more: Any) -> dict[str, Any]:
    return {
        "kafka.bootstrapServers": broker.ssl_bootstrap,
        "kafka.securityProtocol": "SSL",
        "kafka.tls.caFile": str(broker.ca_path),
        "kafka.tls.certFile": str(broker.client_cert_path),
        "kafka.tls.keyFile": str(broker.client_key_path),
        **more,
    }


def exports(n: int) -> list[Any]:
    """``n`` ended TCP connections' records, the same kind the exporter sends."""
    conns = [
        Connection(
            family=socket.AF_INET,
            proto=PROTO_TCP,
            orig_src=bytes([10, 0, 0, 1]),
            orig_dst=bytes([10, 0, 0, 2]),
            orig_sport=40000 + i,
            orig_dport=443,
            reply_src=bytes([10, 0, 0, 2]),
            reply_dst=bytes([10, 0, 0, 1]),
            reply_sport=443,
            reply_dport=40000 + i,
            ct_id=i + 1,
            tcp_state=7,
            orig_packets=3,
            orig_bytes=180,
            reply_packets=3,
            reply_bytes=270,
            start_ns=time.time_ns(),
        )
        for i in range(n)
    ]
    store = ConnectionStore()
    store.update(conns, 0.0, time.time_ns())
    return store.expire(100.0, time.time_ns())


def assert_delivers(cfg: Settings, n: int = 3) -> None:
    """The sink the exporter would build from ``cfg`` gets a delivery report for every record."""
    sink = build_sink(cfg)
    assert sink.unusable_topics() == {}
    for e in exports(n):
        sink.send(e, 0)
    assert sink.flush(20) == 0
    reports = sink.take_reports()
    assert len(reports) == n and all(r.delivered for r in reports), [r.error for r in reports]


def watch_failing(*cfgs: Settings) -> list[KafkaSink]:
    """Sinks that try to deliver one record each, served together for FAIL_WINDOW seconds."""
    sinks = [build_sink(cfg) for cfg in cfgs]
    for sink in sinks:
        sink.send(exports(1)[0], 0)
    deadline = time.monotonic() + FAIL_WINDOW
    while time.monotonic() < deadline:
        for sink in sinks:
            sink.poll(0)
        time.sleep(0.05)
    for sink in sinks:
        assert sink.counters.acked == 0
        # Stop the client now: the sink and its producer reference each other (error_cb), so it
        # would otherwise keep reconnecting until a garbage collection.
        sink._producer.purge()
        del sink._producer
    gc.collect()
    return sinks


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


# ------------------------------------------------------------------------------------ SASL


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"])
def test_sasl_with_the_right_password_delivers(broker: KafkaBroker, topic: str, mechanism: str) -> None:
    assert_delivers(config(topic, **sasl(broker, mechanism, **{"kafka.sasl.password": USERS["alice"]})))


def test_wrong_password_fails_clearly_once_per_interval_with_backoff(
    broker: KafkaBroker,
    topic: str,
    client_errors: list[tuple[KafkaSink, KafkaError]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    mechanisms = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
    with caplog.at_level(logging.WARNING, logger="flow_exporter.sink.kafka"):
        sinks = watch_failing(*(config(topic, **sasl(broker, m, **{"kafka.sasl.password": WRONG})) for m in mechanisms))
    for sink, mechanism in zip(sinks, mechanisms, strict=True):
        auth = [e for s, e in client_errors if s is sink and e.code() == KafkaError._AUTHENTICATION]
        assert auth, f"{mechanism}: no authentication error; got {[e.str() for s, e in client_errors if s is sink]}"
        assert "Authentication failed" in auth[0].str()
        assert len(auth) <= MAX_FAILURES_IN_WINDOW, f"{mechanism}: {len(auth)} login attempts in {FAIL_WINDOW}s"
    # Each sink logs its login failure once: at most one line per 10 s, however often librdkafka retries.
    lines = [r for r in caplog.records if "authentication failed" in r.getMessage()]
    assert len(lines) == len(sinks), [r.getMessage() for r in caplog.records]
    assert all(r.levelno == logging.ERROR and "kafka.sasl" in r.getMessage() for r in lines)
    assert_no_secret(caplog.text + "".join(e.str() for _, e in client_errors))


def test_password_from_a_file_and_from_the_environment(broker: KafkaBroker, topic: str, tmp_path: Path) -> None:
    pw_file = tmp_path / "bob.password"
    pw_file.write_text(USERS["bob"] + "\n")  # as `echo` or an editor leaves it
    from_file = config(topic, **sasl(broker, "SCRAM-SHA-512", "bob", **{"kafka.sasl.passwordFile": str(pw_file)}))
    assert from_file.producer_config()["sasl.password"] == USERS["bob"]
    assert_delivers(from_file)
    env = {
        PASSWORD_ENV: USERS["alice"],
        "FLOW_EXPORTER_KAFKA_SASL_USERNAME": "alice",
        "FLOW_EXPORTER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
        "FLOW_EXPORTER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "FLOW_EXPORTER_KAFKA_BOOTSTRAP_SERVERS": str(broker.sasl_bootstrap),
    }
    assert_delivers(config(topic, environ=env))


# ------------------------------------------------------------------------------------- TLS


def test_mutual_tls_delivers(broker: KafkaBroker, topic: str) -> None:
    assert_delivers(config(topic, **mtls(broker)))


def test_encrypted_client_key_with_a_key_password_file(broker: KafkaBroker, topic: str, tmp_path: Path) -> None:
    passphrase = tmp_path / "key.pass"
    passphrase.write_text(KEY_PASSPHRASE + "\n")
    key = tmp_path / "client.enc.key"
    encrypt = ["openssl", "pkey", "-in", str(broker.client_key_path), "-aes256", "-out", str(key)]
    subprocess.run([*encrypt, "-passout", f"file:{passphrase}"], check=True, capture_output=True)
    assert "ENCRYPTED" in key.read_text()
    assert_delivers(
        config(topic, **mtls(broker, **{"kafka.tls.keyFile": str(key), "kafka.tls.keyPasswordFile": str(passphrase)}))
    )


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_with_scram_delivers(broker: KafkaBroker, topic: str, mechanism: str) -> None:
    assert_delivers(config(topic, **sasl(broker, mechanism, "bob", tls=True, **{"kafka.sasl.password": USERS["bob"]})))


def test_wrong_ca_or_missing_client_certificate_fails_clearly(
    broker: KafkaBroker,
    topic: str,
    tmp_path: Path,
    client_errors: list[tuple[KafkaSink, KafkaError]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    other_ca = make_ca(tmp_path / "other-ca", subject="/CN=some other CA")
    wrong_ca = config(topic, **mtls(broker, **{"kafka.tls.caFile": str(other_ca)}))
    no_cert = config(
        topic,
        **{k: v for k, v in mtls(broker).items() if k not in ("kafka.tls.certFile", "kafka.tls.keyFile")},
    )
    with caplog.at_level(logging.WARNING, logger="flow_exporter.sink.kafka"):
        bad_ca_sink, no_cert_sink = watch_failing(wrong_ca, no_cert)

    # librdkafka reports these as _SSL or, depending on timing, _TRANSPORT errors: check the text.
    for sink, expected in ((bad_ca_sink, "certificate verify failed"), (no_cert_sink, "bad certificate")):
        errors = [e.str() for s, e in client_errors if s is sink and e.code() != KafkaError._ALL_BROKERS_DOWN]
        assert errors and all(expected in e for e in errors), errors
        assert len(errors) <= MAX_FAILURES_IN_WINDOW, f"{expected}: {len(errors)} handshakes in {FAIL_WINDOW}s"
        # One clear line per sink naming the settings to check, however often librdkafka retried.
        lines = [r.getMessage() for r in caplog.records if expected in r.getMessage()]
        assert len(lines) == 1 and "TLS failed; check kafka.tls.caFile" in lines[0], lines


# ------------------------------------------------------------------------- settings checks


def test_producer_config_maps_every_setting(tmp_path: Path, pem: dict[str, Path]) -> None:
    pw = tmp_path / "pw"
    pw.write_text(USERS["alice"] + "\r\n")
    cfg = config(
        "t",
        **{
            "kafka.bootstrapServers": "kafka:9093",
            "kafka.securityProtocol": "sasl_ssl",
            "kafka.sasl.mechanism": "scram-sha-512",
            "kafka.sasl.username": "alice",
            "kafka.sasl.passwordFile": str(pw),
            "kafka.tls.caFile": str(pem["ca"]),
            "kafka.tls.certFile": str(pem["cert"]),
            "kafka.tls.keyFile": str(pem["enc_key"]),
            "kafka.tls.keyPasswordFile": str(pem["key_pass"]),
            "kafka.tls.verifyHostname": "false",
        },
    )
    assert cfg.producer_config() == {
        "bootstrap.servers": "kafka:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "alice",
        "sasl.password": USERS["alice"],
        "ssl.ca.location": str(pem["ca"]),
        "ssl.certificate.location": str(pem["cert"]),
        "ssl.key.location": str(pem["enc_key"]),
        "ssl.key.password": KEY_PASSPHRASE,
        "ssl.endpoint.identification.algorithm": "none",
    }
    assert_no_secret(repr(cfg) + str(cfg.masked()))
    assert config("t").producer_config() == {"bootstrap.servers": "localhost:9092"}
    tls_on = config("t", **{"kafka.securityProtocol": "SSL"}).producer_config()
    assert tls_on["ssl.endpoint.identification.algorithm"] == "https"


SASL_OK = {"kafka.securityProtocol": "SASL_SSL", "kafka.sasl.mechanism": "PLAIN", "kafka.sasl.username": "alice"}
SSL_OK = {
    "kafka.securityProtocol": "SSL",
    "kafka.tls.caFile": "{ca}",
    "kafka.tls.certFile": "{cert}",
    "kafka.tls.keyFile": "{key}",
}


@pytest.mark.parametrize(
    ("settings", "key", "reason"),
    [
        ({"kafka.securityProtocol": "TLS"}, "kafka.securityProtocol", "one of PLAINTEXT"),
        ({**SASL_OK, "kafka.sasl.mechanism": "GSSAPI", "kafka.sasl.password": WRONG}, "kafka.sasl.mechanism", "one of"),
        ({**SASL_OK, "kafka.sasl.mechanism": None, "kafka.sasl.password": WRONG}, "kafka.sasl.mechanism", "required"),
        ({**SASL_OK, "kafka.sasl.username": None, "kafka.sasl.password": WRONG}, "kafka.sasl.username", "required"),
        (SASL_OK, "kafka.sasl.password", "required with SASL_SSL"),
        ({**SASL_OK, "kafka.sasl.password": WRONG, "kafka.sasl.passwordFile": "{pw}"}, "kafka.sasl.password", "both"),
        ({**SASL_OK, "kafka.sasl.passwordFile": "{missing}"}, "kafka.sasl.passwordFile", "unreadable"),
        ({**SASL_OK, "kafka.sasl.passwordFile": "{dir}"}, "kafka.sasl.passwordFile", "unreadable"),
        ({**SASL_OK, "kafka.sasl.passwordFile": "{binary}"}, "kafka.sasl.passwordFile", "unreadable"),
        ({**SASL_OK, "kafka.sasl.passwordFile": "{empty}"}, "kafka.sasl.passwordFile", "empty"),
        ({"kafka.sasl.password": WRONG}, "kafka.sasl.password", "needs kafka.securityProtocol"),
        ({"kafka.securityProtocol": "SSL", "kafka.tls.caFile": "{missing}"}, "kafka.tls.caFile", "unreadable"),
        ({"kafka.securityProtocol": "SSL", "kafka.tls.certFile": "{pw}"}, "kafka.tls.keyFile", "both"),
        ({"kafka.securityProtocol": "SASL_PLAINTEXT", "kafka.tls.caFile": "{pw}"}, "kafka.tls.caFile", "needs"),
        ({"kafka.securityProtocol": "SSL", "kafka.tls.keyPasswordFile": "{pw}"}, "kafka.tls.keyPasswordFile", "needs"),
        ({**SSL_OK, "kafka.tls.caFile": "{pw}"}, "kafka.tls.caFile", "holds no PEM certificate"),
        ({**SSL_OK, "kafka.tls.certFile": "{pw}"}, "kafka.tls.certFile", "holds no PEM certificate"),
        ({**SSL_OK, "kafka.tls.keyFile": "{other_key}"}, "kafka.tls.keyFile", "not the key of kafka.tls.certFile"),
        ({**SSL_OK, "kafka.tls.keyFile": "{pw}"}, "kafka.tls.keyFile", "holds no PEM private key"),
        ({**SSL_OK, "kafka.tls.keyFile": "{enc_key}"}, "kafka.tls.keyFile", "encrypted: set kafka.tls.keyPasswordFile"),
        (
            {**SSL_OK, "kafka.tls.keyFile": "{enc_key}", "kafka.tls.keyPasswordFile": "{wrong_pass}"},
            "kafka.tls.keyPasswordFile",
            "does not decrypt",
        ),
    ],
)
def test_bad_security_settings_exit_2_naming_the_key_and_never_the_secret(
    tmp_path: Path,
    pem: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    settings: dict[str, Any],
    key: str,
    reason: str,
) -> None:
    files = {"pw": tmp_path / "pw", "missing": tmp_path / "missing", "dir": tmp_path, "binary": tmp_path / "bin"}
    files |= pem
    files["empty"] = tmp_path / "empty"
    files["pw"].write_text(USERS["bob"] + "\n")
    files["binary"].write_bytes(USERS["bob"].encode() + b"\xff\xfe\n")
    files["empty"].write_text("\n")
    settings = {k: (v.format(**files) if isinstance(v, str) else v) for k, v in settings.items()}
    with pytest.raises(ConfigError) as info:
        config("t", **settings)
    assert info.value.key == key and reason in str(info.value), str(info.value)
    assert_no_secret(str(info.value))
    flags = [f"--set={k}={'' if v is None else v}" for k, v in settings.items()]
    assert main(["config", "--print", *flags]) == 2
    err = capsys.readouterr().err
    assert key in err
    assert_no_secret(err)


def test_config_print_masks_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, USERS["alice"])
    flags = [f"--set={k}={v}" for k, v in SASL_OK.items()]
    assert main(["config", "--print", *flags]) == 0
    out = capsys.readouterr().out
    assert '"kafka.sasl.password": "***"' in out
    monkeypatch.delenv(PASSWORD_ENV)
    pw = tmp_path / "pw"
    pw.write_text(USERS["bob"])
    assert main(["config", "--print", *flags, f"--set=kafka.sasl.passwordFile={pw}"]) == 0
    out += capsys.readouterr().out
    assert str(pw) in out  # the path is shown, its content is not
    assert_no_secret(out)


# ------------------------------------------------------------------ the real exporter process


def spawn_exporter(lab: Lab, topic: str, log: Path, env: dict[str, str], settings: dict[str, Any]) -> subprocess.Popen:
    """``flow-exporter run`` with debug logging, stdout and stderr into ``log``."""
    cmd = [sys.executable, "-m", "flow_exporter", "run", "--netns", lab.node_ns, "--topic", topic]
    cmd += ["--log-level", "debug"]
    for k, v in {
        "conntrack.pollInterval": "1s",
        "expiry.activeTimeout": "1s",
        "shutdown.grace": "10s",
        "metrics.port": 0,
        "retry.maxBackoff": "2s",
        # librdkafka's own debug output too, its configuration dump included
        "kafka.producer": "{debug: 'security,broker,conf'}",
        **settings,
    }.items():
        cmd += ["--set", f"{k}={v}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_EXPORTER_") or k == "FLOW_EXPORTER_CACHE"}
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**base, "PYTHONUNBUFFERED": "1", **env})


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def count_messages(bootstrap: str, topic: str, timeout: float = 15.0) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    n, deadline = 0, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if n:
                    break
                continue
            if msg.error() is None:
                n += 1
    finally:
        consumer.close()
    return n


@pytest.mark.lab
def test_exporter_process_never_logs_a_secret(broker: KafkaBroker, tmp_path: Path) -> None:
    """Debug logging, credentials from the environment and from a file, and a refused login."""
    env_topic, file_topic = f"sec-env-{uuid.uuid4().hex[:8]}", f"sec-file-{uuid.uuid4().hex[:8]}"
    broker.create_topic(env_topic)
    broker.create_topic(file_topic)
    pw_file = tmp_path / "bob.password"
    pw_file.write_text(USERS["bob"] + "\n")
    logs = {name: tmp_path / f"{name}.log" for name in ("env", "file", "wrong")}
    with Lab(pods=2) as lab:
        procs = {
            "env": spawn_exporter(
                lab, env_topic, logs["env"], {PASSWORD_ENV: USERS["alice"]}, sasl(broker, "SCRAM-SHA-512")
            ),
            "file": spawn_exporter(
                lab,
                file_topic,
                logs["file"],
                {},
                sasl(broker, "SCRAM-SHA-256", "bob", tls=True, **{"kafka.sasl.passwordFile": pw_file}),
            ),
            # No topic check (it would wait out its 10 s timeout): straight to producing, which is refused.
            "wrong": spawn_exporter(
                lab,
                env_topic,
                logs["wrong"],
                {PASSWORD_ENV: WRONG},
                sasl(broker, "PLAIN", **{"kafka.checkTopics": "false", "shutdown.grace": "1s"}),
            ),
        }
        try:
            for name in ("env", "file"):
                wait_for(logs[name], "first poll", procs[name])
            wait_for(logs["wrong"], "authentication failed", procs["wrong"])
            p1, p2 = lab.pods
            lab.tcp_exchange(p1, p2, 9000, 2000, 3000)
            lab.udp_exchange(p2, p1, 5300, 100, 200)
            time.sleep(2.5)  # a poll and an active timeout: records go out while running, not only at exit
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
    out = {name: path.read_text() for name, path in logs.items()}
    assert codes == {"env": 0, "file": 0, "wrong": 0}, out
    assert "(SASL_PLAINTEXT)" in out["env"] and "(SASL_SSL)" in out["file"]
    for name in ("env", "file"):
        assert "final records delivered" in out[name], out[name]
    for text in out.values():
        assert "DEBUG" in text and "sasl.password" in text  # librdkafka's dump names the setting, masked
    assert out["wrong"].count("authentication failed") == 1, out["wrong"]
    assert count_messages(broker.bootstrap, env_topic) > 0
    assert count_messages(broker.bootstrap, file_topic) > 0
    for text in out.values():
        assert_no_secret(text)
