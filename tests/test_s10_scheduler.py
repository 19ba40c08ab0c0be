"""Tests for chapter S10's model-free scheduler (code/s10_scheduler.py), in the spirit of vLLM's
tests/v1/core/test_scheduler.py: requests made of token ids alone and a fake model step
(tests/scheduler_testing.py), no model at all.

Oracles. The fake model's next token is a fixed function of the context it has computed (its
own record of the tokens the scheduler sent it), so a request's outputs do not depend on the
schedule: a run with all the KV the slots hold is the reference, and a lost, duplicated or
mis-positioned token under preemption changes every token after it. Orders and victims are
worked out by hand in the comments; lengths that end by the capacity are closed forms
(a prompt of P tokens in a capacity of C makes C - P + 1 tokens).

Public bug reports (../shared/cases/public-bugs.md, section (g)): G1 vllm PR #1534 (a prompt
that can never fit must not block the queue) and G5 sglang PR #2238 / #1674 / #6778 (once idle,
every KV token is free), each a test below; G2 (preemption loses tokens) is the recompute test.
"""
import re

import numpy as np
import pytest

from s01_generation_loop import ParameterError
from s09_scheduler import RequestStatus
from s10_scheduler import Scheduler, SchedulerConfig, TokenKVPool
from scheduler_testing import FakeModel, alone, check_invariants, make_request


def scheduler(max_num_seqs=4, budget=64, capacity=None, max_model_len=64, policy="fcfs"):
    """A Scheduler over a TokenKVPool of max_num_seqs slots of max_model_len positions and
    `capacity` tokens (None: all the slots hold, so nothing is preempted)."""
    return Scheduler(SchedulerConfig(max_num_seqs, max_model_len, budget, policy),
                     TokenKVPool(max_num_seqs, max_model_len, capacity))


def run(requests, max_num_seqs=4, budget=64, capacity=None, max_model_len=64,
        policy="fcfs", priorities=None):
    """Requests [(prompt length, max_tokens)] added in order, then drained."""
    model = FakeModel(scheduler(max_num_seqs, budget, capacity, max_model_len, policy),
                      max_model_len)
    for i, (p, m) in enumerate(requests):
        model.add(make_request(str(i), p, m, priority=(priorities or [0] * len(requests))[i]))
    model.drain()
    return model


def idle(s) -> bool:
    """Nothing queued, no KV token and no slot held (invariant 8)."""
    kv = s.kv
    return (not s.has_unfinished_requests() and kv.num_used_tokens == 0
            and not any(kv.tokens.values()) and not kv.slots
            and kv.free_slots == list(range(kv.num_slots)))


MIX = [(5, 6), (9, 3), (14, 8), (3, 12), (20, 5), (7, 7), (11, 9), (2, 4)]


# --- the pool -------------------------------------------------------------------------------

def test_token_pool_allocates_all_or_nothing_and_frees_what_a_request_holds():
    pool = TokenKVPool(num_slots=3, slot_size=8, capacity=10)
    a, b, c = (make_request(rid, 1, 1) for rid in "abc")
    assert pool.allocate_slots(a, 6) and pool.allocate_slots(b, 3)
    assert not pool.allocate_slots(a, 2)        # 1 free: nothing taken
    assert (pool.num_tokens("a"), pool.num_free_tokens) == (6, 1)
    assert pool.allocate_slots(a, 1) and pool.num_free_tokens == 0
    assert (pool.block_table("a"), pool.block_table("b"), pool.block_table("c")) == (
        (0,), (1,), ())
    pool.free(a)
    pool.free(a)                                # a second free gives nothing back twice
    assert pool.num_used_tokens == 3 and pool.free_slots == [0, 2]
    assert pool.allocate_slots(c, 7) and pool.block_table("c") == (0,)   # the lowest slot
    assert not pool.allocate_slots(c, 2)        # its slot holds 8 positions
    for bad in (0, 25, 2.5):
        with pytest.raises(ParameterError, match=r"kv_capacity must be an integer in \[1, "
                                                 r"max_num_seqs x max_context = 24\]") as err:
            TokenKVPool(3, 8, bad)
        assert err.value.parameter == "kv_capacity"
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1"):
        TokenKVPool(0, 8)


# --- budgets and order ----------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs,budget,capacity", [
    (4, 64, None), (2, 64, None), (8, 24, None), (8, 64, 40), (3, 24, 30), (1, 64, 21)])
def test_budgets_are_never_exceeded_and_every_output_equals_the_request_alone(
        max_num_seqs, budget, capacity):
    model = run(MIX, max_num_seqs, budget, capacity, max_model_len=24)
    capacity = max_num_seqs * 24 if capacity is None else capacity    # the slots' default
    assert model.scheduler.kv_capacity == capacity
    for i, (p, m) in enumerate(MIX):
        req = model.by_id[str(i)]
        want = alone(p, m, 24)
        if model.ended[str(i)] == "length":        # the capacity ended it: C - P + 1 tokens
            assert len(req.output_ids) == capacity - p + 1 < len(want)
        assert req.output_ids == want[:len(req.output_ids)]
        assert model.ended[str(i)] == "length" or req.output_ids == want
    assert max(o.total_num_scheduled_tokens for o in model.plans) <= budget
    assert idle(model.scheduler)


def test_fcfs_admits_in_arrival_order_and_stops_at_the_first_that_does_not_fit():
    # Capacity 30: "0" (12) and "1" (10) fit, "2" (9) does not (22 + 9 > 30), so "3" (1
    # token, which would fit) must wait behind it: no skipping.
    model = FakeModel(scheduler(8, 64, 30), 64)
    for rid, p in (("0", 12), ("1", 10), ("2", 9), ("3", 1)):
        model.add(make_request(rid, p, 4))
    first = model.step()
    assert first.scheduled_new_ids == ("0", "1")
    assert [r.request_id for r in model.scheduler.waiting] == ["2", "3"]
    model.drain()
    admitted = [rid for o in model.plans for rid in o.scheduled_new_ids]
    assert admitted == ["0", "1", "2", "3"]


def test_priority_admits_the_lowest_value_first_then_by_arrival():
    # One seat: after the first request (admitted alone at step 0), the others run in
    # (priority, arrival) order: 1 (0), 3 (0), 4 (1), 2 (5).
    model = FakeModel(scheduler(1, 64, None, 64, "priority"), 64)
    model.add(make_request("0", 4, 2, priority=3))
    model.step()
    for rid, prio in (("1", 0), ("2", 5), ("3", 0), ("4", 1)):
        model.add(make_request(rid, 4, 2, priority=prio))
    assert [r.request_id for r in model.scheduler.waiting] == ["1", "3", "4", "2"]
    model.drain()
    assert [rid for o in model.plans for rid in o.scheduled_new_ids] == ["0", "1", "3", "4",
                                                                         "2"]


def test_the_running_requests_go_first_and_the_token_budget_holds_back_a_prompt():
    # Budget 10: "0" and "1" run (prompts 4 + 5 = 9); next step their 2 decodes leave 8, so
    # "2" (9 tokens) waits; once "0" is done (max_tokens 2), 1 decode + 9 fits.
    model = FakeModel(scheduler(4, 10, None, 10), 10)
    for rid, p, m in (("0", 4, 2), ("1", 5, 4), ("2", 9, 1)):
        model.add(make_request(rid, p, m))
    steps = []
    for _ in range(3):
        steps.append(model.step())
        if len(steps) == 2:
            assert [r.request_id for r in model.scheduler.waiting] == ["2"]
    assert [o.scheduled_new_ids for o in steps] == [("0", "1"), (), ("2",)]
    assert steps[1].scheduled_running_ids == ("0", "1")
    assert steps[2].num_scheduled_tokens == {"1": 1, "2": 9}


# --- preemption -----------------------------------------------------------------------------

