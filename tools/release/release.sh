#!/usr/bin/env bash
# `make release`: every artifact of the release at the checkout's vX.Y.Z tag into dist/, signed and checked
# (devtools/release.py says what and how; docs/contributing/releasing.md says how to cut one). Settings come from
# the environment: COSIGN_KEY and COSIGN_PASSWORD (else a throwaway key, said loudly), CHART_REGISTRY (push the
# chart there as OCI), RELEASE_ARM64=1 (the arm64 image too, under emulation), PYTHON (default .venv/bin/python).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
export PYTHON=${PYTHON:-$repo/.venv/bin/python}
exec "$PYTHON" -m devtools.release "$@"
