"""A real single-node Apache Kafka broker (KRaft, combined broker+controller) for tests and the demo.

Tests should run against a real broker (restarts, crashes, SASL/SCRAM) rather than a mock, and a
newcomer should not need a Kafka distribution tarball. So the broker is assembled from the Apache
Kafka jars on Maven Central (``tools/kafka/pom.xml``), resolved once into a cache with ``mvn``, and run
as a plain ``java`` process on free loopback ports, with its data and logs in one work directory.

Only the standard library is used, plus confluent-kafka's AdminClient to tell when the broker
really answers (and to create topics). With ``tls=True`` the certificates are made with the
``openssl`` command and the broker's truststore with the JDK's ``keytool``.

Command line: ``python -m devtools.kafka fetch`` (resolve the jars, print count and time)
and ``python -m devtools.kafka serve`` (run a broker until Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from devtools.maven import ANSI, MVN_TIMEOUT, mvn_failure
from devtools.net import free_ports

__all__ = [
    "KAFKA_VERSION",
    "KafkaBroker",
    "KafkaBrokerError",
    "cache_dir",
    "cluster_id",
    "ensure_jars",
    "make_ca",
    "sigterm_as_interrupt",
]

KAFKA_VERSION = "4.4.0"

# This module lives at <root>/devtools/kafka.py.
_REPO_ROOT = Path(__file__).resolve().parents[1]
_POM = _REPO_ROOT / "tools" / "kafka" / "pom.xml"
_MARKER = ".complete"
# Full plugin coordinates (same version as pinned in the pom): a "dependency:" prefix lookup needs
# plugin-group metadata first, and when that download fails Maven only says "No plugin found".
_COPY_DEPENDENCIES = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"
_USER_RE = re.compile(r"[A-Za-z0-9._-]+")

# Heap kept modest: tests start several brokers, and a demo broker holds little data.
# Measured on a 2-CPU machine: SerialGC starts faster than G1, and stopping the JIT at C1
# (TieredStopAtLevel=1) cuts start-up CPU from ~5.6 s to ~3.5 s (wall ~6.9 s -> ~4.0 s) with no
# loss in short ProducerPerformance runs (C2 compiles compete with the broker for the CPUs).
# AppCDS made no measurable difference, so it is not used.
DEFAULT_JVM_OPTIONS: tuple[str, ...] = (
    "-Xmx512m",
    "-Xms256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)

_LOG = logging.getLogger(__name__)

# librdkafka's "connection refused" chatter while the broker boots is expected; keep it out of the
# test output (the broker log is quoted in the error if start-up really fails).
_QUIET = logging.getLogger(__name__ + ".rdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False

# Run as ``python -c`` in the child: asks the kernel to SIGKILL the broker when the Python thread
# that started it dies (PR_SET_DEATHSIG survives execve), then becomes java. Doing this in a tiny
# exec shim rather than subprocess's preexec_fn avoids running Python between fork and exec while
# librdkafka threads exist in the parent, which can deadlock.
_EXEC_SHIM = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if parent:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


class KafkaBrokerError(RuntimeError):
    """The broker could not be formatted, started or used; the message quotes its log."""


# --------------------------------------------------------------------------- jars


def cache_dir() -> Path:
    """Where the jars for this Kafka version are kept: ``<repo>/.cache/kafka/<version>``.

    ``FLOW_EXPORTER_CACHE`` replaces ``<repo>/.cache`` so CI or several work trees can share it.
    """
    base = os.environ.get("FLOW_EXPORTER_CACHE")
    root = Path(base) if base else _REPO_ROOT / ".cache"
    return root / "kafka" / KAFKA_VERSION


def _pom_digest() -> str:
    """Identify what was resolved, so editing the pom re-resolves instead of using stale jars."""
    return hashlib.sha256(_POM.read_bytes() + KAFKA_VERSION.encode()).hexdigest()


def _lib_is_complete(lib: Path, digest: str) -> bool:
    marker = lib / _MARKER
    return marker.is_file() and marker.read_text().strip() == digest


def ensure_jars() -> Path:
    """Resolve the broker jars into ``cache_dir()/lib`` once and return that directory.

    A marker (written last, holding a digest of the pom) says a previous run completed, so a run
    interrupted half-way is redone rather than trusted. A file lock lets parallel test processes
    share one download.
    """
    lib = cache_dir() / "lib"
    digest = _pom_digest()
    if _lib_is_complete(lib, digest):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaBrokerError(
            "mvn (Apache Maven) is not on PATH; it is needed once to fetch the Kafka broker jars "
            "(Debian package 'maven')"
        )
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _lib_is_complete(lib, digest):
            return lib
        staging = Path(tempfile.mkdtemp(prefix="lib.", dir=lib.parent))
        log = lib.parent / "mvn.log"
        cmd = [
            mvn,
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(_POM),
            f"-Dkafka.version={KAFKA_VERSION}",
            _COPY_DEPENDENCIES,
            f"-DoutputDirectory={staging}",
        ]
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=MVN_TIMEOUT,
                check=False,
                stdin=subprocess.DEVNULL,
            )
            # Maven 3.8 still emits colour resets in batch mode; drop them so the log reads cleanly.
            output = ANSI.sub("", proc.stdout + proc.stderr)
            log.write_text(output)
            if proc.returncode != 0:
                raise KafkaBrokerError(mvn_failure(output, log, f"the Kafka {KAFKA_VERSION} jars"))
            if not (staging / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
                raise KafkaBrokerError(f"mvn finished but kafka_2.13-{KAFKA_VERSION}.jar is missing; log: {log}")
            staging.chmod(0o755)  # mkdtemp made it private; the cache may be shared
            shutil.rmtree(lib, ignore_errors=True)
            staging.rename(lib)
            (lib / _MARKER).write_text(digest + "\n")
        except subprocess.TimeoutExpired as exc:
            raise KafkaBrokerError(
                f"mvn took over {MVN_TIMEOUT:.0f}s fetching the Kafka jars (is Maven Central reachable?)"
            ) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return lib


# --------------------------------------------------------------------------- helpers


def cluster_id() -> str:
    """A random Kafka Uuid in its text form (URL-safe base64, no padding), like ``random-uuid``.

    Kafka avoids ids starting with '-' because they read as options on a command line.
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _prop_escape(text: str) -> str:
    """Escape a value for a java.util.Properties file (backslashes and line breaks matter)."""
    out = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "\\" + out if out.startswith(" ") else out


