// The flash backward's five tile products (flash_backward.cc) as a policy, chosen once at the
// kernel's entry (Highway, one copy per target). Per task (a key tile of kKeys keys) and row
// tile (kRowsPerTile query rows of one head):
//
//   s  = q k^T * scale      dp = dout v^T      dv^T += dout^T p      dk^T += q^T du      dq = du k
//
// WideBackward<T>: the rank-1-update f32 micro-kernel (tile_products-inl.h) on operands widened
// to f32, every target and dtype. AmxBackward: bf16 inputs on AMX tiles (kernels/cpu/amx.h; the
// AVX3 targets of a CPU with AMX-BF16): q, k and v multiply as they are, dout, p and du are
// rounded to bf16 (to nearest even) for the products that take them, as FlashAttention's
// bf16 backward does; every sum accumulates in f32, and the softmax, masks and ds stay f32.
// docs/training.md, "bf16 on AMX tiles".

#if defined(QKV_KERNELS_CPU_BACKWARD_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_BACKWARD_PRODUCTS_INL_H_
#undef QKV_KERNELS_CPU_BACKWARD_PRODUCTS_INL_H_
#else
#define QKV_KERNELS_CPU_BACKWARD_PRODUCTS_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kernels/backward_kernel_params.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_products-inl.h"
#include "kernels/cpu/tile_staging-inl.h"
#include "kernels/kernel_params.h"
#include "kernels/product_path.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace backward {

using tiles::DF;
using tiles::kBlockQ;
using tiles::kLanes;
using tiles::VF;
namespace hn = hwy::HWY_NAMESPACE;

constexpr std::int64_t kKeys = kBlockQ;    // keys per task: the lanes of the products
constexpr std::int64_t kRowsPerTile = 64;  // query rows per tile
// The AMX products exist where a task's keys fill the tiles' 64 lanes (AVX3 targets).
constexpr bool kAmxLanes = kKeys == amx::kLanes;
// Key tiles per task: each row tile's packing (q^T / dout^T on the tiles, q * scale in f32)
// and dq adds then serve four key tiles (their dq products summed in the task's dq tile first).
// Against one tile per task, alternating, 2 threads, L = 4096: bf16 on the tiles 1.16x (two)
// then 1.10x (four) at D = 128, 1.105x then 1.05x at D = 64, eight level with four; f32
// 1.16x / 1.19x (four) at D = 128 / 64.
constexpr std::int64_t kTilesPerTask = 4;

