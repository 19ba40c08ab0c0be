"""Tests for chapter S08: static batching.

Oracles: the S05 NumPy engine and HF `transformers` `generate()` run on each prompt alone, HF's
batched `generate()` with left padding on the same batch (float32, eager attention), the S06
engine alone (whole completions: text, finish_reason, stop_reason, logprobs, seeded samples),
a full recompute of the context by S06's `forward` (cached vs uncached), and closed forms
worked out by hand (padding, position ids, masks, waste counts).

Exactness. In the batch-invariant mode a row's logits must be bitwise those of the request
alone, so completions are compared with ==. The fast mode computes B rows in one product; its
greedy tokens are compared with == against the oracles on the tiny random models and the
bundled model (their top-2 gaps are far above the float32 differences measured), and held to
`follows_batch_rule` against the reference where that is the claim.

Public bug reports (../shared/cases/public-bugs.md, sections (e) and (f)), each a test below:
E1 transformers #25790 and E2 optimum-habana PR #1539 (pad == eos), E4 unsloth #3699 (per-row
position ids), F1 transformers #36536 (cached == uncached in float32), F6 swarmllm #31 (the
context limit ends a row with "length" and nothing is written past the cache).
"""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
from engine_testing import greedy, id_text, run_in_turns, tiny_fixture
from model_testing import EOS_UNUSED, PAD, TINY, V, IdTokenizer
from s08_batch_variance import (
    BATCH_TOLERANCE, first_close_call, follows_batch_rule, format_variance_table,
    measure_batch_variance, record_logits, top2_gaps,
)
from s08_static_batching import (
    BatchKVCache, BatchRunner, BatchStats, BatchStream, Engine, attention_allowed,
    batched_attention, format_waste_table, left_pad, main, position_ids_from_mask,
)

CONTEXT = 96          # max_position_embeddings of every tiny model
NEW = 10
BATCH_SIZES = (1, 2, 3, 8, 32)


def first_difference(name, ours, reference) -> str:
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                 min(len(ours), len(reference)))
    return f"{name}: ids differ first at index {index}\n  ours: {ours}\n  ref:  {reference}"


# 32 prompts, lengths from 1 to the context limit (a 95-token prompt has room for one token, so
# the context-full stop fires at once; 90 stops mid-generation).
LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 19, 23, 27, 31, 36, 41, 47, 53, 59, 64, 70,
           75, 80, 84, 86, 88, 90, 92, 94, 95]
PROMPTS = [np.random.default_rng(100 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
# Batches of each size, mixing short and long prompts: index lists into PROMPTS.
BATCHES = {1: [31], 2: [0, 28], 3: [5, 0, 30], 8: [3, 29, 0, 12, 20, 7, 26, 17],
           32: list(range(31, -1, -1))}

text = id_text
# (name, HF model, S06 TorchTransformer, {prompt index: (S05 alone, HF alone)}, checkpoint
# directory) for each tiny random model.
tiny = tiny_fixture("s08", sorted(TINY), PROMPTS, CONTEXT, NEW, with_directory=True)


def hf_left_padded(hf, prompts, max_new_tokens):
    ids, mask = left_pad(prompts, PAD)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=EOS_UNUSED, pad_token_id=PAD)
    rows = out[:, ids.shape[1]:].tolist()
    # HF fills a row that has finished with pad ids until the batch ends: cut after its EOS.
    return [row[:row.index(EOS_UNUSED) + 1] if EOS_UNUSED in row else row for row in rows]


# --- padding, positions and masks by hand ---------------------------------------------------

def test_left_pad_and_position_ids_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8], [1, 9, 10]]
    assert mask.tolist() == [[True] * 3, [False, False, True], [False, True, True]]
    # Each row's first real token is at position 0 (unsloth #3699: not the column index).
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="at least one prompt, each with at least one token"):
        left_pad([[1], []], 0)


def test_attention_mask_hides_padding_and_the_future_and_keeps_a_key_per_query():
    real = torch.tensor([[True, True, True, True], [False, False, True, True]])
    allowed = attention_allowed(real, 0, 3)                               # prefill, T = 3
    expected_row0 = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # Row 1: columns 0 and 1 are padding; a padding query sees only itself (no all--inf row).
    expected_row1 = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert allowed.int().tolist() == [expected_row0, expected_row1]
    decode = attention_allowed(real, 3, 1)                                # column 3 decodes
    assert decode.int().tolist() == [[[1, 1, 1, 1]], [[0, 0, 1, 1]]]
    assert allowed.any(-1).all() and decode.any(-1).all()


@pytest.mark.parametrize("impl", s06.ATTENTION_IMPLS)
def test_batched_attention_equals_s06_attention_on_each_rows_real_keys(impl):
    torch.manual_seed(0)
    b, h, hkv, t, d = 3, 4, 2, 5, 8
    pads = [0, 2, 4]
    real = torch.ones(b, t, dtype=torch.bool)
    for row, pad in enumerate(pads):
        real[row, :pad] = False
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    out = batched_attention(q, k, v, attention_allowed(real, 0, t), 0.3, impl)
    assert out.shape == (b, h, t, d) and torch.isfinite(out).all()
    for row, pad in enumerate(pads):
        alone = s06.attention(q[row, :, pad:], k[row, :, pad:], v[row, :, pad:], 0, 0.3)
        torch.testing.assert_close(out[row, :, pad:], alone, rtol=1e-5, atol=1e-6)


