"""Graded tests for the S01 exercises (see exercises/s01_generation_loop.py)."""
import numpy as np
import pytest

from exercise_loader import load_exercise
from s01_generation_loop import EOS, UNK, Engine, WordTokenizer

ex = load_exercise("s01_generation_loop")

TOK = WordTokenizer([EOS, UNK, "not", "to", "be", ",", "or", "\n"])
NOT, TO, BE, COMMA, OR, NL = 2, 3, 4, 5, 6, 7


class Script:
    """Greedy model that emits `tokens` in order (then EOS) and counts its passes."""

    def __init__(self, tokens):
        self.tokens, self.vocab_size, self.passes = list(tokens), TOK.vocab_size, 0

    def forward(self, ids):
        self.passes += 1
        logits = np.zeros((len(ids), self.vocab_size), dtype=np.float32)
        k = self.passes - 1
        logits[-1, self.tokens[k] if k < len(self.tokens) else TOK.eos_id] = 5.0
        return logits


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_apply_stop_strings_earliest_and_tie():
    assert ex.apply_stop_strings("to be or not", ["or", "be"]) == ("to ", "be")
    assert ex.apply_stop_strings("to be or not", ["xyz"]) == ("to be or not", None)
    assert ex.apply_stop_strings("abc", ["bc", "b"]) == ("a", "bc")
    assert ex.apply_stop_strings("abc", ["b", "bc"]) == ("a", "b")


@pytest.mark.points(2)
def test_stop_string_straddling_a_token_boundary():
    # tokens: "to" "be" "," "or" "not" "to" "be": the stop "or not" spans two tokens.
    model = Script([TO, BE, COMMA, OR, NOT, TO, BE])
    g = ex.StopStringEngine(model, TOK, 64, stop=["or not"]).generate("not", 20)
    assert g.text == "to be, "  # the text before the stop string, to the character
    assert g.finish_reason == "stop" and g.stop_reason == "or not"
    assert g.token_ids == [TO, BE, COMMA, OR, NOT]  # stopped right after the completing token
    assert model.passes == 5


@pytest.mark.points(1)
def test_stop_strings_keep_the_other_rules():
    g = ex.StopStringEngine(Script([TO, BE]), TOK, 64, stop=["xyz"]).generate("not", 20)
    assert g.text == "to be" and g.finish_reason == "stop" and g.stop_reason is None  # EOS
    g = ex.StopStringEngine(Script([TO] * 9), TOK, 64, stop=["be"]).generate("not", 3)
    assert g.finish_reason == "length" and len(g.token_ids) == 3 and g.text == "to to to"
    with pytest.raises(ValueError):
        ex.StopStringEngine(Script([TO]), TOK, 64, stop=[""])


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(2)
def test_stream_joins_to_generate():
    tokens = [TO, BE, COMMA, OR, NOT, NL, TO, BE]
    for max_tokens in (1, 3, 8, 20):
        expected = Engine(Script(tokens), TOK, 64).generate("not", max_tokens).text
        outputs = list(ex.StreamingEngine(Script(tokens), TOK, 64).stream("not", max_tokens))
        assert "".join(o.text_delta for o in outputs) == expected
        # every word arrives with its own token (EOS, the last output, adds none)
        assert all(o.text_delta for o in outputs if o.new_token_ids != [TOK.eos_id])


@pytest.mark.points(1)
def test_stream_is_lazy_and_streams():
    model = Script([TO, BE, OR])
    stream = ex.StreamingEngine(model, TOK, 64).stream("not", 3)
    assert model.passes == 0
    assert next(stream).text_delta == "to" and model.passes == 1
    assert next(stream).text_delta == " be"


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(2)
def test_fit_growth_recovers_power_laws():
    n = np.array([16, 32, 64, 128, 256])
    k, c = ex.fit_growth(n, 3e-9 * n ** 2.0)
    assert k == pytest.approx(2.0, abs=1e-9) and c == pytest.approx(3e-9, rel=1e-6)
    k, _ = ex.fit_growth(n, 5e-7 * n)
    assert k == pytest.approx(1.0, abs=1e-9)
    noise = np.exp(np.random.default_rng(0).normal(0, 0.05, n.size))
    k, _ = ex.fit_growth(n, 1e-8 * n ** 2 * noise)
    assert abs(k - 2.0) < 0.15
    with pytest.raises(ValueError):
        ex.fit_growth([1, 2], [1.0])
    with pytest.raises(ValueError):
        ex.fit_growth([1, 2], [0.0, 1.0])


@pytest.mark.points(1)
def test_time_passes_measures_each_length():
    class Counting:
        vocab_size = 10
        calls = []

        def forward(self, ids):
            self.calls.append(len(ids))
            return np.zeros((len(ids), 10), dtype=np.float32)

    model = Counting()
    times = ex.time_passes(model, [4, 8], repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert model.calls == [4, 4, 8, 8]
