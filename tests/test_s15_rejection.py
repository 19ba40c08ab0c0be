"""Tests for S15's verification step (code/s15_rejection.py), on the CPU.

Oracles: the target distributions themselves (chi-square goodness of fit: speculative sampling
must emit exactly the target's tokens in distribution, whatever the draft), Leviathan et al.'s
closed forms worked out by hand, S06's `draw` (code/s06_sampler.py) row by row, and greedy
cases written out by hand. A sampler that is wrong in the classic way (on a rejection it redraws
from p instead of the residual max(p - q, 0)), built here from the public pieces, must fail the
same statistical tests by orders of magnitude, so the tests are shown to have the power to see
the bug they are for.

Chi-square threshold. scipy is not installed, so `chi2_sf` below is the chi-square upper tail
in closed form for an integer number of degrees of freedom (even df: a Poisson sum; odd df: the
normal tail plus a finite series; Abramowitz and Stegun 26.4.4-26.4.5), checked against
table values, and `threshold(df)` is its 1 - 1e-6 quantile by bisection. Each statistic has
expected counts >= 20 in every cell (asserted), where the chi-square approximation is good,
so a correct sampler exceeds its threshold with probability about 1e-6 per statistic; this
file computes fewer than 25 of them, so a correct sampler with a freshly chosen seed would fail
here with probability below 1e-4. The seeds are fixed, so the outcome is deterministic; the
figure says how unlucky a seed would have to be. N (trials in one batch) is set so that the
wrong sampler's expected statistic, N x sum (w - p)^2 / p for its distribution w, is several
hundred times the threshold (asserted > 100x), and the whole file runs in a few seconds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats_testing import chi2_sf, chi2_threshold
from stats_testing import chi_square as counts_chi_square

import s04_sampling as s04
import s06_sampler as s06
from s15_rejection import (
    acceptance_rate, expected_speedup, expected_tokens_per_step, explain_step, greedy_verify,
    optimal_k, rejection_sample, residual, sample_from,
)

F64 = torch.float64
ALPHA_TEST = 1e-6                        # false-failure probability per chi-square statistic


# --- chi-square, without scipy -----------------------------------------------------------------

def threshold(df: int, alpha: float = ALPHA_TEST) -> float:
    """The 1 - alpha quantile of chi-square(df) (tests/stats_testing.py)."""
    return chi2_threshold(df, alpha)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed ids against probs (C,) and its degrees of freedom."""
    return counts_chi_square(torch.bincount(tokens, minlength=probs.numel()), probs)


def test_chi2_tail_and_threshold_against_tables():
    # Standard table values (any statistics text): upper 5 % and 1 % points.
    for df, point, tail in [(1, 3.841459, 0.05), (2, 5.991465, 0.05), (5, 11.070498, 0.05),
                            (10, 23.209251, 0.01), (35, 57.342073, 0.01)]:
        assert chi2_sf(point, df) == pytest.approx(tail, rel=1e-5)
        assert threshold(df, tail) == pytest.approx(point, rel=1e-5)
    assert threshold(2) == pytest.approx(2 * math.log(1e6), rel=1e-9)   # exponential tail
    # Wilson-Hilferty's cube-root approximation agrees to a few percent at 1e-6.
    z = 4.753424308822899                               # the normal 1 - 1e-6 quantile
    for df in (5, 35):
        wh = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        assert threshold(df) == pytest.approx(wh, rel=0.05)


# --- toy target and draft ----------------------------------------------------------------------
# Six tokens. Position j's rows are these rolled by j, so they differ by position and, being the
# same at every call for the same absolute position, are context-independent: the emitted
# sequence must be i.i.d. across positions with position j's marginal p_j.
P_BASE = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=F64)
Q_BASE = torch.tensor([0.05, 0.1, 0.1, 0.15, 0.3, 0.3], dtype=F64)
# By hand: sum min(p, q) = 0.05 + 0.1 + 0.1 + 0.1 + 0.05 + 0.05 = 0.45 at every position.
ALPHA_TOY = 0.45
K_TOY = 3
N_TOY = 200_000


def p_row(j: int) -> torch.Tensor:
    return P_BASE.roll(j)


def q_row(j: int) -> torch.Tensor:
    return Q_BASE.roll(j)


def toy_call(start: int, n: int, k: int, gen: torch.Generator, sampler=None,
             ngram: bool = False):
    """One verification step for n trials whose next absolute position is `start`. Draft j is
    drawn from q_{start + j} (or, with ngram, is the fixed token 1 with q one-hot)."""
    sampler = sampler or rejection_sample
    target = torch.stack([p_row(start + j) for j in range(k + 1)])                 # (K + 1, V)
    if ngram:
        drafts = torch.full((n, k), 1, dtype=torch.long)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q_row(start + j), n, replacement=True,
                                                generator=gen) for j in range(k)], dim=1)
        draft_probs = torch.stack([q_row(start + j) for j in range(k)]).expand(n, k, -1)
    uniforms = torch.rand((n, k + 1), dtype=F64, generator=gen)
    return sampler(target.expand(n, k + 1, -1), draft_probs, drafts,
                   torch.full((n,), k, dtype=torch.long), uniforms)


