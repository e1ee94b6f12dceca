"""The reference jobs copied out of the repository: what they need, and how they fail without it.

No JVM and no broker: the jobs import pyspark and pyflink only once their arguments are checked,
so the project's interpreter runs both copies up to that point. The copies run from a temporary
directory with a clean environment; the end-to-end run of such copies is in
tests/integration/test_downstream_e2e.py. The rule they share (``contract.py``) is checked here
too, in its pure-Python form (``readme_rule``, what the end-to-end tests hold the jobs to).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from downstream import contract
from tests.support import contract as consumer
from tests.support.downstream import FLINK_JOB, JOB, clean_environment, readme_rule, standalone_copy, synthetic_record
from tests.support.paths import REPO

JOBS = {"spark": JOB, "flink": FLINK_JOB}
BASE = ["--bootstrap-servers", "127.0.0.1:9", "--topic", "flows"]


def _run(job: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, job.name, *BASE, *argv],
        cwd=job.parent,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("job", sorted(JOBS))
def test_missing_jars_exit_2_naming_the_flag(tmp_path: Path, job: str) -> None:
    copy = standalone_copy(JOBS[job], tmp_path / "job")
    proc = _run(copy)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{copy.name}: error: --jars PATH[,PATH...] is required"), proc.stderr
    # A path that is not there is named too.
    proc = _run(copy, "--jars", str(tmp_path / "nothing.jar"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--jars: no such file or directory: {tmp_path / 'nothing.jar'}" in proc.stderr


@pytest.mark.parametrize("job", sorted(JOBS))
def test_without_the_schema_beside_it_the_job_asks_for_schema(tmp_path: Path, job: str) -> None:
    directory = tmp_path / "job"
    directory.mkdir()
    copy = directory / JOBS[job].name
    copy.write_bytes(JOBS[job].read_bytes())
    (directory / "contract.py").write_bytes((REPO / "downstream" / "contract.py").read_bytes())
    jar = tmp_path / "x.jar"
    jar.write_bytes(b"")
    proc = _run(copy, "--jars", str(jar))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--schema is required" in proc.stderr, proc.stderr


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_dead_broker_fails_in_one_line_before_the_jvm(tmp_path: Path, job: str) -> None:
    """Nothing listens on 127.0.0.1:9: exit 1 with one line naming it, before pyspark or pyflink start a JVM (the
    Spark job took 190 s and printed 818 lines of stack traces before)."""
    copy = standalone_copy(JOBS[job], tmp_path / "job")
    jar = tmp_path / "x.jar"
    jar.write_bytes(b"")
    proc = _run(copy, "--jars", str(jar))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot reach any Kafka bootstrap server: 127.0.0.1:9 (ConnectionRefusedError" in proc.stderr


def test_jar_paths(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    a, b, c = tmp_path / "a.jar", tmp_path / "d" / "b.jar", tmp_path / "d" / "c.jar"
    for jar in (a, b, c):
        jar.write_bytes(b"")
    assert contract.jar_paths(f"{a},{tmp_path / 'd'}") == [a, b, c]
    for bad in (None, "", " , "):
        with pytest.raises(ValueError, match=r"^--jars PATH\[,PATH\.\.\.\] is required"):
            contract.jar_paths(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.jar in directory"):
        contract.jar_paths(str(tmp_path / "empty"))


def test_connection_ids_colliding_across_nodes_are_two_connections() -> None:
    """Two exporters' connectionId runs may overlap (by chance, about (n1 + n2) / 2**64): the same
    (connectionId, sequence) from two nodes is two records, both counted; a resent copy is not."""
    assert contract.DEDUP_KEY == ("exporterNode", "connectionId", "sequence")
    assert set(contract.CONNECTION_KEY) <= set(contract.CONNECTION_FIELDS)  # connection_totals' grouping
    pods = (("shop", "web-0"), ("shop", "db-0"), None, 1_700_000_000_000)
    a = synthetic_record(40001, *pods, (3, 300, 2, 200), exporterNode="node-a", connectionId=7, sequence=4)
    b = synthetic_record(40002, *pods, (5, 500, 1, 100), exporterNode="node-b", connectionId=7, sequence=4)
    assert readme_rule([a, b, dict(a)]) == {("shop/web-0", "shop/db-0"): (3 + 2 + 5 + 1, 300 + 200 + 500 + 100)}
    # The tests' contract check dedups alike, and will not take the two for one connection's stream.
    assert consumer.dedup([a, dict(a)])[1] == 1
    with pytest.raises(AssertionError, match="of two exporterNodes"):
        consumer.dedup([a, b])
