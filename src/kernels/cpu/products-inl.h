// The product paths of the flash and chunked kernels (Highway, one copy per target). A path says
// how a block's q is packed and how the two tile products run, for wide blocks and for the
// decode path's narrow ones; the skeletons (flash_forward.cc, chunked_forward.cc,
// decode_walk-inl.h) take it as a template parameter, chosen once at the kernel's entry
// (WithProducts, the one list of instantiations). Every member is static:
//
//   kPath                    its name (kernels/product_path.h)
//   StartBlock(p, qb)        q packed into qb.qt, qb.ot zeroed
//   Scores(p, qb, j0, num_k, st, staging, vec_end)
//                            st[j][:] = q . k[j0 + j] * scale, raw (the masks come after)
//   Values(p, qb, j0, num_k, st, alpha, staging, vec_end)
//                            ot = alpha * ot + v[j0 : j0 + num_k]^T st (alpha null: no rescale)
//   NarrowQuery(p, nb)       a narrow block's q rows
//   NarrowScores(p, narrow, count), NarrowValues(p, narrow, count)
//                            one tile's products for a task's narrow blocks (their nb.part)
//   NarrowProbs(st, num_k, vecs)  the probabilities as NarrowValues reads them
//   kNarrowOrder             how a narrow block's score tile nb.st holds its scores (NarrowOrder)
//   kNarrowEvenOdd           whether a narrow block's q and o rows are in even/odd order
//                            (kEvenOdd in narrow_products-inl.h; FinishNarrow undoes it)
//   TaskScope                a type a task holds while it runs (the AMX tile state; else empty)
//   kPrefetchOut             whether a flash task asks for its blocks' out rows on its last tile
//                            (PrefetchOutRows; docs/kernels.md, "Finishing a block")
//   Softmax(p, qb, num_k, st, staging, vec_end)
//                            the online softmax step on st (online_softmax-inl.h), leaving the
//                            probabilities where Values reads them
//
// vec_end (TileVecKeys(...).ends(), nullable): query vector x needs keys [0, vec_end[x]) only;
// its lanes of the later keys may be left as they were until the masks set them to -inf.

#if defined(QKV_KERNELS_CPU_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_PRODUCTS_INL_H_
#undef QKV_KERNELS_CPU_PRODUCTS_INL_H_
#else
#define QKV_KERNELS_CPU_PRODUCTS_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/decode_walk-inl.h"
#include "kernels/cpu/online_softmax-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_products-inl.h"
#include "kernels/cpu/tile_staging-inl.h"
#include "kernels/kernel_params.h"
#include "kernels/product_path.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// f32 FMA products on operands stored as T (float, hwy::bfloat16_t, hwy::float16_t): q is packed
// as q^T * scale in f32, K and V tiles of bf16/f16 are widened (exactly) into the staging tiles,
// and both products are the micro-kernel of tile_products-inl.h.
template <typename T>
struct WideProducts {
  static constexpr ProductPath kPath = std::is_same_v<T, float>             ? ProductPath::kF32
                                       : std::is_same_v<T, hwy::bfloat16_t> ? ProductPath::kBf16Widened
                                                                            : ProductPath::kF16Widened;
  // Measured on f32 (Intel AMX Xeon: 1.12-1.30x on batches of L = 128-512, no loss on long or
  // causal GQA shapes); the widened bf16/f16 tiles run the same products.
  static constexpr bool kPrefetchOut = true;
  struct TaskScope {};
  // The products and the softmax run on the query vectors that hold rows (UsedQueryVecs): a
  // block of 27 queries (a batch of short texts) takes 2 of the 4.
  static void Softmax(const AttentionKernelParams&, QueryBlock& qb, std::int64_t num_k,
                      float* HWY_RESTRICT st, Staging&, const std::int64_t* vec_end) {
    OnlineSoftmaxTile<rounds_probabilities(kPath)>(qb, num_k, st, UsedQueryVecs(qb), vec_end);
  }

