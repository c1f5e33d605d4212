// Flash attention forward on the CPU: tiles over queries (kBlockQ) and keys (kBlockK) with the
// online softmax (running max and sum, rescaling), never allocating Lq x Lk. Key tiles outside
// the union of the block's allowed ranges (causal, window, key lengths) are skipped, so causal
// costs about half; so are key tiles a sparsity (Longformer, BigBird, a block layout) leaves
// out, and tiles it covers in part take a pair-by-pair predicate (docs/sparse.md).
//
// Work: tasks are groups of query blocks that share one walk over the keys. When the blocks are
// too few to keep the threads busy and the keys are long (decoding: Lq = 1 against a KV cache),
// the keys are split as well (flash-decoding): each (group, split) task leaves a partial result
// per row (unnormalised out, running max and sum), and a merge combines the splits of every row
// in a fixed order. Blocks with few rows (decoding) compute their products row by row instead of
// on kBlockQ lanes (the decode path below). Every choice depends on the shape only and every
// task is computed by one thread in a fixed order, so results are identical whatever the thread
// count. docs/kernels.md explains the plan.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_forward.cc"
#include <cmath>
#include <numeric>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/attention_tiles-inl.h"
#include "kernels/cpu/dropout-inl.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

using namespace tiles;

// ---------------------------------------------------------------------------------------------
// The work plan: a function of the shape only (never of the thread count).

constexpr std::int64_t kMinTasks = 8;          // tasks the block grouping keeps, when it can
constexpr std::int64_t kSplitBelowItems = 32;  // fewer query blocks than this: split the keys
constexpr std::int64_t kSplitTasks = 16;       // tasks a key split aims for
constexpr std::int64_t kMinSplitKeys = 1024;   // keys per split, at least (a multiple of kBlockK)
constexpr std::int64_t kMaxSplits = 16;
constexpr std::int64_t kMergeRows = 64;  // output rows per merge task

struct WorkPlan {
  std::int64_t blocks_per_kv_head;
  std::int64_t items;       // query blocks, flattened (b, kv_head, block)
  std::int64_t per_task;    // consecutive blocks that share one walk over the keys
  std::int64_t groups;      // ceil(items / per_task)
  std::int64_t splits;      // key ranges per group; 1: no split
  std::int64_t split_keys;  // keys per split, a multiple of kBlockK (the last may be shorter)
};

WorkPlan PlanWork(const AttentionKernelParams& p) {
  WorkPlan w;
  w.blocks_per_kv_head = BlocksPerKvHead(p);
  w.items = p.batch * p.num_heads_kv * w.blocks_per_kv_head;
  // A group takes up to kMaxBlocksPerTask consecutive blocks and walks the key tiles once for all
  // of them, so each K/V tile is fetched once per group rather than once per block (at long Lk
  // one head's K/V rows span many pages and re-walking them per block is TLB-bound); fewer
  // blocks per group while that leaves under kMinTasks groups.
  w.per_task = std::clamp<std::int64_t>(w.items / kMinTasks, 1, kMaxBlocksPerTask);
  w.splits = 1;
  w.split_keys = p.seq_kv;
  const std::int64_t max_splits = std::min(kMaxSplits, p.seq_kv / kMinSplitKeys);
  if (w.items < kSplitBelowItems && max_splits >= 2) {
    // Few blocks, long keys (decoding): the splits supply the parallelism, so a group can take
    // more blocks (all kv heads of a decode step: each key tile is then one contiguous stretch of
    // K and V in BSHD, read once); keep >= kMinTasks tasks when the splits alone cannot.
    const std::int64_t groups_needed = (kMinTasks + max_splits - 1) / max_splits;
    w.per_task = std::clamp<std::int64_t>(w.items / groups_needed, 1, kMaxBlocksPerTask);
    const std::int64_t groups = (w.items + w.per_task - 1) / w.per_task;
    const std::int64_t splits =
        std::clamp<std::int64_t>((kSplitTasks + groups - 1) / groups, 1, max_splits);
    const std::int64_t keys = (p.seq_kv + splits - 1) / splits;
    w.split_keys = (keys + kBlockK - 1) / kBlockK * kBlockK;
    w.splits = (p.seq_kv + w.split_keys - 1) / w.split_keys;
  }
  w.groups = (w.items + w.per_task - 1) / w.per_task;
  return w;
}

// The order the groups are handed out in: the costliest first (by the keys their rows may
// attend), ties in index order. parallel_for hands tasks out as threads free up, so a costly
// group handed out last leaves one thread working alone: causal at H = 8, L = 1024 has 16
// groups of 8 blocks, costing 36 or 100 blocks' worth of keys in turn, which in index order
// leaves 2 threads 6% of the time unbalanced. The order changes no result, only which thread
// computes what.
std::vector<std::int64_t> GroupOrder(const AttentionKernelParams& p, const WorkPlan& w) {
  const std::int64_t group_rows = p.num_heads_q / p.num_heads_kv * p.seq_q;
  std::vector<std::int64_t> cost(w.groups, 0), order(w.groups);
  for (std::int64_t item = 0; item < w.items; ++item) {
    const std::int64_t b = item / (p.num_heads_kv * w.blocks_per_kv_head);
    const std::int64_t row0 = item % w.blocks_per_kv_head * kBlockQ;
    for (std::int64_t row = row0; row < std::min(row0 + kBlockQ, group_rows); ++row) {
      const KeyRange keys = LaneKeys(p, b, row % p.seq_q);
      cost[item / w.per_task] += keys.hi - keys.lo;
    }
  }
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t x, std::int64_t y) { return cost[x] > cost[y]; });
  return order;
}

