"""Whether a connection is over while still in the table: Antrea's rule, written once (issue 39).

TCP is over in TIME_WAIT or CLOSE; any other protocol, or TCP without a state, when the kernel set the
DYING status bit. The store reads it for a row that moved (its record need not wait for a timeout) and the
due loop for a slot that comes due (its record is the end of the flow). Compiled (Cython, pure-Python
mode) it is a C call from the compiled due loop (``ledger_core``); interpreted, the same function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flow_exporter.connection import IPS_DYING, PROTO_TCP, TCP_CLOSE, TCP_TIME_WAIT

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["NO_TCP_STATE", "is_dying"]

NO_TCP_STATE = -1  # tcp_state of an entry the kernel gave no TCP state (the store's column holds the same)
_PROTO_TCP: cython.int = PROTO_TCP
_TIME_WAIT: cython.int = TCP_TIME_WAIT
_CLOSE: cython.int = TCP_CLOSE
_IPS_DYING: cython.uint = IPS_DYING


def is_dying(proto: cython.int, tcp_state: cython.int, status: cython.uint) -> cython.bint:
    """Whether the entry is over: ``tcp_state`` is :data:`NO_TCP_STATE` when the kernel gave none."""
    if proto == _PROTO_TCP and tcp_state >= 0:
        return tcp_state in (_TIME_WAIT, _CLOSE)
    return (status & _IPS_DYING) != 0
