#!/usr/bin/env python3
"""Times qkv's attention against its peers in one run: same shapes, same thread count.

    python3 scripts/bench_attention_peers.py [--quick] [--threads N] [--png FILE] [--json FILE]
    python3 scripts/bench_attention_peers.py --training [--lengths 4096] ...

--training times a training step's attention instead: forward + backward (out.backward(dout)
for a fixed random dout) through torch's SDPA (torch-f32/-bf16) and through qkv.torch's
autograd op (qkv-f32/-bf16: qkv's forward, then its flash backward); GFLOP/s then counts 3.5x
the forward's FLOPs (forward 1 + backward 2.5, FlashAttention's convention). No decode case.

Peers (DESIGN.md section 6: timed in the same run, reported as ratios):
  torch-f32, torch-bf16  torch.nn.functional.scaled_dot_product_attention on CPU, inputs
                         (B, H, L, D) contiguous; GQA through enable_gqa=True; causal with
                         Lq = Lk by is_causal, with Lq < Lk by attn_mask=causal_lower_right
                         (torch's bias for a causal mask aligned at the bottom right, as qkv's;
                         is_causal is top-left aligned)
  torch-mm-f32/-bf16     decode only (Lq <= 8): softmax(q k^T) v as two batched matmuls with the
                         query heads (and queries) of one KV head stacked as rows (how
                         hand-written decoders do GQA without copying K/V); SDPA is slow at
                         Lq = 1 on CPU. Causal: a (Lq, Lk) bias of 0 / -inf added to the
                         scores
  ort-mha-f32            ONNX Runtime com.microsoft MultiHeadAttention, BSH-packed (B, L, H*D)
                         inputs, unidirectional=1 for causal (its CPU kernel is float only; with
                         a mask it materialises (B, H, Lq, Lk) scores, so it is skipped where
                         that exceeds --ort-max-mib). GQA: K/V repeated to Hq heads beforehand
  ort-gqa-f32            decode only: com.microsoft GroupQueryAttention appending the Lq new
                         tokens to a KV cache of Lk - Lq keys, past and present bound to one
                         buffer. It is causal by construction (the new tokens see the cache and
                         the new tokens up to their own), so it runs Lq = 1 and causal cases
  qkv.torch-f32/-bf16    qkv's Python module in this process: qkv.torch.scaled_dot_product_attention
                         on the torch peers' tensors (--python-module; the report then compares
                         its ratio to torch with the CLI's, same rounds); causal as torch-f32
  qkv-f32, qkv-bf16      `qkv bench --json --shape B,Hq,Hkv,Lq,Lk,D [--causal] --dtype T
                         --threads N --layout L` (bf16 with --out-dtype input: out in bf16, as
                         torch's bf16 SDPA returns it), one process per round; its JSON carries
                         the fp32 FMA peak (peak_gflops) and read bandwidth measured in the same
                         process. L: bhsd for decode (K/V as (B, H, L, D), the order of qkv's
                         KvCache stores and of the torch peers' tensors; a BSHD twin is timed in
                         the same rounds and its time ratio reported), bshd otherwise

Shapes (issue 4): B=1, H=8, D in {64, 128}, Lq = Lk = L in {1024, 4096, 16384}, causal and
not; decode Lq=1, D=128: Lk=32768, Hq=32, Hkv=8 (GQA) and Lk=16384, Hq=Hkv=32 (multi-head);
and a decode step with four draft tokens (speculative decoding: each sees the cache and the
draft tokens up to its own, causal at the bottom right), Lq=4, Lk=8192, Hq=32, Hkv=8, D=128.
"Decode" below means Lq <= 8.
--quick drops L=16384. --model-shapes times shapes of real models instead (batched encoders
and a GQA decoder's prefill; model_cases below), no decode.

Method: each implementation is warmed up, then timed once per round; rounds interleave the
implementations (in a fresh seeded order each round) so that they share the machine's noise,
and the median over rounds is reported. A call under 20 ms is repeated to fill 20 ms and
divided; in decode cases each of those calls follows an untimed read of a buffer of 256 MiB or
twice the last-level cache (Evictor), so that it finds K and V in memory, as qkv bench's
repeats do. Cases where one call takes over 2 s get 3 rounds instead of --rounds. The peers in
this process read one shared (B, H, L, D) copy of the inputs per dtype (ORT's decode cache
included; ORT's MHA its BSH packing): on the VM of these sessions, decode ratios between
private copies moved by up to 1.6x between runs. qkv bench (its own process) allocates its
own; its JSON quotes its K/V rate against a plain read of its own arrays too.

Columns: median ms; GFLOP/s = 4 * B * Hq * Lq * Lk * D / time, counting only the pairs the causal
mask allows (bottom-right aligned; "effective" GFLOP/s, DESIGN.md section 6); %peak = GFLOP/s /
qkv's measured fp32 FMA peak (median over the qkv processes of this run; bf16 rows use the
peak qkv reports for bf16 when it reports one); decode rows add GB/s = bytes of K and V in the
row's dtype (B * Hkv * Lk * D * 2 tensors) / time, and %bw = that / qkv's measured streaming
read bandwidth. After each shape: qkv / best peer speed ratio per dtype (> 1: qkv faster);
after a causal shape also qkv's causal / non-causal effective GFLOP/s, with the non-causal
twin timed in the same rounds (the median of the per-round ratios); after a non-causal shape
whose L is in --scaling, qkv's thread scaling against a one-thread twin timed the same way;
after decode, qkv's K/V rate against the read probe of its own process and against a plain read
of its own K/V arrays (medians of rounds; qkv bench's JSON), and the time of its BSHD twin over
its own (arrays in BSHD, same rounds). On a CPU with AMX the header also
gives qkv's overlap probe: its tile products and its softmax's vector code run together, over
the two alone (1: they take turns, which bounds the AMX path below its tile peak).

A plain GEMM for scale (not with --decode-only or --training): after the cases, torch.mm of two
4096 x 4096 matrices in f32 (MKL) and in bf16 (oneDNN; AMX where the CPU has it; smaller, halved
until a call is projected to take at most 2 s, where torch is slow, as bf16 is on CPUs without
bf16 instructions), --rounds
rounds of a median of 3 calls after 2 warm-up calls, reported against the same FMA and bf16
probes as the rows: what the best large matrix product reaches on this CPU, the yardstick for
the %peak columns (on the Intel AMX Xeon of 2026-12-06: f32 about 74% of the FMA probe, bf16
about a quarter of the AMX probe).

Pages: the arrays every contender reads are advised onto transparent huge pages (numpy's by
default, qkv's by qkv itself, torch's through THP_MEM_ALLOC_ENABLE=1, which this script sets
unless the environment gives it): on the Intel AMX Xeon VM of 2026-12-05 a streaming read ran
1.14x faster on them and a GQA decode step 1.08-1.10x, so a peer left on 4 KiB pages would lose
by its pages rather than its kernel.

Needs nothing installed: it re-runs itself in .cache/venv-peers (scripts/peers_venv.sh).
"""
import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from peers_env import ensure_venv  # scripts/peers_env.py (this folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
MIN_SAMPLE_S = 0.02  # fast calls are repeated to fill this, so timer overhead stays < 0.1%
SLOW_CALL_S = 2.0  # cases slower than this per call get 3 rounds
FLOP_FACTOR = 1.0  # --training: 3.5 (forward + backward)
# Every contender's large arrays on transparent huge pages: numpy's are by default (madvise,
# 4 MiB and more), qkv's bench operands and KvCache too (core/huge_pages.h), torch's only with
# this switch (read by c10's CPU allocator at its first allocation, so set before torch is
# imported). Decode reads its K/V once per step, and on 4 KiB pages a VM pays page walks: see
# "Pages" in the docstring. THP_MEM_ALLOC_ENABLE=0 in the environment keeps torch on 4 KiB.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    causal: bool

    def name(self):
        return f"({self.B},{self.Hq},{self.Hkv},{self.Lq},{self.Lk},{self.D})" + (
            " causal" if self.causal else "")

    def allowed_pairs(self):
        """Query-key pairs per (batch, head) that the mask allows; causal is bottom-right
        aligned (query i sees keys j <= i + Lk - Lq), as in qkv."""
        if not self.causal:
            return self.Lq * self.Lk
        return sum(max(0, min(self.Lk, i + self.Lk - self.Lq + 1)) for i in range(self.Lq))

    def flops(self):
        return 4 * self.B * self.Hq * self.allowed_pairs() * self.D

    def kv_bytes(self, dtype):
        return 2 * self.B * self.Hkv * self.Lk * self.D * (4 if dtype == "f32" else 2)

    def is_decode(self):
        """A decode step: one query, or a few draft tokens, against a KV cache."""
        return self.Lq <= 8


