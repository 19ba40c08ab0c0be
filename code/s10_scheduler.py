"""S10, the scheduler: who runs in each step and how many tokens, tested without a model.

What is new since S09
    S09 admits waiting requests FIFO into free slots and runs every running request's new
    tokens in every step. Here the decision is a component of its own, `Scheduler`, with
    vLLM V1's interface: `add_request(request)`, `schedule() -> SchedulerOutput` (which
    requests run in this step and how many tokens each, who was preempted, who was ended),
    `update_from_output(output, finished_ids)` after the model step, `abort(request_id)`,
    `has_unfinished_requests()`. It knows nothing of models or tensors: any object with
    `request_id`, `prompt_ids`, `token_ids` (prompt + outputs so far) and
    `num_computed_tokens` can be scheduled, so the tests drive it with a stand-in request and
    a fake model step. code/s10_engine.py drives S09's engine with it.

    - Budgets per step: at most `max_num_seqs` requests running, at most
      `max_num_batched_tokens` tokens scheduled, and KV for every computed token inside
      `kv_capacity` tokens (`TokenKVPool`: `allocate_slots` / `free`, the interface of vLLM
      V1's `KVCacheManager`, which S12 replaces with a block pool).
    - Order (vLLM V1's): first the running requests, in the order they were admitted, one
      token each; then, if nobody was preempted in this step, waiting requests in policy
      order while seats, tokens and KV allow, stopping at the first that does not fit (no
      skipping, so the order holds).
    - Preemption by recompute: when a running request cannot get KV for its next token, the
      most recently admitted running request (under "priority": the lowest priority, then
      the latest arrival) is preempted: its KV freed, `num_computed_tokens = 0`, back to the
      front of the waiting queue (under "priority": to its place in priority order); if the
      victim is the request itself, it waits and the next running request goes on. When it
      runs again it computes its prompt and every token it had generated in one step, and
      samples its next token from the last of them.
    - A request that can never fit: `add_request` refuses a prompt longer than kv_capacity
      (ValueError: such a request would wait at the head of the queue forever, blocking
      everyone behind it, vLLM PR #1534); a running request whose next step would need more
      KV than the whole capacity is ended (`SchedulerOutput.finished_ids`; the engine calls it
      finish_reason "length": the capacity is its context limit).
    - Policies: "fcfs" (default) and "priority" (vLLM's: lower value first, ties by arrival).
      Priority can starve: a steady stream of high-priority arrivals keeps low-priority
      requests waiting (the benchmark measures it).

What it does not handle yet
    A prompt runs whole in one step, so max_num_batched_tokens must be >= max_model_len
    (vLLM V0's rule without chunked prefill; S11 chunks prompts and lifts it). KV is counted
    in tokens, not stored in blocks (S12); no prefix sharing (S13). Waiting requests never
    preempt running ones, whatever their priority.

Run it
    python code/s10_scheduler.py --kv-capacity 96 --max-num-seqs 4  # preemptions, traced
    python benchmarks/bench_s10_scheduler.py --quick                 # KV capacity and policy

Tests
    tests/test_s10_scheduler.py: budgets and max_num_seqs never exceeded; FCFS and priority
    order; the victim of a preemption; a resumed request recomputes prompt + outputs, and the
    fake model's tokens equal a run with unbounded capacity; abort from either queue; the
    public bugs G1 (a prompt that can never fit), G5 (idle means all KV free).
    tests/test_s10_properties.py: hypothesis state machine over add / abort / step.
    tests/test_s10_engine.py: the engine, with real models.

References
    vLLM V1 `Scheduler.schedule` / `update_from_output` / `finish_requests` and
    `KVCacheManager.allocate_slots` (vllm/v1/core/sched/scheduler.py); vLLM (Kwon et al.,
    SOSP 2023) for preemption by recompute; nano-vllm's `Scheduler` (`preempt`, running
    requests before waiting ones).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import s01_generation_loop as s01

POLICIES = ("fcfs", "priority")
WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"


class TokenKVPool:
    """KV capacity counted in tokens: each request holds some of `capacity` token positions.

    `allocate_slots(request_id, num_new_tokens)` gives a request room for num_new_tokens more
    tokens, all or nothing (False, nothing taken, when fewer are free); `free(request_id)`
    gives back everything it holds. S12 replaces this with a block pool of the same interface
    (vLLM V1's `KVCacheManager.allocate_slots` / `free`). Raises ValueError for a capacity
    that is not an integer >= 1 and for a negative or non-integer count.
    """

    def __init__(self, capacity: int):
        if not s01.is_int(capacity) or capacity < 1:
            raise ValueError(f"kv_capacity must be an integer >= 1 (got {capacity!r})")
        self.capacity = int(capacity)
        self.held: dict[str, int] = {}          # request id -> tokens it holds

    @property
    def num_used_tokens(self) -> int:
        return sum(self.held.values())

    @property
    def num_free_tokens(self) -> int:
        return self.capacity - self.num_used_tokens

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request holds (0 for one that holds none)."""
        return self.held.get(request_id, 0)

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        if not s01.is_int(num_new_tokens) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0 (got {num_new_tokens!r})")
        if num_new_tokens > self.num_free_tokens:
            return False
        self.held[request_id] = self.held.get(request_id, 0) + int(num_new_tokens)
        return True

    def free(self, request_id: str) -> int:
        """Give back everything the request holds; returns how many tokens that was."""
        return self.held.pop(request_id, 0)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """The request holds num_tokens (its computed ones) again: `Scheduler.revert`'s
        seam, which S12's block manager overrides to keep the blocks those tokens are in."""
        self.free(request_id)
        self.allocate_slots(request_id, num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan (vLLM V1's `SchedulerOutput`, trimmed).

    step: the step's number, counted by the scheduler (`Scheduler.num_steps` before the call):
    a `schedule` that plans nothing (nobody scheduled, preempted or ended) does not count, and
    `revert` takes a failed step's number back, so the engine's `StepRecord.step` of the same
    step is the same number. num_scheduled_tokens: {request id: tokens it computes in this
    step}, in schedule order (running requests first, in admission order, then those
    admitted). num_computed_tokens: {request id: its num_computed_tokens when scheduled},
    so its new tokens are token_ids[start:start + n].
    scheduled_running_ids / scheduled_new_ids / scheduled_resumed_ids: the scheduled requests
    that were already running (a decode, 1 token), admitted for the first time (the whole
    prompt) and admitted again after a preemption (prompt + every output so far).
    preempted_ids: preempted in this step, in the order it happened. finished_ids: ended by
    the scheduler in this step because their next step would need more KV than kv_capacity
    (the engine's finish_reason "length"). token_budget: max_num_batched_tokens;
    total_num_scheduled_tokens: the part of it used. kv_used_tokens / kv_free_tokens: the
    pool after scheduling. num_waiting: the waiting queue after scheduling.
    """

    step: int
    num_scheduled_tokens: dict[str, int]
    num_computed_tokens: dict[str, int]
    scheduled_running_ids: tuple[str, ...]
    scheduled_new_ids: tuple[str, ...]
    scheduled_resumed_ids: tuple[str, ...]
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    token_budget: int
    kv_used_tokens: int
    kv_free_tokens: int
    num_waiting: int

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_ids(self) -> tuple[str, ...]:
        return tuple(self.num_scheduled_tokens)


@dataclass
class _Ids:
    """The lists one `schedule` call fills in."""

    running: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


class Scheduler:
    """The model-free scheduler: queues, token budget, KV capacity, preemption, policy.

    max_num_seqs: the most requests running at once. max_num_batched_tokens: the most tokens
    scheduled in one step (must be >= max_model_len, see the module docstring).
    kv_capacity: KV token positions in all (`TokenKVPool`). max_model_len: the longest
    context a request may have. policy: "fcfs" or "priority".

    State: `waiting` (deque, in policy order), `running` (list, in admission order), `kv`
    (the pool). A request is in at most one queue; its status is one of "waiting", "running",
    "preempted" (waiting again, holding nothing) and "finished". The scheduler sets on each
    request it is given: status, priority, arrival (the order of add_request calls) and
    num_preemptions. Raises ValueError naming the rule for bad arguments, before anything
    changes.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity: int,
                 max_model_len: int, policy: str = "fcfs"):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        self.check_token_budget(max_num_batched_tokens, max_model_len, max_num_seqs)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} (got {policy!r})")
        self.kv = self.make_kv_pool(kv_capacity)
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_model_len = int(max_model_len)
        self.policy = policy
        self.waiting: deque = deque()
        self.running: list = []
        self.num_steps = 0                    # steps planned (not the idle calls)
        self.num_preemptions = 0              # in all, since construction
        self._arrivals = 0

    def check_token_budget(self, max_num_batched_tokens: int, max_model_len: int,
                           max_num_seqs: int) -> None:
        """The budget's rule (the seam S11 overrides): a prompt, or a preempted request's
        recompute, runs whole in one step, so the budget must hold the longest context."""
        if max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}): without chunked prefill (S11) a prompt, or a preempted "
                "request's recompute, runs whole in one step")

    def make_kv_pool(self, kv_capacity: int) -> TokenKVPool:
        """The KV accounting (the seam S12 overrides with its block pool)."""
        return TokenKVPool(kv_capacity)

    @property
    def kv_capacity(self) -> int:
        return self.kv.capacity

    # --- requests in and out ---------------------------------------------------------------

    def add_request(self, request, priority: int = 0) -> None:
        """Queue a request (its num_computed_tokens must be 0). Raises ValueError, queueing
        nothing, for an id already held, a priority that is not an integer, an empty prompt,
        a prompt longer than max_model_len, or one longer than kv_capacity: it could never
        be scheduled and would block every request behind it (vLLM PR #1534)."""
        rid = request.request_id
        if any(r.request_id == rid for r in (*self.waiting, *self.running)):
            raise ValueError(f"request_id {rid!r} is already queued")
        if not s01.is_int(priority):
            raise ValueError(f"priority must be an integer (lower runs first) (got "
                             f"{priority!r})")
        n = len(request.token_ids)
        if not request.prompt_ids or request.num_computed_tokens != 0:
            raise ValueError("a new request needs a prompt and num_computed_tokens == 0")
        if n > self.max_model_len:
            raise ValueError(f"request {rid!r} has {n} tokens but max_model_len is "
                             f"{self.max_model_len}")
        if n > self.kv_capacity:
            raise ValueError(f"prompt is {n} tokens but kv_capacity is {self.kv_capacity} "
                             "tokens: it could never be scheduled (it would block every "
                             "request behind it)")
        request.priority, request.arrival = int(priority), self._arrivals
        request.num_preemptions, request.status = 0, WAITING
        self._arrivals += 1
        self._to_waiting(request, front=False)

    def abort(self, request_id: str) -> bool:
        """Take a request out of whichever queue holds it and free its KV; False when no
        queue holds it (unknown or already finished)."""
        return bool(self.finish_requests([request_id]))

    def finish_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Take each request out of its queue, free its KV, status "finished" (vLLM V1's
        `finish_requests`). Ids no queue holds are skipped. Returns those taken out."""
        done = []
        for rid in request_ids:
            for queue in (self.running, self.waiting):
                request = next((r for r in queue if r.request_id == rid), None)
                if request is not None:
                    queue.remove(request)
                    self.kv.free(rid)
                    request.status = FINISHED
                    done.append(rid)
                    break
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (in admission order, one token each, with
        preemption when KV runs out), then, if nobody was preempted, waiting requests in
        policy order while max_num_seqs, the token budget and KV allow. See the module
        docstring for the rules; the KV for every scheduled token is allocated here."""
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        starts: dict[str, int] = {}
        ids = _Ids()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            rid, n = request.request_id, self.num_new_tokens(request, budget)
            if n > budget:
                break
            if len(request.token_ids) > self.kv_capacity:   # held + all it has not computed:
                self.running.pop(i)                          # it can never run again
                self._end(request, ids)
                continue
            while not self.kv.allocate_slots(rid, n):
                victim = self._victim()
                at = self.running.index(victim)
                self.running.pop(at)
                budget += scheduled.pop(victim.request_id, 0)    # it may have been scheduled
                starts.pop(victim.request_id, None)
                for group in (ids.running, ids.new, ids.resumed):
                    if victim.request_id in group:
                        group.remove(victim.request_id)
                self._preempt(victim)
                ids.preempted.append(victim.request_id)
                if victim is request:      # it was the one to go: it waits
                    break
                if at < i:
                    i -= 1
            if request.status == PREEMPTED:
                continue     # the next running request may use what it freed (vLLM V1 stops)
            scheduled[rid], starts[rid] = n, request.num_computed_tokens
            ids.running.append(rid)
            budget -= n
            i += 1
        while not ids.preempted and self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            rid, n = request.request_id, self.num_new_tokens(request, budget)
            if len(request.token_ids) > self.kv_capacity:   # a resumed request that outgrew it
                self.waiting.popleft()
                self._end(request, ids)
                continue
            if n == 0 or n > budget or not self.kv.allocate_slots(rid, n):
                break                          # strict order: nobody overtakes the head
            self.waiting.popleft()
            (ids.resumed if request.status == PREEMPTED else ids.new).append(rid)
            request.status = RUNNING
            self.running.append(request)
            scheduled[rid], starts[rid] = n, request.num_computed_tokens
            budget -= n
        out = SchedulerOutput(
            self.num_steps, scheduled, starts, tuple(ids.running), tuple(ids.new),
            tuple(ids.resumed), tuple(ids.preempted), tuple(ids.finished),
            self.max_num_batched_tokens, self.kv.num_used_tokens, self.kv.num_free_tokens,
            len(self.waiting))
        if scheduled or ids.preempted or ids.finished:   # an idle call is not a step
            self.num_steps += 1
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           finished_ids: Iterable[str] = ()) -> None:
        """After the model step: each scheduled request still held has computed its
        scheduled tokens (num_computed_tokens = its start + n); then the requests in
        finished_ids (ended by the caller's stop rules) leave and free their KV."""
        held = {r.request_id: r for r in self.running}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            if rid in held:
                held[rid].num_computed_tokens = scheduler_output.num_computed_tokens[rid] + n
        self.finish_requests(finished_ids)

    def revert(self, scheduler_output: SchedulerOutput) -> None:
        """The model step failed: each scheduled request still running holds KV for its
        computed tokens only again (its num_computed_tokens did not move), so the next
        `schedule` asks for the same tokens without holding them twice; the step's number is
        taken back (the next plan has it)."""
        if scheduler_output.step == self.num_steps - 1:
            self.num_steps -= 1
        for request in self.running:
            rid = request.request_id
            if rid in scheduler_output.num_scheduled_tokens:
                self.kv.trim(rid, request.num_computed_tokens)

    # --- helpers ---------------------------------------------------------------------------

    def num_new_tokens(self, request, budget: int) -> int:
        """Tokens the request computes when scheduled with `budget` tokens left in the step:
        here all it has not computed (the prompt, one decode token, or after a preemption
        prompt + outputs), whatever the budget (the caller checks it fits). The seam S11
        overrides to cut a prompt into chunks."""
        return len(request.token_ids) - request.num_computed_tokens

    def _key(self, request) -> tuple[int, int]:
        return (request.priority, request.arrival) if self.policy == "priority" else (
            0, request.arrival)

    def _victim(self):
        """FCFS: the most recently admitted running request (the tail). Priority: the
        lowest priority (the largest value), then the latest arrival."""
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=self._key)

    def _preempt(self, request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = PREEMPTED
        self._to_waiting(request, front=True)

    def _end(self, request, ids: _Ids) -> None:
        self.kv.free(request.request_id)
        request.status = FINISHED
        ids.finished.append(request.request_id)

    def _to_waiting(self, request, front: bool) -> None:
        """FCFS: a new request at the back, a preempted one at the front. Priority: at its
        place in (priority, arrival) order, whichever it is."""
        if self.policy == "fcfs":
            (self.waiting.appendleft if front else self.waiting.append)(request)
            return
        key = self._key(request)
        at = next((k for k, r in enumerate(self.waiting) if self._key(r) > key),
                  len(self.waiting))
        self.waiting.insert(at, request)


if __name__ == "__main__":   # the chapter's command line is its engine's (code/s10_engine.py)
    import sys

    from s10_engine import main
    sys.exit(main())
