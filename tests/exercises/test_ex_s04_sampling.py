"""Graded tests for the S04 exercises (see exercises/s04_sampling.py).

Oracles: hand-computed values (worked in the comments); Hugging Face transformers'
`TypicalLogitsWarper` and `NoRepeatNGramLogitsProcessor` on random logits and its `generate()`
with `no_repeat_ngram_size` on a tiny random Qwen3 (run here by S03's NumPy model); torch's
log_softmax of the HF model's logits; and the chapter's tested Engine (its raw logprobs).
"""
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (NoRepeatNGramLogitsProcessor,
                                                    TypicalLogitsWarper)

from exercise_loader import load_exercise
from s04_sampling import Engine, SamplingParams

ex = load_exercise("s04_sampling")


def f32(values):
    return np.array(values, dtype=np.float32)


def kept(row):
    return set(np.flatnonzero(np.isfinite(row)).tolist())


# Exercise 1 ----------------------------------------------------------------------------------

HALVES = f32(np.log([0.5, 0.25, 0.125, 0.125]))
# H = 0.5 ln2 + 0.25 (2 ln2) + 2 (0.125)(3 ln2) = 1.75 ln2; -log p = (1, 2, 3, 3) ln2, so the
# scores |-log p - H| are (0.75, 0.25, 1.25, 1.25) ln2: typical order 1, 0, {2, 3}, with mass
# before each 0, 0.25, 0.75 (and 0.875).


TYPICAL_BY_HAND = [
    (0.2, {1}),           # 0 < 0.2 keeps token 1; 0.25 >= 0.2 stops: the argmax (token 0) goes
    (0.3, {0, 1}),        # 0.25 < 0.3 keeps token 0 too; 0.75 >= 0.3 stops
    (0.5, {0, 1}),        # 0.25 < 0.5 keeps token 0; 0.75 >= 0.5 stops
    (0.8, {0, 1, 2, 3}),  # 0.75 < 0.8 keeps token 2, and token 3 ties with it
    (1.0, {0, 1, 2, 3}),  # disabled
    (1e-9, {1}),          # the most typical token is always kept
]


@pytest.mark.points(1)
def test_typical_p_by_hand():
    for typical_p, expected in TYPICAL_BY_HAND:
        row = HALVES.copy()
        out = ex.apply_typical_p(row, typical_p)
        assert kept(out) == expected, f"typical_p={typical_p}"
        assert out.dtype == np.float32 and out.shape == (4,)
        np.testing.assert_array_equal(out[sorted(expected)], HALVES[sorted(expected)])
        np.testing.assert_array_equal(row, HALVES)  # the caller's array is untouched


@pytest.mark.points(1)
def test_typical_p_matches_hf():
    for seed in range(5):
        logits = (np.random.default_rng(seed).standard_normal(300) * 2.5).astype(np.float32)
        for typical_p in (0.05, 0.3, 0.7, 0.95):
            warper = TypicalLogitsWarper(mass=typical_p)
            hf = warper(None, torch.from_numpy(logits)[None, :])[0].numpy()
            assert kept(ex.apply_typical_p(logits, typical_p)) == kept(hf), (seed, typical_p)


@pytest.mark.points(1)
def test_typical_p_edges():
    # All-equal logits: every score is 0, all tie, all are kept whatever typical_p is.
    assert kept(ex.apply_typical_p(np.zeros(7, np.float32), 0.1)) == set(range(7))
    # -inf entries stay removed and take no part: the rest is HALVES again.
    row = f32([HALVES[0], -np.inf, HALVES[1], HALVES[2], -np.inf, HALVES[3]])
    out = ex.apply_typical_p(row, 0.5)
    assert kept(out) == {0, 2} and np.isposinf(out).sum() == 0 and not np.isnan(out).any()
    # One token only: kept.
    assert kept(ex.apply_typical_p(f32([3.0]), 0.01)) == {0}
    for bad in (0, -0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"typical_p must be a number in \(0, 1\]"):
            ex.apply_typical_p(HALVES, bad)
    with pytest.raises(ValueError):
        ex.apply_typical_p(f32([np.nan, 1.0]), 0.5)


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_banned_tokens_by_hand():
    ids = [5, 6, 7, 5, 6]
    assert ex.banned_tokens(ids, 3) == {7}      # (5, 6, 7) occurred; the context ends in 5, 6
    assert ex.banned_tokens(ids, 2) == {7}      # (6, 7) occurred; the context ends in 6
    assert ex.banned_tokens(ids, 4) == set()    # no earlier 4-gram starts with (7, 5, 6)
    assert ex.banned_tokens(ids, 1) == {5, 6, 7}
    assert ex.banned_tokens([1, 2, 1, 3, 1], 2) == {2, 3}  # two earlier bigrams start with 1
    assert ex.banned_tokens([4], 3) == set() and ex.banned_tokens([4, 4], 3) == set()
    assert ex.banned_tokens([4, 4, 4], 3) == {4}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="no_repeat_ngram_size must be an int >= 1"):
            ex.banned_tokens(ids, bad)


