// The AMX micro-kernels (amx.h): raw intrinsics, compiled with -mamx-tile -mamx-bf16 and
// AVX512-BF16 (CMakeLists.txt), reached only when amx::available(). Every product uses one tile
// configuration: 8 tiles of 16 rows x 64 bytes. Tiles 0-3 accumulate a 2 x 2 block of f32
// outputs (32 x 32), tiles 4-5 hold the two A operands (16 rows x 32 bf16 each) and tiles 6-7
// the two B operands (16 pair rows x 16 lanes), so each A and B load serves two products
// (BlockProduct, the one loop both products run).
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/fast_exp.h"

namespace qkv::amx {
namespace {

struct alignas(64) TileConfig {
  std::uint8_t palette_id;
  std::uint8_t start_row;
  std::uint8_t reserved[14];
  std::uint16_t colsb[16];
  std::uint8_t rows[16];
};

const TileConfig& Config() {
  static const TileConfig config = [] {
    TileConfig c;
    std::memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = static_cast<std::uint8_t>(kTileRows);
    }
    return c;
  }();
  return config;
}

// Bytes between rows of qp, pp, st and ot: kLanes words or floats.
constexpr std::int64_t kLaneRowBytes = kLanes * 4;
constexpr std::int64_t kVecLanes = 16;  // f32 lanes of a zmm, = the lanes of one tile column

}  // namespace

TileScope::TileScope() { _tile_loadconfig(&Config()); }
TileScope::~TileScope() { _tile_release(); }

