// One decoding step of a MultiHeadAttention layer against a long KV cache, with the cache in f32
// and in bf16 (half the memory; the attention reads half the bytes), and the projections in f32
// or bf16 (MultiHeadAttentionConfig::matmul_dtype). Links qkv::layers.
//
//   decode_kv_cache [CONTEXT [ROUNDS [EMBED HEADS KV_HEADS]]]   (defaults: 256 5 256 8 2)
//   decode_kv_cache 32768 15 4096 32 8                          (a Llama-sized layer)
//
// The cache holds CONTEXT random tokens (as if a prompt had been run); each round times one step
// (one new token, causal) of every setup in turn, the cache truncated back after it, and then
// qkv::attention alone on that cache (a random q in the cache's dtype). Prints the cache's size,
// the median times of each setup with their speed-ups over the first, and how far the bf16
// setups' outputs are from the f32 one's, relative to the largest |output| (at least 1); exits
// 1 if that is more than 5%.
#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "qkv/attention.h"
#include "qkv/error.h"
#include "qkv/layers/kv_cache.h"
#include "qkv/layers/multi_head_attention.h"

namespace {

struct Setup {
  const char* name;
  qkv::DType matmul_dtype;
  qkv::DType cache_dtype;
};

std::vector<float> random_floats(std::size_t n, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> x(n);
  for (float& e : x) e = uniform(rng);
  return x;
}

// bf16 bits of x, truncated (a random timing input needs no rounding).
std::uint16_t bf16_bits(float x) {
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16);
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1 && argc != 2 && argc != 3 && argc != 6) {
    std::fprintf(stderr, "usage: decode_kv_cache [CONTEXT [ROUNDS [EMBED HEADS KV_HEADS]]]\n");
    return 2;
  }
  const auto arg = [&](int i, std::int64_t fallback) {
    return i < argc ? std::strtoll(argv[i], nullptr, 10) : fallback;
  };
  const std::int64_t context = arg(1, 256), rounds = arg(2, 5), embed = arg(3, 256),
                     heads = arg(4, 8), kv_heads = arg(5, 2);
  if (context < 1 || rounds < 1) {
    std::fprintf(stderr, "decode_kv_cache: CONTEXT and ROUNDS must be >= 1\n");
    return 2;
  }
  const Setup setups[] = {{"f32 matmuls, f32 cache", qkv::DType::kF32, qkv::DType::kF32},
                          {"f32 matmuls, bf16 cache", qkv::DType::kF32, qkv::DType::kBF16},
                          {"bf16 matmuls, bf16 cache", qkv::DType::kBF16, qkv::DType::kBF16}};
  constexpr int kSetups = 3;
  try {
    std::mt19937 rng(11);
    const std::int64_t head_dim = embed / std::max<std::int64_t>(heads, 1);
    const std::int64_t kv_width = kv_heads * head_dim;
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(embed));
    const std::vector<float> q_w = random_floats(embed * embed, w_scale, rng),
                             k_w = random_floats(kv_width * embed, w_scale, rng),
                             v_w = random_floats(kv_width * embed, w_scale, rng),
                             o_w = random_floats(embed * embed, w_scale, rng),
                             o_b = random_floats(embed, 0.1f, rng);
    const qkv::MultiHeadAttentionWeights weights{
        .q_weight = q_w, .k_weight = k_w, .v_weight = v_w, .out_weight = o_w, .out_bias = o_b};

    // The prompt's keys and values, [1, CONTEXT, Hkv, head_dim]: the same tokens in every cache.
    std::vector<float> prompt_k = random_floats(context * kv_width, 2.0f, rng),
                       prompt_v = random_floats(context * kv_width, 1.0f, rng);
    const std::array<std::int64_t, 4> prompt_shape = {1, context, kv_heads, head_dim};
    const std::vector<float> x = random_floats(embed, 1.0f, rng);  // the new token
    // A q for the attention alone, [1, 1, H, head_dim], in f32 and in bf16.
    std::vector<float> q_f32 = random_floats(embed, 1.0f, rng);
    std::vector<std::uint16_t> q_bf16(q_f32.size());
    std::transform(q_f32.begin(), q_f32.end(), q_bf16.begin(), bf16_bits);
    const std::array<std::int64_t, 4> q_shape = {1, 1, heads, head_dim};
    const qkv::TensorView q_views[] = {
        qkv::TensorView::contiguous(q_f32.data(), qkv::DType::kF32, q_shape),
        qkv::TensorView::contiguous(q_bf16.data(), qkv::DType::kBF16, q_shape)};

    std::vector<qkv::MultiHeadAttention> layers;
    std::vector<qkv::KvCache> caches;
    for (const Setup& setup : setups) {
      layers.emplace_back(qkv::MultiHeadAttentionConfig{.embed_dim = embed,
                                                        .num_heads = heads,
                                                        .num_kv_heads = kv_heads,
                                                        .matmul_dtype = setup.matmul_dtype},
                          weights);
      caches.push_back(layers.back().make_cache(1, context + 1, setup.cache_dtype));
      caches.back().append(
          qkv::TensorView::contiguous(prompt_k.data(), qkv::DType::kF32, prompt_shape),
          qkv::TensorView::contiguous(prompt_v.data(), qkv::DType::kF32, prompt_shape));
    }

    std::vector<std::vector<float>> outputs(kSetups, std::vector<float>(embed));
    std::vector<float> attention_out(embed);
    const qkv::AttentionOutputs attention_outputs{
        .out = qkv::TensorView::contiguous(attention_out.data(), qkv::DType::kF32, q_shape)};
    std::vector<std::vector<double>> ms(kSetups), attention_ms(kSetups);
    for (std::int64_t round = 0; round <= rounds; ++round) {  // round 0 warms up
      for (int s = 0; s < kSetups; ++s) {
        const auto start = std::chrono::steady_clock::now();
        layers[s].forward_cached(x.data(), 1, 1, caches[s], outputs[s].data(), {.causal = true});
        const std::chrono::duration<double, std::milli> took =
            std::chrono::steady_clock::now() - start;
        caches[s].truncate(context);
        const auto attention_start = std::chrono::steady_clock::now();
        qkv::attention(q_views[setups[s].cache_dtype == qkv::DType::kF32 ? 0 : 1], caches[s].keys(),
                       caches[s].values(), attention_outputs, {.causal = true});
        const std::chrono::duration<double, std::milli> attention_took =
            std::chrono::steady_clock::now() - attention_start;
        if (round > 0) {
          ms[s].push_back(took.count());
          attention_ms[s].push_back(attention_took.count());
        }
      }
    }

    double scale = 1.0;
    for (float e : outputs[0]) scale = std::max(scale, static_cast<double>(std::abs(e)));
    std::printf(
        "decode_kv_cache: E=%lld H=%lld Hkv=%lld head_dim=%lld, %lld cached tokens, "
        "median of %lld steps\n",
        (long long)embed, (long long)heads, (long long)kv_heads, (long long)head_dim,
        (long long)context, (long long)rounds);
    bool ok = true;
    for (int s = 0; s < kSetups; ++s) {
      double diff = 0;
      for (std::int64_t i = 0; i < embed; ++i) {
        diff = std::max(diff, static_cast<double>(std::abs(outputs[s][i] - outputs[0][i])));
      }
      const double cache_mib = 2.0 * static_cast<double>(context * kv_width) *
                               (setups[s].cache_dtype == qkv::DType::kF32 ? 4 : 2) / (1 << 20);
      std::printf(
          "  %-24s %8.2f MiB  step %8.3f ms %5.2fx  attention %8.3f ms %5.2fx  |out - f32| %.1e\n",
          setups[s].name, cache_mib, median(ms[s]), median(ms[0]) / median(ms[s]),
          median(attention_ms[s]), median(attention_ms[0]) / median(attention_ms[s]), diff / scale);
      ok = ok && diff <= 0.05 * scale;
    }
    return ok ? 0 : 1;
  } catch (const qkv::Error& error) {
    std::fprintf(stderr, "decode_kv_cache: %s\n", error.what());
    return 1;
  }
}
