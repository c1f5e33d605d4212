// qkv: command-line entry point. Dispatches to one command; turns every error into
// "qkv: error: ..." on stderr and exit status 2 (DESIGN.md section 4).
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "tools/cli.h"
#include "tools/cli_ring.h"

namespace {

constexpr const char* kUsage =
    "usage: qkv <command> [options]\n"
    "\n"
    "commands:\n"
    "  attention   scaled dot-product attention on .npy files\n"
    "  attention-backward\n"
    "              its gradients dq, dk, dv (and dbias) for a given dL/d(out)\n"
    "  demo        the main job: standard vs chunked vs flash attention, side by side\n"
    "  bench       GFLOP/s of the attention kernels against this machine's measured peak\n"
    "  embed       sentence embeddings with a BERT-family model (e.g. all-MiniLM-L6-v2)\n"
    "  train-demo  trains a small transformer (sort or copy digits) with qkv's backward\n"
    "  ring-bench  ring attention over MPI ranks: compute, transfers and their overlap\n"
    "              (mpirun -np P qkv ring-bench)\n"
    "\n"
    "Run 'qkv <command> --help' for a command's options.\n";

int dispatch(const std::string& command, std::vector<std::string> args) {
  if (command == "attention") return qkv::cli::run_attention(std::move(args));
  if (command == "attention-backward") return qkv::cli::run_attention_backward(std::move(args));
  if (command == "demo") return qkv::cli::run_demo(std::move(args));
  if (command == "bench") return qkv::cli::run_bench(std::move(args));
  if (command == "embed") return qkv::cli::run_embed(std::move(args));
  if (command == "train-demo") return qkv::cli::run_train_demo(std::move(args));
  if (command == "ring-bench") {
#if QKV_WITH_MPI
    return qkv::cli::run_ring_bench(std::move(args));
#else
    throw qkv::cli::UsageError("ring-bench: this qkv was built without MPI (install "
                               "libopenmpi-dev and openmpi-bin, then rebuild)");
#endif
  }
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  throw qkv::cli::UsageError("unknown command '" + command + "' (try 'qkv --help')");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs("qkv: error: no command given (try 'qkv --help')\n", stderr);
    return 2;
  }
  try {
    return dispatch(argv[1], std::vector<std::string>(argv + 2, argv + argc));
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "qkv: error: out of memory\n");
  } catch (const std::exception& e) {
#if QKV_WITH_MPI
    if (qkv::cli::mpi_active()) return qkv::cli::ring_exit_on_error(e);
#endif
    std::fprintf(stderr, "qkv: error: %s\n", e.what());
  }
  return 2;
}
