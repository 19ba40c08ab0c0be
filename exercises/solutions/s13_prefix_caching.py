"""S13 exercises, reference solutions: a radix-tree prefix cache, how many prompt tokens a new
request skips, and the cache's LRU free queue with reference counts.

Try the stubs in exercises/s13_prefix_caching.py first; grade these with
`python exercises/grade.py --solutions s13`.

Sources followed: SGLang's RadixCache (python/sglang/srt/mem_cache/radix_cache.py: a TreeNode
holds a run of token ids and its children by first token, `_split_node` cuts a node where a
match ends inside it, matched nodes get a new last_access_time, eviction takes least recently
used leaves; Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs",
NeurIPS 2024). Here a leaf is trimmed token by token, so a capacity in tokens is met exactly.
vLLM V1's `KVCacheManager.get_computed_blocks` (the longest run of cached blocks, at most
`num_tokens - 1` tokens, so the last token is computed), `BlockPool.touch` / `get_new_blocks` /
`_maybe_evict_cached_block` and `SingleTypeKVCacheManager.free` (blocks given back last first
to the back of the free queue, keeping their hash; allocation takes the front and evicts).
"""
from __future__ import annotations

from typing import Sequence


# Exercise 1: a radix-tree prefix cache -------------------------------------------------------

class _Node:
    """A run of tokens (key) on the edge into this node; every token of it was last used at
    last_access. children: by their key's first token."""

    __slots__ = ("key", "parent", "children", "last_access")

    def __init__(self, key, parent, last_access):
        self.key, self.parent, self.last_access = list(key), parent, last_access
        self.children = {}


class RadixCache:
    """A token-granular prefix cache (see the stub's docstring). Invariant: all tokens of a
    node were last used at the same tick (a walk that ends inside a node splits it first),
    and a parent's tick is >= its children's (a walk touches the whole path). capacity: None
    or an int >= 1, a bool refused (True is an int to Python, not a capacity)."""

    def __init__(self, capacity=None):
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)
                                     or capacity < 1):
            raise ValueError(f"capacity must be None or an integer >= 1 (got {capacity!r})")
        self.capacity = capacity
        self.root = _Node([], None, 0)
        self.num_tokens = 0
        self.clock = 0

    def _split(self, node, k):
        """Cut node after its first k tokens; returns the new upper part."""
        upper = _Node(node.key[:k], node.parent, node.last_access)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _walk(self, token_ids):
        """Follow token_ids from the root, splitting where the match ends inside a node and
        touching every matched node; returns (last node matched, tokens matched)."""
        node, i = self.root, 0
        while i < len(token_ids) and token_ids[i] in node.children:
            child = node.children[token_ids[i]]
            k = 0
            while k < len(child.key) and i + k < len(token_ids) and child.key[k] == token_ids[i + k]:
                k += 1
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = self.clock
            node, i = child, i + k
        return node, i

    def match_prefix(self, token_ids):
        self.clock += 1
        return self._walk(list(token_ids))[1]

    def insert(self, token_ids):
        token_ids = list(token_ids)
        self.clock += 1
        node, i = self._walk(token_ids)
        if i < len(token_ids):
            leaf = _Node(token_ids[i:], node, self.clock)
            node.children[token_ids[i]] = leaf
            self.num_tokens += len(leaf.key)
        self._evict()

    def _evict(self):
        while self.capacity is not None and self.num_tokens > self.capacity:
            leaves, stack = [], [self.root]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if not n.children and n is not self.root:
                    leaves.append(n)
            leaf = min(leaves, key=lambda n: n.last_access)
            excess = self.num_tokens - self.capacity
            if len(leaf.key) <= excess:
                del leaf.parent.children[leaf.key[0]]
                self.num_tokens -= len(leaf.key)
            else:
                del leaf.key[len(leaf.key) - excess:]
                self.num_tokens -= excess


# Exercise 2: how many prompt tokens a new request skips --------------------------------------

def num_cached_tokens(earlier_prompts: Sequence[Sequence[int]], prompt: Sequence[int],
                      block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError("block_size must be an integer >= 1")
    if len(prompt) < 1:
        raise ValueError("the prompt must have at least one token")
    # A chained block name stands for the block and everything before it: the prefix itself.
    cached = {tuple(p[:(i + 1) * block_size]) for p in earlier_prompts
              for i in range(len(p) // block_size)}
    run = 0
    for i in range((len(prompt) - 1) // block_size):
        if tuple(prompt[:(i + 1) * block_size]) not in cached:
            break                                             # a chain: later blocks miss too
        run += 1
    return run * block_size


# Exercise 3: reference counts and the LRU free queue -----------------------------------------

def serve(num_blocks: int, block_size: int,
          ops: Sequence[tuple]) -> list[tuple[list[int], list[int], list[int]]]:
    if num_blocks < 2 or block_size < 1:
        raise ValueError("num_blocks must be >= 2 (block 0 is the null block), block_size >= 1")
    free = list(range(1, num_blocks))                         # front first
    ref = [0] * num_blocks
    name: dict[int, str] = {}                                 # block id -> hash
    by_name: dict[str, int] = {}                              # hash -> block id
    tables: dict[str, list[int]] = {}
    out = []
    for op in ops:
        if op[0] == "admit":
            _, rid, hashes, num_tokens = op
            if rid in tables or num_tokens < 1 or len(hashes) != num_tokens // block_size:
                raise ValueError(f"bad admit {op!r}")
            hits = []
            for h in hashes[:(num_tokens - 1) // block_size]:
                if h not in by_name:
                    break
                hits.append(by_name[h])
            need = -(-num_tokens // block_size) - len(hits)
            if need > len(free) - sum(ref[b] == 0 for b in hits):
                raise ValueError(f"not enough free blocks for {op!r}")
            for b in hits:                                    # touch: out of the free queue
                if ref[b] == 0:
                    free.remove(b)
                ref[b] += 1
            new, free = free[:need], free[need:]
            evicted = [b for b in new if b in name]
            for b in new:
                ref[b] = 1
                if b in name:
                    del by_name[name.pop(b)]
            tables[rid] = hits + new
            for i, h in enumerate(hashes):                    # the step wrote them: named
                if h not in by_name:                          # a twin stays unnamed
                    by_name[h], name[tables[rid][i]] = tables[rid][i], h
            out.append((hits, evicted, list(free)))
        elif op[0] == "free":
            if op[1] not in tables:
                raise ValueError(f"{op[1]!r} holds no blocks")
            for b in reversed(tables.pop(op[1])):             # last block first
                ref[b] -= 1
                if ref[b] == 0:
                    free.append(b)                            # keeps its name
            out.append(([], [], list(free)))
        else:
            raise ValueError(f"unknown op {op!r}")
    return out
