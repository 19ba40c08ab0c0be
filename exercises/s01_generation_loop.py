"""S01 exercises: stop strings and streaming through the engine's seams, and timing the loop.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s01

Everything you need is in code/s01_generation_loop.py (imported below). Reference solutions are
in exercises/solutions/ -- try first, peek later.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np  # noqa: F401  (you will want it)

from s01_generation_loop import Engine  # noqa: F401


# Exercise 1: stop strings (4 points) ------------------------------------------------------------
# Real APIs let the caller pass `stop=["\n\n", "THE END"]`: generation ends as soon as the
# completion text contains one of them, and the stop string itself is not returned. Stop strings
# are about TEXT, not tokens: "not to" may arrive as two tokens, "not" and "to".

def apply_stop_strings(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """Cut `text` before the earliest occurrence of any stop string.

    Returns (text before the match, the stop string that matched), or (text, None) if none
    occurs. When two stop strings start at the same position, the one listed first wins.
    Example: apply_stop_strings("to be or not", ["or", "be"]) == ("to ", "be").
    """
    raise NotImplementedError("exercise 1a")


class StopStringEngine(Engine):
    """S01's engine that also stops at stop strings, written by overriding seams only: the loop
    (`Engine.run`) and the stop rules (`stop_rule`) stay as they are.

    `stop`: a non-empty list of non-empty strings (else ValueError in __init__). After every
    token, look for the stop strings in the whole completion text so far (decode
    `seq.output_ids`, without EOS), so a stop string spread over two tokens is caught. When one
    occurs, set `seq.matched_stop_string` to it: S01's `stop_rule` then ends the request with
    finish_reason "stop" and stop_reason the stop string. The completion's text must be the
    text before the stop string. Hints: `filter_text(seq, text)` is called with each new piece
    of text and returns what may be shown; `end_text(seq)` gives what is left at the end. S01's
    detokenizer (`DecodeAtEnd`) shows nothing until the end, so `filter_text` sees "" until then:
    decide what you decode, and what `end_text` returns once a stop string matched (nothing more:
    the engine does not call it then).
    """

    def __init__(self, model, tokenizer, max_context: int, stop: Sequence[str]):
        raise NotImplementedError("exercise 1b")


# Exercise 2: streaming (3 points) ---------------------------------------------------------------
# A chat UI shows each word as it is produced instead of waiting for the whole answer. S01's
# stream yields one RequestOutput per token, but its text_delta stays "" until the end.

class WordStreamer:
    """A detokenizer for a word tokenizer (S01's), with the interface the engine expects:
    `feed(token_id) -> str` returns the text this token adds (for S01's tokenizer: the word,
    with the space decode puts before it, if any), `flush() -> str` what is left at the end.
    The deltas joined must equal `tokenizer.decode(all fed ids)`. Keep the work per token
    constant: do not decode the whole output every time (hint: the spacing of a word depends
    only on the word before it).
    """

    def __init__(self, tokenizer):
        raise NotImplementedError("exercise 2")

    def feed(self, token_id: int) -> str:
        raise NotImplementedError("exercise 2")

    def flush(self) -> str:
        raise NotImplementedError("exercise 2")


class StreamingEngine(Engine):
    """S01's engine whose stream shows each word as it arrives: override one seam so it uses
    `WordStreamer`."""


# Exercise 3: timing the loop (3 points) ---------------------------------------------------------
# Counted work says a pass over n tokens costs ~n^2 in a transformer. What does the clock say?

def time_passes(model, lengths: Sequence[int], repeats: int = 3) -> list[float]:
    """Wall seconds of `model.forward` on a context of each length in `lengths` (any valid ids,
    e.g. i % model.vocab_size), the minimum over `repeats` runs (the minimum is the least
    disturbed by other work on the machine). Use time.perf_counter.
    """
    raise NotImplementedError("exercise 3a")


def fit_growth(lengths: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Fit t = c * n**k by least squares on log t = k log n + log c. Return (k, c).

    Raise ValueError if the sequences differ in length, have fewer than 2 points, or hold a
    value <= 0 (a logarithm needs positive numbers).
    """
    raise NotImplementedError("exercise 3b")