// ---------------------------------------------------------------------------------------------
// The decode path. A block with at most kNarrowRows rows (the GQA group of one decode step:
// Lq = 1, 4 heads per kv head) would use 4 of 64 lanes of the transposed micro-kernel and do 16x
// the work it needs; it computes its products row by row instead, vectorised along head_dim:
//   s[j][r] = qr[r] . k[j]               (K dot products at once, then a lane sum)
//   o[r][:] = alpha[r] * o[r][:] + sum_j p[j][r] * v[j][:]
// with qr: [rows][D] (q * scale) and o: [rows][Dv] in its own scratch. The scores still land in
// the block's st[key][lane] tile, so masks and the online softmax are the shared ones
// (MaskScoreTile, OnlineSoftmaxTile); at the end o is transposed into qb.ot for the shared
// finish. It needs unit strides along head_dim (true for BSHD and BHSD).

constexpr std::int64_t kNarrowRows = kBlockQ / 4;
static_assert(kNarrowRows <= kLanes, "FinishNarrow fills one vector of lanes");
constexpr int kDotRows = kNarrowRows < 4 ? static_cast<int>(kNarrowRows) : 4;
// Keys per dot-product step: kDotRows x kDotKeys accumulators (16 of AVX-512's 32 registers;
// 8 of AVX2's 16).
constexpr int kDotKeys = kLanes >= 16 ? 4 : 2;
// Keys per value chunk in BSHD (see NarrowTile; 8 measured best of 1, 2, 4, 8, 16, 32).
constexpr std::int64_t kValueKeys = 8;
// Software prefetch distances of the widening walk (f32, f16) in BSHD, in keys (see NarrowTile).
constexpr std::int64_t kScoreAhead = 2;
constexpr std::int64_t kValueAhead = 16;

// Asks for the cache line holding p toward L2 (prefetcht1 on x86; a no-op where the target has
// no prefetch).
HWY_INLINE void PrefetchL2(const void* p) { __builtin_prefetch(p, 0, 2); }

#if HWY_TARGET != HWY_SCALAR  // (one lane: no blocks to add)
// out[0 : 4] = the sums of the 128-bit blocks of v (a vector of 4 floats per block).
template <class D>
HWY_INLINE void StoreBlockSum(D d, hn::Vec<D> v, float* HWY_RESTRICT out) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    StoreBlockSum(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)), out);
  } else {
    hn::StoreU(v, d, out);
  }
}

// out[r] = sum of the lanes of acc[r], r < 4: a transposing tree (two interleave levels leave
// each 128-bit block holding the 4 rows' partial sums, then the blocks are added), about 13
// operations for 4 sums where 4 separate lane sums take about 40.
HWY_INLINE void StoreLaneSums4(const VF* acc, float* HWY_RESTRICT out) {
  const DF df;
  const hn::Repartition<double, DF> dd;
  // Per block: {a0 + a2, b0 + b2, a1 + a3, b1 + b3} of a = acc[0], b = acc[1]; the same for 2, 3.
  const VF t01 =
      hn::Add(hn::InterleaveLower(df, acc[0], acc[1]), hn::InterleaveUpper(df, acc[0], acc[1]));
  const VF t23 =
      hn::Add(hn::InterleaveLower(df, acc[2], acc[3]), hn::InterleaveUpper(df, acc[2], acc[3]));
  // Per block: the sums of its 4 lanes of acc[0], acc[1], acc[2], acc[3].
  const auto w01 = hn::BitCast(dd, t01), w23 = hn::BitCast(dd, t23);
  const VF u = hn::Add(hn::BitCast(df, hn::InterleaveLower(dd, w01, w23)),
                       hn::BitCast(df, hn::InterleaveUpper(dd, w01, w23)));
  StoreBlockSum(df, u, out);
}

#endif  // HWY_TARGET != HWY_SCALAR

// st[kk * kBlockQ + r] = q[r] . k[kk] for r < R, kk < K.
//   q: [R][head_dim] (row stride head_dim)   k: [K][head_dim] (row stride k_row_stride), stored
//   as T (float, hwy::bfloat16_t or hwy::float16_t; widened to f32 in registers)
//   ahead: the same rows some keys later, prefetched toward L2 as k is read (null: none)
template <int R, int K, typename T>
HWY_INLINE void NarrowDots(const float* HWY_RESTRICT q, const T* HWY_RESTRICT k,
                           std::int64_t k_row_stride, std::int64_t head_dim,
                           float* HWY_RESTRICT st, const T* ahead) {
  const DF df;
  const std::int64_t vec_end = head_dim / kLanes * kLanes;
  VF acc[R][K];
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int kk = 0; kk < K; ++kk) acc[r][kk] = hn::Zero(df);
  }
  for (std::int64_t d = 0; d < vec_end; d += kLanes) {
    if (ahead != nullptr) {
      HWY_UNROLL(4)
      for (int kk = 0; kk < K; ++kk) PrefetchL2(ahead + kk * k_row_stride + d);
    }
    VF key[K];
    HWY_UNROLL(4)
    for (int kk = 0; kk < K; ++kk) key[kk] = LoadWide(df, k + kk * k_row_stride + d);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const VF query = hn::LoadU(df, q + r * head_dim + d);
      HWY_UNROLL(4)
      for (int kk = 0; kk < K; ++kk) acc[r][kk] = hn::MulAdd(query, key[kk], acc[r][kk]);
    }
  }
#if HWY_TARGET != HWY_SCALAR
  if constexpr (R == 4) {
    if (vec_end == head_dim) {
      for (int kk = 0; kk < K; ++kk) {
        const VF rows[4] = {acc[0][kk], acc[1][kk], acc[2][kk], acc[3][kk]};
        StoreLaneSums4(rows, st + kk * kBlockQ);
      }
      return;
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    for (int kk = 0; kk < K; ++kk) {
      float s = hn::GetLane(hn::SumOfLanes(df, acc[r][kk]));
      for (std::int64_t d = vec_end; d < head_dim; ++d) {
        s += q[r * head_dim + d] * WideElement(k[kk * k_row_stride + d]);
      }
      st[kk * kBlockQ + r] = s;
    }
  }
}

