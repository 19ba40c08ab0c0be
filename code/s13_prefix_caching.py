r"""S13, prefix caching: full KV blocks named by a chained hash, shared by reference count.

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
    - A hit (`PrefixCachingKVCacheManager.get_computed_blocks`, which S10's scheduler asks
      at admission and at resume after a preemption): the longest run of cached blocks
      matching the request's token_ids, at most (len(token_ids) - 1) // block_size blocks, so
      at least the last token is computed (its logits give the next token; vLLM does the
      same). When the scheduler admits the request, `allocate_slots` takes the run as its
      first blocks (their ref_cnt goes up; a cached block nobody holds leaves the free queue)
      and its num_computed_tokens starts after them. S10's scheduler needs no change: it
      already asks the manager both questions (`get_computed_blocks` before admission,
      `cache_blocks` after each step), which S09-S12's managers answer with nothing.
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
      asked for (queries) and found (hits), in tokens and in requests. Each request's
      num_cached_tokens (its hit at first admission) comes back on its outputs, which S19's
      server reports as OpenAI's usage.prompt_tokens_details.cached_tokens.
    - `build_engine`: S12's paged engine with this manager (`enable_prefix_caching`: on by
      default, unless batch_invariant=True) and `add_request(..., cache_salt=...)`;
      `CacheTracer`, an observer beside S09's and S12's tracers, records the cache's view of
      each step (hits, reference counts, cached blocks, the free queue).

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
    python code/s13_prefix_caching.py --shared-prefix 24 --num-prompts 4 --block-size 8 \
        --no-prefix-caching
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
    (vllm/v1/core/block_pool.py), `KVCacheManager.get_computed_blocks` / `allocate_slots`
    (vllm/v1/core/kv_cache_manager.py); nano-vllm's
    `BlockManager` (a chained xxhash per full block); Zheng et al., "SGLang: Efficient
    Execution of Structured Language Model Programs" (2024), RadixAttention.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import hashlib
import struct
import sys
from dataclasses import dataclass
from typing import Sequence

import s01_generation_loop as s01
import s06_torch as s06
import s09_continuous_batching as s09
from s01_generation_loop import ParameterError
from s09_scheduler import check_cache_salt
from s12_engine import paged_engine
from s12_paged_attention import BlockPool, CacheConfig, KVCacheBlock, KVCacheManager

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
    return extend_block_hashes(list(known), token_ids, block_size, cache_salt)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None) -> list[BlockHash]:
    """`hash_request_tokens`' chain without its checks, extending `hashes` (the names of the
    first blocks) in place to every full block of token_ids; returns it. The manager's
    per-step call: its block size and the request's salt were checked when they were made."""
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

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        """One admission of a request of num_tokens tokens, num_hit_tokens found cached."""
        self.requests += 1
        self.hit_requests += num_hit_tokens > 0
        self.queries += num_tokens
        self.hits += num_hit_tokens


