// The decode path's f32 products (decode_walk-inl.h): blocks of a few query rows against many
// keys, row by row, vectorised along head_dim for the scores and along Dv for the values, with
// K and V widened to f32 in registers (Highway, one copy per target).

#if defined(QKV_KERNELS_CPU_NARROW_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_NARROW_PRODUCTS_INL_H_
#undef QKV_KERNELS_CPU_NARROW_PRODUCTS_INL_H_
#else
#define QKV_KERNELS_CPU_NARROW_PRODUCTS_INL_H_
#endif

#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// Rows of a narrow block: 16 on AVX-512, 8 on AVX2 (a whole vector of lanes; 4 until
// 2026-12-06: blocks of 5-8 rows, MQA 8:1 or two queries of a 4:1 group, took the wide
// micro-kernel at 15-30% of the FMA peak and ran 1.3-2.1x faster here, AMD EPYC Zen 2,
// docs/kernels.md "Narrow blocks of 8 rows on AVX2"), 1 on scalar.
constexpr std::int64_t kNarrowRows = kLanes == 8 ? kBlockQ / 2 : kBlockQ / 4;
static_assert(kNarrowRows <= kLanes, "FinishNarrow fills one vector of lanes");
// A narrow block's score tile (nb.st, decode_walk-inl.h) holds its rows one after another, each
// row's scores of the tile's keys side by side: st[r * kNarrowKeys + j] (keys along the lanes,
// so a one-row block's softmax takes a vector per kLanes keys: narrow_softmax-inl.h). The tile
// of one vector per key, rows along the lanes, that it replaced (2026-12-05) took a vector per
// key for any number of rows (docs/kernels.md, "Keys along the lanes").
constexpr std::int64_t kNarrowKeys = kBlockK;
constexpr int kDotRows = kNarrowRows < 4 ? static_cast<int>(kNarrowRows) : 4;
// The rows past the last whole group of kDotRows go as one group of 2 or 3 (ForEachRowGroup;
// each row's sums are the same chains in any group, so the bits are those of one row at a time):
// K and V are read once per step for them instead of once per row. Until 2026-12-06 they went
// one by one, and a block of 7 rows (Qwen2-7B's 28:4) ran slower than one of 8 (docs/kernels.md,
// "Remainder rows").
// Keys per dot-product step: kDotRows x kDotKeys accumulators (16 of AVX-512's 32 registers;
// 8 of AVX2's 16).
constexpr int kDotKeys = kLanes >= 16 ? 4 : 2;
// A block of one row (a multi-head decode step: one query row per kv head) whose K rows are a run
// of one head's (BHSD) takes one key per dot-product step on AVX2, not kDotKeys: each step then
// reads one K row, and the walk one ascending stream, where two keys per step read two rows at
// once. An AMD EPYC Zen 2 read it faster so (docs/kernels.md, "Narrow blocks of 8 rows on AVX2,
// and one-row blocks"); 4 and 8 keys per step were slower still. Each key's sum is the same chain
// either way (same bits).
constexpr bool kOneRowOneKey = kLanes == 8;
// Keys per value chunk in BSHD (see NarrowTile; 8 measured best of 1, 2, 4, 8, 16, 32).
constexpr std::int64_t kValueKeys = 8;
// Software prefetch distances of the widening walk (f32, bf16, f16), in keys (see NarrowTile):
// K rows `scores` keys ahead of the score walk, V rows `values` keys ahead of the value walk.
struct WalkAhead {
  std::int64_t scores = 0, values = 0;
};
// Heads inner (BSHD, several kv heads): the walk goes keys outermost across the heads, kDotKeys
// keys per block per step. 8 keys ahead against one key per step 2 ahead: 1.10-1.19x faster in
// bf16 and 1.07-1.08x in f32 (Lq = 1, Lk = 32768, Hq = 32, Hkv = 8, D = 128, 2 threads, Intel
// Xeon model 207, two runs of 5-6 interleaved rounds; 4 and 12-16 ahead measured in between);
// longer ones lose there (multi-head BSHD, K 16-64 ahead: 0.77-0.90x).
constexpr WalkAhead kAheadAcrossHeads{8, 16};
// Runs of one head's rows (BHSD, or a single kv head): each block walks its own head's tile, and
// the longer distances pay (Intel AMX Xeon model 167, 2026-12-05, qkv.torch in one process with
// the distances switched per call, 2 threads, Lq = 1, D = 128, 9-11 rounds: BHSD multi-head
// Lk = 16384 1.02-1.04x, GQA 32:8 Lk = 32768 1.01-1.07x, MQA 8:1 Lk = 262144 1.01-1.08x in
// BHSD and BSHD, f32 and bf16 widened; docs/kernels.md "Two pairs of distances").
constexpr WalkAhead kAheadHeadRuns{32, 64};

