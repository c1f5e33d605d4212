// Argument conversions (python/options.h).
#include "python/options.h"

#include "python/arrays.h"

namespace qkv::python {

Align parse_align(const std::string& align) {
  return parse_choice<Align>("align", align,
                             {{"bottom_right", Align::kBottomRight},
                              {"top_left", Align::kTopLeft},
                              {"bottom-right", Align::kBottomRight},
                              {"top-left", Align::kTopLeft}});
}

Kernel parse_kernel(const std::string& kernel) {
  return parse_choice<Kernel>("kernel", kernel,
                              {{"auto", Kernel::kAuto},
                               {"reference", Kernel::kReference},
                               {"chunked", Kernel::kChunked},
                               {"flash", Kernel::kFlash}});
}

std::vector<std::int64_t> key_lengths_of(nb::handle key_lengths) {
  if (key_lengths.is_none()) return {};
  const Held<InArray> held = input_view(
      "key_lengths", key_lengths, {1, 1, "1: (B,)", {DType::kI32, DType::kI64}, "int32 or int64"});
  const TensorView& view = held.view;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(view.sizes[3]));
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    const std::int64_t offset = static_cast<std::int64_t>(b) * view.strides[3];
    lengths[b] = view.dtype == DType::kI32 ? static_cast<const std::int32_t*>(view.data)[offset]
                                           : static_cast<const std::int64_t*>(view.data)[offset];
  }
  return lengths;
}

}  // namespace qkv::python