// q . k for rows [0, num_q) and K keys at k, into st[kk * kBlockQ + r] (ahead: see NarrowDots;
// the first row group prefetches).
template <int K, typename T>
HWY_INLINE void NarrowDotKeys(const float* q_rows, std::int64_t num_q, const T* k, std::int64_t ks,
                              std::int64_t d, float* st, const T* ahead) {
  std::int64_t r = 0;
  for (; r + kDotRows <= num_q; r += kDotRows) {
    NarrowDots<kDotRows, K>(q_rows + r * d, k, ks, d, st + r, r == 0 ? ahead : nullptr);
  }
  for (; r < num_q; ++r) {
    NarrowDots<1, K>(q_rows + r * d, k, ks, d, st + r, r == 0 ? ahead : nullptr);
  }
}

// o[r][0 : E * kLanes] += sum_j p[j][r] * v[j][0 : E * kLanes], r < R.
//   p: st[j * kBlockQ + r]   v: [num_k][...] (row stride v_row_stride)   o: row stride o_stride
//   ahead: rows j < ahead of v are prefetched toward L2 kValueAhead keys before they are read
template <int R, int E, typename T>
HWY_INLINE void NarrowValueRows(const float* HWY_RESTRICT st, const T* HWY_RESTRICT v,
                                std::int64_t v_row_stride, std::int64_t num_k,
                                float* HWY_RESTRICT o, std::int64_t o_stride, std::int64_t ahead) {
  const DF df;
  VF acc[R][E];
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int e = 0; e < E; ++e) acc[r][e] = hn::LoadU(df, o + r * o_stride + e * kLanes);
  }
  for (std::int64_t j = 0; j < num_k; ++j) {
    if (j + kValueAhead < ahead) {
      HWY_UNROLL(4)
      for (int e = 0; e < E; ++e) PrefetchL2(v + (j + kValueAhead) * v_row_stride + e * kLanes);
    }
    VF value[E];
    HWY_UNROLL(4)
    for (int e = 0; e < E; ++e) value[e] = LoadWide(df, v + j * v_row_stride + e * kLanes);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const VF prob = hn::Set(df, st[j * kBlockQ + r]);
      HWY_UNROLL(4)
      for (int e = 0; e < E; ++e) acc[r][e] = hn::MulAdd(prob, value[e], acc[r][e]);
    }
  }
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int e = 0; e < E; ++e) hn::StoreU(acc[r][e], df, o + r * o_stride + e * kLanes);
  }
}

// Value columns [0, E * kLanes) of rows [0, num_q) (ahead: see NarrowValueRows; the first row
// group prefetches).
template <int E, typename T>
HWY_INLINE void NarrowValueColumns(std::int64_t num_q, const float* st, const T* v,
                                   std::int64_t v_row_stride, std::int64_t num_k, float* o,
                                   std::int64_t o_stride, std::int64_t ahead) {
  std::int64_t r = 0;
  for (; r + kDotRows <= num_q; r += kDotRows) {
    NarrowValueRows<kDotRows, E>(st + r, v, v_row_stride, num_k, o + r * o_stride, o_stride,
                                 r == 0 ? ahead : 0);
  }
  for (; r < num_q; ++r) {
    NarrowValueRows<1, E>(st + r, v, v_row_stride, num_k, o + r * o_stride, o_stride,
                          r == 0 ? ahead : 0);
  }
}

// o += v[0 : num_k]^T p for rows [0, num_q)   (o: [num_q][Dv], p: st[j * kBlockQ + r]; ahead:
// see NarrowValueRows).
template <typename T>
inline void NarrowValueKeys(const AttentionKernelParams& p, std::int64_t num_q, const T* v,
                            std::int64_t num_k, const float* HWY_RESTRICT st,
                            float* HWY_RESTRICT o, std::int64_t ahead) {
  const std::int64_t vs = p.v_stride[1], dv = p.head_dim_v;
  constexpr std::int64_t kWide = kQueryVecs * kLanes;
  std::int64_t e = 0;
  for (; e + kWide <= dv; e += kWide) {
    NarrowValueColumns<kQueryVecs>(num_q, st, v + e, vs, num_k, o + e, dv, ahead);
  }
  for (; e + kLanes <= dv; e += kLanes) {
    NarrowValueColumns<1>(num_q, st, v + e, vs, num_k, o + e, dv, ahead);
  }
  for (; e < dv; ++e) {  // a head_dim_v that is not a multiple of the lanes
    for (std::int64_t r = 0; r < num_q; ++r) {
      float acc = o[r * dv + e];
      for (std::int64_t j = 0; j < num_k; ++j) {
        acc += st[j * kBlockQ + r] * WideElement(v[j * vs + e]);
      }
      o[r * dv + e] = acc;
    }
  }
}

// A block's part of the current key tile: keys [lo, hi) (empty: skip it), and whether the
// sparsity must be applied pair by pair.
struct TilePart {
  std::int64_t lo = 0, hi = 0;
  bool predicate = false;
};

// A narrow block and its own scratch (see NarrowFloats).
struct NarrowBlock {
  QueryBlock* qb = nullptr;
  float* q_rows = nullptr;  // [num_q][D]   q * scale (bf16 on vdpbf16ps: q_pairs instead)
  std::uint32_t* q_pairs = nullptr;  // [num_q][ceil(D / 2)] pair words of q, unscaled (same
                                     // memory as q_rows)
  float* o = nullptr;       // [num_q][Dv]  unnormalised out
  float* st = nullptr;      // [kBlockK][kBlockQ]  its own score tile: NarrowTile computes the
                            // scores of every narrow block before any softmax
  TilePart part;
};