// The value walk's prefetch: rows j < end (those before the block's key_end) are asked for
// `distance` keys before they are read (end 0: none).
struct RowsAhead {
  std::int64_t end = 0, distance = 0;
};

// bf16 K and V rows are widened two vectors at a time: 2 * kLanes elements, loaded as kLanes
// 32-bit words (element 2i in the low half of word i, 2i + 1 in the high half), become the even
// elements by one shift and the odd ones by one AND, where LoadWide takes a zero extension and
// a shift per vector. The products then pair q's and o's elements in the same even/odd order,
// so a narrow block keeps its q rows and its o rows in it: within each whole span of kEvenOddSpan
// elements, position x < kLanes holds element 2x and position kLanes + x element 2x + 1
// (EvenOddElement); positions from EvenOddEnd on are in plain order. FinishNarrow puts o back.
// f32 and f16 keep plain order (f16 widens by one conversion per vector).
template <typename T>
constexpr bool kEvenOdd = std::is_same_v<T, hwy::bfloat16_t>&& HWY_TARGET != HWY_SCALAR;
constexpr std::int64_t kEvenOddSpan = 2 * kLanes;
static_assert(kQueryVecs % 2 == 0, "NarrowValueKeys' wide chunks are whole even/odd spans");

inline std::int64_t EvenOddEnd(std::int64_t n) { return n / kEvenOddSpan * kEvenOddSpan; }

// The element at position x of even/odd order up to end (= EvenOddEnd(n)).
inline std::int64_t EvenOddElement(std::int64_t x, std::int64_t end) {
  if (x >= end) return x;
  const std::int64_t span = x / kEvenOddSpan * kEvenOddSpan, y = x - span;
  return y < kLanes ? span + 2 * y : span + 2 * (y - kLanes) + 1;
}

// Keeps v in a register from here on (AVX2). GCC 12 otherwise folds the load of a vector that
// several multiply-adds use into each of them, one load per use: a 4 x 2 bf16 score step issued
// 20 loads for 16 multiply-adds (q once per key, the bf16 words once for the shift and once for
// the AND): at 2 loads a cycle that is 10 cycles of loads for 8 of multiply-adds, so the loads,
// not the two FMA pipes, set the pace. Same bits. AMD EPYC Zen 2, 2 threads, bf16 decode
// (1,32,8,1,32768,128) 1.045x BSHD and 1.075x BHSD, f32 1.02x (docs/kernels.md, "Loads on
// Zen 2"). Not measured on AVX-512, so not applied there. A vector used once (one key per step)
// is left to GCC: there is no second load to save.
template <class V>
HWY_INLINE void InRegister(V& v) {
#if HWY_TARGET == HWY_AVX2 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
  asm("" : "+x"(v.raw));
#else
  (void)v;
#endif
}

