"""``make release``: every artifact of a release built into ``dist/``, signed, then checked the way a user checks it.

The version is the git tag's (pyproject.toml ``[tool.setuptools_scm]``): the checkout must be a clean tree at a
``vX.Y.Z`` tag, or this stops before building anything. Everything is built from a clone of that commit (so nothing
untracked in the checkout, and nothing a build writes, gets near the artifacts):

* the sdist and the wheel (``python -m build`` without isolation, with the build tools of requirements/build.lock
  that ``make setup`` installs; the wheel is built from the sdist);
* the Helm chart packaged with its version and appVersion set to the release's (Chart.yaml in git is not edited),
  pushed to ``oci://$CHART_REGISTRY`` when that is set, after the checks below;
* the image as an OCI archive for linux/amd64 (tools/image/build.sh with VERSION; ``RELEASE_ARM64=1`` adds
  linux/arm64, built under qemu-user: slow), its index naming the platform;
* a CycloneDX SBOM: cyclonedx-py (requirements/sbom.lock, in a virtualenv of its own under the cache) over the
  runtime lock, then the product itself (flow-exporter, the release's version, the wheel's sha256) as the BOM's
  subject, and each dependency's sha256 of the file that installs on this platform (pip's install report of the
  lock into a fresh virtualenv, which must be one of the hashes the lock accepts);
* ``SHA256SUMS`` over those, signed with cosign (tools/cosign/build.sh): the key in ``COSIGN_KEY`` (its password
  in ``COSIGN_PASSWORD``, which cosign reads itself and nothing here prints), or a throwaway key pair written into
  dist/ when no key is given, said loudly. No transparency log: the signature is checked with the public key alone.

Then the checks: ``sha256sum -c``, ``cosign verify-blob``, the wheel installed in that fresh virtualenv printing
its version, ``helm lint`` and ``helm template`` of the packaged chart, each archive's platform read from its OCI
index and image config, the SBOM's subject. ``RELEASE_IMAGE=<image>`` saves an image already built instead of
building one (the tests reuse theirs; its version label is then whatever it was built with).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASE_VERSION = re.compile(r"\d+\.\d+\.\d+")
# Files in dist/ that SHA256SUMS does not cover: the sums, their signature, and the keys (a public key is trusted
# from wherever the maintainers publish it, not from beside what it signs).
UNSUMMED = ("SHA256SUMS", "SHA256SUMS.sig", "cosign.pub", "cosign.key")
ENGINE_CONF = "tools/image/containers.conf"


class ReleaseError(Exception):
    """A step failed: one line saying which and why."""


def say(message: str) -> None:
    print(f"release: {message}", flush=True)


def run(
    argv: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 3600
) -> subprocess.CompletedProcess[str]:
    """Runs a command, its output captured; a failure raises with the command's last lines."""
    proc = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + proc.stderr[-3000:]).strip()
        raise ReleaseError(
            f"{Path(str(argv[0])).name} {' '.join(str(a) for a in argv[1:4])} ...: exit {proc.returncode}\n{tail}"
        )
    return proc


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pinned_version(script: Path, pattern: str) -> str:
    """The version a tools/ build script pins (one place for it: the script)."""
    found = re.search(pattern, script.read_text(), re.MULTILINE)
    if not found:
        raise ReleaseError(f"cannot read the version from {script.relative_to(REPO)}")
    return found.group(1)


@dataclass
class Settings:
    repo: Path
    python: str
    cache: Path
    helm: Path
    cosign: Path
    image: str | None  # RELEASE_IMAGE: save this instead of building
    arm64: bool
    cosign_key: str | None
    chart_registry: str | None

    @classmethod
    def from_env(cls, repo: Path) -> Settings:
        env = os.environ
        # Absolute: the steps run in other directories. (Not resolved: a virtualenv's python is a link to keep.)
        cache = Path(env.get("RELEASE_CACHE") or repo / ".cache").absolute()
        helm_version = pinned_version(repo / "tools/k8s/tools.sh", r"^build helm (v\S+) ")
        cosign_version = pinned_version(repo / "tools/cosign/build.sh", r"^version=(v\S+)$")
        return cls(
            repo=repo,
            python=str(Path(env.get("PYTHON") or sys.executable).absolute()),
            cache=cache,
            helm=Path(env.get("HELM") or cache / "helm" / helm_version / "bin" / "helm").absolute(),
            cosign=Path(env.get("COSIGN") or cache / "cosign" / cosign_version / "bin" / "cosign").absolute(),
            image=env.get("RELEASE_IMAGE") or None,
            arm64=env.get("RELEASE_ARM64") == "1",
            cosign_key=env.get("COSIGN_KEY") or None,
            chart_registry=env.get("CHART_REGISTRY") or None,
        )


