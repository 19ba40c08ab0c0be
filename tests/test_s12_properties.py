"""Property tests for chapter S12's block manager and paged scheduler (hypothesis).

1. A state machine over the model-free `KVCacheManager`: allocate (a new request's first
   tokens), append (more tokens for a holder), free (finish), preempt (free, then the same id
   allocates again from 0) and abort (free of a request, or of an id that holds nothing),
   trim. A plain dict of token counts is the model. After every rule: `check()` (free + used ==
   usable, blocks per request == ceil(tokens / block_size), no block both held and free, each
   held block's ref_cnt == the tables holding it), the manager's counts equal the model's, an
   allocation that did not fit took nothing, no block id appears in two tables, the null block
   in none. At teardown, after freeing everyone, every usable block is free.
2. The paged scheduler under S10's fake model with its KV kept in a paged memory: one token
   id per pool slot, written through each step's slot mapping (no slot written twice in a
   step) and read back through the block table; the fake model samples from what it read.
   So a block handed to two requests, or reused while held, changes some request's tokens.
   The blocks each plan takes from the free queue (`take_new_blocks`) are the ones its
   block_events allocate, and their slots are cleared (the engine zeroes them), so a read of
   a slot nobody wrote since would show. A step may fail (the engine's `revert`, nothing
   computed). Replaying each successful plan's block_events (a failed plan's come with the
   next plan's) on a free set gives the pool's free queue as planned.
   After every step the accounting above holds; at teardown everything is free (the G5 class)
   and every request not aborted has exactly the fake model's tokens for it alone, as many as
   its max_tokens, its context or the capacity allow (tests/test_s10_scheduler.py's closed
   forms).
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from s10_scheduler import POLICIES
from s12_paged_attention import NULL_BLOCK_ID, KVCacheManager, PagedScheduler, slot_mapping
from test_s10_properties import abort_drawn, check_outputs_alone, drain
from test_s10_scheduler import FakeModel, Req, check_invariants, next_token

MAX_MODEL_LEN = 24


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def build(self, num_blocks, block_size):
        self.m = KVCacheManager(num_blocks, block_size)
        self.tokens: dict[str, int] = {}
        self.bs, self.usable = block_size, num_blocks - 1

    def _allocate(self, rid, n):
        before_free = self.m.num_free_blocks
        need = ceil_div(self.tokens.get(rid, 0) + n, self.bs) - ceil_div(
            self.tokens.get(rid, 0), self.bs)
        assert self.m.num_blocks_to_allocate(rid, n) == need
        ok = self.m.allocate_slots(rid, n)
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
        assert self.m.free(rid) == self.tokens.pop(rid)
        # the freed blocks go to the back of the queue, the table's last block first
        assert self.m.pool.free_block_queue.block_ids() == front + table[::-1]
        if again:                      # preempted: it comes back and recomputes from 0
            self._allocate(rid, data.draw(st.integers(1, 8)))

    @rule(rid=st.sampled_from("xyz"))
    def abort_unknown(self, rid):
        before = self.m.num_free_blocks
        assert self.m.free(rid) == 0 and self.m.num_free_blocks == before

    @precondition(lambda self: hasattr(self, "m") and self.tokens)
    @rule(data=st.data())
    def trim(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        keep = data.draw(st.integers(0, self.tokens[rid]))
        table = self.m.block_table(rid)
        self.m.trim(rid, keep)
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
            self.m.free(rid)
        assert self.m.num_free_blocks == self.usable and not self.m.req_blocks


ManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_manager_state_machine = ManagerMachine.TestCase


class PagedFakeModel(FakeModel):
    """S10's fake model with its "KV" in a paged memory: each scheduled token's id is
    written to its slot, and the context a request samples from is read back through its
    block table (S10's fake model keeps a private list per request instead)."""

    def __init__(self, scheduler: PagedScheduler):
        super().__init__(scheduler)
        self.memory = [None] * (scheduler.num_blocks * scheduler.block_size)
        self.free = set(range(1, scheduler.num_blocks))   # replayed from block_events
        self.carried = 0      # events of a failed plan, reported again at the next plan's head

    def plan(self):
        """schedule(), then what the engine does before the model runs: the new blocks'
        slots cleared."""
        s = self.scheduler
        out = s.schedule()
        for rid in out.finished_ids:
            self.ended[rid] = "length"
        new = s.kv.pool.take_new_blocks()
        assert len(new) == len(set(new))
        assert set(new) == {b for kind, _, ids in out.block_events[self.carried:]
                            if kind == "allocated" for b in ids}
        if out.block_events:
            self.carried = 0
        for block in new:
            bs = s.block_size
            self.memory[block * bs:(block + 1) * bs] = [None] * bs
        return out

    def fail(self):
        """A step whose model run failed: planned, then reverted (a plan that computes
        nothing runs no model, so it cannot fail: it goes on as a step)."""
        out = self.plan()
        if not out.num_scheduled_tokens:
            return self.run(out)
        self.scheduler.revert(out)
        self.scheduler.kv.check()
        self.carried = len(out.block_events)
        return out

    def step(self):
        return self.run(self.plan())

    def run(self, out):
        s = self.scheduler
        self.outputs.append(out)
        for kind, _, ids in out.block_events:
            if kind == "allocated":
                assert self.free >= set(ids)
                self.free -= set(ids)
            else:
                assert not self.free & set(ids)
                self.free |= set(ids)
        if out.num_scheduled_tokens or out.preempted_ids or out.finished_ids:
            # (an idle plan leaves the changes since the last one for the next)
            assert self.free == set(s.kv.pool.free_block_queue.block_ids())
        written, finished = set(), []
        for rid, n in out.num_scheduled_tokens.items():
            req, start = self.by_id[rid], out.num_computed_tokens[rid]
            table = out.block_tables[rid]
            assert list(table) == s.kv.block_table(rid)
            assert len(table) == ceil_div(start + n, s.block_size)
            slots = slot_mapping(table, start, n, s.block_size)
            assert not written & set(slots), "a slot written twice in one step"
            written.update(slots)
            assert all(slot >= s.block_size for slot in slots), "the null block was written"
            for slot, token in zip(slots, req.token_ids[start:start + n]):
                self.memory[slot] = token
            if start + n == len(req.token_ids):
                context = [self.memory[k] for k in slot_mapping(table, 0, start + n,
                                                                s.block_size)]
                assert None not in context, "a slot read before it was written"
                token = next_token(context)   # from the paged memory, not from req
                req.token_ids.append(token)
                req.output_ids.append(token)
                if (len(req.output_ids) >= req.max_tokens
                        or len(req.token_ids) >= s.max_model_len):
                    finished.append(rid)
                    self.ended[rid] = "stop"
        s.update_from_output(out, finished)
        check_invariants(s, out)
        return out


class PagedSchedulerMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 20),
                threshold=st.sampled_from([0, 0, 2, 5]), num_blocks=st.integers(2, 16),
                block_size=st.sampled_from([1, 2, 4, 8, 32]), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, num_blocks, block_size, policy):
        self.model = PagedFakeModel(PagedScheduler(
            max_num_seqs, max_num_seqs + extra_budget, num_blocks, block_size, MAX_MODEL_LEN,
            policy, threshold))
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self) -> PagedScheduler:
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = Req(str(self.count), prompt_len, max_tokens)
        if ceil_div(prompt_len, self.s.block_size) > self.s.num_blocks - 1:   # G1, in blocks
            before = len(self.s.waiting)
            try:
                self.s.add_request(req, priority)
            except ValueError as err:
                assert "could never be scheduled" in str(err) and "blocks" in str(err)
            else:
                raise AssertionError("a prompt needing more blocks than the pool was queued")
            assert len(self.s.waiting) == before
            return
        self.model.add(req, priority)
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
            assert len(t) == ceil_div(r.num_computed_tokens, s.block_size)
        assert all(not s.kv.block_table(r.request_id) for r in s.waiting)
        assert s.kv.num_used_blocks == len(ids)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        work = sum(len(r.prompt_ids) + r.max_tokens + 1 for r in self.model.by_id.values())
        drain(self, work)
        assert self.s.kv.num_free_blocks == self.s.num_blocks - 1 and not self.s.kv.req_blocks
        check_outputs_alone(self, MAX_MODEL_LEN)


PagedSchedulerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_paged_scheduler_state_machine = PagedSchedulerMachine.TestCase
