"""The Spark connector jars (Kafka source, Avro functions) that the pyspark wheel does not ship.

``downstream/spark_flows.py`` runs Spark in local mode from the pip package. That package carries
Spark, Scala and their libraries in ``pyspark/jars`` but neither ``spark-sql-kafka-0-10`` nor
``spark-avro``. Resolving them with ``spark.jars.packages`` would need Ivy and the network at every
start, so instead Maven resolves them once (``tools/spark/pom.xml``) into
``<repo>/.cache/spark/<version>/jars``; the harness (``devtools.downstream.jar_args``) gives those
files to the job with ``--jars``, and the job passes them in ``spark.jars``.

Only jars whose artifact pyspark does not already have are kept: a second, older copy of
scala-library or slf4j-api on the class path would shadow or clash with pyspark's own. The
version is the installed pyspark's, because connector and Spark versions must match exactly.

Command line: ``python -m devtools.spark fetch`` (resolve, print the jars).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from devtools.maven import Resolved, fetch_command, resolve_jars

__all__ = ["SCALA_BINARY", "cache_dir", "ensure_spark_jars", "pyspark_jars_dir", "spark_version"]

SCALA_BINARY = "2.13"

_REPO_ROOT = Path(__file__).resolve().parents[1]
_POM = _REPO_ROOT / "tools" / "spark" / "pom.xml"


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


def ensure_spark_jars(version: str | None = None) -> list[Path]:
    """Resolve the connectors for ``version`` (default: installed pyspark) once; return the jars.

    Jars whose artifact pyspark already ships are left out (devtools.maven.resolve_jars: marker,
    lock, one-line errors).
    """
    version = version or spark_version()
    shipped = _shipped_artifacts(pyspark_jars_dir())

    def select(resolved: Resolved, log: Path) -> Resolved:
        names = {a: v for a, v, _ in resolved}
        for connector in (f"spark-sql-kafka-0-10_{SCALA_BINARY}", f"spark-avro_{SCALA_BINARY}"):
            if names.get(connector) != version:
                raise RuntimeError(f"mvn resolved no {connector} {version} (got {names.get(connector)}); log: {log}")
        # pyspark's own copy wins: two versions of one artifact on a class path clash.
        return [r for r in resolved if not _has_artifact(shipped, r[0])]

    properties = [f"-Dspark.version={version}", f"-Dscala.binary.version={SCALA_BINARY}"]
    return resolve_jars(
        _POM,
        properties,
        cache_dir(version) / "jars",
        _digest(version, shipped),
        f"the Spark {version} connector jars",
        select,
    )


def main(argv: list[str] | None = None) -> int:
    """``fetch``: resolve the connector jars into the cache and list them."""
    ap = argparse.ArgumentParser(prog="python -m devtools.spark", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help="resolve the connector jars for the installed pyspark (once)")
    fetch.add_argument("--version", help="Spark version (default: the installed pyspark's)")
    return fetch_command("spark", ensure_spark_jars, ap.parse_args(argv).version)


if __name__ == "__main__":
    sys.exit(main())
