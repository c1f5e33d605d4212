// The masks and the online softmax of a narrow block's score tile with its keys along the lanes
// (Highway, one copy per target): st[r * kNarrowKeys + i] holds row r's score of the tile's key
// i, so a row's step takes ceil(num_k / kLanes) vectors. The rows-in-lanes tile of the wide blocks
// (st[j * kBlockQ + r], score_masks-inl.h, online_softmax-inl.h) takes one vector per key
// whatever the rows, 16 lanes for the one row of a multi-head decode step. Same masks, same
// running max, alpha and probabilities bit for bit; each row's sum is taken across its lanes, so
// it adds in another order (decode_walk-inl.h, NarrowTile).

#if defined(QKV_KERNELS_CPU_NARROW_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_NARROW_SOFTMAX_INL_H_
#undef QKV_KERNELS_CPU_NARROW_SOFTMAX_INL_H_
#else
#define QKV_KERNELS_CPU_NARROW_SOFTMAX_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/fast_exp-inl.h"
#include "kernels/cpu/narrow_products-inl.h"
#include "kernels/cpu/online_softmax-inl.h"
#include "kernels/cpu/score_masks-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/kernel_params.h"
#include "kernels/sparse_pair.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// The lanes of the vector at row + x that hold [begin, end) of the row.
HWY_INLINE auto RowLanes(DF df, std::int64_t x, std::int64_t begin, std::int64_t end) {
  const auto count = [](std::int64_t n) {
    return static_cast<std::size_t>(std::clamp<std::int64_t>(n, 0, kLanes));
  };
  return hn::AndNot(hn::FirstN(df, count(begin - x)), hn::FirstN(df, count(end - x)));
}

// Row r's scores with softcap, bias and every mask applied, as MaskScoreTile does for the
// rows-in-lanes tile: not-allowed pairs are exactly -inf. st[r * kNarrowKeys + i] is the score
// of key first + i; the block's part of the tile is i in [begin, end). sparse_predicate: the
// sparsity pair by pair, by the one predicate (kernels/sparse_pair.h). The softcap runs on the
// whole vectors that hold the part: their other lanes hold earlier values of the tile (finite
// or not), which nothing reads.
inline void MaskNarrowRows(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t first,
                           std::int64_t begin, std::int64_t end, float* HWY_RESTRICT st,
                           bool sparse_predicate) {
  const DF df;
  const std::int64_t j0 = first + begin;
  const bool by_pair =
      p.softcap > 0.0f || p.bias != nullptr || p.mask != nullptr || sparse_predicate;
  for (std::int64_t r = 0; r < qb.num_q; ++r) {
    // A part inside the row's range with nothing else to apply: nothing to do.
    if (!by_pair && qb.lo[r] <= j0 && qb.hi[r] >= first + end) continue;
    float* row = st + r * kNarrowKeys;
    if (p.softcap > 0.0f) {
      // "s = softcap * tanh(s / softcap)"; scale is already folded into q.
      const VF cap = hn::Set(df, p.softcap), inv_cap = hn::Set(df, 1.0f / p.softcap);
      for (std::int64_t x = begin / kLanes * kLanes; x < end; x += kLanes) {
        hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::Load(df, row + x), inv_cap))), df, row + x);
      }
    }
    float* part = row + begin;
    const std::int64_t num_k = end - begin;
    BiasAndMaskLane(p, qb, r, j0, num_k, part, 1);
    if (sparse_predicate) {
      for (std::int64_t j = 0; j < num_k; ++j) {
        if (!sparse_pair_allowed(p.sparse, p.diagonal_offset, qb.head[r], qb.query[r], j0 + j)) {
          part[j] = kNegInf;
        }
      }
    }
    // The range masks (causal, window, key lengths): keys outside [lo, hi).
    const std::int64_t lo = std::clamp<std::int64_t>(qb.lo[r] - j0, 0, num_k);
    const std::int64_t hi = std::clamp<std::int64_t>(qb.hi[r] - j0, lo, num_k);
    std::fill(part, part + lo, kNegInf);
    std::fill(part + hi, part + num_k, kNegInf);
  }
}

