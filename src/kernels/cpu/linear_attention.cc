// Linear attention on the CPU (Highway SIMD, one copy per target): chunk-wise prefix sums.
//
// Per (batch, kv head) the keys are summarised by a State: S = sum_j phi(k_j) v_j^T [M][Dv],
// z = sum_j phi(k_j) [M], and the key stabiliser c (FAVOR+: phi(k) carries exp(-c); elu+1:
// c = 0). Queries read it: out_i = phi(q_i)^T S / phi(q_i)^T z. Everything is small GEMMs on
// chunks of C = chunk_size rows, done by one register-tiled micro-kernel (Gemm):
//
//   key features   FAVOR+: P^T [M][C] = W [M][D] . K'^T [D][C]; phi(k)^T = exp(P^T - |k'|^2/2 - c)
//   absorb         S [M][Dv] += phi(k)^T [M][C] . V [C][Dv];    z += row sums of phi(k)^T
//   query side     P [C][M] = Q' [C][D] . W^T [D][M];          phi(q) = exp(P - row max)
//                  num [C][Dv] = phi(q) [C][M] . S;             den = phi(q) . z
//   causal, intra  A [C][C] = phi(q) . phi(k)^T, zero where key > i';  num += A . V; den += A 1
//
// Causal: a query chunk [i0, i1) sees the state of keys [0, a) plus its own keys [a, e) through
// the masked quadratic part A, with a = clamp(i0 + offset, 0, L), e = clamp(i1 + offset, 0, L)
// (e - a <= C); then [a, e) is absorbed and the next chunk starts at e. The key stabiliser is a
// running maximum: when a chunk's exponents exceed c, the state is rescaled by exp(c_old - c)
// first (like an online softmax), so exp never overflows; both S and z carry the same factor,
// which cancels in num / den. The query stabiliser is each row's own maximum (cancels too).
//
// Threads: with few (batch, kv head) pairs the sequence is also split into G segments (G from
// the shape only): pass 1 sums each segment's keys into its own State, pass 2 merges them in a
// fixed order (a running prefix for causal, one total for non-causal), pass 3 computes outputs.
// Each task is one thread's fixed-order work, so results are identical for any thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/linear_attention.cc"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/kernels.h"
// Highway's math header must come after foreach_target (it is re-included per target).
#include "hwy/contrib/math/math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace linear {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr std::int64_t kLanes = HWY_LANES(float);
// Micro-tile: kRows rows x kVecs vectors of accumulators (AVX-512: 4 x 4 of 32 registers;
// AVX2: 4 x 2 of 16).
constexpr int kRows = 4;
constexpr int kVecs = kLanes == 8 ? 2 : 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::int64_t RoundUp(std::int64_t x) { return (x + kLanes - 1) / kLanes * kLanes; }

// c[r][n] = (accumulate ? c[r][n] : 0) + sum_{t < depth} a(r, t) * b[t][n] for r < R and the
// NV vectors of columns at c, b; a(r, t) = a[r * a_rs + t * a_ts]. Fixed summation order.
template <int R, int NV>
HWY_INLINE void MicroTile(std::int64_t depth, const float* HWY_RESTRICT a, std::int64_t a_rs,
                          std::int64_t a_ts, const float* HWY_RESTRICT b, std::int64_t ldb,
                          float* HWY_RESTRICT c, std::int64_t ldc, bool accumulate) {
  const DF df;
  VF acc[R][NV];
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int x = 0; x < NV; ++x) {
      acc[r][x] = accumulate ? hn::Load(df, c + r * ldc + x * kLanes) : hn::Zero(df);
    }
  }
  for (std::int64_t t = 0; t < depth; ++t) {
    VF b_vec[NV];
    HWY_UNROLL(4)
    for (int x = 0; x < NV; ++x) b_vec[x] = hn::Load(df, b + t * ldb + x * kLanes);
    HWY_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const VF a_val = hn::Set(df, a[r * a_rs + t * a_ts]);
      HWY_UNROLL(4)
      for (int x = 0; x < NV; ++x) acc[r][x] = hn::MulAdd(a_val, b_vec[x], acc[r][x]);
    }
  }
  HWY_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int x = 0; x < NV; ++x) hn::Store(acc[r][x], df, c + r * ldc + x * kLanes);
  }
}

