"""Tests for chapter S09: continuous batching (code/s09_continuous_batching.py, the runner in
code/s09_ragged.py, Part I's call style over it in code/s09_llm.py, the trace in
code/s09_trace.py).

Oracles: the S05 NumPy engine and HF `transformers` `generate()` on each prompt alone
(float32, eager attention), the S06 engine alone (whole completions: text, finish_reason,
stop_reason, logprobs, seeded samples; S06's `CachedTransformer` for logits), S08's static
batch, and counts worked out by hand (the ragged batch's metadata, the slots).

Exactness. The batch-invariant mode must give each request's logits bitwise as if it ran
alone, so its completions are compared with ==. The fast mode's greedy tokens are compared
with == against the oracles on the tiny random models and the bundled model (their top-2 gaps
are far above the float32 differences, S08's measurement), and held to S08's
`follows_batch_rule` against the reference where that is the claim.

The scheduling invariants are checked at every step (`fifo_step_check`, tests/engine_testing.py):
every scheduled request makes exactly one token and no one else does; admission is FIFO and no
request waits while a seat is free; once idle, every slot is free (`drive`, and the slot list
here).

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G4 vllm
#24584 (reported: a streaming request kept generating after its client went away; PR #24586,
closed unmerged, and a maintainer's reply on PR #32442 that AsyncLLM.generate already aborts
on disconnect) -- here a request whose client goes away is aborted and its KV returns to the
free pool within a step; others are unaffected and G5 sglang PR #2238 / PR #1674 / #6778 (after
finishes, aborts while running and aborts while waiting, free slots == total when idle). G1
(a prompt that can never fit blocks the queue) and G2 (preemption) are S10's; here the
nearest case, a prompt that fills the context, finishes on arrival and blocks nobody. The
issue's bad input: one request whose row the sampler refuses (NaN logits, a penalty pushed
past float32) ends alone while its neighbours go on, and a max_num_seqs whose KV cannot fit is
refused naming it.
"""
import numpy as np
import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
import s08_batch_variance as s08bv
import s08_static_batching as s08
import s09_continuous_batching as s09
from engine_testing import (FailingRunner, LogitsRecorder, NaNRows, drive, fifo_step_check,
                            greedy, id_text, run_in_turns, text_of, tiny_fixture, tokens_of)
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s09_continuous_batching import FINISH_ABORT
from s09_scheduler import Request, SchedulerOutput, SlotKVManager
from s09_llm import LLM
from s09_ragged import RaggedBatch, RaggedRunner, SlotKVCache
from s09_trace import format_occupancy_table, trace

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 90]   # 90 + 8 > 96: the context stop fires mid-generation
PROMPTS = [np.random.default_rng(300 + n).integers(2, V, size=n).tolist() for n in LENGTHS]

text = id_text

tiny = tiny_fixture("s09", ["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"], PROMPTS,
                    CONTEXT, NEW)


def engine_for(model, max_num_seqs: int, tokenizer=None, **options) -> s09.LLMEngine:
    """S09's engine on a tiny model (IdTokenizer, context CONTEXT) or the bundled one."""
    if tokenizer is None:
        tokenizer, options = IdTokenizer(), {"max_context": CONTEXT, **options}
    return s09.build_engine(model, tokenizer, max_num_seqs=max_num_seqs, **options)


def all_slots_free(engine) -> bool:
    kv = engine.scheduler.kv
    return kv.free_slots == list(range(kv.num_slots)) and kv.num_used_tokens == 0


def first_difference(name, ours, reference) -> str:
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                 min(len(ours), len(reference)))
    return f"{name}: ids differ first at index {index}\n  ours: {ours}\n  ref:  {reference}"


def collect(engine, seen: dict | None = None) -> dict:
    """Step until nothing is unfinished; every output by request id (added to `seen`)."""
    seen = {} if seen is None else seen
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    return seen


# --- by hand --------------------------------------------------------------------------------

def test_slot_manager_hands_out_the_lowest_free_slot_and_never_overfills_one():
    kv = SlotKVManager(num_slots=3, slot_size=8)
    a, b, c, d = (Request.for_tokens(rid, [1, 2]) for rid in "abcd")
    assert all(kv.allocate_slots(r, 2) for r in (a, b, c))
    assert [kv.block_table(rid) for rid in "abc"] == [(0,), (1,), (2,)]
    assert not kv.allocate_slots(d, 1)                    # no slot free: nothing taken
    assert (kv.block_table("d"), kv.num_tokens("d")) == ((), 0)
    assert not kv.allocate_slots(a, 7) and kv.num_tokens("a") == 2   # 9 > 8 positions
    kv.free(b)
    kv.free(a)
    kv.free(a)                                            # a second free gives nothing twice
    assert kv.free_slots == [0, 1] and kv.num_used_tokens == 2
    assert kv.allocate_slots(d, 8) and kv.block_table("d") == (0,)
    kv.trim(d, 3)                                         # a failed step's revert
    assert kv.num_tokens("d") == 3 and (kv.capacity, kv.num_free_tokens) == (24, 19)
    kv.check_fits(8)
    with pytest.raises(ParameterError, match="prompt is 9 tokens but a KV slot holds 8") as err:
        kv.check_fits(9)
    assert err.value.parameter == "prompt"
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1"):
        SlotKVManager(0, 8)
    cache = SlotKVCache(2, 3, 2, 8, 4)
    assert cache.k.shape == cache.v.shape == (2, 3, 2, 8, 4) and not cache.k.any()
    assert (cache.num_slots, cache.max_seq_len, cache.nbytes) == (3, 8, 2 * 2 * 3 * 2 * 8 * 4 * 4)
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1"):
        SlotKVCache(2, 0, 2, 8, 4)