class PrefixCachingKVCacheManager(KVCacheManager):
    """S12's manager over a `PrefixCachingBlockPool`, and the cache's three moves:

    - `get_computed_blocks(request)`: the longest run of cached blocks matching the
      request's first blocks, at most (num_tokens - 1) // block_size of them, and the tokens
      they hold (no change to anything). The request's `block_hashes` are extended here (and
      in `cache_blocks`) to cover its full blocks; a block's hash is computed once.
    - `allocate_slots(request, n, computed_blocks)`: a waiting request takes the run as its
      first blocks (ref_cnt += 1, out of the free queue), then new blocks for n more tokens,
      all or nothing; an admission (a request holding no blocks) is counted in `stats`.
    - `cache_blocks(request, num_tokens)`: name the request's full blocks among its first
      num_tokens tokens (their KV is written: S10's scheduler calls it after each step).

    Events (when kept) also get ("hit", rid, block ids), ("evicted", rid, block ids taken
    from the cache by rid's allocation, before its "allocated") and ("cached", rid, ids).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_kv_cache_events: bool = False):
        super().__init__(num_blocks, block_size, enable_kv_cache_events)
        self.req_entries: dict[str, list[int]] = {}   # entry of each full block it holds
        self.stats = PrefixCacheStats()

    def make_block_pool(self, num_blocks: int, block_size: int) -> PrefixCachingBlockPool:
        return PrefixCachingBlockPool(num_blocks, block_size)

    def block_hashes(self, request) -> list[BlockHash]:
        """The names of the request's full blocks, `request.block_hashes` extended to its
        tokens so far (its early blocks never change as it grows, so they are kept)."""
        return extend_block_hashes(request.block_hashes, request.token_ids, self.block_size,
                                   request.cache_salt)

    def get_computed_blocks(self, request) -> tuple[list[KVCacheBlock], int]:
        """Walk the request's blocks from the first: block i is a hit when a cached block has
        its hash AND remembers its tokens, extra keys and, as parent, the entry of the block
        matched for i - 1. Stops at the first miss; the last token is always computed."""
        size, parent, run = self.block_size, ROOT_ENTRY, []
        max_blocks = (request.num_tokens - 1) // size
        for i, block_hash in enumerate(self.block_hashes(request)[:max_blocks]):
            block = self.pool.get_cached_block(
                block_hash, parent, tuple(request.token_ids[i * size:(i + 1) * size]),
                block_extra_keys(i, request.cache_salt))
            if block is None:
                break
            run.append(block)
            parent = block.cache_key.entry
        return run, len(run) * size

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks=()) -> bool:
        rid = request.request_id
        admission = rid not in self.req_blocks
        hits = list(computed_blocks) if admission else []
        hit_tokens = len(hits) * self.block_size
        need = self.num_blocks_to_allocate(rid, hit_tokens + num_new_tokens) - len(hits)
        reusable = sum(1 for b in hits if b.ref_cnt == 0)     # taken out of the free queue
        if need > self.pool.num_free_blocks - reusable:
            return False
        self.pool.touch(hits)         # first, so allocating cannot evict a block just hit
        blocks = self.pool.allocate(need)
        self.req_blocks.setdefault(rid, []).extend(hits + blocks)
        self.req_tokens[rid] = self.num_tokens(rid) + hit_tokens + int(num_new_tokens)
        if hits:
            self.req_entries[rid] = [b.cache_key.entry for b in hits]
            self.record("hit", rid, hits)
        if self.pool.evicted:
            self.record("evicted", rid, self.pool.evicted)
            self.pool.evicted.clear()
        if blocks:
            self.record("allocated", rid, blocks)
        if admission:
            self.stats.record(request.num_tokens, hit_tokens)
        return True

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Name the request's full blocks among its first num_tokens tokens (their KV is
        written), from the first it has not named yet. A block whose twin (same hash and
        key) is already cached stays unnamed; the twin's entry is recorded as the parent
        of the next block, so the chain goes on through the twin."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            return
        size = self.block_size
        full = min(num_tokens, self.req_tokens[rid], request.num_tokens) // size
        hashes = self.block_hashes(request)
        entries = self.req_entries.setdefault(rid, [])
        named = []
        for i in range(len(entries), full):
            block = blocks[i]
            before = block.block_hash
            entries.append(self.pool.cache_block(
                block, hashes[i], entries[i - 1] if i else ROOT_ENTRY,
                tuple(request.token_ids[i * size:(i + 1) * size]),
                block_extra_keys(i, request.cache_salt)))
            if before is None and block.block_hash is not None:
                named.append(block)
        if named:
            self.record("cached", rid, named)

    def free(self, request) -> int:
        self.req_entries.pop(request.request_id, None)
        return super().free(request)

    def trim(self, request, num_tokens: int) -> None:
        super().trim(request, num_tokens)
        rid = request.request_id
        if rid in self.req_entries:
            del self.req_entries[rid][self.num_tokens(rid) // self.block_size:]

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds (vLLM's reset_prefix_cache); returns how
        many. The counters are kept."""
        return self.pool.reset_prefix_cache()

    def check(self) -> None:
        """S12's accounting, and the cache's: the map holds exactly the blocks with a name,
        each under its own hash; only a request holding blocks has cache entries, at most one
        per full block it holds."""
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
        for rid, entries in self.req_entries.items():
            assert rid in self.req_blocks, f"cache entries kept for {rid!r}, which holds no KV"
            assert len(entries) <= self.num_tokens(rid) // self.block_size, (
                f"{rid!r} keeps more cache entries than it holds full blocks")


