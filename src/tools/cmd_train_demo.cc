// qkv train-demo: trains a TokenTagger (qkv/models/token_tagger.h) on a task generated on the
// fly, with qkv's own backward and AdamW, printing a line per step and an evaluation on fresh
// sequences every few steps; stops at a target accuracy, a step count or a time limit; saves
// and reloads the weights as .safetensors.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/layers/adamw.h"
#include "qkv/models/token_tagger.h"
#include "tools/cli.h"

namespace qkv::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: qkv train-demo [--task sort|copy] [--seq N] [--batch B] [--lr LR] [--steps N]
                      [--time-limit S] [--target A] [--eval-every N] [--eval-size N]
                      [--embed E] [--heads H] [--layers N] [--ff F] [--dropout P] [--seed S]
                      [--dtype T] [--threads N] [--save FILE] [--load FILE] [--eval-only]
                      [--log FILE] [--quiet]

Trains a small transformer encoder (token + position embeddings, Pre-LN encoder layers with
GELU, a final LayerNorm, a linear head; default 2 layers, embed 128, 4 heads, d_ff 512) on a
task generated on the fly, with qkv's attention backward, the layers' backward and AdamW
(docs/training.md). Every step prints its loss, its batch's token accuracy, tokens/s and the
time so far; every --eval-every steps the token accuracy on --eval-size fresh sequences. Stops
when that accuracy reaches --target, after --steps steps, or at --time-limit seconds.

tasks:
  sort   N random digits in, the same digits sorted out, at every position (bidirectional)
  copy   N random digits, a separator, the same digits again, under a causal mask: each
         token of the copy predicts the next (scored on the N copied digits)

options:
  --task T          sort (default) or copy
  --seq N           digits per sequence (default 10)
  --batch B         sequences per step (default 64)
  --lr LR           AdamW's learning rate (default 0.002; linear warm-up over 50 steps)
  --steps N         at most N steps (default 0: no limit)
  --time-limit S    stop after S seconds of training (default 180)
  --target A        stop when the evaluated token accuracy reaches A (default 0.95)
  --eval-every N    evaluate every N steps (default 25)
  --eval-size N     fresh sequences per evaluation (default 512), run --batch at a time
  --embed E, --heads H, --layers N, --ff F   the model (defaults 128, 4, 2, 512)
  --dropout P       dropout in every layer while training (default 0)
  --seed S          weights and data (default 1)
  --dtype T         f32 (default) or bf16: the encoder layers' matrix products, forward and
                    backward (mixed precision: bf16 operands, on AMX tiles where the CPU has
                    AMX-BF16; the weights, AdamW, LayerNorm, softmax and every sum stay f32;
                    docs/training.md). Applies to --load's model too
  --threads N       OpenMP threads (default: OpenMP's default)
  --save FILE       write the trained weights (.safetensors, the config in its metadata)
  --load FILE       start from saved weights (their config replaces --embed ... --ff)
  --eval-only       with --load: evaluate only, no training
  --log FILE        a CSV row per step: step,seconds,loss,batch_accuracy,eval_accuracy
                    (scripts/plot_train_demo.py draws it)
  --quiet           no per-step lines (evaluations and the summary only)
  --help            this text
)";

struct Options {
  std::string task = "sort", save, load, log;
  std::int64_t seq = 10, batch = 64, steps = 0, eval_every = 25, eval_size = 512;
  std::int64_t embed = 128, heads = 4, layers = 2, ff = 512, threads = 0;
  double lr = 0.002, time_limit = 180, target = 0.95, dropout = 0;
  std::uint64_t seed = 1;
  bool eval_only = false, quiet = false;
  DType dtype = DType::kF32;
};

// A batch of the task: tokens and targets [batch, length], -100 where nothing is scored.
struct Batch {
  std::vector<std::int32_t> tokens, targets;
};

class Task {
 public:
  Task(const std::string& name, std::int64_t digits) : copy_(name == "copy"), digits_(digits) {}
  std::int64_t length() const { return copy_ ? 2 * digits_ + 1 : digits_; }
  std::int64_t vocab() const { return copy_ ? 11 : 10; }  // copy: 10 = the separator
  bool causal() const { return copy_; }