def default_cases(lengths):
    cases = [Case(1, 8, 8, L, L, D, causal) for D in (64, 128) for causal in (False, True)
             for L in lengths]
    # Decode steps: GQA 32:8 (issue 16's shape) and multi-head (Hq = Hkv = 32, as in models
    # without GQA), both D = 128 against a long KV cache; and GQA 32:8 with four draft tokens
    # (16 query rows per kv head: qkv's wide blocks), causal as a verification step is.
    return cases + [Case(1, 32, 8, 1, 32768, 128, False), Case(1, 32, 32, 1, 16384, 128, False),
                    Case(1, 32, 8, 4, 8192, 128, True)]


def model_cases():
    """Shapes of real models' attention: a batch of short sequences through a BERT-base /
    MiniLM-sized encoder (12 heads of 64), longer ones, and a Llama-style GQA prefill (32 query
    heads on 8 kv heads of 128, causal), one long and a batch of four shorter."""
    return [Case(32, 12, 12, 128, 128, 64, False), Case(8, 12, 12, 512, 512, 64, False),
            Case(4, 16, 16, 1024, 1024, 64, False), Case(1, 32, 8, 2048, 2048, 128, True),
            Case(4, 32, 8, 512, 512, 128, True)]


class Skip(Exception):
    """An implementation that cannot run a case (the message says why)."""


class NotApplicable(Exception):
    """An implementation made for other cases (decode-only peers); left out of the table."""


def make_inputs(case):
    """q: [B, Lq, Hq, D], k, v: [B, Lk, Hkv, D] float32 ~ N(0, 1), one fixed seed per case;
    every implementation gets these same values (in its own layout and dtype)."""
    import numpy as np
    rng = np.random.default_rng(abs(hash((case.Lq, case.Lk, case.D, case.Hq))) % 2**32)
    q = rng.standard_normal((case.B, case.Lq, case.Hq, case.D), dtype=np.float32)
    k, v = (rng.standard_normal((case.B, case.Lk, case.Hkv, case.D), dtype=np.float32)
            for _ in range(2))
    return q, k, v


# ---- peers in this process: each prepare() returns a no-argument callable --------------------


# The (B, H, L, D) copies of the current case's inputs, one per array and dtype, shared by every
# implementation in this process (bench_case clears it per case). On the VM of these sessions
# the memory bandwidth a process got moved with what had just been done to memory elsewhere
# (with 6 GiB that another process had just filled held, the read probe fell from 27 to 11-16
# GB/s), and decode ratios between peers that each read their own copy, made at different
# moments, moved by up to 1.6x from one run to the next (docs/cli-bench-demo.md, "The kernel's
# own pages"). Reading the same bytes, they compare the kernels.
_SHARED_BHSD = {}


