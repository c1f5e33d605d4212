// Flash attention backward on the CPU (qkv/attention_backward.h; FlashAttention-2's scheme):
// the probabilities are recomputed tile by tile from the forward's lse, never stored, so the
// memory is O(tile) per thread plus D_i = dout_i . out_i per row.
//
// Tasks are (batch, kv head, key tile of kBlockQ keys). A task packs its keys and values once,
// then walks the query tiles of every query head of its group that may attend its keys
// (causal, window and key lengths decide which; a tile the masks leave empty is skipped):
//
//   s  = q k^T * scale (softcap, bias, masks)      p  = exp(s - lse)
//   dp = dout v^T        ds = p (dp - D_i)         du = ds (1 - tanh^2) with softcap, else ds
//   dv += p^T dout       dk += du^T q * scale       dq_tile = du k * scale
//
// Every product is the rank-1-update micro-kernel of tile_products-inl.h with the tile's keys
// along the lanes (s, dp, dv^T, dk^T) or the head dimension along them (dq). dk and dv
// accumulate in the task in a fixed order and are written once. dq gathers from every key tile:
// the tasks add their tiles into dq in key-tile order, each waiting (a per-row-tile counter) for
// the previous key tile's turn, so the sum's order, and every bit, is the same on any thread
// count (parallel_for hands tasks out in index order, so a task only ever waits for a task that
// already runs; docs/kernels.md, "Backward").
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_backward.cc"
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

// (per target, after foreach_target.h)
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/backward_products-inl.h"
#include "kernels/cpu/dropout-inl.h"
#include "kernels/cpu/fast_exp-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_products-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"
#include "kernels/sparse_pair.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

using tiles::DF;
using tiles::kBlockQ;
using tiles::kLanes;
using tiles::kNegInf;
using tiles::VF;
namespace hn = hwy::HWY_NAMESPACE;

using backward::kKeys;
using backward::kRowsPerTile;
using backward::Plan;
using backward::RowTile;

// Whether some row of [i0, i0 + rows) may attend some key of [j0, j1) under causal, window and
// key lengths: the rows' allowed keys slide by one per row, so their union is one interval.
bool Interacts(const AttentionKernelParams& p, std::int64_t key_limit, std::int64_t i0,
               std::int64_t rows, std::int64_t j0, std::int64_t j1) {
  const std::int64_t lo = p.window_left < 0 ? 0 : i0 + p.diagonal_offset - p.window_left;
  const std::int64_t hi =
      p.window_right < 0 ? key_limit - 1 : i0 + rows - 1 + p.diagonal_offset + p.window_right;
  return std::max(lo, j0) <= std::min({hi, j1 - 1, key_limit - 1});
}

std::int64_t KeyLimit(const AttentionKernelParams& p, std::int64_t b) {
  return p.key_lengths != nullptr ? p.key_lengths[b] : p.seq_kv;
}

// Whether key group kg (plan.tiles_per_task key tiles) has a key that some row of
// [i0, i0 + rows) may attend. The groups that do are one contiguous range (the rows' allowed
// keys form one interval).
bool GroupInteracts(const AttentionKernelParams& p, const Plan& plan, std::int64_t key_limit,
                    std::int64_t i0, std::int64_t rows, std::int64_t kg) {
  const std::int64_t group_keys = plan.tiles_per_task * kKeys;
  return kg >= 0 && kg < plan.key_groups &&
         Interacts(p, key_limit, i0, rows, kg * group_keys,
                   std::min(p.seq_kv, (kg + 1) * group_keys));
}

