// Flash attention forward on the CPU: tiles over queries (kBlockQ) and keys (kBlockK) with the
// online softmax (running max and sum, rescaling), never allocating Lq x Lk. Key tiles outside
// the union of the block's allowed ranges (causal, window, key lengths) are skipped, so causal
// costs about half; so are key tiles a sparsity (Longformer, BigBird, a block layout) leaves
// out, and tiles it covers in part take a pair-by-pair predicate (docs/sparse.md). Threads
// split (batch, head, query block); every block is computed by one thread in a fixed order, so
// results are identical whatever the thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_forward.cc"
#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/attention_tiles-inl.h"
#include "kernels/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {

void FlashForward(const AttentionKernelParams& p) {
  using namespace tiles;
  // Work items are the query blocks of one kv head (see QueryBlock: rows of the flattened
  // (head in GQA group, query) space); a task takes up to `per_task` consecutive blocks of one
  // kv head and walks the key tiles once for all of them, so each K/V tile is fetched once per task
  // rather than once per block (at long Lk the K/V rows of one head span many pages and re-walking
  // them per block is TLB-bound). The grouping depends on the shape only, never on the thread
  // count, so results stay bit-identical.
  const std::int64_t items_per_kv_head = BlocksPerKvHead(p);
  const std::int64_t total_items = p.batch * p.num_heads_kv * items_per_kv_head;
  const std::int64_t per_task = std::clamp<std::int64_t>(total_items / 8, 1, kMaxBlocksPerTask);
  const std::int64_t tasks_per_kv_head = (items_per_kv_head + per_task - 1) / per_task;
  const std::int64_t num_tasks = p.batch * p.num_heads_kv * tasks_per_kv_head;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));

  // Per-thread scratch, sized once: per_task QueryBlock states + one score tile
  // st [kBlockK][kBlockQ].
  const std::int64_t block_floats = ScratchFloats(p);
  const std::int64_t floats = per_task * block_floats + kBlockK * kBlockQ;
  const std::int64_t ints = per_task * kScratchInts;
  AlignedBuffer float_scratch(sizeof(float) * floats * num_threads);
  AlignedBuffer int_scratch(sizeof(std::int64_t) * ints * num_threads);

  const bool sparse = p.sparse.kind != SparseKernelParams::Kind::kNone;

  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    float* mine = float_scratch.as<float>() + thread * floats;
    float* st = mine + per_task * block_floats;
    QueryBlock blocks[kMaxBlocksPerTask];

    const std::int64_t b = task / (p.num_heads_kv * tasks_per_kv_head);
    const std::int64_t kv_head = task / tasks_per_kv_head % p.num_heads_kv;
    const std::int64_t first = task % tasks_per_kv_head * per_task;
    const std::int64_t count = std::min(per_task, items_per_kv_head - first);
    std::int64_t key_begin = p.seq_kv, key_end = 0;
    for (std::int64_t n = 0; n < count; ++n) {
      QueryBlock& qb = blocks[n];
      BindScratch(p, mine + n * block_floats,
                  int_scratch.as<std::int64_t>() + thread * ints + n * kScratchInts, qb);
      StartQueryBlock(p, b, kv_head, first + n, qb);
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
    for (std::int64_t j0 = first_tile; j0 < key_end; j0 += kBlockK) {
      for (std::int64_t n = 0; n < count; ++n) {
        QueryBlock& qb = blocks[n];
        // This block's part of the tile; tiles outside its allowed keys are skipped.
        std::int64_t lo = std::max(j0, qb.key_begin);
        std::int64_t hi = std::min(j0 + kBlockK, qb.key_end);
        if (hi <= lo) continue;
        bool predicate = false;
        if (sparse) {
          // Key tiles the sparsity leaves out are skipped; the rest trimmed to what it allows.
          const SparseTile t = SparseTileKeys(p, qb, lo, hi);
          if (t.hi <= t.lo) continue;
          lo = t.lo;
          hi = t.hi;
          predicate = t.predicate;
        }
        ScoreTile(p, qb, lo, hi - lo, st, predicate);
        OnlineSoftmaxTile(qb, hi - lo, st);
        AccumulateValues(p, qb, lo, hi - lo, st, qb.alpha);
      }
    }
    for (std::int64_t n = 0; n < count; ++n) FinishQueryBlock(p, blocks[n]);
  });
}

// Name of the Highway target this dispatch lands on (tests force each target and check).
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(FlashForward);
HWY_EXPORT(TargetName);

const char* attention_cpu_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void attention_flash_cpu(const AttentionKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(FlashForward)(params);
}

}  // namespace qkv
#endif  // HWY_ONCE
