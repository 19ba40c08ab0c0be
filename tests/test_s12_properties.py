"""Property tests for chapter S12's block manager and S11's scheduler on it (hypothesis).

1. A state machine over the model-free `KVCacheManager`: allocate (a new request's first
   tokens), append (more tokens for a holder), free (finish), preempt (free, then the same
   request allocates again from 0) and abort (free of a request, or of one that holds
   nothing), trim. A plain dict of token counts is the model. After every rule: `check()`
   (free + used == usable, blocks per request == ceil(tokens / block_size), no block both
   held and free, each held block's ref_cnt == the tables holding it), the manager's counts
   equal the model's, an allocation that did not fit took nothing, no block id appears in
   two tables, the null block in none. At teardown, after freeing everyone, every usable
   block is free.
2. S11's `ChunkedScheduler` over the manager (S12's engine's assembly) under the fake model
   of tests/scheduler_testing.py with its KV kept in a paged memory: one token id per pool
   slot, written through each step's slot mapping (no slot written twice in a step) and read
   back through the block table; the fake model samples from what it read. So a block handed
   to two requests, or reused while held, changes some request's tokens. The blocks each
   plan takes from the free queue (`new_block_ids`) are the ones its block events allocate,
   and their slots are cleared (the runner zeroes them), so a read of a slot nobody wrote
   since would show. A step may fail (the engine's path when the model run raises: the plan
   is reverted, the observers hear no `on_step`). S12's `BlockTracer` is attached as the
   engine attaches it: replaying its records' block_events (a failed plan's come with the
   next record) on a free set gives the pool's free queue after every step, and no block is
   freed that nobody was seen taking. After every step the accounting above holds; at
   teardown everything is free (the G5 class) and every request not aborted has exactly the
   fake model's tokens for it alone, as many as its max_tokens, its context or the capacity
   allow (tests/scheduler_testing.py's closed forms).
"""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from s01_generation_loop import ParameterError
from s10_scheduler import POLICIES
from s12_engine import BlockTracer
from s12_paged_attention import NULL_BLOCK_ID, KVCacheManager, slot_mapping
from scheduler_testing import (ObservedFakeModel, abort_drawn, ceil_div, check_invariants,
                               check_outputs_alone, chunked_scheduler, drain, make_request)