def test_fcfs_preempts_the_most_recently_admitted_and_it_resumes_at_the_front():
    # Capacity 20, prompts 6, 6, 7 (19 tokens after step 0). Step 1: "0" takes the last free
    # token, "1" finds none, so the tail "2" is preempted (freeing 7) and "1" runs.
    model = FakeModel(scheduler(4, 64, 20), 64)
    for rid, p in (("0", 6), ("1", 6), ("2", 7)):
        model.add(make_request(rid, p, 5))
    model.step()
    later = model.add(make_request("3", 2, 2))
    out = model.step()
    assert out.preempted_ids == ("2",) and out.scheduled_running_ids == ("0", "1")
    assert out.scheduled_new_ids == ()                      # nobody admitted in that step
    resumed = model.by_id["2"]
    assert (resumed.status, resumed.num_computed_tokens, resumed.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in model.scheduler.waiting] == ["2", "3"]   # front, not back
    model.drain()
    back = next(o for o in model.plans if "2" in o.scheduled_resumed_ids)
    # Its recompute is its prompt and the one token it had made: 7 + 1.
    assert back.num_scheduled_tokens["2"] == 8 and back.num_computed_tokens["2"] == 0
    assert resumed.output_ids == alone(7, 5, 64) and later.output_ids == alone(2, 2, 64)


def test_priority_preempts_the_lowest_priority_even_if_it_was_admitted_first():
    # "0" has priority 9 and is admitted first; "1" (priority 0) then runs beside it. When
    # KV runs out, "0" is the victim (largest value), not the tail "1".
    model = FakeModel(scheduler(4, 64, 14, 64, "priority"), 64)
    model.add(make_request("0", 6, 6, priority=9))
    model.step()                                    # "0": 6 tokens, then 7 held
    model.add(make_request("1", 6, 6, priority=0))
    model.step()                                    # "0" decodes (8), "1" prefills (14)
    out = model.step()                              # no free token: "0" must go
    assert out.preempted_ids == ("0",) and out.scheduled_running_ids == ("1",)
    model.drain()
    assert model.by_id["0"].output_ids == alone(6, 6, 64)
    assert model.by_id["1"].output_ids == alone(6, 6, 64)


def test_a_low_priority_request_that_is_its_own_victim_lets_the_others_run():
    # "0" (priority 5) is admitted first and sits at the head of running; "1" and "2"
    # (priority 0) beside it fill the capacity of 17 (7 + 5 + 5). Next step "0" needs a
    # token, finds none, and is its own victim (the largest value); "1" and "2" still run in
    # that step, on the 7 tokens it freed.
    model = FakeModel(scheduler(4, 64, 17, 64, "priority"), 64)
    model.add(make_request("0", 6, 4, priority=5))
    model.step()
    model.add(make_request("1", 5, 4, priority=0))
    model.add(make_request("2", 5, 4, priority=0))
    model.step()                                    # "0" decodes (7), "1" and "2" prefill
    assert model.scheduler.kv.num_free_tokens == 0
    out = model.step()
    assert out.preempted_ids == ("0",) and out.scheduled_ids == ("1", "2")
    model.drain()
    assert [model.by_id[r].output_ids for r in "012"] == [alone(6, 4, 64)] + [
        alone(5, 4, 64)] * 2


def test_a_preempted_request_recomputes_prompt_and_outputs_with_nothing_lost():
    """vllm #16832 (G2, an open report without a reproduction): output incomplete after
    recompute preemption. Under a capacity that preempts again and again, each resumed
    request computes prompt + every output it had, and its outputs equal the unbounded
    run's, length included."""
    requests = [(10, 12), (12, 12), (8, 12), (11, 12)]
    tight = run(requests, capacity=30)
    free = run(requests)
    assert tight.scheduler.num_preemptions >= 3 and free.scheduler.num_preemptions == 0
    for out in tight.plans:
        for rid in out.scheduled_resumed_ids:
            assert out.num_computed_tokens[rid] == 0
            req_len = out.num_scheduled_tokens[rid]
            assert req_len > len(tight.by_id[rid].prompt_ids)      # prompt + outputs
    for rid, req in tight.by_id.items():
        assert req.output_ids == free.by_id[rid].output_ids
        assert len(req.output_ids) == 12


