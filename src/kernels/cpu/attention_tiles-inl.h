// Tile machinery shared by the flash and chunked CPU kernels (Highway, one copy per target).
//
// Layout idea: scores are kept TRANSPOSED, st[key][query], with the queries of one block along
// the SIMD lanes. Then everything that is per query (running max, running sum, rescale factor,
// allowed key range) is lane-wise, softmax needs no horizontal reductions, and K and V are read
// in their natural layout through scalar broadcasts, so they are never packed or transposed.
// Only q is packed, once per query block, as q^T * scale.
//
//   qt: [D][kBlockQ]    st: [keys][kBlockQ]    ot: [Dv][kBlockQ]  (out^T, unnormalised)
//
// Both products are the same rank-1-update micro-kernel (OuterProductRows):
//   st[j][:] = sum_d  k[j][d] * qt[d][:]          (R keys at a time)
//   ot[e][:] = alpha * ot[e][:] + sum_j v[j][e] * st[j][:]   (R value dims at a time)

#if defined(QKV_KERNELS_CPU_ATTENTION_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_ATTENTION_TILES_INL_H_
#undef QKV_KERNELS_CPU_ATTENTION_TILES_INL_H_
#else
#define QKV_KERNELS_CPU_ATTENTION_TILES_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/fast_exp-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/kernel_params.h"
#include "kernels/sparse_pair.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Tile geometry for this target (x86 targets have a fixed vector length).
constexpr std::int64_t kLanes = HWY_LANES(float);
// Query vectors per block: as many accumulators as the register file holds comfortably
// (AVX-512: 32 registers -> 4 x 4 accumulators; AVX2: 16 -> 4 x 2).
constexpr int kQueryVecs = kLanes == 8 ? 2 : 4;
constexpr std::int64_t kBlockQ = kQueryVecs * kLanes;  // queries per block
constexpr std::int64_t kBlockK = 128;                  // keys per tile
constexpr int kRows = 4;                               // micro-kernel rows (keys or value dims)
constexpr std::int64_t kMaxBlocksPerTask = 8;          // query blocks sharing one K/V walk

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// QueryBlock::lane_anchor of a lane that attends any key of its band (query positions can be
// negative: bottom-right alignment with Lq > Lk).
constexpr std::int64_t kAnyKey = std::numeric_limits<std::int64_t>::min();

// kLanes elements of an f32, bf16 or f16 row (T = float, hwy::bfloat16_t, hwy::float16_t) as
// f32 (exact), and one element.
template <typename T>
HWY_INLINE VF LoadWide(DF df, const T* HWY_RESTRICT src) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, src);
  } else {
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<T, DF>(), src));
  }
}
template <typename T>
HWY_INLINE float WideElement(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    return bf16_bits_to_f32(x.bits);
  } else {
    return f16_bits_to_f32(x.bits);
  }
}

// The micro-kernel's inner loop: acc[r][x] += sum_{t in [t0, t1)} b(r, t) * a[t][x lanes] for
// the query vectors x >= X0 (the others are neither read nor touched).
template <int R, int X0>
HWY_INLINE void MulAddVecs(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                           std::int64_t b_row_stride, std::int64_t b_depth_stride, std::int64_t t0,
                           std::int64_t t1, VF (&acc)[R][kQueryVecs]) {
  const DF df;
  for (std::int64_t t = t0; t < t1; ++t) {
    VF a_vec[kQueryVecs];
    HWY_UNROLL(4)
    for (int x = X0; x < kQueryVecs; ++x) a_vec[x] = hn::Load(df, a + t * kBlockQ + x * kLanes);
    const float* b_col = b + t * b_depth_stride;
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const VF b_val = hn::Set(df, b_col[r * b_row_stride]);
      HWY_UNROLL(4)
      for (int x = X0; x < kQueryVecs; ++x) acc[r][x] = hn::MulAdd(b_val, a_vec[x], acc[r][x]);
    }
  }
}

// MulAddVecs over depth segments: vectors >= X take [t0, depth_end[X]), vectors >= X + 1 then
// take [depth_end[X], depth_end[X + 1]), and so on, so vector x sums depth [t0, depth_end[x]).
template <int R, int X>
HWY_INLINE void MulAddSegments(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                               std::int64_t b_row_stride, std::int64_t b_depth_stride,
                               const std::int64_t* depth_end, std::int64_t t0,
                               VF (&acc)[R][kQueryVecs]) {
  MulAddVecs<R, X>(a, b, b_row_stride, b_depth_stride, t0, depth_end[X], acc);
  if constexpr (X + 1 < kQueryVecs) {
    MulAddSegments<R, X + 1>(a, b, b_row_stride, b_depth_stride, depth_end, depth_end[X], acc);
  }
}

// c[r][:] = (alpha ? alpha * c[r][:] : accumulate ? c[r][:] : 0) + sum_t b(r, t) * a[t][:]
// for r in [0, R), t in [0, depth), where b(r, t) = b[r * b_row_stride + t * b_depth_stride],
// on the query vectors x >= X0 only (the lanes of the others are left as they are). With
// depth_end (non-decreasing, each <= depth), vector x sums t in [0, depth_end[x]) only.
//   a: [depth][kBlockQ]   c: [R][kBlockQ]   alpha: [kBlockQ] or null
template <int R, int X0>
HWY_INLINE void OuterProductRows(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                                 std::int64_t b_row_stride, std::int64_t b_depth_stride,
                                 std::int64_t depth, const std::int64_t* depth_end,
                                 float* HWY_RESTRICT c, const float* HWY_RESTRICT alpha,
                                 bool accumulate) {
  const DF df;
  VF acc[R][kQueryVecs];
  HWY_UNROLL(4)
  for (int x = X0; x < kQueryVecs; ++x) {
    const VF scale = alpha != nullptr ? hn::Load(df, alpha + x * kLanes) : hn::Set(df, 1.0f);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      acc[r][x] =
          accumulate ? hn::Mul(hn::Load(df, c + r * kBlockQ + x * kLanes), scale) : hn::Zero(df);
    }
  }
  if (depth_end == nullptr) {
    MulAddVecs<R, X0>(a, b, b_row_stride, b_depth_stride, 0, depth, acc);
  } else {
    MulAddSegments<R, X0>(a, b, b_row_stride, b_depth_stride, depth_end, 0, acc);
  }
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int x = X0; x < kQueryVecs; ++x) hn::Store(acc[r][x], df, c + r * kBlockQ + x * kLanes);
  }
}

