"""S12, the paged engine: KV stored in blocks, written through a slot mapping, read through
block tables.

What is new since S11
    code/s12_paged_attention.py decides which blocks each request holds; this module stores
    the keys and values there and runs the model against them.

    - `PagedKVCache`: k, v (L, num_blocks, block_size, Hkv, D), zeroed; block 0 (the null
      block) holds no request's keys and is only ever read under a mask (S16's padded rows
      write finite values into it), and a block is zeroed again when it is handed out
      (`zero_blocks`, the plan's new_block_ids).
    - `PagedRunner`: S09's `RaggedRunner` with its KV seams going through the block tables.
      Every step's plan carries each scheduled request's block table (the manager's); the
      batch lays them out as an int64 (B, longest table) tensor on the device, shorter ones
      padded with the null block (vLLM's `BlockTable`). Writes: the slot of position p of a
      request is table[p // block_size] * block_size + p % block_size (`slot_mapping`); each
      layer writes the step's keys with one index_copy_ into its cache seen as
      (num_blocks block_size, Hkv, D). Reads: one gather (`PagedKVCache.gather`) takes each
      request's first cdiv(S, block_size) table entries, indexes the blocks with them and
      lays them end to end, (B, Hkv, S, D); then S09's attention as before: the decoding
      requests in one masked batch (columns past each context masked), a prompt chunk alone
      with its start offset. The batch-invariant reference is S09's too, unchanged: its
      outputs are bitwise those of the request run alone, and (measured in the tests)
      bitwise S11's.
    - `build_engine`: S11's chunked scheduler over code/s12_paged_attention.py's
      `KVCacheManager` (a `CacheConfig`: block_size, default 16, and num_blocks, default
      enough for max_num_seqs requests of max_context tokens plus the null block, so it
      schedules as S11 by default), and this runner. The engine is S09's.
    - `BlockTracer`: an observer beside S09's `StepTracer` that records, per step, the slots
      each scheduled request's tokens were written to (at most TRACE_SLOTS each), the pool's
      changes (`block_events`: the manager keeps them when built with
      enable_kv_cache_events) and the free blocks after it.

What it does not handle yet
    The gather copies every decoding request's keys in every layer (S17's paged kernels read
    the blocks in place: code/s17_attention.py's attention backends); blocks are not shared
    between requests (S13).

Run it
    python code/s12_paged_attention.py --block-size 4 --num-blocks 40 --max-num-seqs 4
    python code/s12_paged_attention.py --block-size 8 --num-blocks 12 --max-num-batched-tokens 32

Tests
    tests/test_s12_paged_attention.py (see code/s12_paged_attention.py).

References
    Kwon et al., SOSP 2023 (PagedAttention); vLLM V1's `BlockTable` (vllm/v1/worker/
    block_table.py: a row per request, slot_mapping = block_number * block_size + offset).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import s01_generation_loop as s01
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
from s09_ragged import RaggedBatch, RaggedRunner, allocate_kv, context_mask, decode_rows
from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig
from s12_paged_attention import (CacheConfig, KVCacheManager, cdiv, check_pool_sizes,
                                 slot_mapping)

TRACE_SLOTS = 64        # slots of one request's scheduled tokens kept in a BlockRecord


# ---------------------------------------------------------------------------------------------
# The storage
# ---------------------------------------------------------------------------------------------

class PagedKVCache:
    """k, v (L, num_blocks, block_size, Hkv, D), zeroed, on the device; max_seq_len: the
    longest context a request may reach (the engine's max_context).

    `slot_mapping(tables, rows, positions)` gives the pool slot of each token; `write(layer,
    slots, k, v)` is the only write and `gather(layer, tables, length)` the only read (the
    runner goes through these two, so a pool storing KV otherwise, S14's 8-bit one, plugs
    in); `zero_blocks(ids)` clears blocks newly handed out.
    Which request holds which blocks is the manager's business (`KVCacheManager`); the
    tables come with each step's batch. Raises ValueError for sizes < 1, and ParameterError
    for a pool whose two tensors would not fit the device's free memory (checked before
    they are allocated), naming `sized_by`: the setting that chose num_blocks.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, max_seq_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", sized_by: str = "num_blocks"):
        check_pool_sizes(num_blocks, block_size)
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_seq_len", max_seq_len)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k, self.v = allocate_kv(shape, dtype, device, "KV pool",  # (L, blocks, bs, Hkv, D)
                                     sized_by, "use fewer num_blocks or a smaller "
                                     "block_size")
        self.block_size, self.max_seq_len = int(block_size), int(max_seq_len)

    @classmethod
    def for_model(cls, model: s06.TorchTransformer, num_blocks: int, block_size: int,
                  max_seq_len: int, sized_by: str = "num_blocks") -> "PagedKVCache":
        """The pool for this model's layers, KV heads, head dim, dtype and device."""
        cfg = model.config
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                   cfg.head_dim, max_seq_len, model.dtype, model.device, sized_by)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of these blocks in every layer (blocks just taken from the
        free queue: what an earlier holder left there is never read, even masked: -inf + NaN
        and 0 x NaN are NaN)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.k.device)
        self.k.index_fill_(1, ids, 0)
        self.v.index_fill_(1, ids, 0)

    def slot_mapping(self, tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
        """tables int64 (B, n) (each request's block ids, null-padded); rows, positions int64
        (N,), each token's request and position -> int64 (N,): tables[row, p // block_size] *
        block_size + p % block_size, each token's slot in the pool seen as (num_blocks
        block_size, Hkv, D)."""
        blocks = tables[rows, positions // self.block_size]                        # (N,)
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """k, v (Hkv, N, D) to the slots (int64 (N,), `slot_mapping`'s) of the layer's pool,
        one index_copy_ each into the pool seen as (num_blocks block_size, Hkv, D)."""
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            n_kv, d = pool.shape[-2:]
            pool.view(-1, n_kv, d).index_copy_(0, slots, new.transpose(0, 1))  # (N, Hkv, D)

    def gather(self, layer: int, tables: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length - 1 of the requests whose block tables
        are the rows of tables (int64 (B, n)), two (B, Hkv, length, D) copies. A request with
        fewer positions gets, past its own, positions of its last block or of the null block
        (zeros): its caller masks them."""
        n = cdiv(length, self.block_size)
        ids = tables[:, :n].reshape(-1)                                           # (B n,)
        _, num_blocks, _, n_kv, d = self.k.shape
        out = []
        for cache in (self.k[layer], self.v[layer]):
            # index_select of whole blocks, each one row of (num_blocks, bs Hkv D): measured
            # about 1.5x faster than advanced indexing on the CPU
            blocks = cache.view(num_blocks, -1).index_select(0, ids)      # (B n, bs Hkv D)
            out.append(blocks.view(len(tables), n * self.block_size, n_kv, d)[:, :length]
                       .transpose(1, 2))                                 # (B, Hkv, S, D)
        return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

class PagedRunner(RaggedRunner):
    """S09's `RaggedRunner` over a `PagedKVCache`: its KV seams (`kv_index`, `write_kv`,
    `read_kv`) and its masked decode attention go through the batch's block tables and the
    slot mapping; everything else (the batched and the batch-invariant paths, the layers) is
    S09's. Before a step writes, the blocks its plan took from the free queue are zeroed.
    Arguments as S09's, with a `PagedKVCache`."""

    def execute_model(self, plan, requests):
        if plan.new_block_ids:
            self.cache.zero_blocks(plan.new_block_ids)
        return super().execute_model(plan, requests)

    def kv_index(self, batch: RaggedBatch, seq_of_token: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        return self.cache.slot_mapping(batch.block_table_tensor, seq_of_token, positions)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 where: torch.Tensor) -> None:
        """k, v (Hkv, N, D) to the slots `where` (N,) of the layer's pool (the cache's
        `write`)."""
        self.cache.write(layer, where, k, v)

    def read_kv(self, layer: int, batch: RaggedBatch, b: int, length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.gather(layer, batch.block_table_tensor[b:b + 1], length)
        return k[0], v[0]                                                  # (Hkv, S, D)

    def _decode_meta(self, batch: RaggedBatch) -> dict | None:
        """The decoding requests' block tables, longest context and mask, once per step
        (None when no request decodes): each attends over its gathered blocks, columns past
        its context masked."""
        device = self.model.device
        decodes, rows = decode_rows(batch, device)
        if not decodes:
            return None
        s_len, allowed = context_mask([batch.context_lens[b] for b in decodes], device,
                                      self.model.dtype)                   # (B_d, 1, S)
        tables = (batch.block_table_tensor if rows is None else
                  batch.block_table_tensor[torch.tensor(decodes, device=device)])
        return dict(tables=tables, s_len=s_len, allowed=allowed, rows=rows)

    def _decode_attention(self, layer: int, q: torch.Tensor, scale: float, meta: dict
                          ) -> torch.Tensor:
        """q (H, B_d, D), one query per decoding request -> (H, B_d, D)."""
        keys, values = self.cache.gather(layer, meta["tables"], meta["s_len"])
        queries = q.transpose(0, 1)[:, :, None]                          # (B_d, H, 1, D)
        out = s08.batched_attention(queries, keys, values, meta["allowed"], scale,
                                    self.model.attention_impl)           # (B_d, H, 1, D)
        return out[:, :, 0].transpose(0, 1)                               # (H, B_d, D)


# ---------------------------------------------------------------------------------------------
# The engine: S11's scheduler over the block manager, and this runner
# ---------------------------------------------------------------------------------------------

def paged_engine(model: s06.TorchTransformer, tokenizer, manager_class, cache_config,
                 max_num_batched_tokens: int | None, policy: str,
                 long_prefill_token_threshold: int, options: dict,
                 make_cache: Callable[..., PagedKVCache] = PagedKVCache.for_model
                 ) -> s09.LLMEngine:
    """S09's engine with S11's `ChunkedScheduler` over a block manager of `manager_class`
    (S12's `KVCacheManager`, S13's prefix-caching one) sized by cache_config, and a
    `PagedRunner` over a pool of as many blocks, made by make_cache(model, num_blocks,
    block_size, max_seq_len, sized_by) (default `PagedKVCache.for_model`; S14 passes its
    8-bit pool's). The assembly S12's, S13's and S14's `build_engine` share."""
    config = s09.EngineConfig.of(model, options)
    processor = s09.make_processor(model, tokenizer, config)
    num_blocks = cache_config.num_blocks_for(config.max_num_seqs, config.max_context)
    scheduler_config = ChunkedSchedulerConfig(config.max_num_seqs, config.max_context,
                                              max_num_batched_tokens, policy,
                                              long_prefill_token_threshold)
    sized_by = ("num_blocks" if cache_config.num_blocks is not None else     # what the
                "block_size" if cache_config.block_size > config.max_context      # default
                else "max_num_seqs")                                              # grew with
    cache = make_cache(model, num_blocks, cache_config.block_size,  # memory checked
                       config.max_context, sized_by)                # before the books
    kv = manager_class(num_blocks, cache_config.block_size, cache_config.enable_kv_cache_events)
    runner = PagedRunner(model, cache, config.batch_invariant, config.attention)
    return s09.LLMEngine(config, processor, ChunkedScheduler(scheduler_config, kv), runner)


def build_engine(model: s06.TorchTransformer, tokenizer, *, block_size: int = 16,
                 num_blocks: int | None = None, enable_kv_cache_events: bool = False,
                 max_num_batched_tokens: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, **options) -> s09.LLMEngine:
    """S12's engine: S11's scheduler over a `KVCacheManager` of num_blocks blocks of
    block_size tokens (block 0 the null block, so (num_blocks - 1) * block_size token
    positions; default enough for max_num_seqs requests of max_context tokens), and the
    `PagedRunner`. max_num_batched_tokens, policy, long_prefill_token_threshold: S11's
    (the default budget, max_num_seqs x max_context, never chunks);
    enable_kv_cache_events: keep the pool's changes for `BlockTracer`. options: S09's
    `EngineConfig` fields. Raises ParameterError naming the option."""
    cache_config = CacheConfig(block_size, num_blocks, enable_kv_cache_events)
    return paged_engine(model, tokenizer, KVCacheManager, cache_config, max_num_batched_tokens,
                        policy, long_prefill_token_threshold, options)


# ---------------------------------------------------------------------------------------------
# The pool's trace
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockRecord:
    """The pool's side of one planned step (beside S09's `StepRecord` of the same step):
    step; slot_mapping, per running id (S09's record's order), the slots its scheduled tokens
    were written to (the first TRACE_SLOTS); block_events: the pool's changes since the
    previous record, in order, ("allocated" | "freed" | S13's "hit", "evicted", "cached",
    request id, block ids); free_blocks after the step; num_blocks (the null block
    included); block_size."""

    step: int
    slot_mapping: tuple[tuple[int, ...], ...]
    block_events: tuple[tuple[str, str, tuple[int, ...]], ...]
    free_blocks: int
    num_blocks: int
    block_size: int


class BlockTracer:
    """The observer that records a `BlockRecord` per planned step into `records`. The
    engine's KV manager must keep its events (built with enable_kv_cache_events=True):
    without them block_events stay empty. A step whose model run raised has no record; its
    events come with the next one (so a replay never sees a block freed that nobody was
    seen taking)."""

    def __init__(self):
        self.records: list[BlockRecord] = []
        self._seen: tuple | None = None
        self._carried: list = []             # events of a plan whose step raised

    def on_plan(self, engine, plan) -> None:
        kv = engine.scheduler.kv
        if self._seen is not None:           # the step after that plan raised
            self._carried = list(self._seen[2])
        if not plan.planned:
            self._seen = None
            return
        size = kv.block_size
        slots = tuple(tuple(slot_mapping(plan.block_tables[rid], plan.num_computed_tokens[rid],
                                         min(n, TRACE_SLOTS), size))
                      for rid, n in plan.num_scheduled_tokens.items())
        self._seen = (plan.step, slots, self._carried + kv.take_events())
        self._carried = []

    def on_step(self, engine, result) -> None:
        kv, seen, self._seen = engine.scheduler.kv, self._seen, None
        if seen is None:                     # nothing planned: its events wait for the next
            self._carried += kv.take_events()
            return
        step, slots, events = seen
        self.records.append(BlockRecord(step, slots, tuple(events + kv.take_events()),
                                        kv.num_free_blocks, kv.num_blocks, kv.block_size))


def trace_blocks(engine) -> BlockTracer:
    """A `BlockTracer` attached to the engine. Raises ParameterError when the engine's KV
    manager keeps no events (built without enable_kv_cache_events=True): the records' block
    events would be silently empty."""
    if getattr(engine.scheduler.kv, "events", None) is None:
        raise s01.ParameterError("trace_blocks needs the pool's events: build the engine with "
                                 "enable_kv_cache_events=True", "enable_kv_cache_events")
    tracer = BlockTracer()
    engine.observers.append(tracer)
    return tracer


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_block_table(steps: Sequence, blocks: Sequence[BlockRecord], max_rows: int = 40
                       ) -> str:
    """S09's step records and this chapter's block records of the same steps as the pool
    sees them, one line per step: step, free blocks / usable, each scheduled request's block
    table ("A:[3,4,7]+2" is request A holding blocks 3, 4 and 7 and computing 2 tokens), and
    the blocks freed in the step. A trace longer than max_rows shows its first and last
    max_rows // 2 steps. Raises ValueError for max_rows < 2 or records of different steps."""
    from s08_cli import render_table
    if [r.step for r in steps] != [b.step for b in blocks]:
        raise ValueError("the step records and the block records must be of the same steps")

    def render(pair) -> str:
        r, b = pair
        cells = [f"{rid}:[{','.join(map(str, table))}]+{n}"
                 for rid, table, n in zip(r.running, r.block_tables, r.num_scheduled_tokens)]
        freed = [f"{rid}:{','.join(map(str, ids))}" for kind, rid, ids in b.block_events
                 if kind == "freed"]
        return (f"{r.step:>5} {f'{b.free_blocks}/{b.num_blocks - 1}':>9}  " + "  ".join(cells)
                + (f"   | {' '.join(freed)}" if freed else ""))

    return render_table(f"{'step':>5} {'free':>9}  block tables (id:[blocks]+tokens)   | freed",
                        list(zip(steps, blocks)), render, max_rows)


def add_paged_arguments(parser, num_blocks_help: str) -> None:
    """The paged engines' flags (S12's and S13's scripts): S11's scheduler flags without the
    token capacity (the pool is counted in blocks), --block-size and --num-blocks."""
    import s11_chunked_prefill as s11
    s11.add_chunk_arguments(parser, kv_capacity=False)
    parser.add_argument("--block-size", type=int, default=16,
                        help="token positions per KV block (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=None, help=num_blocks_help)
    # S10's token capacity, parsed so that `check_paged_arguments` can say what replaced it
    parser.add_argument("--kv-capacity", type=int, default=None, help=argparse.SUPPRESS)


def check_paged_arguments(parser, args) -> None:
    """S10's flag rules, and --kv-capacity refused with a pointer to the pool's flags."""
    import s10_scheduler as s10
    s10.check_scheduler_arguments(parser, args)
    if args.kv_capacity is not None:
        parser.error("--kv-capacity counts tokens; the paged engine's capacity is "
                     "--num-blocks blocks of --block-size tokens")


def paged_options(args) -> dict:
    """`build_engine`'s arguments from the paged engines' flags (the pool's events kept for
    `BlockTracer`)."""
    import s11_chunked_prefill as s11
    return dict(s11.chunk_options(args), block_size=args.block_size,
                num_blocks=args.num_blocks, enable_kv_cache_events=True)


def describe_pool(engine, tracers) -> str:
    """The header's words on a paged engine: budget, pool, policy, and how it went."""
    scheduler, blocks = engine.scheduler, tracers[1].records
    # the most blocks held while a step ran: the plan's, before the step's finished requests
    # gave theirs back
    used = max((b.num_blocks - 1 - r.kv_free_tokens // b.block_size
                for r, b in zip(tracers[0].records, blocks)), default=0)
    return (f"{scheduler.max_num_batched_tokens} tokens per step; KV pool "
            f"{scheduler.kv.num_blocks} blocks of {scheduler.kv.block_size} "
            f"token{'s' if scheduler.kv.block_size > 1 else ''} (block 0 "
            f"null), {engine.runner.cache.nbytes / 2**20:.2f} MiB, policy {scheduler.policy}; "
            f"{scheduler.num_preemptions} preemptions, at most {used} blocks in use")


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 12: paged attention, KV in blocks handed out as requests grow.", build_engine,
        add_arguments=lambda parser: add_paged_arguments(
            parser, "KV blocks in the pool, block 0 (the null block) included; small values "
                    "force preemptions (default: max-num-seqs x the context's blocks + 1, "
                    "none)"),
        check=check_paged_arguments, options=paged_options,
        tracers=lambda engine: [s09_trace.StepTracer(), BlockTracer()],
        describe=describe_pool,
        table=lambda run, tracers: format_block_table(tracers[0].records,
                                                      tracers[1].records)), argv)


if __name__ == "__main__":
    sys.exit(main())
