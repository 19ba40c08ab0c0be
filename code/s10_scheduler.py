r"""S10, the scheduler: who runs in each step and how many tokens, tested without a model.

What is new since S09
    S09's `FIFOScheduler` runs every running request's new tokens in every step and admits
    waiting requests while a slot is free. Here the decision gets budgets and can take KV
    back: `Scheduler`, with vLLM V1's interface (`schedule() -> SchedulerOutput`,
    `update_from_output(plan, finished_ids)`, `finish_requests`), is one component of S09's
    engine (`build_engine` below puts it in); the engine, the runner and Part I's sampler
    and stop rules are S09's, unchanged. The scheduler knows nothing of models or tensors:
    the tests drive it with `Request.for_tokens` requests and a fake model step.

    - Budgets per step: at most `max_num_seqs` requests running, at most
      `max_num_batched_tokens` tokens scheduled, and KV for every computed token inside
      `kv_capacity` tokens (`TokenKVPool`: S09's slots, with a token capacity on top; the
      capacity is an accounting limit, the memory is still S09's slots; S12 replaces it
      with a block pool of the same interface, whose size is real memory).
    - Order (vLLM V1's): first the running requests, in the order they were admitted, one
      token each; then, if nobody was preempted in this step, waiting requests in policy
      order while seats, tokens and KV allow, stopping at the first that does not fit (no
      skipping, so the order holds). Admission is optimistic, as in vLLM V1: a request
      joins when its tokens fit the free KV now (`admits`, the seam a conservative policy
      overrides).
    - Preemption by recompute: when a running request cannot get KV for its next token, the
      most recently admitted running request (under "priority": the lowest priority, then
      the latest arrival) is preempted: its KV freed, `num_computed_tokens = 0`, back to the
      front of the waiting queue (under "priority": to its place in priority order); if the
      victim is the request itself, it waits and the next running request goes on. When it
      runs again it computes its prompt and every token it had generated in one step, and
      samples its next token from the last of them, by its own seeded generator, penalty
      counts and detokenizer, which simply continue: its output is the one it would have had
      (exactly in the batch-invariant mode, whose runner recomputes it with S06's shapes;
      within S08's rule in the fast mode, which recomputes in one pass, as vLLM does).
    - A request that can never fit: the engine refuses a prompt longer than kv_capacity
      (`check_request`; ParameterError: such a request would wait at the head of the queue
      forever, blocking everyone behind it, vLLM PR #1534); a running request whose next step
      would need more KV than the whole capacity is ended (`SchedulerOutput.finished_ids`;
      the engine ends it with finish_reason "length": the capacity is its context limit).
    - A plan is all or nothing: when `schedule` raises (an `admits` that raises or returns
      something other than a bool, an admission policy that refuses the head of the queue
      while nothing runs, which would wait forever), what the call did is taken back before
      the exception goes on: the requests it admitted wait again at the head of the queue
      holding no KV, and each running request holds KV for what it has computed (S09's
      `revert_plan`, as after a failed model step). Only what a retry would redo stays: a
      request ended for outgrowing the pool is reported by the next plan, and a request
      preempted before the failure waits with nothing computed.
    - Policies: "fcfs" (default) and "priority" (vLLM's: lower value first, ties by arrival).
      Priority can starve: a steady stream of high-priority arrivals keeps low-priority
      requests waiting (the benchmark measures it).
    - The KV manager is asked explicitly for what the prefix cache would give
      (`get_computed_blocks` at admission) and told what each step filled (`cache_blocks`,
      in `update_from_output`): nothing before S13, whose manager answers both, so S13
      needs no scheduler of its own.

What it does not handle yet
    A prompt runs whole in one step, so max_num_batched_tokens must be >= max_model_len
    (vLLM V0's rule without chunked prefill; S11 chunks prompts and lifts it). KV is counted
    in tokens over S09's slots, not stored in blocks (S12); no prefix sharing (S13). Waiting
    requests never preempt running ones, whatever their priority. A recompute costs a whole
    prefill; vLLM V0 could also swap KV to host memory instead, which V1 dropped.

Run it
    python code/s10_scheduler.py --kv-capacity 96 --max-num-seqs 4      # preemptions, traced
    python code/s10_scheduler.py --policy priority --kv-capacity 96 --priorities 1,0,1,0,1,0,1,0
    python code/s10_scheduler.py --max-context 64 --max-num-batched-tokens 64 \
        --kv-capacity 128 --arrival-every 0 --seed 4 --max-tokens 24    # the budget decides
    python benchmarks/bench_s10_scheduler.py --quick                     # KV capacity, policy

Tests
    tests/test_s10_scheduler.py: budgets and max_num_seqs never exceeded; FCFS and priority
    order; the victim of a preemption; a resumed request recomputes prompt + outputs, and the
    fake model's tokens equal a run with unbounded capacity; abort from either queue; the
    public bugs G1 (a prompt that can never fit), G5 (idle means all KV free).
    tests/test_s10_properties.py: hypothesis state machine over add / abort / step.
    tests/test_s10_engine.py: the engine with this scheduler, on real models.

References
    vLLM V1 `Scheduler.schedule` / `update_from_output` / `finish_requests` and
    `KVCacheManager.allocate_slots` / `get_computed_blocks` (vllm/v1/core/sched/scheduler.py,
    vllm/v1/core/kv_cache_manager.py); vLLM (Kwon et al., SOSP 2023) for preemption by
    recompute; nano-vllm's `Scheduler` (`preempt`, running requests before waiting ones).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

import s01_generation_loop as s01
import s09_continuous_batching as s09
from s01_generation_loop import ParameterError
from s09_scheduler import (Request, RequestStatus, SchedulerOutput, SlotKVManager,
                           record_computed, revert_plan, scheduled_drafts, take_out)

POLICIES = ("fcfs", "priority")


# ---------------------------------------------------------------------------------------------
# KV capacity in tokens
# ---------------------------------------------------------------------------------------------

class TokenKVPool(SlotKVManager):
    """S09's slots with a KV capacity counted in tokens on top: every request holds some of
    `capacity` token positions, and `allocate_slots(request, n)` gives it n more only while
    they fit, all or nothing (False, nothing taken). The capacity is an accounting limit
    only: the storage stays S09's (a slot of slot_size positions per running request,
    allocated whatever the capacity), and a capacity below num_slots * slot_size makes the
    scheduler preempt as a pool of that size would. S12 makes the pool real memory. S12's block manager has the same
    interface. Raises ParameterError (parameter "kv_capacity") for a capacity that is not an
    integer in [1, num_slots * slot_size].
    """

    def __init__(self, num_slots: int, slot_size: int, capacity: int | None = None):
        super().__init__(num_slots, slot_size)
        slots = self.num_slots * self.slot_size
        capacity = slots if capacity is None else capacity
        if not s01.is_int(capacity) or not 1 <= capacity <= slots:
            raise ParameterError(f"kv_capacity must be an integer in [1, max_num_seqs x "
                                 f"max_context = {slots}] (got {capacity!r}): the KV slots "
                                 "hold no more", "kv_capacity", capacity)
        self.token_capacity = int(capacity)

    @property
    def capacity(self) -> int:
        return self.token_capacity

    def check_fits(self, num_tokens: int) -> None:
        """A prompt needs KV for all its tokens, so it may not be longer than the capacity
        (vLLM PR #1534: such a request waits at the head of the queue forever, and everyone
        behind it). ParameterError, parameter "prompt"."""
        if num_tokens > self.capacity:
            raise ParameterError(f"prompt is {num_tokens} tokens but kv_capacity is "
                                 f"{self.capacity} tokens: it could never be scheduled (it "
                                 "would block every request behind it)", "prompt")

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks=()) -> bool:
        """Room for num_new_tokens more tokens while they fit the capacity (and S09's slot
        rules), all or nothing: False, nothing taken, when they do not."""
        if num_new_tokens > self.num_free_tokens:
            return False
        return super().allocate_slots(request, num_new_tokens)


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings, checked once here (vLLM's `SchedulerConfig`).

    max_num_seqs: the most requests running at once. max_model_len: the longest context a
    request may reach (the engine's max_context). max_num_batched_tokens: the most tokens
    scheduled in one step (None: max_num_seqs * max_model_len, no limit); here at least
    max_model_len (`check_token_budget`; S11's rule is looser). policy: "fcfs" or
    "priority". Raises ParameterError naming the field.
    """

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not s01.is_int(value) or value < 1:
                raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})", name,
                                     value)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens",
                               self.max_num_seqs * self.max_model_len)
        elif not s01.is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise ParameterError(f"max_num_batched_tokens must be an integer >= 1 (got "
                                 f"{self.max_num_batched_tokens!r})", "max_num_batched_tokens")
        self.check_token_budget()
        if self.policy not in POLICIES:
            raise ParameterError(f"policy must be one of {POLICIES} (got {self.policy!r})",
                                 "policy", self.policy)

    def check_token_budget(self) -> None:
        """The budget's rule (S11 overrides it): a prompt, or a preempted request's
        recompute, runs whole in one step, so the budget must hold the longest context."""
        if self.max_num_batched_tokens < self.max_model_len:
            raise ParameterError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): without chunked prefill (S11) a "
                "prompt, or a preempted request's recompute, runs whole in one step",
                "max_num_batched_tokens")


@dataclass
class _Plan:
    """What one `schedule` call fills in: the tokens left in the step's budget, each
    scheduled request's tokens and start (schedule order), and the ids by what happened."""

    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)
    # admitted in this call, (request, status, num_cached_tokens) before: what a failed
    # call puts back
    admitted: list[tuple[Request, RequestStatus, int]] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def add(self, request: Request, n: int, start: int, group: list[str]) -> None:
        """Schedule n tokens of the request from `start`, listed in `group`."""
        self.scheduled[request.request_id], self.starts[request.request_id] = n, start
        group.append(request.request_id)
        self.budget -= n

    def drop(self, request: Request) -> None:
        """Take a preempted request out of this step's plan (it may have been scheduled),
        giving its tokens back to the budget."""
        rid = request.request_id
        self.budget += self.scheduled.pop(rid, 0)
        self.starts.pop(rid, None)
        for group in (self.running, self.new, self.resumed):
            if rid in group:
                group.remove(rid)
        self.preempted.append(rid)


class Scheduler:
    """The model-free scheduler: queues, token budget, KV capacity, preemption, policy.

    config: a `SchedulerConfig`. kv: the KV manager (`TokenKVPool`; S12's and S13's block
    managers). State: `waiting` (deque, in policy order), `running` (list, in admission
    order), `num_steps` (plans made), `num_preemptions` (in all). A request is in at most one
    queue; the scheduler sets its status, num_computed_tokens, num_preemptions and
    num_cached_tokens, and nothing else does.
    """

    def __init__(self, config: SchedulerConfig, kv):
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0                    # plans that did something
        self.num_preemptions = 0              # in all, since construction
        self._ended: list[str] = []           # ended by a call that raised: next plan reports

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def kv_capacity(self) -> int:
        return self.kv.capacity

    # --- requests in and out ---------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """The rule a new request must meet to ever run: its prompt fits the KV pool
        (`kv.check_fits`; ParameterError). The engine checks everything else first."""
        assert request.num_tokens <= self.config.max_model_len, "the engine checks the length"
        self.kv.check_fits(request.num_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a checked request: at the back (FCFS) or at its place in (priority, arrival)
        order (priority)."""
        assert request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING
        self._to_waiting(request, front=False)

    def finish_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Take each request out of its queue, free its KV, status finished (vLLM V1's
        `finish_requests`, S09's rule). Returns the ids taken out (with any still to be
        reported as ended by a call of `schedule` that raised: they are ended already)."""
        ended = [rid for rid in self._ended if rid in request_ids]
        self._ended = [rid for rid in self._ended if rid not in ended]
        return take_out((self.running, self.waiting), request_ids, self.kv) + ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (in admission order, with preemption when KV
        runs out), then, if nobody was preempted, waiting requests in policy order while
        max_num_seqs, the token budget and KV allow. See the module docstring; the KV for
        every scheduled token is allocated here. If it raises, `_take_back` undoes what a retry
        would not redo before the exception goes on (see the module docstring)."""
        step = _Plan(self.max_num_batched_tokens)
        step.finished += self._ended           # ended by a call that raised
        try:
            self._schedule_running(step)
            if not step.preempted:
                self._schedule_waiting(step)
            self._schedule_drafts(step)
            drafts = {r.request_id: scheduled_drafts(r, step.starts[r.request_id],
                                                     step.scheduled[r.request_id])
                      for r in self.running if r.spec_token_ids and r.request_id in step.scheduled}
            plan = SchedulerOutput(
                self.num_steps, step.scheduled, step.starts,
                {rid: tuple(self.kv.block_table(rid)) for rid in step.scheduled},
                tuple(step.new), tuple(step.resumed), tuple(step.running),
                tuple(step.preempted), tuple(step.finished), tuple(self.kv.take_new_blocks()),
                {rid: d for rid, d in drafts.items() if d})
        except BaseException:
            self._take_back(step)
            raise
        self._ended = []
        if plan.planned:                       # an idle call is not a step
            self.num_steps += 1
        return plan

    def _take_back(self, step: _Plan) -> None:
        """`schedule` raised: the requests it admitted leave `running`, give their KV back and
        wait again at the head of the queue, in their order, as they were; each running
        request it scheduled holds KV for what it has computed again (S09's `revert_plan`,
        the rule after a failed model step). What a retry would redo is kept: the requests
        it ended (they can never run; the next plan reports them) and those it preempted
        (they wait with nothing computed; their outputs are unchanged by the recompute)."""
        for request, status, num_cached in reversed(step.admitted):
            self.running.remove(request)
            self.kv.free(request)
            request.status, request.num_computed_tokens = status, 0
            request.num_cached_tokens = num_cached
            self.waiting.appendleft(request)
        revert_plan(self.running, SchedulerOutput(self.num_steps, step.scheduled, step.starts,
                                                  {}), self.kv, self.num_steps)
        self._ended = list(step.finished)

    def _schedule_running(self, step: _Plan) -> None:
        """The running requests, in admission order, each with its new tokens while the
        budget lasts; when one cannot get KV for them, preempt (`_victim`) until it can, or
        until it is the victim itself. One that outgrew the whole pool is ended."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            n = self.num_new_tokens(request, request.num_computed_tokens, step.budget)
            if n > step.budget:
                break
            if request.num_tokens > self.kv_capacity:   # held + all it has not computed:
                self.running.pop(i)                     # it can never run again
                self._end(request, step)
                continue
            while not self.kv.allocate_slots(request, n):
                victim = self._victim()
                at = self.running.index(victim)
                self.running.pop(at)
                step.drop(victim)
                self._preempt(victim)
                if victim is request:      # it was the one to go: it waits
                    break
                if at < i:
                    i -= 1
            if request.status == RequestStatus.PREEMPTED:
                continue     # the next running request may use what it freed (vLLM V1 stops)
            step.add(request, n, request.num_computed_tokens, step.running)
            i += 1

    def _schedule_waiting(self, step: _Plan) -> None:
        """Waiting requests in policy order while a seat, the budget, the admission policy
        (`admits`) and KV allow, the KV manager asked first for what its cache already holds
        (S13's prefix hit; nothing before). Stops at the first that does not fit: nobody
        overtakes the head."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_tokens > self.kv_capacity:   # a resumed request that outgrew it
                self.waiting.popleft()
                self._end(request, step)
                continue
            blocks, num_cached = self.kv.get_computed_blocks(request)   # S13's prefix hit
            n = self.num_new_tokens(request, num_cached, step.budget)
            if (n == 0 or n > step.budget or not self._admits(request, n)
                    or not self.kv.allocate_slots(request, n, blocks)):
                break
            step.admitted.append((request, request.status, request.num_cached_tokens))
            self.waiting.popleft()
            if request.status == RequestStatus.PREEMPTED:
                group = step.resumed
            else:
                group, request.num_cached_tokens = step.new, num_cached
            request.status, request.num_computed_tokens = RequestStatus.RUNNING, num_cached
            self.running.append(request)
            step.add(request, n, num_cached, group)

    def _schedule_drafts(self, step: _Plan) -> None:
        """S15's draft tokens, last: each running request scheduled for its decode token gets
        as many of its drafts as the budget left and the free KV hold, in admission order,
        and drops the rest. Drafts are a bet, so they take only what no real token needed:
        they never delay a decode or an admission, and never cost anyone a preemption."""
        for request in self.running:
            rid = request.request_id
            if not request.spec_token_ids:
                continue
            n = step.scheduled.get(rid)
            if n is None or step.starts[rid] + n != request.num_tokens:  # not its last token
                request.spec_token_ids, request.spec_draft_probs = [], None
                continue
            extra = min(len(request.spec_token_ids), step.budget)
            while extra and not self.kv.allocate_slots(request, extra):
                extra -= 1
            del request.spec_token_ids[extra:]
            if request.spec_draft_probs is not None:
                request.spec_draft_probs = (request.spec_draft_probs[:extra] if extra
                                            else None)
            step.scheduled[rid] += extra
            step.budget -= extra

    def update_from_output(self, plan: SchedulerOutput, finished_ids: Sequence[str] = (),
                           num_rejected: Mapping[str, int] | None = None) -> None:
        """After the model step: each scheduled request still running has computed its
        scheduled tokens but its num_rejected drafts (S15), and the KV manager names the
        blocks they filled (S13); then the requests in finished_ids (ended by the engine's
        stop rules) leave (S09's rules)."""
        record_computed(self.running, plan, self.kv, num_rejected)
        self.finish_requests(finished_ids)

    def revert(self, plan: SchedulerOutput) -> None:
        """The model step failed: KV back to what each request has computed, the step's number
        taken back (S09's `revert_plan`)."""
        self.num_steps = revert_plan(self.running, plan, self.kv, self.num_steps)

    # --- the rules -------------------------------------------------------------------------

    def num_new_tokens(self, request: Request, num_computed_tokens: int, budget: int) -> int:
        """Tokens the request computes when scheduled with `budget` tokens left in the step,
        starting after num_computed_tokens: here all it has not computed (the prompt, one
        decode token, or after a preemption prompt + outputs), whatever the budget (the
        caller checks it fits). The rule S11 changes, to cut a prompt into chunks. (S15's
        draft tokens are not counted here: `_schedule_drafts` gives them what is left.)"""
        return request.num_tokens - num_computed_tokens

    def admits(self, request: Request, num_new_tokens: int) -> bool:
        """The admission policy, asked for the head of the waiting queue once a seat and the
        token budget allow its num_new_tokens, before its KV is taken. Here: always yes, so
        a request joins whenever its tokens fit the free KV now, and preemption handles the
        steps in which the running requests outgrow it (vLLM V1's optimistic admission). A
        subclass may refuse, to keep KV aside for what the running requests will still
        decode (SGLang's conservative admission; the exercises write one). It must return a
        bool and must admit when nothing runs (`_admits` raises otherwise)."""
        return True

    def _admits(self, request: Request, num_new_tokens: int) -> bool:
        """`admits`, its answer checked: a bool (NumPy's too), or TypeError; and a refusal
        while nothing runs is a RuntimeError, since nothing would ever change its answer
        (no running request will finish and free KV): the queue would wait forever."""
        ok = self.admits(request, num_new_tokens)
        if not isinstance(ok, (bool, np.bool_)):
            raise TypeError(f"{type(self).__name__}.admits must return a bool (True: admit, "
                            f"False: wait) but returned {ok!r} ({type(ok).__name__}) for "
                            f"request {request.request_id!r}")
        if not ok and not self.running:
            raise RuntimeError(
                f"{type(self).__name__}.admits refused request {request.request_id!r} while "
                "no request is running: nothing will free KV or change its answer, so the "
                "policy can never make progress (it must admit the head of the queue when "
                "nothing runs)")
        return bool(ok)

    def _key(self, request: Request) -> tuple[int, int]:
        return (request.priority, request.arrival) if self.policy == "priority" else (
            0, request.arrival)

    def _victim(self) -> Request:
        """FCFS: the most recently admitted running request (the tail). Priority: the
        lowest priority (the largest value), then the latest arrival."""
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=self._key)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_draft_probs = [], None   # proposed for a decode
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._to_waiting(request, front=True)

    def _end(self, request: Request, step: _Plan) -> None:
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        step.finished.append(request.request_id)

    def _to_waiting(self, request: Request, front: bool) -> None:
        """FCFS: a new request at the back, a preempted one at the front. Priority: at its
        place in (priority, arrival) order, whichever it is."""
        if self.policy == "fcfs":
            (self.waiting.appendleft if front else self.waiting.append)(request)
            return
        key = self._key(request)
        at = next((k for k, r in enumerate(self.waiting) if self._key(r) > key),
                  len(self.waiting))
        self.waiting.insert(at, request)


