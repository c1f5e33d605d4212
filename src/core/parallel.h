// The one place qkv touches OpenMP. Kernels call parallel_for; they never carry pragmas.
#pragma once

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

}  // namespace qkv
