#include "core/parallel.h"

#include <omp.h>

#include <exception>
#include <mutex>

namespace qkv {

int resolve_num_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

void set_default_num_threads(int n) { omp_set_num_threads(n); }

void parallel_for(std::int64_t num_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int thread)>& body) {
  if (num_tasks <= 0) return;
  if (num_threads <= 1 || num_tasks == 1) {
    for (std::int64_t task = 0; task < num_tasks; ++task) body(task, 0);
    return;
  }
  // Exceptions must not cross the OpenMP region boundary (that would terminate): keep the
  // first one and rethrow it after the region.
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (std::int64_t task = 0; task < num_tasks; ++task) {
    try {
      body(task, omp_get_thread_num());
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace qkv
