// The decode path of the flash kernel (Highway, one copy per target). A block with at most
// kNarrowRows rows (the GQA group of one decode step: Lq = 1, 4 heads per kv head) would use 4 of
// 64 lanes of the transposed micro-kernel (AVX-512; 4 of 16 on AVX2) and do 16x the work it
// needs; it computes its products row by row instead, vectorised along head_dim:
//   s[j][r] = qr[r] . k[j]               (K dot products at once, then a lane sum)
//   o[r][:] = alpha[r] * o[r][:] + sum_j p[j][r] * v[j][:]
// with qr: [rows][D] (q * scale) and o: [rows][Dv] in its own scratch. The scores land in the
// block's own score tile, in the order its product path keeps (Products::kNarrowOrder): the
// widening walk's keys along the lanes (narrow_products-inl.h; its masks and softmax in
// narrow_softmax-inl.h), bf16dot's pairs a vector of rows per key (the wide blocks' masks and
// online softmax: MaskScoreTile, OnlineSoftmaxTile); at the end o is transposed into qb.ot for
// the shared finish. It needs unit strides along head_dim (true for BSHD and BHSD).
//
// The walk (StartNarrow, NarrowTile, FinishNarrow) is one skeleton for every product path
// (products-inl.h): the path packs q (NarrowQuery), computes the scores and values of a tile for
// all narrow blocks of a task (NarrowScores, NarrowValues: the f32 walks or the bf16 runs below)
// and, for bf16 pairs, turns the probabilities into pair words (NarrowProbs).

#if defined(QKV_KERNELS_CPU_DECODE_WALK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_DECODE_WALK_INL_H_
#undef QKV_KERNELS_CPU_DECODE_WALK_INL_H_
#else
#define QKV_KERNELS_CPU_DECODE_WALK_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/narrow_products-inl.h"
#include "kernels/cpu/narrow_softmax-inl.h"
#include "kernels/cpu/online_softmax-inl.h"
#include "kernels/cpu/score_masks-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_staging-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// A block's part of the current key tile: keys [lo, hi) (empty: skip it), whether the
// sparsity must be applied pair by pair, and the tile's first key (the widening walk's score
// rows start there: NarrowOrder).
struct TilePart {
  std::int64_t lo = 0, hi = 0;
  bool predicate = false;
  std::int64_t first = 0;
};

// How a narrow block's score tile nb.st holds its scores (Products::kNarrowOrder):
//   kKeysInLanes  st[r * kNarrowKeys + j - part.first]: row r's score of key j, each row's
//                 keys side by side from the tile's first (the widening walk)
//   kRowsInLanes  st[(j - part.lo) * kBlockQ + r]: each key's rows side by side (bf16dot's
//                 narrow calls and pack_probs take these rows)
enum class NarrowOrder { kKeysInLanes, kRowsInLanes };

// A narrow block and its own scratch (see NarrowFloats).
struct NarrowBlock {
  QueryBlock* qb = nullptr;
  float* q_rows = nullptr;  // [num_q][D]   q * scale (bf16 on vdpbf16ps: q_pairs instead)
  std::uint32_t* q_pairs = nullptr;  // [num_q][ceil(D / 2)] pair words of q, unscaled (same
                                     // memory as q_rows)
  float* o = nullptr;       // [num_q][Dv]  unnormalised out
  float* st = nullptr;      // its own score tile (NarrowOrder): NarrowTile computes the
                            // scores of every narrow block before any softmax
  TilePart part;
};

// q and o rows, rounded up to whole kBlockQ so that st (and the next block's scratch) stays
// aligned for full-vector loads.
inline std::int64_t NarrowRowFloats(const AttentionKernelParams& p) {
  return (kNarrowRows * (p.head_dim + p.head_dim_v) + kBlockQ - 1) / kBlockQ * kBlockQ;
}
template <class Products>
std::int64_t NarrowFloats(const AttentionKernelParams& p) {
  constexpr bool kKeysInLanes = Products::kNarrowOrder == NarrowOrder::kKeysInLanes;
  return NarrowRowFloats(p) + (kKeysInLanes ? kNarrowRows * kNarrowKeys : kBlockK * kBlockQ);
}

