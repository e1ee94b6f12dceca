"""The settings table: every setting once, with its type, default and meaning.

It drives parsing and validation (each bad value is a :class:`ConfigError` naming the key and
the value), the environment variable names, ``flow-exporter config --print-defaults``, and the
defaults of the constructors that take a setting (:data:`DEFAULTS`), so a default is written
in one place only. Pure: no file, environment or network access (that is :mod:`.config`).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "FLOW_EXPORTER_"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and the value (shortened: a value can be a
    50 MB string or a YAML alias bomb, and the message is one log line)."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        super().__init__(f"config {key}={_SHORT.repr(shown(key, value))}: {reason}")
        self.key = key


# How much of a bad value an error message shows: enough to find it, never the whole of a huge one.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple = 3, 6, 6, 6


# ------------------------------------------------------------------ value types
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(key: str, value: object) -> float:
    """``5s``, ``1m``, ``250ms``, ``1.5h`` or a bare number of seconds; never negative."""
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected a duration like 5s, 1m or 250ms")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds):  # YAML .inf and .nan are floats too
            raise ConfigError(key, value, "expected a finite duration like 5s, 1m or 250ms")
        if seconds < 0:
            raise ConfigError(key, value, "must not be negative")
        return _at_most_a_year(key, value, seconds)
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ConfigError(key, value, "must not be negative")
        m = _DURATION.match(value)
        if m:
            return _at_most_a_year(key, value, float(m.group(1)) * _UNITS[m.group(2)])
    raise ConfigError(key, value, "expected a duration like 5s, 1m or 250ms")


_YEAR = 365 * 86400.0


def _at_most_a_year(key: str, value: object, seconds: float) -> float:
    """No timeout or interval here means anything past a year; beyond, time arithmetic only overflows."""
    if seconds > _YEAR:
        raise ConfigError(key, value, "more than a year (365 days): not a meaningful duration here")
    return seconds


MIN_PROBABILITY = 2.0**-32  # below: a node keeps (almost) nothing, and the estimates carry no information


def parse_probability(key: str, value: object) -> float:
    """A probability in [2**-32, 1]: a number (``0.0625``) or a fraction (``1/16``)."""
    p: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        p = float(value)
    elif isinstance(value, str):
        text = value.strip()
        num, slash, den = text.partition("/")
        try:
            p = float(num) / float(den) if slash else float(text)
        except (ValueError, ZeroDivisionError):
            p = None
    if p is None or not math.isfinite(p):
        raise ConfigError(key, value, "expected a probability like 1, 0.25 or 1/16")
    if not MIN_PROBABILITY <= p <= 1:
        raise ConfigError(key, value, "a probability is between 2**-32 and 1 (1: every connection is kept)")
    return p


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


def parse_auto_bool(key: str, value: object) -> bool | None:
    """true, false, or auto (None: the program decides from other settings)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return parse_bool(key, value)
    except ConfigError:
        raise ConfigError(key, value, "expected auto, true or false") from None


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


def parse_opt_topic(key: str, value: object) -> str | None:
    """A topic name, or empty/none for off."""
    if value is None or value == "":
        return None
    return parse_topic(key, value)


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


def parse_u16(key: str, value: object) -> int:
    """A 16-bit unsigned value (0-65535), e.g. the Community ID seed."""
    n = parse_count(key, value)
    if n > 0xFFFF:
        raise ConfigError(key, value, "must be 0-65535")
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


MAX_ATTRIBUTES = 16  # stamped on every record: a handful of resource attributes, not a payload
MAX_ATTRIBUTE_VALUE = 256
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]{0,62}")


def parse_attributes(key: str, value: object) -> dict[str, str]:
    """Static attributes for every record: a map (``{environment: prod, region: eu-west-1}``), or
    ``environment=prod,region=eu-west-1`` from the environment or a flag."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs: dict[object, object] = {}
        for part in (p for p in re.split(r"\s*,\s*", value.strip()) if p):
            name, eq, text = part.partition("=")
            if not eq:
                raise ConfigError(key, value, f"{part!r} is not name=value")
            pairs[name.strip()] = text.strip()
        value = pairs
    if not isinstance(value, dict):
        raise ConfigError(key, value, "expected a map of names to strings, e.g. {environment: prod}")
    if len(value) > MAX_ATTRIBUTES:
        raise ConfigError(key, value, f"at most {MAX_ATTRIBUTES} attributes (they go into every record)")
    out: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or not _ATTRIBUTE_NAME.fullmatch(name):
            raise ConfigError(key, value, f"attribute name {name!r}: letters, digits, _ . - /, at most 63, not a "
                              "digit first")  # fmt: skip
        if not isinstance(text, str):
            raise ConfigError(key, value, f"attribute {name}: {text!r} is not a string (quote it in YAML)")
        if len(text) > MAX_ATTRIBUTE_VALUE:
            raise ConfigError(key, value, f"attribute {name}: longer than {MAX_ATTRIBUTE_VALUE} characters")
        out[name] = text
    return out


def parse_k8s_scope(key: str, value: object) -> str:
    s = parse_str(key, value).lower()
    if s not in ("cluster", "node"):
        raise ConfigError(key, value, "one of cluster (every pod), node (this node's pods)")
    return s


# Schema Registry (flow_exporter.sink.registry); kept here so loading a config imports no registry client.
REGISTRY_COMPATIBILITY = (
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
    "NONE",
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


def parse_opt_subject(key: str, value: object) -> str | None:
    """A fixed subject name, or empty/none to let ``schemaRegistry.subjectNameStrategy`` name it."""
    if value is None:
        return None
    s = parse_str(key, value).strip()
    if not s and value != "":
        raise ConfigError(key, value, "a subject name, or empty for the strategy's")
    return s or None


def parse_subject_strategy(key: str, value: object) -> str:
    s = parse_str(key, value).strip().lower()
    if s not in ("topic", "record"):
        raise ConfigError(key, value, "topic (<topic>-value, the default) or record (io.flowexporter.FlowRecord)")
    return s


def parse_user_info(key: str, value: object) -> str | None:
    s = parse_opt_str(key, value)
    if s is not None and ":" not in s:
        raise ConfigError(key, value, "expected user:password")
    return s


def _one_of(choices: Mapping[str, str]) -> Callable[[str, object], str]:
    """A parser for one word out of ``choices`` (word -> what it means, for the error)."""

    def parse(key: str, value: object) -> str:
        s = parse_str(key, value).strip().lower()
        if s not in choices:
            raise ConfigError(key, value, "one of " + ", ".join(f"{c} ({why})" for c, why in choices.items()))
        return s

    return parse


parse_source = _one_of({
    "netfilter": "the kernel's conntrack table",
    "cilium": "Cilium's BPF connection-tracking maps",
    "auto": "Cilium's maps when they are pinned under cilium.bpffs, else netfilter",
})  # fmt: skip
parse_cilium_counters = _one_of({
    "combined": "Cilium 1.16 and later: one packets and bytes pair for both directions",
    "split": "Cilium 1.15 and earlier: received and sent counted apart",
})  # fmt: skip
parse_cilium_clock = _one_of({
    "ktime": "Cilium's default: lifetimes in seconds of the monotonic clock",
    "jiffies": "Cilium with bpf-clock-probe: lifetimes are not compared",
})  # fmt: skip


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
    Setting("clusterName", parse_str, "", "This cluster's name in records (clusterName); empty: null."),
    Setting(
        "networks.file",
        parse_opt_str,
        None,
        "Named networks for the ends that are not pods or nodes (sourceNetwork, destinationNetwork): a YAML map of "
        "names to lists of CIDRs, IPv4 and IPv6, longest prefix wins; read again when it changes.",
    ),
    Setting(
        "networks.maxPrefixes",
        lambda k, v: parse_count(k, v, minimum=1),
        200_000,
        "At most this many prefixes in networks.file (a bigger file is refused, at start or at a reload).",
    ),
    Setting("networks.reloadInterval", positive_duration, 10.0, "How often networks.file is checked for a change."),
    Setting(
        "record.attributes",
        parse_attributes,
        {},
        "Static attributes stamped on every record (attributes): at most 16 name: value strings, e.g. "
        "{environment: prod, region: eu-west-1}; from the environment: environment=prod,region=eu-west-1.",
    ),
    Setting(
        "sampling.probability",
        parse_probability,
        1.0,
        "Keep each connection with this probability (README: Sampling): decided once per connection by a keyed "
        "hash of its ends, alike on every node with the same sampling.seed; 1 keeps all. Powers of two (1/16) "
        "keep the consumers' estimates exact in floating point.",
    ),
    Setting(
        "sampling.seed",
        parse_str,
        "",
        "The key of the sampling hash (any string; kept secret, as it tells which tuples are sampled). Every "
        "exporter of a cluster needs the same seed for both nodes of a connection to choose alike.",
    ),
    Setting(
        "sampling.budget.connections",
        parse_count,
        0,
        "Adaptive shedding: the store rows (tracked connections) this node may hold; past it the probability for "
        "new connections is halved, and doubled back when well under (0: no such budget). Kept connections stay.",
    ),
    Setting(
        "sampling.budget.recordsPerSecond",
        parse_count,
        0,
        "Adaptive shedding: the flow records per second this node may send (0: no such budget).",
    ),
    Setting(
        "sampling.adjustInterval",
        positive_duration,
        30.0,
        "Adaptive shedding: how often the load is set against the budget (one halving or doubling at most).",
    ),
    Setting(
        "sampling.maxHalvings",
        lambda k, v: parse_count(k, v, minimum=1),
        10,
        "Adaptive shedding: how far the probability may fall, in halvings of sampling.probability (10: 1/1024 of it).",
    ),
    Setting("communityId.seed", parse_u16, 0, "Community ID seed (0-65535); all tools comparing IDs use one seed."),
    Setting(
        "conntrack.source",
        parse_source,
        "netfilter",
        "Where connections are read: netfilter (the kernel's conntrack), cilium (Cilium's BPF CT maps, for "
        "clusters where Cilium keeps pod traffic out of netfilter), or auto (cilium when its maps are pinned).",
    ),
    Setting("cilium.bpffs", parse_str, "/sys/fs/bpf", "The BPF filesystem Cilium pins its maps in (tc/globals/...)."),
    Setting(
        "cilium.counters",
        parse_cilium_counters,
        "combined",
        "The counter layout of Cilium's CT entries: combined (Cilium 1.16 and later) or split (1.15 and earlier); "
        "the maps do not say, and a wrong layout misreads every counter.",
    ),
    Setting(
        "cilium.clock",
        parse_cilium_clock,
        "ktime",
        "Cilium's BPF clock: ktime (its default), or jiffies (bpf-clock-probe on): then an entry past its lifetime "
        "is over only when Cilium deletes it.",
    ),
    Setting("conntrack.netns", parse_opt_str, None, "Read conntrack of this named network namespace."),
    Setting("conntrack.zones", parse_zones, (), "Conntrack zones to export; empty means all zones."),
    Setting("conntrack.pollInterval", positive_duration, 5.0, "How often the conntrack table is dumped."),
    Setting("conntrack.events", parse_bool, True, "Also listen to NEW/DESTROY events (short-lived flows)."),
    Setting(
        "conntrack.eventBuffer",
        lambda k, v: parse_count(k, v, minimum=4096),
        64 << 20,
        "Receive buffer of the event socket, bytes (the kernel drops events beyond it).",
    ),
    Setting(
        "conntrack.eventBufferMax",
        lambda k, v: parse_count(k, v, minimum=4096),
        128 << 20,
        "Ceiling the event buffer doubles up to when events are lost; at or below eventBuffer: no growth.",
    ),
    Setting(
        "conntrack.compiled",
        parse_bool,
        True,
        "Unused; kept so older configs load (false is warned about): the build is chosen once, at start: the "
        "compiled modules when installed; FLOW_EXPORTER_INTERPRETED=1 forces the interpreted ones.",
    ),
    Setting("conntrack.setSysctls", parse_bool, True, "Turn on nf_conntrack_acct and _timestamp at start."),
    Setting("expiry.activeTimeout", positive_duration, 5.0, "A record every this long while a flow is active."),
    Setting("expiry.idleTimeout", positive_duration, 15.0, "A flow with no packets for this long is idle."),
    Setting("expiry.staleTimeout", positive_duration, 300.0, "Unused; kept so older configs load."),
    Setting("kafka.bootstrapServers", parse_str, "localhost:9092", "Kafka bootstrap servers, host:port[,...]."),
    Setting("kafka.topic", parse_topic, "flows", "Topic for flow records (unless a route matches)."),
    Setting("export.flows", parse_bool, True, "Export flow records; false: only the health stream (health.topic)."),
    Setting(
        "export.prefixCache",
        parse_auto_bool,
        None,
        "Keep each active connection's encoded record prefix between its records: true, false, or auto (null, "
        "the default: on when expiry.activeTimeout is under 30 s, where records are frequent enough to pay for "
        "the ~160 bytes per connection).",
    ),
    Setting("health.topic", parse_opt_topic, None, "Topic for ConntrackHealth records; empty: no health stream."),
    Setting("health.interval", positive_duration, 60.0, "Time between two ConntrackHealth records."),
    Setting("markers.topic", parse_opt_topic, None, "Topic for CompletenessMarker records; empty: none sent."),
    Setting("markers.interval", positive_duration, 10.0, "Time between two rounds of completeness markers."),
    Setting("kafka.routes", parse_routes, (), "Other topics by flowType or endReason; first match wins."),
    Setting("schemaRegistry.url", parse_registry_url, None, "Schema Registry URL; set: Confluent-framed values."),
    Setting(
        "schemaRegistry.subjectNameStrategy",
        parse_subject_strategy,
        "topic",
        "topic: subject <topic>-value per topic; record: io.flowexporter.FlowRecord.",
    ),
    Setting("schemaRegistry.subject", parse_opt_subject, None, "One subject for every topic (overrides the strategy)."),
    Setting("schemaRegistry.compatibility", parse_compatibility, "BACKWARD_TRANSITIVE", "Set at start; empty: keep."),
    Setting("schemaRegistry.basicAuthUserInfo", parse_user_info, None, "user:password for the registry (a secret)."),
    Setting("kafka.producer", parse_map, {}, "librdkafka producer settings, checked by librdkafka at start."),
    Setting(
        "kafka.allowUnsafeProducer",
        parse_bool,
        False,
        "Accept kafka.producer settings that void the accounting (acks not all, idempotence off).",
    ),
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
    Setting(
        "kafka.readyTimeout",
        parse_duration,
        120.0,
        "Not ready (/readyz 503) once a topic's records waited this long with no delivery; 0: never.",
    ),
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
    Setting(
        "metrics.address",
        parse_str,
        "127.0.0.1",
        "Address of the /metrics, /healthz, /readyz listener (the DaemonSet sets the pod's IP).",
    ),
    Setting("metrics.port", parse_port, 9690, "Port of that listener; 0 turns it off."),
    Setting("log.level", parse_level, "info", "debug, info, warning or error."),
    Setting("log.format", parse_log_format, "text", "text or json."),
)
BY_KEY = {s.key: s for s in SETTINGS}
DEFAULTS: Mapping[str, Any] = {s.key: s.default for s in SETTINGS}


def defaults_text() -> str:
    """Every setting at its default, as a YAML config file to start from (``config --print-defaults``).

    Nested like the config file; each setting's comment says what it means and its environment
    variable. Written by hand (this module is pure, no YAML library): strings and lists in JSON
    form, which YAML reads as they are.
    """
    tree: dict[str, Any] = {}
    for st in SETTINGS:
        *path, leaf = st.key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = st
    lines = [
        "# flow-exporter configuration: every setting at its default.",
        "# Each can also be set by the environment variable in its comment, or with --set key=value.",
    ]

    def emit(node: dict[str, Any], depth: int) -> None:
        pad = "  " * depth
        for name, item in node.items():
            if isinstance(item, Setting):
                lines.append(f"{pad}# {item.doc} (env {item.env})")
                lines.append(f"{pad}{name}: {_yaml_value(item)}")
            else:
                lines.append(f"{pad}{name}:")
                emit(item, depth + 1)

    emit(tree, 0)
    return "\n".join(lines) + "\n"


def _yaml_value(st: Setting) -> str:
    value = st.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and st.parse in (parse_duration, positive_duration):
        return f"{value:g}s"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


# Words in a setting's key (ours or librdkafka's) that make its value secret: passwords, inline
# PEM keys (ssl.key.pem, ssl_key), OAUTHBEARER and SASL/OIDC client secrets, tokens.
_SECRET_WORDS = (
    "password", "secret", "userinfo", "key.pem", "ssl_key", "oauthbearer.config", "token", "credential",
    "sampling.seed",
)  # fmt: skip
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def is_secret(key: str) -> bool:
    """Whether a setting's value must never be shown: the one rule for printing, errors and logs."""
    k = key.lower()
    if k.endswith(("file", ".location")):  # the path to a secret, which helps to show
        return False
    return any(word in k for word in _SECRET_WORDS)


def shown(key: str, value: object) -> object:
    """``value`` as it may be printed or logged: secrets as ``***``, a URL's ``user:password@`` as ``***@``."""
    if value is None:
        return None
    if is_secret(key):
        return "***"
    if isinstance(value, str) and "@" in value:
        return _URL_USERINFO.sub("***@", value)
    if isinstance(value, dict):
        return {k: shown(f"{key}.{k}", v) for k, v in value.items()}
    return value
