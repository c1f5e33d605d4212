// TokenTagger (qkv/models/token_tagger.h): training steps lower the loss on a fixed batch;
// save() / load() give back the same logits; a causal model's logits at a position ignore
// later tokens; load() refuses files that are not its own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "expect_error.h"
#include "io/safetensors.h"
#include "qkv/models/token_tagger.h"

namespace qkv::testing {
namespace {

namespace fs = std::filesystem;

const TokenTaggerConfig kSmall{.vocab = 6, .num_classes = 5, .max_seq = 7, .embed_dim = 16,
                               .num_heads = 2, .num_layers = 2, .d_ff = 24};

std::vector<std::int32_t> tokens_of(std::int64_t n, int vocab) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) t[i] = static_cast<std::int32_t>((i * 7 + 3) % vocab);
  return t;
}

TEST(TokenTagger, TrainingLowersTheLoss) {
  TokenTagger model(kSmall, 1);
  const std::int64_t B = 4, L = 7;
  const auto tokens = tokens_of(B * L, 6);
  std::vector<std::int32_t> targets(tokens.size());
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = i % 3 == 0 ? -100 : tokens[i] % 5;
  AdamW opt({.lr = 0.01f});
  const TrainStepResult first = model.train_step(tokens.data(), targets.data(), B, L, opt);
  TrainStepResult last = first;
  for (int i = 0; i < 30; ++i) last = model.train_step(tokens.data(), targets.data(), B, L, opt);
  EXPECT_EQ(first.counted, 18);
  EXPECT_LT(last.loss, 0.5 * first.loss);
  EXPECT_EQ(last.correct, last.counted);  // memorised
  EXPECT_EQ(opt.steps(), 31);
  expect_error([&] { model.train_step(tokens.data(), targets.data(), B, 8, opt); },
               "seq <= max_seq = 7");
  std::vector<std::int32_t> bad = tokens;
  bad[5] = 6;
  expect_error([&] { model.train_step(bad.data(), targets.data(), B, L, opt); },
               "tokens[5] = 6 is outside [0, vocab = 6)");
}

TEST(TokenTagger, SaveAndLoadGiveTheSameLogits) {
  TokenTagger model(kSmall, 2);
  AdamW opt({});
  const auto tokens = tokens_of(14, 6);
  std::vector<std::int32_t> targets(14, 1);
  model.train_step(tokens.data(), targets.data(), 2, 7, opt);  // not the initial weights
  const fs::path dir = fs::temp_directory_path() / ("qkv_tagger_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "m.safetensors").string();
  model.save(path);
  const TokenTagger loaded = TokenTagger::load(path);
  EXPECT_EQ(loaded.config().d_ff, 24);
  EXPECT_EQ(loaded.num_parameters(), model.num_parameters());
  std::vector<float> a(14 * 5), b(14 * 5);
  model.forward(tokens.data(), 2, 7, a.data());
  loaded.forward(tokens.data(), 2, 7, b.data());
  EXPECT_EQ(a, b);
  // Not a TokenTagger file: a tensor missing, the metadata missing.
  io::write_safetensors(path, {{"embed.weight", io::SafetensorsDType::kF32, {6, 16},
                                std::vector<float>(96).data()}},
                        {{"vocab", "6"}});
  expect_error([&] { TokenTagger::load(path); }, "metadata has no 'num_classes'");
  fs::remove_all(dir);
}

TEST(TokenTagger, CausalLogitsIgnoreLaterTokens) {
  TokenTaggerConfig c = kSmall;
  c.causal = true;
  const TokenTagger model(c, 3);
  auto tokens = tokens_of(7, 6);
  std::vector<float> a(7 * 5), b(7 * 5);
  model.forward(tokens.data(), 1, 7, a.data());
  tokens[6] = (tokens[6] + 1) % 6;  // only the last token changes
  model.forward(tokens.data(), 1, 7, b.data());
  for (int i = 0; i < 6 * 5; ++i) EXPECT_EQ(a[i], b[i]) << i;
  bool last_changed = false;
  for (int i = 6 * 5; i < 7 * 5; ++i) last_changed |= a[i] != b[i];
  EXPECT_TRUE(last_changed);
}

}  // namespace
}  // namespace qkv::testing