def to_torch_bhsd(x, dtype, shared=True):
    """[B, L, H, D] float32 numpy -> contiguous [B, H, L, D] torch tensor in dtype; with shared,
    the case's one copy (callers must not write to it; ORT's decode rewrites the values it
    holds)."""
    import torch
    key = (id(x), dtype)
    if shared and key in _SHARED_BHSD:
        return _SHARED_BHSD[key]
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    out = torch.from_numpy(x).transpose(1, 2).contiguous().to(dt)
    if shared:
        _SHARED_BHSD[key] = out
    return out


def causal_options(case):
    """torch SDPA's arguments for the case's mask: qkv's causal is aligned at the bottom right,
    torch's is_causal at the top left, so where Lq != Lk torch gets its lower-right causal bias
    (torch.nn.attention.bias.causal_lower_right: the same mask, computed, no array)."""
    if not case.causal:
        return {}
    if case.Lq == case.Lk:
        return {"is_causal": True}
    if case.Lq > case.Lk:
        raise Skip("causal with Lq > Lk leaves rows without keys (NaN in torch)")
    from torch.nn.attention.bias import causal_lower_right
    return {"attn_mask": causal_lower_right(case.Lq, case.Lk)}


class TorchSdpa:
    def __init__(self, dtype):
        self.dtype, self.label = dtype, f"torch-{dtype}"

    def prepare(self, case, data, threads):
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(threads)
        q, k, v = (to_torch_bhsd(x, self.dtype) for x in data)
        options = causal_options(case)
        if case.Hq != case.Hkv:
            options["enable_gqa"] = True

        def call():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(q, k, v, **options)

        return call, lambda out: out.float().transpose(1, 2).numpy()  # -> (B, Lq, Hq, D)


