#!/usr/bin/env python3
"""Derives the constants of qkv's vectorised exp (src/kernels/cpu/fast_exp-inl.h).

    /usr/bin/python3 scripts/fit_exp_poly.py                          # the table, then constants
    /usr/bin/python3 scripts/fit_exp_poly.py --degree 5 --pinned 2   # (the defaults)
    /usr/bin/python3 scripts/fit_exp_poly.py --base2 --degree 5      # fastexp::Pow2's constants
    /usr/bin/python3 scripts/fit_exp_poly.py --base2 --half --degree 4   # Pow2CoarseHalf's

exp(x) = 2^n * p(r), n = round(x * log2(e)), r = x - n * ln2 in [-ln2/2, ln2/2]. p's first
`pinned` coefficients are fixed at the Taylor ones: pinned 1 (p = 1 + r q(r), Horner) or pinned 2
(p = 1 + (r + r^2 q(r))); either way exp(0) is exactly 1. The free ones minimise the maximum
RELATIVE error max |p(r) e^-r - 1| (the 2^n scaling is exact, so this is the result's relative
error), found by Lawson's algorithm (iteratively reweighted least squares, see lawson()).

ln2 is split Cody-Waite style into ln2_hi (float with the low 8 mantissa bits zero: n * ln2_hi
is exact for |n| < 2^8, and x - n * ln2_hi is exact) and ln2_lo = float(ln2 - ln2_hi).

Besides the real-number minimax error, the table gives the float32 formula's error (FMA emulated
in float64, where the product of two floats is exact) on 3e6 samples of x in [-87.33, 0], and
its inversions (exp(x) > exp(x') for adjacent floats x < x') in one window. Result: degree 5 is
the smallest within 2 ulp (float32: 1.6e-7 Horner, 1.8e-7 pinned 2; degree 4: 2.9e-6); the
Horner form inverts, the pinned-2 form does not (one op more). The C++ test then measures the
chosen formula on every 7th float.

--base2: the constants of 2^x = 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2] (exact, no
Cody-Waite split), p = 1 + r q(r) in Horner form (fastexp::Pow2, Pow2Coarse). The minimax
problem is the same one with r scaled by ln2 (p(r) 2^-r = P(r ln2) e^-(r ln2)), so p's
coefficients are the natural fit's (pinned 1) times ln2^i, rounded to float32; the table gives
the float32 formula's error against float64 2^x on 3e6 samples of x in [-126, 0].
"""
import argparse
import math

import numpy as np

LN2 = math.log(2.0)
# |r| <= ln2/2 plus a margin: without FMA (Highway's SCALAR target) n is rounded twice.
HALF_RANGE = LN2 / 2 * (1 + 1e-5)


def relative_error(coefs, r):
    """p(r) e^-r - 1 in float64, p(r) = sum coefs[i] r^i."""
    p = np.zeros_like(r)
    for c in reversed(coefs):
        p = p * r + c
    return p * np.exp(-r) - 1.0


def lawson(degree, pinned, iterations=1500):
    """Minimax p of `degree` for the relative error, its first `pinned` coefficients fixed at the
    Taylor ones (1, 1), by Lawson's algorithm: weighted least squares on a grid, each point's
    weight multiplied by its |error| every round, converges to the minimax solution. (A plain
    Remez exchange is fragile here: the error is pinned to 0 at r = 0, where the basis functions
    r^i all vanish.) Returns all coefficients c_0..c_degree and the maximum error on the grid."""
    r = np.linspace(-HALF_RANGE, HALF_RANGE, 20001)
    fixed = [1.0, 1.0][:pinned]
    # error = sum_{i >= pinned} c_i r^i e^-r - (1 - (sum of the fixed terms) e^-r) = A c - b
    a = np.stack([r ** (i + pinned) * np.exp(-r) for i in range(degree + 1 - pinned)], axis=1)
    b = 1.0 - sum(c * r**i for i, c in enumerate(fixed)) * np.exp(-r)
    weight = np.full(r.size, 1.0 / r.size)
    for _ in range(iterations):
        root = np.sqrt(weight)
        sol, *_ = np.linalg.lstsq(a * root[:, None], b * root, rcond=None)
        err = np.abs(a @ sol - b)
        weight *= err
        weight /= weight.sum()
    coefs = fixed + list(sol)
    fine = np.linspace(-HALF_RANGE, HALF_RANGE, 400001)
    return coefs, float(np.max(np.abs(relative_error(coefs, fine))))


def f32(x):
    return np.float32(x)


