"""Real Spark standalone and Flink session clusters on this machine: a master and two workers, each a process.

The reference jobs (``downstream/``) run in local mode everywhere else; production runs them on a
cluster whose workers die and restart. These start the clusters the way their distributions do,
from the launchers the pip packages ship, so a worker can be SIGKILLed under a running job:

* :class:`SparkCluster`: ``bin/spark-class org.apache.spark.deploy.master.Master`` and two
  ``...deploy.worker.Worker spark://...`` (one core each), from the pyspark wheel; a job is
  submitted with ``--master spark://127.0.0.1:PORT`` (client mode: the driver is the job's process).
* :class:`FlinkCluster`: a JobManager and two TaskManagers (one slot each) with ``bin/jobmanager.sh``
  and ``bin/taskmanager.sh start-foreground``, from the apache-flink wheel (``.venv-flink``), sharing
  one ``config.yaml``; a job is submitted with ``bin/flink run -m 127.0.0.1:PORT -py JOB``.

Each process runs in a process group of its own: :meth:`kill_worker` SIGKILLs the whole group (a
Spark worker and the executor it launched; a TaskManager), as a node that dies would.

Command line: ``python -m devtools.job_cluster spark|flink`` starts one until Ctrl-C and prints how
to submit the job to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

__all__ = ["FlinkCluster", "SparkCluster", "flink_home", "spark_home"]

ROOT = Path(__file__).resolve().parents[1]
FLINK_PYTHON = ROOT / ".venv-flink" / "bin" / "python"
WORKERS = 2
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening on {port}; log: {log}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not listening on {port} after {timeout:.0f} s; log: {log}")
        time.sleep(0.2)


def _kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


class Processes:
    """A cluster's processes: a master and numbered workers, each in a process group of its own, logs in ``workdir``."""

    def __init__(self, kind: str, workdir: Path | None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{kind}-cluster-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.started = 0  # workers started so far: the next one's number is this plus one

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
            )
        return proc, log

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i``'s process group (the worker and what it launched)."""
        _kill_group(self.workers.pop(i))

    def close(self) -> None:
        for proc in [*self.workers.values(), *([self.master] if self.master else [])]:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGTERM)
            if proc.poll() is None:
                _kill_group(proc)
        self.workers.clear()
        self.master = None


