# syntax=docker/dockerfile:1
#
# flow-exporter image: docker build -t localhost/flow-exporter:0.1.0 .
#
# Two stages. "build" turns the project and its dependencies into wheels; the final stage
# installs those wheels into a virtual environment and keeps nothing else: no build tree, no
# wheel files (they are bind-mounted from the build stage, never copied into a layer), no pip
# cache, no compilers (the slim base has none, and every dependency ships a manylinux wheel).
#
# tests/integration/test_dockerfile.py replays this file's COPY and RUN steps, in order, in a
# temporary directory, and checks the result; keep RUN steps free of steps that only make sense in
# a container (creating users, apt-get), or teach that test about them.

# Base image: pinned by tag. To pin it by digest (recommended for production builds), resolve the
# tag where a registry is reachable and write the digest into both FROM lines, e.g.
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm --format '{{json .Manifest.Digest}}'
#   FROM python:3.11.14-slim-bookworm@sha256:<that digest> AS build
# and repeat when moving to a new tag (Python patch releases, Debian security updates).

# ----------------------------------------------------------------------------- build
FROM python:3.11.14-slim-bookworm AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1

WORKDIR /src
# The dependencies first, from the lockfile alone (exact versions, every file checked against its
# sha256 hash), so that this layer is rebuilt only when requirements/runtime.lock changes. Every
# dependency ships a manylinux wheel: pip downloads it, and its hash is the one the lock records.
# The pip cache is a BuildKit cache mount: it speeds up rebuilds and stays out of layers.
COPY requirements/runtime.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip wheel --require-hashes --wheel-dir /wheels -r requirements/runtime.lock

COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY flow_exporter/ flow_exporter/
# The Avro schema lives at the repo root (schemas/); flow_exporter/schemas links to it and the
# wheel carries it as package data, where flow_exporter.record.schema_path() finds it.
COPY schemas/ schemas/

# Then the project's own wheel, next to them: no dependencies resolved (the lock has them all).
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip wheel --no-deps --wheel-dir /wheels .

# ----------------------------------------------------------------------------- runtime
FROM python:3.11.14-slim-bookworm

# VERSION is flow_exporter.__version__ (tests/integration/test_dockerfile.py checks it, and the
# image tags in k8s/ and README.md); SOURCE_URL is the repository the image is built from: pass
# the real one with --build-arg SOURCE_URL=...
ARG VERSION=0.1.0
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
# filesystem is read-only at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/requirements,target=/requirements \
    python -m venv --without-pip "$VIRTUAL_ENV" \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" install --no-cache-dir --no-index \
        --find-links /wheels --require-hashes -r /requirements/runtime.lock \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" install --no-cache-dir --no-index \
        --no-deps /wheels/flow_exporter-*.whl \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" check

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
# `docker run flow-exporter:0.1.0 config --print-defaults` and any other ad hoc use gets, and the
# DaemonSet (k8s/daemonset.yaml) opts in to UID 0 explicitly with every capability dropped except
# NET_ADMIN, no privilege escalation, a read-only root filesystem and the RuntimeDefault seccomp
# profile. Root without CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_SYS_* etc. gains nothing beyond NET_ADMIN.
USER 65532:65532

EXPOSE 9690
ENTRYPOINT ["flow-exporter"]
CMD ["run", "--config", "/etc/flow-exporter/config.yaml"]
