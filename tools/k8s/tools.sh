#!/usr/bin/env bash
# Builds the manifest tools the tests use, from the Go module proxy, into <repo>/.cache: kustomize
# (kubectl apply -k's renderer), helm, and kube-state-metrics (the pods' resource limits that the
# Grafana dashboard shows, tests/integration/test_prometheus_lab.py). Each is built once per version;
# a line says when one is.
# The test fixtures build them too if this did not run (same versions, same places).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
command -v go >/dev/null || { echo "k8s tools: no go toolchain on PATH; the kustomize and helm tests will be skipped" >&2; exit 0; }

build() {  # name version package
    local bin="$repo/.cache/$1/$2/bin"
    [ -x "$bin/$1" ] && return 0
    echo "k8s tools: building $1 $2 from the Go module proxy (first run only, a few minutes)" >&2
    mkdir -p "$bin"
    GOBIN="$bin" go install "$3@$2" >"$repo/.cache/$1/$2/build.log" 2>&1 \
        || { echo "k8s tools: $1 failed to build; log: $repo/.cache/$1/$2/build.log" >&2; exit 1; }
}

# The versions the tests name (tests/integration/test_k8s_manifests.py, test_helm_chart.py, test_prometheus_lab.py).
build kustomize v5.8.2 sigs.k8s.io/kustomize/kustomize/v5
build helm v4.3.2 helm.sh/helm/v4/cmd/helm
build kube-state-metrics v2.20.0 k8s.io/kube-state-metrics/v2
