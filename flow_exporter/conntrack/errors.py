"""Exceptions of the conntrack source.

All are `OSError`s carrying the errno, so callers may treat them as I/O errors; the
subclasses tell apart what to do: retry now (`retryable`), or fix the host.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "ConntrackDumpInterrupted",
    "ConntrackError",
    "ConntrackOverrun",
    "ConntrackPermissionError",
    "ConntrackUnavailable",
    "NetnsError",
    "error_from_errno",
]


class ConntrackError(OSError):
    """A conntrack netlink operation failed."""

    retryable = False

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(errno, message)


class ConntrackPermissionError(ConntrackError):
    """EPERM/EACCES: reading conntrack needs CAP_NET_ADMIN (in the netns' user namespace)."""


class ConntrackUnavailable(ConntrackError):
    """ENOENT/EPROTONOSUPPORT/EOPNOTSUPP: nf_conntrack(_netlink) is not loaded."""


class ConntrackOverrun(ConntrackError):
    """ENOBUFS: the kernel dropped dump data; the dump is incomplete, retry it."""

    retryable = True


class ConntrackDumpInterrupted(ConntrackError):
    """EINTR, or NLM_F_DUMP_INTR on a reply: the dump may be inconsistent, retry it."""

    retryable = True


class NetnsError(ConntrackError):
    """The network namespace could not be opened or entered."""


_UNAVAILABLE = {_errno.ENOENT, _errno.EPROTONOSUPPORT, _errno.EOPNOTSUPP, _errno.EAFNOSUPPORT}


def error_from_errno(err: int, what: str) -> ConntrackError:
    """The exception for `err` raised while doing `what` (e.g. "conntrack dump in netns x")."""
    text = os.strerror(err)
    if err in (_errno.EPERM, _errno.EACCES):
        return ConntrackPermissionError(err, f"{what}: {text}: needs CAP_NET_ADMIN")
    if err in _UNAVAILABLE:
        return ConntrackUnavailable(
            err, f"{what}: {text}: conntrack module not loaded (nf_conntrack, nf_conntrack_netlink)"
        )
    if err == _errno.ENOBUFS:
        return ConntrackOverrun(err, f"{what}: {text}: receive buffer overrun, dump incomplete; retry")
    if err == _errno.EINTR:
        return ConntrackDumpInterrupted(err, f"{what}: {text}: dump interrupted; retry")
    return ConntrackError(err, f"{what}: {text}")
