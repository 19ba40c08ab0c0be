"""S15 exercises, reference solutions: several candidates at one position, the greedy step with
the stop rules, the KV of rejected drafts, and how many drafts to propose.

Try the stubs in exercises/s15_speculative.py first; grade these with
`python exercises/grade.py --solutions s15`.

Sources followed: Leviathan, Kalman, Matias (ICML 2023), Algorithm 1 and Theorem 3.8; Chen et
al. (DeepMind 2023), modified rejection sampling; the multi-candidate rule is SpecInfer's
multi-step speculative sampling (Miao et al., ASPLOS 2024, Algorithm 2: each rejected
candidate leaves the residual as the next target) and Sun et al.'s SpecTr (NeurIPS 2023) for
the setting; vLLM V1's greedy rejection sampler, its min_tokens processor and the scheduler's
rollback of rejected tokens (`update_from_output`); vLLM's `SpecDecodingStats`
(num_accepted_tokens_per_pos) for what is measured per position.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


# Exercise 1: several candidates at one position ----------------------------------------------

def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF in float64: the smallest id whose cumulative sum exceeds u x total, never
    an id past the last one with mass."""
    cdf = torch.cumsum(probs, dim=0)
    total = cdf[-1]
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(total)], dtype=cdf.dtype),
                                   right=True))
    return min(token, int((cdf < total).sum()))


def verify_candidates(p: torch.Tensor, q: torch.Tensor, candidates: Sequence[int],
                      uniforms: Sequence[float]) -> tuple[int, int]:
    """Candidate i is tested against p_i, the distribution the output must follow once
    candidates 0..i-1 were rejected: p_0 = p, and p_{i+1} = max(p_i - q, 0), normalised (one
    draft's argument applied to p_i: since x_{i+1} is a fresh draw from q, the next test is the
    one-draft rule with target p_{i+1}). All rejected: draw from p_m."""
    m = len(candidates)
    if m < 1 or len(uniforms) != m + 1:
        raise ValueError(f"need m >= 1 candidates and m + 1 uniforms (got {m} and "
                         f"{len(uniforms)})")
    target, q = p.double(), q.double()
    for i, x in enumerate(candidates):
        if uniforms[i] * float(q[x]) < float(target[x]):
            return i, int(x)
        rest = (target - q).clamp(min=0.0)
        mass = float(rest.sum())
        target = rest / mass if mass > 0 else target / target.sum()
    return -1, _draw(target, float(uniforms[m]))


# Exercise 2: the greedy step with the stop rules ---------------------------------------------

def greedy_step(logits: torch.Tensor, drafts: Sequence[int], num_output_tokens: int,
                min_tokens: int, stop_ids: set[int] | frozenset[int]) -> list[int]:
    """Row j's choice is its argmax with the stop ids ruled out while the output would still
    be shorter than min_tokens (num_output_tokens + j tokens exist before it: the accepted
    drafts count as output); drafts are kept while they equal the choice; the choice at the
    first mismatch (or the bonus row) ends the step; a stop id ends it where it stands."""
    stop = sorted(stop_ids)
    out: list[int] = []
    for j in range(len(drafts) + 1):
        row = logits[j].float()
        if stop and num_output_tokens + j < min_tokens:
            row = row.clone()
            row[stop] = -math.inf
        choice = int(row.argmax())
        out.append(choice)
        if choice in stop_ids or j == len(drafts) or drafts[j] != choice:
            break
    return out


# Exercise 3: the KV of rejected drafts -------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_after_step(num_computed_tokens: int, num_drafts: int, num_accepted: int,
                  block_size: int) -> tuple[int, int, int, int]:
    """The step computes the last token and the drafts (1 + d positions, allocated on top of
    the c held), keeps the last token and the accepted ones, and trims the rest."""
    c, d, a = num_computed_tokens, num_drafts, num_accepted
    if c < 0 or d < 0 or not 0 <= a <= d or block_size < 1:
        raise ValueError("need num_computed_tokens >= 0, num_drafts >= 0, "
                         "0 <= num_accepted <= num_drafts, block_size >= 1")
    after = c + 1 + a
    held_before, held_during = _cdiv(c, block_size), _cdiv(c + 1 + d, block_size)
    held_after = _cdiv(after, block_size)
    return after, held_after, held_during - held_before, held_during - held_after


# Exercise 4: how many drafts ------------------------------------------------------------------

def expected_tokens_per_forward(acceptance_per_position: Sequence[float], k: int) -> float:
    """Draft j is accepted only with every draft before it, so the measured rate at position j
    is already P(at least j + 1 accepted), and proposing fewer drafts does not change the first
    ones: E[tokens] = 1 + sum of the first k rates."""
    rates = list(acceptance_per_position)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(rates):
        raise ValueError(f"k must be an int in 0..{len(rates)} (got {k!r})")
    return 1.0 + float(sum(rates[:k]))


def choose_num_drafts(acceptance_per_position: Sequence[float], c: float
                      ) -> tuple[int, float]:
    """The k in 0..K with the largest E[tokens] / (1 + k c), the smallest on a tie."""
    if not c >= 0:
        raise ValueError(f"c must be >= 0 (got {c!r})")
    best_k, best = 0, 1.0
    for k in range(1, len(acceptance_per_position) + 1):
        speedup = expected_tokens_per_forward(acceptance_per_position, k) / (1.0 + k * c)
        if speedup > best:
            best_k, best = k, speedup
    return best_k, best
