// float32 <-> bfloat16 / IEEE binary16 conversions: used to store attention operands as bf16/f16
// (`--dtype`, the kernels' reference loads, tests) and by the safetensors reader.
// Both conversions round to nearest, ties to even, like numpy's astype(np.float16) and
// PyTorch's .to(torch.bfloat16). NaN stays NaN (quietened), infinities stay infinite, values
// past the type's range become infinities, and f16 subnormals are kept.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/huge_pages.h"
#include "qkv/tensor.h"

namespace qkv {

// bfloat16 is the top 16 bits of a float32: round the low 16 bits away, ties to even.
inline std::uint16_t f32_to_bf16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // NaN: keep sign, set quiet bit
  }
  const std::uint32_t lsb = (bits >> 16) & 1u;
  // Adding 0x7fff (+1 when the kept part is odd) carries into bit 16 exactly when the dropped
  // half is above one half, or equal to it with an odd kept part. A carry into the exponent is
  // correct rounding (and turns the largest finite values into infinity, as it should).
  return static_cast<std::uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

inline float bf16_bits_to_f32(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
inline std::uint16_t f32_to_f16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // infinity or NaN (NaN keeps a nonzero, quiet mantissa)
    const std::uint32_t nan = magnitude > 0x7f800000u ? 0x0200u | ((magnitude >> 13) & 0x3ffu) : 0;
    return static_cast<std::uint16_t>(sign | 0x7c00u | nan);
  }
  // 65520 = 65504 (the largest half) + half an ulp: it and everything above rounds to infinity
  // (the tie goes to the even neighbour, which is the infinity encoding).
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a half subnormal m * 2^-24. value * 2^24 is exact in float, and nearbyint
    // rounds ties to even in the default rounding mode; m == 1024 is the smallest normal, whose
    // encoding is the same number.
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent, keep 10 of the 23 mantissa bits, round the 13 dropped bits.
  const std::uint32_t exponent = (magnitude >> 23) - 127 + 15;
  const std::uint32_t mantissa = magnitude & 0x7fffffu;
  std::uint32_t half = exponent << 10 | mantissa >> 13;
  const std::uint32_t dropped = mantissa & 0x1fffu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (half & 1u))) ++half;  // may carry: correct
  return static_cast<std::uint16_t>(sign | half);
}

inline float f16_bits_to_f32(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | mantissa << 13);
  return std::bit_cast<float>(sign | (exponent - 15 + 127) << 23 | mantissa << 13);
}

inline float round_to_bf16(float value) { return bf16_bits_to_f32(f32_to_bf16_bits(value)); }
inline float round_to_f16(float value) { return f16_bits_to_f32(f32_to_f16_bits(value)); }

// The same by DType: `dtype` is DType::kBF16 or DType::kF16.
inline std::uint16_t f32_to_half_bits(DType dtype, float value) {
  return dtype == DType::kBF16 ? f32_to_bf16_bits(value) : f32_to_f16_bits(value);
}
inline float half_bits_to_f32(DType dtype, std::uint16_t bits) {
  return dtype == DType::kBF16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits);
}
// Large results on huge pages where the kernel grants them (core/huge_pages.h): operands that
// a kernel then streams, such as a benchmark's K and V.
inline std::vector<std::uint16_t> to_half_bits(DType dtype, std::span<const float> values) {
  std::vector<std::uint16_t> bits;
  reserve_on_huge_pages(bits, values.size());
  for (const float value : values) bits.push_back(f32_to_half_bits(dtype, value));
  return bits;
}

}  // namespace qkv