# ---------------------------------------------------------------------------------------------
# The engine with this scheduler
# ---------------------------------------------------------------------------------------------

def build_engine(model, tokenizer, *, max_num_batched_tokens: int | None = None,
                 kv_capacity: int | None = None, policy: str = "fcfs",
                 **options) -> s09.LLMEngine:
    """S09's engine with `Scheduler` over a `TokenKVPool`: S09's components otherwise.
    max_num_batched_tokens: tokens per step, >= the context (default: max_num_seqs x the
    context, no limit); kv_capacity: KV token positions in all, 1 to max_num_seqs x the
    context (default: all of them, so nothing is preempted unless asked); policy: "fcfs" or
    "priority". options: S09's `EngineConfig` fields. Raises ParameterError naming the
    option."""
    config = s09.EngineConfig.of(model, options)
    processor = s09.make_processor(model, tokenizer, config)
    scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_context,
                                       max_num_batched_tokens, policy)
    kv = TokenKVPool(config.max_num_seqs, config.max_context, kv_capacity)
    runner = s09.slot_runner(model, config)     # the slots' memory is checked there
    return s09.LLMEngine(config, processor, Scheduler(scheduler_config, kv), runner)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

# Columns of `format_schedule_table` that list ids: (header, StepRecord field, widest cell).
TABLE_ID_COLUMNS = (("running, admission order (tokens)", "running", 56),
                    ("joined", "joined", 24), ("resumed", "resumed", 24),
                    ("preempted", "preempted", 24), ("left", "left", 24))


