"""S13 exercises: the block hash chain, how many prompt tokens a new request skips, and the
cache's free queue with reference counts and LRU eviction.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s13

The chapter's code is in code/s13_prefix_caching.py (`encode_block`, `hash_block_tokens`,
`hash_request_tokens`, `PrefixCachingBlockPool`, `PrefixCachingKVCacheManager` and its
`get_computed_blocks`, which S10's scheduler asks at admission). Write your own versions here:
the graded tests compare you with values worked by hand, with S13's hash chain on random token
ids, with what S13's engine's scheduler admits a new prompt with after serving earlier ones (a
fake model, no model needed), and with S13's KV cache manager driven through the same
admissions and frees.
Reference solutions are in exercises/solutions/ -- try first, peek later.

Block 0 of a pool is the null block (S12): it is never handed out, so the usable blocks are
1 .. num_blocks - 1, and the free queue starts as 1, 2, ..., num_blocks - 1, front first.
"""
from __future__ import annotations

import hashlib
import struct  # noqa: F401  (for exercise 1)
from typing import Sequence

# The parent of every request's first block, as in code/s13_prefix_caching.py.
ROOT_HASH = hashlib.sha256(b"s13 prefix cache: no parent block").digest()


# Exercise 1: the block hash chain (3 points) -------------------------------------------------
# A full block's name is SHA-256 of a byte string that holds its parent's name, its token ids
# and its extra keys, each field of fixed width or with its length before it (so two
# different blocks never give the same bytes). Python's hash() would not do: it is 64 bits,
# and for strings it changes from one process to the next.

def block_hashes(token_ids: Sequence[int], block_size: int,
                 cache_salt: str | None = None) -> list[bytes]:
    """The names of the full blocks of token_ids, len(token_ids) // block_size of them (a
    last block with fewer than block_size tokens has no name). Each is 32 bytes:

        name_i = sha256(parent_i + <I n> + <q t_1> ... <q t_n> + <I k> + (<I len> + utf-8)*k)

    with struct's little-endian formats: parent_i is ROOT_HASH for block 0 and name_{i-1}
    after it; n the number of tokens (block_size), each token id an int64; k the number of
    extra keys, each key its UTF-8 length (uint32) then its bytes. Block 0's extra keys are
    (cache_salt,) when a salt is given, else none; later blocks have none (the chain carries
    the salt on).
    Example: block_hashes([5, 6, 7], 2) is one name, sha256(ROOT_HASH + struct.pack("<I", 2) +
    struct.pack("<qq", 5, 6) + struct.pack("<I", 0)).digest().
    Raises ValueError for block_size < 1 and for a cache_salt that is not None or a non-empty
    string.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: how many prompt tokens a new request skips (3 points) ---------------------------
# A new request takes the longest run of cached blocks that match its first blocks, and its
# prefill starts after them. But the last prompt token is always computed: its logits give
# the first output token.

def num_cached_tokens(earlier_prompts: Sequence[Sequence[int]], prompt: Sequence[int],
                      block_size: int) -> int:
    """The prompt tokens a new request is admitted with as already computed (a multiple of
    block_size), when each earlier prompt was served before it, alone, to its first output
    token, and nothing was evicted: every full block of every earlier prompt is cached, and
    nothing else is (an earlier request's output token is never computed into its KV).
    Only full blocks are matched, from the first; a block matches when some earlier prompt
    has a block with the same name (exercise 1, no salt), and the run stops at the first that
    does not; at most (len(prompt) - 1) // block_size blocks are taken.
    Example: with block size 4 and the earlier prompt [1, ..., 8], the prompt [1, ..., 8, 9]
    skips 8 tokens and the prompt [1, ..., 8] skips 4 (its last token must be computed, and
    a hit is whole blocks).
    Raises ValueError for block_size < 1 or an empty prompt.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: reference counts and the LRU free queue (4 points) ------------------------------
# A cached block nobody holds stays in the free queue with its name: it can still be hit.
# Allocation takes blocks from the front of the queue, and a named block taken loses its name
# (an eviction). A request gives its blocks back last block first, to the back of the queue,
# so the tail of a chain is evicted before its head.

def serve(num_blocks: int, block_size: int,
          ops: Sequence[tuple]) -> list[tuple[list[int], list[int], list[int]]]:
    """Replay admissions and frees on a pool of num_blocks blocks of block_size tokens;
    return, for each operation, (blocks hit, blocks evicted, the free queue after it, front
    first), as lists of block ids.

    ops, in order, each one of:
    - ("admit", request_id, hashes, num_tokens): a new request of num_tokens prompt tokens,
      whose full blocks have the names `hashes` (num_tokens // block_size of them; treat them
      as opaque strings). Its hit: the longest run of its first names found in the cache map,
      at most (num_tokens - 1) // block_size blocks. Each block hit gets ref_cnt + 1 (one
      with ref_cnt 0 leaves the free queue). Then it takes ceil(num_tokens / block_size)
      minus the hits new blocks from the front of the free queue, each with ref_cnt 1; a
      taken block that had a name loses it (it is evicted: listed, in the order taken). A
      hit block that sat in the free queue is not free for this: the admission fits only if
      the free queue, less the blocks it hits, holds the new blocks it needs. Its
      block table is the hits then the new blocks. The step computes the rest of its prompt,
      and then each of its full blocks i gets the name hashes[i] unless a block with that
      name is already cached (a twin stays unnamed).
    - ("free", request_id): the request lets go: its blocks, last of its table first, each
      ref_cnt - 1; a block reaching 0 goes to the back of the free queue and keeps its name.
      (blocks hit and evicted are [] for a free.)
    Example: serve(5, 4, [("admit", "a", ["x", "y"], 9), ("free", "a"),
    ("admit", "b", ["x", "z"], 9)]) -> [([], [], [4]), ([], [], [4, 3, 2, 1]), ([1], [], [2])]:
    a takes 1, 2, 3 and names 1 "x" and 2 "y" (its third block holds one token: no name); it
    gives back 3, 2, 1; b hits 1 ("x"), then takes 4 and 3 from the front, neither of them
    named, and names 4 "z". Had b needed block 2 too, "y" would have been evicted.
    Raises ValueError for num_blocks < 2, block_size < 1, an unknown operation, and for an
    admission that does not fit in the free blocks (as above), whose request_id is admitted
    and not yet freed (an id may come back after its free), whose num_tokens is < 1, or whose
    hashes are not num_tokens // block_size names; and for a free of a request_id that holds
    no blocks (never admitted, or freed already).
    """
    raise NotImplementedError("exercise 3")
