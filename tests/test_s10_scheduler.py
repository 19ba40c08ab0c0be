"""Tests for chapter S10's model-free scheduler (code/s10_scheduler.py), in the spirit of vLLM's
tests/v1/core/test_scheduler.py: a stand-in request and a fake model step, no model at all.

Oracles. The fake model's next token is a fixed function of the context it has computed (its
own record of the tokens the scheduler sent it), so a request's outputs do not depend on the
schedule: a run with unbounded KV capacity is the reference, and a lost, duplicated or
mis-positioned token under preemption changes every token after it. Orders and victims are
worked out by hand in the comments; lengths that end by the capacity are closed forms
(a prompt of P tokens in a capacity of C makes C - P + 1 tokens).

Public bug reports (../shared/cases/public-bugs.md, section (g)): G1 vllm PR #1534 (a prompt
that can never fit must not block the queue) and G5 sglang PR #2238 / #1674 / #6778 (once idle,
every KV token is free), each a test below; G2 (preemption loses tokens) is the recompute test.
"""
import pytest

from s10_scheduler import (FINISHED, PREEMPTED, RUNNING, WAITING, Scheduler, SchedulerOutput,
                           TokenKVPool)

VOCAB = 97


class Req:
    """The least a request needs to be scheduled, plus what the fake model keeps."""

    def __init__(self, request_id: str, prompt_len: int, max_tokens: int):
        self.request_id = request_id
        self.prompt_ids = [(7 * i + prompt_len) % VOCAB for i in range(prompt_len)]
        self.token_ids = list(self.prompt_ids)
        self.output_ids: list[int] = []
        self.num_computed_tokens = 0
        self.max_tokens = max_tokens


def next_token(context: list[int]) -> int:
    return (31 * sum(context) + 7 * len(context) + context[-1]) % VOCAB


class FakeModel:
    """Runs a SchedulerOutput: keeps each request's computed context (what a KV cache would
    hold), checks the scheduler asked for exactly the tokens after it, and samples a token
    for each request whose scheduled tokens reach the end of its token_ids. A request stops
    at its max_tokens or when its context reaches max_model_len (Part I's stop rules)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.kv: dict[str, list[int]] = {}
        self.by_id: dict[str, Req] = {}
        self.ended: dict[str, str] = {}       # request id -> "length" / "stop" / "abort"
        self.outputs: list[SchedulerOutput] = []

    def add(self, req: Req, priority: int = 0) -> Req:
        self.scheduler.add_request(req, priority)
        self.by_id[req.request_id] = req
        return req

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.outputs.append(out)
        for rid in out.finished_ids:
            self.ended[rid] = "length"
        finished = []
        for rid, n in out.num_scheduled_tokens.items():
            req, start = self.by_id[rid], out.num_computed_tokens[rid]
            assert start == req.num_computed_tokens and n >= 1
            kept = self.kv.get(rid, [])[:start]
            assert len(kept) == start, "the scheduler claims KV the model never computed"
            self.kv[rid] = kept + req.token_ids[start:start + n]
            if start + n == len(req.token_ids):
                assert self.kv[rid] == req.token_ids
                token = next_token(self.kv[rid])
                req.token_ids.append(token)
                req.output_ids.append(token)
                if (len(req.output_ids) >= req.max_tokens
                        or len(req.token_ids) >= self.scheduler.max_model_len):
                    finished.append(rid)
                    self.ended[rid] = "stop"
        self.scheduler.update_from_output(out, finished)
        check_invariants(self.scheduler, out)
        return out

    def drain(self, limit: int = 10_000) -> None:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < limit, "the scheduler never drains (a hang)"


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert 0 <= s.kv.num_used_tokens <= s.kv_capacity
    ids = [r.request_id for r in (*s.running, *s.waiting)]
    assert len(ids) == len(set(ids)), "a request in two queues"
    for r in s.running:
        assert r.status == RUNNING and s.kv.num_tokens(r.request_id) == r.num_computed_tokens
    for r in s.waiting:
        assert r.status in (WAITING, PREEMPTED) and s.kv.num_tokens(r.request_id) == 0
    assert s.kv.num_used_tokens == sum(r.num_computed_tokens for r in s.running)


def alone(prompt_len: int, max_tokens: int, max_model_len: int) -> list[int]:
    """The fake model's tokens for one request with all the room it wants."""
    req = Req("x", prompt_len, max_tokens)
    while len(req.output_ids) < max_tokens and len(req.token_ids) < max_model_len:
        req.token_ids.append(next_token(req.token_ids))
        req.output_ids.append(req.token_ids[-1])
    return req.output_ids


