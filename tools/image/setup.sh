#!/usr/bin/env bash
# Prepares the image build for `make image` and the image tests: Debian's podman, buildah, runc
# and mmdebstrap when missing, then the stand-in base image (tools/image/base.sh, cached).
# The engine's settings are tools/image/containers.conf, passed as CONTAINERS_CONF by every
# script here (nothing in /etc is changed). Each failure prints one line and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "image setup: $*" >&2; exit 1; }

need_pkgs=()
command -v podman >/dev/null || need_pkgs+=(podman)
command -v buildah >/dev/null || need_pkgs+=(buildah)
command -v runc >/dev/null || need_pkgs+=(runc)
command -v mmdebstrap >/dev/null || need_pkgs+=(mmdebstrap)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "image setup: installing Debian packages: ${need_pkgs[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}") \
        >/tmp/flow-exporter-apt-image.log 2>&1 \
        || die "cannot install ${need_pkgs[*]} with apt-get; log: /tmp/flow-exporter-apt-image.log"
fi
bash tools/image/base.sh