// The scores s[r][l] (Products::Scores) of rows [i0, i0 + rows) of head h against the task's
// keys, in place: softcap (cap[r][l] = 1 - tanh^2, its derivative), bias, every mask (not
// allowed: -inf); then p = exp(s - lse).
void Probabilities(const AttentionKernelParams& p, const Plan& plan, std::int64_t b,
                   std::int64_t h, std::int64_t i0, std::int64_t rows, std::int64_t j0,
                   std::int64_t num_k, float* w) {
  const DF df;
  float* s = w + plan.s;
  float* cap = w + plan.cap;
  if (p.softcap > 0.0f) {
    const VF c = hn::Set(df, p.softcap), inv_c = hn::Set(df, 1.0f / p.softcap);
    const VF one = hn::Set(df, 1.0f);
    for (std::int64_t x = 0; x < rows * kKeys; x += kLanes) {
      const VF t = hn::Tanh(df, hn::Mul(hn::Load(df, s + x), inv_c));
      hn::Store(hn::Mul(c, t), df, s + x);
      hn::Store(hn::NegMulAdd(t, t, one), df, cap + x);
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = i0 + r;
    float* row = s + r * kKeys;
    if (p.bias != nullptr) {
      const float* bias = p.bias + b * p.bias_stride[0] + h * p.bias_stride[1] +
                          i * p.bias_stride[2] + j0 * p.bias_stride[3];
      for (std::int64_t l = 0; l < num_k; ++l) row[l] += bias[l * p.bias_stride[3]];
    }
    const tiles::KeyRange keys = tiles::LaneKeys(p, b, i);
    const std::int64_t lo = std::clamp<std::int64_t>(keys.lo - j0, 0, kKeys);
    const std::int64_t hi = std::clamp<std::int64_t>(keys.hi - j0, lo, kKeys);
    for (std::int64_t l = 0; l < lo; ++l) row[l] = kNegInf;
    for (std::int64_t l = hi; l < kKeys; ++l) row[l] = kNegInf;
    if (p.mask != nullptr) {
      const std::uint8_t* mask = p.mask + b * p.mask_stride[0] + h * p.mask_stride[1] +
                                 i * p.mask_stride[2] + j0 * p.mask_stride[3];
      for (std::int64_t l = lo; l < hi; ++l) {
        if (mask[l * p.mask_stride[3]] == 0) row[l] = kNegInf;
      }
    }
    if (p.sparse.kind != SparseKernelParams::Kind::kNone) {
      for (std::int64_t l = lo; l < hi; ++l) {
        if (!sparse_pair_allowed(p.sparse, p.diagonal_offset, h, i, j0 + l)) row[l] = kNegInf;
      }
    }
    // A row with no allowed key has lse = -inf and only -inf scores: p = exp(-inf) = 0.
    const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
    const VF shift = hn::Set(df, lse == kNegInf ? 0.0f : lse);
    const VF zero = hn::Zero(df);
    for (std::int64_t x = 0; x < kKeys; x += kLanes) {
      // s <= lse up to rounding: clamp to the exp's domain.
      const VF arg = hn::Min(hn::Sub(hn::Load(df, row + x), shift), zero);
      hn::Store(fastexp::ExpNonPositive(df, arg), df, row + x);
    }
  }
}

// The forward's dropout mask on the tile (kernels/dropout_mask.h): pz = p z and dp = z dp with
// z = keep / (1 - dropout_p), keys along the lanes.
void Dropout(const AttentionKernelParams& p, const Plan& plan, std::int64_t b, std::int64_t h,
             std::int64_t i0, std::int64_t rows, std::int64_t j0, float* w) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const float* s = w + plan.s;
  float* dp = w + plan.dp;
  float* pz = w + plan.pz;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint64_t row =
        dropout_row(p.dropout_seed, p.dropout_offset, b, h, i0 + r, p.num_heads_q, p.seq_q);
    const auto lo = hn::Set(du, static_cast<std::uint32_t>(row));
    const auto hi = hn::Set(du, static_cast<std::uint32_t>(row >> 32));
    for (std::int64_t x = 0; x < kKeys; x += kLanes) {
      const auto key = hn::Iota(du, static_cast<std::uint32_t>(j0 + x));
      const auto bits = dropout::Bits(du, lo, hi, key);
      const std::int64_t at = r * kKeys + x;
      hn::Store(dropout::Apply(df, du, hn::Load(df, s + at), bits, p.dropout_threshold,
                               p.dropout_scale),
                df, pz + at);
      hn::Store(dropout::Apply(df, du, hn::Load(df, dp + at), bits, p.dropout_threshold,
                               p.dropout_scale),
                df, dp + at);
    }
  }
}

