// The online softmax on a score tile (Highway, one copy per target): running max and sum per query
// lane, the rescale factor of the tile, probabilities in place.

#if defined(QKV_KERNELS_CPU_ONLINE_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_ONLINE_SOFTMAX_INL_H_
#undef QKV_KERNELS_CPU_ONLINE_SOFTMAX_INL_H_
#else
#define QKV_KERNELS_CPU_ONLINE_SOFTMAX_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/fast_exp-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// The max to subtract for a running max m: m itself, or 0 while no key was allowed
// (we don't want (-inf) - (-inf), which would give NaN).
HWY_INLINE VF SafeMax(DF df, VF m) {
  return hn::IfThenElse(hn::Eq(m, hn::Set(df, kNegInf)), hn::Zero(df), m);
}

// Max of st[0 : num_k][lane0 : lane0 + kLanes] down the keys, in four chains (a max is exact and
// its order changes no bit; one chain waits a max's latency per key, which the AMX path, whose
// products are fast, would see).
HWY_INLINE VF ColumnMax(DF df, const float* HWY_RESTRICT st, std::int64_t num_k,
                        std::int64_t lane0) {
  VF m0 = hn::Set(df, kNegInf), m1 = m0, m2 = m0, m3 = m0;
  std::int64_t j = 0;
  for (; j + 4 <= num_k; j += 4) {
    const float* s = st + j * kBlockQ + lane0;
    m0 = hn::Max(m0, hn::Load(df, s));
    m1 = hn::Max(m1, hn::Load(df, s + kBlockQ));
    m2 = hn::Max(m2, hn::Load(df, s + 2 * kBlockQ));
    m3 = hn::Max(m3, hn::Load(df, s + 3 * kBlockQ));
  }
  for (; j < num_k; ++j) m0 = hn::Max(m0, hn::Load(df, st + j * kBlockQ + lane0));
  return hn::Max(hn::Max(m0, m1), hn::Max(m2, m3));
}

// st[j][lanes] = 2^(st[j][lanes] * c - shift2) in place (fastexp::Pow2: one FMA for the
// argument, 5 for the polynomial; with c = scale * log2e and shift2 a max in base 2 this is
// exp(st * scale - max)); returns the sum down the keys.
// 2^(-inf) = 0: masked pairs drop out exactly. kCoarse: the 2^x for probabilities rounded to bf16
// afterwards (fastexp::Pow2ForProbs; its argument's kHalfShift is taken off shift2 once, so
// each score still costs one FMA for it).
// The exact 2^x goes kExpGroup keys at a time (fastexp::Pow2Group; the same bits, and the sum
// adds the keys in order; docs/kernels.md, "exp", measured on Zen 2). The coarse one (AMX and
// vdpbf16ps paths) goes key by key.
constexpr int kExpGroup = 4;
template <bool kCoarse = false>
HWY_INLINE VF ExpInPlaceAndSum(DF df, float* HWY_RESTRICT st, std::int64_t num_k,
                               std::int64_t lane0, VF shift2, VF c) {
  if constexpr (kCoarse) shift2 = hn::Sub(shift2, hn::Set(df, fastexp::kHalfShift));
  VF sum = hn::Zero(df);
  std::int64_t j = 0;
  if constexpr (!kCoarse) {
    for (; j + kExpGroup <= num_k; j += kExpGroup) {
      float* s = st + j * kBlockQ + lane0;
      VF x[kExpGroup], p[kExpGroup];
      for (int i = 0; i < kExpGroup; ++i) {
        x[i] = hn::MulSub(hn::Load(df, s + i * kBlockQ), c, shift2);
      }
      fastexp::Pow2Group(df, x, p);
      for (int i = 0; i < kExpGroup; ++i) {
        hn::Store(p[i], df, s + i * kBlockQ);
        sum = hn::Add(sum, p[i]);
      }
    }
  }
  for (; j < num_k; ++j) {
    float* s = st + j * kBlockQ + lane0;
    const VF prob = fastexp::Pow2ForProbs<kCoarse>(df, hn::MulSub(hn::Load(df, s), c, shift2));
    hn::Store(prob, df, s);
    sum = hn::Add(sum, prob);
  }
  return sum;
}

// How far above the running max (base 2) a tile's scores may lie before the lazy max (below)
// moves it: p = 2^(x) then stays below 2^12 = 4096 (Pow2Coarse's domain reaches 16).
constexpr float kLazyMaxSlack = 12.0f;

