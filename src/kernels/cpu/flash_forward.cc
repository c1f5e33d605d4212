// Flash attention forward on the CPU: tiles over queries (kBlockQ) and keys (kBlockK) with the
// online softmax (running max and sum, rescaling), never allocating Lq x Lk. Key tiles outside
// the union of the block's allowed ranges (causal, window, key lengths) are skipped, so causal
// costs about half; so are key tiles a sparsity (Longformer, BigBird, a block layout) leaves
// out, and tiles it covers in part take a pair-by-pair predicate (docs/sparse.md).
//
// Work: tasks are groups of query blocks that share one walk over the keys. When the blocks are
// too few to keep the threads busy and the keys are long (decoding: Lq = 1 against a KV cache),
// the keys are split as well (flash-decoding): each (group, split) task leaves a partial result
// per row (unnormalised out, running max and sum), and a merge combines the splits of every row
// in a fixed order. Blocks with few rows (decoding) compute their products row by row instead of
// on kBlockQ lanes (the decode path,
// decode_walk-inl.h). Every choice depends on the shape (and, for the decode split groups, on the
// CPU's vendor) only and every task is computed by one thread in a fixed order, so results are
// identical whatever the thread count. docs/kernels.md explains the plan.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_forward.cc"
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/cpu_vendor.h"
#include "core/parallel.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/decode_walk-inl.h"
#include "kernels/cpu/dropout-inl.h"
#include "kernels/cpu/kv_head_major.h"
#include "kernels/cpu/online_softmax-inl.h"
#include "kernels/cpu/products-inl.h"
#include "kernels/cpu/query_block-inl.h"
#include "kernels/cpu/score_masks-inl.h"
#include "kernels/cpu/sparse_tiles-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_staging-inl.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"
#include "kernels/product_path.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

using namespace tiles;

// ---------------------------------------------------------------------------------------------
// The work plan: a function of the shape (and the CPU's vendor: SplitGroupNarrowBlocks), never
// of the thread count.

constexpr std::int64_t kMinTasks = 8;           // tasks a key split keeps, when it can
constexpr std::int64_t kMinGroups = 16;         // groups the block grouping keeps, when it can
constexpr std::int64_t kSplitGroupBlocks = 16;  // blocks per group at most, with a key split
// Fewer query blocks than this: split the keys. 64 blocks of 64 rows (AVX-512) when it was set;
// in rows, so AVX2's blocks of 16 take 256 (before 2026-12-06 they took 64 too, and a chunk of
// 128 or 256 queries against a long cache did not split: each of 16 tasks walked all keys for
// half of one head's rows, so every head's K/V was read by two or more tasks, and in BSHD as
// slices of its rows. Zen 2, 2 threads, alternating, 3 rounds: (1,8,8,128,8192,64) BSHD f32
// 1.31x, causal 1.26x; (1,8,8,256,8192,64) 1.14x, causal 1.11x, BHSD 1.10x, bf16 1.05x;
// (1,8,8,256,4096,128) 1.10x; (2,8,8,128,4096,64) 1.05x; 256 blocks and more unchanged:
// (1,8,8,512,8192,64) 1.006x, (1,32,8,128,8192,128) 0.996x.)
constexpr std::int64_t kSplitBelowRows = 4096;
constexpr std::int64_t kSplitBelowItems = kSplitBelowRows / kBlockQ;
// The same two for narrow blocks (decoding: at most kNarrowRows rows per kv head), whose scratch
// and per-tile work are small, and batches of multi-head decode steps still split. On AMD a
// group of 32 takes all heads of a 32-head decode step (each key's K and V rows then read
// whole): against 16 and 64 (Zen 4, 2 threads, Lq = 1, Lk = 16384, D = 128, in-process A/B,
// 2026-12-03): Hq = Hkv = 32 at B = 1 bf16 1.26x, f32 1.17x; at B = 2 bf16 1.89x, f32 1.44x;
// B = 8 GQA 32:8 (Lk = 8192) bf16 1.44x; the same bounds for wide blocks split B = 1, H = 8,
// Lq = 512, Lk = 8192 into 32-block groups at 0.94x, so wide blocks keep 16 and 64. On the
// Intel AMX Xeon (model 167, 2026-12-05, BSHD, qkv bench old and new alternating, the caches
// evicted between repeats, 5-7 rounds) groups of 16 ran faster than 32: Hq = Hkv = 32, D = 128,
// Lk = 16384 f32 1.04x, bf16 1.10x (Lk = 32768: 1.06x, 1.07x); B = 2 1.04x, 1.10x; 64 heads
// (Lk = 8192) 1.08x, 1.14x, at D = 64 1.08x, 1.12x; 32 heads at D = 64 f32 1.05-1.06x, bf16
// 0.92x and 1.00x (two runs); GQA 64:32 1.04x, 1.04x. So the group size is the vendor's.
constexpr std::int64_t kSplitGroupNarrowBlocksAmd = 32;
constexpr std::int64_t kSplitGroupNarrowBlocksOther = 16;
inline std::int64_t SplitGroupNarrowBlocks() {
  return cpu_is_amd() ? kSplitGroupNarrowBlocksAmd : kSplitGroupNarrowBlocksOther;
}
constexpr std::int64_t kSplitBelowNarrowItems = 128;
// Blocks one task may hold (the per-task arrays of Flash).
constexpr std::int64_t kTaskBlocks =
    std::max({kMaxBlocksPerTask, kSplitGroupNarrowBlocksAmd, kSplitGroupNarrowBlocksOther});
