"""S15 exercises: several candidates at one position, the greedy step with the stop rules, the
KV of rejected drafts, and how many drafts to propose.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s15

The chapter's code is code/s15_rejection.py (the verification rule: `rejection_sample`,
`residual`, `greedy_verify`, Leviathan's formulas) and code/s15_speculative.py (proposers, the
`RejectionSampler` the engine samples with, `SpecDecodingStats`, `build_engine`); the engine
seams are S09's (`LLMEngine._propose`, `record_computed` in code/s09_scheduler.py) and the
blocks S12's (`KVCacheManager` in code/s12_paged_attention.py). The graded tests hold your
answers against the target distribution itself (chi-square), against the chapter's one-draft
rule on random rows, against the chapter's engine on the bundled model step by step (its
tokens, its KV manager's books, its statistics), and against Monte-Carlo runs of the chapter's
rejection sampler. Reference solutions are in exercises/solutions/ -- try first, peek later.

Vocabulary (the chapter's): the target's distribution p and the draft's q at a position; a
draft token x drawn from q is accepted with probability min(1, p(x) / q(x)); on a rejection the
token is drawn from the residual, max(p - q, 0) normalised; one target forward verifies the
last token and k drafts and emits the accepted drafts and one more token (the correction at
the first rejection, or the bonus when every draft was accepted).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


# Exercise 1: several candidates at one position (3 points) -----------------------------------
# The chapter verifies one chain of drafts, one candidate per position. Tree methods (SpecInfer,
# SpecTr) offer several candidates for the same position and want the best chance that one of
# them is kept, without changing the output's distribution. Build that verifier for one
# position from the definition, using the chapter's argument for why the residual is right
# (the section on the rejection rule and its proof).

def verify_candidates(p: torch.Tensor, q: torch.Tensor, candidates: Sequence[int],
                      uniforms: Sequence[float]) -> tuple[int, int]:
    """One position, m candidates: return (index of the candidate kept, the token emitted),
    or (-1, a token drawn after every candidate was rejected). Whatever p and q, the emitted
    token must follow p exactly.

    p, q: float64 (V,), the target's and the draft's distributions at this position (each sums
    to 1). candidates: m >= 1 token ids, each drawn independently from q (the same q for all).
    uniforms: m + 1 floats in [0, 1).

    The rule, in order for i = 0, 1, ..., m - 1: candidate x_i is tested against p_i, the
    distribution the output must follow given that candidates 0..i-1 were rejected (p_0 = p),
    and kept iff uniforms[i] * q(x_i) < p_i(x_i) (the chapter's test u < p / q written without
    a division). The first candidate kept is emitted. If all m are rejected, the token is drawn
    from p_m with uniforms[m] by inverse CDF (float64): the smallest id t whose cumulative sum
    of p_m up to t exceeds uniforms[m] x (the sum of p_m). What p_{i+1} is, given p_i and q, is
    the exercise: the chapter's one-draft proof tells you what the output must follow after a
    rejection, and candidate i + 1 is a fresh draw from q, independent of what happened before.
    (Rounding only: if the distribution you arrive at has no mass left, use p_i again.)

    With m = 1 this is the chapter's `rejection_sample` for K = 1, decision for decision and
    token for token (the tests check it on random rows), and with more candidates the chance
    that one is kept grows. Example: p = (0.6, 0.3, 0.1), q = (0.2, 0.3, 0.5), candidates [2],
    uniforms [0.21, 0.9]: 0.21 x 0.5 >= 0.1, rejected; max(p - q, 0) = (0.4, 0, 0), so the
    token is 0: (-1, 0). Raises ValueError unless m >= 1 and there are m + 1 uniforms.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the greedy step, stop rules included (2 points) ---------------------------------
# At temperature 0 the target's choice at each position is its argmax, and a draft is kept
# while it equals that choice (the chapter's section on greedy verification). But the engine's
# choice is the argmax of the *processed* row, and Part I's min_tokens rule rules out EOS and
# the stop ids until enough tokens exist; and a stop id inside a run of kept drafts ends the
# request right there (the chapter's section on the engine's step: `_finish_rows`).

