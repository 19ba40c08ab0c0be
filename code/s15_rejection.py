"""S15, speculative decoding: the verification step (modified rejection sampling), and the formulas
that say what it buys.

What is new since S14
    A cheap proposer (a small draft model, or an n-gram lookup in the prompt) guesses K tokens;
    the target model scores all of them in one forward (code/s15_speculative.py); this module
    decides which guesses to keep so that the emitted tokens follow the *target's* distribution
    exactly, whatever the draft proposed (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    - `rejection_sample`: for each of B requests, draft j (token x, drawn from q_j) is accepted
      with probability min(1, p_j(x) / q_j(x)); at the first rejection the request stops and
      draws its final token from the residual max(p_j - q_j, 0) (normalised); if every draft
      was accepted it draws a bonus token from p at the next position. So one target forward
      yields between 1 and K + 1 tokens. Vectorised over the batch: no loop over requests or
      positions, a few host syncs for the argument checks only.
      `draft_probs=None` is a deterministic proposer (n-gram, greedy draft): q is one-hot at the
      draft token, so x is accepted with probability p(x) and the residual is p without x
      (vLLM's convention for n-gram).
    - Seeded reproducibility: a request consumes exactly K + 1 uniform numbers per step,
      whatever is accepted: uniforms[:, j] decides draft j, uniforms[:, K] draws the final token.
    - `greedy_verify`: temperature 0, accept while the draft equals the target's argmax.
    - `sample_from`: S06's inverse-CDF draw (code/s06_sampler.py `draw`) for a batch of
      probability rows; `explain_step`: one position worked out in numbers, for the chapter.
    - The formulas: `acceptance_rate` (alpha = sum_x min(p, q)), `expected_tokens_per_step`
      ((1 - alpha^(k+1)) / (1 - alpha)), `expected_speedup` (Leviathan Theorem 3.8) and
      `optimal_k`.

What it does not handle
    Probabilities in, tokens out: turning logits into target and draft rows (temperature,
    top-k, top-p, penalties) is the caller's job, and both rows must come from the same
    processing for the guarantee to hold. Rows are taken as distributions (each sums to 1);
    they are not renormalised before the acceptance test. One draft chain per request (no
    trees, no typical acceptance); no logprobs; no fused kernel (vLLM uses Triton kernels).

Run it
    No main; code/s15_speculative.py calls it from the engine's step.

Tests
    tests/test_s15_rejection.py: on toy targets and drafts that differ by position, chi-square
    tests that the first emitted token, the token at each position given the run reached it,
    and the first two tokens of a generation (two steps) follow the target, while a sampler
    that redraws from p instead of the residual fails the same tests by orders of magnitude;
    measured acceptance and tokens per step against the formulas; the n-gram convention;
    greedy verification by hand; q == p and disjoint supports; `sample_from` against S06's
    `draw` row by row; the formulas by hand; every argument rule.

References
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
    ICML 2023: Algorithm 1, Definition 3.1 and Corollary 3.6 (alpha), Equation 1 / Theorem 3.5
    (expected tokens), Theorem 3.8 (walltime improvement). Chen, Borgeaud, Irving, Lespiau,
    Sifre, Jumper, "Accelerating Large Language Model Decoding with Speculative Sampling",
    DeepMind 2023 (modified rejection sampling). vLLM v1 `vllm/v1/sample/rejection_sampler.py`
    (the output layout: (B, K + 1) with -1 past the emitted tokens; the one-hot q for n-gram;
    greedy verification against the target's argmax).

Shape legend (the whole course): B batch (here: requests), T tokens in this step, S key/value
length, H query heads, Hkv key/value heads, D head dim, V vocabulary, L layers; K the most draft
tokens of any request in the batch.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import torch

# vLLM's PLACEHOLDER_TOKEN_ID: the slots of output_token_ids past a request's emitted tokens.
PLACEHOLDER_TOKEN_ID = -1

# The most draft tokens per step the formulas accept: far beyond any real k, and small enough
# that k + 1 and k x c stay exact floats (10**400 would overflow them).
MAX_K = 10**6


# ---------------------------------------------------------------------------------------------
# The draw
# ---------------------------------------------------------------------------------------------

def _check_tensor(t, name: str, optional: bool = False) -> None:
    """TypeError unless t is a torch.Tensor (or None, when optional): lists and numpy arrays
    would otherwise fail later with an AttributeError that names no argument."""
    if optional and t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got "
                        f"{type(t).__name__}")


def _show(value) -> str:
    """repr, except for an int too long to print usefully (or at all: Python refuses to turn
    an int of more than 4300 digits into a string)."""
    if isinstance(value, Integral) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an int of {int(value).bit_length()} bits"
    return repr(value)


def _check_uniforms(u: torch.Tensor, name: str) -> None:
    if not u.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {u.dtype}")
    if not bool(((u >= 0) & (u < 1)).all()):   # NaN fails both comparisons
        raise ValueError(f"{name} must lie in [0, 1)")


def _check_probs(probs: torch.Tensor, name: str, used: torch.Tensor | None = None) -> None:
    """probs (..., V) finite and non-negative; only the rows where `used` (...) is True."""
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {probs.dtype}")
    if probs.dim() == 0:
        raise ValueError(f"{name} must have a vocabulary dimension (..., V), got a 0-d tensor")
    if probs.shape[-1] == 0:
        raise ValueError(f"{name} must have a vocabulary of at least one token")
    # amin and amax propagate NaN, and NaN fails both comparisons.
    row_ok = (probs.amin(dim=-1) >= 0) & (probs.amax(dim=-1) < math.inf)
    if used is not None:
        row_ok = row_ok | ~used
    if not bool(row_ok.all()):
        raise ValueError(f"{name} must be finite and non-negative (no NaN, inf or negative "
                         "entries)")


def _check_mass(probs: torch.Tensor, name: str) -> None:
    """Every row of probs (..., V), already checked by `_check_probs`, has positive mass."""
    if not bool((probs.double().sum(dim=-1) > 0).all()):
        raise ValueError(f"{name} rows must have positive mass (a row of zeros has nothing to "
                         "draw)")


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one token per row: S06's `draw` rule for a batch of probability rows.

    probs: (B, V) float, non-negative, finite; a row need not sum to 1 (it is drawn in
    proportion), but must have positive mass. u: (B,) float64 in [0, 1). Returns int64 (B,) on
    probs' device: the id whose interval of the float64 cumulative sum contains u x total, never
    an id of probability 0 (if u x total rounds up to total, the last id with mass). With probs
    = softmax(logits) in float32 this is bit for bit S06 `draw(logits, params, u)` for a
    non-greedy request (tests, row by row).
    Raises TypeError if probs or u is not a torch.Tensor; ValueError if probs is not 2-D, u is
    not (B,), u is outside [0, 1), a row has a negative, NaN or infinite entry, or a row has no
    mass.
    """
    _check_tensor(probs, "probs")
    _check_tensor(u, "u")
    if probs.dim() != 2:
        raise ValueError(f"probs must be (B, V), got shape {tuple(probs.shape)}")
    if u.shape != probs.shape[:1]:
        raise ValueError(f"u must be (B,) = ({probs.shape[0]},), got shape {tuple(u.shape)}")
    _check_uniforms(u, "u")
    _check_probs(probs, "probs")
    cdf = torch.cumsum(probs.double(), dim=-1)                                 # (B, V)
    total = cdf[:, -1:]                                                        # (B, 1)
    if not bool((total > 0).all()):
        raise ValueError("probs rows must have positive mass (a row of zeros has nothing to draw)")
    return _draw(cdf, total, u)


