"""Tests for chapter S11, chunked prefill (code/s11_chunked_prefill.py).

Oracles: HF `transformers` (float32, eager attention: the logits of the whole prompt and of
every decode after it, and greedy `generate` alone), the S05 engine alone (greedy ids), the S06
engine alone (whole completions: ids, text, finish_reason, stop_reason, logprobs, seeded
samples), S10's engine (with the default budget S11 must schedule exactly as it does), and
counts from the rule, worked out in the comments (a prompt of P tokens in chunks of c takes
ceil(P / c) steps; the per-step floor of a chunk under FCFS).

Exactness. A chunk is a different matmul shape from the whole prompt, so in the fast mode its
logits equal a one-shot prefill's only within float32 rounding (measured about 1e-6 on these
models; asserted allclose at S06's tolerance against HF and at 1e-5 against the one-shot
engine); greedy ids are compared with == (these models' top-2 gaps are far above that,
S08's measurement) and held to S08's `follows_batch_rule` against the batch-invariant
reference. The batch-invariant mode computes a chunked prompt again whole at its last chunk,
so its logits and completions are compared bitwise with the request alone.

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534 (a prompt that can never fit must not block the queue, chunking or not), G2 vllm
#16832 (output incomplete after recompute preemption: here the recompute is chunked), G4 vllm
#24584 / PR #24586 (a client that goes away mid-stream kept its request and KV: here its stream
is closed while its prompt is part-way in), G5 sglang PR #2238 / PR #1674 / #6778 (aborted
requests leaked KV: here aborted mid-chunk). Section (h)'s
H3 (tenstorrent/vllm #415: a prefill resuming at num_computed_tokens = k > 0 must use the
right positions, attend to the cached prefix and write its KV from k on) is the chunk-size
test: every chunk after the first is such a prefill.
"""
import math
import re
from dataclasses import fields

import numpy as np
import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
import s08_static_batching as s08
import s10_engine as s10
from s11_chunked_prefill import (DECODE, PREFILL, ChunkedScheduler, LLMEngine, StepRecord,
                                 format_chunk_table, main)