def test_ragged_batch_metadata_by_hand():
    # A 3-token prompt piece in slot 2 that does not sample, between two decodes (slots 0
    # and 1, 5 and 9 cached).
    batch = RaggedBatch.build([[7], [4, 5, 6], [8]], [5, 0, 9], [(0,), (2,), (1,)],
                              [True, False, True])
    assert batch.input_ids.tolist() == [7, 4, 5, 6, 8]
    assert batch.positions.tolist() == [5, 0, 1, 2, 9]
    assert batch.query_start_loc == [0, 1, 4, 5] and batch.query_lens() == [1, 3, 1]
    assert batch.context_lens == [6, 3, 10]
    assert batch.query_starts() == [5, 0, 9]
    assert batch.slots == [0, 2, 1] and batch.block_table_tensor.tolist() == [[0], [2], [1]]
    assert batch.sample_rows.tolist() == [0, 4]
    assert (batch.num_tokens, batch.num_seqs) == (5, 3)
    every = RaggedBatch.build([[7], [4, 5, 6], [8]], [5, 0, 9], [(0,), (2,), (1,)])
    assert every.samples == [True] * 3 and every.sample_rows.tolist() == [0, 3, 4]
    ragged_tables = RaggedBatch.build([[1], [2]], [0, 0], [(3,), (1, 4)])
    assert ragged_tables.block_table_tensor.tolist() == [[3, 0], [1, 4]]   # padded with 0
    with pytest.raises(ValueError, match="each with a new token"):
        RaggedBatch.build([[1], []], [0, 0], [(0,), (1,)])


@pytest.mark.parametrize("attention", ["masked", "loop"])
def test_a_mixed_step_gives_each_request_its_logits_alone(tiny, attention):
    """A step that mixes a whole prompt with decodes (slots out of order, an empty slot inside
    the decoding range), after a step of prompt pieces that sample nothing: each request's
    logits are those of S06's `CachedTransformer` on that request alone (its prompt in one
    pass, then one token per pass); the batch-invariant mode's bitwise."""
    name, _, model, _ = tiny
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[1]]
    extra = [11, 12, 13]                             # the token each request "samples" next
    alone = []
    for p, t in zip(prompts, extra):
        single = s06.CachedTransformer(model, CONTEXT)
        alone.append((single.prefill(p), single.decode(t)))
    slots = {"0": 3, "1": 1, "2": 0}
    for invariant in (False, True):
        runner = RaggedRunner(model, SlotKVCache.for_model(model, 4, CONTEXT), invariant,
                              attention)
        requests = {str(i): Request.for_tokens(str(i), p) for i, p in enumerate(prompts)}

        def run(num_scheduled, starts):
            plan = SchedulerOutput(0, num_scheduled, starts,
                                   {rid: (slots[rid],) for rid in num_scheduled})
            return runner.execute_model(plan, requests)

        # All but the last token of requests 0 and 2 (slots 3 and 0): no row samples.
        out = run({"0": len(prompts[0]) - 1, "2": len(prompts[2]) - 1}, {"0": 0, "2": 0})
        assert out.req_ids == [] and out.logits.shape == (0, model.vocab_size)
        # Their last prompt tokens as decodes beside request 1's whole prompt (slot 1), then
        # one decode each.
        for phase, (num_scheduled, starts) in enumerate([
                ({"0": 1, "1": len(prompts[1]), "2": 1},
                 {"0": len(prompts[0]) - 1, "1": 0, "2": len(prompts[2]) - 1}),
                ({rid: 1 for rid in requests}, {str(i): len(p) for i, p in enumerate(prompts)})]):
            out = run(num_scheduled, starts)
            assert out.req_ids == ["2", "1", "0"]        # rows in slot order
            assert out.num_tokens == sum(num_scheduled.values())
            for row, rid in enumerate(out.req_ids):
                want = alone[int(rid)][phase]
                if invariant:
                    assert torch.equal(out.logits[row], want), (name, phase, rid)
                else:
                    torch.testing.assert_close(out.logits[row], want, rtol=1e-4, atol=1e-5)
            if phase == 0:
                for i, rid in enumerate(requests):
                    requests[rid].append_token(extra[i])


