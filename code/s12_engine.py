"""S12, the paged engine: KV stored in blocks, written through a slot mapping, read through
block tables.

What is new since S11
    code/s12_paged_attention.py decides which blocks each request holds; this module stores
    the keys and values there and runs the model against them.

    - `PagedKVCache`: k, v (L, num_blocks, block_size, Hkv, D), zeroed; block 0 (the null
      block) is never written, and a block is zeroed again when it is handed out
      (`zero_blocks`). A running request has a row of `block_tables` (max_num_seqs,
      max_blocks_per_seq), int64 on the device, its block ids then the null block (vLLM's
      persistent `BlockTable`); `allocate` / `free` hand out rows as S09's slots were, so
      S09's and S10's engine code runs unchanged (`seq.slot` is now the request's row).
    - Writes: the slot of position p of a request is block_tables[row, p // block_size] *
      block_size + p % block_size (`slot_mapping`); each layer writes the step's keys with one
      index_copy_ into its cache seen as (num_blocks block_size, Hkv, D).
    - Reads: one gather (`PagedKVCache.gather`) takes each request's first cdiv(S, block_size)
      table entries, indexes the blocks with them and lays them end to end, (B, Hkv, S, D);
      then S09's attention as before: the decoding requests in one masked batch (columns past
      each context masked), a prompt chunk alone with its start offset.
    - `LLMEngine`: S11's, with block_size (default 16) and num_blocks (default: enough for
      max_num_seqs requests of max_context tokens, plus the null block, so it schedules as S11
      by default) instead of kv_capacity. Batch-invariant mode keeps S11's promise (each
      request computed alone with S06's shapes, a chunked prompt again whole at its last
      chunk): its outputs are bitwise those of the request run alone, and (measured in the
      tests) bitwise S11's.
    - `engine.trace`: S11's `StepRecord`, and per running request its block table and the
      slots its scheduled tokens were written to (at most TRACE_SLOTS each), the pool's
      changes in the step (`block_events`), free blocks after it, num_blocks, block_size.

What it does not handle yet
    The gather copies every decoding request's keys in every layer (S17's paged kernel reads
    the blocks in place); blocks are not shared between requests (S13).

Run it
    python code/s12_paged_attention.py --block-size 4 --num-blocks 40 --max-num-seqs 4
    python code/s12_engine.py --block-size 8 --num-blocks 12 --max-num-batched-tokens 32

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
import bisect
import sys
from dataclasses import dataclass, fields
from typing import Sequence

import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
import s10_engine as s10
import s11_chunked_prefill as s11
from s12_paged_attention import (NULL_BLOCK_ID, PagedScheduler, PagedSchedulerOutput, cdiv,
                                 check_pool_sizes, slot_mapping)

DEFAULT_BLOCK_SIZE = 16
TRACE_SLOTS = 64        # slots of one request's scheduled tokens kept in a StepRecord


# ---------------------------------------------------------------------------------------------
# The storage
# ---------------------------------------------------------------------------------------------

def device_memory(device: str | torch.device) -> int:
    """Bytes of memory of the device: a GPU's total, or the host's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class PagedKVCache:
    """k, v (L, num_blocks, block_size, Hkv, D) and the block tables of up to num_rows running
    requests, block_tables int64 (num_rows, cdiv(max_seq_len, block_size)) on the device.

    Rows are handed out as S09's slots (`allocate`: the lowest free row; `free`: the row's
    table back to the null block). `set_block_table(row, ids)` writes a request's table;
    `slot_mapping(rows, positions)` gives the pool slot of each token; `gather(layer, rows,
    length)` is the only read; `zero_blocks(ids)` clears blocks newly handed out. Raises
    ValueError for sizes < 1, a pool whose two tensors would not fit the device's memory
    (checked before they are allocated), no free row, a row not in use, a table longer than a
    row or holding an id outside 1 .. num_blocks - 1.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, num_rows: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        check_pool_sizes(num_blocks, block_size)
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_rows", num_rows),
                            ("max_seq_len", max_seq_len)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        need = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        have = device_memory(device)
        if need > have:
            raise ValueError(
                f"the KV pool would take {need / 2**30:,.1f} GiB (2 x {num_layers} layers x "
                f"{num_blocks} blocks x {block_size} tokens x {num_kv_heads} KV heads x "
                f"{head_dim} x {dtype}), more than the {have / 2**30:,.1f} GiB of memory of "
                f"{device}: use fewer or smaller blocks")
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, blocks, bs, Hkv, D)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as err:      # out of memory (on a GPU, what others hold counts)
            raise ValueError(f"the KV pool of {need / 2**30:,.1f} GiB could not be allocated "
                             f"on {device}: use fewer or smaller blocks ({err})") from err
        self.block_size, self.max_seq_len = int(block_size), int(max_seq_len)
        self.block_tables = torch.full((num_rows, cdiv(max_seq_len, block_size)),
                                       NULL_BLOCK_ID, dtype=torch.int64, device=device)
        self.free_slots: list[int] = list(range(num_rows))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_slots(self) -> int:        # S09's name for the rows
        return self.block_tables.shape[0]

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def allocate(self) -> int:
        if not self.free_slots:
            raise ValueError(f"no block-table row is free (all {self.num_slots} are in use)")
        return self.free_slots.pop(0)

    def free(self, row: int) -> None:
        if not s01.is_int(row) or not 0 <= row < self.num_slots or row in self.free_slots:
            raise ValueError(f"row {row!r} is not in use, so it cannot be freed")
        self.block_tables[row] = NULL_BLOCK_ID
        bisect.insort(self.free_slots, int(row))

    def set_block_table(self, row: int, block_ids: Sequence[int]) -> None:
        if not s01.is_int(row) or not 0 <= row < self.num_slots:
            raise ValueError(f"row must be an integer in [0, {self.num_slots}) (got {row!r})")
        if len(block_ids) > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {len(block_ids)} blocks does not fit a row of "
                             f"{self.block_tables.shape[1]}")
        if block_ids and not (NULL_BLOCK_ID < min(block_ids) and max(block_ids) < self.num_blocks):
            raise ValueError(f"block ids must be in 1 .. {self.num_blocks - 1} (block 0 is the "
                             f"null block) (got {list(block_ids)!r})")
        table = torch.full((self.block_tables.shape[1],), NULL_BLOCK_ID, dtype=torch.int64)
        table[:len(block_ids)] = torch.tensor(block_ids, dtype=torch.int64)
        self.block_tables[row] = table.to(self.block_tables.device)

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the keys and values of these blocks in every layer (blocks just taken from the
        free queue: what an earlier holder left there is never read, even masked)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.k.device)
        self.k.index_fill_(1, ids, 0)
        self.v.index_fill_(1, ids, 0)

    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows, positions int64 (N,) -> int64 (N,): block_tables[row, p // block_size] *
        block_size + p % block_size, each token's slot in the pool seen as (num_blocks
        block_size, Hkv, D)."""
        blocks = self.block_tables[rows, positions // self.block_size]            # (N,)
        return blocks * self.block_size + positions % self.block_size

    def gather(self, layer: int, rows: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length - 1 of the requests in rows (int64 (B,)),
        two (B, Hkv, length, D) copies. A request with fewer positions gets, past its own,
        positions of its last block or of the null block (zeros): its caller masks them."""
        n = cdiv(length, self.block_size)
        ids = self.block_tables[rows, :n].reshape(-1)                             # (B n,)
        _, num_blocks, _, n_kv, d = self.k.shape
        out = []
        for cache in (self.k[layer], self.v[layer]):
            # index_select of whole blocks, each one row of (num_blocks, bs Hkv D): measured
            # about 1.5x faster than advanced indexing on the CPU
            blocks = cache.view(num_blocks, -1).index_select(0, ids)      # (B n, bs Hkv D)
            out.append(blocks.view(len(rows), n * self.block_size, n_kv, d)[:, :length]
                       .transpose(1, 2))                                 # (B, Hkv, S, D)
        return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

class PagedRunner(s09.RaggedRunner):
    """S09's `RaggedRunner` over a `PagedKVCache`: its KV seams (`kv_index`, `write_kv`,
    `read_kv`) and its masked decode attention go through the slot mapping and block tables;
    everything else (the batched and the batch-invariant paths, the layers) is S09's.
    `batch.slots` are the requests' block-table rows. Arguments as S09's, and num_blocks,
    block_size; raises ValueError as S09's and `PagedKVCache` do."""

    def __init__(self, model: s06.TorchTransformer, max_num_seqs: int, max_seq_len: int,
                 num_blocks: int, block_size: int, batch_invariant: bool = False,
                 attention: str = "masked"):
        self.num_blocks, self.block_size = num_blocks, block_size     # read by make_cache
        super().__init__(model, max_num_seqs, max_seq_len, batch_invariant, attention)

    def make_cache(self, max_num_seqs: int, max_seq_len: int) -> PagedKVCache:
        cfg, model = self.model.config, self.model
        return PagedKVCache(cfg.num_hidden_layers, self.num_blocks, self.block_size,
                            cfg.num_key_value_heads, cfg.head_dim, max_num_seqs, max_seq_len,
                            model.dtype, model.device)

    def kv_index(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.cache.slot_mapping(slot_of_token, positions)                   # (N,)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 where: torch.Tensor) -> None:
        """k, v (Hkv, N, D) to the slots `where` (N,) of the layer's pool."""
        cache = self.cache
        for pool, new in ((cache.k[layer], k), (cache.v[layer], v)):
            n_kv, d = pool.shape[-2:]
            pool.view(-1, n_kv, d).index_copy_(0, where, new.transpose(0, 1))  # (N, Hkv, D)

    def read_kv(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.gather(layer, torch.tensor([slot], device=self.model.device), length)
        return k[0], v[0]                                                  # (Hkv, S, D)

    def _decode_meta(self, batch: s09.RaggedBatch) -> dict | None:
        """The decoding requests' rows, longest context and mask, once per step (None when
        no request decodes): each attends over its gathered blocks, columns past its context
        masked."""
        device = self.model.device
        lens = batch.query_lens()
        decodes = [b for b, n in enumerate(lens) if n == 1]
        if not decodes:
            return None
        ctx = [batch.context_lens[b] for b in decodes]
        s_len = max(ctx)
        allowed = None
        if min(ctx) < s_len:
            allowed = s08.additive_mask(torch.arange(s_len, device=device)[None, :]
                                        < torch.tensor(ctx, device=device)[:, None],
                                        self.model.dtype)[:, None]          # (B_d, 1, S)
        rows = (None if len(decodes) == len(lens) else
                torch.tensor([batch.query_start_loc[b] for b in decodes], device=device))
        return dict(table_rows=torch.tensor([batch.slots[b] for b in decodes], device=device),
                    s_len=s_len, allowed=allowed, rows=rows)

    def _decode_attention(self, layer: int, q: torch.Tensor, scale: float, meta: dict
                          ) -> torch.Tensor:
        """q (H, B_d, D), one query per decoding request -> (H, B_d, D)."""
        keys, values = self.cache.gather(layer, meta["table_rows"], meta["s_len"])
        queries = q.transpose(0, 1)[:, :, None]                          # (B_d, H, 1, D)
        out = s08.batched_attention(queries, keys, values, meta["allowed"], scale,
                                    self.model.attention_impl)           # (B_d, H, 1, D)
        return out[:, :, 0].transpose(0, 1)                               # (H, B_d, D)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord(s11.StepRecord):
    """S11's record of one step, and per running id (aligned with `running`): block_tables
    (its block ids when scheduled) and slot_mapping (the slots its scheduled tokens were
    written to, the first TRACE_SLOTS of them); block_events: the pool's changes since the
    previous record, in order, ("allocated" | "freed", request id, block ids); free_blocks
    after the step; num_blocks (the null block included); block_size."""

    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: tuple[tuple[int, ...], ...]
    block_events: tuple[tuple[str, str, tuple[int, ...]], ...]
    free_blocks: int
    num_blocks: int
    block_size: int


class LLMEngine(s11.LLMEngine):
    """S11's engine over a block pool (see the module docstring).

    Arguments as S11's, without kv_capacity, and: block_size (tokens per block, default 16),
    num_blocks (blocks in the pool, the null block included; default max_num_seqs *
    cdiv(max_context, block_size) + 1, which never preempts). `kv_capacity` is
    (num_blocks - 1) * block_size tokens. Raises ValueError naming the rule, before anything
    is built.
    """

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_num_seqs: int = s09.DEFAULT_MAX_NUM_SEQS, batch_invariant: bool = False,
                 attention: str = "masked", logprobs_mode: str = "raw_logprobs",
                 sync_timing: bool = False, pad_id: int | None = None, *,
                 max_num_batched_tokens: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None):
        check_pool_sizes(2 if num_blocks is None else num_blocks, block_size)
        self._block_size, self._num_blocks = int(block_size), num_blocks  # read by the seams
        super().__init__(model, tokenizer, max_context, max_num_seqs, batch_invariant,
                         attention, logprobs_mode, sync_timing, pad_id,
                         max_num_batched_tokens=max_num_batched_tokens, policy=policy,
                         long_prefill_token_threshold=long_prefill_token_threshold)

    def make_ragged_runner(self, model: s06.TorchTransformer, batch_invariant: bool,
                           attention: str) -> PagedRunner:
        num_blocks = (self.max_num_seqs * cdiv(self.max_context, self._block_size) + 1
                      if self._num_blocks is None else self._num_blocks)
        return PagedRunner(model, self.max_num_seqs, self.max_context, num_blocks,
                           self._block_size, batch_invariant, attention)

    def make_scheduler(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                       max_model_len: int, policy: str) -> PagedScheduler:
        """S11's scheduler over the runner's pool (kv_capacity, S10's default, is unused)."""
        return PagedScheduler(max_num_seqs, max_num_batched_tokens,
                              self.runner.cache.num_blocks, self._block_size, max_model_len,
                              policy, self._threshold)

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    def check_prompt(self, prompt: str) -> list[int]:
        """S11's rules, the KV one in blocks: a prompt shorter than max_context needs
        cdiv(len, block_size) blocks, at most the pool's usable ones (vLLM PR #1534)."""
        prompt_ids = s09.LLMEngine.check_prompt(self, prompt)
        need = cdiv(len(prompt_ids), self.block_size)
        usable = self.num_blocks - 1
        if need > usable and len(prompt_ids) < self.max_context:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens, {need} blocks of "
                             f"{self.block_size}, but the pool has {usable} usable blocks: it "
                             "could never be scheduled")
        return prompt_ids

    def schedule(self) -> list[str]:
        """S11's, then the blocks the plan took from the free queue are zeroed (see
        `BlockPool.take_new_blocks`; S13's hits are not new, and keep their KV) and each
        scheduled request's block table goes into its row of the cache."""
        joined = super().schedule()
        new = self.scheduler.kv.pool.take_new_blocks()
        if new:
            self.runner.cache.zero_blocks(new)
        out = self.scheduler_output
        for rid, table in out.block_tables.items():
            self.runner.cache.set_block_table(self.requests[rid].slot, table)
        return joined

    def _record(self, base: s09.StepRecord | None, out: PagedSchedulerOutput) -> StepRecord:
        record = super()._record(base, out)
        values = {f.name: getattr(record, f.name) for f in fields(s11.StepRecord)}
        size = out.block_size
        later = tuple(self.scheduler.kv.take_events())     # finishes after the plan
        values.update(
            block_tables=tuple(out.block_tables[rid] for rid in record.running),
            slot_mapping=tuple(tuple(slot_mapping(
                out.block_tables[rid], out.num_computed_tokens[rid],
                min(out.num_scheduled_tokens[rid], TRACE_SLOTS), size))
                for rid in record.running),
            block_events=out.block_events + later, free_blocks=self.scheduler.kv.num_free_blocks,
            num_blocks=out.num_blocks, block_size=size)
        return StepRecord(**values)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_block_table(trace: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The trace as the pool sees it, one line per step: step, free blocks / usable, each
    scheduled request's block table ("A:[3,4,7]+2" is request A holding blocks 3, 4 and 7 and
    computing 2 tokens), and the blocks freed in the step. A trace longer than max_rows shows
    its first and last max_rows // 2 steps. Raises ValueError for max_rows < 2."""
    if not s01.is_int(max_rows) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2 (got {max_rows!r}): the table "
                         "shows the first and the last steps")
    trace = list(trace)
    half = max_rows // 2
    shown = trace if len(trace) <= max_rows else [*trace[:half], None, *trace[-half:]]
    lines = [f"{'step':>5} {'free':>9}  block tables (id:[blocks]+tokens)   | freed"]
    for r in shown:
        if r is None:
            lines.append(f"{'…':>5} {len(trace) - 2 * half} steps not shown")
            continue
        at = {rid: k for k, rid in enumerate(r.running)}
        cells = [f"{rid}:[{','.join(map(str, r.block_tables[at[rid]]))}]"
                 f"+{r.num_scheduled_tokens[at[rid]]}" for rid in r.schedule_order]
        freed = [f"{rid}:{','.join(map(str, ids))}" for kind, rid, ids in r.block_events
                 if kind == "freed"]
        lines.append(f"{r.step:>5} {f'{r.free_blocks}/{r.num_blocks - 1}':>9}  "
                     + "  ".join(cells) + (f"   | {' '.join(freed)}" if freed else ""))
    return "\n".join(line.rstrip() for line in lines)


