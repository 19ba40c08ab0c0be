"""Chi-square helpers for the tests that check a sampler's output distribution (S15's
rejection sampler and its exercise): scipy is not a dependency, so the upper tail is computed in
closed form for integer degrees of freedom (Abramowitz & Stegun 26.4.4, 26.4.5) and the
threshold found by bisection. tests/test_s15_rejection.py checks both against table values."""
from __future__ import annotations

import math

import torch


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), df a positive integer."""
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for r in range(1, df // 2):
            term *= (x / 2) / r
            total += term
        return math.exp(-x / 2) * total
    s = math.sqrt(x)
    tail = math.erfc(s / math.sqrt(2))                  # 2 (1 - Phi(sqrt x))
    term, total = s, 0.0                                # x^(r - 1/2) / (1 * 3 * ... * (2r - 1))
    for r in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * r + 1)
    return tail + 2 * math.exp(-x / 2) / math.sqrt(2 * math.pi) * total


def chi2_threshold(df: int, alpha: float = 1e-6) -> float:
    """The 1 - alpha quantile of chi-square(df), by bisection on `chi2_sf`."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts (C,) against probs (C,), and its degrees of freedom. A
    count in a cell of probability 0 makes the statistic infinite; every expected count must be
    at least 20 (asserted) for the chi-square approximation to hold."""
    n = float(counts.sum())
    probs, counts = probs.double(), counts.double()
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return math.inf, int(support.sum()) - 1
    expected = n * probs[support]
    assert float(expected.min()) >= 20, "too few trials for the chi-square approximation"
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1