constexpr std::int64_t kSplitTasks = 16;      // tasks a key split aims for
constexpr std::int64_t kMinSplitKeys = 1024;  // keys per split, at least (a multiple of kBlockK)
// ... or this many, where that keeps more of an entry's kv heads in one group (PlanWork).
constexpr std::int64_t kMinSplitKeysWholeRows = 256;
constexpr std::int64_t kMaxSplits = 16;
constexpr std::int64_t kMergeRows = 64;  // output rows per merge task
// Decode steps whose blocks are wide (9-32 rows per kv head on AVX2: a few queries of a GQA
// group) over long keys: a task's blocks belong to several kv heads, each stages its own K and V
// tiles, and the next tile's rows asked for a tile ahead (PrefetchRows) are not in cache when
// staged, so staging V asks for its next rows as it goes (Staging::read_ahead; docs/kernels.md,
// "V staged reading ahead"). There an f32 K whose rows lie kInPlaceRowBytes apart or more (BSHD
// with 4 kv heads or more at D = 128) is read where it lies instead of copied: the copy serves
// one block. Measured on AVX2 (Zen 2) only, so AVX2 only.
constexpr std::int64_t kReadAheadBlocks = 2;   // query blocks per kv head, at most
constexpr std::int64_t kReadAheadKeys = 1024;  // keys, at least
constexpr std::int64_t kInPlaceRowBytes = 2048;

struct WorkPlan {
  std::int64_t blocks_per_kv_head;
  std::int64_t items;       // query blocks, flattened (b, kv_head, block)
  std::int64_t per_task;    // consecutive blocks that share one walk over the keys
  std::int64_t groups;      // ceil(items / per_task)
  std::int64_t splits;      // key ranges per group; 1: no split
  std::int64_t split_keys;  // keys per split, a multiple of kBlockK (the last may be shorter)
};

