"""Tests for chapter S09: continuous batching.

Oracles: the S05 NumPy engine and HF `transformers` `generate()` on each prompt alone
(float32, eager attention), the S06 engine alone (whole completions: text, finish_reason,
stop_reason, logprobs, seeded samples), S08's static batch, and counts worked out by hand
(the ragged batch's metadata, the slots).

Exactness. The batch-invariant mode must give each request's logits bitwise as if it ran
alone, so its completions are compared with ==. The fast mode's greedy tokens are compared
with == against the oracles on the tiny random models and the bundled model (their top-2 gaps
are far above the float32 differences, S08's measurement), and held to S08's
`follows_batch_rule` against the reference where that is the claim.

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G4 vllm
#24584 / PR #24586 (a request whose client goes away is aborted and its KV returns to the free
pool within a step; others are unaffected) and G5 sglang PR #2238 / PR #1674 / #6778 (after
finishes, aborts while running and aborts while waiting, free slots == total when idle). G1
(a prompt that can never fit blocks the queue) and G2 (preemption) are S10's; here the
nearest case, a prompt that fills the context, finishes on arrival and blocks nobody.
"""
import numpy as np
import pytest
import torch

import s03_transformer as s03
from s01_generation_loop import RequestOutput
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
import s08_static_batching as s08
from s09_continuous_batching import (
    FINISH_ABORT, LLMEngine, RaggedBatch, RaggedRunner, SlotKVCache, format_occupancy_table,
    main,
)
from engine_testing import run_in_turns
from engine_testing import id_text, tiny_references
from test_s03_transformer import V, IdTokenizer

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 90]   # 90 + 8 > 96: the context stop fires mid-generation
PROMPTS = [np.random.default_rng(300 + n).integers(2, V, size=n).tolist() for n in LENGTHS]


def greedy(max_tokens=NEW, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


text = id_text


def first_difference(name, ours, reference) -> str:
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                 min(len(ours), len(reference)))
    return f"{name}: ids differ first at index {index}\n  ours: {ours}\n  ref:  {reference}"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"])
def tiny(request, tmp_path_factory):
    """(name, S06 model, {prompt index: (S05 alone, HF alone)}) for one tiny random model."""
    directory = tmp_path_factory.mktemp(f"s09_{request.param}")
    hf, model, references = tiny_references(request.param, directory, PROMPTS, CONTEXT, NEW)
    return request.param, model, references


def drive(engine, requests, arrivals, aborts=None):
    """Run requests [(prompt, params)] through add_request / step: request i is added before
    step call arrivals[i]; aborts {step call: [request index]}. Checks the scheduling
    invariants at every step. Returns ({index: outputs}, ids)."""
    aborts = aborts or {}
    ids, outputs, call = {}, {}, 0
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                ids[i] = engine.add_request(*requests[i])
        for i in aborts.get(call, []):
            if i in ids:
                engine.abort(ids[i])
        steps_before = len(engine.trace)
        waiting = {seq.request_id for seq in engine.waiting}
        waiting_before = [rid for rid in ids.values() if rid in waiting]   # by arrival
        got = engine.step()
        call += 1
        if len(engine.trace) > steps_before:
            record = engine.trace[-1]
            # No request waits while a slot is free (FIFO admission fills every slot).
            assert record.waiting == 0 or record.free_slots == 0, record
            # FIFO: the requests admitted are the oldest waiting ones, in arrival order.
            assert list(record.joined) == waiting_before[:len(record.joined)]
            # Every running request made exactly one token in this step, and no one else did.
            made = [o for o in got if o.new_token_ids]
            assert sorted(o.request_id for o in made) == sorted(record.running)
            assert all(len(o.new_token_ids) == 1 for o in made)
        index_of = {rid: i for i, rid in ids.items()}
        for o in got:
            outputs.setdefault(index_of[o.request_id], []).append(o)
        assert call < 10_000
    # Invariant 8: every slot free, nothing held, once everything finished or was aborted.
    assert engine.runner.cache.free_slots == list(range(engine.max_num_seqs))
    assert not engine.requests and not engine.running and not engine.waiting
    return outputs, ids


