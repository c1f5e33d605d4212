#!/usr/bin/env bash
# The suite under the sanitizers, as CI runs it after the README's test command (.ci/run):
#   asan preset  GCC, ASan + UBSan, -fno-sanitize-recover: every GoogleTest case and the CLI
#                tests (the Python module is not built there: its tests would need libasan
#                preloaded into python; the installed-package test is left out as the examples
#                would need the sanitizer link flags, and the netns ring test times its overlap,
#                which ASan distorts; LeakSanitizer is off for the MPI tests: Open MPI leaks)
#   tsan preset  ThreadSanitizer on tests/cpp/test_concurrency.cc with OMP_NUM_THREADS=1: GCC's
#                libgomp is not instrumented, so its barriers would be reported as races; with
#                one OpenMP thread the only concurrency left is the test's own std::threads,
#                which is what it checks; the same for the AMX path on the emulated tiles
#                (AmxEmulatedConcurrency, tests/amx_emulated/; where the CPU has AVX512-BF16)
#   fuzz         scripts/fuzz.sh: every libFuzzer harness for FUZZ_SECONDS (default 20)
#
#   scripts/test_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --fuzz
QKV_MODEL_DIR=$(scripts/fetch_model.sh)
export QKV_MODEL_DIR

python=$(scripts/python_env.sh)  # numpy and pytest for the CLI tests

echo "== asan: ASan + UBSan suite" >&2
cmake --preset asan -DPython3_EXECUTABLE="$python" >/dev/null
cmake --build --preset asan
ctest --preset asan -j2 -E '^(cpp_package|ring_netns)$'

echo "== tsan: the concurrency test" >&2
cmake --preset tsan >/dev/null
cmake --build --preset tsan --target qkv_tests
OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  build/tsan/tests/qkv_tests --gtest_filter='Concurrency.*'
if [ "$(uname -m)" = x86_64 ]; then  # (the emulated tiles' binary is built on x86-64 only)
  cmake --build --preset tsan --target qkv_amx_emulated_tests
  OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    build/tsan/tests/qkv_amx_emulated_tests --gtest_filter='AmxEmulatedConcurrency.*'
fi

echo "== fuzz: every harness, ${FUZZ_SECONDS:-20} s" >&2
scripts/fuzz.sh "${FUZZ_SECONDS:-20}" --jobs 2
