#!/usr/bin/env python3
"""Sentence-embedding throughput of all-MiniLM-L6-v2: `qkv embed` against PyTorch and ONNX
Runtime in the same run, same threads, same texts (issue 3's benchmark).

    python3 scripts/bench_embed_peers.py [--threads N] [--sentences S] [--repeats R] [--bf16]
                                         [--memory]

Workload: S sentences (default 256), each tokenizing to at least 128 word pieces, so that every
row of every batch is exactly 128 tokens after truncation (checked with the HF tokenizer), run
in batches of 32 on N threads (default 2). Each implementation embeds all S sentences per
repeat; reported: median seconds over repeats (implementations interleaved, rotating order),
sentences/s, and qkv / peer throughput ratios (> 1: qkv faster).

Implementations:
  torch      sentence-transformers' model.encode(texts, batch_size=32) with max_seq_length 128,
             float32, torch.inference_mode, torch.set_num_threads(N) (tokenisation included, as
             a user runs it)
  ort        the BERT encoder + mean pooling + L2 normalisation exported once with
             torch.onnx.export (opset 17, dynamic batch and sequence axes) into
             .cache/bench_embed/, run with all graph optimisations (ORT_ENABLE_ALL fuses
             attention, LayerNorm, GELU), intra_op_num_threads N; the fast tokenizer
             (tokenizer.json) pads and truncates each batch to 128; tokenisation included
  ort-opt    the same graph after onnxruntime.transformers' BERT optimizer (fused Attention,
             SkipLayerNorm, BiasGelu), when that optimizer loads
  qkv        `build/release/qkv embed --model DIR --input FILE --out E.npy --threads N
             --batch-size 32 --max-length 128`, one process per repeat: its wall time includes
             starting the process and loading the model, which the peers (loaded once, before
             timing) do not pay. "qkv steady" subtracts the wall time of a 1-sentence run (the
             start-up cost), so the two bracket qkv's throughput.

--bf16 adds the bf16 runs a user on a bf16 server would compare:
  torch-bf16   model.encode under torch.autocast("cpu", torch.bfloat16): bf16 matrix products,
               LayerNorm and softmax in f32 (the split `qkv embed --dtype bf16` makes)
  torch-bf16w  a second SentenceTransformer with its weights cast to bf16 (model.to(bfloat16)):
               everything in bf16, the fastest way torch runs it
  qkv-bf16     `qkv embed ... --dtype bf16` (and "qkv-bf16 steady", as above)
and compares qkv-bf16 with the two bf16 peers.

Agreement: the max |difference| of each implementation's embeddings against torch's, and the
smallest cosine between them.

--memory runs `qkv embed` on 1,000 and on 10,000 sentences under /usr/bin/time -v and prints
the maximum resident set size of both: it should be flat (texts are streamed in batches).

Needs nothing installed: it re-runs itself in .cache/venv-peers (scripts/peers_venv.sh).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_embed"
BATCH = 32
MAX_LENGTH = 128

# Sentence pieces mixed by a seeded generator into texts of 150+ word pieces.
PHRASES = [
    "the committee approved the new budget after a long debate",
    "rain is expected to continue through the weekend in the northern valleys",
    "researchers measured the thermal conductivity of the thin films at low temperatures",
    "she bought fresh bread, cheese and a bottle of olive oil at the market",
    "the algorithm sorts the records by timestamp before merging overlapping intervals",
    "a small boat drifted slowly towards the lighthouse on the rocky coast",
    "investors reacted cautiously to the quarterly earnings report",
    "the museum's new exhibition explores the history of early photography",
    "children played football in the park until the streetlights came on",
    "the compiler inlines small functions and unrolls loops with known trip counts",
    "a sudden gust of wind scattered the papers across the courtyard",
    "the orchestra rehearsed the second movement three times before the concert",
    "engineers replaced the worn bearings and recalibrated the sensors",
    "the novel follows two sisters who inherit a crumbling house by the sea",
    "heavy traffic delayed the delivery of medical supplies to the hospital",
    "the recipe calls for two cups of flour, a pinch of salt and warm water",
    "astronomers detected a faint signal from a distant galaxy cluster",
    "the city council voted to extend the bicycle lanes along the river",
    "after the update the application started noticeably faster on older phones",
    "the hikers reached the summit just before the clouds rolled in",
]


sys.path.insert(0, str(ROOT / "scripts"))
from peers_env import ensure_venv, model_dir  # noqa: E402
from bench_attention_peers import OtherLoad  # noqa: E402  (one copy of the CPU-use meter)


def fast_tokenizer(directory):
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.enable_truncation(max_length=MAX_LENGTH)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    return tok


def make_texts(count, tokenizer, seed=0):
    """count distinct one-line texts that each tokenize to >= MAX_LENGTH word pieces."""
    import random
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        parts = [f"Report {index}:"]
        while True:
            parts.append(rng.choice(PHRASES).capitalize() + ".")
            text = " ".join(parts)
            if len(parts) > 12 and len(tokenizer.encode(text).ids) >= MAX_LENGTH:
                break
        texts.append(text)
    return texts


# ---- implementations: prepare() loads once; the returned callable embeds a list of texts ------


def torch_impl(directory, threads, mode="f32"):
    """mode: "f32"; "autocast" (bf16 products under torch.autocast); "bf16" (bf16 weights)."""
    import contextlib

    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(threads)
    model = SentenceTransformer(str(directory), device="cpu")
    model.max_seq_length = MAX_LENGTH
    if mode == "bf16":
        model.to(torch.bfloat16)

    def embed(texts):
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast"
                    else contextlib.nullcontext())
        with torch.inference_mode(), autocast:
            out = model.encode(texts, batch_size=BATCH, convert_to_tensor=True)
            return out.float().numpy()

    return embed


def pooled_and_normalized(bert):
    """BertModel -> mean over real tokens -> L2 normalisation (modules.json's pipeline)."""
    import torch

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            # hidden: [B, L, E]; mask: [B, L, 1]
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)

    return Embed().eval()


