// One table of attention cases drives the kernel tests: a Case describes shapes and masks,
// Problem owns random data for it and runs any kernel. Problem::plain is the "plain
// implementation of the same formula in the same precision" of DESIGN.md section 5, used to
// size the tolerance.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/product_path.h"
#include "qkv/attention.h"

namespace qkv::testing {

enum class MaskKind { kNone, kRandom, kRowBroadcast, kKeyPadding };
// kRandom / kWithNegInf: [B, H, Lq, Lk]; kPerHeadRow: [1, H, Lq, 1]; kShared: [1, 1, Lq, Lk]
// (one bias for every batch entry and head); kPerKey: [B, 1, 1, Lk].
enum class BiasKind { kNone, kRandom, kWithNegInf, kPerHeadRow, kShared, kPerKey };

struct Case {
  std::int64_t batch = 1, seq_q = 5, seq_kv = 5, num_heads_q = 1, num_heads_kv = 1;
  std::int64_t head_dim = 16, head_dim_v = -1;  // -1: = head_dim
  bool causal = false;
  Align align = Align::kBottomRight;
  std::int64_t window_left = -1, window_right = -1;
  bool key_lengths = false;  // random key lengths in [0, Lk], one batch entry 0 when B > 1
  bool nan_padding = false;  // keys/values past key_lengths are NaN
  MaskKind mask = MaskKind::kNone;
  BiasKind bias = BiasKind::kNone;
  float softcap = 0.0f;
  std::optional<float> scale = std::nullopt;
  float input_scale = 1.0f;   // multiply q and k: large logits
  bool bhsd = false;          // q/k/v/out stored (B, H, L, D)
  bool dim_strided = false;   // stored (B, L, D, H): elements along D lie H apart (not bhsd)
  DType dtype = DType::kF32;  // storage of q, k, v (bf16/f16: random values rounded to it)
  std::uint64_t seed = 1;

