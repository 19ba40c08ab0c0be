"""Tests for chapter S04: SamplingParams, the processors, sampling, seeds, logprobs, the Engine.

Oracles: hand-computed vectors (every boundary of SamplingParams); Hugging Face transformers'
own logits processors and warpers on random logits, and its `generate()` (greedy with
repetition penalty / min_new_tokens) on a tiny random Qwen3 and on the bundled model; torch's
log_softmax for logprobs; closed-form distributions checked with a chi-square statistic whose
critical values are checked against closed forms too; S02's stop-string matcher against a
character-by-character search written here; and the S01 and S02 engines for greedy parity (the
loop is S01's: this chapter only overrides its `sample`, `make_sequence` and `filter_text`).
"""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

import s01_generation_loop as s01
import s02_tokenizer as s02
import s03_checkpoint
from s01_generation_loop import Completion
from s04_sampling import (
    Engine, SamplingParams, TokenLogprobs, apply_min_p, apply_min_tokens,
    apply_presence_frequency_penalties, apply_repetition_penalty, apply_temperature, apply_top_k,
    apply_top_p, compute_logprobs, draw, process_logits, sample,
)

INF = np.inf


def f32(values):
    return np.array(values, dtype=np.float32)


def kept(row):
    """Indices of the tokens a processor left in play (finite logits)."""
    return set(np.flatnonzero(np.isfinite(row)).tolist())


# --- SamplingParams -------------------------------------------------------------------------

def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert (p.ignore_eos, p.seed, p.logprobs) == (False, None, None)


def test_params_are_frozen_and_normalised():
    p = SamplingParams(stop="\n", stop_token_ids=[3, 4])
    assert p.stop == ("\n",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    none = SamplingParams(stop=None, stop_token_ids=None)  # what a JSON null arrives as
    assert none.stop == () and none.stop_token_ids == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    assert {p: "ok"}[SamplingParams(stop=("\n",), stop_token_ids=(3, 4))] == "ok"  # hashable


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=float("nan")), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=float("inf")), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature="1"), r"temperature must be a number"),
    (dict(top_k=-2), r"top_k must be an int >= -1"),
    (dict(top_k=2.0), r"top_k must be an int >= -1"),
    (dict(top_k=True), r"top_k must be an int >= -1"),
    (dict(top_p=-0.01), r"top_p must be a number in \[0, 1\]"),
    (dict(top_p=1.01), r"top_p must be a number in \[0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
    (dict(min_p=1.5), r"min_p must be a number in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a number in \(0, inf\)"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be a number in \(0, inf\)"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1"),
    (dict(max_tokens=3.0), r"max_tokens must be an integer >= 1"),
    (dict(min_tokens=-1), r"min_tokens must be an int in \[0, max_tokens=16\]"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be an int in \[0, max_tokens=4\]"),
    (dict(stop=[""]), r"stop strings must be non-empty strings"),
    (dict(stop=""), r"stop strings must be non-empty strings"),
    (dict(stop=[1]), r"stop strings must be non-empty strings"),
    (dict(stop=["\ud800"]), r"stop strings must be valid Unicode without lone surrogates"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be a sequence of ints >= 0"),
    (dict(stop_token_ids="ab"), r"stop_token_ids must be a sequence of ints >= 0"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a sequence of ints >= 0"),
    (dict(stop_token_ids=0), r"stop_token_ids must be a sequence of ints >= 0"),
    (dict(stop=0), r"stop must be a string, an iterable of strings or None"),
    (dict(ignore_eos="yes"), r"ignore_eos must be a bool"),
    (dict(seed=-1), r"seed must be None or an int in \[0, 2\*\*63\)"),
    (dict(seed=1.5), r"seed must be None or an int in \[0, 2\*\*63\)"),
    (dict(seed=2**63), r"seed must be None or an int in \[0, 2\*\*63\)"),   # torch's limit
    (dict(seed=2**70), r"seed must be None or an int in \[0, 2\*\*63\)"),
    (dict(seed=True), r"seed must be None or an int in \[0, 2\*\*63\)"),
    (dict(temperature=100.001), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=1e39), r"temperature must be a number in \[0, 100\]"),
    (dict(logprobs=-1), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\]"),
])
def test_invalid_params_name_the_parameter_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(top_k=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.0),
    dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(min_tokens=16), dict(logprobs=0), dict(logprobs=20), dict(seed=0),
    dict(seed=2**63 - 1), dict(temperature=100.0), dict(temperature=5e-324),
])
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_iterables_are_read_once_before_they_are_checked():
    """A generator used to be checked (consumed) first and stored empty: no stop rule at all."""
    p = SamplingParams(stop=(s for s in ["x", "y"]), stop_token_ids=(i for i in [1, 2]))
    assert (p.stop, p.stop_token_ids) == (("x", "y"), (1, 2))
    assert SamplingParams(stop=iter(["\n"])).stop == ("\n",)
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        SamplingParams(stop=(s for s in ["x", ""]))
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence of ints >= 0"):
        SamplingParams(stop_token_ids=(i for i in [1, -1]))
    with pytest.raises(ValueError, match="stop must be a string, an iterable of strings or None"):
        SamplingParams(stop=b"\n")


# --- processors on hand-computed vectors ----------------------------------------------------

def test_temperature_by_hand():
    np.testing.assert_array_equal(apply_temperature(f32([1, 2, 3]), 0.5), f32([-4, -2, 0]))
    np.testing.assert_array_equal(apply_temperature(f32([1, 2, 3]), 2.0), f32([-1, -0.5, 0]))


def test_tiny_temperature_is_finite_and_puts_all_mass_on_the_argmax():
    out = apply_temperature(f32([1, 2, 3, -INF]), 1e-6)
    assert out[2] == 0 and out[3] == -INF and np.isfinite(out[:3]).all()
    with np.errstate(all="raise"):  # no overflow, no invalid operation, even with huge logits
        huge = apply_temperature(f32([3e38, -3e38, 0]), 1e-6)
    assert huge.tolist() == [0.0, -INF, -INF]
    gen = np.random.default_rng(0)
    params = SamplingParams(temperature=1e-6)
    assert {sample(f32([1, 2, 3, -INF]), params, gen) for _ in range(50)} == {2}


def test_temperature_below_float32s_range_samples_among_the_tied_maxima():
    """1e-50 is 0 in float32: dividing by float32(T) gave 0 / 0 = NaN at the max and a bare
    AssertionError in draw. Divided in float64, every gap becomes -inf and the max stays 0."""
    params = SamplingParams(temperature=1e-50)
    assert process_logits(f32([1, 2, 3, 0.5]), params).tolist() == [-INF, -INF, 0.0, -INF]
    gen = np.random.default_rng(0)
    assert {sample(f32([1, 2, 3, 0.5]), params, gen) for _ in range(50)} == {2}
    # T -> 0 is uniform over the tokens tied at the max (greedy would always say 0).
    tied = [sample(f32([3, 1, 3]), SamplingParams(temperature=5e-324), gen) for _ in range(400)]
    assert set(tied) == {0, 2} and 150 < tied.count(0) < 250   # Binomial(400, 1/2): +-5 sd


