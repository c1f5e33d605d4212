// flash_product_paths() and pin_flash_product_path() (kernels/product_path.h): the flash kernel
// picks its products from the CPU (FlashProductPath in products-inl.h), and so does its backward
// (backward_products-inl.h); these walk the switches that steer that choice and read back what
// it became.
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

// The distinct paths `path_of(dtype)` takes over the settings, the defaults' first.
template <class PathOf>
std::vector<ProductPath> PathsOf(DType dtype, PathOf path_of) {
  std::vector<ProductPath> paths;
  for (const Switches& s : kSettings) {
    set(s);
    const ProductPath path = path_of(dtype);
    if (std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
  }
  set(kSettings[0]);
  return paths;
}

// The forced pairs first: pinning bf16-vdpbf16ps forces them, so that the shapes where the
// flash kernel would widen by itself (FlashProductPath(params)) run on the pairs too.
constexpr Switches kPinOrder[] = {kSettings[1], kSettings[0], kSettings[2], kSettings[3]};

template <class PathOf>
bool Pin(DType dtype, ProductPath path, PathOf path_of) {
  for (const Switches& s : kPinOrder) {
    set(s);
    if (path_of(dtype) == path) return true;
  }
  set(kSettings[0]);
  return false;
}

ProductPath ForwardPath(DType dtype) { return attention_flash_product_path(dtype); }
ProductPath BackwardPath(DType dtype) { return attention_backward_flash_product_path(dtype); }

}  // namespace

std::vector<ProductPath> flash_product_paths(DType dtype) { return PathsOf(dtype, ForwardPath); }

bool pin_flash_product_path(DType dtype, ProductPath path) { return Pin(dtype, path, ForwardPath); }

std::vector<ProductPath> backward_product_paths(DType dtype) {
  return PathsOf(dtype, BackwardPath);
}

bool pin_backward_product_path(DType dtype, ProductPath path) {
  return Pin(dtype, path, BackwardPath);
}

void unpin_flash_product_path() { set(kSettings[0]); }

}  // namespace qkv