# --- greedy parity: whatever the arrivals, the slots and the companions ---------------------

SCHEDULES = {   # name: (max_num_seqs, arrival step of each of the 8 prompts)
    "all_at_once_8_slots": (8, [0] * 8),
    "all_at_once_2_slots": (2, [0] * 8),
    "staggered_3_slots": (3, [0, 1, 2, 3, 5, 8, 9, 13]),
    "reverse_order_1_slot": (1, [7, 6, 5, 4, 3, 2, 1, 0]),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("attention", ["masked", "loop"])
def test_every_request_equals_s05_and_hf_alone(tiny, schedule, attention):
    name, _, model, references = tiny
    max_num_seqs, arrivals = SCHEDULES[schedule]
    engine = engine_for(model, max_num_seqs, attention=attention)
    tracer, check = fifo_step_check(engine)
    outputs, _ = drive(engine, [(text(p), greedy()) for p in PROMPTS], arrivals, check=check)
    for i, outs in outputs.items():
        alone, hf_alone = references[i]
        got = tokens_of(outs)
        assert got == alone.token_ids, first_difference(f"{name} S05 p{i}", got,
                                                        alone.token_ids)
        assert got == hf_alone, first_difference(f"{name} HF p{i}", got, hf_alone)
        assert outs[-1].finished and outs[-1].finish_reason == alone.finish_reason
        assert text_of(outs) == alone.text
    assert all_slots_free(engine)
    assert max(len(r.running) for r in tracer.records) == max_num_seqs
    if schedule == "staggered_3_slots":   # some step mixed a prefill with decodes
        assert any(r.prefill_tokens and r.num_tokens > r.prefill_tokens for r in tracer.records)


def test_two_copies_of_a_prompt_beside_a_third_do_not_attend_across(tiny):
    """Identical prompts in one batch (identical keys in two slots) next to a different one:
    the batch-invariant logits are bitwise those of each request alone, so no request read
    another's keys; the fast mode's tokens equal them."""
    name, _, model, references = tiny
    prompts = [text(PROMPTS[3]), text(PROMPTS[3]), text(PROMPTS[5])]
    together = engine_for(model, 3, batch_invariant=True)
    together.runner = recorded = LogitsRecorder(together.runner)
    _, ids = drive(together, [(p, greedy()) for p in prompts], [0, 1, 0],
                   check=fifo_step_check(together)[1])
    for i, prompt in enumerate(prompts):
        alone = engine_for(model, 1, batch_invariant=True)
        alone.runner = alone_recorded = LogitsRecorder(alone.runner)
        LLM(alone).generate(prompt, greedy())
        (theirs,) = alone_recorded.logits.values()
        mine = recorded.logits[ids[i]]
        assert len(mine) == len(theirs) == NEW
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), (name, i)
    fast = LLM(engine_for(model, 3)).generate(prompts, greedy())
    assert [c.token_ids for c in fast] == [references[3][0].token_ids] * 2 + [
        references[5][0].token_ids]


def test_fast_mode_follows_the_batch_rule_against_the_reference(tiny):
    name, _, model, _ = tiny
    prompts = [text(p) for p in PROMPTS]
    params = greedy(logprobs=2)
    fast = LLM(engine_for(model, 3)).generate(prompts, params)
    ref = LLM(engine_for(model, 3, batch_invariant=True)).generate(prompts, params)
    for f, r in zip(fast, ref):
        assert s08bv.follows_batch_rule(f, r, s08bv.BATCH_TOLERANCE[torch.float32]), name


def test_seeded_sampling_equals_the_request_alone(tiny):
    name, _, model, _ = tiny
    params = [s04.SamplingParams(temperature=1.0, seed=7 + i, max_tokens=NEW, top_k=20)
              for i in range(4)]
    prompts = [text(PROMPTS[i]) for i in (0, 3, 3, 6)]
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    for invariant in (True, False):
        engine = engine_for(model, 2, batch_invariant=invariant)
        outputs, _ = drive(engine, list(zip(prompts, params)), [2, 0, 1, 0],
                           check=fifo_step_check(engine)[1])
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            assert tokens_of(outputs[i]) == single.generate(prompt, p).token_ids, (name, i)


def test_generate_takes_more_prompts_than_slots_and_equals_s08(tiny):
    name, _, model, _ = tiny
    prompts = [text(p) for p in PROMPTS] * 2
    engine = engine_for(model, 3)
    ours = LLM(engine).generate(prompts, greedy())
    static = s08.Engine(model, IdTokenizer(), CONTEXT).generate(prompts, greedy())
    assert [(c.token_ids, c.text, c.finish_reason) for c in ours] == [
        (c.token_ids, c.text, c.finish_reason) for c in static]
    assert [c.request_id for c in ours] == [str(i) for i in range(len(prompts))]
    assert all_slots_free(engine) and not engine.has_unfinished_requests()


