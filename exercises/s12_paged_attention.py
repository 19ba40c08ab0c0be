"""S12 exercises: the waste a block size costs a workload, the most requests a pool runs
without preemption, and a copy-on-write fork of a block table.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s12

The chapter's code is in code/s12_paged_attention.py (the block pool and the KV manager) and
code/s11_chunked_prefill.py (the scheduler that runs on it). Exercises 1 and 2 are planning
questions the chapter does not answer: the graded tests put your plan through S11's real
scheduler over S12's real `KVCacheManager` (a fake model that makes one token per request and
step, no model weights) and count what the manager and the scheduler report. Exercise 3 is the
original vLLM's copy-on-write, checked on a pool of real storage. Reference solutions are in
exercises/solutions/ -- try first, peek later.

Vocabulary (the chapter's): the KV pool holds `num_blocks` blocks of `block_size` token slots
each. Block 0 is the null block, as in the chapter's `BlockPool`: it is never handed out, so a
pool of num_blocks has num_blocks - 1 usable blocks, and no table or free queue here ever holds
block 0. A request of `prompt_len` tokens asked for `max_tokens` outputs holds, in the step it
is admitted, its prompt (nothing is chunked here); in each later step one token more (the one
it sampled last); its last step computes position prompt_len + max_tokens - 2 and samples its
last token, so it holds at most prompt_len + max_tokens - 1 tokens. A request holding t tokens
holds ceil(t / block_size) blocks.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


# Exercise 1: what a block size wastes (3 points) ---------------------------------------------
# Larger blocks mean shorter block tables and larger contiguous reads for the attention kernel
# (the chapter's trade); they also waste more of the last block of every request. Measure the
# waste of a workload over a whole run, then pick the largest block size that keeps it under a
# limit.

def run_waste(requests: Sequence[tuple[int, int]], block_size: int) -> tuple[int, int]:
    """(wasted, held): summed over every step of a run in which nobody is preempted, over the
    requests running in that step, the positions their blocks hold and do not use (wasted),
    and the positions their blocks hold (held). requests: (prompt_len, max_tokens) pairs.

    Counted as S12's manager counts them right after the scheduler plans a step: held =
    capacity - num_free_tokens, used = num_used_tokens, wasted = held - used. Each request
    goes through the same states whoever runs beside it (see the module docstring), so the
    sums do not depend on the order or the number of seats.
    Example: run_waste([(5, 3)], 4) -> (6, 24): the request holds 5, 6 and 7 tokens in its
    three steps, in 2 blocks of 4 each time: 8 positions held per step, 3 + 2 + 1 wasted.
    Raises ValueError for block_size < 1, a prompt_len < 1 or a max_tokens < 1.
    """
    raise NotImplementedError("exercise 1")


def largest_block_size(requests: Sequence[tuple[int, int]], block_sizes: Sequence[int],
                       max_waste_share: float) -> int | None:
    """The largest of block_sizes whose run wastes at most max_waste_share of the positions
    it holds (wasted / held from `run_waste`), or None when none does.

    Example: largest_block_size([(5, 3)], [1, 2, 4, 8], 0.2) -> 2 (block sizes 8 and 4 both
    waste 6 of the 24 positions held, a quarter; 2 wastes 1 + 0 + 1 of 6 + 6 + 8 held).
    The test is wasted <= max_waste_share x held, with no division: an empty workload (no
    requests) holds and wastes nothing, so every candidate passes and the largest is returned
    (largest_block_size([], [4, 16, 8], 0.0) -> 16), never a ZeroDivisionError.
    Raises ValueError for an empty block_sizes, a block size < 1, or a max_waste_share outside
    [0, 1].
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the most requests at once without preemption (3 points) -------------------------
# max_num_seqs caps the seats. Too few and the pool sits idle; too many and the running
# requests outgrow the pool, and the scheduler preempts (S10's recompute: work thrown away).
# Plan the largest seat count that never preempts, for a known queue.

