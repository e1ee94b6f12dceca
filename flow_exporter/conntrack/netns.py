"""Run a function inside another network namespace without moving the process.

setns(CLONE_NEWNET) changes only the calling thread, so a short-lived thread enters the
target namespace, runs the function (create a socket, open a /proc/sys file) and ends;
the caller's threads stay where they are. A socket keeps the namespace it was created in.
/proc/sys/net is resolved against the *current thread's* namespace (checked on kernel
6.18: the thread sees the target's nf_conntrack_count), unlike /proc/net, which follows
the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from flow_exporter.conntrack.errors import NetnsError

__all__ = ["current_netns_inode", "netns_path", "run_in_netns"]

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/var/run/netns"

_libc: Any = None


def netns_path(netns: str) -> str:
    """A name means /var/run/netns/<name>; anything with a slash is a path (/proc/PID/ns/net)."""
    if "/" in netns:
        return netns
    if not netns or netns in (".", ".."):
        raise NetnsError(errno.EINVAL, f"invalid network namespace name {netns!r}")
    return os.path.join(NETNS_RUN_DIR, netns)


def current_netns_inode() -> int:
    """Inode of the calling thread's network namespace."""
    return os.stat("/proc/thread-self/ns/net").st_ino


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, CLONE_NEWNET)
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def run_in_netns(netns: str | None, fn: Callable[[], T]) -> T:
    """`fn()` run in network namespace `netns` (None: here, in the calling thread)."""
    if netns is None:
        return fn()
    path = netns_path(netns)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(e.errno or 0, f"cannot open network namespace {path}: {e.strerror}") from e
    target = os.fstat(fd).st_ino
    before = current_netns_inode()
    box: dict[str, Any] = {}

    def worker() -> None:
        try:
            try:
                _setns(fd)
            except OSError as e:
                raise NetnsError(e.errno or 0, f"setns({path}): {e.strerror}") from e
            if current_netns_inode() != target:
                raise NetnsError(0, f"setns({path}) did not take effect")
            box["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    try:
        th = threading.Thread(target=worker, name=f"netns-{netns}", daemon=True)
        th.start()
        th.join()
    finally:
        os.close(fd)
    if current_netns_inode() != before:  # would mean setns leaked out of the worker thread
        raise NetnsError(0, "the caller's network namespace changed")
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result