def test_part_one_streams_interleaved_equal_each_alone(tiny):
    """Part I's single-prompt streams of one LLM advanced in turns: each gets its own outputs,
    equal to the request alone; a stream's requests are queued by the call, and nothing runs
    before a stream is iterated."""
    name, _, model, references = tiny
    engine = engine_for(model, 2)
    llm = LLM(engine)
    streams = [llm.stream(text(PROMPTS[i]), NEW) for i in (1, 4, 6)]
    assert len(engine.requests) == 3 and engine.scheduler.num_steps == 0
    results = run_in_turns(streams)
    for i, got in zip((1, 4, 6), results):
        assert got.token_ids == references[i][0].token_ids
    assert len({c.request_id for c in results}) == 3 and all_slots_free(engine)


# --- whole completions on the bundled model --------------------------------------------------

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")

BUNDLED_PROMPTS = ["Rom.\nBut soft! what light through yonder window breaks?", "O",
                   "Ham.\nTo be, or not to be, that is the question:", "First Citizen.\n",
                   "Hello world,", "How are you, my lord?\n"]


@pytest.fixture(scope="module")
def bundled_model():
    return s06.load(s03.BUNDLED_MODEL_DIR, device="cpu", dtype="float32")


@bundled
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_whole_completions_equal_the_s06_engine_alone(bundled_model, invariant):
    """Stop ids, stop strings, min_tokens, penalties, seeded sampling and logprobs, arriving
    staggered into 3 slots: every request's outputs join to the S06 engine's completion alone
    (ids, text, finish_reason, stop_reason; logprobs exactly in the invariant mode); no
    output holds U+FFFD."""
    model, tokenizer = bundled_model
    single = s06.Engine(model, tokenizer)
    free = single.generate(BUNDLED_PROMPTS[0], greedy(30, ignore_eos=True))
    params = [   # test_s08_static_batching.mixed_params: every stop rule and the sampler
        greedy(30), greedy(30, stop_token_ids=[free.token_ids[5]]),
        greedy(30, stop=[tokenizer.decode(free.token_ids[3:5])[-2:]]),
        s04.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=25, seed=3, logprobs=3),
        greedy(30, min_tokens=20, repetition_penalty=1.3, logprobs=1),
        s04.SamplingParams(temperature=1.2, top_k=30, max_tokens=1, seed=9)]
    engine = engine_for(model, 3, tokenizer, batch_invariant=invariant)
    outputs, _ = drive(engine, list(zip(BUNDLED_PROMPTS, params)), [0, 0, 1, 4, 4, 9],
                       check=fifo_step_check(engine)[1])
    reasons = set()
    for i, (prompt, p) in enumerate(zip(BUNDLED_PROMPTS, params)):
        alone = single.generate(prompt, p)
        outs = outputs[i]
        assert tokens_of(outs) == alone.token_ids, prompt
        assert text_of(outs) == alone.text
        assert not any("\ufffd" in o.text_delta for o in outs)
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (alone.finish_reason,
                                                                  alone.stop_reason)
        reasons.add(alone.finish_reason)
    assert reasons == {"stop", "length"}
    if invariant:   # logprobs: the whole Completion through S08's list call
        got = LLM(engine_for(model, 3, tokenizer, batch_invariant=True)).generate(
            BUNDLED_PROMPTS, params)
        assert [c.logprobs for c in got] == [single.generate(q, p).logprobs
                                             for q, p in zip(BUNDLED_PROMPTS, params)]


@bundled
def test_bundled_model_requests_equal_s05_and_hf_alone(bundled_model):
    from transformers import AutoModelForCausalLM
    model, tokenizer = bundled_model
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    numpy_model = s03.Transformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    s05_engine = s05.Engine(numpy_model, tokenizer, numpy_model.config.max_position_embeddings)
    engine = engine_for(model, 4, tokenizer)
    outputs, _ = drive(engine, [(p, greedy(24)) for p in BUNDLED_PROMPTS], [0, 2, 2, 3, 0, 7],
                       check=fifo_step_check(engine)[1])
    eos = tokenizer.eos_id
    for i, prompt in enumerate(BUNDLED_PROMPTS):
        got = tokens_of(outputs[i])
        assert got == s05_engine.generate(prompt, greedy(24)).token_ids, prompt
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), max_new_tokens=24, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
        assert got == out[0, len(ids):].tolist(), prompt


# --- the public bug reports and aborts ------------------------------------------------------

