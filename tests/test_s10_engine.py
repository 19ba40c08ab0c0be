"""Tests for chapter S10's engine: S09's engine with S10's scheduler (`s10_scheduler.build_engine`).

Oracles: the S06 engine on each request alone (whole completions: ids, text, finish_reason,
stop_reason, logprobs, seeded samples), S05 and HF `generate` alone (greedy ids, float32,
eager attention), S09's engine (the default S10 engine must schedule exactly as it does), and
counts worked out by hand (a prompt of P tokens in a capacity of C makes C - P + 1 tokens; the
FCFS bound on steps, below).

Exactness, as in S09: the batch-invariant mode (here with preemption: the runner computes a
resumed request again with S06's shapes) must give each request bitwise its outputs alone, so
completions are compared with ==; the fast mode recomputes a preempted request in one pass,
its greedy ids are compared with == against S05 and HF on these models (their top-2 gaps are
far above float32 differences, S08's measurement) and held to S08's `follows_batch_rule`
against the reference.

The scheduler's invariants are checked at every step (`budget_check`): the token budget and
max_num_seqs, KV accounting (each running request holds exactly its computed tokens, waiting
ones none), at most one token per request per step, the trace's step numbers.

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534, G2 vllm #16832 (an open report without a reproduction), G4 vllm #24584 (PR #24586
closed unmerged; a maintainer said AsyncLLM already aborts on disconnect), G5 sglang PR #2238 /
PR #1674 / #6778.
"""
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s08_batch_variance as s08bv
import s08_cli
import s09_continuous_batching as s09
import s10_scheduler as s10
from engine_testing import (FailingRunner, NaNRows, drive, greedy, id_text, tiny_fixture,
                            tokens_of)
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s09_scheduler import RequestStatus
from s09_llm import LLM
from s09_trace import StepRecord, trace
from s10_scheduler import TABLE_ID_COLUMNS, format_schedule_table
from scheduler_testing import check_invariants

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 90]    # 90 + 8 > 96: the context stop fires
PROMPTS = [np.random.default_rng(300 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
TIGHT = 100     # >= 95, the most KV any request here needs (90 + 6 - 1), far below their sum
ARRIVAL = [4, 5, 3, 6, 2, 7, 1, 0]   # an order of PROMPTS that preempts 4 times in TIGHT

text = id_text

tiny = tiny_fixture("s10", ["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"], PROMPTS,
                    CONTEXT, NEW)


def engine_for(model, max_num_seqs: int, tokenizer=None, **options) -> s09.LLMEngine:
    """S10's engine on a tiny model (IdTokenizer, context CONTEXT) or the bundled one."""
    if tokenizer is None:
        tokenizer, options = IdTokenizer(), {"max_context": CONTEXT, **options}
    return s10.build_engine(model, tokenizer, max_num_seqs=max_num_seqs, **options)


def mixed_params() -> list[s04.SamplingParams]:
    """Greedy with logprobs (for S08's rule) and seeded sampling, alternating."""
    return [greedy(logprobs=2) if i % 2 == 0 else
            s04.SamplingParams(temperature=1.0, seed=7 + i, top_k=20, max_tokens=NEW)
            for i in range(len(PROMPTS))]


class Plans:
    """An observer that keeps every plan the engine made."""

    def __init__(self):
        self.plans: list = []

    def on_plan(self, engine, plan) -> None:
        self.plans.append(plan)

    def on_step(self, engine, result) -> None:
        pass


def budget_check(engine):
    """S10's per-step invariants for `drive`: attaches a `StepTracer` and returns (tracer,
    check), where check asserts after each step the scheduler's invariants on its last plan
    (`check_invariants`: the token budget, max_num_seqs, KV accounting, no request in two
    queues), at most one token per request, and that the trace's records are numbered
    0, 1, 2, ... and count what they scheduled."""
    tracer, plans = trace(engine), Plans()
    engine.observers.append(plans)

    def check(engine, call, outputs):
        assert all(len(o.new_token_ids) <= 1 for o in outputs)
        if plans.plans:
            check_invariants(engine.scheduler, plans.plans[-1])
        if tracer.records:
            r = tracer.records[-1]
            assert r.step == len(tracer.records) - 1
            assert r.num_tokens == sum(r.num_scheduled_tokens) <= r.token_budget
            assert r.kv_used_tokens + r.kv_free_tokens == r.kv_capacity

    return tracer, check


def kv_idle(engine) -> bool:
    """Nothing unfinished, every KV token and slot free (invariant 8)."""
    kv = engine.scheduler.kv
    return (not engine.has_unfinished_requests() and kv.num_used_tokens == 0
            and kv.num_free_tokens == kv.capacity and not kv.slots
            and kv.free_slots == list(range(kv.num_slots)))


def collect(engine, seen: dict | None = None) -> dict:
    """Step until nothing is unfinished; every output by request id (added to `seen`)."""
    seen = {} if seen is None else seen
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    return seen


# --- preemption keeps every output ------------------------------------------------------------

@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_forced_preemption_gives_each_request_its_output_alone(tiny, invariant):
    """A KV capacity far below what the requests need together: requests are preempted and
    recomputed, and each still gives exactly its S06 completion alone (ids, text,
    finish_reason, logprobs in the invariant mode; greedy ids equal S05 and HF, seeded ids
    equal, and S08's rule against the reference in the fast mode)."""
    name, _, model, references = tiny
    prompts, params = [text(PROMPTS[k]) for k in ARRIVAL], mixed_params()
    engine = engine_for(model, 4, batch_invariant=invariant, max_num_batched_tokens=CONTEXT,
                        kv_capacity=TIGHT)
    tracer = trace(engine)
    got = LLM(engine).generate(prompts, params)
    resumed = [rid for r in tracer.records for rid in r.resumed]
    assert engine.scheduler.num_preemptions > 0 and resumed
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    for i, (c, prompt, p) in enumerate(zip(got, prompts, params)):
        alone = single.generate(prompt, p)
        if invariant:
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) == (
                alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason,
                alone.logprobs), (name, i)
        else:
            assert c.token_ids == alone.token_ids and c.finish_reason == alone.finish_reason
            if p.greedy:
                k = ARRIVAL[i]
                assert c.token_ids == references[k][0].token_ids == references[k][1]
                assert s08bv.follows_batch_rule(c, alone, s08bv.BATCH_TOLERANCE[torch.float32])
    for record in tracer.records:
        assert isinstance(record, StepRecord)
        assert record.num_tokens == sum(record.num_scheduled_tokens) <= record.token_budget
        assert record.kv_used_tokens + record.kv_free_tokens == TIGHT
        assert len(record.running) <= 4
    assert kv_idle(engine)


def test_a_resumed_request_recomputes_its_prompt_and_every_output(tiny):
    """vllm #16832 (G2, an open report without a reproduction): output incomplete after
    recompute preemption. Each resumed request is scheduled from position 0 with prompt +
    outputs so far (more than its prompt), and
    the run's outputs equal those of a run without preemption: the same ids, the same
    length, the same finish_reason."""
    name, _, model, references = tiny
    requests = [(text(PROMPTS[k]), greedy()) for k in ARRIVAL]
    free = engine_for(model, 4)
    tight = engine_for(model, 4, kv_capacity=TIGHT)
    tracer, check = budget_check(tight)
    outs_free, _ = drive(free, requests, [0] * 8, check=budget_check(free)[1])
    outs_tight, ids = drive(tight, requests, [0] * 8, check=check)
    assert free.scheduler.num_preemptions == 0 < tight.scheduler.num_preemptions
    prompt_len = {ids[i]: LENGTHS[k] for i, k in enumerate(ARRIVAL)}
    resumed = [(r, r.running.index(rid), rid) for r in tracer.records for rid in r.resumed]
    assert resumed
    for r, k, rid in resumed:
        assert r.num_computed_tokens[k] == 0 and r.kinds[k] == "prefill"
        assert r.num_scheduled_tokens[k] == r.request_num_tokens[k] > prompt_len[rid]
        assert rid in r.sampled
    for i, k in enumerate(ARRIVAL):
        a, b = outs_free[i], outs_tight[i]
        assert tokens_of(a) == tokens_of(b) == references[k][0].token_ids, (name, i)
        assert b[-1].finish_reason == a[-1].finish_reason == references[k][0].finish_reason


def test_the_default_engine_schedules_exactly_as_s09(tiny):
    """Default budget and capacity: nothing is preempted or held back, and the trace (who
    ran in which slot, in which order, joined, left, tokens, waiting, KV) is S09's step by
    step; so are the outputs."""
    name, _, model, _ = tiny
    requests = [(text(p), greedy()) for p in PROMPTS]
    arrivals = [0, 1, 2, 3, 5, 8, 9, 13]
    ours = engine_for(model, 3)
    theirs = s09.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=3)
    tracer, check = budget_check(ours)
    their_tracer = trace(theirs)
    outs, _ = drive(ours, requests, arrivals, check=check)
    their_outs, _ = drive(theirs, requests, arrivals)
    skip = ("token_budget", "model_s", "step_s")
    fields = lambda r: {k: v for k, v in asdict(r).items() if k not in skip}  # noqa: E731
    assert [fields(r) for r in tracer.records] == [fields(r) for r in their_tracer.records]
    assert outs == their_outs and ours.scheduler.num_preemptions == 0


