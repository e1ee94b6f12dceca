#!/usr/bin/env bash
# The compiled modules built with AddressSanitizer and UndefinedBehaviorSanitizer, and the tests that drive them
# run against that build (`make test` runs this: the decoder, the fused poll and the admission are compiled
# without bounds checks, on indices their own checks bound). Those tests include
# the decoder's bounded fuzz (random and mutated netlink buffers, tests/unit/test_native.py), the hostile
# objects and failed allocations (test_native_hostile.py) and the lockstep tests of every compiled path.
#
# The sources are copied to a scratch directory and built there, so the in-place build `make test` uses is left
# alone. Python itself is not instrumented: the sanitizer runtime is preloaded, and PYTHONMALLOC=malloc sends
# every allocation through it (pymalloc's arenas would hide an overrun of a small object). Leak checking is
# off: an interpreter's exit leaks by design.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
py="$repo/.venv/bin/python"
cc=$(command -v gcc || true)
[ -n "$cc" ] || { echo "sanitize: gcc is needed (apt-get install gcc)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/flow-exporter-sanitize.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
cp -r flow_exporter setup.py pyproject.toml README.md LICENSE MANIFEST.in "$work/src/"
find "$work/src/flow_exporter" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +

flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
echo "sanitize: building the compiled modules with ASAN and UBSAN"
(cd "$work/src" && CFLAGS="$flags" LDFLAGS="$flags" "$py" setup.py -q build_ext --inplace >"$work/build.log" 2>&1) \
    || { cat "$work/build.log" >&2; echo "sanitize: the build failed" >&2; exit 1; }

runtime="$("$cc" -print-file-name=libasan.so):$("$cc" -print-file-name=libubsan.so)"
run() {
    # -P: the checkout is not put first on sys.path, so flow_exporter is the sanitized copy; tests come from here.
    PYTHONPATH="$work/src:$repo" PYTHONMALLOC=malloc LD_PRELOAD="$runtime" \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "$py" -P "$@"
}
# Every compiled module must be the instrumented one, or the run below would test the everyday build.
run -c '
import sys
from flow_exporter import compiled
for name in compiled.MODULES:
    path = __import__("flow_exporter." + name, fromlist=["_"]).__file__
    if not path.startswith(sys.argv[1]) or b"__asan_init" not in open(path, "rb").read():
        sys.exit(f"sanitize: {name} is not the instrumented build: {path}")
' "$work/src/"
echo "sanitize: the compiled paths' tests under the sanitizers"
# Left to the everyday run: the journal through a whole Checkpoint, both builds of its rows (25 s here); the
# rows' writers run under the sanitizers in test_checkpoint_rows.py, and make test must stay within its time.
run -m pytest -q -p no:cacheprovider -p no:randomly --rootdir "$repo" \
    tests/unit/test_native.py tests/unit/test_native_admit.py \
    tests/unit/test_record_bytes.py tests/unit/test_native_hostile.py tests/unit/test_encoder.py \
    tests/unit/test_deadline_heap.py tests/unit/test_checkpoint_rows.py tests/unit/test_deliveries.py \
    tests/unit/test_export.py tests/unit/test_poll_core.py tests/unit/test_decode.py \
    --deselect tests/unit/test_record_bytes.py::test_journal_rows_equal_interpreted
