// Ring attention (qkv/ring_attention.h) under mpirun -np 2, 3, 4 (tests/CMakeLists.txt): every
// rank builds the same whole problem, computes it alone with the flash kernel, runs the ring on
// its shards and compares its rows of out and lse with the whole's: non-causal, causal in both
// alignments with the contiguous and the zigzag layout, windows narrower than a shard and wider
// than several, key lengths ending inside a shard (a batch entry of 0: rows with no key at all),
// GQA, Lq != Lk, lengths that do not divide by P, softcap, bf16; and the errors every rank must
// get alike.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention_case.h"
#include "qkv/error.h"
#include "qkv/ring_attention.h"

namespace qkv::testing {
namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

struct RingCase {
  Case c;
  RingLayout layout = RingLayout::kContiguous;
  std::int64_t block_rows = 0;  // 0: one block per shard at these sizes
};

std::string name(const RingCase& rc) {
  return rc.c.name() + (rc.layout == RingLayout::kZigzag ? " zigzag" : " contiguous") +
         (rc.block_rows > 0 ? " blocks of " + std::to_string(rc.block_rows) + " rows" : "");
}

// This rank's rows of a BSHD tensor of `data` (sizes [B, L, H, D]), as a new contiguous buffer.
template <typename T>
std::vector<T> shard_of(std::vector<T>& data, DType dtype, std::array<std::int64_t, 4> sizes,
                        RingLayout layout) {
  std::int64_t rows = 0;
  for (const RingSegment& s : ring_shard(layout, sizes[1], world_rank(), world_size())) {
    rows += s.length;
  }
  std::array<std::int64_t, 4> shard_sizes = sizes;
  shard_sizes[1] = rows;
  std::vector<T> shard(static_cast<std::size_t>(sizes[0] * rows * sizes[2] * sizes[3]));
  copy_to_shard(TensorView::contiguous(data.data(), dtype, sizes),
                TensorView::contiguous(shard.data(), dtype, shard_sizes), layout, world_rank(),
                world_size());
  return shard;
}

void check_case(const RingCase& rc) {
  SCOPED_TRACE(name(rc) + " on " + std::to_string(world_size()) + " ranks, rank " +
               std::to_string(world_rank()));
  const Case& c = rc.c;
  Problem p(c);
  const Result whole = p.run(Kernel::kFlash, false);
  const std::int64_t dv = p.head_dim_v();
  const bool half = c.dtype != DType::kF32;
  auto q = shard_of(p.q, DType::kF32, {c.batch, c.seq_q, c.num_heads_q, c.head_dim}, rc.layout);
  auto k = shard_of(p.k, DType::kF32, {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim}, rc.layout);
  auto v = shard_of(p.v, DType::kF32, {c.batch, c.seq_kv, c.num_heads_kv, dv}, rc.layout);
  std::vector<std::uint16_t> q16, k16, v16;
  if (half) {
    q16 = shard_of(p.q16, c.dtype, {c.batch, c.seq_q, c.num_heads_q, c.head_dim}, rc.layout);
    k16 = shard_of(p.k16, c.dtype, {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim}, rc.layout);
    v16 = shard_of(p.v16, c.dtype, {c.batch, c.seq_kv, c.num_heads_kv, dv}, rc.layout);
  }
  const std::int64_t lq = static_cast<std::int64_t>(q.size()) / (c.batch * c.num_heads_q * c.head_dim);
  const std::int64_t lk = static_cast<std::int64_t>(k.size()) / (c.batch * c.num_heads_kv * c.head_dim);
  auto view = [&](std::vector<float>& f, std::vector<std::uint16_t>& h, std::int64_t rows,
                  std::int64_t heads, std::int64_t d) {
    return half ? TensorView::contiguous(h.data(), c.dtype, {c.batch, rows, heads, d})
                : TensorView::contiguous(f.data(), DType::kF32, {c.batch, rows, heads, d});
  };
  std::vector<float> out(static_cast<std::size_t>(c.batch * lq * c.num_heads_q * dv), 7.0f);
  std::vector<float> lse(static_cast<std::size_t>(c.batch * c.num_heads_q * lq), 7.0f);
  RingParams params{.attention = p.params(), .layout = rc.layout, .seq_q = c.seq_q,
                    .seq_kv = c.seq_kv, .block_rows = rc.block_rows};
  const RingStats stats = ring_attention(
      MPI_COMM_WORLD, view(q, q16, lq, c.num_heads_q, c.head_dim),
      view(k, k16, lk, c.num_heads_kv, c.head_dim), view(v, v16, lk, c.num_heads_kv, dv),
      {.out = TensorView::contiguous(out.data(), DType::kF32, {c.batch, lq, c.num_heads_q, dv}),
       .lse = TensorView::contiguous(lse.data(), DType::kF32, {c.batch, c.num_heads_q, lq, 1})},
      params);

  // The whole's rows of this rank.
  auto whole_out = const_cast<std::vector<float>&>(whole.out);
  const std::vector<float> expected_out =
      shard_of(whole_out, DType::kF32, {c.batch, c.seq_q, c.num_heads_q, dv}, rc.layout);
  // lse is [B, Hq, Lq]: shard it as [B, Lq, Hq, 1] after a transpose.
  std::vector<float> lse_bshd(whole.lse.size()), mine(lse.size());
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.num_heads_q; ++h)
      for (std::int64_t i = 0; i < c.seq_q; ++i)
        lse_bshd[(b * c.seq_q + i) * c.num_heads_q + h] = whole.lse[(b * c.num_heads_q + h) * c.seq_q + i];
  const std::vector<float> expected_lse =
      shard_of(lse_bshd, DType::kF32, {c.batch, c.seq_q, c.num_heads_q, 1}, rc.layout);
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.num_heads_q; ++h)
      for (std::int64_t i = 0; i < lq; ++i)
        mine[(b * lq + i) * c.num_heads_q + h] = lse[(b * c.num_heads_q + h) * lq + i];

  const double tolerance = (half ? 2e-2 : 2e-5) * std::max(1.0, max_abs(whole.out));
  EXPECT_LE(max_abs_diff(out, expected_out), tolerance);
  EXPECT_LE(max_abs_diff(mine, expected_lse), (half ? 2e-2 : 1e-4) * std::max(1.0, max_abs(expected_lse)));
  for (std::size_t i = 0; i < mine.size(); ++i) {
    ASSERT_EQ(std::isinf(mine[i]), std::isinf(expected_lse[i])) << "row " << i;
  }
  for (float x : out) ASSERT_FALSE(std::isnan(x));
  // (query segment, key segment) pairs: one block per shard gives P of them per query segment
  // and key segment; smaller blocks cut shards (and zigzag's segments) further.
  const std::int64_t pairs = world_size() * (rc.layout == RingLayout::kZigzag ? 4 : 1);
  if (rc.block_rows == 0) {
    EXPECT_EQ(stats.blocks_computed + stats.blocks_skipped, pairs);
  } else {
    EXPECT_GT(stats.blocks_computed + stats.blocks_skipped, pairs);
    EXPECT_LE(stats.block_bytes, rc.block_rows * c.batch * c.num_heads_kv * (c.head_dim + dv) *
                                     (half ? 2 : 4));
  }
  if (c.causal && c.seq_q == c.seq_kv && world_size() > 1) {
    // Causal self-attention leaves ring steps empty: some rank skips, and the shard that wraps
    // from the last rank to rank 0 is needed by no one (contiguous layout).
    int skipped = static_cast<int>(stats.blocks_skipped), total = 0;
    MPI_Allreduce(&skipped, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_GT(total, 0);
    if (rc.layout == RingLayout::kContiguous && world_rank() == world_size() - 1) {
      EXPECT_GE(stats.sends_skipped, 1);
    }
  }
}