// q_rows[r][d] = q[r][d] * scale for the block's rows r < num_q (the products PackQuery forms,
// read straight from q: a narrow block never packs q^T), in even/odd order for bf16 (kEvenOdd:
// as NarrowDots pairs them with K).
template <typename T>
void NarrowQueryRows(const AttentionKernelParams& p, const QueryBlock& qb, float* q_rows) {
  const DF df;
  const VF scale = hn::Set(df, p.scale);
  const bool unit = p.q_stride[3] == 1;
  const std::int64_t d_vecs = unit ? p.head_dim / kLanes * kLanes : 0;
  const std::int64_t even_odd_end = kEvenOdd<T> ? EvenOddEnd(p.head_dim) : 0;
  for (std::int64_t r = 0; r < qb.num_q; ++r) {
    const T* row = static_cast<const T*>(p.q) + LaneRow(p.q_stride, qb, r);
    float* dst = q_rows + r * p.head_dim;
    std::int64_t d = 0;
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kEvenOdd<T>) {
      for (; unit && d < even_odd_end; d += kEvenOddSpan) {
        VF even, odd;
        LoadEvenOdd(df, row + d, even, odd);
        hn::StoreU(hn::Mul(even, scale), df, dst + d);
        hn::StoreU(hn::Mul(odd, scale), df, dst + d + kLanes);
      }
    }
#endif
    for (; d < d_vecs; d += kLanes) hn::StoreU(hn::Mul(LoadWide(df, row + d), scale), df, dst + d);
    for (; d < p.head_dim; ++d) {  // position d holds element EvenOddElement(d)
      dst[d] = WideElement(row[EvenOddElement(d, even_odd_end) * p.q_stride[3]]) * p.scale;
    }
  }
}

// nb.q_pairs: q's rows as pair words (the bf16 runs below).
inline void NarrowQueryPairs(const AttentionKernelParams& p, NarrowBlock& nb) {
  nb.q_pairs = reinterpret_cast<std::uint32_t*>(nb.q_rows);
  const std::int64_t words = (p.head_dim + 1) / 2;
  for (std::int64_t r = 0; r < nb.qb->num_q; ++r) {
    QueryPairs(p, *nb.qb, r, nb.q_pairs + r * words, 1);
  }
}

template <class Products>
NarrowBlock StartNarrow(const AttentionKernelParams& p, QueryBlock& qb, float* scratch) {
  NarrowBlock nb;
  nb.qb = &qb;
  nb.q_rows = scratch;
  nb.o = nb.q_rows + kNarrowRows * p.head_dim;
  nb.st = scratch + NarrowRowFloats(p);
  Products::NarrowQuery(p, nb);
  std::fill(nb.o, nb.o + qb.num_q * p.head_dim_v, 0.0f);
  if constexpr (Products::kNarrowOrder == NarrowOrder::kKeysInLanes) {
    // The softcap runs on whole vectors of a row, past num_k too: keep them defined.
    std::fill(nb.st, nb.st + qb.num_q * kNarrowKeys, 0.0f);
  } else {
    // The softmax runs on the query vectors holding the rows; their lanes past num_q are never
    // written by the scores: keep them finite.
    const std::int64_t lanes = (qb.num_q + kLanes - 1) / kLanes * kLanes;
    for (std::int64_t j = 0; j < kBlockK; ++j) {
      std::fill(nb.st + j * kBlockQ + qb.num_q, nb.st + j * kBlockQ + lanes, 0.0f);
    }
  }
  return nb;
}

// The V rows the bf16 score walk prefetches toward L2 for the value step that follows, as it
// reads K: key j's rows of all heads of a run as one byte range, when they lie within one key's
// row (the heads of one key are neighbours, BSHD; or a single head, in any layout); null
// otherwise. BSHD, Lk = 32768, 2 threads: bf16 5-15% faster; the same in the f32 walk was 6%
// slower, and prefetching K (any distance, any hint) 15% slower.
struct ValueRows {
  const char* first = nullptr;  // key 0 of the part, head 0
  std::int64_t row_stride = 0, bytes = 0;
};