def export_onnx(directory):
    """Exports the encoder + pooling + normalisation once; returns the .onnx path."""
    import torch
    from transformers import AutoModel
    path = WORK / "minilm_embed.onnx"
    if path.exists():
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    # eager attention: plain MatMul/Softmax in the graph, which ORT's fusions recognise.
    bert = AutoModel.from_pretrained(str(directory), attn_implementation="eager").eval()
    module = pooled_and_normalized(bert)
    ids = torch.randint(1000, 2000, (2, 16))
    axes = {0: "batch", 1: "sequence"}
    tmp = path.with_suffix(".tmp.onnx")
    torch.onnx.export(module, (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(tmp),
                      input_names=["input_ids", "attention_mask", "token_type_ids"],
                      output_names=["embedding"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                    "token_type_ids": axes, "embedding": {0: "batch"}})
    tmp.rename(path)
    return path


def bert_optimized(path, config):
    """The graph after onnxruntime.transformers' BERT optimizer, or None where it fails."""
    out = path.with_name("minilm_embed_opt.onnx")
    if out.exists():
        return out
    try:
        from onnxruntime.transformers import optimizer
        model = optimizer.optimize_model(str(path), model_type="bert",
                                         num_heads=config["num_attention_heads"],
                                         hidden_size=config["hidden_size"])
        model.save_model_to_file(str(out))
        return out
    except Exception as error:  # an optional variant: report and go on without it
        print(f"note: onnxruntime.transformers optimizer unavailable: {error}", file=sys.stderr)
        return None


def ort_impl(path, directory, threads):
    import numpy as np
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    tokenizer = fast_tokenizer(directory)

    def embed(texts):
        rows = []
        for start in range(0, len(texts), BATCH):
            batch = tokenizer.encode_batch(texts[start:start + BATCH])
            feeds = {"input_ids": np.array([e.ids for e in batch], np.int64),
                     "attention_mask": np.array([e.attention_mask for e in batch], np.int64),
                     "token_type_ids": np.array([e.type_ids for e in batch], np.int64)}
            rows.append(session.run(None, feeds)[0])
        return np.concatenate(rows)

    return embed


class QkvEmbed:
    def __init__(self, binary, directory, threads, dtype="f32"):
        self.binary, self.directory, self.threads = binary, directory, threads
        self.dtype = dtype

    def command(self, input_file, out_file):
        return [str(self.binary), "embed", "--model", str(self.directory), "--input",
                str(input_file), "--out", str(out_file), "--threads", str(self.threads),
                "--batch-size", str(BATCH), "--max-length", str(MAX_LENGTH),
                "--dtype", self.dtype]

    def write_input(self, texts, name):
        path = WORK / name
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
        return path

    def supported(self):
        """None when `qkv embed` runs with the options above, else why not."""
        if not Path(self.binary).exists():
            return f"{self.binary} not found (scripts/build.sh builds it)"
        probe = self.write_input(["hello world"], "probe.txt")
        proc = subprocess.run(self.command(probe, WORK / "probe.npy"), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return None

    def embedder(self, texts, name):
        """A callable that embeds `texts` in one qkv process and returns the (N, E) array."""
        import numpy as np
        input_file = self.write_input(texts, name + ".txt")
        out_file = WORK / (name + ".npy")

        def embed(_texts=None):
            subprocess.run(self.command(input_file, out_file), check=True, capture_output=True)
            return np.load(out_file)

        return embed


# ---- measurements -----------------------------------------------------------------------------


def time_interleaved(impls, texts, repeats, log):
    """{name: [seconds per repeat]} with the implementations in rotating order each repeat."""
    names = list(impls)
    samples = {name: [] for name in names}
    outputs = {}
    for name in names:  # warm-up: first-call costs (allocation, primitive creation, caches)
        outputs[name] = impls[name](texts)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            time.sleep(0.05)  # let the previous implementation's spinning threads go idle
            start = time.perf_counter()
            impls[name](texts)
            samples[name].append(time.perf_counter() - start)
        log(f"  repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{n} {samples[n][-1]:.2f} s" for n in names))
    return samples, outputs


def wall_seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def agreement(outputs, base="torch"):
    import numpy as np
    ref = outputs[base].astype(np.float64)
    lines = []
    for name, out in outputs.items():
        if name == base:
            continue
        out = out.astype(np.float64)
        if out.shape != ref.shape:
            lines.append(f"{name}: shape {out.shape} vs {base} {ref.shape}")
            continue
        cos = (out * ref).sum(1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1))
        lines.append(f"{name} vs {base}: max|diff| {np.abs(out - ref).max():.2e}, "
                     f"min cosine {cos.min():.7f}")
    return lines