// OuterProductRows<R, first_vec> for a run-time first_vec in [0, kQueryVecs).
template <int R, int X = 0>
HWY_INLINE void OuterProductRowsFrom(int first_vec, const float* a, const float* b,
                                     std::int64_t b_row_stride, std::int64_t b_depth_stride,
                                     std::int64_t depth, const std::int64_t* depth_end, float* c,
                                     const float* alpha, bool accumulate) {
  if constexpr (X + 1 < kQueryVecs) {
    if (first_vec > X) {
      OuterProductRowsFrom<R, X + 1>(first_vec, a, b, b_row_stride, b_depth_stride, depth,
                                     depth_end, c, alpha, accumulate);
      return;
    }
  }
  OuterProductRows<R, X>(a, b, b_row_stride, b_depth_stride, depth, depth_end, c, alpha,
                         accumulate);
}

// Runs OuterProductRows over `rows` rows: blocks of kRows, then single rows for the tail, so no
// row past `rows` is ever read (keys past the tile may be padding garbage or out of bounds).
// With row_end (non-decreasing, the last = rows), query vector x computes rows [0, row_end[x])
// only: a block of rows starts at the first vector that still needs its first row. With
// depth_end, see OuterProductRows. (The causal diagonal: docs/kernels.md, "Causal diagonal".)
// (Copies with a constant depth for head_dim 64/128 and full key tiles measured no faster:
// 182/195 vs 185/194 GFLOP/s at L = 4096, D = 64/128, so the one generic loop stays.)
HWY_INLINE void OuterProduct(const float* a, const float* b, std::int64_t rows,
                             std::int64_t b_row_stride, std::int64_t b_depth_stride,
                             std::int64_t depth, float* c, const float* alpha, bool accumulate,
                             const std::int64_t* row_end = nullptr,
                             const std::int64_t* depth_end = nullptr) {
  const auto first_vec = [&](std::int64_t r) {
    int x = 0;
    while (row_end != nullptr && x + 1 < kQueryVecs && row_end[x] <= r) ++x;
    return x;
  };
  std::int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    OuterProductRowsFrom<kRows>(first_vec(r), a, b + r * b_row_stride, b_row_stride, b_depth_stride,
                                depth, depth_end, c + r * kBlockQ, alpha, accumulate);
  }
  for (; r < rows; ++r) {
    OuterProductRowsFrom<1>(first_vec(r), a, b + r * b_row_stride, b_row_stride, b_depth_stride,
                            depth, depth_end, c + r * kBlockQ, alpha, accumulate);
  }
}

// Per-thread state of one query block. The rows of a block come from the flattened
// (query head in the GQA group, query) space of one kv head: row r is query r % Lq of head
// kv_head * group + r / Lq. For Lq >= kBlockQ a block lies within one head; for decoding
// (Lq = 1) the heads of a group share one block, and one K/V walk.
struct QueryBlock {
  // Scratch (sized by the caller, see ScratchFloats / ScratchInts).
  float* qt;         // [D][kBlockQ]   q^T * scale; zero in lanes past num_q
  float* ot;         // [Dv][kBlockQ]  unnormalised out^T
  float* row_max;    // [kBlockQ]      running max of the scores
  float* row_sum;    // [kBlockQ]      running sum of exp(score - row_max)
  float* alpha;      // [kBlockQ]      rescale factor of the current tile
  std::int64_t* lo;  // [kBlockQ]      allowed keys of each lane: [lo, hi); lo = hi = 0 if none
  std::int64_t* hi;
  std::int64_t* head;   // [kBlockQ]   query head of each lane
  std::int64_t* query;  // [kBlockQ]   query index of each lane
  // Sparsity (p.sparse.kind != kNone; see StartSparseBlock), per lane:
  std::int64_t* band_lo;  // kBand: the lane's band keys [band_lo, band_hi) (all keys for a global
  std::int64_t* band_hi;  //        query); kBlock: unused
  std::int64_t* lane_anchor;  // kBand, dilation > 1: the lane's query position (kAnyKey: any)
  std::int64_t* run_lane;     // kBlock: lanes with the same layout row form runs: run r is lanes
  std::int64_t* run_row;  //         [run_lane[r], run_lane[r + 1]) reading layout row run_row[r]
  std::int64_t num_runs;
  // Hull of the keys the sparsity allows to some lane, and (kBand, dilation 1) the keys it
  // allows to every lane: tiles inside [exact_begin, exact_end) need no per-pair predicate.
  std::int64_t sparse_begin, sparse_end, exact_begin, exact_end;
  std::int64_t band_begin, band_end;  // kBand: hull of the lanes' bands (globals not included)
  // Position.
  std::int64_t b, num_q;  // num_q: lanes in use
  // Union of the allowed key ranges: tiles outside [key_begin, key_end) are skipped.
  std::int64_t key_begin, key_end;
  const void* k;  // k[b, 0, kv_head, 0], stored as p.dtype
  const void* v;  // v[b, 0, kv_head, 0]
};

// The keys of a tile [j0, j0 + num_k) each query vector of a block needs: vector x computes the
// tile's keys [0, end[x]) and skips the rest, which lie past every allowed key of its lanes (they
// could only give -inf scores and zero probabilities). end[x] is the running max over vectors
// 0..x of their lanes' allowed ends, rounded up to even (the vdpbf16ps value product reads keys
// in pairs), within [0, num_k]; it never decreases and the last is num_k. On the causal diagonal
// the leading vectors skip the keys after their queries: of a 64 x 64 diagonal square, 10 of
// the 16 squares of 16 x 16 are computed. ends() is null when every vector needs every key.
struct VecKeys {
  std::int64_t end[kQueryVecs];
  bool all;
  const std::int64_t* ends() const { return all ? nullptr : end; }
};
inline VecKeys TileVecKeys(const std::int64_t* hi, std::int64_t j0, std::int64_t num_k) {
  VecKeys keys;
  keys.all = true;
  std::int64_t running = 0;
  for (int x = 0; x < kQueryVecs; ++x) {
    for (std::int64_t l = x * kLanes; l < (x + 1) * kLanes; ++l) {
      running = std::max(running, std::min(hi[l] - j0, num_k));
    }
    keys.end[x] = x + 1 < kQueryVecs ? std::min(num_k, (running + 1) / 2 * 2) : num_k;
    keys.all = keys.all && keys.end[x] == num_k;
  }
  return keys;
}

// Scratch one QueryBlock needs: floats, and int64s.
inline std::int64_t ScratchFloats(const AttentionKernelParams& p) {
  return (p.head_dim + p.head_dim_v + 3) * kBlockQ;
}
constexpr std::int64_t kScratchInts = 9 * kBlockQ + 1;

// Query blocks per kv head of batch entry: the flattened group rows in blocks of kBlockQ.
inline std::int64_t BlocksPerKvHead(const AttentionKernelParams& p) {
  const std::int64_t rows = p.num_heads_q / p.num_heads_kv * p.seq_q;
  return (rows + kBlockQ - 1) / kBlockQ;
}