def test_the_largest_temperature_keeps_the_order_of_the_logits():
    """At T = 100 the scaled gaps are hand-computable: (l - 3) / 100. top_k=2 keeps ids 1 and 2
    (T = 1e39, now refused, rounded every gap to 0 and let id 0 through), min_tokens leaves
    -inf at -inf (not NaN), and the probabilities are e^(gap) normalised."""
    logits = f32([1, 2, 3, 0.5])
    out = process_logits(logits, SamplingParams(temperature=100.0))
    np.testing.assert_allclose(out, [-0.02, -0.01, 0.0, -0.025], rtol=1e-6)
    out = process_logits(logits, SamplingParams(temperature=100.0, top_k=2))
    assert kept(out) == {1, 2}
    gen = np.random.default_rng(1)
    assert {sample(logits, SamplingParams(temperature=100.0, top_k=2), gen)
            for _ in range(200)} == {1, 2}
    out = process_logits(logits, SamplingParams(temperature=100.0, min_tokens=1), eos_ids=[0])
    assert not np.isnan(out).any() and out[0] == -INF and kept(out) == {1, 2, 3}


def test_draw_rejects_a_row_that_is_not_a_distribution():
    """draw used to end in `assert token < cdf.size` (a bare AssertionError) on NaN."""
    gen = np.random.default_rng(0)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0)):
        with pytest.raises(ValueError, match="must not contain NaN or \\+inf"):
            draw(f32([np.nan, 0.0]), params, gen)
        with pytest.raises(ValueError, match="at least one finite entry"):
            draw(f32([-INF, -INF]), params, gen)


def test_all_equal_logits_stay_uniform():
    out = apply_temperature(f32([5, 5, 5, 5]), 1e-6)
    assert out.tolist() == [0, 0, 0, 0]
    assert process_logits(f32([5] * 4), SamplingParams(top_k=2)).tolist() == [0, 0, 0, 0]


def test_top_k_by_hand():
    assert kept(apply_top_k(f32([1, 3, 2, 4]), 2)) == {1, 3}
    assert kept(apply_top_k(f32([1, 3, 2, 4]), 1)) == {3}
    for disabled in (0, -1, 4, 5, 10_000):  # 0 / -1 disable; so does any k >= V
        np.testing.assert_array_equal(apply_top_k(f32([1, 3, 2, 4]), disabled), f32([1, 3, 2, 4]))


def test_top_k_keeps_ties_with_the_kth_value():
    assert kept(apply_top_k(f32([1, 2, 2, 3]), 2)) == {1, 2, 3}
    assert kept(apply_top_k(f32([3, 3, 1]), 1)) == {0, 1}


def test_top_k_leaves_minus_inf_entries_and_values_alone():
    out = apply_top_k(f32([0, -INF, -INF, 1]), 3)  # only 2 finite tokens: nothing to remove
    np.testing.assert_array_equal(out, f32([0, -INF, -INF, 1]))
    out = apply_top_k(f32([0.5, -1, 2, -INF]), 2)
    np.testing.assert_array_equal(out, f32([0.5, -INF, 2, -INF]))


# Probabilities 0.3, 0.5, 0.05, 0.15 for ids 0..3: sorted 0.5 (id 1), 0.3 (id 0), 0.15 (id 3),
# 0.05 (id 2); the mass before each is 0, 0.5, 0.8, 0.95.
SKEWED = np.log(f32([0.3, 0.5, 0.05, 0.15]))


@pytest.mark.parametrize("top_p, expected", [
    (0.0, {1}),            # 0 keeps the most likely token
    (1e-6, {1}),           # so does a tiny value
    (0.4, {1}),
    (0.55, {1, 0}),        # id 0 crosses 0.55 and is kept
    (0.85, {1, 0, 3}),
    (0.99, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),   # disabled
])
def test_top_p_by_hand(top_p, expected):
    assert kept(apply_top_p(SKEWED, top_p)) == expected


@pytest.mark.parametrize("top_p, expected", [
    (0.25, {0}),                # reaching top_p exactly: the token that reaches it is the last
    (0.2500001, {0, 1}),
    (0.5, {0, 1}),
    (0.75, {0, 1, 2}),
    (0.7500001, {0, 1, 2, 3}),
])
def test_top_p_exact_boundaries_on_uniform_logits(top_p, expected):
    # softmax of four zeros is exactly 0.25 each and the running sums are exact in binary, so
    # these are true boundaries. Equal probabilities are taken lowest id first.
    assert kept(apply_top_p(f32([0, 0, 0, 0]), top_p)) == expected


def test_top_p_ignores_minus_inf_entries():
    assert kept(apply_top_p(f32([0, -INF, 0, -INF]), 0.6)) == {0, 2}


def test_min_p_by_hand():
    # p = 0.3, 0.5, 0.05, 0.15 (SKEWED). min_p 0.4 -> threshold 0.2; 0.55 -> 0.275; 0.65 -> 0.325
    assert kept(apply_min_p(SKEWED, 0.4)) == {0, 1}
    assert kept(apply_min_p(SKEWED, 0.25)) == {0, 1, 3}
    assert kept(apply_min_p(SKEWED, 0.65)) == {1}
    np.testing.assert_array_equal(apply_min_p(SKEWED, 0.0), SKEWED)


def test_min_p_one_keeps_the_top_token_and_its_ties():
    assert kept(apply_min_p(f32([2, 2, 1, -INF]), 1.0)) == {0, 1}


def test_repetition_penalty_by_hand():
    logits = f32([2, -2, 0, 1])
    seen = [0, 1, 2, 0]  # id 0 twice: penalised once
    np.testing.assert_array_equal(apply_repetition_penalty(logits, seen, 2.0), f32([1, -4, 0, 1]))
    np.testing.assert_array_equal(apply_repetition_penalty(logits, seen, 0.5), f32([4, -1, 0, 1]))
    np.testing.assert_array_equal(apply_repetition_penalty(logits, seen, 1.0), logits)
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [], 2.0), logits)


def test_presence_and_frequency_penalties_by_hand():
    out = apply_presence_frequency_penalties(f32([1, 1, 1, 1]), [0, 0, 2], 0.5, 0.25)
    np.testing.assert_array_equal(out, f32([0, 1, 0.25, 1]))  # 1 - 2*0.25 - 0.5; 1 - 0.25 - 0.5
    out = apply_presence_frequency_penalties(f32([1, -INF, 1]), [1, 2], -1.0, 0.0)
    np.testing.assert_array_equal(out, f32([1, -INF, 2]))     # negative values encourage


def test_presence_and_frequency_ignore_the_prompt_repetition_does_not():
    params = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=1.0)
    out = process_logits(f32([1, 1, 1]), params, prompt_ids=[0], output_ids=[])
    np.testing.assert_array_equal(out, f32([1, 1, 1]))
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = process_logits(f32([1, 1, 1]), params, prompt_ids=[0], output_ids=[2])
    np.testing.assert_array_equal(out, f32([0.5, 1, 0.5]))


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    logits = f32([5, 1, 4, 3])
    out = process_logits(logits, params, output_ids=[3], eos_ids=[0])
    np.testing.assert_array_equal(out, f32([-INF, 1, -INF, 3]))
    np.testing.assert_array_equal(process_logits(logits, params, output_ids=[3, 3], eos_ids=[0]),
                                  logits)
    ignore = dataclasses.replace(params, ignore_eos=True)  # EOS is then an ordinary token
    np.testing.assert_array_equal(process_logits(logits, ignore, output_ids=[3], eos_ids=[0]),
                                  f32([5, 1, -INF, 3]))
    np.testing.assert_array_equal(apply_min_tokens(logits, 0, 1, []), logits)