def cached_block_map(pool: PrefixCachingBlockPool, digits: int = 8) -> dict[int, str]:
    """{block id: the first `digits` hex digits of its hash} for every cached block, by id:
    the view a trace shows."""
    return {b.block_id: b.block_hash.hex()[:digits] for b in pool.blocks
            if b.block_hash is not None}


# ---------------------------------------------------------------------------------------------
# The engine with this manager, and its trace
# ---------------------------------------------------------------------------------------------

def kv_manager_class(enable_prefix_caching: bool | None, batch_invariant) -> type:
    """The block manager `build_engine` builds on: `PrefixCachingKVCacheManager` when
    enable_prefix_caching is True, S12's `KVCacheManager` when False; None decides by the mode
    (on in the fast mode, off with batch_invariant=True). Raises ParameterError naming
    enable_prefix_caching: a value that is not None, True or False, or True with
    batch_invariant=True (that mode computes each request alone, a chunked prompt again
    whole, so it cannot reuse another request's KV)."""
    if enable_prefix_caching is None:
        enable_prefix_caching = batch_invariant is not True
    if not isinstance(enable_prefix_caching, bool):
        raise ParameterError(f"enable_prefix_caching must be None, True or False (got "
                             f"{enable_prefix_caching!r})", "enable_prefix_caching")
    if enable_prefix_caching and batch_invariant is True:
        raise ParameterError("enable_prefix_caching needs the fast mode: batch_invariant=True "
                             "computes every request alone, so it cannot reuse KV another "
                             "request computed (turn one of them off)", "enable_prefix_caching")
    return PrefixCachingKVCacheManager if enable_prefix_caching else KVCacheManager


def build_engine(model: s06.TorchTransformer, tokenizer, *,
                 enable_prefix_caching: bool | None = None, block_size: int = 16,
                 num_blocks: int | None = None, enable_kv_cache_events: bool = False,
                 max_num_batched_tokens: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, **options) -> s09.LLMEngine:
    """S12's paged engine with prefix caching: its block manager is a
    `PrefixCachingKVCacheManager`. enable_prefix_caching: True, False (S12's manager: S12's
    engine exactly) or None, the default: on in the fast mode, off with batch_invariant=True
    (vLLM also leaves it None until the configuration decides). The other arguments are
    S12's. Raises ParameterError naming the rule (`kv_manager_class`)."""
    manager = kv_manager_class(enable_prefix_caching, options.get("batch_invariant", False))
    return paged_engine(model, tokenizer, manager,
                        CacheConfig(block_size, num_blocks, enable_kv_cache_events),
                        max_num_batched_tokens, policy, long_prefill_token_threshold, options)


@dataclass(frozen=True)
class CacheRecord:
    """The prefix cache's side of one planned step (beside S09's `StepRecord` and S12's
    `BlockRecord` of the same step): step; cache_hits, ((id, cached tokens, its tokens in
    all), ...) for the requests admitted or resumed in the step (misses: in all - cached);
    ref_cnts, per running id (S09's record's order), the ref_cnt of each block of its block
    table when scheduled (a block shared by k requests shows k); cached_blocks, ((block id,
    hash prefix), ...) of every cached block after the step, by id; free_queue, the free
    block ids after the step, front first (allocation takes, and evicts, from the front);
    cache_stats, (requests, hit_requests, queries, hits) so far."""

    step: int
    cache_hits: tuple[tuple[str, int, int], ...]
    ref_cnts: tuple[tuple[int, ...], ...]
    cached_blocks: tuple[tuple[int, str], ...]
    free_queue: tuple[int, ...]
    cache_stats: tuple[int, int, int, int]


