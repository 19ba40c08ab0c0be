"""Tests for chapter S15, speculative decoding (code/s15_speculative.py) in the Part II engine.

Oracles, never the code under test: S05 alone and HF `generate` alone (greedy ids,
tests/engine_testing.py's tiny_references); S06's single-request engine alone (whole
completions: ids, text, finish_reason, stop_reason, logprobs; a seeded request that is offered
no draft draws exactly what it draws there); the same seeded request run again, or run without
its neighbours (reproducibility, independence); a brute-force prompt-lookup written out here;
counts worked out by hand in the comments (tokens per step, num_computed_tokens, blocks).

Drafts are made to be offered: the tiny random models' prompts repeat a pattern (n-gram lookup
finds it; these models' greedy outputs repeat too), and every greedy test asserts from
`SpecDecodingStats` that drafts were verified and some accepted, so no test passes with
speculation silently off. Rejections at a chosen draft position come from `ScriptedProposer`,
a `Proposer` written here that proposes the target's own continuation (from S06 alone) with one
token changed.

Engines: S09's FIFO slots, S10's budgeted slots, S11's chunks (a budget that cuts drafts),
S12's blocks, S13/S14's prefix-caching default, each through `s15.build_engine(builder=...)`.
"""
import dataclasses
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import s03_transformer as s03
import s06_torch as s06
import s09_continuous_batching as s09
import s10_scheduler as s10
import s11_chunked_prefill as s11
import s12_engine as s12
import s15_speculative as s15
from engine_testing import (FailingRunner, RunnerWrapper, drive, greedy, id_text, text_of,
                            tiny_fixture, tokens_of)
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s04_sampling import SamplingParams
from s09_llm import LLM

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 96
NEW = 12
KS = (1, 2, 4, 8)
rng = np.random.default_rng(1500)
PROMPTS = [rng.integers(2, V, size=5).tolist() * 4,          # a pattern, 4 times
           rng.integers(2, V, size=7).tolist() * 3 + [5],    # 3 times, and one more token
           rng.integers(2, V, size=30).tolist(),             # no repeat in the prompt
           rng.integers(2, V, size=3).tolist()]
ARRIVALS = [0, 0, 1, 3]
# 60 distinct ids of the 95 the models produce here: a sampled token is often in it, so
# n-gram lookup offers drafts to seeded sampling too
SEEDED_PROMPT = rng.permutation(np.arange(2, V))[:60].tolist()

# (name, HF model, S06 model, {prompt index: (S05 alone, HF alone)})
tiny = tiny_fixture("s15", ["qwen3_gqa_tied", "llama_gqa_rope_scaling"], PROMPTS, CONTEXT, NEW)

# name -> (the base builder, its options): slots (FIFO, S10's budget), chunks (a budget of
# 10 tokens, less than 3 requests' 1 + 8, so drafts get cut), blocks, the prefix cache.
BUILDERS = {
    "s09_slots": (s09.build_engine, {}),
    "s10_slots": (s10.build_engine, {}),
    "s11_chunked": (s11.build_engine, {"max_num_batched_tokens": 10}),
    "s12_paged": (s12.build_engine, {"block_size": 4}),
    "s14_default": (None, {"block_size": 4, "max_num_batched_tokens": 12}),
}
METHODS = {"ngram": dict(speculative="ngram"),
           "int4": dict(speculative="draft", draft_model="int4")}

