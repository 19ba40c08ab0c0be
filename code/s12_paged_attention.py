"""S12, paged attention: KV in fixed-size blocks, block tables per request, a slot per token.

What is new since S11
    Up to S11 every running request owns one KV slot of max_context positions, whatever it
    needs: a 20-token request reserves as much as a 4,000-token one, and the KV capacity is
    accounting on top of that reservation. Here KV lives in a pool of `num_blocks` blocks of
    `block_size` token positions each (vLLM's PagedAttention), handed out as a request grows.

    - `BlockPool`: the blocks (`KVCacheBlock`: block_id, ref_cnt), a free queue
      (`FreeBlockQueue`: allocation takes from the front, a freed block goes to the back, so
      the front is always the block freed longest ago) and reference counts. Block 0 is the
      null block (vLLM's `null_block`): never handed out, so no request's keys live there
      (here it stays zeros; S16's padded rows write finite values into it, only ever read
      under a mask), and the padded entries of a block table point at it. So a pool of num_blocks has
      num_blocks - 1 usable blocks.
    - `KVCacheManager`: S10's `TokenKVPool` interface (`allocate_slots(request, n)` all or
      nothing, `free(request)`, `trim`, `check_fits`, `num_used_tokens`, `num_free_tokens`,
      `capacity`) over the pool, blocks on demand: a request holding t tokens in b blocks that
      asks for n more gets ceil((t + n) / block_size) - b new blocks. `block_table(request_id)`
      is its block ids; token position p of the request lives at slot
      block_table[p // block_size] * block_size + p % block_size of the pool
      (`slot_mapping`). S10's and S11's schedulers run on it unchanged: the scheduler plans,
      the manager says which blocks, and each plan carries every scheduled request's block
      table to the runner.
    - code/s12_engine.py: the storage (`PagedKVCache`, (L, num_blocks, block_size, Hkv, D)),
      the runner that writes through the slot mapping and reads through the block tables
      (`PagedRunner`), `build_engine` (S11's scheduler over this manager) and the trace of
      the pool (`BlockTracer`).

What it does not handle yet
    Blocks are never shared: two requests with the same prompt hold two copies (S13 hashes
    full blocks and shares them; `touch` and the reference counts are here for it). Reads
    gather each request's blocks into a contiguous copy before S06's attention, which costs
    time and memory a fused paged kernel avoids (S17's "paged" and "triton" attention
    backends). No swapping to host memory.

Run it
    python code/s12_paged_attention.py --block-size 4 --num-blocks 40 --max-num-seqs 4
    python benchmarks/bench_s12_paged_attention.py --quick   # memory, step time, waste

Tests
    tests/test_s12_paged_attention.py: the pool and the manager (all-or-nothing, errors,
    free order), logits against S11's contiguous cache at every step, greedy equal to S05
    and HF alone with block sizes 1, 16 and one larger than any prompt, block accounting after
    every step, a failed step (its blocks back, the trace still replays), stale NaN in
    reused blocks, the public bugs G1 (in blocks), G2 (recompute after a block preemption),
    G4 (a stream closed mid-chunk), G5 (everything free once idle).
    tests/test_s12_properties.py: hypothesis state machines over the manager and over S11's
    scheduler on it with a fake model (failed steps included).

References
    Kwon et al., "Efficient Memory Management for Large Language Model Serving with
    PagedAttention" (SOSP 2023). vLLM V1 `BlockPool` / `FreeKVCacheBlockQueue` / `KVCacheBlock`
    (vllm/v1/core/block_pool.py, kv_cache_utils.py) and `KVCacheManager.allocate_slots`;
    nano-vllm's `BlockManager` (allocate, may_append, deallocate).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

import s01_generation_loop as s01
from s01_generation_loop import ParameterError

NULL_BLOCK_ID = 0
MAX_NUM_BLOCKS = 2**24  # a Python object per block: 16.8M blocks is ~2 GB of them already


class BlockPoolError(ValueError):
    """A block handed to the pool that it cannot take: freed twice, the null block, another
    pool's, or a request for more blocks than are free."""


