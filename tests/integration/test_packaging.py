"""The sdist and the wheel, as a user gets them: built, listed, installed away from the checkout, run.

The sdist is built from a copy of the checkout (a fresh tree: setuptools re-reads a stale
``*.egg-info/SOURCES.txt`` if one is lying around, and nothing is written into the checkout), the
wheel from that sdist, both with ``python -m build`` in its default isolated mode: the build
backend is the one ``[build-system]`` asks for (setuptools>=77, for PEP 639 license metadata), as
for ``pip wheel .`` in the Dockerfile and for anyone installing from PyPI; the dev environment's
own setuptools plays no part. A fresh virtual environment under ``tmp_path`` then gets the runtime
lock (``--require-hashes``) and the wheel (``--no-deps``), and the installed ``flow-exporter`` is
run from a directory outside the checkout, ``tail`` against the real broker.

The copy has no ``.git``: the sdist is given the checkout's version (setuptools-scm's reading of the git tags,
tests/support/version.py) in SETUPTOOLS_SCM_PRETEND_VERSION, and the wheel, built from the sdist with nothing set,
must find it in the sdist's PKG-INFO.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Producer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.bench_export import synthetic_exports
from devtools.kafka import KafkaBroker
from flow_exporter.sink.encoder import RecordEncoder, partition_key
from tests.support.cli import from_json, settings_missing_from
from tests.support.lockfile import locked
from tests.support.paths import REPO
from tests.support.reference import build_record
from tests.support.version import checkout_version

pytestmark = pytest.mark.kafka

RUNTIME_LOCK = REPO / "requirements" / "runtime.lock"
DEV_LOCK = REPO / "requirements" / "dev.lock"  # runtime + the dev and bench extras
SCHEMA = REPO / "schemas" / "flow_record.avsc"
VERSION = checkout_version()
NAME = f"flow_exporter-{VERSION}"
CYTHON = sorted(p.stem for p in (REPO / "flow_exporter").glob("*.pxd"))  # the Cython-compiled sources (setup.py)
NODE = "node-packaging"
EXPORT_MS = 1_767_225_600_123  # 2026-01-01T00:00:00.123Z
# Not part of the sdist's source tree: version control, environments, caches, build output.
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".cache",
    "*.egg-info",
    "build",
    "dist",
    "__pycache__",
    "*.pyc",
    ".*_cache",
    ".hypothesis",
    "*.so",  # the editable install's build of the compiled poll path
)
# The wheel carries the compiled poll path, so it is built for this interpreter and platform.
WHEEL = (
    f"{NAME}-cp{sys.version_info.major}{sys.version_info.minor}-cp{sys.version_info.major}"
    f"{sys.version_info.minor}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}.whl"
)
# Top-level names the distributions must not carry: the harness, the tests, the benchmarks.
NOT_SHIPPED = ("devtools", "tests", "bench")
TIMEOUT = 300


def run(argv: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{argv}\nexit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


@dataclass
class Dists:
    sdist: Path
    wheel: Path
    source: Path  # the copy of the checkout the sdist was built from
    timings: dict[str, float]


@dataclass
class Installed:
    venv: Path
    env: dict[str, str]  # the venv first on PATH, nothing pointing into the checkout
    cwd: Path  # outside the checkout

    def run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / argv[0]), *argv[1:]],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    work = tmp_path_factory.mktemp("packaging")
    source = work / "checkout"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_SOURCE)
    out = work / "dist"
    timings = {}

    started = time.monotonic()
    pretend = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": VERSION}  # the copy has no .git
    run([sys.executable, "-m", "build", "--sdist", "--outdir", out, source], cwd=work, env=pretend)
    timings["sdist"] = time.monotonic() - started
    sdists = list(out.glob("*.tar.gz"))
    assert [p.name for p in sdists] == [f"{NAME}.tar.gz"]

    # The wheel from the sdist alone, unpacked where nothing else of the checkout is.
    unpacked = work / "from-sdist"
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(unpacked, filter="data")
    started = time.monotonic()
    run([sys.executable, "-m", "build", "--wheel", "--outdir", out, unpacked / NAME], cwd=work)
    timings["wheel"] = time.monotonic() - started
    wheels = list(out.glob("*.whl"))
    assert [p.name for p in wheels] == [WHEEL]
    return Dists(sdists[0], wheels[0], source, timings)


@pytest.fixture(scope="module")
def installed(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """A new venv (no pip of its own; this interpreter's pip installs into it): the lock, then the wheel."""
    work = tmp_path_factory.mktemp("installed")
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
    started = time.monotonic()
    run([*pip, "--require-hashes", "-r", RUNTIME_LOCK], cwd=work)
    run([*pip, "--no-deps", dists.wheel], cwd=work)
    run([sys.executable, "-m", "pip", "--python", python, "check"], cwd=work)
    dists.timings["install"] = time.monotonic() - started
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOW_EXPORTER_", "PYTHON"))}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(env_dir))
    yield Installed(env_dir, env, elsewhere)
    print(", ".join(f"{step} {seconds:.1f}s" for step, seconds in dists.timings.items()))


# ------------------------------------------------------------------------------ the locks


def test_locks_satisfy_pyproject() -> None:
    """Each lock pins every requirement pyproject.toml states, at a version it allows; else: make lock."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime, dev = locked(RUNTIME_LOCK), locked(DEV_LOCK)
    for lock, requirements in (
        (runtime, project["dependencies"]),
        (dev, [*project["dependencies"], *extras["dev"], *extras["bench"]]),
    ):
        for text in requirements:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate():
                continue
            pinned = lock.get(canonicalize_name(req.name))
            assert pinned is not None, f"{text} is not in the lock: run make lock"
            assert req.specifier.contains(pinned, prereleases=True), f"{text}, locked at {pinned}: run make lock"
    assert {name: dev.get(name) for name in runtime} == runtime, "CI and the image run the same versions"


# ------------------------------------------------------------------------------ the archives


def test_sdist_contents(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tar:
        members = {m.name.removeprefix(f"{NAME}/"): m for m in tar.getmembers() if m.name != NAME}

        def read(name: str) -> bytes:
            f = tar.extractfile(members[name])
            assert f is not None
            return f.read()

        for name in ("pyproject.toml", "PKG-INFO", "README.md", "LICENSE", "flow_exporter/py.typed"):
            assert name in members, name
        # The schema at its documented place, and as the package's data: a real file, not a link.
        for name in ("schemas/flow_record.avsc", "flow_exporter/schemas/flow_record.avsc"):
            assert name in members and members[name].isfile(), name
            assert read(name) == SCHEMA.read_bytes(), name
        assert read("LICENSE") == (REPO / "LICENSE").read_bytes()
        pkg_info = read("PKG-INFO").decode()
        version_file = read("flow_exporter/_version.py").decode()
    top = {name.split("/")[0] for name in members}
    assert not top & set(NOT_SHIPPED), sorted(top & set(NOT_SHIPPED))
    assert not [n for n in members if "__pycache__" in n or n.endswith(".pyc")]
    # Every module of the package is in it (a subpackage that setuptools' find missed would not be).
    modules = {p.relative_to(dists.source).as_posix() for p in (dists.source / "flow_exporter").rglob("*.py")}
    assert modules <= set(members), sorted(modules - set(members))
    assert f"\nVersion: {VERSION}\n" in pkg_info
    assert f"__version__ = version = {VERSION!r}\n" in version_file, "flow_exporter/_version.py, as the build wrote it"
    assert "\nLicense-Expression: Apache-2.0\n" in pkg_info


def test_wheel_contents(dists: Dists) -> None:
    info = f"{NAME}.dist-info"
    with zipfile.ZipFile(dists.wheel) as whl:
        names = set(whl.namelist())
        assert whl.read("flow_exporter/schemas/flow_record.avsc") == SCHEMA.read_bytes()
        assert "flow_exporter/py.typed" in names
        assert whl.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert {n.split("/")[0] for n in names} == {"flow_exporter", info}, "the package and its metadata only"
    for module in CYTHON:  # the Cython-compiled sources (setup.py)
        assert [n for n in names if n.startswith(f"flow_exporter/{module}.") and n.endswith(".so")], module
    for module in CYTHON:  # the .pxd too: flow_exporter.compiled finds the modules by it, at run time
        assert f"flow_exporter/{module}.pxd" in names, module
    assert not [n for n in names if n.endswith((".c", ".h"))], "the C built from is the sdist's, not the wheel's"
    modules = {p.relative_to(dists.source).as_posix() for p in (dists.source / "flow_exporter").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "\nLicense-File: LICENSE\n" in metadata
    assert "flow-exporter = flow_exporter.cli:main" in entry_points


def test_sdist_builds_without_a_compiler(dists: Dists, tmp_path: Path) -> None:
    """Where no C compiler works, the build leaves the compiled path out instead of failing (pure Python runs)."""
    unpacked = tmp_path / "from-sdist"
    with tarfile.open(dists.sdist) as tar:
        tar.extractall(unpacked, filter="data")
        assert not list((REPO / "flow_exporter").glob("_*.[ch]")), "no hand-written C is left (issue 39)"
        for source in [*(f"{m}{ext}" for m in CYTHON for ext in (".py", ".pxd")), "../setup.py"]:
            assert os.path.normpath(f"{NAME}/flow_exporter/{source}") in tar.getnames(), source
    out = tmp_path / "dist"
    env = {**os.environ, "CC": "false"}  # a compiler that always fails
    run([sys.executable, "-m", "build", "--wheel", "--outdir", out, unpacked / NAME], cwd=tmp_path, env=env)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    assert "flow_exporter/compiled.py" in names
    for module in CYTHON:  # the interpreted build of each Cython-compiled source
        assert f"flow_exporter/{module}.py" in names
    assert not [n for n in names if n.endswith(".so")], names


# ------------------------------------------------------------------------------ the installed wheel


def test_installed_holds_the_lock_and_the_wheel_only(installed: Installed) -> None:
    code = (
        "import importlib.metadata as m, importlib.util as u, json, re, flow_exporter; print(json.dumps(["
        "{re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version for d in m.distributions()},"
        "{n: u.find_spec(n) is not None for n in ('devtools', 'tests', 'bench')},"
        "flow_exporter.__file__]))"
    )
    proc = installed.run("python", "-c", code)
    assert proc.returncode == 0, proc.stderr
    distributions, importable, package = json.loads(proc.stdout)
    assert distributions == {**locked(RUNTIME_LOCK), "flow-exporter": VERSION}
    assert importable == dict.fromkeys(NOT_SHIPPED, False), "the harness, tests or benchmarks got installed"
    assert Path(package).is_relative_to(installed.venv), f"imported from {package}, not the installed wheel"
    proc = installed.run("python", "-c", "import devtools")
    assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'devtools'" in proc.stderr, proc.stderr


def test_installed_cli(installed: Installed) -> None:
    helped = installed.run("flow-exporter", "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("run", "config", "tail", "schema"):
        assert command in helped.stdout

    version = installed.run("flow-exporter", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.split() == ["flow-exporter", VERSION]

    schema = installed.run("flow-exporter", "schema")
    assert schema.returncode == 0, schema.stderr
    parsed = json.loads(schema.stdout)
    assert parsed["name"] == "FlowRecord"
    assert parsed == json.loads(SCHEMA.read_text())

    defaults = installed.run("flow-exporter", "config", "--print-defaults")
    assert defaults.returncode == 0, defaults.stderr
    assert settings_missing_from(defaults.stdout) == []


def test_installed_tail_reads_records_from_kafka(
    installed: Installed, kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    # Two records as the exporter writes them (its encoder, its key), produced by this process.
    exports = synthetic_exports(2)
    expected = [build_record(e, NODE, EXPORT_MS) for e in exports]  # first: encoding lets go of e.conn
    encoder = RecordEncoder(NODE)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for e in exports:
        producer.produce(kafka_topic, encoder.encode(e, EXPORT_MS), key=partition_key(e))
    assert producer.flush(30) == 0

    args = ["--bootstrap-servers", kafka_broker.bootstrap, "--topic", kafka_topic, "--from-beginning"]
    proc = installed.run("flow-exporter", "tail", *args, "--json", "--count", "2")
    assert proc.returncode == 0, proc.stderr
    assert [from_json(line) for line in proc.stdout.splitlines()] == expected
