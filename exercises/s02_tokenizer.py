"""S02 exercises: training BPE, merge lists, text-level streaming, and stop-string hold-back.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s02

Everything you need is in code/s02_tokenizer.py (imported below). Reference solutions are in
exercises/solutions/ -- try first, peek later.
"""
from __future__ import annotations

from collections import Counter  # noqa: F401  (you will want it)
from typing import Iterator, Sequence

import regex  # noqa: F401  (the `regex` package: \p{L} and friends)

from s02_tokenizer import SPLIT_PATTERN, BPETokenizer  # noqa: F401


# Exercise 1: train BPE the plain way (4 points) -------------------------------------------------
# The chapter's train_bpe keeps pair counts up to date with a heap. Here you write the textbook
# version: recount everything after every merge. It is slow, but it is obviously right, and it
# must learn exactly the same tokens.

def train_merges(text: str, num_merges: int, pattern: str = SPLIT_PATTERN) -> list[bytes]:
    """Learn `num_merges` new byte-level BPE tokens from `text`; return their bytes in the order
    they were made (so result[k] is the token with id 256 + k).

    1. Cut `text` into pre-tokens with `regex.findall(pattern, text)`; count each distinct
       pre-token once, with its frequency. Each pre-token starts as its UTF-8 bytes, one token
       per byte (b"the" -> [b"t", b"h", b"e"]).
    2. Until the result holds `num_merges` tokens: count every adjacent pair of tokens inside
       every pre-token, weighted by the pre-token's frequency (never across two pre-tokens).
       Take the most frequent pair; on a tie, the smallest pair, comparing (left bytes,
       right bytes) as a tuple. Merge every occurrence of it, left to right, in every
       pre-token, and append left + right to the result.
       If left + right is already a token (it can happen: b"ab" + b"c" after b"a" + b"bc"), the
       merge still happens in the pre-tokens, but nothing is appended: no new token was made.
    Stop early, without error, when no pre-token has two tokens left.

    Example: train_merges("aaabdaaabac", 3) == [b"aa", b"ab", b"aaab"].
    Raise ValueError if num_merges is negative.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: encode with a merge list (2 points) ------------------------------------------------
# A Hugging Face tokenizer.json stores merge RULES: pairs of tokens in priority order. The
# chapter's encoder ranks a pair by the token it makes instead. Here you use the rules.

def encode_with_merges(piece: bytes, merges: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
    """Cut one pre-token into tokens by applying merge rules in priority order.

    Start from single bytes. Repeatedly find, among the adjacent pairs of the current parts, the
    one that appears EARLIEST in `merges` (the leftmost occurrence if it appears several times),
    and merge it. Stop when no adjacent pair is in `merges`. Return the parts.

    Example: encode_with_merges(b"aaab", [(b"a", b"a"), (b"a", b"b"), (b"aa", b"ab")])
    == [b"aaab"]. An empty piece gives [].
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: stream at the text level (2 points) ------------------------------------------------
# The chapter's StreamingDetokenizer looks at UTF-8 bytes when the tokenizer offers them.
# transformers' streamers and vLLM's detokenizer never do: they decode text and wait while it
# ends in U+FFFD. Rebuild that rule in its simplest form, without the chapter's window (our
# byte-level decode does not depend on a token's neighbours, so no window is needed here).

def stream_text(tokenizer: BPETokenizer, ids: Sequence[int]) -> Iterator[str]:
    """Yield text deltas for `ids`, fed one at a time, using only `tokenizer.decode` (no bytes).

    After each id, decode the ids that are not shown yet; if that text ends with "\\ufffd" the
    last character may still be incomplete, so show nothing yet. Otherwise yield it (if it is
    not empty) and remember that those ids are shown. After the last id, yield whatever is left
    (if not empty), U+FFFD included: those bytes never completed.

    Contract: "".join(stream_text(tok, ids)) == tok.decode(ids), and for ids that encode valid
    text no delta contains U+FFFD. Never yield "". Decode only the ids not yet shown, not the
    whole list every time (that would be quadratic in the length of the answer).
    """
    raise NotImplementedError("exercise 3")


# Exercise 4: how much to hold back (2 points) ---------------------------------------------------
# A streaming server must not show text that could turn out to be the start of a stop string.

def held_back_length(text: str, stop: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of some stop string
    (a proper prefix: shorter than the stop string itself), or 0 if there is none.

    Examples: held_back_length("Hello\\n", ["\\n\\n"]) == 1;
    held_back_length("to the e", ["the end"]) == 5 (the suffix "the e");
    held_back_length("abc", ["x"]) == 0 (a one-character stop string is never held back).
    Assume no stop string occurs complete in `text` (the matcher would have stopped).
    Raise ValueError if a stop string is empty.
    """
    raise NotImplementedError("exercise 4")