namespace {

// GCC 12's _tile_loadd is an asm that names the address it reads, not the memory there, so a
// store made earlier in the same function may be moved past it, or dropped as dead where
// nothing else reads it (the probes' operands were, once their fill moved into a helper). A
// compiler barrier before the tile loads orders them; it costs no instruction.
inline void StoresBeforeTileLoads() { __asm__ volatile("" ::: "memory"); }

// One output block of f32 tiles: rows [0, 16) (and [16, 32) when kTwo) of `out`, lanes [0, 32),
// rows kLanes floats apart; zeroed (kLoad false) or loaded from out, then += sum over `steps`
// of A x B, and stored back. A: rows a_stride bf16 apart, step c at a + c * kDepthStep (the
// second row group 16 rows down); B: pair rows of kLanes words, step c 16 rows down from b.
template <bool kTwo, bool kLoad>
void BlockProduct(const std::uint16_t* a, std::int64_t a_stride, const std::uint32_t* b,
                  std::int64_t steps, float* out) {
  const std::int64_t a_bytes = a_stride * 2;
  const std::uint16_t* a1 = a + kTileRows * a_stride;
  float* out1 = out + kTileRows * kLanes;
  if constexpr (kLoad) {
    StoresBeforeTileLoads();  // (values: the rescale's vector stores into out)
    _tile_loadd(0, out, kLaneRowBytes);
    _tile_loadd(1, out + kVecLanes, kLaneRowBytes);
    if constexpr (kTwo) {
      _tile_loadd(2, out1, kLaneRowBytes);
      _tile_loadd(3, out1 + kVecLanes, kLaneRowBytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (std::int64_t c = 0; c < steps; ++c, b += kTileRows * kLanes) {
    _tile_loadd(6, b, kLaneRowBytes);
    _tile_loadd(7, b + kVecLanes, kLaneRowBytes);
    _tile_loadd(4, a + c * kDepthStep, a_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, a1 + c * kDepthStep, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, kLaneRowBytes);
  _tile_stored(1, out + kVecLanes, kLaneRowBytes);
  if constexpr (kTwo) {
    _tile_stored(2, out1, kLaneRowBytes);
    _tile_stored(3, out1 + kVecLanes, kLaneRowBytes);
  }
}

// BlockProduct over 32 rows when `two`, else over the last 16.
template <bool kLoad>
void BlockProduct(bool two, const std::uint16_t* a, std::int64_t a_stride,
                  const std::uint32_t* b, std::int64_t steps, float* out) {
  if (two) {
    BlockProduct<true, kLoad>(a, a_stride, b, steps, out);
  } else {
    BlockProduct<false, kLoad>(a, a_stride, b, steps, out);
  }
}

}  // namespace

void scores(const std::uint16_t* k, std::int64_t k_stride, const std::uint32_t* qp,
            std::int64_t depth, std::int64_t num_k, float scale, float* st, std::int64_t lanes) {
  const std::int64_t groups = (num_k + kTileRows - 1) / kTileRows;
  for (std::int64_t g = 0; g < groups; g += 2) {  // 32 keys (the last 16) x 32 queries
    for (std::int64_t l = 0; l < lanes; l += 2 * kVecLanes) {
      BlockProduct<false>(g + 1 < groups, k + g * kTileRows * k_stride, k_stride, qp + l,
                          depth / kDepthStep, st + g * kTileRows * kLanes + l);
    }
  }
  if (scale == 1.0f) return;
  const __m512 s = _mm512_set1_ps(scale);
  for (float* row = st; row < st + groups * kTileRows * kLanes; row += kLanes) {
    for (float* x = row; x < row + lanes; x += kVecLanes) {
      _mm512_store_ps(x, _mm512_mul_ps(_mm512_load_ps(x), s));
    }
  }
}

namespace {

// Pair words of two key rows of 16 lanes: word l = (bf16(lo[l]), bf16(hi[l])), rounded to nearest
// even. vcvtne2ps2bf16(hi, lo) gives the 16-bit words [bf16(lo) x 16, bf16(hi) x 16]; the vpermw
// index interleaves them: word 2i <- lo[i] (word i), word 2i + 1 <- hi[i] (word 16 + i).
inline __m512i PairWords(__m512 lo, __m512 hi) {
  alignas(64) static constexpr std::uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave),
                                  (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

}  // namespace

void pack_probs(const float* st, std::int64_t num_k, const std::int64_t* key_end,
                std::uint32_t* pp, unsigned vecs) {
  std::int64_t end[kLanes / kVecLanes];
  for (int x = 0; x < kLanes / kVecLanes; ++x) end[x] = key_end != nullptr ? key_end[x] : num_k;
  const std::int64_t pairs = round_up(num_k, kDepthStep) / 2;
  for (std::int64_t t = 0; t < pairs; ++t) {
    const std::int64_t j = 2 * t;
    for (int x = 0; x < kLanes / kVecLanes; ++x) {
      if ((vecs >> x & 1u) == 0) continue;
      const float* lo_row = st + j * kLanes + x * kVecLanes;
      const __m512 lo = j < end[x] ? _mm512_load_ps(lo_row) : _mm512_setzero_ps();
      const __m512 hi = j + 1 < end[x] ? _mm512_load_ps(lo_row + kLanes) : _mm512_setzero_ps();
      _mm512_store_si512(pp + t * kLanes + x * kVecLanes, PairWords(lo, hi));
    }
  }
}

namespace {

// fastexp::Pow2CoarseHalf (fast_exp-inl.h) bit for bit, on AVX3's instructions: 2^(xh - 1/2) =
// 2^floor(xh) * q(t), t = xh - floor(xh) in one vreduceps rounding down (exact), q the degree-4
// polynomial, 2^floor(xh) by vscalefps (which floors its exponent operand), +0 below
// kMinPow2HalfArg (a NaN xh stays NaN). 7 instructions.
inline __m512 Pow2CoarseHalf(__m512 xh) {
  using namespace fastexp;
  const __m512 t = _mm512_reduce_round_ps(xh, _MM_FROUND_TO_NEG_INF, _MM_FROUND_CUR_DIRECTION);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(kHalfP4), t, _mm512_set1_ps(kHalfP3));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(kHalfP2));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(kHalfP1));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(kHalfP0));
  const __mmask16 normal = _mm512_cmp_ps_mask(xh, _mm512_set1_ps(kMinPow2HalfArg), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, q, xh);
}

// _mm512_max_ps (vmaxps: b where either is NaN), through its masked form with every lane set:
// the same instruction, without GCC 12's false -Wmaybe-uninitialized on the plain intrinsic's
// undefined pass-through operand.
inline __m512 Max(__m512 a, __m512 b) { return _mm512_mask_max_ps(a, 0xFFFF, a, b); }

// One query vector's probabilities against a shift: p = Pow2CoarseHalf(s * c - (shift - 1/2))
// for its keys [0, end) of st (s: its first lane, rows kLanes floats apart), written as pair
// words from out on (pairs rows, +0 past end), with their sum in key order; kMax: also their
// max in ColumnMax's four chains (so a NaN takes the same course), into *max.
template <bool kMax>
inline __m512 ExpPackVec(const float* s, std::int64_t end, std::int64_t pairs, __m512 cv,
                         __m512 shift, std::uint32_t* out, __m512* max) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  // The argument of Pow2CoarseHalf: s * c - (m2 - 1/2) (online_softmax-inl.h's
  // ExpInPlaceAndSum, the same bits).
  shift = _mm512_sub_ps(shift, _mm512_set1_ps(fastexp::kHalfShift));
  __m512 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf, sum = _mm512_setzero_ps();
  std::int64_t j = 0;
  for (; j + 4 <= end; j += 4, s += 4 * kLanes, out += 2 * kLanes) {
    const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + kLanes);
    const __m512 s2 = _mm512_load_ps(s + 2 * kLanes), s3 = _mm512_load_ps(s + 3 * kLanes);
    if constexpr (kMax) {
      m0 = Max(m0, s0);
      m1 = Max(m1, s1);
      m2 = Max(m2, s2);
      m3 = Max(m3, s3);
    }
    const __m512 p0 = Pow2CoarseHalf(_mm512_fmsub_ps(s0, cv, shift));
    const __m512 p1 = Pow2CoarseHalf(_mm512_fmsub_ps(s1, cv, shift));
    const __m512 p2 = Pow2CoarseHalf(_mm512_fmsub_ps(s2, cv, shift));
    const __m512 p3 = Pow2CoarseHalf(_mm512_fmsub_ps(s3, cv, shift));
    sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(sum, p0), p1), p2), p3);
    _mm512_store_si512(out, PairWords(p0, p1));
    _mm512_store_si512(out + kLanes, PairWords(p2, p3));
  }
  for (; j < end; j += 2, s += 2 * kLanes, out += kLanes) {
    const __m512 s0 = _mm512_load_ps(s);
    if constexpr (kMax) m0 = Max(m0, s0);
    const __m512 p0 = Pow2CoarseHalf(_mm512_fmsub_ps(s0, cv, shift));
    sum = _mm512_add_ps(sum, p0);
    __m512 p1 = _mm512_setzero_ps();
    if (j + 1 < end) {
      const __m512 s1 = _mm512_load_ps(s + kLanes);
      if constexpr (kMax) m0 = Max(m0, s1);
      p1 = Pow2CoarseHalf(_mm512_fmsub_ps(s1, cv, shift));
      sum = _mm512_add_ps(sum, p1);
    }
    _mm512_store_si512(out, PairWords(p0, p1));
  }
  for (std::int64_t t = (end + 1) / 2; t < pairs; ++t, out += kLanes) {
    _mm512_store_si512(out, _mm512_setzero_si512());
  }
  if constexpr (kMax) *max = Max(Max(m0, m1), Max(m2, m3));
  return sum;
}

}  // namespace