class TorchMatmulDecode:
    def __init__(self, dtype):
        self.dtype, self.label = dtype, f"torch-mm-{dtype}"

    def prepare(self, case, data, threads):
        import torch
        if not case.is_decode():
            raise NotApplicable
        torch.set_num_threads(threads)
        q, k, v = (to_torch_bhsd(x, self.dtype) for x in data)
        # q: [B, Hkv, group * Lq, D] -- the query heads sharing one KV head (and their queries),
        # stacked as rows
        # (query head h uses KV head h // group, so heads h = j * group + g are adjacent)
        q = q.reshape(case.B, case.Hkv, (case.Hq // case.Hkv) * case.Lq, case.D)
        scale = 1.0 / math.sqrt(case.D)
        # Causal (bottom right): row (g, i) of a kv head's stack sees keys j <= i + Lk - Lq.
        bias = None
        if case.causal:
            i = torch.arange(case.Lq).repeat(case.Hq // case.Hkv)[:, None]
            allowed = torch.arange(case.Lk)[None, :] <= i + case.Lk - case.Lq
            bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, -math.inf)

        def call():
            with torch.inference_mode():
                s = torch.matmul(q, k.transpose(-1, -2)) * scale
                if bias is not None:
                    s += bias
                return torch.matmul(torch.softmax(s, dim=-1), v)

        return call, lambda out: out.float().reshape(case.B, case.Hq, case.Lq, case.D).transpose(
            1, 2).numpy()


def ort_session(graph_nodes, inputs, outputs, threads):
    import onnxruntime as ort
    from onnx import helper
    graph = helper.make_graph(graph_nodes, "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


class OrtMha:
    dtype, label = "f32", "ort-mha-f32"

    def __init__(self, max_mib):
        self.max_mib = max_mib

    def prepare(self, case, data, threads):
        import numpy as np
        from onnx import TensorProto, helper
        if case.causal and case.Lq != case.Lk:
            raise Skip("unidirectional is top-left aligned")
        # Its CPU kernel runs a fused flash path only without masks; with unidirectional=1 it
        # materialises the scores (measured: +700 MiB at L=4096).
        scores_mib = 4 * case.B * case.Hq * case.Lq * case.Lk / 2**20
        if case.causal and scores_mib > self.max_mib:
            raise Skip(f"unfused causal path needs ~{scores_mib:.0f} MiB of scores "
                       f"(> --ort-max-mib {self.max_mib})")
        hidden = case.Hq * case.D
        node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"],
                                domain="com.microsoft", num_heads=case.Hq,
                                unidirectional=int(case.causal))
        vi = helper.make_tensor_value_info
        session = ort_session(
            [node], [vi("q", TensorProto.FLOAT, [case.B, case.Lq, hidden]),
                     vi("k", TensorProto.FLOAT, [case.B, case.Lk, hidden]),
                     vi("v", TensorProto.FLOAT, [case.B, case.Lk, hidden])],
            [vi("o", TensorProto.FLOAT, [case.B, case.Lq, hidden])], threads)
        q = data[0].reshape(case.B, case.Lq, hidden)
        # K/V repeated from Hkv to Hq heads (MHA has no GQA) before timing starts.
        k, v = (np.ascontiguousarray(np.repeat(x, case.Hq // case.Hkv, axis=2)).reshape(
            case.B, case.Lk, hidden) for x in data[1:])
        feeds = {"q": q, "k": k, "v": v}
        return (lambda: session.run(None, feeds)[0],
                lambda out: out.reshape(case.B, case.Lq, case.Hq, case.D))


class OrtGqaDecode:
    dtype, label = "f32", "ort-gqa-f32"

    def prepare(self, case, data, threads):
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
        if not case.is_decode():
            raise NotApplicable
        if case.Lq > 1 and not case.causal:
            raise Skip("GroupQueryAttention is causal: its new tokens see each other causally")
        F, I32 = TensorProto.FLOAT, TensorProto.INT32
        B, Hq, Hkv, Lq, Lk, D = case.B, case.Hq, case.Hkv, case.Lq, case.Lk, case.D
        node = helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
            ["o", "present_key", "present_value"], domain="com.microsoft", num_heads=Hq,
            kv_num_heads=Hkv)
        vi = helper.make_tensor_value_info
        cache = [B, Hkv, Lk, D]  # BNSH, max_sequence_length = Lk: the buffer-sharing layout
        session = ort_session(
            [node], [vi("q", F, [B, Lq, Hq * D]), vi("k", F, [B, Lq, Hkv * D]),
                     vi("v", F, [B, Lq, Hkv * D]), vi("past_key", F, cache),
                     vi("past_value", F, cache), vi("seqlens_k", I32, [B]),
                     vi("total_sequence_length", I32, [])],
            [vi("o", F, [B, Lq, Hq * D]), vi("present_key", F, cache),
             vi("present_value", F, cache)], threads)
        q, k, v = data
        binding = session.io_binding()
        # The cache holds keys 0 .. Lk-Lq-1, the step appends keys Lk-Lq .. Lk-1 (rewriting the
        # same values on every call), so the result is attention over the same Lk keys as the
        # others' (seqlens_k: the total length minus 1, ORT's convention).
        binding.bind_cpu_input("q", q.reshape(B, Lq, Hq * D))
        binding.bind_cpu_input("k", np.ascontiguousarray(k[:, -Lq:]).reshape(B, Lq, Hkv * D))
        binding.bind_cpu_input("v", np.ascontiguousarray(v[:, -Lq:]).reshape(B, Lq, Hkv * D))
        binding.bind_cpu_input("seqlens_k", np.full((B,), Lk - 1, np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(Lk, np.int32))
        # past and present share one buffer, so a step appends its tokens in place instead of
        # copying the whole cache (the way ORT's generate loop runs it). The buffer is the
        # case's shared (B, H, L, D) copy (to_torch_bhsd): the step writes the last Lq keys'
        # values where they already are.
        self.caches = [ort.OrtValue.ortvalue_from_numpy(to_torch_bhsd(x, "f32").numpy())
                       for x in (k, v)]
        binding.bind_ortvalue_input("past_key", self.caches[0])
        binding.bind_ortvalue_input("past_value", self.caches[1])
        binding.bind_ortvalue_output("present_key", self.caches[0])
        binding.bind_ortvalue_output("present_value", self.caches[1])
        binding.bind_output("o")

        def call():
            session.run_with_iobinding(binding)
            return binding

        return call, lambda out: out.copy_outputs_to_cpu()[2].reshape(B, Lq, Hq, D)


class QkvTorchOp:
    """qkv's Python module in this process: qkv.torch.scaled_dot_product_attention on the same
    (B, H, L, D) torch tensors as torch-f32/-bf16 (a torch.library op; --python-module)."""

    def __init__(self, dtype, module_dir):
        self.dtype, self.label, self.module_dir = dtype, f"qkv.torch-{dtype}", module_dir

    def prepare(self, case, data, threads):
        import torch
        if str(self.module_dir) not in sys.path:
            sys.path.insert(0, str(self.module_dir))
        try:
            import qkv.torch as qt
        except ImportError as error:
            raise Skip(f"cannot import qkv from {self.module_dir}: {error}")
        torch.set_num_threads(threads)  # qkv.torch runs on torch.get_num_threads() threads
        q, k, v = (to_torch_bhsd(x, self.dtype) for x in data)
        options = causal_options(case)  # torch's arguments, which qkv.torch takes as torch does
        if case.Hq != case.Hkv:
            options["enable_gqa"] = True

        def call():
            return qt.scaled_dot_product_attention(q, k, v, **options)

        return call, lambda out: out.float().transpose(1, 2).numpy()


class Training:
    """--training: forward + backward of one attention call through `module`'s SDPA on
    (B, H, L, D) tensors that require grad; dout fixed per case; grads reset per call."""

    def __init__(self, dtype, label, module_dir=None):
        self.dtype, self.label, self.module_dir = dtype, label, module_dir

    def prepare(self, case, data, threads):
        import torch
        import torch.nn.functional as F
        if case.is_decode():
            raise NotApplicable
        sdpa = F.scaled_dot_product_attention
        if self.module_dir is not None:
            if str(self.module_dir) not in sys.path:
                sys.path.insert(0, str(self.module_dir))
            try:
                import qkv.torch as qt
            except ImportError as error:
                raise Skip(f"cannot import qkv from {self.module_dir}: {error}")
            sdpa = qt.scaled_dot_product_attention
        torch.set_num_threads(threads)
        # Own copies: they require grad (the forward-only peers share theirs).
        q, k, v = (to_torch_bhsd(x, self.dtype, shared=False).requires_grad_() for x in data)
        dout = torch.randn(q.shape[:-1] + (v.shape[-1],),
                           generator=torch.Generator().manual_seed(7)).to(q.dtype)
        options = causal_options(case)
        if case.Hq != case.Hkv:
            options["enable_gqa"] = True

        def call():
            q.grad = k.grad = v.grad = None
            out = sdpa(q, k, v, **options)
            out.backward(dout)
            return out.detach()

        return call, lambda out: out.float().transpose(1, 2).numpy()


# ---- qkv: one `qkv bench` process per round ---------------------------------------------------


class Qkv:
    def __init__(self, dtype, binary):
        self.dtype, self.label, self.binary = dtype, f"qkv-{dtype}", binary

    def command(self, case, threads, repeats, layout=None):
        shape = f"{case.B},{case.Hq},{case.Hkv},{case.Lq},{case.Lk},{case.D}"
        # Decode reads K/V as (B, H, L, D), the order of qkv's KvCache stores and of the torch
        # peers' tensors (its BSHD twin is timed in the same rounds); other cases BSHD.
        layout = layout or ("bhsd" if case.is_decode() else "bshd")
        # bf16: out in bf16 too (--out-dtype input), as torch's bf16 SDPA returns it.
        return [str(self.binary), "bench", "--json", "--shape", shape, "--dtype", self.dtype,
                "--threads", str(threads), "--repeats", str(repeats), "--layout", layout] + (
                    ["--causal"] if case.causal else []) + (
                    ["--out-dtype", "input"] if self.dtype != "f32" else [])

    def run(self, case, threads, repeats, layout=None):
        """Returns qkv bench's JSON object for the case; raises Skip when qkv refuses it."""
        proc = subprocess.run(self.command(case, threads, repeats, layout), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            raise Skip(lines[-1])
        return json.loads(proc.stdout.strip().splitlines()[-1])


class QkvTwin:
    """qkv on a variant of the case, timed in the same rounds as the case itself, so that a
    ratio between the two compares samples taken side by side (taken from two cases minutes
    apart, such a ratio moved by 10% on a shared host):
      non-causal  a causal case's shape without the mask (causal / non-causal effective rate)
      1 thread    the case on one thread (thread scaling: one-thread time / --threads time)
      bshd        a decode case with its arrays in BSHD (time / the (B, H, L, D) case's time)"""

    def __init__(self, qkv, kind):
        self.qkv, self.kind, self.label = qkv, kind, f"{qkv.label} {kind}"

    def run(self, case, threads, repeats):
        if self.kind == "non-causal":
            return self.qkv.run(replace(case, causal=False), threads, repeats)
        if self.kind == "bshd":
            return self.qkv.run(case, threads, repeats, layout="bshd")
        return self.qkv.run(case, 1, repeats)

    def ratio(self, case, case_seconds, twin_seconds):
        """The per-round figure quoted for this twin (its median over rounds is reported)."""
        if self.kind == "non-causal":
            full = replace(case, causal=False).flops() / case.flops()
            return twin_seconds / case_seconds / full
        return twin_seconds / case_seconds


def twins_for(qkv, case, args):
    kinds = ["non-causal"] if case.causal else []
    if args.threads > 1 and not case.causal and case.Lq in args.scaling:
        kinds.append("1 thread")
    if case.is_decode():
        kinds.append("bshd")
    return [QkvTwin(qkv, kind) for kind in kinds]


# ---- timing -----------------------------------------------------------------------------------


def eviction_mib():
    """qkv bench's read probe size (tools::read_probe_mib): 256 MiB, or twice the last-level
    cache where that is larger, at most a quarter of the memory (never under 256)."""
    def getconf(name):
        out = subprocess.run(["getconf", name], capture_output=True, text=True).stdout.strip()
        return int(out) if out.lstrip("-").isdigit() else 0
    cache = getconf("LEVEL3_CACHE_SIZE") or getconf("LEVEL2_CACHE_SIZE")
    memory_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    return min(max(256.0, 2 * max(cache, 0) / 2**20), max(256.0, memory_mib / 4))


class Evictor:
    """A buffer of eviction_mib(), read (untimed) before each timed call of a decode case, so that
    the call finds K and V in memory as a decode step does once the other layers' caches have
    run through (qkv bench sweeps its probe between repeats the same way). Without it, on a host
    whose L3 reads 480 MiB, the in-process peers' repeated calls read a 128 MiB bf16 cache
    partly from the L3 (docs/cli-bench-demo.md, "A last-level cache larger than the sweep")."""

    def __init__(self):
        import numpy as np
        self.buffer = np.ones(int(eviction_mib() * 2**20 // 4), dtype=np.int32)

    def __call__(self):
        # numpy's sum runs on this thread alone, so no thread pool is left spinning into the
        # timed call (with a torch sum here, the multi-head qkv.torch f32 step ran 0.82x
        # torch-mm's speed, against 1.02x with this, the next run).
        return int(self.buffer.sum(dtype="int64"))


def time_call(call, calls, evict=None):
    """Seconds per call: `calls` calls back to back, or (evict given) each after an untimed
    evict()."""
    if evict is None:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls
    total = 0.0
    for _ in range(calls):
        evict()
        start = time.perf_counter()
        call()
        total += time.perf_counter() - start
    return total / calls


def bench_case(case, impls, args, log):
    """Times every implementation on one case; returns {label: result dict}."""
    results, runners, outputs = {}, {}, {}
    _SHARED_BHSD.clear()
    data = make_inputs(case)
    twins = {}  # qkv label -> its twins (QkvTwin), timed in the same rounds
    for impl in impls:
        if isinstance(impl, Qkv):
            runners[impl.label] = impl
            twins[impl.label] = twins_for(impl, case, args)
            for twin in twins[impl.label]:
                runners[twin.label] = twin
            continue
        try:
            call, to_bshd = impl.prepare(case, data, args.threads)
            warm = time.perf_counter()
            out = call()
            warm = time.perf_counter() - warm
            outputs[impl.label] = to_bshd(out)
            if warm < SLOW_CALL_S:  # a second warm-up where it is cheap
                call()
            runners[impl.label] = (call, max(1, math.ceil(MIN_SAMPLE_S / max(warm, 1e-6))), warm)
        except NotApplicable:
            pass
        except Skip as why:
            results[impl.label] = {"skipped": str(why)}
        except (RuntimeError, TypeError, ValueError) as error:  # a peer's own refusal
            results[impl.label] = {"skipped": f"{type(error).__name__}: {str(error)[:120]}"}
    slow = any(isinstance(r, tuple) and r[2] > SLOW_CALL_S for r in runners.values())
    rounds = 3 if slow else args.rounds
    samples = {label: [] for label in runners}
    qkv_json = {label: [] for label in runners}
    order = list(runners)
    evict = Evictor() if case.is_decode() else None
    for round_index in range(rounds):
        # A fresh order each round (seeded: the same run twice times in the same orders), not a
        # rotation: a rotation keeps each implementation behind the same one in every round, and
        # on the VM of docs/benchmarks.md ("fifth session") an in-process call that came right
        # after a `qkv bench` process sometimes ran up to 1.8x slower, so a rotation charged that
        # to qkv.torch-f32 (behind qkv-bf16) in every round.
        for label in random.Random(round_index).sample(order, len(order)):
            runner = runners[label]
            if label in results:  # a qkv that refused in an earlier round
                continue
            time.sleep(0.05)  # let the previous implementation's spinning threads go idle
            if not isinstance(runner, tuple):  # Qkv or QkvTwin
                try:
                    row = runner.run(case, args.threads, 1 if slow else 3)
                except Skip as why:
                    results[label] = {"skipped": str(why)}
                    continue
                samples[label].append(row["seconds"])
                qkv_json[label].append(row)
                # --settle: the VM of docs/benchmarks.md ("sixth session") reports the memory a
                # qkv bench process frees to its host about 2 s after it exits, and in-process
                # rows timed then sometimes ran slower.
                time.sleep(args.settle)
            else:
                call, calls, _ = runner
                samples[label].append(time_call(call, calls, evict))
        log(f"  round {round_index + 1}/{rounds} done")
    twin_labels = {twin.label for group in twins.values() for twin in group}
    for label in runners:
        if label in results or label in twin_labels:
            continue
        seconds = statistics.median(samples[label])
        result = {"seconds": seconds, "rounds": len(samples[label]),
                  "gflops": FLOP_FACTOR * case.flops() / seconds / 1e9}
        if qkv_json[label]:
            rows = qkv_json[label]
            result["peak_gflops"] = statistics.median(r["peak_gflops"] for r in rows)
            # The product path each round ran (it may depend on the shape: qkv bench --help).
            result["products"] = "/".join(sorted({r.get("products", "?") for r in rows}))
            for key in ("read_gbytes_per_second", "kv_fraction_of_read_bandwidth",
                        "kv_fraction_of_read_between_repeats", "kv_fraction_of_kv_arrays_read",
                        "amx_softmax_together_over_sum"):
                if key in rows[0]:  # per process (same-process probes), median over rounds
                    result[key] = statistics.median(r[key] for r in rows)
        for twin in twins.get(label, []):
            if samples[twin.label] and twin.label not in results:
                result.setdefault("twins", {})[twin.kind] = statistics.median(
                    twin.ratio(case, c, t) for c, t in zip(samples[label], samples[twin.label]))
        results[label] = result
    agreement = peer_agreement(outputs)
    return {i.label: results[i.label] for i in impls if i.label in results}, agreement


def peer_agreement(outputs):
    """Max |difference| of the f32 peers' outputs against torch-f32 (a sanity check that the
    peers compute the same attention, causal alignment included)."""
    import numpy as np
    base = outputs.get("torch-f32")
    if base is None:
        return {}
    return {label: float(np.abs(out.astype(np.float32) - base).max())
            for label, out in outputs.items() if label != "torch-f32"}


# ---- report -----------------------------------------------------------------------------------


def peaks(all_results, dtype):
    values = [r["peak_gflops"] for res in all_results.values() for label, r in res.items()
              if label == f"qkv-{dtype}" and "peak_gflops" in r]
    return statistics.median(values) if values else None


def bandwidth(all_results):
    values = [r["read_gbytes_per_second"] for res in all_results.values() for r in res.values()
              if "read_gbytes_per_second" in r]
    return statistics.median(values) if values else None


def amx_overlap(all_results):
    """Median of qkv's AMX overlap probe over its bf16 processes (0 or absent without AMX): the
    tiles and the softmax's vector code together, over the sum of the two alone."""
    values = [r["amx_softmax_together_over_sum"] for res in all_results.values()
              for r in res.values() if r.get("amx_softmax_together_over_sum", 0) > 0]
    return statistics.median(values) if values else None


def ratios(results):
    """{dtype: (qkv / best peer speed ratio, best peer label)} and the overall ratio."""
    out = {}
    fastest = {}
    for label, r in results.items():
        if "seconds" in r:
            fastest[label] = r["seconds"]
    peers = {k: v for k, v in fastest.items() if not k.startswith("qkv")}
    for dtype in ("f32", "bf16"):
        mine = fastest.get(f"qkv-{dtype}")
        same = {k: v for k, v in peers.items() if k.endswith(dtype)}
        if mine and same:
            best = min(same, key=same.get)
            out[dtype] = (same[best] / mine, best)
    mine = [v for k, v in fastest.items() if k.startswith("qkv-")]
    if mine and peers:
        best = min(peers, key=peers.get)
        out["any"] = (peers[best] / min(mine), best)
    return out


def gemm_reference(torch, rounds, log, n=4096, max_call_seconds=2.0):
    """{dtype: (median GFLOP/s, size)} of torch.mm on two size x size matrices, f32 and bf16
    (--rounds rounds, each the median of 3 calls after 2 untimed ones). size is n, or halved
    until one call is projected to take at most max_call_seconds from a 512^3 call (torch's
    bf16 on a CPU without bf16 instructions ran 1.3 GFLOP/s at 512^3 on an AMD EPYC Zen 2,
    2026-12-06, and the 4096^3 rounds had not finished after 50 minutes there)."""
    out = {}
    for dtype, torch_dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        generator = torch.Generator().manual_seed(3)
        small = torch.randn(512, 512, generator=generator).to(torch_dtype)
        torch.mm(small, small)
        start = time.perf_counter()
        torch.mm(small, small)
        small_rate = 2.0 * 512 ** 3 / (time.perf_counter() - start)
        size = n
        while size > 512 and 2.0 * size ** 3 / small_rate > max_call_seconds:
            size //= 2
        a = torch.randn(size, size, generator=generator).to(torch_dtype)
        b = torch.randn(size, size, generator=generator).to(torch_dtype)
        rates = []
        for _ in range(rounds):
            for _ in range(2):
                torch.mm(a, b)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - start)
            rates.append(2.0 * size ** 3 / statistics.median(times) / 1e9)
        out[dtype] = (statistics.median(rates), size)
        log(f"torch.mm {size}^3 {dtype}: {out[dtype][0]:.1f} GFLOP/s")
    return out


def report(all_results, agreements, threads, gemm=None):
    peak = {d: peaks(all_results, d) for d in ("f32", "bf16")}
    read_bw = bandwidth(all_results)
    lines = []
    if peak["f32"]:
        lines.append(f"qkv measured: fp32 FMA peak {peak['f32']:.1f} GFLOP/s"
                     + (f", bf16 peak {peak['bf16']:.1f}" if peak["bf16"] else "")
                     + (f", streaming read {read_bw:.1f} GB/s" if read_bw else ""))
    if gemm:
        parts = []
        for dtype, (rate, size) in gemm.items():
            limit = peak.get(dtype)
            share = f" ({100 * rate / limit:.0f}% of qkv's {dtype} probe)" if limit else ""
            parts.append(f"{dtype} {size}^3 {rate:.1f} GFLOP/s{share}")
        lines.append("a plain GEMM, same run: torch.mm " + ", ".join(parts))
    if amx_overlap(all_results):
        lines.append(f"qkv measured: AMX tiles beside the softmax's vector code take "
                     f"{amx_overlap(all_results):.2f}x the sum of the two alone (1 = they take "
                     f"turns; docs/kernels.md, \"The ceiling\")")
    header = (f"{'shape (B,Hq,Hkv,Lq,Lk,D)':<32} {'impl':<13} {'median ms':>10} "
              f"{'GFLOP/s':>8} {'%peak':>6} {'GB/s':>6} {'%bw':>5}")
    lines += [header, "-" * len(header)]
    for case, results in all_results.items():
        for label, r in results.items():
            if "skipped" in r:
                lines.append(f"{case.name():<32} {label:<13} skipped: {r['skipped']}")
                continue
            dtype = label.rsplit("-", 1)[1]
            # qkv rows: the peak of the products that ran (a bf16 row may have widened).
            row_peak = r.get("peak_gflops") or peak.get(dtype) or peak["f32"]
            pct = f"{100 * r['gflops'] / row_peak:5.0f}%" if row_peak else "   n/a"
            gbs = bw = ""
            if case.is_decode():
                rate = case.kv_bytes(dtype) / r["seconds"] / 1e9
                gbs = f"{rate:6.1f}"
                bw = f"{100 * rate / read_bw:4.0f}%" if read_bw else ""
            lines.append(f"{case.name():<32} {label:<13} {1e3 * r['seconds']:10.2f} "
                         f"{r['gflops']:8.1f} {pct:>6} {gbs:>6} {bw:>5}")
        products = ", ".join(f"{label} {r['products']}" for label, r in results.items()
                             if "products" in r)
        if products:
            lines.append(f"{'':<32} qkv products: {products}")
        summary = ", ".join(f"{dtype}: {ratio:.2f}x vs {best}"
                            for dtype, (ratio, best) in ratios(results).items())
        if summary:
            lines.append(f"{'':<32} qkv / best peer  {summary}")
        for kind, text in (("non-causal", "qkv causal / non-causal (effective GFLOP/s, "
                                          "same rounds)"),
                           ("1 thread", f"qkv thread scaling 1 -> {threads} (same rounds)"),
                           ("bshd", "qkv bench with BSHD arrays / with (B, H, L, D) ones, time "
                                    "(same rounds)")):
            same_rounds = ", ".join(f"{label[4:]} {r['twins'][kind]:.2f}"
                                    for label, r in results.items()
                                    if kind in r.get("twins", {}))
            if same_rounds:
                lines.append(f"{'':<32} {text}: {same_rounds}")
        module = []
        for dtype in ("f32", "bf16"):
            py, cli, peer = (results.get(f"{kind}-{dtype}", {}).get("seconds")
                             for kind in ("qkv.torch", "qkv", "torch"))
            if py and cli and peer:
                module.append(f"{dtype} {peer / py:.2f}x vs {peer / cli:.2f}x "
                              f"(module / CLI {cli / py:.2f})")
        if module:
            lines.append(f"{'':<32} qkv.torch / torch vs qkv bench / torch: " + ", ".join(module))
        if case.is_decode():
            same_process = ", ".join(
                f"{label[4:]} {r['kv_fraction_of_read_bandwidth']:.2f} (between repeats "
                f"{r.get('kv_fraction_of_read_between_repeats', 0):.2f}, its own K/V arrays "
                f"{r.get('kv_fraction_of_kv_arrays_read', 0):.2f})"
                for label, r in results.items() if "kv_fraction_of_read_bandwidth" in r)
            if same_process:
                lines.append(f"{'':<32} qkv K/V read / read probe of its own process "
                             f"(median of rounds): {same_process}")
        if agreements.get(case):
            lines.append(f"{'':<32} peers vs torch-f32 max|diff|: " + ", ".join(
                f"{k} {v:.1e}" for k, v in agreements[case].items()))
    return "\n".join(lines)


class OtherLoad:
    """CPU time that other processes used while the benchmark ran (all CPUs' busy time from
    /proc/stat minus this process's and its children's): they shift the ratios."""

    def __init__(self):
        self.start = self.sample()

    @staticmethod
    def sample():
        try:
            with open("/proc/stat") as stat:
                fields = [int(x) for x in stat.readline().split()[1:]]
        except OSError:
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy - (own.user + own.system + own.children_user +
                                         own.children_system)

    def note(self):
        end = self.sample()
        if self.start is None or end is None:
            return "other processes' CPU use: unknown (no /proc/stat)"
        cores = (end[1] - self.start[1]) / (end[0] - self.start[0])
        note = f"other processes used {max(cores, 0):.2f} cores on average during the run"
        if cores > 0.1:
            note += ": treat the figures as noisy and rerun on a quiet machine"
        return note


def plot(all_results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(c.D, c.causal) for c in all_results if not c.is_decode()})
    labels = sorted({k for res in all_results.values() for k, r in res.items() if "gflops" in r})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (D, causal) in zip(axes[0], groups):
        cases = sorted((c for c in all_results if (c.D, c.causal) == (D, causal)
                        and not c.is_decode()), key=lambda c: c.Lk)
        for index, label in enumerate(labels):
            pts = [(c.Lk, all_results[c][label]["gflops"]) for c in cases
                   if "gflops" in all_results[c].get(label, {})]
            if pts:  # one colour per implementation across panels
                ax.plot(*zip(*pts), marker="o", label=label, color=f"C{index}",
                        linestyle="-" if label.startswith("qkv") else "--")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L (= Lq = Lk)")
        ax.set_ylabel("effective GFLOP/s" if causal else "GFLOP/s")
        ax.set_title(f"D={D}{' causal' if causal else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(
        description="qkv attention vs PyTorch SDPA and ONNX Runtime, same run, same threads.")
    parser.add_argument("--quick", action="store_true", help="L in {1024, 4096} + decode")
    parser.add_argument("--model-shapes", action="store_true",
                        help="real models' shapes instead (batched encoders, GQA prefill)")
    parser.add_argument("--lengths", help="comma list of L instead of the default set")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait after each qkv bench process (default 0)")
    parser.add_argument("--scaling", default="4096",
                        help="comma list of L whose non-causal cases also time qkv on one "
                             "thread in the same rounds (thread scaling); empty: none")
    parser.add_argument("--impls", help="comma list of implementation labels to run")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode cases")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the decode cases (GQA 32:8, multi-head 32 heads, and GQA "
                        "32:8 with four draft tokens)")
    parser.add_argument("--ort-max-mib", type=float, default=3072,
                        help="skip ORT's unfused (causal) path above this many MiB of scores")
    parser.add_argument("--qkv", default=str(ROOT / "build" / "release" / "qkv"))
    parser.add_argument("--python-module", default=str(ROOT / "build" / "release" / "python"),
                        help="folder holding the qkv Python package (qkv.torch-* rows; "
                             "scripts/test.sh builds it there)")
    parser.add_argument("--training", action="store_true",
                        help="forward + backward through torch SDPA and qkv.torch (see above)")
    parser.add_argument("--png", help="write GFLOP/s against L per implementation")
    parser.add_argument("--json", help="write every measurement as JSON")
    args = parser.parse_args()
    args.scaling = {int(x) for x in args.scaling.split(",") if x}
    ensure_venv(__file__, ["onnxruntime", "torch"])
    import onnxruntime
    import torch

    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else [1024, 4096] if args.quick else [1024, 4096, 16384])
    cases = model_cases() if args.model_shapes else default_cases(lengths)
    if args.no_decode and args.decode_only:
        parser.error("--no-decode and --decode-only leave nothing to run")
    if not args.settle >= 0:
        parser.error(f"--settle must be a number of seconds >= 0, got {args.settle}")
    if args.no_decode:
        cases = [c for c in cases if not c.is_decode()]
    if args.decode_only:
        cases = [c for c in cases if c.is_decode()]
    impls = [TorchSdpa("f32"), TorchSdpa("bf16"), TorchMatmulDecode("f32"),
             TorchMatmulDecode("bf16"), OrtMha(args.ort_max_mib), OrtGqaDecode()]
    if Path(args.qkv).exists():
        impls += [Qkv("f32", args.qkv), Qkv("bf16", args.qkv)]
    else:
        print(f"note: {args.qkv} not found (scripts/build.sh builds it); not timing qkv's CLI")
    if (Path(args.python_module) / "qkv").is_dir():
        impls += [QkvTorchOp("f32", args.python_module), QkvTorchOp("bf16", args.python_module)]
    else:
        print(f"note: no Python module under {args.python_module} (scripts/test.sh builds "
              "it); not timing qkv.torch")
    if args.training:
        global FLOP_FACTOR
        FLOP_FACTOR = 3.5
        cases = [c for c in cases if not c.is_decode()]
        impls = [Training("f32", "torch-f32"), Training("bf16", "torch-bf16"),
                 Training("f32", "qkv-f32", args.python_module),
                 Training("bf16", "qkv-bf16", args.python_module)]
        args.scaling = set()
    if args.impls:
        wanted = set(args.impls.split(","))
        impls = [i for i in impls if i.label in wanted]

    def log(message):
        print(message, file=sys.stderr, flush=True)

    log(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"{args.threads} threads, {len(cases)} cases")
    others = OtherLoad()
    all_results, agreements = {}, {}
    for index, case in enumerate(cases):
        log(f"[{index + 1}/{len(cases)}] {case.name()}")
        all_results[case], agreements[case] = bench_case(case, impls, args, log)
    gemm = None
    if not args.training and not args.decode_only:
        gemm = gemm_reference(torch, args.rounds, log)
    if args.training:
        print("training step: forward + backward; GFLOP/s counts 3.5x the forward's FLOPs")
    print(report(all_results, agreements, args.threads, gemm))
    print(others.note())
    if args.png:
        plot(all_results, args.png)
        print(f"wrote {args.png}")
    if args.json:
        rows = [{"B": c.B, "Hq": c.Hq, "Hkv": c.Hkv, "Lq": c.Lq, "Lk": c.Lk, "D": c.D,
                 "causal": c.causal, "impl": label, "threads": args.threads, **r}
                for c, res in all_results.items() for label, r in res.items()]
        meta = {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                "threads": args.threads, "peak_gflops_f32": peaks(all_results, "f32"),
                "read_gbytes_per_second": bandwidth(all_results),
                "amx_softmax_together_over_sum": amx_overlap(all_results),
                "torch_mm_gflops": {d: rate for d, (rate, _) in (gemm or {}).items()},
                "torch_mm_size": {d: size for d, (_, size) in (gemm or {}).items()}}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
