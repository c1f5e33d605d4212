// qkv::attention validates everything at the boundary: each error path is asserted by its
// message (the argument it names and, for shapes, both shapes), and nothing is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qkv/attention.h"
#include "qkv/error.h"

namespace qkv {
namespace {

// A valid problem (B=2, Lq=3, Lk=5, Hq=4, Hkv=2, D=8, Dv=6) that each test breaks once.
struct Valid {
  std::vector<float> q = std::vector<float>(2 * 3 * 4 * 8, 0.5f);
  std::vector<float> k = std::vector<float>(2 * 5 * 2 * 8, 0.5f);
  std::vector<float> v = std::vector<float>(2 * 5 * 2 * 6, 0.5f);
  std::vector<float> out = std::vector<float>(2 * 3 * 4 * 6, 42.0f);
  std::vector<float> lse = std::vector<float>(2 * 4 * 3, 42.0f);
  std::vector<float> probs = std::vector<float>(2 * 4 * 3 * 5, 42.0f);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(2 * 4 * 3 * 5, 1);
  std::vector<float> bias = std::vector<float>(2 * 4 * 3 * 5, 0.0f);
  std::vector<std::int64_t> key_lengths = {5, 2};

  TensorView qv = TensorView::contiguous(q.data(), DType::kF32, {2, 3, 4, 8});
  TensorView kv = TensorView::contiguous(k.data(), DType::kF32, {2, 5, 2, 8});
  TensorView vv = TensorView::contiguous(v.data(), DType::kF32, {2, 5, 2, 6});
  AttentionOutputs outputs{TensorView::contiguous(out.data(), DType::kF32, {2, 3, 4, 6}), {}, {}};
  AttentionParams params;

