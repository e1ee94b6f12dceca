"""Exceptions of the conntrack source.

All are `OSError`s carrying the errno, so callers may treat them as I/O errors; the
subclasses tell apart what to do: retry (after a backoff), or stop and fix the host (`fatal`:
a missing capability, module or namespace, which no retry can fix). `is_fatal` is the one rule
the poll loop follows.
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
    "is_fatal",
]


class ConntrackError(OSError):
    """A conntrack netlink operation failed: retried with a backoff unless ``fatal``."""

    fatal = False

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(errno, message)


class ConntrackPermissionError(ConntrackError):
    """EPERM/EACCES: reading conntrack needs CAP_NET_ADMIN (in the netns' user namespace)."""

    fatal = True


class ConntrackUnavailable(ConntrackError):
    """ENOENT/EPROTONOSUPPORT/EOPNOTSUPP: nf_conntrack(_netlink) is not loaded."""

    fatal = True


class ConntrackOverrun(ConntrackError):
    """ENOBUFS: the kernel dropped dump data; the dump is incomplete, retry it."""


class ConntrackDumpInterrupted(ConntrackError):
    """EINTR, or NLM_F_DUMP_INTR on a reply: the dump may be inconsistent, retry it."""


class NetnsError(ConntrackError):
    """The network namespace could not be opened or entered."""

    fatal = True


def is_fatal(exc: BaseException) -> bool:
    """Whether no retry can fix ``exc``: stop and say what the host lacks (every other error is retried)."""
    return isinstance(exc, ConntrackError) and exc.fatal


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
