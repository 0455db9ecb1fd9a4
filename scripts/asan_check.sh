#!/usr/bin/env bash
# The CPU implementations under AddressSanitizer and UndefinedBehaviorSanitizer: builds the extension CPU-only with
# both in a scratch copy of the working tree (.asan-build/; the in-place build is left alone), then runs the test
# suite there with the runtimes preloaded (cuda tests skip). Any heap overflow, use after free, signed overflow,
# bad shift or misaligned access in a CPU op aborts the test that caused it; tests/test_fuzz_ops.py feeds every op
# hostile arguments. Extra arguments go to pytest (e.g. tests/test_fuzz_ops.py).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
py="$repo/.venv/bin/python"
scratch="$repo/.asan-build"
rm -rf "$scratch" && mkdir -p "$scratch"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$scratch")
cd "$scratch"
# A CPU-only module: neither its build nor tests/test_pdl_sass.py may require CUDA code here (.ci/run sets
# DSV4_REQUIRE_CUDA=1 for its own build, under which those tests fail a module without it).
export DSV4_CPU_ONLY=1 DSV4_REQUIRE_CUDA=0
sanitizers="-fsanitize=address,undefined"
LDFLAGS="$sanitizers" CFLAGS="$sanitizers -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  "$py" setup.py -q build_ext --inplace
# Python itself is not instrumented, so the runtimes must come first; torch's own allocations are not checked for
# leaks (detect_leaks) or for new/free pairing across its libraries (alloc_dealloc_mismatch).
export LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
exec "$py" -m pytest -q -p no:cacheprovider "$@" tests
