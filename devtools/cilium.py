"""Cilium's own code for the tests of the Cilium source (issue 41): ``ctwriter``, per pinned Cilium release.

The Cilium source reads Cilium's BPF connection-tracking maps. Its tests must not write those maps
with the reader's idea of their layout, so ``tools/cilium/ctwriter.go`` is built against each pinned
``github.com/cilium/cilium`` release (``tools/cilium/v1.15``, ``tools/cilium/v1.20``: a go.mod, its
go.sum and the one call whose name changed between them) and writes and dumps the maps with that
release's ``pkg/maps/ctmap`` types and ``pkg/bpf`` code. v1.15 is the last layout with per-direction
counters (rx/tx packets and bytes in the value's first 32 bytes); from v1.16 the value holds one
packets/bytes pair for both directions at offsets 16 and 24, same size.

The binaries are built once into ``<repo>/.cache/cilium/<release>/ctwriter`` (``FLOW_EXPORTER_CACHE``
replaces ``<repo>/.cache``) from the Go module proxy: about 30 s (v1.15.19) and 50 s (v1.20.2) cold on
two cores, the modules downloaded included.

Cilium looks for its maps under the first bpf filesystem in ``/proc/self/mountinfo`` (``tc/globals``
below it), so :func:`run_ctwriter` runs the program in a mount namespace of its own where every other
bpf mount is gone and only the test's private one (:class:`Bpffs`, mounted in the root namespace, so
the pins outlive the program and the reader sees them) is left.

Command line: ``python -m devtools.cilium build`` builds both and prints their paths.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["RELEASES", "Bpffs", "ctwriter", "run_ctwriter"]

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools" / "cilium"
# Layout directory -> the Cilium release its go.mod pins.
RELEASES = {"v1.15": "v1.15.19", "v1.20": "v1.20.2"}


def _cache(release: str) -> Path:
    base = os.environ.get("FLOW_EXPORTER_CACHE")
    return (Path(base) if base else ROOT / ".cache") / "cilium" / release


def _sources(layout: str) -> list[Path]:
    return [TOOLS / "ctwriter.go", *sorted((TOOLS / layout).iterdir())]


def ctwriter(layout: str, timeout: float = 1500) -> Path:
    """``ctwriter`` built against the release of ``tools/cilium/<layout>`` (once; rebuilt when a source changes)."""
    if layout not in RELEASES:
        raise ValueError(f"no Cilium layout {layout!r}; known: {', '.join(RELEASES)}")
    out = _cache(RELEASES[layout])
    binary, marker = out / "ctwriter", out / "ctwriter.sources"
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in _sources(layout))).hexdigest()
    if binary.is_file() and marker.is_file() and marker.read_text() == digest:
        return binary
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ctwriter-") as build:
        for src in _sources(layout):
            shutil.copy2(src, Path(build) / src.name)
        proc = subprocess.run(
            ["go", "build", "-mod=mod", "-o", str(binary), "."],
            cwd=build,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"building ctwriter against cilium {RELEASES[layout]} failed:\n{proc.stderr[-4000:]}")
    marker.write_text(digest)
    return binary


class Bpffs:
    """A private bpf filesystem mounted (in the root mount namespace) on a new temporary directory."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="bpffs-"))
        self._mounted = False

    @property
    def globals(self) -> Path:
        """Where Cilium pins its global maps: ``<bpffs>/tc/globals``."""
        return self.path / "tc" / "globals"

    def __enter__(self) -> Bpffs:
        subprocess.run(["mount", "-t", "bpf", "bpf", str(self.path)], check=True, capture_output=True)
        self._mounted = True
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self._mounted = False
        shutil.rmtree(self.path, ignore_errors=True)


# Inside the new mount namespace: unmount every bpf filesystem but the test's, then run the program.
_ONLY_OURS = (
    "for m in $(awk '$9 == \"bpf\" {print $5}' /proc/self/mountinfo); do "
    '[ "$m" = "$BPFFS" ] || umount -l "$m"; done; exec "$@"'
)


def run_ctwriter(binary: Path, bpffs: Bpffs, *args: str, stdin: str | None = None, timeout: float = 600) -> str:
    """Run ``ctwriter`` with ``bpffs`` as the only bpf filesystem it can see; its standard output."""
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", _ONLY_OURS, "ctwriter", str(binary), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "BPFFS": str(bpffs.path)},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ctwriter {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.cilium", description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=("build",))
    ap.parse_args(argv)
    for layout, release in RELEASES.items():
        print(f"cilium {release}: {ctwriter(layout)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
