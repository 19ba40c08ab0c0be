"""S11, chunked prefill: a long prompt shares each step's token budget with the running decodes.

What is new since S10
    S10 runs a prompt whole in one step, so its token budget must hold the longest context,
    and one long prompt makes one long step: every running request waits for it before its
    next token (the stall the benchmark measures). Here a prompt is split into chunks over
    several steps (Sarathi-Serve's stall-free batching; vLLM V1 does it natively), and each
    step mixes the running requests' decodes with a chunk of prefill.

    - `ChunkedScheduler` (S10's `Scheduler` with one rule changed, `num_new_tokens`): a
      request scheduled with `budget` tokens left computes
      min(tokens it has not computed, budget, long_prefill_token_threshold if > 0) tokens
      (vLLM V1's rule). Everything else is S10's: running requests in admission order, then
      waiting ones in policy order while seats, budget and KV allow (a waiting request is
      admitted with a chunk of what is left: its whole prompt need not fit), KV allocated for
      each chunk as it is scheduled, preemption by recompute (a resumed request's recompute
      is chunked too), abort, the capacity rules. S10's rule max_num_batched_tokens >=
      max_model_len is lifted (`ChunkedSchedulerConfig`); the rule here is vLLM's
      max_num_batched_tokens >= max_num_seqs.
    - Neither side starves. Every running request is scheduled in every step (unless it is
      preempted): it was admitted with budget to spare, and the requests ahead of it never
      take more in a later step than they did then (a decode takes 1 token; a chunk cut by
      the threshold takes at most the threshold again; a chunk that ends a prompt is followed
      by decodes; a chunk cut by the budget left nothing, so nobody was admitted behind it).
      So the decodes go on while a long prompt is chunked, and a long prompt, once admitted,
      gains at least one chunk per step however many short requests arrive (FCFS admits no
      one ahead of it). Without a threshold at most one request is part-way through its
      prefill, and it is the last scheduled.
    - Nothing is sampled for a request until its whole prompt (or recompute) is in the cache:
      S09's runner already computes logits only for the rows whose new tokens reach the end
      of their token_ids, and the engine samples only those; a chunk's row computes its KV
      and nothing more, so its seeded generator does not move.
    - The model needs no change: S09's ragged batch already carries a position per token and
      each request's first new position, and its attention gives a query block that starts at
      position p > 0 the keys 0 .. p + T - 1 of its slot (S06's `attention` with its start
      offset; a one-token chunk takes the decode path). A chunk's logits equal a one-shot
      prefill's within float32 rounding, far under S08's BATCH_TOLERANCE: on the bundled
      model, a 183-token prompt's last logits measured bitwise equal at most chunk sizes and
      up to 4.3e-6 apart when the last chunk is a single token (the decode path, another
      matmul shape); the tests hold the tiny models to 1e-5.
    - Batch-invariant mode keeps S10's promise (each request's outputs bitwise its outputs
      alone) with no change either: S09's reference runner computes nothing for a chunk that
      does not sample and computes the whole prompt in one pass (a recompute: S06's passes)
      when the last chunk samples, so that step computes more than the budget. It is the
      exact reference for the scheduling logic, not a model of chunked cost; the fast mode
      computes the real chunks and is held to S08's `follows_batch_rule` against it.
    - The trace (S09's `StepTracer`) already shows, per scheduled request, its kind
      ("prefill": a piece of a prompt or of a recompute, from the step it is admitted or
      resumed up to and including the step it samples; "decode": one token after a step
      that sampled), where its tokens start, how many tokens it has in all, and which rows
      sampled: `format_chunk_table` prints it.

What it does not handle yet
    KV is still counted in tokens over one slot per request (S12 pages it in blocks). No
    prefix sharing (S13). Chunk sizes are whatever the budget leaves; nothing aligns them to
    blocks or tunes them to the hardware (the benchmark measures the trade).

Run it
    python code/s11_chunked_prefill.py --max-num-batched-tokens 32 --num-prompts 4
    python code/s11_chunked_prefill.py --max-num-batched-tokens 32 --long-prefill-token-threshold 8
    python benchmarks/bench_s11_chunked_prefill.py --quick   # ITL and TTFT against chunk size

Tests
    tests/test_s11_chunked_prefill.py: logits after a chunked prefill against a one-shot
    prefill at chunk sizes 1, P - 1, P, P + 1; greedy equal to S05 and HF alone on tiny random
    GPT-2, Qwen3, Llama and the bundled model; seeded and whole completions against S06 alone
    (bitwise in batch-invariant mode); decodes advance in every step while a long prompt is
    chunked; a long prompt keeps advancing under a steady stream of short requests; S09's
    "loop" attention and `stream` under chunking; the public bugs G1, G2 (chunked
    recompute), G4 (a stream closed mid-chunk), G5 (aborts mid-chunk). tests/test_s11_properties.py:
    hypothesis over budgets, chunk limits and arrivals.

References
    Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve"
    (OSDI 2024): chunked prefills, stall-free batching. vLLM V1 `Scheduler.schedule`
    (num_new_tokens capped by the token budget and `long_prefill_token_threshold`) and its
    `max_num_batched_tokens >= max_num_seqs` rule.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import sys
from dataclasses import dataclass
from typing import Sequence

import s01_generation_loop as s01
import s09_continuous_batching as s09
from s01_generation_loop import ParameterError
from s09_trace import PREFILL
from s10_scheduler import Scheduler, SchedulerConfig, TokenKVPool


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkedSchedulerConfig(SchedulerConfig):
    """S10's `SchedulerConfig`, and long_prefill_token_threshold: the most tokens one request
    computes in a step (0: no limit but the budget; vLLM's name and convention).
    max_num_batched_tokens may be below max_model_len but not below max_num_seqs; None means
    S10's default (max_num_seqs x max_model_len: nothing is chunked). Raises ParameterError
    naming the field."""

    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.long_prefill_token_threshold
        if not s01.is_int(value) or value < 0:
            raise ParameterError(f"long_prefill_token_threshold must be an integer >= 0, 0 for "
                                 f"no limit (got {value!r})", "long_prefill_token_threshold",
                                 value)

    def check_token_budget(self) -> None:
        """Prompts are chunked, so any budget holds them; a step must hold one decode for
        every seat (vLLM's rule)."""
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ParameterError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): a step must hold one decode token for "
                "every running request", "max_num_batched_tokens")


