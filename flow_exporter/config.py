"""Configuration: one YAML file, then ``FLOW_EXPORTER_*`` environment variables, then CLI flags.

Every setting is declared once, in :mod:`flow_exporter.settings`; this module reads the
sources, parses each value by its declaration, builds the typed :class:`Settings` (whose
sections check what spans their settings), and checks what needs files: the Kafka TLS and SASL
settings, whose secrets it reads. Any bad value raises :class:`ConfigError` naming the key and
the value; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import os
import socket
import ssl
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from flow_exporter import compiled
from flow_exporter.settings import BY_KEY, ENV_PREFIX, SASL_MECHANISMS, SETTINGS, ConfigError, Settings, settings_from

__all__ = [
    "ConfigError",
    "Settings",
    "add_flags",
    "from_env",
    "from_flags",
    "load",
    "parse_overrides",
    "read_file",
    "this_node",
]


def this_node(settings: Settings) -> str:
    """This node's name in records: ``nodeName``, else $NODE_NAME (the DaemonSet's downward API), else the host name."""
    return settings.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


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


def _kafka_security(settings: Settings) -> dict[str, str]:
    """Check the SASL and TLS settings against the protocol; read the secret files (once, at start).

    Settings that the protocol would silently ignore are errors: an operator who gave a
    password or a CA meant the connection to be authenticated or encrypted.
    """
    kafka = settings.kafka
    protocol = kafka.security_protocol
    sasl, tls = protocol.startswith("SASL_"), protocol in ("SSL", "SASL_SSL")
    sasl_given = (
        ("kafka.sasl.mechanism", kafka.sasl.mechanism),
        ("kafka.sasl.username", kafka.sasl.username),
        ("kafka.sasl.password", kafka.sasl.password),
        ("kafka.sasl.passwordFile", kafka.sasl.password_file),
    )
    for key, value in sasl_given:
        if value is not None and not sasl:
            raise ConfigError(key, value, f"needs kafka.securityProtocol SASL_PLAINTEXT/SASL_SSL, not {protocol}")
    files = _tls_files(settings)
    for key, value in (*files, ("kafka.tls.keyPasswordFile", kafka.tls.key_password_file)):
        if value is not None and not tls:
            raise ConfigError(key, value, f"needs kafka.securityProtocol SSL/SASL_SSL, not {protocol}")
    secrets: dict[str, str] = {}
    if sasl:
        if kafka.sasl.mechanism is None:
            raise ConfigError("kafka.sasl.mechanism", None, f"required with {protocol}: " + ", ".join(SASL_MECHANISMS))
        if kafka.sasl.username is None:
            raise ConfigError("kafka.sasl.username", None, f"required with {protocol}")
        inline, path = kafka.sasl.password, kafka.sasl.password_file
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
        for key, value in files:
            if value is not None and not _ca_not_a_file(key, value):
                _check_readable(key, value)
        cert, key_file = kafka.tls.cert_file, kafka.tls.key_file
        if (cert is None) != (key_file is None):
            missing = "kafka.tls.keyFile" if key_file is None else "kafka.tls.certFile"
            raise ConfigError(missing, None, "mutual TLS needs both kafka.tls.certFile and kafka.tls.keyFile")
        key_password = kafka.tls.key_password_file
        if key_password is not None:
            if key_file is None:
                raise ConfigError("kafka.tls.keyPasswordFile", key_password, "needs kafka.tls.keyFile")
            secrets["kafka.tls.keyPassword"] = _read_secret("kafka.tls.keyPasswordFile", key_password)
        _check_pem(settings, secrets.get("kafka.tls.keyPassword"))
    return secrets


def _tls_files(settings: Settings) -> tuple[tuple[str, str | None], ...]:
    """The PEM files librdkafka is given, by key (the key password's file is read here, not by librdkafka)."""
    tls = settings.kafka.tls
    return (
        ("kafka.tls.caFile", tls.ca_file),
        ("kafka.tls.certFile", tls.cert_file),
        ("kafka.tls.keyFile", tls.key_file),
    )


def _ca_not_a_file(key: str, path: str) -> bool:
    """librdkafka also takes a directory of CA certificates, or "probe" for the system's usual places."""
    return key == "kafka.tls.caFile" and (path == "probe" or os.path.isdir(path))


def _check_pem(settings: Settings, key_password: str | None) -> None:
    """Load the CA, certificate and key with OpenSSL as librdkafka will, so a wrong file or
    passphrase stops the start naming its key, instead of a traceback from the producer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls = settings.kafka.tls
    for key, path in (("kafka.tls.caFile", tls.ca_file), ("kafka.tls.certFile", tls.cert_file)):
        if path is not None and not _ca_not_a_file(key, path):
            try:
                ctx.load_verify_locations(cafile=path)
            except ssl.SSLError:
                raise ConfigError(key, path, "holds no PEM certificate") from None
    cert, key_file = tls.cert_file, tls.key_file
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
            "kafka.tls.keyPasswordFile", tls.key_password_file, "does not decrypt kafka.tls.keyFile"
        ) from None


def unknown(key: str, where: str = "setting") -> str:
    """The reason for an unknown key, with the nearest known one when there is one ("did you mean")."""
    close = difflib.get_close_matches(key, BY_KEY, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown {where}{hint} (see: flow-exporter config --print-defaults)"


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}" if str(k) else f"{prefix}(empty key)"
        if key in BY_KEY:
            out[key] = v
        elif isinstance(v, Mapping) and any(s.startswith(key + ".") for s in BY_KEY):
            out.update(_flatten(v, key + "."))
        else:
            raise ConfigError(key, v, unknown(key))
    return out


MAX_FILE_BYTES = 1 << 20  # a config file is a few kB; anything near this is a mistake (or an attack)
MAX_NODES = 100_000  # values in the file once YAML aliases are expanded (an alias "bomb" is billions)
# Settings whose value is a list: a file must give a list (``zones: [7]``), not a scalar that would be read as one.
LIST_KEYS = frozenset(s.key for s in SETTINGS if isinstance(s.default, tuple | list))


class _Twice(Exception):
    """A key given twice in one mapping of the file."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise _Twice(f"key {key!r} given twice (lines {seen[key]} and {line})")
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep)


