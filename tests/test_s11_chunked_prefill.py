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

The engine is S09's, built by `s11.build_engine`; the steps are read from S09's `StepTracer`,
the logits from a `LogitsRecorder` around the runner, and failures are injected by runner
wrappers (tests/engine_testing.py).

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534 (a prompt that can never fit must not block the queue, chunking or not), G2 vllm
#16832 (output incomplete after recompute preemption: here the recompute is chunked), G4 vllm
#24584 (a report that a request kept generating after its streaming client went away; PR #24586,
an abort added in the API server, was closed without being merged, and in PR #32442 a maintainer
answered that AsyncLLM's generate already aborts a request whose consumer goes away: here the
stream is closed while its prompt is part-way in, and the request must be gone at once), G5
sglang PR #2238 / PR #1674 / #6778 (aborted requests leaked KV: here aborted mid-chunk).
Section (h)'s
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
import s05_kv_cache as s05
import s06_torch as s06
import s10_scheduler as s10
import s11_chunked_prefill as s11
from engine_testing import (FailingRunner, LogitsRecorder, NaNRows, drive, greedy, id_text,
                            tiny_fixture, tokens_of)
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s04_sampling import SamplingParams
from s08_batch_variance import BATCH_TOLERANCE, follows_batch_rule
from s09_llm import LLM
from s09_trace import DECODE, PREFILL, StepRecord, StepTracer, trace
from scheduler_testing import ObservedFakeModel, chunked_scheduler, make_request

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 88]
PROMPTS = [np.random.default_rng(500 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
TIGHT = 100     # >= 95, the most KV any request here needs, far below their sum

text = id_text
tiny = tiny_fixture("s11", ["gpt2", "qwen3_gqa_tied", "llama_gqa_rope_scaling"], PROMPTS,
                    CONTEXT, NEW)


def build(model, max_num_seqs, **options):
    """S11's engine on a tiny model (IdTokenizer, context CONTEXT)."""
    return s11.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=max_num_seqs,
                            **options)


def recording(model, max_num_seqs, **options):
    """S11's engine with a `LogitsRecorder` around its runner (`engine.runner.logits`)."""
    engine = build(model, max_num_seqs, **options)
    engine.runner = LogitsRecorder(engine.runner)
    return engine


def chunk_checks(engine):
    """A `StepTracer` on the engine, and the check `drive` runs after every step: the
    budget; KV accounting (the pool holds exactly the running requests' computed tokens); a
    token comes exactly for the rows whose new tokens reach the end of their token_ids (the
    record's `sampled`, the step's outputs), and a step that planned nothing makes none.
    Returns (tracer, check)."""
    tracer = trace(engine)
    seen = [0]

    def check(engine, call, outputs):
        s = engine.scheduler
        assert s.kv.num_used_tokens == sum(r.num_computed_tokens for r in s.running)
        made = {o.request_id for o in outputs if o.new_token_ids}
        if len(tracer.records) == seen[0]:
            assert not made
            return
        seen[0] = len(tracer.records)
        r = tracer.records[-1]
        assert r.num_tokens == sum(r.num_scheduled_tokens) <= s.max_num_batched_tokens
        reached = {rid for rid, n, start, total in zip(r.running, r.num_scheduled_tokens,
                                                       r.num_computed_tokens,
                                                       r.request_num_tokens)
                   if start + n == total}
        assert set(r.sampled) == reached == made

    return tracer, check


def run(engine, requests, arrivals, aborts=None, check=None):
    """`drive` with `chunk_checks` (and check, if given) after every step; at the end every
    KV slot is free too. Returns (outputs, ids, tracer)."""
    tracer, checks = chunk_checks(engine)

    def both(engine, call, outputs):
        checks(engine, call, outputs)
        if check is not None:
            check(engine, call, outputs)

    outputs, ids = drive(engine, requests, arrivals, aborts, both)
    kv = engine.scheduler.kv
    assert kv.free_slots == list(range(kv.num_slots)) and not kv.slots
    return outputs, ids, tracer


def chunked(records) -> bool:
    """Whether some step computed part of a request's missing tokens only."""
    return any(start + n < total for r in records for n, start, total in zip(
        r.num_scheduled_tokens, r.num_computed_tokens, r.request_num_tokens))


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
        one = recording(model, 1, batch_invariant=invariant)
        first = LLM(one).generate(text(ids), greedy(4))
        (ref_rows,) = one.runner.logits.values()
        for c in (1, P - 1, P, P + 1):
            kw = (dict(long_prefill_token_threshold=c) if how == "threshold"
                  else dict(max_num_batched_tokens=c))
            eng = recording(model, 1, batch_invariant=invariant, **kw)
            tracer = trace(eng)
            done = LLM(eng).generate(text(ids), greedy(4))
            (rows,) = eng.runner.logits.values()
            steps = math.ceil(P / c)
            records = tracer.records[:steps]
            assert [r.sampled for r in records] == [()] * (steps - 1) + [("0",)]
            assert [r.num_scheduled_tokens[0] for r in records] == [
                min(c, P - k * c) for k in range(steps)]
            expected = hf_logits(hf, ids + done.token_ids)[P - 1:P - 1 + len(rows)]
            np.testing.assert_allclose(torch.stack(rows).numpy(), expected.numpy(),
                                       rtol=1e-4, atol=2e-5, err_msg=f"{name} c={c}")
            for got, want in zip(rows, ref_rows, strict=True):
                if invariant:
                    assert torch.equal(got, want), (name, c)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert done.token_ids == first.token_ids


# --- outputs under chunking --------------------------------------------------------------------

@pytest.mark.parametrize("budget,threshold", [(3, 0), (8, 0), (24, 5), (96, 16)])
def test_greedy_outputs_equal_s05_and_hf_alone_under_chunking(tiny, budget, threshold):
    """Eight prompts of 1 to 88 tokens arriving staggered, three seats, budgets from 3 tokens
    (every prompt chunked) up: every request's greedy ids equal S05's and HF's alone."""
    name, hf, model, references = tiny
    engine = build(model, 3, max_num_batched_tokens=budget,
                   long_prefill_token_threshold=threshold)
    outs, _, tracer = run(engine, [(p, greedy()) for p in PROMPTS], [0, 0, 1, 2, 4, 5, 9, 10])
    assert chunked(tracer.records), "nothing was chunked"
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
              SamplingParams(temperature=1.0, seed=7 + i, top_k=20, max_tokens=NEW)
              for i in range(len(PROMPTS))]
    prompts = [text(p) for p in PROMPTS]
    engine = build(model, 4, batch_invariant=invariant, max_num_batched_tokens=6,
                   long_prefill_token_threshold=4, kv_capacity=TIGHT)
    tracer = trace(engine)
    got = LLM(engine).generate(prompts, params)
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
                assert follows_batch_rule(c, alone, BATCH_TOLERANCE[torch.float32])
    assert tracer.records
    for record in tracer.records:
        assert isinstance(record, StepRecord)
        assert record.num_tokens == sum(record.num_scheduled_tokens) <= 6
        assert all(n <= 4 for n in record.num_scheduled_tokens)