class CacheTracer:
    """The observer that records a `CacheRecord` per planned step into `records` (an engine
    whose manager caches: `build_engine` with the cache on). It snapshots the whole free
    queue and the cached blocks every step, which costs time with thousands of blocks: a
    tracer for the chapter's tables and the simulators, not for serving."""

    def __init__(self):
        self.records: list[CacheRecord] = []
        self._seen: tuple | None = None

    def on_plan(self, engine, plan) -> None:
        if not plan.planned:
            self._seen = None
            return
        blocks = engine.scheduler.kv.pool.blocks
        hits = tuple((rid, plan.num_computed_tokens[rid], engine.requests[rid].num_tokens)
                     for rid in plan.scheduled_new_ids + plan.scheduled_resumed_ids)
        ref_cnts = tuple(tuple(blocks[b].ref_cnt for b in plan.block_tables[rid])
                         for rid in plan.scheduled_ids)
        self._seen = (plan.step, hits, ref_cnts)

    def on_step(self, engine, result) -> None:
        seen, self._seen = self._seen, None
        if seen is None:
            return
        kv = engine.scheduler.kv
        stats = kv.stats
        self.records.append(CacheRecord(
            *seen, tuple(cached_block_map(kv.pool).items()),
            tuple(kv.pool.free_block_queue.block_ids()),
            (stats.requests, stats.hit_requests, stats.queries, stats.hits)))


def trace_cache(engine) -> CacheTracer:
    """A `CacheTracer` attached to the engine. Raises ParameterError for an engine whose KV
    manager does not cache (built with enable_prefix_caching=False, or S12's): it would have
    no cache to record."""
    if not isinstance(engine.scheduler.kv, PrefixCachingKVCacheManager):
        raise ParameterError("trace_cache needs an engine with the prefix cache on",
                             "enable_prefix_caching")
    tracer = CacheTracer()
    engine.observers.append(tracer)
    return tracer


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_cache_table(steps: Sequence, blocks: Sequence, cache: Sequence[CacheRecord],
                       max_rows: int = 40) -> str:
    """The step, block and cache records of the same steps as the prefix cache sees them,
    one line per step: step, tokens computed, the requests admitted with their cached /
    total tokens ("B 32/41" skipped 32 of 41), each scheduled block table with its shared
    blocks marked by their ref_cnt ("B:[1x2,2x2,7]" is blocks 1 and 2 held by two
    requests), the blocks cached, evicted and freed in the step, and cached blocks / free
    blocks after it. A trace longer than max_rows shows its first and last max_rows // 2
    steps. Raises ValueError for max_rows < 2 or records of different steps."""
    from s08_cli import render_table
    if not [r.step for r in steps] == [b.step for b in blocks] == [c.step for c in cache]:
        raise ValueError("the step, block and cache records must be of the same steps")

    def render(row) -> str:
        r, b, c = row
        hits = " ".join(f"{rid} {n}/{total}" for rid, n, total in c.cache_hits) or "-"
        tables = " ".join(
            f"{rid}:[" + ",".join(f"{blk}x{cnt}" if cnt > 1 else str(blk)
                                  for blk, cnt in zip(table, cnts)) + "]"
            for rid, table, cnts in zip(r.running, r.block_tables, c.ref_cnts)) or "-"
        events = " ".join(f"{kind}:{rid}:{','.join(map(str, ids))}"
                          for kind, rid, ids in b.block_events
                          if kind in ("cached", "evicted", "freed")) or "-"
        return (f"{r.step:>5} {r.num_tokens:>6}  {hits} | {tables} | {events} | "
                f"{len(c.cached_blocks)}, {len(c.free_queue)}/{b.num_blocks - 1}")

    return render_table(f"{'step':>5} {'tokens':>6}  hits (cached/all) | tables (block x "
                        "ref_cnt) | events | cached, free blocks",
                        list(zip(steps, blocks, cache)), render, max_rows)


