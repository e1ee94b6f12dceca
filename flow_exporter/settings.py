"""The settings, declared once as typed objects: every setting with its type, default and meaning.

Each setting is a field of a frozen section class (:class:`KafkaSettings`, :class:`ConntrackSettings`, ...),
composed into :class:`Settings`, so the product reads ``settings.kafka.topic`` and mypy checks it. From those
declarations follow the keys of the file, the environment variable names, parsing and validation (each bad value
is a :class:`ConfigError` naming the key and the value), ``flow-exporter config --print-defaults``, the chart's
``values.schema.json`` and the reference pages (:data:`SETTINGS`, :func:`format_default`), and the defaults of
the constructors that take a setting (:data:`DEFAULT_SETTINGS`), so a default is written in one place only.
Pure: no file, environment or network access (that is :mod:`.config`).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

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


@dataclass(frozen=True, slots=True)
class Route:
    """A ``kafka.routes`` entry: records matching ``flow_type`` and/or ``end_reason`` go to ``topic`` (the sink
    takes the first that matches; flow_exporter.sink.Route is this class)."""

    topic: str
    flow_type: int | None = None
    end_reason: int | None = None

    def matches(self, flow_type: int, end_reason: int) -> bool:
        if self.flow_type is not None and flow_type != self.flow_type:
            return False
        return not (self.end_reason is not None and end_reason != self.end_reason)

    def as_config(self) -> dict[str, Any]:
        """The route as the config file writes it: ``{topic: T, flowType: N}``."""
        out: dict[str, Any] = {"topic": self.topic}
        if self.flow_type is not None:
            out["flowType"] = self.flow_type
        if self.end_reason is not None:
            out["endReason"] = self.end_reason
        return out


def parse_routes(key: str, value: object) -> tuple[Route, ...]:
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
        topic = parse_topic(f"{where}.topic", r["topic"])
        matched: dict[str, int] = {}
        for name, hi in (("flowType", 4), ("endReason", 5)):
            if name in r:
                v = r[name]
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
                    raise ConfigError(f"{where}.{name}", v, f"expected an integer 0-{hi}")
                matched[name] = v
        if not matched:
            raise ConfigError(where, r, "needs flowType or endReason")
        routes.append(Route(topic, flow_type=matched.get("flowType"), end_reason=matched.get("endReason")))
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


# ---------------------------------------------- value types, named for the reference
@dataclass(frozen=True)
class ValueType(Generic[T_co]):
    """What a setting holds: its name in the reference (``duration``, ``list of zones``) and its parser.

    ``parse(key, value)`` takes a value from the file, the environment or a flag and returns it typed, or raises
    a ConfigError naming the key. ``duration``: the default is written ``5s`` (``format_default``).
    """

    name: str
    parse: Callable[[str, object], T_co]
    duration: bool = False


def _count(minimum: int) -> ValueType[int]:
    """A whole number >= ``minimum``."""
    name = "whole number" if minimum == 0 else f"whole number >= {minimum}"
    return ValueType(name, lambda key, value: parse_count(key, value, minimum))


def _choice(words: Iterable[str], parse: Callable[[str, object], T], *, empty: bool = False) -> ValueType[T]:
    """One word of ``words`` (the parser says what each means when a value is refused)."""
    return ValueType("one of " + ", ".join(words) + (", or empty" if empty else ""), parse)


STRING = ValueType("string", parse_str)
OPTIONAL_STRING = ValueType("string", parse_opt_str)  # empty or null: None
PATH = ValueType("path", parse_str)
OPTIONAL_PATH = ValueType("path", parse_opt_str)  # empty or null: None
BOOL = ValueType("bool", parse_bool)
AUTO_BOOL = ValueType("bool or auto", parse_auto_bool)  # auto: None
DURATION = ValueType("duration", parse_duration, duration=True)
POSITIVE_DURATION = ValueType("duration > 0", positive_duration, duration=True)
PROBABILITY = ValueType("probability", parse_probability)
COUNT = _count(0)
U16 = ValueType("whole number 0-65535", parse_u16)
PORT = ValueType("port", parse_port)
TOPIC = ValueType("topic name", parse_topic)
OPTIONAL_TOPIC = ValueType("topic name or empty", parse_opt_topic)
ZONES = ValueType("list of zones", parse_zones)
ROUTES = ValueType("list of routes", parse_routes)
MAP = ValueType("map", parse_map)
ATTRIBUTES = ValueType("map of strings", parse_attributes)
LABEL_KEYS = ValueType("list of label keys", parse_label_keys)
REGISTRY_URL = ValueType("URL", parse_registry_url)
SUBJECT = ValueType("subject name", parse_opt_subject)
USER_INFO = ValueType("user:password", parse_user_info)
SOURCE = _choice(("netfilter", "cilium", "auto"), parse_source)
CILIUM_COUNTERS = _choice(("combined", "split"), parse_cilium_counters)
CILIUM_CLOCK = _choice(("ktime", "jiffies"), parse_cilium_clock)
SECURITY_PROTOCOL = _choice(SECURITY_PROTOCOLS, parse_security_protocol)
SASL_MECHANISM = _choice(SASL_MECHANISMS, parse_sasl_mechanism)
SUBJECT_STRATEGY = _choice(("topic", "record"), parse_subject_strategy)
COMPATIBILITY = _choice(REGISTRY_COMPATIBILITY, parse_compatibility, empty=True)
K8S_SCOPE = _choice(("cluster", "node"), parse_k8s_scope)
LOG_LEVEL = _choice(("debug", "info", "warning", "error"), parse_level)
LOG_FORMAT = _choice(("text", "json"), parse_log_format)


# ------------------------------------------------------------ the declarations
# Each setting is one field of a section below: its type, then ``setting(value type, default, doc)``; a section
# holds others as ``field(default_factory=TheirClass)``. The key is the field's path in camel case
# (``kafka.tls.ca_file``: ``kafka.tls.caFile``) and the environment variable follows from the key (Setting.env), so
# a new setting is one declaration here and the reads where it is used.
_VALUE_TYPE, _DOC, _SECRET = "value_type", "doc", "secret"


def setting(value_type: ValueType[T], default: T, doc: str, *, secret: bool = False) -> T:
    """Declare a setting (a dataclass field): its value type, default and meaning; ``secret``: never shown."""
    meta = {_VALUE_TYPE: value_type, _DOC: doc, _SECRET: secret}
    if isinstance(default, dict):  # a map's default: each instance gets its own copy
        template = dict(default)
        return field(default_factory=lambda: cast(T, dict(template)), metadata=meta)
    return field(default=default, metadata=meta)


class _Section:
    """A group of settings: its repr shows secrets as ``***`` (settings.shown), as every print and log does."""

    __slots__ = ()

    def __repr__(self) -> str:
        prefix = _PREFIXES.get(type(self), "")
        shown_fields = []
        for f in fields(cast(Any, self)):
            value = getattr(self, f.name)
            if _VALUE_TYPE in f.metadata:
                value = shown(prefix + _camel(f.name), value)
            if f.repr:
                shown_fields.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown_fields)})"


@dataclass(frozen=True, slots=True, repr=False)
class NetworksSettings(_Section):
    file: str | None = setting(
        OPTIONAL_PATH,
        None,
        "Named networks for the ends that are not pods or nodes (sourceNetwork, destinationNetwork): a YAML map of "
        "names to lists of CIDRs, IPv4 and IPv6, longest prefix wins; read again when it changes.",
    )
    max_prefixes: int = setting(
        _count(1), 200_000, "At most this many prefixes in networks.file (a bigger file is refused, at start or at a "
        "reload).",
    )  # fmt: skip
    reload_interval: float = setting(POSITIVE_DURATION, 10.0, "How often networks.file is checked for a change.")


@dataclass(frozen=True, slots=True, repr=False)
class RecordSettings(_Section):
    attributes: Mapping[str, str] = setting(
        ATTRIBUTES,
        {},
        "Static attributes stamped on every record (attributes): at most 16 name: value strings, e.g. "
        "{environment: prod, region: eu-west-1}; from the environment: environment=prod,region=eu-west-1.",
    )


@dataclass(frozen=True, slots=True, repr=False)
class SamplingBudgetSettings(_Section):
    connections: int = setting(
        COUNT,
        0,
        "Adaptive shedding: the store rows (tracked connections) this node may hold; past it the probability for "
        "new connections is halved, and doubled back when well under (0: no such budget). Kept connections stay.",
    )
    records_per_second: int = setting(
        COUNT, 0, "Adaptive shedding: the flow records per second this node may send (0: no such budget)."
    )


@dataclass(frozen=True, slots=True, repr=False)
class SamplingSettings(_Section):
    probability: float = setting(
        PROBABILITY,
        1.0,
        "Keep each connection with this probability (README: Sampling): decided once per connection by a keyed "
        "hash of its ends, alike on every node with the same sampling.seed; 1 keeps all. Powers of two (1/16) "
        "keep the consumers' estimates exact in floating point.",
    )
    seed: str = setting(
        STRING,
        "",
        "The key of the sampling hash (any string; kept secret, as it tells which tuples are sampled). Every "
        "exporter of a cluster needs the same seed for both nodes of a connection to choose alike.",
        secret=True,
    )
    budget: SamplingBudgetSettings = field(default_factory=SamplingBudgetSettings)
    adjust_interval: float = setting(
        POSITIVE_DURATION,
        30.0,
        "Adaptive shedding: how often the load is set against the budget (one halving or doubling at most).",
    )
    max_halvings: int = setting(
        _count(1),
        10,
        "Adaptive shedding: how far the probability may fall, in halvings of sampling.probability (10: 1/1024 of it).",
    )

    def __post_init__(self) -> None:
        shedding = self.budget.connections or self.budget.records_per_second
        deepest = math.ldexp(self.probability, -self.max_halvings)  # (2.0**-n overflows past n = 1023)
        if shedding and deepest < MIN_PROBABILITY:
            raise ConfigError("sampling.maxHalvings", self.max_halvings,
                              f"sampling.probability halved that often is below 2**-32 ({deepest:g})")  # fmt: skip


@dataclass(frozen=True, slots=True, repr=False)
class CommunityIdSettings(_Section):
    seed: int = setting(U16, 0, "Community ID seed (0-65535); all tools comparing IDs use one seed.")


@dataclass(frozen=True, slots=True, repr=False)
class ConntrackSettings(_Section):
    source: str = setting(
        SOURCE,
        "netfilter",
        "Where connections are read: netfilter (the kernel's conntrack), cilium (Cilium's BPF CT maps, for "
        "clusters where Cilium keeps pod traffic out of netfilter), or auto (cilium when its maps are pinned).",
    )
    netns: str | None = setting(OPTIONAL_STRING, None, "Read conntrack of this named network namespace.")
    zones: tuple[int, ...] = setting(ZONES, (), "Conntrack zones to export; empty means all zones.")
    poll_interval: float = setting(POSITIVE_DURATION, 5.0, "How often the conntrack table is dumped.")
    events: bool = setting(BOOL, True, "Also listen to NEW/DESTROY events (short-lived flows).")
    event_buffer: int = setting(
        _count(4096), 64 << 20, "Receive buffer of the event socket, bytes (the kernel drops events beyond it)."
    )
    event_buffer_max: int = setting(
        _count(4096),
        128 << 20,
        "Ceiling the event buffer doubles up to when events are lost; at or below eventBuffer: no growth.",
    )
    compiled: bool = setting(
        BOOL,
        True,
        "Unused; kept so older configs load (false is warned about): the build is chosen once, at start: the "
        "compiled modules when installed; FLOW_EXPORTER_INTERPRETED=1 forces the interpreted ones.",
    )
    set_sysctls: bool = setting(BOOL, True, "Turn on nf_conntrack_acct and _timestamp at start.")

    def __post_init__(self) -> None:
        if self.source == "cilium" and self.zones:
            raise ConfigError("conntrack.zones", self.zones, "Cilium's CT maps have no zones "
                              "(conntrack.source is cilium): leave it empty")  # fmt: skip


@dataclass(frozen=True, slots=True, repr=False)
class CiliumSettings(_Section):
    bpffs: str = setting(PATH, "/sys/fs/bpf", "The BPF filesystem Cilium pins its maps in (tc/globals/...).")
    counters: str = setting(
        CILIUM_COUNTERS,
        "combined",
        "The counter layout of Cilium's CT entries: combined (Cilium 1.16 and later) or split (1.15 and earlier); "
        "the maps do not say, and a wrong layout misreads every counter.",
    )
    clock: str = setting(
        CILIUM_CLOCK,
        "ktime",
        "Cilium's BPF clock: ktime (its default), or jiffies (bpf-clock-probe on): then an entry past its lifetime "
        "is over only when Cilium deletes it.",
    )


@dataclass(frozen=True, slots=True, repr=False)
class ExpirySettings(_Section):
    active_timeout: float = setting(POSITIVE_DURATION, 5.0, "A record every this long while a flow is active.")
    idle_timeout: float = setting(POSITIVE_DURATION, 15.0, "A flow with no packets for this long is idle.")
    stale_timeout: float = setting(POSITIVE_DURATION, 300.0, "Unused; kept so older configs load.")


@dataclass(frozen=True, slots=True, repr=False)
class KafkaSaslSettings(_Section):
    mechanism: str | None = setting(SASL_MECHANISM, None, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (SASL_*).")
    username: str | None = setting(OPTIONAL_STRING, None, "SASL user name.")
    password: str | None = setting(
        OPTIONAL_STRING, None, "SASL password; prefer the env variable or passwordFile.", secret=True
    )
    password_file: str | None = setting(OPTIONAL_PATH, None, "File holding the SASL password, read at start.")


@dataclass(frozen=True, slots=True, repr=False)
class KafkaTlsSettings(_Section):
    ca_file: str | None = setting(OPTIONAL_PATH, None, "PEM CA bundle (or directory) for the brokers; empty: system's.")
    cert_file: str | None = setting(OPTIONAL_PATH, None, "PEM client certificate for mutual TLS.")
    key_file: str | None = setting(OPTIONAL_PATH, None, "PEM private key of that certificate.")
    key_password_file: str | None = setting(OPTIONAL_PATH, None, "File holding the key's passphrase, if encrypted.")
    verify_hostname: bool = setting(BOOL, True, "Check the broker certificate matches its host name.")


@dataclass(frozen=True, slots=True, repr=False)
class KafkaSettings(_Section):
    bootstrap_servers: str = setting(STRING, "localhost:9092", "Kafka bootstrap servers, host:port[,...].")
    topic: str = setting(TOPIC, "flows", "Topic for flow records (unless a route matches).")
    routes: tuple[Route, ...] = setting(ROUTES, (), "Other topics by flowType or endReason; first match wins.")
    producer: Mapping[str, Any] = setting(MAP, {}, "librdkafka producer settings, checked by librdkafka at start.")
    allow_unsafe_producer: bool = setting(
        BOOL, False, "Accept kafka.producer settings that void the accounting (acks not all, idempotence off)."
    )
    security_protocol: str = setting(SECURITY_PROTOCOL, "PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL")
    sasl: KafkaSaslSettings = field(default_factory=KafkaSaslSettings)
    tls: KafkaTlsSettings = field(default_factory=KafkaTlsSettings)
    check_topics: bool = setting(BOOL, True, "Check at start that every topic exists.")
    ready_timeout: float = setting(
        DURATION, 120.0, "Not ready (/readyz 503) once a topic's records waited this long with no delivery; 0: never."
    )


@dataclass(frozen=True, slots=True, repr=False)
class ExportSettings(_Section):
    flows: bool = setting(BOOL, True, "Export flow records; false: only the health stream (health.topic).")
    prefix_cache: bool | None = setting(
        AUTO_BOOL,
        None,
        "Keep each active connection's encoded record prefix between its records: true, false, or auto (null, "
        "the default: on when expiry.activeTimeout is under 30 s, where records are frequent enough to pay for "
        "the memory it holds per connection; see the docs' Sizing page).",
    )


@dataclass(frozen=True, slots=True, repr=False)
class HealthSettings(_Section):
    topic: str | None = setting(OPTIONAL_TOPIC, None, "Topic for ConntrackHealth records; empty: no health stream.")
    interval: float = setting(POSITIVE_DURATION, 60.0, "Time between two ConntrackHealth records.")


@dataclass(frozen=True, slots=True, repr=False)
class MarkersSettings(_Section):
    topic: str | None = setting(OPTIONAL_TOPIC, None, "Topic for CompletenessMarker records; empty: none sent.")
    interval: float = setting(POSITIVE_DURATION, 10.0, "Time between two rounds of completeness markers.")


@dataclass(frozen=True, slots=True, repr=False)
class SchemaRegistrySettings(_Section):
    url: str | None = setting(REGISTRY_URL, None, "Schema Registry URL; set: Confluent-framed values.")
    subject_name_strategy: str = setting(
        SUBJECT_STRATEGY, "topic", "topic: subject <topic>-value per topic; record: io.flowexporter.FlowRecord."
    )
    subject: str | None = setting(SUBJECT, None, "One subject for every topic (overrides the strategy).")
    compatibility: str | None = setting(COMPATIBILITY, "BACKWARD_TRANSITIVE", "Set at start; empty: keep.")
    basic_auth_user_info: str | None = setting(
        USER_INFO, None, "user:password for the registry (a secret).", secret=True
    )


@dataclass(frozen=True, slots=True, repr=False)
class K8sSettings(_Section):
    enabled: bool = setting(BOOL, False, "Enrich records with pod, node and Service names from the API server.")
    kubeconfig: str | None = setting(
        OPTIONAL_PATH, None, "Kubeconfig file; empty: in-cluster account, else ~/.kube/config."
    )
    scope: str = setting(K8S_SCOPE, "cluster", "Pods to cache: cluster (all) or node (only this node's).")
    pod_labels: tuple[str, ...] = setting(
        LABEL_KEYS, ("app", "app.kubernetes.io/name"), "Pod label keys put in records."
    )
    deleted_pod_retention: float = setting(DURATION, 300.0, "Deleted pods' IPs still resolve for older flows.")


@dataclass(frozen=True, slots=True, repr=False)
class StateSettings(_Section):
    dir: str | None = setting(OPTIONAL_PATH, None, "Checkpoint directory: restarts continue exactly.")


@dataclass(frozen=True, slots=True, repr=False)
class LimitsSettings(_Section):
    max_connections: int = setting(_count(1), 500_000, "Cap on tracked connections.")
    max_in_flight: int = setting(_count(1), 100_000, "Cap on records awaiting Kafka's ack.")


@dataclass(frozen=True, slots=True, repr=False)
class RetrySettings(_Section):
    initial_backoff: float = setting(POSITIVE_DURATION, 0.2, "First wait after a failed dump or produce.")
    max_backoff: float = setting(POSITIVE_DURATION, 30.0, "Longest wait between retries.")

    def __post_init__(self) -> None:
        if self.max_backoff < self.initial_backoff:
            raise ConfigError("retry.maxBackoff", self.max_backoff, "must be >= retry.initialBackoff")


@dataclass(frozen=True, slots=True, repr=False)
class ShutdownSettings(_Section):
    grace: float = setting(DURATION, 30.0, "On SIGTERM: how long to keep delivering final records.")


@dataclass(frozen=True, slots=True, repr=False)
class MetricsSettings(_Section):
    address: str = setting(
        STRING,
        "127.0.0.1",
        "Address of the /metrics, /healthz, /readyz listener (the DaemonSet sets the pod's IP).",
    )
    port: int = setting(PORT, 9690, "Port of that listener; 0 turns it off.")


@dataclass(frozen=True, slots=True, repr=False)
class LogSettings(_Section):
    level: str = setting(LOG_LEVEL, "info", "debug, info, warning or error.")
    format: str = setting(LOG_FORMAT, "text", "text or json.")


@dataclass(frozen=True, slots=True, repr=False)
class Settings(_Section):
    """Every setting, typed: ``settings.kafka.topic``. ``Settings()`` holds every default;
    :func:`flow_exporter.config.load` gives the ones a file, the environment and flags set (checked, with the
    secrets of the ``*File`` settings read).

    ``secrets`` holds passwords read from files at load time, by the key of the setting they stand for; they never
    appear in ``repr()`` or :meth:`masked`.
    """

    node_name: str = setting(STRING, "", "This node's name in records; empty: $NODE_NAME, else the host name.")
    cluster_name: str = setting(STRING, "", "This cluster's name in records (clusterName); empty: null.")
    networks: NetworksSettings = field(default_factory=NetworksSettings)
    record: RecordSettings = field(default_factory=RecordSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    community_id: CommunityIdSettings = field(default_factory=CommunityIdSettings)
    conntrack: ConntrackSettings = field(default_factory=ConntrackSettings)
    cilium: CiliumSettings = field(default_factory=CiliumSettings)
    expiry: ExpirySettings = field(default_factory=ExpirySettings)
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    export: ExportSettings = field(default_factory=ExportSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    markers: MarkersSettings = field(default_factory=MarkersSettings)
    schema_registry: SchemaRegistrySettings = field(default_factory=SchemaRegistrySettings)
    k8s: K8sSettings = field(default_factory=K8sSettings)
    state: StateSettings = field(default_factory=StateSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    log: LogSettings = field(default_factory=LogSettings)
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def masked(self) -> dict[str, Any]:
        """Every setting by key, as plain YAML/JSON values, every secret (also inside kafka.producer) as ``***``."""
        return {s.key: plain(shown(s.key, s.value_in(self))) for s in SETTINGS}

    def producer_config(self) -> dict[str, Any]:
        """librdkafka settings; ``kafka.producer`` entries win over the ones derived here."""
        kafka = self.kafka
        conf: dict[str, Any] = {"bootstrap.servers": kafka.bootstrap_servers}
        protocol = kafka.security_protocol
        if protocol != "PLAINTEXT":
            conf["security.protocol"] = protocol
        if protocol.startswith("SASL_"):
            conf["sasl.mechanisms"] = kafka.sasl.mechanism
            conf["sasl.username"] = kafka.sasl.username
            conf["sasl.password"] = self.secrets.get("kafka.sasl.password", kafka.sasl.password)
        if protocol in ("SSL", "SASL_SSL"):
            tls = kafka.tls
            for path, name in (
                (tls.ca_file, "ssl.ca.location"),
                (tls.cert_file, "ssl.certificate.location"),
                (tls.key_file, "ssl.key.location"),
            ):
                if path is not None:
                    conf[name] = path
            if "kafka.tls.keyPassword" in self.secrets:
                conf["ssl.key.password"] = self.secrets["kafka.tls.keyPassword"]
            conf["ssl.endpoint.identification.algorithm"] = "https" if tls.verify_hostname else "none"
        return {**conf, **kafka.producer}


# ----------------------------------------------------------- the declarations, listed
@dataclass(frozen=True, slots=True)
class Setting:
    """One declared setting, as the loader, ``config --print-defaults``, the chart's schema and the reference
    pages see it: ``key`` (dotted, as in the file), ``env``, ``default``, ``doc``, ``kind`` (the value type's
    name), ``secret``; ``parse(key, value)`` its parser; ``path`` its attribute path in :class:`Settings`."""

    key: str
    value_type: ValueType[Any]
    default: Any
    doc: str
    secret: bool
    path: tuple[str, ...]

    @property
    def env(self) -> str:
        return ENV_PREFIX + re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", self.key).replace(".", "_").upper()

    @property
    def kind(self) -> str:
        return self.value_type.name

    @property
    def parse(self) -> Callable[[str, object], Any]:
        return self.value_type.parse

    def value_in(self, settings: Settings) -> Any:
        """This setting's value in ``settings`` (for the tools that go through every setting)."""
        value: Any = settings
        for name in self.path:
            value = getattr(value, name)
        return value


