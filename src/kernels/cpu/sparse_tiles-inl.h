// Block sparsity (Longformer and BigBird bands with globals, block layouts) on query blocks: the
// keys each block's lanes may attend, which key tiles a block skips, and the pair-by-pair
// predicate for tiles it covers in part (docs/sparse.md; Highway, one copy per target).

#if defined(QKV_KERNELS_CPU_SPARSE_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_SPARSE_TILES_INL_H_
#undef QKV_KERNELS_CPU_SPARSE_TILES_INL_H_
#else
#define QKV_KERNELS_CPU_SPARSE_TILES_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/kernel_params.h"
#include "kernels/sparse_pair.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

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
  constexpr int kVecs = kQueryVecs;
  VF lo[kVecs], hi[kVecs], first[kVecs];
  const bool dilated = s.dilation > 1;
  for (int x = 0; x < kVecs; ++x) {
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
    for (int x = 0; x < kVecs; ++x) {
      float* sc = st + j * kBlockQ + x * kLanes;
      auto allowed = hn::And(hn::Ge(jv, lo[x]), hn::Lt(jv, hi[x]));
      if (dilated) {
        allowed = hn::And(allowed, hn::Or(hn::Lt(first[x], zero), hn::Eq(j_class, first[x])));
      }
      hn::Store(hn::IfThenElse(allowed, hn::Load(df, sc), neg_inf), df, sc);
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_SPARSE_TILES_INL_H_
