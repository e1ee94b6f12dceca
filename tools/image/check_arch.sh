#!/usr/bin/env bash
# Builds the image for another architecture (ARCH, default arm64) and runs the compiled-path property tests
# inside it: `make image-check-arm64`. On an amd64 machine the build and the tests run under qemu-user
# emulation, which binfmt_misc must offer (Debian's qemu-user-static registers it; binfmt_misc mounted).
# Slow (a base of its own, then the build and the tests under emulation; measured:
# docs/performance.md#the-image-for-arm64), so not part of `make test`.
#
# The tests are the repository's own (tests/unit/test_native*.py and the decoder's), run against the
# package installed in the image: its compiled modules, built by the image's build stage for that
# architecture, must give what the pure path gives there. pytest, hypothesis and communityid (the encoder's
# reference Community ID; the versions of
# requirements/dev.lock) are fetched as that architecture's wheels into a temporary folder mounted in.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
export CONTAINERS_CONF="$repo/tools/image/containers.conf"
export ARCH=${ARCH:-arm64}
image=${IMAGE:-localhost/flow-exporter:$ARCH}
case "$ARCH" in
    arm64) platform=aarch64 ;;
    amd64) platform=x86_64 ;;
    *) echo "check_arch: ARCH=$ARCH: amd64 or arm64" >&2; exit 2 ;;
esac
[ -e /proc/sys/fs/binfmt_misc/qemu-$platform ] || [ "$(uname -m)" = "$platform" ] \
    || { echo "check_arch: no binfmt_misc entry qemu-$platform: install qemu-user-static (and mount binfmt_misc)" >&2; exit 2; }

bash "$repo/tools/image/build.sh" "$image"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pin() { grep -E "^$1==" "$repo/requirements/dev.lock" | head -1 | cut -d' ' -f1; }
"$repo/.venv/bin/pip" install -q --target "$work/deps" --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform "manylinux2014_$platform" --platform "manylinux_2_17_$platform" --platform "manylinux_2_28_$platform" \
    "$(pin pytest)" "$(pin hypothesis)" "$(pin communityid)"
# Emulation is 10-20x slower: no hypothesis deadlines.
cat >"$work/deps/emulated_profile.py" <<'PY'
from hypothesis import settings

settings.register_profile("emulated", deadline=None, database=None)
settings.load_profile("emulated")
PY
podman run --rm --runtime runc --network none \
    -v "$repo/tests:/src/tests:ro" -v "$repo/devtools:/src/devtools:ro" -v "$work/deps:/deps:ro" \
    -e PYTHONPATH=/src:/deps -e PYTHONDONTWRITEBYTECODE=1 -w /src --entrypoint python "$image" \
    -m pytest -q -p no:cacheprovider -p emulated_profile --rootdir /src -o addopts="" \
    tests/unit/test_native.py tests/unit/test_native_admit.py tests/unit/test_record_bytes.py \
    tests/unit/test_encoder.py tests/unit/test_deliveries.py tests/unit/test_checkpoint_rows.py \
    tests/unit/test_deadline_heap.py \
    tests/unit/test_decode.py