// q and o rows, rounded up to whole kBlockQ so that st (and the next block's scratch) stays
// aligned for full-vector loads.
inline std::int64_t NarrowRowFloats(const AttentionKernelParams& p) {
  return (kNarrowRows * (p.head_dim + p.head_dim_v) + kBlockQ - 1) / kBlockQ * kBlockQ;
}
inline std::int64_t NarrowFloats(const AttentionKernelParams& p) {
  return NarrowRowFloats(p) + kBlockK * kBlockQ;
}

// q_rows[r][d] = q[r][d] * scale for the block's rows r < num_q (the products PackQuery forms,
// read straight from q: a narrow block never packs q^T).
template <typename T>
void NarrowQueryRows(const AttentionKernelParams& p, const QueryBlock& qb, float* q_rows) {
  const DF df;
  const VF scale = hn::Set(df, p.scale);
  const std::int64_t d_vecs = p.q_stride[3] == 1 ? p.head_dim / kLanes * kLanes : 0;
  for (std::int64_t r = 0; r < qb.num_q; ++r) {
    const T* row = static_cast<const T*>(p.q) + LaneRow(p.q_stride, qb, r);
    float* dst = q_rows + r * p.head_dim;
    for (std::int64_t d = 0; d < d_vecs; d += kLanes) {
      hn::StoreU(hn::Mul(LoadWide(df, row + d), scale), df, dst + d);
    }
    for (std::int64_t d = d_vecs; d < p.head_dim; ++d) {
      dst[d] = WideElement(row[d * p.q_stride[3]]) * p.scale;
    }
  }
}

inline NarrowBlock StartNarrow(const AttentionKernelParams& p, QueryBlock& qb, float* scratch,
                               bool bf16_dot) {
  NarrowBlock nb;
  nb.qb = &qb;
  nb.q_rows = scratch;
  nb.o = nb.q_rows + kNarrowRows * p.head_dim;
  nb.st = scratch + NarrowRowFloats(p);
  if (bf16_dot) {
    nb.q_pairs = reinterpret_cast<std::uint32_t*>(nb.q_rows);
    const std::int64_t words = (p.head_dim + 1) / 2;
    for (std::int64_t r = 0; r < qb.num_q; ++r) QueryPairs(p, qb, r, nb.q_pairs + r * words, 1);
  } else if (p.dtype == DType::kF32) {
    NarrowQueryRows<float>(p, qb, nb.q_rows);
  } else if (p.dtype == DType::kBF16) {
    NarrowQueryRows<hwy::bfloat16_t>(p, qb, nb.q_rows);
  } else {
    NarrowQueryRows<hwy::float16_t>(p, qb, nb.q_rows);
  }
  std::fill(nb.o, nb.o + qb.num_q * p.head_dim_v, 0.0f);
  // The softmax runs on the query vectors holding the rows; their lanes past num_q are never
  // written by the scores: keep them finite.
  const std::int64_t lanes = (qb.num_q + kLanes - 1) / kLanes * kLanes;
  for (std::int64_t j = 0; j < kBlockK; ++j) {
    std::fill(nb.st + j * kBlockQ + qb.num_q, nb.st + j * kBlockQ + lanes, 0.0f);
  }
  return nb;
}

// V rows of key j, all heads of a run, as one byte range (when the heads of one key are
// neighbours, BSHD): the bf16 score walk prefetches them toward L2 for the value step that
// follows. Measured at Lk = 32768, 2 threads: bf16 5-15% faster; the same in the f32 walk was 6%
// slower, and prefetching K (any distance, any hint) 15% slower. Null when the heads lie apart.
struct ValueRows {
  const char* first = nullptr;  // key 0 of the part
  std::int64_t row_stride = 0, bytes = 0;
};

inline ValueRows ValueRowsOf(const AttentionKernelParams& p, const NarrowBlock& nb,
                             std::int64_t heads, std::int64_t head_stride) {
  constexpr std::int64_t kBytes = 2;  // bf16
  if (!(p.v_stride[2] < p.v_stride[1]) || head_stride < 0 ||
      (heads - 1) * head_stride + p.head_dim_v > p.v_stride[1]) {
    return {};
  }
  return {static_cast<const char*>(nb.qb->v) + nb.part.lo * p.v_stride[1] * kBytes,
          p.v_stride[1] * kBytes, ((heads - 1) * head_stride + p.head_dim_v) * kBytes};
}

// bf16 on vdpbf16ps (bf16dot::narrow_scores / narrow_values): one call serves a run of
// consecutive narrow blocks with the same part of the tile whose operands lie at one stride (the
// kv heads of one decode step), so the keys are walked outermost across all of them.
struct NarrowRun {
  std::int64_t count = 1;
  std::int64_t k = 0, v = 0, scratch = 0;  // strides: K and V elements, scratch floats
};

inline NarrowRun RunFrom(const NarrowBlock* narrow, std::int64_t first, std::int64_t count) {
  NarrowRun run;
  if (first + 1 >= count) return run;
  const NarrowBlock& a = narrow[first];
  const auto elements = [](const void* x, const void* y) {
    return static_cast<const std::uint16_t*>(y) - static_cast<const std::uint16_t*>(x);
  };
  run.k = elements(a.qb->k, narrow[first + 1].qb->k);
  run.v = elements(a.qb->v, narrow[first + 1].qb->v);
  run.scratch = narrow[first + 1].st - a.st;
  for (std::int64_t n = first + 1; n < count; ++n) {
    const NarrowBlock& b = narrow[n];
    const std::int64_t i = n - first;
    if (b.part.lo != a.part.lo || b.part.hi != a.part.hi || b.qb->num_q != a.qb->num_q ||
        elements(a.qb->k, b.qb->k) != i * run.k || elements(a.qb->v, b.qb->v) != i * run.v ||
        b.st - a.st != i * run.scratch || b.o - a.o != i * run.scratch ||
        reinterpret_cast<const float*>(b.q_pairs) - reinterpret_cast<const float*>(a.q_pairs) !=
            i * run.scratch) {
      break;
    }
    run.count = i + 1;
  }
  return run;
}

