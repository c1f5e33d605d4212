"""The attention case table shared by the CLI tests (test_cli_attention.py) and the Python
module's tests (module/): each mask kind alone, then combined, with the float64 / plain float32
references and DESIGN.md section 5's tolerance check.

Shapes are (B, Lq, Hq, D) etc. as in DESIGN.md; `problem` dicts hold the inputs and options
(align spelled as the CLI does: "top-left", "bottom-right").
"""

import numpy as np

import reference as ref


def make_problem(rng, batch=2, seq_q=5, seq_kv=7, num_heads_q=4, num_heads_kv=2, head_dim=8,
                 head_dim_v=None, data_scale=1.0, **options):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    def normal(*shape):
        return (rng.standard_normal(shape) * data_scale).astype(np.float32)
    problem = dict(q=normal(batch, seq_q, num_heads_q, head_dim),
                   k=normal(batch, seq_kv, num_heads_kv, head_dim),
                   v=normal(batch, seq_kv, num_heads_kv, head_dim_v))
    problem.update(options)
    return problem


def references(problem, round_fn=None):
    """(out, lse, weights) in float64 and in plain float32, on inputs rounded by round_fn (the
    plain one then also rounds the probabilities by it, as the vdpbf16ps and AMX paths do)."""
    inputs = {name: problem[name] for name in ("q", "k", "v")}
    if round_fn is not None:
        inputs = {name: round_fn(value) for name, value in inputs.items()}
    options = {key: problem[key] for key in ("scale", "softcap", "causal", "align", "window",
                                             "key_lengths", "mask", "bias") if key in problem}
    return (ref.attention(**inputs, **options, dtype=np.float64),
            ref.attention(**inputs, **options, dtype=np.float32, store=round_fn))


def cli_options(problem, save):
    """The `qkv attention` options (scores and masks) for `problem`; save(name, array) stores an
    array as a .npy file and returns its path."""
    args = []
    if problem.get("scale") is not None:
        args += ["--scale", repr(problem["scale"])]
    if problem.get("softcap"):
        args += ["--softcap", repr(problem["softcap"])]
    if problem.get("causal"):
        args += ["--causal"]
    if problem.get("align"):
        args += ["--align", problem["align"]]
    if problem.get("window"):
        args += ["--window", "%d,%d" % problem["window"]]
    for key, option in (("key_lengths", "--key-lengths"), ("mask", "--mask"), ("bias", "--bias")):
        if problem.get(key) is not None:
            args += [option, save(f"{key}.npy", problem[key])]
    return args


def check_close(actual, ref64, ref32, what):
    assert actual.dtype == np.float32, what
    assert actual.shape == ref64.shape, f"{what}: shape {actual.shape} != {ref64.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in the output"
    infinite = np.isneginf(ref64)
    assert np.array_equal(np.isneginf(actual), infinite), f"{what}: -inf entries differ"
    finite = ~infinite
    if not finite.any():
        return
    error = float(np.max(np.abs(actual[finite].astype(np.float64) - ref64[finite])))
    tolerance = ref.tolerance(np.where(finite, ref64, 0), np.where(finite, ref32, 0))
    assert error <= tolerance, f"{what}: max abs error {error:.3g} > tolerance {tolerance:.3g}"


# ---------------------------------------------------------------------------------------------
# One table of cases: each mask kind alone, then combined. Default shape: B=2, Lq=5, Lk=7,
# Hq=4, Hkv=2, D=Dv=8.

def random_mask(rng, shape, p=0.6):
    return rng.random(shape) < p