inline std::int64_t RoundUp(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// The sizes every task shares, and its scratch layout (offsets in floats; every area starts
// 64-byte aligned). Both: s, dp, cap, pz, dqt, dkt, dvt. Widened only: kt, vt, kp (the keys and
// values in f32), qs and douts (a row tile's q * scale and dout). AMX and pairs only: the bf16
// operands named in AmxBackward.
struct Plan {
  std::int64_t key_tiles, row_tiles, passes;  // passes: head_dim in kBlockQ-wide parts
  // A task takes tiles_per_task consecutive key tiles (groups of them: key_groups per kv head),
  // each with a scratch of its own (`floats` apart).
  std::int64_t tiles_per_task, key_groups;
  std::int64_t kt, vt, kp, qs, douts, dkt, dvt, s, dp, cap, pz, dqt;
  std::int64_t depth, depth_v;  // AMX and pairs: D and Dv rounded up to the tiles' 32
  std::int64_t k_pairs, v_pairs, k_cols, q_cols, dout_cols, p_pairs, du_pairs, du_rows;
  std::int64_t floats;
};

inline Plan MakePlan(const AttentionKernelParams& p, bool tiles) {
  Plan plan{};
  plan.key_tiles = (p.seq_kv + kKeys - 1) / kKeys;
  plan.row_tiles = (p.seq_q + kRowsPerTile - 1) / kRowsPerTile;
  plan.passes = (p.head_dim + kBlockQ - 1) / kBlockQ;
  plan.tiles_per_task = kTilesPerTask;
  plan.key_groups = (plan.key_tiles + plan.tiles_per_task - 1) / plan.tiles_per_task;
  std::int64_t at = 0;
  auto take = [&](std::int64_t n) {
    const std::int64_t start = at;
    at += RoundUp(n, kBlockQ);
    return start;
  };
  if (!tiles) {  // (the widened operands; the tiles and the pairs read the bf16 ones below)
    plan.kt = take(p.head_dim * kKeys);
    plan.vt = take(p.head_dim_v * kKeys);
    plan.kp = take(plan.passes * kKeys * kBlockQ);
    plan.qs = take(kRowsPerTile * p.head_dim);
    plan.douts = take(kRowsPerTile * p.head_dim_v);
  }
  // (rows past D / Dv up to 16: the tiles write them)
  plan.dkt = take(RoundUp(p.head_dim, 16) * kKeys);
  plan.dvt = take(RoundUp(p.head_dim_v, 16) * kKeys);
  plan.s = take(kRowsPerTile * kKeys);
  plan.dp = take(kRowsPerTile * kKeys);
  plan.cap = take(kRowsPerTile * kKeys);
  plan.pz = take(kRowsPerTile * kKeys);
  plan.dqt = take(plan.passes * kRowsPerTile * kBlockQ);
  if (tiles) {  // (bf16 and pair words: two per float)
    plan.depth = RoundUp(p.head_dim, amx::kDepthStep);
    plan.depth_v = RoundUp(p.head_dim_v, amx::kDepthStep);
    plan.k_pairs = take(plan.depth / 2 * kKeys);
    plan.v_pairs = take(plan.depth_v / 2 * kKeys);
    plan.k_cols = take(plan.passes * kKeys / 2 * kBlockQ);
    plan.q_cols = take(RoundUp(p.head_dim, 16) * tiles::kBlockK / 2);
    plan.dout_cols = take(RoundUp(p.head_dim_v, 16) * tiles::kBlockK / 2);
    plan.p_pairs = take(kRowsPerTile / 2 * kKeys);
    plan.du_pairs = take(kRowsPerTile / 2 * kKeys);
    plan.du_rows = take(kRowsPerTile * kKeys / 2);
  }
  plan.floats = at;
  return plan;
}

template <typename T>
float Element(const void* base, std::int64_t offset) {
  return tiles::WideElement(static_cast<const T*>(base)[offset]);
}

// AMX: every row of q (bf16 as stored) and bf16(dout) (to nearest even), zero past D / Dv up
// to depth / depth_v, rows (b, h, i) in that order, and 16 zero rows past the last (which the
// tiles of a last, partial row tile read). Made once per row in the pass that computes D_r
// (AmxBackward::CopyRows), where every key tile would otherwise gather them again (BSHD's rows
// lie Hq * D elements apart): q rows are s's A operand and dout rows dp's, both transposed per
// row tile for dk and dv. q's size plus half of dout's. (The widened path copies nothing per
// call: null.)
struct RowCopies {
  std::uint16_t* q16 = nullptr;
  std::uint16_t* dout16 = nullptr;
};

// One row tile: head h of batch entry b, rows [i0, i0 + rows).
struct RowTile {
  std::int64_t b, h, i0, rows;
  const std::uint16_t* q16;  // AMX: the copies' rows from i0 on (null widened)
  const std::uint16_t* dout16;
  // The scratch whose row-tile areas PackRows fills (widened: qs, douts; AMX: q_cols,
  // dout_cols), read by the products of every key tile of the task.
  float* row_scratch;
};

inline void CopyRowsBf16(const AttentionBackwardKernelParams& g, const Plan& plan, std::int64_t b,
                         std::int64_t h, const RowCopies& copies) {
  const AttentionKernelParams& p = g.forward;
  const DF df;
  const std::int64_t d = p.head_dim, dv = p.head_dim_v;
  const std::int64_t first = (b * p.num_heads_q + h) * p.seq_q;
  for (std::int64_t i = 0; i < p.seq_q; ++i) {
    const std::uint16_t* q = static_cast<const std::uint16_t*>(p.q) + b * p.q_stride[0] +
                             i * p.q_stride[1] + h * p.q_stride[2];
    std::uint16_t* q_dst = copies.q16 + (first + i) * plan.depth;
    if (p.q_stride[3] == 1) {
      std::memcpy(q_dst, q, d * sizeof(std::uint16_t));
    } else {
      for (std::int64_t e = 0; e < d; ++e) q_dst[e] = q[e * p.q_stride[3]];
    }
    std::fill(q_dst + d, q_dst + plan.depth, std::uint16_t{0});
    const float* src = g.dout + b * g.dout_stride[0] + i * g.dout_stride[1] + h * g.dout_stride[2];
    std::uint16_t* dst = copies.dout16 + (first + i) * plan.depth_v;
    std::int64_t e = 0;
    if (g.dout_stride[3] == 1) {
      for (; e + kLanes <= dv; e += kLanes) {
        tiles::StoreHalfLanes(DType::kBF16, df, hn::LoadU(df, src + e), dst + e);
      }
    }
    for (; e < dv; ++e) dst[e] = f32_to_bf16_bits(src[e * g.dout_stride[3]]);
    std::fill(dst + dv, dst + plan.depth_v, std::uint16_t{0});
  }
}

// pairs[t][l] = (x[l][2t], x[l][2t + 1]) for t < half_depth, l < kKeys, from `dim` elements of
// num_k bf16 rows (rows row_stride, elements elem_stride apart), zero past them. With unit
// stride along an even dim a row already is its pair words: squares of kLanes words x kLanes
// rows are transposed in registers (as PackQueryPairs does), the rest word by word.
inline void PairRows(const std::uint16_t* x, std::int64_t row_stride, std::int64_t elem_stride,
                     std::int64_t dim, std::int64_t num_k, std::int64_t half_depth,
                     std::uint32_t* pairs) {
  const auto at = [&](std::int64_t l, std::int64_t d) -> std::uint32_t {
    return l < num_k && d < dim ? x[l * row_stride + d * elem_stride] : 0u;
  };
  std::int64_t squares = 0;
#if HWY_TARGET != HWY_SCALAR
  using DU = hn::RebindToUnsigned<DF>;
  const DU du;
  const hn::Repartition<std::uint16_t, DU> du16;
  if (elem_stride == 1 && dim % 2 == 0) {
    squares = dim / 2 / kLanes * kLanes;
    for (std::int64_t l0 = 0; l0 < kKeys; l0 += kLanes) {
      for (std::int64_t t0 = 0; t0 < squares; t0 += kLanes) {
        hn::Vec<DU> v[kLanes];
        HWY_UNROLL(16)
        for (std::int64_t r = 0; r < kLanes; ++r) {
          v[r] = l0 + r < num_k
                     ? hn::BitCast(du, hn::LoadU(du16, x + (l0 + r) * row_stride + 2 * t0))
                     : hn::Zero(du);
        }
        TransposeSquare(du, v);
        HWY_UNROLL(16)
        for (std::int64_t c = 0; c < kLanes; ++c)
          hn::Store(v[c], du, pairs + (t0 + c) * kKeys + l0);
      }
    }
  }
#endif
  for (std::int64_t l = 0; l < kKeys; ++l) {
    for (std::int64_t t = squares; t < half_depth; ++t) {
      pairs[t * kKeys + l] = at(l, 2 * t) | at(l, 2 * t + 1) << 16;
    }
  }
}

// A task scope that does nothing (the f32 products need no tile state).
struct NoScope {};

// The f32 products: the keys and values widened once per task, q * scale and dout once per row
// tile.
template <typename T>
struct WideBackward {
  using TaskScope = NoScope;
  // The task asks for its dk and dv rows toward L2 when it starts (flash_backward.cc,
  // PrefetchGradientRows).
  static constexpr bool kPrefetchGradients = true;

  static std::int64_t CopyBytes(const AttentionKernelParams&, const Plan&) { return 0; }
  static RowCopies Copies(const AttentionKernelParams&, const Plan&, void*) { return {}; }
  static void CopyRows(const AttentionBackwardKernelParams&, const Plan&, std::int64_t,
                       std::int64_t, const RowCopies&) {}
  static RowTile MakeRowTile(const AttentionKernelParams&, const Plan&, const RowCopies&,
                             std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t rows,
                             float* row_scratch) {
    return {b, h, i0, rows, nullptr, nullptr, row_scratch};
  }

  // kt[d][l] = k[j0 + l][d], vt[e][l] = v[j0 + l][e], kp[pass][l][x] = k[j0 + l][pass kBlockQ + x]
  // (f32, zero past num_k). kt and vt are transposed in squares of registers (element by
  // element, the loads waited on rows that lie Hkv * D elements apart in BSHD, one at a time).
  static void PackKeys(const AttentionKernelParams& p, const Plan& plan, std::int64_t b,
                       std::int64_t hkv, std::int64_t j0, std::int64_t num_k, float* w) {
    float* kt = w + plan.kt;
    float* vt = w + plan.vt;
    float* kp = w + plan.kp;
    std::fill(kt, kt + p.head_dim * kKeys, 0.0f);
    std::fill(vt, vt + p.head_dim_v * kKeys, 0.0f);
    std::fill(kp, kp + plan.passes * kKeys * kBlockQ, 0.0f);
    const T* k =
        static_cast<const T*>(p.k) + b * p.k_stride[0] + j0 * p.k_stride[1] + hkv * p.k_stride[2];
    const T* v =
        static_cast<const T*>(p.v) + b * p.v_stride[0] + j0 * p.v_stride[1] + hkv * p.v_stride[2];
    tiles::TransposeRows(k, p.k_stride[1], p.k_stride[3], p.head_dim, num_k, kt, kKeys);
    tiles::TransposeRows(v, p.v_stride[1], p.v_stride[3], p.head_dim_v, num_k, vt, kKeys);
    for (std::int64_t l = 0; l < num_k; ++l) {
      const T* row = k + l * p.k_stride[1];
      for (std::int64_t pass = 0; pass < plan.passes; ++pass) {
        const std::int64_t d0 = pass * kBlockQ, width = std::min(kBlockQ, p.head_dim - d0);
        float* dst = kp + (pass * kKeys + l) * kBlockQ;
        if (p.k_stride[3] == 1) {
          tiles::WidenRow(row + d0, width, dst);
        } else {
          for (std::int64_t x = 0; x < width; ++x) {
            dst[x] = tiles::WideElement(row[(d0 + x) * p.k_stride[3]]);
          }
        }
      }
    }
  }

  // qs[r][d] = q[i0 + r][d] * scale, douts[r][e] = dout[i0 + r][e]: every key tile's products
  // read them, and in BSHD the user's rows lie Hq * D elements apart, so that the 64 rows of a
  // tile share a few L1 sets (dout read where it lies: 0.94x at L = 4096, D = 128, 0.89x at
  // (8, 12, 12, 512, 512, 64); docs/kernels.md, "Backward").
  static void PackRows(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t) {
    const AttentionKernelParams& p = g.forward;
    float* qs = t.row_scratch + plan.qs;
    float* douts = t.row_scratch + plan.douts;
    for (std::int64_t r = 0; r < t.rows; ++r) {
      const std::int64_t q_row =
          t.b * p.q_stride[0] + (t.i0 + r) * p.q_stride[1] + t.h * p.q_stride[2];
      for (std::int64_t d = 0; d < p.head_dim; ++d) {
        qs[r * p.head_dim + d] = Element<T>(p.q, q_row + d * p.q_stride[3]) * p.scale;
      }
      const float* dout =
          g.dout + t.b * g.dout_stride[0] + (t.i0 + r) * g.dout_stride[1] + t.h * g.dout_stride[2];
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) {
        douts[r * p.head_dim_v + e] = dout[e * g.dout_stride[3]];
      }
    }
  }

  // s[r][l] = qs_r . k_l.
  static void Scores(const AttentionKernelParams& p, const Plan& plan, const RowTile& t, float* w) {
    tiles::OuterProduct(w + plan.kt, t.row_scratch + plan.qs, t.rows, p.head_dim, 1, p.head_dim,
                        w + plan.s, nullptr, false);
  }

  // dp[r][l] = dout_r . v_l.
  static void DoutValues(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t,
                         float* w) {
    const std::int64_t dv = g.forward.head_dim_v;
    tiles::OuterProduct(w + plan.vt, t.row_scratch + plan.douts, t.rows, dv, 1, dv, w + plan.dp,
                        nullptr, false);
  }

  // dv^T[e][l] += sum_r dout[r][e] pv[r][l];  dk^T[d][l] += sum_r qs[r][d] du[r][l] (du in dp);
  // dqt[pass][r][x] = sum_l du[r][l] k[l][pass kBlockQ + x].
  static void Gradients(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t,
                        std::int64_t num_k, const float* pv, float* w, float* dqt,
                        bool add_to_dqt) {
    const AttentionKernelParams& p = g.forward;
    tiles::OuterProduct(pv, t.row_scratch + plan.douts, p.head_dim_v, 1, p.head_dim_v, t.rows,
                        w + plan.dvt, nullptr, true);
    tiles::OuterProduct(w + plan.dp, t.row_scratch + plan.qs, p.head_dim, 1, p.head_dim, t.rows,
                        w + plan.dkt, nullptr, true);
    for (std::int64_t pass = 0; pass < plan.passes; ++pass) {
      tiles::OuterProduct(w + plan.kp + pass * kKeys * kBlockQ, w + plan.dp, t.rows, kKeys, 1,
                          num_k, dqt + pass * kRowsPerTile * kBlockQ, nullptr, add_to_dqt);
    }
  }

  // What dk^T is multiplied by when written (qs carried the scale already).
  static float DkScale(const AttentionKernelParams&) { return 1.0f; }
};