  static void StartBlock(const AttentionKernelParams& p, QueryBlock& qb) {
    PackQuery<T>(p, qb);
    std::fill(qb.ot, qb.ot + p.head_dim_v * kBlockQ, 0.0f);
  }
  static void Scores(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, float* HWY_RESTRICT st, Staging& staging,
                     const std::int64_t* vec_end) {
    const TileRows k =
        StageRows<T>(qb.k, p.k_stride, p.head_dim, j0, num_k, staging.k, staging.k_in_place);
    // K read where it lies, first in the task: its rows come from memory, 6 at a time, a line
    // waited for at a time; so each block of rows asks for the next block's toward L1
    // (docs/kernels.md, "Cold K rows").
    const bool cold = staging.cold_k && k.data != staging.k.buffer && k.elem_stride == 1;
    OuterProduct<true>(qb.qt, k.data, num_k, k.row_stride, k.elem_stride, p.head_dim, st, nullptr,
                       false, vec_end, nullptr, UsedQueryVecs(qb), cold);
  }
  static void Values(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, const float* st, const float* alpha, Staging& staging,
                     const std::int64_t* vec_end) {
    const TileRows v =
        StageColumns<T>(qb.v, p.v_stride, p.head_dim_v, j0, num_k, staging.v, staging.read_ahead);
    OuterProduct<true>(st, v.data, p.head_dim_v, v.elem_stride, v.row_stride, num_k, qb.ot, alpha,
                       true, nullptr, vec_end, UsedQueryVecs(qb));
  }

  static void NarrowQuery(const AttentionKernelParams& p, NarrowBlock& nb) {
    NarrowQueryRows<T>(p, *nb.qb, nb.q_rows);
  }
  static void NarrowScores(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    NarrowScoresWide<T>(p, narrow, count);
  }
  static void NarrowProbs(float*, std::int64_t, int) {}
  static void NarrowValues(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    NarrowValuesWide<T>(p, narrow, count);
  }
  static constexpr NarrowOrder kNarrowOrder = NarrowOrder::kKeysInLanes;
  static constexpr bool kNarrowEvenOdd = kEvenOdd<T>;
};

// bf16 on vdpbf16ps (kernels/cpu/bf16_dot.h): on the AVX3 target of a CPU with AVX512-BF16,
// both tile products of bf16 operands run on pairs of bf16 accumulated in f32. The scores use q
// unscaled (its bf16 values are exact) and multiply the f32 dot products by scale; the values
// use the probabilities rounded to bf16 (as FlashAttention does on GPUs; the row sums stay f32).
// Operands become pair words (tile_staging-inl.h). bf16dot's blocks are 4 vectors of 16 lanes:
// the path exists where kBlockQ is that (kPairLanes).
struct PairProducts {
  static constexpr ProductPath kPath = ProductPath::kBf16Pairs;
  static constexpr bool kPairLanes = kBlockQ == bf16dot::kLanes;
  static constexpr bool kPrefetchOut = false;  // (not measured on an AMD CPU)
  struct TaskScope {};
  static void Softmax(const AttentionKernelParams&, QueryBlock& qb, std::int64_t num_k,
                      float* HWY_RESTRICT st, Staging&, const std::int64_t* vec_end) {
    OnlineSoftmaxTile<rounds_probabilities(kPath)>(qb, num_k, st, kQueryVecs, vec_end);
  }

  static void StartBlock(const AttentionKernelParams& p, QueryBlock& qb) {
    PackQueryPairs(p, qb);
    std::fill(qb.ot, qb.ot + p.head_dim_v * kBlockQ, 0.0f);
  }
  static void Scores(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, float* HWY_RESTRICT st, Staging& staging,
                     const std::int64_t* vec_end) {
    const std::int64_t words = (p.head_dim + 1) / 2;
    bf16dot::outer_product(reinterpret_cast<const std::uint32_t*>(qb.qt),
                           StageKeyPairs(p, qb, j0, num_k, staging.k), num_k, words, 1, words, st,
                           nullptr, false, p.scale, vec_end);
  }
  static void Values(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, const float* st, const float* alpha, Staging& staging,
                     const std::int64_t* vec_end) {
    const std::uint32_t* v = StageValuePairs(p, qb, j0, num_k, staging.v);
    bf16dot::pack_probs(st, num_k, kQueryVecs, staging.prob_pairs);
    // The keys each vector needs, in pairs (vec_end is even but for the last, num_k).
    std::int64_t pair_end[kQueryVecs];
    for (int x = 0; vec_end != nullptr && x < kQueryVecs; ++x) pair_end[x] = (vec_end[x] + 1) / 2;
    bf16dot::outer_product(staging.prob_pairs, v, p.head_dim_v, 1, p.head_dim_v, (num_k + 1) / 2,
                           qb.ot, alpha, true, 1.0f, nullptr,
                           vec_end != nullptr ? pair_end : nullptr);
  }