def run(requests, max_num_seqs=4, budget=64, capacity=10_000, max_model_len=64,
        policy="fcfs", priorities=None):
    model = FakeModel(Scheduler(max_num_seqs, budget, capacity, max_model_len, policy))
    for i, (p, m) in enumerate(requests):
        model.add(Req(str(i), p, m), (priorities or [0] * len(requests))[i])
    model.drain()
    return model


MIX = [(5, 6), (9, 3), (14, 8), (3, 12), (20, 5), (7, 7), (11, 9), (2, 4)]


# --- the pool -------------------------------------------------------------------------------

def test_token_pool_allocates_all_or_nothing_and_frees_what_a_request_holds():
    pool = TokenKVPool(10)
    assert pool.allocate_slots("a", 6) and pool.allocate_slots("b", 3)
    assert not pool.allocate_slots("a", 2)        # 1 free: nothing taken
    assert (pool.num_tokens("a"), pool.num_free_tokens) == (6, 1)
    assert pool.allocate_slots("a", 1) and pool.num_free_tokens == 0
    assert pool.free("a") == 7 and pool.free("a") == 0 and pool.num_used_tokens == 3
    with pytest.raises(ValueError, match="kv_capacity must be an integer >= 1"):
        TokenKVPool(0)
    with pytest.raises(ValueError, match="num_new_tokens must be an integer >= 0"):
        pool.allocate_slots("c", -1)


# --- budgets and order ----------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs,budget,capacity", [
    (4, 64, 10_000), (2, 64, 10_000), (8, 24, 10_000), (8, 64, 40), (3, 24, 30), (1, 64, 21)])
def test_budgets_are_never_exceeded_and_every_output_equals_the_request_alone(
        max_num_seqs, budget, capacity):
    model = run(MIX, max_num_seqs, budget, capacity, max_model_len=24)
    for i, (p, m) in enumerate(MIX):
        req = model.by_id[str(i)]
        want = alone(p, m, 24)
        if model.ended[str(i)] == "length":        # the capacity ended it: C - P + 1 tokens
            assert len(req.output_ids) == capacity - p + 1 < len(want)
        assert req.output_ids == want[:len(req.output_ids)]
        assert model.ended[str(i)] == "length" or req.output_ids == want
    assert max(o.total_num_scheduled_tokens for o in model.outputs) <= budget
    assert model.scheduler.kv.num_free_tokens == capacity and not model.scheduler.kv.held


def test_fcfs_admits_in_arrival_order_and_stops_at_the_first_that_does_not_fit():
    # Capacity 30: "0" (12) and "1" (10) fit, "2" (9) does not (22 + 9 > 30), so "3" (1
    # token, which would fit) must wait behind it: no skipping.
    model = FakeModel(Scheduler(8, 64, 30, 64))
    for rid, p in (("0", 12), ("1", 10), ("2", 9), ("3", 1)):
        model.add(Req(rid, p, 4))
    first = model.step()
    assert first.scheduled_new_ids == ("0", "1")
    assert [r.request_id for r in model.scheduler.waiting] == ["2", "3"]
    model.drain()
    admitted = [rid for o in model.outputs for rid in o.scheduled_new_ids]
    assert admitted == ["0", "1", "2", "3"]


def test_priority_admits_the_lowest_value_first_then_by_arrival():
    # One seat: after the first request (admitted alone at step 0), the others run in
    # (priority, arrival) order: 1 (0), 3 (0), 4 (1), 2 (5).
    model = FakeModel(Scheduler(1, 64, 1000, 64, "priority"))
    model.add(Req("0", 4, 2), 3)
    model.step()
    for rid, prio in (("1", 0), ("2", 5), ("3", 0), ("4", 1)):
        model.add(Req(rid, 4, 2), prio)
    assert [r.request_id for r in model.scheduler.waiting] == ["1", "3", "4", "2"]
    model.drain()
    assert [rid for o in model.outputs for rid in o.scheduled_new_ids] == ["0", "1", "3", "4",
                                                                           "2"]


def test_the_running_requests_go_first_and_the_token_budget_holds_back_a_prompt():
    # Budget 10: "0" and "1" run (prompts 4 + 5 = 9); next step their 2 decodes leave 8, so
    # "2" (9 tokens) waits; once "0" is done (max_tokens 2), 1 decode + 9 fits.
    model = FakeModel(Scheduler(4, 10, 1000, 10))
    for rid, p, m in (("0", 4, 2), ("1", 5, 4), ("2", 9, 1)):
        model.add(Req(rid, p, m))
    steps = [model.step() for _ in range(3)]
    assert [o.scheduled_new_ids for o in steps] == [("0", "1"), (), ("2",)]
    assert steps[1].scheduled_running_ids == ("0", "1") and steps[1].num_waiting == 1
    assert steps[2].num_scheduled_tokens == {"1": 1, "2": 9}


# --- preemption -----------------------------------------------------------------------------