// What the tasks share: D_r per (b, h, row); the row copies (backward::RowCopies); dq's
// running sums between a row tile's first and last key group, rows (b, h, i) D floats apart
// (the user's dq rows may lie Hq * D floats apart, a multiple of 4 KiB that puts every row of a
// tile in the same L1 sets: 1.12x on the tiles, 1.03x in f32 at L = 4096, D = 128, against
// adding there); and each row tile's turn on them.
struct Shared {
  const float* delta;
  backward::RowCopies copies;
  float* dq_sum;
  std::atomic<std::int64_t>* turns;
};

// D_i = out_i . dout_i, summed in f64 (each product exact) and rounded once to f32; on unit
// strides in f64 vectors (element by element, one dependent add per element, it took 7% of the
// AMX backward's time at L = 2048, D = 128).
float RowDelta(const float* out, std::int64_t out_step, const float* dout, std::int64_t dout_step,
               std::int64_t n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dh;  // (as many f32 lanes as dd has f64 lanes)
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  std::int64_t e = 0;
  double sum = 0.0;
  if (out_step == 1 && dout_step == 1) {
    auto acc0 = hn::Zero(dd), acc1 = hn::Zero(dd);
    for (; e + 2 * lanes <= n; e += 2 * lanes) {
      acc0 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, out + e)),
                        hn::PromoteTo(dd, hn::LoadU(dh, dout + e)), acc0);
      acc1 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, out + e + lanes)),
                        hn::PromoteTo(dd, hn::LoadU(dh, dout + e + lanes)), acc1);
    }
    sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  }
  for (; e < n; ++e) sum += static_cast<double>(out[e * out_step]) * dout[e * dout_step];
  return static_cast<float>(sum);
}

// delta[(b * Hq + h) * Lq + i] = D_r (RowDelta) for rows [i0, i1) of heads [h0, h1) of batch
// entry b, the heads inner.
void RowDeltas(const AttentionBackwardKernelParams& g, std::int64_t b, std::int64_t i0,
               std::int64_t i1, std::int64_t h0, std::int64_t h1, float* delta) {
  const AttentionKernelParams& p = g.forward;
  for (std::int64_t i = i0; i < i1; ++i) {
    for (std::int64_t h = h0; h < h1; ++h) {
      const float* out = p.out + b * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2];
      const float* dout =
          g.dout + b * g.dout_stride[0] + i * g.dout_stride[1] + h * g.dout_stride[2];
      delta[(b * p.num_heads_q + h) * p.seq_q + i] =
          RowDelta(out, p.out_stride[3], dout, g.dout_stride[3], p.head_dim_v);
    }
  }
}

// Every row's D_r, reading out in memory order: in BSHD a row's heads lie side by side, so a
// task takes 64 rows of a batch entry, every head; otherwise (BHSD) one (b, h), every row. (One
// (b, h) per task in BSHD jumps Hq * D floats from row to row: at (32,12,12,128,128,64) the
// pass took twice BHSD's time.)
void RowDeltas(const AttentionBackwardKernelParams& g, float* delta) {
  const AttentionKernelParams& p = g.forward;
  const bool heads_inner = p.out_stride[2] < p.out_stride[1];
  const std::int64_t per_batch =
      heads_inner ? (p.seq_q + kRowsPerTile - 1) / kRowsPerTile : p.num_heads_q;
  const std::int64_t tasks = p.batch * per_batch;
  const int threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, tasks));
  parallel_for(tasks, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / per_batch, part = task % per_batch;
    if (heads_inner) {
      const std::int64_t i0 = part * kRowsPerTile;
      RowDeltas(g, b, i0, std::min(p.seq_q, i0 + kRowsPerTile), 0, p.num_heads_q, delta);
    } else {
      RowDeltas(g, b, 0, p.seq_q, part, part + 1, delta);
    }
  });
}