class OldestScheduled:
    """An observer that checks FCFS's promise at every plan: the oldest unfinished request
    is scheduled in the step (or ended by the capacity), so nobody starves."""

    def on_plan(self, engine, plan) -> None:
        if engine.requests:
            oldest = min(engine.requests.values(), key=lambda r: r.arrival).request_id
            assert oldest in plan.scheduled_ids or oldest in plan.finished_ids, (
                f"step {plan.step}: {oldest} starved")

    def on_step(self, engine, result) -> None:
        pass


def test_every_request_finishes_within_a_bounded_number_of_steps_under_steady_arrivals(tiny):
    """FCFS under a steady stream (one arrival per step, a tight capacity): in every step the
    oldest unfinished request is scheduled (running requests are preempted from the newest
    end, and a waiting head is admitted whenever nobody was preempted), so request i finishes
    at most sum(max_tokens of requests 0..i) steps after it arrives."""
    name, _, model, references = tiny
    order = [2, 4, 5, 3, 1, 6, 0, 5, 4, 2, 3, 5, 1, 4, 6, 2]
    engine = engine_for(model, 3, kv_capacity=TIGHT)
    engine.observers.append(OldestScheduled())
    _, invariants = budget_check(engine)
    finish: dict[str, int] = {}

    def check(engine, call, outputs):
        invariants(engine, call, outputs)
        finish.update({o.request_id: call for o in outputs if o.finished})

    outputs, ids = drive(engine, [(text(PROMPTS[k]), greedy()) for k in order],
                         list(range(len(order))), check=check)
    assert engine.scheduler.num_preemptions > 0
    lengths = [len(references[k][0].token_ids) for k in order]
    for i, rid in ids.items():
        assert finish[rid] - i < sum(lengths[:i + 1]), rid
        assert tokens_of(outputs[i]) == references[order[i]][0].token_ids


