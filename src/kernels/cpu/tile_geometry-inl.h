// The tile geometry and a query block's state, shared by the flash, chunked and backward CPU
// kernels (Highway, one copy per target). The rest of the tile machinery, one concept per file:
// tile_products-inl.h (the f32 micro-kernel), tile_staging-inl.h (packing q, staging K and V),
// sparse_tiles-inl.h, score_masks-inl.h, online_softmax-inl.h, query_block-inl.h (a block's start
// and finish), products-inl.h (the product paths), decode_walk-inl.h (the decode path).
//
// Layout idea: scores are kept TRANSPOSED, st[key][query], with the queries of one block along
// the SIMD lanes. Then everything that is per query (running max, running sum, rescale factor,
// allowed key range) is lane-wise, softmax needs no horizontal reductions, and K and V are read
// through scalar broadcasts. q is packed once per query block, as q^T * scale; an f32 K is read
// where it lies, and V is staged as columns vt[Dv][keys] once per tile (tile_staging-inl.h).
//
//   qt: [D][kBlockQ]    st: [keys][kBlockQ]    ot: [Dv][kBlockQ]  (out^T, unnormalised)
//
// Both products are the same rank-1-update micro-kernel (OuterProductRows):
//   st[j][:] = sum_d  k[j][d] * qt[d][:]          (R keys at a time)
//   ot[e][:] = alpha * ot[e][:] + sum_j vt[e][j] * st[j][:]  (R value dims at a time)

#if defined(QKV_KERNELS_CPU_TILE_GEOMETRY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_TILE_GEOMETRY_INL_H_
#undef QKV_KERNELS_CPU_TILE_GEOMETRY_INL_H_
#else
#define QKV_KERNELS_CPU_TILE_GEOMETRY_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/float16.h"
#include "hwy/highway.h"
#include "kernels/kernel_params.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Tile geometry for this target (x86 targets have a fixed vector length).
constexpr std::int64_t kLanes = HWY_LANES(float);
// Query vectors per block: as many accumulators as the register file holds comfortably
// (AVX-512: 32 registers -> kRows x 4 accumulators; AVX2: 16 -> kRows x 2).
constexpr int kQueryVecs = kLanes == 8 ? 2 : 4;
constexpr std::int64_t kBlockQ = kQueryVecs * kLanes;  // queries per block
// Keys per tile. AVX2: 64, so the staged K or V tile of the product at hand stays in L1 beside
// q^T, st and out^T (16 KiB at D = 64; 128 keys, 32 KiB, spilled to L2): 1.00-1.11x at B = 1,
// H = 8, L = 1024-16384, D = 64 and 128, causal or not, 2 threads (docs/kernels.md, "AVX2").
constexpr std::int64_t kBlockK = kLanes == 8 ? 64 : 128;
// Whether an f32 K tile is copied into contiguous rows once per task (StageRows) rather than
// read where it lies by every query block. AVX2: yes; in BSHD at D = 128 its rows are 4 KiB
// apart, so the 64 rows of a tile fall into the same 8 L1 sets and each block read them again
// from L2. Staged (Zen 3, 2 threads, L = 4096-16384): BSHD 1.07-1.12x at D = 128, 1.00x at
// D = 64; BHSD 1.02x and 1.06x. AVX-512 (128-key tiles) reads in place, as measured before.
constexpr bool kStagesF32Rows = kLanes == 8;
// Micro-kernel rows (keys or value dims): kRows x kQueryVecs accumulators. AVX2 has 6 x 2 (12
// chains, 15 of its 16 registers): on Zen 3 the rate grows with the chains well past the 8 that
// two pipes of 4 cycles' latency would seem to need; a lone loop over a 64-deep tile in L1 ran
// 4 x 2 at 55%, 5 x 2 at 65-73%, 6 x 2 at 79-91% and 7 x 2 (a q vector then read from memory)
// at 74% of the FMA peak, interleaved in one process (docs/kernels.md, "AVX2: 6 x 2"). AVX-512
// has 6 x 4 (24 chains, 29 of its 32 registers): on the Intel AMX Xeon the lone loop ran 4 x 4
// at 85-86% of the FMA peak and 6 x 4 at 89-93%, and the flash kernel 1.02-1.07x faster; on
// Zen 4, 4 x 4 and 6 x 4 run the kernel alike (0.99-1.02x; docs/kernels.md, "AVX-512: 6 x 4").
constexpr int kRows = kLanes >= 8 ? 6 : 4;
// Query blocks sharing one K/V walk (flash_forward.cc's work plan): 1024 queries on AVX-512 and
// on AVX2 (whose blocks are 4x narrower), so a staged K/V tile serves as many queries.
constexpr std::int64_t kMaxBlocksPerTask = kLanes == 8 ? 64 : 16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0x1.62e43p-1f;  // ln(2) rounded to float
// QueryBlock::lane_anchor of a lane that attends any key of its band (query positions can be
// negative: bottom-right alignment with Lq > Lk).
constexpr std::int64_t kAnyKey = std::numeric_limits<std::int64_t>::min();