def tokens_of(outs):
    return [t for o in outs for t in o.new_token_ids]


# --- by hand --------------------------------------------------------------------------------

def test_slot_cache_hands_out_the_lowest_free_slot_and_refuses_a_double_free():
    cache = SlotKVCache(2, 3, 2, 8, 4)
    assert cache.k.shape == (2, 3, 2, 8, 4) and cache.num_free == 3
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="no KV slot is free"):
        cache.allocate()
    cache.free(1)
    cache.free(0)
    assert cache.free_slots == [0, 1] and cache.allocate() == 0
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        cache.free(1)
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1"):
        SlotKVCache(2, 0, 2, 8, 4)


def test_ragged_batch_metadata_by_hand():
    # A 3-token prefill in slot 2 between two decodes (slots 0 and 1, 5 and 9 cached).
    batch = RaggedBatch.build([[7], [4, 5, 6], [8]], [5, 0, 9], [0, 2, 1])
    assert batch.input_ids.tolist() == [7, 4, 5, 6, 8]
    assert batch.positions.tolist() == [5, 0, 1, 2, 9]
    assert batch.query_start_loc == [0, 1, 4, 5]
    assert batch.context_lens == [6, 3, 10]
    assert batch.query_starts() == [5, 0, 9]
    assert batch.sample_rows.tolist() == [0, 3, 4]
    assert (batch.num_tokens, batch.num_seqs) == (5, 3)
    with pytest.raises(ValueError, match="each with a new token"):
        RaggedBatch.build([[1], []], [0, 0], [0, 1])


@pytest.mark.parametrize("attention", ["masked", "loop"])
def test_ragged_forward_equals_each_request_alone(tiny, attention):
    """A mixed step (a prefill beside decodes, slots out of order) gives each request the
    logits of S06's CachedTransformer on that request alone; batch-invariant mode bitwise."""
    name, model, _ = tiny
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[1]]
    alone = []
    for i, p in enumerate(prompts):   # 0 and 2 decode their last token, 1 prefills
        runner = s06.CachedTransformer(model, CONTEXT)
        if i == 1:
            alone.append(runner.prefill(p))
        else:
            runner.prefill(p[:-1])
            alone.append(runner.decode(p[-1]))
    for invariant in (False, True):
        ragged = RaggedRunner(model, 4, CONTEXT, invariant, attention)
        # Prefill all but the last token of requests 0 and 2 first (slots 3 and 0) ...
        ragged.forward(RaggedBatch.build([prompts[0][:-1], prompts[2][:-1]], [0, 0], [3, 0]))
        # ... then their last tokens as decodes beside request 1's whole prompt (slot 1).
        logits = ragged.forward(RaggedBatch.build(
            [prompts[0][-1:], prompts[1], prompts[2][-1:]],
            [len(prompts[0]) - 1, 0, len(prompts[2]) - 1], [3, 1, 0]))
        for row, want in enumerate(alone):
            if invariant:
                assert torch.equal(logits[row], want), (name, row)
            else:
                torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-5)


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
    name, model, references = tiny
    max_num_seqs, arrivals = SCHEDULES[schedule]
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, max_num_seqs, attention=attention)
    outputs, _ = drive(engine, [(text(p), greedy()) for p in PROMPTS], arrivals)
    for i, outs in outputs.items():
        alone, hf_alone = references[i]
        got = tokens_of(outs)
        assert got == alone.token_ids, first_difference(f"{name} S05 p{i}", got,
                                                        alone.token_ids)
        assert got == hf_alone, first_difference(f"{name} HF p{i}", got, hf_alone)
        assert outs[-1].finished and outs[-1].finish_reason == alone.finish_reason
        assert "".join(o.text_delta for o in outs) == alone.text
    assert max(len(r.running) for r in engine.trace) == max_num_seqs
    if schedule == "staggered_3_slots":   # some step mixed a prefill with decodes
        assert any(r.prefill_tokens and r.num_tokens > r.prefill_tokens for r in engine.trace)