def wrong_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens,
                           uniforms):
    """The classic bug, composed from the public pieces: the same accept decisions, but after a
    rejection the final token is redrawn from p itself instead of the residual."""
    out, num_accepted = rejection_sample(target_probs, draft_probs, draft_token_ids,
                                         num_draft_tokens, uniforms)
    rows = torch.arange(out.shape[0])
    rejected = num_accepted < num_draft_tokens
    from_p = sample_from(target_probs[rows, num_accepted], uniforms[:, -1])
    out = out.clone()
    out[rows, num_accepted] = torch.where(rejected, from_p, out[rows, num_accepted])
    return out, num_accepted


def toy_statistics(sampler, seed: int = 0, ngram: bool = False) -> dict:
    """Chi-square statistics of one batch of N_TOY trials: "first" (the first emitted token
    against p_0), "pos{j}" (the token at position j among trials that reached it, against
    p_j, j = 1..K) and "joint" (the first two tokens of a generation against p_0 x p_1: trials
    that emitted one token take their second from a next call starting at position 1)."""
    gen = torch.Generator().manual_seed(seed)
    out, num_accepted = toy_call(0, N_TOY, K_TOY, gen, sampler, ngram)
    stats = {"first": chi_square(out[:, 0], p_row(0))}
    for j in range(1, K_TOY + 1):
        reached = num_accepted >= j
        stats[f"pos{j}"] = chi_square(out[reached, j], p_row(j))
    second = out[:, 1].clone()
    short = num_accepted == 0
    out2, _ = toy_call(1, int(short.sum()), K_TOY, gen, sampler, ngram)
    second[short] = out2[:, 0]
    assert bool((second >= 0).all())
    joint = torch.outer(p_row(0), p_row(1)).flatten()                            # (V * V,)
    stats["joint"] = chi_square(out[:, 0] * P_BASE.numel() + second, joint)
    return stats


@pytest.fixture(scope="module")
def right_stats():
    return toy_statistics(rejection_sample)


@pytest.fixture(scope="module")
def wrong_stats():
    return toy_statistics(wrong_rejection_sample)


@pytest.mark.parametrize("name", ["first", "pos1", "pos2", "pos3", "joint"])
def test_emitted_tokens_follow_the_target(right_stats, name):
    stat, df = right_stats[name]
    assert stat < threshold(df), f"{name}: chi-square {stat:.1f} >= {threshold(df):.1f} (df {df})"


@pytest.mark.parametrize("name", ["first", "pos1", "pos2", "joint"])
def test_redrawing_from_p_fails_the_same_test_by_orders_of_magnitude(wrong_stats, name):
    # pos3 is the bonus position: only reached when every draft was accepted, so both samplers
    # draw it from p_3 and it cannot tell them apart.
    stat, df = wrong_stats[name]
    assert stat > 100 * threshold(df), f"{name}: {stat:.1f} vs {threshold(df):.1f}"


def test_the_wrong_sampler_is_wrong_by_the_amount_theory_says(wrong_stats):
    # On a rejection it draws from p, so its first token follows min(p, q) + (1 - alpha) p;
    # its expected statistic is N sum (w - p)^2 / p + df (0.1525 N here, by hand).
    p = p_row(0)
    w = torch.minimum(p, q_row(0)) + (1 - ALPHA_TOY) * p
    expected = N_TOY * float(((w - p) ** 2 / p).sum())
    assert expected == pytest.approx(0.1525 * N_TOY)
    assert wrong_stats["first"][0] == pytest.approx(expected, rel=0.1)


# --- measured against the formulas -------------------------------------------------------------
P_THEORY = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=F64)
Q_THEORY = torch.tensor([0.25, 0.25, 0.25, 0.15, 0.1], dtype=F64)
# By hand: sum min = 0.25 + 0.25 + 0.15 + 0.1 + 0.05 = 0.8.
N_THEORY = 200_000


@pytest.mark.parametrize("k", [1, 2, 4])
def test_measured_acceptance_and_tokens_per_step_match_the_formulas(k):
    """With the same p, q at every position, each offered draft is accepted independently
    with probability alpha = 0.8, and a step emits 1 + Geometric tokens capped at k + 1.
    1 % must be more than 5 standard errors: for the acceptance rate the SE is
    sqrt(alpha (1 - alpha) / offered) (offered >= N = 200k: SE <= 0.0009, 1 % = 0.008); for the
    mean tokens per step SE = sd / sqrt(N) with sd from the exact distribution (both checked
    below before comparing)."""
    alpha = acceptance_rate(P_THEORY, Q_THEORY)
    assert alpha == pytest.approx(0.8)
    gen = torch.Generator().manual_seed(10 + k)
    drafts = torch.multinomial(Q_THEORY, N_THEORY * k, replacement=True, generator=gen)
    uniforms = torch.rand((N_THEORY, k + 1), dtype=F64, generator=gen)
    _, num_accepted = rejection_sample(
        P_THEORY.expand(N_THEORY, k + 1, -1), Q_THEORY.expand(N_THEORY, k, -1),
        drafts.view(N_THEORY, k), torch.full((N_THEORY,), k), uniforms)
    offered = torch.clamp(num_accepted + 1, max=k).sum().item()   # positions reached
    measured_alpha = num_accepted.sum().item() / offered
    se_alpha = math.sqrt(alpha * (1 - alpha) / offered)
    assert 0.01 * alpha > 5 * se_alpha
    assert measured_alpha == pytest.approx(alpha, rel=0.01)

    emitted = (num_accepted + 1).double()
    probs = [alpha ** i * (1 - alpha) for i in range(k)] + [alpha ** k]      # P(emit i + 1)
    mean = sum((i + 1) * pr for i, pr in enumerate(probs))
    sd = math.sqrt(sum((i + 1 - mean) ** 2 * pr for i, pr in enumerate(probs)))
    assert mean == pytest.approx(expected_tokens_per_step(alpha, k))
    assert 0.01 * mean > 5 * sd / math.sqrt(N_THEORY)
    assert emitted.mean().item() == pytest.approx(expected_tokens_per_step(alpha, k), rel=0.01)