def _camel(name: str) -> str:
    """A field's name as the settings' keys spell it: ``bootstrap_servers``: ``bootstrapServers``."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)


_PREFIXES: dict[type, str] = {}  # each section class's key prefix ("kafka.tls."), for its repr


def _section_of(f: Field[Any]) -> type[_Section] | None:
    """The section class a field holds (``field(default_factory=KafkaSettings)``); None for a setting."""
    factory: object = f.default_factory
    return factory if isinstance(factory, type) and issubclass(factory, _Section) else None


def _declared(cls: type, prefix: str = "", path: tuple[str, ...] = ()) -> Iterator[Setting]:
    _PREFIXES[cls] = prefix
    for f in fields(cast(Any, cls)):
        key = prefix + _camel(f.name)
        held = _section_of(f)
        if held is not None:
            yield from _declared(held, key + ".", (*path, f.name))
        elif _VALUE_TYPE in f.metadata:
            default = f.default if f.default is not MISSING else cast(Callable[[], Any], f.default_factory)()
            meta = f.metadata
            yield Setting(key, meta[_VALUE_TYPE], default, meta[_DOC], meta[_SECRET], (*path, f.name))


SETTINGS: tuple[Setting, ...] = tuple(_declared(Settings))
BY_KEY = {s.key: s for s in SETTINGS}
DEFAULT_SETTINGS = Settings()  # every default, typed: the constructors that take a setting default to these


def settings_from(values: Mapping[str, Any]) -> Settings:
    """Settings from parsed values by key (a missing key: its default); ConfigError if they do not go together."""

    def build(cls: type, prefix: str) -> Any:
        kwargs: dict[str, Any] = {}
        for f in fields(cast(Any, cls)):
            key = prefix + _camel(f.name)
            held = _section_of(f)
            if held is not None:
                kwargs[f.name] = build(held, key + ".")
            elif _VALUE_TYPE in f.metadata and key in values:
                kwargs[f.name] = values[key]
        return cls(**kwargs)

    built: Settings = build(Settings, "")
    return built


def plain(value: object) -> object:
    """A setting's value as YAML or JSON writes it: tuples as lists, a route as its mapping."""
    if isinstance(value, Route):
        return value.as_config()
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def format_default(s: Setting) -> str:
    """A setting's default as it is written in a YAML config file: ``null``, ``true``, ``5s``, ``9690``,
    ``"flows"``, ``["app", "app.kubernetes.io/name"]`` (strings and lists in JSON form, which YAML reads as they
    are)."""
    value = s.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and s.value_type.duration:
        return f"{value:g}s"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(plain(value))