// Asks for the cache line holding p toward L2 (prefetcht1 on x86; a no-op where the target has
// no prefetch).
HWY_INLINE void PrefetchL2(const void* p) { __builtin_prefetch(p, 0, 2); }
// The same toward L1 (prefetcht0), as a volatile asm statement on x86: GCC 12 took a helper made
// of nothing but __builtin_prefetch calls (PrefetchOutRows) for a const call and deleted it
// (as it once did bf16dot's, bf16_narrow_avx512.cc, prefetch_line; tests/codegen).
HWY_INLINE void PrefetchL1(const void* p) {
#if HWY_ARCH_X86
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}
// The cache lines of bytes bytes from row on, toward L1 (PrefetchL1 per 64 bytes).
HWY_INLINE void PrefetchLinesL1(const void* row, std::int64_t bytes) {
  const char* first = static_cast<const char*>(row);
  for (std::int64_t x = 0; x < bytes; x += 64) PrefetchL1(first + x);
}

template <typename T>
HWY_INLINE float WideElement(T x);

// kLanes elements of an f32, bf16 or f16 row (T = float, hwy::bfloat16_t, hwy::float16_t) as
// f32 (exact), and one element. (On HWY_SCALAR, Highway 1.0.3 widens f16 by bit arithmetic that
// turns inf into 65536 and NaN into finite values; the one lane is widened as WideElement does.
// The x86 targets use the hardware conversion, which keeps them. test_f16_split.cc.)
template <typename T>
HWY_INLINE VF LoadWide(DF df, const T* HWY_RESTRICT src) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, src);
  } else {
#if HWY_TARGET == HWY_SCALAR
    if constexpr (std::is_same_v<T, hwy::float16_t>) return hn::Set(df, WideElement(*src));
#endif
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<T, DF>(), src));
  }
}
template <typename T>
HWY_INLINE float WideElement(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    return bf16_bits_to_f32(x.bits);
  } else {
    return f16_bits_to_f32(x.bits);
  }
}

// The bf16 bits of x's lanes (in the low 16 bits of each u32 lane), rounded to nearest even as
// f32_to_bf16_bits does (NaN: its top half with the quiet bit set); Highway 1.0.3's DemoteTo
// truncates.
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Bf16BitsNearestEven(DF, VF x) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, x);
  const auto odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(odd, hn::Set(du, 0x7fffu))));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)),
                        hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x40u)), rounded);
}

// dst[0 : kLanes] = x rounded to nearest even as `dtype` (kBF16 or kF16) bits, the bits
// f32_to_half_bits gives (a NaN stays a NaN). bf16 in integer operations (Bf16BitsNearestEven),
// f16 by the hardware conversion (vcvtps2ph, F16C), element by element on
// HWY_SCALAR (whose DemoteTo truncates too).
HWY_INLINE void StoreHalfLanes(DType dtype, DF df, VF x, std::uint16_t* HWY_RESTRICT dst) {
  if (dtype == DType::kBF16) {
    const hn::Rebind<std::uint16_t, hn::RebindToUnsigned<DF>> du16;
    hn::StoreU(hn::TruncateTo(du16, Bf16BitsNearestEven(df, x)), du16, dst);
    return;
  }
#if HWY_TARGET == HWY_SCALAR
  dst[0] = f32_to_f16_bits(hn::GetLane(x));
#else
  const hn::Rebind<hwy::float16_t, DF> df16;
  hn::StoreU(hn::DemoteTo(df16, x), df16, reinterpret_cast<hwy::float16_t*>(dst));
#endif
}