def test_two_copies_of_a_prompt_beside_a_third_do_not_attend_across(tiny):
    """Identical prompts in one batch (identical keys in two slots) next to a different one:
    the batch-invariant logits are bitwise those of each request alone, so no request read
    another's keys; the fast mode's tokens equal them."""
    name, model, references = tiny
    prompts = [text(PROMPTS[3]), text(PROMPTS[3]), text(PROMPTS[5])]

    class Recording(LLMEngine):
        def execute_model(self, batch):
            logits = super().execute_model(batch)
            self.recorded.append(dict(zip([s.request_id for s in self.running], logits)))
            return logits

    together = Recording(model, IdTokenizer(), CONTEXT, 3, batch_invariant=True)
    together.recorded = []
    _, ids = drive(together, [(p, greedy()) for p in prompts], [0, 1, 0])
    for i, prompt in enumerate(prompts):
        alone = Recording(model, IdTokenizer(), CONTEXT, 1, batch_invariant=True)
        alone.recorded = []
        alone.generate(prompt, greedy())
        mine = [step[ids[i]] for step in together.recorded if ids[i] in step]
        assert len(mine) == len(alone.recorded)
        for a, b in zip(mine, alone.recorded):
            assert torch.equal(a, b["0"]), (name, i)
    fast = LLMEngine(model, IdTokenizer(), CONTEXT, 3).generate(prompts, greedy())
    assert [c.token_ids for c in fast] == [references[3][0].token_ids] * 2 + [
        references[5][0].token_ids]


def test_fast_mode_follows_the_batch_rule_against_the_reference(tiny):
    name, model, _ = tiny
    prompts = [text(p) for p in PROMPTS]
    params = greedy(logprobs=2)
    fast = LLMEngine(model, IdTokenizer(), CONTEXT, 3).generate(prompts, params)
    ref = LLMEngine(model, IdTokenizer(), CONTEXT, 3, batch_invariant=True).generate(prompts,
                                                                                       params)
    for f, r in zip(fast, ref):
        assert s08.follows_batch_rule(f, r, s08.BATCH_TOLERANCE[torch.float32])


def test_seeded_sampling_equals_the_request_alone(tiny):
    name, model, _ = tiny
    params = [s04.SamplingParams(temperature=1.0, seed=7 + i, max_tokens=NEW, top_k=20)
              for i in range(4)]
    prompts = [text(PROMPTS[i]) for i in (0, 3, 3, 6)]
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    for invariant in (True, False):
        engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, batch_invariant=invariant)
        outputs, _ = drive(engine, list(zip(prompts, params)), [2, 0, 1, 0])
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            assert tokens_of(outputs[i]) == single.generate(prompt, p).token_ids, (name, i)


def test_generate_takes_more_prompts_than_slots_and_equals_s08(tiny):
    name, model, _ = tiny
    prompts = [text(p) for p in PROMPTS] * 2
    ours = LLMEngine(model, IdTokenizer(), CONTEXT, 3).generate(prompts, greedy())
    static = s08.Engine(model, IdTokenizer(), CONTEXT).generate(prompts, greedy())
    assert [(c.token_ids, c.text, c.finish_reason) for c in ours] == [
        (c.token_ids, c.text, c.finish_reason) for c in static]
    assert [c.request_id for c in ours] == [str(i) for i in range(len(prompts))]