// C [rows][cols] (+)= A [rows][depth] . B [depth][cols]; cols a multiple of kLanes, b and c
// rows aligned; A read through its strides (it may be a transposed view).
void Gemm(std::int64_t rows, std::int64_t cols, std::int64_t depth, const float* a,
          std::int64_t a_rs, std::int64_t a_ts, const float* b, std::int64_t ldb, float* c,
          std::int64_t ldc, bool accumulate) {
  constexpr std::int64_t kWide = kVecs * kLanes;
  std::int64_t n = 0;
  // One column panel of B at a time, walked by every row block, so it stays in cache.
  for (; n + kWide <= cols; n += kWide) {
    std::int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      MicroTile<kRows, kVecs>(depth, a + r * a_rs, a_rs, a_ts, b + n, ldb, c + r * ldc + n, ldc,
                              accumulate);
    }
    for (; r < rows; ++r) {
      MicroTile<1, kVecs>(depth, a + r * a_rs, a_rs, a_ts, b + n, ldb, c + r * ldc + n, ldc,
                          accumulate);
    }
  }
  for (; n < cols; n += kLanes) {
    std::int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      MicroTile<kRows, 1>(depth, a + r * a_rs, a_rs, a_ts, b + n, ldb, c + r * ldc + n, ldc,
                          accumulate);
    }
    for (; r < rows; ++r) {
      MicroTile<1, 1>(depth, a + r * a_rs, a_rs, a_ts, b + n, ldb, c + r * ldc + n, ldc,
                      accumulate);
    }
  }
}

// Sizes shared by every task; all leading dimensions are multiples of kLanes.
struct Geometry {
  std::int64_t chunk, chunk_pad;  // C and C rounded up
  std::int64_t m, m_pad;          // features
  std::int64_t dv_pad;            // value dims rounded up
  std::int64_t state_floats;      // S [M][Dv_pad], z [M_pad], c (padded to a vector)
  std::int64_t scratch_floats;    // per thread
};

// Key summary of one (batch, kv head) over some keys. c is FAVOR+'s stabiliser (-inf while
// no key is in; elu+1 keeps 0).
struct State {
  float* s;  // [M][Dv_pad]
  float* z;  // [M_pad]
  float* c;  // [1]
};

State BindState(const Geometry& g, float* base) {
  return {base, base + g.m * g.dv_pad, base + g.m * g.dv_pad + g.m_pad};
}

void ZeroState(const LinearKernelParams& p, const Geometry& g, State st) {
  std::fill(st.s, st.s + g.state_floats, 0.0f);
  *st.c = p.favor ? kNegInf : 0.0f;
}

void ScaleArray(float* x, std::int64_t count, float factor) {
  const DF df;
  const VF f = hn::Set(df, factor);
  for (std::int64_t i = 0; i < count; i += kLanes)
    hn::Store(hn::Mul(hn::Load(df, x + i), f), df, x + i);
}

// Moves the state to stabiliser c_new >= *st.c (FAVOR+): S and z scale by exp(c_old - c_new).
// An empty state (c = -inf) is all zeros and just takes the new c; (-inf) - (-inf) is never
// formed.
void RaiseStabiliser(const Geometry& g, State st, float c_new) {
  if (!(c_new > *st.c)) return;
  if (*st.c != kNegInf) {
    const float factor = std::exp(*st.c - c_new);
    ScaleArray(st.s, g.m * g.dv_pad, factor);
    ScaleArray(st.z, g.m_pad, factor);
  }
  *st.c = c_new;
}

// dst += src in a fixed order, after bringing both to the larger stabiliser.
void MergeState(const Geometry& g, State dst, State src) {
  if (*src.c == kNegInf) return;  // an empty FAVOR+ state adds nothing
  RaiseStabiliser(g, dst, *src.c);
  const float factor = *src.c == *dst.c ? 1.0f : std::exp(*src.c - *dst.c);
  const DF df;
  const VF f = hn::Set(df, factor);
  const std::int64_t count = g.m * g.dv_pad + g.m_pad;  // s and z are contiguous
  for (std::int64_t i = 0; i < count; i += kLanes) {
    hn::Store(hn::MulAdd(hn::Load(df, src.s + i), f, hn::Load(df, dst.s + i)), df, dst.s + i);
  }
}