// A key tile's gradient rows: dst[l * row_stride + d * step] = src[d * kKeys + l] * scale for
// keys l < rows and d < depth (src's rows padded to a multiple of 16). Squares of kLanes x
// kLanes are transposed in registers so that each key's row is stored in whole vectors (element
// by element, the loads at kKeys' stride and a store per element took 9% of the AMX backward's
// time at L = 2048, D = 128). The same products as element by element: same bits.
void StoreTransposed(const float* src, std::int64_t depth, std::int64_t rows, float scale,
                     float* dst, std::int64_t row_stride, std::int64_t step) {
  static_assert(16 % kLanes == 0 && kKeys % kLanes == 0, "whole squares in src");
  const DF df;
  const VF vscale = hn::Set(df, scale);
  for (std::int64_t l0 = 0; l0 < rows; l0 += kLanes) {
    const std::int64_t lanes = std::min(kLanes, rows - l0);
    // The next kLanes rows' lines toward L1 while these are stored.
    for (std::int64_t r = l0 + kLanes; r < std::min(rows, l0 + 2 * kLanes); ++r) {
      tiles::PrefetchLinesL1(dst + r * row_stride, depth * step * std::int64_t{sizeof(float)});
    }
    for (std::int64_t d0 = 0; d0 < depth; d0 += kLanes) {
      const std::int64_t width = std::min(kLanes, depth - d0);
      VF v[kLanes];
      HWY_UNROLL(16)
      for (std::int64_t c = 0; c < kLanes; ++c) v[c] = hn::Load(df, src + (d0 + c) * kKeys + l0);
      TransposeSquare(df, v);
      for (std::int64_t r = 0; r < lanes; ++r) {
        float* out = dst + (l0 + r) * row_stride + d0 * step;
        const VF x = hn::Mul(v[r], vscale);
        if (step == 1 && width == kLanes) {
          hn::StoreU(x, df, out);
        } else {
          HWY_ALIGN float lane[kLanes];
          hn::Store(x, df, lane);
          for (std::int64_t e = 0; e < width; ++e) out[e * step] = lane[e];
        }
      }
    }
  }
}

// out[d * out_step] = tile[d] * scale + (in ? in[d] : 0) for d < head_dim, from a row of the
// dq tile (passes of kBlockQ columns, kRowsPerTile * kBlockQ floats apart). Without `in`, the
// product added to zero: the bits of a sum that starts from a zeroed buffer. A strided row is
// written from a vector's worth of results at a time, so it has the same bits too.
void AddDqRow(const float* tile, std::int64_t passes, std::int64_t head_dim, float scale,
              const float* in, float* out, std::int64_t out_step) {
  const DF df;
  const VF vscale = hn::Set(df, scale);
  for (std::int64_t pass = 0; pass < passes; ++pass) {
    const float* tile_row = tile + pass * kRowsPerTile * kBlockQ;
    const std::int64_t d0 = pass * kBlockQ, width = std::min(kBlockQ, head_dim - d0);
    HWY_ALIGN float strided[kBlockQ];
    float* dst = out_step == 1 ? out + d0 : strided;
    std::int64_t x = 0;
    if (in == nullptr) {  // (the zero added turns a -0 product into +0, as the zeroed sum did)
      for (; x + kLanes <= width; x += kLanes)
        hn::StoreU(hn::MulAdd(hn::Load(df, tile_row + x), vscale, hn::Zero(df)), df, dst + x);
      for (; x < width; ++x) dst[x] = 0.0f + tile_row[x] * scale;
    } else {
      for (; x + kLanes <= width; x += kLanes) {
        hn::StoreU(hn::MulAdd(hn::Load(df, tile_row + x), vscale, hn::LoadU(df, in + d0 + x)), df,
                   dst + x);
      }
      for (; x < width; ++x) dst[x] = in[d0 + x] + tile_row[x] * scale;
    }
    for (x = 0; out_step != 1 && x < width; ++x) out[(d0 + x) * out_step] = strided[x];
  }
}

