"""What the broker, Spark and Flink jar fetchers share: running ``mvn``, caching what it resolved, one-line errors."""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

MVN_TIMEOUT = 900.0
# Signs in Maven's output that Maven Central could not be reached (as opposed to a bad pom).
NETWORK_HINTS = (
    "Could not transfer",
    "UnknownHostException",
    "Connection refused",
    "Connect timed out",
    "Network is unreachable",
    "No route to host",
    "Temporary failure in name resolution",
    "Could not resolve host",
    "transfer failed",
)
# Maven 3.8 colours its output even with -B.
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def mvn_failure(output: str, log: Path, what: str) -> str:
    """A one-line reason for a failed ``mvn`` run fetching ``what``, telling a network problem from the rest."""
    lines = [ln.strip() for ln in output.splitlines()]
    errors = [ln.removeprefix("[ERROR]").strip() for ln in lines if ln.startswith("[ERROR]")]
    first = next((e for e in errors if e), lines[-1] if lines else "no output")[:300]
    if any(hint in output for hint in NETWORK_HINTS):
        return f"cannot reach Maven Central to fetch {what} ({first}); log: {log}"
    return f"mvn could not resolve {what} ({first}); log: {log}"


MARKER = ".complete"
# Full coordinates: a bare "dependency:" prefix needs plugin-group metadata first (see kafka.py).
DEPENDENCY_LIST = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:list"

Resolved = list[tuple[str, str, Path]]  # (artifactId, version, file)


def parse_dependency_list(text: str) -> Resolved:
    """(artifactId, version, file) from ``dependency:list`` output with absolute file names.

    Lines look like ``g:a:jar:v:scope:/path/a-v.jar`` or ``g:a:jar:classifier:v:scope:/path``,
    possibly followed by `` -- module name``.
    """
    out = []
    for line in text.splitlines():
        token = line.strip().split(" ", 1)[0]
        parts = token.split(":")
        if len(parts) < 6 or not parts[-1].endswith(".jar"):
            continue
        out.append((parts[1], parts[-3], Path(parts[-1])))
    return out


def cached_jars(jars_dir: Path, digest: str) -> list[Path] | None:
    """The jars of a completed resolution for ``digest`` (marker: digest, then the names), else None."""
    marker = jars_dir / MARKER
    if not (marker.is_file() and marker.read_text().splitlines()[:1] == [digest]):
        return None
    jars = [jars_dir / name for name in marker.read_text().splitlines()[1:]]
    return jars if all(j.is_file() for j in jars) else None


def resolve_jars(
    pom: Path,
    properties: Sequence[str],
    jars_dir: Path,
    digest: str,
    what: str,
    select: Callable[[Resolved, Path], Resolved],
) -> list[Path]:
    """Resolve ``pom``'s dependencies with Maven once into ``jars_dir``; the jars ``select`` keeps.

    ``select(resolved, log)`` checks what Maven resolved (raising RuntimeError with one line) and
    returns the jars to keep. The marker (written last: ``digest``, then the jar names) says a
    previous run completed, so an interrupted run is redone rather than trusted; a file lock lets
    parallel runs share one download. Raises RuntimeError with one line when Maven is missing or fails.
    """
    done = cached_jars(jars_dir, digest)
    if done is not None:
        return done
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError(
            f"mvn (Apache Maven) is not on PATH; it is needed once to fetch {what} (Debian package 'maven')"
        )
    jars_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(jars_dir.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = cached_jars(jars_dir, digest)
        if done is not None:
            return done
        staging = Path(tempfile.mkdtemp(prefix="jars.", dir=jars_dir.parent))
        log = jars_dir.parent / "mvn.log"
        listing = staging / "dependencies.txt"
        cmd = [
            mvn, "-B", "-Dstyle.color=never", "-f", str(pom), *properties, DEPENDENCY_LIST,
            # The engine itself would be "provided" by any cluster; here the pip package provides it.
            "-DexcludeScope=provided", f"-DoutputFile={listing}",
            "-DoutputAbsoluteArtifactFilename=true", "-DappendOutput=false",
        ]  # fmt: skip
        try:
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=MVN_TIMEOUT, check=False, stdin=subprocess.DEVNULL
                )
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(
                    f"mvn took over {MVN_TIMEOUT:.0f}s fetching {what} (is Maven Central reachable?)"
                ) from exc
            output = ANSI.sub("", proc.stdout + proc.stderr)
            log.write_text(output)
            if proc.returncode != 0 or not listing.is_file():
                raise RuntimeError(mvn_failure(output, log, what))
            kept = []
            for _, _, path in select(parse_dependency_list(listing.read_text()), log):
                shutil.copy2(path, staging / path.name)
                kept.append(path.name)
            listing.unlink()
            staging.chmod(0o755)  # mkdtemp made it private; the cache may be shared
            shutil.rmtree(jars_dir, ignore_errors=True)
            staging.rename(jars_dir)
            (jars_dir / MARKER).write_text("\n".join([digest, *sorted(kept)]) + "\n")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return [jars_dir / name for name in sorted(kept)]


def fetch_command(name: str, ensure: Callable[[str | None], list[Path]], version: str | None) -> int:
    """The ``fetch`` command of a jar fetcher: resolve (once), list the jars and their size; 1 on failure."""
    t0 = time.monotonic()
    try:
        jars = ensure(version)
    except RuntimeError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    size = sum(j.stat().st_size for j in jars)
    for jar in jars:
        print(jar)
    print(f"{len(jars)} jars, {size / 2**20:.1f} MiB ({time.monotonic() - t0:.1f}s)")
    return 0
