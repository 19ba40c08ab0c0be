"""S10, the engine driven by the scheduler: S09's `LLMEngine` with token budgets and preemption.

What is new since S09
    S09's engine decided admission itself (FIFO into free slots). This one asks
    code/s10_scheduler.py's `Scheduler` every step: `schedule()` says which requests run and
    how many tokens each; the engine gives slots to those admitted, takes them from those
    preempted, runs S09's ragged step over the scheduled requests (in slot order), and
    reports back (`update_from_output`). Everything else is S09's: the ragged batch, the
    runner, Part I's sampler, detokenizer and stop rules, `add_request` / `step` / `abort` /
    `has_unfinished_requests`, `generate` / `stream`.

    - New constructor arguments: `max_num_batched_tokens` (default max_num_seqs *
      max_context: S09's step, unbounded), `kv_capacity` in tokens (default max_num_seqs *
      max_context: what S09's slots hold, so nothing is preempted unless asked) and `policy`
      ("fcfs" or "priority"); `add_request(..., priority=0)`. Only `add_request` takes a
      priority: S09's `generate` and `stream` are unchanged, so every request they add has
      priority 0, and under "priority" they run in arrival order, as under "fcfs".
    - KV storage stays S09's, one slot of max_context positions per running request; the
      token capacity is accounting on top of it (a tight kv_capacity makes the scheduler
      preempt as a real pool of that size would). S12 makes it real with blocks.
    - Preemption by recompute: a preempted request loses its slot and its KV; when it runs
      again its whole context (prompt + outputs) is computed in one step and its next token
      sampled from the last row, by its own seeded generator, penalty counts and detokenizer,
      which simply continue: its output is the one it would have had. In batch-invariant mode
      the recompute replays the request's first run (the prompt in one pass, then one token
      per pass), so its logits stay bitwise those of the request alone; the fast mode
      recomputes in one pass, as vLLM does, and is held to S08's `follows_batch_rule`.
    - A prompt needing more KV than kv_capacity is refused by `add_request` (ValueError,
      vLLM PR #1534); a request whose next step would need more KV than kv_capacity ends
      with finish_reason "length" (its last output, without a token, comes with the next
      `step`, as an abort's does).
    - `engine.trace`: S09's `StepRecord` extended (`StepRecord` here) with each request's
      scheduled tokens, the scheduler's order of them (admission order: under FCFS the
      victim of a preemption is the last), who resumed, who was preempted, who the capacity
      ended, the token budget and the KV tokens used and free; `seq.num_preemptions` per
      request, `engine.scheduler.num_preemptions` in all.

What it does not handle yet
    See code/s10_scheduler.py: no chunked prefill (S11), no blocks (S12). A recompute costs a
    whole prefill; vLLM V0 could also swap KV to host memory instead, which V1 dropped.

Run it
    python code/s10_scheduler.py --kv-capacity 96 --max-num-seqs 4  # preemptions, traced
    python code/s10_engine.py --policy priority --kv-capacity 120 --priorities 1,0,1,0,1,0,1,0
    python code/s10_engine.py --max-context 64 --max-num-batched-tokens 64 --kv-capacity 128 \
        --arrival-every 0 --seed 4 --max-tokens 24          # the token budget decides who joins
    python benchmarks/bench_s10_scheduler.py --quick

Tests
    tests/test_s10_engine.py: every request's output (greedy and seeded) the same with forced
    preemption and without, exactly in batch-invariant mode, the fast mode within S08's rule;
    greedy equal to S05 and HF alone; preemptions really happen; bounded steps under a steady
    stream of arrivals; aborts of waiting, running and preempted requests; the public bugs
    G1, G2, G4, G5. tests/test_parity.py runs this engine in the parity chain.

References
    vLLM V1's `EngineCore.step` (schedule, execute the model, `update_from_output`) and its
    recompute preemption; nano-vllm's `LLMEngine.step` and `Scheduler.preempt`.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import argparse
import sys
import time
from dataclasses import dataclass, fields
from typing import Sequence

import s01_generation_loop as s01
import s03_transformer as s03
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
from s10_scheduler import FINISHED, POLICIES, Scheduler, SchedulerOutput


@dataclass(frozen=True)
class StepRecord(s09.StepRecord):
    """S09's record of one step, and the scheduler's side of it. S09's fields: running (the
    scheduled ids, in batch order), slots, joined (admitted for the first time), left
    (finished, aborted or ended by the capacity), num_tokens (scheduled tokens in all),
    prefill_tokens (those of joined and resumed requests), waiting, free_slots, model_s,
    step_s. New: num_scheduled_tokens (per running id), schedule_order (the same ids in the
    scheduler's order: those already running in admission order, then those admitted in
    this step; when KV runs out, FCFS preempts from the end), resumed (admitted again after a
    preemption, computing prompt + outputs), preempted (in this step), ended (by the KV
    capacity: finish_reason "length"), token_budget (max_num_batched_tokens),
    kv_used_tokens / kv_free_tokens (after scheduling), kv_capacity. A step that ran no model
    but preempted or ended someone has a record with running == (). step is also the
    scheduler's number of the step (`SchedulerOutput.step`)."""

    num_scheduled_tokens: tuple[int, ...]
    schedule_order: tuple[str, ...]
    resumed: tuple[str, ...]
    preempted: tuple[str, ...]
    ended: tuple[str, ...]
    token_budget: int
    kv_used_tokens: int
    kv_free_tokens: int
    kv_capacity: int