bundled_ready = (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists()
draft_ready = (s15.DRAFT_MODEL_DIR / "model.safetensors").exists()
BUNDLED_PROMPTS = ["Rom.\nBut soft! what light through yonder window",
                   "Ham.\nTo be, or not to be, that is the question:",
                   "O"]


def build(model, engine_name, method, k, tokenizer=None, max_num_seqs=3, **options):
    """S15's engine on `model` over BUILDERS[engine_name], method a key of METHODS (or
    "draft": the project's 1-layer draft), k drafts, its `SpecDecodingStats` attached."""
    builder, base = BUILDERS[engine_name]
    spec = METHODS.get(method, dict(speculative="draft"))
    if tokenizer is None:
        tokenizer = IdTokenizer()
        options.setdefault("max_context", CONTEXT)
    engine = s15.build_engine(model, tokenizer, builder=builder, num_speculative_tokens=k,
                              max_num_seqs=max_num_seqs, **spec, **{**base, **options})
    stats = s15.SpecDecodingStats()
    engine.observers.append(stats)
    return engine, stats


def kv_check(engine, call, outputs):
    """After every step: the KV manager holds exactly each running request's computed tokens
    (rejected drafts trimmed), in whole blocks when paged, and no waiting request holds any."""
    s = engine.scheduler
    for r in s.running:
        assert s.kv.num_tokens(r.request_id) == r.num_computed_tokens, (call, r.request_id)
    assert s.kv.num_used_tokens == sum(r.num_computed_tokens for r in s.running), call
    if hasattr(s.kv, "check"):
        s.kv.check()


def finish_idle(engine):
    """All work done: a draft proposer holds no slot and no context (the engine releases a
    finished or aborted request's draft state after each step), and one more step makes
    nothing and changes nothing."""
    assert not engine.has_unfinished_requests()
    for _ in range(2):
        if isinstance(engine.proposer, s15.DraftModelProposer):
            assert engine.proposer.num_held_slots == 0 and not engine.proposer.computed
            assert engine.proposer.slots.num_used_tokens == 0
        assert engine.scheduler.kv.num_used_tokens == 0
        if _ == 0:
            assert engine.step() == []


class LastStep:
    """An observer keeping the last `StepResult` (and every one in `results`)."""

    def __init__(self):
        self.results = []

    def on_plan(self, engine, plan):
        pass

    def on_step(self, engine, result):
        self.results.append(result)

    @property
    def last(self):
        return self.results[-1]


class ScriptedProposer(s15.Proposer):
    """Proposes each request's true continuation (truth[rid], the target's own output alone)
    up to its cap, with the draft at position wrong[rid] (if set and proposed) replaced by
    another token: a rejection exactly there. Records (rid, cap, drafts) per proposal."""

    def __init__(self, k, truth, vocab_size):
        self.num_speculative_tokens = k
        self.truth, self.vocab_size = truth, vocab_size
        self.wrong: dict[str, int | None] = {}
        self.calls: list[tuple[str, int, list[int]]] = []

    def propose(self, requests, caps, live_ids):
        result = []
        for r, cap in zip(requests, caps):
            n = len(r.output_ids)
            drafts = list(self.truth[r.request_id][n:n + cap])
            assert len(drafts) == cap, "the truth is long enough for every proposal"
            j = self.wrong.get(r.request_id)
            if j is not None and j < len(drafts):
                drafts[j] = (drafts[j] + 1) % self.vocab_size
            self.calls.append((r.request_id, cap, drafts))
            result.append((drafts, None))
        return result


def scripted(model, tokenizer, builder, truth, k, **options):
    """S15's `speculate` over builder's engine with a `ScriptedProposer` and a `LastStep`."""
    proposer = ScriptedProposer(k, truth, model.vocab_size)
    engine = s15.speculate(builder(model, tokenizer, **options), proposer)
    last = LastStep()
    engine.observers.append(last)
    return engine, proposer, last


@pytest.fixture(scope="module")
def bundled():
    if not bundled_ready:
        pytest.skip("bundled model missing (scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    return model, tokenizer, s06.Engine(model, tokenizer)


# --- 1. greedy: the target's tokens exactly --------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("engine_name", list(BUILDERS))
def test_greedy_equals_s05_and_hf_alone_for_every_k(tiny, engine_name, method):
    """Every k in 1, 2, 4, 8, requests joining at different steps: each request's ids equal
    S05 alone and HF alone; drafts were verified and some accepted; the KV books hold exactly
    the computed tokens after every step; idle at the end."""
    name, _, model, references = tiny
    for k in KS:
        engine, stats = build(model, engine_name, method, k)
        outputs, ids = drive(engine, [(p, greedy(NEW)) for p in PROMPTS], ARRIVALS,
                             check=kv_check)
        for i in range(len(PROMPTS)):
            ours = tokens_of(outputs[i])
            assert ours == references[i][0].token_ids == references[i][1], (name, k, i)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, (k, stats)
        assert len(stats.num_offered_per_pos) <= k
        finish_idle(engine)


@pytest.mark.parametrize("method", ["ngram", "int4", "draft"])
@pytest.mark.parametrize("engine_name", list(BUILDERS))
def test_greedy_equals_the_target_alone_on_the_bundled_model(bundled, engine_name, method):
    if method == "draft" and not draft_ready:
        pytest.skip("data/draft_model not trained yet")
    model, tokenizer, single = bundled
    alone = [single.generate(p, greedy(16)).token_ids for p in BUNDLED_PROMPTS]
    for k in KS:
        engine, stats = build(model, engine_name, method, k, tokenizer=tokenizer,
                              max_context=128)
        outputs, _ = drive(engine, [(p, greedy(16)) for p in BUNDLED_PROMPTS], [0, 1, 1],
                           check=kv_check)
        assert [tokens_of(outputs[i]) for i in range(3)] == alone, (k, method)
        assert stats.num_draft_tokens > 0, (k, stats)
        if method != "ngram":               # normal text has few repeats for n-gram lookup
            assert stats.num_accepted_tokens > 0, (k, stats)
        finish_idle(engine)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("engine_name", ["s11_chunked", "s14_default"])
def test_batch_invariant_speculation_is_bitwise_the_s06_engine_alone(tiny, engine_name,
                                                                      method):
    """Batch-invariant mode: ids, text, finish_reason, stop_reason and logprobs bitwise S06
    alone, for plain greedy rows (decided together) and greedy rows with a penalty or
    min_tokens (each on its own processors)."""
    _, _, model, _ = tiny
    params = [greedy(NEW, logprobs=2), greedy(NEW, repetition_penalty=1.3, logprobs=1),
              greedy(NEW, min_tokens=NEW, logprobs=0), greedy(NEW, frequency_penalty=0.5)]
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    for k in (2, 8):
        engine, stats = build(model, engine_name, method, k, batch_invariant=True,
                              max_num_seqs=4)
        got = LLM(engine).generate([id_text(p) for p in PROMPTS], params)
        for i, (c, p) in enumerate(zip(got, params)):
            alone = single.generate(id_text(PROMPTS[i]), p)
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) == (
                alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason,
                alone.logprobs), (k, i)
        assert stats.num_accepted_tokens > 0
        assert engine.scheduler.kv.num_used_tokens == 0


# --- 2. a rejection at a chosen position ------------------------------------------------------

FORCED_BUILDERS = {
    "s09_slots": (s09.build_engine, {}),
    "s12_paged": (s12.build_engine, {"block_size": 4}),
    "s14_default": (None, {"block_size": 4})      # S14's, S13's engine,
}


def base_builder(engine_name):
    builder, options = FORCED_BUILDERS[engine_name]
    if builder is None:
        import s14_quantization as s14
        builder = s14.build_engine
    return builder, options


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "penalty"])
@pytest.mark.parametrize("engine_name", list(FORCED_BUILDERS))
def test_a_rejection_at_the_first_a_middle_and_the_last_draft_and_full_acceptance(
        tiny, engine_name, penalty):
    """k = 4. Two requests side by side; their drafts are the true continuation with one
    wrong token at position j (A: 0, 2, 3, none; B: none, 3, 2, 0). A step with a wrong draft
    at j emits the j drafts before it and the target's own token there (j + 1 tokens, j
    accepted); all right: the 4 drafts and the bonus (5 tokens, 4 accepted). After each step
    num_computed_tokens = before + 1 + accepted (= num_tokens - 1) and the KV manager holds
    exactly that many tokens: cdiv(num_computed, 4) blocks when paged."""
    _, _, model, _ = tiny
    params = greedy(40, repetition_penalty=penalty)
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    prompts = {"A": PROMPTS[2], "B": PROMPTS[0]}
    truth = {rid: single.generate(id_text(p), params).token_ids for rid, p in prompts.items()}
    builder, options = base_builder(engine_name)
    engine, proposer, last = scripted(model, IdTokenizer(), builder, truth, 4,
                                      max_context=CONTEXT, **options)
    kv = engine.scheduler.kv
    for rid, p in prompts.items():
        engine.add_request(p, params, request_id=rid)
    got = {rid: [] for rid in prompts}
    for out in engine.step():                               # the prompts: one token each
        got[out.request_id] += out.new_token_ids
    assert not last.last.plan.scheduled_spec_decode_tokens and proposer.calls == []
    schedule = {"A": [0, 2, 3, None], "B": [None, 3, 2, 0]}
    for step in range(4):
        before = {rid: (len(got[rid]), engine.requests[rid].num_computed_tokens)
                  for rid in prompts}
        for rid in prompts:
            proposer.wrong[rid] = schedule[rid][step]
        outputs = {o.request_id: o for o in engine.step()}
        result = last.last
        for rid in prompts:
            j = schedule[rid][step]
            accepted = 4 if j is None else j
            n, computed = before[rid]
            drafts = [d for r, _, d in proposer.calls[-2:] if r == rid][0]
            assert result.plan.scheduled_spec_decode_tokens[rid] == tuple(drafts)
            assert result.num_accepted_tokens[rid] == accepted, (rid, step)
            assert outputs[rid].new_token_ids == truth[rid][n:n + accepted + 1], (rid, step)
            got[rid] += outputs[rid].new_token_ids
            request = engine.requests[rid]
            assert request.num_computed_tokens == computed + 1 + accepted
            assert request.num_computed_tokens == request.num_tokens - 1
            assert kv.num_tokens(rid) == request.num_computed_tokens
            if hasattr(kv, "req_blocks"):
                assert len(kv.req_blocks[rid]) == math.ceil(request.num_computed_tokens / 4)
                kv.check()
            else:
                assert kv.tokens[rid] == request.num_computed_tokens
            assert not request.spec_token_ids          # spent, whatever was accepted
    for rid in prompts:
        engine.abort(rid)
    engine.step()
    assert kv.num_used_tokens == 0 and not engine.has_unfinished_requests()