def shared_prefix_prompts(tokenizer, prompts: Sequence[str], shared_tokens: int
                          ) -> list[str]:
    """The longest prompt first, then each other prompt behind its first shared_tokens
    tokens, decoded, with a line break between (a system prompt every request starts with;
    the tokenizer may merge its last token with what follows, so a request may share a token
    fewer). Raises ValueError for a negative count or one longer than the longest prompt."""
    if shared_tokens < 0:
        raise ValueError(f"--shared-prefix must be >= 0 (got {shared_tokens})")
    if shared_tokens == 0:
        return list(prompts)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    source = lengths.index(max(lengths))
    ids = tokenizer.encode(prompts[source])
    if shared_tokens > len(ids):
        raise ValueError(f"--shared-prefix {shared_tokens} is longer than the longest prompt "
                         f"({len(ids)} tokens)")
    head = tokenizer.decode(ids[:shared_tokens])
    head += "" if head.endswith("\n") else "\n"
    return [prompts[source]] + [head + p for k, p in enumerate(prompts) if k != source]


def add_prefix_arguments(parser) -> None:
    """S12's paged flags, and the prefix cache's: a shared prefix for the prompts, and off."""
    import s12_engine as s12
    s12.add_paged_arguments(
        parser, "KV blocks in the pool, block 0 (the null block) included; small values force "
                "evictions and preemptions (default: max-num-seqs x the context's blocks + 1)")
    parser.add_argument("--shared-prefix", type=int, default=24,
                        help="tokens of the longest prompt put in front of every other "
                             "prompt, a system prompt they share; 0 = none (default: "
                             "%(default)s)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn the prefix cache off (S12's engine)")


def cached_note(rid: str, run, tracers) -> str:
    """Prompt tokens found cached at admission (and at each resume after a preemption)."""
    if len(tracers) < 3:
        return "prefix cache off"
    hits = [n for c in tracers[2].records for r, n, _ in c.cache_hits if r == rid]
    first, *resumed = hits or [0]
    again = (f", then {', '.join(map(str, resumed))} at resume after preemption"
             if resumed else "")
    return f"{first} found cached at admission{again}"


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    import s12_engine as s12

    def check(parser, args) -> None:
        s12.check_paged_arguments(parser, args)
        if args.shared_prefix < 0:
            parser.error(f"--shared-prefix must be >= 0 (got {args.shared_prefix})")

    def describe(engine, tracers) -> str:
        words = s12.describe_pool(engine, tracers)
        if len(tracers) < 3:
            return words + "; prefix cache off"
        stats = engine.scheduler.kv.stats
        return (f"{words}; prefix cache: {stats.hits} of {stats.queries} prompt tokens hit "
                f"({100 * stats.hit_rate:.1f}%), {stats.hit_requests} of {stats.requests} "
                "admissions hit")

    def table(run, tracers) -> str:
        steps, blocks = tracers[0].records, tracers[1].records
        if len(tracers) < 3:
            return s12.format_block_table(steps, blocks)
        return format_cache_table(steps, blocks, tracers[2].records)

    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 13: prefix caching, full KV blocks shared by hash and reference count.",
        build_engine, add_arguments=add_prefix_arguments, check=check,
        options=lambda args: dict(
            s12.paged_options(args),
            enable_prefix_caching=False if args.no_prefix_caching else None),
        prompts=lambda tokenizer, prompts, args: shared_prefix_prompts(
            tokenizer, prompts, args.shared_prefix),
        tracers=lambda engine: [s09_trace.StepTracer(), s12.BlockTracer()] + (
            [CacheTracer()] if isinstance(engine.scheduler.kv, PrefixCachingKVCacheManager)
            else []),
        describe=describe, note=cached_note, table=table), argv)


if __name__ == "__main__":
    sys.exit(main())
