// The --linear option of `qkv attention` and `qkv bench`: spec parsing, the bridge from the
// command's AttentionParams to LinearAttentionParams, and names for tables
// (docs/linear-attention.md).
//
//   --linear elu                                  Linear Transformer, phi(x) = elu(x) + 1
//   --linear favor[:features=N][,seed=S]          Performer FAVOR+ (default features=256, seed=1)
#pragma once

#include <string>

#include "io/npy.h"
#include "qkv/attention.h"
#include "qkv/linear_attention.h"

namespace qkv::cli {

// Help text for the option, shared by both commands (ends with a newline).
extern const char* const kLinearUsage;

// Parses a spec; UsageError naming `option` on any syntax or range problem.
LinearAttentionParams parse_linear_spec(const std::string& option, const std::string& text);

// `spec` (feature map, features, seed) with every other field taken from `params`: the shared
// options, and those linear attention rejects (softcap, window, mask, bias), so that the
// library's error names them. --kernel auto/reference map to LinearKernel kAuto/kReference;
// chunked and flash are exact-attention kernels: UsageError.
LinearAttentionParams linear_params_from(const LinearAttentionParams& spec,
                                         const AttentionParams& params);

// Short name for tables and JSON: "lin-elu", "favor-256".
std::string linear_spec_name(const LinearAttentionParams& params);

// The FAVOR+ projection `params` uses for head_dim, as a float32 (features, head_dim) array
// (what --favor-features-out writes); `where` names the option for errors.
io::NpyArray favor_projection_array(const LinearAttentionParams& params, std::int64_t head_dim,
                                    const std::string& where);

}  // namespace qkv::cli