def test_batch_kv_cache_refuses_to_write_past_its_columns():
    cache = BatchKVCache(2, 3, 2, 5, 4)
    assert cache.k.shape == (2, 3, 2, 5, 4) and cache.num_cols == 0
    cache.write(0, torch.ones(3, 2, 4, 4), torch.ones(3, 2, 4, 4))
    cache.advance(0, 4)
    with pytest.raises(ValueError, match="batch KV cache is full: layer 0 has 5 columns"):
        cache.write(0, torch.ones(3, 2, 2, 4), torch.ones(3, 2, 2, 4))
    assert cache.k[0, :, :, 4].abs().sum() == 0      # nothing written by the refused call
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        BatchKVCache(2, 0, 2, 5, 4)


# --- greedy parity on tiny random models ----------------------------------------------------

@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_each_row_equals_s05_and_hf_alone(tiny, batch_size):
    """Every row of a static batch gives the tokens of its prompt run alone: S05 (NumPy, one
    request) and HF generate; prompt lengths from 1 to the context limit, so some rows stop at
    the context (finish_reason "length" before max_tokens) while others run on."""
    name, hf, model, references, _ = tiny
    batch = BATCHES[batch_size]
    engine = Engine(model, IdTokenizer(), CONTEXT)
    results = engine.generate([text(PROMPTS[i]) for i in batch], greedy(NEW))
    assert len(results) == batch_size
    for i, got in zip(batch, results):
        alone, hf_alone = references[i]
        assert got.token_ids == alone.token_ids, first_difference(f"{name} S05 p{i}",
                                                                  got.token_ids, alone.token_ids)
        assert got.token_ids == hf_alone, first_difference(f"{name} HF p{i}", got.token_ids,
                                                           hf_alone)
        assert (got.text, got.finish_reason, got.stop_reason) == (
            alone.text, alone.finish_reason, alone.stop_reason)
        assert len(PROMPTS[i]) + len(got.token_ids) <= CONTEXT


@pytest.mark.parametrize("batch_size", [2, 8, 32])
def test_same_tokens_as_hf_batched_generate_with_left_padding(tiny, batch_size):
    """HF's own batched generate on the same left-padded block (prompts whose rows all fit the
    context with NEW tokens: HF does not stop at the context, it fails past it)."""
    name, hf, model, *_ = tiny
    fitting = [p for p in PROMPTS if len(p) + NEW <= CONTEXT]
    batch = [fitting[(7 * j) % len(fitting)] for j in range(batch_size)]
    expected = hf_left_padded(hf, batch, NEW)
    got = Engine(model, IdTokenizer(), CONTEXT).generate([text(p) for p in batch], greedy(NEW))
    for j, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours.token_ids == theirs, first_difference(f"{name} row {j}", ours.token_ids,
                                                          theirs)


def test_position_ids_from_the_column_show_on_gpt2_and_hide_under_rope(tiny):
    """unsloth #3699's bug, planted in a runner subclass: positions = column index, shared by
    every row, so a padded row's tokens sit at positions shifted by its padding. GPT-2 learns a
    vector per position: its padded rows' logits move far from the prompt run alone. RoPE's
    scores depend only on the distance between query and key, so a uniform shift of a whole
    row is hidden (up to rounding): that is why GPT-2 is among the models of every parity test.
    The correct runner matches the prompt alone in both families."""
    name, hf, model, *_ = tiny

    class ColumnPositions(BatchRunner):
        def step(self, ids, positions, active):
            return super().step(ids, torch.arange(ids.shape[1]).expand_as(ids), active)

    prompts = [PROMPTS[LENGTHS.index(n)] for n in (3, 47, 9)]     # rows 0 and 2 are padded
    alone = torch.stack([s06.CachedTransformer(model, CONTEXT).prefill(p) for p in prompts])
    right = BatchRunner(model, CONTEXT).prefill(prompts, 1)
    wrong = ColumnPositions(model, CONTEXT).prefill(prompts, 1)
    torch.testing.assert_close(right, alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wrong[1], alone[1], rtol=1e-4, atol=1e-5)  # no padding: no shift
    shift = (wrong - alone).abs().amax(-1)
    if name == "gpt2":
        assert shift[0] > 0.05 and shift[2] > 0.05, shift
    else:
        assert shift.max() < 1e-4, shift


# --- batch-invariant mode: bitwise the request alone ----------------------------------------

def test_batch_invariant_logits_are_bitwise_those_of_the_request_alone(tiny):
    name, hf, model, *_ = tiny
    batch = [text(PROMPTS[i]) for i in BATCHES[8]]
    together = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=True)
    together_logits = record_logits(together)
    results = together.generate(batch, greedy(NEW))
    for row, prompt in enumerate(batch):
        alone = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=True)
        alone_logits = record_logits(alone)
        single = alone.generate([prompt], greedy(NEW))[0]
        assert single.token_ids == results[row].token_ids
        for step in range(len(single.token_ids)):
            assert torch.equal(together_logits[step][row], alone_logits[step][0]), (name, row)
    assert Engine.runner_class is BatchRunner         # the seam was set on the instances only


def test_fast_mode_follows_the_stated_rule_against_the_reference(tiny):
    name, hf, model, *_ = tiny
    batch = [text(PROMPTS[i]) for i in BATCHES[32]]
    params = greedy(NEW, logprobs=2)
    fast = Engine(model, IdTokenizer(), CONTEXT).generate(batch, params)
    reference = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=True).generate(batch, params)
    for f, r in zip(fast, reference):
        assert follows_batch_rule(f, r, BATCH_TOLERANCE[torch.float32])


def test_permuted_batch_gives_permuted_results(tiny):
    name, hf, model, *_ = tiny
    batch = [text(PROMPTS[i]) for i in BATCHES[8]]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    for invariant in (True, False):
        engine = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=invariant)
        straight = engine.generate(batch, greedy(NEW))
        permuted = engine.generate([batch[j] for j in order], greedy(NEW))
        assert [p.token_ids for p in permuted] == [straight[j].token_ids for j in order]