from engine_testing import SampledLogits, id_text, nan_for, tiny_references
from test_s03_transformer import V, IdTokenizer
from test_s10_scheduler import FakeModel, Req

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 88]
PROMPTS = [np.random.default_rng(500 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
TIGHT = 100     # >= 95, the most KV any request here needs, far below their sum


def greedy(max_tokens=NEW, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


text = id_text


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"])
def tiny(request, tmp_path_factory):
    """(name, HF model, S06 model, {prompt index: (S05 alone, HF alone)})."""
    directory = tmp_path_factory.mktemp(f"s11_{request.param}")
    hf, model, references = tiny_references(request.param, directory, PROMPTS, CONTEXT, NEW)
    return request.param, hf, model, references


class Recording(SampledLogits, LLMEngine):
    """Keeps a copy of the logits of every row that sampled, per request."""


def drive(engine, requests, arrivals, aborts=None, check=None):
    """Run [(prompt, params)] through add_request / step (request i added before step call
    arrivals[i]; aborts {call: [index]}), checking budgets, KV accounting and the sampling
    rule at every step; check(engine, call) runs after each step. Returns ({index: outputs},
    ids)."""
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
        out = engine.scheduler_output
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert sched.kv.num_used_tokens == sum(s.num_computed_tokens for s in engine.running)
        made = {o.request_id for o in got if o.new_token_ids}
        if len(engine.trace) > before and engine.trace[-1].running:
            # a token comes exactly for the rows whose new tokens reached their end
            assert made == set(out.sample_ids)
        index_of = {rid: i for i, rid in ids.items()}
        for o in got:
            outputs.setdefault(index_of[o.request_id], []).append(o)
        if check is not None:
            check(engine, call)
        call += 1
        assert call < 10_000
    assert engine.runner.cache.free_slots == list(range(engine.max_num_seqs))
    assert engine.kv_free_tokens == engine.kv_capacity and not sched.kv.held
    assert not engine.requests and not engine.running and not engine.waiting
    return outputs, ids


def tokens_of(outs):
    return [t for o in outs for t in o.new_token_ids]


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()     # (T, V)


# --- a chunked prefill is a prefill -----------------------------------------------------------

@pytest.mark.parametrize("how", ["threshold", "budget"])
def test_chunked_prefill_logits_equal_a_one_shot_prefill(tiny, how):
    """Chunk sizes 1, P - 1, P, P + 1 (P = 50), set by the per-request threshold or by the
    token budget: the logits after the prompt, and after each of the next tokens, allclose to
    HF's for the whole context (the chunks wrote the right KV at the right positions) and to
    a one-shot prefill's; bitwise the one-shot's in batch-invariant mode. The first token
    comes after ceil(P / c) steps, and no step before it samples."""
    name, hf, model, _ = tiny
    ids = PROMPTS[5]
    P = len(ids)
    for invariant in (False, True):
        one = Recording(model, IdTokenizer(), CONTEXT, 1, batch_invariant=invariant)
        one.generate(text(ids), greedy(4))
        (ref_rows,) = one.logits.values()
        for c in (1, P - 1, P, P + 1):
            kw = (dict(long_prefill_token_threshold=c) if how == "threshold"
                  else dict(max_num_batched_tokens=c))
            eng = Recording(model, IdTokenizer(), CONTEXT, 1, batch_invariant=invariant, **kw)
            done = eng.generate(text(ids), greedy(4))
            (rows,) = eng.logits.values()
            steps = math.ceil(P / c)
            assert [r.sampled for r in eng.trace[:steps]] == [()] * (steps - 1) + [("0",)]
            assert [r.num_scheduled_tokens[0] for r in eng.trace[:steps]] == [
                min(c, P - k * c) for k in range(steps)]
            expected = hf_logits(hf, ids + done.token_ids)[P - 1:P - 1 + len(rows)]
            np.testing.assert_allclose(torch.stack(rows).numpy(), expected.numpy(),
                                       rtol=1e-4, atol=2e-5, err_msg=f"{name} c={c}")
            for got, want in zip(rows, ref_rows):
                if invariant:
                    assert torch.equal(got, want), (name, c)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert done.token_ids == one.generate(text(ids), greedy(4)).token_ids


# --- outputs under chunking --------------------------------------------------------------------

@pytest.mark.parametrize("budget,threshold", [(3, 0), (8, 0), (24, 5), (96, 16)])
def test_greedy_outputs_equal_s05_and_hf_alone_under_chunking(tiny, budget, threshold):
    """Eight prompts of 1 to 88 tokens arriving staggered, three seats, budgets from 3 tokens
    (every prompt chunked) up: every request's greedy ids equal S05's and HF's alone."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=budget,
                       long_prefill_token_threshold=threshold)
    requests = [(text(p), greedy()) for p in PROMPTS]
    outs, _ = drive(engine, requests, [0, 0, 1, 2, 4, 5, 9, 10])
    chunked = {rid for r in engine.trace for rid, n, t, s in zip(
        r.running, r.num_scheduled_tokens, r.request_num_tokens, r.num_computed_tokens)
        if s + n < t}
    assert chunked, "nothing was chunked"
    for i in range(len(PROMPTS)):
        assert tokens_of(outs[i]) == references[i][0].token_ids == references[i][1], (name, i)
        assert outs[i][-1].finish_reason == references[i][0].finish_reason


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_seeded_and_whole_completions_equal_the_request_alone(tiny, invariant):
    """Greedy with logprobs and seeded sampling, alternating, chunked by a budget of 6 and a
    threshold of 4, with a tight KV capacity (preemptions, chunked recomputes): bitwise the S06
    engine alone in batch-invariant mode (ids, text, finish_reason, logprobs); in the fast mode
    equal ids and S08's rule against the reference."""
    name, hf, model, references = tiny
    params = [greedy(logprobs=2) if i % 2 == 0 else
              s04.SamplingParams(temperature=1.0, seed=7 + i, top_k=20, max_tokens=NEW)
              for i in range(len(PROMPTS))]
    prompts = [text(p) for p in PROMPTS]
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4, batch_invariant=invariant,
                       max_num_batched_tokens=6, long_prefill_token_threshold=4,
                       kv_capacity=TIGHT)
    got = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
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
                assert c.token_ids == references[i][0].token_ids
                assert s08.follows_batch_rule(c, alone, s08.BATCH_TOLERANCE[torch.float32])
    for record in engine.trace:
        assert isinstance(record, StepRecord)
        assert record.num_tokens == sum(record.num_scheduled_tokens) <= 6
        assert all(n <= 4 for n in record.num_scheduled_tokens)


def test_the_default_engine_schedules_exactly_as_s10(tiny):
    """With S10's default budget nothing is chunked: S10's trace, field by field."""
    name, hf, model, _ = tiny
    requests = [(text(PROMPTS[k]), greedy()) for k in (4, 5, 3, 6, 2, 7, 1, 0)]
    arrivals = [0] * 8
    ours = LLMEngine(model, IdTokenizer(), CONTEXT, 4, kv_capacity=TIGHT)
    theirs = s10.LLMEngine(model, IdTokenizer(), CONTEXT, 4, kv_capacity=TIGHT)
    outs, _ = drive(ours, requests, arrivals)
    ids, theirs_outs, call = {}, {}, 0
    while len(ids) < len(requests) or theirs.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call:
                ids[i] = theirs.add_request(*requests[i])
        for o in theirs.step():
            theirs_outs.setdefault(o.request_id, []).append(o)
        call += 1
    keys = [f.name for f in fields(s10.StepRecord) if f.name not in ("model_s", "step_s")]
    assert [[getattr(r, k) for k in keys] for r in ours.trace] == [
        [getattr(r, k) for k in keys] for r in theirs.trace]
    assert {ids[i]: o for i, o in outs.items()} == theirs_outs
    assert theirs.scheduler.num_preemptions > 0


def test_the_loop_attention_gives_s05s_greedy_tokens_under_chunking(tiny):
    """S09's attention="loop" (each row attends on its own, from its first new position)
    under chunks of at most 5 tokens in a budget of 7, prompts arriving staggered: every
    request's greedy ids equal S05's alone."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, attention="loop",
                       max_num_batched_tokens=7, long_prefill_token_threshold=5)
    outs, _ = drive(engine, [(text(p), greedy()) for p in PROMPTS], [0, 0, 1, 2, 4, 5, 9, 10])
    assert any(len(r.sampled) < len(r.running) for r in engine.trace), "nothing was chunked"
    for i in range(len(PROMPTS)):
        assert tokens_of(outs[i]) == references[i][0].token_ids, (name, i)


def test_a_stream_under_chunking_joins_to_generates_text(tiny):
    """engine.stream with prompts chunked (budget 6, at most 4 tokens a request, 3 seats):
    each request's text deltas, joined, are generate's text for it on a fresh engine of the
    same settings, and its token ids are generate's too."""
    name, hf, model, _ = tiny
    prompts = [text(p) for p in PROMPTS]

    def engine():
        return LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=6,
                         long_prefill_token_threshold=4)

    streamed = engine()
    deltas, ids = {}, {}
    for step_outputs in streamed.stream(prompts, greedy()):
        for o in step_outputs:
            deltas.setdefault(o.request_id, []).append(o.text_delta)
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert any(len(r.sampled) < len(r.running) for r in streamed.trace), "nothing was chunked"
    for i, c in enumerate(engine().generate(prompts, greedy())):
        assert "".join(deltas[str(i)]) == c.text and ids[str(i)] == c.token_ids, (name, i)


# --- neither side starves ----------------------------------------------------------------------

def test_decodes_advance_in_every_step_while_a_long_prompt_is_chunked(tiny):
    """Three requests decoding, then an 80-token prompt arrives under a budget of 8: in every
    step until its prompt is in, each of the three makes a token, and the long prompt gets the
    5 tokens they leave (8 - 3), so its first token comes ceil(80 / 5) = 16 steps after it
    joined. S10 (a budget that must hold the context) runs the 80 tokens in one step with
    theirs: the stall chunking removes."""
    name, hf, model, references = tiny
    short = [(text(PROMPTS[k]), greedy(40, ignore_eos=True)) for k in (0, 1, 2)]
    long = (text(PROMPTS[6]), greedy())
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=8)
    rids = [engine.add_request(*r) for r in short]
    for _ in range(3):                           # all three prefilled and decoding
        engine.step()
    lid = engine.add_request(*long)
    got = {rid: [] for rid in rids + [lid]}
    steps = 0
    while not any(o.new_token_ids for o in got[lid]):
        outs = engine.step()
        steps += 1
        for o in outs:
            got[o.request_id].append(o)
        record = engine.trace[-1]
        k = record.running.index(lid)
        assert record.kinds[k] == PREFILL and record.num_scheduled_tokens[k] == 5
        for rid in rids:
            assert record.kinds[record.running.index(rid)] == DECODE
            assert [len(o.new_token_ids) for o in outs if o.request_id == rid] == [1]
    assert steps == math.ceil(80 / 5)
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].append(o)
    assert tokens_of(got[lid]) == references[6][0].token_ids
    # S10, no chunking: the long prompt's step carries all 80 of its tokens beside the decodes
    s10_engine = s10.LLMEngine(model, IdTokenizer(), CONTEXT, 4)
    for r in short:
        s10_engine.add_request(*r)
    for _ in range(3):
        s10_engine.step()
    s10_engine.add_request(*long)
    s10_engine.step()
    assert s10_engine.trace[-1].num_tokens == 80 + 3


