"""Graded tests for the S02 exercises (see exercises/s02_tokenizer.py).

Oracles: values worked out by hand (in the comments), the chapter's tested `train_bpe` and
`StopStringMatcher` (tests/test_s02_tokenizer.py pins them to tiktoken, HF and hand values), HF
`tokenizers` (a BPE model that applies merge rules, and its streaming `DecodeStream`), and
Python's own UTF-8 codec.
"""
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from exercise_loader import load_exercise
from s02_tokenizer import (
    CORPUS_PATH, TOKENIZER_PATH, BPETokenizer, StopStringMatcher, bytes_to_unicode, train_bpe,
)

ex = load_exercise("s02_tokenizer")

CORPUS = CORPUS_PATH.read_text(encoding="utf-8")
PROJECT = BPETokenizer.load_hf(TOKENIZER_PATH)
FILE = json.loads(TOKENIZER_PATH.read_text(encoding="utf-8"))
_CHAR_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _bytes(token: str) -> bytes:
    return bytes(_CHAR_BYTE[c] for c in token)


MERGES = [(_bytes(a), _bytes(b)) for a, b in FILE["model"]["merges"]]


def new_tokens(tokenizer: BPETokenizer) -> list[bytes]:
    """The merged tokens of a trained tokenizer, in id order (ids 256, 257, ...)."""
    return [b for b, i in sorted(tokenizer.ranks.items(), key=lambda kv: kv[1]) if i >= 256]


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_train_merges_textbook_example():
    # "aaabdaaabac": aa (4x) -> XabdXabac; ab and (aa, a) tie at 2, (b"a", b"b") is the
    # smaller pair -> ab; then (aa, ab) (2x) -> aaab. Worked by hand.
    assert ex.train_merges("aaabdaaabac", 3) == [b"aa", b"ab", b"aaab"]
    assert ex.train_merges("aaabdaaabac", 0) == []
    # Pairs never cross pre-tokens: "ab ab" is "ab", " ab" -> merges ab, then " "+ab, then none.
    assert ex.train_merges("ab ab", 10) == [b"ab", b" ab"]
    with pytest.raises(ValueError):
        ex.train_merges("ab", -1)


@pytest.mark.points(2)
def test_train_merges_learns_what_train_bpe_learns_on_the_corpus():
    text = CORPUS[:20_000]
    expected = new_tokens(train_bpe(text, 256 + 100 + 1))       # + 1: <|endoftext|>
    assert ex.train_merges(text, 100) == expected


@pytest.mark.points(1)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="abc é", min_size=2, max_size=30), st.integers(1, 8))
def test_train_merges_equals_train_bpe_on_small_texts(text, k):
    # Small alphabets make ties and re-made tokens (ab+c after a+bc) common.
    try:
        reference = train_bpe(text, 256 + k + 1)
    except ValueError:                                          # fewer than k tokens possible
        assume(False)
    assert ex.train_merges(text, k) == new_tokens(reference)


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_encode_with_merges_by_hand():
    assert ex.encode_with_merges(b"aaab", [(b"a", b"a"), (b"a", b"b"), (b"aa", b"ab")]) == [b"aaab"]
    # The rule listed first wins, wherever it is: bc before ab -> [a, bc]; swapped -> [ab, c].
    assert ex.encode_with_merges(b"abc", [(b"b", b"c"), (b"a", b"b")]) == [b"a", b"bc"]
    assert ex.encode_with_merges(b"abc", [(b"a", b"b"), (b"b", b"c")]) == [b"ab", b"c"]
    # Leftmost occurrence first: "aaa" with aa -> [aa, a].
    assert ex.encode_with_merges(b"aaa", [(b"a", b"a")]) == [b"aa", b"a"]
    assert ex.encode_with_merges(b"", [(b"a", b"a")]) == []
    assert ex.encode_with_merges(b"xyz", []) == [b"x", b"y", b"z"]