def test_penalties_act_before_temperature():
    # presence 1 on raw logits [2, 1] with id 0 already generated: [1, 1], equal probabilities
    # at any temperature. Scaling by 1/T = 2 first would give [4, 2] - 1 = [3, 2] instead.
    params = SamplingParams(temperature=0.5, presence_penalty=1.0)
    probs = np.exp(process_logits(f32([2, 1]), params, output_ids=[0]))
    np.testing.assert_allclose(probs / probs.sum(), [0.5, 0.5], rtol=1e-6)


def test_min_p_acts_before_top_p_as_in_vllm_not_after_as_in_hf():
    logits = np.log(f32([0.4, 0.3, 0.2, 0.1]))
    # Ours: min_p 0.6 keeps p >= 0.24 -> {0.4, 0.3} renormalised to {4/7, 3/7}; top_p 0.5 then
    # keeps only id 0 (4/7 > 0.5).
    ours = process_logits(logits, SamplingParams(min_p=0.6, top_p=0.5))
    assert kept(ours) == {0}
    # HF: top_p 0.5 first keeps {0.4, 0.3} (0.4 < 0.5 so 0.3 is kept), then min_p keeps both.
    hf = LogitsProcessorList([TopPLogitsWarper(0.5), MinPLogitsWarper(0.6)])(
        torch.zeros(1, 1, dtype=torch.long), torch.from_numpy(logits)[None])
    assert kept(hf[0].numpy()) == {0, 1}


def test_greedy_is_the_argmax_of_penalised_logits_lowest_id_on_tie():
    gen = np.random.default_rng(0)
    assert sample(f32([1, 3, 3]), SamplingParams(temperature=0), gen) == 1
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(f32([1, 3, 2]), penalised, gen, output_ids=[1]) == 2   # 3 -> 1.5 < 2
    # top_k, top_p, min_p never remove the argmax, so greedy ignores them.
    filtered = SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    assert sample(f32([1, 3, 3]), filtered, gen) == 1


@pytest.mark.parametrize("logits, message", [
    ([[1.0, 2.0]], "non-empty 1-D"),
    ([], "non-empty 1-D"),
    ([1.0, float("nan")], "NaN or \\+inf"),
    ([1.0, float("inf")], "NaN or \\+inf"),
    ([-INF, -INF], "at least one finite entry"),
])
def test_bad_logits(logits, message):
    with pytest.raises(ValueError, match=message):
        process_logits(logits, SamplingParams())


def test_bad_history_ids_and_an_empty_choice():
    with pytest.raises(ValueError, match=r"output_ids must lie in \[0, V=3\)"):
        process_logits(f32([1, 2, 3]), SamplingParams(), output_ids=[3])
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, V=3\)"):
        process_logits(f32([1, 2, 3]), SamplingParams(), prompt_ids=[-1])
    with pytest.raises(ValueError, match=r"stop_token_ids must lie in \[0, V=3\)"):
        process_logits(f32([1, 2, 3]), SamplingParams(stop_token_ids=[7]))
    with pytest.raises(ValueError, match="min_tokens ruled out every token"):
        process_logits(f32([-INF, 0]), SamplingParams(min_tokens=1), eos_ids=[1])
    with pytest.raises(ValueError, match="temperature must be > 0 here"):
        apply_temperature(f32([1, 2]), 0.0)


def test_processors_do_not_edit_the_callers_array():
    logits = f32([1, 2, 3, 4])
    process_logits(logits, SamplingParams(top_k=1, top_p=0.1, min_p=0.5, presence_penalty=1,
                                          repetition_penalty=2), [0], [1, 2], eos_ids=[0])
    np.testing.assert_array_equal(logits, f32([1, 2, 3, 4]))


finite_logits = st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(values=finite_logits, n_inf=st.integers(0, 5),
       temperature=st.sampled_from([5e-324, 1e-50, 1e-6, 0.3, 1.0, 7.0, 100.0]),
       top_k=st.integers(-1, 45), top_p=st.sampled_from([0.0, 1e-6, 0.3, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 1e-6, 0.5, 1.0]), seed=st.integers(0, 2**32))
def test_pipeline_is_finite_keeps_the_argmax_and_never_draws_a_removed_token(
        values, n_inf, temperature, top_k, top_p, min_p, seed):
    logits = f32(values + [-INF] * n_inf)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = process_logits(logits, params)
    assert not np.isnan(out).any() and not np.isposinf(out).any()
    assert np.argmax(logits) in kept(out)
    assert kept(out) <= kept(logits)
    token = draw(out, params, np.random.default_rng(seed))
    assert token in kept(out)


# --- the same result as Hugging Face's processors on random logits ---------------------------

def hf(processor, logits, input_ids=()):
    ids = torch.tensor([list(input_ids) or [0]], dtype=torch.long)
    return processor(ids, torch.from_numpy(logits.copy())[None])[0].numpy()


def random_logits(seed, vocab=1000, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [1e-3, 0.3, 1.0, 2.5])
def test_temperature_matches_hf(seed, temperature):
    logits = random_logits(seed)
    ours = apply_temperature(logits, temperature)
    theirs = hf(TemperatureLogitsWarper(temperature), logits)
    # Ours is theirs shifted by -max (same softmax); compare with both shifted to a max of 0.
    np.testing.assert_allclose(ours, theirs - theirs.max(), rtol=1e-5, atol=1e-5 / temperature)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_k", [1, 2, 10, 999, 1000, 5000])
def test_top_k_matches_hf(seed, top_k):
    logits = random_logits(seed)
    np.testing.assert_array_equal(apply_top_k(logits, top_k), hf(TopKLogitsWarper(top_k), logits))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_hf(seed, top_p):
    logits = random_logits(seed)
    np.testing.assert_array_equal(apply_top_p(logits, top_p), hf(TopPLogitsWarper(top_p), logits))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_p", [1e-4, 0.05, 0.3, 0.9, 1.0])
def test_min_p_matches_hf(seed, min_p):
    logits = random_logits(seed)
    np.testing.assert_array_equal(apply_min_p(logits, min_p), hf(MinPLogitsWarper(min_p), logits))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hf(seed, penalty):
    logits = random_logits(seed)
    seen = np.random.default_rng(100 + seed).integers(0, logits.size, 60).tolist()  # repeats too
    np.testing.assert_array_equal(apply_repetition_penalty(logits, seen, penalty),
                                  hf(RepetitionPenaltyLogitsProcessor(penalty), logits, seen))


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_matches_hf_min_new_tokens(generated):
    logits, prompt = random_logits(0, vocab=50), [4, 5, 6]
    output = list(range(7, 7 + generated))
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    theirs = hf(MinNewTokensLengthLogitsProcessor(len(prompt), 3, [9, 2]), logits, prompt + output)
    ours = process_logits(logits, params, prompt, output, eos_ids=[2])
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("seed", range(4))
def test_whole_pipeline_matches_hf_generate_order(seed):
    # Without min_p our order and HF's coincide: penalty, temperature, top-k, top-p.
    logits = random_logits(seed)
    history = np.random.default_rng(seed).integers(0, 1000, 30).tolist()
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2)
    ours = process_logits(logits, params, prompt_ids=history[:10], output_ids=history[10:])
    theirs = hf(LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(50), TopPLogitsWarper(0.9)]), logits, history)
    assert kept(ours) == kept(theirs)
    np.testing.assert_allclose(np.exp(ours) / np.exp(ours).sum(),
                               torch.softmax(torch.from_numpy(theirs), -1).numpy(), atol=1e-6)


