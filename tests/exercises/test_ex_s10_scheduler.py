"""Graded tests for the S10 exercises (see exercises/s10_scheduler.py).

Oracles, none of them the solution: schedules worked by hand, S10's tested `Scheduler`
(code/s10_scheduler.py) itself, and for exercise 1 a closed-form guarantee (a full reservation
never preempts) and the stock scheduler's preemptions and tokens on the same seeded workloads.
Exercise 1 runs your subclass of the real scheduler. For exercises 2 and 3 a fake model drives
the real scheduler on random queues (random prompt and output lengths, seats, token budgets, KV
capacities, priorities, arrivals and aborts); before every `schedule()` the test asks your
function what the scheduler is about to do, from the state it is in, and compares with the
`SchedulerOutput` it returns (or, for the queue order, with its `waiting` queue after the
step). No model is needed. What your functions return is compared as lists, so any sequence
(list, tuple, deque) is accepted.
"""
import random

import pytest

from exercise_loader import load_exercise
from s09_scheduler import Request
from s10_scheduler import Scheduler, SchedulerConfig, TokenKVPool

ex = load_exercise("s10_scheduler")
MAX_MODEL_LEN = 32


# Your functions may return any sequence (a list, a tuple, a deque): the tests compare lists.
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
# The learner's `ReservingScheduler` is S10's real scheduler with `admits` overridden. Oracles:
# states worked by hand; a closed-form guarantee (reserving every running request's whole
# remaining output, no request is ever preempted, since each one's future KV is set aside
# before anyone joins); the stock optimistic scheduler on the same seeded workload (its
# preemptions, and the tokens of every request); and the rule's words, re-evaluated by the
# test from the scheduler's state at every call.

def reserving(ratio: float):
    return lambda config, kv: ex.ReservingScheduler(config, kv, ratio)


def fake_step(sched, reqs: dict) -> None:
    """One step of the real scheduler with a fake model: a request that computed its last
    token gets one more; it finishes at max_tokens."""
    out = sched.schedule()
    finished = []
    for rid, n in out.num_scheduled_tokens.items():
        req = reqs[rid]
        if out.num_computed_tokens[rid] + n == req.num_tokens:
            req.append_token(1000 + req.num_tokens)
            if len(req.output_ids) >= req.params.max_tokens:
                finished.append(rid)
    sched.update_from_output(out, finished)


def seeded_run(make, seed: int, aborts: bool = False, num_requests: int = 40):
    """A seeded workload on `make(config, kv)`: 6 seats, a context of 64, KV for 120 tokens
    (S09's slots would hold 384), prompts of 4 to 20 tokens, max_tokens 8 to 40, 0 to 3
    arrivals per step. Returns (scheduler, requests, steps, most requests running at once)."""
    rng = random.Random(seed)
    policy = ("fcfs", "priority")[seed % 2]
    sched = make(SchedulerConfig(6, 64, 256, policy), TokenKVPool(6, 64, 120))
    specs = [(rng.randint(4, 20), rng.randint(8, 40), rng.randint(0, 3))
             for _ in range(num_requests)]
    reqs: dict[str, Request] = {}
    steps = most_running = 0
    while len(reqs) < num_requests or sched.has_unfinished_requests():
        assert steps < 3000, "the run does not end: does admits refuse with nobody running?"
        for _ in range(rng.randint(0, 3)):
            if len(reqs) < num_requests:
                prompt, max_tokens, priority = specs[len(reqs)]
                rid = f"r{len(reqs)}"
                req = Request.for_tokens(rid, [5] * prompt, max_tokens, priority=priority,
                                         arrival=len(reqs))
                sched.check_request(req)
                sched.add_request(req)
                reqs[rid] = req
        if aborts and reqs and rng.random() < 0.05:
            sched.finish_requests([rng.choice(sorted(reqs))])
        fake_step(sched, reqs)
        steps += 1
        most_running = max(most_running, len(sched.running))
    return sched, reqs, steps, most_running


