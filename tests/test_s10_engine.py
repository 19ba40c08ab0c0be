"""Tests for chapter S10's engine (code/s10_engine.py): S09's engine driven by the scheduler.

Oracles: the S06 engine on each request alone (whole completions: ids, text, finish_reason,
stop_reason, logprobs, seeded samples), S05 and HF `generate` alone (greedy ids, float32,
eager attention), S09's engine (the default S10 engine must schedule exactly as it does), and
counts worked out by hand (a prompt of P tokens in a capacity of C makes C - P + 1 tokens; the
FCFS bound on steps, below).

Exactness, as in S09: the batch-invariant mode (here with preemption: the recompute replays
the request's first run) must give each request bitwise its outputs alone, so completions are
compared with ==; the fast mode recomputes a preempted request in one pass, its greedy ids are
compared with == against S05 and HF on these models (their top-2 gaps are far above float32
differences, S08's measurement) and held to S08's `follows_batch_rule` against the reference.

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534, G2 vllm #16832, G4 vllm #24584 / PR #24586, G5 sglang PR #2238 / PR #1674 / #6778.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
from s01_generation_loop import RequestOutput
from s10_engine import TABLE_ID_COLUMNS, LLMEngine, StepRecord, format_schedule_table, main
from s10_scheduler import PREEMPTED
from engine_testing import id_text, tiny_references
from test_s03_transformer import V, IdTokenizer

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 90]    # 90 + 8 > 96: the context stop fires
PROMPTS = [np.random.default_rng(300 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
TIGHT = 100     # >= 95, the most KV any request here needs (90 + 6 - 1), far below their sum
ARRIVAL = [4, 5, 3, 6, 2, 7, 1, 0]   # an order of PROMPTS that preempts 4 times in TIGHT


def greedy(max_tokens=NEW, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


text = id_text


def mixed_params() -> list[s04.SamplingParams]:
    """Greedy with logprobs (for S08's rule) and seeded sampling, alternating."""
    return [greedy(logprobs=2) if i % 2 == 0 else
            s04.SamplingParams(temperature=1.0, seed=7 + i, top_k=20, max_tokens=NEW)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"])
def tiny(request, tmp_path_factory):
    """(name, S06 model, {prompt index: (S05 alone, HF alone)}) for one tiny random model."""
    directory = tmp_path_factory.mktemp(f"s10_{request.param}")
    hf, model, references = tiny_references(request.param, directory, PROMPTS, CONTEXT, NEW)
    return request.param, model, references


def drive(engine, requests, arrivals, aborts=None):
    """Run requests [(prompt, params)] through add_request / step: request i is added before
    step call arrivals[i]; aborts {step call: [request index]}. Checks the budgets and the
    KV accounting at every step. Returns ({index: outputs}, ids)."""
    aborts = aborts or {}
    ids, outputs, call = {}, {}, 0
    sched = engine.scheduler
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                ids[i] = engine.add_request(*requests[i])
        for i in aborts.get(call, []):
            if i in ids:
                engine.abort(ids[i])
        before = len(engine.trace)
        got = engine.step()
        call += 1
        out = engine.scheduler_output
        if len(engine.trace) > before:     # the engine's step numbers are the scheduler's
            assert engine.trace[-1].step == out.step == len(engine.trace) - 1
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(engine.running) <= engine.max_num_seqs
        assert sched.kv.num_used_tokens == sum(s.num_computed_tokens for s in engine.running)
        for seq in engine.running:
            assert sched.kv.num_tokens(seq.request_id) == seq.num_computed_tokens
        assert all(len(o.new_token_ids) <= 1 for o in got)
        index_of = {rid: i for i, rid in ids.items()}
        for o in got:
            outputs.setdefault(index_of[o.request_id], []).append(o)
        assert call < 10_000
    # Invariant 8: every slot and every KV token free once everything is done.
    assert engine.runner.cache.free_slots == list(range(engine.max_num_seqs))
    assert engine.kv_free_tokens == engine.kv_capacity and not sched.kv.held
    assert not engine.requests and not engine.running and not engine.waiting
    return outputs, ids


def tokens_of(outs):
    return [t for o in outs for t in o.new_token_ids]


# --- preemption keeps every output ------------------------------------------------------------

@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_forced_preemption_gives_each_request_its_output_alone(tiny, invariant):
    """A KV capacity far below what the requests need together: requests are preempted and
    recomputed, and each still gives exactly its S06 completion alone (ids, text,
    finish_reason, logprobs in the invariant mode; greedy ids equal S05 and HF, seeded ids
    equal, and S08's rule against the reference in the fast mode)."""
    name, model, references = tiny
    prompts, params = [text(PROMPTS[k]) for k in ARRIVAL], mixed_params()
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4, batch_invariant=invariant,
                       max_num_batched_tokens=CONTEXT, kv_capacity=TIGHT)
    got = engine.generate(prompts, params)
    resumed = [rid for r in engine.trace for rid in r.resumed]
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
                assert s08.follows_batch_rule(c, alone, s08.BATCH_TOLERANCE[torch.float32])
    for record in engine.trace:
        assert isinstance(record, StepRecord)
        assert record.num_tokens == sum(record.num_scheduled_tokens) <= record.token_budget
        assert record.kv_used_tokens + record.kv_free_tokens == TIGHT
        assert len(record.running) <= 4


def test_a_resumed_request_recomputes_its_prompt_and_every_output(tiny):
    """vllm #16832 (G2): output incomplete after recompute preemption. Each resumed request
    is scheduled with prompt + outputs so far, and the run's outputs equal those of a run
    without preemption: the same ids, the same length, the same finish_reason."""
    name, model, references = tiny
    requests = [(text(PROMPTS[k]), greedy()) for k in ARRIVAL]
    free = LLMEngine(model, IdTokenizer(), CONTEXT, 4)
    tight = LLMEngine(model, IdTokenizer(), CONTEXT, 4, kv_capacity=TIGHT)
    made = {}

    class Watch(LLMEngine):
        def make_batch(self, rows):
            for seq in rows:
                if seq.request_id in self.scheduler_output.scheduled_resumed_ids:
                    n = self.scheduler_output.num_scheduled_tokens[seq.request_id]
                    made.setdefault(seq.request_id, []).append(
                        (n, len(seq.prompt_ids) + len(seq.output_ids)))
            return super().make_batch(rows)

    watched = Watch(model, IdTokenizer(), CONTEXT, 4, kv_capacity=TIGHT)
    outs_free, _ = drive(free, requests, [0] * 8)
    outs_tight, _ = drive(tight, requests, [0] * 8)
    drive(watched, requests, [0] * 8)
    assert free.scheduler.num_preemptions == 0 < tight.scheduler.num_preemptions
    assert made and all(n == want and n > 1 for runs in made.values() for n, want in runs)
    for i, k in enumerate(ARRIVAL):
        a, b = outs_free[i], outs_tight[i]
        assert tokens_of(a) == tokens_of(b) == references[k][0].token_ids, (name, i)
        assert b[-1].finish_reason == a[-1].finish_reason == references[k][0].finish_reason


def test_the_default_engine_schedules_exactly_as_s09(tiny):
    """Default budget and capacity: nothing is preempted or held back, and the trace (who
    ran, in which slot, joined, left, tokens, waiting, free slots) is S09's step by step."""
    name, model, _ = tiny
    requests = [(text(p), greedy()) for p in PROMPTS]
    arrivals = [0, 1, 2, 3, 5, 8, 9, 13]
    ours = LLMEngine(model, IdTokenizer(), CONTEXT, 3)
    theirs = s09.LLMEngine(model, IdTokenizer(), CONTEXT, 3)
    outs, _ = drive(ours, requests, arrivals)
    ids, theirs_outs, call = {}, {}, 0
    while len(ids) < len(requests) or theirs.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call:
                ids[i] = theirs.add_request(*requests[i])
        for o in theirs.step():
            theirs_outs.setdefault(o.request_id, []).append(o)
        call += 1
    keys = ("running", "slots", "joined", "left", "num_tokens", "prefill_tokens", "waiting",
            "free_slots")
    assert [[getattr(r, k) for k in keys] for r in ours.trace] == [
        [getattr(r, k) for k in keys] for r in theirs.trace]
    assert {ids[i]: o for i, o in outs.items()} == theirs_outs


def test_every_request_finishes_within_a_bounded_number_of_steps_under_steady_arrivals(tiny):
    """FCFS under a steady stream (one arrival per step, a tight capacity): in every step the
    oldest unfinished request is scheduled (running requests are preempted from the newest
    end, and a waiting head is admitted whenever nobody was preempted), so request i finishes
    at most sum(max_tokens of requests 0..i) steps after it arrives."""
    name, model, references = tiny
    order = [2, 4, 5, 3, 1, 6, 0, 5, 4, 2, 3, 5, 1, 4, 6, 2]
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, kv_capacity=TIGHT)
    ids, arrival, finish, call = {}, {}, {}, 0
    while len(ids) < len(order) or engine.has_unfinished_requests():
        if len(ids) < len(order):
            i = len(ids)
            ids[i] = engine.add_request(text(PROMPTS[order[i]]), greedy())
            arrival[ids[i]] = call
        unfinished = [ids[i] for i in sorted(ids) if ids[i] in engine.requests]
        got = engine.step()
        out = engine.scheduler_output
        if unfinished:
            assert unfinished[0] in out.scheduled_ids, f"step {call}: {unfinished[0]} starved"
        for o in got:
            if o.finished:
                finish[o.request_id] = call
        call += 1
    assert engine.scheduler.num_preemptions > 0
    lengths = [len(references[k][0].token_ids) for k in order]
    for i, rid in ids.items():
        assert finish[rid] - arrival[rid] < sum(lengths[:i + 1]), rid


