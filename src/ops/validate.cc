#include "ops/validate.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <numeric>
#include <utility>

#include "qkv/error.h"

namespace qkv::ops {

std::string describe(const char* name, const TensorView& view) {
  return std::string(name) + ": shape " + shape_string(view.sizes);
}

void require_data(const char* name, const TensorView& view) {
  if (view.data == nullptr) throw Error(std::string(name) + ": data pointer is null");
}

void require_dtype(const char* name, const TensorView& view, DType want,
                   const std::string& what_else) {
  if (view.dtype != want) {
    throw Error(std::string(name) + ": dtype " + dtype_name(view.dtype) + " is not supported (" +
                what_else + ")");
  }
}

void require_positive_sizes(const char* name, const TensorView& view) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] < 1) {
      throw Error(describe(name, view) + " has size " + std::to_string(view.sizes[d]) + " in dim " +
                  std::to_string(d) + "; every size must be >= 1");
    }
  }
}

void require_same(const char* name_a, const TensorView& a, int dim_a, const char* name_b,
                  const TensorView& b, int dim_b, const char* what) {
  if (a.sizes[dim_a] != b.sizes[dim_b]) {
    throw Error(describe(name_a, a) + " does not match " + describe(name_b, b) + ": " + what +
                " differs (" + std::to_string(a.sizes[dim_a]) + " vs " +
                std::to_string(b.sizes[dim_b]) + ")");
  }
}

void require_shape(const char* name, const TensorView& view,
                   const std::array<std::int64_t, 4>& want, const char* want_text) {
  if (view.sizes != want) {
    throw Error(describe(name, view) + " must be " + shape_string(want) + " " + want_text);
  }
}

void require_writable_strides(const char* name, const TensorView& view) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] > 1 && view.strides[d] == 0) {
      throw Error(std::string(name) + ": stride 0 in dim " + std::to_string(d) +
                  " of an output with size " + std::to_string(view.sizes[d]));
    }
  }
}

void broadcast_strides(const char* name, const TensorView& view,
                       const std::array<std::int64_t, 4>& full, std::int64_t out[4]) {
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] == full[d]) {
      out[d] = full[d] == 1 ? 0 : view.strides[d];
    } else if (view.sizes[d] == 1) {
      out[d] = 0;
    } else {
      throw Error(describe(name, view) +
                  " is not broadcastable to (B, Hq, Lq, Lk) = " + shape_string(full) + ": dim " +
                  std::to_string(d) + " must be 1 or " + std::to_string(full[d]));
    }
  }
}

DType output_dtype(DType input) { return input == DType::kF64 ? DType::kF64 : DType::kF32; }

void require_output_dtype(const char* name, const TensorView& view, DType input) {
  require_dtype(name, view, output_dtype(input),
                input == DType::kF64 ? "expected f64 (q, k and v are f64)" : "expected f32");
}

AttentionShape validate_operands(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, bool half_inputs,
                                 const std::string& dtype_hint, bool out_in_input_dtype) {
  const std::pair<const char*, const TensorView*> operands[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
  // Sizes first: an empty array (from DLPack, a torch tensor of 0 elements) has no data either,
  // and its shape is what the user can act on.
  for (const auto& [name, view] : operands) {
    require_positive_sizes(name, *view);
    require_data(name, *view);
  }
  const bool half = q.dtype == DType::kBF16 || q.dtype == DType::kF16 || q.dtype == DType::kF64;
  if (!(q.dtype == DType::kF32 || (half_inputs && half))) {
    require_dtype("q", q, DType::kF32, dtype_hint);
  }
  for (const auto& [name, view] : {operands[1], operands[2]}) {
    if (view->dtype != q.dtype) {
      throw Error(std::string(name) + ": dtype " + dtype_name(view->dtype) + " differs from q's " +
                  dtype_name(q.dtype) + " (q, k and v must share one dtype)");
    }
  }
  const bool half_in = q.dtype == DType::kBF16 || q.dtype == DType::kF16;
  if (out_in_input_dtype && half_in) {
    if (out.dtype != DType::kF32 && out.dtype != q.dtype) {
      throw Error(std::string("out: dtype ") + dtype_name(out.dtype) +
                  " is not supported (expected f32, or " + dtype_name(q.dtype) +
                  " as q, k and v are)");
    }
  } else {
    require_output_dtype("out", out, q.dtype);
  }
  require_same("q", q, 0, "k", k, 0, "batch (dim 0)");
  require_same("k", k, 0, "v", v, 0, "batch (dim 0)");
  require_same("k", k, 1, "v", v, 1, "seq_kv (dim 1)");
  require_same("k", k, 2, "v", v, 2, "num_heads_kv (dim 2)");
  require_same("q", q, 3, "k", k, 3, "head_dim (dim 3)");
  const AttentionShape s{.batch = q.sizes[0],
                         .seq_q = q.sizes[1],
                         .seq_kv = k.sizes[1],
                         .num_heads_q = q.sizes[2],
                         .num_heads_kv = k.sizes[2],
                         .head_dim = q.sizes[3],
                         .head_dim_v = v.sizes[3]};
  if (s.num_heads_q % s.num_heads_kv != 0) {
    throw Error(describe("q", q) + " has " + std::to_string(s.num_heads_q) +
                " heads, not a multiple of the " + std::to_string(s.num_heads_kv) + " heads of " +
                describe("k", k) + " (num_heads_q % num_heads_kv must be 0)");
  }
  require_shape("out", out, {s.batch, s.seq_q, s.num_heads_q, s.head_dim_v}, "(B, Lq, Hq, Dv)");
  require_writable_strides("out", out);
  return s;
}

namespace {

// [first byte, one past the last byte] of the elements a view addresses.
std::pair<std::uintptr_t, std::uintptr_t> byte_extent(const TensorView& view) {
  std::int64_t low = 0, high = 0;  // element offsets of the lowest and highest element
  for (int d = 0; d < 4; ++d) {
    const std::int64_t reach = (view.sizes[d] - 1) * view.strides[d];
    (reach < 0 ? low : high) += reach;
  }
  const std::int64_t size = dtype_size(view.dtype);
  const auto base = reinterpret_cast<std::uintptr_t>(view.data);
  return {base + static_cast<std::uintptr_t>(low * size),
          base + static_cast<std::uintptr_t>((high + 1) * size)};
}

// A view's bytes as runs: `run` contiguous bytes at every base + sum i_d * outer[d], where the
// run is the innermost dims whose elements lie end to end (a row's heads x head_dim, say) and
// outer holds the other dims' strides in bytes (0 where there are fewer).
struct Runs {
  std::int64_t run = 0;
  std::array<std::int64_t, 4> outer = {0, 0, 0, 0};
};

Runs runs_of(const TensorView& view) {
  const std::int64_t size = dtype_size(view.dtype);
  std::array<int, 4> order = {0, 1, 2, 3};
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return std::abs(view.strides[a]) < std::abs(view.strides[b]); });
  Runs r{.run = size};
  int outer = 0;
  for (int d : order) {
    if (view.sizes[d] == 1) continue;
    if (outer == 0 && view.strides[d] * size == r.run) {
      r.run *= view.sizes[d];
    } else {
      r.outer[outer++] = std::abs(view.strides[d]) * size;
    }
  }
  return r;
}

