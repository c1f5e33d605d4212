// A query block's start (its lanes' allowed key ranges, the running softmax state reset) and
// finish (out = ot^T / row_sum, lse), shared by the flash and chunked kernels (Highway, one copy
// per target).

#if defined(QKV_KERNELS_CPU_QUERY_BLOCK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_QUERY_BLOCK_INL_H_
#undef QKV_KERNELS_CPU_QUERY_BLOCK_INL_H_
#else
#define QKV_KERNELS_CPU_QUERY_BLOCK_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/sparse_tiles-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// Starts block `block` of kv head `kv_head` in batch entry b: computes each lane's allowed key
// range from causal/window/key_lengths, resets the running softmax state. The tile products then
// need the product path's StartBlock (products-inl.h); the decode path (decode_walk-inl.h) keeps q
// and o rows of its own.
inline void StartQueryBlock(const AttentionKernelParams& p, std::int64_t b, std::int64_t kv_head,
                            std::int64_t block, QueryBlock& qb) {
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  const std::int64_t row0 = block * kBlockQ;
  qb.b = b;
  qb.num_q = std::min<std::int64_t>(kBlockQ, RowsPerKvHead(p) - row0);
  qb.k = element_at(p.k, p.dtype, b * p.k_stride[0] + kv_head * p.k_stride[2]);
  qb.v = element_at(p.v, p.dtype, b * p.v_stride[0] + kv_head * p.v_stride[2]);

  qb.key_begin = p.seq_kv;
  qb.key_end = 0;
  // Row row0 + l is query (row0 + l) % Lq of query head kv_head * group + (row0 + l) / Lq: one
  // division for the block, then counters (a division per lane had cost 3% of a call at L = 64).
  std::int64_t head = kv_head * group + row0 / p.seq_q, query = row0 % p.seq_q;
  for (std::int64_t l = 0; l < kBlockQ; ++l) {
    KeyRange keys{0, 0};
    qb.head[l] = kv_head * group;
    qb.query[l] = 0;
    if (l < qb.num_q) {
      qb.head[l] = head;
      qb.query[l] = query;
      keys = LaneKeys(p, b, query);
      if (++query == p.seq_q) {
        query = 0;
        ++head;
      }
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

// The block's out rows: ot^T * inv_sum, row by row, transposing squares of ot in registers
// where out has unit stride along Dv (as PackQuery), the rest of Dv element by element; into
// p.out, or rounded into p.out16 (kHalf).
template <bool kHalf>
inline void WriteOutRows(const AttentionKernelParams& p, const QueryBlock& qb,
                         const float* inv_sum) {
  const DF df;
  const std::int64_t squares = p.out_stride[3] == 1 ? p.head_dim_v / kLanes * kLanes : 0;
  for (std::int64_t l0 = 0; l0 < qb.num_q; l0 += kLanes) {
    std::int64_t rows[kLanes];
    for (std::int64_t r = 0; r < kLanes; ++r) {
      const std::int64_t l = std::min(l0 + r, qb.num_q - 1);  // (lanes past num_q: not stored)
      rows[r] = LaneRow(p.out_stride, qb, l);
    }
    const std::int64_t lanes = std::min(kLanes, qb.num_q - l0);
    for (std::int64_t e0 = 0; e0 < squares; e0 += kLanes) {
      VF v[kLanes];
      HWY_UNROLL(16)
      for (std::int64_t c = 0; c < kLanes; ++c)
        v[c] = hn::Load(df, qb.ot + (e0 + c) * kBlockQ + l0);
      TransposeSquare(df, v);
      for (std::int64_t r = 0; r < lanes; ++r) {
        const VF x = hn::Mul(v[r], hn::Set(df, inv_sum[l0 + r]));
        if constexpr (kHalf) {
          StoreHalfLanes(p.dtype, df, x, p.out16 + rows[r] + e0);
        } else {
          hn::StoreU(x, df, p.out + rows[r] + e0);
        }
      }
    }
    for (std::int64_t r = 0; r < lanes; ++r) {
      for (std::int64_t e = squares; e < p.head_dim_v; ++e) {
        const float x = qb.ot[e * kBlockQ + l0 + r] * inv_sum[l0 + r];
        const std::int64_t at = rows[r] + e * p.out_stride[3];
        if constexpr (kHalf) {
          p.out16[at] = f32_to_half_bits(p.dtype, x);
        } else {
          p.out[at] = x;
        }
      }
    }
  }
}

// Whether the kernels ask for out's rows before they write them (PrefetchOutRows): only where out
// is larger than a core's caches would keep between calls (4 MiB); for a smaller out the
// prefetches only cost (0.96x at 2 MiB, docs/kernels.md, "Finishing a block").
inline bool PrefetchesOut(const AttentionKernelParams& p) {
  constexpr double kMinBytes = 4.0 * 1024 * 1024;
  return static_cast<double>(p.batch * p.seq_q * p.num_heads_q * p.head_dim_v) *
             (p.out16 != nullptr ? 2.0 : 4.0) >=
         kMinBytes;
}

// Asks for the block's out rows toward L1 (where out has unit stride along Dv), some time before
// FinishQueryBlock writes them: its stores then find the lines in cache. Without it the stores
// waited on memory, and with them the loads of ot that follow (docs/kernels.md, "Finishing a
// block": batches of short sequences ran 1.12-1.30x faster with it).
inline void PrefetchOutRows(const AttentionKernelParams& p, const QueryBlock& qb) {
  if (p.out_stride[3] != 1) return;
  const bool half = p.out16 != nullptr;
  const char* base = half ? reinterpret_cast<const char*>(p.out16)
                          : reinterpret_cast<const char*>(p.out);
  const std::int64_t bytes = half ? 2 : 4;
  for (std::int64_t l = 0; l < qb.num_q; ++l) {
    PrefetchLinesL1(base + LaneRow(p.out_stride, qb, l) * bytes, p.head_dim_v * bytes);
  }
}

// out = ot^T / row_sum (0 for rows with no allowed key), lse = row_max * ln2 + log(row_sum)
// (-inf): row_max is the max in base 2 (online_softmax-inl.h).
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
    const VF row_lse =
        hn::MulAdd(hn::Load(df, qb.row_max + lane0), hn::Set(df, kLn2), hn::Log(df, safe_sum));
    hn::Store(hn::IfThenElse(has_keys, row_lse, hn::Set(df, kNegInf)), df, lse + lane0);
  }
  if (p.out16 != nullptr) {
    WriteOutRows<true>(p, qb, inv_sum);
  } else {
    WriteOutRows<false>(p, qb, inv_sum);
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

#endif  // QKV_KERNELS_CPU_QUERY_BLOCK_INL_H_
