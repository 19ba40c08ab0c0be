"""Property tests for chapter S10's scheduler (hypothesis): a state machine of add / abort / step.

Any sequence of rules, on a scheduler of random max_num_seqs, token budget, KV capacity and
policy, keeps after every rule: the token budget and max_num_seqs; KV accounting (each running
request holds exactly its computed tokens, waiting ones hold none, the pool's total is their
sum); no request in two queues; under FCFS, the running then the waiting requests in arrival
order and the oldest unfinished request scheduled in every step (so nobody starves); under
priority, the waiting queue in (priority, arrival) order. A prompt longer than the capacity is
refused before it is queued (G1). At teardown the machine drains: everything finishes within a
bounded number of steps, every KV token and slot is free (invariant 8; the G5 bug class), and
every request that was not aborted has exactly the fake model's tokens for it alone, as many as
its max_tokens, its context or the capacity allow (closed forms; the fake model is
tests/scheduler_testing.py's).
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from s01_generation_loop import ParameterError
from s10_scheduler import POLICIES, Scheduler, SchedulerConfig, TokenKVPool
from scheduler_testing import (FakeModel, abort_drawn, check_invariants, check_outputs_alone,
                               drain, make_request)

MAX_MODEL_LEN = 24


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 16),
                capacity=st.integers(1, 60), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, capacity, policy):
        # The pool counts tokens over max_num_seqs slots of MAX_MODEL_LEN: no more than those.
        pool = TokenKVPool(max_num_seqs, MAX_MODEL_LEN, min(capacity,
                                                            max_num_seqs * MAX_MODEL_LEN))
        config = SchedulerConfig(max_num_seqs, MAX_MODEL_LEN, MAX_MODEL_LEN + extra_budget,
                                 policy)
        self.model = FakeModel(Scheduler(config, pool), MAX_MODEL_LEN)
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self) -> Scheduler:
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = make_request(str(self.count), prompt_len, max_tokens, priority=priority)
        if prompt_len > self.s.kv_capacity:        # G1: refused, nothing queued
            before = len(self.s.waiting)
            try:
                self.model.add(req)
            except ParameterError as err:
                assert "could never be scheduled" in str(err) and err.parameter == "prompt"
            else:
                raise AssertionError("a prompt longer than the capacity was queued")
            assert len(self.s.waiting) == before and req.request_id not in self.model.by_id
            return
        self.model.add(req)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        abort_drawn(self, data)

    @rule()
    def step(self):
        before = sorted((r for r in (*self.s.running, *self.s.waiting)),
                        key=lambda r: r.arrival)
        out = self.model.step()
        assert out.scheduled_ids or not self.s.running, "requests running, none scheduled"
        if self.s.policy == "fcfs" and before:
            oldest = before[0].request_id
            assert oldest in out.scheduled_ids or oldest in out.finished_ids, (
                "FCFS: the oldest unfinished request made no progress")

    @invariant()
    def queues_and_accounting(self):
        if not hasattr(self, "model"):
            return
        s = self.s
        if self.model.plans:
            check_invariants(s, self.model.plans[-1])
        assert s.kv.num_used_tokens == sum(r.num_computed_tokens for r in s.running)
        if s.policy == "fcfs":
            order = [r.arrival for r in (*s.running, *s.waiting)]
            assert order == sorted(order)
        else:
            keys = [(r.priority, r.arrival) for r in s.waiting]
            assert keys == sorted(keys)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        work = sum(r.params.max_tokens + 1 for r in self.model.by_id.values())
        drain(self, work)
        kv = self.s.kv
        assert kv.num_free_tokens == kv.capacity and not kv.slots
        assert kv.free_slots == list(range(kv.num_slots))
        check_outputs_alone(self, MAX_MODEL_LEN)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase
