// Transparent huge pages for large arrays that are read in long streams (K/V caches, weights,
// benchmark operands), as numpy does for its arrays of 4 MiB and more.
//
// Why: a decode step streams its whole K/V cache through the cores once. On 4 KiB pages every
// 4 KiB of it costs a TLB miss, and under a hypervisor a two-level page walk. Intel AMX Xeon VM
// (model 167), 2 threads, medians of 5 alternating runs: a streaming read 1.14x faster on huge
// pages, a GQA decode step (Lq 1, Lk 32768, Hq 32, Hkv 8, D 128) 1.08x in bf16 and 1.10x in f32
// (docs/kernels.md, "K/V on huge pages"). The kernel acts on the advice under its
// transparent_hugepage modes "madvise" and "always", not under "never" (the system's switch).
#pragma once

#include <cstddef>
#include <vector>

namespace qkv {

// Arrays below this size are left alone (numpy's threshold).
constexpr std::size_t kHugePageAdviceBytes = std::size_t{4} << 20;

// Asks the kernel (madvise MADV_HUGEPAGE) to back the whole 2 MiB pages inside
// [data, data + bytes) with huge pages. Call it before the memory is first written: pages
// already faulted in stay 4 KiB. Returns true where the advice was taken; false for ranges
// under kHugePageAdviceBytes, off Linux, or where the kernel has no transparent huge pages.
// Never fails otherwise: it is advice.
bool advise_huge_pages(void* data, std::size_t bytes);

// v.reserve(count) with the reserved memory advised before anything is written to it; the
// caller then fills v (resize, assign, push_back) without reallocating.
template <typename T>
void reserve_on_huge_pages(std::vector<T>& v, std::size_t count) {
  v.reserve(count);
  advise_huge_pages(v.data(), v.capacity() * sizeof(T));
}

}  // namespace qkv
