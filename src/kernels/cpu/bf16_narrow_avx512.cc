// The decode (narrow) products of bf16_dot.h on vdpbf16ps, in raw intrinsics. Compiled with the
// same AVX-512 flags as bf16_dot_avx512.cc and under the same ODR rule (see there): intrinsics,
// plain loops and builtins only, no STL, helpers with internal linkage. Callers reach these
// functions only after bf16dot::available().
//
// A decode block has a few query rows (4 for GQA 32:8) and thousands of keys, so the lanes run
// along head_dim instead of along the queries (as the flash kernel's decode path does in f32):
//   scores: acc[r][j] += dot2(k pairs of key j, q pairs of row r), 16 pairs per zmm, then one
//           lane sum per (r, j), four at a time by a transposing tree;
//   values: two V rows (keys 2t and 2t + 1) interleaved into pairs along the keys by vpermt2w,
//           against the broadcast probability pair of each row.
// Compared with widening bf16 to f32 in registers, a K or V byte costs half the multiply-adds
// and no conversion.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/bf16_dot.h"

namespace qkv::bf16dot {
namespace {

constexpr int kPairs = 16;   // pair words (32 bf16) per zmm
constexpr int kRows = 4;     // query rows per micro-kernel call
constexpr int kColVecs = 4;  // f32 vectors of output columns per values call (64 columns)

inline __m512bh as_pairs(__m512i words) { return (__m512bh)words; }

// The first n (0 .. 32) bits set.
inline __mmask32 first_bits32(std::int64_t n) {
  return n >= 32 ? ~__mmask32{0} : n <= 0 ? __mmask32{0} : (__mmask32{1} << n) - 1;
}
inline __mmask16 first_bits16(std::int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Full masks: the zero-masking forms with full masks are the plain instructions (GCC 12's
// unmasked intrinsics warn spuriously, -Wmaybe-uninitialized on their undefined pass-through).
constexpr __mmask16 kAll16 = 0xffff;
constexpr __mmask8 kAll8 = 0xff;

// Two interleave levels: each 128-bit block of the result holds that block's part of the lane
// sums of a, b, c and d, in that order.
inline __m512 block_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab =
      _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll16, a, b), _mm512_maskz_unpackhi_ps(kAll16, a, b));
  const __m512 cd =
      _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll16, c, d), _mm512_maskz_unpackhi_ps(kAll16, c, d));
  const __m512d ab_d = _mm512_castps_pd(ab), cd_d = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, ab_d, cd_d)),
                       _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, ab_d, cd_d)));
}

// The lane sums of a, b, c and d, in that order: block_sums4, then the four blocks are added.
inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 u = block_sums4(a, b, c, d);
  const __m256 h = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(kAll8, u, 0),
                                 _mm512_maskz_extractf32x8_ps(kAll8, u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The lane sums of x[0 .. 15]: lane i of the result is the sum of the lanes of x[i].
// block_sums4 of each four (c[m] for x[4m .. 4m + 3]), then two levels of 128-bit block shuffles
// add the blocks: 45 operations for 16 sums where lane_sums4 takes 60.
inline __m512 lane_sums16(const __m512* x) {
  __m512 c[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) c[m] = block_sums4(x[4 * m], x[4 * m + 1], x[4 * m + 2], x[4 * m + 3]);
  // d01 blocks: c0.b0 + c0.b2, c0.b1 + c0.b3, c1.b0 + c1.b2, c1.b1 + c1.b3 (d23 likewise).
  const __m512 d01 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll16, c[0], c[1], 0x44),
                                   _mm512_maskz_shuffle_f32x4(kAll16, c[0], c[1], 0xee));
  const __m512 d23 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll16, c[2], c[3], 0x44),
                                   _mm512_maskz_shuffle_f32x4(kAll16, c[2], c[3], 0xee));
  // Blocks: the whole sums of c0, c1, c2, c3.
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll16, d01, d23, 0x88),
                       _mm512_maskz_shuffle_f32x4(kAll16, d01, d23, 0xdd));
}

