// qkv::attention: validate everything at the boundary, normalise it into one
// AttentionKernelParams, pick a kernel, call it once (CTranslate2's ops/ recipe).
#include "qkv/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/parallel.h"
#include "kernels/kernels.h"
#include "ops/sparse_layout.h"
#include "qkv/error.h"

namespace qkv {
namespace {

constexpr const char* kDimNames[4] = {"batch", "seq", "heads", "head_dim"};

std::string describe(const char* name, const TensorView& view) {
  return std::string(name) + ": shape " + shape_string(view.sizes);
}

void require_data(const char* name, const TensorView& view) {
  if (view.data == nullptr) throw Error(std::string(name) + ": data pointer is null");
}

void require_dtype(const char* name, const TensorView& view, DType want) {
  if (view.dtype != want) {
    throw Error(std::string(name) + ": dtype " + dtype_name(view.dtype) + " is not supported (" +
                (view.dtype == DType::kBF16 || view.dtype == DType::kF16
                     ? "bf16/f16 storage is not implemented yet; round to f32"
                     : std::string("expected ") + dtype_name(want)) +
                ")");
  }
}

void require_positive_sizes(const char* name, const TensorView& view) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] < 1) {
      throw Error(describe(name, view) + " has size " + std::to_string(view.sizes[d]) + " in dim " +
                  std::to_string(d) + "; every size must be >= 1");
    }
  }
}

// a.sizes[dim_a] == b.sizes[dim_b], else an error naming both shapes.
void require_same(const char* name_a, const TensorView& a, int dim_a, const char* name_b,
                  const TensorView& b, int dim_b, const char* what) {
  if (a.sizes[dim_a] != b.sizes[dim_b]) {
    throw Error(describe(name_a, a) + " does not match " + describe(name_b, b) + ": " + what +
                " differs (" + std::to_string(a.sizes[dim_a]) + " vs " +
                std::to_string(b.sizes[dim_b]) + ")");
  }
}

void require_shape(const char* name, const TensorView& view,
                   const std::array<std::int64_t, 4>& want, const char* want_text) {
  if (view.sizes != want) {
    throw Error(describe(name, view) + " must be " + shape_string(want) + " " + want_text);
  }
}

// Outputs are written by several threads: a zero stride on a dim of size > 1 would make them
// race on one element.
void require_writable_strides(const char* name, const TensorView& view) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] > 1 && view.strides[d] == 0) {
      throw Error(std::string(name) + ": stride 0 in dim " + std::to_string(d) +
                  " of an output with size " + std::to_string(view.sizes[d]));
    }
  }
}

// mask / bias: each size 1 (broadcast: stride 0) or the full size of [B, Hq, Lq, Lk].
void broadcast_strides(const char* name, const TensorView& view,
                       const std::array<std::int64_t, 4>& full, std::int64_t out[4]) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] == full[d]) {
      out[d] = full[d] == 1 ? 0 : view.strides[d];
    } else if (view.sizes[d] == 1) {
      out[d] = 0;
    } else {
      throw Error(describe(name, view) +
                  " is not broadcastable to (B, Hq, Lq, Lk) = " + shape_string(full) + ": dim " +
                  std::to_string(d) + " must be 1 or " + std::to_string(full[d]));
    }
  }
}

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

Kernel resolve_kernel(Kernel requested, bool wants_probs) {
  if (requested != Kernel::kAuto) return requested;
  return wants_probs ? Kernel::kChunked : Kernel::kFlash;
}

}  // namespace