// The bf16 products on AMX tiles. Operands (bf16 or pair words, zero past their extent up to
// the padded one, so padding adds exact zeros):
//   k_pairs [depth / 2][kKeys]   (k[l][2t], k[l][2t + 1])        s's B, per key tile
//   v_pairs [depth_v / 2][kKeys] (v[l][2t], v[l][2t + 1])        dp's B, per key tile
//   k_cols  [passes][kKeys / 2][kBlockQ] (k[2t][x], k[2t + 1][x]) dq's B, per key tile
//   q16     [Lq][depth]                q rows (CopyRows)          s's A, per (b, h)
//   dout16  [Lq][depth_v]              bf16(dout) rows (CopyRows) dp's A, per (b, h)
//   q_cols  [round_up(D, 16)][kBlockK] q^T                        dk's A, per row tile (PackRows)
//   dout_cols [round_up(Dv, 16)][kBlockK] bf16(dout)^T            dv's A, per row tile (PackRows)
//   p_pairs, du_pairs [kRowsPerTile / 2][kKeys] (x[2t][l], x[2t + 1][l])  dv's and dk's B
//   du_rows [kRowsPerTile][kKeys]      bf16(du) rows              dq's A
struct AmxBackward {
  using TaskScope = amx::TileScope;
  // (Its tasks end too soon for the prefetches to pay: 0.94-0.98x at L = 4096, D = 128.)
  static constexpr bool kPrefetchGradients = false;

