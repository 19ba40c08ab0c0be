"""Tests for S07's workloads (code/s07_workloads.py): seeded requests of exact token lengths.

Oracles: the project tokenizer and S01's word tokenizer (a prompt's token count, encoded
independently of the cut), the corpus itself (every prompt is a piece of it), and the
lengths of each kind as stated in `WORKLOAD_KINDS`.
"""
import pytest

import s01_generation_loop as s01
import s07_workloads as s07w
from s03_checkpoint import CheckpointTokenizer
from s07_workloads import Request, Workload, make_workload, prompt_of_length

TOKENIZER_JSON = s07w.ROOT / "data" / "tokenizer.json"
EOS = 2047   # <|endoftext|> in data/tokenizer.json


@pytest.fixture(scope="module")
def tokenizer():
    return CheckpointTokenizer(TOKENIZER_JSON, [EOS])


@pytest.mark.parametrize("kind", sorted(s07w.WORKLOAD_KINDS))
def test_workload_is_reproducible_and_exact(kind, tokenizer):
    first = make_workload(kind, tokenizer, 5, seed=3, max_context=256)
    again = make_workload(kind, tokenizer, 5, seed=3, max_context=256)
    other = make_workload(kind, tokenizer, 5, seed=4, max_context=256)
    assert first == again
    assert first.requests != other.requests
    (p_lo, p_hi), (o_lo, o_hi) = s07w.WORKLOAD_KINDS[kind]
    corpus = s07w.CORPUS_PATH.read_text(encoding="utf-8")
    for r in first.requests:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_tokens
        assert p_lo <= r.prompt_tokens <= p_hi and o_lo <= r.max_tokens <= o_hi
        assert r.prompt in corpus
    assert first.max_context <= 256
    assert [r.request_id for r in first.requests] == list(range(5))


def test_workload_output_cap_and_word_tokenizer():
    words, _ = s01.build_default()
    w = make_workload("chat", words, 4, seed=0, max_context=64, max_output_tokens=5)
    assert all(r.max_tokens <= 5 for r in w.requests)
    assert all(len(words.encode(r.prompt)) == r.prompt_tokens for r in w.requests)


def test_prompt_of_length_rejects_a_cut_that_re_encodes_differently(tokenizer):
    text = "To be, or not to be, that is the question."
    prompt = prompt_of_length(text, 0, 5, tokenizer)
    assert prompt is not None and len(tokenizer.encode(prompt)) == 5
    assert prompt_of_length(text, 0, 10_000, tokenizer) is None     # the text is too short


def test_max_context_is_the_longest_request():
    w = Workload("w", 0, (Request(0, "a", 3, 4), Request(1, "b", 10, 1)))
    assert w.max_context == 11


def test_workload_errors(tokenizer):
    with pytest.raises(ValueError, match="kind must be one of"):
        make_workload("poetry", tokenizer, 1, 0, 256)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        make_workload("chat", tokenizer, 0, 0, 256)
    for seed in (-1, None, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer >= 0"):
            make_workload("chat", tokenizer, 1, seed, 256)
    with pytest.raises(ValueError, match=r"needs max_context >= 224 tokens"):
        make_workload("long", tokenizer, 1, 0, 200)
    with pytest.raises(ValueError, match="max_output_tokens must be >= 1"):
        make_workload("chat", tokenizer, 1, 0, 256, max_output_tokens=0)
    with pytest.raises(ValueError, match="no speech of the corpus gave a prompt"):
        make_workload("chat", tokenizer, 1, 0, 256, text="Ham.\nNo.\n\nHor.\nYes.\n")
