// Ring attention (qkv/ring_attention.h) under mpirun -np 2, 3, 4 (tests/CMakeLists.txt): every
// rank builds the same whole problem, computes it alone with the flash kernel, runs the ring on
// its shards and compares its rows of out and lse with the whole's: non-causal, causal in both
// alignments with the contiguous and the zigzag layout, windows narrower than a shard and wider
// than several, key lengths ending inside a shard (a batch entry of 0: rows with no key at all),
// GQA, Lq != Lk, lengths that do not divide by P, softcap, bf16; the backward's dq, dk, dv
// against attention_backward on the whole for every such case; and the errors every rank must
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

// This rank's shards of a problem and the ring forward on them.
struct RingRun {
  RingRun(Problem& p, const RingCase& rc) : c(p.spec()), layout(rc.layout) {
    dv = p.head_dim_v();
    half = c.dtype != DType::kF32;
    q = shard_of(p.q, DType::kF32, {c.batch, c.seq_q, c.num_heads_q, c.head_dim}, layout);
    k = shard_of(p.k, DType::kF32, {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim}, layout);
    v = shard_of(p.v, DType::kF32, {c.batch, c.seq_kv, c.num_heads_kv, dv}, layout);
    if (half) {
      q16 = shard_of(p.q16, c.dtype, {c.batch, c.seq_q, c.num_heads_q, c.head_dim}, layout);
      k16 = shard_of(p.k16, c.dtype, {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim}, layout);
      v16 = shard_of(p.v16, c.dtype, {c.batch, c.seq_kv, c.num_heads_kv, dv}, layout);
    }
    lq = static_cast<std::int64_t>(q.size()) / (c.batch * c.num_heads_q * c.head_dim);
    lk = static_cast<std::int64_t>(k.size()) / (c.batch * c.num_heads_kv * c.head_dim);
    out.assign(static_cast<std::size_t>(c.batch * lq * c.num_heads_q * dv), 7.0f);
    lse.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * lq), 7.0f);
    params = {.attention = p.params(), .layout = layout, .seq_q = c.seq_q, .seq_kv = c.seq_kv,
              .block_rows = rc.block_rows};
    stats = ring_attention(MPI_COMM_WORLD, q_view(), k_view(), v_view(),
                           {.out = f32(out, lq, c.num_heads_q, dv), .lse = lse_view()}, params);
  }
  TensorView f32(std::vector<float>& f, std::int64_t rows, std::int64_t heads, std::int64_t d) const {
    return TensorView::contiguous(f.data(), DType::kF32, {c.batch, rows, heads, d});
  }
  TensorView input(std::vector<float>& f, std::vector<std::uint16_t>& h, std::int64_t rows,
                   std::int64_t heads, std::int64_t d) const {
    return half ? TensorView::contiguous(h.data(), c.dtype, {c.batch, rows, heads, d})
                : f32(f, rows, heads, d);
  }
  TensorView q_view() { return input(q, q16, lq, c.num_heads_q, c.head_dim); }
  TensorView k_view() { return input(k, k16, lk, c.num_heads_kv, c.head_dim); }
  TensorView v_view() { return input(v, v16, lk, c.num_heads_kv, dv); }
  TensorView lse_view() {
    return TensorView::contiguous(lse.data(), DType::kF32, {c.batch, c.num_heads_q, lq, 1});
  }
  // This rank's rows of a whole [B, L, H, D] tensor.
  std::vector<float> mine(const std::vector<float>& whole, std::int64_t seq, std::int64_t heads,
                          std::int64_t d) const {
    auto copy = whole;
    return shard_of(copy, DType::kF32, {c.batch, seq, heads, d}, layout);
  }

  const Case& c;
  RingLayout layout;
  std::int64_t dv = 0, lq = 0, lk = 0;
  bool half = false;
  std::vector<float> q, k, v, out, lse;
  std::vector<std::uint16_t> q16, k16, v16;
  RingParams params;
  RingStats stats;
};

void check_case(const RingCase& rc) {
  SCOPED_TRACE(name(rc) + " on " + std::to_string(world_size()) + " ranks, rank " +
               std::to_string(world_rank()));
  const Case& c = rc.c;
  Problem p(c);
  const Result whole = p.run(Kernel::kFlash, false);
  RingRun ring(p, rc);
  const std::int64_t dv = ring.dv, lq = ring.lq;
  const bool half = ring.half;
  const std::vector<float>& out = ring.out;
  const std::vector<float>& lse = ring.lse;
  const RingStats& stats = ring.stats;

  // The whole's rows of this rank.
  const std::vector<float> expected_out = ring.mine(whole.out, c.seq_q, c.num_heads_q, dv);
  // lse is [B, Hq, Lq]: shard it as [B, Lq, Hq, 1] after a transpose.
  std::vector<float> lse_bshd(whole.lse.size()), mine(lse.size());
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.num_heads_q; ++h)
      for (std::int64_t i = 0; i < c.seq_q; ++i)
        lse_bshd[(b * c.seq_q + i) * c.num_heads_q + h] = whole.lse[(b * c.num_heads_q + h) * c.seq_q + i];
  const std::vector<float> expected_lse = ring.mine(lse_bshd, c.seq_q, c.num_heads_q, 1);
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

