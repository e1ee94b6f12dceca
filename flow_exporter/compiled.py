"""The one place that chooses between the compiled and the interpreted build of the hot modules (issue 39).

The hot modules are Python sources in Cython's pure-Python mode (a ``.py`` with its ``.pxd``): a build with
Cython and a C compiler compiles each into an extension module of the same name, which Python's import
system prefers to the source beside it; a build without leaves the sources, which run interpreted (same
results, slower). The choice is made once, here, at import: ``FLOW_EXPORTER_INTERPRETED=1`` forces the
interpreted sources (tests, debugging).
Components are handed what this module loaded; they never ask which build it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "COMPILED", "INTERPRETED_ENV", "MODULES", "NOT_BUILT", "describe", "forced_interpreted", "interpreted",
    "is_compiled", "load", "reference",
]  # fmt: skip

INTERPRETED_ENV = "FLOW_EXPORTER_INTERPRETED"
_PACKAGE = Path(__file__).parent


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


def reference(name: str) -> ModuleType:
    """The interpreted build of ``flow_exporter.<name>``, loaded once beside whichever build runs (a component's
    ``compiled=False`` test seam takes it, so the lockstep tests hold the two builds of one source together)."""
    qualified = f"{__package__}._interpreted_{name}"
    return sys.modules.get(qualified) or interpreted(name, as_name=qualified)


def load(name: str) -> ModuleType:
    """``flow_exporter.<name>``: compiled when built and not forced off, else interpreted (a plain import does the
    same: the choice is this module's, made when the package is imported)."""
    return importlib.import_module(f"{__package__}.{name}")


# The Cython-compiled sources: a .py with its .pxd beside it (setup.py compiles them; the wheel carries both).
MODULES = tuple(sorted(p.stem for p in _PACKAGE.glob("*.pxd")))


def _built(name: str) -> bool:
    """Whether ``flow_exporter.<name>`` has a compiled build installed (found, not imported)."""
    spec = importlib.util.find_spec(f"{__package__}.{name}")
    return spec is not None and not str(spec.origin).endswith(".py")


NOT_BUILT = tuple(m for m in MODULES if not _built(m))
COMPILED = bool(MODULES) and not NOT_BUILT and not forced_interpreted()
"""Whether the compiled build of every hot module is the one running (the start-up line says which)."""


class _Sources(importlib.abc.MetaPathFinder):
    """With ``FLOW_EXPORTER_INTERPRETED`` set: every import of a hot module finds its Python source, never its
    extension module. One finder, placed when the package is imported (flow_exporter/__init__.py), so a plain
    ``from flow_exporter.export import Export`` anywhere gets the chosen build; nothing depends on import order."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, _PACKAGE / f"{name}.py")


if forced_interpreted() and not any(isinstance(f, _Sources) for f in sys.meta_path):
    sys.meta_path.insert(0, _Sources())


def describe() -> str:
    """The build that runs, for the exporter's start-up line: an install without a C compiler (or without Cython)
    runs the interpreted sources, the same records at a higher CPU cost, and the operator should be told."""
    if forced_interpreted():
        return f"interpreted ({INTERPRETED_ENV}=1)"
    if NOT_BUILT:
        return (
            f"interpreted ({', '.join(NOT_BUILT)} not compiled at install: no C compiler or no Cython; "
            "the same records at a higher CPU cost)"
        )
    return "compiled"
