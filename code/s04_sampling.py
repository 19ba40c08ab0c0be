r"""S04, sampling: `SamplingParams`, the logits-processor pipeline, seeds and logprobs.

What is new since S03
    S01 turned logits into a token with one knob, the temperature. Serving APIs expose about a
    dozen (OpenAI's and vLLM's `SamplingParams`), and each one is a small function from a row of
    logits (V,) to a row of logits (V,). This chapter writes them one by one, chains them in the
    order vLLM and Hugging Face use, and plugs them into S02's `Engine` through its `sample`
    seam: the engine takes `SamplingParams` and returns S01's `Completion` (finish_reason,
    stop_reason, optional logprobs, stats), or streams it like every engine of the course.

    The pipeline, in order (`process_logits`):
      1. min_tokens   EOS and stop_token_ids set to -inf until min_tokens tokens exist.
      2. penalties    repetition (prompt + output), then frequency and presence (output only).
      --- temperature 0 stops here: greedy is the argmax of these logits ---
      3. temperature  divide by T (after subtracting the max, so tiny T cannot overflow).
      4. min_p        drop tokens with p < min_p * p_max.
      5. top_k        keep the k largest logits (ties at the k-th value are all kept).
      6. top_p        keep the smallest head of the sorted distribution whose mass reaches top_p.
    Why this order. Penalties edit what the model said about specific tokens, so they act on raw
    logits, where "divide a positive logit by 1.3" has a fixed meaning; applied after temperature
    their strength would change with T. Temperature comes next because every filter after it is
    defined on the final distribution the token is drawn from: top-p's "90% of the mass" must be
    90% of the mass we sample from, not of some other distribution. Steps 4-6 never remove the
    argmax, so none of them can change a greedy choice; that is why greedy stops after step 2.
    This is vLLM v1's order (`vllm/v1/sample/sampler.py`: min-tokens, penalties, temperature,
    min-p, then top-k and top-p). Hugging Face `generate()` uses the same order except that it
    applies min-p after top-p; the two agree unless both top_p < 1 and min_p > 0 are set.

    Logprobs. `logprobs=n` returns, for every generated token, its log-probability and the n
    most likely tokens. From which distribution? vLLM returns by default the log-softmax of the
    *raw* model logits, before penalties, temperature and filters (`logprobs_mode=
    "raw_logprobs"`), so the numbers describe the model, not the sampler settings. We do the same
    by default; `Engine(..., logprobs_mode="processed_logprobs")` returns the log-softmax of the
    distribution the token was actually drawn from instead (vLLM has that mode too).

    Seeds. Every request owns a `np.random.Generator` made from its seed, and a sampled token
    consumes exactly one uniform draw (greedy consumes none), so a request's tokens depend on its
    prompt, seed and parameters only, never on what else ran before or between. (Tiny
    temperatures are sampled as they are, safely; vLLM instead switches to greedy below 1e-5.)

    Stop rules. EOS (every EOS id of the tokenizer) unless ignore_eos, stop_token_ids, stop
    strings (S02's `StopStringMatcher`: cut at the first one completed, across token
    boundaries), max_tokens, a full context. min_tokens holds all of them off: EOS and stop ids
    get probability 0 and stop strings are looked for only in text that arrives from the
    min_tokens-th token on.

What it does not handle yet
    Batches of requests (S08), logit_bias, bad-words lists, beam search, n > 1 choices, and
    `include_stop_str_in_output`. Every pass still recomputes the whole context (S05 adds the
    KV cache through the `model_step` seam).

Run it
    python code/s04_sampling.py                      # one prompt, a tour of settings
    python code/s04_sampling.py --top-p 0.9 --temperature 0.8 --stop $'\n'   # your own

Tests
    tests/test_s04_sampling.py: every processor against hand-computed vectors (each boundary of
    SamplingParams) and against `transformers`' own processors and warpers on random logits;
    chi-square tests of sampled frequencies; seeds; logprobs against torch; the Engine's stop
    rules and stream == generate; greedy parity with the S01 and S02 engines, and greedy with
    repetition penalty / min_tokens equal to HF `generate()` on a tiny Qwen3 run by S03's model.

References
    A. Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR 2020): top-p.
    A. Fan, M. Lewis, Y. Dauphin, "Hierarchical Neural Story Generation" (ACL 2018): top-k.
    N. S. Keskar et al., "CTRL: A Conditional Transformer Language Model for Controllable
    Generation" (2019): the repetition penalty ("penalized sampling").
    M. N. Nguyen et al., "Turning Up the Heat: Min-p Sampling" (2024): min-p.
    OpenAI API reference: presence_penalty / frequency_penalty (subtract alpha * [count > 0] and
    alpha * count), stop, logprobs. vLLM `SamplingParams` (names, defaults, ranges) and
    `vllm/v1/sample/sampler.py` (order, raw logprobs), and vLLM's incremental detokenizer (hold
    back text ending in U+FFFD). Hugging Face transformers
    `generation/logits_process.py` (the oracles of the tests).

Shape legend (the whole course): T tokens in this step, V vocabulary.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

import s01_generation_loop as s01
from s01_generation_loop import ParameterError
import s02_tokenizer as s02

# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------

MAX_LOGPROBS = 20  # OpenAI's top_logprobs allows 0..20; vLLM's default max_logprobs is 20 too.
# Far above this the scaled logits (logits - max) / T of a float32 row round to 0 (float32
# underflow), so tokens with different logits tie and top_k / top_p / min_p can keep the wrong
# ones (T = 1e39 kept id 0 of [1, 2, 3, 0.5] under top_k=2). Up to 100 a nonzero scaled gap
# stays above float32's smallest normal number (1.2e-38) unless the logits involved are all
# below about 1e-28 in magnitude, so scaling keeps their order as well as it does at T = 1.
# At T = 100 a gap of 10 in logits is a factor e^0.1 = 1.1 in probability: nearly flat already.
# (OpenAI's API allows [0, 2]; vLLM and HF set no cap.)
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 4096   # per request, like S02's MAX_STOP for stop strings
MAX_SEED = 2**63  # seeds lie in [0, 2**63): torch.Generator.manual_seed takes a signed 64-bit int


@dataclass(frozen=True, kw_only=True)
class SamplingParams(s02.GenerationParams):
    """How one request turns logits into tokens; names, meanings and defaults follow vLLM.

    temperature         in [0, 100]. 0 is greedy (argmax, lowest id on a tie); 1 leaves the
                        model's distribution as it is. Default 1.0, as in vLLM and OpenAI. Any
                        T > 0 is sampled as it is (a T so small that every other logit scales to
                        -inf samples among the tied maxima); the cap of 100 keeps scaled
                        float32 logits clear of underflow (see MAX_TEMPERATURE).
    top_k               int >= -1. Keep the k most likely tokens; 0 or -1 disables, and so
                        does any k >= V.
    top_p               in [0, 1]. Keep the smallest set of most likely tokens whose probability
                        reaches top_p (the token that crosses it is kept); 1 disables; 0 or a
                        tiny value keeps only the most likely token.
    min_p               in [0, 1]. Drop tokens whose probability is below min_p times the top
                        token's probability; 0 disables.
    repetition_penalty  > 0. For every token already in the prompt or the output, a positive
                        logit is divided by it and a negative one multiplied; 1 disables.
    presence_penalty    in [-2, 2]. Subtracted once from the logit of every token that occurs
                        in the output so far (positive values push towards new tokens).
    frequency_penalty   in [-2, 2]. Subtracted from a token's logit once per occurrence in the
                        output so far.
    max_tokens          int >= 1. Most tokens to generate (vLLM's default, 16).
    min_tokens          int in [0, max_tokens]. EOS and stop_token_ids cannot be sampled, and no
                        stop rule fires, before this many tokens exist.
    stop                stop strings (a str or a sequence of non-empty str; None = none):
                        generation ends when the output text contains one, cut before it.
    stop_token_ids      token ids (ints >= 0; None = none) that end generation like EOS.
    ignore_eos          keep generating after EOS (EOS becomes an ordinary token).
    seed                None (fresh entropy) or an int in [0, 2**63) for a reproducible request.
    logprobs            None, or n in [0, 20]: return the sampled token's logprob and the n
                        most likely tokens' logprobs at every step.

    Raises ParameterError naming the parameter (`.parameter`) and its allowed range for any
    other value; numbers are stored as Python floats (so a huge int never reaches torch).
    `stop` and `stop_token_ids` are stored as tuples so the object stays hashable and frozen;
    any iterable is accepted and read once (a generator is materialised before it is checked).
    """

    temperature: float = 1.0      # vLLM's default; S01's call style still means greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            low_ok = s01.is_real(value) and (value > lo if lo_open else value >= lo)
            if not (low_ok and s01.is_finite(value) and value <= hi):
                bracket = "(" if lo_open else "["
                high = "inf)" if math.isinf(hi) else f"{hi:g}]"
                raise ParameterError(f"{name} must be a number in {bracket}{lo:g}, {high} "
                                     f"(got {value!r})", name, value)
            # Stored as a Python float: an int too large for a C long (10**20) would otherwise
            # reach torch inside a step and fail there, for the whole batch.
            object.__setattr__(self, name, float(value))

        real("temperature", 0.0, MAX_TEMPERATURE)
        real("top_p", 0.0, 1.0)
        real("min_p", 0.0, 1.0)
        real("repetition_penalty", 0.0, math.inf, lo_open=True)
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        if not s01.is_int(self.top_k) or self.top_k < -1:
            raise ParameterError(f"top_k must be an int >= -1 (0 or -1 disables; got "
                                 f"{self.top_k!r})", "top_k", self.top_k)
        if self.seed is not None and (not s01.is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ParameterError(f"seed must be None or an int in [0, 2**63) (got "
                                 f"{self.seed!r})", "seed", self.seed)
        super().__post_init__()   # S01's max_tokens, ignore_eos and seed rules, S02's stop
        if not s01.is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ParameterError(f"min_tokens must be an int in [0, max_tokens="
                                 f"{self.max_tokens}] (got {self.min_tokens!r})", "min_tokens",
                                 self.min_tokens)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        ids = (tuple(itertools.islice(ids, MAX_STOP_TOKEN_IDS + 1))   # endless: error, no hang
               if hasattr(ids, "__iter__") and not isinstance(ids, (str, bytes, dict)) else None)
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ParameterError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids",
                                 "stop_token_ids")
        if ids is None or not all(s01.is_int(i) and i >= 0 for i in ids):
            raise ParameterError(f"stop_token_ids must be a sequence of ints >= 0 "
                                 f"(got {self.stop_token_ids!r})", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if self.logprobs is not None and (not s01.is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParameterError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] "
                                 f"(got {self.logprobs!r})", "logprobs", self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---------------------------------------------------------------------------------------------
# Logits processors: each maps float32 logits (V,) to new float32 logits (V,)
# ---------------------------------------------------------------------------------------------
# -inf is the only "removed" marker: exp(-inf) = 0 exactly, so a removed token has probability 0
# in every later step, and nothing here ever produces NaN or +inf from finite or -inf input.

NEG_INF = np.float32(-np.inf)


def check_logits(logits: np.ndarray) -> np.ndarray:
    """Validate one row of logits and return a float32 copy.

    logits: array-like (V,). -inf entries are allowed (tokens already ruled out).
    Raises ValueError if it is not 1-D and non-empty, holds NaN or +inf, or has no finite entry.
    """
    row = np.array(logits, dtype=np.float32)  # a copy: processors never edit the caller's array
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array (V,), got shape {row.shape}")
    if np.isnan(row).any() or np.isposinf(row).any():
        raise ValueError("logits must not contain NaN or +inf")
    if not np.isfinite(row).any():
        raise ValueError("logits must have at least one finite entry (every token is ruled out)")
    return row


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p for float32 logits (V,) with at least one finite entry; -inf stays -inf."""
    shifted = logits - logits.max()  # the max becomes 0, so exp() cannot overflow
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities (V,) float32 from logits (V,) with at least one finite entry."""
    e = np.exp(logits - logits.max())
    return (e / e.sum()).astype(np.float32)


def apply_min_tokens(logits: np.ndarray, num_output_tokens: int, min_tokens: int,
                     stop_ids: Sequence[int]) -> np.ndarray:
    """Set the logits of `stop_ids` (EOS and stop_token_ids) to -inf while fewer than
    `min_tokens` tokens have been generated. Same as HF `MinNewTokensLengthLogitsProcessor`."""
    out = logits.copy()
    if num_output_tokens < min_tokens and len(stop_ids):
        out[np.asarray(stop_ids, dtype=np.int64)] = NEG_INF
    return out


def apply_repetition_penalty(logits: np.ndarray, seen_ids: Sequence[int],
                             penalty: float) -> np.ndarray:
    """CTRL's repetition penalty on every token id in `seen_ids` (prompt and output).

    A positive logit is divided by `penalty`, a negative one multiplied, so penalty > 1 always
    makes a seen token less likely (dividing a negative logit would make it *more* likely).
    Each distinct token is penalised once however often it occurred. Same as HF
    `RepetitionPenaltyLogitsProcessor` and vLLM.
    """
    out = logits.copy()
    if penalty == 1.0 or len(seen_ids) == 0:
        return out
    ids = np.unique(np.asarray(seen_ids, dtype=np.int64))
    picked = out[ids]
    with np.errstate(over="ignore"):   # a penalty far from 1 can overflow: process_logits says so
        out[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def apply_presence_frequency_penalties(logits: np.ndarray, output_ids: Sequence[int],
                                       presence_penalty: float,
                                       frequency_penalty: float) -> np.ndarray:
    """OpenAI's additive penalties over the generated tokens only (not the prompt):
    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)."""
    out = logits.copy()
    if len(output_ids) == 0 or (presence_penalty == 0 and frequency_penalty == 0):
        return out
    ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    out[ids] -= np.float32(frequency_penalty) * counts.astype(np.float32) \
        + np.float32(presence_penalty)
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Scale logits by 1 / temperature (temperature > 0).

    We return (logits - max) / T rather than HF's logits / T: softmax cannot tell them apart,
    and with the max at 0 every entry is <= 0, so even T = 1e-6 cannot make exp() overflow to
    +inf (for a large gap exp() underflows to 0, which is the right answer: probability 0).
    The division runs in float64 by T itself, not by float32(T): T = 1e-50 would round to 0 in
    float32 and give 0 / 0 = NaN for the max. In float64 the max stays 0 for every T > 0 and a
    gap too large for float32 becomes -inf on the way back, so a T that small samples among the
    tied maxima (the limit T -> 0), and -inf / T stays -inf.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 here (0 means greedy; got {temperature})")
    gaps = logits.astype(np.float64) - float(logits.max())    # (V,), the max at exactly 0
    with np.errstate(over="ignore"):                           # a gap beyond float32 -> -inf
        return (gaps / float(temperature)).astype(np.float32)


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Remove tokens with p < min_p * p_max, compared in log space: logit - max < log(min_p).

    Working with logits instead of probabilities avoids exp() underflow deciding the answer.
    min_p = 1 keeps only the top token (and any token tied with it). Same kept set as HF
    `MinPLogitsWarper` and vLLM.
    """
    out = logits.copy()
    if min_p == 0:
        return out
    gap = logits.astype(np.float64) - float(logits.max())
    out[gap < math.log(min_p)] = NEG_INF
    return out