class ChunkedScheduler(Scheduler):
    """S10's scheduler with chunked prefill: one rule changed, `num_new_tokens` (see the
    module docstring). config: a `ChunkedSchedulerConfig`; kv: as S10's."""

    def num_new_tokens(self, request, num_computed_tokens: int, budget: int) -> int:
        """min(what it has not computed, the budget left, the threshold if set): vLLM V1's
        rule. 0 when no budget is left (the waiting loop stops there)."""
        n = min(request.num_tokens - num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold else n


def build_engine(model, tokenizer, *, max_num_batched_tokens: int | None = None,
                 kv_capacity: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, **options) -> s09.LLMEngine:
    """S10's engine with `ChunkedScheduler`: arguments as S10's `build_engine`, and
    long_prefill_token_threshold (0: no limit); max_num_batched_tokens (default S10's,
    max_num_seqs x max_context: nothing is chunked) may be anything from max_num_seqs up.
    Raises ParameterError naming the option."""
    config = s09.EngineConfig.of(model, options)
    processor = s09.make_processor(model, tokenizer, config)
    scheduler_config = ChunkedSchedulerConfig(config.max_num_seqs, config.max_context,
                                              max_num_batched_tokens, policy,
                                              long_prefill_token_threshold)
    kv = TokenKVPool(config.max_num_seqs, config.max_context, kv_capacity)
    runner = s09.slot_runner(model, config)     # the slots' memory is checked there
    return s09.LLMEngine(config, processor, ChunkedScheduler(scheduler_config, kv), runner)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_chunk_table(records: Sequence, max_rows: int = 40) -> str:
    """S09's trace records as aligned text, one line per step: step, tokens / budget, then
    each scheduled request in the scheduler's order as id:tokens, a prefill piece marked "p"
    with how far it got ("L:32p 64/200" is 32 prompt tokens reaching 64 of 200), a "*" on
    the rows that sampled. A trace longer than max_rows shows its first and last
    max_rows // 2 steps. Raises ValueError for max_rows that is not an integer >= 2."""
    from s08_cli import render_table

    def render(r) -> str:
        cells = []
        for rid, n, start, total, kind in zip(r.running, r.num_scheduled_tokens,
                                              r.num_computed_tokens, r.request_num_tokens,
                                              r.kinds):
            cell = f"{rid}:{n}" + (f"p {start + n}/{total}" if kind == PREFILL else "")
            cells.append(cell + ("*" if rid in r.sampled else ""))
        return f"{r.step:>5} {f'{r.num_tokens}/{r.token_budget}':>9}  " + "  ".join(cells)

    return render_table(f"{'step':>5} {'tokens':>9}  scheduled (id:tokens, p = prefill "
                        f"reaching k/of, * = sampled)", records, render, max_rows)


def add_chunk_arguments(parser, kv_capacity: bool = True) -> None:
    """S10's scheduler flags, the budget's default now chunking, and the per-request limit
    (S11's to S13's scripts; kv_capacity=False for the paged engines)."""
    import s10_scheduler as s10
    s10.add_scheduler_arguments(
        parser, kv_capacity, "most tokens per step, from max-num-seqs up; a longer prompt is "
                             "chunked (default: max(16, max-num-seqs))")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="most tokens one request computes in a step, 0 = only the "
                             "budget limits it (default: %(default)s)")


def chunk_options(args) -> dict:
    """`build_engine`'s scheduler arguments from S11's flags (the budget's default chunks)."""
    budget = (max(16, args.max_num_seqs) if args.max_num_batched_tokens is None
              else args.max_num_batched_tokens)
    return dict(max_num_batched_tokens=budget, policy=args.policy,
                long_prefill_token_threshold=args.long_prefill_token_threshold)


def first_token_note(rid: str, run, tracers) -> str:
    """The step a request joined and the step it sampled its first token, from the trace."""
    records = tracers[0].records
    joined = next((r.step for r in records if rid in r.joined), None)
    first = next((r.step for r in records if rid in r.sampled), None)
    return ("no token" if first is None else
            f"first token in step {first} (joined in step {joined})")


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    import s10_scheduler as s10

    def describe(engine, tracers) -> str:
        scheduler = engine.scheduler
        threshold = scheduler.config.long_prefill_token_threshold
        return (f"{scheduler.max_num_batched_tokens} tokens per step, "
                f"{f'at most {threshold} per request' if threshold else 'no per-request limit'}"
                f", KV capacity {scheduler.kv_capacity} tokens, policy {scheduler.policy}; "
                f"{scheduler.num_preemptions} preemptions")

    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 11: chunked prefill, prompt chunks and decodes share each step's token "
        "budget.", build_engine, add_arguments=add_chunk_arguments,
        check=s10.check_scheduler_arguments,
        options=lambda args: dict(chunk_options(args), kv_capacity=args.kv_capacity),
        tracers=lambda engine: [s09_trace.StepTracer()], describe=describe,
        note=first_token_note,
        table=lambda run, tracers: format_chunk_table(tracers[0].records)), argv)


if __name__ == "__main__":
    sys.exit(main())