def greedy_step(logits: torch.Tensor, drafts: Sequence[int], num_output_tokens: int,
                min_tokens: int, stop_ids: set[int] | frozenset[int]) -> list[int]:
    """The tokens one step appends to a greedy request's output.

    logits: float32 (d + 1, V), the target's raw logits for this request's step: row j scores
    the token after the request's tokens and drafts[:j] (row d: the bonus position).
    drafts: the d draft ids the step verifies (d may be 0: a plain decode step).
    num_output_tokens: tokens the request had generated before this step.
    min_tokens: the request's SamplingParams.min_tokens. stop_ids: the ids that end it (its
    EOS ids, unless ignore_eos, and its stop_token_ids).

    The engine's rules, which you assemble: row j decides the request's output token number
    num_output_tokens + j + 1 (the kept drafts before it count as output); while fewer than
    min_tokens tokens precede that token, the stop ids are ruled out there (S04's
    `apply_min_tokens`); the choice at row j is the argmax of what is left (the first on a tie,
    as torch.argmax). Keep drafts while they equal the choice; then the choice at the first
    mismatch (or at row d) is the step's last token. A stop id among the tokens ends the step
    there, itself included (the engine drops what would follow). Returns 1 to d + 1 ids.
    Example: rows whose argmaxes are 3, 5, 7, 4, drafts [3, 5, 7]: [3, 5, 7, 4]; drafts
    [3, 2, 7]: [3, 5]; drafts [3, 5, 7] with 5 a stop id: [3, 5].
    The tests compare you with rows worked by hand and, step by step, with what the chapter's
    engine emitted on the bundled model (EOS, stop ids and min_tokens inside runs of drafts).
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: the KV of rejected drafts (2 points) --------------------------------------------
# The target computes the KV of every draft it verifies, before it knows which are kept; the
# rejected drafts' KV belongs to tokens that are not the request's. The chapter's section on
# what a step does to the scheduler and the KV (S09's `record_computed`, S12's `trim`) rolls
# them back. Work out the books of one step on S12's block manager.

def kv_after_step(num_computed_tokens: int, num_drafts: int, num_accepted: int,
                  block_size: int) -> tuple[int, int, int, int]:
    """(num_computed_tokens after the step, blocks the request holds after it, blocks
    allocated for the step, blocks given back after it) for one decoding request in S15's
    engine on S12's `KVCacheManager` (blocks of block_size tokens, no prefix caching).

    Before the step the request has computed num_computed_tokens = c tokens and its KV holds
    exactly those (S12: a request holding t tokens holds ceil(t / block_size) blocks); its last
    token is not computed yet. The step schedules that token and num_drafts = d drafts; the
    rejection sampler keeps num_accepted = a of them (0 <= a <= d); the request does not
    finish in this step. Count what the scheduler allocates for the step, what it keeps, and
    what it gives back once it knows a.
    Example: c = 7, d = 8, a = 0, blocks of 4: the step computes positions 7..15 (blocks 1
    to 3 of 0..3, two new); one token is kept, so 8 tokens are computed after the step, in 2
    blocks: (8, 2, 2, 2).
    Raises ValueError unless c >= 0, d >= 0, 0 <= a <= d and block_size >= 1.
    The tests compare you with S12's real manager (allocate_slots, then trim) and with the
    chapter's engine's books (`engine.scheduler.kv`) around real steps.
    """
    raise NotImplementedError("exercise 3")


# Exercise 4: how many drafts (3 points) -----------------------------------------------------
# Leviathan's formulas (the chapter's section on what speculation buys) assume every draft is
# accepted with the same probability alpha, independently. Measured acceptance is not like
# that: it falls with the position (a draft far ahead is a guess on a guess). Plan from what
# SpecDecodingStats measures instead.

def expected_tokens_per_forward(acceptance_per_position: Sequence[float], k: int) -> float:
    """Expected tokens one target forward emits per request when it verifies k drafts, from
    per-position rates measured with K = len(acceptance_per_position) drafts per step.

    acceptance_per_position[j]: as `SpecDecodingStats.acceptance_per_position` reports it, the
    fraction of verifications (that offered draft j) in which draft j was accepted. Think about
    what that fraction already includes (a draft is only accepted if every draft before it
    was), and about what changes, and what does not, when fewer drafts are proposed.
    k: 0..K (0: no drafts, one token per forward). Raises ValueError for k outside 0..K.
    Not Leviathan's (1 - alpha^(k+1)) / (1 - alpha): the tests use targets and drafts whose
    acceptance falls with the position, where that formula is far off.
    """
    raise NotImplementedError("exercise 4")


def choose_num_drafts(acceptance_per_position: Sequence[float], c: float
                      ) -> tuple[int, float]:
    """(k, expected speedup): the number of drafts per step, 0..K, that makes decoding
    fastest, and its expected speedup over decoding with the target alone.

    c >= 0: the cost of one draft token over the cost of one target forward (the chapter's
    cost model, Leviathan's Theorem 3.8: a step with k drafts costs 1 + k c target forwards,
    the target verifying k + 1 positions as fast as one). k = 0 turns speculation off (speedup
    1); on a tie, the smaller k. The tests compare your choice with Monte-Carlo runs of the
    chapter's rejection sampler at each k: it must be (within the runs' noise) the best
    measured speedup, and your expected speedup what the runs measure.
    """
    raise NotImplementedError("exercise 4")