// Per-thread state of one query block. The rows of a block come from the flattened
// (query head in the GQA group, query) space of one kv head: row r is query r % Lq of head
// kv_head * group + r / Lq. For Lq >= kBlockQ a block lies within one head; for decoding
// (Lq = 1) the heads of a group share one block, and one K/V walk.
struct QueryBlock {
  // Scratch (sized by the caller, see ScratchFloats / ScratchInts).
  float* qt;         // [D][kBlockQ]   q^T * scale; zero in lanes past num_q (QtRows rows)
  float* ot;         // [Dv][kBlockQ]  unnormalised out^T (OtRows rows)
  float* row_max;    // [kBlockQ]      running max of the scores times log2(e) (base 2)
  float* row_sum;    // [kBlockQ]      running sum of 2^(score * log2(e) - row_max)
  float* alpha;      // [kBlockQ]      rescale factor of the current tile
  std::int64_t* lo;  // [kBlockQ]      allowed keys of each lane: [lo, hi); lo = hi = 0 if none
  std::int64_t* hi;
  std::int64_t* head;   // [kBlockQ]   query head of each lane
  std::int64_t* query;  // [kBlockQ]   query index of each lane
  // Sparsity (p.sparse.kind != kNone; see StartSparseBlock), per lane:
  std::int64_t* band_lo;  // kBand: the lane's band keys [band_lo, band_hi) (all keys for a global
  std::int64_t* band_hi;  //        query); kBlock: unused
  std::int64_t* lane_anchor;  // kBand, dilation > 1: the lane's query position (kAnyKey: any)
  std::int64_t* run_lane;     // kBlock: lanes with the same layout row form runs: run r is lanes
  std::int64_t* run_row;  //         [run_lane[r], run_lane[r + 1]) reading layout row run_row[r]
  std::int64_t num_runs;
  // Hull of the keys the sparsity allows to some lane, and (kBand, dilation 1) the keys it
  // allows to every lane: tiles inside [exact_begin, exact_end) need no per-pair predicate.
  std::int64_t sparse_begin, sparse_end, exact_begin, exact_end;
  std::int64_t band_begin, band_end;  // kBand: hull of the lanes' bands (globals not included)
  // Position.
  std::int64_t b, num_q;  // num_q: lanes in use
  // Union of the allowed key ranges: tiles outside [key_begin, key_end) are skipped.
  std::int64_t key_begin, key_end;
  const void* k;  // k[b, 0, kv_head, 0], stored as p.dtype
  const void* v;  // v[b, 0, kv_head, 0]
};

// The query vectors that hold a block's rows (the lanes of the later ones are all past num_q).
inline int UsedQueryVecs(const QueryBlock& qb) {
  return static_cast<int>((qb.num_q + kLanes - 1) / kLanes);
}

// The keys of a tile [j0, j0 + num_k) each query vector of a block needs: vector x computes the
// tile's keys [0, end[x]) and skips the rest, which lie past every allowed key of its lanes (they
// could only give -inf scores and zero probabilities). end[x] is the running max over vectors
// 0..x of their lanes' allowed ends, rounded up to even (the vdpbf16ps value product reads keys
// in pairs), within [0, num_k]; it never decreases and the last is num_k. On the causal diagonal
// the leading vectors skip the keys after their queries: of a 64 x 64 diagonal square, 10 of
// the 16 squares of 16 x 16 are computed. ends() is null when every vector needs every key.
struct VecKeys {
  std::int64_t end[kQueryVecs];
  bool all;
  const std::int64_t* ends() const { return all ? nullptr : end; }
};
inline VecKeys TileVecKeys(const std::int64_t* hi, std::int64_t j0, std::int64_t num_k) {
  VecKeys keys;
  keys.all = true;
  std::int64_t running = 0;
  for (int x = 0; x < kQueryVecs; ++x) {
    for (std::int64_t l = x * kLanes; l < (x + 1) * kLanes; ++l) {
      running = std::max(running, std::min(hi[l] - j0, num_k));
    }
    keys.end[x] = x + 1 < kQueryVecs ? std::min(num_k, (running + 1) / 2 * 2) : num_k;
    keys.all = keys.all && keys.end[x] == num_k;
  }
  return keys;
}