  Batch make(std::int64_t batch, std::mt19937_64& rng) const {
    std::uniform_int_distribution<std::int32_t> digit(0, 9);
    const std::int64_t L = length();
    Batch out;
    out.tokens.resize(static_cast<std::size_t>(batch * L));
    out.targets.assign(out.tokens.size(), -100);
    std::vector<std::int32_t> x(static_cast<std::size_t>(digits_));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int32_t& d : x) d = digit(rng);
      std::int32_t* t = out.tokens.data() + b * L;
      std::int32_t* y = out.targets.data() + b * L;
      if (!copy_) {
        std::copy(x.begin(), x.end(), t);
        std::sort(x.begin(), x.end());
        std::copy(x.begin(), x.end(), y);
        continue;
      }
      const std::int64_t n = digits_;
      std::copy(x.begin(), x.end(), t);
      t[n] = 10;
      std::copy(x.begin(), x.end(), t + n + 1);
      for (std::int64_t i = 0; i < n; ++i) y[n + i] = x[i];  // position n + i predicts x_i
    }
    return out;
  }

 private:
  bool copy_;
  std::int64_t digits_;
};

// Token accuracy of `model` on the first `sequences` sequences of `batch` (argmax against the
// scored targets), run `chunk` sequences at a time (the training batch: the layers' scratch
// then stays the size training made it; 512 sequences of 128 at once took 1.4 GB more at
// embed 512).
double accuracy(const TokenTagger& model, const Batch& batch, std::int64_t sequences,
                std::int64_t length, std::int64_t chunk) {
  const std::int64_t C = model.config().num_classes;
  std::vector<float> logits(static_cast<std::size_t>(std::min(chunk, sequences) * length * C));
  std::int64_t correct = 0, counted = 0;
  for (std::int64_t s0 = 0; s0 < sequences; s0 += chunk) {
    const std::int64_t n = std::min(chunk, sequences - s0);
    model.forward(batch.tokens.data() + s0 * length, n, length, logits.data());
    for (std::int64_t r = 0; r < n * length; ++r) {
      const std::int32_t target = batch.targets[s0 * length + r];
      if (target < 0) continue;
      const float* row = logits.data() + r * C;
      correct += std::max_element(row, row + C) - row == target;
      ++counted;
    }
  }
  return counted == 0 ? 0.0 : static_cast<double>(correct) / counted;
}

std::string digits_text(const std::int32_t* x, std::int64_t n) {
  std::string s;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i > 0) s += ' ';
    s += x[i] == 10 ? std::string("|") : std::to_string(x[i]);
  }
  return s;
}

