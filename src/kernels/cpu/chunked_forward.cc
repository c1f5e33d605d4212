// Query-chunked "memory-efficient" attention (the seed's MemoryEfficientAttention): for each
// chunk of queries, materialise the scores against ALL keys (a [Lk][kBlockQ] panel per
// thread, O(chunk x Lk) memory), take an ordinary two-pass softmax, optionally write the
// probabilities, then multiply by v. Same tile machinery and masks as the flash kernel.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/chunked_forward.cc"
#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/online_softmax-inl.h"
#include "kernels/cpu/products-inl.h"
#include "kernels/cpu/query_block-inl.h"
#include "kernels/cpu/score_masks-inl.h"
#include "kernels/cpu/tile_geometry-inl.h"
#include "kernels/cpu/tile_staging-inl.h"
#include "kernels/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

using namespace tiles;

// Two-pass softmax down the panel's keys for the query vectors that hold rows: panel becomes
// exp(s - max), row_max / row_sum hold the max (in base 2, as the online softmax keeps it) and
// the sum.
void PanelSoftmax(QueryBlock& qb, std::int64_t num_keys, float* HWY_RESTRICT panel) {
  const DF df;
  const VF log2e = hn::Set(df, fastexp::kLog2e);
  for (int x = 0; x < UsedQueryVecs(qb); ++x) {
    const std::int64_t lane0 = x * kLanes;
    const VF max = hn::Mul(ColumnMax(df, panel, num_keys, lane0), log2e);
    const VF sum = ExpInPlaceAndSum(df, panel, num_keys, lane0, SafeMax(df, max), log2e);
    hn::Store(max, df, qb.row_max + lane0);
    hn::Store(sum, df, qb.row_sum + lane0);
  }
}

// probs[b, h, i, :] = panel / row_sum over [key_begin, key_end), 0 elsewhere.
void WriteProbs(const AttentionKernelParams& p, const QueryBlock& qb, const float* panel) {
  for (std::int64_t i = 0; i < qb.num_q; ++i) {
    float* row = p.probs + qb.b * p.probs_stride[0] + qb.head[i] * p.probs_stride[1] +
                 qb.query[i] * p.probs_stride[2];
    const float sum = qb.row_sum[i];
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (std::int64_t j = 0; j < p.seq_kv; ++j) {
      const bool inside = j >= qb.key_begin && j < qb.key_end;
      row[j * p.probs_stride[3]] =
          inside ? panel[(j - qb.key_begin) * kBlockQ + i] * inv_sum : 0.0f;
    }
  }
}

// The chunked skeleton on one product path (always a widening one: WideningProductPath).
template <class Products>
void Chunked(const AttentionKernelParams& p) {
  // A chunk is chunk_size queries rounded up to whole query blocks; the chunk's blocks run one
  // after another on one thread, reusing one panel.
  const std::int64_t blocks_per_chunk = std::max<std::int64_t>(1, p.chunk_size / kBlockQ);
  const std::int64_t num_blocks = BlocksPerKvHead(p);
  const std::int64_t num_chunks = (num_blocks + blocks_per_chunk - 1) / blocks_per_chunk;
  const std::int64_t num_tasks = p.batch * p.num_heads_kv * num_chunks;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));

  // Per-thread scratch, sized once: QueryBlock state + the panel [Lk][kBlockQ] + staging tiles.
  const std::int64_t floats = ScratchFloats(p) + p.seq_kv * kBlockQ + StagingFloats(p);
  AlignedBuffer float_scratch(sizeof(float) * floats * num_threads);
  AlignedBuffer int_scratch(sizeof(std::int64_t) * kScratchInts * num_threads);

  const bool prefetch_out = PrefetchesOut(p);
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    float* mine = float_scratch.as<float>() + thread * floats;
    QueryBlock qb;
    BindScratch(p, mine, int_scratch.as<std::int64_t>() + thread * kScratchInts, qb);
    float* panel = mine + ScratchFloats(p);
    Staging staging = BindStaging(p, panel + p.seq_kv * kBlockQ);

    const std::int64_t chunk = task % num_chunks;
    const std::int64_t b_kv = task / num_chunks;  // batch * num_heads_kv + kv_head
    const std::int64_t last_block = std::min(num_blocks, (chunk + 1) * blocks_per_chunk);
    for (std::int64_t block = chunk * blocks_per_chunk; block < last_block; ++block) {
      StartQueryBlock(p, b_kv / p.num_heads_kv, b_kv % p.num_heads_kv, block, qb);
      Products::StartBlock(p, qb);
      const std::int64_t num_keys = qb.key_end - qb.key_begin;
      for (std::int64_t j0 = qb.key_begin; j0 < qb.key_end; j0 += kBlockK) {
        const std::int64_t num_k = std::min<std::int64_t>(kBlockK, qb.key_end - j0);
        // Every tile takes the pair-by-pair sparsity (no skipping: the panel holds all keys).
        float* st = panel + (j0 - qb.key_begin) * kBlockQ;
        Products::Scores(p, qb, j0, num_k, st, staging, nullptr);
        MaskScoreTile(p, qb, j0, num_k, st, p.sparse.kind != SparseKernelParams::Kind::kNone);
      }
      if (prefetch_out) PrefetchOutRows(p, qb);  // written by FinishQueryBlock after the values
      PanelSoftmax(qb, num_keys, panel);
      if (p.probs != nullptr) WriteProbs(p, qb, panel);
      for (std::int64_t j0 = qb.key_begin; j0 < qb.key_end; j0 += kBlockK) {
        const std::int64_t num_k = std::min<std::int64_t>(kBlockK, qb.key_end - j0);
        Products::Values(p, qb, j0, num_k, panel + (j0 - qb.key_begin) * kBlockQ, nullptr, staging,
                         nullptr);
      }
      FinishQueryBlock(p, qb);
    }
  });
}

}  // namespace

void ChunkedForward(const AttentionKernelParams& p) {
  WithProducts(WideningProductPath(p.dtype), [&](auto products) { Chunked<decltype(products)>(p); });
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(ChunkedForward);

void attention_chunked_cpu(const AttentionKernelParams& params) {
  HWY_DYNAMIC_DISPATCH(ChunkedForward)(params);
}

}  // namespace qkv
#endif  // HWY_ONCE