class LLMEngine(s09.LLMEngine):
    """S09's engine, with `Scheduler` deciding every step (see the module docstring).

    Arguments as S09's, and: max_num_batched_tokens (tokens per step, >= max_context),
    kv_capacity (KV token positions in all, 1 to max_num_seqs * max_context), policy ("fcfs"
    or "priority"). `add_request(prompt, params, request_id=None, priority=0)`: lower
    priority values run first under "priority" (ignored under "fcfs"); `generate` and
    `stream` take no priority (S09's API): their requests all have priority 0. `waiting` and
    `running` are the scheduler's queues; `scheduler_output` the last `SchedulerOutput`.
    Raises ValueError naming the rule, before anything is queued, for a bad argument or a
    prompt that needs more KV than kv_capacity.
    """

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_num_seqs: int = s09.DEFAULT_MAX_NUM_SEQS, batch_invariant: bool = False,
                 attention: str = "masked", logprobs_mode: str = "raw_logprobs",
                 sync_timing: bool = False, pad_id: int | None = None, *,
                 max_num_batched_tokens: int | None = None, kv_capacity: int | None = None,
                 policy: str = "fcfs"):
        super().__init__(model, tokenizer, max_context, max_num_seqs, batch_invariant,
                         attention, logprobs_mode, sync_timing, pad_id)
        slots = self.max_num_seqs * self.max_context
        kv_capacity = slots if kv_capacity is None else kv_capacity
        if s01.is_int(kv_capacity) and kv_capacity > slots:
            raise ValueError(f"kv_capacity ({kv_capacity}) must be <= max_num_seqs * "
                             f"max_context ({slots}): the KV slots hold no more")
        self.scheduler = self.make_scheduler(self.max_num_seqs,
                                             slots if max_num_batched_tokens is None
                                             else max_num_batched_tokens,
                                             kv_capacity, self.max_context, policy)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running
        self.scheduler_output: SchedulerOutput | None = None
        self._priority = 0                  # of the request add_request is queueing

    def make_scheduler(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                       max_model_len: int, policy: str) -> Scheduler:
        """The scheduler this engine asks every step (the seam S11 overrides)."""
        return Scheduler(max_num_seqs, max_num_batched_tokens, kv_capacity, max_model_len,
                         policy)

    @property
    def kv_capacity(self) -> int:
        return self.scheduler.kv_capacity

    @property
    def kv_free_tokens(self) -> int:
        return self.scheduler.kv.num_free_tokens

    def check_prompt(self, prompt: str) -> list[int]:
        """S09's rules, and: a prompt that runs (shorter than max_context) needs KV for all
        its tokens, so it may not be longer than kv_capacity (vLLM PR #1534: such a request
        waits at the head of the queue forever, and everyone behind it)."""
        prompt_ids = super().check_prompt(prompt)
        if self.kv_capacity < len(prompt_ids) < self.max_context:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens but kv_capacity is "
                             f"{self.kv_capacity} tokens: it could never be scheduled")
        return prompt_ids

    def add_request(self, prompt: str, params=None, request_id: str | None = None,
                    priority: int = 0) -> str:
        """S09's `add_request`, and priority: an integer, lower first under "priority".
        Raises ValueError, before anything is queued, for a priority that is not an int."""
        if not s01.is_int(priority):
            raise ValueError(f"priority must be an integer (lower runs first) (got "
                             f"{priority!r})")
        self._priority = int(priority)
        try:
            return super().add_request(prompt, params, request_id)
        finally:
            self._priority = 0

    # --- S09's seams, driven by the scheduler --------------------------------------------

    def _enqueue(self, seq: s01.Sequence) -> None:
        if seq.finished:                  # finished on arrival: S09's last output, no queue
            super()._enqueue(seq)
            return
        seq.slot = None
        self.scheduler.add_request(seq, self._priority)
        self.requests[seq.request_id] = seq

    def _release(self, seq: s01.Sequence) -> None:
        """A request leaves (finished or aborted): its slot, if it has one, and its KV."""
        if seq.slot is not None:
            self.runner.cache.free(seq.slot)
            seq.slot = None
        self.scheduler.finish_requests([seq.request_id])

    def _drop_waiting(self, seq: s01.Sequence) -> None:
        """A waiting request aborted: the scheduler takes it out (`finish_requests`), so its
        subclasses drop what they keep for it (S13's block hashes)."""
        self.scheduler.finish_requests([seq.request_id])

    def schedule(self) -> list[str]:
        """Ask the scheduler; free the slots of the preempted and of those the capacity
        ended, give slots to those admitted. Returns the ids admitted for the first time."""
        out = self.scheduler_output = self.scheduler.schedule()
        for rid in out.preempted_ids:
            seq = self.requests[rid]
            self.runner.cache.free(seq.slot)
            seq.slot = None
        for rid in out.finished_ids:
            self._end_by_capacity(self.requests[rid])
        for rid in out.scheduled_new_ids + out.scheduled_resumed_ids:
            self.requests[rid].slot = self.runner.cache.allocate()
        if not out.num_scheduled_tokens and (out.preempted_ids or out.finished_ids):
            self.trace.append(self._record(None, out))     # no model step: still traced
            self._aborted = []
        return list(out.scheduled_new_ids)

    def _end_by_capacity(self, seq: s01.Sequence) -> None:
        """Part I's "length" end (its held-back text released, as `finish_if_stopped`
        does), for a request whose next step needs more KV than the whole capacity."""
        if seq.slot is not None:
            self.runner.cache.free(seq.slot)
            seq.slot = None
        seq.finish_reason, seq.stop_reason = s01.FINISH_LENGTH, None
        tail = self.end_text(seq)
        if seq.matched_stop_string is not None:   # the held-back text completed a stop string
            seq.finish_reason, seq.stop_reason = s01.FINISH_STOP, seq.matched_stop_string
        seq.text.append(tail)
        seq.status = FINISHED
        self.requests.pop(seq.request_id)
        self._final.append(s01.RequestOutput(seq.request_id, [], tail, True,
                                             seq.finish_reason, seq.stop_reason))

    def make_batch(self, rows: list[s01.Sequence]) -> s09.RaggedBatch:
        """S09's batch. In batch-invariant mode a resumed request first replays its history
        as its first run computed it (`_replay`), so only its last token is in the batch."""
        if self.batch_invariant:
            for seq in rows:
                if seq.num_computed_tokens == 0 and seq.output_ids:
                    self._replay(seq)
        return super().make_batch(rows)

    def _replay(self, seq: s01.Sequence) -> None:
        """Recompute a resumed request's KV with its first run's shapes: the prompt in one
        pass, then each output but the last in a pass of its own (the logits are dropped)."""
        start = 0
        for piece in [seq.prompt_ids] + [[t] for t in seq.output_ids[:-1]]:
            self.runner.forward(s09.RaggedBatch.build([piece], [start], [seq.slot],
                                                      self.model.device))
            start += len(piece)
        seq.num_computed_tokens = start

    def _forward_step(self, joined: list[str], rows=None) -> list[s01.RequestOutput]:
        """S09's step over the scheduled requests (in slot order), then the scheduler's
        update. If the step fails (a row S04 refuses), the scheduled tokens' KV goes back
        (`Scheduler.revert`)."""
        out = self.scheduler_output
        if not out.num_scheduled_tokens:   # running requests, none scheduled: no model step
            return []
        rows = sorted((self.requests[rid] for rid in out.num_scheduled_tokens),
                      key=lambda seq: seq.slot)
        try:
            outputs = super()._forward_step(joined, rows)
        except BaseException:     # KV back to what each request has computed, then S09's
            self.scheduler.revert(out)        # step keeps the last outputs for the next one
            raise
        self.scheduler.update_from_output(out)   # the finished left through _release
        self.trace[-1] = self._record(self.trace[-1], out)
        return outputs

    def _record(self, base: s09.StepRecord | None, out: SchedulerOutput) -> StepRecord:
        ended = tuple(out.finished_ids)
        if base is None:
            base = s09.StepRecord(self.trace.num_recorded, (), (), (), tuple(self._aborted), 0, 0,
                                  len(self.waiting), self.runner.cache.num_free, 0.0, 0.0)
        values = {f.name: getattr(base, f.name) for f in fields(s09.StepRecord)}
        values.update(
            left=ended + base.left, num_tokens=out.total_num_scheduled_tokens,
            prefill_tokens=sum(out.num_scheduled_tokens[rid] for rid in
                               out.scheduled_new_ids + out.scheduled_resumed_ids),
            num_scheduled_tokens=tuple(out.num_scheduled_tokens[rid] for rid in base.running),
            schedule_order=out.scheduled_ids,
            resumed=out.scheduled_resumed_ids, preempted=out.preempted_ids, ended=ended,
            token_budget=out.token_budget, kv_used_tokens=out.kv_used_tokens,
            kv_free_tokens=out.kv_free_tokens, kv_capacity=self.kv_capacity)
        return StepRecord(**values)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

