#include "qkv/layers/kv_cache.h"

#include <algorithm>
#include <string>

#include "qkv/error.h"

namespace qkv {

KvCache::KvCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t head_dim,
                 std::int64_t max_seq)
    : batch_(batch), num_kv_heads_(num_kv_heads), head_dim_(head_dim), max_seq_(max_seq) {
  if (batch <= 0 || num_kv_heads <= 0 || head_dim <= 0 || max_seq < 0) {
    throw Error("KvCache: batch = " + std::to_string(batch) + ", num_kv_heads = " +
                std::to_string(num_kv_heads) + ", head_dim = " + std::to_string(head_dim) +
                " must be > 0 and max_seq = " + std::to_string(max_seq) + " >= 0");
  }
  if (max_seq > 0) reserve(max_seq);
}

void KvCache::reserve(std::int64_t tokens) {
  if (tokens <= capacity_) return;
  // Growing: double (amortised O(1) per token); fixed: exactly max_seq, allocated up front.
  const std::int64_t new_capacity =
      max_seq_ > 0 ? max_seq_ : std::max({tokens, 2 * capacity_, std::int64_t{16}});
  const std::int64_t row = num_kv_heads_ * head_dim_;  // floats per token
  for (std::vector<float>* store : {&keys_, &values_}) {
    std::vector<float> grown(static_cast<std::size_t>(batch_ * new_capacity * row));
    for (std::int64_t b = 0; b < batch_; ++b) {
      std::copy_n(store->data() + b * capacity_ * row, size_ * row,
                  grown.data() + b * new_capacity * row);
    }
    store->swap(grown);
  }
  capacity_ = new_capacity;
}

void KvCache::append(const TensorView& k, const TensorView& v) {
  // k, v: [B, Lnew, Hkv, head_dim] f32, any strides
  const std::array<std::int64_t, 4> expected = {batch_, k.sizes[1], num_kv_heads_, head_dim_};
  for (const auto& [name, view] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    if (view->dtype != DType::kF32 || view->sizes != expected || view->data == nullptr) {
      throw Error(std::string("KvCache::append: ") + name + ": shape " + shape_string(view->sizes) +
                  " (" + dtype_name(view->dtype) + ") does not match the cache's " +
                  shape_string(expected) + " (f32)");
    }
  }
  const std::int64_t seq_new = k.sizes[1];
  if (max_seq_ > 0 && size_ + seq_new > max_seq_) {
    throw Error("KvCache::append: " + std::to_string(size_) + " cached + " +
                std::to_string(seq_new) +
                " new tokens exceed max_seq = " + std::to_string(max_seq_));
  }
  reserve(size_ + seq_new);
  const std::int64_t row = num_kv_heads_ * head_dim_;
  for (const auto& [src, store] : {std::pair{&k, &keys_}, std::pair{&v, &values_}}) {
    const float* data = static_cast<const float*>(src->data);
    for (std::int64_t b = 0; b < batch_; ++b) {
      for (std::int64_t t = 0; t < seq_new; ++t) {
        float* dst = store->data() + (b * capacity_ + size_ + t) * row;
        for (std::int64_t h = 0; h < num_kv_heads_; ++h) {
          for (std::int64_t d = 0; d < head_dim_; ++d) {
            dst[h * head_dim_ + d] = data[src->offset(b, t, h, d)];
          }
        }
      }
    }
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
TensorView cache_view(const std::vector<float>& store, std::int64_t batch, std::int64_t size,
                      std::int64_t capacity, std::int64_t heads, std::int64_t head_dim) {
  TensorView view;
  view.data = const_cast<float*>(store.data());
  view.dtype = DType::kF32;
  view.sizes = {batch, size, heads, head_dim};
  view.strides = {capacity * heads * head_dim, heads * head_dim, head_dim, 1};
  return view;
}
}  // namespace

TensorView KvCache::keys() const {
  return cache_view(keys_, batch_, size_, capacity_, num_kv_heads_, head_dim_);
}
TensorView KvCache::values() const {
  return cache_view(values_, batch_, size_, capacity_, num_kv_heads_, head_dim_);
}

}  // namespace qkv