  static std::int64_t CopyRowCount(const AttentionKernelParams& p) {
    return p.batch * p.num_heads_q * p.seq_q + amx::kTileRows;
  }
  static std::int64_t CopyBytes(const AttentionKernelParams& p, const Plan& plan) {
    return sizeof(std::uint16_t) * CopyRowCount(p) * (plan.depth + plan.depth_v);
  }
  // The copies in buffer, with their 16 zero rows past the last already written.
  static RowCopies Copies(const AttentionKernelParams& p, const Plan& plan, void* buffer) {
    const std::int64_t rows = CopyRowCount(p), used = rows - amx::kTileRows;
    RowCopies copies;
    copies.q16 = static_cast<std::uint16_t*>(buffer);
    copies.dout16 = copies.q16 + rows * plan.depth;
    std::fill(copies.q16 + used * plan.depth, copies.q16 + rows * plan.depth, std::uint16_t{0});
    std::fill(copies.dout16 + used * plan.depth_v, copies.dout16 + rows * plan.depth_v,
              std::uint16_t{0});
    return copies;
  }
  static RowTile MakeRowTile(const AttentionKernelParams& p, const Plan& plan,
                             const RowCopies& copies, std::int64_t b, std::int64_t h,
                             std::int64_t i0, std::int64_t rows, float* row_scratch) {
    const std::int64_t first = (b * p.num_heads_q + h) * p.seq_q + i0;
    return {b,
            h,
            i0,
            rows,
            copies.q16 + first * plan.depth,
            copies.dout16 + first * plan.depth_v,
            row_scratch};
  }
  static void CopyRows(const AttentionBackwardKernelParams& g, const Plan& plan, std::int64_t b,
                       std::int64_t h, const RowCopies& copies) {
    CopyRowsBf16(g, plan, b, h, copies);
  }

