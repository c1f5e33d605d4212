// The one place qkv touches OpenMP. Kernels call parallel_for; they never carry pragmas.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

namespace qkv {

// Threads parallel_for will use for `requested` (0 = OpenMP's default).
int resolve_num_threads(int requested);

// Sets the process-wide default thread count (OpenMP's, which oneDNN's GEMMs use as well);
// n >= 1. What resolve_num_threads(0) returns afterwards.
void set_default_num_threads(int n);

// Calls body(task, thread) for every task in [0, num_tasks), on up to `num_threads` threads
// (from resolve_num_threads), handing tasks out dynamically. `thread` is in [0, num_threads) and
// indexes per-thread scratch sized before the call. Which thread runs a task must never change
// a result: each task writes its own outputs only. An exception thrown by body is rethrown here.
void parallel_for(std::int64_t num_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int thread)>& body);

// body(begin, end) over the items [0, n), each about `item_elements` elements of work (a
// row's width), in blocks of whole items of about 16 Ki elements, on up to `num_threads`
// threads. For short items: one task per row of a few hundred elements cost more in the loop's
// dynamic scheduling than the row's own work (the bf16 embed's rounding passes: 1.14x).
template <class F>
void parallel_for_blocks(std::int64_t n, std::int64_t item_elements, int num_threads, F body) {
  const std::int64_t block =
      std::max<std::int64_t>(1, (1 << 14) / std::max<std::int64_t>(1, item_elements));
  parallel_for((n + block - 1) / block, num_threads, [&](std::int64_t task, int) {
    body(task * block, std::min(n, (task + 1) * block));
  });
}

}  // namespace qkv