inline ValueRows ValueRowsOf(const AttentionKernelParams& p, const NarrowBlock& nb,
                             std::int64_t heads, std::int64_t head_stride) {
  constexpr std::int64_t kBytes = 2;  // bf16
  const std::int64_t span = (heads - 1) * head_stride + p.head_dim_v;
  if (heads > 1 && (head_stride < 0 || span > p.v_stride[1])) return {};
  const char* first = static_cast<const char*>(nb.qb->v) + nb.part.lo * p.v_stride[1] * kBytes;
  return {first, p.v_stride[1] * kBytes, span * kBytes};
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

// The K rows of a run's next tile (keys [part.hi, part.hi + kBlockK), up to the first block's
// key_end), for the value step to prefetch (bf16dot::NarrowValues::prefetch): one byte range
// when it holds at most twice the rows' own bytes (the heads of one key neighbours, BSHD, or a
// single head), null otherwise.
struct ByteRange {
  const char* first = nullptr;
  std::int64_t bytes = 0;
};

inline ByteRange NextKeysOf(const AttentionKernelParams& p, const NarrowBlock& nb,
                            const NarrowRun& run) {
  constexpr std::int64_t kBytes = 2;  // bf16
  const std::int64_t keys = std::min(kBlockK, nb.qb->key_end - nb.part.hi);
  const std::int64_t span = (keys - 1) * p.k_stride[1] + (run.count - 1) * run.k + p.head_dim;
  if (keys <= 0 || run.k < 0 || span > 2 * keys * run.count * p.head_dim) return {};
  const auto* k = static_cast<const std::uint16_t*>(nb.qb->k) + nb.part.hi * p.k_stride[1];
  return {reinterpret_cast<const char*>(k), span * kBytes};
}

// All keys of each block's part at once, while the next tile's K is prefetched (the score walk
// prefetched this tile's V: ValueRowsOf).
inline void NarrowValuesBf16(const AttentionKernelParams& p, const NarrowBlock* narrow,
                             std::int64_t count) {
  ForEachRun(narrow, count, [&](const NarrowBlock& nb, const NarrowRun& run) {
    const auto* v = static_cast<const std::uint16_t*>(nb.qb->v) + nb.part.lo * p.v_stride[1];
    const ByteRange next = NextKeysOf(p, nb, run);
    bf16dot::narrow_values({reinterpret_cast<const std::uint32_t*>(nb.st), run.scratch, kBlockQ, v,
                            run.v, p.v_stride[1], nb.o, run.scratch, p.head_dim_v, run.count,
                            nb.qb->num_q, nb.part.hi - nb.part.lo, p.head_dim_v, next.first,
                            next.bytes});
  });
}

// Keys [lo, hi): the hull of the narrow blocks' parts of the tile.
inline TilePart NarrowHull(const NarrowBlock* narrow, std::int64_t count, std::int64_t seq_kv) {
  TilePart hull{seq_kv, 0, false};
  for (std::int64_t n = 0; n < count; ++n) {
    if (narrow[n].part.hi <= narrow[n].part.lo) continue;
    hull.lo = std::min(hull.lo, narrow[n].part.lo);
    hull.hi = std::max(hull.hi, narrow[n].part.hi);
  }
  return hull;
}

// Whether the rows of neighbouring kv heads for one key are neighbours in memory (BSHD).
inline bool HeadsInner(const AttentionKernelParams& p) {
  return p.k_stride[2] < p.k_stride[1] && p.v_stride[2] < p.v_stride[1];
}

// f(nb, a, b) for each narrow block's keys [a, b) (non-empty) in each chunk of `chunk` keys of
// the blocks' hull, chunks outermost (keys outermost across the blocks: NarrowTile).
template <class F>
void ForEachChunk(const AttentionKernelParams& p, const NarrowBlock* narrow, std::int64_t count,
                  std::int64_t chunk, F&& f) {
  const TilePart hull = NarrowHull(narrow, count, p.seq_kv);
  for (std::int64_t j = hull.lo; j < hull.hi; j += chunk) {
    for (std::int64_t n = 0; n < count; ++n) {
      const NarrowBlock& nb = narrow[n];
      const std::int64_t a = std::max(j, nb.part.lo), b = std::min(j + chunk, nb.part.hi);
      if (b > a) f(nb, a, b);
    }
  }
}

// The scores of every narrow block's part, on f32 products (K stored as T, widened in registers).
template <typename T>
void NarrowScoresWide(const AttentionKernelParams& p, const NarrowBlock* narrow,
                      std::int64_t count) {
  const std::int64_t ks = p.k_stride[1], d = p.head_dim;
  const bool heads_inner = HeadsInner(p);
  // With heads inner, kDotKeys keys of every block in turn (the keys stay outermost across the
  // blocks); either way the rows some keys later are prefetched as they are read (BHSD too:
  // 1.45-1.6x there, docs/kernels.md, "Software prefetch"; WalkAhead for the distances).
  const std::int64_t score_chunk = heads_inner ? kDotKeys : kBlockK;
  const std::int64_t distance = (heads_inner ? kAheadAcrossHeads : kAheadHeadRuns).scores;
  // bf16 and f16 in runs of one head's rows also ask for the V rows of the keys whose K they
  // ask for, so the value step reads this tile's V from L2 (as the vdpbf16ps walk does,
  // ValueRowsOf). Intel AMX Xeon model 167, 2 threads, Lq = 1, D = 128, BHSD: with a switch per
  // call in one process, bf16 multi-head (Hq = Hkv = 32, Lk = 16384) 1.04-1.07x, GQA 32:8 (Lk =
  // 32768) 1.01-1.06x, MQA 8:1 (Lk = 262144) 1.06x; old and new modules in alternating
  // processes, bf16 1.11x and 1.08x, f16 1.13x and 1.06x (multi-head, GQA). f32 lost on the
  // multi-head step there (0.97-0.99x; GQA and MQA 1.02-1.05x), so f32 does not on AVX-512. On
  // AVX2 it does: AMD EPYC Zen 2, 2 threads, f32 BHSD GQA 32:8 1.096x, multi-head 1.091x, MQA
  // 8:1 (a single kv head is a run in BSHD too) 1.128x (docs/kernels.md, "f32 V asked for on
  // AVX2").
  constexpr bool kValuesToo = !std::is_same_v<T, float> || kLanes == 8;
  const bool values_too = !heads_inner && kValuesToo;
  ForEachChunk(p, narrow, count, score_chunk,
               [&](const NarrowBlock& nb, std::int64_t a, std::int64_t b) {
    const T* k = static_cast<const T*>(nb.qb->k) + a * ks;
    float* st = nb.st + (a - nb.part.first);
    // For the step at key a + x: asks for the V rows `distance` keys on (values_too) and
    // returns the K rows there, which NarrowDots asks for as it reads (null past key_end).
    const auto ask_ahead = [&](std::int64_t x, std::int64_t keys) -> const T* {
      const std::int64_t first = a + x + distance;
      if (first + keys > nb.qb->key_end) return nullptr;
      if (values_too) {
        PrefetchRows(nb.qb->v, p.v_stride, p.head_dim_v, sizeof(T), first, first + keys);
      }
      return k + (x + distance) * ks;
    };
    // A one-row block in a run of one head's rows takes one key per step on AVX2
    // (kOneRowOneKey), so its K is read as one ascending stream.
    const bool one_key = kOneRowOneKey && !heads_inner && nb.qb->num_q == 1;
    std::int64_t x = 0;
    for (; !one_key && x + kDotKeys <= b - a; x += kDotKeys) {
      NarrowDotKeys<kDotKeys>(nb.q_rows, nb.qb->num_q, k + x * ks, ks, d, st + x,
                              ask_ahead(x, kDotKeys));
    }
    for (; x < b - a; ++x) {
      NarrowDotKeys<1>(nb.q_rows, nb.qb->num_q, k + x * ks, ks, d, st + x, ask_ahead(x, 1));
    }
  });
}

// The values of every narrow block's part, on f32 products (V stored as T).
template <typename T>
void NarrowValuesWide(const AttentionKernelParams& p, const NarrowBlock* narrow,
                      std::int64_t count) {
  const std::int64_t vs = p.v_stride[1];
  const bool heads_inner = HeadsInner(p);
  const std::int64_t distance = (heads_inner ? kAheadAcrossHeads : kAheadHeadRuns).values;
  ForEachChunk(p, narrow, count, heads_inner ? kValueKeys : kBlockK,
               [&](const NarrowBlock& nb, std::int64_t a, std::int64_t b) {
    const T* v = static_cast<const T*>(nb.qb->v) + a * vs;
    const float* st = nb.st + (a - nb.part.first);
    NarrowValueKeys(p, nb.qb->num_q, v, b - a, st, nb.o, RowsAhead{nb.qb->key_end - a, distance});
  });
}

// One key tile for every narrow block of a task. In BSHD the rows of neighbouring kv heads for
// one key are neighbours in memory, so the walk goes keys outermost: the scores kDotKeys keys at
// a time for all blocks (K is then read as one ascending stream, which the hardware prefetchers
// follow; a 4-key dot product block by block over a whole tile read 512-byte runs on 4 pages at
// once and was ~15% slower at Lk = 32768; 4 keys per block per step, with the prefetch 8 keys
// ahead, beat one key per step: kAheadAcrossHeads), the values kValueKeys keys at a time (o
// does not fit in registers: it is loaded and stored once per chunk). In BHSD each head's rows
// are already one ascending run, read a whole tile at a time per block (key-outermost was slower
// there). Each block's arithmetic is the same either way; only the order of blocks interleaves.
// The walk also prefetches toward L2 (prefetcht1) the K rows ahead of the scores and the V rows
// ahead of the values (WalkAhead: 8 and 16 keys with heads inner, 32 and 64 in runs of one
// head's rows): the hardware prefetchers alone left the core with too few misses in flight (the
// multiply-adds waiting on one K line fill the scheduler). Measured at Lk = 32768, Hq:Hkv = 32:8, 2
// threads, 8 interleaved rounds: f32 1.13-1.16x, f16 1.51x (BSHD; BHSD, which had none until
// 2026-12-03: f32 1.55-1.6x); toward L1 (prefetcht0) K was slower and V gained less; distances 1-4
// (K) and 4-32 (V) within noise of these; 4 heads of one key per step (16 independent sums)
// was 1.4x slower. bf16 on vdpbf16ps goes through bf16dot's narrow products, a run of blocks per
// call: the scores keys outermost across the run, the values a whole part per block, from L2, where
// the score walk prefetched them (NarrowScoresBf16, NarrowValuesBf16 above).
template <class Products>
void NarrowTile(const AttentionKernelParams& p, NarrowBlock* narrow, std::int64_t count) {
  Products::NarrowScores(p, narrow, count);
  // Masks and the online softmax, block by block; o *= alpha before this tile's values (bf16
  // pairs: the probabilities become pair words in place, rows 2t and 2t + 1 into row t).
  for (std::int64_t n = 0; n < count; ++n) {
    const NarrowBlock& nb = narrow[n];
    const std::int64_t num_k = nb.part.hi - nb.part.lo;
    if (num_k <= 0) continue;
    QueryBlock& qb = *nb.qb;
    const int vecs = UsedQueryVecs(qb);
    if constexpr (Products::kNarrowOrder == NarrowOrder::kKeysInLanes) {
      const std::int64_t begin = nb.part.lo - nb.part.first;
      MaskNarrowRows(p, qb, nb.part.first, begin, begin + num_k, nb.st, nb.part.predicate);
      OnlineSoftmaxRows(qb, begin, begin + num_k, nb.st);
    } else {
      MaskScoreTile(p, qb, nb.part.lo, num_k, nb.st, nb.part.predicate);
      OnlineSoftmaxTile<false>(qb, num_k, nb.st, vecs);
    }
    for (std::int64_t r = 0; r < qb.num_q; ++r) {
      float* row = nb.o + r * p.head_dim_v;
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) row[e] *= qb.alpha[r];
    }
    Products::NarrowProbs(nb.st, num_k, vecs);
  }
  Products::NarrowValues(p, narrow, count);
}

// qb.ot (the layout FinishQueryBlock and WritePartial read) from the o rows: lanes [0, kLanes)
// (num_q <= kNarrowRows <= kLanes), zero past num_q; kLanes x kLanes squares transposed in
// registers, the rest of Dv element by element; o's even/odd order (Products::kNarrowEvenOdd)
// undone on the way.
template <class Products>
void FinishNarrow(const AttentionKernelParams& p, const NarrowBlock& nb) {
  const DF df;
  const std::int64_t num_q = nb.qb->num_q, dv = p.head_dim_v;
  const std::int64_t even_odd_end = Products::kNarrowEvenOdd ? EvenOddEnd(dv) : 0;
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
    for (std::int64_t c = 0; c < kLanes; ++c) {
      hn::Store(v[c], df, ot + EvenOddElement(e0 + c, even_odd_end) * kBlockQ);
    }
  }
  for (std::int64_t e = squares; e < dv; ++e) {
    for (std::int64_t r = 0; r < kLanes; ++r) {
      ot[e * kBlockQ + r] = r < num_q ? nb.o[r * dv + e] : 0.0f;
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_DECODE_WALK_INL_H_