  static std::uint16_t* Bf16(float* w, std::int64_t at) {
    return reinterpret_cast<std::uint16_t*>(w + at);
  }
  static std::uint32_t* Words(float* w, std::int64_t at) {
    return reinterpret_cast<std::uint32_t*>(w + at);
  }

  // du's rows rounded to bf16 (dq's A), in the du_rows area.
  static const std::uint16_t* DuRows(const Plan& plan, const RowTile& t, const float* du,
                                     float* w) {
    const DF df;
    std::uint16_t* du_rows = Bf16(w, plan.du_rows);
    for (std::int64_t r = 0; r < t.rows; ++r) {
      for (std::int64_t x = 0; x < kKeys; x += kLanes) {
        tiles::StoreHalfLanes(DType::kBF16, df, hn::Load(df, du + r * kKeys + x),
                              du_rows + r * kKeys + x);
      }
    }
    return du_rows;
  }

  static void PackKeys(const AttentionKernelParams& p, const Plan& plan, std::int64_t b,
                       std::int64_t hkv, std::int64_t j0, std::int64_t num_k, float* w) {
    const std::uint16_t* k = static_cast<const std::uint16_t*>(p.k) + b * p.k_stride[0] +
                             j0 * p.k_stride[1] + hkv * p.k_stride[2];
    const std::uint16_t* v = static_cast<const std::uint16_t*>(p.v) + b * p.v_stride[0] +
                             j0 * p.v_stride[1] + hkv * p.v_stride[2];
    PairRows(k, p.k_stride[1], p.k_stride[3], p.head_dim, num_k, plan.depth / 2,
             Words(w, plan.k_pairs));
    PairRows(v, p.v_stride[1], p.v_stride[3], p.head_dim_v, num_k, plan.depth_v / 2,
             Words(w, plan.v_pairs));
    // k_cols: two key rows interleaved, kBlockQ dims per pass.
    std::uint32_t* k_cols = Words(w, plan.k_cols);
    for (std::int64_t pass = 0; pass < plan.passes; ++pass) {
      const std::int64_t d0 = pass * kBlockQ, width = std::min(kBlockQ, p.head_dim - d0);
      for (std::int64_t t = 0; t < kKeys / 2; ++t) {
        std::uint32_t* row = k_cols + (pass * kKeys / 2 + t) * kBlockQ;
        const std::uint16_t* lo = k + 2 * t * p.k_stride[1] + d0 * p.k_stride[3];
        const std::uint16_t* hi = lo + p.k_stride[1];
        std::int64_t x = 0;
        if (2 * t + 1 < num_k && p.k_stride[3] == 1) {  // (a loop the compiler vectorises)
          for (; x < width; ++x) row[x] = lo[x] | static_cast<std::uint32_t>(hi[x]) << 16;
        } else if (2 * t < num_k) {
          for (; x < width; ++x) {
            const std::uint32_t h = 2 * t + 1 < num_k ? hi[x * p.k_stride[3]] : 0u;
            row[x] = lo[x * p.k_stride[3]] | h << 16;
          }
        }
        std::fill(row + x, row + kBlockQ, 0u);
      }
    }
  }

