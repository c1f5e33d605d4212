// Tests of the AVX512-BF16 kernels (kernels/cpu/bf16_dot.h) skip on CPUs without it.
#pragma once

#include <gtest/gtest.h>

#include "kernels/cpu/bf16_dot.h"

#define QKV_SKIP_WITHOUT_BF16() \
  if (!bf16dot::available()) GTEST_SKIP() << "no AVX512-BF16 on this CPU"

// Tests of the AMX tiles (kernels/cpu/amx.h) skip on CPUs (or kernels) without AMX-BF16.
#include "kernels/cpu/amx.h"

#define QKV_SKIP_WITHOUT_AMX() \
  if (!amx::available()) GTEST_SKIP() << "no AMX-BF16 on this CPU (lscpu: amx_bf16)"
