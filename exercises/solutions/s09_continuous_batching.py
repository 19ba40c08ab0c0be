"""S09 exercises, reference solutions: one step ahead, a ragged batch's metadata, slot reuse.

Try the stubs in exercises/s09_continuous_batching.py first; grade these with
`python exercises/grade.py --solutions s09`.

Sources followed: Orca's iteration-level scheduling (Yu et al., OSDI 2022); vLLM's async
scheduling (vllm/v1/core/sched/async_scheduler.py: num_computed_tokens advanced when a step is
scheduled, `num_output_placeholders` for the tokens still in flight; vllm/v1/engine/core.py
`step_with_batch_queue`: schedule the next batch before blocking on the one in flight); the
flattened batch metadata of vLLM (`query_start_loc`, `seq_lens`) and flash-attention's varlen
interface (`cu_seqlens_q`); the chapter's FIFO admission into the lowest free slot.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Sequence

import s01_generation_loop as s01
import s09_continuous_batching as s09
from s09_scheduler import RequestStatus, SchedulerOutput


# Exercise 1: one step ahead -------------------------------------------------------------------

def generate_ahead(engine, prompts: Sequence, params: Sequence, launch=None) -> list[list]:
    kv, seats = engine.scheduler.kv, engine.scheduler.max_num_seqs
    made = [engine.make_request(p, sp, request_id=str(i))
            for i, (p, sp) in enumerate(zip(prompts, params))]
    live = {r.request_id: r for r in made}            # what the runner reads token_ids from
    outputs = {r.request_id: [] for r in made}
    waiting = deque(r for r in made if not r.finished)
    for r in made:                                    # a prompt that fills the context
        if r.finished:
            outputs[r.request_id].append(s01.RequestOutput(
                r.request_id, [], "", True, r.seq.finish_reason, r.seq.stop_reason))
    running: list = []
    step = 0
    pool = None
    if launch is None:                                # the "device": one worker thread
        pool = ThreadPoolExecutor(max_workers=1)

        def launch(plan, reqs):
            return pool.submit(engine.runner.execute_model, plan, reqs)

    def schedule() -> SchedulerOutput:
        """The next plan, made before the step in flight has returned its tokens: a running
        request computes the one position its pending token (a placeholder) will fill; a new
        one its prompt. num_computed_tokens moves now, at schedule time."""
        nonlocal step
        scheduled, starts, new = {}, {}, []
        for r in running:
            assert kv.allocate_slots(r, 1), "a slot holds max_context positions"
            scheduled[r.request_id], starts[r.request_id] = 1, r.num_computed_tokens
        while (waiting and len(running) < seats
               and kv.allocate_slots(waiting[0], waiting[0].num_tokens)):
            r = waiting.popleft()
            r.status = RequestStatus.RUNNING
            running.append(r)
            new.append(r.request_id)
            scheduled[r.request_id], starts[r.request_id] = r.num_tokens, 0
        for rid, n in scheduled.items():
            live[rid].num_computed_tokens += n
        plan = SchedulerOutput(step, scheduled, starts,
                               {rid: kv.block_table(rid) for rid in scheduled},
                               scheduled_new_ids=tuple(new),
                               scheduled_running_ids=tuple(r for r in scheduled if r not in new))
        step += bool(scheduled)
        for observer in engine.observers:
            observer.on_plan(engine, plan)
        return plan

    def without_finished(plan: SchedulerOutput) -> SchedulerOutput:
        """The plan less the rows of requests that finished after it was made: they take no
        extra token (their slot is already free)."""
        keep = [rid for rid in plan.num_scheduled_tokens if not live[rid].finished]
        if len(keep) == len(plan.num_scheduled_tokens):
            return plan
        return SchedulerOutput(plan.step, {rid: plan.num_scheduled_tokens[rid] for rid in keep},
                               {rid: plan.num_computed_tokens[rid] for rid in keep},
                               {rid: plan.block_tables[rid] for rid in keep},
                               scheduled_new_ids=tuple(r for r in plan.scheduled_new_ids
                                                       if r in keep),
                               scheduled_running_ids=tuple(r for r in plan.scheduled_running_ids
                                                           if r in keep))

    def collect(plan: SchedulerOutput, run, start: float) -> None:
        """The step's tokens replace the placeholders: sample, Part I's postprocess (text,
        stop rules), and the finished leave and free their slots."""
        seqs = [live[rid].seq for rid in run.req_ids]
        tokens, _ = engine.processor.sample_batch(run.logits, seqs, [True] * len(seqs))
        step_outputs = []
        for rid, token in zip(run.req_ids, tokens):
            r = live[rid]
            out = engine.processor.postprocess(r.seq, token)
            step_outputs.append(out)
            outputs[rid].append(out)
            if out.finished:
                r.status = RequestStatus.FINISHED
                running.remove(r)
                kv.free(r)
        result = s09.StepResult(plan, run, step_outputs, time.perf_counter() - start)
        for observer in engine.observers:
            observer.on_step(engine, result)

    try:
        plan = schedule()
        while plan.num_scheduled_tokens:
            start = time.perf_counter()
            handle = launch(plan, live)               # step N runs ...
            upcoming = schedule()                     # ... while step N + 1 is planned
            collect(plan, handle.result(), start)
            plan = without_finished(upcoming)
            if not plan.num_scheduled_tokens and (waiting or running):
                plan = schedule()                     # all it held finished: plan again
    finally:
        if pool is not None:
            pool.shutdown()
    return [outputs[r.request_id] for r in made]


# Exercise 2: flatten a ragged batch -----------------------------------------------------------

def flatten(new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int]) -> dict:
    if not new_tokens or len(new_tokens) != len(num_cached):
        raise ValueError("need one num_cached per request, and at least one request")
    if any(len(t) == 0 for t in new_tokens) or any(c < 0 for c in num_cached):
        raise ValueError("every request needs a new token, and num_cached must be >= 0")
    lens = [len(t) for t in new_tokens]
    starts = [0, *accumulate(lens)]
    return {"input_ids": [int(t) for tokens in new_tokens for t in tokens],
            "positions": [c + i for c, n in zip(num_cached, lens) for i in range(n)],
            "query_start_loc": starts,
            "context_lens": [c + n for c, n in zip(num_cached, lens)],
            "sample_rows": [end - 1 for end in starts[1:]]}


# Exercise 3: slots that come back -------------------------------------------------------------

def simulate(output_lens: Sequence[int], max_num_seqs: int,
             aborts: dict[int, int] | None = None) -> list[list[tuple[int, int]]]:
    if max_num_seqs < 1 or any(n < 1 for n in output_lens):
        raise ValueError("max_num_seqs and every output length must be >= 1")
    aborts = aborts or {}
    waiting = list(range(len(output_lens)))
    free = list(range(max_num_seqs))
    running: list[int] = []
    slot_of, made, steps = {}, [0] * len(output_lens), []
    while waiting or running:
        k = len(steps)
        for i, when in aborts.items():          # aborted just before step k
            if when == k and i in waiting:
                waiting.remove(i)
            elif when == k and i in running:
                running.remove(i)
                free.append(slot_of[i])
        if not (waiting or running):
            break
        free.sort()
        while waiting and free:                 # the oldest into the lowest free slot
            i, slot = waiting.pop(0), free.pop(0)
            slot_of[i] = slot
            running.append(i)
        steps.append(sorted(((i, slot_of[i]) for i in running), key=lambda pair: pair[1]))
        for i in list(running):
            made[i] += 1
            if made[i] == output_lens[i]:
                running.remove(i)
                free.append(slot_of[i])
    return steps