class BadRows(RunnerWrapper):
    """Sets NaN logits in request `bad`'s verified rows number `rows` (0: its first draft's
    position) in the next step that verifies its drafts."""

    bad, rows = None, ()

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        if self.bad in out.req_ids and plan.scheduled_spec_decode_tokens.get(self.bad):
            starts = np.cumsum([0] + [1 + d for d in out.num_draft_tokens]).tolist()
            logits = out.logits.clone()
            first = starts[out.req_ids.index(self.bad)]
            for j in self.rows:
                logits[first + j] = float("nan")
            out = dataclasses.replace(out, logits=logits)
            self.bad = None
        return out


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "penalty"])
def test_a_bad_row_counts_only_at_a_position_the_verification_reaches(tiny, penalty):
    """k = 4, the draft at position 1 wrong: the step reaches rows 0 and 1 only. NaN in rows
    2..4 changes nothing (the request goes on as S06 alone); NaN in row 1 ends that request
    alone, "abort" with S04's error; its neighbour is untouched, and nothing is held."""
    _, _, model, _ = tiny
    params = greedy(20, repetition_penalty=penalty)
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    truth = {rid: single.generate(id_text(p), params).token_ids
             for rid, p in (("a", PROMPTS[2]), ("b", PROMPTS[0]))}
    for rows, ends in (((2, 3, 4), False), ((1, 4), True)):
        engine, proposer, _ = scripted(model, IdTokenizer(), s12.build_engine, truth, 4,
                                       max_context=CONTEXT, block_size=4)
        engine.runner = BadRows(engine.runner)
        engine.runner.bad, engine.runner.rows = "a", rows
        proposer.wrong["a"] = 1
        engine.add_request(PROMPTS[2], params, request_id="a")
        engine.add_request(PROMPTS[0], params, request_id="b")
        got = {"a": [], "b": []}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got[o.request_id].append(o)
        assert tokens_of(got["b"]) == truth["b"]
        if ends:
            assert got["a"][-1].finish_reason == "abort"
            assert "NaN" in str(got["a"][-1].error)
            assert tokens_of(got["a"]) == truth["a"][:1]
        else:
            assert tokens_of(got["a"]) == truth["a"] and got["a"][-1].error is None
        assert engine.scheduler.kv.num_used_tokens == 0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