def apply_top_k(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the `top_k` largest logits. 0, -1 or any k >= V keeps everything.

    Tokens tied with the k-th largest value are all kept (so a tie can keep more than k), as HF
    `TopKLogitsWarper` and vLLM do: which of two equal logits to drop would be arbitrary.
    """
    out = logits.copy()
    if top_k <= 0 or top_k >= logits.size:
        return out
    kth_largest = np.partition(logits, logits.size - top_k)[logits.size - top_k]
    out[logits < kth_largest] = NEG_INF
    return out


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches `top_p`.

    logits: float32 (V,), -inf allowed. Returns a float32 (V,) copy, dropped tokens at -inf.
    HF `TopPLogitsWarper`'s rule and arithmetic (vLLM's too): sort the tokens by probability,
    ascending; p = their softmax in float32 by torch's steps (e = exp(z - max), each rounded
    once to float32 from float64, then p = e * (1 / sum of e)); c[i] = p[0] + ... + p[i], the
    mass of token i and of every less likely one, accumulated in float64 and rounded to float32
    at each i (as torch's CPU cumsum does); drop token i if c[i] <= float32(1 - top_p), but
    never the most likely token. In exact arithmetic, token i is kept iff the tokens more
    likely than it hold < top_p: the token that reaches top_p exactly is the last one kept
    ([0.1, 0.3, 0.6] at top_p 0.9 keeps {1, 2}), and top_p = 0 keeps only the most likely
    token. Equal probabilities: the lower id counts as the more likely, so the result is
    deterministic (HF leaves ties to an unstable sort). Smallest first is also why a float32
    running sum (torch's on CUDA) does not stall: each term is at least the mean of those
    before it, so none falls under half an ulp of the sum while V < 2**24 (summed most likely
    first, terms under 6e-8 vanish near 1 and a long tail would be kept).
    Where HF can differ: torch's vectorised exp and sum can round differently in the last bit.
    That moves the cut only when some c[i] lies within an ulp or two of 1 - top_p, i.e. when a
    head of the sorted mass equals top_p exactly (short decimals, such as multiples of 0.05).
    """
    out = logits.copy()
    if top_p >= 1.0:
        return out
    order = np.argsort(-logits, kind="stable")[::-1]        # (V,) least likely first
    shifted = logits[order] - logits.max()                   # (V,) sorted ascending, <= 0
    e = np.exp(shifted.astype(np.float64)).astype(np.float32)
    probs = e * (np.float32(1.0) / e.sum())                  # torch's float32 softmax steps
    mass_up_to = np.cumsum(probs, dtype=np.float64).astype(np.float32)   # (V,) inclusive sums
    drop = mass_up_to <= np.float32(1.0 - top_p)
    drop[-1] = False
    out[order[drop]] = NEG_INF
    return out


# The errors a row can raise after min_tokens and the penalties (S06's device sampler flags the
# same ones). A repetition_penalty far from 1 can push a float32 logit past its range.
MIN_TOKENS_RULED_OUT = ("min_tokens ruled out every token: the model gave only EOS or stop ids "
                        "a finite logit")
PENALTY_OVERFLOW = ("repetition_penalty pushed a logit past float32's range (to +inf): use a "
                    "penalty nearer 1")
PENALTY_RULED_OUT = ("repetition_penalty pushed every logit to -inf (past float32's range): use "
                     "a penalty nearer 1")


def process_logits(logits: np.ndarray, params: SamplingParams,
                   prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                   eos_ids: Sequence[int] = ()) -> np.ndarray:
    """The whole pipeline, in vLLM's order (see the module docstring for why this order).

    logits: the model's raw logits for the next token, (V,). prompt_ids, output_ids: the
    request's token ids so far (penalties and min_tokens need them). eos_ids: the tokenizer's
    end-of-sequence ids (suppressed by min_tokens unless params.ignore_eos).
    Returns float32 (V,): for temperature 0, the penalised logits (their argmax is the greedy
    token); otherwise the logits of the distribution to draw from, removed tokens at -inf.
    Raises ValueError for invalid logits or a token id outside [0, V), and for a row the
    penalties push out of float32's range or that has no finite entry left.
    """
    row = check_logits(logits)
    vocab = row.size
    for name, ids in (("prompt_ids", prompt_ids), ("output_ids", output_ids),
                      ("stop_token_ids", params.stop_token_ids), ("eos_ids", eos_ids)):
        if any(not 0 <= int(i) < vocab for i in ids):
            raise ValueError(f"{name} must lie in [0, V={vocab})")
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.extend(eos_ids)
    row = apply_min_tokens(row, len(output_ids), params.min_tokens, stop_ids)
    row = apply_repetition_penalty(row, [*prompt_ids, *output_ids], params.repetition_penalty)
    row = apply_presence_frequency_penalties(row, output_ids, params.presence_penalty,
                                             params.frequency_penalty)
    if np.isnan(row).any() or np.isposinf(row).any():
        raise ValueError(PENALTY_OVERFLOW)     # a finite logit / 1e-40 is +inf in float32
    if not np.isfinite(row).any():
        raise ValueError(MIN_TOKENS_RULED_OUT if len(output_ids) < params.min_tokens
                         else PENALTY_RULED_OUT)
    if params.greedy:
        return row
    row = apply_temperature(row, params.temperature)
    row = apply_min_p(row, params.min_p)
    row = apply_top_k(row, params.top_k)
    row = apply_top_p(row, params.top_p)
    return row


def draw(processed: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    """Pick a token from `process_logits`' output (V,).

    Greedy (temperature 0): the argmax, lowest id on a tie; the generator is not touched.
    Otherwise inverse-CDF sampling with one uniform draw u in [0, 1): the token whose interval
    of the cumulative distribution (float64) contains u * total. A removed token has an empty
    interval, so it can never be drawn. Raises ValueError (`check_logits`) for a row with NaN or
    +inf or without a finite entry, which no distribution comes from.
    """
    processed = check_logits(processed)
    if params.greedy:
        return int(np.argmax(processed))
    cdf = np.cumsum(softmax(processed).astype(np.float64))   # (V,)
    u = generator.random() * cdf[-1]
    # u <= 1 - 2**-53, so u * total rounds to a float below total: the token is < V, and
    # cdf[token] > u >= cdf[token - 1] means its probability is > 0.
    return int(np.searchsorted(cdf, u, side="right"))  # the first token with cdf > u


def sample(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator,
           prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
           eos_ids: Sequence[int] = ()) -> int:
    """One sampling step: `process_logits` then `draw`. Arguments as there; returns a token id."""
    return draw(process_logits(logits, params, prompt_ids, output_ids, eos_ids), params, generator)


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position (natural log).

    token_id, logprob: the generated token and its log-probability. top_logprobs: the n most
    likely tokens as (token_id, logprob), most likely first, equal values by lowest id; n is
    SamplingParams.logprobs (0 gives an empty tuple), capped at V.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def compute_logprobs(logits: np.ndarray, token_id: int, n: int) -> TokenLogprobs:
    """log-softmax of `logits` (V,), then the sampled token's entry and the top n entries.

    Raises ValueError for invalid logits (`check_logits`), a token_id that is not an int in
    [0, V), or an n that is not an int >= 0.
    """
    logp = log_softmax(check_logits(logits))                 # (V,)
    if not s01.is_int(token_id) or not 0 <= token_id < logp.size:
        raise ValueError(f"token_id must be an int in [0, V={logp.size}) (got {token_id!r})")
    if not s01.is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0 (got {n!r})")
    top = np.argsort(-logp, kind="stable")[:n]
    return TokenLogprobs(token_id=int(token_id), logprob=float(logp[token_id]),
                         top_logprobs=tuple((int(i), float(logp[i])) for i in top))


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


class Engine(s02.Engine):
    """S02's engine with `SamplingParams`: processors, stop tokens, min_tokens, per-request
    seeds, logprobs.

    model, max_context: as in S01. tokenizer: `encode`, `decode` and `eos_id` (or `eos_ids`,
    all of which then count as EOS), for example S01's, S02's or a checkpoint's (S03); one
    with `decode_bytes` streams through S02's byte path, any other through its text path.
    logprobs_mode: "raw_logprobs" (vLLM's default: log-softmax of the model's logits) or
    "processed_logprobs" (of the distribution the token was drawn from; for greedy requests,
    of the logits after min_tokens and penalties, whose argmax was taken).

    Call style: `generate(prompt, SamplingParams(...))`, or S01's `generate(prompt, max_tokens,
    temperature, seed)` with any SamplingParams field as a keyword (S01's style keeps
    temperature 0 as its default: the same call is greedy on every engine).
    Seams: `sample` runs S04's pipeline; `make_sequence` adds stop token ids and the logprobs
    list; `filter_text` looks for stop strings only in text that arrives from the
    min_tokens-th token on (text shown earlier is final, so a stream never takes text back).
    Before min_tokens tokens exist, EOS and stop ids cannot be sampled (`apply_min_tokens`).
    The loop and the stop rules are S01's (`s01.stop_rule`).
    """

    params_class = SamplingParams

    def __init__(self, model, tokenizer, max_context: int, logprobs_mode: str = "raw_logprobs"):
        super().__init__(model, tokenizer, max_context)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ParameterError(f"logprobs_mode must be one of {LOGPROBS_MODES} "
                                 f"(got {logprobs_mode!r})", "logprobs_mode", logprobs_mode)
        self.logprobs_mode = logprobs_mode

    def make_params(self, max_tokens=16, temperature=None, seed=None, **options):
        """S01's rule (a SamplingParams, or its fields as keywords), with one guard: S01's call
        style is greedy unless a temperature is given, so a top_k, top_p or min_p passed
        without one would silently do nothing; that is a ValueError."""
        active = {"top_k": lambda k: s01.is_int(k) and k > 0, "top_p": lambda p: p != 1.0,
                  "min_p": lambda p: p != 0.0}        # a disabled filter does nothing anyway
        filters = sorted(name for name, on in active.items() if name in options
                         and on(options[name]))
        if filters and temperature is None and not isinstance(max_tokens, s01.GenerationParams):
            raise ValueError(f"{filters} only shape sampling, and this call is greedy: pass "
                             "temperature > 0 (or a SamplingParams)")
        return super().make_params(max_tokens, temperature, seed, **options)

    def make_sequence(self, request_id, prompt_ids, params: SamplingParams) -> s01.Sequence:
        """S02's request state, plus stop token ids and a logprobs list when asked for.
        Raises ParameterError for a stop token id outside [0, V)."""
        if any(i >= self.model.vocab_size for i in params.stop_token_ids):
            raise ParameterError(f"stop_token_ids must lie in [0, V={self.model.vocab_size})",
                                 "stop_token_ids")
        seq = super().make_sequence(request_id, prompt_ids, params)
        seq.stop_token_ids = frozenset(params.stop_token_ids)
        seq.logprobs = [] if params.logprobs is not None else None
        return seq

    def sample(self, logits: np.ndarray, seq: s01.Sequence) -> int:
        """S04's pipeline on the raw logits (V,): `process_logits`, then `draw` with the
        request's generator; the token's logprobs are recorded when the request asks."""
        params = seq.params
        processed = process_logits(logits, params, seq.prompt_ids, seq.output_ids,
                                   tuple(seq.eos_ids))
        token = draw(processed, params, seq.generator)
        if seq.logprobs is not None:
            source = logits if self.logprobs_mode == "raw_logprobs" else processed
            seq.logprobs.append(compute_logprobs(source, token, params.logprobs))
        return token

    def filter_text(self, seq: s01.Sequence, text: str) -> str:
        if len(seq.output_ids) < seq.params.min_tokens:
            return text                    # min_tokens holds every stop rule off
        return super().filter_text(seq, text)


# ---------------------------------------------------------------------------------------------
# main: one prompt under several settings, with per-token probabilities
# ---------------------------------------------------------------------------------------------

DEMO_SETTINGS: list[tuple[str, dict]] = [
    ("greedy", dict(temperature=0.0)),
    ("temperature 0.7", dict(temperature=0.7)),
    ("temperature 1.5", dict(temperature=1.5)),
    ("temperature 1, top_k 5", dict(top_k=5)),
    ("temperature 1, top_p 0.5", dict(top_p=0.5)),
    ("temperature 1, min_p 0.2", dict(min_p=0.2)),
    ("temperature 1, min_tokens 12 (no EOS before 12 tokens)", dict(min_tokens=12)),
    # Greedy text that is long enough to repeat itself, then the penalties that break loops.
    ("greedy, min_tokens 20", dict(temperature=0.0, min_tokens=20)),
    ("greedy, min_tokens 20, repetition_penalty 1.3",
     dict(temperature=0.0, min_tokens=20, repetition_penalty=1.3)),
    ("greedy, min_tokens 20, frequency_penalty 1.0",
     dict(temperature=0.0, min_tokens=20, frequency_penalty=1.0)),
]


def load_demo_model(name_or_path: str | None = None):
    """(model, tokenizer, description) for the demo.

    A checkpoint directory or hub id if given (S03's loader); else the bundled model in
    data/model when it has been trained; else S02's bigram model over the project tokenizer.
    Raises S03's CheckpointError (a ValueError) for a checkpoint that cannot be loaded.
    """
    import s03_checkpoint
    import s03_transformer as s03
    if name_or_path is None and not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists():
        tokenizer, model = s02.build_default()
        return model, tokenizer, (f"S02 bigram model (bundled model not trained yet), "
                                  f"V = {model.vocab_size:,}")
    model, tokenizer = s03_checkpoint.load(name_or_path or s03.BUNDLED_MODEL_DIR)
    cfg = model.config
    return model, tokenizer, (f"{name_or_path or 'bundled model'} ({cfg.model_type}, "
                              f"{s03.parameter_count(cfg):,} parameters, V = {cfg.vocab_size:,})")


def format_tokens(tokenizer, completion: s01.Completion, processed: s01.Completion) -> str:
    """One line per generated token: its text, p under the model, p under the sampler."""
    def show(token_id: int) -> str:
        return "<eos>" if token_id == tokenizer.eos_id else repr(tokenizer.decode([token_id]))

    lines = [f"    {'token':<14} {'p model':>8} {'p sampled':>10}   top tokens under the model"]
    for raw_lp, proc_lp in zip(completion.logprobs, processed.logprobs):
        top = ", ".join(f"{show(i)} {math.exp(lp):.2f}" for i, lp in raw_lp.top_logprobs)
        piece = show(raw_lp.token_id)
        lines.append(f"    {piece:<14} {math.exp(raw_lp.logprob):>8.3f} "
                     f"{math.exp(proc_lp.logprob):>10.3f}   {top}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Chapter 4: sampling controls.")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or hub id (default: the bundled model)")
    parser.add_argument("--prompt", default="Ham.\nTo be, or not to be",
                        help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=20, help="tokens per completion (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every sampled request (default: %(default)s)")
    parser.add_argument("--logprobs", type=int, default=3, help="top tokens shown per position (default: %(default)s)")
    knobs = parser.add_argument_group(
        "one setting of your own instead of the tour",
        "Give any of these and the run is one request with them, the others at their "
        "SamplingParams defaults (shown); give none and it runs the tour of settings.")
    for flag, kind, what in (
            ("temperature", float, "0 = greedy"), ("top-k", int, "keep the k likeliest, 0 = off"),
            ("top-p", float, "keep the likeliest tokens up to this probability, 1 = off"),
            ("min-p", float, "drop tokens under min-p times the top probability, 0 = off"),
            ("repetition-penalty", float, "seen logits: > 0 divided, < 0 multiplied, 1 = off"),
            ("presence-penalty", float, "subtracted once from each output token's logit"),
            ("frequency-penalty", float, "subtracted per occurrence in the output"),
            ("min-tokens", int, "no EOS or stop rule before this many tokens")):
        default = SamplingParams.__dataclass_fields__[flag.replace("-", "_")].default
        knobs.add_argument(f"--{flag}", type=kind, default=None,
                           help=f"{what} (default: {default})")
    knobs.add_argument("--stop", action="append", default=None,
                       help="stop string (repeatable) (default: none)")
    args = parser.parse_args(argv)
    for flag, text in [("--prompt", args.prompt)] + [("--stop", s) for s in args.stop or []]:
        try:
            s01.check_text(text, flag)   # argv bytes that are not UTF-8 arrive as surrogates
        except ValueError as err:
            parser.error(str(err))

    custom = {name: value for name, value in vars(args).items() if value is not None and name in {
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "min_tokens", "stop"}}
    settings = [("your setting", custom)] if custom else DEMO_SETTINGS
    try:
        model, tokenizer, name = load_demo_model(args.model)
    except ValueError as err:
        parser.error(str(err))
    print(f"model: {name}\nprompt: {args.prompt!r}\n")
    max_context = getattr(getattr(model, "config", None), "max_position_embeddings", 256)
    raw_engine = Engine(model, tokenizer, max_context)
    proc_engine = Engine(model, tokenizer, max_context, logprobs_mode="processed_logprobs")
    for label, knobs_set in settings:
        if knobs_set.get("min_tokens", 0) > args.max_tokens and not custom:
            knobs_set = {**knobs_set, "min_tokens": args.max_tokens}  # fit a small --max-tokens
            label += f" (min_tokens cut to --max-tokens {args.max_tokens})"
        try:
            params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed,
                                    logprobs=args.logprobs, **knobs_set)
            completion = raw_engine.generate(args.prompt, params)
        except ValueError as err:
            parser.error(str(err))
        # Same seed and parameters, so the same tokens: only the reported distribution differs.
        processed = proc_engine.generate(args.prompt, params)
        assert processed.token_ids == completion.token_ids
        print(f"[{label}] finish_reason={completion.finish_reason}\n    {completion.text!r}")
        print(format_tokens(tokenizer, completion, processed) + "\n")


if __name__ == "__main__":
    main()
