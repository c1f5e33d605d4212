// qkv::attention: validate everything at the boundary and normalise it into one
// AttentionKernelParams (ops/prepare_attention.h), pick a kernel, call it once (CTranslate2's
// ops/ recipe).
#include "qkv/attention.h"
#include "qkv/block_attention.h"

#include <algorithm>

#include "kernels/kernels.h"
#include "kernels/product_path.h"
#include "ops/prepare_attention.h"
#include "ops/validate.h"

namespace qkv {

const char* resolved_kernel_name(const AttentionParams& params, const AttentionOutputs& outputs) {
  switch (ops::resolve_kernel(params.kernel, !outputs.probs.empty(), params.dropout_p > 0.0f)) {
    case Kernel::kReference:
      return "reference";
    case Kernel::kChunked:
      return "chunked";
    case Kernel::kFlash:
      return "flash";
    case Kernel::kAuto:
      break;
  }
  return "?";
}

const char* resolved_product_path(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const AttentionOutputs& outputs, const AttentionParams& params) {
  ops::PreparedAttention prepared;
  ops::prepare_attention(q, k, v, outputs, params, nullptr, prepared,
                         /*out_in_input_dtype=*/true);
  const DType dtype = prepared.params.dtype;
  if (dtype == DType::kF64) return "reference-f64";
  switch (prepared.kernel) {
    case Kernel::kChunked:
      return product_path_name(WideningProductPath(dtype));
    case Kernel::kFlash:
      return product_path_name(attention_flash_product_path(prepared.params));
    case Kernel::kReference:
    case Kernel::kAuto:
      break;
  }
  return "reference-f64";
}

namespace {

// attention() and attention_block() in one; `block` (nullable) places q and k in longer
// sequences.
void run_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                   const AttentionOutputs& outputs, const AttentionParams& params,
                   const BlockPositions* block) {
  ops::PreparedAttention prepared;
  // out in the inputs' dtype for attention() only (a block's out is merged in f32).
  ops::prepare_attention(q, k, v, outputs, params, block, prepared,
                         /*out_in_input_dtype=*/block == nullptr);
  const AttentionKernelParams& p = prepared.params;
  switch (prepared.kernel) {
    case Kernel::kReference:
      attention_reference(p);
      return;
    case Kernel::kChunked:
      attention_chunked_cpu(p);
      return;
    case Kernel::kFlash:
    case Kernel::kAuto:
      attention_flash_cpu(p);
      return;
  }
}

}  // namespace

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOutputs& outputs, const AttentionParams& params) {
  run_attention(q, k, v, outputs, params, nullptr);
}

void attention_block(const TensorView& q, const TensorView& k, const TensorView& v,
                     const AttentionOutputs& outputs, const AttentionParams& params,
                     const BlockPositions& positions) {
  run_attention(q, k, v, outputs, params, &positions);
}

double attention_flops(std::int64_t batch, std::int64_t num_heads_q, double pairs,
                       std::int64_t head_dim, std::int64_t head_dim_v) {
  return 2.0 * static_cast<double>(batch) * static_cast<double>(num_heads_q) * pairs *
         static_cast<double>(head_dim + head_dim_v);
}

double allowed_pairs(std::int64_t seq_q, std::int64_t seq_kv, const AttentionParams& params) {
  const std::int64_t offset = params.align == Align::kBottomRight ? seq_kv - seq_q : 0;
  const ops::Window window = ops::effective_window(params, seq_q, seq_kv, offset);
  const std::int64_t right = window.right;
  double pairs = 0.0;
  for (std::int64_t i = 0; i < seq_q; ++i) {
    const std::int64_t diag = i + offset;
    const std::int64_t lo =
        window.left < 0 ? 0 : std::max<std::int64_t>(0, diag - window.left);
    const std::int64_t hi = right < 0 ? seq_kv : std::min<std::int64_t>(seq_kv, diag + right + 1);
    if (hi > lo) pairs += static_cast<double>(hi - lo);
  }
  return pairs;
}

}  // namespace qkv