def test_a_step_that_fails_after_the_run_is_taken_back_with_its_drafts(tiny, method,
                                                                         invariant):
    """The model run fails after it wrote KV for the drafts (twice): the plan is taken back,
    the retry proposes again, and every request's ids equal S05 alone; nothing is held."""
    _, _, model, references = tiny
    engine, stats = build(model, "s14_default", method, 4, max_num_seqs=4,
                          batch_invariant=invariant)
    engine.runner = FailingRunner(engine.runner)
    ids = [engine.add_request(p, greedy(NEW)) for p in PROMPTS]
    got, calls = {rid: [] for rid in ids}, 0
    while engine.has_unfinished_requests():
        calls += 1
        assert calls < 100
        engine.runner.failures = int(calls in (3, 6))
        try:
            outputs = engine.step()
        except RuntimeError as err:
            assert "injected" in str(err)
            kv_check(engine, calls, [])
            continue
        for o in outputs:
            got[o.request_id].append(o)
    for i, rid in enumerate(ids):
        assert tokens_of(got[rid]) == references[i][0].token_ids
    assert stats.num_accepted_tokens > 0
    finish_idle(engine)


# --- 3. a stop inside an accepted run ---------------------------------------------------------

def first_new_at(ids, lo=2, hi=7):
    """An index m in lo..hi whose token does not occur before it (None when there is none)."""
    return next((m for m in range(lo, min(hi, len(ids) - 1) + 1) if ids[m] not in ids[:m]),
                None)


def run_scripted(engine, proposer, prompt, params):
    """One request through a scripted engine whose drafts are all right: (its outputs, the
    step results of the steps that verified drafts)."""
    rid = engine.add_request(prompt, params, request_id="r")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    results = [r for r in engine.observers[-1].results if r.plan.scheduled_spec_decode_tokens]
    return outs, results


@pytest.mark.parametrize("engine_name", list(FORCED_BUILDERS))
def test_eos_and_a_stop_token_inside_an_accepted_run_end_the_request_there(tiny, engine_name):
    """k = 8, every draft right: the EOS (the tokenizer's) or a stop token id at output index
    m in 2..7 falls inside the first run of drafts; the request ends at it, ids, text,
    finish_reason and stop_reason as S06 alone with the same tokenizer and params, and the
    step that ended it emitted fewer tokens than it verified."""
    _, _, model, _ = tiny
    builder, options = base_builder(engine_name)
    for prompt in PROMPTS:
        free = s06.Engine(model, IdTokenizer(), CONTEXT).generate(id_text(prompt),
                                                                  greedy(30, ignore_eos=True))
        m = first_new_at(free.token_ids)
        if m is not None:
            break
    assert m is not None, "some prompt's output has a new token at index 2..7"
    stop = free.token_ids[m]
    for tokenizer, params in ((IdTokenizer(eos_id=stop), greedy(30)),
                              (IdTokenizer(), greedy(30, stop_token_ids=[stop]))):
        alone = s06.Engine(model, tokenizer, CONTEXT).generate(id_text(prompt), params)
        assert alone.finish_reason == "stop" and len(alone.token_ids) == m + 1
        engine, proposer, last = scripted(model, tokenizer, builder, {"r": free.token_ids}, 8,
                                          max_context=CONTEXT, **options)
        outs, results = run_scripted(engine, proposer, prompt, params)
        assert tokens_of(outs) == alone.token_ids
        assert (text_of(outs), outs[-1].finish_reason, outs[-1].stop_reason) == (
            alone.text, alone.finish_reason, alone.stop_reason)
        ending = results[-1]
        assert len(ending.plan.scheduled_spec_decode_tokens["r"]) == 8
        assert len(ending.outputs[0].new_token_ids) < ending.num_accepted_tokens["r"] + 1
        assert engine.scheduler.kv.num_used_tokens == 0


def test_max_tokens_caps_the_drafts_and_ends_the_request_at_its_last_token(tiny):
    """max_tokens 5, k 8: after the prompt's token, the cap is 5 - 1 - 1 = 3 drafts (the
    bonus is the 5th token): one step of 4 tokens ends the request, "length"."""
    _, _, model, _ = tiny
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    free = single.generate(id_text(PROMPTS[2]), greedy(30))
    alone = single.generate(id_text(PROMPTS[2]), greedy(5))
    for builder, options in (base_builder("s09_slots"), base_builder("s12_paged")):
        engine, proposer, last = scripted(model, IdTokenizer(), builder, {"r": free.token_ids},
                                          8, max_context=CONTEXT, **options)
        outs, results = run_scripted(engine, proposer, PROMPTS[2], greedy(5))
        assert [cap for _, cap, _ in proposer.calls] == [3]
        assert [len(o.new_token_ids) for o in outs] == [1, 4]
        assert (tokens_of(outs), outs[-1].finish_reason) == (alone.token_ids, "length")
        assert results[-1].num_accepted_tokens == {"r": 3}
        assert engine.scheduler.kv.num_used_tokens == 0