// Per-thread scratch of one task (sized by MakeGeometry, bound once per task).
struct Scratch {
  float* x;       // FAVOR+: keys K'^T [D][C_pad] or queries Q' [C][D]
  float* knorm;   // [C_pad]: |k'|^2 / 2
  float* phi_kt;  // [M][C_pad]: phi(k)^T, zero past the chunk's keys
  float* vp;      // [C_pad][Dv_pad]: the chunk's values, zero past Dv
  float* phi_q;   // [C][M_pad]: phi(q), zero past M
  float* att;     // [C][C_pad]: causal intra-chunk weights
  float* num;     // [C][Dv_pad]
  float* den;     // [C_pad]
  float* run;     // one State: the running causal prefix
};

Geometry MakeGeometry(const LinearKernelParams& p) {
  Geometry g;
  g.chunk = p.chunk_size;
  g.chunk_pad = RoundUp(g.chunk);
  g.m = p.num_features;
  g.m_pad = RoundUp(g.m);
  g.dv_pad = RoundUp(p.head_dim_v);
  g.state_floats = g.m * g.dv_pad + g.m_pad + kLanes;
  const std::int64_t x = std::max(p.head_dim * g.chunk_pad, g.chunk * p.head_dim);
  g.scratch_floats = RoundUp(x) + g.chunk_pad + g.m * g.chunk_pad + g.chunk_pad * g.dv_pad +
                     g.chunk * g.m_pad + g.chunk * g.chunk_pad + g.chunk * g.dv_pad + g.chunk_pad +
                     g.state_floats;
  return g;
}

Scratch BindScratch(const LinearKernelParams& p, const Geometry& g, float* base) {
  Scratch s;
  s.x = base;
  base += RoundUp(std::max(p.head_dim * g.chunk_pad, g.chunk * p.head_dim));
  s.knorm = base;
  base += g.chunk_pad;
  s.phi_kt = base;
  base += g.m * g.chunk_pad;
  s.vp = base;
  base += g.chunk_pad * g.dv_pad;
  s.phi_q = base;
  base += g.chunk * g.m_pad;
  s.att = base;
  base += g.chunk * g.chunk_pad;
  s.num = base;
  base += g.chunk * g.dv_pad;
  s.den = base;
  base += g.chunk_pad;
  s.run = base;
  return s;
}

// dst[0, count) = src[e * stride] * scale, dst[count, pad) = 0. Operand rows are contiguous
// in both BSHD and BHSD (stride 1): then whole vectors are copied.
void PackRow(const float* src, std::int64_t stride, std::int64_t count, float scale, float* dst,
             std::int64_t pad) {
  const DF df;
  std::int64_t e = 0;
  if (stride == 1) {
    const VF f = hn::Set(df, scale);
    for (; e + kLanes <= count; e += kLanes)
      hn::StoreU(hn::Mul(hn::LoadU(df, src + e), f), df, dst + e);
  }
  for (; e < count; ++e) dst[e] = src[e * stride] * scale;
  std::fill(dst + count, dst + pad, 0.0f);
}

// dst[d * ldd + t] = src[t * row_stride + d * col_stride] * scale for t < rows, d < cols (a
// transposed pack, reading each source row in order); dst[d * ldd + t] = 0 for t in [rows, ldd).
void PackTransposed(const float* src, std::int64_t row_stride, std::int64_t col_stride,
                    std::int64_t rows, std::int64_t cols, float scale, float* dst,
                    std::int64_t ldd) {
  for (std::int64_t t = 0; t < rows; ++t) {
    const float* row = src + t * row_stride;
    for (std::int64_t d = 0; d < cols; ++d) dst[d * ldd + t] = row[d * col_stride] * scale;
  }
  for (std::int64_t d = 0; d < cols; ++d)
    std::fill(dst + d * ldd + rows, dst + (d + 1) * ldd, 0.0f);
}