unsigned softmax_pack_lazy(const float* st, std::int64_t num_k, const std::int64_t* key_end,
                           float c, float slack, const float* row_max, float* row_sum, float* alpha,
                           std::uint32_t* pp, unsigned vecs) {
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const std::int64_t pairs = round_up(num_k, kDepthStep) / 2;
  unsigned redo = 0;
  for (int x = 0; x < kLanes / kVecLanes; ++x) {
    if ((vecs >> x & 1u) == 0) continue;
    const std::int64_t end = key_end != nullptr ? key_end[x] : num_k;
    const __m512 old_max = _mm512_load_ps(row_max + x * kVecLanes);
    if (_mm512_cmp_ps_mask(old_max, neg_inf, _CMP_GT_OQ) != 0xFFFF) {
      redo |= 1u << x;
      continue;
    }
    __m512 max;
    const __m512 sum =
        ExpPackVec<true>(st + x * kVecLanes, end, pairs, cv, old_max, pp + x * kVecLanes, &max);
    const __m512 tile_max = _mm512_mul_ps(max, cv);
    const __m512 bound = _mm512_add_ps(old_max, _mm512_set1_ps(slack));
    if (_mm512_cmp_ps_mask(tile_max, bound, _CMP_LE_OQ) != 0xFFFF) {
      redo |= 1u << x;
      continue;
    }
    float* rs = row_sum + x * kVecLanes;
    _mm512_store_ps(rs, _mm512_add_ps(_mm512_load_ps(rs), sum));
    _mm512_store_ps(alpha + x * kVecLanes, _mm512_set1_ps(1.0f));
  }
  return redo;
}

