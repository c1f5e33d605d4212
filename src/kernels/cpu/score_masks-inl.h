// The masks of a score tile (Highway, one copy per target): softcap, additive bias, attend mask,
// the sparsity predicate, and the causal / window / key-length ranges. Not-allowed pairs become
// exactly -inf.

#if defined(QKV_KERNELS_CPU_SCORE_MASKS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_SCORE_MASKS_INL_H_
#undef QKV_KERNELS_CPU_SCORE_MASKS_INL_H_
#else
#define QKV_KERNELS_CPU_SCORE_MASKS_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/sparse_tiles-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// The additive bias and the attend mask of lane l's scores of keys [j0, j0 + num_k), which lie
// key_stride floats apart from s (the wide tile's column l, or a narrow block's row).
inline void BiasAndMaskLane(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t l,
                            std::int64_t j0, std::int64_t num_k, float* HWY_RESTRICT s,
                            std::int64_t key_stride) {
  if (p.bias != nullptr) {
    const float* bias = p.bias + qb.b * p.bias_stride[0] + qb.head[l] * p.bias_stride[1] +
                        qb.query[l] * p.bias_stride[2] + j0 * p.bias_stride[3];
    for (std::int64_t j = 0; j < num_k; ++j) s[j * key_stride] += bias[j * p.bias_stride[3]];
  }
  if (p.mask != nullptr) {
    const std::uint8_t* mask = p.mask + qb.b * p.mask_stride[0] + qb.head[l] * p.mask_stride[1] +
                               qb.query[l] * p.mask_stride[2] + j0 * p.mask_stride[3];
    for (std::int64_t j = 0; j < num_k; ++j) {
      if (mask[j * p.mask_stride[3]] == 0) s[j * key_stride] = kNegInf;
    }
  }
}

// st[j][:] = scores of keys [j0, j0 + num_k) against the block's queries, from raw scores q.k *
// scale (any product path, wide or decode), with softcap, bias and every mask applied:
// not-allowed pairs are exactly -inf. sparse_predicate: apply the sparsity pair by pair (tiles
// SparseTileKeys found partly covered; every tile in chunked).
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
  if (p.bias != nullptr || p.mask != nullptr) {
    for (std::int64_t l = 0; l < qb.num_q; ++l) {
      BiasAndMaskLane(p, qb, l, j0, num_k, st + l, kBlockQ);
    }
  }

  if (sparse_predicate) ApplySparsity(p, qb, j0, num_k, st);

  // Range masks (causal, window, key lengths). A tile inside every query's range needs none.
  bool interior = true;
  for (std::int64_t i = 0; i < qb.num_q; ++i) {
    interior = interior && qb.lo[i] <= j0 && qb.hi[i] >= j0 + num_k;
  }
  if (interior) return;
  constexpr int kVecs = kQueryVecs;
  VF lo[kVecs], hi[kVecs];
  for (int x = 0; x < kVecs; ++x) {
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
    for (int x = 0; x < kVecs; ++x) {
      float* s = st + j * kBlockQ + x * kLanes;
      const auto allowed = hn::And(hn::Ge(jv, lo[x]), hn::Lt(jv, hi[x]));
      hn::Store(hn::IfThenElse(allowed, hn::Load(df, s), neg_inf), df, s);
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_SCORE_MASKS_INL_H_