def _too_many_nodes(data: object) -> bool:
    """Whether ``data`` has more than MAX_NODES values, counting each alias's target every time it is used."""
    todo, count = [data], 0
    while todo:
        count += 1
        if count > MAX_NODES:
            return True
        item = todo.pop()
        if isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


def read_file(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML file, flattened to their keys; ConfigError (exit 2) for anything that is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError("--config", str(path), f"larger than {MAX_FILE_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("--config", str(path), f"not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a safe loader: _Loader is yaml.SafeLoader's
    except _Twice as exc:
        raise ConfigError("--config", str(path), str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", str(path), f"not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("--config", str(path), "the file must hold a mapping of settings")
    if _too_many_nodes(data):
        raise ConfigError("--config", str(path), f"more than {MAX_NODES:,} values once YAML aliases are expanded")
    out = _flatten(data)
    for key in LIST_KEYS & out.keys():
        if out[key] is not None and not isinstance(out[key], list):
            raise ConfigError(key, out[key], "expected a list (in a file: [a, b]; from a flag or the environment: a,b)")
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (its own text spans several, with the line quoted)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:300] + "..."


# Variables of the prefix that are not settings: the harness's cache, the build choice (flow_exporter.compiled),
# the build switch (setup.py).
NOT_SETTINGS = ("FLOW_EXPORTER_CACHE", compiled.INTERPRETED_ENV, "FLOW_EXPORTER_REQUIRE_COMPILED")


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    by_env = {s.env: s.key for s in SETTINGS}
    out = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        if name not in by_env:
            close = difflib.get_close_matches(name, by_env, n=1, cutoff=0.75)
            raise ConfigError(
                name, value, "unknown environment setting" + (f"; did you mean {close[0]}?" if close else "")
            )
        out[by_env[name]] = value
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` flags; values are read as YAML scalars or lists. A map setting takes one of its entries
    as ``--set kafka.producer.linger.ms=20``; flags of one map merge in order, over the file's and the environment's
    map, entry by entry."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(pair, None, "expected --set key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        entry = next((m for m in MAP_KEYS if key.startswith(m + ".") and len(key) > len(m) + 1), None)
        if entry is not None:  # one entry of a map, over what earlier flags gave it
            out.setdefault(entry, {})[key[len(entry) + 1 :]] = value
            continue
        if key not in BY_KEY:
            raise ConfigError(key, raw, unknown(key))
        if key in MAP_KEYS:  # a whole map (YAML, or k=v,k=v), over what earlier flags gave it
            out.setdefault(key, {}).update(BY_KEY[key].parse(key, value))
            continue
        out[key] = value
    return out


MAP_KEYS = ("kafka.producer",)  # map settings whose entries a flag may set one by one


# A check the caller adds to loading (the entry points add the Kafka producer's, so that this module
# stays below the edges): it raises ConfigError naming the setting.
Check = Callable[[Settings], None]


def load(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    checks: Sequence[Check] = (),
) -> Settings:
    """Merge file < environment < flags over the defaults, and validate every value (``checks`` last).

    Each value is parsed by its setting's parser, then the settings are built (each section checks what spans
    its settings: retry order, Cilium without zones, shedding's depth), then the Kafka security settings are
    checked against each other and their files read, then ``checks``."""
    raw: dict[str, Any] = {}
    maps: dict[str, dict[str, Any]] = {}  # MAP_KEYS: each source's map merged over the earlier ones
    sources = (
        read_file(path) if path is not None else {},
        from_env(os.environ if environ is None else environ),
        dict(overrides or {}),
    )
    for source in sources:
        for key in MAP_KEYS:
            if key in source:
                maps.setdefault(key, {}).update(BY_KEY[key].parse(key, source.pop(key)))
        raw.update(source)
    raw.update(maps)
    values = {key: BY_KEY[key].parse(key, value) for key, value in raw.items()}
    settings = settings_from(values)  # each section checks what spans its settings (settings.RetrySettings, ...)
    settings = replace(settings, secrets=_kafka_security(settings))
    for check in checks:
        check(settings)
    return settings


# The command line's third source: --config, --set for any key, and shortcuts for the keys set most
# often (flag, key), declared once for every command that reads the settings.
SHORTCUTS = (
    ("bootstrap-servers", "kafka.bootstrapServers"),
    ("topic", "kafka.topic"),
    ("netns", "conntrack.netns"),
    ("node-name", "nodeName"),
    ("log-level", "log.level"),
    ("log-format", "log.format"),
)


def add_flags(
    parser: argparse.ArgumentParser, shortcuts: Collection[str] | None = None, config_help: str = "YAML config file"
) -> None:
    """Declare ``--config``, ``--set`` and the ``shortcuts`` (flag names; all when None) on a command."""
    parser.add_argument("--config", metavar="FILE", help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")
    for flag, key in SHORTCUTS:
        if shortcuts is None or flag in shortcuts:
            parser.add_argument(f"--{flag}", help=f"same as --set {key}=...")


def from_flags(args: argparse.Namespace, checks: Sequence[Check] = ()) -> Settings:
    """The settings of a command whose flags ``add_flags`` declared: file < environment < flags."""
    overrides: dict[str, Any] = parse_overrides(args.set)
    for flag, key in SHORTCUTS:
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            overrides[key] = value
    return load(args.config, overrides=overrides, checks=checks)