WorkPlan PlanWork(const AttentionKernelParams& p) {
  WorkPlan w;
  w.blocks_per_kv_head = BlocksPerKvHead(p);
  w.items = p.batch * p.num_heads_kv * w.blocks_per_kv_head;
  // A group takes up to kMaxBlocksPerTask consecutive blocks and walks the key tiles once for all
  // of them, so each K/V tile is fetched once per group rather than once per block (at long Lk
  // one head's K/V rows span many pages and re-walking them per block is TLB-bound); fewer
  // blocks per group while that leaves under kMinGroups groups. (Up to 16 blocks of 64 queries:
  // at B=1, H=8, L=4096, 2 threads, the bf16 AMX path ran 1.02-1.06x and f32 1.02x faster than
  // with 8; keeping 16 groups leaves L=1024 as it was, where 8 groups ran 5-7% slower for lack
  // of balance. AVX2's blocks of 16 queries: 64 per group, docs/kernels.md, "AVX2".)
  // Narrow blocks (decoding) whose kv heads lie apart (BHSD, the layout qkv.torch passes): one
  // per group, so each task reads one head's K and V rows as two ascending runs, as long as
  // its keys (in BSHD the heads of one key are neighbours, and a group of all heads reads
  // them as one run instead: below). Against the groups of BSHD's rules (all 32 heads, or 4
  // kv heads, per group), Zen 4, 2 threads, Lq = 1, D = 128, in-process A/B, two runs: Hq =
  // Hkv = 32, Lk = 16384: f32 1.19-1.23x, bf16 1.72-1.88x (4 heads per group: 1.12-1.13x and
  // 1.37-1.70x); GQA 32:8, Lk = 32768: f32 1.07-1.09x, bf16 1.14-1.20x. The same in BSHD ran
  // 0.38-0.62x.
  const bool narrow = RowsPerKvHead(p) <= kNarrowRows;
  const bool one_per_group = narrow && !HeadsInner(p);
  w.per_task = one_per_group
                   ? 1
                   : std::clamp<std::int64_t>(w.items / kMinGroups, 1, kMaxBlocksPerTask);
  w.splits = 1;
  w.split_keys = p.seq_kv;
  const std::int64_t batch_items = p.num_heads_kv * w.blocks_per_kv_head;
  const std::int64_t group_blocks = one_per_group ? 1
                                    : narrow      ? SplitGroupNarrowBlocks()
                                                  : kSplitGroupBlocks;
  // Blocks per group of a key split with at most `splits` splits (below).
  const auto group_size = [&](std::int64_t splits) {
    const std::int64_t groups_needed = (kMinTasks + splits - 1) / splits;
    const std::int64_t size =
        std::clamp<std::int64_t>(w.items / groups_needed, 1, std::min(group_blocks, batch_items));
    // A size that divides an entry's blocks, if one is at least half as large: no group then
    // straddles two entries.
    for (std::int64_t s = size; 2 * s > size; --s) {
      if (batch_items % s == 0) return s;
    }
    return size;
  };
  std::int64_t max_splits = std::min(kMaxSplits, p.seq_kv / kMinSplitKeys);
  // In BSHD (heads inner) a group of all of an entry's kv heads reads each key's K and V rows
  // whole, and groups of some of them read their parts of every row: where kMinTasks tasks
  // split the heads for want of splits (Lk < 8192 at B = 1, or no split under 2048 keys), the
  // fewest shorter splits (down to kMinSplitKeysWholeRows keys, from Lk = kMinSplitKeys on) that
  // keep the most of them together. Zen 2, 2 threads, D = 128, alternating binaries, 3-5
  // rounds: GQA 32:8 decode at Lk = 7168 (7 splits in two groups of 4 kv heads before, 8 splits
  // in one now) bf16 1.27-1.28x, f32 1.22-1.28x; Lk = 8064 1.41x, 1.23x; Lk = 2000 (single-head
  // tasks before) 1.16x, 1.26x; four draft tokens (1,32,8,4,8000) 1.13x; multi-head
  // (1,32,32,1,6000) 1.10x, 1.09x; (1,32,32,1,1500) 1.56x, 1.90x (docs/kernels.md, "Shorter
  // splits that keep the heads together"). Shorter
  // splits where the groups stay as they were (B = 2, Lk = 6000) measured 0.97x, and under
  // 1024 keys 0.95-1.07x: hence only where a group grows, and from 1024 keys.
  if (HeadsInner(p) && p.seq_kv >= kMinSplitKeys) {
    std::int64_t largest = group_size(std::max<std::int64_t>(max_splits, 1));
    const std::int64_t most = std::min(kMaxSplits, p.seq_kv / kMinSplitKeysWholeRows);
    for (std::int64_t splits = std::max<std::int64_t>(max_splits, 1) + 1; splits <= most;
         ++splits) {
      const std::int64_t size = group_size(splits);
      if (size > largest) {
        max_splits = splits;
        largest = size;
      }
    }
  }
  if (w.items < (narrow ? kSplitBelowNarrowItems : kSplitBelowItems) && max_splits >= 2) {
    // Few blocks, long keys (decoding): the splits supply the parallelism, so a group can take
    // more blocks (all kv heads of a decode step: each key tile is then one contiguous stretch of
    // K and V in BSHD, read once), but not those of two batch entries (two streams, shorter
    // splits: 0.91x at B = 2, Hq = 32, Hkv = 8); keep >= kMinTasks tasks when the splits alone
    // cannot. (Up to 32 items and 8 blocks per group for every block before 2026-12-03; against
    // that, Zen 4, 2 threads, Lq = 1, Lk = 16384, D = 128, in-process A/B, with 64 and 16: Hq =
    // Hkv = 32 bf16 1.55-2.0x and f32 1.32-1.6x, Hq = Hkv = 16 bf16 1.34x, B = 4 with Hq = 32,
    // Hkv = 8 bf16 2.7-3.5x and f32 1.25-1.38x; B = 1, H = 8, Lq = 256, Lk = 8192 f32
    // 1.05-1.11x; docs/kernels.md, "Flash-decoding".)
    w.per_task = group_size(max_splits);
    const std::int64_t groups = (w.items + w.per_task - 1) / w.per_task;
    const std::int64_t splits =
        std::clamp<std::int64_t>((kSplitTasks + groups - 1) / groups, 1, max_splits);
    const std::int64_t keys = (p.seq_kv + splits - 1) / splits;
    w.split_keys = (keys + kBlockK - 1) / kBlockK * kBlockK;
    w.splits = (p.seq_kv + w.split_keys - 1) / w.split_keys;
  }
  w.groups = (w.items + w.per_task - 1) / w.per_task;
  return w;
}

