# Sourced by the scripts that build Go binaries from the module proxy (tools/k8s/build.sh,
# tools/prometheus/build.sh): `fail NAME` tells "no network" apart from a broken go.mod in a one-line
# message. Needs the caller's $log (the build log) and die().
fail() {
    if grep -qE 'dial tcp|no such host|i/o timeout|connection refused|network is unreachable|TLS handshake timeout|reading https:[^ ]*: (502|503|504)' "$log"; then
        die "cannot reach the Go module proxy ($(go env GOPROXY)) to download $1's modules; log: $log"
    fi
    local why
    why=$(grep -E '^go: |\.go:[0-9]+:' "$log" | grep -v '^go: downloading' | tail -n 1)
    [ -n "$why" ] || why=$(tail -n 1 "$log")
    die "$1 failed to build: $(echo "$why" | cut -c1-200); log: $log"
}
