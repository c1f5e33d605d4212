// Cross-entropy over class logits, for training (torch.nn.functional.cross_entropy with
// reduction "mean" and ignore_index).
#pragma once

#include <cstdint>

namespace qkv {

// logits: [rows, classes] f32; targets: [rows], each in [0, classes) or ignore_index (such a
// row adds nothing). Returns the mean over the counted rows of -log softmax(logits)[target]
// (0 when none counts) and, when dlogits is not null, writes its gradient there
// ([rows, classes]: (softmax - onehot(target)) / count; 0 on ignored rows). Row by row in
// double, max-subtracted (no overflow for any finite logits). Throws qkv::Error for a target
// out of range (naming the row) or a non-finite logit.
double cross_entropy(const float* logits, std::int64_t rows, std::int64_t classes,
                     const std::int32_t* targets, float* dlogits, std::int32_t ignore_index = -100);

}  // namespace qkv
