"""S09's trace: what each step did, recorded by an observer outside the step.

What is here
    The engine tells its observers about every step (`on_plan` with the plan, before the
    model runs; `on_step` with the result, after). `StepTracer` is such an observer: it
    turns what it hears, and what the engine's public state shows at that moment (queues, KV
    usage), into one `StepRecord` per planned step. The chapters' tables, the notebooks'
    plots, the site's simulators and the benchmarks read these records; the engine never
    builds them, so an engine without observers pays nothing for them. Later chapters add
    observers of their own beside this one (S12's blocks, S13's prefix cache).

    A record covers the scheduler's side of the step for every scheduler of Part II: S09's
    FIFO admits and never preempts, so its records have no resumed, preempted or ended ids.

Tests
    tests/test_s09_continuous_batching.py (records against the steps), and every Part II
    chapter's tests of its table.

References
    vLLM's `SchedulerStats` and `IterationStats` (what a step reports to its stat loggers,
    vllm/v1/metrics/stats.py): measurement outside the step, fed by what the step returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class StepRecord:
    """One planned step (a plan that ran, preempted or ended someone).

    step: the scheduler's number of the step. running: the scheduled ids in schedule order
    (running requests first, in admission order, then those admitted in the step: when KV
    runs out, S10's FCFS preempts from the end); aligned with it: num_scheduled_tokens,
    num_computed_tokens (where each one's new tokens start), request_num_tokens (its
    len(token_ids) when scheduled: it samples when start + scheduled reaches it),
    block_tables (its KV blocks; S09-S11: its one slot) and kinds ("prefill": a piece of a
    prompt or of a recompute, from its admission up to and including the step it samples;
    "decode": one token after a step that sampled). sampled: the ids that sampled a token,
    in batch order. joined / resumed: admitted for the first time / again after a
    preemption. preempted / ended: preempted, or ended by the KV capacity ("length"), in the
    step. left: every id that finished in the step (ended included) or was aborted since
    the step before. num_tokens: tokens computed (prefill_tokens of them in prefill pieces).
    waiting: the queue after scheduling. kv_used_tokens / kv_free_tokens: the KV manager's
    after scheduling; kv_capacity: its token positions in all. token_budget: the
    scheduler's max_num_batched_tokens (None for S09's FIFO, which has none). model_s /
    step_s: wall seconds of the model call / of the whole step.
    """

    step: int
    running: tuple[str, ...]
    num_scheduled_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    request_num_tokens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    kinds: tuple[str, ...]
    sampled: tuple[str, ...]
    joined: tuple[str, ...]
    resumed: tuple[str, ...]
    preempted: tuple[str, ...]
    ended: tuple[str, ...]
    left: tuple[str, ...]
    num_tokens: int
    prefill_tokens: int
    waiting: int
    kv_used_tokens: int
    kv_free_tokens: int
    kv_capacity: int
    token_budget: int | None
    model_s: float
    step_s: float

    @property
    def slots(self) -> tuple[int, ...]:
        """Each running request's slot (the first entry of its block table)."""
        return tuple(table[0] for table in self.block_tables)