# --- aborts, streams, idle -------------------------------------------------------------------

def test_aborting_a_waiting_a_running_and_a_preempted_request(tiny):
    """Each abort frees what the request holds at once; the others give their outputs alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 3, kv_capacity=TIGHT)
    s, kv = engine.scheduler, engine.scheduler.kv
    chosen = [5, 4, 6, 3, 2, 1]
    rids = [engine.add_request(text(PROMPTS[k]), greedy()) for k in chosen]
    seen: dict[str, list] = {rid: [] for rid in rids}
    preempted = None
    for _ in range(40):
        for o in engine.step():
            seen[o.request_id].append(o)
        preempted = next((r for r in s.waiting if r.status == RequestStatus.PREEMPTED), None)
        if preempted is not None:
            break
    assert preempted is not None
    running = s.running[0]
    never = next(r for r in s.waiting
                 if r.status == RequestStatus.WAITING and not r.output_ids)
    for request in (preempted, running, never):
        held, free = kv.num_tokens(request.request_id), kv.num_free_tokens
        assert engine.abort(request.request_id)
        assert kv.num_free_tokens == free + held and request.request_id not in engine.requests
        assert request.status == RequestStatus.FINISHED
    assert engine.abort(running.request_id) is False
    collect(engine, seen)
    aborted = {preempted.request_id, running.request_id, never.request_id}
    for k, rid in zip(chosen, rids):
        want = references[k][0].token_ids
        got = tokens_of(seen[rid])
        if rid in aborted:
            assert seen[rid][-1] == s09.RequestOutput(rid, [], "", True, "abort", None)
            assert got == want[:len(got)]
        else:
            assert got == want, (name, rid)
    assert kv_idle(engine)


def test_closing_a_stream_frees_its_kv_within_the_step(tiny):
    """vllm #24584 (G4, reported; PR #24586 closed unmerged): a client that disconnects
    mid-stream must not keep its request running and its KV held. Closing the stream aborts
    its requests: their slots and KV tokens are free before close returns, and the engine
    serves the next request."""
    name, _, model, references = tiny
    engine = engine_for(model, 2, kv_capacity=TIGHT)
    stream = LLM(engine).stream([text(PROMPTS[4]), text(PROMPTS[5])], 30)
    next(stream)
    assert engine.scheduler.kv.num_free_tokens < TIGHT
    stream.close()
    kv = engine.scheduler.kv
    assert kv.num_free_tokens == TIGHT and kv.free_slots == [0, 1] and not kv.slots
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    rid = engine.add_request(text(PROMPTS[3]), NEW)
    assert tokens_of(collect(engine)[rid]) == references[3][0].token_ids
    assert kv_idle(engine)


def test_idle_means_every_kv_token_is_free_after_finishes_and_aborts(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted and completed requests leaked KV.
    Many requests under preemption, some aborted while running, some while waiting (one of
    them preempted), one aborted twice: once idle, free KV == capacity and free slots ==
    total, and the rest give their outputs alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 3, kv_capacity=TIGHT)
    requests = [(text(PROMPTS[ARRIVAL[i % 8]]), greedy()) for i in range(12)]
    aborts = {1: [0, 9], 3: [4, 5, 11], 4: [4], 6: [2]}
    outputs, ids = drive(engine, requests, [0] * 10 + [2, 2], aborts,
                         check=budget_check(engine)[1])
    assert engine.scheduler.num_preemptions > 0 and kv_idle(engine)
    for i, outs in outputs.items():
        want = references[ARRIVAL[i % 8]][0].token_ids
        got = tokens_of(outs)
        if outs[-1].finish_reason == "abort":
            assert got == want[:len(got)] and i in {0, 2, 4, 5, 9, 11}
        else:
            assert got == want


# --- requests that can never fit --------------------------------------------------------------

def test_a_prompt_longer_than_the_capacity_is_refused_and_blocks_nobody(tiny):
    """vllm PR #1534 (G1): a prompt needing more KV blocks than the whole pool stayed at the
    head of the queue and blocked every later request. Here add_request (and LLM's
    generate) refuse it with a ParameterError naming the prompt and the rule, with nothing
    queued; the requests around it finish. A prompt that fills the context needs no KV (it
    finishes on arrival) and is still accepted."""
    name, _, model, references = tiny
    engine = engine_for(model, 2, kv_capacity=40)
    first = engine.add_request(text(PROMPTS[3]), greedy())
    for prompt in (text(PROMPTS[5]), PROMPTS[5]):
        with pytest.raises(ParameterError, match="prompt is 50 tokens but kv_capacity is 40 "
                                                 "tokens: it could never be scheduled") as err:
            engine.add_request(prompt, greedy())
        assert err.value.parameter == "prompt"
    full = engine.add_request(text([5] * CONTEXT), greedy())
    last = engine.add_request(text(PROMPTS[2]), greedy())
    assert [r.request_id for r in engine.scheduler.waiting] == [first, last]
    seen = collect(engine)
    assert tokens_of(seen[first]) == references[3][0].token_ids
    assert tokens_of(seen[last]) == references[2][0].token_ids
    assert seen[full][-1].finish_reason == "length" and tokens_of(seen[full]) == []
    with pytest.raises(ParameterError, match="prompt 1: prompt is 50 tokens but kv_capacity"):
        LLM(engine).generate([text(PROMPTS[1]), text(PROMPTS[5])], greedy())
    assert kv_idle(engine)


def test_a_request_that_outgrows_the_capacity_ends_with_length_in_the_same_step(tiny):
    """A prompt of 16 tokens in a capacity of 20 tokens: after 20 - 16 + 1 = 5 tokens its
    next step would need 21, more than the whole pool, so the scheduler ends it, and the
    engine returns its last output (no token, finish_reason "length") from that very step,
    never a retry loop; the 5 tokens are its first 5 alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 2, kv_capacity=20)
    tracer, invariants = budget_check(engine)
    ended_at = []

    def check(engine, call, outputs):
        invariants(engine, call, outputs)
        if any(o.finish_reason == "length" for o in outputs):
            ended_at.append((call, len(tracer.records), tracer.records[-1]))

    outputs, ids = drive(engine, [(text(PROMPTS[3]), greedy(30))], [0], check=check)
    rid, outs = ids[0], outputs[0]
    assert tokens_of(outs) == references[3][0].token_ids[:5] and len(outs) == 6
    assert outs[-1] == s09.RequestOutput(rid, [], "", True, "length", None)
    ((call, num_records, record),) = ended_at
    # The step that ended it is the sixth, its record the last: nothing scheduled, rid ended.
    assert call == 5 and num_records == 6 and record is tracer.records[-1]
    assert (record.ended, record.running, record.sampled, rid in record.left) == (
        (rid,), (), (), True)
    assert [r.ended for r in tracer.records if r.ended] == [(rid,)] and kv_idle(engine)
    done = LLM(engine).generate(text(PROMPTS[3]), 30)
    assert (done.token_ids, done.finish_reason) == (references[3][0].token_ids[:5], "length")


