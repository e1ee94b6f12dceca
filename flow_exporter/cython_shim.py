"""What the Cython-compiled modules' sources take from ``cython`` when Cython is not installed.

The hot modules (``deadline_heap`` ...) are Python sources in Cython's pure-Python mode: compiled where
the build had Cython and a C compiler, interpreted elsewhere (``flow_exporter.compiled`` chooses). Running
interpreted they only need these no-op decorators and ``compiled = False``, so an install without a
compiler does not need Cython at run time. Cython's own ``Shadow`` module is the full version.
"""

from __future__ import annotations

import builtins
import dataclasses as dataclasses  # cython.dataclasses.dataclass: the standard one, interpreted
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

_T = TypeVar("_T")

compiled = False
NULL: Any = None  # a C null pointer: only ever used in a source's `if cython.compiled:` branch

# The C types the sources annotate with, as the Python types they hold when interpreted (for mypy; at run
# time the annotations are never evaluated: the sources postpone them).
int: TypeAlias = builtins.int
uint: TypeAlias = builtins.int
uchar: TypeAlias = builtins.int
ushort: TypeAlias = builtins.int
long: TypeAlias = builtins.int
longlong: TypeAlias = builtins.int
ulonglong: TypeAlias = builtins.int
Py_ssize_t: TypeAlias = builtins.int
bint: TypeAlias = bool
double: TypeAlias = float
p_char: TypeAlias = bytes  # pointers: only ever cast to in a source's `if cython.compiled:` branch
p_const_char: TypeAlias = bytes
p_uchar: TypeAlias = bytearray  # stored through, so a mutable buffer


def _same(x: _T) -> _T:
    return x


def _directive(_value: bool = True) -> Callable[[_T], _T]:
    return _same


cclass = cfunc = ccall = inline = final = no_gc = _same
boundscheck = wraparound = cdivision = initializedcheck = _directive


def cast(_type: Any, value: Any) -> Any:
    return value


def address(value: Any) -> Any:
    return value