def test_part_one_streams_interleaved_equal_each_alone(tiny):
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2)
    streams = [engine.stream(text(PROMPTS[i]), NEW) for i in (1, 4, 6)]
    results = run_in_turns(streams)
    for i, got in zip((1, 4, 6), results):
        assert got.token_ids == references[i][0].token_ids
    assert engine.num_free_slots == 2


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
    engine = LLMEngine(model, tokenizer, max_num_seqs=3, batch_invariant=invariant)
    outputs, ids = drive(engine, list(zip(BUNDLED_PROMPTS, params)), [0, 0, 1, 4, 4, 9])
    reasons = set()
    for i, (prompt, p) in enumerate(zip(BUNDLED_PROMPTS, params)):
        alone = single.generate(prompt, p)
        outs = outputs[i]
        assert tokens_of(outs) == alone.token_ids, prompt
        assert "".join(o.text_delta for o in outs) == alone.text
        assert not any("\ufffd" in o.text_delta for o in outs)
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (alone.finish_reason,
                                                                  alone.stop_reason)
        reasons.add(alone.finish_reason)
    assert reasons == {"stop", "length"}
    if invariant:   # logprobs: the whole Completion through S08's list call
        got = LLMEngine(model, tokenizer, max_num_seqs=3, batch_invariant=True).generate(
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
    engine = LLMEngine(model, tokenizer, max_num_seqs=4)
    outputs, _ = drive(engine, [(p, greedy(24)) for p in BUNDLED_PROMPTS], [0, 2, 2, 3, 0, 7])
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
    """vllm #24584 / PR #24586 (G4): a client that goes away mid-stream. Its request is
    aborted: its slot is free before abort returns (the next step already admits a waiting
    request into it), its last output says "abort", the tokens it streamed are a prefix of its
    output alone, and the requests beside it give exactly their outputs alone."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2)
    a = engine.add_request(text(PROMPTS[2]), greedy(30))
    b = engine.add_request(text(PROMPTS[3]), greedy())
    c = engine.add_request(text(PROMPTS[4]), greedy())    # waits: both slots are taken
    seen = {a: [], b: [], c: []}
    for _ in range(2):
        for o in engine.step():
            seen[o.request_id].append(o)
    assert engine.num_free_slots == 0 and [s.request_id for s in engine.waiting] == [c]
    assert engine.abort(a) is True
    assert engine.num_free_slots == 1                      # freed at once, not at a later step
    outs = engine.step()
    assert outs[0] == RequestOutput(a, [], "", True, FINISH_ABORT, None)
    assert engine.trace[-1].joined == (c,) and a in engine.trace[-1].left
    for o in outs[1:]:
        seen[o.request_id].append(o)
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    streamed = tokens_of(seen[a])
    assert streamed == references[2][0].token_ids[:len(streamed)] and len(streamed) == 2
    assert tokens_of(seen[b]) == references[3][0].token_ids
    assert tokens_of(seen[c]) == references[4][0].token_ids
    assert engine.num_free_slots == 2
    assert engine.abort(a) is False and engine.abort("no such id") is False


def test_closing_a_stream_aborts_its_request_and_frees_its_slot(tiny):
    """G4 through S08's stream: a caller that stops reading and closes the stream (as a
    server does on disconnect) aborts its requests; their slots are free at once."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2)
    stream = engine.stream([text(PROMPTS[2]), text(PROMPTS[3])], 30)
    next(stream)
    assert engine.num_free_slots == 0
    stream.close()
    assert engine.num_free_slots == 2 and not engine.requests
    # Each request's result is what it had streamed, ended by the abort.
    assert [(len(c.token_ids), c.finish_reason) for c in stream.result] == [(1, "abort")] * 2
    assert engine.generate(text(PROMPTS[2]), NEW).token_ids == references[2][0].token_ids


def test_no_slot_leaks_after_finishes_and_aborts_while_running_and_waiting(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): many requests, some finish, some are aborted
    while running, some while still waiting, one aborted twice: once idle, free slots ==
    total, and every request that was not aborted gives its output alone."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3)
    requests = [(text(PROMPTS[i % len(PROMPTS)]), greedy()) for i in range(12)]
    aborts = {1: [0, 9], 3: [4, 5, 11], 4: [4], 6: [2]}    # 9, 11: while waiting
    outputs, ids = drive(engine, requests, [0] * 10 + [2, 2], aborts)
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
    assert engine.num_free_slots == 3 and not engine.has_unfinished_requests()