@pytest.mark.parametrize("threshold", [0, 6])
def test_a_long_prompt_keeps_advancing_under_a_steady_stream_of_short_requests(tiny, threshold):
    """One short request arrives before every step (FCFS, 3 seats, budget 8). Once the
    88-token prompt is admitted, its computed tokens grow in every step until its prompt is
    in; without a threshold everyone ahead of it decodes (one token each, at most 2 of them),
    so it gains at least 8 - 2 = 6 tokens per step and samples within ceil(88 / 6) = 15 steps;
    with a threshold of 6 it gains exactly 6 while 6 are left for it (nobody ahead of it takes
    more than it did when it was admitted behind them) and needs the same 15 steps."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=8,
                       long_prefill_token_threshold=threshold)
    stream = [PROMPTS[k] for k in (1, 2, 0, 3)] * 10
    lid, joined, progress, outs = None, None, [], {}
    for call in range(400):
        if call < len(stream):
            engine.add_request(text(stream[call]), greedy(4))
        if call == 2:
            lid = engine.add_request(text(PROMPTS[7]), greedy())
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        record = engine.trace[-1]
        if lid in record.joined:
            joined = record.step
        if lid in record.running:
            k = record.running.index(lid)
            if record.kinds[k] == PREFILL:
                progress.append(record.num_computed_tokens[k] + record.num_scheduled_tokens[k])
    assert joined is not None and len(progress) <= 15 and progress[-1] == 88
    assert all(b > a for a, b in zip(progress, progress[1:]))
    assert tokens_of(outs[lid]) == references[7][0].token_ids
    assert not engine.has_unfinished_requests()


# --- public bugs -------------------------------------------------------------------------------

def test_g2_a_chunked_recompute_after_preemption_loses_no_token(tiny):
    """vllm #16832 (G2): output incomplete after recompute preemption. Under a tight capacity
    and a budget of 6, preempted requests resume and recompute prompt + outputs in chunks over
    several steps; every output equals the run without preemption and S05 alone, the same
    length and finish_reason."""
    name, hf, model, references = tiny
    order = [4, 5, 3, 6, 2, 7, 1, 0]
    requests = [(text(PROMPTS[k]), greedy()) for k in order]
    tight = LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=6,
                      kv_capacity=TIGHT)
    free = LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=6)
    outs_tight, ids = drive(tight, requests, [0] * 8)
    outs_free, _ = drive(free, requests, [0] * 8)
    assert free.scheduler.num_preemptions == 0 < tight.scheduler.num_preemptions
    # a resumed request whose recompute (prompt + outputs) spans several steps
    pieces = {}
    for r in tight.trace:
        for rid, kind, start, n, total in zip(r.running, r.kinds, r.num_computed_tokens,
                                              r.num_scheduled_tokens, r.request_num_tokens):
            seq_prompt = len(PROMPTS[order[int(rid)]])
            if kind == PREFILL and total > seq_prompt:        # a recompute with outputs
                pieces.setdefault((rid, total), []).append((start, n))
    assert any(len(p) > 1 for p in pieces.values()), "no recompute was chunked"
    for p in pieces.values():
        assert p[0][0] == 0 and all(a + m == b for (a, m), (b, _) in zip(p, p[1:]))
    for i, k in enumerate(order):
        assert tokens_of(outs_tight[i]) == tokens_of(outs_free[i]) == references[k][0].token_ids
        assert outs_tight[i][-1].finish_reason == references[k][0].finish_reason


def test_g4_closing_a_stream_mid_chunk_frees_its_kv_and_slot_within_the_step(tiny):
    """vllm #24584 / PR #24586 (G4): a client that disconnects mid-stream kept its request
    running and its KV held. Budget 8: in the first step the 3-token prompt runs whole and
    samples, the 80-token one gets a chunk of 5. The stream is closed there, its second
    request part-way through its prompt: before close returns (no step in between) both
    requests are gone, every slot and KV token is free, and the engine serves the next
    request (chunked) as it would alone."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8,
                       kv_capacity=TIGHT)
    stream = engine.stream([text(PROMPTS[1]), text(PROMPTS[6])], 30)
    first = next(stream)
    assert [o.request_id for o in first if o.new_token_ids] == ["0"]
    long = engine.requests["1"]
    assert 0 < long.num_computed_tokens == 5 < len(long.prompt_ids)       # mid-chunk
    assert engine.kv_free_tokens == TIGHT - 5 - 3
    steps = len(engine.trace)
    stream.close()
    assert len(engine.trace) == steps
    assert engine.kv_free_tokens == TIGHT and engine.num_free_slots == 2
    assert not engine.scheduler.kv.held and not engine.requests
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.generate(text(PROMPTS[5]), NEW).token_ids == references[5][0].token_ids
    assert engine.kv_free_tokens == TIGHT and engine.num_free_slots == 2


