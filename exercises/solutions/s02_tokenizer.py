"""Reference solutions for the S02 exercises. Try exercises/s02_tokenizer.py first."""
from __future__ import annotations

from collections import Counter
from typing import Iterator, Sequence

import regex

from s02_tokenizer import SPLIT_PATTERN, BPETokenizer


# Exercise 1 -----------------------------------------------------------------------------------

def train_merges(text: str, num_merges: int, pattern: str = SPLIT_PATTERN) -> list[bytes]:
    if num_merges < 0:
        raise ValueError(f"num_merges must be >= 0 (got {num_merges})")
    counts = Counter(regex.findall(pattern, text))
    words = [[bytes([b]) for b in piece.encode("utf-8")] for piece in counts]
    freqs = list(counts.values())
    known = {bytes([b]) for b in range(256)}
    new_tokens: list[bytes] = []
    while len(new_tokens) < num_merges:
        pairs: Counter = Counter()
        for word, freq in zip(words, freqs):
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))  # most frequent, then smallest
        merged = best[0] + best[1]
        for w, word in enumerate(words):
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[w] = out
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
    return new_tokens


# Exercise 2 -----------------------------------------------------------------------------------

def encode_with_merges(piece: bytes, merges: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
    priority = {pair: i for i, pair in reversed(list(enumerate(merges)))}  # first listing wins
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        candidates = [(priority[pair], i) for i, pair in enumerate(zip(parts, parts[1:]))
                      if pair in priority]
        if not candidates:
            break
        _, i = min(candidates)                      # earliest rule, then leftmost
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


# Exercise 3 -----------------------------------------------------------------------------------

def stream_text(tokenizer: BPETokenizer, ids: Sequence[int]) -> Iterator[str]:
    start = 0                                       # ids[:start] are shown
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[start:end])
        if text.endswith("\ufffd"):
            continue                                # maybe an unfinished character: wait
        if text:
            yield text
        start = end
    rest = tokenizer.decode(ids[start:])
    if rest:
        yield rest


# Exercise 4 -----------------------------------------------------------------------------------

def held_back_length(text: str, stop: Sequence[str]) -> int:
    if any(not s for s in stop):
        raise ValueError("stop strings must be non-empty")
    longest = max((len(s) for s in stop), default=1)
    for k in range(min(len(text), longest - 1), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stop):
            return k
    return 0