  void run() { attention(qv, kv, vv, outputs, params); }
  bool out_untouched() const {
    for (float x : out) {
      if (x != 42.0f) return false;
    }
    return true;
  }
};

// Runs `break_it` on a fresh valid problem, expects qkv::Error whose message contains every
// string in `needles`, and checks that no output was written.
template <typename F>
void expect_error(F break_it, std::initializer_list<const char*> needles) {
  Valid p;
  break_it(p);
  try {
    p.run();
    FAIL() << "no error thrown; expected one mentioning " << *needles.begin();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const char* needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message '" << message << "' lacks '" << needle << "'";
    }
  }
  EXPECT_TRUE(p.out_untouched());
}

TEST(Validation, ValidProblemRuns) {
  for (Kernel kernel : {Kernel::kReference, Kernel::kChunked, Kernel::kFlash, Kernel::kAuto}) {
    Valid p;
    p.params.kernel = kernel;
    p.params.key_lengths = p.key_lengths;
    p.run();
    EXPECT_FALSE(p.out_untouched());
    EXPECT_NEAR(p.out[0], 0.5f, 1e-6f);  // v is constant, so out is too
  }
}

TEST(Validation, NullData) {
  expect_error([](Valid& p) { p.qv.data = nullptr; }, {"q: data pointer is null"});
  expect_error([](Valid& p) { p.outputs.out.data = nullptr; }, {"out: data pointer is null"});
}

TEST(Validation, Dtypes) {
  expect_error([](Valid& p) { p.kv.dtype = DType::kI32; }, {"k: dtype i32"});
  expect_error([](Valid& p) { p.vv.dtype = DType::kBF16; },
               {"v: dtype bf16", "differs from q's f32"});
  expect_error([](Valid& p) { p.qv.dtype = DType::kI64; },
               {"q: dtype i64", "f32, bf16, f16 or f64"});
  // f64 q, k, v (the reference kernel's gradient-check path) need f64 outputs.
  expect_error(
      [](Valid& p) {
        p.qv.dtype = p.kv.dtype = p.vv.dtype = DType::kF64;
      },
      {"out: dtype f32", "expected f64 (q, k and v are f64)"});
  expect_error([](Valid& p) { p.outputs.out.dtype = DType::kBF16; },
               {"out: dtype bf16", "expected f32"});
  expect_error(
      [](Valid& p) {
        p.params.mask = TensorView::contiguous(p.bias.data(), DType::kF32, {2, 4, 3, 5});
      },
      {"mask: dtype f32", "bool or u8"});
  expect_error(
      [](Valid& p) {
        p.params.bias = TensorView::contiguous(p.mask.data(), DType::kU8, {2, 4, 3, 5});
      },
      {"bias: dtype u8"});
}

TEST(Validation, ZeroSizes) {
  expect_error([](Valid& p) { p.kv.sizes[1] = 0; }, {"k: shape (2, 0, 2, 8)", ">= 1"});
  // An empty array may come with no data (DLPack): its shape is still what the message names.
  expect_error(
      [](Valid& p) {
        p.qv.sizes[0] = 0;
        p.qv.data = nullptr;
      },
      {"q: shape (0, 3, 4, 8)", ">= 1"});
}

TEST(Validation, ShapeMismatchesNameBothShapes) {
  expect_error([](Valid& p) { p.kv.sizes[3] = 7; },
               {"q: shape (2, 3, 4, 8)", "k: shape (2, 5, 2, 7)", "head_dim"});
  expect_error([](Valid& p) { p.vv.sizes[1] = 4; },
               {"k: shape (2, 5, 2, 8)", "v: shape (2, 4, 2, 6)", "seq_kv"});
  expect_error([](Valid& p) { p.kv.sizes[0] = 1; }, {"q: shape", "k: shape (1, 5, 2, 8)", "batch"});
  expect_error([](Valid& p) { p.vv.sizes[2] = 1; }, {"num_heads_kv"});
  expect_error([](Valid& p) { p.outputs.out.sizes[3] = 8; },
               {"out: shape (2, 3, 4, 8) must be (2, 3, 4, 6)"});
}

TEST(Validation, HeadsNotMultiple) {
  expect_error(
      [](Valid& p) {
        p.kv.sizes[2] = 3;
        p.vv.sizes[2] = 3;
      },
      {"q: shape (2, 3, 4, 8)", "not a multiple", "k: shape (2, 5, 3, 8)"});
}

TEST(Validation, OptionalOutputs) {
  expect_error(
      [](Valid& p) {
        p.outputs.lse = TensorView::contiguous(p.lse.data(), DType::kF32, {2, 3, 4, 1});
      },
      {"lse: shape (2, 3, 4, 1) must be (2, 4, 3, 1)"});
  expect_error(
      [](Valid& p) {
        p.outputs.probs = TensorView::contiguous(p.probs.data(), DType::kF32, {2, 4, 3, 5});
        p.params.kernel = Kernel::kFlash;
      },
      {"probs:", "flash"});
  expect_error(
      [](Valid& p) {
        p.outputs.probs = TensorView::contiguous(p.probs.data(), DType::kF32, {2, 4, 5, 3});
      },
      {"probs: shape (2, 4, 5, 3) must be (2, 4, 3, 5)"});
  expect_error([](Valid& p) { p.outputs.out.strides[1] = 0; }, {"out: stride 0 in dim 1"});
}

TEST(Validation, OutputsMustNotOverlapInputsOrEachOther) {
  auto expect_refused = [](auto break_it, const char* needle) {
    Valid p;
    break_it(p);
    const std::vector<float> q_before = p.q, bias_before = p.bias;
    try {
      p.run();
      FAIL() << "no error thrown; expected one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(p.q, q_before);
    EXPECT_EQ(p.bias, bias_before);
    EXPECT_TRUE(p.out_untouched());
  };
  // out written over q's memory (in place), over k, probs over the bias, lse inside out.
  expect_refused(
      [](Valid& p) {
        p.outputs.out = TensorView::contiguous(p.q.data(), DType::kF32, {2, 3, 4, 6});
      },
      "out: its memory overlaps q's");
  expect_refused(
      [](Valid& p) {
        // Negative strides: from k's last element backwards, wholly inside k.
        p.outputs.out.data = p.k.data() + (p.k.size() - 1);
        p.outputs.out.strides = {-72, -24, -6, -1};
      },
      "out: its memory overlaps k's");
  expect_refused(
      [](Valid& p) {
        p.params.bias = TensorView::contiguous(p.bias.data(), DType::kF32, {2, 4, 3, 5});
        p.outputs.probs = p.params.bias;
      },
      "probs: its memory overlaps bias's");
  expect_refused(
      [](Valid& p) {
        p.outputs.lse = TensorView::contiguous(p.out.data() + 10, DType::kF32, {2, 4, 3, 1});
      },
      "out: its memory overlaps lse's");
}

TEST(Validation, OutputsNextToInputsInOneBufferAreFine) {
  Valid p;
  std::vector<float> buffer(p.q.size() + p.out.size(), 0.5f);  // q, then out, back to back
  p.qv = TensorView::contiguous(buffer.data(), DType::kF32, {2, 3, 4, 8});
  p.outputs.out = TensorView::contiguous(buffer.data() + p.q.size(), DType::kF32, {2, 3, 4, 6});
  p.run();
  EXPECT_NEAR(buffer[p.q.size()], 0.5f, 1e-6f);
}

// q and out as column ranges of one row buffer ([q | out] per (b, l) row, their extents
// interleaved): apart, and out equals the one computed in a buffer of its own. out rows 64
// floats apart over q rows 56 apart share memory from the second row on: refused.
TEST(Validation, OutputsInterleavedWithInputsByColumnsAreFine) {
  Valid alone;
  alone.run();
  Valid p;
  const std::int64_t F = 4 * 8 + 4 * 6;  // q's 32 floats, then out's 24
  std::vector<float> rows(2 * 3 * F, 7.0f);
  for (std::int64_t r = 0; r < 6; ++r) std::copy_n(p.q.data() + r * 32, 32, rows.data() + r * F);
  p.qv = {.data = rows.data(), .sizes = {2, 3, 4, 8}, .strides = {3 * F, F, 8, 1}};
  p.outputs.out = {.data = rows.data() + 32, .sizes = {2, 3, 4, 6}, .strides = {3 * F, F, 6, 1}};
  p.run();
  for (std::int64_t r = 0; r < 6; ++r) {
    for (std::int64_t i = 0; i < 24; ++i) {
      ASSERT_EQ(rows[r * F + 32 + i], alone.out[r * 24 + i]) << "row " << r << ", " << i;
    }
  }
  Valid wider;
  std::vector<float> buffer(2 * 3 * 64 + F, 0.5f);
  wider.qv = {.data = buffer.data(), .sizes = {2, 3, 4, 8}, .strides = {3 * F, F, 8, 1}};
  wider.outputs.out = {
      .data = buffer.data() + 32, .sizes = {2, 3, 4, 6}, .strides = {3 * 64, 64, 6, 1}};
  try {
    wider.run();
    ADD_FAILURE() << "no error thrown for out rows over q rows";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out: its memory overlaps q's"), std::string::npos)
        << e.what();
  }
}

// A side of at least max(Lq, Lk) allows every key on its side, up to INT64_MAX: it must mean
// "unbounded", bit for bit, and never overflow i' + side (issue 18: exit 0, wrong output).
TEST(Validation, WindowSidesPastEveryKeyAreUnbounded) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (Kernel kernel : {Kernel::kReference, Kernel::kChunked, Kernel::kFlash}) {
    for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
      for (bool causal : {false, true}) {
        auto run = [&](std::int64_t left, std::int64_t right) {
          Valid p;
          for (std::size_t i = 0; i < p.q.size(); ++i) p.q[i] = std::sin(0.7f * i);
          for (std::size_t i = 0; i < p.k.size(); ++i) p.k[i] = std::cos(0.3f * i);
          for (std::size_t i = 0; i < p.v.size(); ++i) p.v[i] = std::sin(1.3f * i);
          p.params = {.causal = causal, .align = align, .window_left = left,
                      .window_right = right, .kernel = kernel};
          p.run();
          EXPECT_EQ(allowed_pairs(3, 5, p.params),
                    allowed_pairs(3, 5, {.causal = causal, .align = align}));
          return p.out;
        };
        const std::vector<float> unbounded = run(-1, -1);
        for (auto [left, right] : {std::pair{kMax, kMax}, {-1, kMax}, {kMax, -1},
                                   {kMax - 1, kMax}, {std::int64_t{5}, std::int64_t{5}}}) {
          EXPECT_EQ(run(left, right), unbounded)
              << "kernel " << int(kernel) << " window (" << left << ", " << right << ")";
        }
      }
    }
  }
}

