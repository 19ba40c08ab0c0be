"""S12 exercises, reference solutions: a slot mapping from a block table, blocks on demand, a
copy-on-write fork of a block table.

Try the stubs in exercises/s12_paged_attention.py first; grade these with
`python exercises/grade.py --solutions s12`. Block ids here are arbitrary; the null block is not
modelled (any id, 0 included, is an ordinary block).

Sources followed: vLLM's slot mapping (slot = block id * block_size + offset in the block, as
in the paper's block table, Kwon et al., SOSP 2023, section 4.2); vLLM V1's
`KVCacheManager.allocate_slots` (blocks for ceil(tokens / block_size), all or nothing, None when
too few are free) and `BlockPool` (allocation from the front of the free queue, freeing to its
back, the tail of a table first); the paper's copy-on-write for parallel sampling (section 4.4:
a shared block is copied before it is written, and its reference count drops by one).
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


# Exercise 1: the slot mapping ----------------------------------------------------------------

def slot_mapping(block_table: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                 block_size: int) -> list[int]:
    _check_counts(block_size, num_computed_tokens, num_new_tokens)
    end = num_computed_tokens + num_new_tokens
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end - 1} need {_blocks_for(end, block_size)} "
                         f"blocks; the table holds {len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(num_computed_tokens, end)]


# Exercise 2: blocks on demand ----------------------------------------------------------------

def num_new_blocks(num_tokens: int, num_held_blocks: int, num_new_tokens: int,
                   block_size: int) -> int:
    _check_counts(block_size, num_tokens, num_held_blocks, num_new_tokens)
    if num_held_blocks < _blocks_for(num_tokens, block_size):
        raise ValueError(f"{num_tokens} tokens need {_blocks_for(num_tokens, block_size)} "
                         f"blocks; only {num_held_blocks} are held")
    return max(0, _blocks_for(num_tokens + num_new_tokens, block_size) - num_held_blocks)


def allocate(block_table: list[int], free_queue: deque, num_tokens: int, num_new_tokens: int,
             block_size: int) -> bool:
    need = num_new_blocks(num_tokens, len(block_table), num_new_tokens, block_size)
    if need > len(free_queue):
        return False                                      # all or nothing
    block_table.extend(free_queue.popleft() for _ in range(need))
    return True


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