# --- aborts, streams, idle -------------------------------------------------------------------

def test_aborting_a_waiting_a_running_and_a_preempted_request(tiny):
    """Each abort frees what the request holds at once; the others give their outputs alone."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, kv_capacity=TIGHT)
    chosen = [5, 4, 6, 3, 2, 1]
    rids = [engine.add_request(text(PROMPTS[k]), greedy()) for k in chosen]
    seen: dict[str, list] = {rid: [] for rid in rids}
    preempted = None
    for _ in range(40):
        for o in engine.step():
            seen[o.request_id].append(o)
        preempted = next((s for s in engine.waiting if s.status == PREEMPTED), None)
        if preempted is not None:
            break
    assert preempted is not None
    running = engine.running[0]
    never = next(s for s in engine.waiting if s.status != PREEMPTED and not s.output_ids)
    for seq in (preempted, running, never):
        held, free = engine.scheduler.kv.num_tokens(seq.request_id), engine.kv_free_tokens
        assert engine.abort(seq.request_id)
        assert engine.kv_free_tokens == free + held and seq.request_id not in engine.requests
    assert engine.abort(running.request_id) is False
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    aborted = {preempted.request_id, running.request_id, never.request_id}
    for k, rid in zip(chosen, rids):
        want = references[k][0].token_ids
        got = tokens_of(seen[rid])
        if rid in aborted:
            assert seen[rid][-1] == RequestOutput(rid, [], "", True, "abort", None)
            assert got == want[:len(got)]
        else:
            assert got == want, (name, rid)
    assert engine.kv_free_tokens == TIGHT and engine.num_free_slots == 3


def test_closing_a_stream_frees_its_kv_within_the_step(tiny):
    """vllm #24584 / PR #24586 (G4): a client that disconnects mid-stream kept its request
    running and its KV held. Closing the stream aborts its requests: their slots and KV
    tokens are free before close returns, and the engine serves the next request."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, kv_capacity=TIGHT)
    stream = engine.stream([text(PROMPTS[4]), text(PROMPTS[5])], 30)
    next(stream)
    assert engine.kv_free_tokens < TIGHT
    stream.close()
    assert engine.kv_free_tokens == TIGHT and engine.num_free_slots == 2
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    assert engine.generate(text(PROMPTS[3]), NEW).token_ids == references[3][0].token_ids


