// KvCache: the keys and values a MultiHeadAttention has seen so far, for incremental
// decoding. K and V are each stored as [B, Hkv, capacity, head_dim] (each kv head's tokens one
// run, PyTorch's (B, H, L, D) cache order), and keys() / values() are [B, size, Hkv, head_dim]
// strided views of the cached prefix, which qkv::attention takes as they are: a decode step
// then reads each kv head's keys as one ascending run (against the token-major [B, capacity,
// Hkv, head_dim] store: 1.08-1.16x, except f32 GQA 0.965x; docs/layers.md). They are stored in f32, or in bf16 / f16
// (half the memory, and a decode step reads half the bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "qkv/tensor.h"

namespace qkv {

class KvCache {
 public:
  KvCache() = default;
  // max_seq == 0: grows without bound (capacity doubles, old entries are copied);
  // max_seq > 0: fixed capacity, append() past it throws qkv::Error.
  // dtype: how K and V are stored, DType::kF32, kBF16 or kF16.
  KvCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t head_dim,
          std::int64_t max_seq = 0, DType dtype = DType::kF32);

  std::int64_t batch() const { return batch_; }
  std::int64_t num_kv_heads() const { return num_kv_heads_; }
  std::int64_t head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  std::int64_t size() const { return size_; }  // tokens cached
  std::int64_t capacity() const { return capacity_; }
  std::int64_t max_seq() const { return max_seq_; }
  void clear() { size_ = 0; }  // keeps the memory
  // Drops every token at or past `size` (0 <= size <= size()); e.g. to undo an append.
  void truncate(std::int64_t size);

  // k, v: [B, Lnew, Hkv, head_dim], any strides, f32 or the cache's dtype (f32 values are
  // rounded to it: nearest, ties to even). Appends at position size().
  void append(const TensorView& k, const TensorView& v);

  // [B, size(), Hkv, head_dim] views of what is cached, in dtype() (valid until the next
  // append); strided: element (b, t, h, d) at ((b * Hkv + h) * capacity() + t) * head_dim + d.
  TensorView keys() const;
  TensorView values() const;

 private:
  void reserve(std::int64_t tokens);

  std::int64_t batch_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  std::int64_t size_ = 0, capacity_ = 0, max_seq_ = 0;
  DType dtype_ = DType::kF32;
  std::vector<std::byte> keys_;    // [B, Hkv, capacity, head_dim] of dtype_
  std::vector<std::byte> values_;  // [B, Hkv, capacity, head_dim] of dtype_
};

}  // namespace qkv
