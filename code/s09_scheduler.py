"""S09's scheduler side: the request, the step's plan, the KV slots' books, FIFO admission.

What is here
    code/s09_continuous_batching.py's engine asks a scheduler, every step, which requests run
    and how many tokens each. This module holds what that conversation is made of, and S09's
    own scheduler:

    - `Request` (vLLM's, vllm/v1/request.py): the id, Part I's `Sequence` (`seq`) by
      composition, arrival, priority, cache_salt, status (`RequestStatus`), the counts the
      scheduler keeps (num_computed_tokens, num_preemptions, num_cached_tokens) and
      block_hashes (S13). Later chapters use these fields; none adds one.
    - `SchedulerOutput`, the plan the scheduler hands the runner (vLLM's name): each scheduled
      request's tokens, where they start, its KV blocks; who was admitted, resumed,
      preempted or ended.
    - `SlotKVManager`: which request holds which KV slot (the bookkeeping; the tensors are
      the runner's `SlotKVCache`), with the interface every KV manager of the course has
      (`allocate_slots`, `free`, `trim`, `check_fits`, and S13's `get_computed_blocks` /
      `cache_blocks`, which do nothing here).
    - `FIFOScheduler`: every running request computes what it has not computed; waiting
      requests are admitted in arrival order while seats and slots allow. The rules every
      scheduler shares (`record_computed`, `take_out`, `revert_plan`) are functions S10's
      `Scheduler` calls too.

What it does not handle
    No token budget, no preemption, no priority (S10's `Scheduler`); KV in whole slots of
    max_context positions (S12's block manager).

Tests
    tests/test_s09_continuous_batching.py (with the engine), tests/test_s10_scheduler.py
    (S10's scheduler on the same interface).

References
    vLLM V1 `Request` / `RequestStatus` (vllm/v1/request.py), `SchedulerOutput`
    (vllm/v1/core/sched/output.py), `KVCacheManager` (vllm/v1/core/kv_cache_manager.py);
    nano-vllm's `Sequence` and `Scheduler`.
"""
from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import s01_generation_loop as s01
from s01_generation_loop import ParameterError


class RequestStatus(enum.StrEnum):
    """Where a request is (vLLM's `RequestStatus`, its finished states folded into one: the
    finish_reason says why). A str, so `status == "waiting"` reads as it looks."""

    WAITING = "waiting"        # queued, holding no KV
    RUNNING = "running"        # admitted: holds KV and is scheduled in steps
    PREEMPTED = "preempted"    # waiting again after a preemption (S10), holding no KV
    FINISHED = "finished"      # ended: stopped, length, aborted