# --- whole completions against the S06 engine, on real text ---------------------------------

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")

BUNDLED_PROMPTS = ["Rom.\nBut soft! what light through yonder window breaks?", "O",
                   "Ham.\nTo be, or not to be, that is the question:", "First Citizen.\n",
                   "Hello world,", "How are you, my lord?\n"]


@pytest.fixture(scope="module")
def bundled_model():
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    return model, tokenizer


def mixed_params(tokenizer, free_ids):
    """Per-row settings that exercise every stop rule and the sampler; free_ids: a greedy run's
    tokens, so stop ids and strings are ones that occur."""
    return [
        greedy(30),
        greedy(30, stop_token_ids=[free_ids[5]]),
        greedy(30, stop=[tokenizer.decode(free_ids[3:5])[-2:]]),
        s04.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=25, seed=3, logprobs=3),
        greedy(30, min_tokens=20, repetition_penalty=1.3, logprobs=1),
        s04.SamplingParams(temperature=1.2, top_k=30, max_tokens=1, seed=9),
    ]


@bundled
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_whole_completions_equal_the_s06_engine_alone(bundled_model, invariant):
    """Per-row params (stop ids, stop strings, min_tokens, penalties, seeded sampling,
    logprobs) in one batch: every Completion is the S06 engine's for that request alone (its
    text, ids, finish_reason, stop_reason, logprobs), exactly."""
    model, tokenizer = bundled_model
    single = s06.Engine(model, tokenizer)
    free = single.generate(BUNDLED_PROMPTS[0], greedy(30, ignore_eos=True))
    params = mixed_params(tokenizer, free.token_ids)
    engine = Engine(model, tokenizer, batch_invariant=invariant)
    results = engine.generate(BUNDLED_PROMPTS, params)
    for prompt, p, got in zip(BUNDLED_PROMPTS, params, results):
        alone = single.generate(prompt, p)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason), prompt
        if invariant:
            assert got.logprobs == alone.logprobs
        elif alone.logprobs is not None:
            assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in alone.logprobs]
            np.testing.assert_allclose([lp.logprob for lp in got.logprobs],
                                       [lp.logprob for lp in alone.logprobs], atol=1e-4)
    assert {r.finish_reason for r in results} == {"stop", "length"}