inline void BindScratch(const AttentionKernelParams& p, float* floats, std::int64_t* ints,
                        QueryBlock& qb) {
  qb.qt = floats;
  qb.ot = qb.qt + p.head_dim * kBlockQ;
  qb.row_max = qb.ot + p.head_dim_v * kBlockQ;
  qb.row_sum = qb.row_max + kBlockQ;
  qb.alpha = qb.row_sum + kBlockQ;
  qb.lo = ints;
  qb.hi = ints + kBlockQ;
  qb.head = ints + 2 * kBlockQ;
  qb.query = ints + 3 * kBlockQ;
  qb.band_lo = ints + 4 * kBlockQ;
  qb.band_hi = ints + 5 * kBlockQ;
  qb.lane_anchor = ints + 6 * kBlockQ;
  qb.run_row = ints + 7 * kBlockQ;
  qb.run_lane = ints + 8 * kBlockQ;  // kBlockQ + 1 entries
}

// The sparse part of StartQueryBlock: per-lane band or layout rows, and the block's hulls.
inline void StartSparseBlock(const AttentionKernelParams& p, QueryBlock& qb) {
  const SparseKernelParams& s = p.sparse;
  using Kind = SparseKernelParams::Kind;
  qb.sparse_begin = p.seq_kv;
  qb.sparse_end = 0;
  qb.exact_begin = 0;
  qb.exact_end = 0;
  if (s.kind == Kind::kBand) {
    qb.exact_end = p.seq_kv;
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      const std::int64_t position = qb.query[l] + p.diagonal_offset;
      const bool global = sparse_is_global(s, position);
      qb.band_lo[l] = global ? 0 : std::clamp<std::int64_t>(position - s.band, 0, p.seq_kv);
      qb.band_hi[l] =
          global ? p.seq_kv : std::clamp<std::int64_t>(position + s.band + 1, 0, p.seq_kv);
      qb.lane_anchor[l] = global || s.dilation == 1 ? kAnyKey : position;
      if (qb.band_hi[l] > qb.band_lo[l]) {
        qb.sparse_begin = std::min(qb.sparse_begin, qb.band_lo[l]);
        qb.sparse_end = std::max(qb.sparse_end, qb.band_hi[l]);
      }
      qb.exact_begin = std::max(qb.exact_begin, qb.band_lo[l]);
      qb.exact_end = std::min(qb.exact_end, qb.band_hi[l]);
    }
    qb.band_begin = qb.sparse_begin;
    qb.band_end = qb.sparse_end;
    if (s.dilation > 1) qb.exact_end = qb.exact_begin;  // every tile checks the residue
    if (s.num_global > 0) {  // every query attends the global key columns
      qb.sparse_begin = std::min(qb.sparse_begin, s.global[0]);
      qb.sparse_end = std::max(qb.sparse_end, s.global[s.num_global - 1] + 1);
    }
  } else if (s.kind == Kind::kBlock) {
    qb.num_runs = 0;
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      const std::int64_t row =
          qb.head[l] * s.layout_stride[0] + qb.query[l] / s.block_q * s.layout_stride[1];
      if (qb.num_runs == 0 || qb.run_row[qb.num_runs - 1] != row) {
        qb.run_row[qb.num_runs] = row;
        qb.run_lane[qb.num_runs++] = l;
      }
    }
    qb.run_lane[qb.num_runs] = qb.num_q;
    std::int64_t first = s.num_k_blocks, last = -1;
    for (std::int64_t r = 0; r < qb.num_runs; ++r) {
      const std::uint8_t* row = s.layout + qb.run_row[r];
      for (std::int64_t kb = 0; kb < first; ++kb) {
        if (row[kb * s.layout_stride[2]] != 0) first = kb;
      }
      for (std::int64_t kb = s.num_k_blocks - 1; kb > last; --kb) {
        if (row[kb * s.layout_stride[2]] != 0) last = kb;
      }
    }
    if (last >= first) {
      qb.sparse_begin = first * s.block_k;
      qb.sparse_end = std::min(p.seq_kv, (last + 1) * s.block_k);
    }
  }
  if (qb.sparse_end <= qb.sparse_begin) qb.sparse_begin = qb.sparse_end = 0;
}

// The keys of [j0, j1) the sparsity allows to some lane of the block: their hull [lo, hi)
// (empty: skip the tile), and whether some lane must still drop some of them (the per-pair
// predicate, ApplySparsity). Trimming a tile to the hull changes no result bit: the keys cut
// off would only have added exact zeros.
struct SparseTile {
  std::int64_t lo, hi;
  bool predicate;
};
inline SparseTile SparseTileKeys(const AttentionKernelParams& p, const QueryBlock& qb,
                                 std::int64_t j0, std::int64_t j1) {
  const SparseKernelParams& s = p.sparse;
  SparseTile t{std::max(j0, qb.sparse_begin), std::min(j1, qb.sparse_end), false};
  if (t.hi <= t.lo) return {0, 0, false};
  if (s.kind == SparseKernelParams::Kind::kBand) {
    // Band hull of the lanes, plus the global key columns inside [j0, j1).
    std::int64_t lo = std::max(qb.band_begin, t.lo), hi = std::min(qb.band_end, t.hi);
    const std::int64_t* g = std::lower_bound(s.global, s.global + s.num_global, t.lo);
    const std::int64_t* g_end = std::lower_bound(g, s.global + s.num_global, t.hi);
    if (g != g_end) {
      const bool band_empty = hi <= lo;
      lo = band_empty ? *g : std::min(lo, *g);
      hi = band_empty ? g_end[-1] + 1 : std::max(hi, g_end[-1] + 1);
    }
    if (hi <= lo) return {0, 0, false};
    // Only global columns, or only keys every lane's band allows: nothing to drop.
    // (Counted as a difference: with no globals g is null, and null + n is undefined.)
    const bool all_global =
        std::lower_bound(g, g_end, hi) - std::lower_bound(g, g_end, lo) == hi - lo;
    t = {lo, hi, !(lo >= qb.exact_begin && hi <= qb.exact_end) && !all_global};
    return t;
  }
  // kBlock: trim to the first and last key block some run attends; the predicate is needed
  // when some run leaves out a key block in between.
  const auto attending = [&](std::int64_t kb) {
    std::int64_t count = 0;
    for (std::int64_t r = 0; r < qb.num_runs; ++r) {
      count += s.layout[qb.run_row[r] + kb * s.layout_stride[2]] != 0;
    }
    return count;
  };
  std::int64_t kb_first = t.lo / s.block_k, kb_last = (t.hi - 1) / s.block_k;
  while (kb_first <= kb_last && attending(kb_first) == 0) ++kb_first;
  while (kb_last >= kb_first && attending(kb_last) == 0) --kb_last;
  if (kb_last < kb_first) return {0, 0, false};
  t.lo = std::max(t.lo, kb_first * s.block_k);
  t.hi = std::min(t.hi, (kb_last + 1) * s.block_k);
  for (std::int64_t kb = kb_first; kb <= kb_last && !t.predicate; ++kb) {
    t.predicate = attending(kb) != qb.num_runs;
  }
  return t;
}

