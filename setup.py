"""The compiled modules (issue 39): Cython-compiled Python sources; no hand-written C is left.

``CYTHON_MODULES`` are the Python sources (Cython's pure-Python mode) compiled here, found by their ``.pxd``; each
also runs interpreted, and ``flow_exporter.compiled`` chooses at import. Everything compiled is optional:
without a C compiler the build goes on without it, and the interpreted sources run (same results, slower).
``FLOW_EXPORTER_REQUIRE_COMPILED=1`` (the image build) makes a module that does not build an error instead.
The project's metadata is in pyproject.toml.
"""

from __future__ import annotations

import glob
import os

from setuptools import Extension, setup

# A Cython-compiled source is a .py with its .pxd (the C types) beside it: the .pxd files are the list.
CYTHON_MODULES = sorted(p[:-4] + ".py" for p in glob.glob("flow_exporter/*.pxd"))
REQUIRED = os.environ.get("FLOW_EXPORTER_REQUIRE_COMPILED") == "1"


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        if REQUIRED:
            raise SystemExit("FLOW_EXPORTER_REQUIRE_COMPILED=1, but Cython is not installed") from None
        return []
    cython = [
        Extension(path[:-3].replace("/", "."), [path], optional=not REQUIRED, extra_compile_args=["-O2"])
        for path in CYTHON_MODULES
    ]
    compiled = cythonize(cython, language_level=3, quiet=True)
    for ext in compiled:  # cythonize makes new Extensions and does not carry `optional` over
        ext.optional = not REQUIRED
    return compiled


setup(ext_modules=extensions())
