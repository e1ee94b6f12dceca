"""Config values fuzzed: any value for any key is accepted or refused with exit code 2 naming the key."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flow_exporter.cli import main
from flow_exporter.config import SETTINGS, ConfigError, load

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["5s", "-1s", "1m", "0", "1e309", "nan", "PLAINTEXT", "all", "1,2", "0x10", "9999999999999h"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
keys = st.sampled_from([s.key for s in SETTINGS])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys, values)
def test_any_value_is_accepted_or_names_the_key(key: str, value: object) -> None:
    try:
        load(None, environ={}, overrides={key: value})
    except ConfigError as exc:
        assert exc.key.startswith(key.split(".")[0]) or exc.key.startswith("retry"), (exc.key, key)
        assert key in str(exc) or exc.key in str(exc)


@settings(max_examples=150, deadline=None)
@given(keys, values)
def test_cli_exits_0_or_2_never_a_traceback(key: str, value: object) -> None:
    raw = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["config", "--print", "--set", f"{key}={raw}"])
    assert rc in (0, 2)
    if rc == 2:
        assert key in err.getvalue() or "retry" in err.getvalue()


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=12), values, max_size=4))
def test_fuzzed_yaml_files(tmp_path_factory, doc: dict) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path_factory.mktemp("cfg") / "c.yaml"
    f.write_text(yaml.safe_dump(doc))
    try:
        load(f, environ={})
    except ConfigError as exc:
        assert exc.key