// Sets st[j][l] = -inf where the sparsity leaves out key j0 + j for lane l (the tile form of
// sparse_pair_allowed in kernels/sparse_pair.h).
inline void ApplySparsity(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                          std::int64_t num_k, float* HWY_RESTRICT st) {
  const SparseKernelParams& s = p.sparse;
  if (s.kind == SparseKernelParams::Kind::kBlock) {
    for (std::int64_t r = 0; r < qb.num_runs; ++r) {
      const std::uint8_t* row = s.layout + qb.run_row[r];
      for (std::int64_t kb = j0 / s.block_k; kb * s.block_k < j0 + num_k; ++kb) {
        if (row[kb * s.layout_stride[2]] != 0) continue;
        const std::int64_t lo = std::max(j0, kb * s.block_k);
        const std::int64_t hi = std::min(j0 + num_k, (kb + 1) * s.block_k);
        for (std::int64_t j = lo - j0; j < hi - j0; ++j) {
          std::fill(st + j * kBlockQ + qb.run_lane[r], st + j * kBlockQ + qb.run_lane[r + 1],
                    kNegInf);
        }
      }
    }
    return;
  }
  // kBand, lane-wise: tile-relative band bounds (clamped so they stay exact as floats) and, with
  // dilation, the tile-relative first key of the lane's residue class (-1: any key).
  const DF df;
  VF lo[kQueryVecs], hi[kQueryVecs], first[kQueryVecs];
  const bool dilated = s.dilation > 1;
  for (int x = 0; x < kQueryVecs; ++x) {
    HWY_ALIGN float lo_rel[kLanes], hi_rel[kLanes], first_rel[kLanes];
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const std::int64_t i = x * kLanes + l;
      const bool used = i < qb.num_q;
      lo_rel[l] =
          used ? static_cast<float>(std::clamp<std::int64_t>(qb.band_lo[i] - j0, -1, kBlockK + 1))
               : 0.0f;
      hi_rel[l] =
          used ? static_cast<float>(std::clamp<std::int64_t>(qb.band_hi[i] - j0, -1, kBlockK + 1))
               : 0.0f;
      first_rel[l] = -1.0f;
      if (used && dilated && qb.lane_anchor[i] != kAnyKey) {
        // The first key >= j0 with (anchor - key) % dilation == 0, relative to j0 (< dilation).
        const std::int64_t offset =
            ((qb.lane_anchor[i] - j0) % s.dilation + s.dilation) % s.dilation;
        first_rel[l] = static_cast<float>(std::min<std::int64_t>(offset, kBlockK + 1));
      }
    }
    lo[x] = hn::Load(df, lo_rel);
    hi[x] = hn::Load(df, hi_rel);
    first[x] = hn::Load(df, first_rel);
  }
  const VF neg_inf = hn::Set(df, kNegInf);
  const VF zero = hn::Zero(df);
  const std::int64_t* g = std::lower_bound(s.global, s.global + s.num_global, j0);
  const std::int64_t* g_end = s.global + s.num_global;
  for (std::int64_t j = 0; j < num_k; ++j) {
    if (g != g_end && *g == j0 + j) {  // a global key column: every lane attends it
      ++g;
      continue;
    }
    const VF jv = hn::Set(df, static_cast<float>(j));
    // Key j is in lane l's residue class iff j % dilation == first_l (first_l < dilation);
    // for dilation > kBlockK only j == first_l is in the tile.
    const VF j_class = hn::Set(df, static_cast<float>(s.dilation > kBlockK ? j : j % s.dilation));
    for (int x = 0; x < kQueryVecs; ++x) {
      float* sc = st + j * kBlockQ + x * kLanes;
      auto allowed = hn::And(hn::Ge(jv, lo[x]), hn::Lt(jv, hi[x]));
      if (dilated) {
        allowed = hn::And(allowed, hn::Or(hn::Lt(first[x], zero), hn::Eq(j_class, first[x])));
      }
      hn::Store(hn::IfThenElse(allowed, hn::Load(df, sc), neg_inf), df, sc);
    }
  }
}

// Keys [lo, hi) that query `query` of batch entry b may attend under causal, window and key
// lengths (lo = hi = 0: none).
struct KeyRange {
  std::int64_t lo, hi;
};
inline KeyRange LaneKeys(const AttentionKernelParams& p, std::int64_t b, std::int64_t query) {
  const std::int64_t key_length = p.key_lengths != nullptr ? p.key_lengths[b] : p.seq_kv;
  const std::int64_t diag = query + p.diagonal_offset;
  const std::int64_t lo = p.window_left < 0 ? 0 : std::max<std::int64_t>(0, diag - p.window_left);
  const std::int64_t hi = p.window_right < 0
                              ? key_length
                              : std::min<std::int64_t>(key_length, diag + p.window_right + 1);
  return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};
}

// qt[d][l] = q[l][d] * scale for the block's lanes l < num_q, 0 past them (q stored as T). Row by
// row: the rows lie Hq * D elements apart, often a multiple of 4 KiB, so a walk column by column
// keeps evicting them from one L1 set. With unit stride along D, squares of kLanes x kLanes are
// transposed in registers (TransposeSquare); the rest of D element by element.
// Offset (in elements) of lane l's row in a [B, Lq, Hq, ...] operand with these strides (q, out).
inline std::int64_t LaneRow(const std::int64_t* stride, const QueryBlock& qb, std::int64_t l) {
  return qb.b * stride[0] + qb.query[l] * stride[1] + qb.head[l] * stride[2];
}

template <typename T>
inline void PackQuery(const AttentionKernelParams& p, QueryBlock& qb) {
  const DF df;
  const T* q = static_cast<const T*>(p.q);
  const VF scale = hn::Set(df, p.scale);
  const std::int64_t squares = p.q_stride[3] == 1 ? p.head_dim / kLanes * kLanes : 0;
  for (std::int64_t l0 = 0; l0 < kBlockQ; l0 += kLanes) {
    const T* rows[kLanes];
    for (std::int64_t r = 0; r < kLanes; ++r) {
      const std::int64_t l = l0 + r;
      rows[r] = l < qb.num_q ? q + LaneRow(p.q_stride, qb, l) : nullptr;
    }
    for (std::int64_t d0 = 0; d0 < squares; d0 += kLanes) {
      VF v[kLanes];
      HWY_UNROLL(16)
      for (std::int64_t r = 0; r < kLanes; ++r) {
        v[r] = rows[r] != nullptr ? hn::Mul(LoadWide(df, rows[r] + d0), scale) : hn::Zero(df);
      }
      TransposeSquare(df, v);
      HWY_UNROLL(16)
      for (std::int64_t c = 0; c < kLanes; ++c) {
        hn::Store(v[c], df, qb.qt + (d0 + c) * kBlockQ + l0);
      }
    }
    for (std::int64_t r = 0; r < kLanes; ++r) {
      for (std::int64_t d = squares; d < p.head_dim; ++d) {
        qb.qt[d * kBlockQ + l0 + r] =
            rows[r] != nullptr ? WideElement(rows[r][d * p.q_stride[3]]) * p.scale : 0.0f;
      }
    }
  }
}