def test_abort_frees_the_slot_within_the_step_and_spares_the_others(tiny):
    """vllm #24584 (G4, the report; see the module docstring): a client that goes away
    mid-stream. Its request is aborted: its slot is free before abort returns (the next step
    already admits a waiting request into it), its last output says "abort", the tokens it
    streamed are a prefix of its output alone, and the requests beside it give exactly their
    outputs alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 2)
    tracer = trace(engine)
    kv = engine.scheduler.kv
    a = engine.add_request(text(PROMPTS[2]), greedy(30))
    b = engine.add_request(text(PROMPTS[3]), greedy())
    c = engine.add_request(text(PROMPTS[4]), greedy())    # waits: both slots are taken
    seen = {a: [], b: [], c: []}
    for _ in range(2):
        for o in engine.step():
            seen[o.request_id].append(o)
    assert kv.free_slots == [] and [r.request_id for r in engine.scheduler.waiting] == [c]
    assert engine.abort(a) is True
    assert kv.free_slots == [0] and a not in engine.requests   # freed at once
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert outs[0] == s09.RequestOutput(a, [], "", True, FINISH_ABORT, None)
    assert tracer.records[-1].joined == (c,) and a in tracer.records[-1].left
    assert tracer.records[-1].slots[tracer.records[-1].running.index(c)] == 0
    for o in outs[1:]:
        seen[o.request_id].append(o)
    collect(engine, seen)
    streamed = tokens_of(seen[a])
    assert streamed == references[2][0].token_ids[:len(streamed)] and len(streamed) == 2
    assert tokens_of(seen[b]) == references[3][0].token_ids
    assert tokens_of(seen[c]) == references[4][0].token_ids
    assert all_slots_free(engine)
    assert engine.abort(a) is False and engine.abort("no such id") is False


def test_closing_a_stream_aborts_its_requests_and_frees_their_slots(tiny):
    """G4 through S08's list stream: a caller that stops reading and closes the stream (as a
    server does on disconnect) aborts its requests; their slots are free at once, and the
    engine serves the next request."""
    name, _, model, references = tiny
    engine = engine_for(model, 2)
    llm = LLM(engine)
    stream = llm.stream([text(PROMPTS[2]), text(PROMPTS[3])], 30)
    next(stream)
    assert engine.scheduler.kv.free_slots == []
    stream.close()
    assert all_slots_free(engine) and not engine.requests
    assert not engine.scheduler.has_unfinished_requests()
    # Each request's result is what it had streamed, ended by the abort.
    assert [(len(c.token_ids), c.finish_reason) for c in stream.result] == [(1, "abort")] * 2
    rid = engine.add_request(text(PROMPTS[2]), greedy())
    assert tokens_of(collect(engine)[rid]) == references[2][0].token_ids


def test_an_llm_serves_the_next_call_after_a_stream_is_closed(tiny):
    name, _, model, references = tiny
    llm = LLM(engine_for(model, 2))
    stream = llm.stream([text(PROMPTS[2]), text(PROMPTS[3])], 30)
    next(stream)
    stream.close()
    assert llm.generate(text(PROMPTS[2]), NEW).token_ids == references[2][0].token_ids


def test_no_slot_leaks_after_finishes_and_aborts_while_running_and_waiting(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): many requests, some finish, some are aborted
    while running, some while still waiting, one aborted twice: once idle, free slots ==
    total, and every request that was not aborted gives its output alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 3)
    requests = [(text(PROMPTS[i % len(PROMPTS)]), greedy()) for i in range(12)]
    aborts = {1: [0, 9], 3: [4, 5, 11], 4: [4], 6: [2]}    # 9, 11: while waiting
    outputs, ids = drive(engine, requests, [0] * 10 + [2, 2], aborts,
                         check=fifo_step_check(engine)[1])
    aborted = {0, 2, 4, 5, 9, 11}
    for i, outs in outputs.items():
        want = references[i % len(PROMPTS)][0].token_ids
        got = tokens_of(outs)
        if i in aborted and outs[-1].finish_reason == FINISH_ABORT:
            assert got == want[:len(got)]
        else:
            assert got == want and i not in {0, 9, 11}
    assert sum(o.finish_reason == FINISH_ABORT for outs in outputs.values()
               for o in outs) == len(aborted)
    assert all_slots_free(engine) and not engine.has_unfinished_requests()


def test_a_prompt_that_fills_the_context_finishes_on_arrival_and_blocks_nobody(tiny):
    """The nearest case here to vllm PR #1534 (G1, a request that can never be scheduled
    blocking the queue): a prompt of max_context tokens takes no slot, ends with "length"
    and no token in the next step, and the request behind it runs in that step."""
    name, _, model, references = tiny
    engine = engine_for(model, 1)
    tracer = trace(engine)
    full = engine.add_request(text([5] * CONTEXT), greedy())
    after = engine.add_request([5] * CONTEXT, greedy())       # as token ids too
    last = engine.add_request(text(PROMPTS[1]), greedy())
    assert engine.scheduler.kv.free_slots == [0] and list(engine.requests) == [last]
    outs = engine.step()
    assert [o.request_id for o in outs] == [full, after, last]
    for o in outs[:2]:
        assert (o.new_token_ids, o.finished, o.finish_reason) == ([], True, "length")
    assert tracer.records[-1].joined == (last,)
    assert tokens_of(collect(engine, {last: outs[2:]})[last]) == references[1][0].token_ids


def test_bad_requests_are_refused_naming_the_parameter_before_anything_is_taken(tiny):
    """Every bad input gets a ParameterError whose `parameter` names the field, from
    add_request (and make_request) before anything is queued or an id is used: the request
    id, the prompt (empty, ids outside [0, V), longer than the context), the params (Part I's
    rules; a penalty outside its range is refused by SamplingParams itself), the priority
    and the cache salt; the engine's own options too."""
    name, _, model, _ = tiny
    engine = engine_for(model, 2)
    assert engine.add_request(text(PROMPTS[1]), greedy(), request_id="a") == "a"
    good = dict(prompt=text(PROMPTS[2]), params=greedy())
    cases = [
        (dict(request_id="a"), r"request_id 'a' is already in use", "request_id"),
        (dict(request_id=""), "request_id must be a non-empty string", "request_id"),
        (dict(request_id=7), "request_id must be a non-empty string", "request_id"),
        (dict(request_id="x" * 257), "request_id must be a non-empty string of at most 256",
         "request_id"),
        (dict(prompt=""), "prompt must be a non-empty", "prompt"),
        (dict(prompt=[]), "prompt", "prompt"),
        (dict(prompt=text([2] * 97)), r"prompt is 97 tokens but max_context is 96", "prompt"),
        (dict(prompt=[2] * 97), r"prompt is 97 tokens but max_context is 96", "prompt"),
        (dict(prompt=text([V + 5])), "token ids", "prompt"),
        (dict(prompt=[V]), r"\[0, V", "prompt"),
        (dict(prompt=[-1]), r"\[0, V", "prompt"),
        (dict(prompt="\ud800"), "prompt", "prompt"),
        (dict(params=0), "max_tokens must be an integer >= 1", "max_tokens"),
        (dict(params="fast"), "or a params object", "max_tokens"),
        (dict(params=greedy(stop_token_ids=[V + 1])), "stop_token_ids", "stop_token_ids"),
        (dict(priority=1.5), "priority must be an integer", "priority"),
        (dict(priority=True), "priority must be an integer", "priority"),
        (dict(priority="high"), "priority must be an integer", "priority"),
        (dict(priority=None), "priority must be an integer", "priority"),
        (dict(cache_salt=""), "cache_salt must be a non-empty string", "cache_salt"),
        (dict(cache_salt=5), "cache_salt must be a non-empty string", "cache_salt"),
        (dict(cache_salt="\ud800"), "cache_salt must be valid Unicode", "cache_salt"),
    ]
    for change, rule, parameter in cases:
        fields = {**good, **change}
        prompt, params = fields.pop("prompt"), fields.pop("params")
        for call in (engine.add_request, engine.make_request):
            with pytest.raises(ParameterError, match=rule) as err:
                call(prompt, params, **fields)
            assert err.value.parameter == parameter, (change, err.value)
    for field in ("presence_penalty", "frequency_penalty"):   # the 10**20 in JSON
        with pytest.raises(ParameterError, match=field) as err:
            s04.SamplingParams(**{field: 10**20})
        assert err.value.parameter == field
    with pytest.raises(ParameterError, match="request_id must be a string") as err:
        engine.abort(3)
    assert err.value.parameter == "request_id"
    assert list(engine.requests) == ["a"] and len(engine.scheduler.waiting) == 1
    assert engine.add_request(text(PROMPTS[1])) == "0"      # no id was used by the refusals
    engine.add_request(text(PROMPTS[1]), request_id="1")
    assert engine.add_request(text(PROMPTS[1])) == "2"      # "1" is in use: skipped
    for options, parameter in ((dict(max_num_seqs=0), "max_num_seqs"),
                               (dict(max_num_seqs=2.5), "max_num_seqs"),
                               (dict(max_context=0), "max_context"),
                               (dict(attention="flash"), "attention"),
                               (dict(batch_invariant="yes"), "batch_invariant"),
                               (dict(sync_timing=1), "sync_timing")):
        with pytest.raises(ParameterError, match=parameter) as err:
            s09.build_engine(model, IdTokenizer(), **options)
        assert err.value.parameter == parameter
    # max_context past the model's window: tests/test_s09_engine_edges.py's build options
    assert engine.step() and engine_for(model, 2).step() == []