# --- the n-gram convention: q one-hot at the draft ---------------------------------------------

def test_ngram_drafts_are_accepted_with_probability_p_and_the_output_is_still_p():
    gen = torch.Generator().manual_seed(3)
    out, num_accepted = toy_call(0, N_TOY, K_TOY, gen, ngram=True)
    # Draft 0 is token 1 with p_0(1) = 0.2: accepted 0.2 of the time (SE 0.0009).
    accepted = (num_accepted >= 1).double().mean().item()
    assert accepted == pytest.approx(0.2, abs=5 * math.sqrt(0.2 * 0.8 / N_TOY))
    # Given draft 0 accepted, draft 1 is token 1 with p_1(1) = 0.5.
    reached = num_accepted >= 1
    accepted1 = (num_accepted[reached] >= 2).double().mean().item()
    assert accepted1 == pytest.approx(0.5, abs=5 * math.sqrt(0.25 / int(reached.sum())))
    for j in range(K_TOY + 1):
        stat, df = chi_square(out[num_accepted >= j, j], p_row(j))
        assert stat < threshold(df), f"position {j}: {stat:.1f} vs {threshold(df):.1f}"
    # On a rejection the residual is p_0 without token 1: never token 1 at the first position.
    rejected = num_accepted == 0
    assert not bool((out[rejected, 0] == 1).any())


def test_ngram_residual_is_p_without_the_draft_renormalised():
    p = torch.tensor([0.5, 0.25, 0.25], dtype=F64)
    assert residual(p, None, torch.tensor(0)).tolist() == [0.0, 0.5, 0.5]


# --- the extremes: q == p, disjoint supports, a ragged batch --------------------------------------

def test_q_equal_to_p_always_accepts_and_draws_the_bonus_from_the_next_row():
    gen = torch.Generator().manual_seed(4)
    n, k = 20_000, 3
    rows = torch.stack([p_row(j) for j in range(k + 1)])
    drafts = torch.stack([torch.multinomial(rows[j], n, replacement=True, generator=gen)
                          for j in range(k)], dim=1)
    uniforms = torch.rand((n, k + 1), dtype=F64, generator=gen)
    out, num_accepted = rejection_sample(rows.expand(n, -1, -1), rows[:k].expand(n, -1, -1),
                                         drafts, torch.full((n,), k), uniforms)
    assert bool((num_accepted == k).all())
    assert torch.equal(out[:, :k], drafts)
    assert torch.equal(out[:, k], sample_from(rows[k].expand(n, -1), uniforms[:, k]))


def test_disjoint_supports_never_accept_and_the_residual_is_p():
    gen = torch.Generator().manual_seed(5)
    n, k = 20_000, 2
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0], dtype=F64)
    q = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5], dtype=F64)
    drafts = torch.multinomial(q, n * k, replacement=True, generator=gen).view(n, k)
    uniforms = torch.rand((n, k + 1), dtype=F64, generator=gen)
    out, num_accepted = rejection_sample(p.expand(n, k + 1, -1), q.expand(n, k, -1), drafts,
                                         torch.full((n,), k), uniforms)
    assert bool((num_accepted == 0).all())
    # max(p - q, 0) is p exactly here, so the draw is p's with the last uniform.
    assert torch.equal(out[:, 0], sample_from(p.expand(n, -1), uniforms[:, k]))
    assert bool((out[:, 1:] == -1).all())
    assert torch.equal(residual(p, q), p)


def test_a_ragged_batch_equals_each_request_alone_and_ignores_padding():
    gen = torch.Generator().manual_seed(6)
    b, k, v = 64, 4, 7
    target = torch.softmax(torch.randn((b, k + 1, v), generator=gen, dtype=F64), dim=-1)
    draft = torch.softmax(torch.randn((b, k, v), generator=gen, dtype=F64), dim=-1)
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    drafts = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).view(b, k)
    uniforms = torch.rand((b, k + 1), dtype=F64, generator=gen)
    # Garbage wherever the rules say "ignored": rows past num_draft_tokens, padded ids.
    pos = torch.arange(k + 1)
    target_padded = torch.where((pos > num_draft[:, None])[..., None], math.nan, target)
    draft_padded = torch.where((pos[:k] >= num_draft[:, None])[..., None], -1.0, draft)
    drafts_padded = torch.where(pos[:k] >= num_draft[:, None], 10**6, drafts)
    out, num_accepted = rejection_sample(target_padded, draft_padded, drafts_padded, num_draft,
                                         uniforms)
    for i in range(b):
        n = int(num_draft[i])
        one_out, one_acc = rejection_sample(
            target[i:i + 1, :n + 1], draft[i:i + 1, :n], drafts[i:i + 1, :n],
            num_draft[i:i + 1], torch.cat([uniforms[i:i + 1, :n], uniforms[i:i + 1, k:]], 1))
        assert int(num_accepted[i]) == int(one_acc[0])
        assert out[i, :n + 1].tolist() == one_out[0].tolist()
        assert bool((out[i, n + 1:] == -1).all())
        emitted = int(num_accepted[i]) + 1
        assert bool((out[i, :emitted] >= 0).all()) and bool((out[i, emitted:] == -1).all())