@bundled
def test_bundled_model_rows_equal_s05_and_hf_alone_and_hf_batched(bundled_model):
    from transformers import AutoModelForCausalLM
    model, tokenizer = bundled_model
    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    numpy_model = s03.Transformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    limit = numpy_model.config.max_position_embeddings
    corpus = s03.ROOT.joinpath("data", "shakespeare.txt").read_text(encoding="utf-8")
    long_ids = tokenizer.encode(corpus[200_000:203_000])[:limit - 6]      # near the limit
    prompts = BUNDLED_PROMPTS + [tokenizer.decode(long_ids)]
    assert tokenizer.encode(prompts[-1]) == long_ids
    eos = tokenizer.eos_id
    results = Engine(model, tokenizer).generate(prompts, greedy(24))
    s05_engine = s05.Engine(numpy_model, tokenizer, limit)
    ids = [tokenizer.encode(p) for p in prompts]
    for p, got in zip(prompts, results):
        assert got.token_ids == s05_engine.generate(p, greedy(24)).token_ids
        n = len(tokenizer.encode(p))
        with torch.no_grad():
            out = hf.generate(torch.tensor([tokenizer.encode(p)]),
                              attention_mask=torch.ones(1, n, dtype=torch.long),
                              max_new_tokens=min(24, limit - n), do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
        assert got.token_ids == out[0, n:].tolist(), p
    assert results[-1].finish_reason == "length" and len(results[-1].token_ids) == 6
    # HF's batched generate, left-padded with pad == eos, on the rows that fit 24 new tokens.
    fitting = [i for i, x in enumerate(ids) if len(x) + 24 <= limit]
    block, mask = left_pad([ids[i] for i in fitting], eos)
    with torch.no_grad():
        out = hf.generate(block, attention_mask=mask.long(), max_new_tokens=24, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)
    for row, i in enumerate(fitting):
        theirs = out[row, block.shape[1]:].tolist()
        if eos in theirs:     # HF pads a finished row with more eos: cut after the first
            theirs = theirs[:theirs.index(eos) + 1]
        assert results[i].token_ids == theirs, prompts[i]


# --- the public bug reports ------------------------------------------------------------------

@bundled
def test_pad_equal_to_eos_never_ends_or_erases_a_row(bundled_model):
    """transformers #25790 (E1) and optimum-habana PR #1539 (E2): with pad == eos (the bundled
    model's config), left pads are not generated EOS: the shorter prompt's output is not empty
    and equals its output alone; EOS is looked for only in generated tokens."""
    model, tokenizer = bundled_model
    engine = Engine(model, tokenizer)
    assert engine.pad_id == tokenizer.eos_id
    pair = ["Hello world,", "How are you, my lord?\n"]
    lengths = [len(tokenizer.encode(p)) for p in pair]
    assert lengths[0] != lengths[1]            # one of them is padded
    single = s06.Engine(model, tokenizer)
    for prompt, got in zip(pair, engine.generate(pair, greedy(30))):
        alone = single.generate(prompt, greedy(30))
        assert got.token_ids and got.text and got.token_ids == alone.token_ids
        assert tokenizer.eos_id not in got.token_ids[:-1]


def test_position_ids_are_per_row_in_prefill_and_decode(tiny):
    """unsloth #3699 (E4): the first real token of each row is at position 0, and each decode
    step adds 1 to each row's own position."""
    name, hf, model, references, _ = tiny
    runner = BatchRunner(model, CONTEXT)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    runner.prefill(prompts, 4)
    assert runner.positions.tolist() == [5, 1, 3]
    runner.decode(torch.tensor([3, 4, 5]))
    assert runner.positions.tolist() == [6, 2, 4]
    assert runner.key_is_real[:, :6].int().tolist() == [[1] * 6, [0] * 4 + [1] * 2,
                                                        [0] * 2 + [1] * 4]


def test_no_nan_in_padded_rows_even_a_column_of_padding_only(tiny):
    """A 1-token prompt next to a 90-token one: its row is all padding in 89 columns. No query
    row of softmax is all -inf, so nothing is NaN: not the logits, not the cached keys and
    values, in prefill or decode, in both modes; pad == eos as well (E1)."""
    name, hf, model, *_ = tiny
    for invariant in (False, True):
        for pad_id in (PAD, EOS_UNUSED):
            runner = BatchRunner(model, CONTEXT, batch_invariant=invariant, pad_id=pad_id)
            logits = runner.prefill([PROMPTS[0], PROMPTS[28]], 6)
            assert torch.isfinite(logits).all()
            for _ in range(5):
                logits = runner.decode(logits.argmax(-1))
                assert torch.isfinite(logits).all()
            assert torch.isfinite(runner.cache.k).all() and torch.isfinite(runner.cache.v).all()


def test_cached_batch_logits_equal_a_full_recompute(tiny):
    """transformers #36536 (F1): in float32, the logits of every step with the batched KV cache
    are allclose to recomputing the row's whole context without a cache, and greedy equal."""
    name, hf, model, *_ = tiny
    batch = [PROMPTS[i] for i in BATCHES[3]]
    engine = Engine(model, IdTokenizer(), CONTEXT)
    recorded = record_logits(engine)
    results = engine.generate([text(p) for p in batch], greedy(NEW))
    for row, (prompt, got) in enumerate(zip(batch, results)):
        context = prompt + got.token_ids
        full = model.forward(context[:-1])[len(prompt) - 1:]         # (n, V), no cache
        cached = torch.stack([recorded[step][row] for step in range(len(got.token_ids))])
        np.testing.assert_allclose(cached.numpy(), full, rtol=1e-4, atol=1e-5, err_msg=name)
        assert full.argmax(-1).tolist() == got.token_ids


def test_context_limit_ends_each_row_with_length_and_never_overruns_the_cache(tiny):
    """swarmllm #31 (F6): prompt_len + max_tokens > max_context. Each row stops when it holds
    max_context tokens with finish_reason "length", rows of other lengths run on, and the
    batch cache (columns past max_context for the short rows) is never written past its end; a
    prompt that cannot fit is refused before anything runs."""
    name, hf, model, *_ = tiny
    max_context = 64
    runners = []

    class Kept(BatchRunner):              # keeps each batch's runner, to look at its cache
        def prefill(self, prompts, max_new_tokens, active=None):
            runners.append((self, self.max_seq_len))
            logits = super().prefill(prompts, max_new_tokens, active)
            runners[-1] = (self, self.cache.max_cols)
            return logits

    engine = type("KeptEngine", (Engine,), {"runner_class": Kept})(model, IdTokenizer(),
                                                                    max_context)
    prompts = [PROMPTS[i] for i in (0, 20, 23)]          # 1, 59 and 75 tokens
    results = engine.generate([text(p) for p in prompts[:2]], greedy(60, ignore_eos=True))
    assert [r.finish_reason for r in results] == ["length", "length"]
    assert [len(p) + len(r.token_ids) for p, r in zip(prompts, results)] == [61, 64]
    assert runners[0][1] == 59 + 60 - 1 and engine.last_batch.steps
    assert runners[0][0].cache is None               # freed when the batch ended
    with pytest.raises(ValueError, match="prompt 1: prompt is 75 tokens but max_context is 64"):
        engine.generate([text(prompts[0]), text(prompts[2])], greedy(NEW))


# --- the waste table ------------------------------------------------------------------------

def test_waste_counts_equal_closed_forms(tiny):
    name, hf, model, *_ = tiny
    lengths, outputs = [3, 9, 1, 6], [5, 2, 8, 1]     # ignore_eos: exactly these many tokens
    prompts = [text(PROMPTS[LENGTHS.index(n)]) for n in lengths]
    params = [greedy(n, ignore_eos=True) for n in outputs]
    engine = Engine(model, IdTokenizer(), CONTEXT)
    results = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == outputs
    stats = engine.last_batch
    b, t, steps = 4, max(lengths), max(outputs)
    assert [s.kind for s in stats.steps] == ["prefill"] + ["decode"] * (steps - 1)
    assert stats.padding == [t - n for n in lengths] == [6, 0, 8, 3]
    assert stats.padding_slots == b * t - sum(lengths)
    # Row i runs for outputs[i] steps, then idles until the longest row ends.
    assert stats.idle_row_steps == stats.idle == sum(steps - n for n in outputs)
    assert stats.useful == sum(lengths) + sum(n - 1 for n in outputs)
    assert stats.slots == b * t + b * (steps - 1) == stats.useful + stats.padding_slots + stats.idle
    assert [s.masked_keys for s in stats.steps[1:]] == [sum(stats.padding)] * (steps - 1)
    assert stats.steps[0].masked_keys == 0         # prefill's padding: counted as slots
    assert stats.timeline() == ["......PPPGGGG---", "PPPPPPPPPG------",
                                "........PGGGGGGG", "...PPPPPP-------"]
    table = format_waste_table(stats)
    assert "prefill" in table and f"{stats.slots:,} token slots computed" in table
    assert [r.stats.passes for r in results] == outputs


# --- the call styles ------------------------------------------------------------------------

def test_part_one_call_styles_and_streams(tiny):
    name, hf, model, references, _ = tiny
    engine = Engine(model, IdTokenizer(), CONTEXT)
    prompts = [text(PROMPTS[i]) for i in (3, 12, 0)]
    by_params = engine.generate(prompts, greedy(6))
    assert [c.token_ids for c in engine.generate(prompts, 6)] == \
        [c.token_ids for c in engine.generate(prompts, max_tokens=6, temperature=0.0)] == \
        [c.token_ids for c in by_params]
    one = engine.generate(prompts[0], 6)                # a str: Part I's single request
    assert isinstance(one, s01.Completion) and one.token_ids == by_params[0].token_ids
    outputs = list(engine.stream(prompts[0], 6))
    assert [t for o in outputs for t in o.new_token_ids] == one.token_ids
    stream = engine.stream(prompts, greedy(6))
    assert isinstance(stream, BatchStream)
    steps = list(stream)
    assert len(steps) == 6 and all(isinstance(o, s01.RequestOutput) for s in steps for o in s)
    for seq_index, completion in enumerate(stream.result):
        mine = [o for s in steps for o in s if o.request_id == completion.request_id]
        assert "".join(o.text_delta for o in mine) == completion.text
        assert [t for o in mine for t in o.new_token_ids] == by_params[seq_index].token_ids
        assert mine[-1].finished and mine[-1].finish_reason == completion.finish_reason
    assert isinstance(stream.stats, BatchStats) and stream.stats.batch_size == 3


class NeverRuns(Engine):
    def model_step_batch(self, *args):
        raise AssertionError("a forward pass ran for a bad request")


@pytest.mark.parametrize("prompts, params, kwargs, message", [
    ([], None, {}, "prompts must hold at least one prompt"),
    (["   "], None, {}, "prompt 0: prompt must contain at least one token"),
    (["1 2"] * 5, None, {}, "a batch holds at most max_batch_size=4 prompts"),
    (["1 2", ""], None, {}, "prompt 1: prompt must be a non-empty string"),
    (["1 2", " ".join(["3"] * 97)], None, {}, "prompt 1: prompt is 97 tokens but max_context"),
    (["1 2", "3"], [greedy(NEW)], {}, r"a list of exactly one per prompt \(got 1 for 2"),
    (["1 2", "3"], [greedy(NEW), {"max_tokens": 3}], {}, r"params\[1\] must be a SamplingParams"),
    (["1 2"], [greedy(NEW)], {"temperature": 0.5}, "either a list of params objects or keyword"),
    (["1 2"], "greedy", {}, "params must be a SamplingParams, a list of one per prompt"),
    (["1 2"], 5, {"max_tokens": 6}, "max_tokens was given twice"),
    (["1 2"], None, {"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    (["1 2"], None, {"top_q": 0.5}, "unknown option"),
    (("1 2" for _ in range(2)), None, {}, "prompts must be a list of strings"),
])
def test_bad_input_is_refused_before_any_forward_pass(tiny, prompts, params, kwargs, message):
    name, hf, model, *_ = tiny
    engine = NeverRuns(model, IdTokenizer(), CONTEXT, max_batch_size=4)
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, params, **kwargs)


def test_bad_engine_settings(tiny):
    name, hf, model, *_ = tiny
    for kwargs, message in [(dict(max_batch_size=0), "max_batch_size must be an integer >= 1"),
                            (dict(batch_invariant=1), "batch_invariant must be a bool"),
                            (dict(pad_id=V), r"pad_id must be an integer in \[0, V=97\)")]:
        with pytest.raises(ValueError, match=message):
            Engine(model, IdTokenizer(), CONTEXT, **kwargs)


def test_a_prompt_that_fills_the_context_finishes_on_arrival_without_a_row(tiny):
    """Part I's rule: a prompt of exactly max_context tokens ends at once ("length", no
    token); it takes no row of the batch."""
    name, hf, model, references, _ = tiny
    engine = Engine(model, IdTokenizer(), 8)
    full, short = text(PROMPTS[LENGTHS.index(8)]), text(PROMPTS[LENGTHS.index(3)])
    done = engine.generate([full, short], greedy(NEW, ignore_eos=True))
    assert done[0].token_ids == [] and done[0].finish_reason == "length"
    assert len(done[1].token_ids) == 5 and engine.last_batch.batch_size == 1
    only_full = engine.generate([full], greedy(NEW))
    assert only_full[0].finish_reason == "length" and engine.last_batch.steps == []


def test_a_bad_row_fails_the_batch_with_s04s_message(tiny):
    """A row of NaN logits (put in through the runner seam) is S04's ValueError, as in S06."""
    name, hf, model, *_ = tiny

    class NaNRow(BatchRunner):
        def step(self, ids, positions, active):
            logits = super().step(ids, positions, active)
            logits[1, 3] = float("nan")
            return logits

    engine = type("NaNEngine", (Engine,), {"runner_class": NaNRow})(model, IdTokenizer(), CONTEXT)
    with pytest.raises(ValueError, match="logits must not contain NaN or"):
        engine.generate([text(PROMPTS[2]), text(PROMPTS[4])], greedy(NEW))
    with pytest.raises(ValueError, match="logits must not contain NaN or"):
        engine.generate([text(PROMPTS[2]), text(PROMPTS[4])],
                        s04.SamplingParams(temperature=1.0, seed=1, max_tokens=3))


def sampler_state(seq):
    """What a row's next draws depend on and a step may change: its generator's state, its
    history (seen mask, counts), its last token and how many logprobs it has."""
    sampler = seq.sampler
    copy = lambda t: None if t is None else t.clone()    # noqa: E731 (updated in place)
    return [None if sampler.generator is None else sampler.generator.get_state(),
            copy(sampler.seen), copy(sampler.counts), copy(getattr(sampler, "last_token", None)),
            None if seq.logprobs is None else len(seq.logprobs)]


def same_state(a, b) -> bool:
    return all(x == y if not isinstance(x, torch.Tensor) else torch.equal(x, y)
               for x, y in zip(a, b))


def test_a_failed_step_leaves_every_rows_sampler_as_it_was(tiny):
    """Every row draws on the device before the one copy to the host shows a bad row, so a
    failed `sample_batch` puts back what it changed: each row's generator, history and
    logprobs are exactly as before the call, and the next draws equal those of fresh rows
    with the same seeds (the caller may drop the bad request and go on, as S09 does). The bad
    row is a sampled one between sampled rows, or a plain greedy one; NaN, +inf or no finite
    entry. Crafted logits, so no forward pass runs."""
    name, hf, model, *_ = tiny
    engine = Engine(model, IdTokenizer(), CONTEXT)
    params = [s04.SamplingParams(temperature=1.0, seed=5, frequency_penalty=0.5, max_tokens=4),
              greedy(4),                                                   # plain greedy
              s04.SamplingParams(temperature=0.8, seed=6, max_tokens=4),
              s04.SamplingParams(temperature=1.2, top_k=20, seed=7, logprobs=2, max_tokens=4),
              greedy(4, repetition_penalty=1.3)]                  # no generator, a history
    prompts = [text(PROMPTS[i]) for i in (3, 5, 7, 9, 11)]
    rows, fresh = engine.add_requests(prompts, params), engine.add_requests(prompts, params)
    active = [True] * len(rows)
    noise = torch.Generator().manual_seed(0)
    first = torch.randn(len(rows), V, generator=noise)
    assert engine.sample_batch(first, rows, active)[0] == \
        engine.sample_batch(first, fresh, active)[0]
    for bad_row, bad in ((2, float("nan")), (1, float("inf")), (2, None), (0, float("nan"))):
        logits = torch.randn(len(rows), V, generator=noise)
        broken = logits.clone()
        if bad is None:
            broken[bad_row] = float("-inf")                     # no finite entry
        else:
            broken[bad_row, 3] = bad
        before = [sampler_state(seq) for seq in rows]
        with pytest.raises(ValueError, match="logits must"):
            engine.sample_batch(broken, rows, active)
        assert all(same_state(sampler_state(seq), b) for seq, b in zip(rows, before)), (
            name, bad_row, bad)
        got, _ = engine.sample_batch(logits, rows, active)
        assert got == engine.sample_batch(logits, fresh, active)[0], (name, bad_row, bad)
        assert all(same_state(sampler_state(a), sampler_state(b)) for a, b in zip(rows, fresh))


def test_nan_in_a_finished_row_is_never_read_nor_fed_back(tiny):
    """A finished row's logits are never read: NaN written into every finished row (through
    the `model_step_batch` seam) changes nothing, with every row plain greedy (one batched
    argmax) and with a sampled row next to them; finished rows are fed pad_id, never a flag
    (before the fix the NaN row's flag -2 came back as an input id)."""
    name, hf, model, *_ = tiny
    fed = []

    class Fed(BatchRunner):
        def decode(self, tokens, active=None):
            fed.append((tokens.tolist(), list(active)))
            return super().decode(tokens, active)

    class NaNWhenFinished(Engine):
        runner_class = Fed

        def model_step_batch(self, rows, tokens, active, max_new_tokens):
            logits = super().model_step_batch(rows, tokens, active, max_new_tokens).clone()
            for i, running in enumerate(active):
                if not running:
                    logits[i] = float("nan")
            return logits

    prompts = [text(PROMPTS[i]) for i in (3, 12, 0)]
    sampled = s04.SamplingParams(temperature=1.0, seed=4, max_tokens=6)
    for invariant in (False, True):
        for params in ([greedy(1), greedy(6), greedy(3)], [greedy(1), sampled, greedy(3)]):
            fed.clear()
            want = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=invariant).generate(
                prompts, params)
            got = NaNWhenFinished(model, IdTokenizer(), CONTEXT,
                                  batch_invariant=invariant).generate(prompts, params)
            assert [c.token_ids for c in got] == [c.token_ids for c in want], (name, invariant)
            # A finished row is fed pad_id (its last token once, in the step after it ended).
            assert fed and all(t in (PAD, got[i].token_ids[-1]) for tokens, active in fed
                               for i, (t, running) in enumerate(zip(tokens, active))
                               if not running)


def test_a_bad_row_is_named_by_index_and_uses_no_request_id(tiny):
    """Every row's params are checked before the first Sequence is made: a bad one names its
    index, and the failed call takes no request id (the next call's ids start where they
    would have)."""
    name, hf, model, *_ = tiny

    @dataclass(frozen=True)
    class LaterParams(s04.SamplingParams):        # a later chapter's field, set in one row
        beam_width: int = 1

    engine = NeverRuns(model, IdTokenizer(), CONTEXT)
    prompts = ["1 2", "3", "4 5 6", "7"]
    for params, message in [
            ([greedy(NEW)] * 2 + [greedy(NEW, stop_token_ids=[V])] + [greedy(NEW)],
             r"^params\[2\]: stop_token_ids must lie in \[0, V=97\)"),
            ([greedy(NEW), LaterParams(beam_width=4), greedy(NEW), greedy(NEW)],
             r"^params\[1\]: this engine does not implement \['beam_width'\]")]:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, params)
        assert engine._request_count == 0
    with pytest.raises(ValueError, match=r"^stop_token_ids must lie in"):   # one for all rows
        engine.generate(prompts, greedy(NEW, stop_token_ids=[V]))
    seqs = Engine(model, IdTokenizer(), CONTEXT).add_requests(prompts, greedy(NEW))
    assert [seq.request_id for seq in seqs] == ["0", "1", "2", "3"]