def test_llm_checks_every_request_first_and_refuses_an_engine_it_does_not_own(tiny):
    """LLM (Part I's call style over the engine): a bad prompt or params among several is
    refused (prefixed "prompt i: " / "params[i]: ") with nothing queued; it refuses to start,
    naming the rule, while the engine holds requests added with add_request (its steps would
    take their outputs), and works once they are done."""
    name, _, model, references = tiny
    engine = engine_for(model, 4)
    llm = LLM(engine)
    with pytest.raises(ParameterError, match="^prompt 1: prompt must be a non-empty") as err:
        llm.generate([text(PROMPTS[1]), ""], greedy())
    assert err.value.parameter == "prompt"
    with pytest.raises(ParameterError, match=r"^params\[1\]: ") as err:
        llm.generate([text(PROMPTS[1]), text(PROMPTS[2])],
                     [greedy(), greedy(stop_token_ids=[V + 1])])
    assert err.value.parameter == "stop_token_ids" and not engine.requests
    mine = engine.add_request(text(PROMPTS[2]), greedy(), request_id="mine")
    rule = "the engine holds 1 requests this LLM did not add"
    for call in (llm.generate, llm.stream):
        for prompts in (text(PROMPTS[3]), [text(PROMPTS[3])]):
            with pytest.raises(ValueError, match=rule):
                call(prompts, NEW)
    assert list(engine.requests) == [mine] and len(engine.scheduler.waiting) == 1
    assert tokens_of(collect(engine)[mine]) == references[2][0].token_ids
    other = engine.add_request(text(PROMPTS[1]), greedy(), request_id="other")
    engine.step()
    assert engine.abort(other)          # finished by the abort; its last output still pending
    with pytest.raises(ValueError, match=rule):
        llm.generate(text(PROMPTS[3]), NEW)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("other", FINISH_ABORT)]
    assert llm.generate(text(PROMPTS[3]), NEW).token_ids == references[3][0].token_ids
    assert all_slots_free(engine)