// The order the groups are handed out in: the costliest first (by the keys their rows may
// attend), ties in index order. parallel_for hands tasks out as threads free up, so a costly
// group handed out last leaves one thread working alone: causal at H = 8, L = 1024 has 16
// groups of 8 blocks, costing 36 or 100 blocks' worth of keys in turn, which in index order
// leaves 2 threads 6% of the time unbalanced. The order changes no result, only which thread
// computes what.
std::vector<std::int64_t> GroupOrder(const AttentionKernelParams& p, const WorkPlan& w) {
  std::vector<std::int64_t> order(w.groups);
  std::iota(order.begin(), order.end(), std::int64_t{0});
  // Every row attends all keys (no causal or window side, no key lengths): index order, without
  // the count (one serial pass over all rows: 9% of a call's time at B = 32, H = 12, L = 128).
  if (p.window_left < 0 && p.window_right < 0 && p.key_lengths == nullptr) return order;
  const std::int64_t group_rows = RowsPerKvHead(p);
  std::vector<std::int64_t> cost(w.groups, 0);
  for (std::int64_t item = 0; item < w.items; ++item) {
    const std::int64_t b = item / (p.num_heads_kv * w.blocks_per_kv_head);
    const std::int64_t row0 = item % w.blocks_per_kv_head * kBlockQ;
    std::int64_t query = row0 % p.seq_q;  // row = (query head in the group) * Lq + query
    for (std::int64_t row = row0; row < std::min(row0 + kBlockQ, group_rows); ++row) {
      const KeyRange keys = LaneKeys(p, b, query);
      cost[item / w.per_task] += keys.hi - keys.lo;
      if (++query == p.seq_q) query = 0;
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t x, std::int64_t y) { return cost[x] > cost[y]; });
  return order;
}

// Where K and V's rows lie apart (BSHD: one key's rows of every kv head side by side), the walk
// reads a head-major copy of them (kv_head_major.h) when each row is read by enough tasks
// (every task of a kv head walks its keys) to pay for the copy: its bytes, a fresh buffer's first
// touch included, cost about what 8 (f32) or 16 (bf16, f16: a faster kernel) strided walks lose
// against the copy's. Intel AMX Xeon (model 167), 2 threads, B = 1, H = 8, against the walk in
// place, 3 alternating rounds, two runs (docs/kernels.md, "A head-major copy of K and V"): 16
// tasks a head (L = 16384) f32 1.04-1.08x, bf16 1.13x and 1.18x at D = 128, 1.11x and 0.99x at
// D = 64, causal 1.04-1.06x; GQA 32:8 at L = 4096 (16 tasks) f32 1.06x, bf16 1.05x; 8 tasks
// (L = 8192) f32 1.05x, bf16 1.01x; 4 (L = 4096) 0.94-0.99x, f32 D = 128 1.07x. A kv head whose K
// and V fit in a core's L2 beside the blocks (kCopyMinHeadBytes) is read from there after its first
// task, and the copy's size is capped (kCopyMaxBytes; the walk in place needs no memory).
constexpr std::int64_t kCopyMinTasks = 16;
constexpr std::int64_t kCopyMinTasksF32 = 8;
constexpr double kCopyMinHeadBytes = 1024.0 * 1024;
constexpr double kCopyMaxBytes = 512.0 * 1024 * 1024;

