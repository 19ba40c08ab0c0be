"""Graded tests for the S10 exercises (see exercises/s10_scheduler.py).

Oracles, none of them the solution: schedules worked by hand, and S10's tested `Scheduler`
(code/s10_scheduler.py) itself. A fake model drives the real scheduler on random queues (random
prompt and output lengths, seats, token budgets, KV capacities, priorities, arrivals and
aborts); before every `schedule()` the test asks your function what the scheduler is about to
do, from the state it is in, and compares with the `SchedulerOutput` it returns (or, for the
queue order, with its `waiting` queue after the step). No model is needed. What your functions
return is compared as lists, so any sequence (list, tuple, deque) is accepted.
"""
import random

import pytest

from exercise_loader import load_exercise
from s09_scheduler import Request
from s10_scheduler import Scheduler, SchedulerConfig, TokenKVPool

ex = load_exercise("s10_scheduler")
MAX_MODEL_LEN = 32


# Your functions may return any sequence (a list, a tuple, a deque): the tests compare lists.
def admit(*args):
    return list(ex.admit(*args))


def schedule_running(*args):
    scheduled, preempted = ex.schedule_running(*args)
    return list(scheduled), list(preempted)


def waiting_order(*args):
    return list(ex.waiting_order(*args))


class Run:
    """The real scheduler, a fake model (one token per request that computed its last token)
    and random arrivals; `events` logs what happened to the waiting queue."""

    def __init__(self, rng: random.Random, policy: str):
        self.rng, self.policy = rng, policy
        seats, budget = rng.randint(1, 6), rng.randint(MAX_MODEL_LEN, 64)
        capacity = rng.randint(MAX_MODEL_LEN, 120)
        # KV counted in tokens over slots of MAX_MODEL_LEN: enough slots for every seat and
        # for the capacity, so the capacity is what runs out
        slots = max(seats, -(-capacity // MAX_MODEL_LEN))
        self.sched = Scheduler(SchedulerConfig(seats, MAX_MODEL_LEN, budget, policy),
                               TokenKVPool(slots, MAX_MODEL_LEN, capacity))
        self.reqs: dict[str, Request] = {}
        self.events: list[tuple] = []

    def arrive(self, count: int) -> None:
        for _ in range(count):
            rid = f"r{len(self.reqs)}"
            prompt = self.rng.randint(1, 20)
            max_tokens = self.rng.randint(1, MAX_MODEL_LEN - prompt)
            priority = self.rng.randint(0, 3)
            req = Request.for_tokens(rid, [5] * prompt, max_tokens, priority=priority,
                                     arrival=len(self.reqs))    # the engine numbers arrivals
            self.sched.check_request(req)
            self.sched.add_request(req)
            self.reqs[rid] = req
            self.events.append(("add", rid, priority))

    def maybe_abort(self) -> None:
        if self.reqs and self.rng.random() < 0.15:
            rid = self.rng.choice(sorted(self.reqs))
            self.sched.finish_requests([rid])     # what the engine's abort asks of it
            self.events.append(("abort", rid))

    def step(self):
        out = self.sched.schedule()
        scheduled = list(out.num_scheduled_tokens)
        self.events += [("preempt", rid) for rid in out.preempted_ids]
        self.events += [("admit", rid) for rid in scheduled[len(out.scheduled_running_ids):]]
        finished = []
        for rid, n in out.num_scheduled_tokens.items():          # the fake model step
            req = self.reqs[rid]
            if out.num_computed_tokens[rid] + n == req.num_tokens:
                req.append_token(1000 + req.num_tokens)
                if len(req.output_ids) >= req.params.max_tokens:
                    finished.append(rid)
        self.sched.update_from_output(out, finished)
        return out

    def would_end(self) -> bool:
        """A running request holds every KV position: the scheduler ends it (not in the
        exercises)."""
        return any(self.sched.kv.num_tokens(r.request_id) + 1 > self.sched.kv_capacity
                   for r in self.sched.running)


def runs(seed: int, trials: int, steps: int):
    rng = random.Random(seed)
    for _ in range(trials):
        run = Run(rng, rng.choice(["fcfs", "priority"]))
        run.arrive(rng.randint(1, 5))
        for _ in range(steps):
            yield run
            run.maybe_abort()
            if rng.random() < 0.4:
                run.arrive(rng.randint(1, 2))


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_admit_by_hand():
    assert admit([("a", 5), ("b", 9), ("c", 1)], 1, 4, 12, 20) == ["a"]
    assert admit([("a", 5), ("b", 6), ("c", 1)], 0, 4, 12, 20) == ["a", "b", "c"]
    assert admit([("a", 5), ("b", 6), ("c", 1)], 2, 4, 12, 20) == ["a", "b"]   # seats
    assert admit([("a", 5), ("b", 6), ("c", 1)], 0, 4, 12, 10) == ["a"]        # KV
    assert admit([("a", 13)], 0, 4, 12, 20) == []                              # tokens
    assert admit([], 0, 1, 1, 1) == []
    for bad in (([("a", 0)], 0, 1, 5, 5), ([("a", 1)], -1, 1, 5, 5), ([("a", 1)], 0, 0, 5, 5),
                ([("a", 1)], 0, 1, -1, 5), ([("a", 1)], 0, 1, 5, -1)):
        with pytest.raises(ValueError):
            admit(*bad)


@pytest.mark.points(2)
def test_admit_matches_the_scheduler():
    checked = 0
    for run in runs(seed=10, trials=60, steps=25):
        sched = run.sched
        running = len(sched.running)
        if sched.kv.num_free_tokens >= running and not run.would_end():   # nobody preempted
            waiting = [(r.request_id, r.num_tokens - r.num_computed_tokens)
                       for r in sched.waiting]
            want = admit(waiting, running, sched.max_num_seqs,
                            sched.max_num_batched_tokens - running,
                            sched.kv.num_free_tokens - running)
            out = run.step()
            assert out.preempted_ids == ()
            got = list(out.num_scheduled_tokens)[len(out.scheduled_running_ids):]
            assert want == got, (waiting, running, sched.max_num_seqs)
            checked += bool(waiting)
        else:
            run.step()
    assert checked > 200


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_schedule_running_by_hand_fcfs():
    run = [("a", 10, 0, 0), ("b", 8, 0, 1), ("c", 5, 0, 2)]
    assert schedule_running(run, 1) == (["a", "b"], ["c"])
    assert schedule_running(run, 3) == (["a", "b", "c"], [])
    assert schedule_running(run, 0) == (["a", "b"], ["c"])          # c's 5 feed a and b
    # b is the last one running when it needs a position: it preempts itself and waits.
    assert schedule_running([("a", 3, 0, 0), ("b", 1, 0, 1)], 1) == (["a"], ["b"])
    assert schedule_running([], 4) == ([], [])
    with pytest.raises(ValueError):
        schedule_running(run, 1, "lifo")
    with pytest.raises(ValueError):
        schedule_running(run, -1)


@pytest.mark.points(1)
def test_schedule_running_by_hand_priority():
    run = [("a", 4, 0, 0), ("b", 4, 5, 1), ("c", 4, 1, 2)]
    assert schedule_running(run, 0, "priority") == (["a", "c"], ["b"])
    # The victim already ran in this step: its position comes back with the rest.
    assert schedule_running([("a", 2, 9, 0), ("b", 2, 0, 1)], 1, "priority") == (["b"], ["a"])
    # The request is its own victim: it waits, and the one after it runs on its freed KV.
    assert schedule_running([("a", 2, 9, 0), ("b", 2, 0, 1)], 0, "priority") == (["b"], ["a"])
    assert schedule_running([("a", 1, 0, 0), ("b", 1, 9, 1), ("c", 1, 0, 2)], 1,
                               "priority") == (["a", "c"], ["b"])
    # Ties in priority: the later arrival goes.
    assert schedule_running([("a", 3, 1, 0), ("b", 3, 1, 1)], 0, "priority") == (["a"], ["b"])


@pytest.mark.points(2)
def test_schedule_running_matches_the_scheduler():
    checked = preempted = 0
    for run in runs(seed=11, trials=60, steps=25):
        sched = run.sched
        if run.would_end():
            run.step()
            continue
        state = [(r.request_id, sched.kv.num_tokens(r.request_id), r.priority, r.arrival)
                 for r in sched.running]
        want = schedule_running(state, sched.kv.num_free_tokens, run.policy)
        out = run.step()
        got = (list(out.scheduled_running_ids), list(out.preempted_ids))
        assert want == got, (state, sched.kv.num_free_tokens, run.policy)
        checked += bool(state)
        preempted += bool(out.preempted_ids)
    assert checked > 200 and preempted > 20


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_waiting_order_by_hand():
    events = [("add", "a", 0), ("add", "b", 0), ("admit", "a"), ("add", "c", 0),
              ("preempt", "a")]
    assert waiting_order(events) == ["a", "b", "c"]
    prio = [("add", "a", 2), ("add", "b", 0), ("add", "c", 2), ("add", "d", 1)]
    assert waiting_order(prio, "priority") == ["b", "d", "a", "c"]
    assert waiting_order(prio) == ["a", "b", "c", "d"]
    # Two preempted in one step (the tail first): the earlier admitted ends up ahead.
    two = [("add", "a", 0), ("add", "b", 0), ("add", "c", 0), ("admit", "a"), ("admit", "b"),
           ("preempt", "b"), ("preempt", "a")]
    assert waiting_order(two) == ["a", "b", "c"]
    # Under priority a preempted request goes back to its place, not to the front.
    back = [("add", "a", 3), ("admit", "a"), ("add", "b", 1), ("preempt", "a")]
    assert waiting_order(back, "priority") == ["b", "a"]
    assert waiting_order(back + [("abort", "b"), ("abort", "zz")], "priority") == ["a"]
    with pytest.raises(ValueError):
        waiting_order([("drop", "a")])
    with pytest.raises(ValueError):
        waiting_order([], "sjf")


@pytest.mark.points(2)
def test_waiting_order_matches_the_scheduler():
    checked = 0
    for run in runs(seed=12, trials=60, steps=25):
        run.step()
        want = waiting_order(run.events, run.policy)
        assert want == [r.request_id for r in run.sched.waiting], (run.policy, run.events)
        checked += len(want) > 1
    assert checked > 200
