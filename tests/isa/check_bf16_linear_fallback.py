#!/usr/bin/env python3
"""The bf16 Linear's fallback, run on any CPU: where oneDNN has no bf16 matmul (Debian's 2.6
needs AVX-512 for one), Linear keeps the bf16-rounded operands in f32 and multiplies them with
an f32 matmul (src/layers/linear.cc, `rounds_in_f32`). The machines the suite usually runs on
have AVX-512, so that path would otherwise never run here. ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN
refuse its bf16 matmuls, and ONEDNN_VERBOSE=1 names every matmul it executes.

Runs the GoogleTest cases that build bf16 Linears (alone, in an encoder layer, in the MiniLM
model) on two OpenMP threads (the fallback's rounding runs on the workers too), and fails
unless they pass, at least one matmul ran, and every matmul ran on f32 (none on bf16), so the
fallback really was the path tested.

usage: check_bf16_linear_fallback.py QKV_TESTS_BINARY
"""
import os
import re
import subprocess
import sys

FILTER = ":".join([
    "LayersLinear.*",
    "EncoderBackward.Bf16MatmulsTrainCloseToF32",
    "MiniLmTest.Bf16MatmulsStayWithinCosine0999",
])


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ONEDNN_VERBOSE="1", OMP_NUM_THREADS="2")
    run = subprocess.run([sys.argv[1], f"--gtest_filter={FILTER}"], env=env,
                         capture_output=True, text=True)
    out = run.stdout + run.stderr
    if run.returncode != 0:
        print(out[-6000:])
        sys.exit(f"FAIL: the bf16 Linear tests under ONEDNN_MAX_CPU_ISA=AVX2 exited with "
                 f"{run.returncode}")
    matmuls = [line for line in out.splitlines()
               if line.startswith("onednn_verbose,exec,cpu,matmul")]
    bf16 = [line for line in matmuls if "src_bf16" in line or "wei_bf16" in line]
    skipped = sorted(set(re.findall(r"^\[  SKIPPED \] (\S+\.\S+) \(", out, re.M)))
    for name in skipped:
        print(f"note: skipped {name} (the model is read from QKV_MODEL_DIR)")
    if not matmuls:
        sys.exit("FAIL: no oneDNN matmul ran (ONEDNN_VERBOSE printed none)")
    if bf16:
        sys.exit(f"FAIL: {len(bf16)} of {len(matmuls)} matmuls ran on bf16 although "
                 f"ONEDNN_MAX_CPU_ISA=AVX2 (the fallback was not tested), e.g.\n{bf16[0]}")
    print(f"ok: {len(matmuls)} matmuls, all f32 (the bf16 Linear's fallback); "
          f"{out.count('[       OK ]')} tests passed")


if __name__ == "__main__":
    main()