Options parse(std::vector<std::string> argv, bool& help) {
  Options o;
  Args args(std::move(argv));
  auto positive = [](const std::string& name, std::int64_t v, std::int64_t hi) {
    if (v < 1 || v > hi) {
      throw UsageError(name + ": expected 1 to " + std::to_string(hi) + ", got " +
                       std::to_string(v));
    }
    return v;
  };
  while (!args.done()) {
    const std::string name = args.next();
    if (name == "--help" || name == "-h") {
      help = true;
      return o;
    } else if (name == "--task") {
      o.task = args.value(name);
      if (o.task != "sort" && o.task != "copy") {
        throw UsageError("--task: expected sort or copy, got '" + o.task + "'");
      }
    } else if (name == "--seq") {
      o.seq = positive(name, parse_int(name, args.value(name)), 512);
    } else if (name == "--batch") {
      o.batch = positive(name, parse_int(name, args.value(name)), 1 << 16);
    } else if (name == "--lr") {
      o.lr = parse_double(name, args.value(name));
      if (!(o.lr > 0 && o.lr < 1)) throw UsageError("--lr: expected a value in (0, 1)");
    } else if (name == "--steps") {
      o.steps = parse_int(name, args.value(name));
      if (o.steps < 0) throw UsageError("--steps: expected >= 0 (0: no limit)");
    } else if (name == "--time-limit") {
      o.time_limit = parse_double(name, args.value(name));
      if (!(o.time_limit > 0)) throw UsageError("--time-limit: expected seconds > 0");
    } else if (name == "--target") {
      o.target = parse_double(name, args.value(name));
      if (!(o.target > 0 && o.target <= 1)) throw UsageError("--target: expected (0, 1]");
    } else if (name == "--eval-every") {
      o.eval_every = positive(name, parse_int(name, args.value(name)), 1 << 30);
    } else if (name == "--eval-size") {
      o.eval_size = positive(name, parse_int(name, args.value(name)), 1 << 20);
    } else if (name == "--embed") {
      o.embed = positive(name, parse_int(name, args.value(name)), 4096);
    } else if (name == "--heads") {
      o.heads = positive(name, parse_int(name, args.value(name)), 256);
    } else if (name == "--layers") {
      o.layers = positive(name, parse_int(name, args.value(name)), 64);
    } else if (name == "--ff") {
      o.ff = positive(name, parse_int(name, args.value(name)), 1 << 16);
    } else if (name == "--dropout") {
      o.dropout = parse_double(name, args.value(name));
      if (!(o.dropout >= 0 && o.dropout < 1)) throw UsageError("--dropout: expected [0, 1)");
    } else if (name == "--seed") {
      const std::int64_t s = parse_int(name, args.value(name));
      if (s < 0) throw UsageError("--seed: expected >= 0");
      o.seed = static_cast<std::uint64_t>(s);
    } else if (name == "--dtype") {
      const std::string t = args.value(name);
      if (t != "f32" && t != "bf16") {
        throw UsageError("--dtype: expected f32 or bf16, got '" + t + "'");
      }
      o.dtype = t == "bf16" ? DType::kBF16 : DType::kF32;
    } else if (name == "--threads") {
      o.threads = positive(name, parse_int(name, args.value(name)), 4096);
    } else if (name == "--save") {
      o.save = args.value(name);
    } else if (name == "--load") {
      o.load = args.value(name);
    } else if (name == "--eval-only") {
      o.eval_only = true;
    } else if (name == "--log") {
      o.log = args.value(name);
    } else if (name == "--quiet") {
      o.quiet = true;
    } else {
      throw UsageError("unknown option '" + name + "' for train-demo (try --help)");
    }
  }
  if (o.eval_only && o.load.empty()) throw UsageError("--eval-only: needs --load FILE");
  if (o.embed % o.heads != 0) {
    throw UsageError("--embed " + std::to_string(o.embed) + " is not a multiple of --heads " +
                     std::to_string(o.heads));
  }
  return o;
}

}  // namespace