def format_schedule_table(records: Sequence, max_rows: int = 40) -> str:
    """S09's trace records as aligned text, one line per step: step, tokens / budget, the
    running ids in the scheduler's order (admission order, so FCFS's next victim is the
    last) with their scheduled tokens when more than 1, joined, resumed, preempted, left,
    waiting, KV used / capacity. Each column is as wide as its widest cell, up to a limit; a
    cell past it shows how many ids it holds and is cut with "…" (`fit_ids`). A trace
    longer than max_rows shows its first and last max_rows // 2 steps and says how many it
    left out. Raises ValueError for max_rows that is not an integer >= 2."""
    from s08_cli import elide, fit_ids, render_table
    shown = [r for r in elide(list(records), max_rows) if r is not None]

    def cells(r) -> dict[str, list[str]]:
        out = {"running": [f"{rid}({n})" if n > 1 else rid
                           for rid, n in zip(r.running, r.num_scheduled_tokens)]}
        out.update({name: list(getattr(r, name)) for _, name, _ in TABLE_ID_COLUMNS[1:]})
        return out

    widths = {name: min(limit, max([len(header)] + [len(",".join(cells(r)[name]))
                                                    for r in shown]))
              for header, name, limit in TABLE_ID_COLUMNS}

    def render(r) -> str:
        row = cells(r)
        ids = " ".join(f"{fit_ids(row[name], widths[name]):<{widths[name]}}"
                       for _, name, _ in TABLE_ID_COLUMNS)
        return (f"{r.step:>5} {f'{r.num_tokens}/{r.token_budget}':>11} {ids} {r.waiting:>7} "
                f"{f'{r.kv_used_tokens}/{r.kv_capacity}':>9}")

    ids_header = " ".join(f"{header:<{widths[name]}}" for header, name, _ in TABLE_ID_COLUMNS)
    return render_table(f"{'step':>5} {'tokens':>11} {ids_header} {'waiting':>7} "
                        f"{'KV used':>9}", records, render, max_rows)