bool CopiesKvHeadMajor(const AttentionKernelParams& p, const WorkPlan& w) {
  // Wide blocks only (the decode walk has its own order for BSHD), unsplit keys.
  const std::int64_t last_rows = (RowsPerKvHead(p) - 1) % kBlockQ + 1;
  if (!HeadsInner(p) || p.k_stride[3] != 1 || p.v_stride[3] != 1 || w.splits != 1 ||
      last_rows <= kNarrowRows) {
    return false;
  }
  if (kv_head_major_forced()) return true;
  const std::int64_t tasks_per_head = (w.blocks_per_kv_head + w.per_task - 1) / w.per_task;
  const double head_bytes =
      static_cast<double>(p.seq_kv * (p.head_dim + p.head_dim_v) * dtype_size(p.dtype));
  return tasks_per_head >= (p.dtype == DType::kF32 ? kCopyMinTasksF32 : kCopyMinTasks) &&
         head_bytes >= kCopyMinHeadBytes &&
         head_bytes * static_cast<double>(p.batch * p.num_heads_kv) <= kCopyMaxBytes;
}

// ---------------------------------------------------------------------------------------------
// Key splits: partial results and their merge.

// Per split s and output row (row = (b * Hq + head) * Lq + query): the unnormalised out, and
// the running max (in base 2, as QueryBlock::row_max) and sum of that split's keys (max -inf,
// sum 0 and out 0 when it had none).
struct SplitPartials {
  float* out;  // [splits][rows][Dv]
  float* max;  // [splits][rows]
  float* sum;  // [splits][rows]
  std::int64_t rows;
};

inline void WritePartial(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t split,
                         const SplitPartials& partials) {
  for (std::int64_t l = 0; l < qb.num_q; ++l) {
    const std::int64_t at =
        split * partials.rows + (qb.b * p.num_heads_q + qb.head[l]) * p.seq_q + qb.query[l];
    partials.max[at] = qb.row_max[l];
    partials.sum[at] = qb.row_sum[l];
    float* out = partials.out + at * p.head_dim_v;
    for (std::int64_t e = 0; e < p.head_dim_v; ++e) out[e] = qb.ot[e * kBlockQ + l];
  }
}

// out and lse of rows [row0, row1) from the splits, combined in split order 0, 1, 2, ...
// (m_s in base 2):
//   M = max_s m_s,  w_s = 2^(m_s - M),  out = sum_s w_s o_s / sum_s w_s l_s,
//   lse = M ln2 + log(sum_s w_s l_s).
// Splits with no allowed key (l_s = 0) take no part; a row with none anywhere gets out 0 and
// lse -inf, as in FinishQueryBlock (no (-inf) - (-inf), no 0 / 0).
void MergeSplits(const AttentionKernelParams& p, const SplitPartials& partials, std::int64_t splits,
                 std::int64_t row0, std::int64_t row1, float* acc) {
  const std::int64_t dv = p.head_dim_v;
  for (std::int64_t row = row0; row < row1; ++row) {
    const std::int64_t b = row / (p.num_heads_q * p.seq_q);
    const std::int64_t head = row / p.seq_q % p.num_heads_q;
    const std::int64_t query = row % p.seq_q;
    float row_max = kNegInf;
    for (std::int64_t s = 0; s < splits; ++s) {
      const std::int64_t at = s * partials.rows + row;
      if (partials.sum[at] > 0.0f) row_max = std::max(row_max, partials.max[at]);
    }
    float row_sum = 0.0f;
    std::fill(acc, acc + dv, 0.0f);
    if (row_max != kNegInf) {
      for (std::int64_t s = 0; s < splits; ++s) {
        const std::int64_t at = s * partials.rows + row;
        if (!(partials.sum[at] > 0.0f)) continue;
        const float weight = std::exp2(partials.max[at] - row_max);
        row_sum += weight * partials.sum[at];
        const float* out = partials.out + at * dv;
        for (std::int64_t e = 0; e < dv; ++e) acc[e] += weight * out[e];
      }
    }
    const bool has_keys = row_sum > 0.0f;
    const float inv_sum = has_keys ? 1.0f / row_sum : 0.0f;
    const std::int64_t out_row =
        b * p.out_stride[0] + query * p.out_stride[1] + head * p.out_stride[2];
    if (p.out16 != nullptr) {
      for (std::int64_t e = 0; e < dv; ++e) {
        p.out16[out_row + e * p.out_stride[3]] = f32_to_half_bits(p.dtype, acc[e] * inv_sum);
      }
    } else {
      for (std::int64_t e = 0; e < dv; ++e) p.out[out_row + e * p.out_stride[3]] = acc[e] * inv_sum;
    }
    if (p.lse != nullptr) {
      p.lse[b * p.lse_stride[0] + head * p.lse_stride[1] + query * p.lse_stride[2]] =
          has_keys ? std::fma(row_max, kLn2, std::log(row_sum)) : kNegInf;
    }
  }
}

}  // namespace