def test_the_victim_itself_waits_and_the_others_keep_running():
    # Two requests of 9 in a capacity of 19: "0" takes token 19, then "1" (the tail) cannot
    # get one and is its own victim; it resumes when "0" is done.
    model = FakeModel(scheduler(4, 64, 19), 64)
    model.add(make_request("0", 9, 3))
    model.add(make_request("1", 9, 3))
    model.step()
    out = model.step()
    assert out.preempted_ids == ("1",) and out.scheduled_ids == ("0",)
    model.drain()
    assert model.by_id["1"].output_ids == alone(9, 3, 64)


# --- requests that can never fit, aborts, idle ------------------------------------------------

def test_a_prompt_longer_than_the_capacity_is_refused_and_blocks_nobody():
    """vllm PR #1534 (G1): a prompt needing more KV than the whole pool stayed at the head of
    the queue forever. Here `check_request` refuses it before it is queued (ParameterError
    naming the prompt); the requests behind it finish."""
    s = scheduler(4, 64, 16)
    model = FakeModel(s, 64)
    model.add(make_request("a", 5, 3))
    with pytest.raises(ParameterError, match="prompt is 17 tokens but kv_capacity is 16 tokens: "
                                             "it could never be scheduled") as err:
        model.add(make_request("big", 17, 3))
    assert err.value.parameter == "prompt"
    model.add(make_request("b", 6, 3))
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    model.drain()
    assert model.ended == {"a": "stop", "b": "stop"} and idle(s)


def test_a_lone_request_that_fills_the_capacity_ends_with_length():
    # Prompt 5, capacity 8: it makes tokens until its context is 9 > 8 (8 - 5 + 1 = 4 tokens),
    # then the scheduler ends it instead of preempting it forever.
    model = run([(5, 50)], capacity=8)
    req = model.by_id["0"]
    assert model.ended == {"0": "length"} and req.output_ids == alone(5, 4, 64)
    end = next(o for o in model.plans if o.finished_ids)
    assert end.finished_ids == ("0",) and end.preempted_ids == () and not end.scheduled_ids
    assert end.planned and end is model.plans[-1]
    assert req.status == RequestStatus.FINISHED and idle(model.scheduler)


