"""Property tests for chapter S10's scheduler (hypothesis): a state machine of add / abort / step.

Any sequence of rules, on a scheduler of random max_num_seqs, token budget, KV capacity and
policy, keeps after every rule: the token budget and max_num_seqs; KV accounting (each running
request holds exactly its computed tokens, waiting ones hold none, the pool's total is their
sum); no request in two queues; under FCFS, the running then the waiting requests in arrival
order and the oldest unfinished request scheduled in every step (so nobody starves); under
priority, the waiting queue in (priority, arrival) order. At teardown the machine drains:
everything finishes within a bounded number of steps, every KV token is free (invariant 8; the
G5 bug class), and every request that was not aborted has exactly the fake model's tokens for
it alone, as many as its max_tokens, its context or the capacity allow (closed forms; see
tests/test_s10_scheduler.py for the fake model).
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from s10_scheduler import POLICIES, Scheduler
from test_s10_scheduler import FakeModel, Req, alone, check_invariants

MAX_MODEL_LEN = 24


def abort_drawn(machine, data) -> str:
    """The `abort` rule of the fake-model machines (S10-S12): abort a drawn id among those
    added; the scheduler says it held it exactly when it was queued. Returns the id."""
    rid = str(data.draw(st.integers(0, machine.count - 1)))
    held = any(r.request_id == rid for r in (*machine.s.running, *machine.s.waiting))
    assert machine.s.abort(rid) is held
    if held:
        machine.aborted.add(rid)
        machine.model.ended[rid] = "abort"
    return rid


def drain(machine, work: int) -> None:
    """Step the machine until its scheduler has nothing unfinished, in at most `work` steps."""
    steps = 0
    while machine.s.has_unfinished_requests():
        machine.step()
        steps += 1
        assert steps <= work, "the scheduler does not drain within the work it has"


def check_outputs_alone(machine, max_model_len: int) -> None:
    """After `drain`: every request not aborted has exactly the fake model's tokens for it
    alone, as many as its max_tokens, its context or the capacity allow, and the finish
    reason that says which; an aborted one has a prefix of them."""
    for rid, req in machine.model.by_id.items():
        want = alone(len(req.prompt_ids), req.max_tokens, max_model_len)
        if rid in machine.aborted:
            assert req.output_ids == want[:len(req.output_ids)]
            continue
        room = machine.s.kv_capacity - len(req.prompt_ids) + 1
        assert req.output_ids == want[:min(len(want), room)], rid
        assert machine.model.ended[rid] == ("length" if room < len(want) else "stop")


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 16),
                capacity=st.integers(1, 60), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, capacity, policy):
        self.model = FakeModel(Scheduler(max_num_seqs, MAX_MODEL_LEN + extra_budget, capacity,
                                         MAX_MODEL_LEN, policy))
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self) -> Scheduler:
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = Req(str(self.count), prompt_len, max_tokens)
        if prompt_len > self.s.kv_capacity:        # G1: refused, nothing queued
            before = len(self.s.waiting)
            try:
                self.s.add_request(req, priority)
            except ValueError as err:
                assert "could never be scheduled" in str(err)
            else:
                raise AssertionError("a prompt longer than the capacity was queued")
            assert len(self.s.waiting) == before
            return
        self.model.add(req, priority)
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
        if self.model.outputs:
            check_invariants(s, self.model.outputs[-1])
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
        work = sum(r.max_tokens + 1 for r in self.model.by_id.values())
        drain(self, work)
        assert self.s.kv.num_free_tokens == self.s.kv_capacity and not self.s.kv.held
        check_outputs_alone(self, MAX_MODEL_LEN)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase
