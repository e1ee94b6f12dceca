"""Configuration: one YAML file, then ``FLOW_EXPORTER_*`` environment variables, then CLI flags.

Every setting is declared once in :data:`SETTINGS` (key, type, default, meaning),
which drives parsing, validation, the environment variable names and
``flow-exporter config --print-defaults``. Any bad value raises
:class:`ConfigError` naming the key and the value; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "FLOW_EXPORTER_"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and the value."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        shown = "***" if _is_secret(key) and value is not None else repr(value)
        super().__init__(f"config {key}={shown}: {reason}")
        self.key = key


# ------------------------------------------------------------------ value types
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(key: str, value: object) -> float:
    """``5s``, ``1m``, ``250ms``, ``1.5h`` or a bare number of seconds; never negative."""
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected a duration like 5s, 1m or 250ms")
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(key, value, "must not be negative")
        return float(value)
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ConfigError(key, value, "must not be negative")
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2)]
    raise ConfigError(key, value, "expected a duration like 5s, 1m or 250ms")


def positive_duration(key: str, value: object) -> float:
    d = parse_duration(key, value)
    if d <= 0:
        raise ConfigError(key, value, "must be greater than zero")
    return d


def parse_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.strip().lower() in ("true", "yes", "on", "1")
    raise ConfigError(key, value, "expected true or false")


def parse_str(key: str, value: object) -> str:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(key, value, "expected a string")


def parse_opt_str(key: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    return parse_str(key, value)


def parse_topic(key: str, value: object) -> str:
    s = parse_str(key, value)
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", s):
        raise ConfigError(key, value, "a Kafka topic name: 1-249 of letters, digits, '.', '_', '-'")
    return s


def parse_zones(key: str, value: object) -> tuple[int, ...]:
    """A list of zone numbers (0-65535); empty means every zone."""
    if value is None or value == "" or value == "all":
        return ()
    items: list[object]
    if isinstance(value, str):
        items = [v for v in re.split(r"[,\s]+", value) if v]
    elif isinstance(value, list):
        items = value
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    else:
        raise ConfigError(key, value, "expected a list of zone numbers")
    zones = []
    for item in items:
        try:
            z = int(str(item), 0)
        except ValueError:
            raise ConfigError(key, value, f"zone {item!r} is not a number") from None
        if not 0 <= z <= 0xFFFF:
            raise ConfigError(key, value, f"zone {z} is outside 0-65535")
        zones.append(z)
    return tuple(sorted(set(zones)))


def parse_count(key: str, value: object, minimum: int = 0) -> int:
    """A whole number >= ``minimum`` (``100000`` or ``100_000``)."""
    try:
        n = int(str(value).replace("_", ""), 10)
    except ValueError:
        raise ConfigError(key, value, "expected a whole number") from None
    if isinstance(value, bool) or n < minimum:
        raise ConfigError(key, value, f"expected a whole number >= {minimum}")
    return n


def parse_port(key: str, value: object) -> int:
    """A TCP port; 0 turns the listener off."""
    try:
        port = int(str(value), 10)
    except ValueError:
        raise ConfigError(key, value, "expected a port number 0-65535") from None
    if isinstance(value, bool) or not 0 <= port <= 65535:
        raise ConfigError(key, value, "expected a port number 0-65535")
    return port


def parse_level(key: str, value: object) -> str:
    s = parse_str(key, value).lower()
    if s not in ("debug", "info", "warning", "error"):
        raise ConfigError(key, value, "one of debug, info, warning, error")
    return s


def parse_log_format(key: str, value: object) -> str:
    s = parse_str(key, value).lower()
    if s not in ("text", "json"):
        raise ConfigError(key, value, "one of text, json")
    return s


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def parse_security_protocol(key: str, value: object) -> str:
    s = parse_str(key, value).strip().upper()
    if s not in SECURITY_PROTOCOLS:
        raise ConfigError(key, value, "one of " + ", ".join(SECURITY_PROTOCOLS))
    return s


def parse_sasl_mechanism(key: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    s = parse_str(key, value).strip().upper()
    if s not in SASL_MECHANISMS:
        raise ConfigError(key, value, "one of " + ", ".join(SASL_MECHANISMS))
    return s


def parse_map(key: str, value: object) -> dict[str, Any]:
    """A mapping; from the environment or a flag, ``k=v,k=v``."""
    if value is None:
        return {}
    if isinstance(value, str):
        out: dict[str, Any] = {}
        for part in (p for p in value.split(",") if p.strip()):
            k, sep, v = part.partition("=")
            if not sep or not k.strip():
                raise ConfigError(key, value, "expected k=v pairs separated by commas")
            out[k.strip()] = v.strip()
        return out
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, list | dict):
                raise ConfigError(f"{key}.{k}", v, "expected a scalar value")
        return {str(k): v for k, v in value.items()}
    raise ConfigError(key, value, "expected a mapping")


def parse_routes(key: str, value: object) -> tuple[dict[str, Any], ...]:
    """``[{topic: T, flowType: N}, {topic: T, endReason: N}]``: first match wins."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, value, "expected a list of {topic, flowType | endReason}")
    routes = []
    for i, r in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(r, Mapping):
            raise ConfigError(where, r, "expected a mapping with topic and flowType or endReason")
        unknown = set(r) - {"topic", "flowType", "endReason"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", r[sorted(unknown)[0]], "unknown key")
        if "topic" not in r:
            raise ConfigError(f"{where}.topic", None, "missing")
        route: dict[str, Any] = {"topic": parse_topic(f"{where}.topic", r["topic"])}
        for name, hi in (("flowType", 4), ("endReason", 5)):
            if name in r:
                v = r[name]
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
                    raise ConfigError(f"{where}.{name}", v, f"expected an integer 0-{hi}")
                route[name] = v
        if len(route) == 1:
            raise ConfigError(where, r, "needs flowType or endReason")
        routes.append(route)
    return tuple(routes)


MAX_POD_LABEL_KEYS = 16  # labels are copied into every record: keep the set small
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def parse_label_keys(key: str, value: object) -> tuple[str, ...]:
    """Pod label keys (``app``, ``app.kubernetes.io/name``): a list, or ``a,b`` from env/flags."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        items: list[object] = [v for v in re.split(r"[,\s]+", value) if v]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ConfigError(key, value, "expected a list of label keys")
    keys: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(key, value, f"label key {item!r} is not a string")
        prefix, _, name = item.rpartition("/")
        if not _LABEL_NAME.fullmatch(name) or (prefix and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix))):
            raise ConfigError(key, value, f"{item!r} is not a valid label key")
        if item not in keys:
            keys.append(item)
    if len(keys) > MAX_POD_LABEL_KEYS:
        raise ConfigError(key, value, f"at most {MAX_POD_LABEL_KEYS} label keys")
    return tuple(keys)


def parse_k8s_scope(key: str, value: object) -> str:
    s = parse_str(key, value).lower()
    if s not in ("cluster", "node"):
        raise ConfigError(key, value, "one of cluster (every pod), node (this node's pods)")
    return s


# Schema Registry (flow_exporter.sink.registry); kept here so loading a config imports no registry client.
REGISTRY_COMPATIBILITY = (
    "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE", "NONE"
)


def parse_registry_url(key: str, value: object) -> str | None:
    """``http(s)://host:port[,...]``; ``mock://name`` is confluent-kafka's in-memory registry (tests)."""
    s = parse_opt_str(key, value)
    if s is not None and not all(re.match(r"(https?|mock)://[^\s/]", u.strip()) for u in s.split(",")):
        raise ConfigError(key, value, "expected http://host:port or https://host:port (comma-separated)")
    return s


def parse_compatibility(key: str, value: object) -> str | None:
    """A subject compatibility level, or empty/none to leave the registry's level alone."""
    s = parse_opt_str(key, value)
    if s is None:
        return None
    if s.strip().upper() not in REGISTRY_COMPATIBILITY:
        raise ConfigError(key, value, "one of " + ", ".join(REGISTRY_COMPATIBILITY) + " or empty")
    return s.strip().upper()


def parse_subject(key: str, value: object) -> str:
    s = parse_str(key, value).strip()
    if not s:
        raise ConfigError(key, value, "must not be empty")
    return s


def parse_user_info(key: str, value: object) -> str | None:
    s = parse_opt_str(key, value)
    if s is not None and ":" not in s:
        raise ConfigError(key, value, "expected user:password")
    return s


# --------------------------------------------------------------------- settings
@dataclass(frozen=True, slots=True)
class Setting:
    key: str
    parse: Callable[[str, object], Any]
    default: Any
    doc: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", self.key).replace(".", "_").upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("nodeName", parse_str, "", "This node's name in records; empty: $NODE_NAME, else the host name."),
    Setting("conntrack.netns", parse_opt_str, None, "Read conntrack of this named network namespace."),
    Setting("conntrack.zones", parse_zones, (), "Conntrack zones to export; empty means all zones."),
    Setting("conntrack.pollInterval", positive_duration, 5.0, "How often the conntrack table is dumped."),
    Setting("conntrack.events", parse_bool, True, "Also listen to NEW/DESTROY events (short-lived flows)."),
    Setting("conntrack.setSysctls", parse_bool, True, "Turn on nf_conntrack_acct and _timestamp at start."),
    Setting("expiry.activeTimeout", positive_duration, 5.0, "A record every this long while a flow is active."),
    Setting("expiry.idleTimeout", positive_duration, 15.0, "A flow with no packets for this long is idle."),
    Setting("expiry.staleTimeout", positive_duration, 300.0, "Unused; kept so older configs load."),
    Setting("kafka.bootstrapServers", parse_str, "localhost:9092", "Kafka bootstrap servers, host:port[,...]."),
    Setting("kafka.topic", parse_topic, "flows", "Topic for flow records (unless a route matches)."),
    Setting("kafka.routes", parse_routes, (), "Other topics by flowType or endReason; first match wins."),
    Setting("schemaRegistry.url", parse_registry_url, None, "Schema Registry URL; set: Confluent-framed values."),
    Setting("schemaRegistry.subject", parse_subject, "io.flowexporter.FlowRecord", "Subject for the schema."),
    Setting("schemaRegistry.compatibility", parse_compatibility, "BACKWARD_TRANSITIVE", "Set at start; empty: keep."),
    Setting("schemaRegistry.basicAuthUserInfo", parse_user_info, None, "user:password for the registry (a secret)."),
    Setting("kafka.producer", parse_map, {}, "librdkafka producer settings passed through as they are."),
    Setting("kafka.securityProtocol", parse_security_protocol, "PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    Setting("kafka.sasl.mechanism", parse_sasl_mechanism, None, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (SASL_*)."),
    Setting("kafka.sasl.username", parse_opt_str, None, "SASL user name."),
    Setting("kafka.sasl.password", parse_opt_str, None, "SASL password; prefer the env variable or passwordFile."),
    Setting("kafka.sasl.passwordFile", parse_opt_str, None, "File holding the SASL password, read at start."),
    Setting("kafka.tls.caFile", parse_opt_str, None, "PEM CA bundle (or directory) for the brokers; empty: system's."),
    Setting("kafka.tls.certFile", parse_opt_str, None, "PEM client certificate for mutual TLS."),
    Setting("kafka.tls.keyFile", parse_opt_str, None, "PEM private key of that certificate."),
    Setting("kafka.tls.keyPasswordFile", parse_opt_str, None, "File holding the key's passphrase, if encrypted."),
    Setting("kafka.tls.verifyHostname", parse_bool, True, "Check the broker certificate matches its host name."),
    Setting("kafka.checkTopics", parse_bool, True, "Check at start that every topic exists."),
    Setting("k8s.enabled", parse_bool, False, "Enrich records with pod, node and Service names from the API server."),
    Setting("k8s.kubeconfig", parse_opt_str, None, "Kubeconfig file; empty: in-cluster account, else ~/.kube/config."),
    Setting("k8s.scope", parse_k8s_scope, "cluster", "Pods to cache: cluster (all) or node (only this node's)."),
    Setting("k8s.podLabels", parse_label_keys, ("app", "app.kubernetes.io/name"), "Pod label keys put in records."),
    Setting("k8s.deletedPodRetention", parse_duration, 300.0, "Deleted pods' IPs still resolve for older flows."),
    Setting("state.dir", parse_opt_str, None, "Checkpoint directory: restarts continue exactly."),
    Setting("limits.maxConnections", lambda k, v: parse_count(k, v, 1), 500_000, "Cap on tracked connections."),
    Setting("limits.maxInFlight", lambda k, v: parse_count(k, v, 1), 100_000, "Cap on records awaiting Kafka's ack."),
    Setting("retry.initialBackoff", positive_duration, 0.2, "First wait after a failed dump or produce."),
    Setting("retry.maxBackoff", positive_duration, 30.0, "Longest wait between retries."),
    Setting("shutdown.grace", parse_duration, 30.0, "On SIGTERM: how long to keep delivering final records."),
    Setting("metrics.address", parse_str, "0.0.0.0", "Address of the /metrics, /healthz, /readyz listener."),
    Setting("metrics.port", parse_port, 9690, "Port of that listener; 0 turns it off."),
    Setting("log.level", parse_level, "info", "debug, info, warning or error."),
    Setting("log.format", parse_log_format, "text", "text or json."),
)
BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Config:
    """Validated settings, by key (``config["kafka.topic"]``) and a few helpers.

    ``secrets`` holds passwords read from files at load time, by the key of the setting they
    stand for; they never appear in ``values``, ``repr()`` or :meth:`masked`.
    """

    values: Mapping[str, Any]
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __repr__(self) -> str:
        return f"Config({self.masked()!r})"

    @property
    def node_name(self) -> str:
        return self.values["nodeName"] or os.environ.get("NODE_NAME") or socket.gethostname()

    def masked(self) -> dict[str, Any]:
        """The values with every secret (also inside kafka.producer) shown as ``***``, for printing."""
        out = {k: ("***" if v is not None and _is_secret(k) else v) for k, v in self.values.items()}
        out["kafka.producer"] = {k: ("***" if _is_secret(k) else v) for k, v in self.values["kafka.producer"].items()}
        return out

    def producer_config(self) -> dict[str, Any]:
        """librdkafka settings; ``kafka.producer`` entries win over the ones derived here."""
        v = self.values
        conf: dict[str, Any] = {"bootstrap.servers": v["kafka.bootstrapServers"]}
        protocol = v["kafka.securityProtocol"]
        if protocol != "PLAINTEXT":
            conf["security.protocol"] = protocol
        if protocol.startswith("SASL_"):
            conf["sasl.mechanisms"] = v["kafka.sasl.mechanism"]
            conf["sasl.username"] = v["kafka.sasl.username"]
            conf["sasl.password"] = self.secrets.get("kafka.sasl.password", v["kafka.sasl.password"])
        if protocol in ("SSL", "SASL_SSL"):
            for key, name in _TLS_FILES.items():
                if v[key] is not None:
                    conf[name] = v[key]
            if "kafka.tls.keyPassword" in self.secrets:
                conf["ssl.key.password"] = self.secrets["kafka.tls.keyPassword"]
            conf["ssl.endpoint.identification.algorithm"] = "https" if v["kafka.tls.verifyHostname"] else "none"
        return {**conf, **v["kafka.producer"]}


