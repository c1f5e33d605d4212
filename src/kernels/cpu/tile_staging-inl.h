// Operands in the layouts the tile products read (Highway, one copy per target): q packed once per
// block (q^T * scale, or pair words for the vdpbf16ps products), and K and V rows staged once per
// (rows, tile) where they are not f32 (widened to f32, or paired along the reduction axis).

#if defined(QKV_KERNELS_CPU_TILE_STAGING_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_TILE_STAGING_INL_H_
#undef QKV_KERNELS_CPU_TILE_STAGING_INL_H_
#else
#define QKV_KERNELS_CPU_TILE_STAGING_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/float16.h"
#include "hwy/highway.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// qt[d][l] = q[l][d] * scale for the block's lanes l < num_q, 0 past them (q stored as T). Row by
// row: the rows lie Hq * D elements apart, often a multiple of 4 KiB, so a walk column by column
// keeps evicting them from one L1 set. With unit stride along D, squares of kLanes x kLanes are
// transposed in registers (TransposeSquare); the rest of D element by element.
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

// ---------------------------------------------------------------------------------------------
// K and V for the tile products. An f32 K is read where it lies on AVX-512 and copied into a
// per-thread staging tile on AVX2 (kStagesF32Rows; but for a decode step's wide blocks whose K
// rows lie far apart, Staging::k_in_place); bf16/f16 K rows are widened (exactly) into
// it (StageRows); V of every dtype is staged as f32 columns (StageColumns). Each is staged once
// per (rows, tile): the query blocks of a task that share a kv head then reuse it.

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
  // The buffer as U*, after fill(it) unless it holds rows [first, first + count) of `rows`
  // already (every Stage* function below stages through this).
  template <typename U, class Fill>
  U* Stage(const void* rows, std::int64_t first, std::int64_t count, Fill&& fill) {
    U* out = reinterpret_cast<U*>(buffer);
    if (!Holds(rows, first, count)) {
      fill(out);
      source = rows;
      j0 = first;
      num = count;
    }
    return out;
  }
};

struct Staging {
  StagedRows k, v;
  std::uint32_t* prob_pairs = nullptr;  // bf16: [kBlockK / 2][kBlockQ] pair words
  // A decode step's wide blocks (flash_forward.cc sets these per call): V's staging asks for its
  // next rows as it goes (StageColumns), and an f32 K is read where it lies (StageRows).
  bool read_ahead = false;
  bool k_in_place = false;
  // A task of one key tile (short sequences), whose K rows nothing asked for before
  // (flash_forward.cc's PrefetchRows asks for the next tile's): an f32 K read in place asks for
  // its next rows toward L1 as the scores go (WideProducts::Scores).
  bool cold_k = false;
};

// Floats of the K and V staging tiles: kBlockK rows of dim f32 (an f32 K uses its part only
// where kStagesF32Rows); for bf16 and f16 at least the AMX tiles' bf16 K rows of AmxDepth and
// V columns of Dv rounded up to 16 (for f16 two sets, its hi and lo parts, and the split rows
// they are transposed from: StageValueSplit; AmxProducts in products-inl.h).
inline std::int64_t StagedKFloats(const AttentionKernelParams& p) {
  return kBlockK * (p.dtype == DType::kF32 ? p.head_dim : std::max(p.head_dim, AmxDepth(p) / 2));
}
inline std::int64_t StagedVFloats(const AttentionKernelParams& p) {
  const std::int64_t columns = (p.head_dim_v + 15) / 16 * 16;  // bf16 elements of one set
  if (p.dtype == DType::kF16) {  // hi and lo columns, and their rows before the transpose
    return kBlockK * (columns + p.head_dim_v);
  }
  return kBlockK * (p.dtype == DType::kF32 ? p.head_dim_v : std::max(p.head_dim_v, columns / 2));
}

// Floats of the staging tiles; bf16 and f16 add the probabilities as pair words for the
// vdpbf16ps and AMX products (PairProducts, AmxProducts in products-inl.h).
inline std::int64_t StagingFloats(const AttentionKernelParams& p) {
  return StagedKFloats(p) + StagedVFloats(p) + (p.dtype != DType::kF32 ? kBlockK / 2 * kBlockQ : 0);
}