  static void NarrowQuery(const AttentionKernelParams& p, NarrowBlock& nb) {
    NarrowQueryPairs(p, nb);
  }
  static void NarrowScores(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    NarrowScoresBf16(p, narrow, count);
  }
  static void NarrowProbs(float* st, std::int64_t num_k, int vecs) {
    bf16dot::pack_probs(st, num_k, vecs, reinterpret_cast<std::uint32_t*>(st));
  }
  static void NarrowValues(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    NarrowValuesBf16(p, narrow, count);
  }
  // bf16dot's narrow calls and pack_probs take score rows of kBlockQ.
  static constexpr NarrowOrder kNarrowOrder = NarrowOrder::kRowsInLanes;
  static constexpr bool kNarrowEvenOdd = false;
};

// bf16 and f16 on AMX tiles (kernels/cpu/amx.h): on the AVX3 targets of a CPU with AMX-BF16,
// both tile products of the wide blocks run as tdpbf16ps, f32 accumulation. As on the vdpbf16ps
// path, q is unscaled (its bf16 values are exact) and the scores are multiplied by scale in f32
// (inside the softmax's exp, SoftmaxScale, where no softcap or bias needs them scaled before),
// and the values use the probabilities rounded to bf16 (the row sums stay f32). K rows are
// staged as padded bf16 rows, V as bf16 columns, once per tile for the blocks of a task; the
// tile configuration is loaded once per task (TaskScope). f16 (T = hwy::float16_t; the tiles
// multiply bf16 only, and the CPUs with AMX-FP16 are not the ones this was written on) takes
// each value as bf16 hi + lo (exact; tile_staging-inl.h): the scores are one product over three
// segments of the depth (qh . kh + qh . kl + ql . kh), the values two (P . Vh + P . Vl), so f16
// loses nothing but the probabilities' rounding to bf16, for 3x and 2x the tile work. The decode
// path's narrow blocks keep the widened products: a few query rows fill no tile, and decoding is
// bound by the reads.
template <typename T>
struct AmxProducts {
  static constexpr bool kSplit = std::is_same_v<T, hwy::float16_t>;
  static constexpr ProductPath kPath = kSplit ? ProductPath::kF16Amx : ProductPath::kBf16Amx;
  static constexpr bool kAmxLanes = kBlockQ == amx::kLanes;
  // 1.03-1.08x at L = 128 but 0.93-0.94x on a causal GQA batch (4,32,8,512,512,128): off.
  static constexpr bool kPrefetchOut = false;
  using Narrow = WideProducts<T>;
  using TaskScope = amx::TileScope;

