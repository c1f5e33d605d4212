// Sparsity patterns (qkv/sparse.h): validation, BigBird's layout draw, the dense mask of a
// pattern and its allowed-pair count. The per-pair rule itself is kernels/sparse_pair.h.
#include "ops/sparse_layout.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/int_math.h"
#include "core/splitmix64.h"
#include "kernels/sparse_pair.h"
#include "ops/validate.h"
#include "qkv/attention.h"
#include "qkv/error.h"

namespace qkv {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

std::string sizes_text(std::int64_t seq_q, std::int64_t seq_kv) {
  return "(Lq = " + str(seq_q) + ", Lk = " + str(seq_kv) + ")";
}

void validate_bigbird(const BigBirdSparsity& s, std::int64_t seq_q, std::int64_t seq_kv,
                      std::int64_t num_heads_q) {
  if (s.block < 1) throw Error("sparsity: BigBird block = " + str(s.block) + " must be >= 1");
  if (s.num_random_blocks < 0) {
    throw Error("sparsity: BigBird random = " + str(s.num_random_blocks) + " must be >= 0");
  }
  if (s.num_global_blocks < 0) {
    throw Error("sparsity: BigBird global = " + str(s.num_global_blocks) + " must be >= 0");
  }
  // The layout is materialised: Hq x ceil(Lq / b) x ceil(Lk / b) bytes.
  const double bytes = static_cast<double>(num_heads_q) *
                       static_cast<double>(ceil_div(seq_q, s.block)) *
                       static_cast<double>(ceil_div(seq_kv, s.block));
  if (bytes > static_cast<double>(std::int64_t{1} << 30)) {
    throw Error("sparsity: BigBird block = " + str(s.block) + " gives a " + str(num_heads_q) +
                " x " + str(ceil_div(seq_q, s.block)) + " x " + str(ceil_div(seq_kv, s.block)) +
                " block layout " + sizes_text(seq_q, seq_kv) + ", over 1 GiB; use a larger block");
  }
}

}  // namespace

std::vector<std::uint8_t> bigbird_layout(const BigBirdSparsity& s, std::int64_t seq_q,
                                         std::int64_t seq_kv, std::int64_t num_heads_q) {
  // layout: [Hq, nqb, nkb], row-major
  validate_bigbird(s, seq_q, seq_kv, num_heads_q);
  const std::int64_t nqb = ceil_div(seq_q, s.block), nkb = ceil_div(seq_kv, s.block);
  std::vector<std::uint8_t> layout(static_cast<std::size_t>(num_heads_q * nqb * nkb), 0);
  std::vector<std::int64_t> candidates;
  for (std::int64_t h = 0; h < num_heads_q; ++h) {
    for (std::int64_t qb = 0; qb < nqb; ++qb) {
      std::uint8_t* row = layout.data() + (h * nqb + qb) * nkb;
      if (qb < s.num_global_blocks) {  // a global query block attends every key block
        std::fill(row, row + nkb, 1);
        continue;
      }
      candidates.clear();
      for (std::int64_t kb = 0; kb < nkb; ++kb) {
        const bool fixed = kb < s.num_global_blocks || std::abs(kb - qb) <= 1;
        if (fixed) {
          row[kb] = 1;
        } else {
          candidates.push_back(kb);
        }
      }
      // r distinct random blocks from the rest: a partial Fisher-Yates shuffle driven by a
      // splitmix64 stream keyed by (seed, head, query block); docs/sparse.md spells it out.
      std::uint64_t state =
          s.seed ^ (static_cast<std::uint64_t>(h * nqb + qb) * 0xD1B54A32D192ED03ull);
      const std::int64_t n = static_cast<std::int64_t>(candidates.size());
      const std::int64_t draws = std::min(s.num_random_blocks, n);
      for (std::int64_t t = 0; t < draws; ++t) {
        const std::int64_t pick = t + static_cast<std::int64_t>(splitmix64_next(state) %
                                                                static_cast<std::uint64_t>(n - t));
        std::swap(candidates[t], candidates[pick]);
        row[candidates[t]] = 1;
      }
    }
  }
  return layout;
}

