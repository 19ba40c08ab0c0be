"""Property tests for chapter S09 (hypothesis): any arrivals, aborts and slot counts.

For random request mixes (prompt lengths 1 to the context limit, max_tokens, min_tokens, stop
token ids, EOS on or off, greedy or seeded sampling), random arrival steps, random aborts (of
requests waiting, running or already done) and max_num_seqs 1 to 4, the batch-invariant
engine gives every request that was not aborted exactly the Completion of the S06 engine run
on it alone (ids, text, finish_reason, stop_reason); an aborted request's tokens are a prefix
of that; every running request makes exactly one token per step; no request waits while a
slot is free; admission is FIFO; and once everything has finished or been aborted every slot is free (invariant
8). The fast mode, on the same schedule, keeps the scheduling invariants and its greedy
requests equal their alone outputs where the reference's top-2 gaps allow (S08's rule).
Oracle: the S06 single-request engine (itself pinned to S05, the S01 loop and HF).
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s04_sampling as s04
import s06_torch as s06
from s08_static_batching import BATCH_TOLERANCE, follows_batch_rule
from s09_continuous_batching import FINISH_ABORT, LLMEngine
from test_s03_transformer import V, IdTokenizer, build_tiny

CONTEXT = 96


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied"])
def model(request, tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp(f"s09_prop_{request.param}")
    build_tiny(request.param, directory)
    yield s06.TorchTransformer.from_pretrained(directory)
    torch.set_num_threads(before)


@st.composite
def requests(draw):
    """(prompt ids, SamplingParams, arrival step, abort step or None) of one request."""
    length = draw(st.integers(1, CONTEXT - 1) | st.sampled_from([1, CONTEXT - 2, CONTEXT]))
    ids = draw(st.lists(st.integers(0, V - 1), min_size=length, max_size=length))
    max_tokens = draw(st.integers(1, 8))
    sampled = draw(st.booleans())
    params = s04.SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0])) if sampled else 0.0,
        seed=draw(st.integers(0, 1000)) if sampled else None,
        max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
        stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=6)),
        ignore_eos=draw(st.booleans()), logprobs=None if sampled else 2)
    return (ids, params, draw(st.integers(0, 6)),
            draw(st.none() | st.none() | st.integers(0, 10)))


def run(engine, batch):
    """Drive the engine; check the scheduling invariants each step. Returns {index: tokens,
    finish_reason}."""
    ids, tokens, reasons, call = {}, {}, {}, 0
    while len(ids) < len(batch) or engine.has_unfinished_requests():
        for i, (prompt, params, arrive, abort) in enumerate(batch):
            if arrive == call:
                ids[i] = engine.add_request(" ".join(map(str, prompt)), params)
            if abort == call and i in ids:
                engine.abort(ids[i])
        steps = len(engine.trace)
        waiting = {seq.request_id for seq in engine.waiting}
        waiting = [rid for rid in ids.values() if rid in waiting]    # by arrival
        outputs = engine.step()
        call += 1
        if len(engine.trace) > steps:
            record = engine.trace[-1]
            assert record.waiting == 0 or record.free_slots == 0
            assert list(record.joined) == waiting[:len(record.joined)]     # FIFO admission
            made = sorted(o.request_id for o in outputs if o.new_token_ids)
            assert made == sorted(record.running)
            assert all(len(o.new_token_ids) <= 1 for o in outputs)
        assert call < 1000, "requests never finish (a slot was never freed?)"
        index = {rid: i for i, rid in ids.items()}
        for o in outputs:
            tokens.setdefault(index[o.request_id], []).extend(o.new_token_ids)
            if o.finished:
                reasons[index[o.request_id]] = o.finish_reason
    assert engine.num_free_slots == engine.max_num_seqs and not engine.requests
    assert sorted(reasons) == list(range(len(batch)))
    return tokens, reasons


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6), max_num_seqs=st.integers(1, 4))
def test_any_schedule_gives_each_request_its_output_alone(model, batch, max_num_seqs):
    tokenizer = IdTokenizer(eos_id=3)          # an EOS the random models do produce at times
    single = s06.Engine(model, tokenizer, CONTEXT)
    alone = [single.generate(" ".join(map(str, ids)), p) for ids, p, _, _ in batch]
    reference = LLMEngine(model, tokenizer, CONTEXT, max_num_seqs, batch_invariant=True)
    tokens, reasons = run(reference, batch)
    for i, want in enumerate(alone):
        got = tokens.get(i, [])
        if reasons[i] == FINISH_ABORT:
            assert got == want.token_ids[:len(got)] and len(got) < max(1, len(want.token_ids))
        else:
            assert (got, reasons[i]) == (want.token_ids, want.finish_reason)
    fast_tokens, fast_reasons = run(LLMEngine(model, tokenizer, CONTEXT, max_num_seqs), batch)
    for i, want in enumerate(alone):
        p = batch[i][1]
        if p.greedy and p.min_tokens == 0 and FINISH_ABORT not in (fast_reasons[i], reasons[i]):
            fast = as_completion(fast_tokens.get(i, []), fast_reasons[i], want)
            assert follows_batch_rule(fast, want, BATCH_TOLERANCE[torch.float32])


def as_completion(tokens, reason, like):
    """A Completion with the fast run's tokens, for `follows_batch_rule` (its text and stop
    reason are the reference's: the rule compares them only when every gap is wide, and then
    equal tokens give equal text)."""
    from dataclasses import replace
    return replace(like, token_ids=tokens, finish_reason=reason)
