// advise_huge_pages: the advice reaches the kernel (the mapping's VmFlags carry "hg" in
// /proc/self/smaps) where the kernel has transparent huge pages, and is never given for small
// ranges. Whether the pages then are huge is the kernel's choice (memory fragmentation), so the
// tests check the advice, not the page size.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/huge_pages.h"
#include "qkv/layers/kv_cache.h"

namespace qkv {
namespace {

// The kernel has transparent huge pages (then madvise(MADV_HUGEPAGE) succeeds, whatever the
// mode: under "never" the advice is kept and not acted on).
bool kernel_has_thp() {
  return std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled");
}

#define SKIP_WITHOUT_THP_AND_SMAPS()                                                      \
  if (!kernel_has_thp() || !std::filesystem::exists("/proc/self/smaps")) {                \
    GTEST_SKIP() << "no /sys/kernel/mm/transparent_hugepage or /proc/self/smaps: cannot " \
                    "tell whether the advice should be taken";                            \
  }

// The VmFlags line of the /proc/self/smaps mapping that holds `address` (nullopt: none found).
std::optional<std::string> vm_flags_at(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return std::nullopt;
}

bool advised_at(const void* address) {
  const std::optional<std::string> flags = vm_flags_at(address);
  return flags && flags->find(" hg") != std::string::npos;
}

// An address inside the 2 MiB-aligned interior of [data, data + bytes).
const void* interior(const void* data, std::size_t bytes) {
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t lo = (begin + kHuge - 1) / kHuge * kHuge;
  EXPECT_LT(lo + kHuge, begin + bytes);
  return reinterpret_cast<const void*>(lo);
}

TEST(HugePages, LargeVectorIsAdvised) {
  SKIP_WITHOUT_THP_AND_SMAPS();
  std::vector<float> values;
  const std::size_t count = std::size_t{16} << 20;  // 64 MiB
  reserve_on_huge_pages(values, count);
  ASSERT_GE(values.capacity(), count);
  const void* inner = interior(values.data(), count * sizeof(float));
  EXPECT_TRUE(advised_at(inner));
  values.resize(count, 1.0f);  // filling does not reallocate: the advice stays with the data
  EXPECT_TRUE(advised_at(interior(values.data(), count * sizeof(float))));
  // The control: a plain vector of the same size carries no advice (its own mapping: larger
  // than glibc's largest mmap threshold, 32 MiB).
  const std::vector<float> plain(count, 1.0f);
  EXPECT_FALSE(advised_at(interior(plain.data(), count * sizeof(float))));
}

TEST(HugePages, SmallAndNullRangesAreNotAdvised) {
  std::vector<std::byte> small(kHugePageAdviceBytes - 1);
  EXPECT_FALSE(advise_huge_pages(small.data(), small.size()));
  EXPECT_FALSE(advise_huge_pages(nullptr, std::size_t{64} << 20));
  EXPECT_FALSE(advise_huge_pages(small.data(), 0));
}

TEST(HugePages, LargeRangeReturnsWhetherTaken) {
  // Without THP the call returns false; with it, true (and the flag shows in smaps, above).
  std::vector<std::byte> large;
  large.reserve(std::size_t{8} << 20);
  EXPECT_EQ(advise_huge_pages(large.data(), large.capacity()), kernel_has_thp());
}

TEST(HugePages, KvCacheStoresAreAdvised) {
  SKIP_WITHOUT_THP_AND_SMAPS();
  // [1, 4096, 8, 128] f32: 16 MiB each for K and V.
  KvCache cache(1, 8, 128, 4096, DType::kF32);
  std::vector<float> rows(8 * 128, 0.5f);
  const TensorView k = TensorView::contiguous(rows.data(), DType::kF32, {1, 1, 8, 128});
  cache.append(k, k);
  const std::size_t bytes = std::size_t{4096} * 8 * 128 * 4;
  EXPECT_TRUE(advised_at(interior(cache.keys().data, bytes)));
  EXPECT_TRUE(advised_at(interior(cache.values().data, bytes)));
}

}  // namespace
}  // namespace qkv
