// core/parallel.h's parallel_for_blocks: every item in exactly one block, blocks of whole items
// of about 16 Ki elements, n == 0 calls nothing, and an exception in a block reaches the caller.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/parallel.h"

namespace qkv::testing {
namespace {

TEST(ParallelForBlocks, EveryItemOnceInBlocksOfWholeItems) {
  for (const int threads : {1, 2, 3}) {
    for (const std::int64_t n : {1, 2, 41, 42, 43, 1000, 4097}) {
      for (const std::int64_t item_elements : {0, 1, 384, 385, 16384, 100000}) {
        SCOPED_TRACE(::testing::Message() << "threads " << threads << ", n " << n
                                          << ", item_elements " << item_elements);
        const std::int64_t block =
            item_elements <= 0 ? 16384 : std::max<std::int64_t>(1, 16384 / item_elements);
        std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
        std::atomic<int> bad_blocks{0};
        parallel_for_blocks(n, item_elements, threads, [&](std::int64_t begin, std::int64_t end) {
          // A block starts on a multiple of the block length and is whole unless it is the last.
          if (begin % block != 0 || end <= begin || end - begin > block ||
              (end - begin < block && end != n)) {
            ++bad_blocks;
          }
          for (std::int64_t i = begin; i < end; ++i) ++seen[static_cast<std::size_t>(i)];
        });
        EXPECT_EQ(bad_blocks.load(), 0);
        for (std::int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(seen[static_cast<std::size_t>(i)].load(), 1) << "item " << i;
        }
      }
    }
  }
}

TEST(ParallelForBlocks, NothingToDoCallsNothing) {
  int calls = 0;
  parallel_for_blocks(0, 384, 2, [&](std::int64_t, std::int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ParallelForBlocks, AnExceptionInABlockReachesTheCaller) {
  EXPECT_THROW(parallel_for_blocks(1000, 384, 2,
                                   [](std::int64_t begin, std::int64_t end) {
                                     if (begin <= 500 && 500 < end) throw std::runtime_error("x");
                                   }),
               std::runtime_error);
}

}  // namespace
}  // namespace qkv::testing