// Starts block `block` of kv head `kv_head` in batch entry b: computes each lane's allowed key
// range from causal/window/key_lengths, resets the running softmax state. The tile products then
// need StartTileProducts; the narrow decode path (flash_forward.cc) keeps q and o rows of its own.
inline void StartQueryBlock(const AttentionKernelParams& p, std::int64_t b, std::int64_t kv_head,
                            std::int64_t block, QueryBlock& qb) {
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  const std::int64_t row0 = block * kBlockQ;
  qb.b = b;
  qb.num_q = std::min<std::int64_t>(kBlockQ, group * p.seq_q - row0);
  qb.k = element_at(p.k, p.dtype, b * p.k_stride[0] + kv_head * p.k_stride[2]);
  qb.v = element_at(p.v, p.dtype, b * p.v_stride[0] + kv_head * p.v_stride[2]);

  qb.key_begin = p.seq_kv;
  qb.key_end = 0;
  for (std::int64_t l = 0; l < kBlockQ; ++l) {
    KeyRange keys{0, 0};
    qb.head[l] = kv_head * group;
    qb.query[l] = 0;
    if (l < qb.num_q) {
      qb.head[l] = kv_head * group + (row0 + l) / p.seq_q;
      qb.query[l] = (row0 + l) % p.seq_q;
      keys = LaneKeys(p, b, qb.query[l]);
    }
    qb.lo[l] = keys.lo;
    qb.hi[l] = keys.hi;
    if (keys.hi > keys.lo) {
      qb.key_begin = std::min(qb.key_begin, keys.lo);
      qb.key_end = std::max(qb.key_end, keys.hi);
    }
    qb.row_max[l] = kNegInf;
    qb.row_sum[l] = 0.0f;
  }
  if (qb.key_end <= qb.key_begin) qb.key_begin = qb.key_end = 0;
  if (p.sparse.kind != SparseKernelParams::Kind::kNone) StartSparseBlock(p, qb);
}

// ---------------------------------------------------------------------------------------------
// K and V rows for the tile products. An f32 operand is read where it lies; bf16/f16 rows are
// widened (exactly) into a per-thread staging tile, once per (rows, tile): the query blocks of a
// task that share a kv head then reuse it.

// Rows [j0, j0 + num_k) of K or V: row j at data + j * row_stride, element e at + e * elem_stride.
struct TileRows {
  const float* data;
  std::int64_t row_stride, elem_stride;
};

// A staging tile [kBlockK][dim] and what it holds (rows [j0, j0 + num) below `source`).
struct StagedRows {
  float* buffer = nullptr;
  const void* source = nullptr;
  std::int64_t j0 = 0, num = 0;

  bool Holds(const void* rows, std::int64_t first, std::int64_t count) const {
    return source == rows && j0 == first && num == count;
  }
};

struct Staging {
  StagedRows k, v;
  std::uint32_t* prob_pairs = nullptr;  // bf16: [kBlockK / 2][kBlockQ] pair words
};

// Floats of the staging tiles (none for f32 operands); bf16 adds the probabilities as pair
// words for the vdpbf16ps path (see UseBf16Dot).
inline std::int64_t StagingFloats(const AttentionKernelParams& p) {
  if (p.dtype == DType::kF32) return 0;
  return kBlockK * (p.head_dim + p.head_dim_v) +
         (p.dtype == DType::kBF16 ? kBlockK / 2 * kBlockQ : 0);
}

inline Staging BindStaging(const AttentionKernelParams& p, float* floats) {
  Staging s;
  s.k.buffer = floats;
  s.v.buffer = floats + kBlockK * p.head_dim;
  if (p.dtype == DType::kBF16) {
    s.prob_pairs = reinterpret_cast<std::uint32_t*>(s.v.buffer + kBlockK * p.head_dim_v);
  }
  return s;
}

// dst[0 : n] = the f32 values of src[0 : n].
template <typename T>
HWY_INLINE void WidenRow(const T* HWY_RESTRICT src, std::int64_t n, float* HWY_RESTRICT dst) {
  const DF df;
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) hn::StoreU(LoadWide(df, src + i), df, dst + i);
  for (; i < n; ++i) dst[i] = WideElement(src[i]);
}

// Rows [j0, j0 + num_k) of the operand whose (b, kv_head) rows start at `rows` (p.k's or p.v's
// strides, `dim` elements each), as f32.
inline TileRows StageRows(const AttentionKernelParams& p, const void* rows,
                          const std::int64_t* stride, std::int64_t dim, std::int64_t j0,
                          std::int64_t num_k, StagedRows& staged) {
  if (p.dtype == DType::kF32) {
    return {static_cast<const float*>(rows) + j0 * stride[1], stride[1], stride[3]};
  }
  if (!staged.Holds(rows, j0, num_k)) {
    for (std::int64_t j = 0; j < num_k; ++j) {
      const std::int64_t at = (j0 + j) * stride[1];
      float* dst = staged.buffer + j * dim;
      if (stride[3] != 1) {
        for (std::int64_t e = 0; e < dim; ++e)
          dst[e] = load_element(rows, p.dtype, at + e * stride[3]);
      } else if (p.dtype == DType::kBF16) {
        WidenRow(static_cast<const hwy::bfloat16_t*>(rows) + at, dim, dst);
      } else {
        WidenRow(static_cast<const hwy::float16_t*>(rows) + at, dim, dst);
      }
    }
    staged = {staged.buffer, rows, j0, num_k};
  }
  return {staged.buffer, dim, 1};
}

// st[j][:] = scores of keys [j0, j0 + num_k) against the block's queries, with softcap, bias
// and every mask applied: not-allowed pairs are exactly -inf. sparse_predicate: apply the
// sparsity pair by pair (tiles SparseTileKeys found partly covered; every tile in chunked).
inline void MaskScoreTile(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                          std::int64_t num_k, float* HWY_RESTRICT st, bool sparse_predicate);
// vec_end (TileVecKeys(...).ends(), nullable): query vector x needs keys [0, vec_end[x]) only; its
// lanes of the later keys may be left as they were until the masks set them to -inf.
inline void ScoreTile(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                      std::int64_t num_k, float* HWY_RESTRICT st, bool sparse_predicate,
                      Staging& staging, const std::int64_t* vec_end = nullptr) {
  const TileRows k = StageRows(p, qb.k, p.k_stride, p.head_dim, j0, num_k, staging.k);
  OuterProduct(qb.qt, k.data, num_k, k.row_stride, k.elem_stride, p.head_dim, st, nullptr, false,
               vec_end);
  MaskScoreTile(p, qb, j0, num_k, st, sparse_predicate);
}