@dataclass
class Release:
    version: str
    dist: Path
    src: Path  # the clone everything is built from
    work: Path
    wheel: Path | None = None
    sdist: Path | None = None
    chart: Path | None = None
    images: dict[str, Path] = field(default_factory=dict)  # architecture -> OCI archive
    sbom: Path | None = None
    venv: Path | None = None  # the fresh virtualenv the lock and the wheel were installed into
    install_report: Path | None = None
    throwaway_key: bool = False
    timings: dict[str, float] = field(default_factory=dict)


def scm_version(python: str, root: Path) -> str:
    return run([python, "-m", "setuptools_scm"], cwd=root).stdout.strip()


def preflight(s: Settings) -> str:
    version = scm_version(s.python, s.repo)
    if not RELEASE_VERSION.fullmatch(version):
        raise ReleaseError(
            f"the checkout's version is {version}: a release is built from a clean tree at a vX.Y.Z tag "
            "(git tag -a vX.Y.Z -m 'flow-exporter X.Y.Z'; docs/contributing/releasing.md)"
        )
    missing = [
        f"{what} ({path}; {how})"
        for what, path, how in (
            ("helm", s.helm, "make setup-k8s"),
            ("cosign", s.cosign, "make setup-cosign"),
        )
        if not Path(path).is_file()
    ]
    missing += [f"{tool} (make setup-image)" for tool in ("podman", "buildah") if shutil.which(tool) is None]
    if missing:
        raise ReleaseError("missing: " + ", ".join(missing))
    return version


def clone(s: Settings, release: Release) -> None:
    """A clone of the checkout's HEAD: what is committed, and nothing a build or an editor left around."""
    head = run(["git", "rev-parse", "HEAD"], cwd=s.repo).stdout.strip()
    run(["git", "clone", "--quiet", "--no-checkout", s.repo, release.src])
    run(["git", "checkout", "--quiet", "--detach", head], cwd=release.src)
    cloned = scm_version(s.python, release.src)
    if cloned != release.version:
        raise ReleaseError(f"the clone's version is {cloned}, the checkout's {release.version}")


def build_python(s: Settings, release: Release) -> None:
    """sdist, then the wheel from it, with the locked build tools (no isolation: nothing resolved anew)."""
    epoch = run(["git", "log", "-1", "--format=%ct"], cwd=release.src).stdout.strip()
    env = {**os.environ, "SOURCE_DATE_EPOCH": epoch}
    env.pop("SETUPTOOLS_SCM_PRETEND_VERSION", None)
    run([s.python, "-m", "build", "--no-isolation", "--outdir", release.dist, release.src], env=env)
    (release.sdist,) = release.dist.glob(f"flow_exporter-{release.version}.tar.gz")
    (release.wheel,) = release.dist.glob(f"flow_exporter-{release.version}-*.whl")


def build_chart(s: Settings, release: Release) -> None:
    v = release.version
    chart_dir = release.src / "charts" / "flow-exporter"
    run([s.helm, "package", chart_dir, "--version", v, "--app-version", v, "--destination", release.dist])
    release.chart = release.dist / f"flow-exporter-{v}.tgz"
    if not release.chart.is_file():
        raise ReleaseError(f"helm package wrote no {release.chart.name}")


def engine_env(release: Release) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(release.src / ENGINE_CONF)}


