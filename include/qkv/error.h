// qkv::Error: the one exception type the library throws. Messages name the bad argument and,
// for shape problems, both shapes involved, e.g.
//   "k: shape (2, 128, 4, 64) does not match v: shape (2, 127, 4, 64) in dim 1 (seq_kv)".
#pragma once

#include <stdexcept>
#include <string>

namespace qkv {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace qkv