// The ring's backward on this rank's shards against attention_backward on the whole (flash),
// for dL/d(out) = dout ~ N(0, 1); then again on one thread: the same bits.
void check_backward(const RingCase& rc) {
  SCOPED_TRACE("backward " + name(rc) + " on " + std::to_string(world_size()) +
               " ranks, rank " + std::to_string(world_rank()));
  const Case& c = rc.c;
  Problem p(c);
  RingRun ring(p, rc);
  const std::int64_t dv = ring.dv, lq = ring.lq, lk = ring.lk;
  std::vector<float> dout = normal_values(p.q.size() / c.head_dim * dv, 11);
  const Grads whole = run_backward(p, p.params(), dout, false, 0, Kernel::kFlash);
  std::vector<float> my_dout = ring.mine(dout, c.seq_q, c.num_heads_q, dv);
  auto run = [&](int num_threads) {
    Grads g;
    g.dq.assign(ring.q.size(), 7.0f);
    g.dk.assign(ring.k.size(), 7.0f);
    g.dv.assign(ring.v.size(), 7.0f);
    RingParams params = ring.params;
    params.attention.num_threads = num_threads;
    ring_attention_backward(
        MPI_COMM_WORLD, ring.q_view(), ring.k_view(), ring.v_view(),
        ring.f32(ring.out, lq, c.num_heads_q, dv), ring.lse_view(),
        ring.f32(my_dout, lq, c.num_heads_q, dv),
        {.dq = ring.f32(g.dq, lq, c.num_heads_q, c.head_dim),
         .dk = ring.f32(g.dk, lk, c.num_heads_kv, c.head_dim),
         .dv = ring.f32(g.dv, lk, c.num_heads_kv, dv)},
        params);
    return g;
  };
  const Grads mine = run(0);
  const double scale = ring.half ? 2e-2 : 1e-4;
  const struct {
    const char* name;
    const std::vector<float>& got;
    std::vector<float> expected;
  } grads[] = {
      {"dq", mine.dq, ring.mine(whole.dq, c.seq_q, c.num_heads_q, c.head_dim)},
      {"dk", mine.dk, ring.mine(whole.dk, c.seq_kv, c.num_heads_kv, c.head_dim)},
      {"dv", mine.dv, ring.mine(whole.dv, c.seq_kv, c.num_heads_kv, dv)},
  };
  for (const auto& g : grads) {
    EXPECT_LE(max_abs_diff(g.got, g.expected), scale * std::max(1.0, max_abs(g.expected)))
        << g.name;
  }
  const Grads one_thread = run(1);
  EXPECT_TRUE(bit_equal(one_thread.dq, mine.dq));
  EXPECT_TRUE(bit_equal(one_thread.dk, mine.dk));
  EXPECT_TRUE(bit_equal(one_thread.dv, mine.dv));
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

TEST(Ring, BackwardEqualsTheWholeOnEveryRank) {
  for (const RingCase& rc : cases()) check_backward(rc);
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
  // The backward: rank 0's dq has a row too few, or every rank asks for the reference kernel.
  auto backward = [&](std::int64_t dq_rows, Kernel kernel) {
    std::vector<float> q(2 * rows * 8, 0.5f), k(rows * 8, 0.5f), out(2 * rows * 8, 0.0f),
        lse(2 * rows, 0.0f), dq(2 * rows * 8), dk(rows * 8), dv(rows * 8);
    auto view = [](std::vector<float>& f, std::int64_t n, std::int64_t heads) {
      return TensorView::contiguous(f.data(), DType::kF32, {1, n, heads, 8});
    };
    ring_attention_backward(
        MPI_COMM_WORLD, view(q, rows, 2), view(k, rows, 1), view(k, rows, 1), view(out, rows, 2),
        TensorView::contiguous(lse.data(), DType::kF32, {1, 2, rows, 1}), view(out, rows, 2),
        {.dq = view(dq, dq_rows, 2), .dk = view(dk, rows, 1), .dv = view(dv, rows, 1)},
        {.attention = {.kernel = kernel}, .seq_q = L, .seq_kv = L});
  };
  const std::string dq_rows =
      error_of([&] { backward(rows - (rank == 0), Kernel::kAuto); });
  EXPECT_NE(dq_rows.find("ring_attention_backward: rank 0: dq:"), std::string::npos) << dq_rows;
  const std::string reference = error_of([&] { backward(rows, Kernel::kReference); });
  EXPECT_NE(reference.find("kernel: the ring's backward runs the flash kernel"), std::string::npos)
      << reference;
  // Every rank saw the same messages (the ring still works afterwards: the next test runs).
  for (const std::string* message : {&heads, &shard, &short_seq, &dq_rows, &reference}) {
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
