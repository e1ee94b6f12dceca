"""Pinned BPF maps, read-only, through bpf(2): open a pin, learn its shape, read every entry in batches.

Cilium keeps its connection tracking in pinned LRU hash maps (README, "Clusters running Cilium",
issue 41). Reading them takes four bpf(2) commands, written by hand with ctypes: the libraries that
wrap them for Python (bcc, libbpf bindings) need a compiler toolchain or kernel headers on the node,
which a DaemonSet image should not carry for four system calls.

* ``BPF_OBJ_GET`` with ``BPF_F_RDONLY``: the pin opened read-only, so the exporter can never change
  Cilium's state (and needs no write access to it);
* ``BPF_OBJ_GET_INFO_BY_FD``: type, key and value size, capacity, name;
* ``BPF_MAP_LOOKUP_BATCH`` (kernel 5.6 and later): up to ``batch`` entries per call, keys and values
  into two flat buffers, the cheapest way through a large map;
* ``BPF_MAP_GET_NEXT_KEY`` and ``BPF_MAP_LOOKUP_ELEM``, one entry at a time, where the kernel refuses
  batches (``EINVAL``/``ENOTSUPP``): the fallback walk.

A hash map being written while it is read has no snapshot. Batches go bucket by bucket, so an entry
present for the whole read is returned once; one added or deleted meanwhile may be returned or not.
The walk starts over from the first key when the key it stood on is deleted (the kernel's rule) and
skips the keys it already returned, so it also returns each entry at most once.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["BpfMapError", "MapInfo", "PinnedMap", "map_contains"]

# bpf(2)'s number per architecture (the image is built for both).
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280}
_MAP_LOOKUP_ELEM, _MAP_GET_NEXT_KEY, _OBJ_GET, _OBJ_GET_INFO_BY_FD, _MAP_LOOKUP_BATCH = 1, 4, 7, 15, 24
_F_RDONLY = 1 << 3
_ATTR_SIZE = 128  # larger than every union bpf_attr member used here; the kernel checks the tail is zero
_INFO_SIZE = 88  # struct bpf_map_info up to btf_value_type_id
# errno values the kernel gives when it cannot do batches on a map (ENOTSUPP is kernel-internal 524).
_NO_BATCH = {errno.EINVAL, errno.EOPNOTSUPP, 524}


class BpfMapError(OSError):
    """A bpf(2) call on a pinned map failed; the message names the map and the command."""


@dataclass(frozen=True)
class MapInfo:
    """What the kernel says a map is (``struct bpf_map_info``)."""

    type: int  # BPF_MAP_TYPE_*: 9 is LRU hash
    id: int  # the kernel's id of this map: a pin recreated (Cilium's upgrade path) is a new map, a new id
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str  # the kernel keeps the first 15 bytes
    btf_id: int  # 0 when the map was created without BTF


class _Bpf:
    """The one system call, with errno kept."""

    def __init__(self) -> None:
        number = _SYS_BPF.get(platform.machine())
        if number is None:
            raise BpfMapError(errno.ENOSYS, f"bpf(2): no syscall number known for {platform.machine()}")
        self._number = number
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall

    def __call__(self, cmd: int, attr: bytes, what: str) -> int:
        result, code, _ = self.raw(cmd, attr)
        if code:
            raise BpfMapError(code, f"{what}: {os.strerror(code)}")
        return result

    def raw(self, cmd: int, attr: bytes) -> tuple[int, int, bytes]:
        """(result, errno or 0, the attribute block as the kernel left it: some commands write back)."""
        buf = ctypes.create_string_buffer(attr, _ATTR_SIZE)
        result = int(self._syscall(self._number, cmd, buf, _ATTR_SIZE))
        return result, (ctypes.get_errno() if result < 0 else 0), buf.raw


_VALUE_ROOM = 4096  # larger than any value this module reads (a lookup writes the whole value)
_shared: _Bpf | None = None


def map_contains(fd: int, key: bytes, bpf: _Bpf | None = None) -> bool:
    """Whether the map open as ``fd`` holds ``key`` now (one ``BPF_MAP_LOOKUP_ELEM``; the kernel's lookup from a
    system call leaves an LRU map's recency alone, so asking does not keep an entry alive)."""
    global _shared
    if bpf is None:
        bpf = _shared = _shared or _Bpf()
    k = ctypes.create_string_buffer(key, len(key))
    value = ctypes.create_string_buffer(_VALUE_ROOM)
    attr = struct.pack("=IIQQQ", fd, 0, ctypes.addressof(k), ctypes.addressof(value), 0)
    _, code, _ = bpf.raw(_MAP_LOOKUP_ELEM, attr)
    if code == errno.ENOENT:
        return False
    if code:
        raise BpfMapError(code, f"lookup in map fd {fd}: {os.strerror(code)}")
    return True


class PinnedMap:
    """A pinned map opened read-only; close it (or use ``with``) to release the descriptor."""

    def __init__(self, path: str, bpf: _Bpf | None = None) -> None:
        self.path = path
        self._bpf = bpf or _Bpf()
        name = ctypes.create_string_buffer(os.fsencode(path))
        self.fd = self._bpf(_OBJ_GET, struct.pack("=QII", ctypes.addressof(name), 0, _F_RDONLY), f"open {path}")
        try:
            self.info = self._read_info()
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> PinnedMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _read_info(self) -> MapInfo:
        out = ctypes.create_string_buffer(_INFO_SIZE)
        self._bpf(_OBJ_GET_INFO_BY_FD, struct.pack("=IIQ", self.fd, _INFO_SIZE, ctypes.addressof(out)), self.path)
        kind, map_id, key_size, value_size, max_entries, flags = struct.unpack_from("=6I", out.raw, 0)
        name = out.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")
        (btf_id,) = struct.unpack_from("=I", out.raw, 64)
        return MapInfo(kind, map_id, key_size, value_size, max_entries, flags, name, btf_id)

    def batches(self, batch: int = 4096, *, walk: bool = False) -> Iterator[tuple[int, bytes, bytes]]:
        """``(count, keys, values)`` per batch: ``count`` entries, keys and values packed back to back.

        Batch lookup where the kernel offers it, else (or with ``walk``) the walk, one entry per tuple.
        """
        if not walk:
            try:
                yield from self._lookup_batches(batch)
                return
            except _BatchRefused:
                pass
        for key, value in self._walk():
            yield 1, key, value

    def items(self, batch: int = 4096, *, walk: bool = False) -> Iterator[tuple[bytes, bytes]]:
        """Every entry as ``(key, value)`` bytes (a convenience over :meth:`batches`)."""
        ks, vs = self.info.key_size, self.info.value_size
        for count, keys, values in self.batches(batch, walk=walk):
            for i in range(count):
                yield keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs]

    def _lookup_batches(self, batch: int) -> Iterator[tuple[int, bytes, bytes]]:
        ks, vs = self.info.key_size, self.info.value_size
        keys = ctypes.create_string_buffer(ks * batch)
        values = ctypes.create_string_buffer(vs * batch)
        token = ctypes.create_string_buffer(max(ks, 8) * 2)  # in_batch, then out_batch
        half = len(token.raw) // 2
        started = False
        while True:
            in_batch = ctypes.addressof(token) if started else 0
            # in_batch, out_batch, keys, values (u64 each), then count (in: room; out: filled) and map_fd
            attr = struct.pack(
                "=QQQQIIQQ", in_batch, ctypes.addressof(token) + half, ctypes.addressof(keys),
                ctypes.addressof(values), batch, self.fd, 0, 0,
            )  # fmt: skip
            _, code, after = self._bpf.raw(_MAP_LOOKUP_BATCH, attr)
            (count,) = struct.unpack_from("=I", after, 32)
            if code and code != errno.ENOENT:
                if code in _NO_BATCH and not started:
                    raise _BatchRefused
                if code == errno.ENOSPC:  # one hash bucket holds more than a batch: a bigger one
                    batch *= 2
                    keys = ctypes.create_string_buffer(ks * batch)
                    values = ctypes.create_string_buffer(vs * batch)
                    continue
                raise BpfMapError(code, f"batch lookup in {self.path}: {os.strerror(code)}")
            if count:
                yield count, keys.raw[: count * ks], values.raw[: count * vs]
            if code == errno.ENOENT:  # the end of the map (with the last entries, if any)
                return
            ctypes.memmove(token, ctypes.addressof(token) + half, half)
            started = True

    def _walk(self) -> Iterator[tuple[bytes, bytes]]:
        """One key after the other. When the key it stands on is deleted meanwhile, the kernel answers
        the next-key call with the map's first key: the walk starts over, so keys already given are
        skipped (a set of them, kept only on this fallback path)."""
        ks, vs = self.info.key_size, self.info.value_size
        key = ctypes.create_string_buffer(ks)
        nxt = ctypes.create_string_buffer(ks)
        value = ctypes.create_string_buffer(vs)
        seen: set[bytes] = set()
        first = True
        while True:
            attr = struct.pack("=IIQQ", self.fd, 0, 0 if first else ctypes.addressof(key), ctypes.addressof(nxt))
            try:
                self._bpf(_MAP_GET_NEXT_KEY, attr, f"next key in {self.path}")
            except BpfMapError as exc:
                if exc.errno == errno.ENOENT:
                    return
                raise
            first = False
            ctypes.memmove(key, nxt, ks)
            if key.raw in seen:
                continue
            attr = struct.pack("=IIQQQ", self.fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0)
            try:
                self._bpf(_MAP_LOOKUP_ELEM, attr, f"lookup in {self.path}")
            except BpfMapError as exc:
                if exc.errno == errno.ENOENT:  # deleted between the two calls
                    continue
                raise
            seen.add(key.raw)
            yield key.raw, value.raw


class _BatchRefused(Exception):
    """The kernel does no batch lookups on this map: walk it."""