# --- one bad request among good ones ------------------------------------------------------

@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_one_bad_request_ends_alone_and_its_neighbours_are_untouched(tiny, invariant):
    """The issue's "one request's bad value fails its neighbours": request b's model row
    turns NaN from its second token on (`NaNRows`). In that step b ends alone, with
    finish_reason "abort", the one token it had, and `error` a ParameterError whose parameter
    is None (the model's logits, not b's parameters, are to blame); the seeded requests
    beside it (a before it in the batch with a penalty history, c after it) and a greedy one
    give exactly their completions alone on S06's engine, token for token; every slot is free
    at the end. Through LLM's list call the same: b's completion ends "abort", the others
    are whole."""
    name, _, model, _ = tiny
    requests = {
        "a": (2, s04.SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.4,
                                    max_tokens=NEW)),
        "b": (3, s04.SamplingParams(temperature=0.8, seed=3, max_tokens=NEW)),
        "c": (4, s04.SamplingParams(temperature=1.1, top_p=0.9, seed=12, max_tokens=NEW)),
        "d": (5, greedy())}
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    alone = {rid: single.generate(text(PROMPTS[i]), p) for rid, (i, p) in requests.items()}
    engine = engine_for(model, 4, batch_invariant=invariant)
    engine.runner = NaNRows(engine.runner, bad="b", after=1)
    tracer, check = fifo_step_check(engine)
    outputs, ids = drive(engine, [(text(PROMPTS[i]), p, {"request_id": rid})
                                  for rid, (i, p) in requests.items()], [0] * 4, check=check)
    by_id = {ids[i]: outs for i, outs in outputs.items()}
    bad = by_id["b"][-1]
    assert tokens_of(by_id["b"]) == alone["b"].token_ids[:1]
    assert (bad.new_token_ids, bad.finished, bad.finish_reason) == ([], True, FINISH_ABORT)
    assert isinstance(bad.error, ParameterError) and bad.error.parameter is None
    assert "NaN" in str(bad.error)
    assert tracer.records[1].running == ("a", "b", "c", "d") and "b" in tracer.records[1].left
    for rid in "acd":
        assert tokens_of(by_id[rid]) == alone[rid].token_ids, (name, invariant, rid)
        assert all(o.error is None for o in by_id[rid])
    assert all_slots_free(engine)
    engine.runner.bad = "1"                                    # the list call's second
    got = LLM(engine).generate([text(PROMPTS[requests[r][0]]) for r in "abc"],
                               [requests[r][1] for r in "abc"])
    assert got[1].finish_reason == FINISH_ABORT and len(got[1].token_ids) == 1
    assert [c.token_ids for c in (got[0], got[2])] == [alone["a"].token_ids,
                                                       alone["c"].token_ids]
    assert all_slots_free(engine) and not engine.has_unfinished_requests()