# --- sampled frequencies match the processed distribution (chi-square) -----------------------

# Upper 0.1% points of the chi-square distribution (any statistics table, e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.4): a correct sampler exceeds them with probability 0.001. The draws use
# fixed seeds, so each test is deterministic; the threshold says how surprising a failure is.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
N_DRAWS = 20_000
BASE = np.log(f32([0.4, 0.3, 0.2, 0.1]))


def chi2_survival(x, dof):
    """P(X > x) for X ~ chi-square with `dof` degrees of freedom, in closed form (odd dof via
    erfc, even dof via the Poisson sum; Abramowitz & Stegun 26.4.4-26.4.5)."""
    if dof % 2 == 0:
        return math.exp(-x / 2) * sum((x / 2) ** j / math.factorial(j) for j in range(dof // 2))
    tail, term = math.erfc(math.sqrt(x / 2)), math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for j in range(1, (dof - 1) // 2 + 1):
        tail += term
        term *= x / (2 * j + 1)
    return tail


@pytest.mark.parametrize("dof", sorted(CHI2_CRITICAL_0_001))
def test_the_stated_critical_values_are_the_0_001_points(dof):
    assert chi2_survival(CHI2_CRITICAL_0_001[dof], dof) == pytest.approx(0.001, rel=1e-3)


def chi_square(counts, expected_probs):
    """Pearson's statistic over the tokens with expected probability > 0, and its degrees of
    freedom; tokens with expected probability 0 must never be drawn (asserted)."""
    counts, expected_probs = np.asarray(counts, float), np.asarray(expected_probs, float)
    zero = expected_probs == 0
    assert counts[zero].sum() == 0, "drew a token whose probability is 0"
    expected = expected_probs[~zero] * counts.sum()
    return float(((counts[~zero] - expected) ** 2 / expected).sum()), int((~zero).sum() - 1)


def draw_counts(logits, params, seed, output_ids=()):
    gen = np.random.default_rng(seed)
    tokens = [sample(logits, params, gen, output_ids=output_ids) for _ in range(N_DRAWS)]
    return np.bincount(tokens, minlength=len(logits))


@pytest.mark.slow
@pytest.mark.parametrize("params, output_ids, expected", [
    (SamplingParams(), (), [0.4, 0.3, 0.2, 0.1]),
    (SamplingParams(temperature=0.5), (), np.array([16, 9, 4, 1]) / 30),  # p^2, renormalised
    (SamplingParams(temperature=2.0), (), np.sqrt([4, 3, 2, 1]) / np.sqrt([4, 3, 2, 1]).sum()),
    (SamplingParams(top_k=3), (), [4 / 9, 3 / 9, 2 / 9, 0]),
    (SamplingParams(top_p=0.65), (), [4 / 7, 3 / 7, 0, 0]),       # mass before id 2 is 0.7
    (SamplingParams(min_p=0.45), (), [4 / 9, 3 / 9, 2 / 9, 0]),    # threshold 0.18
    (SamplingParams(presence_penalty=math.log(2)), (0,), [0.25, 0.375, 0.25, 0.125]),  # p0 / 2
], ids=["plain", "t0.5", "t2", "top_k3", "top_p.65", "min_p.45", "presence"])
def test_sampled_frequencies_match_the_processed_distribution(params, output_ids, expected):
    stat, dof = chi_square(draw_counts(BASE, params, seed=1234, output_ids=output_ids), expected)
    assert stat < CHI2_CRITICAL_0_001[dof], f"chi2 = {stat:.2f} with {dof} dof"


@pytest.mark.slow
def test_chi_square_statistics_over_many_seeds_follow_their_distribution():
    # One seed gives one draw of the statistic (seed 1234 above gives 14.0 for t0.5, a
    # p-value of 0.003: unusual, not alarming). If the sampler is right, the statistics of 20
    # independent seeds sum to one draw from chi-square with 20 * 3 = 60 degrees of freedom;
    # both tails are checked at 0.1%: too large means bias, too small means draws too regular.
    params, expected = SamplingParams(temperature=0.5), np.array([16, 9, 4, 1]) / 30
    total = 0.0
    for seed in range(20):
        gen = np.random.default_rng(seed)
        counts = np.bincount([sample(BASE, params, gen) for _ in range(5000)], minlength=4)
        total += chi_square(counts, expected)[0]
    assert 0.001 < chi2_survival(total, 60) < 0.999, f"sum of statistics {total:.1f}"


@pytest.mark.slow
def test_the_chi_square_check_can_fail():
    # Power check: the same draws at temperature 0.5 are rejected against the untempered
    # distribution, so passing above means something.
    stat, dof = chi_square(draw_counts(BASE, SamplingParams(temperature=0.5), seed=1234),
                           [0.4, 0.3, 0.2, 0.1])
    assert stat > CHI2_CRITICAL_0_001[dof]


# --- seeds ----------------------------------------------------------------------------------

def draws(seed, n=40, params=SamplingParams()):
    gen = np.random.default_rng(seed)
    return [sample(np.zeros(10, np.float32), params, gen) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)  # equal by chance with probability 10^-40


def test_a_request_stream_does_not_depend_on_other_requests():
    alone = draws(7)
    gen_a, gen_b, together = np.random.default_rng(7), np.random.default_rng(99), []
    for _ in range(40):
        together.append(sample(np.zeros(10, np.float32), SamplingParams(), gen_a))
        sample(np.zeros(10, np.float32), SamplingParams(top_k=3), gen_b)
        np.random.seed(123)  # the global NumPy state is not ours either
    assert together == alone


def test_greedy_consumes_no_randomness():
    gen = np.random.default_rng(5)
    before = gen.bit_generator.state
    sample(f32([1, 2, 3]), SamplingParams(temperature=0), gen)
    assert gen.bit_generator.state == before


# --- logprobs -------------------------------------------------------------------------------

def test_logprobs_match_torch_log_softmax():
    logits = random_logits(3, vocab=200)
    ref = torch.log_softmax(torch.from_numpy(logits), -1)
    lp = compute_logprobs(logits, token_id=17, n=5)
    assert lp.token_id == 17 and lp.logprob == pytest.approx(ref[17].item(), abs=1e-5)
    values, indices = torch.topk(ref, 5)
    assert [i for i, _ in lp.top_logprobs] == indices.tolist()
    np.testing.assert_allclose([v for _, v in lp.top_logprobs], values.numpy(), atol=1e-5)


def test_logprobs_reject_a_token_or_n_out_of_range():
    with pytest.raises(ValueError, match=r"token_id must be an int in \[0, V=4\) \(got 7\)"):
        compute_logprobs(np.zeros(4), 7, 2)
    with pytest.raises(ValueError, match=r"token_id must be an int in \[0, V=4\)"):
        compute_logprobs(np.zeros(4), -1, 2)     # would silently read the last entry
    with pytest.raises(ValueError, match=r"token_id must be an int in \[0, V=4\)"):
        compute_logprobs(np.zeros(4), 1.0, 2)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        compute_logprobs(np.zeros(4), 1, -1)


def test_logprobs_n_zero_and_n_above_vocab_and_minus_inf():
    assert compute_logprobs(f32([0, 0]), 1, 0) == TokenLogprobs(1, pytest.approx(math.log(0.5)), ())
    lp = compute_logprobs(f32([0, -INF, 0]), 0, 20)
    assert [i for i, _ in lp.top_logprobs] == [0, 2, 1]  # capped at V, ties by lowest id
    assert lp.top_logprobs[2][1] == -INF


# --- the Engine -----------------------------------------------------------------------------

VOCAB = [s01.EOS, s01.UNK, "a", "b", "c", ".", "\n"]
TOK = s01.WordTokenizer(VOCAB)
A, B, C, DOT = 2, 3, 4, 5


class ScriptedModel:
    """After a context of n tokens the logits are `row` with `script[n]` raised to 10 (or
    `row` alone past the script). It records every context it saw."""

    def __init__(self, script=None, row=None):
        self.script = script or {}
        self.row = f32(row if row is not None else [0] * len(VOCAB))
        self.vocab_size = len(VOCAB)
        self.seen = []

    def forward(self, token_ids):
        self.seen.append(list(token_ids))
        logits = np.tile(self.row, (len(token_ids), 1))
        if len(token_ids) in self.script:
            logits[-1, self.script[len(token_ids)]] = 10.0
        return logits


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_completion_fields_and_a_plain_greedy_run():
    engine = Engine(ScriptedModel({1: B, 2: C, 3: TOK.eos_id}), TOK, 16)
    c = engine.generate("a", GREEDY)
    assert isinstance(c, Completion)   # S01's one result type
    assert (c.token_ids, c.text, c.finish_reason) == ([B, C, 0], "b c", "stop")
    assert c.stop_reason is None       # vLLM: EOS names no stop
    assert c.logprobs is None and c.stats.passes == 3 and c.stats.context_lens == [1, 2, 3]


def test_sampling_params_extend_the_s01_and_s02_request_fields():
    assert issubclass(SamplingParams, s02.GenerationParams)
    assert issubclass(s02.GenerationParams, s01.GenerationParams)
    # An earlier chapter's params object is converted, keeping its fields (greedy by default).
    engine = Engine(ScriptedModel({1: B, 2: C}), TOK, 16)
    c = engine.generate("a", s01.GenerationParams(max_tokens=2))
    assert c.token_ids == [B, C] and c.finish_reason == "length"
    c = engine.generate("a", s02.GenerationParams(max_tokens=5, stop=("c",)))
    assert c.token_ids == [B, C] and c.stop_reason == "c"


def test_min_tokens_delays_eos():
    row = [10, 0, 5, 0, 0, 0, 0]  # EOS most likely, then "a"
    engine = Engine(ScriptedModel(row=row), TOK, 16)
    assert engine.generate("a", GREEDY).token_ids == [TOK.eos_id]
    c = engine.generate("a", dataclasses.replace(GREEDY, min_tokens=3))
    assert c.token_ids == [A, A, A, TOK.eos_id] and c.text == "a a a" and c.finish_reason == "stop"


def test_ignore_eos_generates_through_eos_to_the_budget():
    engine = Engine(ScriptedModel(row=[10, 0, 5, 0, 0, 0, 0]), TOK, 16)
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert c.token_ids == [0, 0, 0] and c.finish_reason == "length" and c.stop_reason is None


def test_stop_token_ids_stop_and_are_left_out_of_the_text():
    engine = Engine(ScriptedModel({1: B, 2: DOT}), TOK, 16)
    c = engine.generate("a", dataclasses.replace(GREEDY, stop_token_ids=[DOT]))
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([B, DOT], "b", "stop", DOT)


def test_stop_string_across_tokens_cuts_the_text_before_it():
    engine = Engine(ScriptedModel({1: A, 2: B, 3: C, 4: DOT}), TOK, 16)
    c = engine.generate("a", dataclasses.replace(GREEDY, stop=["b c", "zz"]))
    assert c.token_ids == [A, B, C]        # the token completing "b c" is in token_ids ...
    assert c.text == "a "                  # ... but the text ends before the stop string
    assert (c.finish_reason, c.stop_reason) == ("stop", "b c")


def test_stop_strings_do_not_fire_before_min_tokens():
    engine = Engine(ScriptedModel({1: A, 2: B, 3: C, 4: A}), TOK, 16)
    c = engine.generate("a", dataclasses.replace(GREEDY, stop="a", min_tokens=2))
    assert c.token_ids == [A, B, C, A] and c.text == "a b c " and c.stop_reason == "a"


def first_completed(text, stops):
    """The oracle: read `text` character by character; the first stop string that is complete
    at the end of what was read, the longest when several complete on the same character."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return max(done, key=len)
    return None


def matched(text, stops, cuts=()):
    """Feed `text` to S02's StopStringMatcher in pieces cut at `cuts`; (shown, matched)."""
    matcher = s02.StopStringMatcher(stops)
    bounds = [0, *sorted(cuts), len(text)]
    shown = "".join(matcher.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    shown += matcher.flush()
    assert matcher.stopped == (matcher.matched is not None)
    return shown, matcher.matched


def test_the_matcher_names_the_first_completed_stop_string():
    assert matched("xx ab cd", ["cd", "ab"]) == ("xx ", "ab")     # not the first listed
    assert matched("xx ab cd", ["ab", "a"]) == ("xx ", "a")       # "a" completes first
    assert matched("xx ab cd", ["b", "ab"]) == ("xx ", "ab")      # both end at "b": the longer
    assert matched("xx ab cd", ["zz"]) == ("xx ab cd", None)
    assert matched("xx ab cd", ["b c"], cuts=[4, 5, 6]) == ("xx a", "b c")  # across deltas


@settings(max_examples=200, deadline=None)
@given(text=st.text("abc", max_size=12),
       stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 12), max_size=4))
def test_the_matcher_agrees_with_a_character_by_character_search(text, stops, cuts):
    """Whatever the stop strings and however the text is cut into deltas, `matched` is the
    oracle's, and the shown text is everything before that stop string."""
    shown, name = matched(text, stops, [c for c in cuts if c <= len(text)])
    assert name == first_completed(text, stops)
    if name is None:
        assert shown == text
    else:
        assert text.startswith(shown + name)
        assert first_completed(shown + name, stops) == name


@settings(max_examples=60, deadline=None)
@given(script=st.lists(st.sampled_from([A, B, C]), min_size=1, max_size=8),
       stops=st.lists(st.sampled_from(["a", "b", "a b", "b c", " c", "c a b"]), min_size=1,
                      max_size=3))
def test_completion_stop_reason_is_the_matchers(script, stops):
    """The engine's stop_reason is the matched stop string of the text the tokens make."""
    engine = Engine(ScriptedModel({1 + i: t for i, t in enumerate(script)}), TOK, 16)
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=len(script), stop=stops))
    full = TOK.decode(script)
    expected = first_completed(full, stops)
    assert c.stop_reason == expected
    assert c.finish_reason == ("stop" if expected is not None else "length")
    if expected is not None:
        assert full.startswith(c.text + expected)
        assert first_completed(TOK.decode(c.token_ids), stops) == expected  # ends at the match
        assert first_completed(TOK.decode(c.token_ids[:-1]), stops) is None
    else:
        assert c.text == full


