// qkv embed: sentence embeddings from a BERT-family Hugging Face folder (DESIGN.md section 4).
//
//   texts (--text ..., or --input FILE one per line) -> models::SentenceEmbedder -> E.npy
//   E.npy: [N, dim] float32, row i = text i (input order)
//
// Texts are embedded in windows of kWindowBatches batches: each window is tokenised, sorted by
// length, run, and its rows appended to the output file (io::NpyRowWriter), so memory stays
// flat however many texts there are (only the texts themselves are held). The output appears
// only once every text is done.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "io/npy.h"
#include "qkv/models/sentence_embedder.h"
#include "qkv/error.h"
#include "tools/cli.h"

namespace qkv::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: qkv embed --model DIR (--text T [--text T ...] | --input FILE) --out E.npy [options]

Sentence embeddings with a BERT-family model stored as a Hugging Face / sentence-transformers
folder: WordPiece tokens -> encoder -> pooling (1_Pooling/config.json: mean, cls or max over
the real tokens) -> L2 normalisation when modules.json lists a Normalize module. Writes
(N, dim) float32, one row per text in input order. Full docs: docs/cli-embed.md.

  --model DIR        folder with config.json, model.safetensors, vocab.txt (and optionally
                     tokenizer_config.json, sentence_bert_config.json, 1_Pooling/, modules.json)
  --text T           a text to embed; repeat for several
  --input FILE       texts, one per line (UTF-8; a trailing '\r' is dropped; an empty line is
                     an empty text); '-' reads standard input
  --out E.npy        writes the embeddings (N, dim) float32
  --max-length N     tokens per text, [CLS] and [SEP] included; longer texts are truncated
                     (default: sentence_bert_config.json's max_seq_length, else the model's)
  --batch-size N     texts per forward pass (default 32); texts are sorted by length first
                     so that a batch pads only to its own longest text
  --normalize        L2-normalise the embeddings (default: as modules.json says)
  --no-normalize     do not normalise
  --dtype T          f32 (default) or bf16: the type of the encoder's matrix products, the
                     attention's included (weights rounded to bf16 once, activations before
                     each product; AMX where the CPU has it). Embeddings, LayerNorm, softmax,
                     GELU, pooling and every accumulation stay f32
  --threads N        worker threads; 0 = all cores (default)
  --quiet            no progress output on stderr
  --help             this text

Progress goes to stderr for more than 256 texts in more than 8 batches. Errors print one line
'qkv: error: ...' and exit with status 2; no output file is written unless every text was
embedded.
)";

// Texts per window: tokenised and sorted together, then appended to the output.
constexpr std::int64_t kWindowBatches = 64;
// Progress is shown for inputs of more than this many batches and texts.
constexpr std::int64_t kProgressBatches = 8;
constexpr std::int64_t kProgressTexts = 256;

struct Options {
  std::string model_dir, input_path, out_path;
  std::vector<std::string> texts;
  bool from_input = false;
  models::EmbedderOptions embedder;
  int threads = 0;
  bool quiet = false;
};