// f(first block, run) for each run of blocks with a non-empty part of the tile.
template <class F>
inline void ForEachRun(const NarrowBlock* narrow, std::int64_t count, F&& f) {
  NarrowRun run;
  for (std::int64_t n = 0; n < count; n += run.count) {
    run = RunFrom(narrow, n, count);
    if (narrow[n].part.hi > narrow[n].part.lo) f(narrow[n], run);
  }
}

inline void NarrowScoresBf16(const AttentionKernelParams& p, const NarrowBlock* narrow,
                             std::int64_t count) {
  ForEachRun(narrow, count, [&](const NarrowBlock& nb, const NarrowRun& run) {
    const ValueRows v = ValueRowsOf(p, nb, run.count, run.v);
    const auto* k = static_cast<const std::uint16_t*>(nb.qb->k) + nb.part.lo * p.k_stride[1];
    bf16dot::narrow_scores({nb.q_pairs, run.scratch, k, run.k, p.k_stride[1], nb.st, run.scratch,
                            kBlockQ, run.count, nb.qb->num_q, p.head_dim, nb.part.hi - nb.part.lo,
                            p.scale, v.first, v.row_stride, v.bytes});
  });
}

// All keys of each block's part at once (the score walk prefetched them).
inline void NarrowValuesBf16(const AttentionKernelParams& p, const NarrowBlock* narrow,
                             std::int64_t count) {
  ForEachRun(narrow, count, [&](const NarrowBlock& nb, const NarrowRun& run) {
    const auto* v = static_cast<const std::uint16_t*>(nb.qb->v) + nb.part.lo * p.v_stride[1];
    bf16dot::narrow_values({reinterpret_cast<const std::uint32_t*>(nb.st), run.scratch, kBlockQ, v,
                            run.v, p.v_stride[1], nb.o, run.scratch, p.head_dim_v, run.count,
                            nb.qb->num_q, nb.part.hi - nb.part.lo, p.head_dim_v});
  });
}

// One key tile for every narrow block of a task. In BSHD the rows of neighbouring kv heads for
// one key are neighbours in memory, so the walk goes keys outermost: the scores one key at a
// time for all blocks (K is then read as one ascending stream, which the hardware prefetchers
// follow; a 4-key dot product block by block read 512-byte runs on 4 pages at once and was ~15%
// slower at Lk = 32768), the values kValueKeys keys at a time (o does not fit in registers: it
// is loaded and stored once per chunk). In BHSD each head's rows are already one ascending run,
// read a whole tile at a time per block (key-outermost was slower there). Each block's
// arithmetic is the same either way; only the order of blocks interleaves. In BSHD the walk
// also prefetches toward L2 (prefetcht1) the K rows kScoreAhead keys ahead of the scores and the
// V rows kValueAhead keys ahead of the values: the hardware prefetchers alone left the core with
// too few misses in flight (the multiply-adds waiting on one K line fill the scheduler). Measured
// at Lk = 32768, Hq:Hkv = 32:8, 2 threads, 8 interleaved rounds: f32 1.13-1.16x, f16 1.51x;
// toward L1 (prefetcht0) K was slower and V gained less; distances 1-4 (K) and 4-32 (V) within
// noise of these; 4 heads of one key per step (16 independent sums) was 1.4x slower. bf16 on
// vdpbf16ps goes through bf16dot's narrow products, a run of blocks per call: the scores keys
// outermost across the run, the values a whole part per block, from L2, where the score walk
// prefetched them (NarrowScoresBf16, NarrowValuesBf16 above).
template <typename T>
void NarrowTile(const AttentionKernelParams& p, NarrowBlock* narrow, std::int64_t count,
                bool bf16_dot) {
  std::int64_t j_lo = p.seq_kv, j_hi = 0;
  for (std::int64_t n = 0; n < count; ++n) {
    if (narrow[n].part.hi <= narrow[n].part.lo) continue;
    j_lo = std::min(j_lo, narrow[n].part.lo);
    j_hi = std::max(j_hi, narrow[n].part.hi);
  }
  const std::int64_t ks = p.k_stride[1], vs = p.v_stride[1], d = p.head_dim;
  const bool heads_inner = p.k_stride[2] < p.k_stride[1] && p.v_stride[2] < p.v_stride[1];
  const std::int64_t score_chunk = heads_inner ? 1 : kBlockK;
  const std::int64_t value_chunk = heads_inner ? kValueKeys : kBlockK;
  if (bf16_dot) {
    NarrowScoresBf16(p, narrow, count);
  } else {
    for (std::int64_t j = j_lo; j < j_hi; j += score_chunk) {
      for (std::int64_t n = 0; n < count; ++n) {
        const NarrowBlock& nb = narrow[n];
        const std::int64_t a = std::max(j, nb.part.lo), b = std::min(j + score_chunk, nb.part.hi);
        const T* k = static_cast<const T*>(nb.qb->k) + a * ks;
        float* st = nb.st + (a - nb.part.lo) * kBlockQ;
        // With heads inner: the rows kScoreAhead keys later, while the block reads that far.
        const T* ahead =
            heads_inner && a + kScoreAhead < nb.qb->key_end ? k + kScoreAhead * ks : nullptr;
        std::int64_t x = 0;
        for (; x + kDotKeys <= b - a; x += kDotKeys) {
          NarrowDotKeys<kDotKeys>(nb.q_rows, nb.qb->num_q, k + x * ks, ks, d, st + x * kBlockQ,
                                  static_cast<const T*>(nullptr));
        }
        for (; x < b - a; ++x) {
          NarrowDotKeys<1>(nb.q_rows, nb.qb->num_q, k + x * ks, ks, d, st + x * kBlockQ, ahead);
        }
      }
    }
  }
  // Masks and the online softmax, block by block; o *= alpha before this tile's values (bf16 on
  // vdpbf16ps: the probabilities become pair words in place, rows 2t and 2t + 1 into row t).
  for (std::int64_t n = 0; n < count; ++n) {
    const NarrowBlock& nb = narrow[n];
    const std::int64_t num_k = nb.part.hi - nb.part.lo;
    if (num_k <= 0) continue;
    QueryBlock& qb = *nb.qb;
    const int vecs = static_cast<int>((qb.num_q + kLanes - 1) / kLanes);
    MaskScoreTile(p, qb, nb.part.lo, num_k, nb.st, nb.part.predicate);
    OnlineSoftmaxTile(qb, num_k, nb.st, vecs);
    for (std::int64_t r = 0; r < qb.num_q; ++r) {
      float* row = nb.o + r * p.head_dim_v;
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) row[e] *= qb.alpha[r];
    }
    if (bf16_dot) bf16dot::pack_probs(nb.st, num_k, vecs, reinterpret_cast<std::uint32_t*>(nb.st));
  }
  if (bf16_dot) {
    NarrowValuesBf16(p, narrow, count);
    return;
  }
  for (std::int64_t j = j_lo; j < j_hi; j += value_chunk) {
    for (std::int64_t n = 0; n < count; ++n) {
      const NarrowBlock& nb = narrow[n];
      const std::int64_t a = std::max(j, nb.part.lo), b = std::min(j + value_chunk, nb.part.hi);
      if (b <= a) continue;
      NarrowValueKeys(p, nb.qb->num_q, static_cast<const T*>(nb.qb->v) + a * vs, b - a,
                      nb.st + (a - nb.part.lo) * kBlockQ, nb.o,
                      heads_inner ? nb.qb->key_end - a : 0);
    }
  }
}