// The masking half of ScoreTile, for st holding raw scores q.k * scale (the flash kernel's
// decode path computes them its own way: flash_forward.cc).
inline void MaskScoreTile(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                          std::int64_t num_k, float* HWY_RESTRICT st, bool sparse_predicate) {
  const DF df;
  if (p.softcap > 0.0f) {
    // "s = softcap * tanh(s / softcap)"; scale is already folded into q.
    const VF cap = hn::Set(df, p.softcap), inv_cap = hn::Set(df, 1.0f / p.softcap);
    for (std::int64_t x = 0; x < num_k * kBlockQ; x += kLanes) {
      hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::Load(df, st + x), inv_cap))), df, st + x);
    }
  }
  if (p.bias != nullptr) {
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      const float* bias = p.bias + qb.b * p.bias_stride[0] + qb.head[l] * p.bias_stride[1] +
                          qb.query[l] * p.bias_stride[2] + j0 * p.bias_stride[3];
      for (std::int64_t j = 0; j < num_k; ++j) st[j * kBlockQ + l] += bias[j * p.bias_stride[3]];
    }
  }
  if (p.mask != nullptr) {
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      const std::uint8_t* mask = p.mask + qb.b * p.mask_stride[0] + qb.head[l] * p.mask_stride[1] +
                                 qb.query[l] * p.mask_stride[2] + j0 * p.mask_stride[3];
      for (std::int64_t j = 0; j < num_k; ++j) {
        if (mask[j * p.mask_stride[3]] == 0) st[j * kBlockQ + l] = kNegInf;
      }
    }
  }

  if (sparse_predicate) ApplySparsity(p, qb, j0, num_k, st);

  // Range masks (causal, window, key lengths). A tile inside every query's range needs none.
  bool interior = true;
  for (std::int64_t i = 0; i < qb.num_q; ++i) {
    interior = interior && qb.lo[i] <= j0 && qb.hi[i] >= j0 + num_k;
  }
  if (interior) return;
  VF lo[kQueryVecs], hi[kQueryVecs];
  for (int x = 0; x < kQueryVecs; ++x) {
    // Tile-relative bounds, clamped so they stay exact as floats.
    HWY_ALIGN float lo_rel[kLanes], hi_rel[kLanes];
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const std::int64_t i = x * kLanes + l;
      lo_rel[l] = static_cast<float>(std::clamp<std::int64_t>(qb.lo[i] - j0, -1, kBlockK + 1));
      hi_rel[l] = static_cast<float>(std::clamp<std::int64_t>(qb.hi[i] - j0, -1, kBlockK + 1));
    }
    lo[x] = hn::Load(df, lo_rel);
    hi[x] = hn::Load(df, hi_rel);
  }
  const VF neg_inf = hn::Set(df, kNegInf);
  for (std::int64_t j = 0; j < num_k; ++j) {
    const VF jv = hn::Set(df, static_cast<float>(j));
    for (int x = 0; x < kQueryVecs; ++x) {
      float* s = st + j * kBlockQ + x * kLanes;
      const auto allowed = hn::And(hn::Ge(jv, lo[x]), hn::Lt(jv, hi[x]));
      hn::Store(hn::IfThenElse(allowed, hn::Load(df, s), neg_inf), df, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 on vdpbf16ps (kernels/cpu/bf16_dot.h): on the AVX3 target of a CPU with AVX512-BF16,
// both tile products of bf16 operands run on pairs of bf16 accumulated in f32. The scores use q
// unscaled (its bf16 values are exact) and multiply the f32 dot products by scale; the values
// use the probabilities rounded to bf16 (as FlashAttention does on GPUs; the row sums stay f32).
// Operands become "pair words" (two bf16 along the reduction axis in one uint32), each K and V
// tile once per (rows, tile) in the staging tiles, q once per block in qb.qt.

inline bool UseBf16Dot(const AttentionKernelParams& p) {
  if constexpr (kBlockQ != bf16dot::kLanes) {
    return false;
  } else {
    return p.dtype == DType::kBF16 && bf16dot::available();
  }
}

// The bf16 bits of element `offset` (past the end of a row: 0, the pair's zero padding).
HWY_INLINE std::uint32_t Bf16Bits(const void* base, std::int64_t offset) {
  return static_cast<const std::uint16_t*>(base)[offset];
}

// dst[t * stride] = (q[l][2t], q[l][2t + 1]) for the block's row l, unscaled, first <= t <
// ceil(D / 2) (an odd D's last pair has +0 as its high half).
inline void QueryPairs(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t l,
                       std::uint32_t* dst, std::int64_t stride, std::int64_t first = 0) {
  const std::int64_t row = LaneRow(p.q_stride, qb, l);
  for (std::int64_t t = first; t < (p.head_dim + 1) / 2; ++t) {
    const std::int64_t d = 2 * t;
    const std::uint32_t hi = d + 1 < p.head_dim ? Bf16Bits(p.q, row + (d + 1) * p.q_stride[3]) : 0;
    dst[t * stride] = Bf16Bits(p.q, row + d * p.q_stride[3]) | hi << 16;
  }
}

// qt[t][l] = (q[l][2t], q[l][2t + 1]) of the block's rows, unscaled, zero past num_q and D
// (StartTileProducts with pairs = true). With unit stride along an even D a row already is its
// pair words: squares of them are transposed in registers as in PackQuery, the rest of the words
// lane by lane.
inline void PackQueryPairs(const AttentionKernelParams& p, QueryBlock& qb) {
  std::uint32_t* qt = reinterpret_cast<std::uint32_t*>(qb.qt);
  const std::int64_t words = (p.head_dim + 1) / 2;
#if HWY_TARGET == HWY_SCALAR  // (one lane: no squares; vdpbf16ps never runs on it anyway)
  const std::int64_t squares = 0;
#else
  using DU = hn::RebindToUnsigned<DF>;  // kLanes pair words
  const DU du;
  const hn::Repartition<std::uint16_t, DU> du16;  // the same bytes as bf16
  const bool rows_are_pairs = p.q_stride[3] == 1 && p.head_dim % 2 == 0;
  const std::int64_t squares = rows_are_pairs ? words / kLanes * kLanes : 0;
#endif
  for (std::int64_t l0 = 0; l0 < kBlockQ; l0 += kLanes) {
    const std::uint16_t* rows[kLanes];
    for (std::int64_t r = 0; r < kLanes; ++r) {
      const std::int64_t l = l0 + r;
      rows[r] = l < qb.num_q ? static_cast<const std::uint16_t*>(p.q) + LaneRow(p.q_stride, qb, l)
                             : nullptr;
    }
#if HWY_TARGET != HWY_SCALAR
    for (std::int64_t t0 = 0; t0 < squares; t0 += kLanes) {
      hn::Vec<DU> v[kLanes];
      HWY_UNROLL(16)
      for (std::int64_t r = 0; r < kLanes; ++r) {
        v[r] =
            rows[r] != nullptr ? hn::BitCast(du, hn::LoadU(du16, rows[r] + 2 * t0)) : hn::Zero(du);
      }
      TransposeSquare(du, v);
      HWY_UNROLL(16)
      for (std::int64_t c = 0; c < kLanes; ++c) hn::Store(v[c], du, qt + (t0 + c) * kBlockQ + l0);
    }
#endif
    for (std::int64_t r = 0; r < kLanes; ++r) {
      if (rows[r] != nullptr) {
        QueryPairs(p, qb, l0 + r, qt + l0 + r, kBlockQ, squares);
      } else {
        for (std::int64_t t = squares; t < words; ++t) qt[t * kBlockQ + l0 + r] = 0;
      }
    }
  }
}

// A started block's inputs to the tile products: q^T * scale packed into qt (or, for the
// vdpbf16ps products, q's pair words: PackQueryPairs) and ot zeroed.
inline void StartTileProducts(const AttentionKernelParams& p, QueryBlock& qb, bool pairs = false) {
  if (pairs) {
    PackQueryPairs(p, qb);
  } else if (p.dtype == DType::kF32) {
    PackQuery<float>(p, qb);
  } else if (p.dtype == DType::kBF16) {
    PackQuery<hwy::bfloat16_t>(p, qb);
  } else {
    PackQuery<hwy::float16_t>(p, qb);
  }
  std::fill(qb.ot, qb.ot + p.head_dim_v * kBlockQ, 0.0f);
}

// Keys [j0, j0 + num_k) as pair words along head_dim: [num_k][ceil(D / 2)].
inline const std::uint32_t* StageKeyPairs(const AttentionKernelParams& p, const QueryBlock& qb,
                                          std::int64_t j0, std::int64_t num_k, StagedRows& staged) {
  std::uint32_t* pairs = reinterpret_cast<std::uint32_t*>(staged.buffer);
  if (staged.Holds(qb.k, j0, num_k)) return pairs;
  const std::int64_t words = (p.head_dim + 1) / 2;
  for (std::int64_t j = 0; j < num_k; ++j) {
    const std::int64_t row = (j0 + j) * p.k_stride[1];
    std::uint32_t* dst = pairs + j * words;
    if (p.k_stride[3] == 1 && p.head_dim % 2 == 0) {  // a contiguous row already is its pairs
      std::memcpy(dst, static_cast<const std::uint16_t*>(qb.k) + row, words * 4);
      continue;
    }
    for (std::int64_t t = 0; t < words; ++t) {
      const std::int64_t d = 2 * t;
      const std::uint32_t hi =
          d + 1 < p.head_dim ? Bf16Bits(qb.k, row + (d + 1) * p.k_stride[3]) : 0;
      dst[t] = Bf16Bits(qb.k, row + d * p.k_stride[3]) | hi << 16;
    }
  }
  staged = {staged.buffer, qb.k, j0, num_k};
  return pairs;
}

// Values [j0, j0 + num_k) as pair words along the keys: [ceil(num_k / 2)][Dv] (an odd tile's
// last pair holds +0 for the key past the tile, which is never read: it may be padding).
inline const std::uint32_t* StageValuePairs(const AttentionKernelParams& p, const QueryBlock& qb,
                                            std::int64_t j0, std::int64_t num_k,
                                            StagedRows& staged) {
  std::uint32_t* pairs = reinterpret_cast<std::uint32_t*>(staged.buffer);
  if (staged.Holds(qb.v, j0, num_k)) return pairs;
  const std::int64_t dv = p.head_dim_v;
  for (std::int64_t t = 0; t < (num_k + 1) / 2; ++t) {
    const std::int64_t lo_row = (j0 + 2 * t) * p.v_stride[1];
    const bool has_hi = 2 * t + 1 < num_k;
    std::uint32_t* dst = pairs + t * dv;
    if (p.v_stride[3] == 1 && has_hi) {  // two contiguous rows: a loop the compiler vectorises
      const std::uint16_t* lo = static_cast<const std::uint16_t*>(qb.v) + lo_row;
      const std::uint16_t* hi = lo + p.v_stride[1];
      for (std::int64_t e = 0; e < dv; ++e) {
        dst[e] = static_cast<std::uint32_t>(lo[e]) | static_cast<std::uint32_t>(hi[e]) << 16;
      }
      continue;
    }
    for (std::int64_t e = 0; e < dv; ++e) {
      const std::uint32_t hi =
          has_hi ? Bf16Bits(qb.v, lo_row + p.v_stride[1] + e * p.v_stride[3]) : 0;
      dst[e] = Bf16Bits(qb.v, lo_row + e * p.v_stride[3]) | hi << 16;
    }
  }
  staged = {staged.buffer, qb.v, j0, num_k};
  return pairs;
}

// ScoreTile and AccumulateValues on vdpbf16ps (qb.qt holds PackQueryPairs; vec_end: see
// ScoreTile, with kQueryVecs = 4 = bf16dot's vectors, as UseBf16Dot requires).
inline void ScoreTileBf16(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                          std::int64_t num_k, float* HWY_RESTRICT st, bool sparse_predicate,
                          Staging& staging, const std::int64_t* vec_end = nullptr) {
  const std::int64_t words = (p.head_dim + 1) / 2;
  bf16dot::outer_product(reinterpret_cast<const std::uint32_t*>(qb.qt),
                         StageKeyPairs(p, qb, j0, num_k, staging.k), num_k, words, 1, words, st,
                         nullptr, false, p.scale, vec_end);
  MaskScoreTile(p, qb, j0, num_k, st, sparse_predicate);
}
inline void AccumulateValuesBf16(const AttentionKernelParams& p, const QueryBlock& qb,
                                 std::int64_t j0, std::int64_t num_k, const float* st,
                                 const float* alpha, Staging& staging,
                                 const std::int64_t* vec_end = nullptr) {
  const std::uint32_t* v = StageValuePairs(p, qb, j0, num_k, staging.v);
  bf16dot::pack_probs(st, num_k, kQueryVecs, staging.prob_pairs);
  // The keys each vector needs, in pairs (vec_end is even but for the last, num_k).
  std::int64_t pair_end[kQueryVecs];
  for (int x = 0; vec_end != nullptr && x < kQueryVecs; ++x) pair_end[x] = (vec_end[x] + 1) / 2;
  bf16dot::outer_product(staging.prob_pairs, v, p.head_dim_v, 1, p.head_dim_v, (num_k + 1) / 2,
                         qb.ot, alpha, true, 1.0f, nullptr,
                         vec_end != nullptr ? pair_end : nullptr);
}

// The max to subtract for a running max m: m itself, or 0 while no key was allowed
// (we don't want (-inf) - (-inf), which would give NaN).
HWY_INLINE VF SafeMax(DF df, VF m) {
  return hn::IfThenElse(hn::Eq(m, hn::Set(df, kNegInf)), hn::Zero(df), m);
}

// Max of st[0 : num_k][lane0 : lane0 + kLanes] down the keys.
HWY_INLINE VF ColumnMax(DF df, const float* HWY_RESTRICT st, std::int64_t num_k,
                        std::int64_t lane0) {
  VF max = hn::Set(df, kNegInf);
  for (std::int64_t j = 0; j < num_k; ++j)
    max = hn::Max(max, hn::Load(df, st + j * kBlockQ + lane0));
  return max;
}

// st[j][lanes] = exp(st[j][lanes] - shift) in place; returns the sum down the keys.
// exp(-inf - shift) = 0: masked pairs drop out exactly.
HWY_INLINE VF ExpInPlaceAndSum(DF df, float* HWY_RESTRICT st, std::int64_t num_k,
                               std::int64_t lane0, VF shift) {
  VF sum = hn::Zero(df);
  for (std::int64_t j = 0; j < num_k; ++j) {
    float* s = st + j * kBlockQ + lane0;
    const VF prob = fastexp::ExpNonPositive(df, hn::Sub(hn::Load(df, s), shift));
    hn::Store(prob, df, s);
    sum = hn::Add(sum, prob);
  }
  return sum;
}

// Flash step over one tile: st becomes p = exp(s - m_new) in place; alpha = exp(m_old - m_new);
// row_sum = row_sum * alpha + sum_j p. Only the first num_vecs query vectors (the flash
// kernel's decode path uses fewer lanes; the others are left as they are), and with vec_end
// (see ScoreTile) only keys [0, vec_end[x]) of vector x: the later ones stay -inf.
inline void OnlineSoftmaxTile(QueryBlock& qb, std::int64_t num_k, float* HWY_RESTRICT st,
                              int num_vecs = kQueryVecs, const std::int64_t* vec_end = nullptr) {
  const DF df;
  for (int x = 0; x < num_vecs; ++x) {
    const std::int64_t lane0 = x * kLanes;
    const std::int64_t keys = vec_end != nullptr ? vec_end[x] : num_k;
    const VF old_max = hn::Load(df, qb.row_max + lane0);
    const VF new_max = hn::Max(old_max, ColumnMax(df, st, keys, lane0));
    const VF shift = SafeMax(df, new_max);
    // exp(-inf - shift) = 0: the first tile rescales an all-zero accumulator.
    const VF alpha = fastexp::ExpNonPositive(df, hn::Sub(old_max, shift));
    const VF sum = ExpInPlaceAndSum(df, st, keys, lane0, shift);
    hn::Store(new_max, df, qb.row_max + lane0);
    hn::Store(hn::MulAdd(hn::Load(df, qb.row_sum + lane0), alpha, sum), df, qb.row_sum + lane0);
    hn::Store(alpha, df, qb.alpha + lane0);
  }
}

// ot = alpha * ot + v[j0 : j0 + num_k]^T p   (alpha null: no rescale; vec_end: see ScoreTile)
inline void AccumulateValues(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                             std::int64_t num_k, const float* st, const float* alpha,
                             Staging& staging, const std::int64_t* vec_end = nullptr) {
  const TileRows v = StageRows(p, qb.v, p.v_stride, p.head_dim_v, j0, num_k, staging.v);
  OuterProduct(st, v.data, p.head_dim_v, v.elem_stride, v.row_stride, num_k, qb.ot, alpha, true,
               nullptr, vec_end);
}

// out = ot^T / row_sum (0 for rows with no allowed key), lse = row_max + log(row_sum) (-inf).
inline void FinishQueryBlock(const AttentionKernelParams& p, const QueryBlock& qb) {
  const DF df;
  HWY_ALIGN float inv_sum[kBlockQ];
  HWY_ALIGN float lse[kBlockQ];
  for (int x = 0; x < kQueryVecs; ++x) {
    const std::int64_t lane0 = x * kLanes;
    const VF sum = hn::Load(df, qb.row_sum + lane0);
    const auto has_keys = hn::Gt(sum, hn::Zero(df));
    // Guard the divide and log so lanes without keys never compute 1/0 or log(0).
    const VF safe_sum = hn::IfThenElse(has_keys, sum, hn::Set(df, 1.0f));
    hn::Store(hn::IfThenElseZero(has_keys, hn::Div(hn::Set(df, 1.0f), safe_sum)), df,
              inv_sum + lane0);
    const VF row_lse = hn::Add(hn::Load(df, qb.row_max + lane0), hn::Log(df, safe_sum));
    hn::Store(hn::IfThenElse(has_keys, row_lse, hn::Set(df, kNegInf)), df, lse + lane0);
  }
  // Row by row, transposing squares of ot in registers where out has unit stride along Dv (as
  // PackQuery), the rest of Dv element by element.
  const std::int64_t squares = p.out_stride[3] == 1 ? p.head_dim_v / kLanes * kLanes : 0;
  for (std::int64_t l0 = 0; l0 < qb.num_q; l0 += kLanes) {
    float* rows[kLanes];
    for (std::int64_t r = 0; r < kLanes; ++r) {
      const std::int64_t l = std::min(l0 + r, qb.num_q - 1);  // (lanes past num_q: not stored)
      rows[r] = p.out + LaneRow(p.out_stride, qb, l);
    }
    const std::int64_t lanes = std::min(kLanes, qb.num_q - l0);
    for (std::int64_t e0 = 0; e0 < squares; e0 += kLanes) {
      VF v[kLanes];
      HWY_UNROLL(16)
      for (std::int64_t c = 0; c < kLanes; ++c)
        v[c] = hn::Load(df, qb.ot + (e0 + c) * kBlockQ + l0);
      TransposeSquare(df, v);
      for (std::int64_t r = 0; r < lanes; ++r) {
        hn::StoreU(hn::Mul(v[r], hn::Set(df, inv_sum[l0 + r])), df, rows[r] + e0);
      }
    }
    for (std::int64_t r = 0; r < lanes; ++r) {
      for (std::int64_t e = squares; e < p.head_dim_v; ++e) {
        rows[r][e * p.out_stride[3]] = qb.ot[e * kBlockQ + l0 + r] * inv_sum[l0 + r];
      }
    }
  }
  if (p.lse != nullptr) {
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      p.lse[qb.b * p.lse_stride[0] + qb.head[l] * p.lse_stride[1] + qb.query[l] * p.lse_stride[2]] =
          lse[l];
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_ATTENTION_TILES_INL_H_