def test_earliest_stop_string_wins_within_one_delta():
    # "a b c" arrives as "a", " b", " c"; both stops complete with " c" (" c" and "b c"), and
    # the text is cut at the earlier one, listed second.
    engine = Engine(ScriptedModel({1: A, 2: B, 3: C}), TOK, 16)
    c = engine.generate("a", dataclasses.replace(GREEDY, stop=[" c", "b c"]))
    assert c.text == "a " and c.stop_reason == "b c"


def test_stop_priority_on_the_last_allowed_token():
    engine = Engine(ScriptedModel({1: B, 2: TOK.eos_id}), TOK, 16)
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=2))
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", None, [B, TOK.eos_id])
    engine = Engine(ScriptedModel({1: B, 2: C}), TOK, 16)
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=2, stop="c"))
    assert c.finish_reason == "stop" and c.stop_reason == "c" and c.text == "b "
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[C]))
    assert c.finish_reason == "stop" and c.stop_reason == C and c.text == "b"
    c = engine.generate("a", SamplingParams(temperature=0, max_tokens=2))
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("length", None, [B, C])


def test_full_context_is_length():
    model = ScriptedModel(row=[0, 0, 1, 0, 0, 0, 0])  # "a" forever, never EOS
    c = Engine(model, TOK, max_context=4).generate("a b", GREEDY)
    assert c.finish_reason == "length" and c.stop_reason is None
    # 2 tokens of a budget of 8: the context filled first, and no pass ran on 4 tokens
    assert len(c.token_ids) == 2 and max(len(s) for s in model.seen) == 3