def add_scheduler_arguments(parser, kv_capacity: bool = True,
                            budget_help: str = "most tokens per step, >= the context (default: "
                                               "max-num-seqs x the context, no limit)") -> None:
    """The scheduler's flags, shared by S10's to S13's scripts: the token budget, the KV
    capacity in tokens (kv_capacity=False for the paged engines, whose pool is counted in
    blocks), the policy and each request's priority."""
    import s08_cli
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help=budget_help)
    if kv_capacity:
        parser.add_argument("--kv-capacity", type=int, default=None,
                            help="KV token positions in all; small values force preemptions "
                                 "(default: max-num-seqs x the context, none)")
    parser.add_argument("--policy", default="fcfs", choices=POLICIES,
                        help="scheduling policy (default: %(default)s)")
    parser.add_argument("--priorities", type=s08_cli.priority_list, default=None,
                        help="comma-separated integer priority of each request, lower first; "
                             "only with --policy priority (fcfs ignores priorities, so it "
                             "refuses them) (default: all 0)")


def check_scheduler_arguments(parser, args) -> None:
    """--priorities only under --policy priority (FCFS would silently ignore them)."""
    if args.priorities is not None and args.policy != "priority":
        parser.error("--priorities needs --policy priority (fcfs ignores priorities)")


def preemption_note(rid: str, run, tracers) -> str:
    """How often a request was preempted, in words."""
    request = run.requests.get(rid)
    n = 0 if request is None else request.num_preemptions
    return {0: "not preempted", 1: "preempted once"}.get(n, f"preempted {n} times")


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 10: the scheduler, token budgets, KV capacity and preemption.", build_engine,
        add_arguments=add_scheduler_arguments, check=check_scheduler_arguments,
        options=lambda args: dict(max_num_batched_tokens=args.max_num_batched_tokens,
                                  kv_capacity=args.kv_capacity, policy=args.policy),
        tracers=lambda engine: [s09_trace.StepTracer()],
        describe=lambda engine, tracers: (
            f"{engine.scheduler.max_num_batched_tokens} tokens per step, KV capacity "
            f"{engine.scheduler.kv_capacity} tokens, policy {engine.scheduler.policy}; "
            f"{engine.scheduler.num_preemptions} preemptions"),
        note=preemption_note,
        table=lambda run, tracers: format_schedule_table(tracers[0].records)), argv)


if __name__ == "__main__":
    sys.exit(main())