def _jaas_quote(text: str) -> str:
    """Quote a JAAS option value; Kafka's JAAS parser honours backslash escapes inside quotes."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines)).rstrip()
    except OSError:
        return f"({path} not readable)"


# --------------------------------------------------------------------------- TLS material

# Test-only stores in the broker's work dir; the password just satisfies the PKCS12 format.
_STORE_PASSWORD = "flow-exporter-test"
_TLS_DAYS = "825"
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
[client_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""


def _tool_start(*cmd: str, cwd: Path) -> subprocess.Popen[str]:
    if shutil.which(cmd[0]) is None:
        raise KafkaBrokerError(f"{cmd[0]} is not on PATH; the TLS listeners need it to make test certificates")
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )


def _tool_wait(proc: subprocess.Popen[str]) -> None:
    """Wait for openssl/keytool; a failure quotes its output (these tools say little otherwise)."""
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if proc.returncode != 0:
        name = " ".join(map(str, proc.args[:2]))
        raise KafkaBrokerError(f"{name} failed (exit {proc.returncode}): {out.strip()[-2000:]}")


def _tool(*cmd: str, cwd: Path) -> None:
    _tool_wait(_tool_start(*cmd, cwd=cwd))


def make_ca(directory: Path, name: str = "ca", subject: str = "/CN=flow-exporter test CA") -> Path:
    """A self-signed CA (``<name>.pem`` and ``<name>.key``, EC P-256) in ``directory``; returns the PEM path."""
    directory.mkdir(parents=True, exist_ok=True)
    cnf = directory / "openssl.cnf"
    cnf.write_text(_OPENSSL_CNF)
    _tool(
        "openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", _TLS_DAYS, "-subj", subject,
        "-config", cnf.name, "-extensions", "ca_ext",
        cwd=directory,
    )  # fmt: skip
    return directory / f"{name}.pem"


def _signed_cert(directory: Path, name: str, subject: str, extensions: str, ca: str = "ca") -> None:
    """``<name>.key`` and ``<name>.pem``, signed by the CA ``<ca>.pem`` in the same directory."""
    _tool(
        "openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, "-config", "openssl.cnf",
        cwd=directory,
    )  # fmt: skip
    _tool(
        "openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", _TLS_DAYS, "-sha256",
        "-extfile", "openssl.cnf", "-extensions", extensions, "-out", f"{name}.pem",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.csr").unlink()


def _make_tls_material(directory: Path) -> None:
    """CA, broker certificate (SAN 127.0.0.1, localhost) in PKCS12 key- and truststores, client cert.

    Made once per work dir, so a restarted broker keeps the certificates clients already trust.
    """
    if (directory / ".complete").is_file():
        return
    for stale in ("broker.keystore.p12", "broker.truststore.p12"):
        (directory / stale).unlink(missing_ok=True)
    make_ca(directory)
    # keytool, not openssl: Java only trusts a PKCS12 certificate entry carrying its own trust
    # attribute. It is a JVM (~1 s), so it runs while openssl makes the other certificates.
    keytool = _tool_start(
        "keytool", "-J-XX:TieredStopAtLevel=1", "-J-XX:+UseSerialGC", "-importcert", "-noprompt", "-alias", "ca",
        "-file", "ca.pem", "-keystore", "broker.truststore.p12", "-storetype", "PKCS12",
        "-storepass", _STORE_PASSWORD,
        cwd=directory,
    )  # fmt: skip
    try:
        _signed_cert(directory, "broker", "/CN=localhost", "server_ext")
        _signed_cert(directory, "client", "/CN=flow-exporter-client", "client_ext")
        _tool(
            "openssl", "pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-certfile", "ca.pem",
            "-name", "broker", "-out", "broker.keystore.p12", "-passout", f"pass:{_STORE_PASSWORD}",
            cwd=directory,
        )  # fmt: skip
    finally:
        _tool_wait(keytool)
    (directory / ".complete").write_text("")


# --------------------------------------------------------------------------- broker


class KafkaBroker:
    """One Kafka broker+controller process (KRaft) on loopback, for tests and the demo.

    Ports are chosen when the object is made and kept for its life, so ``restart()`` brings the
    broker back at the same address with the same data, as a real restart would. With
    ``scram_users`` an extra SASL_PLAINTEXT listener accepts SCRAM-SHA-256, SCRAM-SHA-512 and
    PLAIN for those users; ``bootstrap`` (PLAINTEXT) stays open for setup and inspection.

    With ``tls=True`` the first ``start()`` makes a CA, a broker certificate for 127.0.0.1 and
    localhost and a client certificate (in ``tls_dir``), and the broker gets an SSL listener
    (``ssl_bootstrap``) that requires a client certificate (mutual TLS), plus, with
    ``scram_users``, a SASL_SSL listener (``sasl_ssl_bootstrap``, no client certificate needed).
    ``ca_path``, ``client_cert_path`` and ``client_key_path`` are PEM files for librdkafka.

    ``jvm_options`` may be changed before ``start()`` (e.g. a larger heap for benchmarks).

    One of a cluster (:mod:`devtools.kafka_cluster`): ``netns`` runs it in that network namespace,
    listening on ``host`` (ports 9092 for clients, 9093 for the controller there); ``node_id``,
    ``voters`` (the static quorum, ``id@host:port`` comma-separated) and ``cluster_id`` make it one
    voter of a multi-node KRaft quorum, with internal topics replicated three ways.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        scram_users: dict[str, str] | None = None,
        auto_create_topics: bool = True,
        extra_props: dict[str, str] | None = None,
        tls: bool = False,
        host: str = "127.0.0.1",
        netns: str | None = None,
        node_id: int = 1,
        voters: str | None = None,
        cluster_id: str | None = None,
    ) -> None:
        if (netns is None) != (voters is None) or (voters is None) != (cluster_id is None):
            raise ValueError("netns, voters and cluster_id go together (a cluster's broker) or not at all")
        if netns is not None and (scram_users or tls):
            raise ValueError("a cluster's broker has a PLAINTEXT listener only")
        self.host = host
        self.netns = netns
        self.node_id = node_id
        self.voters = voters
        self.cluster_id = cluster_id
        self.scram_users: dict[str, str] = dict(scram_users or {})
        for user, password in self.scram_users.items():
            # Names become JAAS option keys (user_<name>) for PLAIN; the storage tool's --add-scram
            # syntax cannot carry a comma in either.
            if not _USER_RE.fullmatch(user) or "," in password:
                raise ValueError(f"SASL user {user!r}: names must match {_USER_RE.pattern}, passwords hold no ','")
        self._own_workdir = workdir is None
        self.workdir: Path = Path(tempfile.mkdtemp(prefix="kafka-broker-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.auto_create_topics = auto_create_topics
        self.extra_props: dict[str, str] = dict(extra_props or {})
        self.jvm_options: list[str] = list(DEFAULT_JVM_OPTIONS)
        self.tls = tls
        # In a namespace of its own the ports are the broker's alone; on loopback, free ones.
        ports = (
            [9092, 9093]
            if netns
            else free_ports(2 + int(bool(scram_users)) + int(tls) + int(tls and bool(scram_users)))
        )
        self.port, self.controller_port = ports.pop(0), ports.pop(0)
        self.sasl_port: int | None = ports.pop(0) if scram_users else None
        self.ssl_port: int | None = ports.pop(0) if tls else None
        self.sasl_ssl_port: int | None = ports.pop(0) if tls and scram_users else None
        self.bootstrap = f"{host}:{self.port}"
        self.sasl_bootstrap: str | None = f"127.0.0.1:{self.sasl_port}" if self.sasl_port else None
        self.ssl_bootstrap: str | None = f"127.0.0.1:{self.ssl_port}" if self.ssl_port else None
        self.sasl_ssl_bootstrap: str | None = f"127.0.0.1:{self.sasl_ssl_port}" if self.sasl_ssl_port else None
        self.tls_dir: Path | None = self.workdir / "tls" if tls else None
        self.ca_path: Path | None = self.tls_dir / "ca.pem" if self.tls_dir else None
        self.client_cert_path: Path | None = self.tls_dir / "client.pem" if self.tls_dir else None
        self.client_key_path: Path | None = self.tls_dir / "client.key" if self.tls_dir else None
        self.log_path: Path = self.workdir / "broker.log"
        self.stdout_path: Path = self.workdir / "broker.out"
        self.data_dir: Path = self.workdir / "data"
        self.props_path: Path = self.workdir / "server.properties"
        self.log4j_path: Path = self.workdir / "log4j2.properties"
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    # ----------------------------------------------------------------- public

    @property
    def pid(self) -> int | None:
        """The java process id while it runs, else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the broker process is alive (not whether it answers yet)."""
        return self._proc is not None and self._proc.poll() is None

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """A confluent-kafka config for the PLAINTEXT listener, with overrides merged in."""
        return {"bootstrap.servers": self.bootstrap, **overrides}

    def sasl_client_config(
        self,
        user: str,
        mechanism: str = "SCRAM-SHA-256",
        password: str | None = None,
        *,
        tls: bool = False,
        **overrides: Any,
    ) -> dict[str, Any]:
        """A confluent-kafka config for the SASL_PLAINTEXT listener (SASL_SSL with ``tls``) as
        ``user`` (its own password unless ``password`` is given, e.g. a wrong one)."""
        if self.sasl_bootstrap is None:
            raise KafkaBrokerError("this broker has no SASL listener (no scram_users given)")
        conf: dict[str, Any] = {"bootstrap.servers": self.sasl_bootstrap, "security.protocol": "SASL_PLAINTEXT"}
        if tls:
            if self.sasl_ssl_bootstrap is None or self.ca_path is None:
                raise KafkaBrokerError("this broker has no SASL_SSL listener (needs tls=True and scram_users)")
            conf = {
                "bootstrap.servers": self.sasl_ssl_bootstrap,
                "security.protocol": "SASL_SSL",
                "ssl.ca.location": str(self.ca_path),
            }
        return {
            **conf,
            "sasl.mechanism": mechanism,
            "sasl.username": user,
            "sasl.password": self.scram_users[user] if password is None else password,
            **overrides,
        }

    def ssl_client_config(self, **overrides: Any) -> dict[str, Any]:
        """A confluent-kafka config for the mutual-TLS SSL listener, with the harness's client certificate."""
        if self.ssl_bootstrap is None or self.ca_path is None:
            raise KafkaBrokerError("this broker has no SSL listener (tls=True not given)")
        return {
            "bootstrap.servers": self.ssl_bootstrap,
            "security.protocol": "SSL",
            "ssl.ca.location": str(self.ca_path),
            "ssl.certificate.location": str(self.client_cert_path),
            "ssl.key.location": str(self.client_key_path),
            **overrides,
        }

    def start(self, timeout: float = 90.0, *, wait: bool = True) -> None:
        """Start the broker (formatting storage the first time) and wait until it answers metadata.

        Raises KafkaBrokerError quoting the last 30 lines of ``broker.log`` if the process exits or
        ``timeout`` seconds pass first. ``wait`` False: return once it runs (a cluster's voters answer
        only once a quorum of them runs: :meth:`wait_ready` then).
        """
        if self._closed:
            raise KafkaBrokerError("this KafkaBroker was closed; make a new one")
        if self.running:
            raise KafkaBrokerError(f"broker already running (pid {self.pid})")
        deadline = time.monotonic() + timeout
        lib = ensure_jars()
        java = shutil.which("java")
        if java is None:
            raise KafkaBrokerError("java is not on PATH; the Kafka broker needs Java 17 or newer")
        if self.tls_dir is not None:
            _make_tls_material(self.tls_dir)
        self._write_config()
        if not (self.data_dir / "meta.properties").is_file():
            self._format(java, lib)
        self._launch(java, lib)
        if wait:
            self.wait_ready(deadline - time.monotonic())

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Wait until the started broker answers metadata (killing it if it does not in ``timeout`` s)."""
        try:
            self._wait_ready(time.monotonic() + timeout, timeout)
        except BaseException:
            self.kill()
            raise

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the broker's process (SIGSTOP and SIGCONT for a paused broker)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise KafkaBrokerError(f"broker {self.node_id} is not running")
        proc.send_signal(signum)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the broker down cleanly (SIGTERM), falling back to SIGKILL after ``timeout`` s."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _LOG.warning("Kafka broker pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
        self._forget()

    def kill(self) -> None:
        """Kill the broker at once (SIGKILL), like a crash; the data dir keeps what reached it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._forget()

    def restart(self, timeout: float = 90.0) -> None:
        """Stop cleanly and start again on the same ports and data directory."""
        self.stop()
        self.start(timeout)

    def close(self) -> None:
        """Stop the broker and delete the work directory if this object created it."""
        self.stop()
        self._closed = True
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def create_topic(self, name: str, partitions: int = 1, timeout: float = 30.0) -> None:
        """Create a topic and wait until every partition has a leader, so producing works at once.

        An existing topic is an error (its partition count might not be what the caller wants).
        """
        from confluent_kafka.admin import AdminClient, NewTopic

        deadline = time.monotonic() + timeout
        admin = AdminClient(self.client_config(logger=_QUIET))
        futures = admin.create_topics([NewTopic(name, partitions, 1)], request_timeout=timeout)
        futures[name].result(timeout=timeout)
        while True:
            meta = admin.list_topics(topic=name, timeout=max(0.5, deadline - time.monotonic()))
            topic = meta.topics.get(name)
            if (
                topic is not None
                and topic.error is None
                and len(topic.partitions) == partitions
                and all(p.leader >= 0 and p.error is None for p in topic.partitions.values())
            ):
                return
            if time.monotonic() >= deadline:
                raise KafkaBrokerError(f"topic {name!r} has no leader for every partition after {timeout}s")
            time.sleep(0.05)

    def __enter__(self) -> KafkaBroker:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<KafkaBroker {self.bootstrap} {state} {self.workdir}>"

    # ----------------------------------------------------------------- internals

    def properties(self) -> dict[str, str]:
        """The broker's server.properties, as written at each start (``extra_props`` win)."""
        h = self.host
        listeners = [f"PLAINTEXT://{h}:{self.port}", f"CONTROLLER://{h}:{self.controller_port}"]
        advertised = [f"PLAINTEXT://{h}:{self.port}"]
        for name, port in (
            ("SASL_PLAINTEXT", self.sasl_port),
            ("SSL", self.ssl_port),
            ("SASL_SSL", self.sasl_ssl_port),
        ):
            if port is not None:
                listeners.append(f"{name}://127.0.0.1:{port}")
                advertised.append(f"{name}://127.0.0.1:{port}")
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.bootstrap.servers": f"{h}:{self.controller_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": (
                "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL"
            ),
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            # One partition instead of 50: the first consumer group on a fresh broker then waits
            # for one partition's leader, not fifty.
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # After a crash (kill()), the controller keeps the dead broker's registration until its
            # session times out (9 s by default) and refuses the restarted one until then.
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
            "auto.create.topics.enable": "true" if self.auto_create_topics else "false",
        }
        if self.scram_users:
            props["sasl.enabled.mechanisms"] = "SCRAM-SHA-256,SCRAM-SHA-512,PLAIN"
            scram_login = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            # PLAIN checks passwords against user_<name> options of its JAAS entry.
            plain_users = " ".join(f"user_{u}={_jaas_quote(p)}" for u, p in self.scram_users.items())
            plain_login = f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};"
            for listener in ("sasl_plaintext", "sasl_ssl") if self.tls else ("sasl_plaintext",):
                props[f"listener.name.{listener}.scram-sha-256.sasl.jaas.config"] = scram_login
                props[f"listener.name.{listener}.scram-sha-512.sasl.jaas.config"] = scram_login
                props[f"listener.name.{listener}.plain.sasl.jaas.config"] = plain_login
        if self.tls_dir is not None:
            props.update(
                {
                    "ssl.keystore.type": "PKCS12",
                    "ssl.keystore.location": str(self.tls_dir / "broker.keystore.p12"),
                    "ssl.keystore.password": _STORE_PASSWORD,
                    "ssl.key.password": _STORE_PASSWORD,
                    "ssl.truststore.type": "PKCS12",
                    "ssl.truststore.location": str(self.tls_dir / "broker.truststore.p12"),
                    "ssl.truststore.password": _STORE_PASSWORD,
                    "listener.name.ssl.ssl.client.auth": "required",
                    "listener.name.sasl_ssl.ssl.client.auth": "none",
                }
            )
        if self.voters is not None:  # one voter of a static three-node quorum; internal topics replicated
            del props["controller.quorum.bootstrap.servers"]
            props["controller.quorum.voters"] = self.voters
            for key in (
                "default.replication.factor", "offsets.topic.replication.factor",
                "transaction.state.log.replication.factor", "share.coordinator.state.topic.replication.factor",
            ):  # fmt: skip
                props[key] = "3"
            for key in (
                "min.insync.replicas",
                "transaction.state.log.min.isr",
                "share.coordinator.state.topic.min.isr",
            ):
                props[key] = "2"
        props.update(self.extra_props)
        return props

    def _write_config(self) -> None:
        body = "".join(f"{k}={_prop_escape(v)}\n" for k, v in self.properties().items())
        self.props_path.write_text("# Written by devtools.kafka at each start.\n" + body)
        log_file = str(self.log_path).replace("\\", "\\\\")
        self.log4j_path.write_text(
            "status = warn\n"
            "name = flow-exporter-test-broker\n"
            "appender.file.type = File\n"
            "appender.file.name = FILE\n"
            f"appender.file.fileName = {log_file}\n"
            "appender.file.append = true\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\n"
            "rootLogger.appenderRef.file.ref = FILE\n"
        )

    def _java_cmd(self, java: str, lib: Path, main: str, *args: str) -> list[str]:
        return [
            java,
            *self.jvm_options,
            f"-Dlog4j2.configurationFile={self.log4j_path}",
            "-cp",
            f"{lib}/*",
            main,
            *args,
        ]

    def _format(self, java: str, lib: Path) -> None:
        """Format the data dir as a one-voter dynamic quorum, adding the SCRAM users."""
        if self.cluster_id is not None:  # a static quorum's voter: the cluster's id, the voters from the config
            args = ["format", "-t", self.cluster_id, "-c", str(self.props_path)]
        else:
            args = ["format", "--standalone", "-t", cluster_id(), "-c", str(self.props_path)]
        for user, password in self.scram_users.items():
            for mech in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                # The storage tool splits on "," and strips one pair of surrounding quotes, with
                # no escapes: quoting keeps a password that itself starts and ends with '"' intact.
                args += ["--add-scram", f'{mech}=[name={user},password="{password}"]']
        cmd = self._java_cmd(java, lib, "kafka.tools.StorageTool", *args)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip()
            raise KafkaBrokerError(f"formatting {self.data_dir} failed (exit {proc.returncode}): {out[-2000:]}")

    def _launch(self, java: str, lib: Path) -> None:
        # Only tie the broker's life to the starting thread when that thread is the main one:
        # PR_SET_DEATHSIG fires when the *thread* exits, which would kill a broker started from a
        # short-lived worker thread.
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else 0
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []  # ip execs java: one pid throughout
        cmd = [sys.executable, "-c", _EXEC_SHIM, str(parent), *inside, *self._java_cmd(java, lib, "kafka.Kafka")]
        cmd.append(str(self.props_path))
        with open(self.stdout_path, "ab") as out:
            # A new session: Ctrl-C in a terminal reaches Python, which then stops the broker
            # cleanly, instead of killing the JVM mid-write.
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self._atexit_stop)

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(
            self.client_config(
                logger=_QUIET,
                # librdkafka's reconnect backoff grows to 10 s by default; keep probing briskly.
                **{"reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 250},
            )
        )
        assert self._proc is not None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._forget()
                raise KafkaBrokerError(f"Kafka broker exited with code {rc} during start-up{self._log_excerpt()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KafkaBrokerError(f"Kafka broker not ready after {timeout:.0f}s{self._log_excerpt()}")
            try:
                admin.list_topics(timeout=min(2.0, remaining))
                return
            except KafkaException:
                time.sleep(0.05)

    def _log_excerpt(self) -> str:
        text = f"\n--- last 30 lines of {self.log_path} ---\n{_tail(self.log_path)}"
        if self.stdout_path.is_file() and self.stdout_path.stat().st_size:
            text += f"\n--- last 30 lines of {self.stdout_path} ---\n{_tail(self.stdout_path)}"
        return text

    def _forget(self) -> None:
        self._proc = None
        atexit.unregister(self._atexit_stop)

    def _atexit_stop(self) -> None:
        """At interpreter exit: never leave a JVM behind, nor a temp dir only this object knew of."""
        with contextlib.suppress(Exception):
            if self._own_workdir:
                self.close()
            else:
                self.stop(timeout=10)


# --------------------------------------------------------------------------- command line


def _parse_users(pairs: list[str]) -> dict[str, str]:
    users = {}
    for pair in pairs:
        name, sep, password = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--user wants NAME=PASSWORD, got {pair!r}")
        users[name] = password
    return users


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C so ``serve`` stops its broker cleanly either way."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """``fetch`` resolves the jars; ``serve`` runs a broker until Ctrl-C."""
    ap = argparse.ArgumentParser(prog="python -m devtools.kafka", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="resolve the Kafka jars into the cache (once)")
    serve = sub.add_parser("serve", help="run a single-node broker until Ctrl-C")
    serve.add_argument("--workdir", type=Path, help="keep data and logs here (default: a temp dir)")
    serve.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NAME=PASSWORD",
        help="add a SASL_PLAINTEXT listener with this SCRAM/PLAIN user (repeatable)",
    )
    serve.add_argument("--no-auto-create", action="store_true", help="disable auto.create.topics.enable")
    serve.add_argument("--tls", action="store_true", help="add SSL (mutual TLS) and, with --user, SASL_SSL listeners")
    serve.add_argument("--topic", action="append", default=[], help="create this topic at start (repeatable)")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "fetch":
            already = _lib_is_complete(cache_dir() / "lib", _pom_digest())
            t0 = time.monotonic()
            lib = ensure_jars()
            jars = len(list(lib.glob("*.jar")))
            how = "already cached" if already else "fetched"
            print(f"{jars} jars for Kafka {KAFKA_VERSION} in {lib} ({how}, {time.monotonic() - t0:.1f}s)")
            return 0

        broker = KafkaBroker(
            args.workdir,
            scram_users=_parse_users(args.user) or None,
            auto_create_topics=not args.no_auto_create,
            tls=args.tls,
        )
        with sigterm_as_interrupt():
            try:
                t0 = time.monotonic()
                with broker:
                    for topic in args.topic:
                        broker.create_topic(topic)
                    print(f"Kafka {KAFKA_VERSION} up in {time.monotonic() - t0:.1f}s (pid {broker.pid})")
                    print(f"bootstrap:      {broker.bootstrap}")
                    if broker.sasl_bootstrap:
                        print(f"sasl bootstrap: {broker.sasl_bootstrap} (SCRAM-SHA-256/512, PLAIN)")
                    if broker.ssl_bootstrap:
                        print(f"ssl bootstrap:  {broker.ssl_bootstrap} (client certificate required)")
                        print(f"CA, client:     {broker.ca_path}, {broker.client_cert_path}, {broker.client_key_path}")
                    if broker.sasl_ssl_bootstrap:
                        print(f"sasl_ssl:       {broker.sasl_ssl_bootstrap}")
                    print(f"log:            {broker.log_path}")
                    print("Ctrl-C to stop", flush=True)
                    while broker.running:
                        time.sleep(0.5)
                    print(f"broker exited on its own; see {broker.log_path}", file=sys.stderr)
                    return 1
            except KeyboardInterrupt:
                print("stopped")
                return 0
    except KafkaBrokerError as exc:
        print(f"kafka: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
