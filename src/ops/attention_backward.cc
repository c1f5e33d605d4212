// qkv::attention_backward: the forward's boundary (ops/prepare_attention.h) on q, k, v, out,
// lse and the params, then dout and the gradients; one AttentionBackwardKernelParams; one
// kernel call.
#include "qkv/attention_backward.h"

#include <string>

#include "kernels/kernels.h"
#include "kernels/product_path.h"
#include "ops/prepare_attention.h"
#include "ops/validate.h"
#include "qkv/error.h"

namespace qkv {
namespace {

// Of the output dtype for `input` (ops::output_dtype), present, of `want` shape, written by
// several threads.
void require_gradient(const char* name, const TensorView& view,
                      const std::array<std::int64_t, 4>& want, const char* want_text,
                      DType input) {
  if (view.empty()) {
    throw Error(std::string(name) + ": required (" + dtype_name(ops::output_dtype(input)) +
                ", shape " + want_text + " = " + shape_string(want) + ")");
  }
  ops::require_data(name, view);
  ops::require_output_dtype(name, view, input);
  ops::require_shape(name, view, want, want_text);
  ops::require_writable_strides(name, view);
}

// attention_backward, or attention_block_backward when `block` is not null.
void backward(const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const TensorView& dout,
              const AttentionGrads& grads, const AttentionParams& params,
              const BlockPositions* block) {
  if (out.empty() || lse.empty()) {
    throw Error(std::string(out.empty() ? "out" : "lse") +
                ": required (the forward's output for these inputs; f32, f64 for f64 inputs)");
  }
  if (params.kernel == Kernel::kChunked) {
    throw Error("kernel: the backward has no chunked kernel; use kernel auto, flash or reference");
  }
  const bool f64 = q.dtype == DType::kF64;  // (f64: the reference kernel, f64 gradients)
  if (f64 && block != nullptr) {
    throw Error("q: a block's backward needs the flash kernel, which takes f32, bf16 or f16, "
                "not f64");
  }
  if (block != nullptr && params.kernel == Kernel::kReference) {
    throw Error("kernel: a block's backward needs the flash kernel (the reference recomputes "
                "the softmax over the block's keys alone, not from the whole's lse); use kernel "
                "auto or flash");
  }
  ops::PreparedAttention prepared;
  ops::prepare_attention(q, k, v, {.out = out, .lse = lse}, params, block, prepared);
  const AttentionKernelParams& p = prepared.params;
  const std::int64_t batch = p.batch, seq_q = p.seq_q, seq_kv = p.seq_kv;
  const std::int64_t heads_q = p.num_heads_q, heads_kv = p.num_heads_kv;
  const std::int64_t dim = p.head_dim, dim_v = p.head_dim_v;

  if (dout.empty()) {
    throw Error(std::string("dout: required (") + dtype_name(ops::output_dtype(q.dtype)) +
                ", the shape of out)");
  }
  ops::require_data("dout", dout);
  ops::require_output_dtype("dout", dout, q.dtype);
  ops::require_shape("dout", dout, {batch, seq_q, heads_q, dim_v}, "(B, Lq, Hq, Dv)");
  require_gradient("dq", grads.dq, {batch, seq_q, heads_q, dim}, "(B, Lq, Hq, D)", q.dtype);
  require_gradient("dk", grads.dk, {batch, seq_kv, heads_kv, dim}, "(B, Lk, Hkv, D)", q.dtype);
  require_gradient("dv", grads.dv, {batch, seq_kv, heads_kv, dim_v}, "(B, Lk, Hkv, Dv)", q.dtype);
  AttentionBackwardKernelParams g{};
  if (!grads.dbias.empty()) {
    if (params.bias.empty()) throw Error("dbias: needs a bias (params.bias is empty)");
    // (f32 whatever q's dtype: the bias is f32.)
    require_gradient("dbias", grads.dbias, params.bias.sizes, "the bias's shape", DType::kF32);
    ops::broadcast_strides("dbias", grads.dbias, {batch, heads_q, seq_q, seq_kv}, g.dbias_stride);
    g.dbias = static_cast<float*>(grads.dbias.data);
    for (int d = 0; d < 4; ++d) g.dbias_sizes[d] = grads.dbias.sizes[d];
  }
  const ops::NamedView written[] = {
      {"dq", &grads.dq}, {"dk", &grads.dk}, {"dv", &grads.dv}, {"dbias", &grads.dbias}};
  const ops::NamedView read[] = {{"q", &q},       {"k", &k},
                                 {"v", &v},       {"out", &out},
                                 {"lse", &lse},   {"dout", &dout},
                                 {"mask", &params.mask}, {"bias", &params.bias}};
  ops::require_no_overlap(written, read);

  g.forward = p;
  if (f64) {
    g.dout_f64 = static_cast<const double*>(dout.data);
    g.dq_f64 = static_cast<double*>(grads.dq.data);
    g.dk_f64 = static_cast<double*>(grads.dk.data);
    g.dv_f64 = static_cast<double*>(grads.dv.data);
  } else {
    g.dout = static_cast<const float*>(dout.data);
    g.dq = static_cast<float*>(grads.dq.data);
    g.dk = static_cast<float*>(grads.dk.data);
    g.dv = static_cast<float*>(grads.dv.data);
  }
  for (int d = 0; d < 4; ++d) {
    g.dout_stride[d] = dout.strides[d];
    g.dq_stride[d] = grads.dq.strides[d];
    g.dk_stride[d] = grads.dk.strides[d];
    g.dv_stride[d] = grads.dv.strides[d];
  }
  // auto: flash (f64: the reference).
  if (params.kernel == Kernel::kReference || f64) {
    attention_backward_reference(g);
  } else {
    attention_backward_flash_cpu(g);
  }
}

}  // namespace

const char* backward_product_path(const AttentionParams& params, DType dtype) {
  return params.kernel == Kernel::kReference || dtype == DType::kF64
             ? "reference-f64"
             : product_path_name(attention_backward_flash_product_path(dtype));
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const AttentionGrads& grads, const AttentionParams& params) {
  backward(q, k, v, out, lse, dout, grads, params, nullptr);
}

void attention_block_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& lse,
                              const TensorView& dout, const AttentionGrads& grads,
                              const AttentionParams& params, const BlockPositions& positions) {
  backward(q, k, v, out, lse, dout, grads, params, &positions);
}

}  // namespace qkv