@pytest.mark.skipif(not bundled_ready, reason="bundled model missing")
def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(bundled):
    """The bundled model's tokenizer: a stop string that first appears a few tokens into the
    output, inside the first run of 8 right drafts: ids, text, finish_reason, stop_reason as
    S06 alone (with logprobs too: those of the dropped drafts go)."""
    model, tokenizer, single = bundled
    prompt = BUNDLED_PROMPTS[0]
    free = single.generate(prompt, greedy(30, ignore_eos=True))
    text = tokenizer.decode(free.token_ids[:6])
    stop = text[-3:]
    for params in (greedy(30, stop=[stop]), greedy(30, stop=[stop], logprobs=1)):
        alone = single.generate(prompt, params)
        assert alone.finish_reason == "stop" and 2 <= len(alone.token_ids) <= 7, alone
        for engine_name in FORCED_BUILDERS:
            builder, options = base_builder(engine_name)
            engine, proposer, last = scripted(model, tokenizer, builder,
                                              {"r": free.token_ids}, 8, **options)
            outs, results = run_scripted(engine, proposer, prompt, params)
            assert (tokens_of(outs), text_of(outs), outs[-1].finish_reason,
                    outs[-1].stop_reason) == (alone.token_ids, alone.text,
                                              alone.finish_reason, alone.stop_reason)
            assert len(results[-1].plan.scheduled_spec_decode_tokens["r"]) == 8
            assert engine.scheduler.kv.num_used_tokens == 0


# --- 4. nothing held when idle; aborts; preemption --------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("engine_name", ["s11_chunked", "s12_paged", "s14_default"])
def test_aborts_mid_run_leave_no_block_and_no_draft_slot(tiny, engine_name, method):
    """Requests aborted while they decode with drafts (and one while waiting): at the end no
    token or block is held (every usable block free, prefix-cached ones evictable), the
    others' ids equal S05 alone; one more step and the draft proposer holds no slot."""
    _, _, model, references = tiny
    engine, stats = build(model, engine_name, method, 4, max_num_seqs=2)
    observed = LastStep()
    engine.observers.append(observed)
    aborts = {3: [0], 4: [3], 6: [1]}
    outputs, _ = drive(engine, [(p, greedy(NEW)) for p in PROMPTS], [0, 0, 0, 0], aborts,
                       check=kv_check)
    aborted = [i for i in range(4) if outputs[i][-1].finish_reason == "abort"]
    assert aborted, "some request was still running when its abort came"
    drafted = {rid for r in observed.results for rid in r.plan.scheduled_spec_decode_tokens}
    assert drafted, "drafts were verified"
    for i in set(range(4)) - set(aborted):
        assert tokens_of(outputs[i]) == references[i][0].token_ids
    for i in aborted:             # what came out before the abort is the target's prefix
        ours = tokens_of(outputs[i])
        assert ours == references[i][0].token_ids[:len(ours)]
    kv = engine.scheduler.kv
    assert kv.num_used_tokens == 0
    if hasattr(kv, "pool"):
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    finish_idle(engine)


def test_the_draft_proposer_holds_no_slot_once_the_engine_is_idle(tiny):
    """The last request ends at a stop token (not at max_tokens, whose last step proposes
    nothing), or is aborted while it decodes: as soon as the engine has nothing left, the
    draft holds no slot (no extra step needed)."""
    _, _, model, references = tiny
    ids = references[0][0].token_ids
    m = first_new_at(ids, lo=1)
    engine, _ = build(model, "s14_default", "int4", 4)
    done = LLM(engine).generate(id_text(PROMPTS[0]), greedy(NEW, stop_token_ids=[ids[m]]))
    assert done.token_ids == ids[:m + 1] and done.finish_reason == "stop"
    assert not engine.has_unfinished_requests() and engine.proposer.num_held_slots == 0
    rid = engine.add_request(PROMPTS[3], greedy(NEW))
    engine.step()                                  # the prompt
    engine.step()                                  # a decode step with drafts
    assert engine.proposer.num_held_slots == 1
    engine.abort(rid)
    assert engine.step()[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.proposer.num_held_slots == 0
    assert engine.scheduler.kv.num_used_tokens == 0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("engine_name", ["s11_chunked", "s12_paged"])
def test_preemption_under_a_tight_kv_with_speculation_gives_the_outputs_alone(
        tiny, engine_name, method):
    """KV for 48 tokens (S11: kv_capacity; S12: 12 blocks of 4), four requests of up to
    42 tokens each plus 8 drafts: drafts are dropped and requests preempted, and every
    request's ids still equal S05 and HF alone."""
    _, _, model, references = tiny
    tight = {"kv_capacity": 48} if engine_name == "s11_chunked" else {"num_blocks": 13}
    engine, stats = build(model, engine_name, method, 8, max_num_seqs=4, **tight)
    outputs, _ = drive(engine, [(p, greedy(NEW)) for p in PROMPTS], [0, 0, 0, 0],
                       check=kv_check)
    assert engine.scheduler.num_preemptions > 0
    for i in range(len(PROMPTS)):
        assert tokens_of(outputs[i]) == references[i][0].token_ids == references[i][1]
    assert stats.num_accepted_tokens > 0
    finish_idle(engine)


# --- 5. seeded sampling -------------------------------------------------------------------------

SEEDED = [SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=NEW),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.2,
                         min_tokens=6, max_tokens=NEW, logprobs=1)]