def test_zero_drafts_is_a_plain_draw_from_the_bonus_row():
    p = torch.tensor([[[0.0, 0.25, 0.75]]], dtype=F64)
    out, num_accepted = rejection_sample(p, None, torch.zeros((1, 0), dtype=torch.long),
                                         torch.tensor([0]), torch.tensor([[0.3]], dtype=F64))
    assert out.tolist() == [[2]] and num_accepted.tolist() == [0]    # 0.3 > 0.25: token 2


def test_the_accept_boundary_by_hand():
    # p(x) = 0.3, q(x) = 0.6: accept iff u < 0.5. u = 0.5 rejects, the next float below accepts.
    p = torch.tensor([[[0.7, 0.3], [0.5, 0.5]]], dtype=F64)
    q = torch.tensor([[[0.4, 0.6]]], dtype=F64)
    for u, accepted in [(0.5, 0), (math.nextafter(0.5, 0.0), 1)]:
        out, num_accepted = rejection_sample(p, q, torch.tensor([[1]]), torch.tensor([1]),
                                             torch.tensor([[u, 0.0]], dtype=F64))
        assert num_accepted.tolist() == [accepted]
        # Rejected: the residual is [0.3, 0] -> token 0; accepted: the bonus with u = 0.
        assert out.tolist() == ([[1, 0]] if accepted else [[0, -1]])


def test_a_residual_with_no_mass_falls_back_to_p():
    # p is q shrunk by 1e-9 (rows that do not sum to the same total): p(x) < q(x) everywhere,
    # so max(p - q, 0) is all zeros, which in exact arithmetic no rejection can produce.
    q = torch.tensor([0.5, 0.5], dtype=F64)
    p = q * (1 - 1e-9)
    assert residual(p, q).tolist() == [0.5, 0.5]
    out, num_accepted = rejection_sample(
        torch.stack([p, q])[None], q[None, None], torch.tensor([[0]]), torch.tensor([1]),
        torch.tensor([[1 - 1e-12, 0.75]], dtype=F64))        # u q(x) >= p(x): rejected
    assert num_accepted.tolist() == [0] and out.tolist() == [[1, -1]]   # p's draw at 0.75


def test_an_empty_batch():
    out, num_accepted = rejection_sample(
        torch.full((0, 3, 4), 0.25, dtype=F64), None, torch.zeros((0, 2), dtype=torch.long),
        torch.zeros(0, dtype=torch.long), torch.zeros((0, 3), dtype=F64))
    assert out.shape == (0, 3) and num_accepted.shape == (0,)


# --- greedy verification, by hand --------------------------------------------------------------

@pytest.mark.parametrize("drafts,expected,accepted", [
    ([9, 2, 3], [1, -1, -1, -1], 0),          # mismatch at the first draft: the correction
    ([1, 9, 3], [1, 2, -1, -1], 1),           # in the middle
    ([1, 2, 9], [1, 2, 3, -1], 2),            # at the last draft
    ([1, 2, 3], [1, 2, 3, 4], 3),             # all accepted, plus the bonus
])
def test_greedy_verify_by_hand(drafts, expected, accepted):
    target = torch.tensor([[1, 2, 3, 4]])
    out, num_accepted = greedy_verify(target, torch.tensor([drafts]), torch.tensor([3]))
    assert out.tolist() == [expected] and num_accepted.tolist() == [accepted]


def test_greedy_verify_ragged_and_zero_drafts():
    target = torch.tensor([[5, 6, 7], [1, 2, 3], [4, 4, 4], [8, 9, 0]])
    drafts = torch.tensor([[0, 0], [1, 2], [4, 9], [8, 7]])     # row 0's drafts are padding
    out, num_accepted = greedy_verify(target, drafts, torch.tensor([0, 2, 1, 1]))
    assert out.tolist() == [[5, -1, -1], [1, 2, 3], [4, 4, -1], [8, 9, -1]]
    assert num_accepted.tolist() == [0, 2, 1, 1]


# --- sample_from is S06's draw -----------------------------------------------------------------

def test_sample_from_equals_s06_draw_row_by_row():
    rng = np.random.default_rng(7)
    rows = rng.normal(0, 3, size=(300, 50)).astype(np.float32)
    rows[:, ::7] = -np.inf                              # ids of probability 0
    rows[::5, 10:20] = 1.5                              # ties
    rows[3] = -np.inf
    rows[3, 49] = 0.0                                   # one id with mass, the last one
    logits = torch.from_numpy(rows)
    u = torch.from_numpy(rng.random(300))
    u[:3] = torch.tensor([0.0, math.nextafter(1.0, 0.0), 0.5], dtype=F64)
    probs = torch.softmax(logits, dim=-1)                # what S06's draw computes inside
    got = sample_from(probs, u)
    params = s04.SamplingParams(temperature=1.0)
    for i in range(300):
        assert int(got[i]) == int(s06.draw(logits[i], params, u[i])), f"row {i}"
    assert not bool(torch.isinf(logits.gather(1, got[:, None])).any())