class StepTracer:
    """The observer that records a `StepRecord` per planned step into `records`.

    limit: None (every step kept, as the chapters' tables need) or how many of the latest to
    keep; `num_recorded` counts every record made. Attach it with `engine.observers.append`
    (`trace(engine)` does, and returns it). A step whose model run raises has no record and
    its number goes to the step after it; what its plan did to the queues, which the
    scheduler keeps (admissions, preemptions, ends), is listed in that next record.
    """

    def __init__(self, limit: int | None = None):
        self.records: list[StepRecord] = []
        self.limit, self.num_recorded = limit, 0
        self._plan: dict | None = None          # what on_plan saw, until on_step
        self._catching_up: set[str] = set()     # admitted or resumed, not sampled since
        self._left: list[str] = []              # finished in steps that made no record
        self._carried: dict[str, tuple] = {}    # what plans of steps that raised did

    def on_plan(self, engine, plan) -> None:
        # A plan heard without its step: that step raised. The scheduler kept what its plan
        # did to the queues (admissions, preemptions, ends), so the next record lists them.
        failed, self._plan = self._plan, None
        if failed is not None:
            self._carried = {key: self._carried.get(key, ()) + ids
                             for key, ids in failed["changes"].items()}
        if not plan.planned:
            return
        scheduler, kv = engine.scheduler, engine.scheduler.kv
        self._catching_up.update(plan.scheduled_new_ids + plan.scheduled_resumed_ids)
        running = plan.scheduled_ids
        self._plan = dict(
            plan=plan, running=running,
            request_num_tokens=tuple(engine.requests[rid].num_tokens for rid in running),
            kinds=tuple(PREFILL if rid in self._catching_up else DECODE for rid in running),
            waiting=len(scheduler.waiting), kv_used_tokens=kv.num_used_tokens,
            kv_free_tokens=kv.num_free_tokens, kv_capacity=kv.capacity,
            token_budget=scheduler.max_num_batched_tokens,
            changes=dict(joined=plan.scheduled_new_ids, resumed=plan.scheduled_resumed_ids,
                         preempted=plan.preempted_ids, ended=plan.finished_ids))

    def on_step(self, engine, result) -> None:
        left = [o.request_id for o in result.outputs if o.finished]
        seen, self._plan = self._plan, None
        if seen is None:
            self._left += left
            return
        plan, running = seen["plan"], seen["running"]
        self._catching_up.difference_update(result.req_ids)
        self._catching_up.difference_update(left)
        prefill = sum(n for n, kind in zip(plan.num_scheduled_tokens.values(), seen["kinds"])
                      if kind == PREFILL)
        changes = {key: self._carried.get(key, ()) + ids for key, ids in seen["changes"].items()}
        record = StepRecord(
            plan.step, running, tuple(plan.num_scheduled_tokens.values()),
            tuple(plan.num_computed_tokens[rid] for rid in running),
            seen["request_num_tokens"], tuple(plan.block_tables[rid] for rid in running),
            seen["kinds"], tuple(result.req_ids), changes["joined"], changes["resumed"],
            changes["preempted"], changes["ended"], tuple(self._left + left),
            plan.total_num_scheduled_tokens, prefill, seen["waiting"], seen["kv_used_tokens"],
            seen["kv_free_tokens"], seen["kv_capacity"], seen["token_budget"],
            result.model_s, result.step_s)
        self._left, self._carried = [], {}
        self.records.append(record)
        self.num_recorded += 1
        if self.limit is not None and len(self.records) > self.limit:
            del self.records[:len(self.records) - self.limit]


def trace(engine, limit: int | None = None) -> StepTracer:
    """A `StepTracer` attached to the engine (its records grow as the engine steps)."""
    tracer = StepTracer(limit)
    engine.observers.append(tracer)
    return tracer


def format_occupancy_table(records: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The records as aligned text, one line per step (the first and last max_rows // 2
    when longer): step, tokens in the step (prompt tokens), the running ids with their
    slots, joined, left, waiting. Raises ValueError for max_rows that is not an integer
    >= 2."""
    from s08_cli import render_table

    def render(r: StepRecord) -> str:
        tokens = f"{r.num_tokens}" + (f" ({r.prefill_tokens}p)" if r.prefill_tokens else "")
        running = ",".join(f"{rid}@{slot}" for rid, slot in zip(r.running, r.slots))
        return (f"{r.step:>5} {tokens:>9} {running[:32]:<32} {','.join(r.joined):<10} "
                f"{','.join(r.left):<10} {r.waiting:>7}")

    return render_table(f"{'step':>5} {'tokens':>9} {'running (id@slot)':<32} {'joined':<10} "
                        f"{'left':<10} {'waiting':>7}", records, render, max_rows)