_TLS_FILES = {
    "kafka.tls.caFile": "ssl.ca.location",
    "kafka.tls.certFile": "ssl.certificate.location",
    "kafka.tls.keyFile": "ssl.key.location",
}
_SASL_KEYS = ("kafka.sasl.mechanism", "kafka.sasl.username", "kafka.sasl.password", "kafka.sasl.passwordFile")


def _read_secret(key: str, path: str) -> str:
    """A password file's text without its trailing newline; errors name the key, never the content."""
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError(key, path, f"unreadable: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        text = data.decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(key, path, "unreadable: not UTF-8 text") from None
    if not text:
        raise ConfigError(key, path, "the file is empty")
    return text


def _check_readable(key: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except (OSError, ValueError) as exc:
        raise ConfigError(key, path, f"unreadable: {getattr(exc, 'strerror', None) or exc}") from None


def _kafka_security(values: Mapping[str, Any]) -> dict[str, str]:
    """Check the SASL and TLS settings against the protocol; read the secret files (once, at start).

    Settings that the protocol would silently ignore are errors: an operator who gave a
    password or a CA meant the connection to be authenticated or encrypted.
    """
    protocol = values["kafka.securityProtocol"]
    sasl, tls = protocol.startswith("SASL_"), protocol in ("SSL", "SASL_SSL")
    for key in _SASL_KEYS:
        if values[key] is not None and not sasl:
            raise ConfigError(key, values[key], f"needs kafka.securityProtocol SASL_PLAINTEXT/SASL_SSL, not {protocol}")
    for key in (*_TLS_FILES, "kafka.tls.keyPasswordFile"):
        if values[key] is not None and not tls:
            raise ConfigError(key, values[key], f"needs kafka.securityProtocol SSL/SASL_SSL, not {protocol}")
    secrets: dict[str, str] = {}
    if sasl:
        if values["kafka.sasl.mechanism"] is None:
            raise ConfigError("kafka.sasl.mechanism", None, f"required with {protocol}: " + ", ".join(SASL_MECHANISMS))
        if values["kafka.sasl.username"] is None:
            raise ConfigError("kafka.sasl.username", None, f"required with {protocol}")
        inline, path = values["kafka.sasl.password"], values["kafka.sasl.passwordFile"]
        if inline is not None and path is not None:
            raise ConfigError("kafka.sasl.password", inline, "given both inline and as kafka.sasl.passwordFile")
        if path is not None:
            secrets["kafka.sasl.password"] = _read_secret("kafka.sasl.passwordFile", path)
        elif inline is None:
            raise ConfigError(
                "kafka.sasl.password",
                None,
                f"required with {protocol}: set kafka.sasl.passwordFile or {BY_KEY['kafka.sasl.password'].env}",
            )
    if tls:
        for key in _TLS_FILES:
            if values[key] is not None and not _ca_not_a_file(key, values[key]):
                _check_readable(key, values[key])
        cert, key_file = values["kafka.tls.certFile"], values["kafka.tls.keyFile"]
        if (cert is None) != (key_file is None):
            missing = "kafka.tls.keyFile" if key_file is None else "kafka.tls.certFile"
            raise ConfigError(missing, None, "mutual TLS needs both kafka.tls.certFile and kafka.tls.keyFile")
        key_password = values["kafka.tls.keyPasswordFile"]
        if key_password is not None:
            if key_file is None:
                raise ConfigError("kafka.tls.keyPasswordFile", key_password, "needs kafka.tls.keyFile")
            secrets["kafka.tls.keyPassword"] = _read_secret("kafka.tls.keyPasswordFile", key_password)
        _check_pem(values, secrets.get("kafka.tls.keyPassword"))
    return secrets


def _ca_not_a_file(key: str, path: str) -> bool:
    """librdkafka also takes a directory of CA certificates, or "probe" for the system's usual places."""
    return key == "kafka.tls.caFile" and (path == "probe" or os.path.isdir(path))


def _check_pem(values: Mapping[str, Any], key_password: str | None) -> None:
    """Load the CA, certificate and key with OpenSSL as librdkafka will, so a wrong file or
    passphrase stops the start naming its key, instead of a traceback from the producer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for key in ("kafka.tls.caFile", "kafka.tls.certFile"):
        if values[key] is not None and not _ca_not_a_file(key, values[key]):
            try:
                ctx.load_verify_locations(cafile=values[key])
            except ssl.SSLError:
                raise ConfigError(key, values[key], "holds no PEM certificate") from None
    cert, key_file = values["kafka.tls.certFile"], values["kafka.tls.keyFile"]
    if cert is None or key_file is None:
        return
    try:  # the callback keeps OpenSSL from prompting on a terminal for a missing passphrase
        ctx.load_cert_chain(cert, key_file, password=lambda: key_password or "")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError("kafka.tls.keyFile", key_file, "not the key of kafka.tls.certFile") from None
        if b"ENCRYPTED" not in Path(key_file).read_bytes():
            raise ConfigError("kafka.tls.keyFile", key_file, "holds no PEM private key") from None
        if key_password is None:
            raise ConfigError("kafka.tls.keyFile", key_file, "encrypted: set kafka.tls.keyPasswordFile") from None
        raise ConfigError(
            "kafka.tls.keyPasswordFile", values["kafka.tls.keyPasswordFile"], "does not decrypt kafka.tls.keyFile"
        ) from None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}" if str(k) else f"{prefix}(empty key)"
        if key in BY_KEY:
            out[key] = v
        elif isinstance(v, Mapping) and any(s.startswith(key + ".") for s in BY_KEY):
            out.update(_flatten(v, key + "."))
        else:
            raise ConfigError(key, v, "unknown setting (see: flow-exporter config --print-defaults)")
    return out


def read_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("--config", str(path), f"not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("--config", str(path), "the file must hold a mapping of settings")
    return _flatten(data)


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    by_env = {s.env: s.key for s in SETTINGS}
    out = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ("FLOW_EXPORTER_CACHE",):
            continue
        if name not in by_env:
            raise ConfigError(name, value, "unknown environment setting")
        out[by_env[name]] = value
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` flags; values are read as YAML scalars or lists."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(pair, None, "expected --set key=value")
        if key not in BY_KEY:
            raise ConfigError(key, raw, "unknown setting (see: flow-exporter config --print-defaults)")
        try:
            out[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            out[key] = raw
    return out


def load(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file < environment < flags over the defaults, and validate every value."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw.update(read_file(path))
    raw.update(from_env(os.environ if environ is None else environ))
    raw.update(overrides or {})
    values = {s.key: s.default for s in SETTINGS}
    for key, value in raw.items():
        values[key] = BY_KEY[key].parse(key, value)
    if values["retry.maxBackoff"] < values["retry.initialBackoff"]:
        raise ConfigError("retry.maxBackoff", values["retry.maxBackoff"], "must be >= retry.initialBackoff")
    return Config(values, _kafka_security(values))


def defaults_text() -> str:
    """Every setting with its default, environment variable and meaning."""
    lines = []
    for s in SETTINGS:
        default = s.default
        if isinstance(default, float) and s.parse in (parse_duration, positive_duration):
            default = f"{default:g}s"
        elif isinstance(default, tuple):
            default = list(default)
        lines.append(f"{s.key} = {default!r}\n    {s.doc}\n    env: {s.env}")
    return "\n".join(lines) + "\n"


def _is_secret(key: str) -> bool:
    k = key.lower()
    if k.endswith(("file", ".location")):  # the path to a secret, which helps to show
        return False
    return "password" in k or "secret" in k or "userinfo" in k
