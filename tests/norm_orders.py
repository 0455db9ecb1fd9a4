"""Sums of squares of RMSNorm rows in the order cache-writers.md §1.2 pins, and in the wrong orders a kernel could
plausibly use instead (sequential, adjacent pairs, an FMA-contracted square). The tests that push rows exposing a
wrong order through the writers (test_writers.py) and the c1 / c2 ops (test_low_ratio.py) build their rows with
these; the ops themselves are compared with the reference ops.
"""
from __future__ import annotations

import torch


def halve(q: torch.Tensor) -> torch.Tensor:
    """Pairwise halving of the last dim: q_j <- q_j + q_{j+h} for h = n/2, n/4, ..., 1; keeps a dim of 1."""
    while q.shape[-1] > 1:
        h = q.shape[-1] // 2
        q = q[..., :h] + q[..., h:]
    return q


def pinned_ss(x):
    """The §1.2 order: each lane's D / 32 squares halved pairwise, then the 32 lane sums halved pairwise (the
    shfl_xor butterfly 16, 8, 4, 2, 1)."""
    return halve(halve((x * x).reshape(x.shape[0], 32, -1))[..., 0])[..., 0]


def sequential_ss(x):
    q = x * x
    s = q[:, 0]
    for i in range(1, q.shape[1]):
        s = s + q[:, i]
    return s


def adjacent_pairs_ss(x):
    q = x * x
    while q.shape[-1] > 1:
        q = q[:, 0::2] + q[:, 1::2]
    return q[:, 0]


def fma32(a, b):
    """fp32 fma(a, a, b), correctly rounded: a*a + b is summed in float64 with its TwoSum error, rounded to odd
    (53 >= 24 + 2 bits, so the final rounding to fp32 is the single rounding of the exact value)."""
    a2, b = a.double() * a.double(), b.double()  # a*a is exact in float64
    s = a2 + b
    bv = s - a2
    err = (a2 - (s - bv)) + (b - bv)
    toward = torch.where(err > 0, torch.inf, -torch.inf).double()
    s = torch.where((err != 0) & (s.view(torch.int64) & 1 == 0), torch.nextafter(s, toward), s)
    return s.float()


def fma_contracted_ss(x, fused):
    """The pinned order with the first in-lane add contracted with one of its squares: q_j = fma(x_j, x_j,
    x_{j+h}^2) ("low") or fma(x_{j+h}, x_{j+h}, x_j^2) ("high"), as a compiler contracts x0*x0 + x8*x8."""
    g = x.reshape(x.shape[0], 32, -1)
    h = g.shape[-1] // 2
    lo, hi = g[..., :h], g[..., h:]
    q = fma32(lo, hi * hi) if fused == "low" else fma32(hi, lo * lo)
    return halve(halve(q)[..., 0])[..., 0]


WRONG_NORM_ORDERS = {
    "sequential": sequential_ss,
    "adjacent_pairs": adjacent_pairs_ss,
    "fma_low": lambda x: fma_contracted_ss(x, "low"),
    "fma_high": lambda x: fma_contracted_ss(x, "high"),
}


def y_from_ss(x, w, eps, ss):
    """§1.2 scale and output from a given sum of squares (rms_norm_fp32 once ss is known)."""
    ms = ss / x.shape[1]
    r = torch.reciprocal(torch.sqrt((ms + torch.full_like(ms, eps)).double()).float())
    return (x * r.unsqueeze(1)) * w