#if HWY_TARGET != HWY_SCALAR
// even, odd = elements [0, 2 * kLanes) of src at even and odd indices, as f32 (exact).
HWY_INLINE void LoadEvenOdd(DF df, const hwy::bfloat16_t* HWY_RESTRICT src, VF& even, VF& odd) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Repartition<std::uint16_t, DF> du16;
  auto words = hn::BitCast(du, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(src)));
  InRegister(words);  // (GCC loaded the words twice, once for the shift and once for the AND)
  even = hn::BitCast(df, hn::ShiftLeft<16>(words));
  odd = hn::BitCast(df, hn::And(words, hn::Set(du, 0xffff0000u)));
}
#endif

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

// st[r * kNarrowKeys + kk] = q[r] . k[kk] for r < R, kk < K.
//   q: [R][head_dim] (row stride head_dim; in even/odd order for bf16, kEvenOdd)
//   k: [K][head_dim] (row stride k_row_stride), stored as T (float, hwy::bfloat16_t or
//   hwy::float16_t; widened to f32 in registers)
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
  std::int64_t d = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kEvenOdd<T>) {
    for (; d < EvenOddEnd(head_dim); d += kEvenOddSpan) {
      if (ahead != nullptr) {
        HWY_UNROLL(4)
        for (int kk = 0; kk < K; ++kk) PrefetchL2(ahead + kk * k_row_stride + d);
      }
      VF even[K], odd[K];
      HWY_UNROLL(4)
      for (int kk = 0; kk < K; ++kk) LoadEvenOdd(df, k + kk * k_row_stride + d, even[kk], odd[kk]);
      HWY_UNROLL(4)
      for (int r = 0; r < R; ++r) {
        VF q_even = hn::LoadU(df, q + r * head_dim + d);
        VF q_odd = hn::LoadU(df, q + r * head_dim + d + kLanes);
        if constexpr (K > 1) {
          InRegister(q_even);
          InRegister(q_odd);
        }
        HWY_UNROLL(4)
        for (int kk = 0; kk < K; ++kk) {
          acc[r][kk] = hn::MulAdd(q_odd, odd[kk], hn::MulAdd(q_even, even[kk], acc[r][kk]));
        }
      }
    }
  }
#endif
  for (; d < vec_end; d += kLanes) {
    if (ahead != nullptr) {
      HWY_UNROLL(4)
      for (int kk = 0; kk < K; ++kk) PrefetchL2(ahead + kk * k_row_stride + d);
    }
    VF key[K];
    HWY_UNROLL(4)
    for (int kk = 0; kk < K; ++kk) key[kk] = LoadWide(df, k + kk * k_row_stride + d);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      VF query = hn::LoadU(df, q + r * head_dim + d);
      if constexpr (K > 1) InRegister(query);
      HWY_UNROLL(4)
      for (int kk = 0; kk < K; ++kk) acc[r][kk] = hn::MulAdd(query, key[kk], acc[r][kk]);
    }
  }
#if HWY_TARGET != HWY_SCALAR
  // Each row's sums of 4 keys by one transposing tree; fewer keys (a part's last ones) take the
  // same tree beside zeros, so a key's score has the same bits wherever the 4-key steps fall
  // (a tile trimmed to a sparsity's hull starts them elsewhere).
  if constexpr (kDotKeys == 4) {
    if (vec_end == head_dim) {
      HWY_UNROLL(4)
      for (int r = 0; r < R; ++r) {
        if constexpr (K == 4) {
          StoreLaneSums4(acc[r], st + r * kNarrowKeys);
        } else {
          VF keys[4] = {hn::Zero(df), hn::Zero(df), hn::Zero(df), hn::Zero(df)};
          float sums[4];
          HWY_UNROLL(4)
          for (int kk = 0; kk < K; ++kk) keys[kk] = acc[r][kk];
          StoreLaneSums4(keys, sums);
          for (int kk = 0; kk < K; ++kk) st[r * kNarrowKeys + kk] = sums[kk];
        }
      }
      return;
    }
  }