def test_a_prompt_that_fills_the_context_finishes_on_arrival_and_blocks_nobody(tiny):
    """The nearest case here to vllm PR #1534 (G1, a request that can never be scheduled
    blocking the queue): a prompt of max_context tokens takes no slot, ends with "length"
    and no token, and the request behind it runs."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 1)
    full = engine.add_request(text([5] * CONTEXT), greedy())
    after = engine.add_request(text(PROMPTS[1]), greedy())
    assert engine.num_free_slots == 1 and full not in engine.requests
    outs = engine.step()
    assert outs[0].request_id == full and outs[0].finish_reason == "length"
    assert outs[0].new_token_ids == [] and outs[0].finished
    assert outs[1].request_id == after and engine.trace[-1].joined == (after,)


def test_bad_requests_are_refused_before_anything_is_taken(tiny):
    name, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2)
    first = engine.add_request(text(PROMPTS[1]), greedy(), request_id="a")
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        engine.add_request(text(PROMPTS[2]), greedy(), request_id="a")
    for bad_id in ("", 7):
        with pytest.raises(ValueError, match="request_id must be a non-empty string"):
            engine.add_request(text(PROMPTS[2]), greedy(), request_id=bad_id)
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        engine.add_request("", greedy())
    with pytest.raises(ValueError, match=r"prompt is 97 tokens but max_context is 96"):
        engine.add_request(text([2] * 97), greedy())
    with pytest.raises(ValueError, match=r"token ids"):
        engine.add_request(text([V + 5]), greedy())
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        engine.add_request(text(PROMPTS[1]), 0)
    with pytest.raises(ValueError, match="or a params object"):
        engine.add_request(text(PROMPTS[1]), "fast")
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.abort(3)
    assert first == "a" and list(engine.requests) == ["a"] and len(engine.waiting) == 1
    assert engine.add_request(text(PROMPTS[1])) == "0"      # no id was used by the refusals
    engine.add_request(text(PROMPTS[1]), request_id="1")
    assert engine.add_request(text(PROMPTS[1])) == "2"      # "1" is in use: skipped
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLMEngine(model, IdTokenizer(), CONTEXT, 0)
    with pytest.raises(ValueError, match="attention must be one of"):
        LLMEngine(model, IdTokenizer(), CONTEXT, 2, attention="flash")
    assert engine.step() and LLMEngine(model, IdTokenizer(), CONTEXT, 2).step() == []


def test_a_stream_holds_its_request_ids_from_the_call_until_it_ends(tiny):
    """A stream takes its ids when it is made but queues its requests only once iterated, and
    keeps them until it is exhausted: once its requests have finished (add_request is allowed
    again) a caller-chosen id may still not take one (their outputs would mix), an automatic
    id skips them, and the ids are free again once the stream ends or is closed."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4)
    stream = engine.stream([text(PROMPTS[2]), text(PROMPTS[3])], NEW)
    ids = [seq.request_id for seq in stream._seqs]
    assert not engine.requests                              # nothing queued before iterating
    while not stream.finished:
        next(stream)
    for rid in ids:
        with pytest.raises(ValueError, match=f"request_id {rid!r} is already in use"):
            engine.add_request(text(PROMPTS[1]), greedy(), request_id=rid)
    auto = engine.add_request(text(PROMPTS[1]), greedy())
    assert auto not in ids and engine.abort(auto)
    for _ in stream:
        pass
    assert engine.step() == [RequestOutput(auto, [], "", True, FINISH_ABORT, None)]
    assert [c.token_ids for c in stream.result] == [references[i][0].token_ids for i in (2, 3)]
    assert not engine.has_unfinished_requests() and engine.num_free_slots == 4
    assert engine.add_request(text(PROMPTS[1]), greedy(), request_id=ids[0]) == ids[0]
    engine.abort(ids[0])
    engine.step()
    closed = engine.stream([text(PROMPTS[2])], NEW)         # closed before it ever ran
    rid = closed._seqs[0].request_id
    closed.close()
    assert engine.add_request(text(PROMPTS[1]), greedy(), request_id=rid) == rid