# Columns of `format_schedule_table` that list ids: (header, StepRecord field, widest cell).
TABLE_ID_COLUMNS = (("running, admission order (tokens)", "schedule_order", 56),
                    ("joined", "joined", 24), ("resumed", "resumed", 24),
                    ("preempted", "preempted", 24), ("left", "left", 24))


def fit_ids(ids: Sequence[str], width: int) -> str:
    """ids comma-separated, or, when that is wider than width, their count and the first
    ones that fit, cut with "…": "12: 0,1,2,…" (never wider than a width >= 8)."""
    text = ",".join(ids)
    if len(text) <= width:
        return text
    head, shown = f"{len(ids)}: ", []
    for rid in ids:
        if len(head + ",".join([*shown, rid]) + ",…") > width:
            break
        shown.append(rid)
    return head + ",".join(shown) + (",…" if shown else "…")


def format_schedule_table(trace: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The trace as aligned text, one line per step: step, tokens / budget, the running ids in
    the scheduler's order (admission order, so FCFS's next victim is the last) with their
    scheduled tokens when more than 1, joined, resumed, preempted, left, waiting, KV used /
    capacity. Each column is as wide as its widest cell, up to a limit; a cell past it shows
    how many ids it holds and is cut with "…" (`fit_ids`). A trace longer than max_rows shows
    its first max_rows // 2 steps and its last ones, max_rows in all, and says how many it
    left out. Raises ValueError for max_rows that is not an integer >= 2."""
    if not s01.is_int(max_rows) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2 (got {max_rows!r}): the table "
                         "shows the first and the last steps")
    trace = list(trace)
    first = max_rows // 2
    shown = trace if len(trace) <= max_rows else trace[:first] + trace[first - max_rows:]
    rows = []
    for r in shown:
        tokens = dict(zip(r.running, r.num_scheduled_tokens))
        cells = {"schedule_order": [f"{rid}({tokens[rid]})" if tokens[rid] > 1 else rid
                                    for rid in r.schedule_order]}
        cells.update({name: list(getattr(r, name)) for _, name, _ in TABLE_ID_COLUMNS[1:]})
        rows.append((r, cells))
    widths = {name: min(limit, max([len(header)] + [len(",".join(c[name])) for _, c in rows]))
              for header, name, limit in TABLE_ID_COLUMNS}
    ids_header = " ".join(f"{header:<{widths[name]}}" for header, name, _ in TABLE_ID_COLUMNS)
    lines = [f"{'step':>5} {'tokens':>11} {ids_header} {'waiting':>7} {'KV used':>9}"]
    for k, (r, cells) in enumerate(rows):
        if k == first and len(trace) > max_rows:
            lines.append(f"{'…':>5} {len(trace) - max_rows} steps not shown")
        ids = " ".join(f"{fit_ids(cells[name], widths[name]):<{widths[name]}}"
                       for _, name, _ in TABLE_ID_COLUMNS)
        lines.append(f"{r.step:>5} {f'{r.num_tokens}/{r.token_budget}':>11} {ids} "
                     f"{r.waiting:>7} {f'{r.kv_used_tokens}/{r.kv_capacity}':>9}")
    return "\n".join(line.rstrip() for line in lines)


def priority_list(text: str) -> list[int]:
    """--priorities' type: "1,0,1" -> [1, 0, 1]; argparse's usage error otherwise."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--priorities needs comma-separated integers, one per request (got {text!r})"
        ) from None