TEST(Validation, Scalars) {
  expect_error([](Valid& p) { p.params.scale = 0.0f; }, {"scale: must be finite and > 0"});
  expect_error([](Valid& p) { p.params.scale = -1.0f; }, {"scale:"});
  expect_error([](Valid& p) { p.params.scale = std::numeric_limits<float>::quiet_NaN(); },
               {"scale:"});
  expect_error([](Valid& p) { p.params.softcap = -2.0f; }, {"softcap: must be finite and >= 0"});
  expect_error([](Valid& p) { p.params.window_left = -2; }, {"window: (-2, -1)", "below -1"});
  expect_error([](Valid& p) { p.params.window_right = -5; }, {"window: (-1, -5)"});
  expect_error([](Valid& p) { p.params.num_threads = -1; }, {"num_threads: must be >= 0"});
  expect_error([](Valid& p) { p.params.chunk_size = 0; }, {"chunk_size: must be >= 1"});
}

TEST(Validation, KeyLengths) {
  static const std::vector<std::int64_t> too_few = {5};
  static const std::vector<std::int64_t> negative = {5, -1};
  static const std::vector<std::int64_t> too_long = {6, 2};
  expect_error([](Valid& p) { p.params.key_lengths = too_few; },
               {"key_lengths: has 1 entries, expected batch = 2"});
  expect_error([](Valid& p) { p.params.key_lengths = negative; },
               {"key_lengths: entry 1 is -1", "[0, seq_kv = 5]", "k: shape (2, 5, 2, 8)"});
  expect_error([](Valid& p) { p.params.key_lengths = too_long; }, {"key_lengths: entry 0 is 6"});
}