class _Lifetime(ABC):
    """``with`` for a cluster: start it (closing what started if that fails), close it at the end.

    The one order of starting is here; each cluster says how to start its master and a worker and how to
    tell that the workers joined."""

    procs: Processes

    def start(self) -> None:
        """The master, then :data:`WORKERS` workers, until all have joined."""
        self.start_master()
        for _ in range(WORKERS):
            self.start_worker()
        self.wait_workers(WORKERS)

    @abstractmethod
    def start_master(self) -> None: ...

    @abstractmethod
    def start_worker(self) -> int: ...

    @abstractmethod
    def wait_workers(self, count: int, timeout: float = 90.0) -> None: ...

    def __enter__(self) -> Any:
        try:
            self.start()
        except BaseException:
            self.procs.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.procs.close()

    @property
    def workdir(self) -> Path:
        return self.procs.workdir

    @property
    def workers(self) -> dict[int, subprocess.Popen[bytes]]:
        return self.procs.workers

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` with what it launched, as a node that dies."""
        self.procs.kill_worker(i)


def spark_home() -> Path:
    """The pyspark package directory: its ``bin/spark-class`` and ``jars`` are a Spark distribution."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pyspark is not installed (pip install pyspark)")
    return Path(next(iter(spec.submodule_search_locations)))


class SparkCluster(_Lifetime):
    """A Spark standalone master and two workers of one core and 1 GiB each, on loopback."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.procs = Processes("spark", workdir)
        self.port = _free_port()
        self.web_port = _free_port()
        self.url = f"spark://{HOST}:{self.port}"
        home = spark_home()
        self._class = [str(home / "bin" / "spark-class")]
        self._env = {
            "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": HOST,
            "SPARK_LOG_DIR": str(self.workdir),
            # Small JVMs for a two-core machine; the executors get the job's own settings.
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }

    def start_master(self) -> None:
        cmd = [*self._class, "org.apache.spark.deploy.master.Master", "--host", HOST, "--port", str(self.port)]
        self.procs.master, log = self.procs.spawn("master", [*cmd, "--webui-port", str(self.web_port)], self._env)
        _wait_port(self.web_port, self.procs.master, log, 90)

    def start_worker(self) -> int:
        self.procs.started += 1
        i = self.procs.started
        work = self.workdir / f"worker{i}"
        work.mkdir(exist_ok=True)
        cmd = [*self._class, "org.apache.spark.deploy.worker.Worker", "--host", HOST, "--cores", "1"]
        cmd += ["--memory", "1g", "--work-dir", str(work), "--webui-port", str(_free_port()), self.url]
        self.procs.workers[i], _ = self.procs.spawn(f"worker{i}", cmd, self._env)
        return i

    def state(self) -> dict[str, Any]:
        """The master's JSON status page (workers, applications)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.web_port}/json/", timeout=5) as r:
            return dict(json.load(r))

    def alive_workers(self) -> int:
        return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")

    def wait_workers(self, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_workers() < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} Spark workers alive after {timeout:.0f} s ({self.workdir})")
            time.sleep(0.3)

    def job_options(self) -> list[str]:
        """The Spark job's options that send it to this cluster."""
        return ["--master", self.url]


def _default_java_opts(home: Path) -> str:
    """``env.java.opts.all`` of the distribution's own ``conf/config.yaml`` (nested or flat)."""
    conf = yaml.safe_load((home / "conf" / "config.yaml").read_text()) or {}
    opts = conf.get("env.java.opts.all") or conf.get("env", {}).get("java", {}).get("opts", {}).get("all", "")
    return str(opts)


def flink_home() -> Path:
    """The pyflink package directory in ``.venv-flink``: ``bin/``, ``lib/``, ``conf/`` of a Flink distribution."""
    out = subprocess.run(
        [str(FLINK_PYTHON), "-c", "import os, pyflink; print(os.path.dirname(pyflink.__file__))"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError("PyFlink is not installed in .venv-flink; run tools/flink/setup.sh")
    return Path(out.stdout.strip())


class FlinkCluster(_Lifetime):
    """A Flink session cluster: a JobManager and two TaskManagers of one slot each, on loopback."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.procs = Processes("flink", workdir)
        self.home = flink_home()
        self.rest_port = _free_port()
        self.conf = self.workdir / "conf"
        self.conf.mkdir(exist_ok=True)
        for name in ("log4j.properties", "log4j-console.properties", "log4j-cli.properties"):
            (self.conf / name).write_bytes((self.home / "conf" / name).read_bytes())
        settings: dict[str, Any] = {
            # The distribution's --add-opens/--add-exports: Flink's CLI and daemons need them on Java 17.
            "env.java.opts.all": _default_java_opts(self.home),
            "jobmanager.rpc.address": HOST,
            "jobmanager.rpc.port": _free_port(),
            "jobmanager.bind-host": HOST,
            "jobmanager.memory.process.size": "768m",
            "rest.address": HOST,
            "rest.bind-address": HOST,
            "rest.port": self.rest_port,
            "taskmanager.host": HOST,
            "taskmanager.bind-host": HOST,
            "taskmanager.numberOfTaskSlots": 1,
            "taskmanager.memory.process.size": "1g",
            "taskmanager.memory.managed.size": "128m",
            "taskmanager.memory.network.min": "64m",
            "taskmanager.memory.network.max": "64m",
            # A TaskManager that dies is noticed within seconds, not the default 50.
            "heartbeat.interval": 1000,
            "heartbeat.timeout": 5000,
            "python.client.executable": str(FLINK_PYTHON),
            "python.executable": str(FLINK_PYTHON),
        }
        (self.conf / "config.yaml").write_text(yaml.safe_dump(settings, width=1 << 16))
        self._env = {
            "FLINK_CONF_DIR": str(self.conf),
            "FLINK_LOG_DIR": str(self.workdir),
            "FLINK_HOME": str(self.home),
            "JVM_ARGS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }
        self.url = f"http://{HOST}:{self.rest_port}"

    def start_master(self) -> None:
        cmd = ["bash", str(self.home / "bin" / "jobmanager.sh"), "start-foreground"]
        self.procs.master, log = self.procs.spawn("jobmanager", cmd, self._env)
        _wait_port(self.rest_port, self.procs.master, log, 90)

    def start_worker(self) -> int:
        self.procs.started += 1
        i = self.procs.started
        cmd = ["bash", str(self.home / "bin" / "taskmanager.sh"), "start-foreground"]
        self.procs.workers[i], _ = self.procs.spawn(f"taskmanager{i}", cmd, self._env)
        return i

    def rest(self, path: str, method: str = "GET") -> Any:
        """One call of the cluster's REST API (what the web UI and ``flink list``/``cancel`` use)."""
        request = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(request, timeout=5) as r:
            body = r.read()
        return json.loads(body) if body else None

    def wait_workers(self, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.rest("/taskmanagers").get("taskmanagers", [])) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} TaskManagers registered after {timeout:.0f} s")
            time.sleep(0.3)

    def run_command(self, job: Path, *args: str) -> list[str]:
        """``flink run`` of a Python job against this cluster (detached: returns when submitted)."""
        flink = ["bash", str(self.home / "bin" / "flink"), "run", "-m", f"{HOST}:{self.rest_port}"]
        return [*flink, "-py", str(job), "-pyexec", str(FLINK_PYTHON), *args]

    @property
    def env(self) -> dict[str, str]:
        """The environment ``flink run`` needs (the cluster's configuration directory)."""
        return dict(self._env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.job_cluster", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("spark", "flink"))
    args = ap.parse_args(argv)
    cluster: SparkCluster | FlinkCluster = SparkCluster() if args.kind == "spark" else FlinkCluster()
    with cluster:
        if isinstance(cluster, SparkCluster):
            print(
                f"Spark master {cluster.url} (UI http://{HOST}:{cluster.web_port}); submit with --master {cluster.url}"
            )
        else:
            print(
                f"Flink session cluster {cluster.url}; submit with: FLINK_CONF_DIR={cluster.conf} flink run -m "
                f"{HOST}:{cluster.rest_port} -py downstream/flink_flows.py -- ..."
            )
        print(f"logs under {cluster.workdir}; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