#endif
  // Every access to acc has indices known at compile time (the loops unrolled), so acc stays
  // in registers: a loop left rolled here kept the whole array on the stack, zeroed, stored
  // and reloaded around the depth loop on every call.
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int kk = 0; kk < K; ++kk) {
      float s = hn::GetLane(hn::SumOfLanes(df, acc[r][kk]));
      for (std::int64_t e = vec_end; e < head_dim; ++e) {
        s += q[r * head_dim + e] * WideElement(k[kk * k_row_stride + e]);
      }
      st[r * kNarrowKeys + kk] = s;
    }
  }
}

// f.template operator()<R>(r) for each group of R rows starting at row r of a block of num_q
// rows: groups of kDotRows, then the rest as one group of 2 or 3 (see kDotRows) or of 1.
template <class F>
HWY_INLINE void ForEachRowGroup(std::int64_t num_q, F&& f) {
  std::int64_t r = 0;
  for (; r + kDotRows <= num_q; r += kDotRows) f.template operator()<kDotRows>(r);
  if constexpr (kDotRows == 4) {
    if (num_q - r == 3) return f.template operator()<3>(r);
    if (num_q - r == 2) return f.template operator()<2>(r);
  }
  for (; r < num_q; ++r) f.template operator()<1>(r);
}

// q . k for rows [0, num_q) and K keys at k, into st[r * kNarrowKeys + kk] (ahead: see NarrowDots;
// the first row group prefetches).
template <int K, typename T>
HWY_INLINE void NarrowDotKeys(const float* q_rows, std::int64_t num_q, const T* k, std::int64_t ks,
                              std::int64_t d, float* st, const T* ahead) {
  ForEachRowGroup(num_q, [&]<int R>(std::int64_t r) {
    NarrowDots<R, K>(q_rows + r * d, k, ks, d, st + r * kNarrowKeys, r == 0 ? ahead : nullptr);
  });
}

// Vectors of a V row per load: two (an even/odd span, 64 bytes on AVX-512) for bf16 with E
// even, else one.
template <int E, typename T>
constexpr int ValueVecsPerLoad() {
  return kEvenOdd<T> && E % 2 == 0 ? 2 : 1;
}

// value[0 : E] = the E * kLanes elements of v as f32, by ValueVecsPerLoad.
template <int E, typename T>
HWY_INLINE void LoadValueRow(DF df, const T* HWY_RESTRICT v, VF* HWY_RESTRICT value) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (ValueVecsPerLoad<E, T>() == 2) {
    HWY_UNROLL(4)
    for (int e = 0; e < E; e += 2) LoadEvenOdd(df, v + e * kLanes, value[e], value[e + 1]);
    return;
  }
#endif
  HWY_UNROLL(4)
  for (int e = 0; e < E; ++e) value[e] = LoadWide(df, v + e * kLanes);
}

// o[r][0 : E * kLanes] += sum_j p[j][r] * v[j][0 : E * kLanes], r < R.
//   p: st[r * kNarrowKeys + j]   v: [num_k][...] (row stride v_row_stride)   o: row stride o_stride
//   ahead: the rows of v prefetched toward L2 (RowsAhead)
// bf16 with E even (kEvenOdd): o's E * kLanes columns are E / 2 spans in even/odd order.
template <int R, int E, typename T>
HWY_INLINE void NarrowValueRows(const float* HWY_RESTRICT st, const T* HWY_RESTRICT v,
                                std::int64_t v_row_stride, std::int64_t num_k,
                                float* HWY_RESTRICT o, std::int64_t o_stride, RowsAhead ahead) {
  const DF df;
  VF acc[R][E];
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int e = 0; e < E; ++e) acc[r][e] = hn::LoadU(df, o + r * o_stride + e * kLanes);
  }
  for (std::int64_t j = 0; j < num_k; ++j) {
    if (j + ahead.distance < ahead.end) {
      HWY_UNROLL(4)
      for (int e = 0; e < E; e += ValueVecsPerLoad<E, T>()) {
        PrefetchL2(v + (j + ahead.distance) * v_row_stride + e * kLanes);
      }
    }
    VF value[E];
    LoadValueRow<E>(df, v + j * v_row_stride, value);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const VF prob = hn::Set(df, st[r * kNarrowKeys + j]);
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
                                   std::int64_t o_stride, RowsAhead ahead) {
  ForEachRowGroup(num_q, [&]<int R>(std::int64_t r) {
    NarrowValueRows<R, E>(st + r * kNarrowKeys, v, v_row_stride, num_k, o + r * o_stride, o_stride,
                          r == 0 ? ahead : RowsAhead{});
  });
}