// The scores of H heads x J keys x R rows at once (H * J * R = 16, 4 or 1 accumulators): 16 pairs
// of head_dim per step; a last partial step masks both operands to the elements left (so an odd
// depth reads nothing past the row). Each head's query rows are loaded once per step and serve
// its J keys. Accumulator (h, i, r) ends in st + h * st_head_stride + i * st_row_stride + r.
// Every lane sum takes the same additions whatever the grouping (lane_sums16 and lane_sums4 add
// the same pairs in the same order), so the scores do not depend on the walk.
template <int H, int J, int R>
__attribute__((always_inline)) inline void scores_block(const NarrowScores& a, std::int64_t words,
                                                        const std::uint32_t* __restrict q,
                                                        const std::uint16_t* __restrict k,
                                                        float* __restrict st, __m512 scale) {
  constexpr int kAcc = H * J * R;
  static_assert(kAcc == 16 || kAcc == 4 || kAcc == 1);
  __m512 acc[kAcc];
#pragma GCC unroll 16
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_setzero_ps();
  const auto step = [&](std::int64_t t, __mmask32 k_mask, __mmask16 q_mask)
                        __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      __m512bh query[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        query[r] = as_pairs(
            _mm512_maskz_loadu_epi32(q_mask, q + h * a.q_head_stride + r * words + t));
      }
#pragma GCC unroll 16
      for (int i = 0; i < J; ++i) {
        const __m512bh key = as_pairs(_mm512_maskz_loadu_epi16(
            k_mask, k + h * a.k_head_stride + i * a.k_row_stride + 2 * t));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[(h * J + i) * R + r] = _mm512_dpbf16_ps(acc[(h * J + i) * R + r], key, query[r]);
        }
      }
    }
  };
  const std::int64_t full = a.depth / (2 * kPairs) * kPairs;  // words in whole 32-element steps
  for (std::int64_t t = 0; t < full; t += kPairs) step(t, ~__mmask32{0}, __mmask16(0xffff));
  if (full < words) step(full, first_bits32(a.depth - 2 * full), first_bits16(words - full));

  // sums[(h * J + i) * R + r]: head h, key i, row r.
  alignas(64) float sums[16];
  if constexpr (kAcc == 16) {
    _mm512_store_ps(sums, _mm512_mul_ps(lane_sums16(acc), scale));
  } else {  // 4 or 1 accumulators (zero vectors fill the tree)
    __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
#pragma GCC unroll 4
    for (int i = 0; i < kAcc; ++i) part[i] = acc[i];
    const __m128 s = lane_sums4(part[0], part[1], part[2], part[3]);
    _mm_store_ps(sums, _mm_mul_ps(s, _mm_set1_ps(a.out_scale)));
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
#pragma GCC unroll 16
    for (int i = 0; i < J; ++i) {
      float* row = st + h * a.st_head_stride + i * a.st_row_stride;
      const float* sum = sums + (h * J + i) * R;
      if constexpr (R == kRows) {  // one head's four rows are neighbours in st
        _mm_storeu_ps(row, _mm_loadu_ps(sum));
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) row[r] = sum[r];
      }
    }
  }
}

// Keys [j, j + J) of heads [n, n + H) (4 x 1 or 1 x 16 or 1 x 1), every row: blocks of kRows
// rows (H heads x 4 / H keys each), then single rows (H heads x J keys each).
template <int H, int J>
__attribute__((always_inline)) inline void scores_keys(const NarrowScores& a, std::int64_t words,
                                                       std::int64_t n, std::int64_t j,
                                                       __m512 scale) {
  static_assert(H * J == 16 || H * J == 4 || H * J == 1);
  constexpr int kRowKeys = J < 4 / H ? J : 4 / H;
  const std::uint32_t* q = a.q + n * a.q_head_stride;
  const std::uint16_t* k = a.k + n * a.k_head_stride + j * a.k_row_stride;
  float* st = a.st + n * a.st_head_stride + j * a.st_row_stride;
  std::int64_t r = 0;
  for (; r + kRows <= a.rows; r += kRows) {
#pragma GCC unroll 4
    for (int i = 0; i < J; i += kRowKeys) {
      scores_block<H, kRowKeys, kRows>(a, words, q + r * words, k + i * a.k_row_stride,
                                       st + i * a.st_row_stride + r, scale);
    }
  }
  for (; r < a.rows; ++r) scores_block<H, J, 1>(a, words, q + r * words, k, st + r, scale);
}

// The line of p toward L2 (prefetcht1). A volatile asm statement, not _mm_prefetch: GCC 12 takes
// _mm_prefetch for a "looping const" function, and a helper or lambda made of nothing but
// prefetches can then be deleted as a const call whose result is unused once -ffinite-loops
// drops the "looping". It was: reading one more NarrowScores field in the score walk's prefetch
// lambda removed every prefetch from narrow_scores, K's included (BSHD GQA decode 0.55x).
__attribute__((always_inline)) inline void prefetch_line(const char* p) {
  asm volatile("prefetcht1 %0" : : "m"(*p));
}

// Toward L2: the lines of [first, first + bytes).
__attribute__((always_inline)) inline void prefetch_lines(const char* first, std::int64_t bytes) {
  for (std::int64_t x = 0; x < bytes; x += 64) prefetch_line(first + x);
}

// NarrowValues' prefetch: the lines of [next, end) toward L2, `step` bytes per advance().
// (_mm_prefetch is safe here: advance() moves `next`, so no pass takes it for a const call; as
// prefetch_line, the value walk ran 1-3% slower.)
struct PrefetchSpan {
  const char* next = nullptr;
  const char* end = nullptr;
  std::int64_t step = 0;