def oci_platform(archive: Path) -> tuple[dict[str, str], dict[str, object]]:
    """(platform from the image config, index.json) of a single-image OCI archive."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> dict[str, object]:
            algorithm, hexdigest = digest.split(":", 1)
            f = tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
            assert f is not None
            data = f.read()
            if hashlib.new(algorithm, data).hexdigest() != hexdigest:
                raise ReleaseError(f"{archive.name}: blob {digest} does not match its digest")
            loaded: dict[str, object] = json.loads(data)
            return loaded

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        index = json.loads(index_file.read())
        (descriptor,) = index["manifests"]
        manifest = blob(descriptor["digest"])
        config = blob(manifest["config"]["digest"])  # type: ignore[index]
    found = {"architecture": str(config["architecture"]), "os": str(config["os"])}
    if config.get("variant"):
        found["variant"] = str(config["variant"])
    return found, index


def add_platform_to_index(archive: Path) -> dict[str, str]:
    """Writes the image config's platform into the archive's index.json (buildah leaves it out), like a registry's
    index lists it, so that what the archive is for is read without opening the image."""
    found, index = oci_platform(archive)
    index["manifests"][0]["platform"] = found  # type: ignore[index]
    new_index = json.dumps(index, separators=(",", ":")).encode()
    rewritten = archive.with_suffix(".rewrite")
    with tarfile.open(archive) as src, tarfile.open(rewritten, "w", format=tarfile.PAX_FORMAT) as dst:
        for member in src.getmembers():
            if member.name == "index.json":
                info = tarfile.TarInfo("index.json")
                info.size, info.mtime, info.mode = len(new_index), member.mtime, member.mode
                dst.addfile(info, io.BytesIO(new_index))
            else:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    rewritten.replace(archive)
    return found


def build_images(s: Settings, release: Release) -> None:
    v = release.version
    arches = ["amd64", *(["arm64"] if s.arm64 else [])]
    for arch in arches:
        if arch == "amd64" and s.image:
            say(f"image: NOT BUILT, saving RELEASE_IMAGE={s.image} as it is (its version label is its own)")
            ref = s.image
        else:
            ref = f"localhost/flow-exporter:{v}" + ("" if arch == "amd64" else f"-{arch}")
            say(f"image: building {ref} for linux/{arch} (tools/image/build.sh)")
            env = {**engine_env(release), "VERSION": v, "ARCH": arch}
            if arch == "amd64" and platform.machine() in ("x86_64", "amd64"):
                env.pop("ARCH")  # the host's own: no emulation, the base tools/image/base.sh already made
            run(["bash", release.src / "tools/image/build.sh", ref], env=env, timeout=7200)
        archive = release.dist / f"flow-exporter-{v}-linux-{arch}.oci.tar"
        run(["buildah", "push", "--quiet", ref, f"oci-archive:{archive}:flow-exporter:{v}"], env=engine_env(release))
        found = add_platform_to_index(archive)
        if (found["os"], found["architecture"]) != ("linux", arch):
            raise ReleaseError(f"{archive.name} holds an image for {found}, not linux/{arch}")
        release.images[arch] = archive


def host_lock(release: Release) -> Path:
    machine = platform.machine()
    name = {"x86_64": "runtime.lock", "amd64": "runtime.lock", "aarch64": "runtime-arm64.lock"}.get(machine)
    if name is None:
        raise ReleaseError(f"no runtime lock for {machine}")
    return release.src / "requirements" / name


def install_fresh(s: Settings, release: Release) -> None:
    """The lock (hashes required) and the wheel (no dependencies) into a new virtualenv, as a user installs it;
    pip's install report says which file of each locked package it took (the SBOM's hashes)."""
    release.venv = release.work / "venv"
    release.install_report = release.work / "install-report.json"
    run([s.python, "-m", "venv", "--without-pip", release.venv])
    pip = [s.python, "-m", "pip", "--python", release.venv / "bin" / "python", "install", "--quiet"]
    lock = host_lock(release)
    run([*pip, "--require-hashes", "--report", release.install_report, "-r", lock], cwd=release.work)
    assert release.wheel is not None
    run([*pip, "--no-deps", release.wheel], cwd=release.work)
    run([s.python, "-m", "pip", "--python", release.venv / "bin" / "python", "check"], cwd=release.work)


def sbom_tool(s: Settings, release: Release) -> Path:
    """cyclonedx-py from requirements/sbom.lock (hashes checked), in a virtualenv kept under the cache per lock."""
    lock = release.src / "requirements" / "sbom.lock"
    venv = s.cache / "release" / f"sbom-{sha256(lock)[:12]}"
    if not (venv / ".complete").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        run([s.python, "-m", "venv", venv])
        run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--require-hashes", "-r", lock])
        (venv / ".complete").write_text("")
    return venv


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(wheel: Path) -> list[str]:
    """The names the wheel requires unconditionally (its METADATA's Requires-Dist without a marker)."""
    with zipfile.ZipFile(wheel) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        text = whl.read(meta).decode()
    names = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:") and ";" not in line:
            names.append(canonical(re.split(r"[\s\[<>=!~(]", line.split(":", 1)[1].strip(), maxsplit=1)[0]))
    return names


def build_sbom(s: Settings, release: Release) -> None:
    assert release.wheel is not None and release.install_report is not None
    venv = sbom_tool(s, release)
    raw = release.work / "sbom.raw.json"
    lock = host_lock(release)
    run([venv / "bin" / "cyclonedx-py", "requirements", "--output-reproducible", "--of", "JSON", "-o", raw, lock])
    bom = json.loads(raw.read_text())

    installed = {}
    for item in json.loads(release.install_report.read_text())["install"]:
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        installed[canonical(item["metadata"]["name"])] = (item["metadata"]["version"], hashes.get("sha256"))
    refs = {}
    for component in bom["components"]:
        name = canonical(component["name"])
        accepted = {h["content"] for ref in component.get("externalReferences", []) for h in ref.get("hashes", [])}
        version, digest = installed.get(name, (None, None))
        if version != component["version"] or digest is None or digest not in accepted:
            raise ReleaseError(f"SBOM: {name} {component['version']}: installed {version} with sha256 {digest}")
        # The file installed on this platform; the lock's other accepted files stay in externalReferences.
        component["hashes"] = [{"alg": "SHA-256", "content": digest}]
        refs[name] = component["bom-ref"]
    if set(refs) != set(installed):
        raise ReleaseError(f"SBOM and install differ: {sorted(set(refs) ^ set(installed))}")

    v = release.version
    product_ref = f"pkg:pypi/flow-exporter@{v}"
    bom["metadata"]["component"] = {
        "type": "application",
        "bom-ref": product_ref,
        "name": "flow-exporter",
        "version": v,
        "description": "Linux conntrack flow exporter: Kubernetes-enriched Avro flow records to Kafka",
        "licenses": [{"license": {"id": "Apache-2.0"}}],
        "purl": product_ref,
        "hashes": [{"alg": "SHA-256", "content": sha256(release.wheel)}],
        "properties": [{"name": "flow-exporter:wheel", "value": release.wheel.name}],
    }
    direct = wheel_requirements(release.wheel)
    unknown = [n for n in direct if n not in refs]
    if unknown:
        raise ReleaseError(f"SBOM: the wheel requires {unknown}, which the lock does not hold")
    bom.setdefault("dependencies", []).append({"ref": product_ref, "dependsOn": sorted(refs[n] for n in direct)})

    release.sbom = release.dist / f"flow-exporter-{v}.cdx.json"
    release.sbom.write_text(json.dumps(bom, indent=2, sort_keys=True) + "\n")
    check = (
        "import json, sys; from cyclonedx.schema import SchemaVersion; "
        "from cyclonedx.validation.json import JsonStrictValidator; text = open(sys.argv[1]).read(); "
        "errors = JsonStrictValidator(SchemaVersion.from_version(json.loads(text)['specVersion'])).validate_str(text); "
        "sys.exit(str(errors) if errors else 0)"
    )
    run([venv / "bin" / "python", "-c", check, release.sbom])


def write_sums(release: Release) -> Path:
    sums = release.dist / "SHA256SUMS"
    names = sorted(p.name for p in release.dist.iterdir() if p.is_file() and p.name not in UNSUMMED)
    sums.write_text("".join(f"{sha256(release.dist / n)}  {n}\n" for n in names))
    return sums


def cosign_env(release: Release) -> dict[str, str]:
    """cosign's environment. SIGSTORE_REKOR_PUBLIC_KEY names a key file so that verify-blob skips its online fetch
    of Sigstore's trusted root (cosign verify_blob.go): this flow uses no transparency log, so that root is unused."""
    env = {**os.environ, "SIGSTORE_REKOR_PUBLIC_KEY": str(release.dist / "cosign.pub")}
    if release.throwaway_key:
        env["COSIGN_PASSWORD"] = ""  # the throwaway key has none (a given COSIGN_PASSWORD is for COSIGN_KEY)
    return env


def sign(s: Settings, release: Release, sums: Path) -> None:
    if s.cosign_key:
        key = s.cosign_key
        say("signing with the key in COSIGN_KEY")
        run([s.cosign, "public-key", "--key", key, "--outfile", release.dist / "cosign.pub"], env=os.environ.copy())
    else:
        release.throwaway_key = True
        say("!" * 100)
        say("NO COSIGN_KEY: signing with a THROWAWAY key pair generated now (dist/cosign.key, no password).")
        say("This is not a release signature anyone can trust: publish nothing signed with it.")
        say("!" * 100)
        run([s.cosign, "generate-key-pair", "--output-key-prefix", release.dist / "cosign"], env=cosign_env(release))
        key = str(release.dist / "cosign.key")
    run(
        [s.cosign, "sign-blob", "--yes", "--key", key, "--tlog-upload=false",
         "--output-signature", release.dist / "SHA256SUMS.sig", sums],
        env=cosign_env(release) if release.throwaway_key else os.environ.copy(),
    )  # fmt: skip
    (release.dist / "SHA256SUMS.sig").chmod(0o644)  # cosign writes it 0600; it is published like the rest


def verify(s: Settings, release: Release) -> None:
    """The checks a user makes, on dist/ as it will be published."""
    v, dist = release.version, release.dist
    run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=dist)
    say("checked: sha256sum -c SHA256SUMS")
    run(
        [s.cosign, "verify-blob", "--key", dist / "cosign.pub", "--signature", dist / "SHA256SUMS.sig",
         "--insecure-ignore-tlog=true", dist / "SHA256SUMS"],
        env=cosign_env(release),
    )  # fmt: skip
    say("checked: cosign verify-blob --key cosign.pub --signature SHA256SUMS.sig SHA256SUMS")

    assert release.venv is not None
    env = {k: val for k, val in os.environ.items() if not k.startswith(("PYTHON", "FLOW_EXPORTER_"))}
    printed = run([release.venv / "bin" / "flow-exporter", "--version"], cwd=release.work, env=env).stdout.strip()
    if printed != f"flow-exporter {v}":
        raise ReleaseError(f"the installed wheel says {printed!r}, not 'flow-exporter {v}'")
    say(f"checked: the wheel in a fresh virtualenv: {printed}")

    assert release.chart is not None
    run([s.helm, "lint", release.chart])
    shown = run([s.helm, "show", "chart", release.chart]).stdout
    if f"\nversion: {v}\n" not in f"\n{shown}" or f"\nappVersion: {v}\n" not in f"\n{shown}":
        raise ReleaseError(f"the packaged chart's Chart.yaml does not say version and appVersion {v}:\n{shown}")
    rendered = run(
        [s.helm, "template", "flow-exporter", release.chart, "--set", "image.repository=registry.example/flow-exporter"]
    ).stdout
    if f'image: "registry.example/flow-exporter:{v}"' not in rendered:
        raise ReleaseError(f"helm template of the packaged chart does not run the image tagged {v}")
    say(f"checked: helm lint and helm template of {release.chart.name} (version and appVersion {v})")

    for arch, archive in release.images.items():
        found, index = oci_platform(archive)
        listed = index["manifests"][0].get("platform")  # type: ignore[index]
        if listed != found or (found["os"], found["architecture"]) != ("linux", arch):
            raise ReleaseError(f"{archive.name}: index says {listed}, the image config {found}")
        say(f"checked: {archive.name} is linux/{arch} (index and image config)")

    assert release.sbom is not None and release.wheel is not None
    subject = json.loads(release.sbom.read_text())["metadata"]["component"]
    if (subject["name"], subject["version"], subject["hashes"][0]["content"]) != (
        "flow-exporter",
        v,
        sha256(release.wheel),
    ):
        raise ReleaseError(f"the SBOM's subject is {subject}")
    say(f"checked: the SBOM names flow-exporter {v} with the wheel's sha256")