def test_g5_idle_means_every_kv_token_is_free_after_aborts_mid_chunk(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted and completed requests leaked KV. Long
    prompts chunked 4 tokens a step; some aborted part-way through their prefill (holding KV
    for a few chunks), one while waiting, one twice: once idle every KV token and slot is
    free (checked by `drive`) and the others give their outputs alone."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=4,
                       kv_capacity=TIGHT)
    chosen = [6, 5, 7, 4, 3, 2]
    requests = [(text(PROMPTS[k]), greedy()) for k in chosen]
    mid_chunk = []

    def check(engine, call):
        for seq in engine.running:
            if 0 < seq.num_computed_tokens < len(seq.prompt_ids):
                mid_chunk.append((call, seq.request_id))

    aborts = {3: [0], 5: [5], 6: [1, 1], 12: [2]}
    outputs, ids = drive(engine, requests, [0, 0, 0, 1, 1, 2], aborts, check)
    held_mid = {rid for call, rid in mid_chunk if call + 1 in aborts
                and rid in {ids[i] for i in aborts[call + 1]}}
    assert {ids[0], ids[2]} <= held_mid, "the aborts did not land mid-chunk"
    for i, outs in outputs.items():
        want = references[chosen[i]][0].token_ids
        if outs[-1].finish_reason == "abort":
            assert tokens_of(outs) == want[:len(tokens_of(outs))] and i in aborts_of(aborts)
        else:
            assert tokens_of(outs) == want