void exp_pack(const float* st, std::int64_t num_k, const std::int64_t* key_end, int x, float c,
              const float* shift, float* sum, std::uint32_t* pp) {
  const std::int64_t end = key_end != nullptr ? key_end[x] : num_k;
  const __m512 total =
      ExpPackVec<false>(st + x * kVecLanes, end, round_up(num_k, kDepthStep) / 2, _mm512_set1_ps(c),
                        _mm512_load_ps(shift), pp + x * kVecLanes, nullptr);
  _mm512_store_ps(sum, total);
}

void values(const std::uint16_t* vt, std::int64_t vt_stride, const std::uint32_t* pp,
            std::int64_t num_k, std::int64_t dv, const float* alpha, const std::int64_t* key_end,
            float* ot, std::int64_t lanes) {
  const std::int64_t rows = round_up(dv, kTileRows);
  // The rescale, for the vectors whose factor is not exactly 1 (once the running max settles,
  // most tiles leave it unchanged; x * 1 = x, so skipping changes no bit) nor exactly 0 (every
  // lane; a block's first tile, whose running max was -inf): their accumulators start from zero
  // below instead of being loaded (0 * ot = 0 for the finite ot the kernel keeps): no rescale
  // pass and no tile loads of ot on a block's first tile (docs/kernels.md, "AMX tiles").
  unsigned zero = 0;  // bits x / 16 and x / 16 + 1: the factors of lanes [x, x + 32) are all 0
  for (std::int64_t x = 0; alpha != nullptr && x < lanes; x += 2 * kVecLanes) {  // a lane pair
    const __m512 a[2] = {_mm512_load_ps(alpha + x), _mm512_load_ps(alpha + x + kVecLanes)};
    const auto differs = [](__m512 v, float f) {
      return _mm512_cmp_ps_mask(v, _mm512_set1_ps(f), _CMP_NEQ_UQ) != 0;
    };
    if (!differs(a[0], 0.0f) && !differs(a[1], 0.0f)) {
      zero |= 3u << (x / kVecLanes);
      continue;
    }
    for (std::int64_t h = 0; h < 2; ++h) {
      if (!differs(a[h], 1.0f)) continue;
      for (std::int64_t e = 0; e < rows; ++e) {
        float* o = ot + e * kLanes + x + h * kVecLanes;
        _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), a[h]));
      }
    }
  }
  // Value dims outermost: a block's two A tiles (V columns) then serve both lane pairs from L1
  // (Xeon with AMX, one tile product in isolation: 1.12x at Dv = 128 over lanes outermost).
  for (std::int64_t e = 0; e < rows; e += 2 * kTileRows) {  // 32 value dims (the last 16)
    for (std::int64_t l = 0; l < lanes; l += 2 * kVecLanes) {  // x 32 queries
      // Keys these 32 lanes need (key_end does not decrease along the lanes).
      const std::int64_t keys = key_end != nullptr ? key_end[l / kVecLanes + 1] : num_k;
      const std::int64_t steps = (keys + kDepthStep - 1) / kDepthStep;
      const bool two = e + kTileRows < rows;
      if (zero >> (l / kVecLanes) & 1u) {  // (with no step: the zeros are stored)
        BlockProduct<false>(two, vt + e * vt_stride, vt_stride, pp + l, steps,
                            ot + e * kLanes + l);
        continue;
      }
      if (steps == 0) continue;
      BlockProduct<true>(two, vt + e * vt_stride, vt_stride, pp + l, steps, ot + e * kLanes + l);
    }
  }
}

