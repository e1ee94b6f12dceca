#!/usr/bin/env bash
# Prepares the Flink job (downstream/flink_flows.py): its own virtualenv .venv-flink with PyFlink
# from the hashed lock requirements/flink.lock (PyFlink pins old pyarrow/pandas, so not the
# project's .venv), then the connector jars, resolved once with Maven into .cache/flink/<version>/jars.
# Idempotent: a stamp file skips the install while the lock is unchanged; the jar fetch has its own marker.
# Each failure prints one line saying what is missing, with a log, then exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "flink setup: $*" >&2; exit 1; }

PY=${PYTHON:-$(command -v python3.11 || command -v python3 || echo python3.11)}
command -v "$PY" >/dev/null || die "$PY not found (the apache-flink wheels in requirements/flink.lock are for CPython 3.11; set PYTHON=...)"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || die "Python 3.11 is required (found: $("$PY" --version 2>&1))"
command -v java >/dev/null || die "java not found (Flink needs a JRE 11 or 17: Debian package openjdk-17-jre-headless)"
command -v mvn >/dev/null || die "mvn not found (needed once to fetch the Flink connector jars: Debian package maven)"
[ -x .venv/bin/python ] || die "the project's .venv is missing (run tools/setup.sh first; it runs the jar fetch)"

mkdir -p .cache/flink
pip_log=.cache/flink/pip.log
if [ ! -x .venv-flink/bin/python ]; then
    echo "flink setup: creating the virtualenv .venv-flink"
    "$PY" -m venv .venv-flink || die "cannot create .venv-flink (python3.11-venv missing?)"
fi
stamp=.venv-flink/.installed
if [ ! -f "$stamp" ] || [ requirements/flink.lock -nt "$stamp" ]; then
    echo "flink setup: installing PyFlink from requirements/flink.lock (about 800 MB installed, a minute or two on a fresh machine)"
    .venv-flink/bin/python -m pip install -q --require-hashes -r requirements/flink.lock >"$pip_log" 2>&1 \
        || die "pip could not install requirements/flink.lock (is PyPI reachable?); log: $pip_log"
    .venv-flink/bin/python -m pip check >>"$pip_log" 2>&1 \
        || die "the packages in .venv-flink conflict (requirements/flink.lock is stale: recompile it from requirements/flink.in); log: $pip_log"
    touch "$stamp"
fi

# devtools/flink.py does not import PyFlink; the project's .venv runs it (it has devtools on its path).
jars=$(.venv/bin/python -c 'from devtools.flink import cache_dir; print(cache_dir())' 2>/dev/null || true)
if [ -z "$jars" ] || [ ! -f "$jars/jars/.complete" ]; then
    echo "flink setup: fetching the Flink connector jars with Maven (first run only, seconds to a minute)"
fi
.venv/bin/python -m devtools.flink fetch >/dev/null \
    || die "cannot fetch the Flink connector jars (the line above says why)"
echo "flink setup: ready: .venv-flink/bin/python downstream/flink_flows.py --help"