def test_the_default_engine_schedules_exactly_as_s10(tiny):
    """With S10's default budget nothing is chunked: S10's trace, field by field, and the
    same outputs."""
    name, hf, model, _ = tiny
    requests = [(PROMPTS[k], greedy()) for k in (4, 5, 3, 6, 2, 7, 1, 0)]
    ours = build(model, 4, kv_capacity=TIGHT)
    theirs = s10.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=4,
                              kv_capacity=TIGHT)
    ours_outs, ours_ids, ours_trace = run(ours, requests, [0] * 8)
    theirs_trace = trace(theirs)
    theirs_outs, theirs_ids = drive(theirs, requests, [0] * 8)
    keys = [f.name for f in fields(StepRecord) if f.name not in ("model_s", "step_s")]
    assert [[getattr(r, k) for k in keys] for r in ours_trace.records] == [
        [getattr(r, k) for k in keys] for r in theirs_trace.records]
    assert ours_outs == theirs_outs and ours_ids == theirs_ids
    assert theirs.scheduler.num_preemptions > 0


def test_the_loop_attention_gives_s05s_greedy_tokens_under_chunking(tiny):
    """S09's attention="loop" (each row attends on its own, from its first new position)
    under chunks of at most 5 tokens in a budget of 7, prompts arriving staggered: every
    request's greedy ids equal S05's alone."""
    name, hf, model, references = tiny
    engine = build(model, 3, attention="loop", max_num_batched_tokens=7,
                   long_prefill_token_threshold=5)
    outs, _, tracer = run(engine, [(p, greedy()) for p in PROMPTS], [0, 0, 1, 2, 4, 5, 9, 10])
    assert any(len(r.sampled) < len(r.running) for r in tracer.records), "nothing was chunked"
    for i in range(len(PROMPTS)):
        assert tokens_of(outs[i]) == references[i][0].token_ids, (name, i)


