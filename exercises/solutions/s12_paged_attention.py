"""S12 exercises, reference solutions: the waste a block size costs a workload, the most
requests a pool runs without preemption, a copy-on-write fork of a block table.

Try the stubs in exercises/s12_paged_attention.py first; grade these with
`python exercises/grade.py --solutions s12`. Block 0 is the null block, as in the chapter's
pool: never in a table or a free queue here.

Sources followed: vLLM V1's `KVCacheManager.allocate_slots` (blocks for ceil(tokens /
block_size), all or nothing) and S10/S11's scheduler rules (running requests first, preemption
when one cannot grow, waiting requests admitted only in a step with no preemption, the head
first); the vLLM paper's copy-on-write for parallel sampling (Kwon et al., SOSP 2023, section
4.4: a shared block is copied before it is written, and its reference count drops by one).
vLLM V1 has no copy-on-write: n > 1 fans out to child requests (vllm/v1/engine/
parallel_sampling.py) that share the prompt's full blocks through the prefix cache.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


def _check_counts(block_size: int, *counts: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if any(c < 0 for c in counts):
        raise ValueError(f"token and block counts must be >= 0 (got {counts})")


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)                  # ceil without floats


def _check_requests(requests: Sequence[tuple[int, int]]) -> None:
    for prompt_len, max_tokens in requests:
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(f"prompt_len and max_tokens must be >= 1 (got {prompt_len}, "
                             f"{max_tokens})")


# Exercise 1: what a block size wastes --------------------------------------------------------

def run_waste(requests: Sequence[tuple[int, int]], block_size: int) -> tuple[int, int]:
    _check_counts(block_size)
    _check_requests(requests)
    wasted = held = 0
    for prompt_len, max_tokens in requests:
        for tokens in range(prompt_len, prompt_len + max_tokens):   # one state per step
            positions = _blocks_for(tokens, block_size) * block_size
            held += positions
            wasted += positions - tokens
    return wasted, held


def largest_block_size(requests: Sequence[tuple[int, int]], block_sizes: Sequence[int],
                       max_waste_share: float) -> int | None:
    """The largest of block_sizes whose run wastes at most max_waste_share of the positions
    it holds, or None. Compared as wasted <= max_waste_share x held (no division), so an empty
    workload, which holds and wastes nothing, passes every candidate: the largest is returned.
    ValueError for an empty block_sizes, a block size < 1 (from run_waste) or a share outside
    [0, 1]."""
    if not block_sizes:
        raise ValueError("block_sizes is empty")
    if not 0 <= max_waste_share <= 1:
        raise ValueError(f"max_waste_share must be in [0, 1] (got {max_waste_share})")
    best = None
    for block_size in block_sizes:
        wasted, held = run_waste(requests, block_size)
        if wasted <= max_waste_share * held and (best is None or block_size > best):
            best = block_size
    return best


# Exercise 2: the most requests at once without preemption ------------------------------------

def _preempts(requests: Sequence[tuple[int, int]], num_blocks: int, block_size: int,
              max_num_seqs: int) -> bool:
    """Replay the schedule in blocks until a running request cannot grow (True) or the queue
    is served (False)."""
    free = num_blocks - 1                                # block 0 is the null block
    waiting = deque(requests)
    running: list[list[int]] = []                        # [tokens held, outputs left]
    while waiting or running:
        for r in running:                                # each computes one more token
            need = _blocks_for(r[0] + 1, block_size) - _blocks_for(r[0], block_size)
            if need > free:
                return True
            free -= need
            r[0] += 1
        while waiting and len(running) < max_num_seqs:   # then the head, while it fits
            prompt_len, max_tokens = waiting[0]
            need = _blocks_for(prompt_len, block_size)
            if need > free:
                break
            free -= need
            running.append([prompt_len, max_tokens])
            waiting.popleft()
        for r in running:                                # every scheduled request samples
            r[1] -= 1
        for r in [r for r in running if r[1] == 0]:      # done: its blocks back
            free += _blocks_for(r[0], block_size)
            running.remove(r)
    return False


def max_num_seqs_without_preemption(requests: Sequence[tuple[int, int]], num_blocks: int,
                                    block_size: int) -> int:
    if not requests:
        raise ValueError("the queue is empty")
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2, block 0 being the null block (got "
                         f"{num_blocks})")
    _check_counts(block_size)
    _check_requests(requests)
    for prompt_len, max_tokens in requests:
        if _blocks_for(prompt_len + max_tokens - 1, block_size) > num_blocks - 1:
            raise ValueError(f"a request of {prompt_len} + {max_tokens} tokens needs more "
                             f"than the {num_blocks - 1} usable blocks")
    return max(k for k in range(1, len(requests) + 1)
               if not _preempts(requests, num_blocks, block_size, k))


# Exercise 3: a copy-on-write fork ------------------------------------------------------------

def fork(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], parent: str,
         child: str) -> None:
    if parent not in block_tables:
        raise ValueError(f"no block table for parent {parent!r}")
    if child in block_tables:
        raise ValueError(f"{child!r} already has a block table")
    block_tables[child] = list(block_tables[parent])
    for block in block_tables[child]:
        ref_cnt[block] += 1


def append_slot(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], free_queue: deque,
                seq: str, num_tokens: int, block_size: int) -> tuple[int, tuple[int, int] | None]:
    if seq not in block_tables:
        raise ValueError(f"no block table for {seq!r}")
    _check_counts(block_size, num_tokens)
    table = block_tables[seq]
    if len(table) != _blocks_for(num_tokens, block_size):
        raise ValueError(f"{num_tokens} tokens fill {_blocks_for(num_tokens, block_size)} "
                         f"blocks; {seq!r} holds {len(table)}")
    offset, copy = num_tokens % block_size, None
    if offset == 0 or ref_cnt[table[-1]] > 1:
        if not free_queue:
            raise ValueError("no free block for the next token")
        new = free_queue.popleft()
        ref_cnt[new] = 1
        if offset == 0:
            table.append(new)                             # a new block: nothing to copy
        else:
            old = table[-1]
            ref_cnt[old] -= 1                             # still held by the others
            table[-1] = new
            copy = (old, new)
    return table[-1] * block_size + offset, copy


def free(block_tables: dict[str, list[int]], ref_cnt: dict[int, int], free_queue: deque,
         seq: str) -> list[int]:
    if seq not in block_tables:
        raise ValueError(f"no block table for {seq!r}")
    freed = []
    for block in reversed(block_tables.pop(seq)):         # the tail first
        ref_cnt[block] -= 1
        if ref_cnt[block] == 0:
            del ref_cnt[block]
            free_queue.append(block)
            freed.append(block)
    return freed