# --- policy, failures, errors -------------------------------------------------------------------

def test_priority_policy_admits_lower_values_first_and_fcfs_ignores_them(tiny):
    name, _, model, references = tiny
    chosen, priorities = [2, 3, 4, 1], [2, 0, 1, 0]
    for policy, order in (("priority", [1, 3, 2, 0]), ("fcfs", [0, 1, 2, 3])):
        engine = engine_for(model, 1, policy=policy)
        tracer, check = budget_check(engine)
        outputs, ids = drive(engine, [(text(PROMPTS[k]), greedy(), {"priority": p})
                                      for k, p in zip(chosen, priorities)], [0] * 4,
                             check=check)
        assert [rid for r in tracer.records for rid in r.joined] == [ids[i] for i in order]
        for i, k in enumerate(chosen):
            assert tokens_of(outputs[i]) == references[k][0].token_ids


def test_a_bad_row_or_a_failed_model_run_ends_nothing_but_its_own(tiny):
    """Two failures under a token capacity. A model run that raises (`FailingRunner`) fails
    step(): the KV the step had allocated goes back (each running request holds its computed
    tokens), the step has no record and its number is taken back. A request whose row turns
    NaN (`NaNRows`) ends alone in that step, "abort" with the error, and its KV is free at
    once. The other request gives its output alone; every token is free at the end."""
    name, _, model, references = tiny
    engine = engine_for(model, 2, kv_capacity=60)
    tracer, check = budget_check(engine)
    engine.runner = failing = FailingRunner(NaNRows(engine.runner, bad="b", after=2))
    engine.add_request(text(PROMPTS[3]), greedy(), request_id="a")
    engine.add_request(text(PROMPTS[4]), greedy(), request_id="b")
    seen = {}
    for o in engine.step():
        seen.setdefault(o.request_id, []).append(o)
    failing.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    s = engine.scheduler
    assert [(r.request_id, s.kv.num_tokens(r.request_id), r.num_computed_tokens)
            for r in s.running] == [("a", 16, 16), ("b", 31, 31)]
    check(engine, 1, [])
    for call in range(2, 4):
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
        check(engine, call, [])
    bad = seen["b"][-1]
    assert (bad.finish_reason, bad.error.parameter, len(tokens_of(seen["b"]))) == (
        "abort", None, 2)
    assert "b" not in engine.requests and s.kv.num_tokens("b") == 0
    assert tokens_of(seen["b"]) == references[4][0].token_ids[:2]
    collect(engine, seen)
    assert tokens_of(seen["a"]) == references[3][0].token_ids
    assert kv_idle(engine) and s.kv.num_free_tokens == 60
    # The failed step is not numbered: the trace's steps and the scheduler's agree.
    assert [r.step for r in tracer.records] == list(range(len(tracer.records)))
    assert s.num_steps == len(tracer.records)