void resolve_sparsity(const Sparsity& sparsity, std::int64_t seq_q, std::int64_t seq_kv,
                      std::int64_t num_heads_q, std::int64_t diagonal_offset,
                      ResolvedSparsity& resolved) {
  SparseKernelParams& k = resolved.params;
  k = SparseKernelParams{};
  if (const auto* s = std::get_if<LongformerSparsity>(&sparsity)) {
    if (s->window < 0) {
      throw Error("sparsity: Longformer window w = " + str(s->window) + " must be >= 0");
    }
    if (s->dilation < 1) {
      throw Error("sparsity: Longformer dilation = " + str(s->dilation) + " must be >= 1");
    }
    // Positions: keys 0..Lk-1 and queries i' = i + offset, up to Lq - 1 + offset.
    const std::int64_t positions = std::max(seq_kv, seq_q + diagonal_offset);
    for (std::int64_t g : s->global) {
      if (g < 0 || g >= positions) {
        throw Error("sparsity: Longformer global position " + str(g) + " is outside [0, " +
                    str(positions) + ") " + sizes_text(seq_q, seq_kv));
      }
    }
    resolved.global.assign(s->global.begin(), s->global.end());
    std::sort(resolved.global.begin(), resolved.global.end());
    resolved.global.erase(std::unique(resolved.global.begin(), resolved.global.end()),
                          resolved.global.end());
    k.kind = SparseKernelParams::Kind::kBand;
    // No |i' - j| reaches the cap, and a dilation above the band allows only distance 0, as
    // band + 1 does: both clamps keep the rule and keep the numbers small.
    const std::int64_t cap = seq_q + seq_kv + std::abs(diagonal_offset);
    k.band = std::min(s->window, cap);
    k.dilation = std::min(s->dilation, k.band + 1);
    k.global = resolved.global.data();
    k.num_global = static_cast<std::int64_t>(resolved.global.size());
    return;
  }
  if (const auto* s = std::get_if<BigBirdSparsity>(&sparsity)) {
    resolved.layout = bigbird_layout(*s, seq_q, seq_kv, num_heads_q);
    k.kind = SparseKernelParams::Kind::kBlock;
    // A block past both sequences is one block either way: clamped, the kernels' block
    // arithmetic (kb * block, (kb + 1) * block) stays far from overflow.
    k.block_q = k.block_k = std::min(s->block, std::max(seq_q, seq_kv));
    k.num_q_blocks = ceil_div(seq_q, s->block);
    k.num_k_blocks = ceil_div(seq_kv, s->block);
    k.layout = resolved.layout.data();
    k.layout_stride[0] = k.num_q_blocks * k.num_k_blocks;
    k.layout_stride[1] = k.num_k_blocks;
    k.layout_stride[2] = 1;
    return;
  }
  const auto& s = std::get<BlockSparsity>(sparsity);
  if (s.block_q < 1 || s.block_k < 1) {
    throw Error("sparsity: block sizes (block_q, block_k) = (" + str(s.block_q) + ", " +
                str(s.block_k) + ") must be >= 1");
  }
  const TensorView& layout = s.layout;
  if (layout.data == nullptr) throw Error("sparsity: block layout data pointer is null");
  if (layout.dtype != DType::kBool && layout.dtype != DType::kU8) {
    throw Error(std::string("sparsity: block layout dtype ") + dtype_name(layout.dtype) +
                " is not supported (expected bool or u8; true = may attend)");
  }
  const std::int64_t nqb = ceil_div(seq_q, s.block_q), nkb = ceil_div(seq_kv, s.block_k);
  const bool heads_ok = layout.sizes[1] == 1 || layout.sizes[1] == num_heads_q;
  if (layout.sizes[0] != 1 || !heads_ok || layout.sizes[2] != nqb || layout.sizes[3] != nkb) {
    throw Error("sparsity: block layout shape " + shape_string(layout.sizes) +
                " does not match (1, 1 or Hq = " + str(num_heads_q) + ", ceil(Lq / block_q) = " +
                str(nqb) + ", ceil(Lk / block_k) = " + str(nkb) + ") for blocks (" +
                str(s.block_q) + ", " + str(s.block_k) + ") " + sizes_text(seq_q, seq_kv));
  }
  k.kind = SparseKernelParams::Kind::kBlock;
  // A block past its sequence is the one block of it either way (as for BigBird above).
  k.block_q = std::min(s.block_q, seq_q);
  k.block_k = std::min(s.block_k, seq_kv);
  k.num_q_blocks = nqb;
  k.num_k_blocks = nkb;
  k.layout = static_cast<const std::uint8_t*>(layout.data);
  k.layout_stride[0] = layout.sizes[1] == 1 ? 0 : layout.strides[1];
  k.layout_stride[1] = layout.strides[2];
  k.layout_stride[2] = layout.strides[3];
}