def test_a_penalty_past_float32_ends_only_its_request_naming_the_parameter(tiny):
    """A repetition_penalty of 10**20 is accepted (stored as a float: any value > 0 is a
    penalty) and, on these models, keeps every logit finite, so that request equals S06's
    alone. One of 1e-40 divides a positive logit past float32's range: that request ends in
    its first step with "abort" and error.parameter "repetition_penalty" (its own field, so
    a server answers 400), and the request beside it gives its output alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 3)
    huge = greedy(repetition_penalty=10**20)
    made = engine.make_request(text(PROMPTS[3]), huge)
    assert type(made.params.repetition_penalty) is float and made.params.repetition_penalty == 1e20
    rids = [engine.add_request(text(PROMPTS[3]), huge),
            engine.add_request(text(PROMPTS[3]), greedy(repetition_penalty=1e-40)),
            engine.add_request(text(PROMPTS[2]), greedy())]
    seen = collect(engine)
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    assert tokens_of(seen[rids[0]]) == single.generate(text(PROMPTS[3]), huge).token_ids
    (over,) = seen[rids[1]]
    assert (over.new_token_ids, over.finish_reason) == ([], FINISH_ABORT)
    assert over.error.parameter == "repetition_penalty" and "float32" in str(over.error)
    assert tokens_of(seen[rids[2]]) == references[2][0].token_ids
    assert all_slots_free(engine)


def test_a_model_run_that_raises_fails_the_step_and_loses_nothing(tiny):
    """A model run that raises (`FailingRunner`) still fails step(); the plan is reverted
    (each running request holds the KV of what it has computed), the last output the step
    held (an abort since the step before) comes with the next step, the failed step has no
    record and its number is taken back, and every request then gives its output alone."""
    name, _, model, references = tiny
    engine = engine_for(model, 3)
    tracer = trace(engine)
    engine.runner = failing = FailingRunner(engine.runner)
    for rid, i in (("a", 2), ("b", 3), ("x", 4)):
        engine.add_request(text(PROMPTS[i]), greedy(), request_id=rid)
    seen = {}
    for o in engine.step():                           # every request's prompt
        seen.setdefault(o.request_id, []).append(o)
    assert engine.abort("x")
    failing.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    kv = engine.scheduler.kv
    assert [(r.request_id, kv.num_tokens(r.request_id)) for r in engine.scheduler.running] == [
        ("a", len(PROMPTS[2])), ("b", len(PROMPTS[3]))]
    collect(engine, seen)
    assert [(len(o.new_token_ids), o.finish_reason) for o in seen["x"]] == [
        (1, None), (0, FINISH_ABORT)]
    for rid, i in (("a", 2), ("b", 3)):
        assert tokens_of(seen[rid]) == references[i][0].token_ids
    assert [r.step for r in tracer.records] == list(range(len(tracer.records)))
    assert engine.scheduler.num_steps == len(tracer.records) and all_slots_free(engine)


def test_a_max_num_seqs_whose_kv_cannot_fit_is_refused_naming_it_before_allocating(tiny):
    """The issue's "S09-S11 with a very large max_num_seqs crash with a torch RuntimeError":
    10**7 slots (about 900 GiB of KV on these models) are compared with the memory still
    free (`s09_ragged.available_memory`) and refused with a ParameterError naming
    max_num_seqs, before anything of that size is allocated: the call runs under an address
    space limit of its current size + 64 MiB."""
    import contextlib
    import os
    resource = pytest.importorskip("resource")
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs Linux's /proc/self/statm to set the limit")
    name, _, model, _ = tiny

    @contextlib.contextmanager
    def address_space_limit(extra: int):
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
        before = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size + extra, before[1]))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, before)

    with pytest.raises(ParameterError, match="max_num_seqs") as err:
        with address_space_limit(64 << 20):
            s09.build_engine(model, IdTokenizer(), max_num_seqs=10**7)
    assert err.value.parameter == "max_num_seqs"


# --- the harness, the script ------------------------------------------------------------------

@bundled
def test_main_prints_completions_and_the_occupancy_table(capsys):
    s09.main(["--num-prompts", "4", "--max-tokens", "6", "--max-num-seqs", "2",
              "--arrival-every", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 4 and "running" in out and "joined" in out
    s09.main(["--prompt", "Romeo.", "--prompt", "To be, or not", "--max-tokens", "3",
              "--device", "cpu"])
    out = capsys.readouterr().out
    assert "Romeo." in out and "To be, or not" in out
    for bad in (["--max-num-seqs", "0"], ["--arrival-every", "-1"], ["--prompt", ""],
                ["--threads", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            s09.main(bad)
        assert exit_info.value.code == 2


def test_occupancy_table_elides_the_middle_of_a_long_trace(tiny):
    name, _, model, _ = tiny
    engine = engine_for(model, 2)
    tracer = trace(engine)
    LLM(engine).generate([text(p) for p in PROMPTS], greedy(30))
    table = format_occupancy_table(tracer.records, max_rows=10)
    assert len(tracer.records) > 10 and "…" in table and len(table.splitlines()) == 12
    assert [r.step for r in tracer.records] == list(range(len(tracer.records)))
    for r in tracer.records:
        assert r.kv_used_tokens + r.kv_free_tokens == r.kv_capacity == 2 * CONTEXT
        assert r.token_budget is None and r.num_tokens == sum(r.num_scheduled_tokens)
