// The command line's spec parsers on arbitrary text: --sparse (Longformer, BigBird), --linear,
// and the integer lists of --window / --sparse-block. Each returns a value or throws
// UsageError / qkv::Error; a parsed sparsity is then resolved against a few sequence lengths
// through the library (sparse_mask), where every number must still be in range.
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/sparse.h"
#include "tools/cli.h"
#include "tools/cli_linear.h"
#include "tools/cli_sparse.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace qkv;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)cli::parse_int_list("--window", text);
  } catch (const cli::UsageError&) {
  }
  try {
    (void)cli::parse_linear_spec("--linear", text);
  } catch (const cli::UsageError&) {
  } catch (const Error&) {
  }
  for (const char* option : {"--sparse", "--sparse-block"}) {
    cli::SparseCliOptions options;
    try {
      cli::Args args({text});
      if (!cli::parse_sparse_option(option, args, options)) continue;
      if (!options.parsed) continue;
      // Small sizes keep sparse_mask's Lq x Lk output small.
      for (const std::int64_t seq : {1, 7, 64}) {
        io::NpyArray unused;
        const auto sparsity = cli::make_sparsity(options, unused, seq, seq + 3, 2, "");
        if (sparsity) (void)sparse_mask(*sparsity, seq, seq + 3, 2, Align::kBottomRight);
      }
    } catch (const cli::UsageError&) {
    } catch (const Error&) {
    }
  }
  return 0;
}