def test_sample_from_never_draws_a_zero_probability_id():
    # u x total rounds up to total: S06's rule clamps to the last id with mass (here id 1).
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=F64)
    assert sample_from(probs, torch.tensor([math.nextafter(1.0, 0.0)], dtype=F64)).tolist() == [1]


# --- explain_step: one position in numbers ------------------------------------------------------

def test_explain_step_by_hand():
    p = torch.tensor([0.6, 0.3, 0.1], dtype=F64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    rejected = explain_step(p, q, draft=1, u=0.7, u_final=0.9)
    assert rejected["p_x"] == 0.3 and rejected["q_x"] == 0.5
    assert rejected["accept_probability"] == pytest.approx(0.6)
    assert rejected["accepted"] is False                       # 0.7 x 0.5 = 0.35 >= 0.3
    assert rejected["residual"] == pytest.approx([1.0, 0.0, 0.0])   # max(p - q, 0) = [0.4, 0, 0]
    assert rejected["token"] == 0
    accepted = explain_step(p, q, draft=1, u=0.5, u_final=0.9)  # 0.25 < 0.3
    assert accepted["accepted"] is True and accepted["token"] == 1
    ngram = explain_step(p, None, draft=0, u=0.6, u_final=0.0)  # accept iff u < p(0) = 0.6
    assert ngram["q_x"] == 1.0 and ngram["accept_probability"] == 0.6
    assert ngram["accepted"] is False and ngram["residual"] == pytest.approx([0, 0.75, 0.25])
    assert ngram["token"] == 1


def test_explain_step_agrees_with_rejection_sample():
    gen = torch.Generator().manual_seed(8)
    for _ in range(200):
        p = torch.softmax(3 * torch.randn(5, generator=gen, dtype=F64), dim=-1)
        q = torch.softmax(3 * torch.randn(5, generator=gen, dtype=F64), dim=-1)
        bonus = torch.softmax(torch.randn(5, generator=gen, dtype=F64), dim=-1)
        u, u_final = torch.rand(2, generator=gen, dtype=F64).tolist()
        for q_or_none in (q, None):
            draft = int(torch.multinomial(q, 1, generator=gen))
            step = explain_step(p, q_or_none, draft, u, u_final)
            out, num_accepted = rejection_sample(
                torch.stack([p, bonus])[None], None if q_or_none is None else q[None, None],
                torch.tensor([[draft]]), torch.tensor([1]),
                torch.tensor([[u, u_final]], dtype=F64))
            assert step["accepted"] == bool(num_accepted[0] == 1)
            assert step["token"] == int(out[0, 0])


# --- the formulas, by hand ----------------------------------------------------------------------

def test_formulas_by_hand():
    assert acceptance_rate(P_BASE, Q_BASE) == pytest.approx(ALPHA_TOY)
    assert acceptance_rate(P_BASE, P_BASE) == pytest.approx(1.0)
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)        # 1 + 0.5 + 0.25
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(2.952)       # (1 - 0.4096) / 0.2
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.7, 0) == 1.0
    # Close to 1 the closed form loses digits; the sum 1 + a + ... + a^k does not.
    a = 1 - 1e-12
    assert expected_tokens_per_step(a, 3) == pytest.approx(sum(a ** i for i in range(4)),
                                                           rel=1e-14)
    assert expected_speedup(0.8, 3, 0.1) == pytest.approx(2.952 / 1.3)
    for alpha in (0.0, 0.3, 0.9, 1.0):
        for k in (1, 2, 5):
            assert expected_speedup(alpha, k, 0.0) == expected_tokens_per_step(alpha, k)
    assert expected_speedup(0.0, 3, 0.5) == pytest.approx(1 / 2.5)         # only costs


def test_optimal_k_sanity():
    assert optimal_k(1.0, 0.0, k_max=16) == 16         # free, always accepted: as many as allowed
    assert optimal_k(0.0, 0.1) == 1                    # never accepted: the fewest
    assert optimal_k(0.0, 0.0) == 1                    # every k ties at 1: the smallest
    # By hand, alpha 0.8, c 0.1: (1 - 0.8^(k+1)) / 0.2 / (1 + 0.1 k) for k = 1..7 is 1.636,
    # 2.033, 2.271, 2.401, 2.460, 2.470, 2.448: the maximum is at k = 6.
    assert optimal_k(0.8, 0.1) == 6
    assert optimal_k(0.8, 0.1, k_max=5) == 5
    alphas = [i / 20 for i in range(21)]
    costs = [0.0, 0.01, 0.05, 0.1, 0.3, 1.0]
    for c in costs:          # more acceptance never means fewer drafts
        ks = [optimal_k(a, c) for a in alphas]
        assert ks == sorted(ks), (c, ks)
    for a in alphas:         # a dearer draft never means more drafts
        ks = [optimal_k(a, c) for c in costs]
        assert ks == sorted(ks, reverse=True), (a, ks)


