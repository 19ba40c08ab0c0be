"""S11 exercises: one step's chunks under a token budget, the causal mask of a chunk, who goes
first in a step.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s11

The chapter's code is in code/s11_chunked_prefill.py (`ChunkedScheduler.num_new_tokens`, the
one rule it changes in S10's `Scheduler.schedule`) and code/s06_torch.py (`attention`, with
its start offset). Write your own versions here: the graded tests compare you with values
worked by hand, with what S11's tested scheduler plans step by step on random queues driven by
a fake model (no model is needed), with S03's attention over the whole prompt, and with the
chapter's measured figures (the notebook's time to first token at each budget). Reference
solutions are in exercises/solutions/ -- try first, peek later.

Every count here is in tokens. A request's "tokens left" is how many of its token ids are not
in the KV cache yet: its whole prompt when it joins, 1 when it decodes, something in between
while its prompt is being chunked.
"""
from __future__ import annotations

from typing import Collection, Mapping, Sequence

import numpy as np

from s11_chunked_prefill import ChunkedScheduler


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
    with the admission rule below it never actually runs out before the last running
    request). Then, while len(running) + (admitted so far) < max_num_seqs and the queue
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


# Exercise 3: who goes first in a step (3 points) ---------------------------------------------
# S11's scheduler walks its running requests in admission order, so a prompt chunk can come
# before a decode, and new prompts are admitted after everyone running. Production engines
# choose differently: Sarathi-Serve puts the decodes first, and SGLang's default scheduler runs
# a new prefill batch before the decodes. Write the order as a policy that plugs into S11's real
# scheduler, then measure what each order does to inter-token gaps and time to first token, in
# steps. The graded tests drive your scheduler with a fake model on seeded workloads and hold
# it to the stock ChunkedScheduler's plans and to the chapter's measured figures.

STEP_ORDERS = ("admission", "decode-first", "prefill-first")


class OrderedScheduler(ChunkedScheduler):
    """S11's `ChunkedScheduler` that walks its running requests in `order` each step.

    config, kv: as `ChunkedScheduler`. order: one of STEP_ORDERS.
    - "admission": S11's own order (the stock scheduler's plans, unchanged).
    - "decode-first": the running requests that are decoding first, then the others (a prompt,
      or a recompute after a preemption, still being computed).
    - "prefill-first": the running requests still computing their prompt (or recompute) first,
      then the decodes.
    Within each group, keep the order they are in (admission order). A running request is
    decoding when it has sampled at least one token and lacks exactly one token in the KV
    cache (`request.output_ids` and `request.num_tokens - request.num_computed_tokens == 1`).

    The seam: `running` is the scheduler's public list of running requests, and S10's
    `schedule()` (the stock one) gives each of them, in list order, min(tokens it lacks, budget
    left, long_prefill_token_threshold), then admits waiting requests. Override `schedule()`
    to put `self.running` in your order and then call the stock `schedule()`; change no private
    method. (The FCFS victim of a preemption is the tail of `running`; the exercise's KV never
    runs short, so nobody is preempted.)
    Raises ValueError for an order not in STEP_ORDERS.
    """

    def __init__(self, config, kv, order: str = "admission"):
        raise NotImplementedError("exercise 3")

    def schedule(self):
        raise NotImplementedError("exercise 3")


def latency_in_steps(sampled: Sequence[Collection[str]], arrivals: Mapping[str, int]
                     ) -> tuple[int, dict[str, int]]:
    """The worst inter-token gap and each request's time to first token, both in steps.

    sampled: for each step k = 0, 1, ..., the ids of the requests that sampled a token in step
    k. arrivals: {request id: k}, the request was added before step k. Returns (worst gap, TTFT):
    the worst gap is the largest difference k2 - k1 between two consecutive steps in which one
    request sampled (1: a token in every step; 0 when no request sampled twice); TTFT is
    {request id: the step of its first token - its arrival step + 1} (the chapter's count: the
    sampling step included) for every request that sampled.
    Example: latency_in_steps([{"a"}, {"a"}, {"b"}, {"a", "b"}], {"a": 0, "b": 1}) ->
    (2, {"a": 1, "b": 2}): a waited from step 1 to step 3 for its third token.
    Raises ValueError for a sampled id without an arrival, or one sampled before it arrived.
    """
    raise NotImplementedError("exercise 3")