@pytest.mark.points(1)
def test_no_repeat_ngram_matches_hf_and_rules_out_everything():
    removed = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist()  # n-grams do repeat
        logits = rng.standard_normal(10).astype(np.float32)
        for n in (1, 2, 3, 4):
            processor = NoRepeatNGramLogitsProcessor(n)
            hf = processor(torch.tensor([ids]), torch.from_numpy(logits)[None, :])[0].numpy()
            out = ex.apply_no_repeat_ngram(logits, ids, n)
            np.testing.assert_array_equal(out, hf, err_msg=f"seed={seed}, n={n}")
            removed += int(np.isneginf(out).sum())
    assert removed > 0  # the cases did ban something
    with pytest.raises(ValueError, match="ruled out every token"):
        ex.apply_no_repeat_ngram(f32([1.0, 2.0]), [0, 1, 0], 1)


class IdTokenizer:
    """Prompts are token ids written as text ("5 17 3"): the tiny model has no tokenizer.
    vocab_size is the tiny model's V (the engine checks that the tokenizer covers its ids)."""

    vocab_size = 23

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """(HF Qwen3 model, S03 Transformer loaded from the same checkpoint), V = 23.

    A small vocabulary and spread-out weights make greedy decoding fall into loops, which is
    what a no-repeat rule is for.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import s03_transformer as s03
    config = Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=23,
                         max_position_embeddings=96, tie_word_embeddings=True, eos_token_id=0,
                         pad_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(11)
    hf_model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("tiny_qwen3_ex")
    hf_model.save_pretrained(directory)
    return hf_model, s03.Transformer.from_pretrained(directory)


PROMPT_IDS = [5, 17, 3, 9, 8]
PROMPT = " ".join(map(str, PROMPT_IDS))
NO_EOS = 22  # an id the model is never asked to stop on, so every run spends its budget


def hf_greedy(model, ids, **kwargs):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, pad_token_id=1,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             eos_token_id=NO_EOS, **kwargs)
    return out[0, len(ids):].tolist()


def ngrams(seq, n):
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


@pytest.mark.points(1)
def test_engine_greedy_equals_hf_no_repeat_ngram_size(tiny_qwen3):
    hf_model, model = tiny_qwen3
    plain = hf_greedy(hf_model, PROMPT_IDS, max_new_tokens=30)
    for n in (2, 3):
        assert len(set(ngrams(PROMPT_IDS + plain, n))) < len(ngrams(PROMPT_IDS + plain, n)), \
            "the plain greedy run should repeat an n-gram, or this test proves nothing"
        expected = hf_greedy(hf_model, PROMPT_IDS, max_new_tokens=30, no_repeat_ngram_size=n)
        engine = ex.NoRepeatNGramEngine(model, IdTokenizer(eos_id=NO_EOS), max_context=96,
                                        no_repeat_ngram_size=n)
        ours = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))
        assert ours.token_ids == expected, f"n={n}"
        grams = ngrams(PROMPT_IDS + ours.token_ids, n)
        assert len(set(grams)) == len(grams)  # no n-gram occurs twice
        assert engine.no_repeat_ngram_size == n


@pytest.mark.points(1)
def test_engine_keeps_seeds_and_validates(tiny_qwen3):
    _, model = tiny_qwen3
    engine = ex.NoRepeatNGramEngine(model, IdTokenizer(eos_id=NO_EOS), 96, 2)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    first, again = engine.generate(PROMPT, params), engine.generate(PROMPT, params)
    assert first.token_ids == again.token_ids
    grams = ngrams(PROMPT_IDS + first.token_ids, 2)
    assert len(set(grams)) == len(grams)
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be an int >= 1"):
        ex.NoRepeatNGramEngine(model, IdTokenizer(eos_id=NO_EOS), 96, 0)


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_prompt_logprobs_match_torch(tiny_qwen3):
    hf_model, model = tiny_qwen3
    ids = [5, 17, 3, 9, 8, 8, 2, 14]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]          # (T, V)
    logp = torch.log_softmax(logits.double(), dim=-1)
    expected = [None] + [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    got = ex.prompt_logprobs(model, ids)
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose(got[1:], expected[1:], atol=1e-4)


@pytest.mark.points(1)
def test_prompt_logprobs_agree_with_the_engines_own_logprobs(tiny_qwen3):
    # Score prompt + greedy completion in one pass; the engine reported the same numbers
    # (raw logprobs) one pass per token.
    _, model = tiny_qwen3
    engine = Engine(model, IdTokenizer(eos_id=NO_EOS), max_context=96)
    done = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, logprobs=0))
    scored = ex.prompt_logprobs(model, PROMPT_IDS + done.token_ids)
    np.testing.assert_allclose(scored[len(PROMPT_IDS):], [lp.logprob for lp in done.logprobs],
                               atol=1e-4)
    calls = []

    class Counting:
        vocab_size = model.vocab_size

        def forward(self, ids):
            calls.append(len(ids))
            return model.forward(ids)

    ex.prompt_logprobs(Counting(), PROMPT_IDS + done.token_ids)
    assert calls == [len(PROMPT_IDS) + 10]  # one pass over the whole text


@pytest.mark.points(1)
def test_perplexity_and_bad_input():
    assert ex.perplexity([None, math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8))
    assert ex.perplexity([math.log(0.1)] * 5) == pytest.approx(10.0)  # uniform over 10: 10
    for bad in ([], [None], [0.3], [float("nan")]):
        with pytest.raises(ValueError):
            ex.perplexity(bad)
    model = type("M", (), {"vocab_size": 3, "forward": lambda self, ids: None})()
    for bad in ([], [0, 3], [-1]):
        with pytest.raises(ValueError):
            ex.prompt_logprobs(model, bad)
