"""Reference solutions for the S04 exercises. Try exercises/s04_sampling.py first.

Sources followed: C. Meister, T. Pimentel, G. Wiher, R. Cotterell, "Locally Typical Sampling"
(TACL 2023) for typical-p, with Hugging Face `TypicalLogitsWarper`'s tie rule; the n-gram ban of
fairseq's sequence generator as Hugging Face `NoRepeatNGramLogitsProcessor` has it (prompt
included); vLLM's `prompt_logprobs` (None for the first prompt token) for scoring.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from s04_sampling import NEG_INF, Engine, check_logits, log_softmax


# Exercise 1 -----------------------------------------------------------------------------------

def apply_typical_p(logits: np.ndarray, typical_p: float) -> np.ndarray:
    if isinstance(typical_p, bool) or not isinstance(typical_p, (int, float)) \
            or not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be a number in (0, 1] (got {typical_p!r})")
    row = check_logits(logits)
    if typical_p == 1:
        return row
    logp = log_softmax(row).astype(np.float64)                  # (V,)
    finite = np.isfinite(logp)
    p = np.where(finite, np.exp(logp), 0.0)
    entropy = -np.sum(p[finite] * logp[finite])                 # nats
    score = np.where(finite, np.abs(-logp - entropy), np.inf)   # (V,) distance from "typical"
    order = np.lexsort((np.arange(row.size), score))            # score ascending, then id
    mass_before = np.cumsum(p[order]) - p[order]
    keep = mass_before < typical_p
    keep[0] = True
    threshold = score[order][keep].max()
    out = row.copy()
    out[~(score <= threshold) | ~finite] = NEG_INF
    return out


# Exercise 2 -----------------------------------------------------------------------------------

def _check_n(n) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 1 (got {n!r})")


def banned_tokens(ids: Sequence[int], n: int) -> set[int]:
    _check_n(n)
    ids = [int(i) for i in ids]
    if n == 1:
        return set(ids)
    if len(ids) < n - 1:
        return set()
    prefix = tuple(ids[len(ids) - (n - 1):])
    return {ids[i + n - 1] for i in range(len(ids) - n + 1) if tuple(ids[i:i + n - 1]) == prefix}


def apply_no_repeat_ngram(logits: np.ndarray, ids: Sequence[int], n: int) -> np.ndarray:
    row = check_logits(logits)
    banned = banned_tokens(ids, n)
    if any(not 0 <= i < row.size for i in banned):
        raise ValueError(f"ids must lie in [0, V={row.size})")
    if banned:
        row[np.fromiter(banned, dtype=np.int64)] = NEG_INF
    if not np.isfinite(row).any():
        raise ValueError("no_repeat_ngram_size ruled out every token")
    return row


class NoRepeatNGramEngine(Engine):
    def __init__(self, model, tokenizer, max_context: int, no_repeat_ngram_size: int,
                 **kwargs):
        _check_n(no_repeat_ngram_size)
        super().__init__(model, tokenizer, max_context, **kwargs)
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)

    def sample(self, logits: np.ndarray, seq) -> int:
        banned = apply_no_repeat_ngram(logits, seq.token_ids, self.no_repeat_ngram_size)
        return super().sample(banned, seq)


# Exercise 3 -----------------------------------------------------------------------------------

def prompt_logprobs(model, token_ids: Sequence[int]) -> list[float | None]:
    ids = [int(i) for i in token_ids]
    if not ids:
        raise ValueError("token_ids must not be empty")
    if any(not 0 <= i < model.vocab_size for i in ids):
        raise ValueError(f"token_ids must lie in [0, V={model.vocab_size})")
    if len(ids) == 1:
        return [None]
    logits = np.asarray(model.forward(ids), dtype=np.float32)  # (T, V)
    scores: list[float | None] = [None]
    for t in range(1, len(ids)):
        scores.append(float(log_softmax(logits[t - 1])[ids[t]]))
    return scores


def perplexity(logprobs: Sequence[float | None]) -> float:
    values = [float(v) for v in logprobs if v is not None]
    if not values:
        raise ValueError("perplexity needs at least one logprob that is not None")
    if any(math.isnan(v) or v > 0 for v in values):
        raise ValueError("logprobs must be <= 0 (log-probabilities), not NaN")
    return math.exp(-sum(values) / len(values))
