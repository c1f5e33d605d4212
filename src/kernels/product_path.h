// The product paths of the flash and chunked CPU kernels: which instructions compute the two
// tile products (q k^T and p v) for an input dtype. The kernels choose one once per call at their
// entry (kernels/cpu/products-inl.h); `qkv bench` reports it and the tests name the paths they
// exercised. docs/kernels.md, "Product paths".
#pragma once

#include <vector>

#include "qkv/tensor.h"

namespace qkv {

struct AttentionKernelParams;  // kernels/kernel_params.h

enum class ProductPath {
  kF32,          // f32 operands, Highway FMA
  kBf16Widened,  // bf16 operands widened to f32 (exact), Highway FMA
  kF16Widened,   // f16 operands widened to f32 (exact), Highway FMA
  kBf16Pairs,    // bf16 pairs on vdpbf16ps (AVX512-BF16), f32 accumulation, probabilities in bf16
  kBf16Amx,      // bf16 on AMX tiles (tdpbf16ps), f32 accumulation, probabilities in bf16
  kF16Amx,       // f16 split into bf16 hi + lo on AMX tiles (3 products for q k^T, 2 for p v),
                 // f32 accumulation, probabilities in bf16
};

// The f32 FMA path for dtype (bf16 and f16 widened): the chunked kernel always takes it (its
// probabilities are written out in f32), and so does the flash backward.
constexpr ProductPath WideningProductPath(DType dtype) {
  return dtype == DType::kBF16  ? ProductPath::kBf16Widened
         : dtype == DType::kF16 ? ProductPath::kF16Widened
                                : ProductPath::kF32;
}

// Every path, as `qkv bench --products` lists them.
inline constexpr ProductPath kProductPaths[] = {ProductPath::kF32,        ProductPath::kBf16Widened,
                                                ProductPath::kBf16Pairs,  ProductPath::kBf16Amx,
                                                ProductPath::kF16Widened, ProductPath::kF16Amx};

// The storage dtype a path multiplies.
constexpr DType product_path_dtype(ProductPath path) {
  switch (path) {
    case ProductPath::kBf16Widened:
    case ProductPath::kBf16Pairs:
    case ProductPath::kBf16Amx:
      return DType::kBF16;
    case ProductPath::kF16Widened:
    case ProductPath::kF16Amx:
      return DType::kF16;
    case ProductPath::kF32:
      break;
  }
  return DType::kF32;
}

// "f32-fma", "bf16-widened-fma", "f16-widened-fma", "bf16-vdpbf16ps", "bf16-amx",
// "f16-amx-split".
constexpr const char* product_path_name(ProductPath path) {
  switch (path) {
    case ProductPath::kBf16Widened:
      return "bf16-widened-fma";
    case ProductPath::kF16Widened:
      return "f16-widened-fma";
    case ProductPath::kBf16Pairs:
      return "bf16-vdpbf16ps";
    case ProductPath::kBf16Amx:
      return "bf16-amx";
    case ProductPath::kF16Amx:
      return "f16-amx-split";
    case ProductPath::kF32:
      break;
  }
  return "f32-fma";
}

// Whether the path rounds the probabilities to bf16 before the value product (the vdpbf16ps and
// AMX paths do, as FlashAttention does on GPUs; the others keep them in f32).
constexpr bool rounds_probabilities(ProductPath path) {
  return path == ProductPath::kBf16Pairs || path == ProductPath::kBf16Amx ||
         path == ProductPath::kF16Amx;
}

// The path the flash kernel takes for dtype on the Highway target it dispatches to now and this
// CPU (kernels/cpu/flash_forward.cc), and for one call: the dtype's but for the shapes that
// products-inl.h's FlashProductPath(params) names (bf16 multi-head decode steps in BSHD widen
// where the vdpbf16ps pairs are preferred).
ProductPath attention_flash_product_path(DType dtype);
ProductPath attention_flash_product_path(const AttentionKernelParams& params);

// The path the flash backward takes for dtype on the Highway target it dispatches to now and
// this CPU (kernels/cpu/backward_products-inl.h), as the forward's: on the AVX3 targets bf16 on
// vdpbf16ps pairs where bf16dot::preferred() (AMD, or forced), else on AMX tiles where
// amx::available(); otherwise every dtype widened to f32.
ProductPath attention_backward_flash_product_path(DType dtype);

// The paths the flash kernel can take for dtype on this CPU and Highway target, its own choice
// first, and pinning one of them for the rest of the process (`qkv bench --products`), through
// the switches of kernels/cpu/bf16_dot.h and amx.h: the vdpbf16ps pairs forced, or switched off
// so that AMX takes bf16, or both off (widened). pin_flash_product_path returns false, with the
// switches back at their defaults, when the path is not one of flash_product_paths(dtype); a pin
// sets every switch, so it replaces an earlier one. None may run while a kernel does; the
// kernel results of each path are its own (the paths round differently).
std::vector<ProductPath> flash_product_paths(DType dtype);
bool pin_flash_product_path(DType dtype, ProductPath path);
// The same for the flash backward (attention_backward_flash_product_path): for bf16,
// bf16-vdpbf16ps on a CPU with AVX512-BF16 (its own choice on AMD), bf16-amx on one with AMX
// (its choice on Intel), and bf16-widened-fma; the widened path alone for f16, f32 for f32.
std::vector<ProductPath> backward_product_paths(DType dtype);
bool pin_backward_product_path(DType dtype, ProductPath path);
// The switches back at their defaults: the flash kernel's own choice again (forward and
// backward).
void unpin_flash_product_path();

}  // namespace qkv
