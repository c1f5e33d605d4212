// .npy reader on arbitrary bytes: it returns an array or throws qkv::Error, nothing else; what
// it returns holds exactly the bytes its shape and dtype say.
#include <cstdlib>

#include "fuzz_input.h"
#include "io/npy.h"
#include "qkv/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const qkv::fuzz::MemoryFile file(data, size);
  try {
    const qkv::io::NpyArray array = qkv::io::read_npy(file.path(), "fuzz");
    if (array.nbytes() > size) std::abort();  // data never comes from nowhere
  } catch (const qkv::Error&) {
  }
  return 0;
}