def test_a_stream_under_chunking_joins_to_generates_text(tiny):
    """`LLM.stream` with prompts chunked (budget 6, at most 4 tokens a request, 3 seats):
    each request's text deltas, joined, are generate's text for it on a fresh engine of the
    same settings, and its token ids are generate's too, which are HF's (`references`)."""
    name, hf, model, references = tiny
    prompts = [text(p) for p in PROMPTS]

    def engine():
        return build(model, 3, max_num_batched_tokens=6, long_prefill_token_threshold=4)

    streamed = engine()
    tracer = trace(streamed)
    deltas, ids = {}, {}
    for step_outputs in LLM(streamed).stream(prompts, greedy()):
        for o in step_outputs:
            deltas.setdefault(o.request_id, []).append(o.text_delta)
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert any(len(r.sampled) < len(r.running) for r in tracer.records), "nothing was chunked"
    for i, c in enumerate(LLM(engine()).generate(prompts, greedy())):
        assert "".join(deltas[str(i)]) == c.text and ids[str(i)] == c.token_ids, (name, i)
        assert c.token_ids == references[i][0].token_ids, (name, i)


# --- neither side starves ----------------------------------------------------------------------

def test_decodes_advance_in_every_step_while_a_long_prompt_is_chunked(tiny):
    """Three requests decoding, then an 80-token prompt arrives under a budget of 8: in every
    step until its prompt is in, each of the three makes a token, and the long prompt gets the
    5 tokens they leave (8 - 3), so its first token comes ceil(80 / 5) = 16 steps after it
    joined. S10 (a budget that must hold the context) runs the 80 tokens in one step with
    theirs: the stall chunking removes."""
    name, hf, model, references = tiny
    short = [(PROMPTS[k], greedy(40, ignore_eos=True)) for k in (0, 1, 2)]
    long = (PROMPTS[6], greedy())
    engine = build(model, 4, max_num_batched_tokens=8)
    tracer = trace(engine)
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
        record = tracer.records[-1]
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
    s10_engine = s10.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=4)
    s10_trace = trace(s10_engine)
    for r in short:
        s10_engine.add_request(*r)
    for _ in range(3):
        s10_engine.step()
    s10_engine.add_request(*long)
    s10_engine.step()
    assert s10_trace.records[-1].num_tokens == 80 + 3


@pytest.mark.parametrize("threshold", [0, 6])
def test_a_long_prompt_keeps_advancing_under_a_steady_stream_of_short_requests(tiny, threshold):
    """One short request arrives before every step (FCFS, 3 seats, budget 8). Once the
    88-token prompt is admitted, its computed tokens grow in every step until its prompt is
    in; without a threshold everyone ahead of it decodes (one token each, at most 2 of them),
    so it gains at least 8 - 2 = 6 tokens per step and samples within ceil(88 / 6) = 15 steps;
    with a threshold of 6 it gains exactly 6 while 6 are left for it (nobody ahead of it takes
    more than it did when it was admitted behind them) and needs the same 15 steps."""
    name, hf, model, references = tiny
    engine = build(model, 3, max_num_batched_tokens=8, long_prefill_token_threshold=threshold)
    tracer = trace(engine)
    stream = [PROMPTS[k] for k in (1, 2, 0, 3)] * 10
    lid, joined, progress, outs = None, None, [], {}
    for call in range(400):
        if call < len(stream):
            engine.add_request(stream[call], greedy(4))
        if call == 2:
            lid = engine.add_request(PROMPTS[7], greedy())
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        record = tracer.records[-1]
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
    requests = [(PROMPTS[k], greedy()) for k in order]
    tight = build(model, 4, max_num_batched_tokens=6, kv_capacity=TIGHT)
    free = build(model, 4, max_num_batched_tokens=6)
    outs_tight, ids, tight_trace = run(tight, requests, [0] * 8)
    outs_free, _, _ = run(free, requests, [0] * 8)
    assert free.scheduler.num_preemptions == 0 < tight.scheduler.num_preemptions
    # a resumed request whose recompute (prompt + outputs) spans several steps
    index_of = {rid: i for i, rid in ids.items()}
    pieces = {}
    for r in tight_trace.records:
        for rid, kind, start, n, total in zip(r.running, r.kinds, r.num_computed_tokens,
                                              r.num_scheduled_tokens, r.request_num_tokens):
            if kind == PREFILL and total > len(PROMPTS[order[index_of[rid]]]):  # outputs too
                pieces.setdefault((rid, total), []).append((start, n))
    assert any(len(p) > 1 for p in pieces.values()), "no recompute was chunked"
    for p in pieces.values():
        assert p[0][0] == 0 and all(a + m == b for (a, m), (b, _) in zip(p, p[1:]))
    for i, k in enumerate(order):
        assert tokens_of(outs_tight[i]) == tokens_of(outs_free[i]) == references[k][0].token_ids
        assert outs_tight[i][-1].finish_reason == references[k][0].finish_reason


