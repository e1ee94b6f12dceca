"""The Spark connector jars (Kafka source, Avro functions) that the pyspark wheel does not ship.

``downstream/spark_flows.py`` runs Spark in local mode from the pip package. That package carries
Spark, Scala and their libraries in ``pyspark/jars`` but neither ``spark-sql-kafka-0-10`` nor
``spark-avro``. Resolving them with ``spark.jars.packages`` would need Ivy and the network at every
start, so instead Maven resolves them once (``tools/spark/pom.xml``) into
``<repo>/.cache/spark/<version>/jars``, and the job passes those files in ``spark.jars``.

Only jars whose artifact pyspark does not already have are kept: a second, older copy of
scala-library or slf4j-api on the class path would shadow or clash with pyspark's own. The
version is the installed pyspark's, because connector and Spark versions must match exactly.

Command line: ``python -m devtools.spark fetch`` (resolve, print the jars).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools.maven import ANSI, MVN_TIMEOUT, mvn_failure

__all__ = ["SCALA_BINARY", "cache_dir", "ensure_spark_jars", "pyspark_jars_dir", "spark_version"]

SCALA_BINARY = "2.13"

_REPO_ROOT = Path(__file__).resolve().parents[1]
_POM = _REPO_ROOT / "tools" / "spark" / "pom.xml"
_MARKER = ".complete"
# Full coordinates: a bare "dependency:" prefix needs plugin-group metadata first (see kafka.py).
_LIST = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:list"


def spark_version() -> str:
    """The installed pyspark's version; the connectors must be resolved for exactly this one."""
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("pyspark is not installed (pip install pyspark); the Spark job needs it") from None


def pyspark_jars_dir() -> Path:
    """``pyspark/jars`` of the installed package, found without importing pyspark (and py4j)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pyspark is not installed (pip install pyspark); the Spark job needs it")
    jars = Path(next(iter(spec.submodule_search_locations))) / "jars"
    if not jars.is_dir():
        raise RuntimeError(f"pyspark has no jars directory at {jars}; reinstall pyspark")
    return jars


def cache_dir(version: str | None = None) -> Path:
    """``<repo>/.cache/spark/<version>``; ``FLOW_EXPORTER_CACHE`` replaces ``<repo>/.cache``."""
    base = os.environ.get("FLOW_EXPORTER_CACHE")
    root = Path(base) if base else _REPO_ROOT / ".cache"
    return root / "spark" / (version or spark_version())


def _digest(version: str, shipped: set[str]) -> str:
    """What a cache was made from: editing the pom or reinstalling pyspark re-resolves."""
    h = hashlib.sha256(_POM.read_bytes())
    h.update(version.encode())
    h.update("\n".join(sorted(shipped)).encode())
    return h.hexdigest()


def _shipped_artifacts(jars: Path) -> set[str]:
    """File names in pyspark/jars, for the "does pyspark already have artifact X" test."""
    return {p.name for p in jars.glob("*.jar")}


def _has_artifact(shipped: set[str], artifact: str) -> bool:
    """True when some shipped jar is ``<artifact>-<version>.jar`` (any version)."""
    prefix = artifact + "-"
    return any(name.startswith(prefix) and name[len(prefix) : len(prefix) + 1].isdigit() for name in shipped)


def _parse_list(text: str) -> list[tuple[str, str, Path]]:
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


def _complete(jars_dir: Path, digest: str) -> list[Path] | None:
    marker = jars_dir / _MARKER
    if not (marker.is_file() and marker.read_text().splitlines()[:1] == [digest]):
        return None
    jars = [jars_dir / name for name in marker.read_text().splitlines()[1:]]
    return jars if all(j.is_file() for j in jars) else None


def ensure_spark_jars(version: str | None = None) -> list[Path]:
    """Resolve the connectors for ``version`` (default: installed pyspark) once; return the jars.

    The marker (written last: pom digest, then the jar names) says a previous run completed, so
    an interrupted run is redone rather than trusted; a file lock lets parallel runs share one
    download. Raises RuntimeError with one line when Maven is missing or fails.
    """
    version = version or spark_version()
    shipped = _shipped_artifacts(pyspark_jars_dir())
    digest = _digest(version, shipped)
    jars_dir = cache_dir(version) / "jars"
    done = _complete(jars_dir, digest)
    if done is not None:
        return done
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError(
            "mvn (Apache Maven) is not on PATH; it is needed once to fetch the Spark connector jars "
            "(Debian package 'maven')"
        )
    jars_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(jars_dir.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = _complete(jars_dir, digest)
        if done is not None:
            return done
        staging = Path(tempfile.mkdtemp(prefix="jars.", dir=jars_dir.parent))
        log = jars_dir.parent / "mvn.log"
        listing = staging / "dependencies.txt"
        cmd = [
            mvn,
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(_POM),
            f"-Dspark.version={version}",
            f"-Dscala.binary.version={SCALA_BINARY}",
            _LIST,
            # Spark itself would be "provided" by any cluster; here pyspark/jars provides it.
            "-DexcludeScope=provided",
            f"-DoutputFile={listing}",
            "-DoutputAbsoluteArtifactFilename=true",
            "-DappendOutput=false",
        ]
        try:
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=MVN_TIMEOUT, check=False, stdin=subprocess.DEVNULL
                )
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(
                    f"mvn took over {MVN_TIMEOUT:.0f}s fetching the Spark jars (is Maven Central reachable?)"
                ) from exc
            output = ANSI.sub("", proc.stdout + proc.stderr)
            log.write_text(output)
            if proc.returncode != 0 or not listing.is_file():
                raise RuntimeError(mvn_failure(output, log, f"the Spark {version} connector jars"))
            resolved = _parse_list(listing.read_text())
            names = {a: v for a, v, _ in resolved}
            for connector in (f"spark-sql-kafka-0-10_{SCALA_BINARY}", f"spark-avro_{SCALA_BINARY}"):
                if names.get(connector) != version:
                    raise RuntimeError(
                        f"mvn resolved no {connector} {version} (got {names.get(connector)}); log: {log}"
                    )
            kept = []
            for artifact, _, path in resolved:
                if _has_artifact(shipped, artifact):
                    continue  # pyspark's own copy wins; two versions on one class path clash
                shutil.copy2(path, staging / path.name)
                kept.append(path.name)
            listing.unlink()
            staging.chmod(0o755)  # mkdtemp made it private; the cache may be shared
            shutil.rmtree(jars_dir, ignore_errors=True)
            staging.rename(jars_dir)
            (jars_dir / _MARKER).write_text("\n".join([digest, *sorted(kept)]) + "\n")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return [jars_dir / name for name in sorted(kept)]


def main(argv: list[str] | None = None) -> int:
    """``fetch``: resolve the connector jars into the cache and list them."""
    ap = argparse.ArgumentParser(prog="python -m devtools.spark", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help="resolve the connector jars for the installed pyspark (once)")
    fetch.add_argument("--version", help="Spark version (default: the installed pyspark's)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        jars = ensure_spark_jars(args.version)
    except RuntimeError as exc:
        print(f"spark: {exc}", file=sys.stderr)
        return 1
    size = sum(j.stat().st_size for j in jars)
    for jar in jars:
        print(jar)
    print(f"{len(jars)} jars, {size / 2**20:.1f} MiB ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
