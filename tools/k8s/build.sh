#!/usr/bin/env bash
# Builds kube-apiserver and etcd from the Go module proxy for the API-server tests, into
# <repo>/.cache/k8s/<k8s version>/bin/. Idempotent: a marker holding a hash of the inputs (go.mod,
# go.sum, main.go, Go version, version stamp) makes later runs return at once; changing one rebuilds.
# Kubernetes publishes no `go install`-able kube-apiserver (its staging modules are v0.0.0), so
# tools/k8s/apiserver pins each staging module to its release tag and builds the command from there.
# On failure prints one line saying why (full log in the cache dir) and exits non-zero.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

die() { echo "k8s build: $*" >&2; exit 1; }

command -v go >/dev/null || die "the go toolchain is not on PATH (Go >= 1.26 is needed to build kube-apiserver and etcd)"

k8s_version=$(sed -nE 's#^\s*(require\s+)?k8s\.io/kubernetes\s+(v[^ ]+).*#\2#p' "$here/apiserver/go.mod")
[ -n "$k8s_version" ] || die "cannot read the k8s.io/kubernetes version from tools/k8s/apiserver/go.mod"
out="$repo/.cache/k8s/${k8s_version#v}"
marker="$out/.complete"
log="$out/build.log"

major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
# Without these the server reports v0.0.0-master as its version (kubectl and clients show it).
ver_pkg=k8s.io/component-base/version
ldflags="-s -w -X $ver_pkg.gitVersion=$k8s_version -X $ver_pkg.gitMajor=$major -X $ver_pkg.gitMinor=$minor"
ldflags="$ldflags -X $ver_pkg.gitTreeState=clean -X $ver_pkg.buildDate=1970-01-01T00:00:00Z"

inputs_hash=$( {
    go env GOVERSION
    echo "$ldflags"
    for f in apiserver/go.mod apiserver/go.sum etcd/go.mod etcd/go.sum etcd/main.go; do
        echo "== $f"; cat "$here/$f"
    done
} | sha256sum | cut -d' ' -f1)

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$inputs_hash" ] \
    && [ -x "$out/bin/kube-apiserver" ] && [ -x "$out/bin/etcd" ]; then
    exit 0
fi

mkdir -p "$out"
# Two test processes may ask for the binaries at once: the second waits for the first build.
exec 9>"$out/.lock"
flock 9
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$inputs_hash" ]; then
    exit 0
fi
rm -f "$marker"
: >"$log"

# fail NAME: tells "no network" apart from a broken go.mod in the one-line message.
. "$here/../go_fail.sh"

export CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly -buildvcs=false" GOTOOLCHAIN=local
export GOMAXPROCS="${GOMAXPROCS:-2}"
jobs="${K8S_BUILD_JOBS:-2}"
stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

start=$(date +%s)
echo "k8s build: building kube-apiserver $k8s_version and etcd (several minutes on a cold cache; log: $log)" >&2
(cd "$here/apiserver" && go mod download) >>"$log" 2>&1 || fail "kube-apiserver"
(cd "$here/apiserver" && go build -p "$jobs" -ldflags "$ldflags" -o "$stage/kube-apiserver" \
    k8s.io/kubernetes/cmd/kube-apiserver) >>"$log" 2>&1 || fail "kube-apiserver"
(cd "$here/etcd" && go mod download && go build -p "$jobs" -ldflags "-s -w" -o "$stage/etcd" .) \
    >>"$log" 2>&1 || fail "etcd"

mkdir -p "$out/bin"
mv -f "$stage/kube-apiserver" "$stage/etcd" "$out/bin/"
echo "$inputs_hash" >"$marker"
echo "k8s build: done in $(( $(date +%s) - start ))s: $out/bin" >&2
