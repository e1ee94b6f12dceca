#!/usr/bin/env bash
# Prepares a fresh machine for `make test` / `make demo`: root check, Debian
# tools, the virtualenv with the project and its dev extras, the broker jars.
# Each failure prints one line saying what is missing, then exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "setup: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (network namespaces and conntrack need CAP_NET_ADMIN); try: sudo make test"

need_pkgs=()
command -v ip >/dev/null || need_pkgs+=(iproute2)
command -v nft >/dev/null || need_pkgs+=(nftables)
command -v conntrack >/dev/null || need_pkgs+=(conntrack)
command -v mkfs.ext4 >/dev/null || need_pkgs+=(e2fsprogs)  # the state-directory fault tests (an ext4 image)
command -v java >/dev/null || need_pkgs+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need_pkgs+=(maven)
command -v gcc >/dev/null || need_pkgs+=(gcc)  # the compiled modules (setup.py: Cython writes C, gcc builds it)
command -v chromium >/dev/null || need_pkgs+=(chromium)  # the docs site's browser test (headless, Debian's)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${need_pkgs[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}") >/tmp/flow-exporter-apt.log 2>&1 \
        || die "cannot install ${need_pkgs[*]} with apt-get (is the Debian package registry reachable?); log: /tmp/flow-exporter-apt.log"
fi

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python >= 3.11 is required (found: $("$PY" --version 2>&1))"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating the virtualenv .venv"
    "$PY" -m venv .venv || die "cannot create .venv (python3-venv missing?)"
fi
# The dependencies come from the lock (exact versions, hashes checked), the project itself is then
# installed editable without resolving anything; `make lock` rewrites the lock from pyproject.toml.
stamp=.venv/.installed
# The build tools (setuptools, Cython) come from requirements/build.lock the same way, and the project is built
# with them (no build isolation: the versions that compile the hot modules are the locked ones).
editable() { .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >>/tmp/flow-exporter-pip.log 2>&1; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/dev.lock -nt "$stamp" ] || [ requirements/build.lock -nt "$stamp" ]; then
    echo "setup: installing the Python dependencies from requirements/dev.lock (a minute or two on a fresh machine)"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q --require-hashes -r requirements/dev.lock -r requirements/build.lock >/tmp/flow-exporter-pip.log 2>&1 \
        || die "pip could not install requirements/dev.lock and build.lock (is PyPI reachable? is a lock stale? try: make lock); log: /tmp/flow-exporter-pip.log"
    editable \
        || die "pip could not install the project itself (pip install --no-deps -e .); log: /tmp/flow-exporter-pip.log"
    .venv/bin/python -m pip check >>/tmp/flow-exporter-pip.log 2>&1 \
        || die "the installed dependencies do not satisfy pyproject.toml (requirements/dev.lock is stale: run make lock); log: /tmp/flow-exporter-pip.log"
    touch "$stamp"
fi
# The compiled modules (setup.py: the Cython-compiled sources) are built in place by the
# editable install; rebuilt here when a source changed, since an editable install does not notice. No compiler:
# they stay out and the interpreted sources run (tests/unit/test_deadline_heap.py then fails on purpose).
compiled_sources() { ls flow_exporter/*.pxd setup.py; for p in flow_exporter/*.pxd; do echo "${p%.pxd}.py"; done; }
compiled_stale() {
    local so
    for so in $(for p in flow_exporter/*.pxd; do echo "${p%.pxd}"; done); do
        so=$(ls $so.*.so 2>/dev/null | head -1 || true)
        [ -n "$so" ] || return 0
        for src in $(compiled_sources); do [ "$src" -nt "$so" ] && return 0; done
    done
    return 1
}
if compiled_stale; then
    echo "setup: building the compiled modules (setup.py: every flow_exporter/*.py with a .pxd, compiled by Cython)"
    editable || die "pip could not build the project (pip install --no-deps --no-build-isolation -e .); log: /tmp/flow-exporter-pip.log"
    if command -v cc >/dev/null || command -v gcc >/dev/null; then
        # The extensions are optional, so pip reports success when a build fails; an older .so would then stay
        # and every test would run the old code. With a compiler there, a build that did not happen is an error.
        compiled_stale && die "the compiled modules did not build; see: .venv/bin/python -m pip install -v --no-deps --no-build-isolation -e ."
    else
        echo "setup: no C compiler (gcc): the compiled modules are left out (apt-get install gcc)" >&2
    fi
fi

kafka_jars=$(.venv/bin/python -c 'from devtools.kafka import cache_dir; print(cache_dir())' 2>/dev/null || true)
if [ -z "$kafka_jars" ] || [ ! -d "$kafka_jars" ]; then
    echo "setup: fetching the Kafka broker jars with Maven (first run only, about a minute)"
fi
.venv/bin/python -m devtools.kafka fetch >/dev/null \
    || die "cannot fetch the Kafka broker jars with Maven (is Maven Central reachable?)"