  std::string name() const;
};

struct Result {
  std::vector<float> out, lse, probs;
};

class Problem {
 public:
  explicit Problem(const Case& c);
  // Runs qkv::attention with `kernel`; with_probs asks for the probabilities too.
  Result run(Kernel kernel, bool with_probs, int num_threads = 0,
             std::int64_t chunk_size = 128) const;
  // The same with any AttentionParams (e.g. params() plus a sparsity); kernel and threads set
  // in `params` are used as given.
  Result run_with(const AttentionParams& params, bool with_probs) const;
  // The product path the flash kernel takes for this case on this CPU (resolved_product_path:
  // the dtype's, or where the shape makes it, another: products-inl.h, FlashProductPath).
  ProductPath flash_path() const;
  // Naive loops of the same semantics in the precision of the path the flash kernel takes for
  // the case on this CPU (flash_path; the tolerance yardstick, DESIGN.md section 5): the inputs as
  // stored (bf16/f16 values), f32 scores, softmax and accumulation; where the path rounds the
  // probabilities to bf16 before they weight v (bf16-vdpbf16ps), the same rounding of
  // exp(s - max); where it drops a part of the scores' products (f16-amx-split: the lo x lo
  // parts), the same scores. Nothing else is rounded: rounding the scores too made the bf16
  // tolerance about 100x the path's real error. out, lse and probs (p = e / sum, never rounded:
  // what a kernel returns).
  Result plain() const { return plain(flash_path()); }
  // The same for the given path (the chunked kernel's is WideningProductPath(dtype)); with
  // `keep` (a full [B, Hq, Lq, Lk] mask, e.g. a sparsity's pairs), only the pairs it keeps too.
  Result plain(ProductPath path, const std::vector<std::uint8_t>* keep = nullptr) const;
  const Case& spec() const { return c_; }
  AttentionParams params() const;
  // Row i of head h in batch entry b as plain() computes it: s[j] for every key j (f32 dot of
  // the stored values, times scale, softcap, bias; -inf where causal, window, key lengths, the
  // mask or `keep` leave the pair out; with `split`, without the f16 split's lo x lo parts),
  // and, with cap, the softcap's derivative 1 - tanh^2 (1 without softcap). Returns the max.
  float row_scores(std::int64_t b, std::int64_t h, std::int64_t i, bool split,
                   const std::vector<std::uint8_t>* keep, float* s, float* cap) const;
  // Offset of bias element (b, h, i, j) in `bias` (and in a dbias of its shape).
  std::int64_t bias_offset(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;

  TensorView view(std::vector<float>& data, std::int64_t seq, std::int64_t heads,
                  std::int64_t dim) const;
  std::int64_t head_dim_v() const { return c_.head_dim_v < 0 ? c_.head_dim : c_.head_dim_v; }

  std::vector<float> q, k, v, bias;          // f32 values (rounded to dtype: the oracle's inputs)
  std::vector<std::uint16_t> q16, k16, v16;  // their bf16/f16 bits (dtype != f32)
  std::vector<std::uint8_t> mask;
  std::vector<std::int64_t> key_lengths;

 private:
  // Views of the inputs and of r's outputs (filled with 7.0f) for one attention call.
  struct Call {
    TensorView q, k, v;
    AttentionOutputs outputs;
  };
  Call call(Result& r, bool with_probs) const;

  Case c_;
  std::array<std::int64_t, 4> mask_sizes_{}, bias_sizes_{};
};

// Max |a - b| over elements; inf vs inf (same sign) counts as 0; NaN anywhere counts as inf.
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);
double max_abs(const std::vector<float>& a);
// Same size and the same bits (thread invariance, sparse == dense with the equivalent mask).
bool bit_equal(const std::vector<float>& a, const std::vector<float>& b);

// DESIGN.md section 5: max(2e-5 * max(1, max|ref|), 4 * error of the plain f32 implementation).
double tolerance(const std::vector<float>& reference, const std::vector<float>& plain);

// qkv::attention_backward of the problem at its inputs for dL/d(out) = dout (out's shape),
// with `params` on `kernel` and `num_threads`; the forward's out and lse come from the
// reference kernel. Gradients start as 7.0f (an untouched element shows). with_dbias: also
// dbias, in the shape of params.bias.
struct Grads {
  std::vector<float> dq, dk, dv, dbias;
};
Grads run_backward(Problem& pr, const AttentionParams& params, std::vector<float>& dout,
                   bool with_dbias, int num_threads = 0, Kernel kernel = Kernel::kReference);

// Naive loops of the flash backward's bf16 AMX path (kernels/cpu/backward_products-inl.h,
// AmxBackward; the tolerance yardstick of DESIGN.md section 5): f32 scores, p = exp(s - lse)
// with the reference forward's lse and out, dout rounded to bf16 where it multiplies v (dp) and
// p (dv), p rounded to bf16 where it weights dout (dv), du = p (dp - D) (times the softcap's
// derivative) rounded to bf16 where it weights q (dk) and k (dq); D = dout . out and every sum in
// f32. dbias sums ds = p (dp - D) unrounded. params: pr.params() or with dropout (then
// dv takes bf16(p z) and ds = p (z dp - D), z = keep / (1 - dropout_p)); no sparsity.
Grads plain_backward_bf16(Problem& pr, const AttentionParams& params,
                          const std::vector<float>& dout, bool with_dbias);

// Runs the flash backward of pr with params and dout (and dbias where pr has a bias) on 1 thread,
// then on each of `threads`: dq, dk, dv and dbias must keep the same bits.
void expect_same_grads_on_any_thread_count(Problem& pr, const AttentionParams& params,
                                           std::vector<float>& dout,
                                           const std::vector<int>& threads);

// The loss sum(dout * out) of the reference forward with `params`, in f64.
double reference_loss(const Problem& pr, const AttentionParams& params,
                      const std::vector<float>& dout);

// n values ~ N(0, 1), the same for the same seed.
std::vector<float> normal_values(std::size_t n, std::uint64_t seed);

// Runs `params` (kernel and everything else set) on 1 thread, then on 2, 3 and 5: out and lse
// must keep the same bits.
void expect_same_bits_on_any_thread_count(const Problem& problem, AttentionParams params);

}  // namespace qkv::testing

namespace qkv::testing {
// gtest prints a Case by its name instead of its bytes.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }
}  // namespace qkv::testing
