#!/usr/bin/env bash
# Builds prometheus and promtool from the Go module proxy for the alert and dashboard tests, into
# <repo>/.cache/prometheus/<version>/bin/. Idempotent: a marker holding a hash of the inputs (go.mod,
# go.sum, Go version, build flags) makes later runs return at once; changing one rebuilds.
# tools/prometheus/go.mod pins github.com/prometheus/prometheus (its v0.3xx.y tags are the 3.xx.y
# releases) and names both commands as tools. The remove_all_sd tag leaves out the cloud service
# discoveries (static, file and HTTP stay): the tests need static targets only, and the build halves.
# On failure prints one line saying why (full log in the cache dir) and exits non-zero.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

die() { echo "prometheus build: $*" >&2; exit 1; }

command -v go >/dev/null || die "the go toolchain is not on PATH (Go >= 1.26 is needed to build prometheus and promtool)"

module_version=$(sed -nE 's#^\s*(require\s+)?github\.com/prometheus/prometheus\s+(v[^ ]+).*#\2#p' "$here/go.mod")
[ -n "$module_version" ] || die "cannot read the github.com/prometheus/prometheus version from tools/prometheus/go.mod"
# v0.316.0 is Prometheus 3.16.0.
release=$(echo "${module_version#v0.}" | sed -E 's#^([0-9])([0-9]+)\.([0-9]+)$#\1.\2.\3#')
out="$repo/.cache/prometheus/$release"
marker="$out/.complete"
log="$out/build.log"

tags=remove_all_sd
ver_pkg=github.com/prometheus/common/version
ldflags="-s -w -X $ver_pkg.Version=$release -X $ver_pkg.Revision=$module_version -X $ver_pkg.Branch=release"
ldflags="$ldflags -X $ver_pkg.BuildUser=flow-exporter -X $ver_pkg.BuildDate=19700101-00:00:00"

inputs_hash=$( {
    go env GOVERSION
    echo "$tags $ldflags"
    for f in go.mod go.sum build.sh; do
        echo "== $f"; cat "$here/$f"
    done
} | sha256sum | cut -d' ' -f1)

ready() { [ -f "$marker" ] && [ "$(cat "$marker")" = "$inputs_hash" ] && [ -x "$out/bin/prometheus" ] && [ -x "$out/bin/promtool" ]; }
ready && exit 0

mkdir -p "$out"
# Two test processes may ask for the binaries at once: the second waits for the first build.
exec 9>"$out/.lock"
flock 9
ready && exit 0
rm -f "$marker"
: >"$log"

# fail NAME: tells "no network" apart from a broken go.mod in the one-line message.
. "$here/../go_fail.sh"

export CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly -buildvcs=false" GOTOOLCHAIN=local
export GOMAXPROCS="${GOMAXPROCS:-2}"
jobs="${PROMETHEUS_BUILD_JOBS:-2}"
stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

start=$(date +%s)
echo "prometheus build: building prometheus and promtool $release (several minutes on a cold cache; log: $log)" >&2
(cd "$here" && go mod download) >>"$log" 2>&1 || fail "prometheus"
for cmd in prometheus promtool; do
    (cd "$here" && go build -p "$jobs" -tags "$tags" -ldflags "$ldflags" -o "$stage/$cmd" \
        "github.com/prometheus/prometheus/cmd/$cmd") >>"$log" 2>&1 || fail "$cmd"
done

mkdir -p "$out/bin"
mv -f "$stage/prometheus" "$stage/promtool" "$out/bin/"
echo "$inputs_hash" >"$marker"
echo "prometheus build: done in $(( $(date +%s) - start ))s: $out/bin" >&2