def test_fcfs_preempts_the_most_recently_admitted_and_it_resumes_at_the_front():
    # Capacity 20, prompts 6, 6, 7 (19 tokens after step 0). Step 1: "0" takes the last free
    # token, "1" finds none, so the tail "2" is preempted (freeing 7) and "1" runs.
    model = FakeModel(Scheduler(4, 64, 20, 64))
    for rid, p in (("0", 6), ("1", 6), ("2", 7)):
        model.add(Req(rid, p, 5))
    model.step()
    later = model.add(Req("3", 2, 2))
    out = model.step()
    assert out.preempted_ids == ("2",) and out.scheduled_running_ids == ("0", "1")
    assert out.scheduled_new_ids == ()                      # nobody admitted in that step
    resumed = model.by_id["2"]
    assert (resumed.status, resumed.num_computed_tokens, resumed.num_preemptions) == (
        PREEMPTED, 0, 1)
    assert [r.request_id for r in model.scheduler.waiting] == ["2", "3"]   # front, not back
    model.drain()
    back = next(o for o in model.outputs if "2" in o.scheduled_resumed_ids)
    # Its recompute is its prompt and the one token it had made: 7 + 1.
    assert back.num_scheduled_tokens["2"] == 8 and back.num_computed_tokens["2"] == 0
    assert resumed.output_ids == alone(7, 5, 64) and later.output_ids == alone(2, 2, 64)


def test_priority_preempts_the_lowest_priority_even_if_it_was_admitted_first():
    # "0" has priority 9 and is admitted first; "1" (priority 0) then runs beside it. When
    # KV runs out, "0" is the victim (largest value), not the tail "1".
    model = FakeModel(Scheduler(4, 64, 14, 64, "priority"))
    model.add(Req("0", 6, 6), 9)
    model.step()                                    # "0": 6 tokens, then 7 held
    model.add(Req("1", 6, 6), 0)
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
    model = FakeModel(Scheduler(4, 64, 17, 64, "priority"))
    model.add(Req("0", 6, 4), 5)
    model.step()
    model.add(Req("1", 5, 4), 0)
    model.add(Req("2", 5, 4), 0)
    model.step()                                    # "0" decodes (7), "1" and "2" prefill
    assert model.scheduler.kv.num_free_tokens == 0
    out = model.step()
    assert out.preempted_ids == ("0",) and out.scheduled_ids == ("1", "2")
    model.drain()
    assert [model.by_id[r].output_ids for r in "012"] == [alone(6, 4, 64)] + [
        alone(5, 4, 64)] * 2


def test_a_preempted_request_recomputes_prompt_and_outputs_with_nothing_lost():
    """vllm #16832 (G2): output incomplete after recompute preemption. Under a capacity that
    preempts again and again, each resumed request computes prompt + every output it had,
    and its outputs equal the unbounded run's, length included."""
    requests = [(10, 12), (12, 12), (8, 12), (11, 12)]
    tight = run(requests, capacity=30)
    free = run(requests)
    assert tight.scheduler.num_preemptions >= 3
    for out in tight.outputs:
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
    model = FakeModel(Scheduler(4, 64, 19, 64))
    model.add(Req("0", 9, 3))
    model.add(Req("1", 9, 3))
    model.step()
    out = model.step()
    assert out.preempted_ids == ("1",) and out.scheduled_ids == ("0",)
    model.drain()
    assert model.by_id["1"].output_ids == alone(9, 3, 64)


# --- requests that can never fit, aborts, idle ------------------------------------------------

def test_a_prompt_longer_than_the_capacity_is_refused_and_blocks_nobody():
    """vllm PR #1534 (G1): a prompt needing more KV than the whole pool stayed at the head of
    the queue forever. Here it is refused at add_request; the requests behind it finish."""
    s = Scheduler(4, 64, 16, 64)
    model = FakeModel(s)
    model.add(Req("a", 5, 3))
    with pytest.raises(ValueError, match="prompt is 17 tokens but kv_capacity is 16 tokens: "
                                         "it could never be scheduled"):
        model.add(Req("big", 17, 3))
    model.add(Req("b", 6, 3))
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    model.drain()
    assert model.ended == {"a": "stop", "b": "stop"}


def test_a_lone_request_that_fills_the_capacity_ends_with_length():
    # Prompt 5, capacity 8: it makes tokens until its context is 9 > 8 (8 - 5 + 1 = 4 tokens),
    # then the scheduler ends it instead of preempting it forever.
    model = run([(5, 50)], capacity=8)
    req = model.by_id["0"]
    assert model.ended == {"0": "length"} and req.output_ids == alone(5, 4, 64)
    end = next(o for o in model.outputs if o.finished_ids)
    assert end.finished_ids == ("0",) and end.preempted_ids == () and not end.scheduled_ids
    assert req.status == FINISHED and model.scheduler.kv.num_free_tokens == 8