NEIGHBOURS = [SamplingParams(temperature=1.0, seed=99, max_tokens=NEW),
              greedy(NEW, presence_penalty=0.5), SamplingParams(temperature=0.7, max_tokens=NEW)]


def seeded_run(model, method, k, requests, tokenizer=None, **options):
    """The requests through S15 over S14's default engine, arriving one a step, with the
    default budget (max_num_seqs x the context: everyone's 1 + k tokens fit): per request
    (ids, [(token, logprob)]), and the stats."""
    engine, stats = build(model, "s14_default", method, k, max_num_seqs=4, tokenizer=tokenizer,
                          max_num_batched_tokens=None, **options)
    outputs, _ = drive(engine, requests, list(range(len(requests))), check=kv_check)
    return [(tokens_of(outputs[i]), [(lp.token_id, lp.logprob) for o in outputs[i]
                                     for lp in (o.logprobs or [])])
            for i in range(len(requests))], stats


def same_sample(a, b, invariant):
    """Same ids; logprobs bitwise in batch-invariant mode, else within float32 rounding (the
    fast mode's logits depend on the batch's shapes, S08)."""
    assert a[0] == b[0]
    assert [t for t, _ in a[1]] == [t for t, _ in b[1]]
    lp_a, lp_b = [x for _, x in a[1]], [x for _, x in b[1]]
    if invariant:
        assert lp_a == lp_b
    else:
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(tiny, method,
                                                                       invariant):
    """Each seeded request (plain sampling; penalties with min_tokens: the per-row path) run
    twice alone gives the same ids and logprobs, and the same again with three other
    requests (sampled unseeded, greedy with a penalty) arriving beside it. Drafts were
    offered (n-gram: copies of its context, rejected by these flat distributions; int4:
    sampled from the draft's q, mostly accepted)."""
    _, _, model, _ = tiny
    for params in SEEDED:
        for k in (2, 4):
            alone, stats = seeded_run(model, method, k, [(SEEDED_PROMPT, params)],
                                      batch_invariant=invariant)
            again, _ = seeded_run(model, method, k, [(SEEDED_PROMPT, params)],
                                  batch_invariant=invariant)
            assert alone == again
            assert stats.num_draft_tokens > 0
            if method == "int4":
                assert stats.num_accepted_tokens > 0
            crowd, _ = seeded_run(model, method, k, [(SEEDED_PROMPT, params)] + [
                (p, n) for p, n in zip(PROMPTS[1:], NEIGHBOURS)], batch_invariant=invariant)
            same_sample(crowd[0], alone[0], invariant)


@pytest.mark.skipif(not (bundled_ready and draft_ready), reason="bundled or draft model missing")
def test_seeded_sampling_with_the_project_draft_is_reproducible_and_independent(bundled):
    model, tokenizer, _ = bundled
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=16, logprobs=1)
    mine = [(BUNDLED_PROMPTS[0], params)]
    others = [(BUNDLED_PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16)),
              (BUNDLED_PROMPTS[2], greedy(16, min_tokens=10))]
    alone, stats = seeded_run(model, "draft", 3, mine, tokenizer)
    assert seeded_run(model, "draft", 3, mine, tokenizer)[0] == alone
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    same_sample(seeded_run(model, "draft", 3, mine + others, tokenizer)[0][0], alone[0], False)


def test_a_seeded_request_offered_no_draft_draws_what_s06_draws_alone(tiny):
    """n-gram lookup that can never match (min 60 > any context here): no draft is offered,
    and the rejection sampler's one uniform per step is S06's draw: ids, text and logprobs
    bitwise S06 alone in batch-invariant mode, for each seeded request."""
    _, _, model, _ = tiny
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    engine = s15.build_engine(model, IdTokenizer(), speculative="ngram", prompt_lookup_min=60,
                              prompt_lookup_max=60, max_context=CONTEXT, batch_invariant=True)
    stats = s15.SpecDecodingStats()
    engine.observers.append(stats)
    got = LLM(engine).generate([id_text(PROMPTS[0]), id_text(PROMPTS[2])], SEEDED)
    assert stats.num_drafts == 0
    for c, prompt, params in zip(got, (PROMPTS[0], PROMPTS[2]), SEEDED):
        alone = single.generate(id_text(prompt), params)
        assert (c.token_ids, c.text, c.finish_reason, c.logprobs) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.logprobs)


# --- 6. the proposers' edges --------------------------------------------------------------------

