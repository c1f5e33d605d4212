// Boundary checks shared by the ops (attention(), linear_attention()): every message names the
// argument and, for shapes, both shapes (DESIGN.md section 4 and STYLE.md 7). Kernels never
// re-check what passed here.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "qkv/attention.h"
#include "qkv/tensor.h"

namespace qkv::ops {

// "q: shape (2, 5, 4, 8)".
std::string describe(const char* name, const TensorView& view);

void require_data(const char* name, const TensorView& view);
// `what_else` ends the message: "q: dtype bf16 is not supported (<what_else>)".
void require_dtype(const char* name, const TensorView& view, DType want,
                   const std::string& what_else);
void require_positive_sizes(const char* name, const TensorView& view);
// a.sizes[dim_a] == b.sizes[dim_b], else an error naming both shapes.
void require_same(const char* name_a, const TensorView& a, int dim_a, const char* name_b,
                  const TensorView& b, int dim_b, const char* what);
void require_shape(const char* name, const TensorView& view,
                   const std::array<std::int64_t, 4>& want, const char* want_text);
// Outputs are written by several threads: a zero stride on a dim of size > 1 would make them
// race on one element.
void require_writable_strides(const char* name, const TensorView& view);
// mask / bias: each size 1 (broadcast: stride 0) or the full size of [B, Hq, Lq, Lk].
void broadcast_strides(const char* name, const TensorView& view,
                       const std::array<std::int64_t, 4>& full, std::int64_t out[4]);

// The sizes of one attention problem, read from validated operands.
struct AttentionShape {
  std::int64_t batch, seq_q, seq_kv, num_heads_q, num_heads_kv, head_dim, head_dim_v;
};

// Attention's float outputs (out, lse, probs; the backward's out, lse, dout and gradients) are
// f64 for f64 q, k, v (the reference kernel's gradient-check path) and f32 otherwise:
// require_output_dtype checks one against the inputs' dtype, naming it.
DType output_dtype(DType input);
void require_output_dtype(const char* name, const TensorView& view, DType input);

// q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]  out: [B, Lq, Hq, Dv]
// Each present, sizes >= 1, consistent, Hq a multiple of Hkv, out writable and f32 (f64 for f64
// inputs; or, when `out_in_input_dtype`, bf16/f16 like bf16/f16 inputs). q, k and v share one
// dtype: f32, or bf16/f16/f64 when `half_inputs` (else the error ends with `dtype_hint`).
AttentionShape validate_operands(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, bool half_inputs,
                                 const std::string& dtype_hint, bool out_in_input_dtype = false);

// Copies the sizes, data pointers and strides of validated operands into a kernel's params
// struct (AttentionKernelParams, LinearKernelParams: the same field names).
template <typename KernelParams>
void set_operands(KernelParams& p, const AttentionShape& s, const TensorView& q,
                  const TensorView& k, const TensorView& v, const TensorView& out) {
  p.batch = s.batch;
  p.seq_q = s.seq_q;
  p.seq_kv = s.seq_kv;
  p.num_heads_q = s.num_heads_q;
  p.num_heads_kv = s.num_heads_kv;
  p.head_dim = s.head_dim;
  p.head_dim_v = s.head_dim_v;
  p.q = static_cast<decltype(p.q)>(q.data);
  p.k = static_cast<decltype(p.k)>(k.data);
  p.v = static_cast<decltype(p.v)>(v.data);
  p.out = static_cast<float*>(out.data);
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = q.strides[d];
    p.k_stride[d] = k.strides[d];
    p.v_stride[d] = v.strides[d];
    p.out_stride[d] = out.strides[d];
  }
}

// Outputs must not share memory with an input or another output: a kernel that writes out
// rows while it still reads q (or another output's rows) would compute from overwritten data.
// Two views are apart where their byte extents (first to last element) are, or where their
// contiguous runs fall in different residues modulo the gcd of their other strides: column
// ranges of one row buffer (dq, dk, dv in a [dq | dk | dv] gradient) are apart. A sufficient
// test: views that share no byte yet fail both (numpy's shares_memory solves the general case)
// are refused too. `outputs` and `inputs`: (name, view) pairs; empty views are skipped.
using NamedView = std::pair<const char*, const TensorView*>;
void require_no_overlap(std::span<const NamedView> outputs, std::span<const NamedView> inputs);

// The causal/window constraint the kernels apply: key j is allowed for query i when
// i' - left <= j <= i' + right (-1 = unbounded on that side), i' = i + diagonal_offset
// (Lk - Lq bottom-right, 0 top-left; a block of a longer sequence adds its query offset minus
// its key offset). causal is folded into right (right = min(right, 0)), and a side that allows
// every key of [0, Lk) on its side for every query becomes -1: i' +- side then never overflows,
// whatever int64 the caller passed. Sides must be >= -1 (attention() checks).
struct Window {
  std::int64_t left, right;
};
Window effective_window(const AttentionParams& params, std::int64_t seq_q, std::int64_t seq_kv,
                        std::int64_t diagonal_offset);
// The diagonal offset of a whole problem: Lk - Lq bottom-right, 0 top-left.
inline std::int64_t diagonal_offset(Align align, std::int64_t seq_q, std::int64_t seq_kv) {
  return align == Align::kBottomRight ? seq_kv - seq_q : 0;
}

// key_lengths: empty, or [B] entries each in [0, seq_kv] (Lk of k, or the whole key sequence's
// length for a block of it).
void validate_key_lengths(std::span<const std::int64_t> key_lengths, const TensorView& q,
                          const TensorView& k, std::int64_t seq_kv);

void validate_num_threads(int num_threads);

}  // namespace qkv::ops