def test_add_request_refuses_while_a_stream_runs_and_works_once_it_is_over(tiny):
    """A stream's steps keep only its own requests' outputs, so add_request refuses while one
    runs (from the stream call, before it is iterated too, until its requests have
    finished), naming the rule, with nothing queued and no id taken; the stream goes on
    unharmed and gives its requests' outputs alone. add_request works again once the
    stream's requests have finished (its later iterations take no step, so the new request's
    outputs stay whole), and once a stream is closed or dropped unread."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4)
    rule = ("^add_request while a stream is running: the stream's steps would take this "
            "request's outputs; finish or close the stream first$")

    def refused():
        count, queued = engine._request_count, dict(engine.requests)
        for kwargs in ({}, {"request_id": "own"}, {"request_id": "0"}):
            with pytest.raises(ValueError, match=rule):
                engine.add_request(text(PROMPTS[1]), greedy(), **kwargs)
        assert engine._request_count == count and engine.requests == queued
        return count

    def served(rid):
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        return tokens_of(outs)

    stream = engine.stream([text(PROMPTS[2]), text(PROMPTS[3])], NEW)
    count = refused()                                       # before the first step
    for _ in stream:
        if not stream.finished:
            refused()
    assert [c.token_ids for c in stream.result] == [references[i][0].token_ids for i in (2, 3)]
    assert engine.add_request(text(PROMPTS[1]), greedy()) == str(count)   # no id was taken
    assert served(str(count)) == references[1][0].token_ids
    unread = engine.stream([text(PROMPTS[2])], NEW)
    while not unread.finished:                              # finished, not yet exhausted
        next(unread)
    late = engine.add_request(text(PROMPTS[4]), greedy())
    assert list(unread) == [] and served(late) == references[4][0].token_ids
    for close in (True, False):
        # S08's list stream, closed after a step; Part I's single-prompt stream, dropped unread
        other = engine.stream([text(PROMPTS[4])] if close else text(PROMPTS[4]), NEW)
        refused()
        if close:
            next(other)
            refused()
            other.close()
        del other
        rid = engine.add_request(text(PROMPTS[1]), greedy())
        assert served(rid) == references[1][0].token_ids
    assert not engine._stream_ids and engine.num_free_slots == 4


def test_generate_and_stream_refuse_while_add_request_requests_are_unfinished(tiny):
    """generate / stream step the engine and keep only their own outputs: they refuse, with
    nothing taken, while a request queued with add_request (or its last output) is pending,
    since its outputs would be lost."""
    name, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4)
    mine = engine.add_request(text(PROMPTS[2]), greedy(), request_id="mine")
    rule = "generate\\(\\) runs the engine to the end of its own requests: 1 requests added"
    for call in (engine.generate, engine.stream):
        for prompts in (text(PROMPTS[3]), [text(PROMPTS[3])]):
            with pytest.raises(ValueError, match=rule):
                call(prompts, NEW)
    assert list(engine.requests) == [mine] and len(engine.waiting) == 1
    engine.step()
    assert engine.abort(mine)          # finished by the abort; its last output still pending
    with pytest.raises(ValueError, match=rule):
        engine.generate(text(PROMPTS[3]), NEW)
    assert engine.step()[0].finish_reason == FINISH_ABORT
    assert engine.generate(text(PROMPTS[3]), NEW).token_ids == references[3][0].token_ids
    assert engine.add_request(text(PROMPTS[1])) == "1"      # no id was used by the refusals


class NaNFor(LLMEngine):
    """Gives the running request `bad` NaN logits from its second pass on."""

    bad = None

    def execute_model(self, batch):
        logits = super().execute_model(batch)
        for i, seq in enumerate(self.running):
            if seq.request_id == self.bad and seq.stats.passes >= 1:
                logits = logits.clone()
                logits[i] = float("nan")
        return logits


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_bad_row_names_its_request_and_generate_cleans_up_after_it(tiny, seeded):
    """One row S04 refuses fails step() for the batch; the error names its request, so the
    caller can abort it and go on. generate() that fails aborts its own requests and leaves
    no last output behind: the engine is idle and reusable."""
    name, model, references = tiny
    params = (s04.SamplingParams(temperature=0.8, seed=3, max_tokens=NEW) if seeded
              else greedy())
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 2)
    engine.bad = "b"
    engine.add_request(text(PROMPTS[2]), params, request_id="a")
    engine.add_request(text(PROMPTS[3]), params, request_id="b")
    engine.step()
    with pytest.raises(ValueError, match="^request 'b': logits must not contain NaN or \\+inf"):
        engine.step()
    engine.abort("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_slots == 2
    engine.bad = "1"                      # generate's second request
    with pytest.raises(ValueError, match="^request '1': logits must not contain NaN"):
        engine.generate([text(PROMPTS[2]), text(PROMPTS[3])], params)
    assert not engine.has_unfinished_requests() and engine.num_free_slots == 2
    assert not engine.requests and not engine._final
    engine.bad = None
    got = engine.generate([text(PROMPTS[2]), text(PROMPTS[3])], params)
    alone = LLMEngine(model, IdTokenizer(), CONTEXT, 1)
    assert [c.token_ids for c in got] == [alone.generate(text(PROMPTS[i]), params).token_ids
                                          for i in (2, 3)]


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_seeded_requests_beside_a_failed_step_equal_themselves_alone(tiny, invariant):
    """The way past a bad row: catch the error, abort the request it names, step on. The
    seeded requests beside it (one before it in the batch, one after, one with a penalty
    history) give exactly their completions alone on S06's engine: the failed step drew
    their random numbers on the device, and S08's `sample_batch` put their generators back."""
    name, model, _ = tiny
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 3, batch_invariant=invariant)
    engine.bad = "b"
    requests = {
        "a": (2, s04.SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.4,
                                    max_tokens=NEW)),
        "b": (3, s04.SamplingParams(temperature=0.8, seed=3, max_tokens=NEW)),
        "c": (4, s04.SamplingParams(temperature=1.1, top_p=0.9, seed=12, max_tokens=NEW))}
    for rid, (i, p) in requests.items():
        engine.add_request(text(PROMPTS[i]), p, request_id=rid)
    outputs, failures = {rid: [] for rid in requests}, []
    while engine.has_unfinished_requests():
        try:
            step = engine.step()
        except ValueError as err:
            failures.append(str(err))
            engine.abort("b")
            continue
        for o in step:
            outputs[o.request_id].append(o)
    assert len(failures) == 1 and failures[0].startswith("request 'b': logits must not")
    assert outputs["b"][-1].finish_reason == FINISH_ABORT and len(tokens_of(outputs["b"])) == 1
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    for rid in ("a", "c"):
        i, p = requests[rid]
        assert tokens_of(outputs[rid]) == single.generate(text(PROMPTS[i]), p).token_ids, (
            name, invariant, rid)
    assert engine.num_free_slots == 3