Options parse_options(std::vector<std::string> argv) {
  Options o;
  Args args(std::move(argv));
  std::set<std::string> seen;
  const auto value_of = [&](const std::string& name) {
    std::string value = args.value(name);
    if (value.rfind("--", 0) == 0 && name != "--text") {
      throw UsageError(name + ": missing value (got " + value + ")");
    }
    if (value.empty() && name != "--text") throw UsageError(name + ": empty value");
    return value;
  };
  const auto bounded = [&](const std::string& name, std::int64_t lo, std::int64_t hi) {
    const std::int64_t value = parse_int(name, value_of(name));
    if (value < lo || value > hi) {
      throw UsageError(name + ": expected " + std::to_string(lo) + " to " + std::to_string(hi) +
                       ", got " + std::to_string(value));
    }
    return value;
  };
  while (!args.done()) {
    const std::string name = args.next();
    if (name != "--text" && name.rfind("--", 0) == 0 && !seen.insert(name).second) {
      throw UsageError(name + ": given more than once");
    }
    if (name == "--model") {
      o.model_dir = value_of(name);
    } else if (name == "--text") {
      o.texts.push_back(value_of(name));
    } else if (name == "--input") {
      o.input_path = value_of(name);
      o.from_input = true;
    } else if (name == "--out") {
      o.out_path = value_of(name);
    } else if (name == "--max-length") {
      o.embedder.max_length = bounded(name, 2, 1 << 20);
    } else if (name == "--batch-size") {
      o.embedder.batch_size = bounded(name, 1, 1 << 16);
    } else if (name == "--normalize" || name == "--no-normalize") {
      if (o.embedder.normalize) throw UsageError("--normalize and --no-normalize exclude each other");
      o.embedder.normalize = name == "--normalize";
    } else if (name == "--dtype") {
      const std::string value = value_of(name);
      if (value == "f32") {
        o.embedder.matmul_dtype = DType::kF32;
      } else if (value == "bf16") {
        o.embedder.matmul_dtype = DType::kBF16;
      } else {
        throw UsageError("--dtype: expected f32 or bf16, got '" + value + "'");
      }
    } else if (name == "--threads") {
      o.threads = static_cast<int>(bounded(name, 0, 4096));
    } else if (name == "--quiet") {
      o.quiet = true;
    } else {
      throw UsageError("unknown option '" + name + "' (try 'qkv embed --help')");
    }
  }
  if (o.model_dir.empty()) throw UsageError("--model is required");
  if (o.out_path.empty()) throw UsageError("--out is required");
  if (o.from_input && !o.texts.empty()) throw UsageError("give --text or --input, not both");
  if (!o.from_input && o.texts.empty()) throw UsageError("no texts: give --text T or --input FILE");
  return o;
}

// One text per line; "\r\n" or "\n" line ends, the last line's end optional.
std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) throw Error("--input " + path + ": cannot open");
    in = &file;
  }
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(*in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
  }
  if (in->bad()) throw Error("--input " + path + ": read failed");
  return lines;
}

// "[#####.....] 320/1000 texts, 52.1 texts/s" redrawn in place on a terminal; on a pipe or file
// one line per ~10%.
class Progress {
 public:
  Progress(std::int64_t total, bool enabled)
      : total_(total), enabled_(enabled), tty_(::isatty(STDERR_FILENO) != 0),
        start_(std::chrono::steady_clock::now()) {}

  void update(std::int64_t done) {
    if (!enabled_) return;
    const double seconds = elapsed();
    const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
    const int width = 30;
    const int filled = static_cast<int>(width * done / std::max<std::int64_t>(total_, 1));
    const std::int64_t decile = 10 * done / std::max<std::int64_t>(total_, 1);
    if (!tty_ && decile == last_decile_ && done != total_) return;
    last_decile_ = decile;
    std::fprintf(stderr, "%sqkv embed: [%s%s] %lld/%lld texts, %.1f texts/s%s", tty_ ? "\r" : "",
                 std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), rate,
                 tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_ && tty_) std::fputc('\n', stderr);
  }

 private:
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  std::int64_t total_;
  bool enabled_;
  bool tty_;
  std::int64_t last_decile_ = -1;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

int run_embed(std::vector<std::string> args) {
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Options o = parse_options(std::move(args));
  if (o.from_input) o.texts = read_lines(o.input_path);
  // One OpenMP default for the process: the attention kernels and oneDNN's GEMMs both use it.
  if (o.threads > 0) set_default_num_threads(o.threads);

  const models::SentenceEmbedder embedder = models::SentenceEmbedder::load(o.model_dir, o.embedder);
  const std::int64_t count = static_cast<std::int64_t>(o.texts.size());
  const std::int64_t dim = embedder.dimension();
  const std::vector<std::int64_t> shape = {count, dim};
  io::NpyRowWriter writer(o.out_path, DType::kF32, shape, "--out");

  const std::int64_t window = kWindowBatches * o.embedder.batch_size;
  Progress progress(count, !o.quiet && count > kProgressTexts &&
                                     count > kProgressBatches * o.embedder.batch_size);
  std::vector<float> rows;
  for (std::int64_t first = 0; first < count; first += window) {
    const std::int64_t n = std::min(window, count - first);
    rows.resize(static_cast<std::size_t>(n * dim));
    embedder.embed(std::span<const std::string>(o.texts).subspan(first, n), rows.data(),
                   [&](std::int64_t done, std::int64_t) { progress.update(first + done); });
    writer.append(rows.data(), rows.size() * sizeof(float));
  }
  progress.finish();
  writer.commit();
  return 0;
}

}  // namespace qkv::cli
