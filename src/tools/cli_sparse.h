// The sparsity options shared by `qkv attention` and `qkv bench` (docs/sparse.md):
//
//   --sparse longformer:w=W[,dilation=D][,global=P1,P2,...]
//   --sparse bigbird[:block=B][,random=R][,global=G][,seed=S]
//   --sparse-layout L.npy --sparse-block BQ,BK     L: bool/uint8 (nqb, nkb) or (Hq, nqb, nkb)
//
// Commands call parse_sparse_option() from their option loop, check_sparse_options() after it,
// and make_sparsity() once the sizes are known.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/npy.h"
#include "qkv/sparse.h"
#include "tools/cli.h"

namespace qkv::cli {

// Help text for the options above, for the commands' --help.
extern const char* const kSparseHelp;

struct SparseCliOptions {
  std::string spec;                // --sparse text, as given
  std::string layout_path;         // --sparse-layout
  std::string block_text;          // --sparse-block, as given
  std::optional<Sparsity> parsed;  // from --sparse (global positions point into `global`)
  std::vector<std::int64_t> global;
  std::int64_t block_q = 0, block_k = 0;  // from --sparse-block

  bool given() const { return !spec.empty() || !layout_path.empty(); }
};

// If `name` is --sparse, --sparse-layout or --sparse-block: reads and parses its value (UsageError
// naming the option on bad syntax or ranges) and returns true; otherwise returns false.
bool parse_sparse_option(const std::string& name, Args& args, SparseCliOptions& options);

// After all options are read: --sparse excludes --sparse-layout, which needs --sparse-block.
void check_sparse_options(const SparseCliOptions& options);

// The Sparsity for qkv::AttentionParams, or nullopt without sparsity options. Reads the layout
// file into `layout` (kept alive by the caller) and checks its dtype and shape against
// (ceil(Lq / BQ), ceil(Lk / BK)) with an error naming both; `sources` says where Lq, Lk and Hq
// came from.
std::optional<Sparsity> make_sparsity(SparseCliOptions& options, io::NpyArray& layout,
                                      std::int64_t seq_q, std::int64_t seq_kv,
                                      std::int64_t num_heads_q, const std::string& sources);

// The option a library "sparsity:" error is about: "--sparse SPEC" or "--sparse-layout PATH".
std::string sparse_option_text(const SparseCliOptions& options);

}  // namespace qkv::cli
