"""S01 exercises: stop strings, streaming, and timing the loop.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s01

Everything you need is in code/s01_generation_loop.py (imported below). Reference solutions are
in exercises/solutions/ -- try first, peek later.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np  # noqa: F401  (you will want it)

from s01_generation_loop import STOP_EOS, Engine, Generation, Stats, sample  # noqa: F401


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


def generate_with_stop(engine: Engine, prompt: str, max_tokens: int, stop: Sequence[str],
                       temperature: float = 0.0, seed: int | None = None) -> Generation:
    """Like `engine.generate`, but also stop as soon as the decoded completion contains a stop
    string (check after every token, on the whole completion text, so a stop string that spans
    two tokens is caught). Then return the text truncated before the stop string, all generated
    token ids, and stats whose finish_reason is "stop" (set stop_reason to STOP_EOS).

    Raise ValueError if `stop` is empty or contains an empty string. Reuse
    `engine.check_request` and `engine.stop_reason`; keep EOS, budget and context-full rules.
    """
    raise NotImplementedError("exercise 1b")


# Exercise 2: streaming (3 points) ---------------------------------------------------------------
# A chat UI shows each word as it is produced instead of waiting for the whole answer.

def stream(engine: Engine, prompt: str, max_tokens: int, temperature: float = 0.0,
           seed: int | None = None) -> Iterator[str]:
    """Yield the completion as text deltas, one per generated token that adds text, *while*
    generating (a generator: the first delta must be yielded after the first pass, not at the
    end). "".join(stream(...)) must equal engine.generate(...).text for the same arguments.
    Never yield EOS text or an empty string. Same validation and stop rules as generate.
    """
    raise NotImplementedError("exercise 2")


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