// qb.ot (the layout FinishQueryBlock and WritePartial read) from the o rows: lanes [0, kLanes)
// (num_q <= kNarrowRows <= kLanes), zero past num_q; kLanes x kLanes squares transposed in
// registers, the rest of Dv element by element.
inline void FinishNarrow(const AttentionKernelParams& p, const NarrowBlock& nb) {
  const DF df;
  const std::int64_t num_q = nb.qb->num_q, dv = p.head_dim_v;
  float* ot = nb.qb->ot;
  const std::int64_t squares = dv / kLanes * kLanes;
  for (std::int64_t e0 = 0; e0 < squares; e0 += kLanes) {
    VF v[kLanes];
    HWY_UNROLL(16)
    for (std::int64_t r = 0; r < kLanes; ++r) {
      v[r] = r < num_q ? hn::LoadU(df, nb.o + r * dv + e0) : hn::Zero(df);
    }
    TransposeSquare(df, v);
    HWY_UNROLL(16)
    for (std::int64_t c = 0; c < kLanes; ++c) hn::Store(v[c], df, ot + (e0 + c) * kBlockQ);
  }
  for (std::int64_t e = squares; e < dv; ++e) {
    for (std::int64_t r = 0; r < kLanes; ++r) {
      ot[e * kBlockQ + r] = r < num_q ? nb.o[r * dv + e] : 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Key splits: partial results and their merge.

// Per split s and output row (row = (b * Hq + head) * Lq + query): the unnormalised out, and
// the running max and sum of that split's keys (max -inf, sum 0 and out 0 when it had none).
struct SplitPartials {
  float* out;  // [splits][rows][Dv]
  float* max;  // [splits][rows]
  float* sum;  // [splits][rows]
  std::int64_t rows;
};

inline void WritePartial(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t split,
                         const SplitPartials& partials) {
  for (std::int64_t l = 0; l < qb.num_q; ++l) {
    const std::int64_t at =
        split * partials.rows + (qb.b * p.num_heads_q + qb.head[l]) * p.seq_q + qb.query[l];
    partials.max[at] = qb.row_max[l];
    partials.sum[at] = qb.row_sum[l];
    float* out = partials.out + at * p.head_dim_v;
    for (std::int64_t e = 0; e < p.head_dim_v; ++e) out[e] = qb.ot[e * kBlockQ + l];
  }
}

// out and lse of rows [row0, row1) from the splits, combined in split order 0, 1, 2, ...:
//   M = max_s m_s,  w_s = exp(m_s - M),  out = sum_s w_s o_s / sum_s w_s l_s,
//   lse = M + log(sum_s w_s l_s).
// Splits with no allowed key (l_s = 0) take no part; a row with none anywhere gets out 0 and
// lse -inf, as in FinishQueryBlock (no (-inf) - (-inf), no 0 / 0).
void MergeSplits(const AttentionKernelParams& p, const SplitPartials& partials, std::int64_t splits,
                 std::int64_t row0, std::int64_t row1, float* acc) {
  const std::int64_t dv = p.head_dim_v;
  for (std::int64_t row = row0; row < row1; ++row) {
    const std::int64_t b = row / (p.num_heads_q * p.seq_q);
    const std::int64_t head = row / p.seq_q % p.num_heads_q;
    const std::int64_t query = row % p.seq_q;
    float row_max = kNegInf;
    for (std::int64_t s = 0; s < splits; ++s) {
      const std::int64_t at = s * partials.rows + row;
      if (partials.sum[at] > 0.0f) row_max = std::max(row_max, partials.max[at]);
    }
    float row_sum = 0.0f;
    std::fill(acc, acc + dv, 0.0f);
    if (row_max != kNegInf) {
      for (std::int64_t s = 0; s < splits; ++s) {
        const std::int64_t at = s * partials.rows + row;
        if (!(partials.sum[at] > 0.0f)) continue;
        const float weight = std::exp(partials.max[at] - row_max);
        row_sum += weight * partials.sum[at];
        const float* out = partials.out + at * dv;
        for (std::int64_t e = 0; e < dv; ++e) acc[e] += weight * out[e];
      }
    }
    const bool has_keys = row_sum > 0.0f;
    const float inv_sum = has_keys ? 1.0f / row_sum : 0.0f;
    float* out = p.out + b * p.out_stride[0] + query * p.out_stride[1] + head * p.out_stride[2];
    for (std::int64_t e = 0; e < dv; ++e) out[e * p.out_stride[3]] = acc[e] * inv_sum;
    if (p.lse != nullptr) {
      p.lse[b * p.lse_stride[0] + head * p.lse_stride[1] + query * p.lse_stride[2]] =
          has_keys ? row_max + std::log(row_sum) : kNegInf;
    }
  }
}

}  // namespace

// Dropout (kernels/dropout_mask.h) on a tile after OnlineSoftmaxTile: st holds exp(s - max)
// with the row sums already taken; the values see each kept entry times 1 / (1 - p) and the
// dropped ones as 0. Lanes past num_q hold zeros and stay zero.
void DropoutTile(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                 std::int64_t num_k, float* HWY_RESTRICT st) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  HWY_ALIGN std::uint32_t lo[kBlockQ], hi[kBlockQ];
  for (std::int64_t l = 0; l < kBlockQ; ++l) {
    const std::uint64_t row =
        l < qb.num_q ? dropout_row(p.dropout_seed, p.dropout_offset, qb.b, qb.head[l], qb.query[l],
                                   p.num_heads_q, p.seq_q)
                     : 0;
    lo[l] = static_cast<std::uint32_t>(row);
    hi[l] = static_cast<std::uint32_t>(row >> 32);
  }
  for (std::int64_t j = 0; j < num_k; ++j) {
    const auto key = hn::Set(du, static_cast<std::uint32_t>(j0 + j));
    for (std::int64_t x = 0; x < kBlockQ; x += kLanes) {
      const auto bits = dropout::Bits(du, hn::Load(du, lo + x), hn::Load(du, hi + x), key);
      float* e = st + j * kBlockQ + x;
      hn::Store(dropout::Apply(df, du, hn::Load(df, e), bits, p.dropout_threshold, p.dropout_scale),
                df, e);
    }
  }
}

// ---------------------------------------------------------------------------------------------

void FlashForward(const AttentionKernelParams& p) {
  // q: [B, Lq, Hq, D]   k: [B, Lk, Hkv, D]   v: [B, Lk, Hkv, Dv]   out: [B, Lq, Hq, Dv]
  // lse: [B, Hq, Lq] (nullable)
  const WorkPlan plan = PlanWork(p);
  const std::vector<std::int64_t> order = GroupOrder(p, plan);
  const std::int64_t num_tasks = plan.groups * plan.splits;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  // Narrow blocks: rows the last block of a kv head holds (all others hold kBlockQ).
  const std::int64_t last_rows = (p.num_heads_q / p.num_heads_kv * p.seq_q - 1) % kBlockQ + 1;
  // (Dropout takes the wide path only: DropoutTile works on kBlockQ lanes.)
  const bool dropout = p.dropout_p > 0.0f;
  const bool narrow_ok =
      p.k_stride[3] == 1 && p.v_stride[3] == 1 && last_rows <= kNarrowRows && !dropout;

  // Per-thread scratch, sized once: per_task QueryBlock states (each followed by its narrow
  // scratch when blocks can be narrow), then one score tile st [kBlockK][kBlockQ], then the
  // staging tiles of bf16/f16 K and V rows.
  const std::int64_t block_floats = ScratchFloats(p) + (narrow_ok ? NarrowFloats(p) : 0);
  const std::int64_t floats = plan.per_task * block_floats + kBlockK * kBlockQ + StagingFloats(p);
  const std::int64_t ints = plan.per_task * kScratchInts;
  AlignedBuffer float_scratch(sizeof(float) * floats * num_threads);
  AlignedBuffer int_scratch(sizeof(std::int64_t) * ints * num_threads);
  // The splits' partial results: [splits][rows] x (Dv + 2) floats (only when splitting).
  const std::int64_t rows = p.batch * p.num_heads_q * p.seq_q;
  const std::int64_t partial_floats = plan.splits > 1 ? plan.splits * rows * (p.head_dim_v + 2) : 0;
  AlignedBuffer partial_scratch(sizeof(float) * partial_floats);
  SplitPartials partials{partial_scratch.as<float>(), nullptr, nullptr, rows};
  if (plan.splits > 1) {
    partials.max = partials.out + plan.splits * rows * p.head_dim_v;
    partials.sum = partials.max + plan.splits * rows;
  }

  const bool sparse = p.sparse.kind != SparseKernelParams::Kind::kNone;
  const bool bf16_dot = UseBf16Dot(p);

  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    float* mine = float_scratch.as<float>() + thread * floats;
    float* st = mine + plan.per_task * block_floats;
    Staging staging = BindStaging(p, st + kBlockK * kBlockQ);
    QueryBlock blocks[kMaxBlocksPerTask];
    NarrowBlock narrow[kMaxBlocksPerTask];
    QueryBlock* wide[kMaxBlocksPerTask];
    std::int64_t num_narrow = 0, num_wide = 0;

    // This task: blocks [first, first + count) and keys [split_lo, split_hi).
    const std::int64_t split = task % plan.splits;
    const std::int64_t first = order[task / plan.splits] * plan.per_task;
    const std::int64_t count = std::min(plan.per_task, plan.items - first);
    const std::int64_t split_lo = split * plan.split_keys;
    const std::int64_t split_hi = std::min(p.seq_kv, split_lo + plan.split_keys);

    std::int64_t key_begin = p.seq_kv, key_end = 0;
    for (std::int64_t n = 0; n < count; ++n) {
      QueryBlock& qb = blocks[n];
      const std::int64_t item = first + n;
      const std::int64_t b = item / (p.num_heads_kv * plan.blocks_per_kv_head);
      const std::int64_t kv_head = item / plan.blocks_per_kv_head % p.num_heads_kv;
      BindScratch(p, mine + n * block_floats,
                  int_scratch.as<std::int64_t>() + thread * ints + n * kScratchInts, qb);
      StartQueryBlock(p, b, kv_head, item % plan.blocks_per_kv_head, qb);
      // This split's part of the block's keys (all of them without a split).
      qb.key_begin = std::max(qb.key_begin, split_lo);
      qb.key_end = std::min(qb.key_end, split_hi);
      if (narrow_ok && qb.num_q <= kNarrowRows) {
        narrow[num_narrow++] =
            StartNarrow(p, qb, mine + n * block_floats + ScratchFloats(p), bf16_dot);
      } else {
        wide[num_wide++] = &qb;
        StartTileProducts(p, qb, /*pairs=*/bf16_dot);  // (vdpbf16ps: q as pairs, unscaled)
      }
      if (qb.key_end > qb.key_begin) {
        key_begin = std::min(key_begin, qb.key_begin);
        key_end = std::max(key_end, qb.key_end);
      }
    }
    // With a sparsity, the walk starts at the first tile some block's sparsity reaches, on the
    // same tile grid as without it (so a layout that allows everything changes no bit).
    std::int64_t first_tile = key_begin;
    if (sparse && key_end > key_begin) {
      std::int64_t sparse_begin = key_end, sparse_end = key_begin;
      for (std::int64_t n = 0; n < count; ++n) {
        const QueryBlock& qb = blocks[n];
        const std::int64_t lo = std::max(qb.key_begin, qb.sparse_begin);
        const std::int64_t hi = std::min(qb.key_end, qb.sparse_end);
        if (hi <= lo) continue;
        sparse_begin = std::min(sparse_begin, lo);
        sparse_end = std::max(sparse_end, hi);
      }
      first_tile = key_begin + (std::max(sparse_begin, key_begin) - key_begin) / kBlockK * kBlockK;
      key_end = std::min(key_end, sparse_end);
    }
    // A block's part of tile j0; tiles outside its allowed keys, and (sparse) key tiles the
    // sparsity leaves out, are skipped; the rest is trimmed to what the sparsity allows.
    const auto tile_part = [&](const QueryBlock& qb, std::int64_t j0) {
      TilePart part{std::max(j0, qb.key_begin), std::min(j0 + kBlockK, qb.key_end), false};
      if (part.hi <= part.lo) return TilePart{};
      if (sparse) {
        const SparseTile t = SparseTileKeys(p, qb, part.lo, part.hi);
        if (t.hi <= t.lo) return TilePart{};
        part = {t.lo, t.hi, t.predicate};
      }
      return part;
    };
    for (std::int64_t j0 = first_tile; j0 < key_end; j0 += kBlockK) {
      for (std::int64_t n = 0; n < num_wide; ++n) {
        QueryBlock& qb = *wide[n];
        const TilePart t = tile_part(qb, j0);
        if (t.hi <= t.lo) continue;
        // The keys each query vector needs (the causal diagonal skips some; see VecKeys).
        const std::int64_t num_k = t.hi - t.lo;
        const VecKeys keys = TileVecKeys(qb.hi, t.lo, num_k);
        const std::int64_t* vec_end = keys.ends();
        if (bf16_dot) {
          ScoreTileBf16(p, qb, t.lo, num_k, st, t.predicate, staging, vec_end);
          OnlineSoftmaxTile(qb, num_k, st, kQueryVecs, vec_end);
          if (dropout) DropoutTile(p, qb, t.lo, num_k, st);
          AccumulateValuesBf16(p, qb, t.lo, num_k, st, qb.alpha, staging, vec_end);
        } else {
          ScoreTile(p, qb, t.lo, num_k, st, t.predicate, staging, vec_end);
          OnlineSoftmaxTile(qb, num_k, st, kQueryVecs, vec_end);
          if (dropout) DropoutTile(p, qb, t.lo, num_k, st);
          AccumulateValues(p, qb, t.lo, num_k, st, qb.alpha, staging, vec_end);
        }
      }
      if (num_narrow == 0) continue;
      for (std::int64_t n = 0; n < num_narrow; ++n) narrow[n].part = tile_part(*narrow[n].qb, j0);
      if (p.dtype == DType::kBF16) {
        NarrowTile<hwy::bfloat16_t>(p, narrow, num_narrow, bf16_dot);
      } else if (p.dtype == DType::kF16) {
        NarrowTile<hwy::float16_t>(p, narrow, num_narrow, false);
      } else {
        NarrowTile<float>(p, narrow, num_narrow, false);
      }
    }
    for (std::int64_t n = 0; n < num_narrow; ++n) FinishNarrow(p, narrow[n]);
    for (std::int64_t n = 0; n < count; ++n) {
      if (plan.splits == 1) {
        FinishQueryBlock(p, blocks[n]);
      } else {
        WritePartial(p, blocks[n], split, partials);
      }
    }
  });

  if (plan.splits > 1) {
    const std::int64_t merge_tasks = (rows + kMergeRows - 1) / kMergeRows;
    const int merge_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, merge_tasks));
    AlignedBuffer merge_scratch(sizeof(float) * p.head_dim_v * merge_threads);
    parallel_for(merge_tasks, merge_threads, [&](std::int64_t task, int thread) {
      MergeSplits(p, partials, plan.splits, task * kMergeRows,
                  std::min(rows, (task + 1) * kMergeRows),
                  merge_scratch.as<float>() + thread * p.head_dim_v);
    });
  }
}

// Name of the Highway target this dispatch lands on (tests force each target and check).
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(FlashForward);
HWY_EXPORT(TargetName);

const char* attention_cpu_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void attention_flash_cpu(const AttentionKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(FlashForward)(params);
}

}  // namespace qkv
#endif  // HWY_ONCE