std::vector<RingCase> cases() {
  std::vector<RingCase> cases;
  const std::int64_t L = 97;  // divisible by none of 2, 3, 4 (nor by 2P for zigzag)
  cases.push_back({{.batch = 2, .seq_q = L, .seq_kv = L, .num_heads_q = 4, .num_heads_kv = 2,
                    .head_dim = 32}});
  for (RingLayout layout : {RingLayout::kContiguous, RingLayout::kZigzag}) {
    for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
      cases.push_back({{.batch = 1, .seq_q = L, .seq_kv = L, .num_heads_q = 4, .num_heads_kv = 1,
                        .head_dim = 16, .causal = true, .align = align},
                       layout});
    }
    // Windows narrower than one shard, and wider than several.
    cases.push_back({{.batch = 1, .seq_q = 120, .seq_kv = 120, .num_heads_q = 2,
                      .num_heads_kv = 2, .head_dim = 16, .window_left = 4, .window_right = 2},
                     layout});
    cases.push_back({{.batch = 1, .seq_q = 120, .seq_kv = 120, .num_heads_q = 2,
                      .num_heads_kv = 1, .head_dim = 16, .causal = true, .window_left = 70},
                     layout});
    // Key lengths inside shards, one batch entry 0 (no key at all), softcap.
    cases.push_back({{.batch = 3, .seq_q = L, .seq_kv = L, .num_heads_q = 2, .num_heads_kv = 2,
                      .head_dim = 8, .key_lengths = true, .softcap = 4.0f},
                     layout});
    cases.push_back({{.batch = 1, .seq_q = 64, .seq_kv = 64, .num_heads_q = 2, .num_heads_kv = 2,
                      .head_dim = 64, .causal = true, .dtype = DType::kBF16},
                     layout});
  }
  // Cross attention: Lq != Lk (contiguous shards of different lengths), causal both ways.
  cases.push_back({{.batch = 1, .seq_q = 33, .seq_kv = 101, .num_heads_q = 2, .num_heads_kv = 1,
                    .head_dim = 16, .head_dim_v = 9, .causal = true}});
  cases.push_back({{.batch = 2, .seq_q = 101, .seq_kv = 33, .num_heads_q = 3, .num_heads_kv = 3,
                    .head_dim = 8, .causal = true, .align = Align::kTopLeft}});
  // Each again with blocks of 5 rows: every shard travels as several messages, forwarded hop
  // by hop, and the skipping decides block by block.
  const std::size_t whole_shards = cases.size();
  for (std::size_t i = 0; i < whole_shards; ++i) {
    RingCase blocks = cases[i];
    blocks.block_rows = 5;
    cases.push_back(blocks);
  }
  return cases;
}