def test_bad_arguments_are_refused_naming_the_parameter_before_anything_is_queued(tiny):
    name, _, model, _ = tiny
    cases = [
        (dict(max_num_batched_tokens=95), r"max_num_batched_tokens \(95\) must be >= "
                                          r"max_model_len \(96\)", "max_num_batched_tokens"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1",
         "max_num_batched_tokens"),
        (dict(kv_capacity=0), r"kv_capacity must be an integer in \[1, max_num_seqs x "
                              r"max_context = 192\]", "kv_capacity"),
        (dict(kv_capacity=193), r"kv_capacity must be an integer in \[1, max_num_seqs x "
                                r"max_context = 192\]", "kv_capacity"),
        (dict(kv_capacity=2.5), "kv_capacity must be an integer", "kv_capacity"),
        (dict(policy="sjf"), "policy must be one of", "policy"),
        (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1", "max_num_seqs")]
    for options, rule, parameter in cases:
        with pytest.raises(ParameterError, match=rule) as err:
            engine_for(model, options.pop("max_num_seqs", 2), **options)
        assert err.value.parameter == parameter
    engine = engine_for(model, 2, kv_capacity=50, policy="priority")
    for bad in (1.5, True, "high", None):
        with pytest.raises(ParameterError, match="priority must be an integer") as err:
            engine.add_request(text(PROMPTS[1]), greedy(), priority=bad)
        assert err.value.parameter == "priority"
    with pytest.raises(ParameterError, match="prompt must be a non-empty") as err:
        engine.add_request("", greedy(), priority=3)
    assert err.value.parameter == "prompt"
    assert not engine.requests and not engine.scheduler.waiting
    assert engine.add_request(text(PROMPTS[1]), greedy()) == "0"   # no id was used
    assert engine.requests["0"].priority == 0 and engine.requests["0"].arrival == 0


# --- the bundled model ------------------------------------------------------------------------

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")

BUNDLED_PROMPTS = ["Rom.\nBut soft! what light through yonder window breaks?", "O",
                   "Ham.\nTo be, or not to be, that is the question:", "First Citizen.\n",
                   "Hello world,", "How are you, my lord?\n"]


@bundled
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_bundled_whole_completions_survive_preemption(invariant):
    """Stop ids, stop strings, min_tokens, penalties, seeded sampling and logprobs under a
    capacity of 64 tokens for 3 running requests (test_s09's mix): every completion equals
    the S06 engine's alone (logprobs exactly in the invariant mode), with preemptions."""
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    single = s06.Engine(model, tokenizer)
    free = single.generate(BUNDLED_PROMPTS[0], greedy(30, ignore_eos=True))
    params = [
        greedy(30), greedy(30, stop_token_ids=[free.token_ids[5]]),
        greedy(30, stop=[tokenizer.decode(free.token_ids[3:5])[-2:]]),
        s04.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=25, seed=3, logprobs=3),
        greedy(30, min_tokens=20, repetition_penalty=1.3, logprobs=1),
        s04.SamplingParams(temperature=1.2, top_k=30, max_tokens=1, seed=9)]
    engine = engine_for(model, 3, tokenizer, batch_invariant=invariant, kv_capacity=64)
    got = LLM(engine).generate(BUNDLED_PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    for c, prompt, p in zip(got, BUNDLED_PROMPTS, params):
        alone = single.generate(prompt, p)
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason), prompt
        if invariant:
            assert c.logprobs == alone.logprobs
    assert kv_idle(engine)


@bundled
def test_main_prints_the_schedule_with_its_preemptions(capsys):
    s10.main(["--num-prompts", "5", "--max-tokens", "24", "--max-num-seqs", "4",
              "--kv-capacity", "96", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 5 and "preempted" in out and "resumed" in out
    assert " 0 preemptions" not in out and "preempted once" in out
    for bad in (["--max-num-seqs", "0"], ["--kv-capacity", "0"], ["--policy", "lifo"],
                ["--max-num-batched-tokens", "10"], ["--priorities", "1,2"]):
        with pytest.raises(SystemExit) as exit_info:
            s10.main(bad + ["--device", "cpu"])
        assert exit_info.value.code == 2


def test_schedule_table_elides_the_middle_of_a_long_trace(tiny):
    name, _, model, _ = tiny
    engine = engine_for(model, 2, kv_capacity=TIGHT)
    tracer = trace(engine)
    LLM(engine).generate([text(p) for p in PROMPTS], greedy(30))
    records = tracer.records
    n = len(records)
    for max_rows in (10, 7, 2):     # the first and the last max_rows // 2 steps
        half = max_rows // 2
        lines = format_schedule_table(records, max_rows=max_rows).splitlines()
        assert n > 10 and len(lines) == 1 + 2 * half + 1    # header, rows, the marker
        steps = [int(line.split()[0]) for line in lines[1:] if line.split()[0].isdigit()]
        assert steps == list(range(half)) + list(range(n - half, n))
        assert lines[1 + half].split()[:2] == ["…", str(n - 2 * half)]
        assert lines[1 + half].endswith(" steps not shown")
    assert len(format_schedule_table(records, max_rows=n).splitlines()) == n + 1


def test_schedule_table_refuses_fewer_than_two_rows():
    for bad in (1, 0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match=r"^max_rows must be an integer >= 2 \(got "):
            format_schedule_table([], max_rows=bad)


def table_cells(table: str) -> list[dict[str, str]]:
    """Each row's id-list cells, cut at the header's column starts (the cells are left-
    aligned under their headers)."""
    header, *rows = table.splitlines()
    names = [name for _, name, _ in TABLE_ID_COLUMNS]
    starts = [header.index(h) for h, _, _ in TABLE_ID_COLUMNS] + [header.index("waiting") - 1]
    cells = []
    for line in rows:
        if line.split()[0].isdigit():
            cells.append({name: line[a:b].strip()
                          for name, a, b in zip(names, starts, starts[1:])})
    return cells


def check_cells(records, table: str) -> int:
    """Every cell shows all its ids, in order (the running ones with their scheduled tokens
    when more than 1), or says how many and marks the cut (the ids it shows are the first
    ones). Returns how many cells were cut."""
    cut = 0
    for record, cells in zip(records, table_cells(table), strict=True):
        tokens = dict(zip(record.running, record.num_scheduled_tokens))
        for header, name, limit in TABLE_ID_COLUMNS:
            ids = list(getattr(record, name))
            if name == "running":
                ids = [f"{rid}({tokens[rid]})" if tokens[rid] > 1 else rid for rid in ids]
            cell = cells[name]
            assert len(cell) <= limit
            if cell != ",".join(ids):
                count, shown = cell.split(": ", 1)
                assert int(count) == len(ids) and shown.endswith("…"), (name, cell)
                assert shown[:-1].rstrip(",").split(",") == ids[:shown.count(",")], cell
                cut += 1
    return cut


def test_schedule_table_shows_every_id_or_marks_the_cut_with_the_count(tiny):
    name, _, model, _ = tiny
    engine = engine_for(model, 4, max_num_batched_tokens=CONTEXT, kv_capacity=TIGHT)
    tracer = trace(engine)
    LLM(engine).generate([text(PROMPTS[k]) for k in ARRIVAL], greedy())
    assert check_cells(tracer.records, format_schedule_table(tracer.records, 1000)) == 0
    # Long lists: 40 requests that all join in one step, 60 that leave.
    base = tracer.records[0]
    many = [f"r{i}" for i in range(40)]
    wide = replace(base, step=0, running=tuple(many), num_scheduled_tokens=tuple(range(1, 41)),
                   joined=tuple(many), left=tuple(f"q{i}" for i in range(60)),
                   block_tables=tuple((i,) for i in range(40)))
    records = [wide, replace(base, step=1)]
    table = format_schedule_table(records)
    assert check_cells(records, table) == 3        # running, joined, left
    assert "40: r0,r1(2),r2(3)," in table and "40: r0,r1,r2,r3," in table
    assert "60: q0,q1,q2," in table


def test_the_running_column_is_the_schedulers_admission_order_and_fcfs_preempts_its_end(tiny):
    """A record's `running` holds the scheduled ids in the scheduler's order: the requests
    still running from the step before, in their order, then those admitted or resumed;
    under FCFS the first request preempted in a step is the last of the previous step's
    order still running."""
    name, _, model, _ = tiny
    engine = engine_for(model, 4, max_num_batched_tokens=CONTEXT, kv_capacity=TIGHT)
    tracer = trace(engine)
    LLM(engine).generate([text(PROMPTS[k]) for k in ARRIVAL], greedy())
    checked = 0
    for before, record in zip(tracer.records, tracer.records[1:]):
        new = len(record.joined) + len(record.resumed)
        assert set(record.running[len(record.running) - new:]) == set(record.joined
                                                                      + record.resumed)
        assert list(record.running[:len(record.running) - new]) == [
            rid for rid in before.running if rid in record.running]
        if record.preempted:
            still = [rid for rid in before.running
                     if rid not in before.left and rid not in record.ended]
            assert record.preempted[0] == still[-1]
            checked += 1
    assert checked > 0
    table = format_schedule_table(tracer.records, 1000)
    assert "running, admission order (tokens)" in table.splitlines()[0]


def stepper_workload():
    """The stepper's third workload (site/simulators/scheduler-stepper/export.py)."""
    import importlib.util
    from pathlib import Path
    path = (Path(__file__).resolve().parents[1] / "site" / "simulators" / "scheduler-stepper"
            / "export.py")
    spec = importlib.util.spec_from_file_location("s10_stepper_export", path)
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    return export, next(w for w in export.WORKLOADS if w[0] == "budget")


@bundled
def test_main_reproduces_the_steppers_token_budget_workload(capsys, monkeypatch):
    """The flags that replay the stepper's third workload (64-token context and budget) give
    the trace the stepper's exporter records."""
    export, (_, _, num, seed, context, seats, budget, kv, policy, prios, every,
             max_tokens) = stepper_workload()
    assert prios is None and policy == "fcfs"
    made = []

    def kept(*args, **kwargs):
        made.append(build(*args, **kwargs))
        return made[-1]

    build = s10.build_engine
    monkeypatch.setattr(s10, "build_engine", kept)
    s10.main(["--max-context", str(context), "--max-num-batched-tokens", str(budget),
              "--kv-capacity", str(kv), "--max-num-seqs", str(seats), "--num-prompts", str(num),
              "--seed", str(seed), "--arrival-every", str(every), "--max-tokens", str(max_tokens),
              "--device", "cpu"])
    out = capsys.readouterr().out
    assert f"context {context}; {budget} tokens per step, KV capacity {kv} tokens" in out
    (engine,) = made
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    prompts = s08_cli.corpus_prompts(tokenizer, num, seed, 256)
    expected = export.run_workload(model, tokenizer, prompts, [0] * num, context, seats,
                                   budget, kv, policy, every, max_tokens)["trace"]
    tracer = engine.observers[0]
    got = [{f: (list(v) if isinstance(v := getattr(r, f), tuple) else v)
            for f in export.TRACE_FIELDS} for r in tracer.records]
    assert got == expected
    assert max(len(r["joined"]) for r in expected) < seats    # the budget, not the seats


@bundled
def test_main_refuses_bad_flags_naming_the_rule(capsys):
    cases = [(["--priorities", "a,b", "--policy", "priority"],
              "argument --priorities: --priorities needs comma-separated integers, one per "
              "request (got 'a,b')"),
             (["--priorities", "1,,0", "--policy", "priority"],
              "--priorities needs comma-separated integers"),
             (["--priorities", "1,0"], "--priorities needs --policy priority (fcfs ignores "
                                       "priorities)"),
             (["--priorities", "1,2", "--policy", "priority"],
              "--priorities needs one value per request (8)"),
             (["--max-context", "0"], "max_context must be an integer >= 1 (got 0)"),
             (["--max-context", "100000"], "max_context (100000) must be <= the model's "
                                           "max_position_embeddings (256)"),
             (["--max-context", "64", "--max-num-batched-tokens", "32"],
              "max_num_batched_tokens (32) must be >= max_model_len (64)")]
    for argv, rule in cases:
        with pytest.raises(SystemExit) as exit_info:
            s10.main(argv + ["--device", "cpu"])
        assert exit_info.value.code == 2, argv
        assert rule in capsys.readouterr().err, argv


# --- the chapter's figure ---------------------------------------------------------------------

def test_the_figure_is_the_benchmarks_json_drawn_with_its_legend_off_the_data():
    """chapters/figures/s10_scheduler.png is scripts/s10_figure.py's drawing of the committed
    benchmark figures (chapters/figures/s10_scheduler.json), and no legend covers data."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from legend_check import covered_by_legends, describe
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import s10_figure
    figures = json.loads(s10_figure.DATA.read_text())
    fig = s10_figure.build_figure(figures)
    found = covered_by_legends(fig)
    assert not found, describe(found)
    policies = {r["policy"] for r in figures["runs"]}
    assert policies == {"fcfs", "priority"}
    assert any(r["preemptions"] > 0 for r in figures["runs"])
    done = subprocess.run([sys.executable, str(root / "scripts" / "s10_figure.py"), "--check"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# --- a plan that raises (admits) is all or nothing; a policy that can never admit -------------

def with_admits(engine, answer):
    """The engine's scheduler with `admits` replaced by answer(scheduler, request, n)."""
    base = type(engine.scheduler)

    class Flaky(base):
        def admits(self, request, num_new_tokens):
            return answer(self, request, num_new_tokens)

    engine.scheduler.__class__ = Flaky
    return engine


def scheduler_books(s) -> tuple:
    """The queues in order, each queued request's status, counts and KV, the pool's total."""
    return (tuple((r.request_id, r.status, r.num_computed_tokens, s.kv.num_tokens(r.request_id))
                  for q in (s.running, s.waiting) for r in q),
            s.kv.num_used_tokens, s.num_steps, s.num_preemptions)


def test_admits_raising_where_a_request_outgrows_the_capacity_loses_nothing(tiny):
    """A prompt of 16 tokens in a capacity of 20 ends after 5 tokens (the test above); here
    "b" waits and admits raises in the very call that ends "a", and again twice. step()
    raises each time, nothing is allocated, "a" is not lost: the next step returns its last
    output ("length", its 5 tokens alone before), "b" then runs alone, and the engine ends
    idle with every KV token free."""
    name, _, model, references = tiny
    armed = {"on": False}

    def answer(s, request, n):
        if armed["on"]:
            raise RuntimeError("admits failed")
        return not s.running

    engine = with_admits(engine_for(model, 2, kv_capacity=20), answer)
    s = engine.scheduler
    seen = {}
    engine.add_request(text(PROMPTS[3]), greedy(30), request_id="a")
    while engine.requests["a"].num_tokens <= s.kv_capacity:
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    engine.add_request(text(PROMPTS[2]), greedy(), request_id="b")
    armed["on"] = True
    for _ in range(3):
        with pytest.raises(RuntimeError, match="admits failed"):
            engine.step()
        assert engine.has_unfinished_requests() and s.kv.num_used_tokens == 0
    armed["on"] = False
    collect(engine, seen)
    assert tokens_of(seen["a"]) == references[3][0].token_ids[:5]
    assert seen["a"][-1].finish_reason == "length" and seen["a"][-1].finished
    assert tokens_of(seen["b"]) == references[2][0].token_ids
    assert kv_idle(engine)


@pytest.mark.parametrize("chapter", ["s10", "s11", "s12", "s13"])
def test_admits_raising_five_times_leaves_the_engine_as_it_was(tiny, chapter):
    """Two requests decode; a third arrives and admits raises for it five steps in a row:
    the scheduler's queues, counts and KV are what they were before each failed step (no
    KV leaks, one token per running request per step, in S10's, S11's, S12's and S13's
    engines alike, all planned by S10's schedule). Then every request gives its greedy
    tokens alone."""
    import s11_chunked_prefill as s11
    import s12_engine as s12
    import s13_prefix_caching as s13
    name, _, model, references = tiny
    build = {"s10": s10.build_engine, "s11": s11.build_engine, "s12": s12.build_engine,
             "s13": s13.build_engine}[chapter]
    armed = {"on": False}

    def answer(s, request, n):
        if armed["on"] and request.request_id == "c":
            raise RuntimeError("admits failed")
        return True

    engine = with_admits(build(model, IdTokenizer(), max_num_seqs=3, max_context=CONTEXT),
                         answer)
    s, seen = engine.scheduler, {}
    engine.add_request(text(PROMPTS[3]), greedy(), request_id="a")
    engine.add_request(text(PROMPTS[4]), greedy(), request_id="b")
    for _ in range(2):
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    engine.add_request(text(PROMPTS[2]), greedy(), request_id="c")
    armed["on"] = True
    before = scheduler_books(s)
    for _ in range(5):
        with pytest.raises(RuntimeError, match="admits failed"):
            engine.step()
        assert scheduler_books(s) == before
    armed["on"] = False
    collect(engine, seen)
    for rid, k in (("a", 3), ("b", 4), ("c", 2)):
        assert tokens_of(seen[rid]) == references[k][0].token_ids, rid
    assert not engine.has_unfinished_requests() and s.kv.num_used_tokens == 0


def test_generate_with_a_policy_that_never_admits_raises_instead_of_hanging(tiny):
    """An admits that refuses while nothing runs: LLM.generate raises a RuntimeError naming
    the request (it used to step forever, each step returning nothing); an admits that
    returns None is a TypeError naming admits."""
    name, _, model, references = tiny
    engine = with_admits(engine_for(model, 2), lambda s, request, n: False)
    with pytest.raises(RuntimeError, match=r"admits refused request '0' while no request is "
                                           r"running.*can never make progress"):
        LLM(engine).generate(text(PROMPTS[2]), greedy())
    engine = with_admits(engine_for(model, 2), lambda s, request, n: None)
    with pytest.raises(TypeError, match=r"admits must return a bool .* returned None"):
        LLM(engine).generate(text(PROMPTS[2]), greedy())
