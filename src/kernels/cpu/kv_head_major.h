// K and V copied into head-major order ([B, Hkv, Lk, D] and [B, Hkv, Lk, Dv]) for the flash
// walk. In BSHD one key's rows of all kv heads lie side by side, so a task's K/V rows (one head)
// lie Hkv * D elements apart: the hardware's stream prefetchers, which follow ascending lines
// within a page, never fetch them, and every line waits on a software prefetch. Where each
// row is read by many tasks, one copy in head-major order costs less than those waits
// (docs/kernels.md, "A head-major copy of K and V").
#pragma once

#include <cstdint>

#include "core/aligned_buffer.h"
#include "kernels/kernel_params.h"

namespace qkv {

struct HeadMajorKv {
  AlignedBuffer buffer;          // the copied K, then V (p.dtype), on huge pages where granted
  AttentionKernelParams params;  // p with k, v and their strides pointing at the copy
};

// Copies p's K and V (unit stride along D and Dv) in source order on p.num_threads threads.
HeadMajorKv copy_kv_head_major(const AttentionKernelParams& p);

// Tests: the flash kernel takes the copy wherever its walk allows one (flash_forward.cc,
// CopiesKvHeadMajor), not only where it pays; and the copies made since the process started.
void force_kv_head_major(bool forced);
bool kv_head_major_forced();
std::int64_t kv_head_major_copies();

}  // namespace qkv