// Dropout (kernels/dropout_mask.h) on a tile after OnlineSoftmaxTile: st holds exp(s - max)
// with the row sums already taken; the values see each kept entry times 1 / (1 - p) and the
// dropped ones as 0. Lanes past num_q hold zeros and stay zero.
void DropoutTile(const AttentionKernelParams& p, const QueryBlock& qb, std::int64_t j0,
                 std::int64_t num_k, float* HWY_RESTRICT st) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  HWY_ALIGN std::uint32_t lo[kBlockQ], hi[kBlockQ];
  for (std::int64_t l = 0; l < kBlockQ; ++l) {
    const std::uint64_t row =
        l < qb.num_q ? dropout_row(p.dropout_seed, p.dropout_offset, qb.b, qb.head[l], qb.query[l],
                                   p.num_heads_q, p.seq_q)
                     : 0;
    lo[l] = static_cast<std::uint32_t>(row);
    hi[l] = static_cast<std::uint32_t>(row >> 32);
  }
  for (std::int64_t j = 0; j < num_k; ++j) {
    const auto key = hn::Set(du, static_cast<std::uint32_t>(j0 + j));
    for (std::int64_t x = 0; x < kBlockQ; x += kLanes) {
      const auto bits = dropout::Bits(du, hn::Load(du, lo + x), hn::Load(du, hi + x), key);
      float* e = st + j * kBlockQ + x;
      hn::Store(dropout::Apply(df, du, hn::Load(df, e), bits, p.dropout_threshold, p.dropout_scale),
                df, e);
    }
  }
}

// ---------------------------------------------------------------------------------------------

