// qkv::merge_attention: two partial attention results over disjoint key sets, combined by their
// log-sum-exp weights (qkv/block_attention.h). O(B * Lq * Hq * Dv): a plain loop over rows.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.h"
#include "ops/validate.h"
#include "qkv/block_attention.h"
#include "qkv/error.h"

namespace qkv {

void merge_attention(const TensorView& out, const TensorView& lse, const TensorView& out_b,
                     const TensorView& lse_b, int num_threads) {
  // out, out_b: [B, Lq, Hq, Dv]   lse, lse_b: [B, Hq, Lq, 1]
  for (const auto& [name, view] : {std::pair{"out", &out}, {"lse", &lse}, {"out_b", &out_b},
                                   {"lse_b", &lse_b}}) {
    ops::require_data(name, *view);
    ops::require_dtype(name, *view, DType::kF32, "expected f32");
  }
  const std::int64_t batch = out.sizes[0], seq_q = out.sizes[1], heads = out.sizes[2];
  const std::int64_t dim_v = out.sizes[3];
  ops::require_positive_sizes("out", out);
  ops::require_shape("out_b", out_b, out.sizes, "(the shape of out)");
  ops::require_shape("lse", lse, {batch, heads, seq_q, 1}, "(B, Hq, Lq, 1) of out");
  ops::require_shape("lse_b", lse_b, {batch, heads, seq_q, 1}, "(B, Hq, Lq, 1) of out");
  ops::require_writable_strides("out", out);
  ops::require_writable_strides("lse", lse);
  const ops::NamedView written[] = {{"out", &out}, {"lse", &lse}};
  const ops::NamedView read[] = {{"out_b", &out_b}, {"lse_b", &lse_b}};
  ops::require_no_overlap(written, read);
  ops::validate_num_threads(num_threads);

  float* o = static_cast<float*>(out.data);
  float* l = static_cast<float*>(lse.data);
  const float* ob = static_cast<const float*>(out_b.data);
  const float* lb = static_cast<const float*>(lse_b.data);
  // (b, h, i) rows, in blocks of rows per task.
  const auto merge_row = [&](std::int64_t row) {
    const std::int64_t i = row % seq_q, h = row / seq_q % heads;
    const std::int64_t b = row / (seq_q * heads);
    float& la = l[lse.offset(b, h, i, 0)];
    const float lb_row = lb[lse_b.offset(b, h, i, 0)];
    const float m = std::max(la, lb_row);
    // Both -inf: nothing on either side, and exp(-inf - -inf) would be NaN.
    if (m == -std::numeric_limits<float>::infinity()) return;
    const float wa = std::exp(la - m), wb = std::exp(lb_row - m);
    const float inv = 1.0f / (wa + wb);
    for (std::int64_t d = 0; d < dim_v; ++d) {
      float& x = o[out.offset(b, i, h, d)];
      x = (wa * x + wb * ob[out_b.offset(b, i, h, d)]) * inv;
    }
    la = m + std::log(wa + wb);
  };
  parallel_for_blocks(batch * heads * seq_q, dim_v, resolve_num_threads(num_threads),
                      [&](std::int64_t begin, std::int64_t end) {
                        for (std::int64_t row = begin; row < end; ++row) merge_row(row);
                      });
}

}  // namespace qkv
