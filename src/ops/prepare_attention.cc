// The boundary of every attention op (ops/prepare_attention.h): validate, then lower into one
// AttentionKernelParams (CTranslate2's ops/ recipe).
#include "ops/prepare_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/dropout_mask.h"
#include "ops/validate.h"
#include "qkv/error.h"

namespace qkv::ops {
namespace {

// The dtypes attention() takes for q, k and v.
const char* const kDtypeHint = "expected f32, bf16, f16 or f64";

// The bias may hold -inf (a mask), but +inf or NaN would turn a softmax row into NaN.
void require_no_nan_or_pos_inf(const TensorView& bias) {
  const float* data = static_cast<const float*>(bias.data);
  for (std::int64_t b = 0; b < bias.sizes[0]; ++b)
    for (std::int64_t h = 0; h < bias.sizes[1]; ++h)
      for (std::int64_t i = 0; i < bias.sizes[2]; ++i)
        for (std::int64_t j = 0; j < bias.sizes[3]; ++j) {
          const float x = data[bias.offset(b, h, i, j)];
          if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
            throw Error("bias: element (" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                        std::to_string(i) + ", " + std::to_string(j) + ") of " +
                        describe("bias", bias) + " is " + (std::isnan(x) ? "NaN" : "+inf") +
                        "; only finite values and -inf are allowed");
          }
        }
}

// A block's positions: offsets and whole lengths in range, and only the options that are
// defined by positions.
void validate_block(const BlockPositions& b, std::int64_t seq_q, std::int64_t seq_kv,
                    const AttentionParams& params, const AttentionOutputs& outputs) {
  // Whole sequences up to 2^40 keep every diagonal and window sum far from int64's end.
  constexpr std::int64_t kMaxLength = std::int64_t{1} << 40;
  auto in_range = [&](const char* offset_name, std::int64_t offset, const char* length_name,
                      std::int64_t length, std::int64_t block_length) {
    if (offset < 0 || length > kMaxLength || offset > length - block_length) {
      throw Error(std::string("positions: ") + offset_name + " = " + std::to_string(offset) +
                  " and " + length_name + " = " + std::to_string(length) +
                  " do not hold a block of " + std::to_string(block_length) + " (need 0 <= " +
                  offset_name + " <= " + length_name + " - block length, " + length_name +
                  " <= 2^40)");
    }
  };
  in_range("q_offset", b.q_offset, "seq_q", b.seq_q, seq_q);
  in_range("k_offset", b.k_offset, "seq_kv", b.seq_kv, seq_kv);
  const char* unsupported = !params.mask.empty()       ? "mask"
                            : !params.bias.empty()     ? "bias"
                            : params.sparsity          ? "sparsity"
                            : !outputs.probs.empty()   ? "probs"
                            : params.dropout_p != 0.0f ? "dropout_p"
                                                       : nullptr;
  if (unsupported != nullptr) {
    throw Error(std::string(unsupported) +
                ": not available for a block (attention_block takes what positions define: "
                "causal, window, key lengths; and probabilities would cover the block only)");
  }
}

}  // namespace