  // The scores leave the tiles unscaled and the online softmax multiplies them by the scale
  // inside its exp's FMA, saving a pass over the tile, unless softcap or a bias needs them
  // scaled first (MaskScoreTile).
  static bool DeferScale(const AttentionKernelParams& p) {
    return p.softcap <= 0.0f && p.bias == nullptr;
  }
  static float SoftmaxScale(const AttentionKernelParams& p) {
    return DeferScale(p) ? p.scale : 1.0f;
  }
  // The softmax writes the probabilities' pair words itself (amx::softmax_pack_lazy) unless
  // dropout has to change them in st first.
  static bool FusedPack(const AttentionKernelParams& p) { return p.dropout_p <= 0.0f; }
  // The tiles compute the lanes of the block products that hold rows: a block of at most 32
  // rows (short sequences; the last block of an Lq just past a multiple of 64) computes one of
  // the two 32-lane halves, and the softmax runs on its two query vectors.
  static int Vecs(const QueryBlock& qb) { return (UsedQueryVecs(qb) + 1) / 2 * 2; }
  static std::int64_t Lanes(const QueryBlock& qb) { return Vecs(qb) * kLanes; }
  static unsigned VecMask(const QueryBlock& qb) { return (1u << Vecs(qb)) - 1; }
  static void Softmax(const AttentionKernelParams& p, QueryBlock& qb, std::int64_t num_k,
                      float* HWY_RESTRICT st, Staging& staging, const std::int64_t* vec_end) {
    const float scale = SoftmaxScale(p);
    const int vecs = Vecs(qb);
    if (!FusedPack(p)) {
      OnlineSoftmaxTile<true>(qb, num_k, st, vecs, vec_end, scale);
      return;
    }
    const unsigned redo = amx::softmax_pack_lazy(st, num_k, vec_end, scale * fastexp::kLog2e,
                                                 kLazyMaxSlack, qb.row_max, qb.row_sum, qb.alpha,
                                                 staging.prob_pairs, VecMask(qb));
    if (redo == 0) return;
    // The vectors whose running max moves (every vector on a block's first tile): the online
    // step's max pass, then the probabilities straight into their pair words (st unchanged).
    const float c = scale * fastexp::kLog2e;
    for (int x = 0; x < vecs; ++x) {
      if ((redo >> x & 1u) == 0) continue;
      const std::int64_t keys = vec_end != nullptr ? vec_end[x] : num_k;
      OnlineSoftmaxVec<true>(qb, x, keys, st, hn::Set(DF(), c), [&](VF shift) {
        alignas(64) float shift_lanes[kLanes], sum[kLanes];
        hn::Store(shift, DF(), shift_lanes);
        amx::exp_pack(st, num_k, vec_end, x, c, shift_lanes, sum, staging.prob_pairs);
        return hn::Load(DF(), sum);
      });
    }
  }
  static void StartBlock(const AttentionKernelParams& p, QueryBlock& qb) {
    if constexpr (kSplit) {
      PackQuerySplit(p, qb, Lanes(qb));
    } else {
      PackQueryPairs(p, qb, Lanes(qb));
      std::uint32_t* qt = reinterpret_cast<std::uint32_t*>(qb.qt);
      std::fill(qt + (p.head_dim + 1) / 2 * kBlockQ, qt + AmxDepth(p) / 2 * kBlockQ, 0u);
    }
    std::fill(qb.ot, qb.ot + OtRows(p) * kBlockQ, 0.0f);
  }
  static void Scores(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, float* HWY_RESTRICT st, Staging& staging,
                     const std::int64_t*) {
    const std::int64_t depth = AmxDepth(p);
    const std::uint16_t* k = kSplit ? StageKeySplit(p, qb, j0, num_k, staging.k)
                                    : StageKeyTile(p, qb, j0, num_k, depth, staging.k);
    amx::scores(k, depth, reinterpret_cast<const std::uint32_t*>(qb.qt), depth, num_k,
                DeferScale(p) ? 1.0f : p.scale, st, Lanes(qb));
  }
  static void Values(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                     std::int64_t num_k, const float* st, const float* alpha, Staging& staging,
                     const std::int64_t* vec_end) {
    const std::uint16_t* vt = kSplit ? StageValueSplit(p, qb, j0, num_k, staging.v)
                                     : StageValueTile(p, qb, j0, num_k, staging.v);
    const std::int64_t lanes = Lanes(qb);
    if (!FusedPack(p)) {
      amx::pack_probs(st, num_k, vec_end, staging.prob_pairs, VecMask(qb));
    }
    amx::values(vt, kBlockK, staging.prob_pairs, num_k, p.head_dim_v, alpha, vec_end, qb.ot, lanes);
    if constexpr (kSplit) {  // + P . Vl, the lo parts' columns OtRows(p) rows further
      amx::values(vt + OtRows(p) * kBlockK, kBlockK, staging.prob_pairs, num_k, p.head_dim_v,
                  nullptr, vec_end, qb.ot, lanes);
    }
  }