@pytest.mark.points(1)
def test_encode_with_merges_matches_hf_on_the_project_merge_list():
    # The oracle: HF tokenizers' BPE model applying the same merge list (whole-piece lookup
    # switched off, so it merges every piece by the rules, as the exercise does).
    data = json.loads(json.dumps(FILE))
    data["model"]["ignore_merges"] = False
    hf = Tokenizer.from_str(json.dumps(data))
    pieces = sorted(set(PROJECT.pre_tokenize(CORPUS[:30_000])))[:400]
    pieces += ["naïve", " café", "😀", " antidisestablishmentarianism", "    ", "12345678"]
    for piece in pieces:
        shown = "".join(bytes_to_unicode()[b] for b in piece.encode("utf-8"))
        expected = [_bytes(token.value) for token in hf.model.tokenize(shown)]
        assert ex.encode_with_merges(piece.encode("utf-8"), MERGES) == expected, piece


# Exercise 3 ----------------------------------------------------------------------------------

def decode_stream(ids):
    """HF tokenizers' streaming decoder on the project file: the chunks it returns."""
    hf = Tokenizer.from_file(str(TOKENIZER_PATH))
    stream = DecodeStream(skip_special_tokens=False)
    return [chunk for chunk in (stream.step(hf, i) for i in ids) if chunk]


@pytest.mark.points(1)
def test_stream_text_holds_back_a_split_emoji_and_decodes_only_new_ids():
    ids = PROJECT.encode("é😀!")             # one byte per token: C3 A9 F0 9F 98 80 21
    assert len(ids) == 7
    assert list(ex.stream_text(PROJECT, ids)) == ["é", "😀", "!"] == decode_stream(ids)
    # Bytes that never complete come out at the end, as U+FFFD (Python's codec says so).
    assert "".join(ex.stream_text(PROJECT, [0xF0, 0x9F])) == b"\xf0\x9f".decode("utf-8", "replace")

    # Decode only what is not shown yet: with ASCII text every token completes its characters,
    # so no decode call needs more than a few ids (decoding everything again would be quadratic).
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return PROJECT.decode(ids)

    ids = PROJECT.encode(CORPUS[:2_000])
    assert "".join(ex.stream_text(Counting(), ids)) == CORPUS[:2_000]
    assert max(calls) <= 4


@pytest.mark.points(1)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40), st.lists(st.integers(0, 2047), max_size=20))
def test_stream_text_joins_to_decode_and_shows_no_half_characters(text, ids):
    deltas = list(ex.stream_text(PROJECT, ids))
    assert "".join(deltas) == b"".join(PROJECT.id_to_bytes[i] for i in ids).decode("utf-8", "replace")
    assert all(deltas)
    valid = PROJECT.encode(text)
    deltas = list(ex.stream_text(PROJECT, valid))
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert deltas == decode_stream(valid)


# Exercise 4 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_held_back_length_by_hand():
    assert ex.held_back_length("Hello\n", ["\n\n"]) == 1
    assert ex.held_back_length("to the e", ["the end"]) == 5          # "the e"
    assert ex.held_back_length("abc", ["x"]) == 0
    assert ex.held_back_length("abc", ["."]) == 0                     # one character: never held
    assert ex.held_back_length("xab", ["abc", "bz"]) == 2             # "ab" beats "b"
    assert ex.held_back_length("", ["abc"]) == 0
    assert ex.held_back_length("abc", []) == 0
    with pytest.raises(ValueError):
        ex.held_back_length("abc", [""])


@pytest.mark.points(1)
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab\n.", max_size=20),
       st.lists(st.text(alphabet="ab\n.", min_size=1, max_size=5), min_size=1, max_size=3))
def test_held_back_length_equals_what_the_matcher_holds(text, stops):
    assume(not any(s in text for s in stops))
    matcher = StopStringMatcher(stops)
    shown = matcher.feed(text)
    assert ex.held_back_length(text, stops) == len(text) - len(shown)