@pytest.mark.parametrize("call,match", [
    (lambda: expected_tokens_per_step(1.5, 2), "alpha must be a number in"),
    (lambda: expected_tokens_per_step(-0.1, 2), "alpha must be a number in"),
    (lambda: expected_tokens_per_step(math.nan, 2), "alpha must be a number in"),
    (lambda: expected_tokens_per_step(0.5, -1), "k must be an int >= 0"),
    (lambda: expected_tokens_per_step(0.5, 2.0), "k must be an int >= 0"),
    (lambda: expected_speedup(0.5, 2, -0.1), "c must be a finite number >= 0"),
    (lambda: expected_speedup(0.5, 2, math.inf), "c must be a finite number >= 0"),
    (lambda: optimal_k(0.5, 0.1, k_max=0), "k_max must be an int >= 1"),
    (lambda: optimal_k(2.0, 0.1), "alpha must be a number in"),
    (lambda: acceptance_rate(P_BASE, Q_BASE[:3]), "p and q must both be"),
    (lambda: acceptance_rate(P_BASE * 2, Q_BASE), "p must sum to 1"),
    (lambda: acceptance_rate(P_BASE, -Q_BASE), "q must be finite and non-negative"),
])
def test_formula_arguments_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- bad input to the samplers -------------------------------------------------------------------

def _good(b=2, k=2, v=4):
    target = torch.full((b, k + 1, v), 1 / v, dtype=F64)
    draft = torch.full((b, k, v), 1 / v, dtype=F64)
    ids = torch.zeros((b, k), dtype=torch.long)
    n = torch.full((b,), k)
    u = torch.full((b, k + 1), 0.5, dtype=F64)
    return target, draft, ids, n, u


def _with(**changes):
    target, draft, ids, n, u = _good()
    args = dict(target_probs=target, draft_probs=draft, draft_token_ids=ids,
                num_draft_tokens=n, uniforms=u)
    args.update(changes)
    return lambda: rejection_sample(**args)


_T, _D, _I, _N, _U = _good()


@pytest.mark.parametrize("call,match", [
    (_with(target_probs=_T[0]), r"target_probs must be \(B, K \+ 1, V\)"),
    (_with(draft_token_ids=_I[:, :1]), r"draft_token_ids must be \(B, K\)"),
    (_with(draft_token_ids=_I.double()), "draft_token_ids must be an integer tensor"),
    (_with(draft_probs=_D[:, :, :3]), r"draft_probs must be \(B, K, V\)"),
    (_with(uniforms=_U[:, :2]), r"uniforms must be \(B, K \+ 1\)"),
    (_with(num_draft_tokens=_N[:1]), r"num_draft_tokens must be \(B,\)"),
    (_with(num_draft_tokens=_N.double()), "num_draft_tokens must be an integer tensor"),
    (_with(num_draft_tokens=torch.tensor([3, 0])), r"num_draft_tokens must each be in 0..K"),
    (_with(num_draft_tokens=torch.tensor([-1, 0])), r"num_draft_tokens must each be in 0..K"),
    (_with(uniforms=torch.full((2, 3), 1.0, dtype=F64)), r"uniforms must lie in \[0, 1\)"),
    (_with(uniforms=torch.full((2, 3), -0.1, dtype=F64)), r"uniforms must lie in \[0, 1\)"),
    (_with(uniforms=torch.full((2, 3), math.nan, dtype=F64)), r"uniforms must lie in \[0, 1\)"),
    (_with(target_probs=_T.index_fill(2, torch.tensor([1]), -0.25)),
     "target_probs must be finite and non-negative"),
    (_with(target_probs=_T.index_fill(2, torch.tensor([1]), math.nan)),
     "target_probs must be finite and non-negative"),
    (_with(target_probs=_T.index_fill(2, torch.tensor([1]), math.inf)),
     "target_probs must be finite and non-negative"),
    (_with(draft_probs=_D.index_fill(2, torch.tensor([0]), math.nan)),
     "draft_probs must be finite and non-negative"),
    (_with(draft_token_ids=torch.full((2, 2), 4)), r"draft_token_ids must be in 0..V-1"),
    (_with(draft_token_ids=torch.full((2, 2), -1)), r"draft_token_ids must be in 0..V-1"),
    (_with(target_probs=torch.zeros((2, 3, 4), dtype=F64)),
     "target_probs rows must have positive mass"),
    (lambda: greedy_verify(_I, _I, _N), r"draft_token_ids must be \(B, K\)"),
    (lambda: greedy_verify(_I[0], _I, _N), r"target_token_ids must be \(B, K \+ 1\)"),
    (lambda: greedy_verify(torch.zeros((2, 3), dtype=torch.long), _I, torch.tensor([0, 3])),
     r"num_draft_tokens must each be in 0..K"),
    (lambda: sample_from(_T[:, 0], torch.tensor([0.5, 1.0], dtype=F64)), r"u must lie in"),
    (lambda: sample_from(_T[:, 0], torch.tensor([0.5], dtype=F64)), r"u must be \(B,\)"),
    (lambda: sample_from(_T, torch.tensor([0.5, 0.5], dtype=F64)), r"probs must be \(B, V\)"),
    (lambda: sample_from(torch.zeros((2, 4)), torch.tensor([0.5, 0.5], dtype=F64)),
     "probs rows must have positive mass"),
    (lambda: sample_from(-_T[:, 0], torch.tensor([0.5, 0.5], dtype=F64)),
     "probs must be finite and non-negative"),
    (lambda: explain_step(P_BASE, Q_BASE, 6, 0.5, 0.5), r"draft must be an int in 0..V-1"),
    (lambda: explain_step(P_BASE, Q_BASE, 0, 1.0, 0.5), r"u and u_final must lie in"),
    (lambda: explain_step(P_BASE, Q_BASE[:3], 0, 0.5, 0.5), r"p must be \(V,\)"),
])
def test_bad_input_is_refused_with_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