def test_a_failed_step_keeps_the_last_outputs_it_was_to_return(tiny):
    """A step that raises returns nothing, so the last outputs it held (an abort since the
    step before) wait for the next step instead of being lost."""
    name, model, _ = tiny
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 3)
    engine.bad = "b"
    for rid, i in (("a", 2), ("b", 3), ("x", 4)):
        engine.add_request(text(PROMPTS[i]), greedy(), request_id=rid)
    engine.step()                                     # every request's prompt: no NaN yet
    assert engine.abort("x")
    with pytest.raises(ValueError, match="request 'b'"):
        engine.step()
    engine.abort("b")
    later = [o for _ in range(3) for o in engine.step()]
    last_x = [o for o in later if o.request_id == "x"]
    assert len(last_x) == 1 and last_x[0].finished and last_x[0].finish_reason == FINISH_ABORT
    assert [o.request_id for o in later].count("b") == 1


# --- the harness, the script ------------------------------------------------------------------

@bundled
def test_main_prints_completions_and_the_occupancy_table(capsys):
    main(["--num-prompts", "4", "--max-tokens", "6", "--max-num-seqs", "2",
          "--arrival-every", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 4 and "running" in out and "joined" in out
    main(["--prompt", "Romeo.", "--prompt", "To be, or not", "--max-tokens", "3",
          "--device", "cpu"])
    out = capsys.readouterr().out
    assert "Romeo." in out and "To be, or not" in out
    for bad in (["--max-num-seqs", "0"], ["--arrival-every", "-1"], ["--prompt", ""],
                ["--threads", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(bad)
        assert exit_info.value.code == 2


def test_occupancy_table_elides_the_middle_of_a_long_trace(tiny):
    name, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2)
    engine.generate([text(p) for p in PROMPTS], greedy(30))
    table = format_occupancy_table(engine.trace, max_rows=10)
    assert len(engine.trace) > 10 and "..." in table and len(table.splitlines()) == 12