# --- streams: interleaved, interrupted, closed -----------------------------------------------

def test_interleaved_streams_give_what_each_gives_alone(tiny):
    """Each batch has its own runner and cache: streams of one engine advanced in turns (equal
    and different batch sizes and lengths, a Part I single-prompt stream among them, one
    stream started and then dropped) give exactly what each gives run alone, in both modes."""
    name, hf, model, *_ = tiny
    a = [text(PROMPTS[i]) for i in (3, 12, 0)]
    b = [text(PROMPTS[i]) for i in (20, 1, 7)]                # same size, other lengths
    c = [text(PROMPTS[i]) for i in (5, 28)]                   # another size
    single = text(PROMPTS[9])
    params = [greedy(6), greedy(4), s04.SamplingParams(temperature=1.0, seed=2, max_tokens=5)]
    for invariant in (False, True):
        engine = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=invariant)

        def ids(result):
            return ([r.token_ids for r in result] if isinstance(result, list)
                    else result.token_ids)

        alone = [ids(engine.generate(a, params)), ids(engine.generate(b, params)),
                 ids(engine.generate(c, greedy(7))), ids(engine.generate(single, greedy(5)))]
        streams = [engine.stream(a, params), engine.stream(b, params),
                   engine.stream(c, greedy(7)), engine.stream(single, greedy(5))]
        assert [ids(r) for r in run_in_turns(streams)] == alone, (name, invariant)
        first = engine.stream(a, params)
        next(first)
        dropped = engine.stream(c, greedy(7))
        next(dropped), next(dropped)
        del dropped
        assert ids(run_in_turns([first])[0]) == alone[0]


