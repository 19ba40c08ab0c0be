"""S13, prefix caching: full KV blocks named by a chained hash, shared by reference count.

What is new since S12
    S12 gives every request blocks of its own: two requests with the same 1,000-token system
    prompt compute it twice and hold it twice. Here a block that is full is given a name, the
    hash of its tokens chained to the name of the block before it, and kept in a map from
    name to block. A request that arrives looks its prompt up block by block and takes the
    longest run of cached blocks as its own first blocks: their prefill is skipped, their KV
    read where it lies (vLLM V1's automatic prefix caching).

    - The name (`hash_block_tokens`): SHA-256 of a fixed byte encoding of (the parent block's
      hash, the block's token ids, its extra keys), never Python's `hash()` (salted per process
      for strings, and 64 bits). Block i's name depends on every token before it, so equal
      names mean equal prefixes, not just equal blocks. The first block's extra keys hold the
      request's `cache_salt` (vLLM's name): requests with different salts never share.
    - Only full blocks are named. A block becomes cached once its KV is written (after the
      model step that fills it, chunk by chunk under chunked prefill), never before.
    - A hit (`PrefixCachingScheduler.num_new_tokens`, at admission and at resume after a
      preemption): the longest run of cached blocks matching the request's token_ids, at most
      (len(token_ids) - 1) // block_size blocks, so at least the last token is computed (its
      logits give the next token; vLLM does the same). The blocks' ref_cnt goes up (a cached
      block nobody holds leaves the free queue); num_computed_tokens starts after them.
    - Reference counts: a block is in as many block tables as its ref_cnt says. When a request
      lets go, each block's ref_cnt goes down; at 0 it goes to the back of S12's free queue,
      last block first, and KEEPS its name: it can still be hit until it is reused. Taking a
      block from the front of the free queue for new tokens evicts its name first
      (`PrefixCachingBlockPool.allocate`): least recently freed first, and an evicted block is
      never hit. So when every request has finished no block is held, yet cached blocks stay
      in the free queue: that is the cache, not a leak (free + held == usable still holds).
    - Collisions. The hash is only an index. A block found by it is taken only if what it
      remembers equals what the request needs: its token ids, its extra keys and its parent,
      the cache entry (a number given once, when a block is cached) of the block the request
      matched just before. So a run of hits is, by induction, a run of blocks whose KV was
      computed from exactly the request's tokens, whatever the hash function: two different
      blocks with the same hash cost a miss, never a wrong answer (the tests force it with a
      constant hash). With SHA-256 (256 bits) such a collision has probability below
      n^2 / 2^257 for n cached blocks: for a trillion, 1e24 / 2^257, about 4.3e-54.
    - Counters (`PrefixCacheStats`, vLLM's prefix cache hit rate): per admission, the tokens
      asked for (queries) and found (hits), in tokens and in requests.

What it does not handle yet
    Prefix caching needs the fast mode: the batch-invariant mode computes each request alone
    (and a chunked prompt again whole, writing its blocks again), so it refuses
    enable_prefix_caching. Blocks are matched only from the start of the prompt (no middle
    reuse) and only whole blocks: a prompt sharing 15 of a block's 16 tokens shares nothing
    of that block. SGLang's radix tree (RadixAttention) shares at token granularity; see the
    chapter. No copy-on-write: a cached block is not written again, with one exception. After
    a failed step (`revert`), a request's last block may already be named (the failed forward
    filled it) while the request keeps fewer of its tokens; the retry computes those same
    tokens at the same positions again and rewrites that block's tail. The values are the same
    up to the rounding of another chunk shape (the fast mode's tolerance), so a request that
    hits the block in the same step reads the right KV either way.

Run it
    python code/s13_prefix_caching.py --shared-prefix 24 --num-prompts 4 --block-size 8
    python benchmarks/bench_s13_prefix_caching.py --quick   # TTFT against the shared fraction

Tests
    tests/test_s13_prefix_caching.py: the hash chain (encoding, salt, never Python's hash), a
    hand-worked hit/miss example, LRU eviction order, an evicted block never hits, a forced
    collision, outputs with the cache on and off (greedy and seeded, under preemption and
    chunking) against S05 and HF alone, the public bugs H1, H2, H3 and G5.
    tests/test_s13_properties.py: hypothesis state machine over shared prefixes, evictions and
    aborts with a fake model that checks every KV position it reads.

References
    vLLM V1 automatic prefix caching: `hash_block_tokens` (vllm/v1/core/kv_cache_utils.py),
    `BlockPool.get_cached_block` / `cache_full_blocks` / `_maybe_evict_cached_block`
    (vllm/v1/core/block_pool.py), `KVCacheManager.get_computed_blocks`; nano-vllm's
    `BlockManager` (a chained xxhash per full block); Zheng et al., "SGLang: Efficient
    Execution of Structured Language Model Programs" (2024), RadixAttention.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields
from typing import Sequence

import s01_generation_loop as s01
from s10_scheduler import PREEMPTED, WAITING
from s12_paged_attention import (BlockPool, KVCacheBlock, KVCacheManager, PagedScheduler,
                                 PagedSchedulerOutput)

BlockHash = bytes                 # a SHA-256 digest, 32 bytes
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1   # a token id is encoded as an int64
# The parent of every request's first block: a fixed constant, so names are the same in
# every process and run (vLLM draws a random one unless PYTHONHASHSEED is set).
ROOT_HASH: BlockHash = hashlib.sha256(b"s13 prefix cache: no parent block").digest()
ROOT_ENTRY = 0                    # the parent entry of a first block; cached blocks get 1, 2, ...


# ---------------------------------------------------------------------------------------------
# The block hash chain
# ---------------------------------------------------------------------------------------------

def encode_block(parent_hash: BlockHash, token_ids: Sequence[int],
                 extra_keys: Sequence[str] = ()) -> bytes:
    """The bytes a block's hash is taken of, the same in every process and version: the
    parent's hash (32 bytes), the number of tokens (uint32, little-endian), each token id
    (int64), the number of extra keys (uint32), each key as its UTF-8 length (uint32) and
    bytes. Every field has a fixed width or a length before it, so two different
    (parent, tokens, keys) never give the same bytes (no pickle, no repr, no str() joins).
    Raises ValueError for a parent that is not 32 bytes, a token id that is not an int in
    the int64 range, or an extra key that is not a str."""
    if not isinstance(parent_hash, bytes) or len(parent_hash) != 32:
        raise ValueError(f"parent_hash must be 32 bytes (a SHA-256 digest), got "
                         f"{parent_hash!r}")
    check_token_ids(token_ids)
    if not all(isinstance(k, str) for k in extra_keys):
        raise ValueError(f"extra keys must be strings (got {tuple(extra_keys)!r})")
    out = [parent_hash, struct.pack(f"<I{len(token_ids)}q", len(token_ids),
                                    *map(int, token_ids)),
           struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        data = key.encode("utf-8")
        out += [struct.pack("<I", len(data)), data]
    return b"".join(out)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> BlockHash:
    """A full block's name: SHA-256 of `encode_block(parent_hash, token_ids, extra_keys)`,
    32 bytes. The chain: block 0's parent is ROOT_HASH, block i's is block i - 1's hash
    (vLLM V1's `hash_block_tokens`)."""
    return hashlib.sha256(encode_block(parent_hash, token_ids, extra_keys)).digest()


def block_extra_keys(index: int, cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys of block `index` of a request: the cache salt in the first block only
    (the chain carries it to every later block, as in vLLM), none without a salt."""
    return (cache_salt,) if index == 0 and cache_salt is not None else ()


def hash_request_tokens(token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None,
                        known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """The names of the full blocks of token_ids, len(token_ids) // block_size of them.
    known: names already computed for the first blocks (kept, not recomputed: a request's
    early blocks never change as it grows). Raises ValueError for block_size < 1 or an
    empty cache salt (None means no salt)."""
    if not s01.is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (got {block_size!r})")
    check_cache_salt(cache_salt)
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else ROOT_HASH
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                        block_extra_keys(i, cache_salt)))
    return hashes


def check_token_ids(token_ids: Sequence[int]) -> None:
    """Every id an int (not a bool) that fits the int64 the encoding gives it; ValueError
    otherwise."""
    if not all(s01.is_int(t) and INT64_MIN <= t <= INT64_MAX for t in token_ids):
        raise ValueError("token ids must be ints in the int64 range [-2**63, 2**63 - 1] (the "
                         "block encoding stores each as 8 bytes)")


def check_cache_salt(cache_salt) -> None:
    """None (no salt) or a non-empty string that UTF-8 can encode (a lone surrogate, which
    JSON's "\\ud800" decodes to, cannot); ValueError otherwise."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string or None (got {cache_salt!r})")
    if cache_salt is not None:
        try:
            cache_salt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"cache_salt must be valid Unicode text that UTF-8 can encode "
                             f"(got {ascii(cache_salt)}: {err.reason} at {err.start})") from None


# ---------------------------------------------------------------------------------------------
# The caching block pool
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheKey:
    """What a cached block remembers, checked on every hit: entry (its own number, given when
    it was cached, never reused), parent (the entry of the block before it in the request
    that cached it, ROOT_ENTRY for a first block), its token ids and extra keys."""

    entry: int
    parent: int
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


class PrefixCachingBlockPool(BlockPool):
    """S12's pool, and a map from block hash to the cached blocks with that hash
    (`cached_block_hash_to_block`, {hash: {block id: block}} as vLLM's, so a collision keeps
    both). Each block gets two attributes: block_hash (None unless cached) and cache_key
    (a `CacheKey`, None unless cached).

    `get_cached_block(hash, parent, token_ids, extra_keys)`: the cached block with that hash
    whose key matches, or None. `cache_block(block, ...)`: name a full block; returns its
    entry (or the entry of an equal block already cached: then this one stays unnamed).
    `allocate(n)`: S12's, then each block taken that had a name loses it (an eviction, listed
    in `evicted` until the manager takes it). Raises as S12's pool does.
    """

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        for block in self.blocks:
            block.block_hash, block.cache_key = None, None
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.evicted: list[KVCacheBlock] = []
        self._entries = ROOT_ENTRY

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.cached_block_hash_to_block.values())

    @property
    def num_cached_free_blocks(self) -> int:
        """Cached blocks nobody holds: in the free queue, still hittable."""
        return sum(1 for b in self.free_block_queue if b.block_hash is not None)

    def get_cached_block(self, block_hash: BlockHash, parent: int, token_ids: tuple[int, ...],
                         extra_keys: tuple[str, ...]) -> KVCacheBlock | None:
        for block in self.cached_block_hash_to_block.get(block_hash, {}).values():
            key = block.cache_key
            if (key.parent, key.token_ids, key.extra_keys) == (parent, token_ids, extra_keys):
                return block
        return None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, parent: int,
                    token_ids: tuple[int, ...], extra_keys: tuple[str, ...]) -> int:
        """Name a full block whose KV is written. If a block with the same hash and key is
        already cached (this one, after a hit, or a twin computed by another request at the
        same time), nothing changes and its entry is returned."""
        twin = self.get_cached_block(block_hash, parent, token_ids, extra_keys)
        if twin is not None:
            return twin.cache_key.entry
        assert block.block_hash is None and len(token_ids) == self.block_size
        self._entries += 1
        block.block_hash = block_hash
        block.cache_key = CacheKey(self._entries, parent, token_ids, extra_keys)
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
        return self._entries

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """S12's allocation from the front of the free queue (the least recently freed
        blocks); a block that was cached is evicted as it is taken."""
        blocks = super().allocate(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        same = self.cached_block_hash_to_block[block.block_hash]
        del same[block.block_id]
        if not same:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash, block.cache_key = None, None
        self.evicted.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds (a held one keeps its name until it is
        freed and reused); returns how many were forgotten."""
        free = [b for b in self.free_block_queue if b.block_hash is not None]
        for block in free:
            self._evict(block)
        self.evicted.clear()
        return len(free)


# ---------------------------------------------------------------------------------------------
# The KV cache manager
# ---------------------------------------------------------------------------------------------

@dataclass
class PrefixCacheStats:
    """Counted at each admission (new or resumed): requests, requests with at least one hit
    token, tokens asked for (queries: the request's whole token_ids) and tokens found cached
    (hits). hit_rate = hits / queries (vLLM's prefix cache hit rate)."""

    requests: int = 0
    hit_requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0


class PrefixCachingKVCacheManager(KVCacheManager):
    """S12's manager over a `PrefixCachingBlockPool`, and the cache's three moves:

    - `find_cached_blocks(token_ids, block_hashes, cache_salt, max_blocks)`: the longest run
      of cached blocks matching the request's first blocks (no change to anything).
    - `set_computed_blocks(rid, blocks)`: the run found for a waiting request; its next
      `allocate_slots(rid, n)` takes them (ref_cnt += 1, out of the free queue) as its first
      blocks, then new blocks for n more tokens, all or nothing.
    - `cache_blocks(rid, token_ids, block_hashes, cache_salt, num_tokens)`: name the
      request's full blocks among its first num_tokens tokens (KV written).

    events (S12's, `take_events`) also get ("hit", rid, block ids), ("evicted", rid, block
    ids taken from the cache by rid's allocation) and ("cached", rid, block ids).
    """

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.pending: dict[str, list[KVCacheBlock]] = {}
        self.req_entries: dict[str, list[int]] = {}   # entry of each full block cached

    def make_block_pool(self, num_blocks: int, block_size: int) -> PrefixCachingBlockPool:
        return PrefixCachingBlockPool(num_blocks, block_size)

    def find_cached_blocks(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                           cache_salt: str | None, max_blocks: int) -> list[KVCacheBlock]:
        """Walk the request's blocks from the first: block i is a hit when a cached block has
        its hash AND remembers its tokens, extra keys and, as parent, the entry of the block
        matched for i - 1. Stops at the first miss or after max_blocks."""
        size, parent, run = self.block_size, ROOT_ENTRY, []
        for i, block_hash in enumerate(block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(
                block_hash, parent, tuple(token_ids[i * size:(i + 1) * size]),
                block_extra_keys(i, cache_salt))
            if block is None:
                break
            run.append(block)
            parent = block.cache_key.entry
        return run

    def set_computed_blocks(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        assert request_id not in self.req_blocks, "a request holding blocks cannot hit"
        self.pending[request_id] = list(blocks)

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        hits = self.pending.get(request_id)
        if not hits or request_id in self.req_blocks:
            return self._with_evictions(request_id,
                                        super().allocate_slots(request_id, num_new_tokens))
        hit_tokens = len(hits) * self.block_size
        need = self.num_blocks_to_allocate(request_id, hit_tokens + num_new_tokens) - len(hits)
        reusable = sum(1 for b in hits if b.ref_cnt == 0)     # taken out of the free queue
        if need > self.pool.num_free_blocks - reusable:
            return False
        del self.pending[request_id]
        self.pool.touch(hits)         # first, so allocating cannot evict a block just hit
        blocks = self.pool.allocate(need)
        self.req_blocks[request_id] = hits + blocks
        self.req_tokens[request_id] = hit_tokens + int(num_new_tokens)
        self.req_entries[request_id] = [b.cache_key.entry for b in hits]
        self.events.append(("hit", request_id, tuple(b.block_id for b in hits)))
        self._with_evictions(request_id, True)
        if blocks:
            self.events.append(("allocated", request_id, tuple(b.block_id for b in blocks)))
        return True

    def _with_evictions(self, request_id: str, ok: bool) -> bool:
        """Record the evictions of the last allocation, before its "allocated" event."""
        if self.pool.evicted:
            at = len(self.events) - (1 if self.events and self.events[-1][0] == "allocated"
                                     and self.events[-1][1] == request_id else 0)
            self.events.insert(at, ("evicted", request_id,
                                    tuple(b.block_id for b in self.pool.evicted)))
            self.pool.evicted.clear()
        return ok

    def cache_blocks(self, request_id: str, token_ids: Sequence[int],
                     block_hashes: Sequence[BlockHash], cache_salt: str | None,
                     num_tokens: int) -> None:
        """Name the request's full blocks among its first num_tokens tokens (their KV is
        written), from the first it has not named yet. A block whose twin (same hash and
        key) is already cached stays unnamed; the twin's entry is recorded as the parent
        of the next block, so the chain goes on through the twin."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            return
        size = self.block_size
        full = min(num_tokens, self.req_tokens[request_id], len(token_ids)) // size
        entries = self.req_entries.setdefault(request_id, [])
        named = []
        for i in range(len(entries), full):
            parent = entries[i - 1] if i else ROOT_ENTRY
            block = blocks[i]
            before = block.block_hash
            entry = self.pool.cache_block(block, block_hashes[i], parent,
                                          tuple(token_ids[i * size:(i + 1) * size]),
                                          block_extra_keys(i, cache_salt))
            entries.append(entry)
            if before is None and block.block_hash is not None:
                named.append(block.block_id)
        if named:
            self.events.append(("cached", request_id, tuple(named)))

    def free(self, request_id: str) -> int:
        self.pending.pop(request_id, None)
        self.req_entries.pop(request_id, None)
        return super().free(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        super().trim(request_id, num_tokens)
        if request_id in self.req_entries:
            del self.req_entries[request_id][self.num_tokens(request_id) // self.block_size:]

    def check(self) -> None:
        """S12's accounting, and the cache's: the map holds exactly the blocks with a name,
        each under its own hash; no pending hit survives a plan; only a request holding
        blocks has cache entries, at most one per full block it holds."""
        super().check()
        named = {b.block_id for b in self.pool.blocks if b.block_hash is not None}
        mapped = set()
        for block_hash, blocks in self.pool.cached_block_hash_to_block.items():
            assert blocks, "an empty entry in the cache map"
            for block_id, block in blocks.items():
                assert block.block_id == block_id and block.block_hash == block_hash
                assert block.cache_key is not None
                mapped.add(block_id)
        assert named == mapped, "a block named but not in the map, or the other way round"
        assert not self.pending, "a hit found for a request that was not admitted was kept"
        for rid, entries in self.req_entries.items():
            assert rid in self.req_blocks, f"cache entries kept for {rid!r}, which holds no KV"
            assert len(entries) <= self.num_tokens(rid) // self.block_size, rid


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefixCachingSchedulerOutput(PagedSchedulerOutput):
    """S12's `PagedSchedulerOutput`, and: num_cached_tokens, {id: tokens found cached} for the
    requests admitted or resumed in this step (their first chunk starts there); stats, the
    `PrefixCacheStats` so far (a copy); enable_prefix_caching."""

    num_cached_tokens: dict[str, int]
    stats: PrefixCacheStats
    enable_prefix_caching: bool


class PrefixCachingScheduler(PagedScheduler):
    """S12's scheduler with prefix caching (see the module docstring). Arguments as S12's,
    and enable_prefix_caching (a bool, default True; False: S12's behaviour exactly, the
    counters at 0). Requests may carry a `cache_salt` attribute (None or a non-empty str).

    The hit is taken in the one place S10's schedule asks about a waiting request,
    `num_new_tokens`: it finds the run, sets num_computed_tokens after it, and tells the
    manager, whose `allocate_slots` then takes the run or nothing. A request that stays
    waiting (no seat, no budget, no blocks) is set back to num_computed_tokens 0 after the
    plan, holding nothing. Blocks are named after the step that writes them:
    `update_from_output`, or sooner `cache_computed(scheduler_output)` (the engine calls it
    right after the model step, before finished requests let go of their blocks).

    Each queued request's block hashes are kept (`block_hashes`) until it leaves by any
    path: finished, aborted, or ended by S10's capacity rule (`_end`). A preempted request
    keeps them: its tokens only grow, so its early blocks' names stay right. `check()`
    asserts that no other request's hashes are kept and that each kept list is the chain of
    its request's tokens.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int,
                 block_size: int, max_model_len: int, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True):
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False (got "
                             f"{enable_prefix_caching!r})")
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._hashes: dict[str, list[BlockHash]] = {}
        super().__init__(max_num_seqs, max_num_batched_tokens, num_blocks, block_size,
                         max_model_len, policy, long_prefill_token_threshold)

    def make_kv_pool(self, num_blocks: int) -> PrefixCachingKVCacheManager:
        return PrefixCachingKVCacheManager(num_blocks, self.block_size)

    def add_request(self, request, priority: int = 0) -> None:
        """S12's `add_request`; also refuses, queueing nothing, a cache_salt that is not None
        or a non-empty UTF-8-encodable string, and (with the cache on) a token id outside
        the int64 range the block encoding stores (ValueError)."""
        check_cache_salt(getattr(request, "cache_salt", None))
        if self.enable_prefix_caching:
            check_token_ids(request.token_ids)
        super().add_request(request, priority)

    def block_hashes(self, request) -> list[BlockHash]:
        """The names of the request's full blocks (kept per request, extended as it grows)."""
        hashes = hash_request_tokens(request.token_ids, self.block_size,
                                     getattr(request, "cache_salt", None),
                                     self._hashes.get(request.request_id, ()))
        self._hashes[request.request_id] = hashes
        return hashes

    def num_new_tokens(self, request, budget: int) -> int:
        """S11's chunk rule, after the prefix lookup for a waiting request that holds no
        blocks: num_computed_tokens moves past the cached run found."""
        rid = request.request_id
        if (self.enable_prefix_caching and request.status in (WAITING, PREEMPTED)
                and rid not in self.kv.req_blocks):
            max_blocks = (len(request.token_ids) - 1) // self.block_size  # last token computed
            run = self.kv.find_cached_blocks(request.token_ids, self.block_hashes(request),
                                             getattr(request, "cache_salt", None), max_blocks)
            self.kv.set_computed_blocks(rid, run)
            request.num_computed_tokens = len(run) * self.block_size
        return super().num_new_tokens(request, budget)

    def schedule(self) -> PrefixCachingSchedulerOutput:
        out = super().schedule()
        for request in self.waiting:            # looked up but not admitted: holds nothing
            if request.request_id not in self.kv.req_blocks:
                request.num_computed_tokens = 0
        self.kv.pending.clear()
        cached = {}
        for rid in out.scheduled_new_ids + out.scheduled_resumed_ids:
            request = next(r for r in self.running if r.request_id == rid)
            cached[rid] = out.num_computed_tokens[rid]
            if self.enable_prefix_caching:
                self.stats.requests += 1
                self.stats.hit_requests += cached[rid] > 0
                self.stats.queries += len(request.token_ids)
                self.stats.hits += cached[rid]
        values = {f.name: getattr(out, f.name) for f in fields(PagedSchedulerOutput)}
        return PrefixCachingSchedulerOutput(
            **values, num_cached_tokens=cached,
            stats=PrefixCacheStats(**vars(self.stats)),
            enable_prefix_caching=self.enable_prefix_caching)

    def cache_computed(self, scheduler_output: PagedSchedulerOutput) -> None:
        """Name the full blocks each scheduled request still running has written in the step
        (its first start + n tokens). Calling it twice for a step changes nothing."""
        if not self.enable_prefix_caching:
            return
        held = {r.request_id: r for r in self.running}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = held.get(rid)
            if request is not None:
                self.kv.cache_blocks(rid, request.token_ids, self.block_hashes(request),
                                     getattr(request, "cache_salt", None),
                                     scheduler_output.num_computed_tokens[rid] + n)

    def update_from_output(self, scheduler_output, finished_ids=()) -> None:
        """Name the blocks the step wrote, then S12's update (finished requests let go)."""
        self.cache_computed(scheduler_output)
        super().update_from_output(scheduler_output, finished_ids)

    def finish_requests(self, request_ids) -> list[str]:
        """S10's (finished or aborted); the requests' block hashes are dropped."""
        done = super().finish_requests(request_ids)
        for rid in done:
            self._hashes.pop(rid, None)
        return done

    def _end(self, request, ids) -> None:
        """S10's end of a request that outgrew the pool; its block hashes are dropped."""
        super()._end(request, ids)
        self._hashes.pop(request.request_id, None)

    def check(self) -> None:
        """The manager's `check()`, and: hashes are kept only for queued requests, each the
        chain of its request's full blocks (a prefix of it, as it is extended lazily)."""
        self.kv.check()
        queued = {r.request_id: r for r in (*self.waiting, *self.running)}
        for rid, hashes in self._hashes.items():
            assert rid in queued, f"block hashes kept for {rid!r}, which left"
            request = queued[rid]
            want = hash_request_tokens(request.token_ids[:len(hashes) * self.block_size],
                                       self.block_size, getattr(request, "cache_salt", None))
            assert hashes == want, f"the block hashes kept for {rid!r} are not its tokens'"

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds (vLLM's reset_prefix_cache); returns how
        many. The counters are kept."""
        return self.kv.pool.reset_prefix_cache()


def cached_block_map(pool: PrefixCachingBlockPool, digits: int = 8) -> dict[int, str]:
    """{block id: the first `digits` hex digits of its hash} for every cached block, by id:
    the view a trace shows."""
    return {b.block_id: b.block_hash.hex()[:digits] for b in pool.blocks
            if b.block_hash is not None}


if __name__ == "__main__":   # the chapter's command line is its engine's (code/s13_engine.py)
    import sys

    from s13_engine import main
    sys.exit(main())
