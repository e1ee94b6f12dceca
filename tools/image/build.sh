#!/usr/bin/env bash
# Builds the Dockerfile with podman on the stand-in base (tools/image/base.sh): usage build.sh IMAGE.
# The build runs on the host's network (the Dockerfile's `pip wheel` reaches the package index with
# the pip settings the base carries) and with runc; extra podman build arguments may follow IMAGE.
# ARCH=arm64 builds for that architecture on a base of its own (base.sh), under qemu-user emulation.
# VERSION (the wheel's version and the image's label; the build context has no .git) is the checkout's, from its
# git tags (`python -m setuptools_scm`, pyproject.toml [tool.setuptools_scm]), unless VERSION is set.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
export CONTAINERS_CONF="$repo/tools/image/containers.conf"
image=${1:?usage: build.sh IMAGE [podman build arguments]}
shift
if [ -z "${VERSION:-}" ]; then
    VERSION=$(cd "$repo" && "${PYTHON:-$repo/.venv/bin/python}" -m setuptools_scm 2>/dev/null) \
        || { echo "image build: cannot read the version (python -m setuptools_scm; run make setup, or set VERSION)" >&2; exit 1; }
fi
bash "$repo/tools/image/base.sh"
base=$(bash "$repo/tools/image/base.sh" --tag)
exec podman build --runtime runc --network host ${ARCH:+--arch "$ARCH"} --build-arg "BASE=$base" \
    --build-arg "VERSION=$VERSION" -t "$image" "$@" "$repo"