  // q^T and bf16(dout)^T from CopyRows' rows.
  static void PackRows(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t) {
    const AttentionKernelParams& p = g.forward;
    tiles::StageColumnsBf16(t.q16, plan.depth, 1, p.head_dim, t.rows,
                            Bf16(t.row_scratch, plan.q_cols));
    tiles::StageColumnsBf16(t.dout16, plan.depth_v, 1, p.head_dim_v, t.rows,
                            Bf16(t.row_scratch, plan.dout_cols));
  }

  static void Scores(const AttentionKernelParams& p, const Plan& plan, const RowTile& t, float* w) {
    amx::scores(t.q16, plan.depth, Words(w, plan.k_pairs), plan.depth, t.rows, p.scale, w + plan.s);
  }

  static void DoutValues(const AttentionBackwardKernelParams&, const Plan& plan, const RowTile& t,
                         float* w) {
    amx::scores(t.dout16, plan.depth_v, Words(w, plan.v_pairs), plan.depth_v, t.rows, 1.0f,
                w + plan.dp);
  }

  static void Gradients(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t,
                        std::int64_t num_k, const float* pv, float* w, float* dqt,
                        bool add_to_dqt) {
    const AttentionKernelParams& p = g.forward;
    // dv^T += dout^T p and dk^T += q^T du: the rows are the reduction axis, paired.
    amx::pack_probs(pv, t.rows, nullptr, Words(w, plan.p_pairs));
    amx::values(Bf16(t.row_scratch, plan.dout_cols), tiles::kBlockK, Words(w, plan.p_pairs), t.rows,
                p.head_dim_v, nullptr, nullptr, w + plan.dvt);
    const float* du = w + plan.dp;
    amx::pack_probs(du, t.rows, nullptr, Words(w, plan.du_pairs));
    amx::values(Bf16(t.row_scratch, plan.q_cols), tiles::kBlockK, Words(w, plan.du_pairs), t.rows,
                p.head_dim, nullptr, nullptr, w + plan.dkt);
    // dq = du k: du's rows in bf16 (keys past num_k: du = 0 there, and k_cols too).
    const std::uint16_t* du_rows = DuRows(plan, t, du, w);
    const std::int64_t depth = RoundUp(num_k, amx::kDepthStep);
    for (std::int64_t pass = 0; pass < plan.passes; ++pass) {
      const std::uint32_t* k_cols = Words(w, plan.k_cols) + pass * kKeys / 2 * kBlockQ;
      float* out = dqt + pass * kRowsPerTile * kBlockQ;
      if (add_to_dqt) {  // (the values' product: out += A B, A's rows the dq rows)
        amx::values(du_rows, kKeys, k_cols, num_k, t.rows, nullptr, nullptr, out);
      } else {
        amx::scores(du_rows, kKeys, k_cols, depth, t.rows, 1.0f, out);
      }
    }
  }

