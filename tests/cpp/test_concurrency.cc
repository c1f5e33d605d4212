// Several threads calling into qkv at once (issue 18): qkv::attention on different inputs, one
// shared Encoder, one shared MultiHeadAttention whose cross projections are built by the first
// concurrent calls, and one shared SentenceEmbedder (the real model: QKV_MODEL_DIR). Every
// result must equal, bit for bit, the same call made alone. Shapes differ between threads, so
// that scratch sized for one thread's shape is never right for another's (TSan only saw the old
// races with varied shapes), and attention and the encoder run on every compiled Highway target:
// TSan does not see races inside 32/64-byte vector accesses, but does on the scalar target.
// The tsan preset runs this file with OMP_NUM_THREADS=1 (docs/layout.md).
#include <gtest/gtest.h>

#include <barrier>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "every_target.h"
#include "kernels/kernels.h"
#include "layers/layer_kernels.h"
#include "layers_reference.h"
#include "qkv/attention.h"
#include "qkv/models/sentence_embedder.h"

namespace qkv::testing {
namespace {

constexpr int kThreads = 4;
constexpr int kRounds = 3;

// Runs work(t) on kThreads threads released at the same moment.
void on_threads(const std::function<void(int)>& work) {
  std::barrier start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      work(t);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

struct AttentionProblem {
  std::int64_t batch, seq_q, seq_kv, heads_q, heads_kv, dim;
  Kernel kernel;
  bool causal;
  std::vector<float> q, k, v;

  std::vector<float> run() const {
    std::vector<float> out(batch * seq_q * heads_q * dim);
    auto view = [](const std::vector<float>& x, std::array<std::int64_t, 4> sizes) {
      return TensorView::contiguous(const_cast<float*>(x.data()), DType::kF32, sizes);
    };
    attention(view(q, {batch, seq_q, heads_q, dim}), view(k, {batch, seq_kv, heads_kv, dim}),
              view(v, {batch, seq_kv, heads_kv, dim}),
              {.out = view(out, {batch, seq_q, heads_q, dim})},
              {.causal = causal, .kernel = kernel});
    return out;
  }
};

TEST(Concurrency, AttentionFromFourThreadsEqualsAlone) {
  std::vector<AttentionProblem> problems = {
      {2, 130, 257, 4, 2, 64, Kernel::kFlash, true, {}, {}, {}},
      {1, 1, 700, 8, 2, 128, Kernel::kFlash, false, {}, {}, {}},  // the decode path
      {3, 65, 65, 2, 2, 32, Kernel::kChunked, true, {}, {}, {}},
      {1, 37, 90, 3, 1, 16, Kernel::kReference, false, {}, {}, {}},
  };
  std::uint64_t seed = 1;
  for (AttentionProblem& p : problems) {
    p.q = random_floats(p.batch * p.seq_q * p.heads_q * p.dim, seed++);
    p.k = random_floats(p.batch * p.seq_kv * p.heads_kv * p.dim, seed++);
    p.v = random_floats(p.batch * p.seq_kv * p.heads_kv * p.dim, seed++);
  }
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    std::vector<std::vector<float>> alone;
    for (const AttentionProblem& p : problems) alone.push_back(p.run());
    std::vector<std::vector<std::vector<float>>> got(kThreads);
    on_threads([&](int t) {
      for (int round = 0; round < kRounds; ++round) got[t].push_back(problems[t].run());
    });
    for (int t = 0; t < kThreads; ++t) {
      for (const std::vector<float>& out : got[t]) EXPECT_EQ(out, alone[t]) << "thread " << t;
    }
  });
}

TEST(Concurrency, SharedEncoderFromFourThreadsEqualsAlone) {
  const EncoderLayerConfig c{.embed_dim = 32, .num_heads = 4, .num_kv_heads = 2, .d_ff = 48};
  const EncoderLayerData d0(c, 1), d1(c, 50);
  std::vector<EncoderLayer> layers;
  layers.emplace_back(c, d0.weights());
  layers.emplace_back(c, d1.weights());
  const Encoder encoder(std::move(layers));
  const std::int64_t batch[kThreads] = {1, 2, 3, 1}, seq[kThreads] = {7, 33, 5, 64};
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    std::vector<std::vector<float>> input, alone;
    for (int t = 0; t < kThreads; ++t) {
      input.push_back(random_floats(batch[t] * seq[t] * c.embed_dim, 100 + t));
      alone.push_back(input[t]);
      encoder.forward(alone[t].data(), batch[t], seq[t]);
    }
    std::vector<std::vector<std::vector<float>>> got(kThreads);
    on_threads([&](int t) {
      for (int round = 0; round < kRounds; ++round) {
        std::vector<float> x = input[t];
        encoder.forward(x.data(), batch[t], seq[t]);
        got[t].push_back(std::move(x));
      }
    });
    for (int t = 0; t < kThreads; ++t) {
      for (const std::vector<float>& x : got[t]) EXPECT_EQ(x, alone[t]) << "thread " << t;
    }
  });
}