def test_abort_frees_everything_from_either_queue():
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted requests leaked KV. Aborts of a running,
    a preempted and a waiting request, then the rest finish: once idle every token is free."""
    model = FakeModel(scheduler(3, 64, 20), 64)
    for rid, p in (("0", 6), ("1", 6), ("2", 7), ("3", 4), ("4", 3)):
        model.add(make_request(rid, p, 6))
    model.step()
    model.step()                                   # "2" preempted (see the FCFS test)
    s = model.scheduler
    assert [r.request_id for r in s.waiting] == ["2", "3", "4"]
    assert s.finish_requests(["2"]) == ["2"]                          # preempted
    assert model.by_id["2"].status == RequestStatus.FINISHED
    assert s.finish_requests(["4"]) == ["4"]                          # waiting, never ran
    held = s.kv.num_tokens("1")
    free = s.kv.num_free_tokens
    assert s.finish_requests(["1"]) == ["1"] and s.kv.num_free_tokens == free + held  # running
    assert s.finish_requests(["1", "nobody"]) == []
    assert [r.request_id for r in s.running] == ["0"]
    model.drain()
    assert idle(s)
    for rid in ("0", "3"):
        assert model.by_id[rid].output_ids == alone(len(model.by_id[rid].prompt_ids), 6, 64)


def test_an_aborted_request_between_schedule_and_update_is_skipped():
    s = scheduler(2, 64, 100)
    s.add_request(make_request("a", 4, 3))
    out = s.schedule()
    s.finish_requests(["a"])
    s.update_from_output(out, ["a"])
    assert idle(s) and s.kv.num_free_tokens == 100


def test_revert_gives_back_the_kv_of_a_failed_step():
    s = scheduler(2, 64, 100)
    a, b = make_request("a", 4, 3), make_request("b", 6, 3, arrival=1)
    s.add_request(a)
    s.update_from_output(s.schedule())             # "a" computed its prompt: holds 4
    a.append_token(5)                              # and sampled a token
    s.add_request(b)
    out = s.schedule()                             # "a" +1, "b" +6 scheduled
    assert s.kv.num_used_tokens == 11
    s.revert(out)                                  # the model step failed
    assert (s.kv.num_tokens("a"), s.kv.num_tokens("b")) == (4, 0)
    again = s.schedule()
    assert again.num_scheduled_tokens == {"a": 1, "b": 6} and s.kv.num_used_tokens == 11


def test_steps_are_numbered_without_idle_calls_and_a_failed_step_gives_its_number_back():
    """SchedulerOutput.step counts steps that plan something (so a tracer's step numbers
    match): a schedule() with nothing to plan keeps the count, and revert() of a failed step
    takes its number back."""
    s = scheduler(2, 64, 100)
    assert s.schedule().step == 0 and s.num_steps == 0          # idle: nothing to plan
    s.add_request(make_request("a", 4, 3))
    first = s.schedule()
    assert first.step == 0 and first.num_scheduled_tokens == {"a": 4} and s.num_steps == 1
    s.revert(first)                                # its model step failed: not a step
    assert s.num_steps == 0
    again = s.schedule()
    assert again.step == 0 and again.num_scheduled_tokens == {"a": 4}
    s.update_from_output(again, ["a"])
    assert s.schedule().step == 1 and s.num_steps == 1          # idle again: no count
    model = run(MIX, max_num_seqs=3, budget=64, capacity=40)
    assert [o.step for o in model.plans] == list(range(len(model.plans)))


# --- bad arguments ------------------------------------------------------------------------------

def test_bad_arguments_are_refused_naming_the_rule():
    """The scheduler's settings (SchedulerConfig, TokenKVPool) and a request's own fields
    (Request: priority) are refused with a ParameterError naming the field. The rules of a
    request's id, prompt and length are the engine's (`make_request`, test_s10_engine), so
    the scheduler only asserts them."""
    cases = [
        (dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32),
         r"max_num_batched_tokens \(32\) must be >= max_model_len \(64\): without chunked "
         "prefill", "max_num_batched_tokens"),
        (dict(max_num_seqs=0, max_model_len=64), "max_num_seqs must be an integer >= 1",
         "max_num_seqs"),
        (dict(max_num_seqs=4, max_model_len=1.5), "max_model_len must be an integer >= 1",
         "max_model_len"),
        (dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=0),
         "max_num_batched_tokens must be an integer >= 1", "max_num_batched_tokens"),
        (dict(max_num_seqs=4, max_model_len=64, policy="lifo"), "policy must be one of",
         "policy")]
    for fields, rule, parameter in cases:
        with pytest.raises(ParameterError, match=rule) as err:
            SchedulerConfig(**fields)
        assert err.value.parameter == parameter
    with pytest.raises(ParameterError, match="kv_capacity must be an integer in") as err:
        TokenKVPool(4, 64, 0)
    assert err.value.parameter == "kv_capacity"
    for priority in (1.5, True, "high", None):
        with pytest.raises(ParameterError, match="priority must be an integer") as err:
            make_request("d", 3, 1, priority=priority)
        assert err.value.parameter == "priority"
    for salt in ("", 5, "\ud800"):
        with pytest.raises(ParameterError, match="cache_salt must be") as err:
            make_request("e", 3, 1, cache_salt=salt)
        assert err.value.parameter == "cache_salt"


# --- a schedule() that raises is all or nothing; admits' answer is checked --------------------

def flaky(s, answer):
    """The scheduler s with `admits` replaced by answer(scheduler, request, n) (its class
    swapped for a subclass, so S10's schedule calls it as it calls any override)."""
    base = type(s)

    class Flaky(base):
        def admits(self, request, num_new_tokens):
            return answer(self, request, num_new_tokens)

    s.__class__ = Flaky
    return s


def books(s) -> tuple:
    """Everything a call of `schedule` may change: the queues in order, each queued request's
    status and counts and the KV it holds, the pool's total, the step count."""
    return (tuple((r.request_id, r.status, r.num_computed_tokens, r.num_cached_tokens,
                   r.num_preemptions, s.kv.num_tokens(r.request_id))
                  for q in (s.running, s.waiting) for r in q),
            s.kv.num_used_tokens, s.kv.num_free_tokens, s.num_steps, s.num_preemptions,
            s.has_unfinished_requests())


def s11_scheduler():
    from scheduler_testing import chunked_scheduler
    return chunked_scheduler(TokenKVPool(4, 64), 4, 16, 64)


def s12_scheduler():
    from s12_paged_attention import KVCacheManager
    from scheduler_testing import chunked_scheduler
    return chunked_scheduler(KVCacheManager(17, 4), 4, 16, 64)


def s13_scheduler():
    from s13_prefix_caching import PrefixCachingKVCacheManager
    from scheduler_testing import chunked_scheduler
    return chunked_scheduler(PrefixCachingKVCacheManager(17, 4), 4, 16, 64)


@pytest.mark.parametrize("make", [lambda: scheduler(budget=64), s11_scheduler, s12_scheduler,
                                  s13_scheduler], ids=["s10", "s11", "s12", "s13"])
def test_a_schedule_that_raises_in_admits_changes_nothing_and_loses_nothing(make):
    """Two requests run; then "2" and "3" arrive and admits raises for "3", after "2" was
    admitted and both running requests got KV for their next token in the same call. Five
    such calls in a row leave every queue, count and KV token as they were, and the
    exception reaches the caller; once admits answers, every request gets its tokens
    alone, and the pool ends empty (S10's scheduler, S11's chunked one, and S11's over S12's
    and S13's block managers, all running S10's schedule)."""
    armed = {"on": False}

    def answer(s, request, n):
        if armed["on"] and request.request_id == "3":
            raise RuntimeError("admits failed")
        return True

    s = flaky(make(), answer)
    model = FakeModel(s, 64)
    for rid, (p, m) in enumerate([(6, 12), (9, 12)]):
        model.add(make_request(str(rid), p, m))
    while not all(r.output_ids for r in model.by_id.values()):
        model.step()                      # both prompts computed, both decoding
    model.add(make_request("2", 5, 4))
    model.add(make_request("3", 7, 4))
    armed["on"] = True
    before = books(s)
    for _ in range(5):
        with pytest.raises(RuntimeError, match="admits failed"):
            s.schedule()
        assert books(s) == before
        check_invariants(s, model.plans[-1])
    armed["on"] = False
    model.drain()
    for rid, (p, m) in enumerate([(6, 12), (9, 12), (5, 4), (7, 4)]):
        assert model.by_id[str(rid)].output_ids == alone(p, m, 64)
        assert model.ended[str(rid)] == "stop"
    assert s.kv.num_used_tokens == 0 and not s.has_unfinished_requests()


def test_a_request_ended_by_the_capacity_in_a_call_that_raises_is_ended_by_the_next_plan():
    """A prompt of 6 tokens in a capacity of 10: after 10 - 6 + 1 = 5 tokens it has 11, more
    than the pool, and the call that ends it raises (admits, for "b" waiting). The end is
    not lost: it can never run again, so it stays ended (its KV free) and the next plan
    reports it in finished_ids; until then the scheduler has unfinished requests. Then "b"
    runs alone and everything is free."""
    armed = {"on": False}

    def answer(s, request, n):
        if armed["on"]:
            raise RuntimeError("admits failed")
        return True

    s = flaky(scheduler(max_num_seqs=2, budget=64, capacity=10, max_model_len=32), answer)
    model = FakeModel(s, 32)
    a = model.add(make_request("a", 6, 20))
    while a.num_tokens <= s.kv_capacity:
        model.step()
    assert len(a.output_ids) == 5 and a.status == RequestStatus.RUNNING
    model.add(make_request("b", 3, 2))
    armed["on"] = True
    for _ in range(3):
        with pytest.raises(RuntimeError, match="admits failed"):
            s.schedule()
        assert s.has_unfinished_requests() and s.kv.num_used_tokens == 0
        assert [r.request_id for r in s.waiting] == ["b"] and not s.running
    armed["on"] = False
    plan = model.step()
    assert plan.finished_ids == ("a",) and plan.scheduled_new_ids == ("b",)
    model.drain()
    assert model.ended == {"a": "length", "b": "stop"} and a.output_ids == alone(6, 20, 32)[:5]
    assert idle(s) and s.schedule().finished_ids == ()


def test_finish_requests_takes_out_a_request_still_to_be_reported_as_ended():
    """An abort between the failed call that ended "a" and the next plan: finish_requests
    returns its id, and the next plan does not report it again."""
    def answer(s, request, n):
        if request.request_id == "b":
            raise RuntimeError("admits failed")
        return True

    s = flaky(scheduler(max_num_seqs=2, capacity=10, max_model_len=32), answer)
    model = FakeModel(s, 32)
    a = model.add(make_request("a", 10, 20))
    model.step()                        # 10 computed, 11 tokens: ended by the next call
    model.add(make_request("b", 3, 2))
    with pytest.raises(RuntimeError):
        s.schedule()
    assert a.status == RequestStatus.FINISHED and s.has_unfinished_requests()
    assert s.finish_requests(["a"]) == ["a"] and s.finish_requests(["a"]) == []
    assert not s.running and [r.request_id for r in s.waiting] == ["b"]


@pytest.mark.parametrize("answer,shown", [(None, "None (NoneType)"), ("no", "'no' (str)"),
                                          (np.array([True, False]), "(ndarray)"),
                                          (1, "1 (int)")])
def test_admits_must_answer_a_bool(answer, shown):
    """None, a string, an array or an int are not an answer: TypeError naming admits, what it
    returned and the request, and nothing changes. NumPy's bool is one."""
    s = flaky(scheduler(), lambda s, request, n: answer)
    model = FakeModel(s, 64)
    model.add(make_request("a", 5, 3))
    before = books(s)
    with pytest.raises(TypeError, match=r"Flaky\.admits must return a bool .* returned "
                                        rf".*{re.escape(shown)} for request 'a'"):
        s.schedule()
    assert books(s) == before
    s2 = flaky(scheduler(), lambda s, request, n: np.bool_(True))
    FakeModel(s2, 64).add(make_request("a", 5, 3))
    assert s2.schedule().scheduled_new_ids == ("a",)


def test_an_admits_that_refuses_while_nothing_runs_is_an_error_not_a_hang():
    """Refusing the head of the queue while nothing runs would wait forever (no running
    request will finish and free KV): RuntimeError naming the request, nothing changed.
    Refusing while something runs is a wait, as before."""
    s = flaky(scheduler(), lambda s, request, n: bool(s.running) and False)
    model = FakeModel(s, 64)
    model.add(make_request("a", 5, 3))
    before = books(s)
    with pytest.raises(RuntimeError, match=r"refused request 'a' while no request is running"
                                           r".*can never make progress"):
        s.schedule()
    assert books(s) == before
    s = flaky(scheduler(), lambda s, request, n: not s.running)
    model = FakeModel(s, 64)
    model.add(make_request("a", 5, 3))
    model.add(make_request("b", 5, 3))
    assert model.step().scheduled_new_ids == ("a",)     # "b" waits while "a" runs
    model.drain()
    assert model.ended == {"a": "stop", "b": "stop"} and idle(s)