std::vector<std::uint8_t> sparse_mask(const Sparsity& sparsity, std::int64_t seq_q,
                                      std::int64_t seq_kv, std::int64_t num_heads_q, Align align) {
  // mask: [Hq, Lq, Lk], row-major
  const std::int64_t offset = align == Align::kBottomRight ? seq_kv - seq_q : 0;
  ResolvedSparsity resolved;
  resolve_sparsity(sparsity, seq_q, seq_kv, num_heads_q, offset, resolved);
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(num_heads_q * seq_q * seq_kv));
  std::size_t at = 0;
  for (std::int64_t h = 0; h < num_heads_q; ++h)
    for (std::int64_t i = 0; i < seq_q; ++i)
      for (std::int64_t j = 0; j < seq_kv; ++j)
        mask[at++] = sparse_pair_allowed(resolved.params, offset, h, i, j) ? 1 : 0;
  return mask;
}

double sparse_allowed_pairs(std::int64_t seq_q, std::int64_t seq_kv, std::int64_t num_heads_q,
                            const AttentionParams& params) {
  if (!params.sparsity) return allowed_pairs(seq_q, seq_kv, params);
  const std::int64_t offset = params.align == Align::kBottomRight ? seq_kv - seq_q : 0;
  ResolvedSparsity resolved;
  resolve_sparsity(*params.sparsity, seq_q, seq_kv, num_heads_q, offset, resolved);
  const SparseKernelParams& s = resolved.params;
  const ops::Window window = ops::effective_window(params, seq_q, seq_kv, offset);
  const std::int64_t right = window.right;
  // The causal/window range [lo, hi) of query i, as allowed_pairs() counts it.
  const auto range = [&](std::int64_t i, std::int64_t& lo, std::int64_t& hi) {
    const std::int64_t diag = i + offset;
    lo = window.left < 0 ? 0 : std::max<std::int64_t>(0, diag - window.left);
    hi = right < 0 ? seq_kv : std::min<std::int64_t>(seq_kv, diag + right + 1);
  };
  const auto count_globals = [&](std::int64_t lo, std::int64_t hi) {  // globals in [lo, hi)
    return static_cast<std::int64_t>(std::lower_bound(s.global, s.global + s.num_global, hi) -
                                     std::lower_bound(s.global, s.global + s.num_global, lo));
  };
  double pairs = 0.0;
  if (s.kind == SparseKernelParams::Kind::kBand) {
    for (std::int64_t i = 0; i < seq_q; ++i) {
      std::int64_t lo, hi;
      range(i, lo, hi);
      if (hi <= lo) continue;
      const std::int64_t position = i + offset;
      if (sparse_is_global(s, position)) {
        pairs += static_cast<double>(hi - lo);
        continue;
      }
      // Band keys in [lo, hi) of the position's residue class, then the globals outside them.
      const std::int64_t a = std::max(lo, position - s.band);
      const std::int64_t b = std::min(hi, position + s.band + 1);
      std::int64_t band = 0;
      if (b > a) {
        const std::int64_t first = a + ((position - a) % s.dilation + s.dilation) % s.dilation;
        band = first < b ? (b - 1 - first) / s.dilation + 1 : 0;
      }
      std::int64_t globals = count_globals(lo, hi);
      for (const std::int64_t* g = std::lower_bound(s.global, s.global + s.num_global, a);
           g != s.global + s.num_global && *g < b; ++g) {
        if ((position - *g) % s.dilation == 0) --globals;  // already counted in the band
      }
      pairs += static_cast<double>(band + globals);
    }
    return pairs;
  }
  // Block layout: per layout row, allowed keys below x = prefix[x / bk] + part of block x / bk.
  std::vector<std::int64_t> prefix(static_cast<std::size_t>(s.num_k_blocks + 1));
  const std::int64_t heads = s.layout_stride[0] == 0 ? 1 : num_heads_q;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t qb = 0; qb < s.num_q_blocks; ++qb) {
      const std::uint8_t* row = s.layout + h * s.layout_stride[0] + qb * s.layout_stride[1];
      const auto attended = [&](std::int64_t kb) { return row[kb * s.layout_stride[2]] != 0; };
      for (std::int64_t kb = 0; kb < s.num_k_blocks; ++kb) {
        const std::int64_t size = std::min(s.block_k, seq_kv - kb * s.block_k);
        prefix[kb + 1] = prefix[kb] + (attended(kb) ? size : 0);
      }
      const auto below = [&](std::int64_t x) {
        if (x >= seq_kv) return prefix[s.num_k_blocks];
        const std::int64_t kb = x / s.block_k;
        return prefix[kb] + (attended(kb) ? x - kb * s.block_k : 0);
      };
      for (std::int64_t i = qb * s.block_q; i < std::min(seq_q, (qb + 1) * s.block_q); ++i) {
        std::int64_t lo, hi;
        range(i, lo, hi);
        if (hi > lo) pairs += static_cast<double>(below(hi) - below(lo));
      }
    }
  }
  return pairs * static_cast<double>(num_heads_q / heads) / static_cast<double>(num_heads_q);
}

}  // namespace qkv