@pytest.mark.points(1)
def test_reserving_admission_by_hand():
    def setup(ratio):
        sched = ex.ReservingScheduler(SchedulerConfig(4, 32, 64), TokenKVPool(4, 32, 40),
                                      ratio)
        a = Request.for_tokens("a", [5] * 10, 20)
        sched.add_request(a)
        fake_step(sched, {"a": a})                       # a joins alone and makes 1 token
        b = Request.for_tokens("b", [5] * 8, 5, arrival=1)
        sched.add_request(b)
        return sched, {"a": a, "b": b}

    # 29 positions are free after a's decode: b needs 8 + 5, a may still make 19, so b
    # joins when 13 + 19 x ratio <= 29: up to ratio 16/19
    for ratio, joins in ((1.0, False), (0.9, False), (0.75, True), (0.5, True), (0.0, True)):
        sched, reqs = setup(ratio)
        out = sched.schedule()
        assert ("b" in out.num_scheduled_tokens) == joins, (
            f"ratio {ratio}: b {'joined' if not joins else 'did not join'}, expected it "
            f"{'to join' if joins else 'to wait'} (13 + 19 x {ratio} against 29 free)")
        assert "a" in out.num_scheduled_tokens and out.preempted_ids == (), (
            f"ratio {ratio}: got scheduled {list(out.num_scheduled_tokens)}, preempted "
            f"{list(out.preempted_ids)}; expected a scheduled and nobody preempted")
    # the stock scheduler admits b: 8 tokens fit the 29 free positions now
    stock = Scheduler(SchedulerConfig(4, 32, 64), TokenKVPool(4, 32, 40))
    a = Request.for_tokens("a", [5] * 10, 20)
    stock.add_request(a)
    fake_step(stock, {"a": a})
    stock.add_request(Request.for_tokens("b", [5] * 8, 5, arrival=1))
    assert "b" in stock.schedule().num_scheduled_tokens
    # nobody running: a request whose whole output cannot be reserved still joins
    alone = ex.ReservingScheduler(SchedulerConfig(4, 32, 64), TokenKVPool(4, 32, 40), 1.0)
    alone.add_request(Request.for_tokens("c", [5] * 30, 20))
    assert list(alone.schedule().num_scheduled_tokens) == ["c"]
    # a refused head blocks the queue: nobody overtakes it
    sched, reqs = setup(1.0)
    sched.add_request(Request.for_tokens("d", [5] * 1, 1, arrival=2))
    assert list(sched.schedule().num_scheduled_tokens) == ["a"]
    with pytest.raises(ValueError):
        ex.ReservingScheduler(SchedulerConfig(4, 32, 64), TokenKVPool(4, 32, 40), 1.5)


@pytest.mark.points(1)
def test_reserving_admission_preempts_less_with_the_same_tokens():
    stock_total = half_total = 0
    batched = False
    for seed in range(6):
        stock, stock_reqs, _, _ = seeded_run(Scheduler, seed)
        full, full_reqs, _, most = seeded_run(reserving(1.0), seed)
        half, half_reqs, _, _ = seeded_run(reserving(0.5), seed)
        assert full.num_preemptions == 0, (f"seeded_run(reserving(1.0), {seed}): got "
                                           f"{full.num_preemptions} preemptions, expected 0 "
                                           f"(a full reservation never preempts)")
        for ratio, sched, reqs in ((1.0, full, full_reqs), (0.5, half, half_reqs)):
            run = f"seeded_run(reserving({ratio}), {seed})"
            for k, r in reqs.items():
                want = stock_reqs[k].output_ids
                assert r.output_ids == want, \
                    f"{run}, request {k}: got tokens {r.output_ids}, expected {want} (stock)"
                assert len(r.output_ids) == r.params.max_tokens, (
                    f"{run}, request {k}: got {len(r.output_ids)} tokens, expected "
                    f"max_tokens {r.params.max_tokens}")
            assert sched.kv.num_free_tokens == 120 and not sched.kv.slots, (
                f"{run}: at the end got {sched.kv.num_free_tokens} free KV tokens and slots "
                f"{sched.kv.slots}, expected 120 and none")
        stock_total += stock.num_preemptions
        half_total += half.num_preemptions
        batched |= most > 1
    assert stock_total > 60, f"oracle check: the stock scheduler preempted {stock_total} times"
    assert half_total < stock_total, (f"seeds 0-5: ratio 0.5 got {half_total} preemptions, "
                                      f"expected fewer than the stock scheduler's {stock_total}")
    assert batched, "ratio 1.0 never ran two requests at once, expected batching"


@pytest.mark.points(1)
def test_reserving_admission_follows_the_rule_at_every_call():
    decisions = {True: 0, False: 0}

    for ratio in (1.0, 0.5, 0.25, 0.0):
        class Checked(ex.ReservingScheduler):
            def admits(self, request, num_new_tokens):
                free = self.kv.num_free_tokens
                got = super().admits(request, num_new_tokens)
                if self.running:
                    need = num_new_tokens + request.params.max_tokens - len(request.output_ids)
                    need += sum(ratio * (r.params.max_tokens - len(r.output_ids))
                                for r in self.running)
                    want = need <= free
                else:
                    want = True
                assert bool(got) == want, (
                    f"seeded_run(ratio {ratio}, seed {seed}, aborts=True), step "
                    f"{self.num_steps}: admits({request.request_id}, {num_new_tokens}) got "
                    f"{got}, expected {want} ({free} KV tokens free, running "
                    f"{[r.request_id for r in self.running]})")
                assert self.kv.num_free_tokens == free, \
                    f"admits changed the free KV tokens from {free} to {self.kv.num_free_tokens}"
                decisions[want] += 1
                return got

        for seed in range(10, 16):
            seeded_run(lambda config, kv: Checked(config, kv, ratio), seed, aborts=True)
    assert decisions[True] > 100 and decisions[False] > 100


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
        free = sched.kv.num_free_tokens
        got = schedule_running(state, free, run.policy)
        out = run.step()
        want = (list(out.scheduled_running_ids), list(out.preempted_ids))
        assert got == want, (f"got {got}, expected {want} (the scheduler) from "
                             f"schedule_running({state}, {free}, {run.policy!r})")
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
        got = waiting_order(run.events, run.policy)
        want = [r.request_id for r in run.sched.waiting]
        assert got == want, (f"got {got}, expected {want} (the scheduler's waiting queue) from "
                             f"waiting_order(events, {run.policy!r}); events {run.events}")
        checked += len(got) > 1
    assert checked > 200