TEST(Validation, MaskAndBiasBroadcasting) {
  // Broadcastable shapes are accepted...
  for (std::array<std::int64_t, 4> sizes : {std::array<std::int64_t, 4>{1, 1, 1, 5},
                                            {2, 1, 1, 5},
                                            {1, 4, 3, 5},
                                            {2, 4, 3, 1},
                                            {1, 1, 1, 1}}) {
    Valid p;
    p.params.mask = TensorView::contiguous(p.mask.data(), DType::kU8, sizes);
    p.params.bias = TensorView::contiguous(p.bias.data(), DType::kF32, sizes);
    EXPECT_NO_THROW(p.run()) << shape_string(sizes);
  }
  // ...and anything else is named with both shapes.
  expect_error(
      [](Valid& p) {
        p.params.mask = TensorView::contiguous(p.mask.data(), DType::kU8, {2, 4, 3, 4});
      },
      {"mask: shape (2, 4, 3, 4) is not broadcastable", "(2, 4, 3, 5)", "dim 3 must be 1 or 5"});
  expect_error(
      [](Valid& p) {
        p.params.bias = TensorView::contiguous(p.bias.data(), DType::kF32, {2, 2, 3, 5});
      },
      {"bias: shape (2, 2, 3, 5) is not broadcastable", "dim 1 must be 1 or 4"});
}

TEST(Validation, BiasRejectsNanAndPositiveInfinity) {
  expect_error(
      [](Valid& p) {
        p.bias[7] = std::numeric_limits<float>::infinity();
        p.params.bias = TensorView::contiguous(p.bias.data(), DType::kF32, {2, 4, 3, 5});
      },
      {"bias: element (0, 0, 1, 2)", "is +inf", "-inf are allowed"});
  expect_error(
      [](Valid& p) {
        p.bias[0] = std::numeric_limits<float>::quiet_NaN();
        p.params.bias = TensorView::contiguous(p.bias.data(), DType::kF32, {1, 1, 1, 5});
      },
      {"bias: element (0, 0, 0, 0)", "is NaN"});
}

TEST(TensorView, ContiguousAndPermutedStrides) {
  float data[2 * 3 * 4 * 5];
  const TensorView bhsd = TensorView::contiguous(data, DType::kF32, {2, 3, 4, 5});
  EXPECT_EQ(bhsd.strides, (std::array<std::int64_t, 4>{60, 20, 5, 1}));
  const TensorView bshd = bhsd.permuted({0, 2, 1, 3});
  EXPECT_EQ(bshd.sizes, (std::array<std::int64_t, 4>{2, 4, 3, 5}));
  EXPECT_EQ(bshd.strides, (std::array<std::int64_t, 4>{60, 5, 20, 1}));
  EXPECT_EQ(bshd.offset(1, 2, 1, 3), bhsd.offset(1, 1, 2, 3));
  EXPECT_EQ(bshd.numel(), 120);
  EXPECT_THROW(bhsd.permuted({0, 0, 1, 2}), Error);
  EXPECT_EQ(shape_string(bshd.sizes), "(2, 4, 3, 5)");
  EXPECT_EQ(dtype_size(DType::kBF16), 2);
  EXPECT_STREQ(dtype_name(DType::kI64), "i64");
}

TEST(AttentionApi, FlopsAndAllowedPairs) {
  EXPECT_DOUBLE_EQ(attention_flops(1, 8, 4096.0 * 4096.0, 64, 64), 4.0 * 8 * 4096 * 4096 * 64);
  AttentionParams causal;
  causal.causal = true;
  EXPECT_DOUBLE_EQ(allowed_pairs(4, 4, causal), 10.0);  // 1 + 2 + 3 + 4
  causal.align = Align::kTopLeft;
  EXPECT_DOUBLE_EQ(allowed_pairs(2, 4, causal), 3.0);  // 1 + 2
  causal.align = Align::kBottomRight;
  EXPECT_DOUBLE_EQ(allowed_pairs(2, 4, causal), 7.0);  // 3 + 4
  AttentionParams window;
  window.window_left = 1;
  window.window_right = 0;
  EXPECT_DOUBLE_EQ(allowed_pairs(3, 3, window), 5.0);  // 1 + 2 + 2
  EXPECT_STREQ(resolved_kernel_name(AttentionParams{}, AttentionOutputs{}), "flash");
  AttentionOutputs with_probs;
  with_probs.probs.data = &window;
  EXPECT_STREQ(resolved_kernel_name(AttentionParams{}, with_probs), "chunked");
}

}  // namespace
}  // namespace qkv