def brute_ngram(ids, min_n, max_n, k):
    """Prompt lookup written out: the longest n (max_n down to min_n) whose last-n suffix
    occurs earlier (its earliest start), and the up to k tokens after that occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_ngram_propose_by_hand():
    assert s15.ngram_propose([1, 2, 3, 4], 1, 4, 4) == []                    # no repeat
    assert s15.ngram_propose([1, 2, 3, 1, 2], 1, 4, 4) == [3, 1, 2]          # fewer than k left
    assert s15.ngram_propose([5, 6, 7, 5, 6, 8, 5, 6], 1, 4, 4) == [7, 5, 6, 8]   # earliest hit
    assert s15.ngram_propose([5, 6, 7, 5, 6, 8, 5, 6], 1, 4, 2) == [7, 5]
    # [2, 1] recurs (-> 5 2 1), [1] alone first at 1 (-> 4 ...): the longest n wins
    assert s15.ngram_propose([1, 4, 2, 1, 5, 2, 1], 1, 4, 3) == [5, 2, 1]
    assert s15.ngram_propose([1, 4, 2, 1, 5, 2, 1], 1, 1, 3) == [4, 2, 1]    # max_n = 1
    assert s15.ngram_propose([1, 4, 2, 1, 5, 2, 1], 3, 4, 3) == []           # min_n = 3
    assert s15.ngram_propose([1, 4, 2, 1, 5, 2, 1], 2, 2, 3) == [5, 2, 1]
    assert s15.ngram_propose([7], 1, 4, 4) == []                             # nothing before
    assert s15.ngram_propose([7, 7], 1, 4, 4) == [7]
    assert s15.ngram_propose([1, 2, 1, 2], 1, 4, 0) == []                    # k = 0
    r = np.random.default_rng(15)
    for _ in range(300):
        ids = r.integers(0, 4, size=int(r.integers(1, 25))).tolist()
        lo = int(r.integers(1, 4))
        hi = int(r.integers(lo, 6))
        k = int(r.integers(0, 6))
        assert s15.ngram_propose(ids, lo, hi, k) == brute_ngram(ids, lo, hi, k), (ids, lo, hi, k)


def test_ngram_proposer_respects_each_cap():
    class R:
        def __init__(self, ids):
            self.token_ids = ids
    proposer = s15.NgramProposer(4, 1, 4)
    ids = [1, 2, 3, 4, 5, 1, 2]
    got = proposer.propose([R(ids), R(ids), R([9, 8])], [4, 1, 0], set())
    assert got == [([3, 4, 5, 1], None), ([3], None), ([], None)]


def test_no_drafts_past_max_tokens_or_the_context(tiny):
    """k = 8. max_tokens 1: the prompt's step ends the request, no proposal; max_tokens 2:
    after its first token the cap is 2 - 1 - 1 = 0; a prompt of 92 tokens in a context of
    96: after its first token (93 held) the cap is 96 - 93 - 1 = 2, and one step of 2 drafts
    and the bonus fills the context ("length"), as S06 alone stops there."""
    _, _, model, _ = tiny
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    long_prompt = (PROMPTS[1] * 5)[:92]
    free = {"a": single.generate(id_text(PROMPTS[0]), greedy(30)).token_ids,
            "b": single.generate(id_text(PROMPTS[0]), greedy(30)).token_ids,
            "c": single.generate(id_text(long_prompt), greedy(30)).token_ids}
    engine, proposer, last = scripted(model, IdTokenizer(), s12.build_engine, free, 8,
                                      max_context=CONTEXT, block_size=4)
    engine.add_request(PROMPTS[0], greedy(1), request_id="a")
    engine.add_request(PROMPTS[0], greedy(2), request_id="b")
    engine.add_request(long_prompt, greedy(30), request_id="c")
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert sorted((rid, cap) for rid, cap, _ in proposer.calls) == [("b", 0), ("c", 2)]
    assert all(not r.plan.scheduled_spec_decode_tokens.get("b") for r in last.results)
    alone = single.generate(id_text(long_prompt), greedy(30))
    assert (tokens_of(got["c"]), got["c"][-1].finish_reason) == (alone.token_ids, "length")
    assert len(alone.token_ids) == 4 and [len(o.new_token_ids) for o in got["c"]] == [1, 3]
    assert tokens_of(got["a"]) == free["a"][:1] and tokens_of(got["b"]) == free["b"][:2]
    assert engine.scheduler.kv.num_used_tokens == 0


# --- 7. bad input --------------------------------------------------------------------------------

def refused(parameter, match, call, *args, **kwargs):
    with pytest.raises(ParameterError, match=match) as err:
        call(*args, **kwargs)
    assert err.value.parameter == parameter, err.value


def tiny_s06_model(directory, **config):
    """A tiny random Qwen3 as S06's model (config fields as given)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    base = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=V,
                max_position_embeddings=CONTEXT, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**{**base, **config})).save_pretrained(directory)
    return s06.TorchTransformer.from_pretrained(directory)


