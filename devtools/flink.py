"""The Flink SQL connector jars (Kafka connector, Avro formats) that the apache-flink wheel does not ship.

``downstream/flink_flows.py`` runs Flink in local mode (a MiniCluster inside PyFlink's gateway
JVM). The wheel carries Flink itself in ``pyflink/lib`` but no Kafka connector and no Avro
format. Flink has no run-time dependency resolution of its own, so Maven resolves them once
(``tools/flink/pom.xml``) into ``<repo>/.cache/flink/<flink version>/jars``; the harness
(``devtools.downstream.jar_args``) gives those files to the job with ``--jars``, and the job passes
them in ``pipeline.jars``: no network access when a job starts.

Both jars are shaded "sql" uber jars, so unlike Spark's connectors nothing has to be filtered
against what the wheel already has. The pom explains why the registry format jar is 2.1.0.

This module does not import pyflink: it runs in the project's ``.venv`` (``tools/flink/setup.sh``
calls it there) as well as in ``.venv-flink``. The Flink version is the installed apache-flink's
when there is one, else the one pinned in ``requirements/flink.lock``.

Command line: ``python -m devtools.flink fetch`` (resolve, print the jars).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path

from devtools.maven import Resolved, fetch_command, resolve_jars

__all__ = ["CONNECTORS", "cache_dir", "ensure_flink_jars", "flink_version", "jar_urls"]

_REPO_ROOT = Path(__file__).resolve().parents[1]
_POM = _REPO_ROOT / "tools" / "flink" / "pom.xml"
_LOCK = _REPO_ROOT / "requirements" / "flink.lock"
# The artifacts the job cannot run without; the resolved list must have each of them.
CONNECTORS = ("flink-sql-connector-kafka", "flink-sql-avro-confluent-registry")


def flink_version() -> str:
    """The installed apache-flink's version, else the one ``requirements/flink.lock`` pins.

    The lock is the fallback so that ``.venv`` (without PyFlink) fetches the jars for the Flink
    that ``.venv-flink`` gets from the same lock.
    """
    try:
        return importlib.metadata.version("apache-flink")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = _LOCK.read_text()
    except OSError:
        raise RuntimeError(
            f"neither apache-flink installed nor {_LOCK.name} readable; run tools/flink/setup.sh"
        ) from None
    match = re.search(r"^apache-flink==(\S+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_LOCK.name} pins no apache-flink version")
    return match.group(1)


def cache_dir(version: str | None = None) -> Path:
    """``<repo>/.cache/flink/<version>``; ``FLOW_EXPORTER_CACHE`` replaces ``<repo>/.cache``."""
    base = os.environ.get("FLOW_EXPORTER_CACHE")
    root = Path(base) if base else _REPO_ROOT / ".cache"
    return root / "flink" / (version or flink_version())


def _digest(version: str) -> str:
    """What a cache was made from: editing the pom or changing the Flink version re-resolves."""
    h = hashlib.sha256(_POM.read_bytes())
    h.update(version.encode())
    return h.hexdigest()


def _check_resolved(resolved: list[tuple[str, str, Path]], version: str, log: Path) -> None:
    """Both connectors present, and the Kafka connector built for this Flink minor (``x.y.z-2.2``)."""
    names = {a: v for a, v, _ in resolved}
    for connector in CONNECTORS:
        if connector not in names:
            raise RuntimeError(f"mvn resolved no {connector}; log: {log}")
    minor = ".".join(version.split(".")[:2])
    kafka = names["flink-sql-connector-kafka"]
    if not kafka.endswith(f"-{minor}"):
        raise RuntimeError(
            f"flink-sql-connector-kafka {kafka} is not built for Flink {minor}; edit tools/flink/pom.xml"
        )


def ensure_flink_jars(version: str | None = None) -> list[Path]:
    """Resolve the connectors for ``version`` (default: see ``flink_version``) once; return the jars.

    Both are shaded uber jars with nothing of Flink's own inside, so every resolved jar is kept
    (devtools.maven.resolve_jars: marker, lock, one-line errors).
    """
    version = version or flink_version()

    def select(resolved: Resolved, log: Path) -> Resolved:
        _check_resolved(resolved, version, log)
        return resolved

    return resolve_jars(
        _POM, [], cache_dir(version) / "jars", _digest(version), f"the Flink {version} connector jars", select
    )


def jar_urls(jars: list[Path]) -> str:
    """``pipeline.jars``'s value: ``file://`` URLs separated by ``;``."""
    return ";".join(j.resolve().as_uri() for j in jars)


def main(argv: list[str] | None = None) -> int:
    """``fetch``: resolve the connector jars into the cache and list them."""
    ap = argparse.ArgumentParser(prog="python -m devtools.flink", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help="resolve the connector jars for the pinned Flink version (once)")
    fetch.add_argument(
        "--version", help="Flink version (default: the installed apache-flink's, else requirements/flink.lock's)"
    )
    return fetch_command("flink", ensure_flink_jars, ap.parse_args(argv).version)


if __name__ == "__main__":
    sys.exit(main())
