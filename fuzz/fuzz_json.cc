// The strict JSON parser on arbitrary bytes: a value or qkv::Error, in bounded depth, values and
// time (io/json.h).
#include <string_view>

#include "io/json.h"
#include "qkv/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    (void)qkv::io::parse_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const qkv::Error&) {
  }
  return 0;
}