def aborts_of(aborts):
    return {i for ids in aborts.values() for i in ids}


def test_g1_a_prompt_longer_than_the_capacity_is_refused_though_it_could_be_chunked(tiny):
    """vllm PR #1534 (G1): a prompt needing more KV than the whole pool blocked the queue.
    Chunking does not lift the rule (its last chunk needs KV for the whole prompt): refused,
    nothing queued, and the others finish. A prompt longer than the budget is accepted now
    (S10 refuses such a budget at construction)."""
    name, hf, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8,
                       kv_capacity=40)
    first = engine.add_request(text(PROMPTS[3]), greedy())
    with pytest.raises(ValueError, match="prompt is 50 tokens but kv_capacity is 40 tokens: "
                                         "it could never be scheduled"):
        engine.add_request(text(PROMPTS[5]), greedy())
    last = engine.add_request(text(PROMPTS[4]), greedy())       # 31 tokens > the budget of 8
    seen = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    assert tokens_of(seen[first]) == references[3][0].token_ids
    assert tokens_of(seen[last]) == references[4][0].token_ids
    assert engine.kv_free_tokens == 40
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= "
                                         r"max_model_len \(96\)"):
        s10.LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8)


NaNFor = nan_for(LLMEngine)   # request `bad`: NaN logits from its second token on


