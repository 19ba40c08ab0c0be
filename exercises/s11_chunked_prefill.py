"""S11 exercises: one step's chunks under a token budget, the causal mask of a chunk, which rows
sample.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s11

The chapter's code is in code/s11_chunked_prefill.py (`ChunkedScheduler.num_new_tokens`, the
one rule it changes in S10's `Scheduler.schedule`), code/s09_ragged.py
(`RaggedRunner.prepare_inputs`, which marks the rows that sample, and `RaggedBatch`) and
code/s06_torch.py (`attention`, with its start offset). Write your own versions here: the
graded tests compare you with values worked by hand, with what S11's tested scheduler plans
step by step on random queues driven by a fake model (no model is needed), with S03's
attention over the whole prompt, and with the rows S09's ragged batch reads. Reference
solutions are in exercises/solutions/ -- try first, peek later.

Every count here is in tokens. A request's "tokens left" is how many of its token ids are not
in the KV cache yet: its whole prompt when it joins, 1 when it decodes, something in between
while its prompt is being chunked.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


# Exercise 1: one step's chunks under the token budget (4 points) -----------------------------
# The running requests come first, in the order they were admitted; then waiting requests join
# from the head of the queue while a seat is free and budget is left. Each scheduled request
# computes as many of its tokens left as the budget allows, never more than the per-request
# limit (long_prefill_token_threshold, 0 for none). Nothing is kept back for the requests
# after it: in every state S11's scheduler reaches, each running request still finds budget
# (the chapter says why).

def plan_step(running: Sequence[tuple[str, int]], waiting: Sequence[tuple[str, int]],
              token_budget: int, max_num_seqs: int,
              long_prefill_token_threshold: int = 0) -> list[tuple[str, int]]:
    """The (request id, tokens it computes) of one step, in schedule order, as a list of pairs
    (any sequence of pairs is accepted: the tests compare lists of tuples).

    running: (id, tokens left) in admission order; waiting: (id, tokens left) in queue order,
    the head first. KV is never short in this exercise (nobody is preempted).
    Each running request in turn, with b tokens of the budget left, computes
    n = min(tokens left, b, the threshold if it is > 0); when b is 0 the running requests
    still to come are not scheduled in this step (S11's scheduler stops its loop there too;
    with the admission rule below it never actually runs out before the last running request). Then, while len(running) + (admitted so far) < max_num_seqs and the queue
    is not empty: the head computes n = min(tokens left, b, the threshold if > 0); stop when
    n is 0 (the budget is spent). Each scheduled request's n comes off b.
    Example: plan_step([("a", 1), ("b", 1), ("p", 26)], [("q", 9)], 16, 4) ->
    [("a", 1), ("b", 1), ("p", 14)]: a and b decode; p, 26 tokens short of the end of its
    40-token prompt, takes the 14 the decodes leave; q finds no budget left.
    Raises ValueError for token_budget < max_num_seqs (vLLM's rule: every running request
    decodes in every step), max_num_seqs < 1, more running requests than max_num_seqs,
    long_prefill_token_threshold < 0, or a request with fewer than 1 token left.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the causal mask of a chunk (3 points) -------------------------------------------
# A chunk of T prompt tokens at positions start .. start + T - 1 attends over the keys of every
# position before it (already in the cache from earlier chunks) and of its own tokens up to
# itself. The result must equal those rows of attention over the whole prompt at once.

def chunk_mask(start: int, num_new: int) -> np.ndarray:
    """bool (T, S) with T = num_new and S = start + num_new: True where query t (at position
    start + t) may read key s (at position s), that is when s <= start + t.
    Example: chunk_mask(2, 2) -> [[True, True, True, False], [True, True, True, True]].
    Raises ValueError for start < 0 or num_new < 1.
    """
    raise NotImplementedError("exercise 2")


def chunk_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention of a chunk against the cache, in float32 NumPy.

    q: float32 (H, T, D), the chunk's queries at positions start .. start + T - 1; k, v:
    float32 (Hkv, S, D) with S = start + T, the keys and values of positions 0 .. S - 1 (the
    cache, this chunk's included). Query head h reads key head h // (H / Hkv). Scores are
    q k^T / sqrt(D), masked with chunk_mask (a masked score is -inf), softmax over keys.
    Returns float32 (H, T, D). Raises ValueError when H is not a multiple of Hkv or
    S != start + T.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: which rows sample (3 points) ----------------------------------------------------
# A step's ragged batch lays every scheduled request's new tokens end to end. A request samples
# its next token only when its new tokens reach the end of its token ids; a chunk that stops
# inside the prompt samples nothing (the row after it would predict a prompt token the request
# already has), so its seeded generator does not move either.

def rows_to_sample(batch: Sequence[tuple[str, int, int, int]]) -> list[tuple[str, int]]:
    """(request id, row) of every request that samples in this step, in batch order, as a list
    of pairs (any sequence of pairs is accepted).

    batch: (request id, num_computed_tokens, num_scheduled_tokens, num_tokens) in batch order:
    its new tokens are its token ids num_computed_tokens .. num_computed_tokens +
    num_scheduled_tokens - 1, of num_tokens in all. The row is the index, in the flat batch of
    every request's new tokens, of the request's last new token (whose logits are sampled).
    Example: rows_to_sample([("a", 0, 5, 9), ("b", 7, 1, 8), ("c", 0, 3, 3)]) ->
    [("b", 5), ("c", 8)]: a's chunk stops at 5 of 9 tokens.
    Raises ValueError for num_computed_tokens < 0, num_scheduled_tokens < 1 or new tokens that
    run past num_tokens.
    """
    raise NotImplementedError("exercise 3")
