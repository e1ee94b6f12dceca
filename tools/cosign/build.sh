#!/usr/bin/env bash
# Builds cosign (the release's signatures: tools/release/release.sh, tests/integration/test_release.py) from the
# Go module proxy into <repo>/.cache/cosign/<version>/bin/cosign. Idempotent: a marker holding a hash of the inputs
# (version, Go version, build flags, this script) makes later runs return at once; changing one rebuilds.
# `go install module@version` builds the command as its own go.mod and go.sum pin it (checked against the Go
# checksum database), so nothing here needs a go.mod of its own. Prints where the binary is with --path.
# On failure prints one line saying why (full log in the cache dir) and exits non-zero.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

# cosign v2.6.5: the newest v2 release the module proxy serves whose go.mod asks for a Go this machine has (1.25).
version=v2.6.5
out="$repo/.cache/cosign/$version"
[ "${1:-}" = "--path" ] && { echo "$out/bin/cosign"; exit 0; }

die() { echo "cosign build: $*" >&2; exit 1; }
command -v go >/dev/null || die "the go toolchain is not on PATH (Go >= 1.25 is needed to build cosign)"

marker="$out/.complete"
log="$out/build.log"
# sigs.k8s.io/release-utils/version is where `cosign version` reads its version from.
ldflags="-s -w -X sigs.k8s.io/release-utils/version.gitVersion=$version -X sigs.k8s.io/release-utils/version.gitTreeState=clean"
inputs_hash=$( { go env GOVERSION; echo "$version $ldflags"; cat "$here/build.sh"; } | sha256sum | cut -d' ' -f1)

ready() { [ -f "$marker" ] && [ "$(cat "$marker")" = "$inputs_hash" ] && [ -x "$out/bin/cosign" ]; }
ready && exit 0

mkdir -p "$out"
# Two processes may ask for the binary at once: the second waits for the first build.
exec 9>"$out/.lock"
flock 9
ready && exit 0
rm -f "$marker"
: >"$log"

# fail NAME: tells "no network" apart from a broken module in the one-line message.
. "$here/../go_fail.sh"

export CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly -buildvcs=false" GOTOOLCHAIN=local
export GOMAXPROCS="${GOMAXPROCS:-2}"
stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

start=$(date +%s)
echo "cosign build: building cosign $version (a few minutes on a cold cache; log: $log)" >&2
(cd "$stage" && GOBIN="$stage" go install -p "${COSIGN_BUILD_JOBS:-2}" -ldflags "$ldflags" \
    "github.com/sigstore/cosign/v2/cmd/cosign@$version") >>"$log" 2>&1 || fail "cosign"

mkdir -p "$out/bin"
mv -f "$stage/cosign" "$out/bin/"
echo "$inputs_hash" >"$marker"
echo "cosign build: done in $(( $(date +%s) - start ))s: $out/bin/cosign" >&2
