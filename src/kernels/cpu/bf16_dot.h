// The AVX512-BF16 micro-kernel: the flash kernel's rank-1-update products (OuterProductRows in
// tile_products-inl.h) on bf16 inputs with `vdpbf16ps`, which multiplies PAIRS of bf16 and
// accumulates in f32 (32 multiply-adds per zmm instruction instead of 16). Highway 1.0.3 does
// not emit the instruction, so it lives in one ISA-specific file with raw intrinsics
// (bf16_dot_avx512.cc, compiled with -mavx512bf16; DESIGN.md section 7), chosen at run time:
// callers check available() and otherwise take the portable path. docs/kernels.md, section
// "bf16 micro-kernel (vdpbf16ps)".
//
// A "pair word" (uint32) holds two bf16 along the reduction (depth) axis: element 2t in the low
// 16 bits, element 2t + 1 in the high 16 bits, the layout vdpbf16ps reads.
#pragma once

#include <cstdint>

namespace qkv::bf16dot {

// Query lanes of one block: fixed, = the AVX3 Highway target's kBlockQ (4 zmm x 16 floats).
constexpr std::int64_t kLanes = 64;

// True when this CPU and OS run AVX512F + BW + VL + DQ + BF16 (CPUID, and XCR0 enables the zmm
// state) and set_enabled(false) has not switched the kernel off. Cheap: the CPUID answer is
// computed once.
bool available();

// The CPUID / XCR0 part of available() alone, whatever set_enabled says (amx.cc needs it: its
// tiles' probabilities are packed with AVX512-BF16).
bool cpu_supported();

// Tests force the portable path: set_enabled(false) makes available() false until
// set_enabled(true). Not meant to be flipped while kernels run on other threads.
void set_enabled(bool enabled);

// Whether the flash kernel takes these products for bf16 (FlashProductPath in products-inl.h):
// available(), and the CPU is one where they outrun f32 FMA on the widened operands. Measured
// (docs/kernels.md, "Product paths"): on AMD Zen 4 the vdpbf16ps peak is 2.0x the FMA peak and
// the pairs are the faster path; on an Intel Xeon with AVX512-BF16 (family 6 model 207, no AMX)
// it is 0.49x, and the widened FMA path ran 1.72-1.76x faster than the pairs (1.31x decoding).
// So: AMD yes, other vendors no (a CPUID fact, so the choice, and every result bit, is the same
// in every run on one CPU). set_forced(true) takes the pairs wherever available() (tests).
bool preferred();
void set_forced(bool forced);
bool forced();  // whether set_forced(true) holds

// The functions below run AVX512-BF16 instructions: call them only when available().

// c[r][l] = init(r, l) + out_scale * sum_{t < depth} dot2(a[t][l], b(r, t))
//   for r < rows, l < kLanes, where b(r, t) = b[r * b_row_stride + t * b_depth_stride],
//   dot2(x, y) = x.lo * y.lo + x.hi * y.hi accumulated in f32 (vdpbf16ps), and
//   init(r, l) = alpha != nullptr ? alpha[l] * c[r][l] : accumulate ? c[r][l] : 0.
//   a: [depth][kLanes] pair words   b: pair words, strides in words (any 4-byte alignment)
//   c: [rows][kLanes] floats        alpha: [kLanes] or null
// a, c and alpha are 64-byte aligned. No b row >= rows is read and no c row >= rows is touched.
// vdpbf16ps treats bf16 subnormals as zero and flushes subnormal results (DAZ/FTZ implied).
// Skipping (the causal diagonal; VecKeys in tile_geometry-inl.h), per vector x of 16 lanes:
//   row_end (nullable; [4], non-decreasing, the last = rows): vector x needs rows
//     [0, row_end[x]) only; a block of rows starts at the first vector that needs its first
//     row, and the lanes of the rows a vector skips are left as they were;
//   depth_end (nullable; [4], non-decreasing, each <= depth): vector x sums t < depth_end[x] only.
void outer_product(const std::uint32_t* a, const std::uint32_t* b, std::int64_t rows,
                   std::int64_t b_row_stride, std::int64_t b_depth_stride, std::int64_t depth,
                   float* c, const float* alpha, bool accumulate, float out_scale,
                   const std::int64_t* row_end = nullptr, const std::int64_t* depth_end = nullptr);

// Probabilities to pair words: pt[t][l] = pair(bf16(st[2t][l]), bf16(st[2t + 1][l])) for
// t < ceil(num_k / 2) and l < 16 * vecs (vecs = 1 .. 4), rounded to nearest even; when num_k is
// odd the last pair's high half is +0.0. Inputs are finite, of either sign (the backward pairs
// du = p (dp - D) too); f32 subnormal inputs become zero (vcvtne2ps2bf16 treats them as zero,
// as vdpbf16ps would anyway). pt may be st itself (the
// pairs then overwrite the probabilities they came from: row t is written after rows 2t and
// 2t + 1 are read).
//   st: [num_k][kLanes] floats, 64-byte aligned   pt: [ceil(num_k / 2)][kLanes], 64-byte aligned
void pack_probs(const float* st, std::int64_t num_k, int vecs, std::uint32_t* pt);

// The decode (narrow) products, for blocks of a few query rows (the GQA group of one decode
// step) against many keys: vectorised along head_dim for the scores and along Dv for the
// values, on pairs of bf16 (bf16_narrow_avx512.cc; docs/kernels.md, "Decoding"). One call
// serves `heads` blocks side by side (the kv heads of one decode step): block n's operands lie
// at base + n * head_stride. q, k and v elements are bf16 bit patterns at any 2-byte alignment.

// st(n)[j * st_row_stride + r] =
//     out_scale * sum_{d < depth} q(n, r, d) * k(n)[j * k_row_stride + d]
//   for n < heads, r < rows, j < num_k, with q(n, r, d) the bf16 of pair word
//   q[n * q_head_stride + r * ceil(depth / 2) + d / 2] (low half for even d; past depth the
//   pair's high half must be +0). Dot products accumulate in f32 (vdpbf16ps) and are multiplied
//   by out_scale once. k is read in address order: keys outermost when the heads of one key are
//   neighbours (k_head_stride < k_row_stride, BSHD), else head by head (BHSD; the K rows a few
//   keys ahead are prefetched). The bits do not depend on the walk. No element of k past depth
//   in a row is read.
// While key j is walked (by the first head), bytes [0, prefetch_bytes) of prefetch +
// j * prefetch_row_stride (bytes) are prefetched toward L2 when prefetch is not null (the flash
// kernel passes the tile's V rows, read right after: docs/kernels.md, "Decoding"). Prefetches
// never fault.
struct NarrowScores {
  const std::uint32_t* q;
  std::int64_t q_head_stride;  // pair words
  const std::uint16_t* k;
  std::int64_t k_head_stride, k_row_stride;  // elements
  float* st;
  std::int64_t st_head_stride, st_row_stride;  // floats
  std::int64_t heads, rows, depth, num_k;
  float out_scale;
  const void* prefetch = nullptr;
  std::int64_t prefetch_row_stride = 0, prefetch_bytes = 0;
};
void narrow_scores(const NarrowScores& a);

// o(n)[r * o_row_stride + e] += sum_{j < num_k} prob(n, j, r) * v(n)[j * v_row_stride + e]
//   for n < heads, r < rows, e < dv, with prob(n, 2t, r) and prob(n, 2t + 1, r) the low and high
//   bf16 of pair word pp[n * pp_head_stride + t * pp_row_stride + r] (pack_probs; when num_k is
//   odd the last pair's high half must be +0, and row num_k of v is not read). No element of v
//   past dv in a row is read.
// While it walks, bytes [0, prefetch_bytes) of prefetch are prefetched toward L2 when prefetch is
// not null, a few lines per key pair, spread evenly over the whole call (the flash kernel passes
// the next tile's K rows: the memory is otherwise idle while the values read V from L2;
// docs/kernels.md, "Decoding"). Prefetches never fault.
struct NarrowValues {
  const std::uint32_t* pp;
  std::int64_t pp_head_stride, pp_row_stride;  // pair words
  const std::uint16_t* v;
  std::int64_t v_head_stride, v_row_stride;  // elements
  float* o;
  std::int64_t o_head_stride, o_row_stride;  // floats
  std::int64_t heads, rows, num_k, dv;
  const void* prefetch = nullptr;
  std::int64_t prefetch_bytes = 0;
};
void narrow_values(const NarrowValues& a);

// Peak probe: `iterations` rounds of 12 independent vdpbf16ps zmm chains on the calling thread;
// returns the sum of the accumulators (so nothing can be optimised away).
// FLOPs = iterations * 12 * 16 lanes * 4 (two multiply-adds per lane per instruction).
double peak_probe(std::int64_t iterations);

}  // namespace qkv::bf16dot