def test_sdpa_is_causal_is_top_left_so_a_chunk_needs_its_own_mask():
    """Why S06's `attention` builds a mask for a chunk after cached positions: PyTorch's SDPA
    with is_causal=True aligns the causal diagonal to the top-left corner (query t sees keys
    0 .. t, `torch.nn.attention.bias.causal_upper_left`), which for T < S queries hides from
    them the cached keys they must see; a chunk needs the bottom-right alignment (query t sees
    keys 0 .. S - T + t, FlashAttention's rule since 2.1). Checked on the CPU SDPA, float32."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 8, generator=gen) for t in (3, 7, 7))   # T = 3, S = 7
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ones = torch.ones(3, 7, dtype=torch.bool)
    top_left, bottom_right = ones.tril(), ones.tril(diagonal=7 - 3)
    causal = sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(causal, sdpa(q, k, v, attn_mask=top_left))
    assert not torch.allclose(causal, sdpa(q, k, v, attn_mask=bottom_right), atol=1e-3)
    for impl in s06.ATTENTION_IMPLS:          # S06's chunk path: the bottom-right rows
        chunk = s06.attention(q[0], k[0], v[0], 4, 8 ** -0.5, impl)
        torch.testing.assert_close(chunk, sdpa(q, k, v, attn_mask=bottom_right)[0])


def test_g4_closing_a_stream_mid_chunk_frees_its_kv_and_slot_within_the_step(tiny):
    """vllm #24584 (G4): reported as a request that kept running, KV held, after its
    streaming client disconnected (PR #24586 proposed an API-server abort and was closed
    unmerged; vLLM's AsyncLLM aborts on disconnect in its generate). Budget 8: in the first
    step the 3-token prompt runs whole and samples, the 80-token one gets a chunk of 5. The `LLM` stream is closed there, its second
    request part-way through its prompt: before close returns (no step in between) both
    requests are gone, every slot and KV token is free, and the engine serves the next
    request (chunked, through the same `LLM`, right away) as it would alone."""
    name, hf, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8, kv_capacity=TIGHT)
    tracer = trace(engine)
    kv = engine.scheduler.kv
    llm = LLM(engine)
    stream = llm.stream([text(PROMPTS[1]), text(PROMPTS[6])], 30)
    first = next(stream)
    assert [o.request_id for o in first if o.new_token_ids] == ["0"]
    long = engine.requests["1"]
    assert 0 < long.num_computed_tokens == 5 < len(long.prompt_ids)       # mid-chunk
    assert kv.num_free_tokens == TIGHT - 5 - 3
    steps = len(tracer.records)
    stream.close()
    assert len(tracer.records) == steps
    assert kv.num_free_tokens == TIGHT and kv.free_slots == [0, 1] and not kv.slots
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    done = llm.generate(text(PROMPTS[5]), NEW)     # right away: the LLM let its ids go
    assert done.token_ids == references[5][0].token_ids
    assert kv.num_free_tokens == TIGHT and kv.free_slots == [0, 1]
    assert not engine.has_unfinished_requests()   # the aborted ones' last outputs went too


def test_g5_idle_means_every_kv_token_is_free_after_aborts_mid_chunk(tiny):
    """sglang PR #2238 / PR #1674 / #6778 (G5): aborted and completed requests leaked KV. Long
    prompts chunked 4 tokens a step; some aborted part-way through their prefill (holding KV
    for a few chunks), one while waiting, one twice: once idle every KV token and slot is
    free (checked by `drive` and `run`) and the others give their outputs alone."""
    name, hf, model, references = tiny
    engine = build(model, 3, max_num_batched_tokens=4, kv_capacity=TIGHT)
    chosen = [6, 5, 7, 4, 3, 2]
    requests = [(PROMPTS[k], greedy()) for k in chosen]
    mid_chunk = []

    def check(engine, call, outputs):
        for request in engine.scheduler.running:
            if 0 < request.num_computed_tokens < len(request.prompt_ids):
                mid_chunk.append((call, request.request_id))

    aborts = {3: [0], 5: [5], 6: [1, 1], 12: [2]}
    outputs, ids, _ = run(engine, requests, [0, 0, 0, 1, 1, 2], aborts, check)
    held_mid = {rid for call, rid in mid_chunk if call + 1 in aborts
                and rid in {ids[i] for i in aborts[call + 1]}}
    assert {ids[0], ids[2]} <= held_mid, "the aborts did not land mid-chunk"
    aborted = {i for group in aborts.values() for i in group}
    for i, outs in outputs.items():
        want = references[chosen[i]][0].token_ids
        if outs[-1].finish_reason == "abort":
            assert tokens_of(outs) == want[:len(tokens_of(outs))] and i in aborted
        else:
            assert tokens_of(outs) == want


def test_g1_a_prompt_longer_than_the_capacity_is_refused_though_it_could_be_chunked(tiny):
    """vllm PR #1534 (G1): a prompt needing more KV than the whole pool blocked the queue.
    Chunking does not lift the rule (its last chunk needs KV for the whole prompt): refused,
    nothing queued, and the others finish. A prompt longer than the budget is accepted now
    (S10 refuses such a budget at construction)."""
    name, hf, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8, kv_capacity=40)
    first = engine.add_request(PROMPTS[3], greedy())
    with pytest.raises(ParameterError, match="prompt is 50 tokens but kv_capacity is 40 "
                                             "tokens: it could never be scheduled") as err:
        engine.add_request(PROMPTS[5], greedy())
    assert err.value.parameter == "prompt" and len(engine.scheduler.waiting) == 1
    last = engine.add_request(PROMPTS[4], greedy())         # 31 tokens > the budget of 8
    seen = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    assert tokens_of(seen[first]) == references[3][0].token_ids
    assert tokens_of(seen[last]) == references[4][0].token_ids
    assert engine.scheduler.kv.num_free_tokens == 40
    with pytest.raises(ParameterError, match=r"max_num_batched_tokens \(8\) must be >= "
                                             r"max_model_len \(96\)"):
        s10.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=2,
                         max_num_batched_tokens=8)


def test_a_failed_model_run_mid_chunk_is_reverted_and_the_engine_goes_on(tiny):
    """A model run that raises (after writing its KV) while request a is part-way into its
    prompt: `step()` raises, the plan is reverted (every request holds the KV of what it had
    computed before the step, a the chunk's none), the failed step leaves no record and its
    number is taken again; the engine goes on and both requests equal their outputs alone."""
    name, hf, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8)
    engine.runner = FailingRunner(engine.runner)
    tracer = trace(engine)
    kv = engine.scheduler.kv
    engine.add_request(PROMPTS[2], greedy(), request_id="b")       # 7 tokens
    got = {"b": engine.step()}                                     # b's prompt, 1 token
    engine.add_request(PROMPTS[5], greedy(), request_id="a")       # 50 tokens
    held = {rid: kv.num_tokens(rid) for rid in ("a", "b")}
    engine.runner.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()                        # b decodes, a's first chunk of 7: both undone
    assert {rid: kv.num_tokens(rid) for rid in ("a", "b")} == held == {"a": 0, "b": 7}
    assert engine.requests["a"].num_computed_tokens == 0
    assert engine.requests["b"].num_computed_tokens == 7
    assert kv.num_used_tokens == 7 and len(tracer.records) == 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert [r.step for r in tracer.records] == list(range(len(tracer.records)))
    assert tokens_of(got["a"]) == references[5][0].token_ids
    assert tokens_of(got["b"]) == references[2][0].token_ids
    assert kv.num_used_tokens == 0 and kv.free_slots == [0, 1]


def test_a_nan_row_mid_chunk_ends_that_request_alone(tiny):
    """A row S04 refuses (NaN logits for b's second token) while a is part-way into its
    prompt: b ends with finish_reason "abort" and the error on its output (the model's
    logits to blame, so no parameter), a's chunk is computed in the same step (nothing to
    revert), and a's output equals its output alone; every token is free at the end."""
    name, hf, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8)
    engine.runner = NaNRows(engine.runner, bad="b")
    engine.add_request(PROMPTS[2], greedy(), request_id="b")       # 7 tokens
    engine.step()                                                  # b's prompt, 1 token
    engine.add_request(PROMPTS[5], greedy(), request_id="a")       # 50 tokens
    (out,) = engine.step()                   # b decodes (NaN), a's first chunk of 7
    assert (out.request_id, out.finished, out.finish_reason, out.new_token_ids) == (
        "b", True, "abort", [])
    assert isinstance(out.error, ParameterError) and out.error.parameter is None
    assert "logits must not contain NaN" in str(out.error)
    assert "b" not in engine.requests and engine.requests["a"].num_computed_tokens == 7
    assert engine.scheduler.kv.num_used_tokens == 7
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert {o.request_id for o in seen} == {"a"}
    assert tokens_of(seen) == references[5][0].token_ids
    kv = engine.scheduler.kv
    assert kv.num_used_tokens == 0 and kv.free_slots == [0, 1]


# --- errors, the scheduler alone, the table ----------------------------------------------------

def test_bad_arguments_are_refused_naming_the_rule(tiny):
    name, hf, model, _ = tiny
    for bad in (-1, 1.5, True, None, "8"):
        with pytest.raises(ParameterError, match=r"^long_prefill_token_threshold must be an "
                                                 r"integer >= 0, 0 for no limit") as err:
            build(model, 2, long_prefill_token_threshold=bad)
        assert err.value.parameter == "long_prefill_token_threshold"
    with pytest.raises(ParameterError, match=r"max_num_batched_tokens \(3\) must be >= "
                                             r"max_num_seqs \(4\): a step must hold one "
                                             r"decode") as err:
        build(model, 4, max_num_batched_tokens=3)
    assert err.value.parameter == "max_num_batched_tokens"
    with pytest.raises(ParameterError, match="max_num_batched_tokens must be an integer >= 1"):
        s11.ChunkedSchedulerConfig(max_num_seqs=2, max_model_len=10, max_num_batched_tokens=0)
    assert build(model, 4, max_num_batched_tokens=4) is not None


def test_table_marks_prefill_pieces_their_progress_and_the_rows_that_sampled(tiny):
    name, hf, model, _ = tiny
    engine = build(model, 2, max_num_batched_tokens=20)
    tracer = trace(engine)
    LLM(engine).generate([text(PROMPTS[5]), text(PROMPTS[2])], greedy(3))
    lines = s11.format_chunk_table(tracer.records).splitlines()
    # 50 and 7 tokens in budgets of 20: 20, 20, then the last 10 of the first with the second's 7
    assert lines[1].split() == ["0", "20/20", "0:20p", "20/50"]
    assert lines[2].split() == ["1", "20/20", "0:20p", "40/50"]
    assert lines[3].split() == ["2", "17/20", "0:10p", "50/50*", "1:7p", "7/7*"]
    assert lines[4].split() == ["3", "2/20", "0:1*", "1:1*"]
    assert len(s11.format_chunk_table(tracer.records, max_rows=2).splitlines()) == 4
    with pytest.raises(ValueError, match=r"^max_rows must be an integer >= 2"):
        s11.format_chunk_table(tracer.records, max_rows=1)


def test_the_piece_that_completes_a_chunked_recompute_is_a_prefill_piece():
    """A request stays a prefill piece from its admission (or resumption) until the step it
    samples, whatever the piece's size. Two seats, budget 4, KV capacity 7 (the fake model of
    tests/scheduler_testing.py, S09's StepTracer on it): a (2 prompt tokens, 6 outputs) and
    b (4) take 2 + 2 in step 0 (a samples), 1 + 2 in step 1 (b samples): 3 + 4 = 7 tokens
    held, so in step 2 a's next token preempts b (the latest admitted). b waits until a ends
    (step 5), then recomputes its 4 prompt tokens and 1 output in pieces of 4 (step 6) and 1
    (step 7): that last 1-token piece is an output, as a decode's is, but it completes the
    recompute and samples, as a prompt's last chunk does: "prefill". a's pieces after its
    first are decodes."""
    model = ObservedFakeModel(chunked_scheduler(s10.TokenKVPool(2, 40, 7), 2, 4, 40), 40)
    tracer = StepTracer()
    model.observers.append(tracer)
    model.add(make_request("a", 2, 6))
    model.add(make_request("b", 4, 6))
    outs = [model.step() for _ in range(8)]
    assert [dict(o.num_scheduled_tokens) for o in outs] == [
        {"a": 2, "b": 2}, {"a": 1, "b": 2}, {"a": 1}, {"a": 1}, {"a": 1}, {"a": 1},
        {"b": 4}, {"b": 1}]
    assert outs[2].preempted_ids == ("b",) and outs[6].scheduled_resumed_ids == ("b",)
    records = tracer.records
    assert [r.step for r in records] == list(range(8))
    assert (records[7].num_computed_tokens[0], records[7].request_num_tokens[0]) == (4, 5)
    assert [tuple(rid for rid, kind in zip(r.running, r.kinds) if kind == PREFILL)
            for r in records] == [("a", "b"), ("b",), (), (), (), (), ("b",), ("b",)]
    assert [r.sampled for r in records] == [("a",), ("a", "b"), ("a",), ("a",), ("a",),
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
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=25, seed=3, logprobs=3),
        greedy(30, min_tokens=20, repetition_penalty=1.3, logprobs=1),
        SamplingParams(temperature=1.2, top_k=30, max_tokens=1, seed=9)]
    engine = s11.build_engine(model, tokenizer, max_num_seqs=3, batch_invariant=invariant,
                              max_num_batched_tokens=8, long_prefill_token_threshold=5)
    tracer = trace(engine)
    got = LLM(engine).generate(BUNDLED_PROMPTS, params)
    assert any(len(r.sampled) < len(r.running) for r in tracer.records)   # chunks happened
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
    s11.main(["--num-prompts", "4", "--max-tokens", "6", "--max-num-batched-tokens", "16",
              "--long-prefill-token-threshold", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- request ") == 4 and "first token in step" in out
    assert "16 tokens per step, at most 8 per request" in out
    assert "8p " in out and "*" in out
    for argv, rule in ((["--max-num-batched-tokens", "2"], "max_num_batched_tokens (2) must be "
                        ">= max_num_seqs (4)"),
                       (["--long-prefill-token-threshold", "-1"],
                        "long_prefill_token_threshold must be an integer >= 0"),
                       (["--max-context", "0"], "max_context must be an integer >= 1 (got 0)"),
                       (["--priorities", "1,0"], "--priorities needs --policy priority"),
                       (["--policy", "priority", "--priorities", "1,0", "--num-prompts", "3"],
                        "--priorities needs one value per request (3)"),
                       (["--priorities", "a"], "--priorities needs comma-separated integers")):
        with pytest.raises(SystemExit) as exit_info:
            s11.main(argv + ["--device", "cpu"])
        assert exit_info.value.code == 2, argv
        assert rule in capsys.readouterr().err, argv
    # the default budget follows the seats: max(16, max_num_seqs), never below the rule
    s11.main(["--num-prompts", "3", "--max-tokens", "2", "--max-num-seqs", "20", "--device",
              "cpu"])
    assert "at most 20 running, context 256; 20 tokens per step" in capsys.readouterr().out
    # priorities: with all three queued at once and one seat, the lowest value runs first
    s11.main(["--num-prompts", "3", "--max-tokens", "2", "--max-num-seqs", "1",
              "--arrival-every", "0", "--policy", "priority", "--priorities", "2,0,1",
              "--device", "cpu"])
    out = capsys.readouterr().out
    assert "policy priority" in out
    first = [int(step) for step in            # the requests in arrival order
             re.findall(r"--- request \d+: prompt \(\d+ tokens\), first token in step (\d+)",
                        out)]
    assert len(first) == 3 and first[1] < first[2] < first[0], first


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