def test_engine_logprobs_raw_and_processed():
    row = f32([0, 0, 2, 1, 0.5, -1, -INF])
    params = SamplingParams(temperature=0.5, top_k=2, max_tokens=3, logprobs=2, seed=0)
    raw = Engine(ScriptedModel(row=row), TOK, 16).generate("a", params)
    processed = Engine(ScriptedModel(row=row), TOK, 16,
                       logprobs_mode="processed_logprobs").generate("a", params)
    assert raw.token_ids == processed.token_ids and len(raw.logprobs) == 3
    ref_raw = torch.log_softmax(torch.from_numpy(row), -1)
    warped = hf(LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(2)]), row)
    ref_proc = torch.log_softmax(torch.from_numpy(warped), -1)
    for token, lp_raw, lp_proc in zip(raw.token_ids, raw.logprobs, processed.logprobs):
        assert lp_raw.logprob == pytest.approx(ref_raw[token].item(), abs=1e-6)
        assert lp_proc.logprob == pytest.approx(ref_proc[token].item(), abs=1e-6)
        assert [i for i, _ in lp_raw.top_logprobs] == [A, B]


def test_engine_seeded_requests_reproduce_whatever_runs_between(bigram):
    tokenizer, model = bigram
    engine = Engine(model, tokenizer, 64)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=42)
    first = engine.generate("To be, or not to be", params)
    engine.generate("My lord", SamplingParams(temperature=1.2, max_tokens=7, seed=3))
    again = engine.generate("To be, or not to be", params)
    assert first.token_ids == again.token_ids and first.text == again.text
    others = {tuple(engine.generate("To be, or not to be", dataclasses.replace(params, seed=s))
                    .token_ids) for s in range(5)}
    assert len(others) > 1


def test_engine_rejects_bad_input():
    engine = Engine(ScriptedModel(), TOK, 8)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        engine.generate("a", {"temperature": 0})       # not a params object, not a count
    with pytest.raises(ValueError, match="pass either a params object or keyword fields"):
        engine.generate("a", GREEDY, top_k=3)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['top_q'\]"):
        engine.generate("a", 4, top_q=0.5)
    # S01's call style is greedy unless told otherwise: a filter alone would do nothing.
    with pytest.raises(ValueError, match=r"\['min_p', 'top_p'\] only shape sampling, and this "
                                         "call is greedy: pass temperature > 0"):
        engine.generate("a", 4, top_p=0.5, min_p=0.1, seed=0)
    assert engine.generate("a", 4, top_p=1.0, top_k=0).token_ids == engine.generate(
        "a", 4).token_ids                              # disabled filters: nothing to warn of
    assert engine.generate("a", 4, 1.0, 0, top_p=0.5).token_ids == engine.generate(
        "a", SamplingParams(max_tokens=4, temperature=1.0, seed=0, top_p=0.5)).token_ids
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        engine.generate("", GREEDY)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Engine(ScriptedModel(), TOK, 8, logprobs_mode="raw")


# --- greedy parity with the S01 loop --------------------------------------------------------

@pytest.fixture(scope="module")
def bigram():
    return s01.build_default()


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


PROMPTS = ["Ham.\nTo be, or not to be", "My lord", "What say you", "O"]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_tokens, max_context", [(40, 256), (30, 12)])
def test_greedy_equals_the_s01_loop_on_the_bigram_model(bigram, prompt, max_tokens, max_context):
    tokenizer, model = bigram
    reference = s01.Engine(model, tokenizer, max_context).generate(prompt, max_tokens, 0.0)
    ours = Engine(model, tokenizer, max_context).generate(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert ours.token_ids == reference.token_ids, (
        f"first difference at {first_difference(ours.token_ids, reference.token_ids)}: "
        f"{ours.text!r} vs {reference.text!r}")
    assert ours.text == reference.text
    assert (ours.finish_reason, ours.stop_reason) == (reference.finish_reason,
                                                      reference.stop_reason)
    assert ours.stats.context_lens == reference.stats.context_lens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_s01_call_style_is_greedy_and_gives_the_s01_loops_ids(bigram, prompt):
    """`generate(prompt, 12)` as in S01: greedy by default (although SamplingParams' own
    default temperature is 1.0, vLLM's), the same ids, text and passes as the S01 loop."""
    tokenizer, model = bigram
    reference = s01.Engine(model, tokenizer, 256).generate(prompt, 12)
    ours = Engine(model, tokenizer, 256).generate(prompt, 12)
    assert ours.token_ids == reference.token_ids, (
        f"first difference at {first_difference(ours.token_ids, reference.token_ids)}: "
        f"{ours.text!r} vs {reference.text!r}")
    assert (ours.text, ours.finish_reason) == (reference.text, reference.finish_reason)
    assert ours.stats.context_lens == reference.stats.context_lens
    # positional temperature and seed, and SamplingParams fields as keywords
    sampled = Engine(model, tokenizer, 256).generate(prompt, 12, 0.8, 3, top_k=20)
    again = Engine(model, tokenizer, 256).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=3, top_k=20))
    assert sampled.token_ids == again.token_ids


# --- streaming, byte-level text, several EOS ids (S02's tokenizer) ---------------------------

