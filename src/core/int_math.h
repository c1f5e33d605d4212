// Integer helpers for sizes that come from users: no intermediate overflows, whatever int64 the
// caller passed (issue 18 found (a + b - 1) / b overflowing into wrong block counts).
#pragma once

#include <cstdint>

namespace qkv {

// ceil(a / b) for a >= 0 and b >= 1, exact for every such int64 pair.
constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0); }

}  // namespace qkv
