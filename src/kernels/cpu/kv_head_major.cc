#include "kernels/cpu/kv_head_major.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/huge_pages.h"
#include "core/parallel.h"
#include "core/view_copy.h"

namespace qkv {

namespace {

// Keys per copy task: a few hundred rows of every head, read in their stored order.
constexpr std::int64_t kCopyKeys = 256;

std::atomic<bool> g_forced{false};
std::atomic<std::int64_t> g_copies{0};

// One operand's rows [j0, j1) of batch entry b, every kv head, in source order (key, then head:
// the reads run ascending), each head's rows landing contiguously in dst's [b, h] slab
// (copy_view: a memcpy per row).
void CopyRows(const AttentionKernelParams& p, const void* src, const std::int64_t* stride,
              std::int64_t dim, char* dst, std::int64_t b, std::int64_t j0, std::int64_t j1) {
  const std::int64_t bytes = dtype_size(p.dtype);
  const TensorView rows{const_cast<void*>(element_at(src, p.dtype, b * stride[0] + j0 * stride[1])),
                        p.dtype,
                        {1, j1 - j0, p.num_heads_kv, dim},
                        {0, stride[1], stride[2], stride[3]}};
  copy_view(rows, p.dtype, dst + (b * p.num_heads_kv * p.seq_kv + j0) * dim * bytes,
            {0, dim, p.seq_kv * dim, 1});
}

void HeadMajorStrides(const AttentionKernelParams& p, std::int64_t dim, std::int64_t* stride) {
  stride[0] = p.num_heads_kv * p.seq_kv * dim;
  stride[1] = dim;
  stride[2] = p.seq_kv * dim;
  stride[3] = 1;
}

}  // namespace

HeadMajorKv copy_kv_head_major(const AttentionKernelParams& p) {
  const std::int64_t bytes = dtype_size(p.dtype);
  const std::int64_t k_elements = p.batch * p.num_heads_kv * p.seq_kv * p.head_dim;
  const std::int64_t v_elements = p.batch * p.num_heads_kv * p.seq_kv * p.head_dim_v;
  HeadMajorKv kv{AlignedBuffer(static_cast<std::size_t>(bytes * (k_elements + v_elements))), p};
  advise_huge_pages(kv.buffer.as<void>(), kv.buffer.bytes());
  char* k = kv.buffer.as<char>();
  char* v = k + bytes * k_elements;
  const std::int64_t chunks = (p.seq_kv + kCopyKeys - 1) / kCopyKeys;
  const int threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, p.batch * chunks));
  parallel_for(p.batch * chunks, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / chunks;
    const std::int64_t j0 = task % chunks * kCopyKeys;
    const std::int64_t j1 = std::min(p.seq_kv, j0 + kCopyKeys);
    CopyRows(p, p.k, p.k_stride, p.head_dim, k, b, j0, j1);
    CopyRows(p, p.v, p.v_stride, p.head_dim_v, v, b, j0, j1);
  });
  kv.params.k = k;
  kv.params.v = v;
  HeadMajorStrides(p, p.head_dim, kv.params.k_stride);
  HeadMajorStrides(p, p.head_dim_v, kv.params.v_stride);
  g_copies.fetch_add(1, std::memory_order_relaxed);
  return kv;
}

void force_kv_head_major(bool forced) { g_forced.store(forced, std::memory_order_relaxed); }

bool kv_head_major_forced() { return g_forced.load(std::memory_order_relaxed); }

std::int64_t kv_head_major_copies() { return g_copies.load(std::memory_order_relaxed); }

}  // namespace qkv
