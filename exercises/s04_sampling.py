"""S04 exercises: typical sampling, a no-repeat n-gram rule, and scoring text with logprobs.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s04

Everything you need is in code/s04_sampling.py (imported below): `check_logits` validates a row
of logits and returns a float32 copy, `log_softmax` is numerically safe, `NEG_INF` is the only
"removed" marker, and `Engine.sample(logits, seq)` is the seam a subclass overrides (the loop is
S01's `Engine.run`; `seq` is S01's `Sequence`, whose `token_ids` are the prompt and the output so
far). Reference solutions are in exercises/solutions/ -- try first, peek later.

Shape legend: T tokens, V vocabulary. Logits are float32 arrays (V,) unless stated otherwise.
"""
from __future__ import annotations

import math  # noqa: F401  (you will want it)
from typing import Sequence

import numpy as np  # noqa: F401

from s04_sampling import NEG_INF, Engine, check_logits, log_softmax  # noqa: F401


# Exercise 1: typical sampling (3 points) -------------------------------------------------------
# Top-p keeps the most likely tokens. Locally typical sampling (Meister et al., TACL 2023) keeps
# the tokens whose surprise, -log p, is closest to the distribution's entropy H, the *expected*
# surprise: the tokens that are about as informative as a typical token. It can drop the most
# likely token when that token is far more predictable than the distribution as a whole.

def apply_typical_p(logits: np.ndarray, typical_p: float) -> np.ndarray:
    """Typical-p filter on one row of logits (V,); returns new float32 logits (V,).

    1. Validate: typical_p must be a number in (0, 1], else ValueError whose message contains
       "typical_p must be a number in (0, 1]"; the logits go through `check_logits` (so a bad
       row raises its ValueError). typical_p == 1 returns the row unchanged (a copy).
    2. p = softmax(logits), H = -sum_i p_i log p_i over tokens with p_i > 0 (natural log;
       compute in float64). Each token's score is |(-log p_i) - H|; -inf logits never count.
    3. Order the tokens by score, ascending (equal scores: lower id first). Walk that order
       and keep a token while the probability mass of the tokens *before* it is < typical_p:
       the token that reaches or crosses typical_p is kept, and the first one always is.
    4. Also keep every token whose score equals the largest kept score (a tie with the last
       kept token), as Hugging Face's `TypicalLogitsWarper` does. Every other token -> -inf.

    Do not edit the caller's array. Example: probabilities (0.5, 0.25, 0.125, 0.125) have
    H = 1.75 ln 2, scores (0.75, 0.25, 1.25, 1.25) x ln 2, so typical_p = 0.2 keeps only token 1
    (not the most likely token 0), 0.5 keeps tokens {0, 1}, 0.8 keeps all four.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: no repeated n-grams (4 points) ----------------------------------------------------
# S01's greedy bigram looped on "thou art thou art". A blunt but popular cure (fairseq, HF
# `no_repeat_ngram_size`): never generate a token that would complete an n-gram (n consecutive
# tokens) that already occurs in the context, prompt included.

def banned_tokens(ids: Sequence[int], n: int) -> set[int]:
    """The token ids that would repeat an n-gram if appended to `ids` (the whole context).

    A token x is banned when (ids[-(n-1):] + [x]) already occurs somewhere in `ids` as n
    consecutive tokens. n = 1 bans every token in `ids`; fewer than n - 1 tokens (or exactly
    n - 1, with no earlier n-gram) ban nothing. ValueError whose message contains
    "no_repeat_ngram_size must be an int >= 1" for any other n.
    Example: ids = [5, 6, 7, 5, 6]; n = 3 bans {7}, n = 2 bans {7}, n = 4 bans set().
    """
    raise NotImplementedError("exercise 2a")


def apply_no_repeat_ngram(logits: np.ndarray, ids: Sequence[int], n: int) -> np.ndarray:
    """Set the logits of `banned_tokens(ids, n)` to -inf; returns new float32 logits (V,).

    Validate the row with `check_logits`. ValueError if a banned id is outside [0, V), and
    ValueError whose message contains "ruled out every token" if no finite logit is left.
    Do not edit the caller's array.
    """
    raise NotImplementedError("exercise 2b")


class NoRepeatNGramEngine(Engine):
    """S04's Engine that never repeats an n-gram of its context (prompt and output).

    __init__(model, tokenizer, max_context, no_repeat_ngram_size, **kwargs): validate the size
    first (the same ValueError as `banned_tokens`), pass everything else to Engine, keep the
    size in `self.no_repeat_ngram_size`. Override one seam, `sample(logits, seq)`: remove the
    tokens banned by the context `seq.token_ids` from the model's raw logits (V,), then hand
    the row to Engine.sample. Nothing else changes: penalties, temperature, filters, stop rules
    and seeds all work as before, because every step of the pipeline keeps a -inf logit at
    -inf.
    """

    def __init__(self, model, tokenizer, max_context: int, no_repeat_ngram_size: int,
                 **kwargs):
        raise NotImplementedError("exercise 2c")

    def sample(self, logits: np.ndarray, seq) -> int:
        raise NotImplementedError("exercise 2c")


# Exercise 3: scoring text (3 points) -----------------------------------------------------------
# Generation needs one pass per token. Scoring a text that already exists needs ONE pass: row
# t - 1 of forward(ids) scores the token at position t. This is vLLM's `prompt_logprobs` and how
# perplexity is measured.

def prompt_logprobs(model, token_ids: Sequence[int]) -> list[float | None]:
    """log p(token_ids[t] | token_ids[:t]) for every position t, from one model.forward call.

    Returns a list of length T: None at position 0 (nothing predicts the first token), then
    floats (natural log) taken from the log-softmax of row t - 1 of the (T, V) logits.
    ValueError if token_ids is empty or holds an id outside [0, model.vocab_size).
    """
    raise NotImplementedError("exercise 3a")


def perplexity(logprobs: Sequence[float | None]) -> float:
    """exp(-mean of the logprobs), skipping None entries. Example: [None, log 0.5, log 0.25]
    -> exp(-(log 0.5 + log 0.25) / 2) = sqrt(8).

    ValueError if no entry is a number, or if one is NaN or > 0 (not a log-probability).
    """
    raise NotImplementedError("exercise 3b")