namespace {

// The probes' tiles: the operands (tiles 4-7) hold small bf16 pairs (2^-11 each), so the
// accumulators (tiles 0-3, zeroed) stay finite for any realistic run; the tiles never leave the
// registers inside the probes' loops.
void StartProbeTiles() {
  alignas(64) std::uint32_t operand[kTileRows * kVecLanes];
  for (std::uint32_t& w : operand) w = 0x3a003a00u;
  StoresBeforeTileLoads();
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Four independent tile products, one into each accumulator.
inline void FourProbeProducts() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// The sum of the accumulators' outputs.
double ProbeTilesSum() {
  alignas(64) float out[4][kTileRows * kVecLanes];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  double sum = 0.0;
  for (const auto& tile : out) {
    for (float x : tile) sum += x;
  }
  return sum;
}

// overlap_probe's rounds: the tile products (kTiles), the fused softmax's code (kSoftmax), or
// both; returns the softmax's checksum (its sums and max, the last pair word's probabilities).
template <bool kTiles, bool kSoftmax>
double OverlapRounds(std::int64_t iterations) {
  // Scores at or below the running max (0), as in a tile where the max stays.
  alignas(64) float st[kOverlapKeys * kLanes];
  for (std::int64_t i = 0; i < kOverlapKeys * kLanes; ++i) {
    st[i] = -0.125f * static_cast<float>(i % 61);
  }
  alignas(64) std::uint32_t pp[kOverlapKeys / 2 * kLanes] = {};
  constexpr std::int64_t kPairs = kOverlapKeys / 2;
  const __m512 cv = _mm512_set1_ps(1.0f), shift = _mm512_setzero_ps();
  __m512 sum = _mm512_setzero_ps(), max = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < iterations; ++i) {
    if constexpr (kTiles) {
      for (int g = 0; g < kOverlapTileProducts / 4; ++g) FourProbeProducts();
    }
    if constexpr (kSoftmax) {
      __m512 tile_max;
      sum = _mm512_add_ps(sum, ExpPackVec<true>(st, kOverlapKeys, kPairs, cv, shift, pp, &tile_max));
      max = Max(max, tile_max);
    }
  }
  alignas(64) float lanes[2][kVecLanes];
  _mm512_store_ps(lanes[0], sum);
  _mm512_store_ps(lanes[1], max);
  // The last pair word's two probabilities (bf16: the high halves of f32 words).
  const std::uint32_t word = pp[kPairs * kLanes - 1], halves[2] = {word << 16, word & 0xFFFF0000u};
  float last[2];
  std::memcpy(last, halves, sizeof(last));
  double checksum = static_cast<double>(last[0]) + last[1];
  for (const auto& row : lanes) {
    for (float x : row) checksum += x;
  }
  return checksum;
}

}  // namespace

double peak_probe(std::int64_t iterations) {
  const TileScope scope;
  StartProbeTiles();
  for (std::int64_t i = 0; i < iterations; ++i) FourProbeProducts();
  return ProbeTilesSum();
}

double overlap_probe(std::int64_t iterations, OverlapPart part) {
  const TileScope scope;
  StartProbeTiles();
  double checksum = 0.0;
  switch (part) {
    case OverlapPart::kTiles:
      checksum = OverlapRounds<true, false>(iterations);
      break;
    case OverlapPart::kSoftmax:
      checksum = OverlapRounds<false, true>(iterations);
      break;
    case OverlapPart::kBoth:
      checksum = OverlapRounds<true, true>(iterations);
      break;
  }
  return checksum + ProbeTilesSum();
}

}  // namespace qkv::amx
