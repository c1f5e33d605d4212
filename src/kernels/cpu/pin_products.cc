// flash_product_paths() and pin_flash_product_path() (kernels/product_path.h): the flash kernel
// picks its products from the CPU (FlashProductPath in products-inl.h); these walk the switches
// that steer that choice and read back what it became.
#include <algorithm>
#include <vector>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/product_path.h"

namespace qkv {
namespace {

struct Switches {
  bool pairs_enabled, pairs_forced, amx_enabled;
};

// The defaults first, then what each forces: the pairs wherever AVX512-BF16 runs (Intel too),
// AMX for bf16 where the pairs would win (AMD), every product widened.
constexpr Switches kSettings[] = {
    {true, false, true}, {true, true, true}, {false, false, true}, {false, false, false}};

void set(const Switches& s) {
  bf16dot::set_enabled(s.pairs_enabled);
  bf16dot::set_forced(s.pairs_forced);
  amx::set_enabled(s.amx_enabled);
}

}  // namespace

std::vector<ProductPath> flash_product_paths(DType dtype) {
  std::vector<ProductPath> paths;
  for (const Switches& s : kSettings) {
    set(s);
    const ProductPath path = attention_flash_product_path(dtype);
    if (std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
  }
  set(kSettings[0]);
  return paths;
}

// The forced pairs first: pinning bf16-vdpbf16ps forces them, so that the shapes where the
// flash kernel would widen by itself (FlashProductPath(params)) run on the pairs too.
constexpr Switches kPinOrder[] = {kSettings[1], kSettings[0], kSettings[2], kSettings[3]};

bool pin_flash_product_path(DType dtype, ProductPath path) {
  for (const Switches& s : kPinOrder) {
    set(s);
    if (attention_flash_product_path(dtype) == path) return true;
  }
  set(kSettings[0]);
  return false;
}

void unpin_flash_product_path() { set(kSettings[0]); }

}  // namespace qkv
