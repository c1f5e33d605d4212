// qkv::ring_attention: context-parallel attention over MPI. The sequence is split across the
// ranks of a communicator; each rank holds its shard of q, k and v and gets its shard of out (and
// lse). K/V travels around the ring of ranks with non-blocking sends and receives, double
// buffered, so that the next block arrives while this one is computed; each rank merges the
// partial results by their log-sum-exp (qkv/block_attention.h). Shards travel as blocks of
// rows, each passed on as soon as it arrives, so a rank holds a few blocks, never another
// rank's whole shard. Ring attention: Liu et al., 2023. docs/distributed.md has the algorithm,
// layouts, launch and limits.
//
//   q: [B, Lq_r, Hq, D]  k: [B, Lk_r, Hkv, D]  v: [B, Lk_r, Hkv, Dv]        (this rank's shards)
//   out: [B, Lq_r, Hq, Dv]  lse: [B, Hq, Lq_r, 1] (optional)                 (this rank's rows)
//
// Layouts (the same rule for queries and keys; ring_shard() gives a rank's segments):
//   kContiguous  positions split into P shards in rank order; the first L % P shards have one
//                more row. Any Lq, Lk (cross attention) with P <= min(Lq, Lk).
//   kZigzag      positions split into 2P chunks (the same rule over 2P); rank r holds chunks r
//                and 2P - 1 - r, in that order: causal work is then balanced. Needs Lq == Lk and
//                2P <= L.
// Masks: what positions define (causal in both alignments, window, key lengths over the whole
// key sequence), softcap, scale, GQA. Ring steps that causal or a window leave empty are not
// computed, and a K/V block that no rank further along the ring needs is not sent.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/tensor.h"

namespace qkv {

enum class RingLayout : std::uint8_t { kContiguous, kZigzag };

struct RingParams {
  // As for attention_block: causal, align, window, key_lengths (over the whole key sequence),
  // scale, softcap, kernel, num_threads; mask, bias and sparsity must be empty. The same on
  // every rank (checked).
  AttentionParams attention;
  RingLayout layout = RingLayout::kContiguous;
  std::int64_t seq_q = 0;   // whole query sequence length, the same on every rank
  std::int64_t seq_kv = 0;  // whole key sequence length
  // K/V rows per message: every shard travels as the same number of blocks of at most this
  // many rows. 0 picks blocks of about 8 MiB. The ring's own memory is three blocks; smaller
  // blocks start the pipeline sooner and cost more messages.
  std::int64_t block_rows = 0;
};

// What one call did on this rank.
struct RingStats {
  double seconds = 0;          // the whole call
  double compute_seconds = 0;  // block attention and merging
  double wait_seconds = 0;     // blocked on transfers: communication that was not hidden
  // (query segment, key segment of a K/V block) pairs
  std::int64_t blocks_computed = 0, blocks_skipped = 0;
  std::int64_t bytes_sent = 0, sends_skipped = 0;  // K/V block messages
  std::int64_t block_bytes = 0;                    // the largest message (a block's K and V)
};

// One contiguous run of positions a rank holds.
struct RingSegment {
  std::int64_t start = 0, length = 0;
};
// This rank's segments of a sequence of `seq` positions, in the order its rows hold them.
// Throws qkv::Error when the ranks cannot all hold at least one row (two with kZigzag).
std::vector<RingSegment> ring_shard(RingLayout layout, std::int64_t seq, int rank, int ranks);

// Collective over `comm`: every rank calls it with its shards. Throws qkv::Error (on every rank,
// with the same message) when the ranks disagree on shapes, dtype or options, when a shard has
// the wrong number of rows for the layout, or when the sequence is too short for the ranks.
// out (and lse) are written only after that check passed.
RingStats ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k,
                         const TensorView& v, const AttentionOutputs& outputs,
                         const RingParams& params);

// The gradients of ring_attention, collective over `comm` like it: each rank passes its shards
// of q, k, v, this rank's rows of the forward's out and lse (from ring_attention with the same
// params) and of dout = dL/d(out) (f32, out's shape), and gets its shards of dq, dk, dv (f32,
// the shapes of q, k, v with Dv for dv; written, not added to; dbias must be empty). K/V blocks
// travel as in the forward; the gradients of each block's keys follow it one position behind,
// each rank adding its share, and come home to the block's rank at the end of its way. dq stays
// with its queries. Deterministic: the same bits on any thread count. Memory: the forward's
// three K/V blocks and six f32 blocks of dk, dv. The flash kernel (kernel auto or flash).
// Throws like ring_attention (on every rank, with the same message), naming the argument and
// its shape; the gradients are written only after every rank's checks passed.
RingStats ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out,
                                  const TensorView& lse, const TensorView& dout,
                                  const AttentionGrads& grads, const RingParams& params);

// Rows of a whole sequence -> this rank's shard (dim 1 of BSHD views), and back: for callers
// that hold the whole sequence on every rank or on one (the CLI scatters from rank 0).
// full: [B, L, H, D], shard: [B, L_r, H, D], the same dtype; contiguous or not.
void copy_to_shard(const TensorView& full, const TensorView& shard, RingLayout layout, int rank,
                   int ranks);
void copy_from_shard(const TensorView& shard, const TensorView& full, RingLayout layout,
                     int rank, int ranks);

}  // namespace qkv