def test_every_bad_option_is_a_parameter_error_naming_it(tiny, tmp_path):
    _, _, model, _ = tiny
    tok = IdTokenizer()
    build_ = s15.build_engine
    refused("num_speculative_tokens", r"must be an integer >= 1 \(got 0\)", build_, model, tok,
            num_speculative_tokens=0)
    refused("num_speculative_tokens", r"must be an integer >= 1", build_, model, tok,
            num_speculative_tokens=-2)
    refused("num_speculative_tokens", r"must be an integer >= 1", build_, model, tok,
            num_speculative_tokens=2.5)
    refused("num_speculative_tokens", r"\(7\) must be <= max_context - 2 \(6\)", build_, model,
            tok, num_speculative_tokens=7, max_context=8)
    build_(model, tok, num_speculative_tokens=6, max_context=8)              # the largest k
    refused("speculative", r"speculative must be one of \('ngram', 'draft'\)", build_, model,
            tok, speculative="medusa")
    refused("prompt_lookup_min", r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)",
            build_, model, tok, prompt_lookup_min=3, prompt_lookup_max=2)
    refused("prompt_lookup_min", r"prompt_lookup_min must be an integer >= 1", build_, model,
            tok, prompt_lookup_min=0)
    refused("prompt_lookup_max", r"prompt_lookup_max must be an integer >= 1", build_, model,
            tok, prompt_lookup_max=0)
    refused("draft_model", r"draft_model is for speculative='draft'", build_, model, tok,
            speculative="ngram", draft_model="int4")
    refused("prompt_lookup_max", r"prompt_lookup_max is for speculative='ngram'", build_,
            model, tok, speculative="draft", draft_model="int4", prompt_lookup_max=3)
    for name, value in (("num_speculative_tokens", 3), ("prompt_lookup_min", 1),
                        ("prompt_lookup_max", 4), ("draft_model", "int4")):
        refused(name, rf"{name} needs speculative decoding on", build_, model, tok,
                speculative=None, **{name: value})
    assert build_(model, tok, speculative=None).proposer is None              # the base engine
    refused("max_num_seqs", "max_num_seqs", build_, model, tok, max_num_seqs=0)  # the builder's
    other_vocab = tiny_s06_model(tmp_path / "vocab", vocab_size=V + 4)
    refused("draft_model", rf"vocabulary \({V + 4} ids\) must equal the target's \({V}\)",
            build_, model, tok, speculative="draft", draft_model=other_vocab)
    short = tiny_s06_model(tmp_path / "short", max_position_embeddings=32)
    refused("draft_model", r"window \(32 tokens\) is shorter than max_context \(96\)", build_,
            model, tok, speculative="draft", draft_model=short, max_context=CONTEXT)
    refused("draft_model", r"could not be loaded", build_, model, tok, speculative="draft",
            draft_model=str(tmp_path / "nothing here"))
    engine = build_(model, tok, max_context=CONTEXT)
    LLM(engine).generate(id_text(PROMPTS[0]), greedy(2))
    refused("engine", r"speculate takes an engine that has not run yet", s15.speculate,
            engine, s15.NgramProposer(2))


@pytest.mark.skipif(not (bundled_ready and draft_ready), reason="bundled or draft model missing")
def test_a_draft_whose_tokenizer_differs_is_refused(bundled, tmp_path):
    """The project's draft with its BPE merges cut: same vocabulary size, other encodings."""
    import json
    model, tokenizer, _ = bundled
    draft_dir = tmp_path / "draft"
    shutil.copytree(s15.DRAFT_MODEL_DIR, draft_dir)
    spec = json.loads((draft_dir / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:10]
    (draft_dir / "tokenizer.json").write_text(json.dumps(spec))
    refused("draft_model", r"tokenizer encodes text differently", s15.build_engine, model,
            tokenizer, speculative="draft", draft_model=str(draft_dir))
    engine = s15.build_engine(model, tokenizer, speculative="draft",
                              draft_model=str(s15.DRAFT_MODEL_DIR))
    assert isinstance(engine.proposer, s15.DraftModelProposer)


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "0"],
     "--num-speculative-tokens: num_speculative_tokens must be an integer >= 1"),
    (["--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"),
    (["--prompt-lookup-min", "0"], "prompt_lookup_min must be an integer >= 1"),
    (["--draft-model", "int4"], "--draft-model is for --speculative draft"),   # ngram default
    (["--speculative", "ngram", "--draft-model", "int4"],
     "--draft-model is for --speculative draft"),
    (["--speculative", "draft", "--prompt-lookup-max", "3"],
     "--prompt-lookup-max: prompt_lookup_max is for speculative='ngram'"),
    (["--speculative", "medusa"], "invalid choice: 'medusa'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "9", "--max-context", "10"],
     r"num_speculative_tokens \(9\) must be <= max_context - 2 \(8\)"),
])
def test_main_refuses_bad_flags_with_a_usage_error(argv, message, capsys):
    if "--max-context" in argv and not bundled_ready:
        pytest.skip("this rule is checked once the model is loaded")
    with pytest.raises(SystemExit) as exit_:
        s15.main(argv + ["--device", "cpu"])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_speculative_flags_without_speculative_are_usage_errors(capsys):
    """S19's server adds the flags with speculation off by default: each other flag alone is
    a usage error naming it, and off means no speculative option at all."""
    import argparse
    for argv, flag in ((["--num-speculative-tokens", "3"], "--num-speculative-tokens"),
                       (["--prompt-lookup-min", "2"], "--prompt-lookup-min"),
                       (["--prompt-lookup-max", "2"], "--prompt-lookup-max"),
                       (["--draft-model", "int4"], "--draft-model")):
        parser = argparse.ArgumentParser()
        s15.add_speculative_arguments(parser)
        args = parser.parse_args(argv)
        with pytest.raises(SystemExit):
            s15.check_speculative_arguments(parser, args)
        assert f"{flag} needs --speculative" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    s15.add_speculative_arguments(parser)
    assert s15.speculative_options(parser.parse_args([])) == {}
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "int4"])
    s15.check_speculative_arguments(parser, args)
    assert s15.speculative_options(args) == dict(
        speculative="draft", num_speculative_tokens=4, prompt_lookup_min=None,
        prompt_lookup_max=None, draft_model="int4")


@pytest.mark.skipif(not bundled_ready, reason="bundled model missing")
def test_main_prints_the_speculation_statistics():
    out = subprocess.run(
        [sys.executable, str(ROOT / "code" / "s15_speculative.py"), "--speculative", "draft",
         "--draft-model", "int4", "--num-speculative-tokens", "3", "--num-prompts", "2",
         "--max-tokens", "8", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "speculative decoding, a draft model, k = 3" in text
    assert text.count("--- request ") == 2
    assert "verify steps (a request's step with drafts): " in text
    assert "acceptance by draft position: " in text
    assert "tokens per target forward: " in text