  static void NarrowQuery(const AttentionKernelParams& p, NarrowBlock& nb) {
    Narrow::NarrowQuery(p, nb);
  }
  static void NarrowScores(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    Narrow::NarrowScores(p, narrow, count);
  }
  static void NarrowProbs(float* st, std::int64_t num_k, int vecs) {
    Narrow::NarrowProbs(st, num_k, vecs);
  }
  static void NarrowValues(const AttentionKernelParams& p, const NarrowBlock* narrow,
                           std::int64_t count) {
    Narrow::NarrowValues(p, narrow, count);
  }
  static constexpr NarrowOrder kNarrowOrder = Narrow::kNarrowOrder;
  static constexpr bool kNarrowEvenOdd = Narrow::kNarrowEvenOdd;
};

// The path of the flash kernel for dtype on this target and CPU, for bf16: the vdpbf16ps pairs
// where bf16dot::preferred() (AMD: faster than FMA there, slower on Intel; or forced), else AMX
// tiles where amx::available(), else widened; for f16: AMX tiles (hi + lo parts) where
// amx::available(), else widened (the chunked kernel always widens: WideningProductPath).
inline ProductPath FlashProductPath(DType dtype) {
  if constexpr (PairProducts::kPairLanes) {
    if (dtype == DType::kBF16 && bf16dot::preferred()) return ProductPath::kBf16Pairs;
  }
  if constexpr (AmxProducts<hwy::bfloat16_t>::kAmxLanes) {
    if (dtype == DType::kBF16 && amx::available()) return ProductPath::kBf16Amx;
    if (dtype == DType::kF16 && amx::available()) return ProductPath::kF16Amx;
  }
  return WideningProductPath(dtype);
}

// The path of the flash kernel for a call: the dtype's, except that a multi-head decode step in
// BSHD (one query row per kv head, several kv heads, the rows of one key's heads neighbours)
// takes bf16 widened where the pairs are preferred but not forced (qkv bench --products
// bf16-vdpbf16ps forces them). The calls differ only in their decode walk there (every block is
// narrow), and the widening walk (NarrowScoresWide: 4 keys of every head in turn, K 8 and V 16
// keys ahead of the reads) outran the vdpbf16ps one (keys outermost, the tile's V and the next
// tile's K prefetched a tile at a time, 1 MiB each at 32 heads). Zen 4 (family 25 model 17),
// 2 threads, in-process A/B: Hq = Hkv = 32, Lk = 16384, D = 128 1.12-1.31x (qkv bench
// --products all: 1.5-1.6x); B = 4, Lk = 4096 1.32-1.59x; 8 heads, Lk = 32768 1.10x; 12 heads,
// Lk = 2048, D = 64 1.05-1.09x; B = 2, 16 heads, D = 64 0.95-0.98x. GQA (4 rows per kv head)
// and BHSD keep the pairs (there they ran 1.2-1.6x faster than widened).
inline ProductPath FlashProductPath(const AttentionKernelParams& p) {
  const ProductPath path = FlashProductPath(p.dtype);
  const bool multi_head_step = RowsPerKvHead(p) == 1 && p.num_heads_kv > 1 && HeadsInner(p);
  if (path == ProductPath::kBf16Pairs && multi_head_step && !bf16dot::forced()) {
    return ProductPath::kBf16Widened;
  }
  return path;
}

// f(Products{}) for the path: the one place that instantiates the skeletons. (kBf16Pairs and the
// AMX paths exist only where kPairLanes and kAmxLanes hold; FlashProductPath never picks them
// elsewhere.)
template <class F>
void WithProducts(ProductPath path, F&& f) {
  constexpr bool kAmxLanes = AmxProducts<hwy::bfloat16_t>::kAmxLanes;
  switch (path) {
    case ProductPath::kBf16Amx:
      if constexpr (kAmxLanes) return f(AmxProducts<hwy::bfloat16_t>{});
      [[fallthrough]];
    case ProductPath::kBf16Pairs:
      if constexpr (PairProducts::kPairLanes) return f(PairProducts{});
      [[fallthrough]];
    case ProductPath::kBf16Widened:
      return f(WideProducts<hwy::bfloat16_t>{});
    case ProductPath::kF16Amx:
      if constexpr (kAmxLanes) return f(AmxProducts<hwy::float16_t>{});
      [[fallthrough]];
    case ProductPath::kF16Widened:
      return f(WideProducts<hwy::float16_t>{});
    case ProductPath::kF32:
      break;
  }
  return f(WideProducts<float>{});
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_PRODUCTS_INL_H_