@pytest.fixture(scope="module")
def bpe_bigram():
    return s02.build_default()


TOKENIZER_JSON = s02.TOKENIZER_PATH   # data/tokenizer.json, the project's (and the bundled model's)
MULTILINGUAL = "Où est 😀? 日本語 — fin. Ça va, 👍🏽 ok?\n"


def checkpoint_tokenizer():
    """The project tokenizer as a checkpoint's, read by HF `tokenizers` (S03): it has `decode`
    and no `decode_bytes`, so S02's streaming detokenizer takes its text path."""
    return s03_checkpoint.CheckpointTokenizer(TOKENIZER_JSON, eos_ids=[2047])


def streamed(detokenizer, ids):
    return [detokenizer.feed(i) for i in ids] + [detokenizer.flush()]


def test_the_byte_path_never_splits_a_character():
    tokenizer = s02.BPETokenizer.load_hf()
    text = "Café 😀 日本"
    detokenizer = s02.StreamingDetokenizer(tokenizer)
    assert detokenizer.by_bytes
    pieces = streamed(detokenizer, tokenizer.encode_ordinary(text))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert "😀" in pieces  # its four byte tokens come out as one delta


def test_the_text_path_with_a_checkpoint_tokenizer_read_by_hf_tokenizers():
    """S04's engine streams a checkpoint's text through S02's detokenizer: with `decode` only,
    no delta holds U+FFFD, and the deltas joined are HF's decode of the ids, for every prefix."""
    tokenizer = checkpoint_tokenizer()
    ids = tokenizer.encode(MULTILINGUAL)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # byte pieces: a real test
    detokenizer = s02.StreamingDetokenizer(tokenizer)
    assert not detokenizer.by_bytes
    pieces = streamed(detokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == MULTILINGUAL
    assert not any("\ufffd" in p for p in pieces)
    for n in range(1, len(ids) + 1):                     # every prefix, flushed where it stops
        detokenizer = s02.StreamingDetokenizer(tokenizer)
        assert "".join(streamed(detokenizer, ids[:n])) == tokenizer.decode(ids[:n])


class CountingDecoder:
    """Wraps a tokenizer and counts what the detokenizer asks it to decode. It exposes
    `decode_bytes` only when the wrapped tokenizer has it, so the wrapper leaves the path the
    detokenizer takes as it is."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.decoded: list[int] = []          # ids decoded, one entry per call
        if hasattr(tokenizer, "decode_bytes"):
            self.decode_bytes = self._decode_bytes

    def decode(self, ids):
        ids = list(ids)
        self.decoded.append(len(ids))
        return self.inner.decode(ids)

    def _decode_bytes(self, ids):
        ids = list(ids)
        self.decoded.append(len(ids))
        return self.inner.decode_bytes(ids)


@pytest.mark.parametrize("make", [checkpoint_tokenizer, s02.BPETokenizer.load_hf],
                         ids=["text path", "byte path"])
def test_detokenizer_work_per_token_does_not_grow_with_the_output(make):
    """500 tokens of corpus and multilingual text: the ids decoded per `feed` stay bounded by a
    constant (a text-path window is the last shown chunk plus the ids held back), where
    decoding the whole output each step would reach 500 ids and 125,000 in all."""
    tokenizer = make()
    corpus = s02.CORPUS_PATH.read_text(encoding="utf-8")[:4000]
    ids = tokenizer.encode((MULTILINGUAL + corpus[:300]) * 3 + corpus)[:500]
    assert len(ids) == 500
    counting = CountingDecoder(tokenizer)
    detokenizer = s02.StreamingDetokenizer(counting)
    assert detokenizer.by_bytes == hasattr(tokenizer, "decode_bytes")
    per_feed, pieces = [], []
    for token in ids:
        before = sum(counting.decoded)
        pieces.append(detokenizer.feed(token))
        per_feed.append(sum(counting.decoded) - before)
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert max(per_feed) <= 16, max(per_feed)            # bounded, whatever the position
    assert sum(per_feed) <= 16 * len(ids)
    assert max(per_feed[-100:]) <= max(per_feed[:100]) + 8  # no growth from start to end
    if detokenizer.by_bytes:
        assert per_feed == [1] * 500                     # one token's bytes per feed


def test_stop_string_made_of_byte_tokens():
    tokenizer = s02.BPETokenizer.load_hf()
    ids = tokenizer.encode_ordinary("ok 😀 no")
    assert len(tokenizer.encode("A")) == 1
    script = {1 + j: token for j, token in enumerate(ids)}  # after the 1-token prompt "A"
    model = ScriptedModel(script, row=np.zeros(tokenizer.vocab_size))
    model.vocab_size = tokenizer.vocab_size
    c = Engine(model, tokenizer, 64).generate("A", SamplingParams(temperature=0, stop="😀"))
    assert c.text == "ok " and c.stop_reason == "😀" and c.finish_reason == "stop"
    assert c.token_ids == ids[:ids.index(128) + 1]  # up to the emoji's last byte token (0x80)


@pytest.mark.parametrize("stop", [(), ("\n",), (" the", "!")])
@pytest.mark.parametrize("prompt", ["Ham.\nTo be, or not to be", "ROMEO:"])
def test_greedy_equals_s02_engine_with_stop_strings(bpe_bigram, prompt, stop):
    tokenizer, model = bpe_bigram
    reference = s02.Engine(model, tokenizer, 128).generate(prompt, 40, 0.0, stop=stop)
    ours = Engine(model, tokenizer, 128).generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop=stop))
    assert ours.token_ids == reference.token_ids and ours.text == reference.text
    assert (ours.finish_reason, ours.stop_reason) == (reference.finish_reason,
                                                      reference.stop_reason)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, seed=1, stop=["\n\n", "."]),
    SamplingParams(temperature=1.3, top_k=20, max_tokens=40, seed=2, min_tokens=10, stop=" "),
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, stop_token_ids=[13]),
])
def test_stream_joined_equals_generate(bpe_bigram, params):
    tokenizer, model = bpe_bigram
    engine = Engine(model, tokenizer, 128)
    stream = engine.stream("Ham.\nTo be, or not to be", params)
    outputs = list(stream)
    result = stream.result
    whole = engine.generate("Ham.\nTo be, or not to be", params)
    assert "".join(o.text_delta for o in outputs) == result.text == whole.text
    assert result.token_ids == whole.token_ids
    assert [t for o in outputs for t in o.new_token_ids] == result.token_ids  # one per step
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1]
    assert (last.finish_reason, last.stop_reason) == (whole.finish_reason, whole.stop_reason)
    assert all(o.request_id == result.request_id for o in outputs)


def test_stream_validates_before_the_first_token():
    engine = Engine(ScriptedModel(), TOK, 8)
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        engine.stream("", GREEDY)
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        engine.stream("  ", GREEDY)                 # S01's toy tokenizer: no words, no tokens
    with pytest.raises(ValueError, match=r"stop_token_ids must lie in \[0, V=7\)"):
        engine.stream("a", SamplingParams(stop_token_ids=[7]))


class TwoEosTokenizer(s01.WordTokenizer):
    """S01's toy tokenizer with a second end-of-sequence id ("\\n"), like Qwen3's two EOS."""

    eos_ids = (0, 6)


def test_every_eos_id_stops_and_min_tokens_suppresses_them_all():
    tokenizer = TwoEosTokenizer(VOCAB)
    row = [0, 0, 5, 0, 0, 0, 10]  # "\n" (the second EOS) most likely, then "a"
    engine = Engine(ScriptedModel(row=row), tokenizer, 16)
    c = engine.generate("a", GREEDY)
    assert c.token_ids == [6] and c.finish_reason == "stop" and c.stop_reason is None
    c = engine.generate("a", dataclasses.replace(GREEDY, min_tokens=2))
    assert c.token_ids == [A, A, 6]


# --- greedy with penalties and min_tokens == HF generate, on S03's NumPy transformer ---------

class IdTokenizer:
    """Prompts are token ids written as text ("5 17 3"): the tiny model has no tokenizer.
    vocab_size is the tiny model's V (S02's engine and its heirs check that the tokenizer
    covers every id the model can produce)."""

    vocab_size = 97

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """(HF Qwen3 model, S03 Transformer loaded from the same saved checkpoint), V = 97."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import s03_transformer as s03
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=97,
                         max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=0,
                         pad_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    hf_model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.3)  # spread logits: greedy choices are far from ties
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    hf_model.save_pretrained(directory)
    return hf_model, s03.Transformer.from_pretrained(directory)