def test_an_interrupted_or_closed_stream_says_so_and_frees_its_cache(tiny):
    """A KeyboardInterrupt inside a step ends the batch: `result` says it was interrupted
    (not "iterate it to the end", which could never be done) and iterating again yields
    nothing. `close()` ends a batch early the same way. Either way the cache is freed, and
    the engine's next batch is unaffected. `last_batch` is set when `stream` is called."""
    name, hf, model, *_ = tiny
    runners = []

    class Kept(BatchRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runners.append(self)

    class Interrupted(Engine):
        runner_class = Kept
        calls = 0

        def model_step_batch(self, *args):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            return super().model_step_batch(*args)

    prompts = [text(PROMPTS[i]) for i in (3, 12)]
    engine = Interrupted(model, IdTokenizer(), CONTEXT)
    want = Engine(model, IdTokenizer(), CONTEXT).generate(prompts, greedy(5))
    stream = engine.stream(prompts, greedy(5))
    assert engine.last_batch is stream.stats               # set at the call, not at next()
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    assert list(stream) == [] and runners[-1].cache is None
    with pytest.raises(ValueError, match="the batch was interrupted, so it has no result: "
                                         "KeyboardInterrupt"):
        stream.result
    assert [r.token_ids for r in engine.generate(prompts, greedy(5))] == \
        [r.token_ids for r in want]
    stream = engine.stream(prompts, greedy(5))
    next(stream)
    assert runners[-1].cache is not None
    stream.close()
    assert runners[-1].cache is None and list(stream) == []
    with pytest.raises(ValueError, match="the batch was closed before it finished"):
        stream.result
    stream = engine.stream(prompts, greedy(5))
    list(stream)
    stream.close()                                  # after the end: the result stays
    assert [r.token_ids for r in stream.result] == [r.token_ids for r in want]
    before = engine.last_batch
    engine.stream(prompts[0], 3)                    # Part I's single prompt: the same rule
    assert engine.last_batch is not before and engine.last_batch.steps == []


def test_cli_checks_the_batch_size_before_loading_the_model(capsys):
    for argv, message in [
            (["--num-prompts", "5", "--max-batch-size", "4"],
             "5 requests (--num-prompts) do not fit one batch of --max-batch-size 4"),
            (["--prompt", "a", "--prompt", "b", "--max-batch-size", "1"],
             "2 requests (--prompt flags) do not fit one batch of --max-batch-size 1"),
            (["--max-batch-size", "0"], "--max-batch-size must be >= 1")]:
        with pytest.raises(SystemExit):     # a model that does not exist: never reached
            main(["--model", "/nonexistent/model"] + argv)
        assert message in capsys.readouterr().err


# --- seeds, the tolerance rule, batch variance -----------------------------------------------

def test_seeded_samples_do_not_depend_on_batch_mates(tiny):
    name, hf, model, *_ = tiny
    request = text(PROMPTS[9])
    params = s04.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=NEW, seed=42)
    alone = s06.Engine(model, IdTokenizer(), CONTEXT).generate(request, params)
    for invariant in (True, False):
        engine = Engine(model, IdTokenizer(), CONTEXT, batch_invariant=invariant)
        for mates in ([], [3], [28, 0, 15], list(range(20))):
            batch = [text(PROMPTS[i]) for i in mates] + [request]
            mate_params = [s04.SamplingParams(temperature=0.7, max_tokens=4, seed=i)
                           for i in mates] + [params]
            got = engine.generate(batch, mate_params)[-1]
            assert got.token_ids == alone.token_ids, (name, invariant, mates)