// bf16 elements of a q or K row on the AMX tiles: D rounded up to 32, and for f16, whose values
// the tiles take as bf16 hi + lo parts, three such segments (AmxProducts in products-inl.h).
inline std::int64_t AmxDepth(const AttentionKernelParams& p) {
  const std::int64_t padded = (p.head_dim + 31) / 32 * 32;
  return p.dtype == DType::kF16 ? 3 * padded : padded;
}

// Rows of a block's qt and ot: D and Dv, padded for the AMX tiles, whose q pairs cover
// AmxDepth and whose outputs come 16 value dims at a time. (The padding rows hold zeros; no
// other path reads them.)
inline std::int64_t QtRows(const AttentionKernelParams& p) {
  return std::max(p.head_dim, AmxDepth(p) / 2);
}
inline std::int64_t OtRows(const AttentionKernelParams& p) { return (p.head_dim_v + 15) / 16 * 16; }

// Scratch one QueryBlock needs: floats, and int64s.
inline std::int64_t ScratchFloats(const AttentionKernelParams& p) {
  return (QtRows(p) + OtRows(p) + 3) * kBlockQ;
}
constexpr std::int64_t kScratchInts = 9 * kBlockQ + 1;

// Query rows per kv head of a batch entry: the (query head in the GQA group, query) rows that
// share one K/V walk (1 for a multi-head decode step).
inline std::int64_t RowsPerKvHead(const AttentionKernelParams& p) {
  return p.num_heads_q / p.num_heads_kv * p.seq_q;
}

// Query blocks per kv head of batch entry: those rows in blocks of kBlockQ.
inline std::int64_t BlocksPerKvHead(const AttentionKernelParams& p) {
  return (RowsPerKvHead(p) + kBlockQ - 1) / kBlockQ;
}

inline void BindScratch(const AttentionKernelParams& p, float* floats, std::int64_t* ints,
                        QueryBlock& qb) {
  qb.qt = floats;
  qb.ot = qb.qt + QtRows(p) * kBlockQ;
  qb.row_max = qb.ot + OtRows(p) * kBlockQ;
  qb.row_sum = qb.row_max + kBlockQ;
  qb.alpha = qb.row_sum + kBlockQ;
  qb.lo = ints;
  qb.hi = ints + kBlockQ;
  qb.head = ints + 2 * kBlockQ;
  qb.query = ints + 3 * kBlockQ;
  qb.band_lo = ints + 4 * kBlockQ;
  qb.band_hi = ints + 5 * kBlockQ;
  qb.lane_anchor = ints + 6 * kBlockQ;
  qb.run_row = ints + 7 * kBlockQ;
  qb.run_lane = ints + 8 * kBlockQ;  // kBlockQ + 1 entries
}

// Keys [lo, hi) that query `query` of batch entry b may attend under causal, window and key
// lengths (lo = hi = 0: none).
struct KeyRange {
  std::int64_t lo, hi;
};
inline KeyRange LaneKeys(const AttentionKernelParams& p, std::int64_t b, std::int64_t query) {
  const std::int64_t key_length = p.key_lengths != nullptr ? p.key_lengths[b] : p.seq_kv;
  const std::int64_t diag = query + p.diagonal_offset;
  const std::int64_t lo = p.window_left < 0 ? 0 : std::max<std::int64_t>(0, diag - p.window_left);
  const std::int64_t hi = p.window_right < 0
                              ? key_length
                              : std::min<std::int64_t>(key_length, diag + p.window_right + 1);
  return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};
}

// Offset (in elements) of lane l's row in a [B, Lq, Hq, ...] operand with these strides (q, out).
inline std::int64_t LaneRow(const std::int64_t* stride, const QueryBlock& qb, std::int64_t l) {
  return qb.b * stride[0] + qb.query[l] * stride[1] + qb.head[l] * stride[2];
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_TILE_GEOMETRY_INL_H_