def _draw(cdf: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    token = torch.searchsorted(cdf, u.double().to(cdf.device).unsqueeze(-1) * total,
                               right=True)                                     # (B, 1)
    last_with_mass = (cdf < total).sum(dim=-1, keepdim=True)  # cdf reaches total there
    return torch.minimum(token, last_with_mass).squeeze(-1)                    # (B,)


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------

def _num_accepted(accept: torch.Tensor) -> torch.Tensor:
    """accept bool (B, K) -> int64 (B,): the length of each row's leading run of True."""
    return torch.cumprod(accept.long(), dim=-1).sum(dim=-1)


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor
          ) -> torch.Tensor:
    """(B, K + 1): the accepted drafts, the final token at num_accepted, -1 after it."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device)                  # (K + 1,)
    padded = torch.cat([draft_token_ids, final.unsqueeze(-1)], dim=-1)        # (B, K + 1)
    out = torch.where(pos < num_accepted.unsqueeze(-1), padded,
                      torch.full_like(padded, PLACEHOLDER_TOKEN_ID))
    return out.scatter(1, num_accepted.unsqueeze(-1), final.unsqueeze(-1))


def _check_counts(num_draft_tokens: torch.Tensor, b: int, k: int) -> None:
    if num_draft_tokens.shape != (b,):
        raise ValueError(f"num_draft_tokens must be (B,) = ({b},), got shape "
                         f"{tuple(num_draft_tokens.shape)}")
    if num_draft_tokens.is_floating_point() or num_draft_tokens.dtype == torch.bool:
        raise ValueError(f"num_draft_tokens must be an integer tensor, got "
                         f"{num_draft_tokens.dtype}")
    if not bool(((num_draft_tokens >= 0) & (num_draft_tokens <= k)).all()):
        raise ValueError(f"num_draft_tokens must each be in 0..K = 0..{k}")


def _check_ids(ids: torch.Tensor, name: str) -> None:
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")


def residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The distribution to draw from after rejecting draft x: max(p - q, 0), normalised
    (Leviathan Algorithm 1; Chen et al.'s (q - p)+ in their notation with the roles named the
    other way).

    p, q: (..., V) float; the result is float64 (..., V), each row summing to 1. q=None is the
    deterministic proposer: q one-hot at x ((...,) int64), so the residual is p without x. If
    the residual's mass is 0 in floating point, the row is p itself (normalised): in exact
    arithmetic a rejection means p(x) < q(x), and since both sum to 1 some other token has
    p > q, so the mass is positive; only rounding (p == q up to the last bits, or rows that sum
    to slightly different totals) can empty it, and then p is the distribution the draw must
    follow anyway.

    p must be finite and non-negative with positive mass in every row (it is not required to
    sum to 1); q, when given, finite and non-negative, with p's vocabulary and a shape that
    broadcasts to p's. x, when given, is an integer tensor of shape p.shape[:-1] with ids in
    0..V-1 (checked even when q is given, where it is not read).
    Raises TypeError if p, q or x is not a tensor (q and x may be None); ValueError naming the
    argument and the rule otherwise.
    """
    _check_tensor(p, "p")
    _check_tensor(q, "q", optional=True)
    _check_tensor(x, "x", optional=True)
    _check_probs(p, "p")
    v = p.shape[-1]
    if q is not None:
        _check_probs(q, "q")
        try:
            shape = torch.broadcast_shapes(p.shape, q.shape)
        except RuntimeError:
            shape = None
        if q.shape[-1] != v or shape != p.shape:
            raise ValueError(f"q must have p's vocabulary and broadcast to p's shape "
                             f"{tuple(p.shape)}, got shape {tuple(q.shape)}")
    _check_mass(p, "p")
    if x is None:
        if q is None:
            raise ValueError("residual needs the draft token x when q is None (one-hot q)")
    else:
        _check_ids(x, "x")
        if x.shape != p.shape[:-1]:
            raise ValueError(f"x must have shape p.shape[:-1] = {tuple(p.shape[:-1])}, got "
                             f"shape {tuple(x.shape)}")
        if not bool(((x >= 0) & (x < v)).all()):
            raise ValueError(f"x must be in 0..V-1 = 0..{v - 1}")
        x = x.to(p.device)
    return _residual(p, q, x)


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor | None
              ) -> torch.Tensor:
    """`residual` without the argument checks (rejection_sample and explain_step have done
    them)."""
    p = p.double()
    if q is None:
        res = p.scatter(-1, x.long().unsqueeze(-1), 0.0)
    else:
        res = (p - q.double()).clamp(min=0.0)
    mass = res.sum(dim=-1, keepdim=True)                                       # (..., 1)
    res = torch.where(mass > 0, res, p)
    return res / res.sum(dim=-1, keepdim=True)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's verification for a batch of requests (Leviathan et al. 2023,
    Algorithm 1; Chen et al. 2023, modified rejection sampling).

    target_probs: (B, K + 1, V) float. Row j of request b is the target's (processed)
        distribution p_j at draft position j, given that drafts 0..j-1 were accepted; row
        num_draft_tokens[b] is the bonus distribution. Rows past num_draft_tokens[b] are
        ignored (not even checked).
    draft_probs: (B, K, V) float, the distributions q_j the drafts were drawn from, or None for
        a deterministic proposer (n-gram lookup, greedy draft): q_j is then one-hot at the
        draft token, so x is accepted with probability p_j(x) and the residual is p_j without
        x, renormalised (vLLM's n-gram convention). Rows past num_draft_tokens[b] ignored.
    draft_token_ids: int (B, K), ids in 0..V-1; padding past num_draft_tokens[b] is ignored.
    num_draft_tokens: int (B,), each in 0..K.
    uniforms: float64 (B, K + 1) in [0, 1). uniforms[b, j] (j < num_draft_tokens[b]) decides
        draft j: accept iff u * q(x) < p(x), the test u < p(x) / q(x) without a division. So
        with q(x) > 0 draft x is accepted iff u < min(1, p(x) / q(x)), with probability
        exactly min(1, p/q) for a uniform u in [0, 1); p(x) = 0 always rejects; q(x) = 0 with
        p(x) > 0 (the draft drew a token its own row gives no mass, possible only through
        rounding or a caller's bug) accepts, the limit of min(1, p/q). (vLLM accepts on
        p/q >= u and rejects whenever q(x) = 0; the two differ only on these measure-zero
        boundaries.) uniforms[b, K], the last column, draws the final token: the residual at
        the first rejected position, or the bonus row when every draft was accepted. The
        uniform that decided a rejection is never reused for the draw, and every request
        consumes exactly K + 1 uniforms per step whatever happens (the engine's seeded
        generators rely on it); columns num_draft_tokens[b]..K-1 are simply not read.

    Returns (output_token_ids, num_accepted): output_token_ids int64 (B, K + 1), request b's
    num_accepted[b] accepted drafts, then its final token at index num_accepted[b], then -1;
    num_accepted int64 (B,). Request b emits num_accepted[b] + 1 tokens.

    The final draw is `sample_from`'s rule (S06's inverse CDF) on the residual, computed in
    float64; see `residual` for the fallback when its mass is 0.
    Raises TypeError naming the argument if one is not a torch.Tensor (draft_probs may be None);
    ValueError naming the rule broken: shapes that do not agree, num_draft_tokens outside
    0..K, draft ids outside 0..V-1, uniforms outside [0, 1), negative / NaN / infinite
    probabilities in a row that is used, a used target row with no mass.
    """
    _check_tensor(target_probs, "target_probs")
    _check_tensor(draft_probs, "draft_probs", optional=True)
    _check_tensor(draft_token_ids, "draft_token_ids")
    _check_tensor(num_draft_tokens, "num_draft_tokens")
    _check_tensor(uniforms, "uniforms")
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be (B, K + 1, V), got shape "
                         f"{tuple(target_probs.shape)}")
    b, k1, v = target_probs.shape
    k = k1 - 1
    if k < 0:
        raise ValueError("target_probs must have K + 1 >= 1 rows per request")
    if draft_token_ids.shape != (b, k):
        raise ValueError(f"draft_token_ids must be (B, K) = ({b}, {k}), got shape "
                         f"{tuple(draft_token_ids.shape)}")
    _check_ids(draft_token_ids, "draft_token_ids")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be (B, K, V) = ({b}, {k}, {v}) or None, got shape "
                         f"{tuple(draft_probs.shape)}")
    if uniforms.shape != (b, k1):
        raise ValueError(f"uniforms must be (B, K + 1) = ({b}, {k1}), got shape "
                         f"{tuple(uniforms.shape)}")
    _check_counts(num_draft_tokens, b, k)
    _check_uniforms(uniforms, "uniforms")
    device = target_probs.device
    num_draft = num_draft_tokens.to(device=device, dtype=torch.long)
    pos = torch.arange(k1, device=device)                                      # (K + 1,)
    offered = pos[:k] < num_draft.unsqueeze(-1)                                # (B, K)
    _check_probs(target_probs, "target_probs", pos <= num_draft.unsqueeze(-1))
    if draft_probs is not None:
        _check_probs(draft_probs, "draft_probs", offered)
    ids = draft_token_ids.to(device=device, dtype=torch.long)
    if not bool((((ids >= 0) & (ids < v)) | ~offered).all()):
        raise ValueError(f"draft_token_ids must be in 0..V-1 = 0..{v - 1} where "
                         "j < num_draft_tokens")
    ids = torch.where(offered, ids, torch.zeros_like(ids))   # padding -> a harmless index
    u = uniforms.to(device=device, dtype=torch.float64)

    # Acceptance, every offered position at once; only the leading run of accepts counts.
    p_x = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()  # (B, K)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).double()       # (B, K)
    accept = (u[:, :k] * q_x < p_x) & offered                                      # (B, K)
    num_accepted = _num_accepted(accept)                                           # (B,)
    rejected = num_accepted < num_draft                                            # (B,)

    # The final token: from the row at num_accepted, the residual if that draft was rejected.
    row = num_accepted.view(b, 1, 1).expand(b, 1, v)
    p_final = target_probs.gather(1, row).squeeze(1).double()                      # (B, V)
    if k > 0:
        row_k = num_accepted.clamp(max=k - 1)              # a rejected position is < K
        x_final = ids.gather(1, row_k.unsqueeze(-1)).squeeze(-1)                   # (B,)
        q_final = None if draft_probs is None else (
            draft_probs.gather(1, row_k.view(b, 1, 1).expand(b, 1, v)).squeeze(1))  # (B, V)
        final_probs = torch.where(rejected.unsqueeze(-1),
                                  _residual(p_final, q_final, x_final), p_final)    # (B, V)
    else:
        final_probs = p_final
    cdf = torch.cumsum(final_probs, dim=-1)                                        # (B, V)
    total = cdf[:, -1:]
    if not bool((total > 0).all()):
        raise ValueError("target_probs rows must have positive mass where they are used")
    final = _draw(cdf, total, u[:, k])                                             # (B,)
    return _emit(ids, num_accepted, final), num_accepted


def greedy_verify(target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification at temperature 0 (vLLM's greedy rejection sampler): accept draft j iff it
    equals the target's argmax there and drafts 0..j-1 were accepted.

    target_token_ids: int (B, K + 1), the target's argmax at each position (column
    num_draft_tokens[b] is the bonus). draft_token_ids: int (B, K), padding past
    num_draft_tokens[b] ignored. num_draft_tokens: int (B,), each in 0..K. Returns
    (output_token_ids int64 (B, K + 1), num_accepted int64 (B,)) as `rejection_sample` does:
    the accepted drafts, then target_token_ids[b, num_accepted[b]] (the correction, or the
    bonus), then -1. The output is exactly what greedy decoding with the target alone emits.
    Ids must be >= 0 where they are used (target columns 0..num_draft_tokens[b], drafts
    0..num_draft_tokens[b]-1); the upper bound V - 1 cannot be checked here, since only ids
    come in and the vocabulary size is unknown: keeping ids below V is the caller's job.
    Raises TypeError if an argument is not a torch.Tensor; ValueError for shapes that do not
    agree, ids that are not integers or are negative where used, or num_draft_tokens outside
    0..K.
    """
    _check_tensor(target_token_ids, "target_token_ids")
    _check_tensor(draft_token_ids, "draft_token_ids")
    _check_tensor(num_draft_tokens, "num_draft_tokens")
    if target_token_ids.dim() != 2:
        raise ValueError(f"target_token_ids must be (B, K + 1), got shape "
                         f"{tuple(target_token_ids.shape)}")
    b, k1 = target_token_ids.shape
    k = k1 - 1
    if k < 0:
        raise ValueError("target_token_ids must have K + 1 >= 1 columns")
    if draft_token_ids.shape != (b, k):
        raise ValueError(f"draft_token_ids must be (B, K) = ({b}, {k}), got shape "
                         f"{tuple(draft_token_ids.shape)}")
    _check_ids(target_token_ids, "target_token_ids")
    _check_ids(draft_token_ids, "draft_token_ids")
    _check_counts(num_draft_tokens, b, k)
    device = target_token_ids.device
    target = target_token_ids.long()
    num_draft = num_draft_tokens.to(device=device, dtype=torch.long)
    ids = draft_token_ids.to(device=device, dtype=torch.long)
    pos = torch.arange(k1, device=device)                                        # (K + 1,)
    offered = pos[:k] < num_draft.unsqueeze(-1)                                  # (B, K)
    if not bool(((target >= 0) | (pos > num_draft.unsqueeze(-1))).all()):
        raise ValueError("target_token_ids must be >= 0 where j <= num_draft_tokens (token "
                         "ids; -1 is the output's placeholder)")
    if not bool(((ids >= 0) | ~offered).all()):
        raise ValueError("draft_token_ids must be >= 0 where j < num_draft_tokens (token ids)")
    return _greedy_verify(target, ids, num_draft)


