"""S12 exercises: a slot mapping worked from a block table, the blocks a request needs for n more
tokens, and a copy-on-write fork of a block table.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s12

The chapter's code is in code/s12_paged_attention.py (the block pool, the KV manager's
`allocate_slots`, the slot mapping the engine builds for each step). Write your own versions
here, in plain Python: the graded tests compare you with values worked by hand, with what S12's
tested block pool and KV manager do on random workloads, and with a pool of real storage (a
dict from slot to the token written there) that must read back, through every block table,
exactly the tokens each sequence was given. Reference solutions are in exercises/solutions/ --
try first, peek later.

Vocabulary (the chapter's): the KV pool holds `num_blocks` blocks of `block_size` token slots
each; a request's `block_table` lists the ids of its blocks in order, so its token at position
p lives in block `block_table[p // block_size]`, at offset `p % block_size`; that block's
slots are numbered `block_id * block_size + offset` in the flat pool.

Block ids here are arbitrary: the null block is not modelled. The chapter's pool never hands out
block 0 (the null block that pads block tables on the device), but these functions only move ids
between tables and a free queue, so any id, 0 included, is an ordinary block in the examples and
the tests.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


# Exercise 1: the slot mapping (3 points) -----------------------------------------------------
# A step writes each scheduled token's key and value at one slot of the flat pool. The engine
# builds that list (the slot mapping) from the request's block table and the positions of its
# new tokens; the attention reads the same slots back through the block table.

def slot_mapping(block_table: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                 block_size: int) -> list[int]:
    """The slots of positions num_computed_tokens .. num_computed_tokens + num_new_tokens - 1,
    in order: for position p, block_table[p // block_size] * block_size + p % block_size.

    Example: slot_mapping([7, 2], 3, 3, 4) -> [31, 8, 9]: position 3 is the last slot of
    block 7 (7 * 4 + 3), positions 4 and 5 the first two of block 2.
    Raises ValueError for block_size < 1, num_computed_tokens < 0, num_new_tokens < 0, or a
    position past the blocks the table holds (len(block_table) * block_size tokens).
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: blocks on demand (3 points) -----------------------------------------------------
# A request holds blocks for the tokens it has; before a step computes n more of them, the KV
# manager takes just the blocks those n tokens need, all or nothing, from the front of the free
# queue.

def num_new_blocks(num_tokens: int, num_held_blocks: int, num_new_tokens: int,
                   block_size: int) -> int:
    """How many blocks a request that holds num_held_blocks blocks for num_tokens tokens needs
    before it can hold num_new_tokens more: ceil((num_tokens + num_new_tokens) / block_size)
    minus the blocks it holds, and 0 when those already suffice.

    Example: num_new_blocks(15, 1, 2, 16) -> 1 (17 tokens need 2 blocks); num_new_blocks(15,
    1, 1, 16) -> 0 (the 16th token fills the block it has).
    Raises ValueError for block_size < 1, a negative count, or fewer blocks held than
    num_tokens need.
    """
    raise NotImplementedError("exercise 2")


def allocate(block_table: list[int], free_queue: deque, num_tokens: int, num_new_tokens: int,
             block_size: int) -> bool:
    """Grow block_table in place for num_new_tokens more tokens (it holds num_tokens now), all
    or nothing: take the num_new_blocks it needs from the FRONT of free_queue (popleft) and
    append them to the table in that order. When the queue has fewer, change nothing and
    return False; return True otherwise.

    Example: with block_table [3], free_queue deque([5, 1, 4]), num_tokens 4, 5 new tokens,
    block_size 4: 9 tokens need 3 blocks, so the table becomes [3, 5, 1], the queue deque([4]),
    and the call returns True.
    Raises ValueError as num_new_blocks does.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: a copy-on-write fork (4 points) -------------------------------------------------
# Parallel sampling (n completions of one prompt) forks a sequence: the child shares every block
# of the parent's table, and each shared block's reference count goes up by one. A full shared
# block is only ever read. A shared block that is about to be written (the last, partly filled
# block, when either sequence appends its next token) is copied first: the writer takes a fresh
# block from the front of the free queue, the engine copies the old block's slots into it, and
# the old block's count goes down by one (the vLLM paper's copy-on-write, section 4.4).

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