def max_rss_kib(command):
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    for line in proc.stderr.splitlines():
        if "Maximum resident set size" in line:
            return int(line.split(":")[-1])
    raise RuntimeError("no 'Maximum resident set size' in /usr/bin/time -v output")


def memory_check(qkv, tokenizer):
    base = make_texts(200, tokenizer, seed=1)
    rows = []
    for count in (1000, 10000):
        texts = [f"{base[i % len(base)]} ({i})" for i in range(count)]
        input_file = qkv.write_input(texts, f"memory_{count}.txt")
        start = time.perf_counter()
        kib = max_rss_kib(qkv.command(input_file, WORK / f"memory_{count}.npy"))
        rows.append((count, kib, time.perf_counter() - start))
    for count, kib, seconds in rows:
        print(f"qkv embed {count:>6} sentences: max RSS {kib / 1024:7.1f} MiB "
              f"({seconds:.1f} s, {count / seconds:.0f} sentences/s)")
    print(f"max RSS 10,000 / 1,000 sentences: {rows[1][1] / rows[0][1]:.3f} "
          f"(the (N, 384) float32 output itself is {10000 * 384 * 4 / 2**20:.1f} MiB at 10,000)")


def main():
    parser = argparse.ArgumentParser(
        description="all-MiniLM-L6-v2 throughput: qkv embed vs PyTorch and ONNX Runtime.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=256,
                        help="sentences per repeat (a multiple of 32 keeps batches full)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true",
                        help="also torch under bf16 autocast, torch with bf16 weights and "
                        "qkv embed --dtype bf16")
    parser.add_argument("--memory", action="store_true",
                        help="also: max RSS of qkv embed on 1,000 and 10,000 sentences")
    parser.add_argument("--qkv", default=str(ROOT / "build" / "release" / "qkv"))
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    ensure_venv(__file__, ["onnxruntime", "sentence_transformers"])
    import json

    import onnxruntime
    import torch

    def log(message):
        print(message, file=sys.stderr, flush=True)

    directory = model_dir()
    WORK.mkdir(parents=True, exist_ok=True)
    tokenizer = fast_tokenizer(directory)
    texts = make_texts(args.sentences, tokenizer)
    lengths = {len(e.ids) for e in tokenizer.encode_batch(texts)}
    assert lengths == {MAX_LENGTH}, lengths  # every row exactly 128 tokens after truncation

    log(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, {args.threads} "
        f"threads, {len(texts)} sentences x {MAX_LENGTH} tokens, batch {BATCH}")
    impls = {"torch": torch_impl(directory, args.threads)}
    onnx_path = export_onnx(directory)
    impls["ort"] = ort_impl(onnx_path, directory, args.threads)
    config = json.loads((directory / "config.json").read_text())
    optimized = bert_optimized(onnx_path, config)
    if optimized is not None:
        impls["ort-opt"] = ort_impl(optimized, directory, args.threads)
    qkv = QkvEmbed(args.qkv, directory, args.threads)
    why_not = qkv.supported()
    qkv_runs = {}  # label -> the 1-sentence run whose wall time is qkv's start-up cost
    if why_not is None:
        impls["qkv"] = qkv.embedder(texts, "bench")
        qkv_runs["qkv"] = qkv.embedder(texts[:1], "startup")
    else:
        print(f"qkv skipped: `qkv embed` does not run yet: {why_not}")
    if args.bf16:
        impls["torch-bf16"] = torch_impl(directory, args.threads, "autocast")
        impls["torch-bf16w"] = torch_impl(directory, args.threads, "bf16")
        qkv_bf16 = QkvEmbed(args.qkv, directory, args.threads, "bf16")
        why_not_bf16 = qkv_bf16.supported()
        if why_not_bf16 is None:
            impls["qkv-bf16"] = qkv_bf16.embedder(texts, "bench-bf16")
            qkv_runs["qkv-bf16"] = qkv_bf16.embedder(texts[:1], "startup-bf16")
        else:
            print(f"qkv-bf16 skipped: {why_not_bf16}")

    others = OtherLoad()
    samples, outputs = time_interleaved(impls, texts, args.repeats, log)
    median = {name: statistics.median(s) for name, s in samples.items()}
    for name, startup in qkv_runs.items():
        startup_s = statistics.median(wall_seconds(startup) for _ in range(3))
        median[name + " steady"] = max(median[name] - startup_s, 1e-9)

    print(f"all-MiniLM-L6-v2, {len(texts)} sentences x {MAX_LENGTH} tokens, batch {BATCH}, "
          f"{args.threads} threads, median of {args.repeats}")
    print(f"{'impl':<17} {'seconds':>8} {'sentences/s':>12}")
    for name, seconds in median.items():
        print(f"{name:<17} {seconds:8.3f} {len(texts) / seconds:12.1f}")
    # f32 qkv against the f32 peers, bf16 qkv against the bf16 peers.
    for mine in ("qkv", "qkv steady", "qkv-bf16", "qkv-bf16 steady"):
        if mine not in median:
            continue
        peers = [p for p in median
                 if not p.startswith("qkv") and ("bf16" in p) == ("bf16" in mine)]
        print(f"{mine} / peer throughput: " + ", ".join(
            f"{peer} {median[peer] / median[mine]:.2f}x" for peer in peers))
    for line in agreement(outputs):
        print(line)
    print(others.note())
    if args.memory:
        if why_not is None:
            memory_check(qkv, tokenizer)
        else:
            print(f"--memory skipped: {why_not}")


if __name__ == "__main__":
    main()
