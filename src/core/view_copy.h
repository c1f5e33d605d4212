// Copying a strided 4-D view into memory of another layout, converting f32 to bf16/f16: the
// KV cache's appends and the layers' q for a half cache.
#pragma once

#include <array>
#include <cstdint>

#include "qkv/tensor.h"

namespace qkv {

// dst[i0 * dst_strides[0] + ... + i3 * dst_strides[3]] = src[i0, i1, i2, i3] for every index of
// src (strides in elements of `dtype`), stored as `dtype` (kF32, kBF16 or kF16). src is f32
// (rounded to dtype: nearest, ties to even, core/float16.h) or already `dtype` (copied bit for
// bit); the caller validates that.
void copy_view(const TensorView& src, DType dtype, void* dst,
               const std::array<std::int64_t, 4>& dst_strides);

}  // namespace qkv
