// The ring's loop with its two halves separable, for `qkv ring-bench`: the compute of every
// step without the transfers (on this rank's own K/V standing in for the others': the same
// sizes, the same skipped blocks), and the transfers of every step without the compute. Their
// times beside the full ring's say how much of the communication the ring hid.
#pragma once

#include <mpi.h>

#include "qkv/attention_backward.h"
#include "qkv/ring_attention.h"

namespace qkv::distributed {

enum class RingMode { kFull, kComputeOnly, kTransferOnly };

RingStats ring_attention_mode(MPI_Comm comm, const TensorView& q, const TensorView& k,
                              const TensorView& v, const AttentionOutputs& outputs,
                              const RingParams& params, RingMode mode);
RingStats ring_attention_backward_mode(MPI_Comm comm, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& out,
                                       const TensorView& lse, const TensorView& dout,
                                       const AttentionGrads& grads, const RingParams& params,
                                       RingMode mode);

}  // namespace qkv::distributed
