// safetensors reader on arbitrary bytes: a file whose every tensor lies inside the data
// section, or qkv::Error. Every tensor it accepts is read through read_f32 where the dtype
// converts, and through view_f32, which must give the same bytes (in place or converted).
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_input.h"
#include "io/safetensors.h"
#include "qkv/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const qkv::fuzz::MemoryFile file(data, size);
  try {
    const qkv::io::SafetensorsFile st(file.path());
    for (const auto& [name, tensor] : st.tensors()) {
      if (tensor.bytes > size) std::abort();
      try {
        const std::vector<float> copy = st.read_f32(name, tensor.shape);
        std::vector<float> storage;
        const std::span<const float> view = st.view_f32(name, tensor.shape, storage);
        if (view.size() != copy.size() ||
            (!copy.empty() && std::memcmp(view.data(), copy.data(), copy.size() * 4) != 0)) {
          std::abort();
        }
      } catch (const qkv::Error&) {  // a dtype that does not convert to f32
      }
    }
  } catch (const qkv::Error&) {
  }
  return 0;
}