def completion(ids, finish="length"):
    return s01.Completion("0", text(ids), list(ids), finish, None, None, None)


def test_the_batch_rule_by_hand():
    ref = completion([4, 5, 6, 7])
    gaps = [0.5, 0.2, 1e-4, 0.3]          # the third step is a near-tie at tolerance 1e-3
    assert first_close_call(gaps, 1e-3) == 2 and first_close_call([1.0, 2.0], 1e-3) == 2
    assert follows_batch_rule(completion([4, 5, 6, 7]), ref, 1e-3, gaps)
    assert follows_batch_rule(completion([4, 5, 9, 1]), ref, 1e-3, gaps)   # may flip at step 2
    assert not follows_batch_rule(completion([4, 8, 6, 7]), ref, 1e-3, gaps)
    wide = [0.5, 0.2, 0.1, 0.3]
    assert not follows_batch_rule(completion([4, 5, 9, 1]), ref, 1e-3, wide)
    assert not follows_batch_rule(completion([4, 5, 6, 7], "stop"), ref, 1e-3, wide)
    with pytest.raises(ValueError, match="logprobs >= 2"):
        top2_gaps(ref)


@bundled
def test_batch_variance_is_measured_and_within_the_rule(bundled_model):
    model, tokenizer = bundled_model
    table = measure_batch_variance(model, tokenizer, BUNDLED_PROMPTS, [1, 3, 8], max_tokens=6)
    assert [r.batch_size for r in table] == [1, 3, 8]
    for row in table:
        assert row.rule_holds and row.steps_compared == row.batch_size * 6
        assert row.max_abs_diff < BATCH_TOLERANCE[torch.float32] / 20
    assert "max |dlogit|" in format_variance_table(table)


