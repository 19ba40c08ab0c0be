"""Reference solutions for the S01 exercises. Try exercises/s01_generation_loop.py first."""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from s01_generation_loop import STOP_EOS, Engine, Generation, Stats, sample


# Exercise 1 -----------------------------------------------------------------------------------

def apply_stop_strings(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    hits = [(text.find(s), i, s) for i, s in enumerate(stop) if s and s in text]
    if not hits:
        return text, None
    pos, _, matched = min(hits)  # earliest start; on a tie, the earlier entry in `stop`
    return text[:pos], matched


def generate_with_stop(engine: Engine, prompt: str, max_tokens: int, stop: Sequence[str],
                       temperature: float = 0.0, seed: int | None = None) -> Generation:
    if not stop or any(not isinstance(s, str) or s == "" for s in stop):
        raise ValueError("stop must be a non-empty list of non-empty strings")
    ids = engine.check_request(prompt, max_tokens, temperature, seed)
    rng = np.random.default_rng(seed)
    stats = Stats(prompt_tokens=len(ids))
    out: list[int] = []
    while stats.stop_reason is None:
        if len(ids) >= engine.max_context:
            stats.stop_reason = "context_full"
            break
        logits = engine.model.forward(ids)
        stats.context_lens.append(len(ids))
        token = sample(logits[-1], temperature, rng)
        ids.append(token)
        out.append(token)
        stats.tokens_out = len(out)
        stats.stop_reason = engine.stop_reason(token, len(out), max_tokens)
        text, matched = apply_stop_strings(engine.tokenizer.decode(out), stop)
        if matched is not None:
            stats.stop_reason = STOP_EOS  # finish_reason "stop", like EOS
            return Generation(text=text, token_ids=out, stats=stats)
    text_ids = out[:-1] if out and out[-1] == engine.tokenizer.eos_id else out
    return Generation(text=engine.tokenizer.decode(text_ids), token_ids=out, stats=stats)


# Exercise 2 -----------------------------------------------------------------------------------

def stream(engine: Engine, prompt: str, max_tokens: int, temperature: float = 0.0,
           seed: int | None = None) -> Iterator[str]:
    ids = engine.check_request(prompt, max_tokens, temperature, seed)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    sent = ""
    while len(ids) < engine.max_context:
        token = sample(engine.model.forward(ids)[-1], temperature, rng)
        ids.append(token)
        out.append(token)
        if token == engine.tokenizer.eos_id:
            return
        text = engine.tokenizer.decode(out)
        if len(text) > len(sent):
            yield text[len(sent):]
            sent = text
        if len(out) >= max_tokens:
            return


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