TEST(Concurrency, SharedMhaBuildsItsCrossProjectionsOnce) {
  // forward_cross builds q/k/v projections on first use: four first uses at once.
  const MultiHeadAttentionConfig config{.embed_dim = 16, .num_heads = 2};
  MhaF32Weights w;
  w.q_w = random_floats(256, 1), w.q_b = random_floats(16, 2), w.k_w = random_floats(256, 3);
  w.k_b = random_floats(16, 4), w.v_w = random_floats(256, 5), w.v_b = random_floats(16, 6);
  w.o_w = random_floats(256, 7), w.o_b = random_floats(16, 8);
  const MultiHeadAttention reference(config, w.separate());
  const MultiHeadAttention shared(config, w.separate());
  const std::int64_t seq_q[kThreads] = {3, 9, 1, 17}, seq_kv[kThreads] = {5, 2, 30, 17};
  std::vector<std::vector<float>> query, memory, alone;
  for (int t = 0; t < kThreads; ++t) {
    query.push_back(random_floats(seq_q[t] * 16, 20 + t));
    memory.push_back(random_floats(seq_kv[t] * 16, 40 + t));
    alone.emplace_back(seq_q[t] * 16);
    reference.forward_cross(query[t].data(), 1, seq_q[t], memory[t].data(), seq_kv[t],
                            alone[t].data());
  }
  std::vector<std::vector<float>> got(kThreads);
  on_threads([&](int t) {
    got[t].resize(seq_q[t] * 16);
    shared.forward_cross(query[t].data(), 1, seq_q[t], memory[t].data(), seq_kv[t],
                         got[t].data());
  });
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(got[t], alone[t]) << "thread " << t;
}

TEST(Concurrency, SharedSentenceEmbedderFromFourThreadsEqualsAlone) {
  const char* dir = std::getenv("QKV_MODEL_DIR");
  if (dir == nullptr) GTEST_SKIP() << "QKV_MODEL_DIR is not set (scripts/test.sh sets it)";
  const auto shared = models::SentenceEmbedder::load(dir);
  const std::int64_t dim = shared.dimension();
  // Different texts and counts per thread: different batch shapes.
  std::vector<std::vector<std::string>> texts(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < 3 + 5 * t; ++i) {
      texts[t].push_back("thread " + std::to_string(t) + " sentence " + std::to_string(i) +
                         std::string(static_cast<std::size_t>(i * 7 % 40), 'x') + " end.");
    }
  }
  std::vector<std::vector<float>> alone(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    alone[t].resize(texts[t].size() * dim);
    shared.embed(texts[t], alone[t].data());
  }
  std::vector<std::vector<std::vector<float>>> got(kThreads);
  on_threads([&](int t) {
    for (int round = 0; round < kRounds; ++round) {
      std::vector<float> out(texts[t].size() * dim);
      shared.embed(texts[t], out.data());
      got[t].push_back(std::move(out));
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    for (const std::vector<float>& out : got[t]) EXPECT_EQ(out, alone[t]) << "thread " << t;
  }
}

}  // namespace
}  // namespace qkv::testing
