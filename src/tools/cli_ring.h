// The ring options of the command line (qkv attention --ring, qkv ring-bench): MPI setup and
// the whole-sequence <-> shard plumbing of the CLI (docs/distributed.md). Built with MPI only
// (QKV_WITH_MPI); without it --ring is a usage error naming the missing MPI.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "qkv/attention.h"
#include "qkv/error.h"
#include "tools/cli.h"

namespace qkv::cli {

// --ring-layout contiguous|zigzag; the layout enum is in qkv/ring_attention.h, which needs MPI,
// so the choice travels as text until the MPI code takes it. (Inline: builds without MPI parse
// the options too, to say that --ring needs MPI.)
inline constexpr const char* kRingUsage = R"(ring attention (context parallelism over MPI; docs/distributed.md):
  --ring               run under mpirun: every rank reads the inputs, keeps its shard of the
                       sequence and passes K/V around the ring; rank 0 writes the outputs.
                       Takes causal, --align, --window, --key-lengths, --scale, --softcap,
                       --dtype, --kernel, --threads (per rank); not --mask, --bias, --sparse*,
                       --linear or --weights
  --ring-layout L      contiguous (default: rank r holds the r-th P-th of the sequence) or
                       zigzag (2P chunks, rank r holds chunks r and 2P-1-r: balanced causal
                       work; needs Lq == Lk)
  --ring-block ROWS    K/V rows per message (default 0: blocks of about 8 MiB); the ring holds
                       three blocks beside the shards
)";

// The ring's command-line options.
struct RingCliOptions {
  std::string layout = "contiguous";  // --ring-layout
  std::int64_t block_rows = 0;        // --ring-block
};

inline std::string parse_ring_layout(const std::string& text) {
  if (text != "contiguous" && text != "zigzag") {
    throw UsageError("--ring-layout: expected contiguous or zigzag, got '" + text + "'");
  }
  return text;
}

inline std::int64_t parse_ring_block(const std::string& text) {
  const std::int64_t rows = parse_int("--ring-block", text);
  if (rows < 0) throw UsageError("--ring-block: expected ROWS >= 0 (0: about 8 MiB), got " + text);
  return rows;
}

// Attention of whole inputs on every rank of MPI_COMM_WORLD (initialising MPI if needed):
// each rank keeps its shard of q, k and v (every rank has read the same files), the ring
// computes, and rank 0 gathers out and lse into the whole views. Returns the rank (only rank 0
// holds the result and writes files). q, k, v: [B, L, H, D] views; out: [B, Lq, Hq, Dv]; lse:
// [B, Hq, Lq, 1] or empty.
int ring_attention_cli(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOutputs& outputs, const AttentionParams& params,
                       const RingCliOptions& options);

// qkv ring-bench (its --help).
int run_ring_bench(std::vector<std::string> args);

// An error every rank raised alike: main prints it once, on rank 0, and exits 2.
class RingCollectiveError : public Error {
 public:
  using Error::Error;
};
// Whether --ring or ring-bench started MPI (and it is not finished).
bool mpi_active();
// main's error exit while MPI is active: a collective error is printed by rank 0 and returns 2;
// an error of this rank alone is printed and aborts the job (the other ranks would wait for
// this one forever).
int ring_exit_on_error(const std::exception& error);

}  // namespace qkv::cli