def ln2_split():
    bits = np.array([LN2], dtype=np.float32).view(np.uint32)[0] & np.uint32(0xFFFFFF00)
    hi = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    lo = f32(LN2 - float(hi))
    return hi, lo


def fma32(a, b, c):
    """float32 fused multiply-add, emulated: a * b is exact in float64."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def float32_exp(coefs32, pinned, x):
    """The float32 formula of fast_exp-inl.h (pinned = 2) or plain Horner (pinned = 1)."""
    ln2_hi, ln2_lo = ln2_split()
    log2e = f32(1.0 / LN2)
    magic = f32(1.5 * 2**23)
    k = fma32(x, log2e, magic)
    n = k - magic
    r = fma32(-n, ln2_hi, x)
    r = fma32(-n, ln2_lo, r)
    q = np.full_like(r, coefs32[-1])
    for c in reversed(coefs32[pinned:-1]):
        q = fma32(q, r, c)
    if pinned == 1:  # p = 1 + r * q
        p = fma32(q, r, f32(1.0))
    else:  # p = 1 + (r + r^2 * q)
        p = fma32(q, r * r, r) + f32(1.0)
    return np.ldexp(p.astype(np.float64), n.astype(np.int64)).astype(np.float32)


def float32_error(coefs32, pinned, x):
    """Max relative error of the float32 formula over x, against float64 exp."""
    ref = np.exp(x.astype(np.float64))
    return float(np.max(np.abs(float32_exp(coefs32, pinned, x).astype(np.float64) - ref) / ref))


def inversions(coefs32, pinned, low, count):
    """Adjacent-float pairs x < x' in [low, low + count floats) with exp(x) > exp(x')."""
    bits = np.arange(count, dtype=np.uint32) + np.array([low], np.float32).view(np.uint32)[0]
    y = float32_exp(coefs32, pinned, bits.view(np.float32))  # x falling, y must not rise
    return int(np.sum(y[1:] > y[:-1]))


def float32_pow2(coefs32, x):
    """The float32 formula of fastexp::Pow2 (Horner, p = 1 + r q)."""
    magic = f32(1.5 * 2**23)
    k = x + magic  # float32: rounds x to an integer
    n = k - magic
    r = x - n  # exact
    q = np.full_like(r, coefs32[-1])
    for c in reversed(coefs32[1:-1]):
        q = fma32(q, r, c)
    p = fma32(q, r, f32(1.0))
    return np.ldexp(p.astype(np.float64), n.astype(np.int64)).astype(np.float32)


def base2_main(degree):
    rng = np.random.default_rng(1)
    x = np.concatenate([-rng.uniform(0, 126, 2_000_000), -rng.uniform(0, 1, 1_000_000),
                        rng.uniform(0, 12, 100_000)]).astype(np.float32)
    ref = np.exp2(x.astype(np.float64))
    print("degree  minimax (real)  float32 formula: max rel. error, inversions (*)")
    chosen = None
    for d in range(3, 8):
        coefs, err = lawson(d, 1)
        coefs32 = [f32(c * LN2**i) for i, c in enumerate(coefs)]
        err32 = float(np.max(np.abs(float32_pow2(coefs32, x).astype(np.float64) - ref) / ref))
        bits = np.arange(1 << 22, dtype=np.uint32) + np.array([-0.0625], np.float32).view(np.uint32)[0]
        y = float32_pow2(coefs32, bits.view(np.float32))
        print(f"{d:6d}  {err:.3e}       {err32:.3e}  {int(np.sum(y[1:] > y[:-1])):6d}")
        if d == degree:
            chosen = coefs32
    print("(*) of 4M adjacent floats in [-0.09, -0.0625]")
    print(f"\nC++ constants, 2^x, degree {degree}:")
    for i, c in enumerate(chosen[1:], start=1):
        mantissa, exponent = float(c).hex().split("p")
        print(f"constexpr float kP{i} = {mantissa.rstrip('0').rstrip('.')}p{exponent}f;  // {float(c):.9g}")


def float32_pow2_half(coefs32, xh):
    """The float32 formula of fastexp::Pow2CoarseHalf: 2^(xh - 1/2) = 2^n * q(t), n = floor(xh),
    t = xh - n in [0, 1) (exact), q(t) = h0 + t (h1 + t (h2 + ...)) in Horner form."""
    n = np.floor(xh)
    t = (xh - n).astype(np.float32)
    q = np.full_like(t, coefs32[-1])
    for c in reversed(coefs32[:-1]):
        q = fma32(q, t, c)
    return np.ldexp(q.astype(np.float64), n.astype(np.int64)).astype(np.float32)


def half_main(degree):
    """--base2 --half: q(t) = p(t - 1/2) for p the base-2 minimax of `degree` (an affine change of
    variable, so the same minimax error in real arithmetic), re-expanded in float64 and rounded to
    float32; then h0 is moved by ulps until the float32 formula gives q(1/2) = 1 exactly, so
    integers x (xh = x + 1/2) give exactly 2^x."""
    coefs, err = lawson(degree, 1)
    p = np.polynomial.Polynomial([c * LN2**i for i, c in enumerate(coefs)])
    q = p(np.polynomial.Polynomial([-0.5, 1.0]))  # p(t - 1/2)
    h = [f32(c) for c in q.coef]
    half = np.array([0.5], np.float32)
    for _ in range(64):
        v = float32_pow2_half(h, half)[0]
        if v == f32(1.0):
            break
        h[0] = np.nextafter(h[0], f32(-np.inf) if v > 1.0 else f32(np.inf), dtype=np.float32)
    assert float32_pow2_half(h, half)[0] == f32(1.0)
    rng = np.random.default_rng(1)
    x = np.concatenate([-rng.uniform(0, 126, 2_000_000), -rng.uniform(0, 1, 1_000_000),
                        rng.uniform(0, 12, 100_000)]).astype(np.float32)
    xh = (x + np.float32(0.5)).astype(np.float32)
    ref = np.exp2(xh.astype(np.float64) - 0.5)
    err32 = float(np.max(np.abs(float32_pow2_half(h, xh).astype(np.float64) - ref) / ref))
    print(f"degree {degree}: minimax (real) {err:.3e}, float32 formula {err32:.3e} "
          f"(2^(xh - 1/2) on 3.1e6 samples, xh = x + 1/2, x in [-126, 12])")
    print(f"\nC++ constants, 2^(xh - 1/2), degree {degree}:")
    for i, c in enumerate(h):
        mantissa, exponent = float(c).hex().split("p")
        print(f"constexpr float kHalfP{i} = {mantissa.rstrip('0').rstrip('.')}p{exponent}f;  // {float(c):.9g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--degree", type=int, default=5, help="degree whose constants to print")
    parser.add_argument("--pinned", type=int, default=2, help="Taylor coefficients fixed (1, 2)")
    parser.add_argument("--base2", action="store_true", help="the constants of 2^x (fastexp::Pow2)")
    parser.add_argument("--half", action="store_true",
                        help="with --base2: 2^(xh - 1/2) from t = xh - floor(xh) (Pow2CoarseHalf)")
    args = parser.parse_args()
    if args.base2 and args.half:
        half_main(args.degree)
        return
    if args.base2:
        base2_main(args.degree)
        return

    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            -rng.uniform(0, 87.33, 2_000_000).astype(np.float32),
            -rng.uniform(0, 1, 1_000_000).astype(np.float32),
        ]
    )
    print("p(0) = 1 pinned: p = 1 + r * q(r), Horner; p(0) = p'(0) = 1 pinned: p = 1 + (r + r^2 q(r))")
    print("degree pinned  minimax (real)  float32 formula: max rel. error, inversions (*)")
    chosen = None
    for degree in range(4, 8):
        for pinned in (1, 2):
            coefs, err = lawson(degree, pinned)
            coefs32 = [f32(c) for c in coefs]
            err32 = float32_error(coefs32, pinned, x)
            inv = inversions(coefs32, pinned, -0.046875, 1 << 22)
            print(f"{degree:6d} {pinned:6d}  {err:.3e}       {err32:.3e}  {inv:6d}")
            if degree == args.degree and pinned == args.pinned:
                chosen = coefs32
    print("(*) of 4M adjacent floats in [-0.0625, -0.047], where Horner's rounding of q shows")

    def hex32(v):  # shortest hex literal: 0x1.62e4p-1
        mantissa, exponent = float(v).hex().split("p")
        return mantissa.rstrip("0").rstrip(".") + "p" + exponent

    ln2_hi, ln2_lo = ln2_split()
    print(f"\nC++ constants, degree {args.degree}, {args.pinned} pinned:")
    print(f"constexpr float kLn2Hi = {hex32(ln2_hi)}f;  // {float(ln2_hi):.9g}")
    print(f"constexpr float kLn2Lo = {hex32(ln2_lo)}f;  // {float(ln2_lo):.9g}")
    for i, c in enumerate(chosen[args.pinned :], start=args.pinned):
        print(f"constexpr float kC{i} = {hex32(c)}f;  // {float(c):.9g}")


if __name__ == "__main__":
    main()
