// Shared pieces of the qkv command-line tool: the command table, usage errors and a small
// argument cursor. Every command lives in its own cmd_*.cc and registers here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace qkv::cli {

// Bad command-line usage; main() prints "qkv: error: <message>" and exits 2, like qkv::Error.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message) : std::runtime_error(message) {}
};

// Walks argv of one command: `--name value` options and flags.
class Args {
 public:
  explicit Args(std::vector<std::string> args) : args_(std::move(args)) {}
  bool done() const { return pos_ >= args_.size(); }
  const std::string& peek() const { return args_[pos_]; }
  std::string next() { return args_[pos_++]; }
  // The value after option `name`; UsageError if it is missing.
  std::string value(const std::string& name);

 private:
  std::vector<std::string> args_;
  std::size_t pos_ = 0;
};

// Strict parsers: the whole string must be a number; UsageError naming `option` otherwise.
std::int64_t parse_int(const std::string& option, const std::string& text);
double parse_double(const std::string& option, const std::string& text);
// "1,2,3" -> {1, 2, 3}.
std::vector<std::int64_t> parse_int_list(const std::string& option, const std::string& text);
// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
std::vector<std::string> split_commas(const std::string& text);

// --layout of attention and bench: how the arrays are stored, (B, L, H, D) or (B, H, L, D).
enum class Layout { kBSHD, kBHSD };
// "bshd" or "bhsd"; UsageError naming --layout otherwise.
Layout parse_layout(const std::string& text);

// Commands. Each returns the process exit status; --help prints usage to stdout and returns 0.
int run_attention(std::vector<std::string> args);
int run_attention_backward(std::vector<std::string> args);
int run_demo(std::vector<std::string> args);
int run_bench(std::vector<std::string> args);
int run_embed(std::vector<std::string> args);
int run_train_demo(std::vector<std::string> args);

}  // namespace qkv::cli
