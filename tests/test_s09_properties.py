"""Property tests for chapter S09 (hypothesis): any arrivals, aborts and slot counts.

For random request mixes (prompt lengths 1 to the context limit, given as token ids, max_tokens,
min_tokens, stop token ids, EOS on or off, greedy or seeded sampling), random arrival steps,
random aborts (of requests waiting, running or already done) and max_num_seqs 1 to 4, the
batch-invariant engine gives every request that was not aborted exactly the Completion of the
S06 engine run on it alone (ids, finish_reason); an aborted request's tokens are a prefix of
that; every scheduled request makes exactly one token per step and no one else does; no request
waits while a slot is free; admission is FIFO (`fifo_step_check`); and once everything has
finished or been aborted every slot is free (invariant 8, `drive`). The fast mode, on the same
schedule, keeps the scheduling invariants and its greedy requests equal their alone outputs
where the reference's top-2 gaps allow (S08's rule).
Oracle: the S06 single-request engine (itself pinned to S05, the S01 loop and HF).
"""
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s04_sampling as s04
import s06_torch as s06
import s09_continuous_batching as s09
from engine_testing import drive, fifo_step_check, id_text, tokens_of
from model_testing import V, IdTokenizer, build_tiny
from s08_batch_variance import BATCH_TOLERANCE, follows_batch_rule
from s09_continuous_batching import FINISH_ABORT

CONTEXT = 96


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"s09_prop_{request.param}")
    build_tiny(request.param, directory)
    return s06.TorchTransformer.from_pretrained(directory)


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
    """Drive the engine (the prompts as token ids) with S09's per-step checks. Returns
    ({index: tokens}, {index: finish_reason}): every request has had its last output."""
    aborts: dict[int, list[int]] = {}
    for i, (_, _, _, abort) in enumerate(batch):
        if abort is not None:
            aborts.setdefault(abort, []).append(i)
    _, fifo_check = fifo_step_check(engine)

    def check(engine, call, outputs):
        fifo_check(engine, call, outputs)
        assert call < 1000, "requests never finish (a slot was never freed?)"

    outputs, _ = drive(engine, [(ids, params) for ids, params, _, _ in batch],
                       [arrive for _, _, arrive, _ in batch], aborts, check=check)
    assert sorted(outputs) == list(range(len(batch)))
    kv = engine.scheduler.kv
    assert kv.free_slots == list(range(kv.num_slots))
    return ({i: tokens_of(outs) for i, outs in outputs.items()},
            {i: outs[-1].finish_reason for i, outs in outputs.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6), max_num_seqs=st.integers(1, 4))
def test_any_schedule_gives_each_request_its_output_alone(model, batch, max_num_seqs):
    tokenizer = IdTokenizer(eos_id=3)          # an EOS the random models do produce at times
    single = s06.Engine(model, tokenizer, CONTEXT)
    alone = [single.generate(id_text(ids), p) for ids, p, _, _ in batch]
    build = lambda **kw: s09.build_engine(model, tokenizer, max_context=CONTEXT,  # noqa: E731
                                          max_num_seqs=max_num_seqs, **kw)
    tokens, reasons = run(build(batch_invariant=True), batch)
    for i, want in enumerate(alone):
        got = tokens[i]
        if reasons[i] == FINISH_ABORT:
            assert got == want.token_ids[:len(got)] and len(got) < max(1, len(want.token_ids))
        else:
            assert (got, reasons[i]) == (want.token_ids, want.finish_reason)
    fast_tokens, fast_reasons = run(build(), batch)
    for i, want in enumerate(alone):
        p = batch[i][1]
        if p.greedy and p.min_tokens == 0 and FINISH_ABORT not in (fast_reasons[i], reasons[i]):
            # A Completion with the fast run's tokens (its text and stop reason are the
            # reference's: the rule compares them only when every gap is wide, and then
            # equal tokens give equal text).
            fast = replace(want, token_ids=fast_tokens[i], finish_reason=fast_reasons[i])
            assert follows_batch_rule(fast, want, BATCH_TOLERANCE[torch.float32])
