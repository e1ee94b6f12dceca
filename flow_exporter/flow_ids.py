"""The connectionId sequence's rule, written once (issue 39): where the next id comes from, and the id at a position.

:class:`flow_exporter.flow.IdAllocator` says why ids are allocated and why this sequence (a Weyl sequence through
SplitMix64's finalizer); the store's compiled admission (flow_exporter/admission.py) allocates from the same
position in bulk. Cython's pure-Python mode: compiled, a few integer operations; interpreted, the same ones
masked to 64 bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["id_at", "step"]

_MASK: cython.ulonglong = 0xFFFFFFFFFFFFFFFF
_GOLDEN: cython.ulonglong = 0x9E3779B97F4A7C15  # odd: the Weyl sequence visits every 64-bit value once
_MIX1: cython.ulonglong = 0xBF58476D1CE4E5B9  # SplitMix64's multipliers (typed: C arithmetic, compiled)
_MIX2: cython.ulonglong = 0x94D049BB133111EB


def step(position: cython.ulonglong) -> cython.ulonglong:
    """The sequence's next position (the previous plus the odd step, modulo 2**64)."""
    return (position + _GOLDEN) & _MASK


def id_at(position: cython.ulonglong) -> cython.longlong:
    """The id at ``position``: SplitMix64's finalizer, a bijection on 64-bit values, as a signed 64-bit value."""
    x: cython.ulonglong = position
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    x ^= x >> 31
    signed: cython.longlong
    if cython.compiled:  # noqa: SIM108  (the other branch would not compile)
        signed = cython.cast(cython.longlong, x)
    else:
        signed = x - (1 << 64) if x >> 63 else x
    return signed