// Asks for the cache lines of `rows` rows of `row_floats` contiguous floats, `row_stride` apart.
// The next chunk's rows are fetched while this one computes: in BSHD a head's rows are
// Hkv * D floats apart, a few per 4 KiB page, where the hardware prefetchers stop, so without
// this every chunk waited on DRAM latency (elu+1, which does little arithmetic per byte, was
// latency-bound).
void PrefetchRows(const float* base, std::int64_t row_stride, std::int64_t rows,
                  std::int64_t row_floats) {
  constexpr std::int64_t kLineFloats = 64 / sizeof(float);
  for (std::int64_t t = 0; t < rows; ++t) {
    for (std::int64_t e = 0; e < row_floats; e += kLineFloats)
      hwy::Prefetch(base + t * row_stride + e);
  }
}

// elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise: positive, so every normaliser is > 0.
HWY_INLINE VF EluPlusOne(DF df, VF x) {
  return hn::IfThenElse(hn::Gt(x, hn::Zero(df)), hn::Add(x, hn::Set(df, 1.0f)), hn::Exp(df, x));
}

// phi(k)^T and the packed values of keys [j0, j0 + n) of (b, kv_head), n <= C; raises the
// state's stabiliser to cover them first (FAVOR+), so that phi(k) and the state share c.
//   w: [M][D] the FAVOR+ projection (unused for elu+1)
void KeyFeatures(const LinearKernelParams& p, const Geometry& g, const float* w, std::int64_t b,
                 std::int64_t kv_head, std::int64_t j0, std::int64_t n, const Scratch& s,
                 State st) {
  const DF df;
  const std::int64_t cp = g.chunk_pad, d_count = p.head_dim;
  const float* k = p.k + b * p.k_stride[0] + j0 * p.k_stride[1] + kv_head * p.k_stride[2];
  const float* v = p.v + b * p.v_stride[0] + j0 * p.v_stride[1] + kv_head * p.v_stride[2];
  if (p.k_stride[3] == 1 && p.v_stride[3] == 1) {
    const std::int64_t next = std::min(g.chunk, p.seq_kv - (j0 + n));
    PrefetchRows(k + n * p.k_stride[1], p.k_stride[1], next, d_count);
    PrefetchRows(v + n * p.v_stride[1], p.v_stride[1], next, p.head_dim_v);
  }
  for (std::int64_t t = 0; t < n; ++t) {
    PackRow(v + t * p.v_stride[1], p.v_stride[3], p.head_dim_v, 1.0f, s.vp + t * g.dv_pad,
            g.dv_pad);
  }
  const std::int64_t n_pad = RoundUp(n);
  // elu+1: phi(k)^T [D][C_pad] from k itself; FAVOR+: K'^T [D][C_pad]. Zero past n.
  PackTransposed(k, p.k_stride[1], p.k_stride[3], n, d_count, p.favor ? p.feature_scale : 1.0f,
                 p.favor ? s.x : s.phi_kt, cp);
  if (!p.favor) {
    for (std::int64_t d = 0; d < d_count; ++d) {
      float* row = s.phi_kt + d * cp;
      for (std::int64_t t = 0; t < n_pad; t += kLanes) {
        hn::Store(EluPlusOne(df, hn::Load(df, row + t)), df, row + t);
      }
      std::fill(row + n, row + cp, 0.0f);  // elu(0) + 1 = 1 in the padding
    }
    return;
  }
  // |k'|^2 / 2, zero past n.
  std::fill(s.knorm, s.knorm + cp, 0.0f);
  for (std::int64_t d = 0; d < d_count; ++d) {
    for (std::int64_t t = 0; t < n_pad; t += kLanes) {
      const VF x = hn::Load(df, s.x + d * cp + t);
      hn::Store(hn::MulAdd(x, x, hn::Load(df, s.knorm + t)), df, s.knorm + t);
    }
  }
  ScaleArray(s.knorm, n_pad, 0.5f);
  // Exponents P^T - |k'|^2/2 [M][C_pad]; their maximum over the n real keys.
  Gemm(g.m, n_pad, d_count, w, d_count, 1, s.x, cp, s.phi_kt, cp, false);
  VF vmax = hn::Set(df, kNegInf);
  const auto valid = hn::FirstN(df, static_cast<std::size_t>(n % kLanes));
  for (std::int64_t r = 0; r < g.m; ++r) {
    float* row = s.phi_kt + r * cp;
    for (std::int64_t t = 0; t < n_pad; t += kLanes) {
      const VF e = hn::Sub(hn::Load(df, row + t), hn::Load(df, s.knorm + t));
      hn::Store(e, df, row + t);
      const bool partial = t + kLanes > n;
      vmax = hn::Max(vmax, partial ? hn::IfThenElse(valid, e, hn::Set(df, kNegInf)) : e);
    }
  }
  RaiseStabiliser(g, st, hn::GetLane(hn::MaxOfLanes(df, vmax)));
  // phi(k)^T = exp(exponent - c) / sqrt(M) <= 1 / sqrt(M); zero past n.
  const VF c = hn::Set(df, *st.c);
  const VF inv_sqrt_m = hn::Set(df, 1.0f / std::sqrt(static_cast<float>(g.m)));
  for (std::int64_t r = 0; r < g.m; ++r) {
    float* row = s.phi_kt + r * cp;
    for (std::int64_t t = 0; t < n_pad; t += kLanes) {
      hn::Store(hn::Mul(hn::Exp(df, hn::Sub(hn::Load(df, row + t), c)), inv_sqrt_m), df, row + t);
    }
    std::fill(row + n, row + cp, 0.0f);
  }
}