def test_a_failed_step_mid_chunk_gives_back_the_chunks_kv_and_the_engine_goes_on(tiny):
    """A row S04 refuses fails step() while another request is part-way through its prompt:
    S09's error names the bad request (not the chunk's row, whose logits are never read), the
    KV the step allocated goes back (the chunk is computed again), and after the abort the
    other request's output equals its output alone; every token is free."""
    name, hf, model, references = tiny
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8)
    engine.bad = "b"
    engine.add_request(text(PROMPTS[2]), greedy(), request_id="b")       # 7 tokens
    engine.step()                                                         # b's prompt, 1 token
    engine.add_request(text(PROMPTS[5]), greedy(), request_id="a")       # 50 tokens
    with pytest.raises(ValueError, match="^request 'b': logits must not contain NaN"):
        engine.step()                        # b decodes (NaN), a's first chunk of 7
    sched = engine.scheduler
    assert engine.requests["a"].num_computed_tokens == 0 == sched.kv.num_tokens("a")
    assert all(sched.kv.num_tokens(s.request_id) == s.num_computed_tokens
               for s in engine.running)
    engine.abort("b")
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "a"]
    assert tokens_of(seen) == references[5][0].token_ids
    assert engine.kv_free_tokens == engine.kv_capacity and engine.num_free_slots == 2


# --- errors, the scheduler alone, the table ----------------------------------------------------

def test_bad_arguments_are_refused_naming_the_rule(tiny):
    name, hf, model, _ = tiny
    for bad in (-1, 1.5, True, None, "8"):
        with pytest.raises(ValueError, match=r"^long_prefill_token_threshold must be an "
                                             r"integer >= 0, 0 for no limit"):
            LLMEngine(model, IdTokenizer(), CONTEXT, 2, long_prefill_token_threshold=bad)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must be >= "
                                         r"max_num_seqs \(4\): a step must hold one decode"):
        LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        ChunkedScheduler(2, 0, 10, 10)
    assert LLMEngine(model, IdTokenizer(), CONTEXT, 4, max_num_batched_tokens=4) is not None


def test_table_marks_prefill_pieces_their_progress_and_the_rows_that_sampled(tiny):
    name, hf, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=20)
    engine.generate([text(PROMPTS[5]), text(PROMPTS[2])], greedy(3))
    lines = format_chunk_table(engine.trace).splitlines()
    # 50 and 7 tokens in budgets of 20: 20, 20, then the last 10 of the first with the second's 7
    assert lines[1].split() == ["0", "20/20", "0:20p", "20/50"]
    assert lines[2].split() == ["1", "20/20", "0:20p", "40/50"]
    assert lines[3].split() == ["2", "17/20", "0:10p", "50/50*", "1:7p", "7/7*"]
    assert lines[4].split() == ["3", "2/20", "0:1*", "1:1*"]
    assert len(format_chunk_table(engine.trace, max_rows=2).splitlines()) == 4
    with pytest.raises(ValueError, match=r"^max_rows must be an integer >= 2"):
        format_chunk_table(engine.trace, max_rows=1)


def test_the_piece_that_completes_a_chunked_recompute_is_a_prefill_piece():
    """A request stays a prefill piece from its admission (or resumption) until the step it
    samples, whatever the piece's size. Two seats, budget 4, KV capacity 7 (S10's fake model):
    a (2 prompt tokens, 6 outputs) and b (4) take 2 + 2 in step 0 (a samples), 1 + 2 in
    step 1 (b samples): 3 + 4 = 7 tokens held, so in step 2 a's next token preempts b (the
    latest admitted). b waits until a ends (step 5), then recomputes its 4 prompt tokens and
    1 output in pieces of 4 (step 6) and 1 (step 7): that last 1-token piece is an output, as
    a decode's is, but it completes the recompute and samples, as a prompt's last chunk
    does: "prefill". a's pieces after its first are decodes."""
    s = ChunkedScheduler(2, 4, 7, 40)
    model = FakeModel(s)
    model.add(Req("a", 2, 6))
    model.add(Req("b", 4, 6))
    outs = [model.step() for _ in range(8)]
    assert [dict(o.num_scheduled_tokens) for o in outs] == [
        {"a": 2, "b": 2}, {"a": 1, "b": 2}, {"a": 1}, {"a": 1}, {"a": 1}, {"a": 1},
        {"b": 4}, {"b": 1}]
    assert outs[2].preempted_ids == ("b",) and outs[6].scheduled_resumed_ids == ("b",)
    assert (outs[7].num_computed_tokens["b"], outs[7].request_num_tokens["b"]) == (4, 5)
    assert [o.prefill_ids for o in outs] == [("a", "b"), ("b",), (), (), (), (), ("b",),
                                             ("b",)]
    assert [o.sample_ids for o in outs] == [("a",), ("a", "b"), ("a",), ("a",), ("a",),
                                            ("a",), (), ("b",)]


# --- the bundled model -------------------------------------------------------------------------

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet "
                                    "(scripts/train_bundled_model.py)")