def hf_generate(model, ids, **kwargs):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, pad_token_id=1,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kwargs)
    return out[0, len(ids):].tolist()


PROMPT_IDS = [5, 17, 3, 42, 8]


@pytest.mark.parametrize("penalty", [1.0, 1.5, 0.8])
def test_greedy_with_repetition_penalty_equals_hf_generate(tiny_qwen3, penalty):
    hf_model, model = tiny_qwen3
    expected = hf_generate(hf_model, PROMPT_IDS, max_new_tokens=24, repetition_penalty=penalty,
                           eos_token_id=96)
    engine = Engine(model, IdTokenizer(eos_id=96), max_context=128)
    ours = engine.generate(" ".join(map(str, PROMPT_IDS)),
                           SamplingParams(temperature=0, max_tokens=24, repetition_penalty=penalty))
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    if penalty == 1.0:  # and the S01 loop agrees
        reference = s01.Engine(model, IdTokenizer(eos_id=96), 128).generate(
            " ".join(map(str, PROMPT_IDS)), 24)
        assert ours.token_ids == reference.token_ids


def test_min_tokens_equals_hf_min_new_tokens(tiny_qwen3):
    hf_model, model = tiny_qwen3
    # Make the first greedy token the EOS: without min_tokens generation ends at once.
    eos = hf_generate(hf_model, PROMPT_IDS, max_new_tokens=1, eos_token_id=96)[0]
    engine = Engine(model, IdTokenizer(eos_id=eos), max_context=128)
    prompt = " ".join(map(str, PROMPT_IDS))
    assert engine.generate(prompt, SamplingParams(temperature=0)).token_ids == [eos]
    expected = hf_generate(hf_model, PROMPT_IDS, max_new_tokens=30, min_new_tokens=6,
                           eos_token_id=eos)
    ours = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=6))
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    assert ours.token_ids[-1] == eos and len(ours.token_ids) > 6 and ours.finish_reason == "stop"


# --- the bundled model (skipped until scripts/train_bundled_model.py has written data/model) --

def _bundled_dir():
    import s03_transformer as s03
    return s03.BUNDLED_MODEL_DIR


bundled = pytest.mark.skipif(not (_bundled_dir() / "model.safetensors").exists(),
                             reason="bundled model not trained yet "
                                    "(scripts/train_bundled_model.py)")


@pytest.fixture(scope="module")
def bundled_models():
    """(HF model, S03 model, S03 tokenizer) of data/model."""
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(_bundled_dir(), attn_implementation="eager",
                                                    dtype=torch.float32).eval()
    model, tokenizer = s03_checkpoint.load(_bundled_dir())
    return hf_model, model, tokenizer


@bundled
@pytest.mark.slow
@pytest.mark.parametrize("penalty, min_tokens", [(1.0, 0), (1.0, 30), (1.3, 30), (1.3, 10)])
def test_bundled_greedy_equals_s01_loop_and_hf_generate(bundled_models, penalty, min_tokens):
    # Plain greedy ends with EOS after 4 tokens here (` a man.`, then EOS at 0.86); min_tokens
    # keeps it going, so the penalty has a long output to act on (and min_tokens meets HF's
    # min_new_tokens). The prompt is the corpus's own text: it writes speakers as `Ham.`.
    hf_model, model, tokenizer = bundled_models
    prompt = "Ham.\nTo be, or not to be"
    ids = tokenizer.encode(prompt)
    expected = hf_generate(hf_model, ids, max_new_tokens=30, repetition_penalty=penalty,
                           min_new_tokens=min_tokens, eos_token_id=tokenizer.eos_id)
    engine = Engine(model, tokenizer, max_context=model.config.max_position_embeddings)
    params = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=penalty,
                            min_tokens=min_tokens)
    ours = engine.generate(prompt, params)
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    if (penalty, min_tokens) == (1.0, 0):
        reference = s01.Engine(model, tokenizer, model.config.max_position_embeddings).generate(
            prompt, 30)
        assert ours.token_ids == reference.token_ids and ours.text == reference.text


# --- main -------------------------------------------------------------------------------------

def test_main_tours_the_settings(capsys):
    from s04_sampling import DEMO_SETTINGS, main
    main(["--max-tokens", "2", "--logprobs", "1"])
    out = capsys.readouterr().out
    for label, _ in DEMO_SETTINGS:
        assert f"[{label}" in out
    assert out.count("finish_reason=") == len(DEMO_SETTINGS)
    assert "[greedy, min_tokens 20 (min_tokens cut to --max-tokens 2)]" in out


def test_main_reports_a_bad_setting_by_name(capsys):
    from s04_sampling import main
    with pytest.raises(SystemExit):
        main(["--top-p", "5"])
    assert "top_p must be a number in [0, 1]" in capsys.readouterr().err


def test_main_reports_undecodable_argv_bytes_not_a_traceback(capsys):
    """Python turns argv bytes that are not UTF-8 into lone surrogates (PEP 383)."""
    from s04_sampling import main
    for argv in (["--prompt", "ab\udcff"], ["--stop", "\udcff", "--max-tokens", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "must be valid Unicode without lone surrogates" in capsys.readouterr().err


def test_main_reports_a_corrupt_checkpoint_as_a_usage_error(tmp_path, capsys):
    from s04_sampling import main
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--max-tokens", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "config.json" in err and "Traceback" not in err


def test_endless_stop_iterables_are_an_error_not_a_hang():
    import itertools
    with pytest.raises(ValueError, match="stop may hold at most 4096 stop strings"):
        SamplingParams(stop=itertools.repeat("zz"))
    with pytest.raises(ValueError, match="stop_token_ids may hold at most 4096 ids"):
        SamplingParams(stop_token_ids=itertools.count())
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence of ints"):
        SamplingParams(stop_token_ids={434: 1})      # a dict's keys are not a list of ids
    assert len(SamplingParams(stop=["x"] * 4096).stop) == 4096