// Asks for rows [j0, j0 + rows) of dk and dv of (b, hkv) toward L2, which the task writes at
// its end (StoreTransposed): in BSHD they lie Hkv * D floats apart, where no hardware stream
// fetches them, and each store waited for its line.
HWY_INLINE void PrefetchGradientRows(const AttentionBackwardKernelParams& g, std::int64_t b,
                                     std::int64_t hkv, std::int64_t j0, std::int64_t rows) {
  const AttentionKernelParams& p = g.forward;
  tiles::PrefetchRows(g.dk + b * g.dk_stride[0] + hkv * g.dk_stride[2], g.dk_stride, p.head_dim,
                      sizeof(float), j0, j0 + rows);
  tiles::PrefetchRows(g.dv + b * g.dv_stride[0] + hkv * g.dv_stride[2], g.dv_stride, p.head_dim_v,
                      sizeof(float), j0, j0 + rows);
}

// One task: the key tiles [kt0, kt0 + plan.tiles_per_task) of kv head hkv in batch entry b, each
// with its own scratch (w + t * plan.floats; the first also holds the row tiles' packed
// operands and dq tile), walking every query head of the group and every row tile that
// attends one of them.
template <class Products>
void BackwardTask(const AttentionBackwardKernelParams& g, const Plan& plan, const Shared& shared,
                  std::int64_t task, float* w) {
  const AttentionKernelParams& p = g.forward;
  const DF df;
  const std::int64_t per_batch = p.num_heads_kv * plan.key_groups;
  const std::int64_t b = task / per_batch, hkv = task % per_batch / plan.key_groups;
  const std::int64_t kg = task % plan.key_groups;  // (dq's turns count these groups)
  const std::int64_t key_limit = KeyLimit(p, b);
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  std::int64_t j0[backward::kTilesPerTask], num_k[backward::kTilesPerTask];
  float* tw[backward::kTilesPerTask];
  bool any_keys = false;
  for (std::int64_t t = 0; t < plan.tiles_per_task; ++t) {
    j0[t] = (kg * plan.tiles_per_task + t) * kKeys;
    num_k[t] = std::max<std::int64_t>(0, std::min({kKeys, p.seq_kv - j0[t], key_limit - j0[t]}));
    tw[t] = w + t * plan.floats;
    std::fill(tw[t] + plan.dkt, tw[t] + plan.dkt + backward::RoundUp(p.head_dim, 16) * kKeys, 0.0f);
    std::fill(tw[t] + plan.dvt, tw[t] + plan.dvt + backward::RoundUp(p.head_dim_v, 16) * kKeys,
              0.0f);
    if (num_k[t] > 0) Products::PackKeys(p, plan, b, hkv, j0[t], num_k[t], tw[t]);
    if constexpr (Products::kPrefetchGradients) {
      PrefetchGradientRows(g, b, hkv, j0[t], std::min(kKeys, p.seq_kv - j0[t]));
    }
    any_keys = any_keys || num_k[t] > 0;
  }
  float* dqt = w + plan.dqt;
  for (std::int64_t h = hkv * group; any_keys && h < (hkv + 1) * group; ++h) {
    for (std::int64_t it = 0; it < plan.row_tiles; ++it) {
      const std::int64_t i0 = it * kRowsPerTile;
      const std::int64_t rows = std::min(kRowsPerTile, p.seq_q - i0);
      const RowTile tile = Products::MakeRowTile(p, plan, shared.copies, b, h, i0, rows, w);
      bool packed = false;
      for (std::int64_t t = 0; t < plan.tiles_per_task; ++t) {
        if (num_k[t] == 0 || !Interacts(p, key_limit, i0, rows, j0[t], j0[t] + num_k[t])) continue;
        if (!packed) Products::PackRows(g, plan, tile);
        float* ws = tw[t];
        float* s = ws + plan.s;
        float* dp = ws + plan.dp;
        const float* cap = ws + plan.cap;
        Products::Scores(p, plan, tile, ws);
        Probabilities(p, plan, b, h, i0, rows, j0[t], num_k[t], ws);
        // dp[r][l] = dout_r . v_l, then du = p (dp - D_r) (times the softcap's derivative).
        Products::DoutValues(g, plan, tile, ws);
        // Dropout: pz = p z feeds dv, and dp becomes z dp (z = keep / (1 - p), the forward's).
        const float* p_for_dv = s;
        if (p.dropout_p > 0.0f) {
          Dropout(p, plan, b, h, i0, rows, j0[t], ws);
          p_for_dv = ws + plan.pz;
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          const VF d_r = hn::Set(df, shared.delta[(b * p.num_heads_q + h) * p.seq_q + i0 + r]);
          for (std::int64_t x = r * kKeys; x < (r + 1) * kKeys; x += kLanes) {
            VF du = hn::Mul(hn::Load(df, s + x), hn::Sub(hn::Load(df, dp + x), d_r));
            if (p.softcap > 0.0f) du = hn::Mul(du, hn::Load(df, cap + x));
            hn::Store(du, df, dp + x);
          }
        }
        // dv^T += dout^T p, dk^T += q^T du, and the key tile's share of the dq rows (the
        // task's first key tile with these rows sets dqt, a second adds to it).
        Products::Gradients(g, plan, tile, num_k[t], p_for_dv, ws, dqt, packed);
        packed = true;
      }
      if (!packed) continue;
      // Our turn on these dq rows: after every earlier key group that touches them.
      std::atomic<std::int64_t>& turn = shared.turns[(b * p.num_heads_q + h) * plan.row_tiles + it];
      for (int spins = 0; turn.load(std::memory_order_acquire) != kg; ++spins) {
        if (spins > 64) std::this_thread::yield();
      }
      // The first group to touch these rows starts their sums (no zeroed buffer to add to), the
      // last writes the user's rows (no copy-out pass); where one group is both, dq_sum is
      // never touched. The same operations in the same order as adding to zeros: same bits.
      const bool first = !GroupInteracts(p, plan, key_limit, i0, rows, kg - 1);
      const bool last = !GroupInteracts(p, plan, key_limit, i0, rows, kg + 1);
      for (std::int64_t r = 0; r < rows; ++r) {
        // (one group alone needs no running sum, and then there may be no dq_sum at all)
        const std::int64_t row = (b * p.num_heads_q + h) * p.seq_q + i0 + r;
        float* sum = first && last ? nullptr : shared.dq_sum + row * p.head_dim;
        float* dq = g.dq + b * g.dq_stride[0] + (i0 + r) * g.dq_stride[1] + h * g.dq_stride[2];
        AddDqRow(dqt + r * kBlockQ, plan.passes, p.head_dim, p.scale, first ? nullptr : sum,
                 last ? dq : sum, last ? g.dq_stride[3] : 1);
      }
      turn.store(kg + 1, std::memory_order_release);
    }
  }
  // dk = dk^T transposed (times the scale q did not carry); rows past key_limit are 0.
  for (std::int64_t t = 0; t < plan.tiles_per_task; ++t) {
    const std::int64_t rows_out = std::min(kKeys, p.seq_kv - j0[t]);
    StoreTransposed(tw[t] + plan.dkt, p.head_dim, rows_out, Products::DkScale(p),
                    g.dk + b * g.dk_stride[0] + j0[t] * g.dk_stride[1] + hkv * g.dk_stride[2],
                    g.dk_stride[1], g.dk_stride[3]);
    StoreTransposed(tw[t] + plan.dvt, p.head_dim_v, rows_out, 1.0f,
                    g.dv + b * g.dv_stride[0] + j0[t] * g.dv_stride[1] + hkv * g.dv_stride[2],
                    g.dv_stride[1], g.dv_stride[3]);
  }
}

