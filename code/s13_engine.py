"""S13, the prefix-caching engine: S12's paged engine whose scheduler shares cached blocks.

What is new since S12
    code/s13_prefix_caching.py decides which cached blocks a request reuses; this module runs
    the model on it. Almost nothing changes in the model step: a request admitted with k
    cached tokens has num_computed_tokens = k, so S11's batch gives it only its tokens from
    position k on, and S12's runner reads positions 0 .. k - 1 through its block table, from
    blocks another request wrote (a prefill chunk that starts at k > 0, which S11 and S12
    already handle).

    - `LLMEngine`: S12's, with `enable_prefix_caching` (default: on, unless
      batch_invariant=True) and
      `add_request(..., cache_salt=None)`. Right after each model step (`execute_model`) the
      scheduler names the full blocks the step wrote, before a request that finished in the
      step lets go of them, so even a request that ends at its first token leaves its
      prompt's blocks in the cache.
    - `engine.trace`: S12's `StepRecord`, and the cache's view of the step: cache_hits (who
      was admitted with how many cached tokens out of how many), ref_cnts (the reference
      count of every block in each scheduled block table, when scheduled), cached_blocks
      (block id and hash prefix of every cached block after the step), free_queue (after
      the step, front first: the next block taken is evicted first), cache_stats. The
      events "hit", "evicted" and "cached" join S12's "allocated" and "freed".

What it does not handle yet
    See code/s13_prefix_caching.py. The batch-invariant mode refuses prefix caching (by
    default it runs without it).

Run it
    python code/s13_prefix_caching.py --shared-prefix 24 --num-prompts 4 --block-size 8
    python code/s13_engine.py --shared-prefix 24 --block-size 8 --no-prefix-caching  # cache off

Tests
    tests/test_s13_prefix_caching.py, tests/test_s13_properties.py.

References
    vLLM V1 (vllm/v1/core/kv_cache_manager.py `get_computed_blocks`, `allocate_slots`; the
    model runner reads cached blocks through the block table like any other).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Sequence

import torch

import s03_transformer as s03
import s06_torch as s06
import s09_continuous_batching as s09
import s10_engine as s10
import s12_engine as s12
from s13_prefix_caching import (PrefixCachingScheduler, PrefixCachingSchedulerOutput,
                                cached_block_map, check_cache_salt)


@dataclass(frozen=True)
class StepRecord(s12.StepRecord):
    """S12's record of one step, and: cache_hits, ((id, cached tokens, its tokens in all), ...)
    for the requests admitted or resumed in the step (misses: tokens in all - cached; an
    admission made in a step that failed is in no record's cache_hits, though its hit events
    come back with the next record and `stats` counts it);
    ref_cnts, per running id (aligned with `running`), the ref_cnt of each block of its block
    table when scheduled (a block shared by k requests shows k); cached_blocks, ((block id,
    hash prefix), ...) of every cached block after the step, by id; free_queue, the free
    block ids after the step, front first (allocation takes, and evicts, from the front);
    cache_stats, (requests, hit_requests, queries, hits) so far; enable_prefix_caching."""

    cache_hits: tuple[tuple[str, int, int], ...]
    ref_cnts: tuple[tuple[int, ...], ...]
    cached_blocks: tuple[tuple[int, str], ...]
    free_queue: tuple[int, ...]
    cache_stats: tuple[int, int, int, int]
    enable_prefix_caching: bool


class LLMEngine(s12.LLMEngine):
    """S12's engine with prefix caching (see the module docstring).

    Arguments as S12's, and enable_prefix_caching: True, False (S12's engine) or None, the
    default: on in the fast mode, off with batch_invariant=True (vLLM also leaves it None
    until the configuration decides). `add_request(prompt, params, request_id=None,
    priority=0, cache_salt=None)`: requests with different salts never share blocks (None:
    no salt). `generate` / `stream` add requests without a salt. Raises ValueError naming
    the rule: enable_prefix_caching that is not None, True or False, or True with
    batch_invariant=True (that mode computes each request alone, a chunked prompt again
    whole, so it cannot reuse another request's KV), or a salt that is not None or a
    non-empty UTF-8-encodable string.
    """

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_num_seqs: int = s09.DEFAULT_MAX_NUM_SEQS, batch_invariant: bool = False,
                 attention: str = "masked", logprobs_mode: str = "raw_logprobs",
                 sync_timing: bool = False, pad_id: int | None = None, *,
                 max_num_batched_tokens: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0,
                 block_size: int = s12.DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                 enable_prefix_caching: bool | None = None):
        if enable_prefix_caching is None:
            enable_prefix_caching = not batch_invariant
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be None, True or False (got "
                             f"{enable_prefix_caching!r})")
        if enable_prefix_caching and batch_invariant:
            raise ValueError("enable_prefix_caching needs the fast mode: batch_invariant=True "
                             "computes every request alone, so it cannot reuse KV another "
                             "request computed (turn one of them off)")
        self._enable = enable_prefix_caching               # read by make_scheduler
        self._salt: str | None = None        # of the request add_request is queueing
        self._ref_cnts: dict[str, tuple[int, ...]] = {}
        super().__init__(model, tokenizer, max_context, max_num_seqs, batch_invariant,
                         attention, logprobs_mode, sync_timing, pad_id,
                         max_num_batched_tokens=max_num_batched_tokens, policy=policy,
                         long_prefill_token_threshold=long_prefill_token_threshold,
                         block_size=block_size, num_blocks=num_blocks)

    def make_scheduler(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                       max_model_len: int, policy: str) -> PrefixCachingScheduler:
        return PrefixCachingScheduler(max_num_seqs, max_num_batched_tokens,
                                      self.runner.cache.num_blocks, self._block_size,
                                      max_model_len, policy, self._threshold, self._enable)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.scheduler.enable_prefix_caching

    @property
    def stats(self):
        """The scheduler's `PrefixCacheStats` (hits and queries in tokens and requests)."""
        return self.scheduler.stats

    def add_request(self, prompt: str, params=None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """S12's `add_request`, and cache_salt (None or a non-empty string; ValueError
        otherwise, before anything is queued)."""
        check_cache_salt(cache_salt)
        self._salt = cache_salt
        try:
            return super().add_request(prompt, params, request_id, priority)
        finally:
            self._salt = None

    def _enqueue(self, seq) -> None:
        seq.cache_salt = self._salt
        super()._enqueue(seq)

    def schedule(self) -> list[str]:
        """S12's, and the ref counts of the scheduled tables as planned (for the trace)."""
        joined = super().schedule()
        blocks = self.scheduler.kv.pool.blocks
        self._ref_cnts = {rid: tuple(blocks[b].ref_cnt for b in table)
                          for rid, table in self.scheduler_output.block_tables.items()}
        return joined

    def execute_model(self, batch: s09.RaggedBatch) -> torch.Tensor:
        """The model step; then the blocks it filled are named (their KV is written now),
        before postprocess lets finished requests' blocks go."""
        logits = super().execute_model(batch)
        self.scheduler.cache_computed(self.scheduler_output)
        return logits

    def _record(self, base: s09.StepRecord | None, out: PrefixCachingSchedulerOutput
                ) -> StepRecord:
        record = super()._record(base, out)
        values = {f.name: getattr(record, f.name) for f in fields(s12.StepRecord)}
        pool, stats = self.scheduler.kv.pool, out.stats
        values.update(
            cache_hits=tuple((rid, n, out.request_num_tokens[rid])
                             for rid, n in out.num_cached_tokens.items()),
            ref_cnts=tuple(self._ref_cnts.get(rid, ()) for rid in record.running),
            cached_blocks=tuple(cached_block_map(pool).items()),
            free_queue=tuple(pool.free_block_queue.block_ids()),
            cache_stats=(stats.requests, stats.hit_requests, stats.queries, stats.hits),
            enable_prefix_caching=out.enable_prefix_caching)
        return StepRecord(**values)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_cache_table(trace: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The trace as the prefix cache sees it, one line per step: step, tokens computed,
    the requests admitted with their cached / total tokens ("B 32/41" skipped 32 of 41), each
    scheduled block table with its shared blocks marked by their ref_cnt ("B:[1x2,2x2,7]" is
    blocks 1 and 2 held by two requests), the blocks cached, evicted and freed in the step,
    and cached blocks / free blocks after it. A trace longer than max_rows shows its first
    and last max_rows // 2 steps. Raises ValueError for max_rows < 2."""
    if not isinstance(max_rows, int) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2 (got {max_rows!r}): the table "
                         "shows the first and the last steps")
    trace = list(trace)
    half = max_rows // 2
    shown = trace if len(trace) <= max_rows else [*trace[:half], None, *trace[-half:]]
    lines = [f"{'step':>5} {'tokens':>6}  hits (cached/all) | tables (block x ref_cnt) | "
             "events | cached, free blocks"]
    for r in shown:
        if r is None:
            lines.append(f"{'…':>5} {len(trace) - 2 * half} steps not shown")
            continue
        hits = " ".join(f"{rid} {n}/{total}" for rid, n, total in r.cache_hits) or "-"
        at = {rid: k for k, rid in enumerate(r.running)}
        tables = " ".join(
            f"{rid}:[" + ",".join(f"{b}x{c}" if c > 1 else str(b) for b, c in zip(
                r.block_tables[at[rid]], r.ref_cnts[at[rid]])) + "]"
            for rid in r.schedule_order) or "-"
        events = " ".join(f"{kind}:{rid}:{','.join(map(str, ids))}"
                          for kind, rid, ids in r.block_events
                          if kind in ("cached", "evicted", "freed")) or "-"
        lines.append(f"{r.step:>5} {r.num_tokens:>6}  {hits} | {tables} | {events} | "
                     f"{len(r.cached_blocks)}, {len(r.free_queue)}/{r.num_blocks - 1}")
    return "\n".join(line.rstrip() for line in lines)


def shared_prefix_prompts(tokenizer, prompts: Sequence[str], shared_tokens: int
                          ) -> list[str]:
    """The first prompt, then each other prompt behind its first shared_tokens tokens,
    decoded (a system prompt every request starts with; the tokenizer may merge its last
    token with the next prompt's first, so a request may share a token fewer). Raises
    ValueError for a negative count or one longer than the first prompt."""
    if shared_tokens < 0:
        raise ValueError(f"--shared-prefix must be >= 0 (got {shared_tokens})")
    if shared_tokens == 0:
        return list(prompts)
    ids = tokenizer.encode(prompts[0])
    if shared_tokens > len(ids):
        raise ValueError(f"--shared-prefix {shared_tokens} is longer than the first prompt "
                         f"({len(ids)} tokens)")
    head = tokenizer.decode(ids[:shared_tokens])
    return [prompts[0]] + [head + p for p in prompts[1:]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 13: prefix caching, full KV blocks shared by hash and reference "
                    "count.")
    s12.add_paged_arguments(
        parser, "compute every request alone (it turns the prefix cache off: the cache needs "
                "the fast mode)",
        "KV blocks in the pool, block 0 (the null block) included; small values force "
        "evictions and preemptions (default: max-num-seqs x the context's blocks + 1)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of the first prompt put in front of every prompt, a "
                             "system prompt they share (default: %(default)s)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn the prefix cache off (S12's engine)")
    args = parser.parse_args(argv)
    params, budget = s12.check_paged_arguments(parser, args)
    if args.shared_prefix < 0:
        parser.error(f"--shared-prefix must be >= 0 (got {args.shared_prefix})")
    try:
        model, tokenizer, max_context, prompts, priorities = s10.load_workload(args)
        prompts = shared_prefix_prompts(tokenizer, prompts, args.shared_prefix)
        engine = LLMEngine(model, tokenizer, max_context, args.max_num_seqs,
                           args.batch_invariant, max_num_batched_tokens=budget,
                           policy=args.policy,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           block_size=args.block_size, num_blocks=args.num_blocks,
                           enable_prefix_caching=False if args.no_prefix_caching else None)
        run = s10.run_arrivals(engine, prompts, params, priorities, args.arrival_every)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device}; "
          f"{len(prompts)} requests, {s10.describe_arrivals(args.arrival_every)}, "
          f"at most {args.max_num_seqs} running, context {max_context}, "
          f"{engine.scheduler.max_num_batched_tokens} tokens per step; KV pool "
          f"{engine.num_blocks} blocks of {engine.block_size} tokens (block 0 null); prefix "
          f"cache {'on' if engine.enable_prefix_caching else 'off'}")
    hits: dict[str, list[int]] = {}           # cached tokens at admission, then at each resume
    for r in engine.trace:
        for rid, n, _ in r.cache_hits:
            hits.setdefault(rid, []).append(n)
    for rid, prompt in zip(run.ids, prompts):
        first, *resumed = hits.get(rid, [0])
        again = (f", then {', '.join(map(str, resumed))} at resume after preemption"
                 if resumed else "")
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens, "
              f"{first} found cached at admission{again}) ---\n{prompt}\n--- completion "
              f"(finish_reason={run.reasons[rid]}) ---\n{''.join(run.texts.get(rid, []))}")
    stats = engine.stats
    print(f"\n--- {run.made} tokens in {len(engine.trace)} steps, {run.wall_s:.2f} s, "
          f"{engine.scheduler.num_preemptions} preemptions; prefix cache: {stats.hits} of "
          f"{stats.queries} prompt tokens hit ({100 * stats.hit_rate:.1f}%), "
          f"{stats.hit_requests} of {stats.requests} admissions hit ---")
    print(format_cache_table(engine.trace))


if __name__ == "__main__":
    sys.exit(main())
