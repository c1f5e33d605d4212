// Flash attention forward on the CPU: tiles over queries (kBlockQ) and keys (kBlockK) with the
// online softmax (running max and sum, rescaling), never allocating Lq x Lk. Key tiles outside
// the union of the block's allowed ranges (causal, window, key lengths) are skipped, so causal
// costs about half. Threads split (batch, head, query block); every block is computed by one
// thread in a fixed order, so results are identical whatever the thread count.
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
  const std::int64_t num_blocks = (p.seq_q + kBlockQ - 1) / kBlockQ;
  const std::int64_t num_tasks = p.batch * p.num_heads_q * num_blocks;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));

  // Per-thread scratch, sized once: QueryBlock state + one score tile st [kBlockK][kBlockQ].
  const std::int64_t floats = ScratchFloats(p) + kBlockK * kBlockQ;
  AlignedBuffer float_scratch(sizeof(float) * floats * num_threads);
  AlignedBuffer int_scratch(sizeof(std::int64_t) * 2 * kBlockQ * num_threads);

  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    float* mine = float_scratch.as<float>() + thread * floats;
    QueryBlock qb;
    BindScratch(p, mine, int_scratch.as<std::int64_t>() + thread * 2 * kBlockQ, qb);
    float* st = mine + ScratchFloats(p);

    const std::int64_t block = task % num_blocks;
    const std::int64_t bh = task / num_blocks;
    StartQueryBlock(p, bh / p.num_heads_q, bh % p.num_heads_q, block * kBlockQ, qb);
    for (std::int64_t j0 = qb.key_begin; j0 < qb.key_end; j0 += kBlockK) {
      const std::int64_t num_k = std::min<std::int64_t>(kBlockK, qb.key_end - j0);
      ScoreTile(p, qb, j0, num_k, st);
      OnlineSoftmaxTile(qb, num_k, st);
      AccumulateValues(p, qb, j0, num_k, st, qb.alpha);
    }
    FinishQueryBlock(p, qb);
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
