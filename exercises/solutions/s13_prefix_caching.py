"""S13 exercises, reference solutions: the block hash chain, how many prompt tokens a new request
skips, and the cache's LRU free queue with reference counts.

Try the stubs in exercises/s13_prefix_caching.py first; grade these with
`python exercises/grade.py --solutions s13`.

Sources followed: vLLM V1's `hash_block_tokens` (a block's hash taken of its parent's hash, its
token ids and its extra keys; only full blocks), `KVCacheManager.get_computed_blocks` (the
longest run of cached blocks, at most `num_tokens - 1` tokens, so the last token is computed),
`BlockPool.touch` / `get_new_blocks` / `_maybe_evict_cached_block` and
`SingleTypeKVCacheManager.free` (blocks given back last first to the back of the free queue,
keeping their hash; allocation takes the front and evicts); the byte encoding is S13's
(`encode_block` in code/s13_prefix_caching.py).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

ROOT_HASH = hashlib.sha256(b"s13 prefix cache: no parent block").digest()


# Exercise 1: the block hash chain ------------------------------------------------------------

def block_hashes(token_ids: Sequence[int], block_size: int,
                 cache_salt: str | None = None) -> list[bytes]:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError("block_size must be an integer >= 1")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string or None")
    hashes, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):             # full blocks only
        block = list(token_ids[i * block_size:(i + 1) * block_size])
        keys = [cache_salt] if i == 0 and cache_salt is not None else []
        data = parent + struct.pack(f"<I{len(block)}q", len(block), *block)
        data += struct.pack("<I", len(keys))
        for key in keys:
            raw = key.encode("utf-8")
            data += struct.pack("<I", len(raw)) + raw
        parent = hashlib.sha256(data).digest()
        hashes.append(parent)
    return hashes


# Exercise 2: how many prompt tokens a new request skips --------------------------------------

def num_cached_tokens(earlier_prompts: Sequence[Sequence[int]], prompt: Sequence[int],
                      block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError("block_size must be an integer >= 1")
    if len(prompt) < 1:
        raise ValueError("the prompt must have at least one token")
    cached = {h for p in earlier_prompts for h in block_hashes(p, block_size)}
    run = 0
    for h in block_hashes(prompt, block_size)[:(len(prompt) - 1) // block_size]:
        if h not in cached:
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
