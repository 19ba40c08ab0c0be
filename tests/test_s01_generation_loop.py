"""Tests for chapter S01: tokenizer, bigram model, sampler, stop policy, bad input, cost table."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from s01_generation_loop import (
    EOS, UNK, BigramModel, Engine, Stats, UnknownWordError, WordTokenizer, build_default,
    cost_table, format_cost_table, sample, speeches,
)


@pytest.fixture(scope="module")
def default():
    return build_default()


# A tiny hand-made world where every expectation can be worked out by hand.
VOCAB = [EOS, UNK, "a", "b", "c", ".", "\n"]
TOK = WordTokenizer(VOCAB)


class ScriptedModel:
    """Greedy-deterministic model: after a context of length n, the argmax is script[n]
    (or `default` past the script). It also records the context each pass saw."""

    def __init__(self, script: dict[int, int], default: int = 2, vocab_size: int = len(VOCAB)):
        self.script, self.default, self.vocab_size = script, default, vocab_size
        self.seen: list[list[int]] = []

    def forward(self, token_ids):
        self.seen.append(list(token_ids))
        logits = np.zeros((len(token_ids), self.vocab_size), dtype=np.float32)
        logits[-1, self.script.get(len(token_ids), self.default)] = 10.0
        return logits


# --- tokenizer ------------------------------------------------------------------------------

def test_tokenizer_reserved_ids_and_split():
    assert TOK.eos_id == 0 and TOK.unk_id == 1 and TOK.vocab_size == 7
    assert WordTokenizer.split("Who's there?\nNay, answer me") == [
        "Who's", "there", "?", "\n", "Nay", ",", "answer", "me"]


def test_tokenizer_round_trip_on_corpus_speeches(default):
    tokenizer, _ = default
    checked = 0
    for speech in speeches(default_corpus())[:400]:
        ids = tokenizer.encode(speech)
        if tokenizer.unk_id in ids:
            continue
        assert tokenizer.decode(ids) == tokenizer.normalize(speech)
        assert tokenizer.encode(tokenizer.decode(ids)) == ids
        checked += 1
    assert checked > 100


def default_corpus():
    from s01_generation_loop import CORPUS_PATH
    return CORPUS_PATH.read_text()


@given(st.lists(st.sampled_from(["a", "b", "c", ".", "\n"]), min_size=1, max_size=30))
def test_tokenizer_round_trip_property(pieces):
    ids = [TOK.token_to_id[p] for p in pieces]
    assert TOK.encode(TOK.decode(ids)) == ids


def test_unknown_word_policy():
    assert TOK.encode("a zebra b") == [2, 1, 3]
    with pytest.raises(UnknownWordError, match="'zebra' is not in the vocabulary"):
        TOK.encode("a zebra b", unknown="error")
    with pytest.raises(ValueError, match="unknown must be"):
        TOK.encode("a", unknown="skip")


def test_special_strings_in_user_text_are_not_special():
    # "<eos>" typed by a user splits into "<", "eos", ">" (all unknown here), never id 0.
    # By hand: words a, <, eos, >, b -> 2, then three unknowns (<unk> = 1), then 3.
    assert TOK.encode("a <eos> b") == [2, 1, 1, 1, 3]


def test_decode_skips_eos_and_rejects_bad_ids():
    assert TOK.decode([2, 0, 3]) == "a b"
    assert TOK.decode(np.array([2, 3], dtype=np.int64)) == "a b"  # NumPy integers are ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([7])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([-1])


@pytest.mark.parametrize("bad_id", [5.9, 2.0, True, np.float32(3.0), "2"])
def test_decode_rejects_non_integer_ids_instead_of_truncating(bad_id):
    # int(5.9) would silently decode id 5; True would silently be id 1.
    with pytest.raises(ValueError, match="token ids must be integers"):
        TOK.decode([2, bad_id])


def test_vocab_is_most_frequent_words_deterministically():
    tok = WordTokenizer.train("b b b a a c c d", max_vocab=4)
    assert tok.id_to_token == [EOS, UNK, "b", "a"]  # a and c tie on 2; 'a' sorts first


# --- model ----------------------------------------------------------------------------------

def test_bigram_counts_to_logits_by_hand():
    # ids: 2 3 2 3 2 0 over V = 4 (0 eos, 1 unk). Row 2 saw 3 twice and 0 once.
    model = BigramModel.train([2, 3, 2, 3, 2, 0], vocab_size=4, alpha=1.0, unk_id=1)
    probs = np.exp(model.forward([2])[0])
    # add-1 smoothing over the 3 allowed targets (0, 2, 3): counts (1, 0, 2) + 1 -> (2, 1, 3) / 6
    np.testing.assert_allclose(probs, [2 / 6, 0.0, 1 / 6, 3 / 6], rtol=1e-6)
    assert model.forward([2]).dtype == np.float32


def test_forward_shape_is_T_by_V(default):
    tokenizer, model = default
    ids = tokenizer.encode("To be, or not to be")
    logits = model.forward(ids)
    assert logits.shape == (len(ids), tokenizer.vocab_size)
    assert np.all(np.isneginf(logits[:, tokenizer.unk_id]))  # <unk> is never predicted
    np.testing.assert_allclose(np.exp(logits).sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf"), True])
def test_bigram_alpha_must_be_finite_and_positive(alpha):
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        BigramModel.train([2, 3, 2], vocab_size=4, alpha=alpha)


def test_forward_bad_input():
    model = BigramModel.train([2, 3, 2], vocab_size=4)
    with pytest.raises(ValueError, match="non-empty"):
        model.forward([])
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        model.forward([7])


# --- sampler --------------------------------------------------------------------------------

def test_greedy_is_argmax_lowest_id_on_tie():
    rng = np.random.default_rng(0)
    assert sample(np.array([0.1, 3.0, 3.0, -1.0]), 0.0, rng) == 1


def test_sampling_is_seeded_and_reproducible():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [sample(logits, 1.0, rng) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 1


def test_sampling_frequencies_follow_softmax():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    rng = np.random.default_rng(0)
    n = 20000
    counts = np.bincount([sample(logits, 1.0, rng) for _ in range(n)], minlength=4)
    # 4 standard errors of a binomial proportion at p=0.4, n=20000 is about 0.014.
    np.testing.assert_allclose(counts / n, [0.1, 0.2, 0.3, 0.4], atol=0.014)


def test_temperature_sharpens():
    logits = np.log(np.array([0.2, 0.8]))
    rng = np.random.default_rng(1)
    n = 5000
    # At T=0.5 the probabilities are proportional to p^2: 0.04 : 0.64 -> 0.0588 : 0.9412.
    freq = np.mean([sample(logits, 0.5, rng) == 0 for _ in range(n)])
    assert abs(freq - 0.04 / 0.68) < 0.015


@pytest.mark.parametrize("temperature", [-0.1, float("nan"), float("inf"), True, False, "1"])
def test_sample_rejects_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        sample(np.zeros(3), temperature, np.random.default_rng(0))


def test_a_bool_temperature_is_named_as_such():
    # True would otherwise silently mean temperature 1.
    with pytest.raises(ValueError, match=r"an int or a float, not a bool; got True\)"):
        Engine(ScriptedModel({}), TOK, 8).generate("a", 3, True)


@pytest.mark.parametrize("temperature", [np.int64(1), np.float32(0.5), np.float16(2.0), 1])
def test_sample_accepts_numpy_and_int_temperatures(temperature):
    # Only id 1 has a finite logit, so any valid temperature must draw it.
    logits = np.array([-np.inf, 0.0, -np.inf])
    assert sample(logits, temperature, np.random.default_rng(0)) == 1


@pytest.mark.parametrize("temperature", [1e-300, 1e-310, 1e-320, 5e-324])
def test_a_vanishing_temperature_is_greedy_not_garbage(temperature):
    # logits / 1e-310 overflows to inf (and inf - inf is NaN); subtracting the max first cannot.
    # The gaps to the max (2, 1, 2.5) divided by such a temperature are far below -745, where
    # exp() is exactly 0 in float64: the argmax, id 2, is the only possible draw.
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 2.0, 3.0, 0.5], dtype=np.float32)
    assert [sample(logits, temperature, rng) for _ in range(50)] == [2] * 50


def test_huge_logits_do_not_overflow():
    rng = np.random.default_rng(0)
    # Gaps of 1e308 and 2e308 (the latter overflows to -inf): both weights are 0 by hand.
    assert [sample(np.array([1e308, -1e308, 0.0]), 0.5, rng) for _ in range(50)] == [0] * 50
    assert [sample(np.array([-1e308, 1e308]), 1.0, rng) for _ in range(50)] == [1] * 50


def test_tied_maxima_share_the_probability_at_any_temperature():
    # Two tied maxima at 1e308 (1e308 / 0.5 = inf before the fix): 1/2 each, the third 0.
    rng = np.random.default_rng(0)
    n = 4000
    counts = np.bincount([sample(np.array([1e308, 1e308, -1e308]), 0.5, rng) for _ in range(n)],
                         minlength=3)
    # 4 standard errors of a binomial proportion at p = 0.5, n = 4000: 4 * sqrt(0.25 / n) = 0.032.
    np.testing.assert_allclose(counts / n, [0.5, 0.5, 0.0], atol=0.032)
    # The same limit for a tiny temperature on ordinary logits: ids 0 and 1 tie, id 2 never.
    draws = {sample(np.array([3.0, 3.0, 1.0]), 1e-300, rng) for _ in range(200)}
    assert draws == {0, 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("logits, message", [
    ([np.inf, 0.0], r"must not contain NaN or \+inf"),
    ([0.0, np.nan], r"must not contain NaN or \+inf"),
    ([-np.inf, -np.inf], "at least one finite entry"),
    ([], "non-empty 1-D row"),
    ([[0.0, 1.0]], "non-empty 1-D row"),
])
def test_sample_rejects_bad_logits(logits, message, temperature):
    # +inf has no probability (softmax would be inf / inf), at any temperature, greedy included.
    with pytest.raises(ValueError, match=message):
        sample(np.array(logits), temperature, np.random.default_rng(0))


# --- stop policy at every boundary ----------------------------------------------------------

def test_eos_as_last_allowed_token_is_an_eos_stop():
    # prompt "a b" has 2 tokens; passes see contexts of 2, 3, 4: the third token sampled is EOS.
    engine = Engine(ScriptedModel({2: 2, 3: 3, 4: TOK.eos_id}), TOK, max_context=16)
    g = engine.generate("a b", max_tokens=3)
    assert g.finish_reason == "stop" and g.stop_reason is None  # vLLM: EOS names no stop
    assert g.token_ids == [2, 3, 0] and g.text == "a b"  # EOS produced, not in the text
    assert g.stats.passes == 3


def test_budget_stop_when_eos_comes_one_too_late():
    engine = Engine(ScriptedModel({2: 2, 3: 3, 4: 4, 5: TOK.eos_id}), TOK, max_context=16)
    g = engine.generate("a b", max_tokens=3)
    assert g.finish_reason == "length" and g.stop_reason is None
    assert g.token_ids == [2, 3, 4] and g.text == "a b c"


def test_context_full_stop_and_no_pass_beyond_the_window():
    model = ScriptedModel({})
    engine = Engine(model, TOK, max_context=5)
    g = engine.generate("a b", max_tokens=10)
    assert g.finish_reason == "length"                # 3 tokens of a budget of 10
    assert g.stats.context_lens == [2, 3, 4]          # a 5-token context is never run
    assert len(g.token_ids) == 3 and max(len(s) for s in model.seen) == 4


def test_prompt_that_fills_the_context_stops_before_the_first_pass():
    model = ScriptedModel({})
    g = Engine(model, TOK, max_context=3).generate("a b c", max_tokens=5)
    assert g.finish_reason == "length" and g.stats.passes == 0
    assert g.token_ids == [] and g.text == "" and model.seen == []


def test_budget_and_full_context_at_once_reports_the_budget():
    g = Engine(ScriptedModel({}), TOK, max_context=4).generate("a b", max_tokens=2)
    assert g.finish_reason == "length" and g.stats.context_lens == [2, 3]


def test_eos_beats_the_full_context():
    g = Engine(ScriptedModel({3: TOK.eos_id}), TOK, max_context=4).generate("a b", max_tokens=9)
    assert g.finish_reason == "stop" and g.token_ids == [2, 0]


def test_each_pass_sees_the_whole_growing_context():
    model = ScriptedModel({2: 4, 3: 3})
    Engine(model, TOK, max_context=16).generate("a b", max_tokens=3)
    assert model.seen == [[2, 3], [2, 3, 4], [2, 3, 4, 3]]


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", None, b"a", ["a"]])
def test_prompt_must_be_a_non_empty_string(prompt):
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        Engine(ScriptedModel({}), TOK, 8).generate(prompt, 3)


@pytest.mark.parametrize("prompt", ["   ", "\t \t"])
def test_prompt_that_encodes_to_no_token(prompt):
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        Engine(ScriptedModel({}), TOK, 8).generate(prompt, 3)


@pytest.mark.parametrize("prompt, ids", [("\n", [6]), ("   \n", [6]), ("\n\n", [6, 6])])
def test_a_line_break_is_a_token_so_it_is_a_valid_prompt(prompt, ids):
    g = Engine(ScriptedModel({}), TOK, 8).generate(prompt, 1)
    assert TOK.encode(prompt) == ids and g.stats.prompt_tokens == len(ids)
    assert g.token_ids == [2]  # ScriptedModel's default argmax

def test_prompt_of_only_punctuation_outside_vocab_still_encodes_to_unk():
    g = Engine(ScriptedModel({}), TOK, 8).generate("zebra", 1)
    assert g.stats.prompt_tokens == 1


@pytest.mark.parametrize("max_tokens", [0, -3, 2.5, True])
def test_bad_max_tokens(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        Engine(ScriptedModel({}), TOK, 8).generate("a", max_tokens)


@pytest.mark.parametrize("temperature", [-1.0, float("nan"), True, np.float16("nan"), "0"])
def test_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        Engine(ScriptedModel({}), TOK, 8).generate("a", 3, temperature)


def test_numpy_temperature_and_seed_are_accepted():
    # temperature np.int64(0) is greedy: the scripted argmax ids, by hand.
    g = Engine(ScriptedModel({1: 3, 2: 4}), TOK, 8).generate("a", 2, np.int64(0), np.int64(5))
    assert g.token_ids == [3, 4]


@pytest.mark.parametrize("seed", [-1, 1.5, True, "0", np.int64(-2)])
def test_bad_seed(seed):
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0"):
        Engine(ScriptedModel({}), TOK, 8).generate("a", 3, 0.5, seed)


def test_bad_seed_is_rejected_even_when_greedy_and_before_any_pass():
    model = ScriptedModel({})
    with pytest.raises(ValueError, match=r"seed must be None or an integer >= 0 \(got -1\)"):
        Engine(model, TOK, 8).generate("a", 3, 0.0, -1)
    assert model.seen == []


def test_prompt_longer_than_context_is_an_error_not_a_truncation():
    with pytest.raises(ValueError, match="prompt is 4 tokens but max_context is 3"):
        Engine(ScriptedModel({}), TOK, 3).generate("a b c a", 1)


@pytest.mark.parametrize("max_context", [0, -1, 2.0, True, np.bool_(True)])
def test_bad_max_context(max_context):
    with pytest.raises(ValueError, match="max_context must be an integer >= 1"):
        Engine(ScriptedModel({}), TOK, max_context)


# --- real model, cost table -----------------------------------------------------------------

def test_greedy_on_the_corpus_is_deterministic_and_seeded_sampling_reproducible(default):
    tokenizer, model = default
    engine = Engine(model, tokenizer, max_context=128)
    g1 = engine.generate("Ham.\nTo be, or not to be", 20)
    g2 = engine.generate("Ham.\nTo be, or not to be", 20)
    assert g1.token_ids == g2.token_ids
    # Greedy: every token is the argmax of the bigram row of the token before it.
    prev = tokenizer.encode("Ham.\nTo be, or not to be")[-1]
    for tok in g1.token_ids:
        assert tok == int(np.argmax(model.logits_table[prev]))
        prev = tok
    s1 = engine.generate("Ham.\nTo be", 20, temperature=1.0, seed=3)
    s2 = engine.generate("Ham.\nTo be", 20, temperature=1.0, seed=3)
    s3 = engine.generate("Ham.\nTo be", 20, temperature=1.0, seed=4)
    assert s1.token_ids == s2.token_ids and s1.token_ids != s3.token_ids


def test_cost_table_matches_closed_form_sums():
    g = Engine(ScriptedModel({}), TOK, max_context=64).generate("a b c", max_tokens=20)
    p, k = 3, 20  # contexts are p, p+1, ..., p+k-1
    assert g.stats.context_lens == list(range(p, p + k))
    closed_sq = sum_sq(p + k - 1) - sum_sq(p - 1)
    closed_lin = (p + k - 1) * (p + k) // 2 - (p - 1) * p // 2
    assert g.stats.attention_work_uncached == closed_sq == 3790
    assert g.stats.attention_work_cached == closed_lin == 250
    rows = cost_table(g.stats)
    assert rows[-1][4] == pytest.approx(3790 / 250)
    assert rows[0] == (1, 3, 9, 3, 3.0)
    text = format_cost_table(g.stats)
    assert "3,790 token pairs without a cache, 250 with one" in text


def sum_sq(n):
    return n * (n + 1) * (2 * n + 1) // 6


def test_stats_count_passes_and_time_every_step():
    g = Engine(ScriptedModel({}), TOK, max_context=64).generate("a b", max_tokens=4)
    s = g.stats
    assert isinstance(s, Stats) and s.prompt_tokens == 2 and s.passes == 4
    assert len(s.pass_times_s) == len(s.step_times_s) == 4
    assert all(0 <= m <= t for m, t in zip(s.pass_times_s, s.step_times_s))


def test_main_prints_text_and_cost_table(capsys):
    from s01_generation_loop import main
    main(["--max-tokens", "12", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "--- completion ---" in out and "cumulative ratio" in out and "finish_reason=" in out


def test_main_reports_bad_input_without_a_traceback(capsys):
    from s01_generation_loop import main
    with pytest.raises(SystemExit) as exc:
        main(["--max-tokens", "0"])
    assert exc.value.code == 2
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "seed must be None or an integer >= 0"),
    (["--max-context", "0"], "max_context must be an integer >= 1"),
    (["--prompt", "   "], "prompt must contain at least one token"),
])
def test_main_reports_bad_engine_settings_without_a_traceback(capsys, args, message):
    from s01_generation_loop import main
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


# --- the one engine interface: stream, RequestOutput, Completion, params, stop_rule -----------

from s01_generation_loop import (  # noqa: E402
    Completion, CompletionStream, GenerationParams, RequestOutput, Sequence, stop_rule,
)


def test_stream_yields_one_output_per_step_and_its_result_is_generate():
    engine = Engine(ScriptedModel({2: 2, 3: 3, 4: TOK.eos_id}), TOK, max_context=16)
    stream = engine.stream("a b", 5)
    assert isinstance(stream, CompletionStream)
    with pytest.raises(ValueError, match="the stream is not finished"):
        stream.result
    outputs = list(stream)
    assert all(isinstance(o, RequestOutput) for o in outputs)
    assert [o.new_token_ids for o in outputs] == [[2], [3], [0]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason == "stop" and outputs[0].finish_reason is None
    # S01 shows text only at the end (streaming text is S02's); joined == the result's text.
    assert [o.text_delta for o in outputs] == ["", "", "a b"]
    result = stream.result
    assert isinstance(result, Completion) and result.text == "a b"
    assert result.token_ids == [2, 3, 0] and result.request_id == outputs[0].request_id
    again = engine.generate("a b", 5)
    assert (again.text, again.token_ids, again.finish_reason) == ("a b", [2, 3, 0], "stop")
    assert again.request_id != result.request_id  # every request gets its own id


def test_a_stream_is_lazy_and_checks_the_request_at_the_call():
    model = ScriptedModel({})
    engine = Engine(model, TOK, max_context=16)
    stream = engine.stream("a b", 3)
    assert model.seen == []          # nothing ran yet
    next(stream)
    assert len(model.seen) == 1
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        engine.stream("a b", 0)      # raises here, not at the first next()


def test_prompt_that_fills_the_context_gives_an_empty_finished_stream():
    stream = Engine(ScriptedModel({}), TOK, max_context=2).stream("a b", 5)
    assert list(stream) == []
    assert stream.result.finish_reason == "length" and stream.result.token_ids == []


def test_any_eos_id_of_the_tokenizer_ends_the_request():
    class TwoEos(WordTokenizer):
        eos_ids = (0, 5)             # "<eos>" and "."
    tok = TwoEos(VOCAB)
    g = Engine(ScriptedModel({2: 3, 3: 5}), tok, max_context=16).generate("a b", 6)
    assert g.token_ids == [3, 5] and g.finish_reason == "stop" and g.text == "b"  # "." unseen


def test_ignore_eos_generates_the_whole_budget():
    model = ScriptedModel({2: TOK.eos_id, 3: TOK.eos_id})
    g = Engine(model, TOK, max_context=16).generate("a b", 4, ignore_eos=True)
    assert g.token_ids == [0, 0, 2, 2] and g.finish_reason == "length"
    assert g.text == "a a"           # EOS decodes to nothing in S01's tokenizer
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        Engine(model, TOK, 16).generate("a b", 4, ignore_eos=1)


def test_params_object_in_place_of_max_tokens():
    engine = Engine(ScriptedModel({}), TOK, max_context=16)
    g = engine.generate("a", GenerationParams(max_tokens=3))
    assert g.token_ids == [2, 2, 2]
    with pytest.raises(ValueError, match="either a params object or keyword fields"):
        engine.generate("a", GenerationParams(max_tokens=3), temperature=1.0)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['top_p'\]"):
        engine.generate("a", 3, top_p=0.9)   # S04's field: not this engine's
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1, or a params "
                                         r"object \(GenerationParams\) in its place"):
        engine.generate("a", {"temperature": 0})


@pytest.mark.parametrize("prompt", ["a\udcff", "\ud800b"])
def test_prompt_of_invalid_unicode_is_an_error_not_unk(prompt):
    # Bytes that were not UTF-8 arrive from argv as lone surrogates (PEP 383); S02-S06 reject
    # them, and so does S01, instead of encoding them as <unk>.
    with pytest.raises(ValueError, match="prompt must be valid Unicode without lone surrogates"):
        Engine(ScriptedModel({}), TOK, 8).generate(prompt, 2)


def make_seq(prompt, outputs, max_tokens=4, eos=frozenset({0}), stop_ids=frozenset()):
    seq = Sequence("r", list(prompt), GenerationParams(max_tokens=max_tokens), eos_ids=eos,
                   generator=None, detokenizer=None, stop_token_ids=stop_ids)
    for t in outputs:
        seq.append(t)
    return seq


@pytest.mark.parametrize("prompt, outputs, kwargs, expected", [
    ([2], [], {}, None),                                         # nothing generated yet
    ([2, 2, 2, 2], [], {}, ("length", None)),                    # the prompt fills the context
    ([2], [3], {}, None),
    ([2], [0], {}, ("stop", None)),                              # EOS
    ([2], [0], {"eos": frozenset()}, None),                      # ignore_eos: EOS is ordinary
    ([2], [4], {"stop_ids": frozenset({4})}, ("stop", 4)),       # a stop token names itself
    ([2], [3, 3, 3, 0], {}, ("stop", None)),                     # EOS as the last allowed token
    ([2], [3, 3, 3, 3], {}, ("length", None)),                   # the budget
    ([2], [3, 3, 3], {"max_tokens": 9}, ("length", None)),       # the window: 4 tokens
])
def test_stop_rule_by_hand(prompt, outputs, kwargs, expected):
    assert stop_rule(make_seq(prompt, outputs, **kwargs), max_context=4) == expected


def test_stop_rule_stop_string_comes_after_stop_tokens_and_before_the_budget():
    seq = make_seq([2], [3, 3, 3, 3])
    seq.matched_stop_string = "b"
    assert stop_rule(seq, 16) == ("stop", "b")
    seq = make_seq([2], [4], stop_ids=frozenset({4}))
    seq.matched_stop_string = "b"
    assert stop_rule(seq, 16) == ("stop", 4)


def test_a_later_chapters_params_are_refused_where_they_would_be_ignored():
    import s04_sampling as s04
    engine = Engine(ScriptedModel({}), TOK, max_context=16)
    with pytest.raises(ValueError, match=r"this engine does not implement \['top_p'\] "
                                         r"\(fields of SamplingParams\)"):
        engine.generate("a", s04.SamplingParams(max_tokens=3, top_p=0.5))
    # Left at their defaults, a later chapter's params work: only S01's fields are used.
    g = engine.generate("a", s04.SamplingParams(max_tokens=3, temperature=0))
    assert g.token_ids == [2, 2, 2]


@pytest.mark.parametrize("eos_ids", [(0, 99), (-1,), (2.0,), ("0",), (True,)])
def test_tokenizer_eos_ids_must_be_ids_of_the_model(eos_ids):
    class Tok(WordTokenizer):
        pass
    tok = Tok(VOCAB)
    tok.eos_ids = eos_ids
    with pytest.raises(ValueError, match=r"the tokenizer's EOS ids must be integers in \[0, V=7\)"):
        Engine(ScriptedModel({}), tok, max_context=8)


@pytest.mark.parametrize("output, got", [
    (None, "NoneType"), (np.zeros((0, 7), np.float32), r"float32 \(0, 7\)"),
    (np.zeros((2, 8), np.float32), r"float32 \(2, 8\)"), (np.zeros((2, 7), np.int64), "int64"),
])
def test_model_output_that_is_not_logits_of_shape_t_v_is_named(output, got):
    class Broken:
        vocab_size = 7

        def forward(self, ids):
            return output
    with pytest.raises(ValueError, match=rf"model.forward must return float logits of shape "
                                         rf"\(T, V\) = \(2, 7\) \(got {got}"):
        Engine(Broken(), TOK, 8).generate("a b", 2)


def test_max_context_may_not_exceed_a_models_window():
    class Windowed(ScriptedModel):
        class config:
            max_position_embeddings = 6
    with pytest.raises(ValueError, match=r"max_context \(7\) must be <= the model's "
                                         r"max_position_embeddings \(6\)"):
        Engine(Windowed({}), TOK, max_context=7)
    assert Engine(Windowed({}), TOK, max_context=6).generate("a", 9).token_ids == [2] * 5


def test_result_of_a_failed_stream_names_the_failure():
    class FailsSecond(ScriptedModel):
        def forward(self, token_ids):
            if len(token_ids) > 2:
                raise ValueError("the model broke")
            return super().forward(token_ids)
    stream = Engine(FailsSecond({}), TOK, 16).stream("a b", 5)
    next(stream)
    with pytest.raises(ValueError, match="the model broke"):
        next(stream)
    with pytest.raises(ValueError, match="the request failed, so it has no result: "
                                         "ValueError: the model broke"):
        stream.result
