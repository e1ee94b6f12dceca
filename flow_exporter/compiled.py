"""The one place that chooses between the compiled and the interpreted build of the hot modules (issue 39).

The hot modules are Python sources in Cython's pure-Python mode (``setup.py`` lists them): a build with
Cython and a C compiler compiles each into an extension module of the same name, which Python's import
system prefers to the source beside it; a build without leaves the sources, which run interpreted (same
results, slower). The choice is made once, here, at import: ``FLOW_EXPORTER_INTERPRETED=1`` forces the
interpreted sources (tests, debugging) and turns the hand-written C (``_native``) off with them.
Components are handed what this module loaded; they never ask which build it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["INTERPRETED_ENV", "forced_interpreted", "interpreted", "is_compiled", "load"]

INTERPRETED_ENV = "FLOW_EXPORTER_INTERPRETED"
_PACKAGE = Path(__file__).parent
log = logging.getLogger(__name__)


def forced_interpreted() -> bool:
    return os.environ.get(INTERPRETED_ENV, "") not in ("", "0")


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` is an extension module (compiled), not a Python source."""
    return not str(getattr(module, "__file__", "")).endswith(".py")


def interpreted(name: str, *, as_name: str | None = None) -> ModuleType:
    """``flow_exporter.<name>`` from its Python source, whether or not a compiled build is there.

    ``as_name``: load it under another module name, beside the compiled one (the tests that hold the two
    builds of one source to the same results); else it is registered as ``flow_exporter.<name>``.
    """
    qualified = as_name or f"{__package__}.{name}"
    spec = importlib.util.spec_from_file_location(qualified, _PACKAGE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module  # before it runs: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load(name: str) -> ModuleType:
    """``flow_exporter.<name>``: compiled when built and not forced off, else interpreted."""
    qualified = f"{__package__}.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    if forced_interpreted():
        return interpreted(name)
    return importlib.import_module(qualified)


_heap = load("deadline_heap")
COMPILED = is_compiled(_heap) and not forced_interpreted()
"""Whether the compiled build is running (logged at start; ``flow_exporter_build_info``-style facts)."""
if not COMPILED and not forced_interpreted():
    log.info("the compiled modules are not built (no C compiler or no Cython at install): running interpreted")
