#include "tools/cli_linear.h"

#include <algorithm>

#include "tools/cli.h"

namespace qkv::cli {

const char* const kLinearUsage =
    R"(linear attention (an approximation of softmax attention; docs/linear-attention.md):
  --linear SPEC        replace softmax(q.k) by phi(q).phi(k): O(L) time and memory
                         elu                                Linear Transformer, phi = elu + 1
                         favor[:features=N][,seed=S]        Performer FAVOR+, positive
                                                            orthogonal random features
                                                            (default features=256, seed=1;
                                                            a new seed redraws them)
                       combines with --causal, --align, --key-lengths, --threads and, for
                       favor, --scale (the softmax temperature it approximates); --kernel
                       auto or reference. --window, --mask, --bias, --softcap, --lse and
                       --weights cannot be expressed and are errors.
  --favor-features-out F.npy
                       with --linear favor: also writes the projection it drew, float32
                       (features, D), rows w_r of phi(x)_r = exp(w_r.x' - |x'|^2/2) / sqrt(M)
)";

namespace {

[[noreturn]] void bad_spec(const std::string& option, const std::string& text,
                           const std::string& why) {
  throw UsageError(option + ": " + why + " in '" + text +
                   "' (expected elu or favor[:features=N][,seed=S])");
}

}  // namespace

LinearAttentionParams parse_linear_spec(const std::string& option, const std::string& text) {
  LinearAttentionParams params;
  const std::size_t colon = text.find(':');
  const std::string map = text.substr(0, colon);
  if (map == "elu") {
    params.feature_map = FeatureMap::kEluPlusOne;
    if (colon != std::string::npos) bad_spec(option, text, "elu takes no parameters");
    return params;
  }
  if (map != "favor") bad_spec(option, text, "unknown feature map '" + map + "'");
  params.feature_map = FeatureMap::kFavorPositive;
  if (colon == std::string::npos) return params;
  bool seen_features = false, seen_seed = false;
  for (const std::string& item : split_commas(text.substr(colon + 1))) {
    const std::size_t equals = item.find('=');
    if (equals == std::string::npos) bad_spec(option, text, "'" + item + "' is not key=value");
    const std::string key = item.substr(0, equals), value = item.substr(equals + 1);
    if (key == "features" && !seen_features) {
      seen_features = true;
      params.nb_features = parse_int(option + " features", value);
      if (params.nb_features < 1 || params.nb_features > 65536) {
        bad_spec(option, text, "features must be in [1, 65536]");
      }
    } else if (key == "seed" && !seen_seed) {
      seen_seed = true;
      const std::int64_t seed = parse_int(option + " seed", value);
      if (seed < 0) bad_spec(option, text, "seed must be >= 0");
      params.seed = static_cast<std::uint64_t>(seed);
    } else if (key == "features" || key == "seed") {
      bad_spec(option, text, key + " given twice");
    } else {
      bad_spec(option, text, "unknown key '" + key + "'");
    }
  }
  return params;
}

LinearAttentionParams linear_params_from(const LinearAttentionParams& spec,
                                         const AttentionParams& params) {
  if (params.sparsity) {
    throw UsageError(
        "--linear: cannot be combined with block-sparse attention (--sparse...): "
        "linear attention sums over every allowed key");
  }
  LinearAttentionParams linear = spec;
  linear.scale = params.scale;
  linear.causal = params.causal;
  linear.align = params.align;
  linear.key_lengths = params.key_lengths;
  linear.softcap = params.softcap;
  linear.window_left = params.window_left;
  linear.window_right = params.window_right;
  linear.mask = params.mask;
  linear.bias = params.bias;
  linear.num_threads = params.num_threads;
  switch (params.kernel) {
    case Kernel::kAuto:
      linear.kernel = LinearKernel::kAuto;
      break;
    case Kernel::kReference:
      linear.kernel = LinearKernel::kReference;
      break;
    case Kernel::kChunked:
    case Kernel::kFlash:
      throw UsageError(std::string("--kernel: ") +
                       (params.kernel == Kernel::kChunked ? "chunked" : "flash") +
                       " is an exact-attention kernel; with --linear use auto or reference");
  }
  return linear;
}

std::string linear_spec_name(const LinearAttentionParams& params) {
  if (params.feature_map == FeatureMap::kEluPlusOne) return "lin-elu";
  return "favor-" + std::to_string(params.nb_features);
}

io::NpyArray favor_projection_array(const LinearAttentionParams& params, std::int64_t head_dim,
                                    const std::string& where) {
  const std::vector<float> w = favor_projection(head_dim, params.nb_features, params.seed);
  io::NpyArray array = io::make_npy_array(DType::kF32, {params.nb_features, head_dim}, where);
  std::copy(w.begin(), w.end(), array.as<float>());
  return array;
}

}  // namespace qkv::cli
