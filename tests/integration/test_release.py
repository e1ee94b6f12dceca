"""``make release``'s script run in a clone of this checkout tagged v9.8.7, and its artifacts checked with other tools.

The clone gets the checkout's working tree as one commit (what a maintainer would commit), then the tag, so the
release script sees a clean tree at a vX.Y.Z tag, as it requires. It runs tools/release/release.sh there with this
checkout's Python, cache (helm, cosign, the SBOM tool) and the image the image tests build (RELEASE_IMAGE: saved, not
built again), and with CC=false: the wheel is built without its compiled modules, which the build leaves out when no
compiler works (setup.py), so that the test does not spend two minutes compiling what test_packaging and the image
build compile already. No COSIGN_KEY: the script signs with a throwaway key it writes into dist/.

The checks use other tools than the script's: sha256sum, cosign and openssl on the signature (and a tampered
SHA256SUMS must fail both), zipfile and tarfile on the wheel, the sdist, the chart and the OCI archive, the lock
itself for the SBOM's dependencies.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.container_image import BUILD_TIMEOUT
from tests.support.lockfile import locked, locked_hashes
from tests.support.monitoring import helm
from tests.support.paths import REPO

VERSION = "9.8.7"
TAG = f"v{VERSION}"
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
LOCK = "runtime.lock" if ARCH == "amd64" else "runtime-arm64.lock"
WHEEL = (
    f"flow_exporter-{VERSION}-cp{sys.version_info.major}{sys.version_info.minor}-cp{sys.version_info.major}"
    f"{sys.version_info.minor}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}.whl"
)
SDIST = f"flow_exporter-{VERSION}.tar.gz"
CHART = f"flow-exporter-{VERSION}.tgz"
IMAGE = f"flow-exporter-{VERSION}-linux-{ARCH}.oci.tar"
SBOM = f"flow-exporter-{VERSION}.cdx.json"
SUMMED = sorted([WHEEL, SDIST, CHART, IMAGE, SBOM])
# The first test waits for the image the image tests use (built once per session), then the release.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 1200)
GIT = ["git", "-c", "user.name=flow-exporter tests", "-c", "user.email=tests@example.invalid"]


@dataclass
class Released:
    clone: Path
    dist: Path
    output: str
    cosign: Path
    seconds: float


def git(*args: str, cwd: Path) -> str:
    proc = subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def clone_working_tree(dest: Path) -> None:
    """A clone of the checkout with its working tree (tracked and untracked files git does not ignore) committed."""
    git("clone", "--quiet", str(REPO), str(dest), cwd=REPO)
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, names):
        src, dst = REPO / name, dest / name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if src.is_symlink() or src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
    git("add", "--all", cwd=dest)
    git("commit", "--quiet", "--allow-empty", "-m", "the working tree", cwd=dest)


def cosign_binary() -> Path:
    """tools/cosign/build.sh's cosign (make setup-cosign builds it first; built here when that did not run)."""
    build = REPO / "tools" / "cosign" / "build.sh"
    subprocess.run(["bash", str(build)], check=True, timeout=1800)
    path = subprocess.run(["bash", str(build), "--path"], capture_output=True, text=True, check=True, timeout=60)
    return Path(path.stdout.strip())


def release_env(image: str | None, cosign: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("COSIGN_KEY", "COSIGN_PASSWORD", "CHART_REGISTRY", "RELEASE_ARM64", "SETUPTOOLS_SCM_PRETEND_VERSION")
    }
    env |= {"PYTHON": sys.executable, "RELEASE_CACHE": str(REPO / ".cache"), "HELM": str(helm())}
    env |= {"COSIGN": str(cosign), "CC": "false"}
    if image:
        env["RELEASE_IMAGE"] = image
    return env