// The keys phi(k)^T, vp just computed (n of them) join the state: S += phi(k)^T V, z += phi(k)^T 1.
void Absorb(const LinearKernelParams& p, const Geometry& g, std::int64_t n, const Scratch& s,
            State st) {
  const DF df;
  Gemm(g.m, g.dv_pad, n, s.phi_kt, g.chunk_pad, 1, s.vp, g.dv_pad, st.s, g.dv_pad, true);
  const std::int64_t n_pad = RoundUp(n);
  for (std::int64_t r = 0; r < g.m; ++r) {
    VF sum = hn::Zero(df);
    for (std::int64_t t = 0; t < n_pad; t += kLanes)
      sum = hn::Add(sum, hn::Load(df, s.phi_kt + r * g.chunk_pad + t));
    st.z[r] += hn::GetLane(hn::SumOfLanes(df, sum));
  }
}

// Keys [begin, end) of (b, kv_head) into the state, C at a time.
void AbsorbRange(const LinearKernelParams& p, const Geometry& g, const float* w, std::int64_t b,
                 std::int64_t kv_head, std::int64_t begin, std::int64_t end, const Scratch& s,
                 State st) {
  for (std::int64_t j = begin; j < end; j += g.chunk) {
    const std::int64_t n = std::min(g.chunk, end - j);
    KeyFeatures(p, g, w, b, kv_head, j, n, s, st);
    Absorb(p, g, n, s, st);
  }
}