// f(x, lanes) for the vectors at row + x that hold [begin, end) of a row, in ascending x, with
// lanes the mask of those in the part for the first and the last, and f(x) for those between
// (all lanes). The row's vectors start at its first float (the tile's first key).
template <class Part, class Whole>
HWY_INLINE void ForRowVectors(std::int64_t begin, std::int64_t end, const Part& part,
                              const Whole& whole) {
  const DF df;
  std::int64_t x = begin / kLanes * kLanes;
  if (x < begin || x + kLanes > end) {
    part(x, RowLanes(df, x, begin, end));
    x += kLanes;
  }
  for (; x + kLanes <= end; x += kLanes) whole(x);
  if (x < end) part(x, RowLanes(df, x, begin, end));
}

// The max of row[begin : end] (-inf for none).
HWY_INLINE float NarrowRowMax(DF df, const float* HWY_RESTRICT row, std::int64_t begin,
                              std::int64_t end) {
  const VF neg_inf = hn::Set(df, kNegInf);
  VF m = neg_inf;
  ForRowVectors(
      begin, end,
      [&](std::int64_t x, auto lanes) {
        m = hn::Max(m, hn::IfThenElse(lanes, hn::Load(df, row + x), neg_inf));
      },
      [&](std::int64_t x) { m = hn::Max(m, hn::Load(df, row + x)); });
  return hn::GetLane(hn::MaxOfLanes(df, m));
}

// row[begin : end] = 2^(row * c - shift2) in place (fastexp::Pow2, as ExpInPlaceAndSum); returns
// their sum. Lane l adds the keys at x + l in ascending order of x (vectors of the row, from its
// start), then the lanes are added, so a part trimmed to fewer keys of the same tile (a
// sparsity's hull, FlashForward's tile_part) sums the same bits: the keys cut off would have
// added exact zeros.
HWY_INLINE float NarrowRowExp(DF df, float* HWY_RESTRICT row, std::int64_t begin, std::int64_t end,
                              VF shift2, VF c) {
  VF sum = hn::Zero(df);
  ForRowVectors(
      begin, end,
      [&](std::int64_t x, auto lanes) {
        const VF s = hn::Load(df, row + x);
        const VF prob = hn::IfThenElseZero(lanes, fastexp::Pow2(df, hn::MulSub(s, c, shift2)));
        hn::Store(hn::IfThenElse(lanes, prob, s), df, row + x);
        sum = hn::Add(sum, prob);
      },
      [&](std::int64_t x) {
        const VF prob = fastexp::Pow2(df, hn::MulSub(hn::Load(df, row + x), c, shift2));
        hn::Store(prob, df, row + x);
        sum = hn::Add(sum, prob);
      });
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

// The flash step of OnlineSoftmaxTile (online_softmax-inl.h; exact 2^x, no lazy max) on
// row[begin : end] of the block's rows, whose softmax state lies in the first vector of lanes
// (num_q <= kLanes): each row's tile max and sum across its keys' lanes, and the state's update
// as one vector by OnlineSoftmaxStep, so the max, alpha and every probability are the bits of
// the rows-in-lanes step. Lanes past num_q see a tile of no allowed key.
inline void OnlineSoftmaxRows(QueryBlock& qb, std::int64_t begin, std::int64_t end,
                              float* HWY_RESTRICT st) {
  const DF df;
  const VF c = hn::Set(df, fastexp::kLog2e);
  HWY_ALIGN float maxes[kLanes];
  for (std::int64_t r = 0; r < kLanes; ++r) {
    maxes[r] = r < qb.num_q ? NarrowRowMax(df, st + r * kNarrowKeys, begin, end) : kNegInf;
  }
  OnlineSoftmaxStep<false>(qb, 0, hn::Mul(hn::Load(df, maxes), c), [&](VF shift) {
    HWY_ALIGN float shifts[kLanes], sums[kLanes] = {};
    hn::Store(shift, df, shifts);
    for (std::int64_t r = 0; r < qb.num_q; ++r) {
      sums[r] = NarrowRowExp(df, st + r * kNarrowKeys, begin, end, hn::Set(df, shifts[r]), c);
    }
    return hn::Load(df, sums);
  });
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_NARROW_SOFTMAX_INL_H_
