"""top-p where the mass reaches top_p exactly: S04's NumPy `apply_top_p` and S06's torch one
against HF `TopPLogitsWarper` (issue 12).

Oracle: transformers' `TopPLogitsWarper` fed the same float32 logits (the log of short decimal
probabilities, where sums land on top_p exactly and float rounding decides). HF's kept set is
always the n most likely tokens; which of several equal ones it keeps is up to an unstable
sort, so each test takes n from HF and the ids from our documented rule (lowest id first),
and asserts our kept ids are exactly those.
"""
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

import s04_sampling as s04

TOP_PS = [round(0.5 + 0.05 * k, 2) for k in range(10)]           # 0.5, 0.55, ..., 0.95
# Every ordered list of 3 or 4 probabilities in steps of 0.05, each > 0, summing to 1.
PARTS = [parts for n in (3, 4) for parts in itertools.product(range(1, 20), repeat=n)
         if sum(parts) == 20]


# Two ways to make the float32 logits: the log of the float32 probabilities, or the float64
# log rounded once to float32. They differ in the last bit, and at an exact boundary that bit
# decides.
LOGITS = {
    "log_f32": lambda probs: np.log(np.array(probs, dtype=np.float32)),
    "log_f64_rounded": lambda probs: np.log(np.array(probs, dtype=np.float64)).astype(np.float32),
}


def numpy_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    return s04.apply_top_p(logits, top_p)


def torch_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    import s06_sampler
    return s06_sampler.apply_top_p(torch.from_numpy(logits.copy()), top_p).numpy()


def hf_kept_count(logits: np.ndarray, top_p: float) -> int:
    out = TopPLogitsWarper(top_p)(None, torch.from_numpy(logits.copy())[None])[0]
    return int(torch.isfinite(out).sum())


def kept(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(row)).tolist())


def most_likely(logits: np.ndarray, n: int) -> set[int]:
    """The n most likely ids, the lower id first among equal logits."""
    return set(np.argsort(-logits, kind="stable")[:n].tolist())


def reaches_top_p_exactly(parts, top_p: float) -> bool:
    """Whether the mass of some head of the sorted probabilities (parts / 20) equals top_p."""
    head = itertools.accumulate(sorted((Fraction(k, 20) for k in parts), reverse=True))
    return Fraction(round(top_p * 100), 100) in list(head)[:-1]


def softmax_by_torchs_steps(logits: np.ndarray) -> np.ndarray:
    """float32 exp(z - max) rounded once from float64, times the float32 1 / sum: the steps
    of torch's float32 softmax, with an exp that torch's vectorised one may miss by an ulp."""
    e = np.exp((logits - logits.max()).astype(np.float64)).astype(np.float32)
    return e * (np.float32(1.0) / e.sum())


IMPLS = {"numpy": numpy_top_p, "torch": torch_top_p}


@pytest.mark.parametrize("how", LOGITS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("probs, top_p, expected", [
    ([0.1, 0.3, 0.6], 0.9, {1, 2}),        # 0.6 + 0.3 reaches 0.9: id 0 is not needed
    ([0.05, 0.6, 0.35], 0.6, {1}),         # 0.6 reaches 0.6 on its own
])
def test_the_token_that_reaches_top_p_exactly_is_the_last_one_kept(how, impl, probs, top_p,
                                                                   expected):
    logits = LOGITS[how](probs)
    assert hf_kept_count(logits, top_p) == len(expected)   # the oracle agrees with the decimals
    assert kept(IMPLS[impl](logits, top_p)) == expected


@pytest.mark.parametrize("how", LOGITS)
def test_torch_keeps_hfs_set_on_every_case_of_the_sweep(how):
    # Same torch ops as HF on the same device, so the same float32 sums: no exception allowed.
    wrong = []
    for parts in PARTS:
        logits = LOGITS[how]([k / 20 for k in parts])
        for top_p in TOP_PS:
            expected = most_likely(logits, hf_kept_count(logits, top_p))
            if kept(torch_top_p(logits, top_p)) != expected:
                wrong.append((parts, top_p))
    assert not wrong, f"{len(wrong)} of {len(PARTS) * len(TOP_PS)} differ, first {wrong[:5]}"


@pytest.mark.parametrize("how", LOGITS)
def test_numpy_keeps_hfs_set_wherever_the_float32_probabilities_agree(how):
    # NumPy computes torch's softmax steps with its own exp, which can differ from torch's
    # vectorised one in the last bit. Where no head of the sorted mass equals top_p exactly, a
    # bit cannot move the cut, so the sets must be equal. Where one does, they must be equal
    # whenever torch's float32 probabilities are those steps' bits: the rest is HF's arithmetic.
    wrong, boundary, checked_at_boundary = [], 0, 0
    for parts in PARTS:
        logits = LOGITS[how]([k / 20 for k in parts])
        ascending = np.sort(logits)
        same_probs = np.array_equal(softmax_by_torchs_steps(ascending),
                                    torch.softmax(torch.from_numpy(ascending), -1).numpy())
        for top_p in TOP_PS:
            if reaches_top_p_exactly(parts, top_p):
                boundary += 1
                if not same_probs:
                    continue
                checked_at_boundary += 1
            expected = most_likely(logits, hf_kept_count(logits, top_p))
            if kept(numpy_top_p(logits, top_p)) != expected:
                wrong.append((parts, top_p))
    assert not wrong, f"{len(wrong)} differ, first {wrong[:5]}"
    # Not vacuous: with torch 2.13 on x86, torch's bits are those steps' for 1809 (log_f32) and
    # 2106 (log_f64_rounded) of the 2724 boundary cases; half is a floor with room to spare.
    assert boundary == 2724 and checked_at_boundary >= boundary // 2


@pytest.mark.parametrize("impl", IMPLS)
def test_a_long_tail_of_tiny_probabilities_is_summed_without_stalling(impl):
    # 2**20 tail tokens of mass 1e-8 each (0.0105 in all) under four tokens that hold 0.99.
    # A float32 running sum taken most likely first stays at 0.99: each 1e-8 is under half an
    # ulp of 0.99 (6e-8), so top_p 0.995 would keep the whole tail. Summed smallest first, the
    # nucleus drops the r least likely tokens whose mass is <= 1 - 0.995, about half the tail.
    tail = 2**20
    probs = np.concatenate([np.full(4, 0.99 / 4), np.full(tail, 1e-8)])
    logits = np.log(probs / probs.sum()).astype(np.float32)
    r = math.floor((1 - 0.995) / (1e-8 / probs.sum()))         # closed form: 500,242
    ours = kept(IMPLS[impl](logits, 0.995))
    assert ours == most_likely(logits, len(ours))
    # The closed form to a few tokens (a stall would keep all 500,242). HF sums the exps in
    # float32, so its probabilities are a few parts per million off and it keeps 3 fewer:
    # torch has HF's ops and must match it exactly; NumPy normalises in float64.
    assert abs(len(ours) - (4 + tail - r)) <= (0 if impl == "numpy" else 8)
    if impl == "torch":
        assert len(ours) == hf_kept_count(logits, 0.995)


@pytest.mark.parametrize("impl", IMPLS)
def test_top_p_zero_keeps_one_token_of_a_nearly_flat_large_vocabulary(impl):
    logits = (np.random.default_rng(0).standard_normal(151_936) * 1e-3).astype(np.float32)
    assert kept(IMPLS[impl](logits, 0.0)) == {int(np.argmax(logits))}
    assert hf_kept_count(logits, 0.0) == 1