def defaults_text() -> str:
    """Every setting at its default, as a YAML config file to start from (``config --print-defaults``).

    Nested like the config file; each setting's comment says what it means and its environment
    variable. Written by hand (this module is pure, no YAML library).
    """
    lines = [
        "# flow-exporter configuration: every setting at its default.",
        "# Each can also be set by the environment variable in its comment, or with --set key=value.",
    ]
    opened: tuple[str, ...] = ()  # the sections of the last setting written
    for st in SETTINGS:  # in declaration order: a section's settings are together
        *parents, leaf = st.key.split(".")
        common = 0
        while common < min(len(parents), len(opened)) and parents[common] == opened[common]:
            common += 1
        for depth in range(common, len(parents)):
            lines.append(f"{'  ' * depth}{parents[depth]}:")
        opened = tuple(parents)
        pad = "  " * len(parents)
        lines.append(f"{pad}# {st.doc} (env {st.env})")
        lines.append(f"{pad}{leaf}: {format_default(st)}")
    return "\n".join(lines) + "\n"


# Words in a key that is not declared (librdkafka's, in kafka.producer) that make its value secret: passwords,
# inline PEM keys (ssl.key.pem, ssl_key), OAUTHBEARER and SASL/OIDC client secrets, tokens.
_SECRET_WORDS = (
    "password", "secret", "userinfo", "key.pem", "ssl_key", "oauthbearer.config", "token", "credential",
)  # fmt: skip
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def is_secret(key: str) -> bool:
    """Whether a setting's value must never be shown: the one rule for printing, errors and logs. A declared
    setting is secret as declared (``setting(..., secret=True)``); other keys (librdkafka's, in kafka.producer)
    by the words above."""
    declared = BY_KEY.get(key)
    if declared is not None:
        return declared.secret
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