TEST(Ring, EqualsTheWholeOnEveryRank) {
  for (const RingCase& rc : cases()) check_case(rc);
}

// The message every rank must throw, or "" if none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Ring, RanksThatDisagreeAllGetTheSameError) {
  const int rank = world_rank(), ranks = world_size();
  const std::int64_t L = 40;
  auto run = [&](std::int64_t heads_q, std::int64_t rows, RingLayout layout, std::int64_t seq) {
    std::vector<float> q(heads_q * rows * 8, 0.5f), k(rows * 8, 0.5f), out(heads_q * rows * 8);
    ring_attention(MPI_COMM_WORLD, TensorView::contiguous(q.data(), DType::kF32, {1, rows, heads_q, 8}),
                   TensorView::contiguous(k.data(), DType::kF32, {1, rows, 1, 8}),
                   TensorView::contiguous(k.data(), DType::kF32, {1, rows, 1, 8}),
                   {.out = TensorView::contiguous(out.data(), DType::kF32, {1, rows, heads_q, 8})},
                   {.attention = {}, .layout = layout, .seq_q = seq, .seq_kv = seq});
  };
  const std::int64_t rows = ring_shard(RingLayout::kContiguous, L, rank, ranks)[0].length;
  // The last rank passes other heads.
  const std::string heads = error_of([&] { run(rank == ranks - 1 ? 4 : 2, rows, RingLayout::kContiguous, L); });
  EXPECT_NE(heads.find("rank " + std::to_string(ranks - 1) + " has num_heads_q = 4 but rank 0 has 2"),
            std::string::npos) << heads;
  // Rank 0 holds a row too many.
  const std::string shard = error_of([&] { run(2, rows + (rank == 0), RingLayout::kContiguous, L); });
  const std::int64_t rank0_rows = ring_shard(RingLayout::kContiguous, L, 0, ranks)[0].length;
  EXPECT_NE(shard.find("ring_attention: rank 0: rank 0 holds " + std::to_string(rank0_rows + 1) +
                       " query rows"),
            std::string::npos) << shard;
  // More ranks than zigzag chunks.
  const std::string short_seq = error_of([&] { run(2, 1, RingLayout::kZigzag, 2 * ranks - 1); });
  EXPECT_NE(short_seq.find("ranks cannot share a sequence of " + std::to_string(2 * ranks - 1)),
            std::string::npos) << short_seq;
  // Every rank saw the same messages (the ring still works afterwards: the next test runs).
  for (const std::string* message : {&heads, &shard, &short_seq}) {
    std::vector<char> text(512, 0), first(512, 0);
    std::copy_n(message->begin(), std::min<std::size_t>(message->size(), 511), text.begin());
    if (rank == 0) first = text;
    MPI_Bcast(first.data(), 512, MPI_CHAR, 0, MPI_COMM_WORLD);
    EXPECT_EQ(std::string(text.data()), std::string(first.data()));
  }
}

}  // namespace
}  // namespace qkv::testing

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  // Rank 0 prints the progress; the others only their failures.
  if (qkv::testing::world_rank() != 0) GTEST_FLAG_SET(brief, true);
  int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