def push_chart(s: Settings, release: Release) -> None:
    if not s.chart_registry:
        say("chart not pushed (set CHART_REGISTRY=<registry>/<path> to push it as OCI)")
        return
    assert release.chart is not None
    run([s.helm, "push", release.chart, f"oci://{s.chart_registry}"])
    say(f"pushed: oci://{s.chart_registry}/flow-exporter:{release.version}")


def main() -> int:
    started = time.monotonic()
    s = Settings.from_env(REPO)
    try:
        version = preflight(s)
        dist = s.repo / "dist"
        if dist.exists():
            say("emptying dist/")
            shutil.rmtree(dist)
        dist.mkdir()
        (s.cache / "release").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="work-", dir=s.cache / "release") as tmp:
            work = Path(tmp)
            release = Release(version=version, dist=dist, src=work / "src", work=work)
            say(f"flow-exporter {version}")
            steps = [
                ("clone", lambda: clone(s, release)),
                ("wheel and sdist", lambda: build_python(s, release)),
                ("chart", lambda: build_chart(s, release)),
                ("image", lambda: build_images(s, release)),
                ("install", lambda: install_fresh(s, release)),
                ("sbom", lambda: build_sbom(s, release)),
                ("sums and signature", lambda: sign(s, release, write_sums(release))),
                ("verify", lambda: verify(s, release)),
                ("chart push", lambda: push_chart(s, release)),
            ]
            for name, step in steps:
                t0 = time.monotonic()
                step()
                release.timings[name] = time.monotonic() - t0
                say(f"{name}: {release.timings[name]:.1f}s")
    except ReleaseError as e:
        print(f"release: failed: {e}", file=sys.stderr)
        return 1
    say(f"dist/ ({time.monotonic() - started:.0f}s):")
    for p in sorted(dist.iterdir()):
        print(f"  {p.stat().st_size:>12,}  {p.name}")
    if release.throwaway_key:
        say("SIGNED WITH A THROWAWAY KEY (no COSIGN_KEY given): dist/cosign.key is not a release key.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