  __attribute__((always_inline)) void advance() {
    for (std::int64_t x = 0; x < step && next < end; x += 64, next += 64) {
      _mm_prefetch(next, _MM_HINT_T1);
    }
  }
};

// Values of R rows (4 or 1) for output columns [0, 64) of v and o: R x 4 accumulators (16
// columns each), loaded from o and stored back once per call; columns past `cols` are masked off
// in every load and store. Each key pair advances the prefetch.
template <int R>
__attribute__((always_inline)) inline void values_block(
    PrefetchSpan& prefetch, const std::uint32_t* __restrict pp,
    std::int64_t pp_row_stride, const std::uint16_t* __restrict v, std::int64_t v_row_stride,
    std::int64_t num_k, std::int64_t cols, float* __restrict o, std::int64_t o_row_stride) {
  // vpermt2w indices: words 2i <- lo row word i (index i), 2i + 1 <- hi row word i (32 + i),
  // for the low 16 columns of a 32-column load, then for the high 16.
  alignas(64) static const std::uint16_t kLowPairs[32] = {
      0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const std::uint16_t kHighPairs[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low_pairs = _mm512_load_si512(kLowPairs);
  const __m512i high_pairs = _mm512_load_si512(kHighPairs);
  const __mmask32 v_mask[2] = {first_bits32(cols), first_bits32(cols - 32)};
  __mmask16 o_mask[kColVecs];
#pragma GCC unroll 4
  for (int c = 0; c < kColVecs; ++c) o_mask[c] = first_bits16(cols - 16 * c);

  __m512 acc[R][kColVecs];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kColVecs; ++c) {
      acc[r][c] = _mm512_maskz_loadu_ps(o_mask[c], o + r * o_row_stride + 16 * c);
    }
  }
  for (std::int64_t t = 0; 2 * t < num_k; ++t) {
    prefetch.advance();
    const std::uint16_t* lo_row = v + 2 * t * v_row_stride;
    const bool has_hi = 2 * t + 1 < num_k;  // odd num_k: the last pair is (value, 0)
    __m512bh value[kColVecs];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i lo = _mm512_maskz_loadu_epi16(v_mask[h], lo_row + 32 * h);
      const __m512i hi = has_hi
                             ? _mm512_maskz_loadu_epi16(v_mask[h], lo_row + v_row_stride + 32 * h)
                             : _mm512_setzero_si512();
      value[2 * h] = as_pairs(_mm512_permutex2var_epi16(lo, low_pairs, hi));
      value[2 * h + 1] = as_pairs(_mm512_permutex2var_epi16(lo, high_pairs, hi));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh prob =
          as_pairs(_mm512_set1_epi32(static_cast<int>(pp[t * pp_row_stride + r])));
#pragma GCC unroll 4
      for (int c = 0; c < kColVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], value[c], prob);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kColVecs; ++c) {
      _mm512_mask_storeu_ps(o + r * o_row_stride + 16 * c, o_mask[c], acc[r][c]);
    }
  }
}

}  // namespace

