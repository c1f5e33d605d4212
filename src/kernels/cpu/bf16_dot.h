// The AVX512-BF16 micro-kernel: the flash kernel's rank-1-update products (OuterProductRows in
// attention_tiles-inl.h) on bf16 inputs with `vdpbf16ps`, which multiplies PAIRS of bf16 and
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

// Tests force the portable path: set_enabled(false) makes available() false until
// set_enabled(true). Not meant to be flipped while kernels run on other threads.
void set_enabled(bool enabled);

// The functions below run AVX512-BF16 instructions: call them only when available().

// c[r][l] = init(r, l) + out_scale * sum_{t < depth} dot2(a[t][l], b(r, t))
//   for r < rows, l < kLanes, where b(r, t) = b[r * b_row_stride + t * b_depth_stride],
//   dot2(x, y) = x.lo * y.lo + x.hi * y.hi accumulated in f32 (vdpbf16ps), and
//   init(r, l) = alpha != nullptr ? alpha[l] * c[r][l] : accumulate ? c[r][l] : 0.
//   a: [depth][kLanes] pair words   b: pair words, strides in words (any 4-byte alignment)
//   c: [rows][kLanes] floats        alpha: [kLanes] or null
// a, c and alpha are 64-byte aligned. No b row >= rows is read and no c row >= rows is touched.
// vdpbf16ps treats bf16 subnormals as zero and flushes subnormal results (DAZ/FTZ implied).
void outer_product(const std::uint32_t* a, const std::uint32_t* b, std::int64_t rows,
                   std::int64_t b_row_stride, std::int64_t b_depth_stride, std::int64_t depth,
                   float* c, const float* alpha, bool accumulate, float out_scale);

// Probabilities to pair words: pt[t][l] = pair(bf16(st[2t][l]), bf16(st[2t + 1][l])) for
// t < ceil(num_k / 2), rounded to nearest even; when num_k is odd the last pair's high half is
// +0.0. Inputs are finite and >= 0; f32 subnormal inputs become +0 (vcvtne2ps2bf16 treats them as
// zero, as vdpbf16ps would anyway).
//   st: [num_k][kLanes] floats, 64-byte aligned   pt: [ceil(num_k / 2)][kLanes], 64-byte aligned
void pack_probs(const float* st, std::int64_t num_k, std::uint32_t* pt);

// Peak probe: `iterations` rounds of 12 independent vdpbf16ps zmm chains on the calling thread;
// returns the sum of the accumulators (so nothing can be optimised away).
// FLOPs = iterations * 12 * 16 lanes * 4 (two multiply-adds per lane per instruction).
double peak_probe(std::int64_t iterations);

}  // namespace qkv::bf16dot
