#!/usr/bin/env bash
# Installs what qkv needs to build and test on Debian 12, only what is missing. Needs root
# (or sudo) the first time; later runs only check.
#
#   scripts/setup.sh [--fuzz]
set -euo pipefail

# ocl-icd-opencl-dev: Debian's oneDNN is built with the OpenCL GPU runtime, so its CMake config
# (dnnl-config.cmake) calls find_package(OpenCL REQUIRED); libdnnl-dev only recommends it.
# python3-venv, python3-dev: the test venv and the Python module's build (scripts/python_env.sh,
# pip install .); python3-numpy, python3-pytest: the CLI tests on a plain preset build.
# libopenmpi-dev, openmpi-bin: ring attention over MPI (qkv::distributed, mpirun for its tests);
# iproute2: the multi-host ring test's network namespaces.
packages=(g++ cmake ninja-build ccache libhwy-dev libdnnl-dev ocl-icd-opencl-dev libgtest-dev
          python3 python3-pip python3-venv python3-dev python3-numpy python3-pytest
          libopenmpi-dev openmpi-bin iproute2)
# --fuzz: also what scripts/fuzz.sh and the sanitizer presets need (clang with libFuzzer and its
# sanitizer runtimes, and clang's OpenMP).
if [[ ${1:-} == --fuzz ]]; then
  packages+=(clang-14 libclang-rt-14-dev libomp-14-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
