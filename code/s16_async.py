r"""S16, async scheduling: plan step N + 1 while step N runs.

What is new since S15
    S09's `LLMEngine.step` plans, runs, samples, turns tokens into text, applies the stop rules
    and tells the scheduler, in that order, so everything but the model waits for the model and
    the model waits for everything else. vLLM's engine (async scheduling, its default since
    v0.14) keeps one step in flight instead, and this module does the same with the engine's
    own parts:

        step N runs on the worker  | the host, meanwhile
        ---------------------------+--------------------------------------------------------
        forward N                  | plan N + 1: each request scheduled in step N has its
                                   | num_computed_tokens moved now, and the token step N will
                                   | sample is counted as an output placeholder, so a
                                   | decoding request is scheduled for it before it exists
        (logits N arrive)          | sample N, append the tokens (the placeholders resolved)
        forward N + 1              | text and stop rules of step N, free the finished, plan
                                   | N + 2, report step N's outputs

    - `AsyncScheduler`: a scheduler component wrapped around any S09-S13 scheduler. Its
      `schedule` moves num_computed_tokens when it plans (vLLM's `_update_after_schedule`) and
      adds a placeholder (`Request.num_output_placeholders`, declared in S09) to each request
      whose scheduled tokens reach its end (vLLM keeps num_tokens to the known tokens and
      compares num_computed_tokens with num_tokens + num_output_placeholders; here num_tokens
      counts the placeholders, so every scheduler of S09-S13 reads one number unchanged); its
      `update_from_output` lets the inner scheduler
      record the step (the prefix cache names the blocks whose KV now exists) and keeps the
      counts already moved by the plan made since; `revert` takes back a plan in flight.
    - `AsyncLLMEngine`: the engine loop variant, around one S09 `LLMEngine` (not a subclass:
      `add_request`, `abort`, `observers` and the rest are the engine's). Its `step` launches
      step N + 1 as soon as step N's tokens are appended, and does step N's text, stop rules
      and the next plan while the forward runs on one worker thread. What changes is only
      when things happen: a request that ends in step N (EOS, a stop string, max_tokens) has
      already been planned into step N + 1; that row is computed and dropped (one step
      late), while its KV is freed as soon as step N is recorded. That is safe because steps
      run strictly one after another on the worker (one thread, one process or one CUDA
      stream): whatever a later plan does with those blocks (zeroing them for another
      request, a prefix hit on them) runs after step N + 1 has finished writing them. A
      request aborted or preempted while a step holding it is in flight has that row dropped
      unsampled, so its seeded generator draws nothing for it. The outputs are the
      synchronous loop's, with Part II's rule: exactly in the batch-invariant mode; in the
      fast mode the batches differ a little (a dropped row computed, an admission a step
      later), so logits may differ in the last bits, as they do under any other batching.
    - Where the forward runs: on a worker thread (the default, executor_backend "uni"), or in
      a worker process (code/s16_worker.py, "mp"). On CUDA a thread is enough: the kernels
      run on the device while the host goes on. On a CPU a thread gives nothing: torch drops
      Python's GIL inside each op, but the layer code's Python between the ops needs it, so
      the host's Python and the worker's forward take turns (the chapter measures it); only a
      process gives the forward a core of its own.

What it does not handle
    Speculative decoding (S15): its proposer needs the step's tokens before the next plan
    (vLLM also started without it). One step in flight, not a deeper queue. The engine's
    inputs are prepared on the worker, after the tokens arrive: vLLM copies the sampled ids
    into the next step's inputs on the device and prepares everything else before.

Run it
    python code/s16_host.py --async-scheduling
    python benchmarks/bench_s16_host.py --quick

Tests
    tests/test_s16_async.py: the same tokens, text and finish_reasons as the synchronous
    loop under EOS, stop strings, max_tokens, aborts, preemption, chunked prefill and prefix
    hits; seeded sampling equal; a step never planned after the one before it reported; no
    block held when idle; a failing forward taken back with nothing lost.

References
    vLLM V1: `AsyncScheduler` (vllm/v1/core/sched/async_scheduler.py,
    `num_output_placeholders`), `EngineCore.step_with_batch_queue`, the v0.14.0 release notes.
    SGLang's overlap scheduler (the v0.4 "zero-overhead batch scheduler", Dec 2024).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from s01_generation_loop import ParameterError
from s09_continuous_batching import LLMEngine, RequestOutput, StepResult
from s09_ragged import ModelRunnerOutput
from s09_scheduler import RequestStatus, SchedulerOutput


class AsyncScheduler:
    """Any S09-S13 scheduler, planning one step ahead (see the module docstring).

    inner: the scheduler. Everything but `schedule`, `update_from_output` and `revert` is
    inner's (`add_request`, `finish_requests`, `kv`, `running`, `waiting`, ...). A plan's
    moved counts and placeholders are remembered until it is recorded or reverted."""

    def __init__(self, inner):
        self.inner = inner
        self.placeholders: dict[int, list] = {}     # plan number -> requests given one
        self.stepping = False       # set by AsyncLLMEngine.step: no one else plans with it

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def schedule(self) -> SchedulerOutput:
        """inner's plan, with each scheduled request's num_computed_tokens moved past its
        scheduled tokens, and a placeholder for the token it will sample (its scheduled tokens
        reach its end)."""
        if not self.stepping:
            raise ParameterError("this engine's scheduler plans ahead for an AsyncLLMEngine: "
                                 "step the engine through that one, not directly",
                                 "async_scheduling")
        plan = self.inner.schedule()
        if plan.num_scheduled_tokens:
            running = {r.request_id: r for r in self.inner.running}
            given = []
            for rid, n in plan.num_scheduled_tokens.items():
                request = running[rid]
                request.num_computed_tokens = plan.num_computed_tokens[rid] + n
                if request.num_computed_tokens == request.num_tokens:    # it samples
                    request.num_output_placeholders += 1
                    given.append(request)
            self.placeholders[plan.step] = given
        return plan

    def update_from_output(self, plan: SchedulerOutput, finished_ids=(),
                           num_rejected=None) -> None:
        """Step `plan` is done: inner records it (the KV manager may name the blocks it
        filled) and the finished leave; the requests still running keep the counts a later
        plan has already moved."""
        assert not num_rejected, "async scheduling runs without drafts"
        moved = {r.request_id: r.num_computed_tokens for r in self.inner.running}
        self.inner.update_from_output(plan, finished_ids)
        for request in self.inner.running:
            if request.request_id in moved:
                request.num_computed_tokens = moved[request.request_id]
        self.placeholders.pop(plan.step, None)

    def revert(self, plan: SchedulerOutput) -> None:
        """Take back a plan that will not run (its forward failed, or the one before it did):
        each request it scheduled that still runs is back where the plan found it, without
        the placeholder it gave; then inner's revert (KV back to what is computed). Plans are
        taken back newest first."""
        for request in self.placeholders.pop(plan.step, []):
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
        for request in self.inner.running:
            start = plan.num_computed_tokens.get(request.request_id)
            if start is not None:
                request.num_computed_tokens = start
        self.inner.revert(plan)

    def drop_placeholder(self, request) -> None:
        """A request whose row of a step in flight is dropped (preempted meanwhile) has no
        token coming for it."""
        request.num_output_placeholders = max(0, request.num_output_placeholders - 1)


class _Launched:
    """A step in flight: its plan, the handle of its `ModelRunnerOutput`, when it was
    launched, the requests it was launched with (by id), and each one's num_preemptions
    then."""

    def __init__(self, plan, future, start, requests):
        self.plan, self.future, self.start, self.requests = plan, future, start, requests
        self.preemptions = {rid: requests[rid].num_preemptions
                            for rid in plan.num_scheduled_tokens}


class AsyncLLMEngine:
    """An S09 `LLMEngine` stepped one plan ahead (see the module docstring).

    engine: a built engine without speculative decoding; its scheduler is wrapped in an
    `AsyncScheduler` here. Every attribute but `step`, `has_unfinished_requests` and
    `shutdown` is the engine's. `step()` plans the next step, then returns what the
    synchronous step would return for the step in flight (the held outputs of requests
    ended between steps first, then the scheduler's ends, then one per row), launching the
    next step before it turns that step's tokens into text; [] when there is nothing to do.
    A request the scheduler ends (S10: its KV no longer fits the pool) while a step holding
    it is in flight gets that step's token first, as in the synchronous loop. A failing
    forward or draw takes back both plans (the one in flight and the one planned after it)
    before the exception goes on; nothing is lost and the next `step` starts again. Raises
    ParameterError for an engine with a proposer.
    """

    def __init__(self, engine: LLMEngine):
        if not isinstance(engine, LLMEngine) or isinstance(engine.scheduler, AsyncScheduler):
            raise ParameterError("make_async takes an S09 LLMEngine not stepped ahead already "
                                 "(wrap it once; then step it only through the async engine)",
                                 "async_scheduling")
        if engine.proposer is not None:
            raise ParameterError("async_scheduling does not run with speculative decoding (the "
                                 "proposer drafts from tokens the step in flight has not "
                                 "sampled yet): turn one of them off", "async_scheduling")
        engine.scheduler = AsyncScheduler(engine.scheduler)
        self.engine, self.closed = engine, False
        # the "device": a runner that launches steps itself (S16's worker process), or the
        # runner on one worker thread
        self.worker = (None if hasattr(engine.runner, "submit") else
                       ThreadPoolExecutor(max_workers=1, thread_name_prefix="s16-forward"))
        self.in_flight: _Launched | None = None
        self.ending: dict[str, object] = {}   # ended by the scheduler, a row still in flight

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or self.in_flight is not None

    def shutdown(self) -> None:
        """Wait for the step in flight and stop the worker thread (or process); the engine
        takes no more steps. Idempotent."""
        self.closed = True
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        elif hasattr(self.engine.runner, "shutdown"):
            self.engine.runner.shutdown()

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.closed:
            raise RuntimeError("this engine was shut down: build a new one")
        self.engine.scheduler.stepping = True
        try:
            return self._step()
        finally:
            self.engine.scheduler.stepping = False

    def _step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs, engine._pending, engine._pending_ids = engine._pending, [], set()
        times = engine._times = {}          # the phases S09's engine methods time
        planned = None                      # a plan made and not launched yet
        try:
            if self.in_flight is None:                    # idle: start a step
                planned = self._plan(outputs)
                if not planned.num_scheduled_tokens:
                    return outputs
                self._launch(planned, self._requests_of(planned))
                planned = None
            clock = time.perf_counter()
            planned = self._plan(outputs)                 # step N + 1, while N runs
            planned_requests = self._requests_of(planned)
            times["schedule"] = (clock, time.perf_counter())
            launched = self.in_flight
            run = launched.future.result()
            self.in_flight = None
            if not run.model_start:         # a worker process times the step itself
                run.model_start = launched.start
            times["model"] = (run.model_start, run.model_start + run.model_s)
            run = self._live_rows(launched, run)
            requests, tokens, errors = engine._draw(run)          # times "sample"
        except BaseException:
            self._take_back(planned, outputs)
            engine._hold(outputs, first=True)
            raise
        for request, new in zip(requests, tokens):        # the placeholders resolved
            if new is not None:
                request.seq.append(new[0])
                request.num_output_placeholders -= 1
        launch_error = None
        if planned.num_scheduled_tokens:
            try:
                self._launch(planned, planned_requests)   # step N + 1 runs ...
            except BaseException as err:    # step N is finished all the same; N + 1 is not
                engine.scheduler.revert(planned)
                launch_error = err
        outputs += engine._finish_rows(run, requests, tokens, errors, launched.start,
                                       appended=True)   # ... while step N is finished
        clock = times["postprocess"][1]
        finished = [o.request_id for o in outputs
                    if o.finished and o.request_id in engine.requests]
        same = [rid for rid in launched.plan.num_scheduled_tokens
                if engine.requests.get(rid) is launched.requests[rid]]
        recorded = (launched.plan if len(same) == len(launched.plan.num_scheduled_tokens)
                    else without_rows(launched.plan, same))   # not an id a new request took
        engine.scheduler.update_from_output(recorded, finished)
        for rid in finished:
            del engine.requests[rid]
        self._end_scheduler_ended(outputs)
        times["update"] = (clock, time.perf_counter())
        result = StepResult(launched.plan, run, outputs, time.perf_counter() - launched.start,
                            {}, times)
        try:
            for observer in engine.observers:
                observer.on_step(engine, result)
            if launch_error is not None:
                raise launch_error
        except BaseException:
            engine._hold(outputs, first=True)
            raise
        return outputs

    def _plan(self, outputs: list[RequestOutput]) -> SchedulerOutput:
        """The scheduler's next plan (num_computed_tokens moved, placeholders given). A
        request it ended (KV capacity, S10) gets its last output now, or, when a step in
        flight holds its row, once that row's token is in (`ending`). Observers hear of the
        plan."""
        engine = self.engine
        plan = engine.scheduler.schedule()
        held = self.in_flight.plan.num_scheduled_tokens if self.in_flight else {}
        for rid in plan.finished_ids:
            if rid in held:
                self.ending[rid] = engine.requests[rid]
            else:
                outputs.append(engine._end(engine.requests.pop(rid), "length"))
        try:
            for observer in engine.observers:
                observer.on_plan(engine, plan)
        except BaseException:            # as S09's step: the plan is taken back
            engine.scheduler.revert(plan)
            raise
        return plan

    def _end_scheduler_ended(self, outputs: list[RequestOutput]) -> None:
        """The scheduler's ends that waited for a row in flight: unless the stop rules ended
        the request with that row's token, its "length" output now."""
        for rid in list(self.ending):
            del self.ending[rid]
            if rid in self.engine.requests:
                outputs.append(self.engine._end(self.engine.requests.pop(rid), "length"))

    def _requests_of(self, plan: SchedulerOutput) -> dict:
        """The requests a plan schedules, by id, as they are now (an id may be taken again by
        a new request once its request has ended)."""
        return {rid: self.engine.requests[rid] for rid in plan.num_scheduled_tokens}

    def _launch(self, plan: SchedulerOutput, planned: dict) -> None:
        """Start the runner on plan, less the rows of requests that ended since it was made
        (aborted between steps: the token their row would read was never sampled; their KV
        is free already); planned: its requests when it was made. The runner reads its own
        copy of the requests by id; none of the tokens it reads changes before it has read
        them (they are appended before the launch), and the host frees finished requests
        meanwhile."""
        engine = self.engine
        live = [rid for rid, n in plan.num_scheduled_tokens.items()
                if engine.requests.get(rid) is planned[rid]
                and plan.num_computed_tokens[rid] + n <= len(planned[rid].token_ids)]
        for request in engine.scheduler.placeholders.get(plan.step, []):
            if request.request_id not in live:   # gone, or refused its last token: no input
                engine.scheduler.drop_placeholder(request)
        if not live:
            engine.scheduler.placeholders.pop(plan.step, None)
            return
        if len(live) < len(plan.num_scheduled_tokens):
            plan = without_rows(plan, live)
        requests = dict(engine.requests)     # every live request: the batch-invariant
                                             # reference keeps books on the unscheduled too
        start = time.perf_counter()
        handle = (engine.runner.submit(plan, requests) if self.worker is None
                  else self.worker.submit(self._execute, plan, requests))
        self.in_flight = _Launched(plan, handle, start, requests)

    def _execute(self, plan, requests):
        start = time.perf_counter()
        with torch.inference_mode():          # a mode is per thread: this one's, the worker's
            run = self.engine.runner.execute_model(plan, requests)
        run.model_start, run.model_s = start, time.perf_counter() - start
        return run

    def _live_rows(self, launched: _Launched, run: ModelRunnerOutput) -> ModelRunnerOutput:
        """The rows of the run whose requests still run as they did when it was launched
        (and those the scheduler ended meanwhile, `ending`: their token comes first). A row
        of a request that ended (the stop rules one step late, an abort) or was preempted
        since is dropped unsampled, and its placeholder with it."""
        engine = self.engine
        keep = []
        for i, rid in enumerate(run.req_ids):
            request = engine.requests.get(rid)
            if rid in self.ending and self.ending[rid] is launched.requests[rid]:
                keep.append(i)
            elif (request is not launched.requests[rid]
                  or request.status != RequestStatus.RUNNING
                  or request.num_preemptions != launched.preemptions[rid]):
                engine.scheduler.drop_placeholder(launched.requests[rid])
            else:
                keep.append(i)
        if len(keep) == len(run.req_ids):
            return run
        return ModelRunnerOutput([run.req_ids[i] for i in keep], run.logits[keep],
                                 run.num_tokens, run.model_s, [0] * len(keep), run.prepare_s,
                                 run.model_start)

    def _take_back(self, planned: SchedulerOutput | None, outputs: list) -> None:
        """A step failed: the plan made after it, then its own, are taken back (newest
        first). A request the scheduler ended meanwhile, waiting for the failed step's
        token (`ending`), waits again with nothing computed (the scheduler will end it again
        once it has that token, as the synchronous loop does). The next `step` plans again
        from what is computed."""
        launched, self.in_flight = self.in_flight, None
        if planned is not None and planned.num_scheduled_tokens:
            self.engine.scheduler.revert(planned)
        if launched is not None:
            self.engine.scheduler.revert(launched.plan)
        for request in self.ending.values():
            request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
            request.num_output_placeholders = 0
            self.engine.scheduler.add_request(request)
        self.ending.clear()


def without_rows(plan: SchedulerOutput, keep: list[str]) -> SchedulerOutput:
    """plan with only the requests in keep (the KV blocks it took still zeroed)."""
    pick = lambda d: {rid: d[rid] for rid in keep if rid in d}  # noqa: E731
    return replace(plan, num_scheduled_tokens=pick(plan.num_scheduled_tokens),
                   num_computed_tokens=pick(plan.num_computed_tokens),
                   block_tables=pick(plan.block_tables),
                   scheduled_spec_decode_tokens=pick(plan.scheduled_spec_decode_tokens),
                   **{name: tuple(rid for rid in getattr(plan, name) if rid in keep)
                      for name in ("scheduled_new_ids", "scheduled_resumed_ids",
                                   "scheduled_running_ids")})


def make_async(engine: LLMEngine) -> AsyncLLMEngine:
    """The engine, stepped one plan ahead (`AsyncLLMEngine`)."""
    return AsyncLLMEngine(engine)
