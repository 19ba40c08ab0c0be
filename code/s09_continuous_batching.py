r"""S09, continuous batching: iteration-level scheduling, one engine built from components.

What is new since S08
    A static batch runs until its last row finishes: a short request that is done keeps its
    row, and a request that arrives waits for the whole batch. Here the engine schedules per
    step (Orca's iteration-level scheduling): after every step, finished requests leave and
    waiting ones join, so a row never idles while someone waits.

    - The engine is step-based, with vLLM's names: `add_request(prompt, params,
      request_id=None, *, priority=0, cache_salt=None) -> request_id` (the prompt as text or
      as token ids), `step() -> list[RequestOutput]` (one per request that made a token in the
      step, plus the last word of requests that ended without one), `abort(request_id)`,
      `has_unfinished_requests()`. Part I's call style, `generate(prompt)` / `stream(prompt)`
      and S08's `generate(prompts, params)`, is a thin wrapper over these (`LLM`, in
      code/s09_llm.py).
    - `LLMEngine` is written once, here, and never subclassed: later chapters give it other
      components through their own `build_engine`. Its `step` is the whole loop: the
      scheduler plans the step (`SchedulerOutput`: who runs and how many tokens each), the
      runner computes it (code/s09_ragged.py: a ragged batch, the logits of the rows that
      sample), Part I's sampler, `postprocess` and `stop_rule` finish each row, the scheduler
      hears what happened (`update_from_output`), and observers are told.
    - Components (the scheduler side in code/s09_scheduler.py): `FIFOScheduler` (admission
      in arrival order, up to `max_num_seqs` running; S10 replaces it with a scheduler that
      has a token budget and preempts) over a `SlotKVManager` (which request holds which KV
      slot; S10 counts tokens, S12 blocks); the
      runner `RaggedRunner` over `SlotKVCache` (the tensors); Part I's request machinery, held
      as `processor` (S08's engine object, never run here: its checks, its per-request
      `Sequence` with S02's detokenizer and stop matcher and S06's device sampler, S08's
      batched sampler, S01's postprocess and stop rules: one of each, reused, not copied).
    - `Request` (vLLM's): the id, Part I's `Sequence` (`seq`), arrival, priority, cache_salt,
      status (`RequestStatus`: waiting, running, preempted, finished), num_computed_tokens
      (written by the scheduler only), num_preemptions, num_cached_tokens, block_hashes.
      Later chapters use these fields and add few (S15's drafts, S16's placeholders).
    - One bad request fails alone: a row S04's sampler refuses (NaN or +inf logits, a
      penalty pushed past float32's range) ends that request with finish_reason "abort" and
      the error on its output (`RequestOutput.error`, a ParameterError naming the request's
      own field when its parameters are to blame), while the others sample as they would have.
    - Observers (`engine.observers`): objects with `on_plan(engine, plan)` and
      `on_step(engine, result)`, told before and after each step's model run; the trace
      tables of every Part II chapter are built by one (`StepTracer`, code/s09_trace.py).
      With none, tracing costs nothing.

What it does not handle yet
    No token budget per step and no preemption: a step takes every running request's new
    tokens, so one long prompt makes one long step for everyone (S10). A prompt is prefilled
    in one piece (S11 chunks it). Each slot holds max_context positions whatever the request
    needs (S12 pages KV in blocks). The engine is not thread-safe: one thread owns it (S19).
    The step is synchronous: the next plan waits for the model's output (vLLM's default since
    v0.14 plans one step ahead: async scheduling, the chapter's exercise 1, and S16's loop
    around this engine, code/s16_async.py).

Run it
    python code/s09_continuous_batching.py                          # 8 corpus prompts, staggered
    python code/s09_continuous_batching.py --arrival-every 2 --max-num-seqs 3 --num-prompts 6
    python code/s09_continuous_batching.py --prompt "O Romeo, Romeo! wherefore art thou" \
        --prompt "To be, or not"
    python benchmarks/bench_s09_continuous_batching.py --quick      # vs S08 and HF, TTFT / ITL

Tests
    tests/test_s09_continuous_batching.py: every request's greedy tokens equal S05 and HF
    `generate` alone whatever the arrival order, max_num_seqs and companions, on the bundled
    model and tiny random GPT-2, Qwen3, Llama; seeded sampling and whole completions equal S06
    alone; one token per running request per step; no request waits while a slot is free;
    every slot free at the end; one bad request among good streams; every bad input.
    tests/test_s09_properties.py: hypothesis over arrivals, aborts, lengths and stop settings.
    tests/test_parity.py runs this engine in the parity chain.

References
    Orca (Yu et al., OSDI 2022): iteration-level scheduling. vLLM (Kwon et al., SOSP 2023) and
    its V1 engine: `LLMEngine` (`add_request`, `step`, `abort_request`,
    `has_unfinished_requests`), `EngineCore.step` (schedule, execute the model,
    `update_from_output`), `Request` and `RequestStatus` (vllm/v1/request.py),
    `SchedulerOutput`. nano-vllm's `LLMEngine.step` (schedule, run, postprocess).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; N tokens of a ragged batch.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import functools
import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Sequence

import s01_generation_loop as s01
import s04_sampling as s04
import s06_torch as s06
import s08_static_batching as s08
from s01_generation_loop import ParameterError
from s09_ragged import RAGGED_ATTENTION, RaggedRunner, SlotKVCache
from s09_scheduler import (FIFOScheduler, Request, RequestStatus, SchedulerOutput,
                           SlotKVManager)

DEFAULT_MAX_NUM_SEQS = 32
FINISH_ABORT = "abort"
MAX_REQUEST_ID_CHARS = 256


# ---------------------------------------------------------------------------------------------
# What a step returns for a request
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestOutput(s01.RequestOutput):
    """Part I's `RequestOutput` (request_id, new_token_ids, text_delta, finished,
    finish_reason, stop_reason, logprobs), and: num_cached_tokens, the request's prompt
    tokens found in the prefix cache (S13; vLLM's `RequestOutput.num_cached_tokens`); error,
    why a request ended "abort" inside a step (the ParameterError its row raised; its
    `parameter` names the request's field to blame, or is None when the model's logits were
    bad), None otherwise."""

    num_cached_tokens: int = 0
    error: ParameterError | None = None


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineConfig:
    """What every Part II engine is built with, checked once here.

    max_context: the longest context (prompt + output) a request may reach, in tokens; None
    for the model's window (`build_engine` fills it in; Part I's rule, at most the window, is
    checked by the processor, S01's engine). max_num_seqs: the most requests running at once.
    batch_invariant: compute every request alone (the exact reference, code/s09_ragged.py).
    attention: "masked" or "loop" (the fast mode's ragged attention). logprobs_mode:
    "raw_logprobs" or "processed_logprobs" (S04). sync_timing: wait for the device after
    each model call, so the measured model time is real on CUDA (S06).
    Raises ParameterError naming the field.
    """

    max_context: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    batch_invariant: bool = False
    attention: str = "masked"
    logprobs_mode: str = "raw_logprobs"
    sync_timing: bool = False

    def __post_init__(self) -> None:
        if self.max_context is not None and (not s01.is_int(self.max_context)
                                             or self.max_context < 1):
            raise ParameterError(f"max_context must be an integer >= 1 (got "
                                 f"{self.max_context!r})", "max_context", self.max_context)
        if not s01.is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ParameterError(f"max_num_seqs must be an integer >= 1 (got "
                                 f"{self.max_num_seqs!r})", "max_num_seqs", self.max_num_seqs)
        for name in ("batch_invariant", "sync_timing"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(f"{name} must be a bool (got {getattr(self, name)!r})",
                                     name)
        for name, allowed in (("attention", RAGGED_ATTENTION),
                              ("logprobs_mode", s04.LOGPROBS_MODES)):
            if getattr(self, name) not in allowed:
                raise ParameterError(f"{name} must be one of {allowed} (got "
                                     f"{getattr(self, name)!r})", name, getattr(self, name))

    @classmethod
    def of(cls, model: s06.TorchTransformer, options: dict) -> "EngineConfig":
        """The config a `build_engine` makes from the keyword options it does not take
        itself, max_context filled in (`for_model`). Raises ParameterError naming an option
        that is no field of this config (the builder takes no such option) or a bad value."""
        known = {f.name for f in dataclass_fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ParameterError(f"unknown option {unknown[0]!r}: build_engine takes its own "
                                 f"options and EngineConfig's {sorted(known)}", unknown[0])
        return cls(**options).for_model(model)

    def for_model(self, model: s06.TorchTransformer) -> "EngineConfig":
        """This config with max_context filled in: the model's window when None."""
        if self.max_context is not None:
            return self
        return replace(self, max_context=model.config.max_position_embeddings)


@dataclass(frozen=True)
class StepResult:
    """What observers hear after a step (`on_step`): the plan; run, the runner's
    `ModelRunnerOutput` (None when nothing ran); outputs, everything `step` returns; step_s,
    wall seconds of the whole step; num_accepted_tokens, {request id: its draft tokens the
    rejection sampler accepted} for each request that verified drafts (S15; the drafts are
    `plan.scheduled_spec_decode_tokens`). req_ids, num_tokens and model_s are the run's (the
    requests that sampled, in batch order; tokens computed; seconds of the model call).
    times: the step's phases as `time.perf_counter()` readings, {phase: (start, end)} for
    "propose" (S15), "schedule", "model" (the runner's execute_model, batch preparation
    included: `run.prepare_s`), "sample", "postprocess" (text and stop rules) and "update"
    (the scheduler told), each present when the phase ran; S16's profiler reads them. The
    engine takes them whatever observes it: a clock reading costs well under a microsecond."""

    plan: SchedulerOutput
    run: object
    outputs: list[RequestOutput]
    step_s: float
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    times: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def req_ids(self) -> list[str]:
        return [] if self.run is None else self.run.req_ids

    @property
    def num_tokens(self) -> int:
        return 0 if self.run is None else self.run.num_tokens

    @property
    def model_s(self) -> float:
        return 0.0 if self.run is None else self.run.model_s


def timed(phase: str):
    """A decorator for an engine method that is one phase of a step: the call's
    `time.perf_counter()` readings (start, end) go into the step's `_times[phase]`
    (`StepResult.times`), whether it returns or raises."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._times[phase] = (start, time.perf_counter())
        return run
    return wrap


class LLMEngine:
    """The step engine every Part II chapter runs, built from components (see the module
    docstring; each chapter's `build_engine` assembles one).

    config: an `EngineConfig` with max_context filled in. processor: Part I's request
    machinery, an S08 `Engine` on the same model and tokenizer (checks, `make_sequence`,
    `sample_batch`, `postprocess`, `finish`). scheduler: `FIFOScheduler`, S10's `Scheduler`
    or S11's; its `kv` manager decides the block tables. runner: `RaggedRunner` or S12's
    `PagedRunner`. proposer, rejection_sampler: S15's speculative decoding (None: each
    request gains one token a step, drawn by the processor's `sample_batch`): before each
    step the proposer drafts tokens for the requests that decode (`request.spec_token_ids`),
    the scheduler schedules them, the runner returns logits for every position they occupy,
    and the rejection sampler turns those into each request's tokens for the step (the
    accepted drafts and one more). State: `requests` (the unfinished ones by id), `observers`.

    Every check is made once, in `add_request`, before anything is taken (ParameterError
    naming the parameter); a request's failure inside a step ends that request alone.
    """

    def __init__(self, config: EngineConfig, processor: s08.Engine, scheduler, runner,
                 proposer=None, rejection_sampler=None):
        self.config, self.processor = config, processor
        self.scheduler, self.runner = scheduler, runner
        if (proposer is None) != (rejection_sampler is None):
            raise ParameterError("proposer and rejection_sampler come together: a step with "
                                 "drafts returns 1 + k rows of logits per request, which only "
                                 "a rejection sampler reads", "rejection_sampler")
        self.proposer, self.rejection_sampler = proposer, rejection_sampler
        self.requests: dict[str, Request] = {}
        self.observers: list = []
        self._pending: list[RequestOutput] = []  # outputs the next step returns first: last
        self._pending_ids: set[str] = set()      # outputs of requests that ended between steps
        self._made = weakref.WeakSet()           # requests made, not yet queued
        self._next_id = 0
        self._arrivals = 0
        self._times: dict[str, tuple[float, float]] = {}   # this step's phases (StepResult)

    @property
    def model(self) -> s06.TorchTransformer:
        return self.processor.model

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def max_context(self) -> int:
        return self.processor.max_context

    # --- requests in ----------------------------------------------------------------------

    def make_request(self, prompt: str | list[int], params=None, request_id: str | None = None,
                     *, priority: int = 0, cache_salt: str | None = None) -> Request:
        """A checked `Request`, not yet queued (`add_request` queues it). prompt: text, or a
        list of token ids in [0, V). params: a SamplingParams, or max_tokens as an int
        (default: 16 tokens, greedy). request_id: a non-empty str no unfinished request uses
        (default: the next number no request holds; each request made gets a new one, so
        several may be made before they are queued). priority: an int, lower first (S10's
        "priority" policy). cache_salt: None or a non-empty str (S13). Raises ParameterError
        naming the parameter: a bad id, params or prompt (Part I's rules, token ids in
        [0, V)), a stop token id outside the vocabulary, a bad priority or salt, or a prompt
        the KV pool could never hold (the scheduler's rule)."""
        auto = request_id is None       # the next number no request holds, given once
        if auto:
            while self._taken(str(self._next_id)):
                self._next_id += 1
            request_id = str(self._next_id)
        elif (not isinstance(request_id, str) or not request_id
              or len(request_id) > MAX_REQUEST_ID_CHARS):
            raise ParameterError(f"request_id must be a non-empty string of at most "
                                 f"{MAX_REQUEST_ID_CHARS} characters (got {request_id!r:.80})",
                                 "request_id")
        elif self._taken(request_id):
            raise ParameterError(f"request_id {request_id!r} is already in use by an "
                                 "unfinished request", "request_id")
        params = self.processor.make_params(16 if params is None else params)
        prompt_ids = self.processor.check_prompt(prompt)
        seq = self.processor.make_sequence(request_id, prompt_ids, params)
        request = Request(request_id, seq, priority=priority, cache_salt=cache_salt)
        self.processor.finish_if_stopped(seq)     # a prompt that fills the context: done now
        if not seq.finished:
            self.scheduler.check_request(request)
        self._next_id += auto
        self._made.add(request)
        return request

    def add_request(self, prompt: str | list[int], params=None, request_id: str | None = None,
                    *, priority: int = 0, cache_salt: str | None = None) -> str:
        """Check a request (`make_request`) and queue it; returns its id."""
        return self.queue(self.make_request(prompt, params, request_id, priority=priority,
                                            cache_salt=cache_salt))

    def queue(self, request: Request) -> str:
        """Queue a request this engine's `make_request` made (a request finished on arrival
        gets its last output, no token, from the next `step`). Returns its id. Raises
        ParameterError for any other request (another engine's: its checks were not this
        engine's; or one already queued) and for an id taken since it was made."""
        if request not in self._made:
            raise ParameterError("queue takes a request this engine's make_request made and "
                                 "has not queued yet", "request")
        if self._taken(request.request_id):
            raise ParameterError(f"request_id {request.request_id!r} was taken after this "
                                 "request was made", "request_id")
        self._made.discard(request)
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        if request.finished:
            request.status = RequestStatus.FINISHED
            self._hold([self._output(request, s01.RequestOutput(
                request.request_id, [], "", True, request.seq.finish_reason,
                request.seq.stop_reason))])
        else:
            self.scheduler.add_request(request)
            self.requests[request.request_id] = request
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request now with finish_reason "abort": its KV is free
        before this returns; its last output (no token) comes with the next `step`. Returns
        True; False, doing nothing, for an id that is unknown or already finished (a request
        may finish while its abort is on the way; vLLM's `LLMEngine.abort_request` ignores
        such ids too, and returns None). Raises ParameterError for an id that is not a
        string."""
        if not isinstance(request_id, str):
            raise ParameterError(f"request_id must be a string (got {request_id!r})",
                                 "request_id")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish_requests([request_id])
        self._hold([self._end(request, FINISH_ABORT)])
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request waits or runs, or a last output is still to be returned."""
        return bool(self.requests or self._pending)

    # --- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan, compute, sample, stop, report. Returns the step's outputs: the outputs held
        since the last step first (the last outputs of requests that ended between steps),
        then those the scheduler ended, then one per request that sampled, in batch order
        ([] when there is nothing to do). If the scheduler, the model run, the draw of the
        tokens or an observer raises, the plan is reverted (KV as before) and nothing is lost:
        the outputs wait for the next step."""
        start = time.perf_counter()
        plan = self._schedule()            # S15's drafts, then who runs and how many tokens
        outputs, self._pending, self._pending_ids = self._pending, [], set()
        for rid in plan.finished_ids:                     # ended by the KV capacity (S10)
            outputs.append(self._end(self.requests.pop(rid), s01.FINISH_LENGTH))
        try:
            for observer in self.observers:
                observer.on_plan(self, plan)
            run = self._execute(plan) if plan.num_scheduled_tokens else None
            drawn = self._draw(run) if run is not None else None      # all or nothing
        except BaseException:
            self.scheduler.revert(plan)
            self._hold(outputs, first=True)
            raise
        accepted = {}
        if run is not None:
            outputs += self._finish_rows(run, *drawn, start)  # text, Part I's stop rules
            finished = [o.request_id for o in outputs
                        if o.finished and o.request_id in self.requests]
            accepted = self._num_accepted(run, *drawn[:2])           # S15's drafts
            self.scheduler.update_from_output(plan, finished, {
                rid: len(plan.scheduled_spec_decode_tokens[rid]) - a
                for rid, a in accepted.items()})                   # rejected: rolled back
            for rid in finished:
                del self.requests[rid]
            self._times["update"] = (self._times["postprocess"][1], time.perf_counter())
        if self.proposer is not None:
            self.proposer.release(set(self.requests))     # S15: drafts' state of the gone
        result = StepResult(plan, run, outputs, time.perf_counter() - start, accepted,
                            self._times)
        try:
            for observer in self.observers:
                observer.on_step(self, result)
        except BaseException:           # the step happened: its outputs come with the next
            self._hold(outputs, first=True)
            raise
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The step's plan: S15's proposer drafts first (when there is one), then the
        scheduler plans. Starts the step's phase readings (`StepResult.times`)."""
        self._times = {}
        if self.proposer is not None:
            self._propose()                               # draft tokens to verify (S15)
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._times["schedule"] = (start, time.perf_counter())
        return plan

    def _execute(self, plan: SchedulerOutput):
        """The runner's `execute_model`, with `run.model_start` (a perf_counter reading) and
        `run.model_s` set (wall seconds; with sync_timing the device's work is waited for)."""
        start = time.perf_counter()
        run = self.runner.execute_model(plan, self.requests)
        if self.config.sync_timing:
            s06.synchronize(self.model.device)
        run.model_start, run.model_s = start, time.perf_counter() - start
        self._times["model"] = (start, start + run.model_s)
        return run

    def _hold(self, outputs: list[RequestOutput], first: bool = False) -> None:
        """Keep outputs for the next `step` to return first (after those already held, or
        before them: `first`, for a step's own outputs put back when it raised)."""
        if first:
            self._pending[:0] = outputs
        else:
            self._pending += outputs
        self._pending_ids.update(o.request_id for o in outputs)

    @timed("sample")
    def _draw(self, run) -> tuple[list[Request], list[list[int] | None],
                                  dict[int, ParameterError]]:
        """The tokens of each sampling row: (the rows' requests, their new tokens, the
        refused rows' errors by row). One token per row from S08's `sample_batch`; with a
        rejection sampler (S15), a row's accepted drafts and one more. A row the sampler
        refuses gets None and its error; the other rows are sampled again, drawing what they
        would have drawn anyway (a failed call puts every random stream back). All or
        nothing: when it raises, no row has drawn and the step can be reverted."""
        requests = [self.requests[rid] for rid in run.req_ids]
        if not requests:                          # S11: a step of prompt chunks samples none
            return [], [], {}
        try:
            return requests, self._sample(run, requests, [True] * len(requests)), {}
        except s08.RowsRefused as refused:
            active = [i not in refused.errors for i in range(len(requests))]
            tokens = (self._sample(run, requests, active) if any(active)
                      else [None] * len(requests))
            return requests, tokens, refused.errors

    def _sample(self, run, requests: list[Request], active: list[bool]
                ) -> list[list[int] | None]:
        if self.rejection_sampler is not None:
            return self.rejection_sampler.sample(run, requests, active)
        tokens, _ = self.processor.sample_batch(run.logits, [r.seq for r in requests], active)
        return [None if t is None else [t] for t in tokens]

    @staticmethod
    def _num_accepted(run, requests: list[Request], tokens: list[list[int] | None]
                      ) -> dict[str, int]:
        """S15: {request id: drafts the rejection sampler accepted} for each row that verified
        drafts and drew (its tokens are the accepted drafts and one more), counted before the
        stop rules drop any (vLLM counts them the same way)."""
        return {request.request_id: len(new) - 1 for request, new, d in zip(
            requests, tokens, run.num_draft_tokens) if d and new is not None}

    @timed("propose")
    def _propose(self) -> None:
        """S15: the proposer's draft tokens for every running request whose next step is a
        decode (its prompt computed, its last token not), at most the proposer's
        num_speculative_tokens and fewer near its max_tokens or the context's end
        (`num_drafts_allowed`); the others' are cleared."""
        running = [r for r in self.requests.values() if r.status == RequestStatus.RUNNING]
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        for request in running:
            request.spec_token_ids, request.spec_draft_probs = [], None
        caps = [self.num_drafts_allowed(r) for r in decoding]
        drafts = self.proposer.propose(decoding, caps, live_ids=set(self.requests))
        for request, (token_ids, probs) in zip(decoding, drafts):
            request.spec_token_ids, request.spec_draft_probs = list(token_ids), probs

    def num_drafts_allowed(self, request: Request) -> int:
        """How many draft tokens a decoding request may verify in its next step: at most
        the proposer's num_speculative_tokens, and so few that the step's tokens (the drafts
        and one more) fit both its max_tokens and the context (S15)."""
        left = request.params.max_tokens - len(request.output_ids)
        room = self.max_context - request.num_tokens
        return max(0, min(self.proposer.num_speculative_tokens, left - 1, room - 1))

    @timed("postprocess")
    def _finish_rows(self, run, requests: list[Request], tokens: list[list[int] | None],
                     errors: dict[int, ParameterError], start: float,
                     appended: bool = False) -> list[RequestOutput]:
        """Part I's postprocess for each token a row drew, in order (text, stop rules),
        until one ends the request: the tokens after it are dropped (S15: an EOS, a stop
        string or max_tokens inside a run of accepted drafts), with their logprobs. One
        output per row, its tokens and text joined; a refused row ends its request ("abort",
        with the error). Part I's per-request `Stats` get the step's times. appended: each
        row's one token is already its last (S16's async loop)."""
        outputs = []
        for i, (request, new) in enumerate(zip(requests, tokens)):
            if new is None:
                outputs.append(self._end(request, FINISH_ABORT, errors[i]))
                continue
            seq, deltas = request.seq, []
            before = len(request.output_ids) - (len(new) if appended else 0)
            seq.stats.context_lens.append(before + len(request.prompt_ids))   # one pass
            for token in new:
                out = self.processor.postprocess(seq, token, appended)
                deltas.append(out.text_delta)
                if seq.finished:
                    break
            logprobs = None
            if seq.logprobs is not None:       # drawn for every token, kept for the shown
                del seq.logprobs[len(seq.output_ids):]
                logprobs = seq.logprobs[before:]
            outputs.append(self._output(request, s01.RequestOutput(
                out.request_id, seq.output_ids[before:], "".join(deltas), out.finished,
                out.finish_reason, out.stop_reason, logprobs)))
        step_s = time.perf_counter() - start
        for request, new in zip(requests, tokens):
            if new is not None:
                request.seq.stats.pass_times_s.append(run.model_s)
                request.seq.stats.step_times_s.append(step_s)
        return outputs

    def _end(self, request: Request, finish_reason: str, error: ParameterError | None = None
             ) -> RequestOutput:
        """A request's last output without a token. "length" (the scheduler ended it)
        releases its held-back text as Part I does; "abort" drops it."""
        seq = request.seq
        if finish_reason == FINISH_ABORT:
            seq.finish_reason, seq.stop_reason, text = FINISH_ABORT, None, ""
        else:
            text = self.processor.finish(seq, finish_reason)
        seq.text.append(text)
        request.status = RequestStatus.FINISHED
        return self._output(request, s01.RequestOutput(
            request.request_id, [], text, True, seq.finish_reason, seq.stop_reason), error)

    @staticmethod
    def _output(request: Request, out: s01.RequestOutput, error: ParameterError | None = None
                ) -> RequestOutput:
        return RequestOutput(out.request_id, out.new_token_ids, out.text_delta, out.finished,
                             out.finish_reason, out.stop_reason, out.logprobs,
                             request.num_cached_tokens, error)

    def request_ids_in_use(self) -> set[str]:
        """The ids a new request may not take: every unfinished request's, and every
        finished one's whose last output `step` has not returned yet."""
        return set(self.requests) | self._pending_ids

    def _taken(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self._pending_ids


def make_processor(model: s06.TorchTransformer, tokenizer, config: EngineConfig) -> s08.Engine:
    """Part I's request machinery for an engine (see `LLMEngine`): S08's engine object, whose
    constructor checks the model, the tokenizer's EOS ids, max_context against the model's
    window and logprobs_mode. Its own batches are never run."""
    return s08.Engine(model, tokenizer, config.max_context, logprobs_mode=config.logprobs_mode)


def slot_runner(model: s06.TorchTransformer, config: EngineConfig) -> RaggedRunner:
    """The `RaggedRunner` over max_num_seqs `SlotKVCache` slots of max_context positions
    (S09's to S11's runner)."""
    cache = SlotKVCache.for_model(model, config.max_num_seqs, config.max_context)
    return RaggedRunner(model, cache, config.batch_invariant, config.attention)


def build_engine(model: s06.TorchTransformer, tokenizer, **options) -> LLMEngine:
    """S09's engine: `FIFOScheduler` over a `SlotKVManager` of max_num_seqs slots, and the
    `RaggedRunner` over as many `SlotKVCache` slots. options: `EngineConfig`'s fields
    (max_context, max_num_seqs, batch_invariant, attention, logprobs_mode, sync_timing).
    Raises ParameterError naming the option (before any KV is allocated)."""
    config = EngineConfig.of(model, options)
    processor = make_processor(model, tokenizer, config)
    scheduler = FIFOScheduler(config.max_num_seqs,
                              SlotKVManager(config.max_num_seqs, config.max_context))
    return LLMEngine(config, processor, scheduler, slot_runner(model, config))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 9: continuous batching, requests join and leave at every step.",
        build_engine, add_arguments=lambda parser: None, options=lambda args: {},
        tracers=lambda engine: [s09_trace.StepTracer()],
        describe=lambda engine, tracers: "FIFO admission into free KV slots",
        table=lambda run, tracers: s09_trace.format_occupancy_table(tracers[0].records),
        arrival_every=3), argv)


if __name__ == "__main__":
    sys.exit(main())
