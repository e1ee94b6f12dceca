#!/usr/bin/env bash
# Builds the stand-in base image the tests build the Dockerfile on: Debian bookworm's own
# python3.11 (with venv and pip), made with mmdebstrap from this machine's apt sources, since no
# container registry (and so no python:3.11-slim-bookworm) is reachable where the tests run.
# Test tooling only: users build on the official image (the Dockerfile's default BASE).
#
# Like the official image it has `python` on PATH with pip beside it, outside Debian's own
# site-packages (a virtual environment at /usr/local/python, made with Debian's python3.11-venv, so
# that the Dockerfile's `pip uninstall pip` removes it as it does the official image's), and pip's
# version check off. For the Dockerfile's `pip wheel` step to reach the package index from inside
# the build (--network host), it carries this machine's pip settings, read now: the CA bundle
# pip trusts (PIP_CERT or pip's `cert` setting; a TLS-intercepting proxy's CA lives there) and
# the index settings, if any. Nothing of that is written into the repository.
#
# Cached: the image is built once (tagged with $version, tarball under .cache/image/); later runs
# return at once. Raise $version when changing what goes into the image. Prints nothing but one line when it
# builds; `base.sh --tag` prints the tag. ARCH=arm64 (a Debian architecture) builds the base for another
# architecture, run under qemu-user through binfmt_misc (Debian's qemu-user-static registers it).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
export CONTAINERS_CONF="$repo/tools/image/containers.conf"
version=python3.11-2
arch=${ARCH:-}
suffix=${arch:+-$arch}
tag=localhost/flow-exporter-base:bookworm-$version$suffix
cache="$repo/.cache/image"
tarball="$cache/base-$version$suffix.tar"
log="$cache/base-$version$suffix.log"
if [ "${1:-}" = --tag ]; then echo "$tag"; exit 0; fi

die() { echo "image base: $*" >&2; exit 1; }

if podman image exists "$tag" 2>/dev/null; then
    exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
podman image exists "$tag" 2>/dev/null && exit 0

if [ ! -s "$tarball" ]; then
    echo "image base: building $tag with mmdebstrap from this machine's apt sources (first run only, a few minutes)" >&2
    sources=()
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
        [ -s "$f" ] && grep -qE '^\s*(deb|Types:)' "$f" && sources+=("$f")
    done
    [ ${#sources[@]} -gt 0 ] || die "no apt sources found in /etc/apt"
    stage=$(mktemp -d "$cache/stage.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    # The host's pip settings, read now: its CA bundle and index options.
    pipconf="$stage/pip.conf"
    cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
    {
        echo "[global]"
        echo "disable-pip-version-check = true"
        if [ -n "$cert" ] && [ -s "$cert" ]; then
            cp "$cert" "$stage/host-ca.crt"
            echo "cert = /etc/ssl/certs/host-ca.crt"
        fi
        for key in index-url extra-index-url trusted-host; do
            var=PIP_$(echo "$key" | tr a-z- A-Z_)
            value=${!var:-$(python3 -m pip config get "global.$key" 2>/dev/null || true)}
            [ -n "$value" ] && echo "$key = $value"
        done
    } >"$pipconf"
    hooks=(
        --customize-hook='chroot "$1" python3.11 -m venv /usr/local/python'
        --customize-hook="cp '$pipconf' \"\$1\"/etc/pip.conf"
    )
    [ -s "$stage/host-ca.crt" ] && hooks+=(--customize-hook="cp '$stage/host-ca.crt' \"\$1\"/etc/ssl/certs/host-ca.crt")
    mmdebstrap --variant=minbase --mode=root --format=tar ${arch:+--architectures="$arch"} \
        --include=python3.11,python3.11-venv,ca-certificates \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "${hooks[@]}" \
        bookworm "$stage/base.tar" "${sources[@]}" >"$log" 2>&1 \
        || die "mmdebstrap failed (is Debian's package registry reachable?); log: $log"
    mv "$stage/base.tar" "$tarball"
    find "$cache" -maxdepth 1 -name 'base-*' ! -name "base-$version.*" ! -name "base-$version-*" -delete  # an older script's
fi
podman import ${arch:+--arch "$arch"} \
    --change 'ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CONFIG_FILE=/etc/pip.conf' \
    --change 'CMD ["python3"]' \
    "$tarball" "$tag" >>"$log" 2>&1 || die "podman import of $tarball failed; log: $log"
