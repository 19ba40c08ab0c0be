"""Property tests for chapter S08 (hypothesis): any batch composition, exactly as if alone.

For random prompt lengths (1 to the context limit), batch sizes, and per-request stop
settings (max_tokens, min_tokens, stop token ids, EOS on or off, greedy or seeded sampling,
a repetition penalty, logprobs), the batch-invariant mode's Completions equal, field for field,
those of the S06 engine run on each request alone; the fast mode's greedy rows follow
`follows_batch_rule` against them; and the waste table adds up (every computed slot is useful,
padding or idle, and each row runs exactly as many steps as it made tokens).
Oracle: the S06 single-request engine (itself pinned to S05, the S01 loop and HF).
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s04_sampling as s04
import s06_torch as s06
from model_testing import V, IdTokenizer, build_tiny
from s08_batch_variance import BATCH_TOLERANCE, follows_batch_rule
from s08_static_batching import Engine

CONTEXT = 96


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"s08_prop_{request.param}")
    build_tiny(request.param, directory)
    return s06.TorchTransformer.from_pretrained(directory)


@st.composite
def requests(draw):
    """(prompt ids, SamplingParams) of one request."""
    length = draw(st.integers(1, CONTEXT - 1) | st.sampled_from([1, CONTEXT - 2, CONTEXT - 1]))
    ids = draw(st.lists(st.integers(0, V - 1), min_size=length, max_size=length))
    max_tokens = draw(st.integers(1, 8))
    sampled = draw(st.booleans())
    params = s04.SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0])) if sampled else 0.0,
        seed=draw(st.integers(0, 1000)) if sampled else None,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=6)),
        ignore_eos=draw(st.booleans()),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        logprobs=draw(st.sampled_from([None, 2])),
    )
    return ids, params


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6))
def test_any_batch_equals_each_request_alone(model, batch):
    tokenizer = IdTokenizer(eos_id=3)          # an EOS the random models do produce at times
    prompts = [" ".join(map(str, ids)) for ids, _ in batch]
    params = [p for _, p in batch]
    single = s06.Engine(model, tokenizer, CONTEXT)
    alone = [single.generate(prompt, p) for prompt, p in zip(prompts, params)]
    reference = Engine(model, tokenizer, CONTEXT, max_batch_size=6, batch_invariant=True)
    together = reference.generate(prompts, params)
    for got, want in zip(together, alone):
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason, got.logprobs) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason, want.logprobs)
        assert got.stats.passes == len(got.token_ids)
    stats = reference.last_batch
    running = [c for c in alone if c.stats.passes]     # a full-context prompt takes no row
    assert stats.output_tokens == [len(c.token_ids) for c in running]
    assert stats.slots == stats.useful + stats.padding_slots + stats.idle
    assert stats.useful == sum(stats.prompt_tokens) + sum(n - 1 for n in stats.output_tokens)
    fast = Engine(model, tokenizer, CONTEXT, max_batch_size=6).generate(prompts, params)
    for f, ref, p in zip(fast, together, params):
        if p.greedy and p.repetition_penalty == 1.0 and p.min_tokens == 0 and p.logprobs:
            assert follows_batch_rule(f, ref, BATCH_TOLERANCE[torch.float32])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(first=st.lists(requests(), min_size=1, max_size=4),
       second=st.lists(requests(), min_size=1, max_size=4),
       order=st.lists(st.booleans(), max_size=20), invariant=st.booleans())
def test_streams_in_any_interleaving_equal_each_batch_alone(model, first, second, order,
                                                            invariant):
    """Two batches of one engine, stepped in any order (`order`: which one steps next, then
    round robin to the end): each gives exactly its Completions run alone, in either mode,
    since each batch has its own runner and cache."""
    tokenizer = IdTokenizer(eos_id=3)
    engine = Engine(model, tokenizer, CONTEXT, max_batch_size=4, batch_invariant=invariant)
    batches = [([" ".join(map(str, ids)) for ids, _ in b], [p for _, p in b])
               for b in (first, second)]
    alone = [engine.generate(prompts, params) for prompts, params in batches]
    streams = [engine.stream(prompts, params) for prompts, params in batches]
    done = [False, False]
    for pick in [int(b) for b in order] + [0, 1] * 16:
        if not done[pick]:
            done[pick] = next(streams[pick], None) is None
    for stream, want in zip(streams, alone):
        assert list(stream) == []
        assert [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in stream.result] == [
            (c.token_ids, c.text, c.finish_reason, c.logprobs) for c in want]