_P3 = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
_Q3 = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
_L = torch.long


@pytest.mark.parametrize("call,match", [
    # residual: p (and q) checked as probabilities, p with mass, x an id in range.
    (lambda: residual(torch.zeros(3, dtype=F64), _Q3), "p rows must have positive mass"),
    (lambda: residual(torch.stack([_P3, torch.zeros(3, dtype=F64)]), None,
                      torch.tensor([0, 1])), "p rows must have positive mass"),
    (lambda: residual(torch.full((3,), math.nan, dtype=F64), _Q3),
     "p must be finite and non-negative"),
    (lambda: residual(torch.tensor([0.7, -0.1, 0.4], dtype=F64), _Q3),
     "p must be finite and non-negative"),
    (lambda: residual(_P3, torch.tensor([0.2, -0.3, 1.1], dtype=F64)),
     "q must be finite and non-negative"),
    (lambda: residual(_P3, _Q3[:2]), "q must have p's vocabulary and broadcast to p's shape"),
    (lambda: residual(_P3.long(), None, torch.tensor(0)), "p must be a floating-point tensor"),
    (lambda: residual(torch.tensor(0.5, dtype=F64), None, torch.tensor(0)),
     r"p must have a vocabulary dimension"),
    (lambda: residual(_P3, None, torch.tensor(3)), r"x must be in 0..V-1 = 0..2"),
    (lambda: residual(_P3, None, torch.tensor(-1)), r"x must be in 0..V-1 = 0..2"),
    (lambda: residual(_P3, _Q3, torch.tensor(7)), r"x must be in 0..V-1 = 0..2"),
    (lambda: residual(_P3, None, torch.tensor([0])), r"x must have shape p.shape\[:-1\]"),
    (lambda: residual(_P3, None, torch.tensor(0.0)), "x must be an integer tensor"),
    (lambda: residual(_P3, None), "residual needs the draft token x when q is None"),
    # explain_step: p's mass up front, named p; u and u_final real numbers in [0, 1).
    (lambda: explain_step(torch.zeros(3, dtype=F64), _Q3, 0, 0.5, 0.5),
     "p rows must have positive mass"),
    (lambda: explain_step(torch.zeros(3, dtype=F64), None, 0, 0.5, 0.5),
     "p rows must have positive mass"),
    (lambda: explain_step(_P3, _Q3, 0, "0.5", 0.5), r"u must be a real number in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, None, 0.5), r"u must be a real number in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, 0.5j, 0.5), r"u must be a real number in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, True, 0.5), r"u must be a real number in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, 0.5, "x"), r"u_final must be a real number in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, 0.5, None), r"u_final must be a real number in"),
    (lambda: explain_step(_P3, _Q3, 0, 0.5, 0.5 + 0j), r"u_final must be a real number in"),
    (lambda: explain_step(_P3, _Q3, 0, 0.5, -0.25), r"u and u_final must lie in \[0, 1\)"),
    (lambda: explain_step(_P3, _Q3, 0, math.nan, 0.5), r"u and u_final must lie in \[0, 1\)"),
    # greedy_verify: ids >= 0 where used (the bound V - 1 is unknown there).
    (lambda: greedy_verify(torch.tensor([[-5, 1]]), torch.tensor([[3]]), torch.tensor([1])),
     "target_token_ids must be >= 0 where j <= num_draft_tokens"),
    (lambda: greedy_verify(torch.tensor([[3, -5]]), torch.tensor([[3]]), torch.tensor([1])),
     "target_token_ids must be >= 0 where j <= num_draft_tokens"),       # the bonus column
    (lambda: greedy_verify(torch.tensor([[1, 1]]), torch.tensor([[-1]]), torch.tensor([1])),
     "draft_token_ids must be >= 0 where j < num_draft_tokens"),
    (lambda: greedy_verify(torch.tensor([[1, 1]]), torch.tensor([[1.0]]), torch.tensor([1])),
     "draft_token_ids must be an integer tensor"),
    # the formulas: k (and k_max) bounded, so that k + 1 is an exact float.
    (lambda: expected_tokens_per_step(1.0, 10**400), r"k must be an int >= 0 .* at most MAX_K"),
    (lambda: expected_tokens_per_step(0.5, 10**6 + 1), r"at most MAX_K = 1000000"),
    (lambda: expected_tokens_per_step(0.5, 10**5000), r"got an int of 16610 bits"),
    (lambda: expected_speedup(0.5, 10**400, 0.1), r"k must be an int >= 0 .* at most MAX_K"),
    (lambda: optimal_k(0.5, 0.1, k_max=10**400), r"k_max must be an int >= 1 and at most MAX_K"),
])
def test_more_bad_input_is_refused_with_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