const char* resolved_kernel_name(const AttentionParams& params, const AttentionOutputs& outputs) {
  switch (resolve_kernel(params.kernel, !outputs.probs.empty())) {
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

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOutputs& outputs, const AttentionParams& params) {
  // q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]  out: [B, Lq, Hq, Dv]
  const TensorView& out = outputs.out;
  const std::pair<const char*, const TensorView*> operands[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
  for (const auto& [name, view] : operands) {
    require_data(name, *view);
    require_dtype(name, *view, DType::kF32);
    require_positive_sizes(name, *view);
  }
  require_same("q", q, 0, "k", k, 0, "batch (dim 0)");
  require_same("k", k, 0, "v", v, 0, "batch (dim 0)");
  require_same("k", k, 1, "v", v, 1, "seq_kv (dim 1)");
  require_same("k", k, 2, "v", v, 2, "num_heads_kv (dim 2)");
  require_same("q", q, 3, "k", k, 3, "head_dim (dim 3)");
  const std::int64_t batch = q.sizes[0], seq_q = q.sizes[1], num_heads_q = q.sizes[2];
  const std::int64_t head_dim = q.sizes[3], seq_kv = k.sizes[1], num_heads_kv = k.sizes[2];
  const std::int64_t head_dim_v = v.sizes[3];
  if (num_heads_q % num_heads_kv != 0) {
    throw Error(describe("q", q) + " has " + std::to_string(num_heads_q) +
                " heads, not a multiple of the " + std::to_string(num_heads_kv) + " heads of " +
                describe("k", k) + " (num_heads_q % num_heads_kv must be 0)");
  }
  require_shape("out", out, {batch, seq_q, num_heads_q, head_dim_v}, "(B, Lq, Hq, Dv)");
  require_writable_strides("out", out);

  const std::array<std::int64_t, 4> score_shape = {batch, num_heads_q, seq_q, seq_kv};
  const TensorView& lse = outputs.lse;
  if (!lse.empty()) {
    require_data("lse", lse);
    require_dtype("lse", lse, DType::kF32);
    require_shape("lse", lse, {batch, num_heads_q, seq_q, 1}, "(B, Hq, Lq, 1)");
    require_writable_strides("lse", lse);
  }
  const TensorView& probs = outputs.probs;
  const Kernel kernel = resolve_kernel(params.kernel, !probs.empty());
  if (!probs.empty()) {
    require_dtype("probs", probs, DType::kF32);
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
  if (!params.key_lengths.empty()) {
    if (static_cast<std::int64_t>(params.key_lengths.size()) != batch) {
      throw Error("key_lengths: has " + std::to_string(params.key_lengths.size()) +
                  " entries, expected batch = " + std::to_string(batch) + " (q: shape " +
                  shape_string(q.sizes) + ")");
    }
    for (std::size_t b = 0; b < params.key_lengths.size(); ++b) {
      const std::int64_t length = params.key_lengths[b];
      if (length < 0 || length > seq_kv) {
        throw Error("key_lengths: entry " + std::to_string(b) + " is " + std::to_string(length) +
                    ", outside [0, seq_kv = " + std::to_string(seq_kv) + "] (k: shape " +
                    shape_string(k.sizes) + ")");
      }
    }
  }
  if (params.num_threads < 0) {
    throw Error("num_threads: must be >= 0 (0 = default), got " +
                std::to_string(params.num_threads));
  }
  if (params.chunk_size < 1) {
    throw Error("chunk_size: must be >= 1, got " + std::to_string(params.chunk_size));
  }

  AttentionKernelParams p{};
  p.batch = batch;
  p.seq_q = seq_q;
  p.seq_kv = seq_kv;
  p.num_heads_q = num_heads_q;
  p.num_heads_kv = num_heads_kv;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.q = static_cast<const float*>(q.data);
  p.k = static_cast<const float*>(k.data);
  p.v = static_cast<const float*>(v.data);
  p.out = static_cast<float*>(out.data);
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = q.strides[d];
    p.k_stride[d] = k.strides[d];
    p.v_stride[d] = v.strides[d];
    p.out_stride[d] = out.strides[d];
  }
  if (!lse.empty()) {
    p.lse = static_cast<float*>(lse.data);
    for (int d = 0; d < 3; ++d) p.lse_stride[d] = lse.strides[d];
  }
  if (!probs.empty()) {
    p.probs = static_cast<float*>(probs.data);
    for (int d = 0; d < 4; ++d) p.probs_stride[d] = probs.strides[d];
  }
  p.scale = scale;
  p.softcap = params.softcap;
  p.diagonal_offset = params.align == Align::kBottomRight ? seq_kv - seq_q : 0;
  p.window_left = params.window_left;
  p.window_right = params.window_right;
  if (params.causal) {
    p.window_right = p.window_right < 0 ? 0 : std::min<std::int64_t>(p.window_right, 0);
  }
  p.key_lengths = params.key_lengths.empty() ? nullptr : params.key_lengths.data();
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
    require_dtype("bias", params.bias, DType::kF32);
    require_data("bias", params.bias);
    broadcast_strides("bias", params.bias, score_shape, p.bias_stride);
    require_no_nan_or_pos_inf(params.bias);
    p.bias = static_cast<const float*>(params.bias.data);
  }
  ResolvedSparsity sparsity;  // owns what p.sparse points to, for the kernel call
  if (params.sparsity) {
    resolve_sparsity(*params.sparsity, seq_q, seq_kv, num_heads_q, p.diagonal_offset, sparsity);
    p.sparse = sparsity.params;
  }
  p.num_threads = resolve_num_threads(params.num_threads);
  p.chunk_size = params.chunk_size;

  switch (kernel) {
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

double attention_flops(std::int64_t batch, std::int64_t num_heads_q, double pairs,
                       std::int64_t head_dim, std::int64_t head_dim_v) {
  return 2.0 * static_cast<double>(batch) * static_cast<double>(num_heads_q) * pairs *
         static_cast<double>(head_dim + head_dim_v);
}

double allowed_pairs(std::int64_t seq_q, std::int64_t seq_kv, const AttentionParams& params) {
  const std::int64_t offset = params.align == Align::kBottomRight ? seq_kv - seq_q : 0;
  std::int64_t right = params.window_right;
  if (params.causal) right = right < 0 ? 0 : std::min<std::int64_t>(right, 0);
  double pairs = 0.0;
  for (std::int64_t i = 0; i < seq_q; ++i) {
    const std::int64_t diag = i + offset;
    const std::int64_t lo =
        params.window_left < 0 ? 0 : std::max<std::int64_t>(0, diag - params.window_left);
    const std::int64_t hi = right < 0 ? seq_kv : std::min<std::int64_t>(seq_kv, diag + right + 1);
    if (hi > lo) pairs += static_cast<double>(hi - lo);
  }
  return pairs;
}

}  // namespace qkv