// phi(q) [rows][M_pad] of query rows [i0, i0 + rows) of head h; zero past M.
//   wt: [D][M_pad] projection transposed
void QueryFeatures(const LinearKernelParams& p, const Geometry& g, const float* wt, std::int64_t b,
                   std::int64_t h, std::int64_t i0, std::int64_t rows, const Scratch& s) {
  const DF df;
  const std::int64_t mp = g.m_pad, d_count = p.head_dim;
  const float* q = p.q + b * p.q_stride[0] + i0 * p.q_stride[1] + h * p.q_stride[2];
  if (p.q_stride[3] == 1) {
    PrefetchRows(q + rows * p.q_stride[1], p.q_stride[1], std::min(g.chunk, p.seq_q - i0 - rows),
                 d_count);
  }
  if (!p.favor) {
    for (std::int64_t t = 0; t < rows; ++t) {
      float* row = s.phi_q + t * mp;
      PackRow(q + t * p.q_stride[1], p.q_stride[3], d_count, 1.0f, row, mp);
      for (std::int64_t d = 0; d < mp; d += kLanes) {
        hn::Store(EluPlusOne(df, hn::Load(df, row + d)), df, row + d);
      }
      std::fill(row + d_count, row + mp, 0.0f);  // elu(0) + 1 = 1 in the padding
    }
    return;
  }
  for (std::int64_t t = 0; t < rows; ++t) {
    PackRow(q + t * p.q_stride[1], p.q_stride[3], d_count, p.feature_scale, s.x + t * d_count,
            d_count);
  }
  Gemm(rows, mp, d_count, s.x, d_count, 1, wt, mp, s.phi_q, mp, false);
  // Row stabiliser: exp(w_r.q' - |q'|^2/2 - (max_r w_r.q' - |q'|^2/2)) = exp(w_r.q' - max).
  const VF inv_sqrt_m = hn::Set(df, 1.0f / std::sqrt(static_cast<float>(g.m)));
  const auto valid = hn::FirstN(df, static_cast<std::size_t>(g.m % kLanes));
  for (std::int64_t t = 0; t < rows; ++t) {
    float* row = s.phi_q + t * mp;
    VF vmax = hn::Set(df, kNegInf);
    for (std::int64_t r = 0; r < mp; r += kLanes) {
      const VF e = hn::Load(df, row + r);
      vmax = hn::Max(vmax, r + kLanes > g.m ? hn::IfThenElse(valid, e, vmax) : e);
    }
    const VF row_max = hn::Set(df, hn::GetLane(hn::MaxOfLanes(df, vmax)));
    for (std::int64_t r = 0; r < mp; r += kLanes) {
      hn::Store(hn::Mul(hn::Exp(df, hn::Sub(hn::Load(df, row + r), row_max)), inv_sqrt_m), df,
                row + r);
    }
    std::fill(row + g.m, row + mp, 0.0f);
  }
}

float Dot(const float* a, const float* b, std::int64_t count_pad) {
  const DF df;
  VF sum = hn::Zero(df);
  for (std::int64_t i = 0; i < count_pad; i += kLanes) {
    sum = hn::MulAdd(hn::Load(df, a + i), hn::Load(df, b + i), sum);
  }
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

// Outputs of query rows [i0, i0 + rows) of head h from phi(q) (in scratch) and the state; for
// causal also the chunk's own keys [a, a + n) (phi_kt, vp), key j allowed for row i while
// j < key_end(i) = clamp(i + offset + 1, 0, L).
void WriteOutputs(const LinearKernelParams& p, const Geometry& g, std::int64_t b, std::int64_t h,
                  std::int64_t i0, std::int64_t rows, State st, std::int64_t a, std::int64_t n,
                  std::int64_t length, const Scratch& s) {
  Gemm(rows, g.dv_pad, g.m, s.phi_q, g.m_pad, 1, st.s, g.dv_pad, s.num, g.dv_pad, false);
  for (std::int64_t t = 0; t < rows; ++t) s.den[t] = Dot(s.phi_q + t * g.m_pad, st.z, g.m_pad);
  if (n > 0) {
    const std::int64_t cp = g.chunk_pad;
    Gemm(rows, RoundUp(n), g.m, s.phi_q, g.m_pad, 1, s.phi_kt, cp, s.att, cp, false);
    for (std::int64_t t = 0; t < rows; ++t) {
      const std::int64_t key_end =
          std::clamp<std::int64_t>(i0 + t + p.diagonal_offset + 1, 0, length);
      const std::int64_t allowed = std::clamp<std::int64_t>(key_end - a, 0, n);
      float* row = s.att + t * cp;
      std::fill(row + allowed, row + RoundUp(n), 0.0f);
      float sum = 0.0f;
      for (std::int64_t u = 0; u < allowed; ++u) sum += row[u];
      s.den[t] += sum;
    }
    Gemm(rows, g.dv_pad, n, s.att, cp, 1, s.vp, g.dv_pad, s.num, g.dv_pad, true);
  }
  float* out = p.out + b * p.out_stride[0] + i0 * p.out_stride[1] + h * p.out_stride[2];
  const DF df;
  for (std::int64_t t = 0; t < rows; ++t) {
    // den > 0 whenever a key was in (elu+1 > 0); 0 for a row without keys or whose feature
    // products all underflowed: out 0, never 0/0. num * (1 / den) while den is normal; a true
    // division for subnormal den, where 1 / den would overflow (|num| <= den * max |v|).
    const float den = s.den[t];
    const float* num = s.num + t * g.dv_pad;
    float* row = out + t * p.out_stride[1];
    const std::int64_t stride = p.out_stride[3];
    std::int64_t e = 0;
    if (den >= std::numeric_limits<float>::min()) {
      const float inv = 1.0f / den;
      if (stride == 1) {
        for (; e + kLanes <= p.head_dim_v; e += kLanes) {
          hn::StoreU(hn::Mul(hn::Load(df, num + e), hn::Set(df, inv)), df, row + e);
        }
      }
      for (; e < p.head_dim_v; ++e) row[e * stride] = num[e] * inv;
    } else {
      for (; e < p.head_dim_v; ++e) row[e * stride] = den > 0.0f ? num[e] / den : 0.0f;
    }
  }
}

std::int64_t KeyLength(const LinearKernelParams& p, std::int64_t b) {
  return p.key_lengths != nullptr ? p.key_lengths[b] : p.seq_kv;
}

// First key a query chunk starting at row i0 does not see through the state: clamp(i0 + offset).
std::int64_t ChunkKeyBegin(const LinearKernelParams& p, std::int64_t i0, std::int64_t length) {
  return std::clamp<std::int64_t>(i0 + p.diagonal_offset, 0, length);
}

}  // namespace linear

