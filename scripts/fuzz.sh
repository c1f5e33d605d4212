#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/, the fuzz preset: clang 14 with ASan + UBSan) and runs
# each for SECONDS (default 60) on its corpus: the committed seeds in fuzz/corpus/<name>/ plus
# what earlier runs found, kept in .cache/fuzz/<name>/. A crash, leak, UB report, timeout (20 s
# per input) or out-of-memory (2 GiB) fails the run; the input is saved under
# .cache/fuzz/artifacts/<name>/, and belongs in fuzz/corpus/<name>/ once fixed (fuzz/README.md).
# Prints one line per harness: runs, final coverage (libFuzzer's cov:) and corpus size.
#
#   scripts/fuzz.sh [SECONDS] [--jobs N] [--only NAME[,NAME...]]
#
# Installs clang-14, libclang-rt-14-dev and libomp-14-dev the first time (scripts/setup.sh
# --fuzz). CI runs it with SECONDS=20 (.ci/run) so that the harnesses never rot.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60
jobs=1
only=""
while (($#)); do
  case "$1" in
    --jobs) jobs=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) seconds=$1; shift ;;
  esac
done
[[ $seconds =~ ^[0-9]+$ ]] || { echo "fuzz.sh: error: SECONDS must be an integer, got '$seconds'" >&2; exit 2; }

scripts/setup.sh --fuzz
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz

names=(npy safetensors json model_config wordpiece cli_specs attention)
if [[ -n $only ]]; then IFS=, read -r -a names <<<"$only"; fi

run_one() {
  local name=$1 seconds=$2
  local work=.cache/fuzz/$name artifacts=.cache/fuzz/artifacts/$name log=.cache/fuzz/$name.log
  mkdir -p "$work" "$artifacts"
  local status=0
  build/fuzz/fuzz/fuzz_"$name" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "$work" "fuzz/corpus/$name" \
    >"$log" 2>&1 || status=$?
  local runs cov
  runs=$(grep -oE '^stat::number_of_executed_units: [0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -n 1 | grep -oE '[0-9]+' || echo "?")
  if [[ $status -ne 0 ]]; then
    echo "fuzz $name: FAIL after $runs runs (see $log; input in $artifacts/)"
    return 1
  fi
  echo "fuzz $name: ok, $seconds s, $runs runs, cov $cov, corpus $(ls "$work" | wc -l) inputs"
}
export -f run_one

failed=0
if [[ $jobs -gt 1 ]]; then
  printf '%s\n' "${names[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} "$seconds" ||
    failed=1
else
  for name in "${names[@]}"; do run_one "$name" "$seconds" || failed=1; done
fi
exit $failed