def add_paged_arguments(parser: argparse.ArgumentParser, batch_invariant_help: str,
                        num_blocks_help: str) -> None:
    """The command line of a paged engine (S12's, S13's): S10's scheduler flags without its
    token capacity (listed nowhere: the pool is counted in blocks), S11's per-request limit,
    --block-size and --num-blocks."""
    s10.add_scheduler_arguments(
        parser, "most tokens per step, from max-num-seqs up; a longer prompt is chunked "
                "(default: max(16, max-num-seqs))", batch_invariant_help, token_capacity=False)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="most tokens one request computes in a step, 0 = only the "
                             "budget limits it (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="token positions per KV block (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=None, help=num_blocks_help)


def check_paged_arguments(parser: argparse.ArgumentParser, args) -> tuple:
    """S10's checks and the pool's (exit 2 with the rule broken); returns (the sampling
    params, the token budget per step)."""
    params = s10.check_scheduler_arguments(parser, args)
    if args.kv_capacity is not None:
        parser.error("--kv-capacity counts tokens; the paged engine's capacity is "
                     "--num-blocks blocks of --block-size tokens")
    if args.block_size < 1 or (args.num_blocks is not None and args.num_blocks < 2):
        parser.error("--block-size must be >= 1 and --num-blocks >= 2 (block 0 is the null "
                     "block)")
    budget = (max(16, args.max_num_seqs) if args.max_num_batched_tokens is None
              else args.max_num_batched_tokens)
    return params, budget


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 12: paged attention, KV in blocks handed out as requests grow.")
    add_paged_arguments(
        parser, "compute every request alone, a chunked prompt again whole at its last chunk: "
                "slow, bitwise equal to each request run alone",
        "KV blocks in the pool, block 0 (the null block) included; small values force "
        "preemptions (default: max-num-seqs x the context's blocks + 1, none)")
    args = parser.parse_args(argv)
    params, budget = check_paged_arguments(parser, args)
    try:
        model, tokenizer, max_context, prompts, priorities = s10.load_workload(args)
        engine = LLMEngine(model, tokenizer, max_context, args.max_num_seqs,
                           args.batch_invariant, max_num_batched_tokens=budget,
                           policy=args.policy,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           block_size=args.block_size, num_blocks=args.num_blocks)
        run = s10.run_arrivals(engine, prompts, params, priorities, args.arrival_every)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device}; "
          f"{len(prompts)} requests, {s10.describe_arrivals(args.arrival_every)}, "
          f"at most {args.max_num_seqs} running, context {max_context}, "
          f"{engine.scheduler.max_num_batched_tokens} tokens per step; KV pool "
          f"{engine.num_blocks} blocks of {engine.block_size} tokens (block 0 null), "
          f"{engine.runner.cache.nbytes / 2**20:.2f} MiB, policy {args.policy}")
    for rid, prompt in zip(run.ids, prompts):
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens) ---\n"
              f"{prompt}\n--- completion (finish_reason={run.reasons[rid]}) ---\n"
              f"{''.join(run.texts.get(rid, []))}")
    # held while the step ran: the plan's free tokens (free blocks x block_size), before the
    # step's finished requests gave theirs back
    used = max((engine.num_blocks - 1 - r.kv_free_tokens // r.block_size
                for r in engine.trace), default=0)
    print(f"\n--- {run.made} tokens in {len(engine.trace)} steps, {run.wall_s:.2f} s, "
          f"{engine.scheduler.num_preemptions} preemptions, at most {used} blocks in use ---")
    print(format_block_table(engine.trace))


if __name__ == "__main__":
    sys.exit(main())