void LinearForward(const LinearKernelParams& p) {
  using namespace linear;
  const Geometry g = MakeGeometry(p);
  const std::int64_t pairs = p.batch * p.num_heads_kv;
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  const std::int64_t q_chunks = (p.seq_q + g.chunk - 1) / g.chunk;
  // Segments per (batch, kv head), from the shape only. Non-causal splits cost only a merge:
  // aim at 32 tasks. Causal splits cost a second pass over the earlier segments' keys: aim at
  // 8 tasks and split only when (batch, kv head) pairs are fewer.
  const std::int64_t target = p.causal ? 8 : 32;
  const std::int64_t segments = std::clamp<std::int64_t>((target + pairs - 1) / pairs, 1,
                                                         std::max<std::int64_t>(q_chunks, 1));
  const std::int64_t chunks_per_segment = (q_chunks + segments - 1) / segments;
  const std::int64_t key_blocks = (p.seq_kv + g.chunk - 1) / g.chunk;
  const std::int64_t blocks_per_segment = (key_blocks + segments - 1) / segments;

  // Shared, read-only after setup: W [M][D] and W^T [D][M_pad] (FAVOR+).
  AlignedBuffer wt_buffer(sizeof(float) * std::max<std::int64_t>(1, p.head_dim * g.m_pad));
  float* wt = wt_buffer.as<float>();
  if (p.favor) {
    for (std::int64_t d = 0; d < p.head_dim; ++d) {
      for (std::int64_t r = 0; r < g.m_pad; ++r) {
        wt[d * g.m_pad + r] = r < g.m ? p.projection[r * p.head_dim + d] : 0.0f;
      }
    }
  }
  // One State per (pair, segment): segment sums, then (pass 2) what pass 3 starts from.
  AlignedBuffer states(sizeof(float) * pairs * segments * g.state_floats);
  const auto state_at = [&](std::int64_t pair, std::int64_t seg) {
    return BindState(g, states.as<float>() + (pair * segments + seg) * g.state_floats);
  };
  const std::int64_t num_tasks = pairs * segments;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  AlignedBuffer scratch(sizeof(float) * g.scratch_floats * num_threads);
  const auto bind = [&](int thread) {
    return BindScratch(p, g, scratch.as<float>() + thread * g.scratch_floats);
  };
  // Keys summed by segment seg in pass 1: causal, [start of seg, start of seg + 1) where a
  // segment starts at its first chunk's ChunkKeyBegin (segment 0 at key 0); non-causal, its
  // blocks of keys.
  const auto key_range = [&](std::int64_t b, std::int64_t seg) {
    const std::int64_t length = KeyLength(p, b);
    if (!p.causal) {
      return std::pair{std::min(length, seg * blocks_per_segment * g.chunk),
                       std::min(length, (seg + 1) * blocks_per_segment * g.chunk)};
    }
    const auto start = [&](std::int64_t s) {
      return s == 0 ? 0
                    : ChunkKeyBegin(p, std::min(p.seq_q, s * chunks_per_segment * g.chunk), length);
    };
    return std::pair{start(seg), start(seg + 1)};
  };

  // Pass 1: segment sums (causal: all but the last segment, whose sum nobody reads).
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    const std::int64_t pair = task / segments, seg = task % segments;
    const State st = state_at(pair, seg);
    ZeroState(p, g, st);
    if (p.causal && seg == segments - 1) return;
    const auto [begin, end] = key_range(pair / p.num_heads_kv, seg);
    AbsorbRange(p, g, p.projection, pair / p.num_heads_kv, pair % p.num_heads_kv, begin, end,
                bind(thread), st);
  });
  // Pass 2, fixed order: causal, state[seg] := sum of segments < seg (exclusive prefix);
  // non-causal, state[0] := sum of all.
  parallel_for(pairs, num_threads, [&](std::int64_t pair, int thread) {
    if (!p.causal) {
      for (std::int64_t seg = 1; seg < segments; ++seg)
        MergeState(g, state_at(pair, 0), state_at(pair, seg));
      return;
    }
    const State run = BindState(g, bind(thread).run);
    ZeroState(p, g, run);
    for (std::int64_t seg = 0; seg < segments; ++seg) {
      const State st = state_at(pair, seg);
      std::swap_ranges(st.s, st.s + g.state_floats, run.s);  // st := prefix, run := this sum
      MergeState(g, run, st);                                // run := prefix + this sum
    }
  });
  // Pass 3: outputs, segment by segment of query chunks.
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    const std::int64_t pair = task / segments, seg = task % segments;
    const std::int64_t b = pair / p.num_heads_kv, kv_head = pair % p.num_heads_kv;
    const std::int64_t length = KeyLength(p, b);
    const Scratch s = bind(thread);
    State st = state_at(pair, p.causal ? seg : 0);
    std::int64_t covered = 0;  // causal: the state holds keys [0, covered)
    if (p.causal) {
      const State run = BindState(g, s.run);
      std::memcpy(run.s, st.s, sizeof(float) * g.state_floats);
      st = run;
      covered = key_range(b, seg).first;
    }
    const std::int64_t first = seg * chunks_per_segment * g.chunk;
    const std::int64_t last = std::min(p.seq_q, (seg + 1) * chunks_per_segment * g.chunk);
    for (std::int64_t i0 = first; i0 < last; i0 += g.chunk) {
      const std::int64_t rows = std::min(g.chunk, last - i0);
      std::int64_t a = 0, n = 0;
      if (p.causal) {
        a = ChunkKeyBegin(p, i0, length);
        AbsorbRange(p, g, p.projection, b, kv_head, covered, a, s, st);
        n = ChunkKeyBegin(p, i0 + rows, length) - a;
        if (n > 0) KeyFeatures(p, g, p.projection, b, kv_head, a, n, s, st);
      }
      for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        QueryFeatures(p, g, wt, b, h, i0, rows, s);
        WriteOutputs(p, g, b, h, i0, rows, st, a, n, length, s);
      }
      if (n > 0) Absorb(p, g, n, s, st);
      covered = a + n;
    }
  });
}

const char* LinearTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(LinearForward);
HWY_EXPORT(LinearTargetName);

void linear_attention_cpu(const LinearKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(LinearForward)(params);
}

const char* linear_attention_cpu_target_name() { return HWY_DYNAMIC_DISPATCH(LinearTargetName)(); }

}  // namespace qkv
#endif  // HWY_ONCE