def run_release(clone: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "tools/release/release.sh"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def released(image: str, tmp_path_factory: pytest.TempPathFactory) -> Released:
    cosign = cosign_binary()
    clone = tmp_path_factory.mktemp("release") / "flow-exporter"
    clone_working_tree(clone)
    git("tag", "-a", TAG, "-m", f"flow-exporter {VERSION}", cwd=clone)
    started = time.monotonic()
    proc = run_release(clone, release_env(image, cosign))
    seconds = time.monotonic() - started
    print(f"release script: {seconds:.1f}s\n{proc.stdout}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return Released(clone, clone / "dist", proc.stdout, cosign, seconds)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ what is there


def test_dist_holds_every_artifact(released: Released) -> None:
    found = sorted(p.name for p in released.dist.iterdir())
    assert found == sorted([*SUMMED, "SHA256SUMS", "SHA256SUMS.sig", "cosign.pub", "cosign.key"])
    assert "THROWAWAY" in released.output, "a throwaway key is said loudly"


def test_release_leaves_the_tree_as_committed(released: Released) -> None:
    """Nothing tracked is edited (the chart's version is set in the package, not in Chart.yaml)."""
    assert git("status", "--porcelain", "--untracked-files=no", cwd=released.clone) == ""
    assert git("describe", "--tags", "--exact-match", cwd=released.clone).strip() == TAG


def test_an_untagged_checkout_is_refused(tmp_path: Path) -> None:
    clone = tmp_path / "untagged"
    clone_working_tree(clone)
    for tag in git("tag", "--list", cwd=clone).split():
        git("tag", "--delete", tag, cwd=clone)
    proc = run_release(clone, release_env(None, Path("/nonexistent")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a release is built from a clean tree at a vX.Y.Z tag" in proc.stderr
    assert not (clone / "dist").exists()


# ------------------------------------------------------------------------------ sums and signature


def test_sha256sums_check(released: Released) -> None:
    proc = subprocess.run(
        ["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=released.dist, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"{name}: OK" for name in SUMMED]


def cosign_verify(released: Released, blob: Path) -> subprocess.CompletedProcess[str]:
    # SIGSTORE_REKOR_PUBLIC_KEY names a key file only so that cosign skips fetching Sigstore's trusted root over
    # the network (no transparency log is used here).
    env = {**os.environ, "SIGSTORE_REKOR_PUBLIC_KEY": str(released.dist / "cosign.pub")}
    argv = [str(released.cosign), "verify-blob", "--key", str(released.dist / "cosign.pub")]
    argv += ["--signature", str(released.dist / "SHA256SUMS.sig"), "--insecure-ignore-tlog=true", str(blob)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def openssl_verify(released: Released, blob: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The same signature checked by OpenSSL: ECDSA over the blob's SHA-256, DER, base64 in the .sig file."""
    der = tmp_path / "sig.der"
    der.write_bytes(base64.b64decode((released.dist / "SHA256SUMS.sig").read_text()))
    argv = ["openssl", "dgst", "-sha256", "-verify", str(released.dist / "cosign.pub"), "-signature", str(der)]
    return subprocess.run([*argv, str(blob)], capture_output=True, text=True, timeout=60)


def test_signature_verifies(released: Released, tmp_path: Path) -> None:
    sums = released.dist / "SHA256SUMS"
    good = cosign_verify(released, sums)
    assert good.returncode == 0 and "Verified OK" in good.stderr, good.stderr
    proc = openssl_verify(released, sums, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "Verified OK", proc.stdout + proc.stderr


def test_tampered_sums_fail_verification(released: Released, tmp_path: Path) -> None:
    text = (released.dist / "SHA256SUMS").read_text()
    tampered = tmp_path / "SHA256SUMS"
    flipped = "0" if text[0] != "0" else "1"  # one hex digit of the first artifact's digest
    tampered.write_text(flipped + text[1:])
    bad = cosign_verify(released, tampered)
    assert bad.returncode != 0 and "invalid signature" in bad.stderr, bad.stderr
    proc = openssl_verify(released, tampered, tmp_path)
    assert proc.returncode == 1 and "Verification failure" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ the artifacts


def test_wheel_and_sdist_carry_the_tags_version(released: Released) -> None:
    with zipfile.ZipFile(released.dist / WHEEL) as whl:
        metadata = whl.read(f"flow_exporter-{VERSION}.dist-info/METADATA").decode()
        version_file = whl.read("flow_exporter/_version.py").decode()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert f"__version__ = version = '{VERSION}'\n" in version_file
    with tarfile.open(released.dist / SDIST) as tar:
        pkg_info = tar.extractfile(f"flow_exporter-{VERSION}/PKG-INFO")
        assert pkg_info is not None
        assert f"\nVersion: {VERSION}\n" in pkg_info.read().decode()
        top = {name.split("/")[1] for name in tar.getnames() if name.count("/")}
    # Built from git, setuptools-scm would add every tracked file: MANIFEST.in keeps the sdist to the package.
    assert top == {
        *("LICENSE", "MANIFEST.in", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg", "setup.py"),
        *("flow_exporter", "flow_exporter.egg-info", "schemas"),
    }


def test_chart_carries_the_tags_version(released: Released) -> None:
    with tarfile.open(released.dist / CHART) as tar:
        chart_file = tar.extractfile("flow-exporter/Chart.yaml")
        assert chart_file is not None
        chart = yaml.safe_load(chart_file.read())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    in_git = yaml.safe_load((released.clone / "charts" / "flow-exporter" / "Chart.yaml").read_text())
    assert in_git["version"] != VERSION


def test_sbom_names_the_product_and_every_locked_package(released: Released) -> None:
    sbom = json.loads((released.dist / SBOM).read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    product = sbom["metadata"]["component"]
    assert (product["name"], product["version"]) == ("flow-exporter", VERSION)
    assert product["hashes"] == [{"alg": "SHA-256", "content": sha256(released.dist / WHEEL)}]
    lock = REPO / "requirements" / LOCK
    pins, accepted = locked(lock), locked_hashes(lock)
    components = {c["name"].lower().replace("_", "-").replace(".", "-"): c for c in sbom["components"]}
    assert {name: c["version"] for name, c in components.items()} == pins
    for name, component in components.items():
        hashes = {h["content"] for h in component["hashes"] if h["alg"] == "SHA-256"}
        assert hashes and hashes <= accepted[name], (name, hashes)
    (product_deps,) = [d for d in sbom["dependencies"] if d["ref"] == product["bom-ref"]]
    refs = {c["bom-ref"]: name for name, c in components.items()}
    assert "confluent-kafka" in {refs[r] for r in product_deps["dependsOn"]}


def test_image_archive_is_for_this_platform(released: Released) -> None:
    with tarfile.open(released.dist / IMAGE) as tar:

        def blob(digest: str) -> bytes:
            f = tar.extractfile("blobs/" + digest.replace(":", "/"))
            assert f is not None
            data = f.read()
            assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
            return data

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        index = json.loads(index_file.read())
        (descriptor,) = index["manifests"]
        manifest = json.loads(blob(descriptor["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
    assert descriptor["platform"] == {"architecture": ARCH, "os": "linux"}
    assert (config["os"], config["architecture"]) == ("linux", ARCH)
    assert descriptor["annotations"]["org.opencontainers.image.ref.name"] == f"flow-exporter:{VERSION}"
    assert config["config"]["Entrypoint"] == ["flow-exporter"]