def test_idle_means_every_kv_token_is_free_after_finishes_and_aborts(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted and completed requests leaked KV.
    Many requests under preemption, some aborted while running, some while waiting (one of
    them preempted), one aborted twice: once idle, free KV == capacity and free slots ==
    total (checked by `drive`), and the rest give their outputs alone."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, kv_capacity=TIGHT)
    requests = [(text(PROMPTS[ARRIVAL[i % 8]]), greedy()) for i in range(12)]
    aborts = {1: [0, 9], 3: [4, 5, 11], 4: [4], 6: [2]}
    outputs, ids = drive(engine, requests, [0] * 10 + [2, 2], aborts)
    assert engine.scheduler.num_preemptions > 0
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
    head of the queue and blocked every later request. Here add_request (and generate)
    refuse it, naming the rule, with nothing queued; the requests around it finish. A prompt
    that fills the context needs no KV (it finishes on arrival) and is still accepted."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, kv_capacity=40)
    first = engine.add_request(text(PROMPTS[3]), greedy())
    with pytest.raises(ValueError, match="prompt is 50 tokens but kv_capacity is 40 tokens: "
                                         "it could never be scheduled"):
        engine.add_request(text(PROMPTS[5]), greedy())
    full = engine.add_request(text([5] * CONTEXT), greedy())
    last = engine.add_request(text(PROMPTS[2]), greedy())
    assert [s.request_id for s in engine.waiting] == [first, last]
    seen = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    assert tokens_of(seen[first]) == references[3][0].token_ids
    assert tokens_of(seen[last]) == references[2][0].token_ids
    assert seen[full][-1].finish_reason == "length" and tokens_of(seen[full]) == []
    with pytest.raises(ValueError, match="prompt 1: prompt is 50 tokens but kv_capacity"):
        engine.generate([text(PROMPTS[1]), text(PROMPTS[5])], greedy())
    assert not engine.has_unfinished_requests() and engine.kv_free_tokens == 40


def test_a_request_that_outgrows_the_capacity_ends_with_length(tiny):
    """A prompt of 16 tokens in a capacity of 20 tokens: after 20 - 16 + 1 = 5 tokens its
    next step would need 21, more than the whole pool, so it ends with finish_reason
    "length" (its last output has no token), never a retry loop; the 5 tokens are its first
    5 alone."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, kv_capacity=20)
    rid = engine.add_request(text(PROMPTS[3]), greedy(30))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert tokens_of(outs) == references[3][0].token_ids[:5]
    assert outs[-1] == RequestOutput(rid, [], "", True, "length", None)
    assert [r.ended for r in engine.trace if r.ended] == [(rid,)]
    assert engine.trace[-1].running == () and engine.kv_free_tokens == 20
    done = engine.generate(text(PROMPTS[3]), 30)
    assert (done.token_ids, done.finish_reason) == (references[3][0].token_ids[:5], "length")


# --- policy, errors ---------------------------------------------------------------------------

def test_priority_policy_admits_lower_values_first_and_fcfs_ignores_them(tiny):
    name, model, references = tiny
    chosen, priorities = [2, 3, 4, 1], [2, 0, 1, 0]
    for policy, order in (("priority", [1, 3, 2, 0]), ("fcfs", [0, 1, 2, 3])):
        engine = LLMEngine(model, IdTokenizer(), CONTEXT, 1, policy=policy)
        rids = [engine.add_request(text(PROMPTS[k]), greedy(), priority=p)
                for k, p in zip(chosen, priorities)]
        seen = {rid: [] for rid in rids}
        while engine.has_unfinished_requests():
            for o in engine.step():
                seen[o.request_id].append(o)
        assert [rid for r in engine.trace for rid in r.joined] == [rids[i] for i in order]
        for k, rid in zip(chosen, rids):
            assert tokens_of(seen[rid]) == references[k][0].token_ids


class NaNFor(LLMEngine):
    """Gives the running request `bad` NaN logits from its second pass on."""

    bad = None

    def execute_model(self, batch):
        logits = super().execute_model(batch)
        rows = sorted((self.requests[r] for r in self.scheduler_output.num_scheduled_tokens),
                      key=lambda s: s.slot)
        for i, seq in enumerate(rows):
            if seq.request_id == self.bad and seq.stats.passes >= 1:
                logits = logits.clone()
                logits[i] = float("nan")
        return logits


def test_a_failed_step_gives_back_its_kv_and_the_engine_goes_on(tiny):
    """A row S04 refuses fails step() (S09's error, naming the request); the KV the step had
    allocated goes back, so after the bad request is aborted the others finish, equal to
    their outputs alone, and every token is free."""
    name, model, references = tiny
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 2, kv_capacity=60)
    engine.bad = "b"
    engine.add_request(text(PROMPTS[3]), greedy(), request_id="a")
    engine.add_request(text(PROMPTS[4]), greedy(), request_id="b")
    seen = {"a": [], "b": []}
    for o in engine.step():
        seen[o.request_id].append(o)
    with pytest.raises(ValueError, match="^request 'b': logits must not contain NaN"):
        engine.step()
    sched = engine.scheduler
    assert all(sched.kv.num_tokens(s.request_id) == s.num_computed_tokens
               for s in engine.running)
    engine.abort("b")
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    assert tokens_of(seen["a"]) == references[3][0].token_ids
    assert engine.kv_free_tokens == 60 and engine.num_free_slots == 2
    # The failed step is not numbered: the trace's steps and the scheduler's agree.
    assert [r.step for r in engine.trace] == list(range(len(engine.trace)))
    assert engine.scheduler.num_steps == len(engine.trace)


def test_bad_arguments_are_refused_before_anything_is_queued(tiny):
    name, model, _ = tiny
    make = lambda **kw: LLMEngine(model, IdTokenizer(), CONTEXT, 2, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(95\) must be >= "
                                         r"max_model_len \(96\)"):
        make(max_num_batched_tokens=95)
    with pytest.raises(ValueError, match="kv_capacity must be an integer >= 1"):
        make(kv_capacity=0)
    with pytest.raises(ValueError, match=r"kv_capacity \(193\) must be <= max_num_seqs \* "
                                         r"max_context \(192\)"):
        make(kv_capacity=193)
    with pytest.raises(ValueError, match="policy must be one of"):
        make(policy="sjf")
    engine = make(kv_capacity=50)
    for bad in (1.5, True, "high", None):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request(text(PROMPTS[1]), greedy(), priority=bad)
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        engine.add_request("", greedy(), priority=3)
    assert not engine.requests and not engine.waiting
    assert engine.add_request(text(PROMPTS[1]), greedy()) == "0"   # no id was used
    assert engine._priority == 0


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
    engine = LLMEngine(model, tokenizer, max_num_seqs=3, batch_invariant=invariant,
                       kv_capacity=64)
    got = engine.generate(BUNDLED_PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    for c, prompt, p in zip(got, BUNDLED_PROMPTS, params):
        alone = single.generate(prompt, p)
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason), prompt
        if invariant:
            assert c.logprobs == alone.logprobs


@bundled
def test_main_prints_the_schedule_with_its_preemptions(capsys):
    main(["--num-prompts", "5", "--max-tokens", "24", "--max-num-seqs", "4",
          "--kv-capacity", "96", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 5 and "preempted" in out and "resumed" in out
    assert " 0 preemptions" not in out
    for bad in (["--max-num-seqs", "0"], ["--kv-capacity", "0"], ["--policy", "lifo"],
                ["--max-num-batched-tokens", "10"], ["--priorities", "1,2"]):
        with pytest.raises(SystemExit) as exit_info:
            main(bad + ["--device", "cpu"])
        assert exit_info.value.code == 2


def test_schedule_table_elides_the_middle_of_a_long_trace(tiny):
    name, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, kv_capacity=TIGHT)
    engine.generate([text(p) for p in PROMPTS], greedy(30))
    n = len(engine.trace)
    for max_rows in (10, 7, 2):
        lines = format_schedule_table(engine.trace, max_rows=max_rows).splitlines()
        assert n > 10 and len(lines) == 1 + max_rows + 1    # header, rows, the marker
        steps = [int(line.split()[0]) for line in lines[1:] if line.split()[0].isdigit()]
        first = max_rows // 2
        assert steps == list(range(first)) + list(range(n - (max_rows - first), n))
        assert lines[1 + first].split()[:2] == ["…", str(n - max_rows)]
        assert lines[1 + first].endswith(" steps not shown")
    assert len(format_schedule_table(engine.trace, max_rows=n).splitlines()) == n + 1


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
    """Every cell shows all its ids, in order, or says how many and marks the cut (the ids it
    shows are the first ones). Returns how many cells were cut."""
    cut = 0
    for record, cells in zip(records, table_cells(table), strict=True):
        tokens = dict(zip(record.running, record.num_scheduled_tokens))
        for header, name, limit in TABLE_ID_COLUMNS:
            ids = list(getattr(record, name))
            if name == "schedule_order":
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
    name, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=CONTEXT,
                       kv_capacity=TIGHT)
    engine.generate([text(PROMPTS[k]) for k in ARRIVAL], greedy())
    assert check_cells(engine.trace, format_schedule_table(engine.trace, 1000)) == 0
    # Long lists: 40 requests that all join in one step, 60 that leave.
    base = engine.trace[0]
    many = [f"r{i}" for i in range(40)]
    wide = replace(base, step=0, running=tuple(many), schedule_order=tuple(many),
                   num_scheduled_tokens=tuple(range(1, 41)), joined=tuple(many),
                   left=tuple(f"q{i}" for i in range(60)), slots=tuple(range(40)))
    records = [wide, replace(base, step=1)]
    table = format_schedule_table(records)
    assert check_cells(records, table) == 3        # running, joined, left
    assert "40: r0,r1(2),r2(3)," in table and "40: r0,r1,r2,r3," in table
    assert "60: q0,q1,q2," in table


def test_the_running_column_is_the_schedulers_admission_order_and_fcfs_preempts_its_end(tiny):
    """schedule_order holds the scheduled ids in the scheduler's order; under FCFS the first
    request preempted in a step is the last of the previous step's order still running."""
    name, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=CONTEXT,
                       kv_capacity=TIGHT)
    engine.generate([text(PROMPTS[k]) for k in ARRIVAL], greedy())
    checked = 0
    for before, record in zip(engine.trace, engine.trace[1:]):
        assert sorted(record.schedule_order) == sorted(record.running)
        if not before.running or not record.running:     # a step without a model run
            continue
        assert list(record.schedule_order[:len(record.schedule_order) - len(record.joined)
                                          - len(record.resumed)]) == [
            rid for rid in before.schedule_order if rid in record.running]
        if record.preempted:
            still = [rid for rid in before.schedule_order
                     if rid not in before.left and rid not in record.ended]
            assert record.preempted[0] == still[-1]
            checked += 1
    assert checked > 0
    table = format_schedule_table(engine.trace, 1000)
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
    import s10_engine
    export, (_, _, num, seed, context, seats, budget, kv, policy, prios, every,
             max_tokens) = stepper_workload()
    assert prios is None and policy == "fcfs"
    made = []

    class Kept(s10_engine.LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(s10_engine, "LLMEngine", Kept)
    main(["--max-context", str(context), "--max-num-batched-tokens", str(budget),
          "--kv-capacity", str(kv), "--max-num-seqs", str(seats), "--num-prompts", str(num),
          "--seed", str(seed), "--arrival-every", str(every), "--max-tokens", str(max_tokens),
          "--device", "cpu"])
    out = capsys.readouterr().out
    assert f"context {context}, {budget} tokens per step, KV capacity {kv} tokens" in out
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    prompts = s08.corpus_prompts(tokenizer, num, seed, 256)
    expected = export.run_workload(model, tokenizer, prompts, [0] * num, context, seats,
                                   budget, kv, policy, every, max_tokens)["trace"]
    got = [{f: (list(v) if isinstance(v := getattr(r, f), tuple) else v)
            for f in export.TRACE_FIELDS} for r in made[0].trace]
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
             (["--max-context", "0"], "--max-context must be >= 1 (got 0)"),
             (["--max-context", "100000"], "--max-context must be at most the model's "
                                           "context window, max_position_embeddings = 256"),
             (["--max-context", "64"], "max_num_batched_tokens (32) must be >= max_model_len "
                                       "(64)")]
    for argv, rule in cases:
        if argv == ["--max-context", "64"]:
            argv = argv + ["--max-num-batched-tokens", "32"]
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--device", "cpu"])
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