// The flash skeleton on one product path (products-inl.h); FlashForward below picks the path.
template <class Products>
void Flash(const AttentionKernelParams& given) {
  // q: [B, Lq, Hq, D]   k: [B, Lk, Hkv, D]   v: [B, Lk, Hkv, Dv]   out: [B, Lq, Hq, Dv]
  // lse: [B, Hq, Lq] (nullable)
  const WorkPlan plan = PlanWork(given);
  // p: the given params, or (CopiesKvHeadMajor) the same pointing at a head-major K/V copy.
  std::optional<HeadMajorKv> copy;
  if (CopiesKvHeadMajor(given, plan)) copy = copy_kv_head_major(given);
  const AttentionKernelParams& p = copy ? copy->params : given;
  const std::vector<std::int64_t> order = GroupOrder(p, plan);
  const std::int64_t num_tasks = plan.groups * plan.splits;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  // Narrow blocks: rows the last block of a kv head holds (all others hold kBlockQ).
  const std::int64_t last_rows = (RowsPerKvHead(p) - 1) % kBlockQ + 1;
  // (Dropout takes the wide path only: DropoutTile works on kBlockQ lanes.)
  const bool dropout = p.dropout_p > 0.0f;
  const bool narrow_ok =
      p.k_stride[3] == 1 && p.v_stride[3] == 1 && last_rows <= kNarrowRows && !dropout;

  // Per-thread scratch, sized once: per_task QueryBlock states (each followed by its narrow
  // scratch when blocks can be narrow), then one score tile st [kBlockK][kBlockQ], then the
  // staging tiles of bf16/f16 K and V rows.
  const std::int64_t block_floats = ScratchFloats(p) + (narrow_ok ? NarrowFloats<Products>(p) : 0);
  const std::int64_t floats = plan.per_task * block_floats + kBlockK * kBlockQ + StagingFloats(p);
  const std::int64_t ints = plan.per_task * kScratchInts;
  AlignedBuffer float_scratch(sizeof(float) * floats * num_threads);
  AlignedBuffer int_scratch(sizeof(std::int64_t) * ints * num_threads);
  // The splits' partial results: [splits][rows] x (Dv + 2) floats (only when splitting).
  const std::int64_t rows = p.batch * p.num_heads_q * p.seq_q;
  const std::int64_t partial_floats = plan.splits > 1 ? plan.splits * rows * (p.head_dim_v + 2) : 0;
  AlignedBuffer partial_scratch(sizeof(float) * partial_floats);
  SplitPartials partials{partial_scratch.as<float>(), nullptr, nullptr, rows};
  if (plan.splits > 1) {
    partials.max = partials.out + plan.splits * rows * p.head_dim_v;
    partials.sum = partials.max + plan.splits * rows;
  }

  const bool sparse = p.sparse.kind != SparseKernelParams::Kind::kNone;
  const bool prefetch_out = Products::kPrefetchOut && plan.splits == 1 && PrefetchesOut(p);
  const bool read_ahead =
      kLanes == 8 && plan.blocks_per_kv_head <= kReadAheadBlocks && p.seq_kv >= kReadAheadKeys;
  const bool k_in_place = read_ahead && p.k_stride[1] * dtype_size(p.dtype) >= kInPlaceRowBytes;

  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    [[maybe_unused]] const typename Products::TaskScope scope{};
    float* mine = float_scratch.as<float>() + thread * floats;
    float* st = mine + plan.per_task * block_floats;
    Staging staging = BindStaging(p, st + kBlockK * kBlockQ);
    staging.read_ahead = read_ahead;
    staging.k_in_place = k_in_place;
    QueryBlock blocks[kTaskBlocks];
    NarrowBlock narrow[kTaskBlocks];
    QueryBlock* wide[kTaskBlocks];
    std::int64_t num_narrow = 0, num_wide = 0;

    // This task: blocks [first, first + count) and keys [split_lo, split_hi).
    const std::int64_t split = task % plan.splits;
    const std::int64_t first = order[task / plan.splits] * plan.per_task;
    const std::int64_t count = std::min(plan.per_task, plan.items - first);
    const std::int64_t split_lo = split * plan.split_keys;
    const std::int64_t split_hi = std::min(p.seq_kv, split_lo + plan.split_keys);

    std::int64_t key_begin = p.seq_kv, key_end = 0;
    for (std::int64_t n = 0; n < count; ++n) {
      QueryBlock& qb = blocks[n];
      const std::int64_t item = first + n;
      const std::int64_t b = item / (p.num_heads_kv * plan.blocks_per_kv_head);
      const std::int64_t kv_head = item / plan.blocks_per_kv_head % p.num_heads_kv;
      BindScratch(p, mine + n * block_floats,
                  int_scratch.as<std::int64_t>() + thread * ints + n * kScratchInts, qb);
      StartQueryBlock(p, b, kv_head, item % plan.blocks_per_kv_head, qb);
      // This split's part of the block's keys (all of them without a split).
      qb.key_begin = std::max(qb.key_begin, split_lo);
      qb.key_end = std::min(qb.key_end, split_hi);
      if (narrow_ok && qb.num_q <= kNarrowRows) {
        narrow[num_narrow++] =
            StartNarrow<Products>(p, qb, mine + n * block_floats + ScratchFloats(p));
      } else {
        wide[num_wide++] = &qb;
        Products::StartBlock(p, qb);
      }
      if (qb.key_end > qb.key_begin) {
        key_begin = std::min(key_begin, qb.key_begin);
        key_end = std::max(key_end, qb.key_end);
      }
    }
    // With a sparsity, the walk starts at the first tile some block's sparsity reaches, on the
    // same tile grid as without it (so a layout that allows everything changes no bit).
    std::int64_t first_tile = key_begin;
    if (sparse && key_end > key_begin) {
      std::int64_t sparse_begin = key_end, sparse_end = key_begin;
      for (std::int64_t n = 0; n < count; ++n) {
        const QueryBlock& qb = blocks[n];
        const std::int64_t lo = std::max(qb.key_begin, qb.sparse_begin);
        const std::int64_t hi = std::min(qb.key_end, qb.sparse_end);
        if (hi <= lo) continue;
        sparse_begin = std::min(sparse_begin, lo);
        sparse_end = std::max(sparse_end, hi);
      }
      first_tile = key_begin + (std::max(sparse_begin, key_begin) - key_begin) / kBlockK * kBlockK;
      key_end = std::min(key_end, sparse_end);
    }
    // A block's part of tile j0; tiles outside its allowed keys, and (sparse) key tiles the
    // sparsity leaves out, are skipped; the rest is trimmed to what the sparsity allows.
    const auto tile_part = [&](const QueryBlock& qb, std::int64_t j0) {
      TilePart part{std::max(j0, qb.key_begin), std::min(j0 + kBlockK, qb.key_end), false, j0};
      if (part.hi <= part.lo) return TilePart{};
      if (sparse) {
        const SparseTile t = SparseTileKeys(p, qb, part.lo, part.hi);
        if (t.hi <= t.lo) return TilePart{};
        part = {t.lo, t.hi, t.predicate, j0};
      }
      return part;
    };
    // While the task computes tile j0, block n asks for its share of the next tile's K and V
    // rows toward L2, so staging the next tile finds them in cache (docs/kernels.md, "flash").
    const std::int64_t bytes = dtype_size(p.dtype);
    staging.cold_k = key_end - first_tile <= kBlockK;  // (one tile: no tile asked for it)
    for (std::int64_t j0 = first_tile; j0 < key_end; j0 += kBlockK) {
      const std::int64_t next = j0 + kBlockK;
      const std::int64_t next_keys = std::clamp<std::int64_t>(key_end - next, 0, kBlockK);
      const std::int64_t share = num_wide > 0 ? (next_keys + num_wide - 1) / num_wide : 0;
      for (std::int64_t n = 0; n < num_wide; ++n) {
        QueryBlock& qb = *wide[n];
        const std::int64_t lo = next + n * share, hi = std::min(next + next_keys, lo + share);
        PrefetchRows(qb.k, p.k_stride, p.head_dim, bytes, lo, hi);
        PrefetchRows(qb.v, p.v_stride, p.head_dim_v, bytes, lo, hi);
        // The task's last tile: the block's out rows are asked for now, written at the finish.
        if (prefetch_out && next >= key_end) PrefetchOutRows(p, qb);
        const TilePart t = tile_part(qb, j0);
        if (t.hi <= t.lo) continue;
        // The keys each query vector needs (the causal diagonal skips some; see VecKeys).
        const std::int64_t num_k = t.hi - t.lo;
        const VecKeys keys = TileVecKeys(qb.hi, t.lo, num_k);
        const std::int64_t* vec_end = keys.ends();
        Products::Scores(p, qb, t.lo, num_k, st, staging, vec_end);
        MaskScoreTile(p, qb, t.lo, num_k, st, t.predicate);
        Products::Softmax(p, qb, num_k, st, staging, vec_end);
        if (dropout) DropoutTile(p, qb, t.lo, num_k, st);
        Products::Values(p, qb, t.lo, num_k, st, qb.alpha, staging, vec_end);
      }
      if (num_narrow == 0) continue;
      for (std::int64_t n = 0; n < num_narrow; ++n) narrow[n].part = tile_part(*narrow[n].qb, j0);
      NarrowTile<Products>(p, narrow, num_narrow);
    }
    for (std::int64_t n = 0; n < num_narrow; ++n) FinishNarrow<Products>(p, narrow[n]);
    for (std::int64_t n = 0; n < count; ++n) {
      if (plan.splits == 1) {
        FinishQueryBlock(p, blocks[n]);
      } else {
        WritePartial(p, blocks[n], split, partials);
      }
    }
  });

  if (plan.splits > 1) {
    const std::int64_t merge_tasks = (rows + kMergeRows - 1) / kMergeRows;
    const int merge_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, merge_tasks));
    AlignedBuffer merge_scratch(sizeof(float) * p.head_dim_v * merge_threads);
    parallel_for(merge_tasks, merge_threads, [&](std::int64_t task, int thread) {
      MergeSplits(p, partials, plan.splits, task * kMergeRows,
                  std::min(rows, (task + 1) * kMergeRows),
                  merge_scratch.as<float>() + thread * p.head_dim_v);
    });
  }
}

// The entry: the product path, chosen once here (the instantiations: WithProducts).
void FlashForward(const AttentionKernelParams& p) {
  WithProducts(FlashProductPath(p), [&](auto products) { Flash<decltype(products)>(p); });
}

ProductPath FlashPathOf(DType dtype) { return FlashProductPath(dtype); }
ProductPath FlashPathFor(const AttentionKernelParams& p) { return FlashProductPath(p); }

// Name of the Highway target this dispatch lands on (tests force each target and check).
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(FlashForward);
HWY_EXPORT(TargetName);
HWY_EXPORT(FlashPathOf);
HWY_EXPORT(FlashPathFor);

const char* attention_cpu_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

ProductPath attention_flash_product_path(DType dtype) {
  return HWY_DYNAMIC_DISPATCH(FlashPathOf)(dtype);
}

ProductPath attention_flash_product_path(const AttentionKernelParams& params) {
  return HWY_DYNAMIC_DISPATCH(FlashPathFor)(params);
}

void attention_flash_cpu(const AttentionKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(FlashForward)(params);
}

}  // namespace qkv
#endif  // HWY_ONCE