  // q entered the products unscaled.
  static float DkScale(const AttentionKernelParams& p) { return p.scale; }
};

// The bf16 products on vdpbf16ps pairs (AVX512-BF16, bf16dot::outer_product), on AmxBackward's
// operands: its B operands (pair words along the reduction axis, [pairs][kKeys]: k_pairs,
// v_pairs, p_pairs, du_pairs, k_cols) are the pairs' a, and its A rows (q16, dout16, q_cols,
// dout_cols, du_rows: bf16 along the reduction axis) read as pair words are their b. dout, p and
// du are rounded to bf16 where they enter a product, as on the tiles; q enters unscaled (s
// takes the scale as the product's out_scale, dk when it is written). No tile state.
struct PairBackward : AmxBackward {
  using TaskScope = NoScope;
  // (The task's dk and dv rows toward L2 first, as widened: 0.995-1.055x on Zen 4, 5-7 rounds.)
  static constexpr bool kPrefetchGradients = false;

  static const std::uint32_t* PairWords(const std::uint16_t* x) {
    return reinterpret_cast<const std::uint32_t*>(x);
  }

  static void Scores(const AttentionKernelParams& p, const Plan& plan, const RowTile& t, float* w) {
    bf16dot::outer_product(Words(w, plan.k_pairs), PairWords(t.q16), t.rows, plan.depth / 2, 1,
                           plan.depth / 2, w + plan.s, nullptr, false, p.scale);
  }