def _greedy_verify(target: torch.Tensor, ids: torch.Tensor, num_draft: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_verify`'s rule without its checks: int64 (B, K + 1), (B, K), (B,) on one
    device, already valid (the engine's sampler, which builds them, calls this: the checks
    cost more host time than the rule on a small batch)."""
    k = ids.shape[1]
    offered = torch.arange(k, device=ids.device) < num_draft.unsqueeze(-1)         # (B, K)
    num_accepted = _num_accepted((ids == target[:, :k]) & offered)                 # (B,)
    final = target.gather(1, num_accepted.unsqueeze(-1)).squeeze(-1)             # (B,)
    return _emit(ids, num_accepted, final), num_accepted


# ---------------------------------------------------------------------------------------------
# One position in numbers (the chapter's worked example)
# ---------------------------------------------------------------------------------------------

def _real(value, name: str) -> float:
    """value as a float if it is a real number (a one-element real tensor included), else a
    ValueError naming the argument; the range is checked by the caller."""
    if isinstance(value, torch.Tensor):
        ok = (value.numel() == 1 and value.dtype != torch.bool and not value.is_complex())
    else:
        ok = isinstance(value, Real) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name} must be a real number in [0, 1), got {_show(value)}")
    return float(value)


def explain_step(p: torch.Tensor, q: torch.Tensor | None, draft: int, u: float,
                 u_final: float) -> dict:
    """One draft position verified, every intermediate as a plain Python number, for the
    chapter's worked example, the notebook and the simulator.

    p, q: (V,) the target's and the draft's distributions (q=None: one-hot at `draft`);
    draft: the draft token id; u: the uniform that decides it; u_final: the uniform for the
    residual draw. Returns {"p_x", "q_x", "accept_probability" (min(1, p_x / q_x); 1 if q_x = 0
    < p_x, 0 if both are 0), "accepted" (u * q_x < p_x), "residual" (list of V floats,
    normalised, as `residual`), "token" (the draft if accepted, else the residual drawn with
    u_final)}. The same decision and token as `rejection_sample` with K = 1 on
    target rows (p, anything), draft row q and uniforms (u, u_final) (tests).
    u and u_final: real numbers (a Python or numpy int or float, or a one-element real tensor;
    not a bool, str, None or complex) in [0, 1).
    Raises TypeError if p or q is not a tensor (q may be None); ValueError for bad shapes, a
    draft outside 0..V-1, u or u_final not a real number in [0, 1), bad probabilities, or a p
    with no mass.
    """
    _check_tensor(p, "p")
    _check_tensor(q, "q", optional=True)
    if p.dim() != 1 or (q is not None and q.shape != p.shape):
        raise ValueError("p must be (V,) and q (V,) or None")
    v = p.shape[0]
    if isinstance(draft, bool) or not isinstance(draft, Integral) or not 0 <= draft < v:
        raise ValueError(f"draft must be an int in 0..V-1 = 0..{v - 1}")
    u, u_final = _real(u, "u"), _real(u_final, "u_final")
    uu = torch.tensor([u, u_final], dtype=torch.float64)
    _check_uniforms(uu, "u and u_final")
    _check_probs(p, "p")
    if q is not None:
        _check_probs(q, "q")
    _check_mass(p, "p")
    p_x = float(p[draft])
    q_x = 1.0 if q is None else float(q[draft])
    if q_x > 0:
        accept_probability = min(1.0, p_x / q_x)
    else:
        accept_probability = 1.0 if p_x > 0 else 0.0
    accepted = u * q_x < p_x
    res = _residual(p, q, torch.tensor(draft, device=p.device))                   # (V,)
    if accepted:
        token = int(draft)
    else:
        token = int(sample_from(res.unsqueeze(0), uu[1:]).item())
    return {"p_x": p_x, "q_x": q_x, "accept_probability": accept_probability,
            "accepted": bool(accepted), "residual": res.tolist(), "token": token}


# ---------------------------------------------------------------------------------------------
# What it buys: Leviathan et al.'s formulas
# ---------------------------------------------------------------------------------------------

def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), the probability that a draft drawn from q
    is accepted (Leviathan et al. 2023, Definition 3.1 and Corollary 3.6).

    p, q: (V,) float distributions (each summing to 1 within 1e-4). Computed in float64.
    Raises ValueError for shapes that differ, negative / NaN / infinite entries, or a row that
    does not sum to 1; TypeError if p or q is not a torch.Tensor.
    """
    _check_tensor(p, "p")
    _check_tensor(q, "q")
    if p.dim() != 1 or q.shape != p.shape:
        raise ValueError(f"p and q must both be (V,), got shapes {tuple(p.shape)} and "
                         f"{tuple(q.shape)}")
    _check_probs(p, "p")
    _check_probs(q, "q")
    p, q = p.double(), q.double()
    for name, row in (("p", p), ("q", q)):
        if abs(float(row.sum()) - 1.0) > 1e-4:
            raise ValueError(f"{name} must sum to 1 (a distribution), sums to {float(row.sum())}")
    return float(torch.minimum(p, q).sum())


def _check_alpha_k(alpha: float, k: int) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, Integral) or not 0 <= k <= MAX_K:
        raise ValueError(f"k must be an int >= 0 (draft tokens per step) and at most MAX_K = "
                         f"{MAX_K}, got {_show(k)}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens one target forward emits with k drafts
    whose acceptances are i.i.d. with rate alpha (Leviathan et al. 2023, Equation 1); k + 1 when
    alpha == 1, 1 when k == 0 or alpha == 0. Computed as -expm1((k+1) ln alpha) / (1 - alpha),
    which keeps its precision as alpha approaches 1.
    Raises ValueError unless alpha is in [0, 1] and k an int in 0..MAX_K (10**6: k + 1 must
    stay an exact float; 10**400 would overflow it).
    """
    _check_alpha_k(alpha, k)
    alpha = float(alpha)
    if alpha == 1.0:
        return float(k + 1)
    if alpha == 0.0:
        return 1.0
    return -math.expm1((k + 1) * math.log(alpha)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Expected walltime improvement over decoding with the target alone (Leviathan et al.
    2023, Theorem 3.8): (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), that is
    `expected_tokens_per_step` / (k c + 1).

    c: the cost of one draft token over the cost of one target forward (>= 0; the theorem
    assumes the target scores k + 1 positions as fast as one, which holds while decode is
    memory bound). Raises ValueError unless alpha is in [0, 1], k an int in 0..MAX_K and c a
    finite number >= 0.
    """
    _check_alpha_k(alpha, k)
    if isinstance(c, bool) or not isinstance(c, Real) or not 0.0 <= c < math.inf:
        raise ValueError(f"c must be a finite number >= 0 (draft cost / target cost), got {c!r}")
    return expected_tokens_per_step(alpha, k) / (k * float(c) + 1.0)


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The number of drafts per step, k in 1..k_max, with the highest `expected_speedup`
    (the smallest such k on a tie). Raises ValueError as `expected_speedup` does, or unless
    k_max is an int in 1..MAX_K."""
    if isinstance(k_max, bool) or not isinstance(k_max, Integral) or not 1 <= k_max <= MAX_K:
        raise ValueError(f"k_max must be an int >= 1 and at most MAX_K = {MAX_K}, got "
                         f"{_show(k_max)}")
    best_k, best = 1, expected_speedup(alpha, 1, c)
    for k in range(2, k_max + 1):
        speedup = expected_speedup(alpha, k, c)
        if speedup > best:
            best_k, best = k, speedup
    return best_k