def describe_arrivals(every: int) -> str:
    """The arrival schedule of `run_arrivals` in words, for the command lines' header."""
    return {0: "all at once", 1: "one before each step"}.get(every, f"one every {every} steps")


def _preempted(n: int) -> str:
    return {0: "not preempted", 1: "preempted once"}.get(n, f"preempted {n} times")


def add_scheduler_arguments(parser: argparse.ArgumentParser, budget_help: str,
                            invariant_help: str, token_capacity: bool = True) -> None:
    """S08's request flags and the scheduler's (arrivals, seats, context, token budget, KV
    capacity, policy, priorities, batch-invariant mode), shared by S10's to S13's scripts;
    budget_help / invariant_help: each chapter's own words for its budget and its exact mode.
    token_capacity=False (the paged engines, whose pool is counted in blocks): --kv-capacity
    is still parsed, so the script can refuse it with a pointer, but not listed in --help."""
    s08.add_request_arguments(parser)
    parser.add_argument("--arrival-every", type=int, default=1,
                        help="steps between two arrivals; 0 = all at once (default: "
                             "%(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="most requests running at once (KV slots) (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="positions per KV slot, the longest context a request may reach, "
                             "at most the model's window (default: that window, at most 4096)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help=budget_help)
    parser.add_argument("--kv-capacity", type=int, default=None,
                        help="KV token positions in all; small values force preemptions "
                             "(default: max-num-seqs x the context, none)"
                        if token_capacity else argparse.SUPPRESS)
    parser.add_argument("--policy", default="fcfs", choices=POLICIES,
                        help="scheduling policy (default: %(default)s)")
    parser.add_argument("--priorities", type=priority_list, default=None,
                        help="comma-separated integer priority of each request, lower first; "
                             "only with --policy priority (fcfs ignores priorities, so it "
                             "refuses them) (default: all 0)")
    parser.add_argument("--batch-invariant", action="store_true", help=invariant_help)


def check_scheduler_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """S08's checks, then the scheduler flags' (exit 2 naming the rule, before the model
    loads). Returns S08's SamplingParams."""
    params = s08.check_request_arguments(parser, args)
    if args.max_num_seqs < 1 or args.arrival_every < 0:
        parser.error("--max-num-seqs must be >= 1 and --arrival-every >= 0")
    if args.max_context is not None and args.max_context < 1:
        parser.error(f"--max-context must be >= 1 (got {args.max_context})")
    if args.priorities is not None and args.policy != "priority":
        parser.error("--priorities needs --policy priority (fcfs ignores priorities)")
    return params


def load_workload(args: argparse.Namespace):
    """The model, tokenizer, context, prompts and priorities the flags ask for: (model,
    tokenizer, max_context, prompts, priorities). Raises ValueError naming the rule."""
    model, tokenizer = s06.load(args.model, args.device, args.dtype)
    window = model.config.max_position_embeddings
    if args.max_context is not None and args.max_context > window:
        raise ValueError(f"--max-context must be at most the model's context window, "
                         f"max_position_embeddings = {window} (got {args.max_context})")
    max_context = min(window, 4096) if args.max_context is None else args.max_context
    prompts = args.prompt or s08.corpus_prompts(   # drawn as without --max-context
        tokenizer, args.num_prompts, args.seed, min(window, 4096))
    priorities = args.priorities or [0] * len(prompts)
    if len(priorities) != len(prompts):
        raise ValueError(f"--priorities needs one value per request ({len(prompts)})")
    return model, tokenizer, max_context, prompts, priorities


@dataclass
class ArrivalRun:
    """What `run_arrivals` saw: ids in arrival order; texts (deltas), finish reasons, the
    Sequences and first-token steps by id; tokens made; wall seconds."""

    ids: list[str]
    texts: dict[str, list[str]]
    reasons: dict[str, str]
    seqs: dict[str, s01.Sequence]
    first_token_step: dict[str, int]
    made: int
    wall_s: float


def run_arrivals(engine: LLMEngine, prompts: Sequence[str], params, priorities: Sequence[int],
                 arrival_every: int) -> ArrivalRun:
    """Add one prompt every arrival_every calls of `step` (0: all before the first step) and
    step until everything has finished. Every prompt is checked before the first step."""
    for prompt in prompts:
        engine.check_prompt(prompt)
    run = ArrivalRun([], {}, {}, {}, {}, 0, 0.0)
    calls, start = 0, time.perf_counter()
    while len(run.ids) < len(prompts) or engine.has_unfinished_requests():
        if len(run.ids) < len(prompts) and calls >= len(run.ids) * arrival_every:
            k = len(run.ids)
            rid = engine.add_request(prompts[k], params, priority=priorities[k])
            run.ids.append(rid)
            run.seqs[rid] = engine.requests.get(rid)
            continue
        calls += 1
        for out in engine.step():
            run.texts.setdefault(out.request_id, []).append(out.text_delta)
            run.made += len(out.new_token_ids)
            if out.new_token_ids:
                run.first_token_step.setdefault(out.request_id, len(engine.trace) - 1)
            if out.finished:
                run.reasons[out.request_id] = out.finish_reason
    run.wall_s = time.perf_counter() - start
    return run


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 10: the scheduler, token budgets, KV capacity and preemption.")
    add_scheduler_arguments(
        parser, "most tokens per step, >= the context (default: max-num-seqs x the context, "
                "no limit)",
        "compute every request alone: slow, bitwise equal to each request run alone")
    args = parser.parse_args(argv)
    params = check_scheduler_arguments(parser, args)
    try:
        model, tokenizer, max_context, prompts, priorities = load_workload(args)
        engine = LLMEngine(model, tokenizer, max_context, args.max_num_seqs,
                           args.batch_invariant, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_capacity=args.kv_capacity, policy=args.policy)
        run = run_arrivals(engine, prompts, params, priorities, args.arrival_every)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device}; "
          f"{len(prompts)} requests, {describe_arrivals(args.arrival_every)}, at most "
          f"{args.max_num_seqs} running, context {max_context}, "
          f"{engine.scheduler.max_num_batched_tokens} tokens per step, KV capacity "
          f"{engine.kv_capacity} tokens, policy {args.policy}")
    for rid, prompt in zip(run.ids, prompts):
        seq = run.seqs[rid]
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens), "
              f"{_preempted(getattr(seq, 'num_preemptions', 0))} ---\n{prompt}\n"
              f"--- completion (finish_reason={run.reasons[rid]}) ---\n"
              f"{''.join(run.texts.get(rid, []))}")
    print(f"\n--- {run.made} tokens in {len(engine.trace)} steps, {run.wall_s:.2f} s, "
          f"{engine.scheduler.num_preemptions} preemptions ---")
    print(format_schedule_table(engine.trace))


if __name__ == "__main__":
    sys.exit(main())