// d(bias) (AttentionBackwardKernelParams::dbias): ds = p (z dp - D_r), before the softcap's
// derivative (the bias is added after the cap), summed over the dimensions the bias broadcasts
// over. A pass of its own, parallel over the bias's own cells (its batch, its head, a row tile
// of its rows, or all rows when it broadcasts over them), so each element is summed by one task
// in one fixed order (batch, head, row tile, key tile, row, key): the same bits on any thread
// count. It recomputes p and dp tile by tile: two of the main pass's five products.
template <class Products>
void DbiasTask(const AttentionBackwardKernelParams& g, const Plan& plan, const Shared& shared,
               std::int64_t task, float* w) {
  const AttentionKernelParams& p = g.forward;
  const DF df;
  const std::int64_t nb = g.dbias_sizes[0], nh = g.dbias_sizes[1];
  const bool per_row = g.dbias_sizes[2] != 1 || p.seq_q == 1;
  const std::int64_t cells_per_head = per_row ? plan.row_tiles : 1;
  const std::int64_t bb = task / (nh * cells_per_head), hb = task / cells_per_head % nh;
  const std::int64_t cell = task % cells_per_head;
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  const std::int64_t* st = g.dbias_stride;
  // Zero this task's elements: rows of its tile (or row 0), every key column (or column 0).
  const std::int64_t row_begin = per_row ? cell * kRowsPerTile : 0;
  const std::int64_t row_end = per_row ? std::min(p.seq_q, row_begin + kRowsPerTile) : 1;
  const std::int64_t cols = g.dbias_sizes[3];
  for (std::int64_t i = row_begin; i < row_end; ++i)
    for (std::int64_t j = 0; j < cols; ++j)
      g.dbias[bb * st[0] + hb * st[1] + i * st[2] + j * st[3]] = 0.0f;
  float* s = w + plan.s;
  float* dp = w + plan.dp;
  for (std::int64_t b = nb == 1 ? 0 : bb; b < (nb == 1 ? p.batch : bb + 1); ++b) {
    const std::int64_t key_limit = KeyLimit(p, b);
    for (std::int64_t h = nh == 1 ? 0 : hb; h < (nh == 1 ? p.num_heads_q : hb + 1); ++h) {
      const std::int64_t hkv = h / group;
      for (std::int64_t it = per_row ? cell : 0; it < (per_row ? cell + 1 : plan.row_tiles); ++it) {
        const std::int64_t i0 = it * kRowsPerTile;
        const std::int64_t rows = std::min(kRowsPerTile, p.seq_q - i0);
        const RowTile tile = Products::MakeRowTile(p, plan, shared.copies, b, h, i0, rows, w);
        Products::PackRows(g, plan, tile);
        for (std::int64_t jt = 0; jt < plan.key_tiles; ++jt) {
          const std::int64_t j0 = jt * kKeys;
          const std::int64_t num_k =
              std::max<std::int64_t>(0, std::min({kKeys, p.seq_kv - j0, key_limit - j0}));
          if (num_k == 0 || !Interacts(p, key_limit, i0, rows, j0, j0 + num_k)) continue;
          Products::PackKeys(p, plan, b, hkv, j0, num_k, w);
          Products::Scores(p, plan, tile, w);
          Probabilities(p, plan, b, h, i0, rows, j0, num_k, w);
          Products::DoutValues(g, plan, tile, w);
          if (p.dropout_p > 0.0f) Dropout(p, plan, b, h, i0, rows, j0, w);
          for (std::int64_t r = 0; r < rows; ++r) {
            const VF d_r = hn::Set(df, shared.delta[(b * p.num_heads_q + h) * p.seq_q + i0 + r]);
            for (std::int64_t x = r * kKeys; x < (r + 1) * kKeys; x += kLanes) {
              hn::Store(hn::Mul(hn::Load(df, s + x), hn::Sub(hn::Load(df, dp + x), d_r)), df,
                        dp + x);
            }
            float* out = g.dbias + bb * st[0] + hb * st[1] + (per_row ? i0 + r : 0) * st[2];
            for (std::int64_t l = 0; l < num_k; ++l) out[(j0 + l) * st[3]] += dp[r * kKeys + l];
          }
        }
      }
    }
  }
}