def check_cache_salt(cache_salt) -> None:
    """None (no salt) or a non-empty string that UTF-8 can encode (a lone surrogate, which
    JSON's "\\ud800" decodes to, cannot). Raises ParameterError (parameter "cache_salt")."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ParameterError(f"cache_salt must be a non-empty string or None (got "
                             f"{cache_salt!r})", "cache_salt")
    if cache_salt is not None:
        s01.check_text(cache_salt, "cache_salt")


# ---------------------------------------------------------------------------------------------
# A request, what a step returns for it, and a step's plan
# ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Request:
    """One request inside the engine (vLLM's `Request`).

    request_id: its id. seq: Part I's `Sequence`, by composition: prompt and output ids,
    SamplingParams, seeded sampler, detokenizer, stop matcher, logprobs, text, finish_reason.
    arrival: the order of add_request calls (ties in priority go to the earlier). priority:
    an int, lower first (S10's "priority" policy). cache_salt: None or a non-empty str;
    requests with different salts never share cached KV (S13). status: `RequestStatus`.
    num_computed_tokens: how many of token_ids have KV in the cache, written by the scheduler
    only (after each step, at a prefix hit, at a preemption). num_preemptions: times it was
    preempted (S10). num_cached_tokens: prompt tokens found in the prefix cache when it was
    first admitted (S13; 0 before). block_hashes: the names of its full KV blocks (S13).
    spec_token_ids: the draft tokens proposed to follow token_ids, verified in the next step
    (S15; empty before), and spec_draft_probs the distributions they were drawn from, float32
    (len(spec_token_ids), V) on the device, or None for drafts drawn deterministically
    (n-gram lookup, a greedy draft): written by the engine from its proposer, read and
    cleared by the scheduler (vLLM's `Request.spec_token_ids`). num_output_placeholders: the
    tokens a step in flight will sample for it, counted in num_tokens before they are known
    (S16's async scheduling; 0 otherwise; vLLM's name).
    Raises ParameterError for a priority that is not an int or a bad cache_salt.
    """

    request_id: str
    seq: s01.Sequence
    arrival: int = 0
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: object = None
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        if not s01.is_int(self.priority):
            raise ParameterError(f"priority must be an integer (lower runs first) (got "
                                 f"{self.priority!r})", "priority", self.priority)
        self.priority = int(self.priority)
        check_cache_salt(self.cache_salt)

    @classmethod
    def for_tokens(cls, request_id: str, prompt_ids: Sequence[int], max_tokens: int = 16,
                   **fields) -> "Request":
        """A model-free request (no detokenizer, no sampler): what the scheduler tests and
        notebooks drive a scheduler with, appending tokens themselves (`append_token`)."""
        seq = s01.Sequence(request_id, list(prompt_ids), s01.GenerationParams(
            max_tokens=max_tokens), eos_ids=frozenset(), generator=None, detokenizer=None)
        return cls(request_id, seq, **fields)

    @property
    def prompt_ids(self) -> list[int]:
        return self.seq.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output: the context the model continues."""
        return self.seq.token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, with the output tokens still in flight (S16)."""
        return len(self.seq.token_ids) + self.num_output_placeholders

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens with the draft tokens to verify (S15): what a running request computes up to."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def params(self):
        return self.seq.params

    @property
    def finished(self) -> bool:
        return self.seq.finished

    def append_token(self, token_id: int) -> None:
        self.seq.append(token_id)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan, what the runner needs to compute it (vLLM's `SchedulerOutput`).

    step: the step's number, counted by the scheduler (a plan with nothing in it does not
    count; a failed step's number is taken back). num_scheduled_tokens: {request id: tokens
    it computes in this step}, in schedule order. num_computed_tokens: {request id: its
    num_computed_tokens when scheduled}: its new tokens are token_ids[start:start + n].
    block_tables: {request id: its KV block ids after scheduling} (S09-S11: its one slot).
    scheduled_new_ids / scheduled_resumed_ids / scheduled_running_ids: the scheduled requests
    admitted for the first time, admitted again after a preemption (S10), and already running.
    preempted_ids: preempted in this step (S10). finished_ids: ended by the scheduler in this
    step (S10: their next step would need more KV than the pool has; finish_reason
    "length"). new_block_ids: blocks this plan took from the free queue, whose storage the
    runner zeroes before writing (S12; empty before). scheduled_spec_decode_tokens:
    {request id: the draft tokens it verifies in this step} (S15; vLLM's name), the last of
    its scheduled tokens: a request's new tokens are then (token_ids + drafts)[start:start
    + n], and its logits come for its last 1 + len(drafts) positions.
    """

    step: int
    num_scheduled_tokens: dict[str, int]
    num_computed_tokens: dict[str, int]
    block_tables: dict[str, tuple[int, ...]]
    scheduled_new_ids: tuple[str, ...] = ()
    scheduled_resumed_ids: tuple[str, ...] = ()
    scheduled_running_ids: tuple[str, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()
    new_block_ids: tuple[int, ...] = ()
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_ids(self) -> tuple[str, ...]:
        return tuple(self.num_scheduled_tokens)

    @property
    def planned(self) -> bool:
        """Whether the plan does anything (runs a request, preempts or ends one)."""
        return bool(self.num_scheduled_tokens or self.preempted_ids or self.finished_ids)


# ---------------------------------------------------------------------------------------------
# The scheduler side: KV slots and FIFO admission
# ---------------------------------------------------------------------------------------------

class SlotKVManager:
    """Which request holds which KV slot: num_slots slots of slot_size positions, the free
    ones lowest first (vLLM's `KVCacheManager` interface, with a slot as a request's one
    block). The storage is the runner's (`SlotKVCache`); this is the bookkeeping.

    `allocate_slots(request, n)`: room for n more tokens, a slot on the first call; False,
    nothing taken, when no slot is free or the slot would overflow. `free(request)`: the slot
    back. `trim(request, t)`: it holds t tokens again (a failed step's revert).
    `block_table(rid)`: (slot,). `check_fits(n)`: the rule a prompt of n tokens must meet to
    ever run. `get_computed_blocks` and `cache_blocks` are the prefix cache's (S13): nothing
    is cached here. Raises ValueError for sizes that are not integers >= 1.
    """

    def __init__(self, num_slots: int, slot_size: int):
        for name, value in (("num_slots", num_slots), ("slot_size", slot_size)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        self.num_slots, self.slot_size = int(num_slots), int(slot_size)
        # The free slots: those given back (a heap) and all from `_unused` on, never taken
        # yet (so building a manager of many slots costs nothing); the lowest is taken first.
        self._given_back: list[int] = []
        self._unused = 0
        self.slots: dict[str, int] = {}        # request id -> its slot
        self.tokens: dict[str, int] = {}       # request id -> tokens it holds
        self.num_used_tokens = 0               # their sum, kept as they change

    @property
    def capacity(self) -> int:
        """Token positions in all."""
        return self.num_slots * self.slot_size

    @property
    def num_free_tokens(self) -> int:
        return self.capacity - self.num_used_tokens

    def num_tokens(self, request_id: str) -> int:
        return self.tokens.get(request_id, 0)

    @property
    def free_slots(self) -> list[int]:
        """The free slots, lowest first (all of them: a list as long as they are many)."""
        return sorted(self._given_back) + list(range(self._unused, self.num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._given_back) + self.num_slots - self._unused

    def check_fits(self, num_tokens: int) -> None:
        """A prompt of num_tokens tokens fits one slot, or it could never run
        (ParameterError, parameter "prompt")."""
        if num_tokens > self.slot_size:
            raise ParameterError(f"prompt is {num_tokens} tokens but a KV slot holds "
                                 f"{self.slot_size}: it could never run", "prompt")

    def get_computed_blocks(self, request) -> tuple[list, int]:
        """(blocks, tokens) of the request's prompt already in the cache: none (S13 caches)."""
        return [], 0

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks=()) -> bool:
        """Room for num_new_tokens more tokens of the request, in its slot (the lowest free
        one on its first call); False, nothing taken, when no slot is free or the slot
        would overflow. computed_blocks: S13's prefix hit, nothing here."""
        rid = request.request_id
        held = self.tokens.get(rid, 0) + num_new_tokens
        if held > self.slot_size or (rid not in self.slots and not self.num_free_slots):
            return False
        if rid not in self.slots:
            if self._given_back:         # every slot given back is below `_unused`
                self.slots[rid] = heapq.heappop(self._given_back)
            else:
                self.slots[rid], self._unused = self._unused, self._unused + 1
        self.num_used_tokens += num_new_tokens
        self.tokens[rid] = held
        return True

    def free(self, request) -> None:
        """The request's slot back to the free list, its tokens forgotten (nothing for a
        request that holds no slot)."""
        rid = request.request_id
        slot = self.slots.pop(rid, None)
        self.num_used_tokens -= self.tokens.pop(rid, 0)
        if slot is not None:
            heapq.heappush(self._given_back, slot)

    def trim(self, request, num_tokens: int) -> None:
        """The request holds num_tokens tokens again (no more than it held), in its slot."""
        held = self.tokens.get(request.request_id)
        if held is not None and num_tokens < held:
            self.num_used_tokens -= held - num_tokens
            self.tokens[request.request_id] = num_tokens

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Name the request's full blocks among its first num_tokens (S13): nothing here."""

    def block_table(self, request_id: str) -> tuple[int, ...]:
        slot = self.slots.get(request_id)
        return () if slot is None else (slot,)

    def take_new_blocks(self) -> tuple[int, ...]:
        """Blocks taken since the last call, to be zeroed (S12): a slot is not zeroed."""
        return ()


def record_computed(running: Sequence[Request], plan: SchedulerOutput, kv,
                    num_rejected: Mapping[str, int] | None = None) -> None:
    """`update_from_output`'s rule, every scheduler's: each scheduled request still running
    has computed its scheduled tokens (num_computed_tokens = its start + n), and the KV
    manager may name the blocks they filled (S13's prefix cache; nothing before). With
    speculative decoding (S15), num_rejected[rid] of its scheduled draft tokens were
    rejected: their positions hold KV of tokens that are not the request's, so it has
    computed n - num_rejected tokens and the KV manager trims what it held for the rest
    (S12: blocks past the last computed token go back). Its drafts are spent either way."""
    num_rejected = num_rejected or {}
    for request in running:
        rid = request.request_id
        n = plan.num_scheduled_tokens.get(rid)
        if n is not None:
            rejected = num_rejected.get(rid, 0)
            request.num_computed_tokens = plan.num_computed_tokens[rid] + n - rejected
            if rejected:
                kv.trim(request, request.num_computed_tokens)
            request.spec_token_ids, request.spec_draft_probs = [], None
            kv.cache_blocks(request, request.num_computed_tokens)


def scheduled_drafts(request: Request, num_computed_tokens: int, n: int) -> tuple[int, ...]:
    """The draft tokens among a request's n scheduled tokens from num_computed_tokens (S15):
    those of its spec_token_ids that fall inside them (all, or the first few when a budget cut
    the step short); () when it has none."""
    num_drafts = num_computed_tokens + n - request.num_tokens
    return tuple(request.spec_token_ids[:num_drafts]) if num_drafts > 0 else ()


def take_out(queues: Sequence[list], request_ids: Sequence[str], kv) -> list[str]:
    """`finish_requests`'s rule, every scheduler's: each request with one of these ids leaves
    its queue, frees its KV and is finished. Returns the ids taken out. The queues are
    searched in order until every id is found: a step's finished requests, all running, cost
    no scan of the waiting queue."""
    ids, done = set(request_ids), []
    for queue in queues:
        if len(done) == len(ids):
            break
        for request in [r for r in queue if r.request_id in ids]:
            queue.remove(request)
            kv.free(request)
            request.status = RequestStatus.FINISHED
            done.append(request.request_id)
    return done


def revert_plan(running: Sequence[Request], plan: SchedulerOutput, kv, num_steps: int) -> int:
    """`revert`'s rule, every scheduler's, after a model step failed: each scheduled request
    still running holds KV for what it has computed only (its num_computed_tokens did not
    move, so the next plan asks for the same tokens without holding them twice). Returns
    the step count with the failed step's number taken back."""
    for request in running:
        if request.request_id in plan.num_scheduled_tokens:
            kv.trim(request, request.num_computed_tokens)
    return num_steps - 1 if plan.planned and plan.step == num_steps - 1 else num_steps


class FIFOScheduler:
    """S09's scheduler: every running request computes all it has not computed (its whole
    prompt when admitted, then one token a step), and waiting requests are admitted in
    arrival order while fewer than max_num_seqs run and the KV manager gives them room.

    The interface the engine uses (S10's `Scheduler` has the same): `check_request`,
    `add_request`, `schedule() -> SchedulerOutput`, `update_from_output(plan, finished_ids)`,
    `finish_requests(ids)`, `revert(plan)`, `has_unfinished_requests()`; `waiting` (deque),
    `running` (list, admission order), `kv` (the manager), `num_steps`. Raises
    ParameterError for a max_num_seqs that is not an integer >= 1.
    """

    max_num_batched_tokens = None    # no token budget (S10's has one): all running tokens run

    def __init__(self, max_num_seqs: int, kv: SlotKVManager):
        if not s01.is_int(max_num_seqs) or max_num_seqs < 1:
            raise ParameterError(f"max_num_seqs must be an integer >= 1 (got "
                                 f"{max_num_seqs!r})", "max_num_seqs", max_num_seqs)
        self.max_num_seqs, self.kv = int(max_num_seqs), kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0

    def check_request(self, request: Request) -> None:
        """The rules a request must meet to ever run (here: its prompt fits a slot)."""
        self.kv.check_fits(request.num_tokens)

    def add_request(self, request: Request) -> None:
        assert request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        for request in self.running:   # what it has not computed: the token sampled last step
            fits = self.kv.allocate_slots(request, request.num_tokens_with_spec
                                          - request.num_computed_tokens)     # and drafts (S15)
            assert fits, "a slot holds max_context positions; the stop rules end a request there"
        new = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.kv.allocate_slots(request, request.num_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new.append(request.request_id)
        scheduled = {r.request_id: r.num_tokens_with_spec - r.num_computed_tokens
                     for r in self.running}
        drafts = {r.request_id: tuple(r.spec_token_ids) for r in self.running if r.spec_token_ids}
        plan = SchedulerOutput(
            self.num_steps, scheduled, {r.request_id: r.num_computed_tokens for r in self.running},
            {rid: self.kv.block_table(rid) for rid in scheduled}, scheduled_new_ids=tuple(new),
            scheduled_running_ids=tuple(rid for rid in scheduled if rid not in new),
            new_block_ids=tuple(self.kv.take_new_blocks()), scheduled_spec_decode_tokens=drafts)
        self.num_steps += plan.planned
        return plan

    def update_from_output(self, plan: SchedulerOutput, finished_ids: Sequence[str] = (),
                           num_rejected: Mapping[str, int] | None = None) -> None:
        """After the model step: every scheduled request still running has computed its
        scheduled tokens but its rejected drafts (`record_computed`); then the finished ones
        leave."""
        record_computed(self.running, plan, self.kv, num_rejected)
        self.finish_requests(finished_ids)

    def finish_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Take each request out of its queue, free its KV, status finished (vLLM's
        `finish_requests`); unknown ids are skipped. Returns the ids taken out."""
        return take_out((self.running, self.waiting), request_ids, self.kv)

    def revert(self, plan: SchedulerOutput) -> None:
        """The model step failed: see `revert_plan`."""
        self.num_steps = revert_plan(self.running, plan, self.kv, self.num_steps)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