def max_num_seqs_without_preemption(requests: Sequence[tuple[int, int]], num_blocks: int,
                                    block_size: int) -> int:
    """The largest max_num_seqs, from 1 to len(requests), with which S11's scheduler over S12's
    `KVCacheManager(num_blocks, block_size)` serves every request without one preemption.

    requests: (prompt_len, max_tokens), all queued before step 0 in this order, decoded until
    max_tokens (no end-of-sequence); every request alone fits the pool. The scheduler's rules
    (S10's and S11's, with no token budget to chunk a prompt): in each step the running
    requests come first, in admission order, each taking the blocks its next token needs from
    the free blocks; one that finds too few preempts someone (that is what to avoid). Then,
    only in a step with no preemption, waiting requests join from the head of the queue while
    a seat is free and the free blocks hold the head's whole prompt; the first that does not
    fit waits, and nobody overtakes it. Every request scheduled in a step samples a token; one
    that has its max_tokens leaves at the end of the step, and its blocks are free from the
    next step on.
    Example: max_num_seqs_without_preemption([(4, 6), (4, 6), (4, 6)], 7, 4) -> 2: each
    request grows to 4 + 6 - 1 = 9 tokens, 3 blocks of 4, and the pool has 6 usable blocks.
    With 3 seats all three join in step 0 and reach their 9th token together in step 5,
    needing 9 blocks: a preemption. With 2 seats the first two peak at 6 blocks in step 5,
    their last, and the third joins in step 6, alone.
    Raises ValueError for an empty queue, num_blocks < 2, block_size < 1, a count < 1, or a
    request that alone needs more blocks than the pool's usable ones.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: a copy-on-write fork (4 points) -------------------------------------------------
# Parallel sampling (n completions of one prompt) forks a sequence: the child shares every block
# of the parent's table, and each shared block's reference count goes up by one. A full shared
# block is only ever read. A shared block that is about to be written (the last, partly filled
# block, when either sequence appends its next token) is copied first: the writer takes a fresh
# block from the front of the free queue, the engine copies the old block's slots into it, and
# the old block's count goes down by one (the vLLM paper's copy-on-write, section 4.4).
# This is how the original vLLM did it (Kwon et al., SOSP 2023). vLLM V1 has no copy-on-write:
# n > 1 becomes n child requests (vllm/v1/engine/parallel_sampling.py), and the children share
# the prompt's full blocks through the prefix cache (S13); only full blocks are ever shared, so
# no shared block is ever written. Block ids are the pool's: block 0, the null block, is never
# in a table or the free queue.

def fork(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], parent: str,
         child: str) -> None:
    """Give child a copy of parent's block table (a new list with the same ids) and add one to
    the ref_cnt of each of those blocks. Raises ValueError when parent has no table or child
    already has one.
    """
    raise NotImplementedError("exercise 3")


def append_slot(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], free_queue: deque,
                seq: str, num_tokens: int, block_size: int) -> tuple[int, tuple[int, int] | None]:
    """Make room for the next token of seq, which holds num_tokens tokens now (its new token
    goes at position num_tokens), and return (the slot to write it at, the copy to make).

    - If the position starts a new block (num_tokens % block_size == 0): pop a block from the
      front of free_queue, append it to the table with ref_cnt 1; no copy.
    - Else, if the table's last block is shared (ref_cnt > 1): copy on write. Pop a fresh
      block from the front of free_queue, put it in place of the last block in this table only,
      with ref_cnt 1, and take one off the old block's ref_cnt; the copy is (old block id, new
      block id): the engine copies the old block's slots into the new one before it writes.
    - Else the last block is this sequence's alone: write into it; no copy.
    The slot is the new last block's id * block_size + num_tokens % block_size.
    Example: tables {"a": [4], "b": [4]}, ref_cnt {4: 2}, free deque([9, 2]), seq "b",
    num_tokens 3, block_size 4 -> (39, (4, 9)); now "b" is [9], ref_cnt {4: 1, 9: 1}.
    Raises ValueError when seq has no table, when its table does not hold exactly
    ceil(num_tokens / block_size) blocks, and when a block is needed and the queue is empty
    (nothing is changed then).
    """
    raise NotImplementedError("exercise 3")


def free(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], free_queue: deque,
         seq: str) -> list[int]:
    """Drop seq's table: take one off the ref_cnt of each of its blocks, in reverse table order
    (the tail first, as vLLM and nano-vllm do), and append every block whose count reaches 0
    to the BACK of free_queue (deleting it from ref_cnt). Returns the blocks freed, in the
    order they were appended. Raises ValueError when seq has no table.
    """
    raise NotImplementedError("exercise 3")