BUNDLED_PROMPTS = ["Rom.\nBut soft! what light through yonder window breaks?", "O",
                   "Ham.\nTo be, or not to be, that is the question:", "First Citizen.\n",
                   "Hello world,", "How are you, my lord?\n"]


@bundled
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_bundled_whole_completions_survive_chunking(invariant):
    """Stop ids, stop strings, min_tokens, penalties, seeded sampling and logprobs (S10's
    mix) in chunks of at most 5 tokens and a budget of 8 (three seats): every completion
    equals the S06 engine's alone (logprobs bitwise in the invariant mode), and the greedy one
    equals S05 alone."""
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
                       max_num_batched_tokens=8, long_prefill_token_threshold=5)
    got = engine.generate(BUNDLED_PROMPTS, params)
    assert any(len(r.sampled) < len(r.running) for r in engine.trace)    # chunks happened
    for c, prompt, p in zip(got, BUNDLED_PROMPTS, params):
        alone = single.generate(prompt, p)
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason), prompt
        if invariant:
            assert c.logprobs == alone.logprobs
    numpy_model = s03.Transformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    s05_alone = s05.Engine(numpy_model, tokenizer, engine.max_context).generate(
        BUNDLED_PROMPTS[0], greedy(30))
    assert got[0].token_ids == s05_alone.token_ids


@bundled
def test_main_prints_the_chunks_and_refuses_bad_flags(capsys):
    main(["--num-prompts", "4", "--max-tokens", "6", "--max-num-batched-tokens", "16",
          "--long-prefill-token-threshold", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 4 and "first token in step" in out
    assert "16 tokens per step, at most 8 per request" in out
    assert "8p " in out and "*" in out
    for argv, rule in ((["--max-num-batched-tokens", "2"], "max_num_batched_tokens (2) must be "
                        ">= max_num_seqs (4)"),
                       (["--long-prefill-token-threshold", "-1"],
                        "long_prefill_token_threshold must be an integer >= 0"),
                       (["--max-context", "0"], "--max-context must be >= 1 (got 0)"),
                       (["--priorities", "1,0"], "--priorities needs --policy priority"),
                       (["--policy", "priority", "--priorities", "1,0", "--num-prompts", "3"],
                        "--priorities needs one value per request (3)"),
                       (["--priorities", "a"], "--priorities needs comma-separated integers")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--device", "cpu"])
        assert exit_info.value.code == 2, argv
        assert rule in capsys.readouterr().err, argv
    # the default budget follows the seats: max(16, max_num_seqs), never below the rule
    main(["--num-prompts", "3", "--max-tokens", "2", "--max-num-seqs", "20", "--device", "cpu"])
    assert "at most 20 running, context 256, 20 tokens per step" in capsys.readouterr().out
    # priorities: with all three queued at once and one seat, the lowest value runs first
    main(["--num-prompts", "3", "--max-tokens", "2", "--max-num-seqs", "1", "--arrival-every",
          "0", "--policy", "priority", "--priorities", "2,0,1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "policy priority" in out
    first = {rid: int(step) for rid, step in
             re.findall(r"--- request (\d+): prompt \(\d+ tokens\), first token in step (\d+)",
                        out)}
    assert first["1"] < first["2"] < first["0"], first


# --- the chapter's figure ---------------------------------------------------------------------

def test_the_figure_is_the_benchmarks_json_drawn_with_its_legend_off_the_data():
    """chapters/figures/s11_chunked_prefill.png is scripts/s11_figure.py's drawing of the
    committed benchmark figures (chapters/figures/s11_chunked_prefill.json): chunking off and
    every budget, each the median of its repeats; no legend covers data."""
    import json
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    from legend_check import covered_by_legends, describe
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import s11_figure
    figures = json.loads(s11_figure.DATA.read_text())
    found = covered_by_legends(s11_figure.build_figure(figures))
    assert not found, describe(found)
    config = figures["config"]
    assert [s["budget"] for s in figures["summary"]] == ["off"] + config["budgets"]
    for s in figures["summary"]:
        mine = [r for r in figures["runs"] if r["budget"] == s["budget"]]
        assert len(mine) == s["repeats"] == config["repeats"]
        assert s["itl"]["max_ms"] == statistics.median(r["itl"]["max_ms"] for r in mine)
    done = subprocess.run([sys.executable, str(root / "scripts" / "s11_figure.py"), "--check"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
