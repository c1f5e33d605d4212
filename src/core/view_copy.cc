#include "core/view_copy.h"

#include <cstdint>
#include <cstring>

#include "core/float16.h"

namespace qkv {
namespace {

template <typename Dst, typename Src, typename Convert>
void copy_elements(const TensorView& src, Dst* dst, const std::array<std::int64_t, 4>& strides,
                   Convert convert) {
  const auto* data = static_cast<const Src*>(src.data);
  for (std::int64_t i0 = 0; i0 < src.sizes[0]; ++i0) {
    for (std::int64_t i1 = 0; i1 < src.sizes[1]; ++i1) {
      for (std::int64_t i2 = 0; i2 < src.sizes[2]; ++i2) {
        Dst* row = dst + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
        for (std::int64_t i3 = 0; i3 < src.sizes[3]; ++i3) {
          row[i3 * strides[3]] = convert(data[src.offset(i0, i1, i2, i3)]);
        }
      }
    }
  }
}

// Bit for bit with rows of unit stride on both sides: a memcpy per row (element by element,
// bf16 rows copied for the flash kernel's head-major K/V ran 0.96x).
void copy_rows(const TensorView& src, void* dst, const std::array<std::int64_t, 4>& strides) {
  const std::int64_t bytes = dtype_size(src.dtype);
  const auto* data = static_cast<const char*>(src.data);
  auto* out = static_cast<char*>(dst);
  for (std::int64_t i0 = 0; i0 < src.sizes[0]; ++i0) {
    for (std::int64_t i1 = 0; i1 < src.sizes[1]; ++i1) {
      for (std::int64_t i2 = 0; i2 < src.sizes[2]; ++i2) {
        std::memcpy(out + (i0 * strides[0] + i1 * strides[1] + i2 * strides[2]) * bytes,
                    data + src.offset(i0, i1, i2, 0) * bytes,
                    static_cast<std::size_t>(src.sizes[3] * bytes));
      }
    }
  }
}

}  // namespace

void copy_view(const TensorView& src, DType dtype, void* dst,
               const std::array<std::int64_t, 4>& dst_strides) {
  if (src.dtype == dtype && src.strides[3] == 1 && dst_strides[3] == 1) {
    copy_rows(src, dst, dst_strides);
    return;
  }
  if (dtype == DType::kF32) {
    copy_elements<float, float>(src, static_cast<float*>(dst), dst_strides,
                                [](float x) { return x; });
    return;
  }
  auto* bits = static_cast<std::uint16_t*>(dst);
  if (src.dtype == dtype) {
    copy_elements<std::uint16_t, std::uint16_t>(src, bits, dst_strides,
                                                [](std::uint16_t x) { return x; });
  } else if (dtype == DType::kBF16) {
    copy_elements<std::uint16_t, float>(src, bits, dst_strides,
                                        [](float x) { return f32_to_bf16_bits(x); });
  } else {
    copy_elements<std::uint16_t, float>(src, bits, dst_strides,
                                        [](float x) { return f32_to_f16_bits(x); });
  }
}

}  // namespace qkv