void narrow_scores(const NarrowScores& a) {
  const __m512 scale = _mm512_set1_ps(a.out_scale);
  const std::int64_t words = (a.depth + 1) / 2;
  const auto prefetch_rows = [&](std::int64_t j, std::int64_t keys) {
    if (a.prefetch == nullptr) return;
    const char* first = static_cast<const char*>(a.prefetch);
    for (std::int64_t i = j; i < j + keys; ++i) {
      prefetch_lines(first + i * a.prefetch_row_stride, a.prefetch_bytes);
    }
  };
  if (a.heads > 1 && a.k_head_stride < a.k_row_stride) {
    // The heads of one key are neighbours (BSHD): keys outermost, so K is read in address order,
    // 4 heads per block (4 keys of each 4 heads in turn was 25% slower with GQA 32:8; 16 heads
    // of one row per block 20% slower with 32 heads).
    for (std::int64_t j = 0; j < a.num_k; ++j) {
      prefetch_rows(j, 1);
      std::int64_t n = 0;
      for (; n + 4 <= a.heads; n += 4) scores_keys<4, 1>(a, words, n, j, scale);
      for (; n < a.heads; ++n) scores_keys<1, 1>(a, words, n, j, scale);
    }
  } else {
    // Each head's keys are one ascending run (BHSD, or a single head): heads outermost, 16 keys
    // (one row: lane_sums16) or 4 keys (kRows rows) per block, so K is read as one stream at a
    // time. Measured against the keys-outermost walk (which read every head's run at once),
    // Lq = 1, D = 128, 2 threads, Zen 4: 32 heads of one row 1.32-1.39x, GQA 32:8 0.91-1.21x
    // (about 1.07x), one kv head (Hq = 8) 1.22x. The walk also prefetches toward L2 the K rows kAhead keys
    // further on in it (into the next head's keys at the end of each head), 16 keys a block: the
    // hardware prefetchers stop at each 4 KiB page (GQA: 1.10x with, 0.97x without). Since
    // 2026-12-03 the flash kernel calls with one head here (its BHSD decode tasks are one kv
    // head each: flash_forward.cc, PlanWork); several heads come from other callers (tests).
    constexpr int kKeys = 16;
    constexpr std::int64_t kAhead = 32;
    const std::int64_t row_bytes = 2 * a.depth;
    const auto prefetch_k = [&](std::int64_t n, std::int64_t j, std::int64_t keys) {
      std::int64_t m = n, i = j + kAhead;  // head m, key i
      for (; i >= a.num_k && m < a.heads; i -= a.num_k) ++m;
      for (std::int64_t x = 0; x < keys; ++x, ++i) {
        if (i == a.num_k) i = 0, ++m;
        if (m >= a.heads) return;
        prefetch_lines(
            reinterpret_cast<const char*>(a.k + m * a.k_head_stride + i * a.k_row_stride),
            row_bytes);
      }
    };
    for (std::int64_t n = 0; n < a.heads; ++n) {
      std::int64_t j = 0;
      for (; j + kKeys <= a.num_k; j += kKeys) {
        if (n == 0) prefetch_rows(j, kKeys);
        prefetch_k(n, j, kKeys);
        scores_keys<1, kKeys>(a, words, n, j, scale);
      }
      for (; j < a.num_k; ++j) {
        if (n == 0) prefetch_rows(j, 1);
        prefetch_k(n, j, 1);
        scores_keys<1, 1>(a, words, n, j, scale);
      }
    }
  }
}

void narrow_values(const NarrowValues& a) {
  constexpr std::int64_t kCols = 16 * kColVecs;
  // The prefetch, spread over every values_block step (key pair) of the call.
  const std::int64_t steps = a.heads * (a.rows / kRows + a.rows % kRows) *
                             ((a.dv + kCols - 1) / kCols) * ((a.num_k + 1) / 2);
  PrefetchSpan span;
  if (a.prefetch != nullptr && a.prefetch_bytes > 0 && steps > 0) {
    span.next = static_cast<const char*>(a.prefetch);
    span.end = span.next + a.prefetch_bytes;
    span.step = (a.prefetch_bytes / steps + 63) / 64 * 64;
  }
  // Single rows of several heads whose V rows of one key are neighbours (BSHD multi-head
  // decoding): the keys go outermost in chunks of kValueChunk, so V is read in address order
  // (head by head over the whole part, each head's 256 bytes per key lie 8 KiB apart with 32
  // heads, and the part's V outgrows L2 with the next tile's K arriving). Same bits: each
  // output still adds its keys in order. Zen 4, Hq = Hkv = 32, Lq = 1, Lk = 16384, D = 128,
  // 2 threads, in-process A/B, 7 runs: 1.01-1.07x, median 1.05 (controls of unchanged code in
  // the same harness 0.94-1.00x, median 0.97); B = 2, Hq = Hkv = 16, D = 64: 0.99x. Chunking
  // GQA 32:8's 4-row blocks too was 0.90x, so only single rows.
  constexpr std::int64_t kValueChunk = 16;
  const bool chunked = a.heads > 1 && a.rows < kRows && a.v_head_stride < a.v_row_stride;
  const std::int64_t chunk = chunked ? kValueChunk : a.num_k;
  for (std::int64_t k0 = 0; k0 < a.num_k; k0 += chunk) {
    const std::int64_t keys = std::min(chunk, a.num_k - k0);
    for (std::int64_t n = 0; n < a.heads; ++n) {
      const std::uint32_t* pp = a.pp + n * a.pp_head_stride + k0 / 2 * a.pp_row_stride;
      const std::uint16_t* v = a.v + n * a.v_head_stride + k0 * a.v_row_stride;
      float* o = a.o + n * a.o_head_stride;
      std::int64_t r = 0;
      for (; r + kRows <= a.rows; r += kRows) {
        for (std::int64_t e = 0; e < a.dv; e += kCols) {
          values_block<kRows>(span, pp + r, a.pp_row_stride, v + e, a.v_row_stride, keys,
                              a.dv - e, o + r * a.o_row_stride + e, a.o_row_stride);
        }
      }
      for (; r < a.rows; ++r) {
        for (std::int64_t e = 0; e < a.dv; e += kCols) {
          values_block<1>(span, pp + r, a.pp_row_stride, v + e, a.v_row_stride, keys, a.dv - e,
                          o + r * a.o_row_stride + e, a.o_row_stride);
        }
      }
    }
  }
}

}  // namespace qkv::bf16dot