# ---------------------------------------------------------------------------------------------
# The block pool
# ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class KVCacheBlock:
    """One block of the pool: its id (its index in the storage's block axis) and how many
    block tables hold it (ref_cnt; 0: in the free queue). S13 adds a hash."""

    block_id: int
    ref_cnt: int = 0


class FreeBlockQueue:
    """The blocks nobody holds, oldest-freed first: `popleft(n)` takes from the front,
    `append(block)` puts a freed block at the back, `remove(block)` takes one from anywhere
    (S13 takes a cached block back out of the queue when a new request reuses it). An
    insertion-ordered dict keyed by block id: each operation is O(1), as vLLM's doubly linked
    `FreeKVCacheBlockQueue` is."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(list(self._blocks.values()))

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self._blocks.get(block.block_id) is block

    def popleft(self, n: int) -> list[KVCacheBlock]:
        """The n blocks at the front, in queue order (the caller checked there are n)."""
        return [self._blocks.popitem(last=False)[1] for _ in range(n)]

    def append(self, block: KVCacheBlock) -> None:
        self._blocks[block.block_id] = block

    def appendleft(self, block: KVCacheBlock) -> None:
        """A freed block at the front: the next to be taken (a trimmed block, see
        `KVCacheManager.trim`)."""
        self._blocks[block.block_id] = block
        self._blocks.move_to_end(block.block_id, last=False)

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]

    def block_ids(self) -> list[int]:
        """The queue as ids, front first."""
        return list(self._blocks)


class BlockPool:
    """num_blocks blocks of block_size token positions; block 0 is the null block.

    `allocate(n)`: n blocks from the front of the free queue, each with ref_cnt 1, all or
    nothing (BlockPoolError, nothing taken, when fewer than n are free). `free(blocks)`: each
    block's ref_cnt goes down by one, and the blocks that reach 0 go to the back of the free
    queue in the order given. `touch(blocks)`: each block's ref_cnt goes up by one (a block
    in the free queue leaves it): a second holder of a block (S13's prefix hit, a fork).
    Raises ParameterError for sizes that are not integers (num_blocks >= 2: the null block and
    one usable block; block_size >= 1) and BlockPoolError for a block this pool cannot take.
    """

    def __init__(self, num_blocks: int, block_size: int):
        check_pool_sizes(num_blocks, block_size)     # before one object per block is built
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.blocks = [KVCacheBlock(i) for i in range(self.num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1          # held by nobody, handed to nobody, never freed
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self._new: dict[int, None] = {}      # allocated since take_new_blocks (ordered set)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if not s01.is_int(n) or n < 0:
            raise ValueError(f"the number of blocks to allocate must be an integer >= 0 "
                             f"(got {n!r})")
        if n > self.num_free_blocks:
            raise BlockPoolError(f"cannot allocate {n} blocks: only {self.num_free_blocks} "
                                 f"of {self.num_usable_blocks} are free")
        blocks = self.free_block_queue.popleft(int(n))
        for block in blocks:
            assert block.ref_cnt == 0, "a block in the free queue is held"
            block.ref_cnt = 1
            self._new[block.block_id] = None
        return blocks

    def take_new_blocks(self) -> list[int]:
        """Ids of the blocks allocated since the last call, each once, in order taken (at
        most num_blocks - 1 of them). Their storage still holds an earlier holder's KV: the
        engine zeroes it before the step writes (a masked read of the unwritten tail of a
        request's last block must meet finite numbers: -inf + NaN and 0 x NaN are NaN). A
        block `touch` takes back (S13's hit) is not new: its KV is what the hit reuses."""
        new, self._new = list(self._new), {}
        return new

    def free(self, blocks: Iterable[KVCacheBlock], front: bool = False) -> None:
        """See the class docstring; front: the blocks that reach 0 go to the front of the
        free queue instead (blocks that hold nothing worth keeping)."""
        blocks = list(blocks)
        self._check(blocks, "free")
        times = Counter(blocks)              # KVCacheBlock hashes by identity (eq=False)
        for block, k in times.items():       # checked first: nothing changes on an error
            if block.ref_cnt < k:
                raise BlockPoolError(f"block {block.block_id} is freed more times than it is "
                                     f"held (ref_cnt {block.ref_cnt}): a double free")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (self.free_block_queue.appendleft if front else
                 self.free_block_queue.append)(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self._check(blocks, "touch")
        for block in blocks:
            if block.ref_cnt == 0 and block in self.free_block_queue:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def _check(self, blocks: list[KVCacheBlock], what: str) -> None:
        for block in blocks:
            if not isinstance(block, KVCacheBlock) or not (
                    0 <= block.block_id < self.num_blocks
                    and self.blocks[block.block_id] is block):
                raise BlockPoolError(f"cannot {what} {block!r}: not a block of this pool")
            if block is self.null_block:
                raise BlockPoolError(f"cannot {what} the null block (block "
                                     f"{NULL_BLOCK_ID}): it is never allocated")


# ---------------------------------------------------------------------------------------------
# The KV cache manager: TokenKVPool's interface in blocks
# ---------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers a >= 0, b >= 1."""
    return -(-a // b)


def check_pool_sizes(num_blocks, block_size) -> None:
    """The pool's two sizes, checked before anything is built (ValueError naming the rule):
    num_blocks an integer in [2, MAX_NUM_BLOCKS] (block 0 is the null block; every block is
    a Python object), block_size an integer >= 1."""
    if not s01.is_int(num_blocks) or num_blocks < 2:
        raise ParameterError(f"num_blocks must be an integer >= 2, block 0 being the null "
                             f"block (got {num_blocks!r})", "num_blocks", num_blocks)
    if num_blocks > MAX_NUM_BLOCKS:
        raise ParameterError(f"num_blocks must be at most {MAX_NUM_BLOCKS:,} (one Python "
                             f"object per block) (got {num_blocks:,})", "num_blocks",
                             num_blocks)
    if not s01.is_int(block_size) or block_size < 1:
        raise ParameterError(f"block_size must be an integer >= 1 (got {block_size!r})",
                             "block_size", block_size)


class KVCacheManager:
    """Each request's blocks and token count over a `BlockPool` (vLLM V1's `KVCacheManager`),
    with S10's `TokenKVPool` interface so S10's and S11's schedulers run on it unchanged.

    A request holding t tokens holds cdiv(t, block_size) blocks, the list `block_table(rid)`
    (block ids, position p in block p // block_size at offset p % block_size).
    `allocate_slots(request, n)` adds n tokens, taking `num_blocks_to_allocate(rid, n)` new
    blocks from the pool, all or nothing (False, nothing taken). `free(request)` gives every
    block back, the table's last block first (`blocks_to_free`: S13 evicts from the front of
    the free queue, so a request's tail blocks, the least likely to be shared, go first).
    `trim(request, t)` keeps the first t tokens (a failed step's revert), giving back the
    blocks past them. `check_fits(n)`: the rule a prompt must meet to ever run. capacity:
    token positions of the usable blocks, (num_blocks - 1) * block_size. num_used_tokens:
    tokens held; num_free_tokens: what the free blocks hold (num_free_blocks * block_size),
    so capacity - used - free is the internal waste, the unused tail positions of each
    request's last block. `get_computed_blocks` / `cache_blocks` are the prefix cache's (S13):
    nothing is cached here. enable_kv_cache_events: keep a list of the pool's changes
    (`take_events`; vLLM's option of the same name), for the trace; off, nothing is kept.
    Raises ValueError for a count that is not an integer >= 0.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_kv_cache_events: bool = False):
        self.pool = self.make_block_pool(num_blocks, block_size)
        self.block_size = self.pool.block_size
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_tokens: dict[str, int] = {}
        # (kind, request id, block ids): "allocated", "freed"; S13 adds "hit", "evicted",
        # "cached". None when events are not kept.
        self.events: list[tuple[str, str, tuple[int, ...]]] | None = (
            [] if enable_kv_cache_events else None)

    def make_block_pool(self, num_blocks: int, block_size: int) -> BlockPool:
        """The pool (S13's manager makes its hashing pool instead)."""
        return BlockPool(num_blocks, block_size)

    # --- TokenKVPool's interface --------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    @property
    def num_used_tokens(self) -> int:
        return sum(self.req_tokens.values())

    @property
    def num_free_tokens(self) -> int:
        return self.pool.num_free_blocks * self.block_size

    def num_tokens(self, request_id: str) -> int:
        return self.req_tokens.get(request_id, 0)

    def check_fits(self, num_tokens: int) -> None:
        """A prompt needing more blocks than the pool's usable ones could never be scheduled
        (vLLM PR #1534: it would wait at the head of the queue, blocking everyone behind it).
        The same rule as S10's in tokens: cdiv(n, block_size) > num_blocks - 1 exactly when
        n > capacity. ParameterError, parameter "prompt"."""
        need = cdiv(num_tokens, self.block_size)
        if need > self.pool.num_usable_blocks:
            raise ParameterError(
                f"prompt is {num_tokens} tokens, {need} blocks of {self.block_size}, but the "
                f"pool has {self.pool.num_usable_blocks} usable blocks: it could never be "
                "scheduled (it would block every request behind it)", "prompt")

    def get_computed_blocks(self, request) -> tuple[list[KVCacheBlock], int]:
        """(blocks, tokens) of the request's prompt already in the cache: none (S13 caches)."""
        return [], 0

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks=()) -> bool:
        rid = request.request_id
        need = self.num_blocks_to_allocate(rid, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        blocks = self.pool.allocate(need)
        self.req_blocks.setdefault(rid, []).extend(blocks)
        self.req_tokens[rid] = self.num_tokens(rid) + int(num_new_tokens)
        if blocks:
            self.record("allocated", rid, blocks)
        return True

    def free(self, request) -> int:
        """Give back all the request's blocks; returns the tokens it held."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self._give_back(rid, self.blocks_to_free(blocks))
        return self.req_tokens.pop(rid, 0)

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Name the request's full blocks among its first num_tokens (S13): nothing here."""

    def take_new_blocks(self) -> list[int]:
        """The blocks taken from the free queue since the last call (`BlockPool`'s), whose
        storage the runner zeroes before the step writes."""
        return self.pool.take_new_blocks()

    # --- blocks ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order ([] for one that holds none)."""
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def block_tables(self) -> dict[str, list[int]]:
        return {rid: self.block_table(rid) for rid in self.req_blocks}

    def num_blocks_to_allocate(self, request_id: str, num_new_tokens: int) -> int:
        """New blocks the request needs for num_new_tokens more tokens:
        cdiv(held + n, block_size) - blocks held."""
        if not s01.is_int(num_new_tokens) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0 (got {num_new_tokens!r})")
        held = len(self.req_blocks.get(request_id, ()))
        return max(0, cdiv(self.num_tokens(request_id) + int(num_new_tokens), self.block_size)
                   - held)

    def blocks_to_free(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The order a request's blocks go back to the free queue: the last block first."""
        return blocks[::-1]

    def trim(self, request, num_tokens: int) -> None:
        """Keep the request's first num_tokens tokens (no more than it holds) and the
        cdiv(num_tokens, block_size) blocks holding them; the rest go back to the front of the
        free queue: they hold no token anyone computed (a failed step's, or S15's rejected
        drafts'), so they are the next taken, and a block S13 keeps cached further back is
        not evicted for them."""
        if not s01.is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0 (got {num_tokens!r})")
        rid = request.request_id
        if rid not in self.req_tokens:
            return
        num_tokens = min(int(num_tokens), self.req_tokens[rid])
        blocks = self.req_blocks[rid]
        keep = cdiv(num_tokens, self.block_size)
        self._give_back(rid, self.blocks_to_free(blocks[keep:]), front=True)
        del blocks[keep:]
        self.req_tokens[rid] = num_tokens

    def _give_back(self, request_id: str, blocks: list[KVCacheBlock], front: bool = False
                   ) -> None:
        self.pool.free(blocks, front)
        if blocks:
            self.record("freed", request_id, blocks)

    # --- events --------------------------------------------------------------------------

    def record(self, kind: str, request_id: str, blocks: Iterable[KVCacheBlock]) -> None:
        """Add an event (kind, request id, block ids) when events are kept."""
        if self.events is not None:
            self.events.append((kind, request_id, tuple(b.block_id for b in blocks)))

    def take_events(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """The pool's changes since the last call, in order: ("allocated" or "freed", request
        id, block ids in the order taken or given back); [] when events are not kept."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def check(self) -> None:
        """The accounting invariants (AssertionError when broken): free + used == usable;
        each request holds cdiv(tokens, block_size) blocks; no block in two tables or in a
        table and the free queue; every held block's ref_cnt is the tables holding it."""
        pool = self.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
        holders: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            assert len(blocks) == cdiv(self.req_tokens[rid], self.block_size), rid
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert set(self.req_blocks) == set(self.req_tokens)
        free = set(pool.free_block_queue.block_ids())
        assert not free & set(holders), "a held block is in the free queue"
        assert NULL_BLOCK_ID not in free and NULL_BLOCK_ID not in holders
        assert len(free) + len(holders) == pool.num_usable_blocks
        for block_id, n in holders.items():
            assert pool.blocks[block_id].ref_cnt == n, block_id


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool's settings, checked once here (vLLM's `CacheConfig`). block_size: tokens
    per block (default 16, vLLM's). num_blocks: blocks in the pool, the null block included
    (None: enough for max_num_seqs requests of max_context tokens plus the null block, so
    nothing is preempted; `num_blocks_for`). enable_kv_cache_events: keep the pool's changes
    for a trace. Raises ParameterError naming the field."""

    block_size: int = 16
    num_blocks: int | None = None
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        check_pool_sizes(2 if self.num_blocks is None else self.num_blocks, self.block_size)
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ParameterError(f"enable_kv_cache_events must be a bool (got "
                                 f"{self.enable_kv_cache_events!r})", "enable_kv_cache_events")

    def num_blocks_for(self, max_num_seqs: int, max_context: int) -> int:
        """num_blocks, or its default for max_num_seqs requests of max_context tokens
        (checked as num_blocks is, the error naming max_num_seqs, the setting that sized
        it)."""
        if self.num_blocks is not None:
            return self.num_blocks
        num_blocks = max_num_seqs * cdiv(max_context, self.block_size) + 1
        try:
            check_pool_sizes(num_blocks, self.block_size)
        except ParameterError as err:
            per_request = cdiv(max_context, self.block_size)
            raise ParameterError(f"max_num_seqs {max_num_seqs} x {per_request} blocks of "
                                 f"{self.block_size} per request: {err}", "max_num_seqs",
                                 max_num_seqs) from None
        return num_blocks


def slot_mapping(block_table: list[int] | tuple[int, ...], start: int, n: int,
                 block_size: int) -> list[int]:
    """The pool slots of positions start .. start + n - 1 of a request:
    block_table[p // block_size] * block_size + p % block_size. Raises ValueError for a
    start or n that is not an integer >= 0, a block_size < 1, a position past the table's
    blocks."""
    for name, value, least in (("start", start, 0), ("n", n, 0), ("block_size", block_size, 1)):
        if not s01.is_int(value) or value < least:
            raise ValueError(f"{name} must be an integer >= {least} (got {value!r})")
    if start + n > len(block_table) * block_size:
        raise ValueError(f"positions up to {start + n - 1} need {cdiv(start + n, block_size)} "
                         f"blocks but the block table has {len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + n)]


if __name__ == "__main__":   # the chapter's command line is its engine's (code/s12_engine.py)
    import sys

    from s12_engine import main
    sys.exit(main())
