// Shared test helper: run a body once per compiled Highway target this CPU supports.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "hwy/targets.h"

namespace qkv::testing {

// Runs body(target) once per compiled Highway target this CPU supports, with that target
// forced; `target_name` is the kernel family's dispatch (attention_cpu_target_name, ...), which
// must report the forced target. The best target is restored afterwards.
template <class Body>
void for_each_target(const char* (*target_name)(), Body body) {
  const std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    EXPECT_STREQ(target_name(), hwy::TargetName(target));
    body(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace qkv::testing