_NP_IDS = np.zeros((2, 2), dtype=np.int64)


@pytest.mark.parametrize("call,match", [
    (_with(target_probs=_T.tolist()), "target_probs must be a torch.Tensor, got list"),
    (_with(target_probs=_T.numpy()), "target_probs must be a torch.Tensor, got ndarray"),
    (_with(draft_probs=_D.numpy()), "draft_probs must be a torch.Tensor or None, got ndarray"),
    (_with(draft_token_ids=_NP_IDS), "draft_token_ids must be a torch.Tensor, got ndarray"),
    (_with(num_draft_tokens=[2, 2]), "num_draft_tokens must be a torch.Tensor, got list"),
    (_with(uniforms=_U.tolist()), "uniforms must be a torch.Tensor, got list"),
    (lambda: greedy_verify(np.zeros((2, 3), dtype=np.int64), _I, _N),
     "target_token_ids must be a torch.Tensor, got ndarray"),
    (lambda: greedy_verify(torch.zeros((2, 3), dtype=_L), [[0, 0], [0, 0]], _N),
     "draft_token_ids must be a torch.Tensor, got list"),
    (lambda: greedy_verify(torch.zeros((2, 3), dtype=_L), _I, [2, 2]),
     "num_draft_tokens must be a torch.Tensor, got list"),
    (lambda: sample_from(_T[:, 0].numpy(), torch.tensor([0.5, 0.5], dtype=F64)),
     "probs must be a torch.Tensor, got ndarray"),
    (lambda: sample_from(_T[:, 0], [0.5, 0.5]), "u must be a torch.Tensor, got list"),
    (lambda: residual([0.5, 0.5], None, torch.tensor(0)), "p must be a torch.Tensor, got list"),
    (lambda: residual(_P3, _Q3.numpy()), "q must be a torch.Tensor or None, got ndarray"),
    (lambda: residual(_P3, None, 0), "x must be a torch.Tensor or None, got int"),
    (lambda: explain_step(_P3.tolist(), None, 0, 0.5, 0.5), "p must be a torch.Tensor, got list"),
    (lambda: explain_step(_P3, _Q3.numpy(), 0, 0.5, 0.5), "q must be a torch.Tensor or None"),
    (lambda: acceptance_rate(_P3, _Q3.tolist()), "q must be a torch.Tensor, got list"),
])
def test_a_non_tensor_is_refused_with_a_type_error_naming_it(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_the_new_checks_keep_the_good_cases():
    # A one-element tensor or a numpy float is still a real number for explain_step.
    step = explain_step(_P3, None, 0, torch.tensor(0.7, dtype=F64), np.float32(0.2))
    assert step["accepted"] is False and step["token"] == 1     # residual [0, 0.6, 0.4]
    # residual: a q that broadcasts over p's rows, an x given with q (checked, not read),
    # and int32 ids.
    p2 = torch.stack([_P3, _Q3])
    assert torch.equal(residual(p2, _Q3), torch.stack([residual(_P3, _Q3), _Q3]))
    assert torch.equal(residual(_P3, _Q3, torch.tensor(1)), residual(_P3, _Q3))
    assert residual(_P3, None, torch.tensor(0, dtype=torch.int32)).tolist() == \
        pytest.approx([0, 0.6, 0.4])
    # greedy_verify: negative ids in the ignored padding are still ignored.
    out, num_accepted = greedy_verify(torch.tensor([[2, -1]]), torch.tensor([[-7]]),
                                      torch.tensor([0]))
    assert out.tolist() == [[2, -1]] and num_accepted.tolist() == [0]
    # The formulas at the bound.
    assert expected_tokens_per_step(1.0, 10**6) == 10**6 + 1
    assert expected_tokens_per_step(0.5, 10**6) == pytest.approx(2.0)
    assert expected_speedup(0.5, 10**6, 0.0) == pytest.approx(2.0)


@pytest.mark.gpu
def test_on_cuda_the_decisions_equal_the_cpus():
    """The same inputs on CUDA: the accept decisions are the same float64 products and
    comparisons, so num_accepted must be equal; the final draw's float64 cumsum may associate
    differently on the device, so a token may differ only where u x total lies within rounding
    of a boundary (allowed for at most 1 in 10^4 trials)."""
    gen = torch.Generator().manual_seed(9)
    n, k, v = 50_000, 4, 32
    target = torch.softmax(2 * torch.randn((n, k + 1, v), generator=gen), dim=-1)
    draft = torch.softmax(2 * torch.randn((n, k, v), generator=gen), dim=-1)
    drafts = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).view(n, k)
    num_draft = torch.randint(0, k + 1, (n,), generator=gen)
    uniforms = torch.rand((n, k + 1), dtype=F64, generator=gen)
    args = (target, draft, drafts, num_draft, uniforms)
    out_cpu, acc_cpu = rejection_sample(*args)
    out_gpu, acc_gpu = rejection_sample(*(a.cuda() for a in args))
    assert torch.equal(acc_gpu.cpu(), acc_cpu)
    assert (out_gpu.cpu() != out_cpu).any(dim=1).sum().item() <= n // 10_000