template <class Products>
void RunBackward(const AttentionBackwardKernelParams& g, const Plan& plan) {
  const AttentionKernelParams& p = g.forward;
  const std::int64_t heads = p.batch * p.num_heads_q;
  const int head_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, heads));
  // D_r per (b, h, row), then the row copies, one (b, h) per task. dq's sums are kept only
  // where more than one key group adds to a row tile.
  AlignedBuffer delta(sizeof(float) * heads * p.seq_q);
  AlignedBuffer dq_sum(plan.key_groups > 1 ? sizeof(float) * heads * p.seq_q * p.head_dim : 0);
  AlignedBuffer copy_buffer(Products::CopyBytes(p, plan));
  const backward::RowCopies copies = Products::Copies(p, plan, copy_buffer.as<void>());
  RowDeltas(g, delta.as<float>());
  if (copy_buffer.bytes() > 0) {
    parallel_for(heads, head_threads, [&](std::int64_t task, int) {
      Products::CopyRows(g, plan, task / p.num_heads_q, task % p.num_heads_q, copies);
    });
  }
  // Each row tile's turn starts at the first key group that touches it; the dq rows of a row
  // tile that none touches are 0 (the tasks write the others).
  const std::int64_t num_turns = heads * plan.row_tiles;
  std::unique_ptr<std::atomic<std::int64_t>[]> turns(new std::atomic<std::int64_t>[num_turns]);
  for (std::int64_t t = 0; t < num_turns; ++t) {
    const std::int64_t b = t / (p.num_heads_q * plan.row_tiles), it = t % plan.row_tiles;
    const std::int64_t h = t / plan.row_tiles % p.num_heads_q;
    const std::int64_t i0 = it * kRowsPerTile, rows = std::min(kRowsPerTile, p.seq_q - i0);
    const std::int64_t key_limit = KeyLimit(p, b);
    std::int64_t first = 0;
    while (first < plan.key_groups && !GroupInteracts(p, plan, key_limit, i0, rows, first)) ++first;
    turns[t].store(first, std::memory_order_relaxed);
    for (std::int64_t i = i0; first == plan.key_groups && i < i0 + rows; ++i) {
      float* dq = g.dq + b * g.dq_stride[0] + i * g.dq_stride[1] + h * g.dq_stride[2];
      for (std::int64_t d = 0; d < p.head_dim; ++d) dq[d * g.dq_stride[3]] = 0.0f;
    }
  }
  const std::int64_t tasks = p.batch * p.num_heads_kv * plan.key_groups;
  const int threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, tasks));
  const std::int64_t thread_floats = plan.floats * plan.tiles_per_task;
  AlignedBuffer scratch(sizeof(float) * thread_floats * threads);
  const Shared shared{delta.as<float>(), copies, dq_sum.as<float>(), turns.get()};
  parallel_for(tasks, threads, [&](std::int64_t task, int thread) {
    [[maybe_unused]] typename Products::TaskScope scope;
    BackwardTask<Products>(g, plan, shared, task, scratch.as<float>() + thread * thread_floats);
  });
  const bool per_row = g.dbias_sizes[2] != 1 || p.seq_q == 1;
  const std::int64_t dbias_tasks =
      g.dbias == nullptr ? 0 : g.dbias_sizes[0] * g.dbias_sizes[1] * (per_row ? plan.row_tiles : 1);
  if (dbias_tasks == 0) return;
  parallel_for(dbias_tasks, static_cast<int>(std::min<std::int64_t>(threads, dbias_tasks)),
               [&](std::int64_t task, int thread) {
                 [[maybe_unused]] typename Products::TaskScope scope;
                 DbiasTask<Products>(g, plan, shared, task,
                                     scratch.as<float>() + thread * thread_floats);
               });
}

void FlashBackward(const AttentionBackwardKernelParams& g) {
  // The products, chosen once here (the instantiations: WithBackwardProducts).
  const ProductPath path = backward::BackwardProductPath(g.forward.dtype);
  const Plan plan = backward::MakePlan(g.forward, backward::ReadsBf16Operands(path));
  backward::WithBackwardProducts(path,
                                 [&](auto products) { RunBackward<decltype(products)>(g, plan); });
}

}  // namespace

void FlashBackwardEntry(const AttentionBackwardKernelParams& g) { FlashBackward(g); }
ProductPath BackwardPathOf(DType dtype) { return backward::BackwardProductPath(dtype); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(FlashBackwardEntry);
HWY_EXPORT(BackwardPathOf);

ProductPath attention_backward_flash_product_path(DType dtype) {
  return HWY_DYNAMIC_DISPATCH(BackwardPathOf)(dtype);
}

void attention_backward_flash_cpu(const AttentionBackwardKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(FlashBackwardEntry)(params);
}

}  // namespace qkv
#endif  // HWY_ONCE
