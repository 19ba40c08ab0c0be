"""S11, chunked prefill: a long prompt shares each step's token budget with the running decodes.

What is new since S10
    S10 runs a prompt whole in one step, so its token budget must hold the longest context,
    and one long prompt makes one long step: every running request waits for it before its
    next token (the stall the benchmark measures). Here a prompt is split into chunks over
    several steps (Sarathi-Serve's stall-free batching; vLLM V1 does it natively), and each
    step mixes the running requests' decodes with a chunk of prefill.

    - `ChunkedScheduler` (S10's `Scheduler` through one seam, `num_new_tokens(request,
      budget)`): a request scheduled with `budget` tokens left computes
      min(tokens it has not computed, budget, long_prefill_token_threshold if > 0) tokens
      (vLLM V1's rule). Everything else is S10's: running requests in admission order, then
      waiting ones in policy order while seats, budget and KV allow (a waiting request is
      admitted with a chunk of what is left: its whole prompt need not fit), KV allocated for
      each chunk as it is scheduled, preemption by recompute (a resumed request's recompute
      is chunked too), abort, the capacity rules. S10's rule max_num_batched_tokens >=
      max_model_len is lifted; the rule here is vLLM's max_num_batched_tokens >= max_num_seqs.
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
      `ChunkedSchedulerOutput.sample_ids` are the scheduled requests whose new tokens reach
      the end of their token_ids; the engine samples those rows only (S09's
      `rows_to_sample` seam); a chunk's row is computed and its logits left unread, so its
      seeded generator does not move.
    - The model needs no change: S09's ragged batch already carries a position per token and
      each request's first new position, and its attention gives a query block that starts at
      position p > 0 the keys 0 .. p + T - 1 of its slot (S06's `attention` with its start
      offset; a one-token chunk takes the decode path). A chunk's logits equal a one-shot
      prefill's within float32 rounding (max |difference| about 1e-6 on the tests' tiny
      models, far under S08's BATCH_TOLERANCE): a chunk is a different matmul shape, so not
      bitwise.
    - Batch-invariant mode keeps S10's promise (each request's outputs bitwise its outputs
      alone) by computing a chunked prompt again, whole, in one pass when its last chunk is
      scheduled (a chunked recompute replays as S10's does): the earlier chunks' KV is
      overwritten, and that step computes more than the budget. So it is the exact
      reference for the scheduling logic, not a model of chunked cost; the fast mode computes
      the real chunks and is held to S08's `follows_batch_rule` against it.
    - `engine.trace`: S10's `StepRecord` plus, per scheduled request, its kind ("prefill": a
      piece of a prompt or of a recompute, from the step it is admitted or resumed up to and
      including the step it samples, as the last chunk of a prompt does; "decode": a request
      that sampled in its last step computes that one token), where its tokens start, how
      many tokens it has in all, and which rows sampled.

What it does not handle yet
    KV is still counted in tokens over one slot per request (S12 pages it in blocks). No
    prefix sharing (S13). Chunk sizes are whatever the budget leaves; nothing aligns them to
    blocks or tunes them to the hardware (the benchmark measures the trade).

Run it
    python code/s11_chunked_prefill.py --max-num-batched-tokens 32 --num-prompts 4
    python code/s11_chunked_prefill.py --long-prefill-token-threshold 16
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

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Sequence

import s01_generation_loop as s01
import s03_transformer as s03
import s06_torch as s06
import s09_continuous_batching as s09
import s10_engine as s10
from s10_scheduler import Scheduler, SchedulerOutput

PREFILL, DECODE = "prefill", "decode"


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkedSchedulerOutput(SchedulerOutput):
    """S10's `SchedulerOutput`, and: sample_ids, the scheduled requests whose new tokens reach
    the end of their token_ids (their next token is sampled in this step; the others computed
    a chunk), in schedule order; prefill_ids, the scheduled requests computing a piece of a
    prompt or of a recompute: admitted or resumed and not yet sampled since, the piece that
    samples included (the others decode: one token, the output they sampled last);
    request_num_tokens, {id: len(token_ids) when scheduled}; long_prefill_token_threshold.
    scheduled_new_ids / scheduled_resumed_ids hold a request in the step of its first chunk;
    its later chunks are among scheduled_running_ids."""

    sample_ids: tuple[str, ...]
    prefill_ids: tuple[str, ...]
    request_num_tokens: dict[str, int]
    long_prefill_token_threshold: int


class ChunkedScheduler(Scheduler):
    """S10's scheduler with chunked prefill (see the module docstring for the rule).

    Arguments as S10's, and long_prefill_token_threshold: the most tokens one request
    computes in a step (0: no limit but the budget; vLLM's name and convention).
    max_num_batched_tokens may be below max_model_len but not below max_num_seqs. Raises
    ValueError naming the rule, before anything is built.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                 max_model_len: int, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0):
        if not s01.is_int(long_prefill_token_threshold) or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, 0 for no "
                             f"limit (got {long_prefill_token_threshold!r})")
        self.long_prefill_token_threshold = int(long_prefill_token_threshold)
        self._catching_up: set[str] = set()   # admitted or resumed, not sampled since
        super().__init__(max_num_seqs, max_num_batched_tokens, kv_capacity, max_model_len,
                         policy)

    def check_token_budget(self, max_num_batched_tokens: int, max_model_len: int,
                           max_num_seqs: int) -> None:
        """Prompts are chunked, so any budget holds them; a step must hold one decode for
        every seat (vLLM's rule)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): a step must hold one decode "
                             "token for every running request")

    def num_new_tokens(self, request, budget: int) -> int:
        """min(what it has not computed, the budget left, the threshold if set): vLLM V1's
        rule. 0 when no budget is left (the waiting loop stops there)."""
        n = min(len(request.token_ids) - request.num_computed_tokens, budget)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def schedule(self) -> ChunkedSchedulerOutput:
        """S10's plan, with the chunk sizes of `num_new_tokens`, which rows sample, and which
        are prefill pieces: a request is catching up from the step it is admitted or resumed
        until the step it samples, that step included."""
        out = super().schedule()
        by_id = {r.request_id: r for r in self.running}
        self._catching_up = {rid for rid in self._catching_up if rid in by_id}
        self._catching_up.update(out.scheduled_new_ids + out.scheduled_resumed_ids)
        lens, sample, prefill = {}, [], []
        for rid, n in out.num_scheduled_tokens.items():
            lens[rid] = len(by_id[rid].token_ids)
            if out.num_computed_tokens[rid] + n == lens[rid]:
                sample.append(rid)
            if rid in self._catching_up:
                prefill.append(rid)
        values = {f.name: getattr(out, f.name) for f in fields(SchedulerOutput)}
        return ChunkedSchedulerOutput(
            **values, sample_ids=tuple(sample), prefill_ids=tuple(prefill),
            request_num_tokens=lens,
            long_prefill_token_threshold=self.long_prefill_token_threshold)

    def update_from_output(self, scheduler_output, finished_ids=()) -> None:
        """S10's update; the requests that sampled in the step have caught up (so a failed
        step, `revert`, leaves them catching up, and their retry is a prefill piece again)."""
        self._catching_up.difference_update(scheduler_output.sample_ids)
        super().update_from_output(scheduler_output, finished_ids)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord(s10.StepRecord):
    """S10's record of one step, and per running id (aligned with `running`): kinds
    ("prefill": a piece of a prompt or of a recompute, the one that samples included;
    "decode": one token after a step that sampled), num_computed_tokens (where
    its new tokens start), request_num_tokens (its len(token_ids) when scheduled: a request
    samples when start + its scheduled tokens reach it); sampled (the ids that sampled a token
    in this step); long_prefill_token_threshold. prefill_tokens counts every prefill piece's
    tokens (S10 counted those of requests admitted in the step)."""

    kinds: tuple[str, ...]
    num_computed_tokens: tuple[int, ...]
    request_num_tokens: tuple[int, ...]
    sampled: tuple[str, ...]
    long_prefill_token_threshold: int


class LLMEngine(s10.LLMEngine):
    """S10's engine with `ChunkedScheduler` (see the module docstring).

    Arguments as S10's, and long_prefill_token_threshold (0: no limit). max_num_batched_tokens
    (default S10's, max_num_seqs * max_context: nothing is chunked) may be anything from
    max_num_seqs up. Raises ValueError naming the rule, before anything is queued.
    """

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_num_seqs: int = s09.DEFAULT_MAX_NUM_SEQS, batch_invariant: bool = False,
                 attention: str = "masked", logprobs_mode: str = "raw_logprobs",
                 sync_timing: bool = False, pad_id: int | None = None, *,
                 max_num_batched_tokens: int | None = None, kv_capacity: int | None = None,
                 policy: str = "fcfs", long_prefill_token_threshold: int = 0):
        self._threshold = long_prefill_token_threshold     # read by make_scheduler
        self._chunked: set[str] = set()    # ids whose prefill began in an earlier step
        super().__init__(model, tokenizer, max_context, max_num_seqs, batch_invariant,
                         attention, logprobs_mode, sync_timing, pad_id,
                         max_num_batched_tokens=max_num_batched_tokens,
                         kv_capacity=kv_capacity, policy=policy)

    def make_scheduler(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                       max_model_len: int, policy: str) -> ChunkedScheduler:
        return ChunkedScheduler(max_num_seqs, max_num_batched_tokens, kv_capacity,
                                max_model_len, policy, self._threshold)

    @property
    def long_prefill_token_threshold(self) -> int:
        return self.scheduler.long_prefill_token_threshold

    def rows_to_sample(self, rows: list[s01.Sequence]) -> list[bool]:
        """Only the rows whose new tokens reach the end of their context sample."""
        sample = set(self.scheduler_output.sample_ids)
        return [seq.request_id in sample for seq in rows]

    def make_batch(self, rows: list[s01.Sequence]) -> s09.RaggedBatch:
        """Each row's scheduled tokens, token_ids[start:start + n]. In batch-invariant mode a
        row whose prefill was chunked and ends in this step is computed again as its first
        run would have been (the whole prompt in one pass; a recompute replayed as S10's),
        so its logits are bitwise those of the request alone."""
        out = self.scheduler_output
        for seq in rows:
            rid = seq.request_id
            if rid not in out.sample_ids:
                self._chunked.add(rid)
                continue
            if self.batch_invariant and (rid in self._chunked or (
                    seq.num_computed_tokens == 0 and seq.output_ids)):
                seq.num_computed_tokens = 0          # start again from position 0
                if seq.output_ids:
                    self._replay(seq)                # prompt, then one output per pass
            self._chunked.discard(rid)
        ends = [out.num_computed_tokens[s.request_id] + out.num_scheduled_tokens[s.request_id]
                for s in rows]
        return s09.RaggedBatch.build(
            [seq.token_ids[seq.num_computed_tokens:end] for seq, end in zip(rows, ends)],
            [seq.num_computed_tokens for seq in rows], [seq.slot for seq in rows],
            self.model.device)

    def _release(self, seq: s01.Sequence) -> None:
        self._chunked.discard(seq.request_id)
        super()._release(seq)

    def schedule(self) -> list[str]:
        joined = super().schedule()
        for rid in self.scheduler_output.preempted_ids:   # its next run starts again
            self._chunked.discard(rid)
        return joined

    def _record(self, base: s09.StepRecord | None, out: ChunkedSchedulerOutput) -> StepRecord:
        record = super()._record(base, out)
        values = {f.name: getattr(record, f.name) for f in fields(s10.StepRecord)}
        prefill = set(out.prefill_ids)
        values.update(
            prefill_tokens=sum(out.num_scheduled_tokens[rid] for rid in out.prefill_ids),
            kinds=tuple(PREFILL if rid in prefill else DECODE for rid in record.running),
            num_computed_tokens=tuple(out.num_computed_tokens[rid] for rid in record.running),
            request_num_tokens=tuple(out.request_num_tokens[rid] for rid in record.running),
            sampled=tuple(rid for rid in record.running if rid in out.sample_ids),
            long_prefill_token_threshold=out.long_prefill_token_threshold)
        return StepRecord(**values)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_chunk_table(trace: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The trace as aligned text, one line per step: step, tokens / budget, then each
    scheduled request in the scheduler's order as id:tokens, a prefill piece marked "p" with
    how far it got ("L:32p 64/200" is 32 prompt tokens reaching 64 of 200), a "*" on the rows
    that sampled. A trace longer than max_rows shows its first and last max_rows // 2 steps.
    Raises ValueError for max_rows that is not an integer >= 2."""
    if not s01.is_int(max_rows) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2 (got {max_rows!r}): the table "
                         "shows the first and the last steps")
    trace = list(trace)
    half = max_rows // 2
    shown = trace if len(trace) <= max_rows else [*trace[:half], None, *trace[-half:]]
    lines = [f"{'step':>5} {'tokens':>9}  scheduled (id:tokens, p = prefill reaching k/of, "
             f"* = sampled)"]
    for r in shown:
        if r is None:
            lines.append(f"{'…':>5} {len(trace) - 2 * half} steps not shown")
            continue
        at = {rid: k for k, rid in enumerate(r.running)}
        cells = []
        for rid in r.schedule_order:
            k = at[rid]
            n, start, total = r.num_scheduled_tokens[k], r.num_computed_tokens[k], \
                r.request_num_tokens[k]
            cell = f"{rid}:{n}" + (f"p {start + n}/{total}" if r.kinds[k] == PREFILL else "")
            cells.append(cell + ("*" if rid in r.sampled else ""))
        lines.append(f"{r.step:>5} {f'{r.num_tokens}/{r.token_budget}':>9}  "
                     + "  ".join(cells))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 11: chunked prefill, prompt chunks and decodes share each step's "
                    "token budget.")
    s10.add_scheduler_arguments(
        parser, "most tokens per step, from max-num-seqs up; a longer prompt is chunked "
                "(default: max(16, max-num-seqs))",
        "compute every request alone, a chunked prompt again whole at its last chunk: slow, "
        "bitwise equal to each request run alone")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="most tokens one request computes in a step, 0 = only the "
                             "budget limits it (default: %(default)s)")
    args = parser.parse_args(argv)
    params = s10.check_scheduler_arguments(parser, args)
    budget = (max(16, args.max_num_seqs) if args.max_num_batched_tokens is None
              else args.max_num_batched_tokens)
    try:
        model, tokenizer, max_context, prompts, priorities = s10.load_workload(args)
        engine = LLMEngine(model, tokenizer, max_context, args.max_num_seqs,
                           args.batch_invariant,
                           max_num_batched_tokens=budget,
                           kv_capacity=args.kv_capacity, policy=args.policy,
                           long_prefill_token_threshold=args.long_prefill_token_threshold)
        run = s10.run_arrivals(engine, prompts, params, priorities, args.arrival_every)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    threshold = engine.long_prefill_token_threshold
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device}; "
          f"{len(prompts)} requests, {s10.describe_arrivals(args.arrival_every)}, "
          f"at most {args.max_num_seqs} running, context {max_context}, "
          f"{engine.scheduler.max_num_batched_tokens} tokens per step, "
          f"{f'at most {threshold} per request' if threshold else 'no per-request limit'}, "
          f"KV capacity {engine.kv_capacity} tokens, policy {args.policy}")
    joined = {rid: r.step for r in engine.trace for rid in r.joined}
    first = run.first_token_step
    for rid, prompt in zip(run.ids, prompts):
        when = (f"first token in step {first[rid]} (joined in step {joined[rid]})"
                if rid in first else "no token")
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens), "
              f"{when} ---\n{prompt}\n--- completion (finish_reason={run.reasons[rid]}) ---\n"
              f"{''.join(run.texts.get(rid, []))}")
    print(f"\n--- {run.made} tokens in {len(engine.trace)} steps, {run.wall_s:.2f} s, "
          f"{engine.scheduler.num_preemptions} preemptions ---")
    print(format_chunk_table(engine.trace))


if __name__ == "__main__":
    sys.exit(main())