int run_train_demo(std::vector<std::string> argv) {
  bool help = false;
  const Options o = parse(std::move(argv), help);
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (o.threads > 0) omp_set_num_threads(static_cast<int>(o.threads));
  const Task task(o.task, o.seq);
  const std::int64_t L = task.length();
  TokenTagger model = [&] {
    if (!o.load.empty()) return TokenTagger::load(o.load, o.dtype);
    return TokenTagger({.vocab = task.vocab(),
                        .num_classes = 10,
                        .max_seq = L,
                        .embed_dim = o.embed,
                        .num_heads = o.heads,
                        .num_layers = o.layers,
                        .d_ff = o.ff,
                        .causal = task.causal(),
                        .dropout = static_cast<float>(o.dropout),
                        .matmul_dtype = o.dtype},
                       o.seed);
  }();
  const TokenTaggerConfig& c = model.config();
  if (c.vocab != task.vocab() || c.num_classes != 10 || c.max_seq < L || c.causal != task.causal()) {
    throw Error("--load " + o.load + ": the model (vocab " + std::to_string(c.vocab) +
                ", max_seq " + std::to_string(c.max_seq) + (c.causal ? ", causal" : "") +
                ") does not fit task " + o.task + " with --seq " + std::to_string(o.seq) +
                " (vocab " + std::to_string(task.vocab()) + ", length " + std::to_string(L) + ")");
  }
  std::printf(
      "qkv train-demo: task %s, %lld digits (sequence length %lld), batch %lld; model: "
      "%lld layers, embed %lld, %lld heads, d_ff %lld, %lld parameters, %s products; "
      "%d threads\n",
      o.task.c_str(), (long long)o.seq, (long long)L, (long long)o.batch, (long long)c.num_layers,
      (long long)c.embed_dim, (long long)c.num_heads, (long long)c.d_ff,
      (long long)model.num_parameters(), dtype_name(c.matmul_dtype), omp_get_max_threads());
  std::mt19937_64 data_rng(o.seed * 7919 + 1), eval_rng(o.seed * 104729 + 2);
  const Batch eval_batch = task.make(o.eval_size, eval_rng);  // held out: never trained on
  auto evaluate = [&] { return accuracy(model, eval_batch, o.eval_size, L, o.batch); };
  if (o.eval_only) {
    std::printf("eval: token accuracy %.4f on %lld fresh sequences\n", evaluate(),
                (long long)o.eval_size);
    return 0;
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> log(nullptr, &std::fclose);
  if (!o.log.empty()) {
    log.reset(std::fopen(o.log.c_str(), "w"));
    if (!log) throw Error("--log " + o.log + ": cannot open for writing");
    std::fprintf(log.get(), "step,seconds,loss,batch_accuracy,eval_accuracy\n");
  }
  AdamW optimizer({.lr = static_cast<float>(o.lr), .weight_decay = 0.01f});
  constexpr std::int64_t kWarmup = 50;
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double last_eval = 0;
  std::int64_t step = 0;
  std::string stop;
  while (true) {
    optimizer.set_lr(static_cast<float>(o.lr * std::min<double>(1.0, (step + 1.0) / kWarmup)));
    const Batch batch = task.make(o.batch, data_rng);
    const double before = seconds();
    const TrainStepResult r = model.train_step(batch.tokens.data(), batch.targets.data(),
                                               o.batch, L, optimizer, o.seed + 17);
    ++step;
    const double elapsed = seconds();
    const double batch_accuracy = static_cast<double>(r.correct) / std::max<std::int64_t>(1, r.counted);
    if (!o.quiet) {
      std::printf("step %5lld  loss %.4f  batch acc %.3f  %7.0f tokens/s  %6.1f s\n",
                  (long long)step, r.loss, batch_accuracy,
                  static_cast<double>(o.batch * L) / (elapsed - before), elapsed);
    }
    const bool eval_now = step % o.eval_every == 0;
    if (eval_now) {
      last_eval = evaluate();
      std::printf("eval at step %lld: token accuracy %.4f on %lld fresh sequences (%.1f s)\n",
                  (long long)step, last_eval, (long long)o.eval_size, seconds());
    }
    if (log) {
      std::fprintf(log.get(), "%lld,%.3f,%.6f,%.4f,", (long long)step, elapsed, r.loss,
                   batch_accuracy);
      if (eval_now) std::fprintf(log.get(), "%.4f", last_eval);
      std::fprintf(log.get(), "\n");
    }
    std::fflush(stdout);
    if (eval_now && last_eval >= o.target) {
      stop = "reached the target";
      break;
    }
    if (o.steps > 0 && step >= o.steps) {
      stop = "step limit";
      break;
    }
    if (seconds() >= o.time_limit) {
      stop = "time limit";
      break;
    }
  }
  const double final_accuracy = evaluate();
  // One example, so a person can see what the model does.
  std::mt19937_64 example_rng(o.seed + 99);
  const Batch example = task.make(1, example_rng);
  std::vector<float> logits(static_cast<std::size_t>(L * 10));
  model.forward(example.tokens.data(), 1, L, logits.data());
  std::vector<std::int32_t> predicted(static_cast<std::size_t>(L));
  for (std::int64_t i = 0; i < L; ++i) {
    const float* row = logits.data() + i * 10;
    predicted[i] = static_cast<std::int32_t>(std::max_element(row, row + 10) - row);
  }
  std::printf("example: input %s\n", digits_text(example.tokens.data(), L).c_str());
  if (task.causal()) {
    std::printf("         copy  %s (predicted)\n",
                digits_text(predicted.data() + o.seq, o.seq).c_str());
  } else {
    std::printf("         out   %s (predicted)\n", digits_text(predicted.data(), L).c_str());
    std::printf("         want  %s\n", digits_text(example.targets.data(), L).c_str());
  }
  std::printf("%s after %lld steps, %.1f s: token accuracy %.4f on %lld fresh sequences "
              "(target %.2f)\n",
              stop.c_str(), (long long)step, seconds(), final_accuracy, (long long)o.eval_size,
              o.target);
  if (!o.save.empty()) {
    model.save(o.save);
    std::printf("saved %s\n", o.save.c_str());
  }
  return 0;
}

}  // namespace qkv::cli
