#include "qkv/layers/kv_cache.h"

#include <algorithm>
#include <array>
#include <string>

#include "core/huge_pages.h"
#include "core/view_copy.h"
#include "qkv/error.h"

namespace qkv {

KvCache::KvCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t head_dim,
                 std::int64_t max_seq, DType dtype)
    : batch_(batch),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      max_seq_(max_seq),
      dtype_(dtype) {
  if (batch <= 0 || num_kv_heads <= 0 || head_dim <= 0 || max_seq < 0) {
    throw Error("KvCache: batch = " + std::to_string(batch) + ", num_kv_heads = " +
                std::to_string(num_kv_heads) + ", head_dim = " + std::to_string(head_dim) +
                " must be > 0 and max_seq = " + std::to_string(max_seq) + " >= 0");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    throw Error(std::string("KvCache: dtype ") + dtype_name(dtype) +
                " (expected f32, bf16 or f16)");
  }
  if (max_seq > 0) reserve(max_seq);
}

void KvCache::reserve(std::int64_t tokens) {
  if (tokens <= capacity_) return;
  // Growing: double (amortised O(1) per token); fixed: exactly max_seq, allocated up front.
  const std::int64_t new_capacity =
      max_seq_ > 0 ? max_seq_ : std::max({tokens, 2 * capacity_, std::int64_t{16}});
  const std::int64_t row = head_dim_ * dtype_size(dtype_);  // bytes per token and kv head
  const std::int64_t runs = batch_ * num_kv_heads_;         // one per (batch entry, kv head)
  for (std::vector<std::byte>* store : {&keys_, &values_}) {
    // On huge pages where the kernel grants them: a decode step streams the whole cache
    // (core/huge_pages.h).
    std::vector<std::byte> grown;
    reserve_on_huge_pages(grown, static_cast<std::size_t>(runs * new_capacity * row));
    grown.resize(static_cast<std::size_t>(runs * new_capacity * row));
    for (std::int64_t run = 0; run < runs; ++run) {
      std::copy_n(store->data() + run * capacity_ * row, size_ * row,
                  grown.data() + run * new_capacity * row);
    }
    store->swap(grown);
  }
  capacity_ = new_capacity;
}

namespace {

// Element strides, in (b, token, kv head, d) order, of a cache store [B, Hkv, capacity,
// head_dim] (each kv head's tokens one run).
std::array<std::int64_t, 4> store_strides(std::int64_t capacity, std::int64_t heads,
                                          std::int64_t head_dim) {
  return {heads * capacity * head_dim, head_dim, capacity * head_dim, 1};
}

}  // namespace

void KvCache::append(const TensorView& k, const TensorView& v) {
  // k, v: [B, Lnew, Hkv, head_dim], f32 or dtype_, any strides
  const std::array<std::int64_t, 4> expected = {batch_, k.sizes[1], num_kv_heads_, head_dim_};
  for (const auto& [name, view] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    const bool dtype_ok = view->dtype == DType::kF32 || view->dtype == dtype_;
    if (!dtype_ok || view->sizes != expected || view->data == nullptr) {
      throw Error(
          std::string("KvCache::append: ") + name + ": shape " + shape_string(view->sizes) + " (" +
          dtype_name(view->dtype) + ") does not match the cache's " + shape_string(expected) +
          " (f32" +
          (dtype_ == DType::kF32 ? std::string() : std::string(" or ") + dtype_name(dtype_)) + ")");
    }
  }
  const std::int64_t seq_new = k.sizes[1];
  if (max_seq_ > 0 && size_ + seq_new > max_seq_) {
    throw Error("KvCache::append: " + std::to_string(size_) + " cached + " +
                std::to_string(seq_new) +
                " new tokens exceed max_seq = " + std::to_string(max_seq_));
  }
  reserve(size_ + seq_new);
  // Tokens [size_, size_ + seq_new) of every (batch entry, kv head) run.
  const std::array<std::int64_t, 4> strides = store_strides(capacity_, num_kv_heads_, head_dim_);
  const std::int64_t first = size_ * strides[1] * dtype_size(dtype_);  // bytes
  for (const auto& [src, store] : {std::pair{&k, &keys_}, std::pair{&v, &values_}}) {
    copy_view(*src, dtype_, store->data() + first, strides);
  }
  size_ += seq_new;
}

void KvCache::truncate(std::int64_t size) {
  if (size < 0 || size > size_) {
    throw Error("KvCache::truncate: size = " + std::to_string(size) + " not in [0, " +
                std::to_string(size_) + "]");
  }
  size_ = size;
}

namespace {
TensorView cache_view(const std::vector<std::byte>& store, DType dtype, std::int64_t batch,
                      std::int64_t size, std::int64_t capacity, std::int64_t heads,
                      std::int64_t head_dim) {
  TensorView view;
  view.data = const_cast<std::byte*>(store.data());
  view.dtype = dtype;
  view.sizes = {batch, size, heads, head_dim};
  view.strides = store_strides(capacity, heads, head_dim);
  return view;
}
}  // namespace

TensorView KvCache::keys() const {
  return cache_view(keys_, dtype_, batch_, size_, capacity_, num_kv_heads_, head_dim_);
}
TensorView KvCache::values() const {
  return cache_view(values_, dtype_, batch_, size_, capacity_, num_kv_heads_, head_dim_);
}

}  // namespace qkv
