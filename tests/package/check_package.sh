#!/usr/bin/env bash
# The C++ package as a consumer sees it: installs the build tree into a temporary prefix,
# configures and builds examples/ against it (find_package(qkv CONFIG REQUIRED)), runs the
# examples, and checks that the attention-only example links no oneDNN.
#
#   check_package.sh SOURCE_DIR BUILD_DIR      (QKV_MODEL_DIR: the all-MiniLM-L6-v2 folder)
set -euo pipefail
source_dir=$1
build_dir=$2
: "${QKV_MODEL_DIR:?QKV_MODEL_DIR must name the all-MiniLM-L6-v2 folder (scripts/test.sh sets it)}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" --component cpp >/dev/null
# Only public headers are installed.
if [[ -e $work/prefix/include/core || -n $(find "$work/prefix/include" -name '*-inl.h') ]]; then
  echo "check_package: private headers were installed" >&2
  exit 1
fi
cmake -S "$source_dir/examples" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build"

"$work/build/attention_bhsd"
"$work/build/embed_sentences" "$QKV_MODEL_DIR"
"$work/build/decode_kv_cache"
if ldd "$work/build/attention_bhsd" | grep -q libdnnl; then
  echo "check_package: attention_bhsd links oneDNN, but qkv::attention must not need it" >&2
  exit 1
fi
echo "check_package: installed package built and ran the three examples"