def test_abort_frees_everything_from_either_queue():
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted requests leaked KV. Aborts of a running,
    a preempted and a waiting request, then the rest finish: once idle every token is free."""
    model = FakeModel(Scheduler(3, 64, 20, 64))
    for rid, p in (("0", 6), ("1", 6), ("2", 7), ("3", 4), ("4", 3)):
        model.add(Req(rid, p, 6))
    model.step()
    model.step()                                   # "2" preempted (see the FCFS test)
    s = model.scheduler
    assert [r.request_id for r in s.waiting] == ["2", "3", "4"]
    assert s.abort("2") and model.by_id["2"].status == FINISHED       # preempted
    assert s.abort("4")                                               # waiting, never ran
    held = s.kv.num_tokens("1")
    free = s.kv.num_free_tokens
    assert s.abort("1") and s.kv.num_free_tokens == free + held       # running
    assert not s.abort("1") and not s.abort("nobody")
    assert [r.request_id for r in s.running] == ["0"]
    model.drain()
    assert s.kv.num_free_tokens == 20 and not s.kv.held and not s.has_unfinished_requests()
    for rid in ("0", "3"):
        assert model.by_id[rid].output_ids == alone(len(model.by_id[rid].prompt_ids), 6, 64)


def test_an_aborted_request_between_schedule_and_update_is_skipped():
    model = FakeModel(Scheduler(2, 64, 100, 64))
    model.add(Req("a", 4, 3))
    out = model.scheduler.schedule()
    model.scheduler.abort("a")
    model.scheduler.update_from_output(out, ["a"])
    assert model.scheduler.kv.num_free_tokens == 100 and not model.scheduler.running


def test_revert_gives_back_the_kv_of_a_failed_step():
    s = Scheduler(2, 64, 100, 64)
    a, b = Req("a", 4, 3), Req("b", 6, 3)
    s.add_request(a)
    s.update_from_output(s.schedule())             # "a" computed its prompt: holds 4
    a.token_ids.append(5)                          # and sampled a token
    s.add_request(b)
    out = s.schedule()                             # "a" +1, "b" +6 scheduled
    assert s.kv.num_used_tokens == 11
    s.revert(out)                                  # the model step failed
    assert (s.kv.num_tokens("a"), s.kv.num_tokens("b")) == (4, 0)
    again = s.schedule()
    assert again.num_scheduled_tokens == {"a": 1, "b": 6} and s.kv.num_used_tokens == 11


def test_steps_are_numbered_without_idle_calls_and_a_failed_step_gives_its_number_back():
    """SchedulerOutput.step counts steps that plan something (so an engine's trace numbers
    match): a schedule() with nothing to plan keeps the count, and revert() of a failed step
    takes its number back."""
    s = Scheduler(2, 64, 100, 64)
    assert s.schedule().step == 0 and s.num_steps == 0          # idle: nothing to plan
    a = Req("a", 4, 3)
    s.add_request(a)
    first = s.schedule()
    assert first.step == 0 and first.num_scheduled_tokens == {"a": 4} and s.num_steps == 1
    s.revert(first)                                # its model step failed: not a step
    assert s.num_steps == 0
    again = s.schedule()
    assert again.step == 0 and again.num_scheduled_tokens == {"a": 4}
    s.update_from_output(again, ["a"])
    assert s.schedule().step == 1 and s.num_steps == 1          # idle again: no count
    model = run(MIX, max_num_seqs=3, budget=64, capacity=40)
    assert [o.step for o in model.outputs] == list(range(len(model.outputs)))


# --- bad arguments ------------------------------------------------------------------------------

def test_bad_arguments_are_refused_naming_the_rule():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= "
                                         r"max_model_len \(64\): without chunked prefill"):
        Scheduler(4, 32, 100, 64)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        Scheduler(0, 64, 100, 64)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
        Scheduler(4, 64, 100, 1.5)
    with pytest.raises(ValueError, match="kv_capacity must be an integer >= 1"):
        Scheduler(4, 64, 0, 64)
    with pytest.raises(ValueError, match="policy must be one of"):
        Scheduler(4, 64, 100, 64, "lifo")
    s = Scheduler(4, 64, 100, 16)
    s.add_request(Req("a", 3, 1))
    for bad, rule in ((Req("a", 3, 1), "request_id 'a' is already queued"),
                      (Req("b", 17, 1), "request 'b' has 17 tokens but max_model_len is 16"),
                      (Req("c", 0, 1), "a new request needs a prompt")):
        with pytest.raises(ValueError, match=rule):
            s.add_request(bad)
    for priority in (1.5, True, "high"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            s.add_request(Req("d", 3, 1), priority)
    assert [r.request_id for r in s.waiting] == ["a"]
