# syntax=docker/dockerfile:1
#
# flow-exporter image: docker build --build-arg VERSION=X.Y.Z -t <registry>/flow-exporter:X.Y.Z .
# (make image and make release pass VERSION: the version setuptools-scm gives the checkout, from its git tags)
#
# Two stages. "build" turns the project and its dependencies into wheels; the final stage
# installs those wheels into a virtual environment and keeps nothing else: no build tree, no
# wheel files (they are bind-mounted from the build stage, never copied into a layer), no pip
# cache, no compilers (the build stage installs one for the project's own C extension; every
# dependency ships a manylinux wheel).
#
# tests/integration/test_dockerfile.py builds this file with podman (on a stand-in base, below) and
# checks the image.

# Base image: BASE, the official slim Python pinned by tag. To pin it by digest (recommended for
# production builds), resolve the tag where a registry is reachable and pass or write the digest, e.g.
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm --format '{{json .Manifest.Digest}}'
#   --build-arg BASE=python:3.11.14-slim-bookworm@sha256:<that digest>
# and repeat when moving to a new tag (Python patch releases, Debian security updates). The tests
# build on a stand-in (tools/image/base.sh: Debian bookworm's python3.11) passed the same way.
ARG BASE=python:3.11.14-slim-bookworm

# VERSION: the project's version (pyproject.toml [tool.setuptools_scm] reads it from the git tags, but the build
# context holds no .git): the wheel's version and the image's version label. tools/image/build.sh passes the
# checkout's (`python -m setuptools_scm`); a build without it says it does not know which version it is.
ARG VERSION=0+unknown

# ----------------------------------------------------------------------------- build
FROM ${BASE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1

WORKDIR /src
# The dependencies first, from the lockfile alone (exact versions, every file checked against its
# sha256 hash), so that this layer is rebuilt only when a lock changes. One lock per platform
# (`make lock`): runtime.lock for amd64, runtime-arm64.lock for arm64; TARGETARCH (set by BuildKit,
# buildah and podman; amd64 when unset) picks it, copied to requirements/image.lock, the one the
# runtime stage installs. Every dependency ships a manylinux wheel for both: pip downloads it,
# and its hash is one the lock records.
# The pip cache is a BuildKit cache mount: it speeds up rebuilds and stays out of layers.
ARG TARGETARCH
COPY requirements/runtime.lock requirements/runtime-arm64.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    case "${TARGETARCH:-amd64}" in \
        amd64) cp requirements/runtime.lock requirements/image.lock ;; \
        arm64) cp requirements/runtime-arm64.lock requirements/image.lock ;; \
        *) echo "no lock for platform ${TARGETARCH}: amd64 and arm64 are supported" >&2; exit 1 ;; \
    esac \
 && python -m pip wheel --require-hashes --wheel-dir /wheels -r requirements/image.lock

# The SBOM (CycloneDX JSON) of the Python packages the image installs from the lock (the project
# itself is not among its components). Made by cyclonedx-bom, itself installed from
# requirements/sbom.lock (hashes checked) into a virtual environment of this stage only; the runtime
# stage copies the one file.
COPY requirements/sbom.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /sbom-tool \
 && /sbom-tool/bin/pip install --require-hashes -r requirements/sbom.lock \
 && /sbom-tool/bin/cyclonedx-py requirements --output-reproducible --of JSON \
        -o /src/sbom.cdx.json requirements/image.lock

