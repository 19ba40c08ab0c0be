"""Reference solutions for the S01 exercises. Try exercises/s01_generation_loop.py first."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from s01_generation_loop import Engine


# Exercise 1 -----------------------------------------------------------------------------------

def apply_stop_strings(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    hits = [(text.find(s), i, s) for i, s in enumerate(stop) if s and s in text]
    if not hits:
        return text, None
    pos, _, matched = min(hits)  # earliest start; on a tie, the earlier entry in `stop`
    return text[:pos], matched


class StopStringEngine(Engine):
    def __init__(self, model, tokenizer, max_context: int, stop: Sequence[str]):
        if not stop or any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError("stop must be a non-empty list of non-empty strings")
        super().__init__(model, tokenizer, max_context)
        self.stop = list(stop)

    def filter_text(self, seq, text: str) -> str:
        visible = [t for t in seq.output_ids if t not in seq.eos_ids]
        cut, matched = apply_stop_strings(self.tokenizer.decode(visible), self.stop)
        if matched is not None:
            seq.matched_stop_string = matched   # stop_rule ends the request
            return cut                          # all of the text before the stop string
        return ""                               # no match yet: the end shows the whole text

    def end_text(self, seq) -> str:
        return seq.detokenizer.flush()


# Exercise 2 -----------------------------------------------------------------------------------

class WordStreamer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.previous: int | None = None

    def feed(self, token_id: int) -> str:
        if self.previous is None:
            delta = self.tokenizer.decode([token_id])
        else:  # the pair's text minus the previous word's: the space (if any) and the word
            delta = self.tokenizer.decode([self.previous, token_id])[
                len(self.tokenizer.decode([self.previous])):]
        if token_id != self.tokenizer.eos_id:
            self.previous = token_id
        return delta

    def flush(self) -> str:
        return ""


class StreamingEngine(Engine):
    def make_detokenizer(self):
        return WordStreamer(self.tokenizer)


# Exercise 3 -----------------------------------------------------------------------------------

def time_passes(model, lengths: Sequence[int], repeats: int = 3) -> list[float]:
    times = []
    for n in lengths:
        ids = [i % model.vocab_size for i in range(n)]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model.forward(ids)
            best = min(best, time.perf_counter() - start)
        times.append(best)
    return times


def fit_growth(lengths: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    n = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if n.shape != t.shape or n.size < 2:
        raise ValueError("lengths and times_s must have the same length, at least 2")
    if np.any(n <= 0) or np.any(t <= 0):
        raise ValueError("lengths and times_s must be > 0 to fit a power law")
    exponent, log_c = np.polyfit(np.log(n), np.log(t), 1)
    return float(exponent), float(np.exp(log_c))