CASES = {
    "plain": lambda rng: make_problem(rng),
    "scale": lambda rng: make_problem(rng, scale=0.375),
    "softcap": lambda rng: make_problem(rng, softcap=2.5, data_scale=2.0),
    "causal_bottom_right": lambda rng: make_problem(rng, seq_q=5, seq_kv=9, causal=True),
    # Lq > Lk, bottom-right: the first Lq - Lk rows see no key at all.
    "causal_bottom_right_lq_gt_lk": lambda rng: make_problem(rng, seq_q=9, seq_kv=5, causal=True),
    "causal_top_left": lambda rng: make_problem(rng, seq_q=5, seq_kv=9, causal=True,
                                                align="top-left"),
    "causal_top_left_lq_gt_lk": lambda rng: make_problem(rng, seq_q=9, seq_kv=5, causal=True,
                                                         align="top-left"),
    "window_both": lambda rng: make_problem(rng, seq_q=7, seq_kv=7, window=(2, 1)),
    "window_left": lambda rng: make_problem(rng, seq_q=5, seq_kv=9, window=(3, -1)),
    "window_right_top_left": lambda rng: make_problem(rng, seq_q=9, seq_kv=5, window=(-1, 2),
                                                      align="top-left"),
    "window_diagonal_only": lambda rng: make_problem(rng, seq_q=9, seq_kv=5, window=(0, 0)),
    "window_causal": lambda rng: make_problem(rng, seq_q=6, seq_kv=11, window=(3, -1),
                                              causal=True),
    # Sides at or beyond every key, up to INT64_MAX: unbounded, never an overflow (issue 18).
    "window_int64_max_both": lambda rng: make_problem(rng, seq_q=9, seq_kv=5,
                                                      window=(2**63 - 1, 2**63 - 1)),
    "window_int64_max_right": lambda rng: make_problem(rng, seq_q=9, seq_kv=5,
                                                       window=(-1, 2**63 - 1)),
    "window_int64_max_left_causal": lambda rng: make_problem(rng, seq_q=9, seq_kv=5,
                                                             window=(2**63 - 1, -1), causal=True),
    "window_just_wide_enough": lambda rng: make_problem(rng, seq_q=5, seq_kv=9, window=(8, 4),
                                                        align="top-left"),
    "key_lengths_int32": lambda rng: make_problem(rng, key_lengths=np.array([3, 7], np.int32)),
    "key_lengths_int64_zero": lambda rng: make_problem(rng,
                                                       key_lengths=np.array([0, 5], np.int64)),
    "mask_full": lambda rng: make_problem(rng, mask=random_mask(rng, (2, 4, 5, 7))),
    "mask_keys": lambda rng: make_problem(rng, mask=random_mask(rng, (2, 1, 1, 7))),
    "mask_2d": lambda rng: make_problem(rng, mask=random_mask(rng, (5, 7))),
    "mask_1d": lambda rng: make_problem(rng, mask=random_mask(rng, (7,), 0.7)),
    "mask_heads": lambda rng: make_problem(rng, mask=random_mask(rng, (4, 1, 1), 0.5)),
    "mask_uint8": lambda rng: make_problem(
        rng, mask=rng.choice(np.array([0, 1, 7, 255], np.uint8), size=(2, 4, 5, 7))),
    "mask_scalar_true": lambda rng: make_problem(rng, mask=np.array(True)),
    "mask_scalar_false": lambda rng: make_problem(rng, mask=np.array(False)),
    "mask_empty_rows": lambda rng: make_problem(
        rng, mask=np.array([[True] * 7, [False] * 7, [True, False] * 3 + [True], [False] * 7,
                            [False] * 6 + [True]])),
    "bias_full": lambda rng: make_problem(rng, bias=rng.standard_normal((2, 4, 5, 7)).astype(
        np.float32)),
    "bias_keys": lambda rng: make_problem(rng, bias=rng.standard_normal((2, 1, 1, 7)).astype(
        np.float32)),
    "bias_neg_inf": lambda rng: make_problem(rng, bias=np.where(
        random_mask(rng, (5, 7), 0.7), rng.standard_normal((5, 7)), -np.inf).astype(np.float32)),
    "bias_neg_inf_rows": lambda rng: make_problem(rng, bias=np.where(
        np.arange(5)[:, None] % 2 == 1, -np.inf, np.zeros((5, 7))).astype(np.float32)),
    "gqa": lambda rng: make_problem(rng, num_heads_q=6, num_heads_kv=2),
    "mqa": lambda rng: make_problem(rng, num_heads_q=5, num_heads_kv=1),
    "mha": lambda rng: make_problem(rng, num_heads_q=3, num_heads_kv=3),
    "dv_ne_d": lambda rng: make_problem(rng, head_dim=12, head_dim_v=5),
    "decode_lq1": lambda rng: make_problem(rng, seq_q=1, seq_kv=65, causal=True),
    "large_logits": lambda rng: make_problem(rng, data_scale=6.0),
    "combined": lambda rng: make_problem(
        rng, batch=3, seq_q=6, seq_kv=11, num_heads_q=6, num_heads_kv=3, head_dim=12,
        head_dim_v=7, scale=0.25, softcap=4.0, causal=True, window=(4, -1),
        key_lengths=np.array([11, 6, 0], np.int64), mask=random_mask(rng, (3, 1, 6, 11), 0.8),
        bias=rng.standard_normal((6, 6, 11)).astype(np.float32)),
    "combined_top_left": lambda rng: make_problem(
        rng, batch=2, seq_q=9, seq_kv=6, num_heads_q=4, num_heads_kv=1, head_dim=5,
        head_dim_v=3, causal=True, align="top-left", window=(2, 3),
        key_lengths=np.array([4, 6], np.int32), mask=random_mask(rng, (6,), 0.8),
        bias=np.where(random_mask(rng, (1, 4, 9, 1), 0.9), 0.5, -np.inf).astype(np.float32)),
}