void prepare_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOutputs& outputs, const AttentionParams& params,
                       const BlockPositions* block, PreparedAttention& prepared,
                       bool out_in_input_dtype) {
  // q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]  out: [B, Lq, Hq, Dv]
  const TensorView& out = outputs.out;
  const AttentionShape shape =
      validate_operands(q, k, v, out, /*half_inputs=*/true, kDtypeHint, out_in_input_dtype);
  const std::int64_t batch = shape.batch, seq_q = shape.seq_q, num_heads_q = shape.num_heads_q;
  const std::int64_t head_dim = shape.head_dim, seq_kv = shape.seq_kv;

  const std::array<std::int64_t, 4> score_shape = {batch, num_heads_q, seq_q, seq_kv};
  // f64 inputs (gradient checks) run on the reference kernel and give f64 outputs.
  const bool f64 = q.dtype == DType::kF64;
  const TensorView& lse = outputs.lse;
  if (!lse.empty()) {
    require_data("lse", lse);
    require_output_dtype("lse", lse, q.dtype);
    require_shape("lse", lse, {batch, num_heads_q, seq_q, 1}, "(B, Hq, Lq, 1)");
    require_writable_strides("lse", lse);
  }
  const TensorView& probs = outputs.probs;
  if (!(params.dropout_p >= 0.0f && params.dropout_p < 1.0f)) {
    throw Error("dropout_p: must be in [0, 1), got " + std::to_string(params.dropout_p));
  }
  const bool dropout = params.dropout_p > 0.0f;
  if (f64 && params.kernel != Kernel::kAuto && params.kernel != Kernel::kReference) {
    throw Error("kernel: f64 inputs run on the reference kernel only (gradient checks); use "
                "kernel auto or reference");
  }
  const Kernel kernel = f64 ? Kernel::kReference : resolve_kernel(params.kernel, !probs.empty(), dropout);
  if (dropout && kernel == Kernel::kChunked) {
    throw Error("dropout_p: not available from the chunked kernel; use kernel auto, flash or "
                "reference");
  }
  prepared.kernel = kernel;
  if (!probs.empty()) {
    require_output_dtype("probs", probs, q.dtype);
    require_shape("probs", probs, score_shape, "(B, Hq, Lq, Lk)");
    require_writable_strides("probs", probs);
    if (kernel == Kernel::kFlash) {
      throw Error(
          "probs: the flash kernel never materialises probabilities; use kernel "
          "auto, chunked or reference");
    }
  }

  const float scale = params.scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    throw Error("scale: must be finite and > 0, got " + std::to_string(scale));
  }
  if (!(params.softcap >= 0.0f) || !std::isfinite(params.softcap)) {
    throw Error("softcap: must be finite and >= 0 (0 = off), got " +
                std::to_string(params.softcap));
  }
  if (params.window_left < -1 || params.window_right < -1) {
    throw Error("window: (" + std::to_string(params.window_left) + ", " +
                std::to_string(params.window_right) + ") has a side below -1 (-1 = unbounded)");
  }
  // Key lengths count keys of the whole sequence; a block sees the part inside it.
  std::int64_t diagonal = diagonal_offset(params.align, seq_q, seq_kv);
  std::vector<std::int64_t>& block_lengths = prepared.block_lengths;
  std::span<const std::int64_t> key_lengths = params.key_lengths;
  if (block != nullptr) {
    validate_block(*block, seq_q, seq_kv, params, outputs);
    diagonal = diagonal_offset(params.align, block->seq_q, block->seq_kv) + block->q_offset -
               block->k_offset;
    validate_key_lengths(key_lengths, q, k, block->seq_kv);
    for (const std::int64_t length : key_lengths) {
      block_lengths.push_back(std::clamp(length - block->k_offset, std::int64_t{0}, seq_kv));
    }
    if (!key_lengths.empty()) key_lengths = block_lengths;
  } else {
    validate_key_lengths(key_lengths, q, k, seq_kv);
  }
  validate_num_threads(params.num_threads);
  if (params.chunk_size < 1) {
    throw Error("chunk_size: must be >= 1, got " + std::to_string(params.chunk_size));
  }

  AttentionKernelParams& p = prepared.params;
  p = AttentionKernelParams{};
  set_operands(p, shape, q, k, v, out);
  p.dtype = q.dtype;
  if (!lse.empty()) {
    p.lse = static_cast<float*>(lse.data);
    for (int d = 0; d < 3; ++d) p.lse_stride[d] = lse.strides[d];
  }
  if (!probs.empty()) {
    p.probs = static_cast<float*>(probs.data);
    for (int d = 0; d < 4; ++d) p.probs_stride[d] = probs.strides[d];
  }
  if (out.dtype == DType::kBF16 || out.dtype == DType::kF16) {  // the inputs' dtype
    p.out16 = static_cast<std::uint16_t*>(out.data);
    p.out = nullptr;
  }
  if (f64) {  // the same memory as doubles (kernel_params.h)
    p.out_f64 = static_cast<double*>(out.data);
    p.lse_f64 = static_cast<double*>(lse.data);
    p.probs_f64 = static_cast<double*>(probs.data);
    p.out = p.lse = p.probs = nullptr;
  }
  p.scale = scale;
  if (f64) {
    p.scale_f64 = params.scale ? static_cast<double>(*params.scale)
                               : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }
  p.softcap = params.softcap;
  p.diagonal_offset = diagonal;
  const Window window = effective_window(params, seq_q, seq_kv, diagonal);
  p.window_left = window.left;
  p.window_right = window.right;
  p.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
  if (!params.mask.empty()) {
    if (params.mask.dtype != DType::kBool && params.mask.dtype != DType::kU8) {
      throw Error(std::string("mask: dtype ") + dtype_name(params.mask.dtype) +
                  " is not supported (expected bool or u8; true = may attend)");
    }
    require_data("mask", params.mask);
    broadcast_strides("mask", params.mask, score_shape, p.mask_stride);
    p.mask = static_cast<const std::uint8_t*>(params.mask.data);
  }
  if (!params.bias.empty()) {
    require_dtype("bias", params.bias, DType::kF32, "expected f32");
    require_data("bias", params.bias);
    broadcast_strides("bias", params.bias, score_shape, p.bias_stride);
    require_no_nan_or_pos_inf(params.bias);
    p.bias = static_cast<const float*>(params.bias.data);
  }
  const NamedView written[] = {{"out", &out}, {"lse", &lse}, {"probs", &probs}};
  const NamedView read[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"mask", &params.mask}, {"bias", &params.bias}};
  require_no_overlap(written, read);
  if (params.sparsity) {
    resolve_sparsity(*params.sparsity, seq_q, seq_kv, num_heads_q, p.diagonal_offset,
                     prepared.sparsity);
    p.sparse = prepared.sparsity.params;
  }
  if (dropout) {
    p.dropout_p = params.dropout_p;
    p.dropout_threshold = dropout_threshold(params.dropout_p);
    p.dropout_scale = 1.0f / (1.0f - params.dropout_p);
    p.dropout_seed = params.seed;
    p.dropout_offset = params.offset;
  }
  p.num_threads = resolve_num_threads(params.num_threads);
  p.chunk_size = params.chunk_size;
}

Kernel resolve_kernel(Kernel requested, bool wants_probs, bool dropout) {
  if (requested != Kernel::kAuto) return requested;
  if (!wants_probs) return Kernel::kFlash;
  return dropout ? Kernel::kReference : Kernel::kChunked;
}

}  // namespace qkv::ops
