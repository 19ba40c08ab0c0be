"""S09 exercises: admission, flattening a ragged batch, slots that come back.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s09

The chapter's code is in code/s09_continuous_batching.py (`FIFOScheduler.schedule`,
`SlotKVManager`) and code/s09_ragged.py (`RaggedBatch`, `SlotKVCache`). Write your own versions
here: the graded tests compare you with values worked by hand, with loops and closed forms
written in the tests, with the tokens S06's engine makes for each prompt alone, and with the
trace of S09's tested engine on real requests. Reference solutions are in exercises/solutions/
-- try first, peek later.

Shape legend: N tokens of a ragged batch (the sum of each request's new tokens), B requests.
"""
from __future__ import annotations

from typing import Sequence


# Exercise 1: admission, FIFO into free slots (3 points) ---------------------------------------
# Before every step the scheduler lets waiting requests take the slots that are free: the
# oldest request first, each into the lowest free slot. Nobody may wait while a slot is free.

def admit(waiting: Sequence[str], free_slots: Sequence[int]) -> list[tuple[str, int]]:
    """The (request id, slot) pairs admitted before one step, in admission order.

    waiting: request ids, oldest first. free_slots: the free slot numbers, in any order.
    The first min(len(waiting), len(free_slots)) waiting requests are admitted, the oldest into
    the lowest free slot, the next into the next lowest, and so on. The inputs are not changed.
    Example: admit(["a", "b", "c"], [3, 1]) -> [("a", 1), ("b", 3)].
    Raises ValueError for a slot number that is negative or listed twice.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: flatten a ragged batch (4 points) ------------------------------------------------
# A step's batch has no padding: every running request's new tokens are laid end to end. A
# request that just joined brings its whole prompt; one that is decoding brings one token.

def flatten(new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int]) -> dict:
    """The metadata of one ragged batch, as plain Python lists of ints.

    new_tokens[b]: request b's token ids to compute in this step (at least one each).
    num_cached[b]: how many of its positions are already in its KV slot (0 for a new request).
    Returns a dict with:
      "input_ids"       (N,) every request's new tokens, request 0's first;
      "positions"       (N,) the position of each token in its own request (num_cached[b],
                        num_cached[b] + 1, ...);
      "query_start_loc" (B + 1,) where each request's tokens start, and N at the end
                        (cu_seqlens_q in flash-attention's name);
      "context_lens"    (B,) each request's positions after this step (cached + new);
      "sample_rows"     (B,) the row of each request's last new token, whose logits are sampled.
    Example: new_tokens [[5, 6, 7], [9], [4, 2]], num_cached [0, 10, 3] ->
      input_ids [5, 6, 7, 9, 4, 2], positions [0, 1, 2, 10, 3, 4], query_start_loc [0, 3, 4, 6],
      context_lens [3, 11, 5], sample_rows [2, 3, 5].
    Raises ValueError for no request, a request with no token, a negative num_cached, or lists
    of different lengths.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: slots that come back (3 points) --------------------------------------------------
# Simulate the engine's schedule without a model: who runs in which slot at every step.

def simulate(output_lens: Sequence[int], max_num_seqs: int,
             aborts: dict[int, int] | None = None) -> list[list[tuple[int, int]]]:
    """The running (request, slot) pairs of every step of continuous batching.

    Requests 0, 1, ... are all waiting before step 0, in that order; request i makes
    output_lens[i] >= 1 tokens, one per step it runs, starting with the step it joins. Before
    each step, waiting requests are admitted as in `admit` (lowest free slot first). A request
    that makes its last token in step k leaves at the end of step k: its slot is free before
    step k + 1. aborts {i: k}: request i is aborted just before step k (after step k - 1, before
    step k's admission): it leaves, or stops waiting, and its slot is free for step k. An abort
    of a request already finished does nothing.
    Returns one list per step, in order, of (request, slot) for the requests running in it,
    sorted by slot (the runner lays a step's batch out in slot order, so that the running
    requests' KV slots are one contiguous range whenever they can be). Steps continue while anyone waits or runs.
    Example: simulate([2, 1, 1], 2) -> [[(0, 0), (1, 1)], [(0, 0), (2, 1)]].
    Raises ValueError for max_num_seqs < 1 or an output length < 1.
    """
    raise NotImplementedError("exercise 3")
