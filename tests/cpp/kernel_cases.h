// The kernel tests' one table of cases (odd sizes, every mask kind alone and combined, both
// alignments, GQA/MQA, decode, Lq != Lk, Dv != D, head dims 1..256, -inf bias, large logits, NaN
// in padded keys) and the check every fast kernel passes on each.
#pragma once

#include <vector>

#include "attention_case.h"

namespace qkv::testing {

std::vector<Case> kernel_cases();

// cases with q, k, v stored as dtype (the oracle reads the same bits).
std::vector<Case> with_dtype(std::vector<Case> cases, DType dtype);

// The flash kernel (on attention_flash_product_path) and the chunked kernel (three chunk sizes)
// against the reference oracle: out and lse within DESIGN.md section 5's tolerance of each
// kernel's own product path, and the chunked kernel's probabilities; prints each kernel's
// error-to-tolerance ratio and path ("[ err/tol  ]" lines).
void check_against_reference(const Problem& problem);

}  // namespace qkv::testing