# --- main -----------------------------------------------------------------------------------

@bundled
@pytest.mark.slow
def test_main_prints_each_completion_in_order_and_the_waste_table(capsys):
    main(["--device", "cpu", "--prompt", "Romeo.", "--prompt", "To be, or not",
          "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert out.index("request 0: prompt") < out.index("Romeo.") < out.index("request 1")
    assert "token slots computed" in out and "prefill" in out and "'P' prompt" in out
    main(["--device", "cpu", "--num-prompts", "3", "--max-tokens", "4", "--batch-invariant"])
    out = capsys.readouterr().out
    assert "batch-invariant (every row alone) mode" in out and "request 2" in out
    # Rows computed alone, real tokens only: no padding or idle slot, so no waste table.
    assert "all useful: each row ran alone" in out and "masked keys" not in out


# --- CUDA (skipped without a GPU) ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_batch_follows_the_rule_against_the_cuda_reference(tiny, dtype):
    name, hf, model, references, directory = tiny
    cuda_model = s06.TorchTransformer.from_pretrained(directory, "cuda", dtype)
    batch = [text(PROMPTS[i]) for i in BATCHES[32]]
    params = greedy(NEW, logprobs=2)
    fast = Engine(cuda_model, IdTokenizer(), CONTEXT).generate(batch, params)
    ref = Engine(cuda_model, IdTokenizer(), CONTEXT, batch_invariant=True).generate(batch, params)
    assert all(follows_batch_rule(f, r, BATCH_TOLERANCE[dtype]) for f, r in zip(fast, ref))
    if dtype == torch.float32:   # and the CPU's S05 tokens, by the same rule
        for i, f, r in zip(BATCHES[32], fast, ref):
            assert follows_batch_rule(f, references[i][0], BATCH_TOLERANCE[dtype], top2_gaps(r))


def test_the_chapters_real_scale_arithmetic():
    """The Motivation's Deep dive: Llama-3-8B's published shape in bfloat16, one decode step at
    B = 1 and B = 64 with 2,048 positions of context, counted by S07's cost functions and checked
    against the closed forms the chapter writes out (no GPU: arithmetic only)."""
    import s07_roofline
    cfg = s03.TransformerConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
        max_position_embeddings=8192, norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0)
    assert s03.parameter_count(cfg) == 8_030_261_248
    kv_per_token = 2 * 32 * 8 * 128 * 2                  # K and V, L, Hkv, D, bf16 bytes
    assert kv_per_token == 128 * 1024
    assert 64 * 2048 * kv_per_token == 16 * 2**30         # 17.18 GB
    bandwidth, flops = 3.35e12, 989e12                   # H100 SXM datasheet
    weights = s07_roofline.decode_step_cost(cfg, 1, dtype_bytes=2).bytes
    assert round(weights / 1e9, 2) == 15.01 and round(weights / bandwidth * 1e3, 2) == 4.48
    one = s07_roofline.batched_decode_cost(cfg, 1, 2048, dtype_bytes=2)
    many = s07_roofline.batched_decode_cost(cfg, 64, 2048, dtype_bytes=2)
    assert many.bytes - one.bytes == 63 * (2048 * kv_per_token + 2 * 4096)   # + embedding rows
    assert round(many.bytes / 1e9, 2) == 32.19 and round(many.flops / 1e12, 2) == 1.03
    assert round(many.bytes / bandwidth * 1e3, 2) == 9.61
    assert round(many.flops / flops * 1e3, 2) == 1.04
    assert round(one.bytes / 1e9, 2) == 15.28 and round(one.bytes / bandwidth * 1e3, 2) == 4.56
    ratio = (64 / many.bytes) / (1 / one.bytes)
    assert round(64 * bandwidth / many.bytes) == 6660 and round(bandwidth / one.bytes) == 219
    assert round(ratio, 1) == 30.4