  static void DoutValues(const AttentionBackwardKernelParams&, const Plan& plan, const RowTile& t,
                         float* w) {
    bf16dot::outer_product(Words(w, plan.v_pairs), PairWords(t.dout16), t.rows, plan.depth_v / 2, 1,
                           plan.depth_v / 2, w + plan.dp, nullptr, false, 1.0f);
  }

  static void Gradients(const AttentionBackwardKernelParams& g, const Plan& plan, const RowTile& t,
                        std::int64_t num_k, const float* pv, float* w, float* dqt,
                        bool add_to_dqt) {
    const AttentionKernelParams& p = g.forward;
    // dv^T += dout^T p and dk^T += q^T du: the rows are the reduction axis, paired (an odd
    // last row pairs with +0; the columns' rows are zero past t.rows).
    const std::int64_t row_pairs = (t.rows + 1) / 2;
    constexpr std::int64_t kColumnWords = tiles::kBlockK / 2;
    constexpr int kPackVecs = static_cast<int>(kKeys / 16);  // the keys' vectors of 16 lanes
    bf16dot::pack_probs(pv, t.rows, kPackVecs, Words(w, plan.p_pairs));
    bf16dot::outer_product(Words(w, plan.p_pairs), PairWords(Bf16(t.row_scratch, plan.dout_cols)),
                           p.head_dim_v, kColumnWords, 1, row_pairs, w + plan.dvt, nullptr, true,
                           1.0f);
    const float* du = w + plan.dp;
    bf16dot::pack_probs(du, t.rows, kPackVecs, Words(w, plan.du_pairs));
    bf16dot::outer_product(Words(w, plan.du_pairs), PairWords(Bf16(t.row_scratch, plan.q_cols)),
                           p.head_dim, kColumnWords, 1, row_pairs, w + plan.dkt, nullptr, true,
                           1.0f);
    // dq = du k: du's rows in bf16 (keys past num_k: du = 0 there, and k_cols too).
    const std::uint16_t* du_rows = DuRows(plan, t, du, w);
    const std::int64_t key_pairs = (num_k + 1) / 2;
    for (std::int64_t pass = 0; pass < plan.passes; ++pass) {
      bf16dot::outer_product(Words(w, plan.k_cols) + pass * kKeys / 2 * kBlockQ, PairWords(du_rows),
                             t.rows, kKeys / 2, 1, key_pairs, dqt + pass * kRowsPerTile * kBlockQ,
                             nullptr, add_to_dqt, 1.0f);
    }
  }
};

// The backward's products for dtype on this target and CPU, as the forward's (FlashProductPath):
// bf16 on the vdpbf16ps pairs where bf16dot::preferred() (AMD; or forced), else on AMX tiles
// where they run, else widened (f16 always widens).
inline ProductPath BackwardProductPath(DType dtype) {
  if constexpr (kAmxLanes) {
    if (dtype == DType::kBF16 && bf16dot::preferred()) return ProductPath::kBf16Pairs;
    if (dtype == DType::kBF16 && amx::available()) return ProductPath::kBf16Amx;
  }
  return WideningProductPath(dtype);
}

// Whether path's products read the bf16 operands (MakePlan's `tiles` areas).
inline bool ReadsBf16Operands(ProductPath path) {
  return path == ProductPath::kBf16Amx || path == ProductPath::kBf16Pairs;
}

// Calls f(Products{}) with the products of `path` (BackwardProductPath): the one switch of the
// backward's instantiations.
template <class F>
void WithBackwardProducts(ProductPath path, F&& f) {
  if constexpr (kAmxLanes) {
    if (path == ProductPath::kBf16Amx) return f(AmxBackward{});
    if (path == ProductPath::kBf16Pairs) return f(PairBackward{});
  }
  if (path == ProductPath::kBf16Widened) return f(WideBackward<hwy::bfloat16_t>{});
  if (path == ProductPath::kF16Widened) return f(WideBackward<hwy::float16_t>{});
  return f(WideBackward<float>{});
}

}  // namespace backward
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_BACKWARD_PRODUCTS_INL_H_