inline Staging BindStaging(const AttentionKernelParams& p, float* floats) {
  Staging s;
  s.k.buffer = floats;
  s.v.buffer = floats + StagedKFloats(p);
  if (p.dtype != DType::kF32) {
    s.prob_pairs = reinterpret_cast<std::uint32_t*>(s.v.buffer + StagedVFloats(p));
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

// Asks for rows [lo, hi) of the operand whose (b, kv_head) rows start at `rows` (p.k's or
// p.v's strides, `dim` elements of `bytes` each) toward L2, line by line.
inline void PrefetchRows(const void* rows, const std::int64_t* stride, std::int64_t dim,
                         std::int64_t bytes, std::int64_t lo, std::int64_t hi) {
  for (std::int64_t j = lo; j < hi; ++j) {
    const char* row = static_cast<const char*>(rows) + j * stride[1] * bytes;
    for (std::int64_t x = 0; x < dim * bytes; x += 64) PrefetchL2(row + x);
  }
}

// Rows [j0, j0 + num_k) of the operand whose (b, kv_head) rows start at `rows` (p.k's or p.v's
// strides, `dim` elements each, stored as T), as f32. f32 rows are read in place where
// !kStagesF32Rows or in_place.
template <typename T>
inline TileRows StageRows(const void* rows, const std::int64_t* stride, std::int64_t dim,
                          std::int64_t j0, std::int64_t num_k, StagedRows& staged,
                          bool in_place = false) {
  if constexpr (std::is_same_v<T, float>) {
    if (!kStagesF32Rows || in_place) {
      return {static_cast<const float*>(rows) + j0 * stride[1], stride[1], stride[3]};
    }
  }
  const float* data = staged.Stage<float>(rows, j0, num_k, [&](float* buffer) {
    const T* source = static_cast<const T*>(rows);
    for (std::int64_t j = 0; j < num_k; ++j) {
      const std::int64_t at = (j0 + j) * stride[1];
      float* dst = buffer + j * dim;
      if (stride[3] != 1) {
        for (std::int64_t e = 0; e < dim; ++e) dst[e] = WideElement(source[at + e * stride[3]]);
      } else {
        WidenRow(source + at, dim, dst);
      }
    }
  });
  return {data, dim, 1};
}

// dst[e * dst_stride + j] = source[j * row_stride + e * elem_stride] as f32 (exact), for rows
// j < num_k and elements e < dim (T = float, hwy::bfloat16_t, hwy::float16_t): rows turned into
// columns. With unit elem_stride, squares of kLanes rows x kLanes elements are loaded as vectors
// and transposed in registers (TransposeSquare; kLanes lines in flight where the rows lie far
// apart), the rest element by element. With kAhead, each square that starts a cache line of its
// rows asks for that line of the next kLanes rows.
template <typename T, bool kAhead = false>
inline void TransposeRows(const T* source, std::int64_t row_stride, std::int64_t elem_stride,
                          std::int64_t dim, std::int64_t num_k, float* dst,
                          std::int64_t dst_stride) {
  const auto element = [&](std::int64_t j, std::int64_t e) {
    return WideElement(source[j * row_stride + e * elem_stride]);
  };
  std::int64_t j = 0;
  if (elem_stride == 1) {
    const DF df;
    constexpr std::int64_t kLineElements = 64 / sizeof(T);
    for (; j + kLanes <= num_k; j += kLanes) {
      std::int64_t e = 0;
      for (; e + kLanes <= dim; e += kLanes) {
        VF square[kLanes];
        for (std::int64_t r = 0; r < kLanes; ++r) {
          square[r] = LoadWide(df, source + (j + r) * row_stride + e);
        }
        if constexpr (kAhead) {
          if (e % kLineElements == 0 && j + 2 * kLanes <= num_k) {
            for (std::int64_t r = 0; r < kLanes; ++r) {
              PrefetchL2(source + (j + kLanes + r) * row_stride + e);
            }
          }
        }
        TransposeSquare(df, square);
        for (std::int64_t c = 0; c < kLanes; ++c) {
          hn::StoreU(square[c], df, dst + (e + c) * dst_stride + j);
        }
      }
      for (; e < dim; ++e) {
        for (std::int64_t r = 0; r < kLanes; ++r) dst[e * dst_stride + j + r] = element(j + r, e);
      }
    }
  }
  for (; j < num_k; ++j) {
    for (std::int64_t e = 0; e < dim; ++e) dst[e * dst_stride + j] = element(j, e);
  }
}

// Rows [j0, j0 + num_k) of V (p.v's strides, `dim` elements each, stored as T) as f32 columns:
// staged.buffer[e * kBlockK + j] = v[j0 + j][e], once per (rows, tile), whatever T. The value
// product then reads each column as one ascending run (TileRows: row stride 1, element stride
// kBlockK). Read where they lie, V's rows are Hkv * Dv elements apart (BSHD): each pass of the
// micro-kernel over kRows columns touched num_k lines, often 4 KiB apart and so in one or two
// L1 sets, evicted before the next pass read their neighbouring columns (docs/kernels.md,
// "V staged as columns").
// With read_ahead, each square that starts a cache line of its rows asks for that line of the
// next kLanes rows of the tile.
template <typename T>
inline TileRows StageColumns(const void* rows, const std::int64_t* stride, std::int64_t dim,
                             std::int64_t j0, std::int64_t num_k, StagedRows& staged,
                             bool read_ahead = false) {
  const T* source = static_cast<const T*>(rows) + j0 * stride[1];
  const float* data = staged.Stage<float>(rows, j0, num_k, [&](float* dst) {
    if (read_ahead) {
      TransposeRows<T, true>(source, stride[1], stride[3], dim, num_k, dst, kBlockK);
    } else {
      TransposeRows<T>(source, stride[1], stride[3], dim, num_k, dst, kBlockK);
    }
  });
  return {data, 1, kBlockK};
}

// ---------------------------------------------------------------------------------------------
// Pair words for the vdpbf16ps products (kernels/cpu/bf16_dot.h; PairProducts in products-inl.h):
// two bf16 along the reduction axis in one uint32, each K and V tile once per (rows, tile) in
// the staging tiles, q once per block in qb.qt.

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
// (PairProducts::StartBlock). With unit stride along an even D a row already is its
// pair words: squares of them are transposed in registers as in PackQuery, the rest of the words
// lane by lane. Only lanes [0, lanes) (a multiple of kLanes): the AMX path's blocks of at most 32
// rows leave the other half alone (AmxProducts::Lanes).
inline void PackQueryPairs(const AttentionKernelParams& p, QueryBlock& qb,
                           std::int64_t lanes = kBlockQ) {
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
  for (std::int64_t l0 = 0; l0 < lanes; l0 += kLanes) {
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

// Keys [j0, j0 + num_k) as pair words along head_dim: [num_k][ceil(D / 2)].
inline const std::uint32_t* StageKeyPairs(const AttentionKernelParams& p, const QueryBlock& qb,
                                          std::int64_t j0, std::int64_t num_k, StagedRows& staged) {
  return staged.Stage<std::uint32_t>(qb.k, j0, num_k, [&](std::uint32_t* pairs) {
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
  });
}

// Values [j0, j0 + num_k) as pair words along the keys: [ceil(num_k / 2)][Dv] (an odd tile's
// last pair holds +0 for the key past the tile, which is never read: it may be padding).
inline const std::uint32_t* StageValuePairs(const AttentionKernelParams& p, const QueryBlock& qb,
                                            std::int64_t j0, std::int64_t num_k,
                                            StagedRows& staged) {
  return staged.Stage<std::uint32_t>(qb.v, j0, num_k, [&](std::uint32_t* pairs) {
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
  });
}

// ---------------------------------------------------------------------------------------------
// bf16 operands for the AMX tiles (kernels/cpu/amx.h; AmxProducts in products-inl.h), zero past
// their real extent up to the padded one, so the padding multiplies exact zeros.

// Keys [j0, j0 + num_k) as bf16 rows of `depth` (D rounded up to 32) elements, zero past D, and
// zero rows up to a multiple of 16: [round_up(num_k, 16)][depth].
inline const std::uint16_t* StageKeyTile(const AttentionKernelParams& p, const QueryBlock& qb,
                                         std::int64_t j0, std::int64_t num_k, std::int64_t depth,
                                         StagedRows& staged) {
  return staged.Stage<std::uint16_t>(qb.k, j0, num_k, [&](std::uint16_t* rows) {
    const std::uint16_t* k = static_cast<const std::uint16_t*>(qb.k);
    const std::int64_t d = p.head_dim;
    for (std::int64_t j = 0; j < num_k; ++j) {
      const std::uint16_t* src = k + (j0 + j) * p.k_stride[1];
      std::uint16_t* dst = rows + j * depth;
      if (p.k_stride[3] == 1) {
        std::memcpy(dst, src, d * sizeof(std::uint16_t));
      } else {
        for (std::int64_t e = 0; e < d; ++e) dst[e] = src[e * p.k_stride[3]];
      }
      std::fill(dst + d, dst + depth, std::uint16_t{0});
    }
    std::fill(rows + num_k * depth, rows + (num_k + 15) / 16 * 16 * depth, std::uint16_t{0});
  });
}

// bf16 columns vt[e][j] = v[j * row_stride + e * elem_stride] for e < round_up(dv, 16) and
// j < round_up(num_k, 32), zero past dv and num_k; rows of vt kBlockK elements apart. Built as
// pair words (two keys in one uint32, the layout a row of the tile reads): squares of 16 key
// pairs x kLanes value dims are transposed in registers where elem_stride is 1.
inline void StageColumnsBf16(const std::uint16_t* v, std::int64_t row_stride,
                             std::int64_t elem_stride, std::int64_t dv, std::int64_t num_k,
                             std::uint16_t* vt) {
  std::uint32_t* words = reinterpret_cast<std::uint32_t*>(vt);
  constexpr std::int64_t kRowWords = kBlockK / 2;
  const std::int64_t rows = (dv + 15) / 16 * 16;
  const std::int64_t pairs = (num_k + 31) / 32 * 16;
  const auto element = [&](std::int64_t j, std::int64_t e) -> std::uint32_t {
    return j < num_k && e < dv ? v[j * row_stride + e * elem_stride] : 0;
  };
  std::int64_t t0 = 0, e_squares = 0;
#if HWY_TARGET != HWY_SCALAR
  using DU = hn::RebindToUnsigned<DF>;  // kLanes pair words
  const DU du;
  const hn::Rebind<std::uint16_t, DU> du16;  // kLanes bf16
  if (elem_stride == 1) {
    e_squares = dv / kLanes * kLanes;
    for (; 2 * (t0 + kLanes) <= num_k; t0 += kLanes) {
      for (std::int64_t e0 = 0; e0 < e_squares; e0 += kLanes) {
        hn::Vec<DU> w[kLanes];
        HWY_UNROLL(16)
        for (std::int64_t r = 0; r < kLanes; ++r) {
          const std::uint16_t* lo = v + 2 * (t0 + r) * row_stride + e0;
          const auto lo_words = hn::PromoteTo(du, hn::LoadU(du16, lo));
          const auto hi_words = hn::PromoteTo(du, hn::LoadU(du16, lo + row_stride));
          w[r] = hn::Or(lo_words, hn::ShiftLeft<16>(hi_words));
        }
        TransposeSquare(du, w);
        HWY_UNROLL(16)
        for (std::int64_t c = 0; c < kLanes; ++c) {
          hn::StoreU(w[c], du, words + (e0 + c) * kRowWords + t0);
        }
      }
    }
  }
#endif
  // The rest: the value dims past the squares for the squares' pairs, then every dim of the
  // remaining pairs (and the zero padding).
  for (std::int64_t e = e_squares; e < rows; ++e) {
    for (std::int64_t t = 0; t < t0; ++t) {
      words[e * kRowWords + t] = element(2 * t, e) | element(2 * t + 1, e) << 16;
    }
  }
  for (std::int64_t e = 0; e < rows; ++e) {
    for (std::int64_t t = t0; t < pairs; ++t) {
      words[e * kRowWords + t] = element(2 * t, e) | element(2 * t + 1, e) << 16;
    }
  }
}

// Values [j0, j0 + num_k) as bf16 columns (StageColumnsBf16): vt[e][j] = v[j0 + j][e].
inline const std::uint16_t* StageValueTile(const AttentionKernelParams& p, const QueryBlock& qb,
                                           std::int64_t j0, std::int64_t num_k,
                                           StagedRows& staged) {
  return staged.Stage<std::uint16_t>(qb.v, j0, num_k, [&](std::uint16_t* vt) {
    StageColumnsBf16(static_cast<const std::uint16_t*>(qb.v) + j0 * p.v_stride[1], p.v_stride[1],
                     p.v_stride[3], p.head_dim_v, num_k, vt);
  });
}

// ---------------------------------------------------------------------------------------------
// f16 operands for the AMX tiles, which multiply bf16 only: each f16 value x becomes two bf16,
// hi = bf16(x) (to nearest even) and lo = bf16(x - hi). x has 11 significant bits and hi its
// first 8, so x - hi has at most 3 and lo is exact: x = hi + lo, and q . k is
// qh . kh + qh . kl + ql . kh up to the ql . kl term (2^-16 of |q| |k|, below f16's own rounding).
// The products therefore lose nothing f16 had; AmxProducts<hwy::float16_t> in products-inl.h.

struct SplitBf16 {
  std::uint16_t hi = 0, lo = 0;
};

// x = hi + lo for the f16 `bits` (inf and NaN: hi carries them, lo = 0).
HWY_INLINE SplitBf16 SplitF16(std::uint16_t bits) {
  const float x = f16_bits_to_f32(bits);
  const std::uint16_t hi = f32_to_bf16_bits(x);
  if (!std::isfinite(x)) return {hi, 0};
  return {hi, f32_to_bf16_bits(x - bf16_bits_to_f32(hi))};
}

// SplitF16 on kLanes f16 at src (unaligned): hi and lo as the bits of kLanes bf16.
HWY_INLINE void SplitF16Lanes(const hwy::float16_t* src, std::uint16_t* hi, std::uint16_t* lo) {
  const DF df;
  using DU = hn::RebindToUnsigned<DF>;
  const DU du;
  const hn::Rebind<std::uint16_t, DU> du16;
  const VF x = LoadWide(df, src);  // exact
  const auto hi_bits = Bf16BitsNearestEven(df, x);
  const VF rest = hn::Sub(x, hn::BitCast(df, hn::ShiftLeft<16>(hi_bits)));  // exact
  const auto lo_bits =
      hn::ShiftRight<16>(hn::BitCast(du, hn::IfThenElseZero(hn::IsFinite(x), rest)));
  hn::StoreU(hn::TruncateTo(du16, hi_bits), du16, hi);
  hn::StoreU(hn::TruncateTo(du16, lo_bits), du16, lo);
}

// hi[i], lo[i] = the parts of row[i * stride] for i < n (SplitF16Lanes where stride is 1, the
// rest one by one), and zero for n <= i < padded.
HWY_INLINE void SplitRow(const hwy::float16_t* row, std::int64_t n, std::int64_t stride,
                         std::int64_t padded, std::uint16_t* hi, std::uint16_t* lo) {
  const std::int64_t lanes = stride == 1 ? n / kLanes * kLanes : 0;
  for (std::int64_t i = 0; i < lanes; i += kLanes) SplitF16Lanes(row + i, hi + i, lo + i);
  for (std::int64_t i = lanes; i < n; ++i) {
    const SplitBf16 x = SplitF16(row[i * stride].bits);
    hi[i] = x.hi;
    lo[i] = x.lo;
  }
  std::fill(hi + n, hi + padded, std::uint16_t{0});
  std::fill(lo + n, lo + padded, std::uint16_t{0});
}

// The parts of element d of row `row` (q: p's strides along D), zero past D.
HWY_INLINE SplitBf16 SplitAt(const void* base, std::int64_t row, std::int64_t d,
                             const AttentionKernelParams& p, std::int64_t d_stride) {
  if (d >= p.head_dim) return {};
  return SplitF16(static_cast<const std::uint16_t*>(base)[row + d * d_stride]);
}

// qt as three segments of pair rows, each D rounded up to 32 (AmxDepth / 2 rows in all):
// (qh[2t], qh[2t + 1]), the same again, then (ql[2t], ql[2t + 1]); unscaled, zero past num_q
// and D, lanes [0, lanes) only (as PackQueryPairs). The K rows (StageKeySplit) hold kh, kl, kh, so
// one tile product over the three segments sums qh . kh + qh . kl + ql . kh.
inline void PackQuerySplit(const AttentionKernelParams& p, QueryBlock& qb,
                           std::int64_t lanes = kBlockQ) {
  std::uint32_t* qt = reinterpret_cast<std::uint32_t*>(qb.qt);
  const std::int64_t segment = AmxDepth(p) / 6;  // pair rows
  for (std::int64_t l = 0; l < lanes; ++l) {
    const bool real = l < qb.num_q;
    const std::int64_t row = real ? LaneRow(p.q_stride, qb, l) : 0;
    for (std::int64_t t = 0; t < segment; ++t) {
      SplitBf16 a, b;
      if (real) {
        a = SplitAt(p.q, row, 2 * t, p, p.q_stride[3]);
        b = SplitAt(p.q, row, 2 * t + 1, p, p.q_stride[3]);
      }
      const std::uint32_t hi = a.hi | static_cast<std::uint32_t>(b.hi) << 16;
      qt[t * kBlockQ + l] = hi;
      qt[(segment + t) * kBlockQ + l] = hi;
      qt[(2 * segment + t) * kBlockQ + l] = a.lo | static_cast<std::uint32_t>(b.lo) << 16;
    }
  }
}

// Keys [j0, j0 + num_k) as bf16 rows of AmxDepth elements: kh, kl, kh, each segment D rounded
// up to 32 and zero past D, and zero rows up to a multiple of 16.
inline const std::uint16_t* StageKeySplit(const AttentionKernelParams& p, const QueryBlock& qb,
                                          std::int64_t j0, std::int64_t num_k, StagedRows& staged) {
  return staged.Stage<std::uint16_t>(qb.k, j0, num_k, [&](std::uint16_t* rows) {
    const std::int64_t depth = AmxDepth(p), segment = depth / 3;
    const auto* k = static_cast<const hwy::float16_t*>(qb.k);
    for (std::int64_t j = 0; j < num_k; ++j) {
      std::uint16_t* dst = rows + j * depth;
      SplitRow(k + (j0 + j) * p.k_stride[1], p.head_dim, p.k_stride[3], segment, dst,
               dst + segment);
      std::memcpy(dst + 2 * segment, dst, segment * sizeof(std::uint16_t));
    }
    std::fill(rows + num_k * depth, rows + (num_k + 15) / 16 * 16 * depth, std::uint16_t{0});
  });
}

// Values [j0, j0 + num_k) as two sets of bf16 columns (StageColumnsBf16's layout: vt[e][j], rows
// kBlockK elements apart, zero past Dv and num_k up to round_up(num_k, 32)): the hi parts, then,
// round_up(Dv, 16) rows further, the lo parts. The rows are split first into two [num_k][Dv]
// scratch tiles past the columns (StagedVFloats), then transposed.
inline const std::uint16_t* StageValueSplit(const AttentionKernelParams& p, const QueryBlock& qb,
                                            std::int64_t j0, std::int64_t num_k,
                                            StagedRows& staged) {
  return staged.Stage<std::uint16_t>(qb.v, j0, num_k, [&](std::uint16_t* hi) {
    const std::int64_t dv = p.head_dim_v, rows = (dv + 15) / 16 * 16;
    std::uint16_t* lo = hi + rows * kBlockK;
    std::uint16_t* hi_rows = lo + rows * kBlockK;  // [kBlockK][dv] each
    std::uint16_t* lo_rows = hi_rows + kBlockK * dv;
    const auto* v = static_cast<const hwy::float16_t*>(qb.v) + j0 * p.v_stride[1];
    for (std::int64_t j = 0; j < num_k; ++j) {
      SplitRow(v + j * p.v_stride[1], dv, p.v_stride[3], dv, hi_rows + j * dv, lo_rows + j * dv);
    }
    StageColumnsBf16(hi_rows, dv, 1, dv, num_k, hi);
    StageColumnsBf16(lo_rows, dv, 1, dv, num_k, lo);
  });
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_TILE_STAGING_INL_H_