# A C compiler for the compiled modules (setup.py), in this stage only: the runtime stage
# installs the built wheel and has no compiler. The official image has Python's headers; a base without
# them (Debian's own python3.11) gets python3.11-dev as well. Debian's packages, current for the base's
# release (pinning versions here would break as soon as the release's point updates move them).
# hadolint ignore=DL3008,SC2086
RUN include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
 && pkgs="gcc libc6-dev" \
 && { [ -f "$include/Python.h" ] || pkgs="$pkgs python3.11-dev"; } \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs \
 && rm -rf /var/lib/apt/lists/*

# The build tools (setuptools, Cython) from their lock, hashes checked; the wheel is built with them (no build
# isolation, which would resolve them again unpinned).
COPY requirements/build.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /build-tools \
 && /build-tools/bin/pip install --require-hashes -r requirements/build.lock

COPY pyproject.toml setup.py README.md LICENSE MANIFEST.in ./
COPY flow_exporter/ flow_exporter/
# The Avro schema lives at the repo root (schemas/); flow_exporter/schemas links to it and the
# wheel carries it as package data, where flow_exporter.record.schema_path() finds it.
COPY schemas/ schemas/

# Then the project's own wheel, next to them: no dependencies resolved (the lock has them all).
# Their digests, for the runtime stage to copy before it installs (see there).
# The compiled modules are optional for a plain `pip install .`; here (FLOW_EXPORTER_REQUIRE_COMPILED, setup.py)
# one that does not build fails the build, and the wheel is checked to hold each (every source with a .pxd beside
# it: the Cython-compiled ones, as setup.py finds them). SETUPTOOLS_SCM_PRETEND_VERSION gives setuptools-scm the
# version that it cannot read from git here.
ARG VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    SETUPTOOLS_SCM_PRETEND_VERSION="${VERSION}" FLOW_EXPORTER_REQUIRE_COMPILED=1 \
        /build-tools/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && python -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/flow_exporter-*.whl')[0]).namelist(); missing = [m for m in [p[14:-4] for p in glob.glob('flow_exporter/*.pxd')] if not any(n.startswith('flow_exporter/' + m + '.') and n.endswith('.so') for n in names)]; sys.exit('not compiled: ' + ', '.join(missing) if missing else 0)" \
 && sha256sum /wheels/*.whl > /src/wheels.sha256

# ----------------------------------------------------------------------------- runtime
FROM ${BASE}

# VERSION (above) is the wheel's version too (tests/integration/test_dockerfile.py checks both); SOURCE_URL is the
# repository the image is built from: pass the real one with --build-arg SOURCE_URL=...
ARG VERSION
ARG SOURCE_URL=https://github.com/example/flow-exporter
LABEL org.opencontainers.image.title="flow-exporter" \
      org.opencontainers.image.description="Linux conntrack flow records, Avro-encoded, to Kafka (Kubernetes DaemonSet)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}"

ENV VIRTUAL_ENV=/opt/flow-exporter \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The venv gets no pip of its own: the base image's pip installs into it (--python), so the
# runtime environment holds the exporter and its dependencies only. Wheels come from the build
# stage alone (--no-index): what was built and tested is what ships. The dependencies are
# installed from the lockfile with --require-hashes (each wheel must match a hash the lock
# records), then the project's wheel with --no-deps; pip check then proves that the lock
# satisfies the project's own requirements. pip compiles the .pyc files here, since the root
# filesystem is read-only at run time. Last, the base image's pip removes itself: the image has no
# pip anywhere on its PATH.
# The wheels' digests are copied first: buildah (podman build) keys a RUN's cached layer on its
# text alone, not on what a bind mount brings, so without a changed file before it a rebuild after
# a code change would reuse the old install. They stay in the image: the digests of what it runs.
COPY --from=build /src/wheels.sha256 /opt/flow-exporter/wheels.sha256
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/requirements,target=/requirements \
    python -m venv --without-pip "$VIRTUAL_ENV" \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" install --no-cache-dir --no-index \
        --find-links /wheels --require-hashes -r /requirements/image.lock \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" install --no-cache-dir --no-index \
        --no-deps /wheels/flow_exporter-*.whl \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" check \
 && python -m pip uninstall --yes --quiet pip

# The SBOM of what was just installed (the lock's packages, from the build stage).
COPY --from=build /src/sbom.cdx.json /opt/flow-exporter/sbom.cdx.json

# Only now: before the install, "python" must stay the base image's (the venv has no pip).
ENV PATH=/opt/flow-exporter/bin:$PATH

# Who the process runs as.
#
# Reading conntrack over netlink (dumps and NEW/DESTROY events) needs CAP_NET_ADMIN in the
# node's network namespace. A non-root process cannot hold it here:
#   * file capabilities (setcap on the interpreter) would hand NET_ADMIN to every Python program
#     in the image, and the kernel ignores them anyway under no_new_privs, which the DaemonSet
#     sets (allowPrivilegeEscalation: false);
#   * ambient capabilities cannot be requested through a Kubernetes securityContext, and
#     container runtimes give a non-root user's added capabilities no effective bit.
# So the image defaults to an unprivileged user (65532, no passwd entry needed), which is what
# `docker run flow-exporter:X.Y.Z config --print-defaults` and any other ad hoc use gets, and the
# DaemonSet (k8s/daemonset.yaml) opts in to UID 0 explicitly with every capability dropped except
# NET_ADMIN, no privilege escalation, a read-only root filesystem and the RuntimeDefault seccomp
# profile. Root without CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_SYS_* etc. gains nothing beyond NET_ADMIN.
USER 65532:65532

EXPOSE 9690
ENTRYPOINT ["flow-exporter"]
CMD ["run", "--config", "/etc/flow-exporter/config.yaml"]