// Value columns per pass over the keys for a block of one row (a multi-head decode step: one
// query row per kv head). AVX2 takes 4 vectors, two cache lines of each f32 V row (one of bf16),
// where kQueryVecs = 2 take one (half a line of bf16): an AMD EPYC Zen 2 read a one-row walk's
// V faster so (docs/kernels.md, "Narrow blocks of 8 rows on AVX2, and one-row blocks"). Each
// column adds its keys in the same order either way, so the bits do not change.
constexpr int kOneRowValueVecs = kLanes == 8 ? 2 * kQueryVecs : kQueryVecs;

// o += v[0 : num_k]^T p for rows [0, num_q)   (o: [num_q][Dv], in even/odd order up to
// EvenOddEnd(Dv) for bf16; p: st[r * kNarrowKeys + j]; ahead: see NarrowValueRows).
template <typename T>
inline void NarrowValueKeys(const AttentionKernelParams& p, std::int64_t num_q, const T* v,
                            std::int64_t num_k, const float* HWY_RESTRICT st, float* HWY_RESTRICT o,
                            RowsAhead ahead) {
  const std::int64_t vs = p.v_stride[1], dv = p.head_dim_v;
  constexpr std::int64_t kWide = kQueryVecs * kLanes;
  std::int64_t e = 0;
  if constexpr (kOneRowValueVecs != kQueryVecs) {
    if (num_q == 1) {
      constexpr std::int64_t kOneRowWide = kOneRowValueVecs * kLanes;
      for (; e + kOneRowWide <= dv; e += kOneRowWide) {
        NarrowValueRows<1, kOneRowValueVecs>(st, v + e, vs, num_k, o + e, dv, ahead);
      }
    }
  }
  for (; e + kWide <= dv; e += kWide) {
    NarrowValueColumns<kQueryVecs>(num_q, st, v + e, vs, num_k, o + e, dv, ahead);
  }
  // Two vectors (for bf16 the last whole even/odd span; each column adds its keys alike).
  for (; e + 2 * kLanes <= dv; e += 2 * kLanes) {
    NarrowValueColumns<2>(num_q, st, v + e, vs, num_k, o + e, dv, ahead);
  }
  for (; e + kLanes <= dv; e += kLanes) {
    NarrowValueColumns<1>(num_q, st, v + e, vs, num_k, o + e, dv, ahead);
  }
  // A head_dim_v that is not a multiple of the lanes: one multiply-add per key in one lane (as
  // the vectors above; a plain `acc += p * v` GCC turned into unfused multiplies and adds where
  // it vectorised the loop and fused ones in its remainder, so a key's rounding depended on
  // where the part began).
  const hn::CappedTag<float, 1> d1;
  for (; e < dv; ++e) {
    for (std::int64_t r = 0; r < num_q; ++r) {
      auto acc = hn::Set(d1, o[r * dv + e]);
      for (std::int64_t j = 0; j < num_k; ++j) {
        acc = hn::MulAdd(hn::Set(d1, st[r * kNarrowKeys + j]),
                         hn::Set(d1, WideElement(v[j * vs + e])), acc);
      }
      o[r * dv + e] = hn::GetLane(acc);
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_NARROW_PRODUCTS_INL_H_