MAX_MODEL_LEN = 24


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def build(self, num_blocks, block_size):
        self.m = KVCacheManager(num_blocks, block_size)
        self.requests = {rid: make_request(rid, 1, 1) for rid in "abcdefxyz"}
        self.tokens: dict[str, int] = {}
        self.bs, self.usable = block_size, num_blocks - 1

    def _allocate(self, rid, n):
        before_free = self.m.num_free_blocks
        need = ceil_div(self.tokens.get(rid, 0) + n, self.bs) - ceil_div(self.tokens.get(rid, 0), self.bs)
        assert self.m.num_blocks_to_allocate(rid, n) == need
        ok = self.m.allocate_slots(self.requests[rid], n)
        assert ok == (need <= before_free)
        if ok:
            self.tokens[rid] = self.tokens.get(rid, 0) + n
            assert self.m.num_free_blocks == before_free - need
        else:
            assert self.m.num_free_blocks == before_free     # all or nothing

    @rule(rid=st.sampled_from("abcdef"), n=st.integers(0, 20))
    def allocate(self, rid, n):
        if rid in self.tokens:
            return
        self._allocate(rid, n)

    @precondition(lambda self: hasattr(self, "m") and self.tokens)
    @rule(data=st.data(), n=st.integers(1, 5))
    def append(self, data, n):
        self._allocate(data.draw(st.sampled_from(sorted(self.tokens))), n)

    @precondition(lambda self: hasattr(self, "m") and self.tokens)
    @rule(data=st.data(), again=st.booleans())
    def free_or_preempt(self, data, again):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        table = self.m.block_table(rid)
        front = self.m.pool.free_block_queue.block_ids()
        assert self.m.free(self.requests[rid]) == self.tokens.pop(rid)
        # the freed blocks go to the back of the queue, the table's last block first
        assert self.m.pool.free_block_queue.block_ids() == front + table[::-1]
        if again:                      # preempted: it comes back and recomputes from 0
            self._allocate(rid, data.draw(st.integers(1, 8)))

    @rule(rid=st.sampled_from("xyz"))
    def abort_unknown(self, rid):
        before = self.m.num_free_blocks
        assert self.m.free(self.requests[rid]) == 0 and self.m.num_free_blocks == before

    @precondition(lambda self: hasattr(self, "m") and self.tokens)
    @rule(data=st.data())
    def trim(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        keep = data.draw(st.integers(0, self.tokens[rid]))
        table = self.m.block_table(rid)
        self.m.trim(self.requests[rid], keep)
        self.tokens[rid] = keep
        assert self.m.block_table(rid) == table[:ceil_div(keep, self.bs)]

    @invariant()
    def accounting(self):
        if not hasattr(self, "m"):
            return
        self.m.check()
        assert {r: self.m.num_tokens(r) for r in self.tokens} == self.tokens
        tables = [self.m.block_table(r) for r in self.tokens]
        ids = [b for t in tables for b in t]
        assert len(ids) == len(set(ids)) and NULL_BLOCK_ID not in ids
        assert all(len(t) == ceil_div(self.tokens[r], self.bs)
                   for r, t in zip(self.tokens, tables))
        assert self.m.num_used_blocks == len(ids)
        assert self.m.num_free_tokens == (self.usable - len(ids)) * self.bs

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in list(self.tokens):
            self.m.free(self.requests[rid])
        assert self.m.num_free_blocks == self.usable and not self.m.req_blocks


ManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_manager_state_machine = ManagerMachine.TestCase


class PagedMemoryModel(ObservedFakeModel):
    """The fake model with its "KV" in a paged memory: each scheduled token's id is written
    to its slot, and the context a request samples from is read back through its block table
    (the plain fake model keeps a private list per request instead). Before the model runs,
    the slots of the plan's new blocks are cleared (the runner zeroes them). S12's
    `BlockTracer` listens, and its records are replayed after every step."""

    def __init__(self, scheduler, max_model_len: int):
        super().__init__(scheduler, max_model_len)
        kv = scheduler.kv
        self.memory = [None] * (kv.num_blocks * kv.block_size)
        self.blocks = BlockTracer()
        self.observers.append(self.blocks)
        self.free = set(range(1, kv.num_blocks))   # replayed from the records' block_events
        self.held: dict[str, list[int]] = {}

    def schedule(self):
        """Plan, check that the blocks the plan took from the free queue (`new_block_ids`)
        are the ones its events allocate, and clear their slots (the runner zeroes them)."""
        kv = self.scheduler.kv
        start = len(kv.events)        # a failed plan's revert left its frees before it
        plan = super().schedule()
        # each once, in the order first taken (a block taken, freed by a preemption in the
        # same plan and taken again is zeroed once)
        assert list(plan.new_block_ids) == list(dict.fromkeys(
            b for kind, _, ids in kv.events[start:] if kind == "allocated" for b in ids))
        bs = kv.block_size
        for block in plan.new_block_ids:
            self.memory[block * bs:(block + 1) * bs] = [None] * bs
        return plan

    def fail(self):
        """A failed step; its plan's events (and the revert's) come with the next record."""
        records = len(self.blocks.records)
        plan = super().fail()
        if plan.num_scheduled_tokens:
            assert len(self.blocks.records) == records
            self.scheduler.kv.check()
        return plan

    def compute(self, plan, request, start, n):
        kv, rid = self.scheduler.kv, request.request_id
        bs, table = kv.block_size, plan.block_tables[rid]
        assert list(table) == kv.block_table(rid)
        assert len(table) == ceil_div(start + n, bs)
        slots = slot_mapping(table, start, n, bs)
        assert all(slot >= bs for slot in slots), "the null block was written"
        assert not self.written & set(slots), "a slot written twice in one step"
        self.written.update(slots)
        for slot, token in zip(slots, request.token_ids[start:start + n]):
            self.memory[slot] = token
        context = [self.memory[k] for k in slot_mapping(table, 0, start + n, bs)]
        if start + n == request.num_tokens:
            assert None not in context, "a slot read before it was written"
        return context                # the next token comes from the paged memory

    def run(self, plan):
        self.written = set()
        records = len(self.blocks.records)
        super().run(plan)
        if not plan.planned:          # an idle plan: its changes wait for the next record
            assert len(self.blocks.records) == records
            return plan
        record = self.blocks.records[-1]
        assert record.step == plan.step
        for kind, rid, ids in record.block_events:
            assert kind in ("allocated", "freed"), kind
            if kind == "allocated":
                assert self.free >= set(ids)
                self.free -= set(ids)
                self.held.setdefault(rid, []).extend(ids)
            else:                         # no block freed that nobody was seen taking
                assert self.held.get(rid, [])[::-1][:len(ids)] == list(ids), (rid, ids)
                del self.held[rid][len(self.held[rid]) - len(ids):]
                self.free |= set(ids)
        kv = self.scheduler.kv
        assert self.free == set(kv.pool.free_block_queue.block_ids())
        assert len(self.free) == record.free_blocks == kv.num_free_blocks
        return plan


class PagedSchedulerMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 20),
                threshold=st.sampled_from([0, 0, 2, 5]), num_blocks=st.integers(2, 16),
                block_size=st.sampled_from([1, 2, 4, 8, 32]), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, num_blocks, block_size, policy):
        kv = KVCacheManager(num_blocks, block_size, enable_kv_cache_events=True)
        self.model = PagedMemoryModel(chunked_scheduler(
            kv, max_num_seqs, max_num_seqs + extra_budget, MAX_MODEL_LEN, policy, threshold),
            MAX_MODEL_LEN)
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self):
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = make_request(str(self.count), prompt_len, max_tokens, priority=priority)
        if ceil_div(prompt_len, self.s.kv.block_size) > self.s.kv.num_blocks - 1:   # G1, in blocks
            before = len(self.s.waiting)
            with pytest.raises(ParameterError, match="could never be scheduled") as err:
                self.model.add(req)
            assert "blocks" in str(err.value) and len(self.s.waiting) == before
            return
        self.model.add(req)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        rid = abort_drawn(self, data)
        assert not self.s.kv.block_table(rid)

    @rule()
    def step(self):
        self.model.step()

    @rule()
    def failed_step(self):
        self.model.fail()

    @invariant()
    def accounting(self):
        if not hasattr(self, "model"):
            return
        s = self.s
        s.kv.check()
        tables = [s.kv.block_table(r.request_id) for r in s.running]
        ids = [b for t in tables for b in t]
        assert len(ids) == len(set(ids)), "a block held by two requests"
        for r, t in zip(s.running, tables):
            assert len(t) == ceil_div(r.num_computed_tokens, s.kv.block_size)
        assert all(not s.kv.block_table(r.request_id) for r in s.waiting)
        assert s.kv.num_used_blocks == len(ids)
        if self.model.plans:
            check_invariants(s, self.model.plans[-1])

    def teardown(self):
        if not hasattr(self, "model"):
            return
        work = sum(len(r.prompt_ids) + r.params.max_tokens + 1
                   for r in self.model.by_id.values())
        drain(self, work)
        kv = self.s.kv
        assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_blocks
        check_outputs_alone(self, MAX_MODEL_LEN)


PagedSchedulerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_paged_scheduler_state_machine = PagedSchedulerMachine.TestCase