// Whether the two views' runs fall in disjoint residues modulo g, the gcd of both views' outer
// strides (every byte of a view lies at its base plus a run offset, modulo g): then no byte is
// shared, however their extents interleave (dq, dk and dv as column ranges of one [dq | dk |
// dv] row buffer). False where this cannot tell (a run as long as g, or no outer dims at all,
// where the extents are exact).
bool runs_apart(const TensorView& a, const TensorView& b) {
  const Runs ra = runs_of(a), rb = runs_of(b);
  std::int64_t g = 0;
  for (int d = 0; d < 4; ++d) g = std::gcd(g, std::gcd(ra.outer[d], rb.outer[d]));
  if (g == 0 || ra.run > g || rb.run > g) return false;
  const auto modulus = static_cast<std::uintptr_t>(g);
  const std::uintptr_t base_a = reinterpret_cast<std::uintptr_t>(a.data) % modulus;
  const std::uintptr_t base_b = reinterpret_cast<std::uintptr_t>(b.data) % modulus;
  const std::uintptr_t b_after_a = (base_b + modulus - base_a) % modulus;
  return b_after_a >= static_cast<std::uintptr_t>(ra.run) &&
         modulus - b_after_a >= static_cast<std::uintptr_t>(rb.run);
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a_first, a_end] = byte_extent(a);
  const auto [b_first, b_end] = byte_extent(b);
  return a_first < b_end && b_first < a_end && !runs_apart(a, b);
}

}  // namespace

void require_no_overlap(std::span<const NamedView> outputs, std::span<const NamedView> inputs) {
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    const char* name = outputs[o].first;
    const TensorView* view = outputs[o].second;
    if (view->empty()) continue;
    auto check = [&](const NamedView& other) {
      if (!other.second->empty() && overlaps(*view, *other.second)) {
        throw Error(std::string(name) + ": its memory overlaps " + other.first +
                    "'s (an output must not share memory with an input or another output)");
      }
    };
    for (const NamedView& input : inputs) check(input);
    for (std::size_t later = o + 1; later < outputs.size(); ++later) check(outputs[later]);
  }
}

Window effective_window(const AttentionParams& params, std::int64_t seq_q, std::int64_t seq_kv,
                        std::int64_t diagonal_offset) {
  // i' runs over [d, Lq - 1 + d]. left >= Lq - 1 + d puts every i' - left at or below key 0;
  // right >= Lk - 1 - d puts every i' + right at or past key Lk - 1.
  const std::int64_t left_all = std::max<std::int64_t>(0, seq_q - 1 + diagonal_offset);
  const std::int64_t right_all = std::max<std::int64_t>(0, seq_kv - 1 - diagonal_offset);
  Window window{params.window_left >= left_all ? -1 : params.window_left,
                params.window_right >= right_all ? -1 : params.window_right};
  if (params.causal) window.right = window.right < 0 ? 0 : std::min<std::int64_t>(window.right, 0);
  return window;
}

void validate_key_lengths(std::span<const std::int64_t> key_lengths, const TensorView& q,
                          const TensorView& k, std::int64_t seq_kv) {
  if (key_lengths.empty()) return;
  const std::int64_t batch = q.sizes[0];
  if (static_cast<std::int64_t>(key_lengths.size()) != batch) {
    throw Error("key_lengths: has " + std::to_string(key_lengths.size()) +
                " entries, expected batch = " + std::to_string(batch) + " (q: shape " +
                shape_string(q.sizes) + ")");
  }
  for (std::size_t b = 0; b < key_lengths.size(); ++b) {
    const std::int64_t length = key_lengths[b];
    if (length < 0 || length > seq_kv) {
      throw Error("key_lengths: entry " + std::to_string(b) + " is " + std::to_string(length) +
                  ", outside [0, seq_kv = " + std::to_string(seq_kv) + "] (k: shape " +
                  shape_string(k.sizes) + ")");
    }
  }
}

void validate_num_threads(int num_threads) {
  if (num_threads < 0) {
    throw Error("num_threads: must be >= 0 (0 = default), got " + std::to_string(num_threads));
  }
}

}  // namespace qkv::ops
