"""S13 exercises: a token-granular radix-tree prefix cache set against S13's block cache, how
many prompt tokens a new request skips, and the cache's free queue with reference counts and LRU
eviction.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s13

The chapter's code is in code/s13_prefix_caching.py (`PrefixCachingKVCacheManager` and its
`get_computed_blocks`, which S10's scheduler asks at admission). Write your own versions here:
the graded tests compare you with values worked by hand, with brute-force oracles written in
the test file (the longest common prefix with every earlier sequence; a trie of one token per
node), with what S13's engine's scheduler admits each prompt with after serving earlier ones (a
fake model, no model needed), and with S13's KV cache manager driven through the same
admissions and frees.
Reference solutions are in exercises/solutions/ -- try first, peek later.

Block 0 of a pool is the null block (S12): it is never handed out, so the usable blocks are
1 .. num_blocks - 1, and the free queue starts as 1, 2, ..., num_blocks - 1, front first. (A
request's blocks are counted from its first block, "the i-th block"; a block id is something
else: the pool's number for it, never 0.)
"""
from __future__ import annotations

from typing import Sequence


# Exercise 1: a radix-tree prefix cache (3 points) --------------------------------------------
# S13 shares whole blocks: a prompt that shares 15 of a block's 16 tokens shares nothing of that
# block. SGLang's RadixAttention (Zheng et al., 2024) keeps the cache as a radix tree of token
# ids instead, so a prompt can reuse any prefix, to the token. Design one. The chapter does not
# show one: choose your nodes (a run of tokens per node, children by their first token, as
# SGLang's TreeNode), how a match that ends inside a node splits it, and how eviction finds the
# least recently used leaf. The tests serve a multi-turn chat workload through S13's scheduler
# and block cache and through your tree, and check that your hits are the longest common prefix
# with the earlier sequences, which exceeds the block cache's hits by exactly the part of the
# last block they share (the tail the block cache cannot take).

class RadixCache:
    """A token-granular prefix cache: the token sequences inserted, kept as a radix tree.

    RadixCache(capacity=None): capacity is the most tokens the tree may hold (None: no
    limit). Raises ValueError for a capacity that is not None or an int >= 1; a bool is not
    a capacity (Python counts True as the int 1, so check for it: RadixCache(True) raises).

    num_tokens: the tokens the tree holds now (each token of a shared prefix counted once).

    Time is a counter: every call to match_prefix or insert is one tick, 1, 2, 3, ...; a token
    is "used" at a tick when that call walks over it.

    match_prefix(token_ids) -> int: how many leading tokens of token_ids the tree holds (the
    length of the longest prefix of token_ids that is a prefix of something inserted and not
    evicted since). Every token matched is used now; nothing else changes what the tree holds.

    insert(token_ids) -> None: the tokens whose KV is now cached (a finished request's prompt
    and every output token but the last, which was never computed). Every token of token_ids
    is held afterwards, and used now. Then, while the tree holds more than capacity tokens, it
    removes one token: the last token of the least recently used leaf (a leaf is a held
    prefix that no other held prefix extends; on a tie, which never happens when each call is
    its own tick, the longer prefix goes first). So the sequence just inserted goes last, and
    a sequence longer than capacity keeps its first capacity tokens.

    Example: insert([1, 2, 3, 4, 5]); match_prefix([1, 2, 3, 9]) == 3; insert([1, 2, 7]);
    num_tokens == 6; match_prefix([2]) == 0.
    """

    def __init__(self, capacity: int | None = None):
        raise NotImplementedError("exercise 1")

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        raise NotImplementedError("exercise 1")

    def insert(self, token_ids: Sequence[int]) -> None:
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
    Only full blocks are matched, from the first; block i matches when some earlier prompt
    has the same tokens in its i-th block and in every block before it (what the chained hash
    names: a block and everything before it), and the run stops at the first that does not; at
    most (len(prompt) - 1) // block_size blocks are taken.
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