// Flash step over one tile, in base 2: the running max qb.row_max is m2 = max(s) * log2e
// (rounded once per tile, fl(tile max * c) with c = score_scale * log2e), st becomes
// p = 2^(s * c - m2_new) = exp(s - max) in place, alpha = 2^(m2_old - m2_new), row_sum =
// row_sum * alpha + sum_j p. Every p and alpha is computed against the same stored m2, so the
// tiles' weights agree exactly (alpha is exactly 1 where the max stays; a max converted to base 2
// anew in each tile would leave a relative error of about |max| * 2^-24 between the tiles). lse
// = m2 * ln2 + log(row_sum) (FinishQueryBlock; the splits' merge combines m2 in base 2 too).
// Only the first num_vecs query vectors (the flash kernel's decode path uses fewer lanes; the
// others are left as they are), and with vec_end (VecKeys in tile_geometry-inl.h) only keys
// [0, vec_end[x]) of vector x: the later ones stay -inf.
// kCoarse (the product paths that round the probabilities to bf16: rounds_probabilities) takes
// the coarse 2^x for p (alpha keeps the exact one) and keeps the running max lazily: while
// every lane of a vector has a finite running max and the tile's scores stay within
// kLazyMaxSlack above it, the max (and so the shift) is left as it is: alpha is exactly 1 and the
// value product skips the rescale of the whole accumulator. Softmax is shift-invariant, so this
// is the same attention; p is then at most 2^12, and out = ot / row_sum and lse are unchanged in
// meaning (the splits' merge takes any shift).
// score_scale > 0: st holds the scores divided by it (the AMX path defers the scale to here,
// Products::SoftmaxScale).
// exp_sum(shift) is the second pass: p against the shift (the new running max, 0 where it is
// -inf), returning their sum down the keys; ExpInPlaceAndSum writes them into st, the AMX path
// straight into its pair words (AmxProducts::Softmax).
// OnlineSoftmaxStep is the step on the lanes [lane0, lane0 + kLanes) of the softmax state given
// their tile max (times c; the narrow blocks' rows compute theirs along the keys,
// narrow_softmax-inl.h).
template <bool kCoarse, class ExpSum>
HWY_INLINE void OnlineSoftmaxStep(QueryBlock& qb, std::int64_t lane0, VF tile_max,
                                  const ExpSum& exp_sum) {
  const DF df;
  const VF old_max = hn::Load(df, qb.row_max + lane0);
  VF new_max = hn::Max(old_max, tile_max);
  if constexpr (kCoarse) {
    const auto keep = hn::And(hn::Gt(old_max, hn::Set(df, kNegInf)),
                              hn::Le(tile_max, hn::Add(old_max, hn::Set(df, kLazyMaxSlack))));
    if (hn::AllTrue(df, keep)) new_max = old_max;
  }
  // 2^(-inf) = 0: the first tile rescales an all-zero accumulator.
  const VF shift = SafeMax(df, new_max);
  const VF alpha = fastexp::Pow2(df, hn::Sub(old_max, shift));
  const VF sum = exp_sum(shift);
  hn::Store(new_max, df, qb.row_max + lane0);
  hn::Store(hn::MulAdd(hn::Load(df, qb.row_sum + lane0), alpha, sum), df, qb.row_sum + lane0);
  hn::Store(alpha, df, qb.alpha + lane0);
}

template <bool kCoarse, class ExpSum>
HWY_INLINE void OnlineSoftmaxVec(QueryBlock& qb, int x, std::int64_t keys,
                                 const float* HWY_RESTRICT st, VF c, const ExpSum& exp_sum) {
  const std::int64_t lane0 = x * kLanes;
  OnlineSoftmaxStep<kCoarse>(qb, lane0, hn::Mul(ColumnMax(DF(), st, keys, lane0), c), exp_sum);
}

// The step with the probabilities written into st.
template <bool kCoarse = false>
HWY_INLINE void OnlineSoftmaxVec(QueryBlock& qb, int x, std::int64_t keys, float* HWY_RESTRICT st,
                                 VF c) {
  OnlineSoftmaxVec<kCoarse>(qb, x, keys, st, c, [&](VF shift) {
    return ExpInPlaceAndSum<kCoarse>(DF(), st, keys, x * kLanes, shift, c);
  });
}

// The step on every query vector x whose bit is set in `vecs` (all of them by default). st's rows
// lie kBlockQ floats apart (narrow blocks on the bf16 pairs too; the widening walk has its own,
// narrow_softmax-inl.h).
template <bool kCoarse = false>
inline void OnlineSoftmaxTile(QueryBlock& qb, std::int64_t num_k, float* HWY_RESTRICT st,
                              int num_vecs = kQueryVecs, const std::int64_t* vec_end = nullptr,
                              float score_scale = 1.0f, unsigned vecs = ~0u) {
  const VF c = hn::Set(DF(), score_scale * fastexp::kLog2e);
  for (int x = 0; x < num_vecs; ++x) {
    if ((vecs >> x & 1u) == 0) continue;
    OnlineSoftmaxVec<kCoarse>(qb, x, vec_end != nullptr ? vec_end[x] : num_k, st, c);
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_ONLINE_SOFTMAX_INL_H_
