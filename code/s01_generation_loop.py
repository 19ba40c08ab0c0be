"""S01, the generation loop: how a language model writes text, one token per pass.

What is here
    Everything an inference engine does, at its smallest: a word-level toy tokenizer, a NumPy
    bigram "language model" trained from the bundled Shakespeare corpus in about a second, a
    sampler, and the `Engine`, whose loop (`Engine.run`) runs the model on the whole context,
    takes the logits of the last position, samples a token, appends it and repeats until a stop
    rule (`stop_rule`) fires. `Stats` records what every pass cost, so the quadratic growth of an
    engine without a cache is visible before we build one.

    The engine's shape is the course's: `generate(prompt, max_tokens, temperature, seed)` returns
    a `Completion` (text, token ids, finish_reason, stop_reason, stats); `stream(...)` yields a
    `RequestOutput` per step and then holds the same `Completion`. A request's state is a
    `Sequence`. Later chapters keep these calls and types and override the loop's seams
    (`model_step`, `sample`, `make_detokenizer`, `filter_text`), never the loop itself.

What it does not handle yet
    Real tokenization (S02: byte-level BPE), a real transformer (S03), the sampling controls that
    serving APIs expose (S04), and any caching: every pass recomputes the whole context, which is
    exactly the waste S05's KV cache removes. This loop stays the course's oracle: every later
    engine must produce the same greedy tokens on the same model.

Run it
    python code/s01_generation_loop.py --prompt "To be, or not to be" --max-tokens 40

Tests
    tests/test_s01_generation_loop.py (tokenizer, model, sampler, every stop rule at its
    boundary, stream == generate, bad input, the cost table against closed-form sums);
    tests/test_parity.py drives every later engine through this engine's calls.

References
    C. E. Shannon, "A Mathematical Theory of Communication" (1948), section 3: sampling text from
    n-gram statistics. Jurafsky & Martin, "Speech and Language Processing", 3rd ed. draft, ch. 3
    (n-gram language models, add-k smoothing). The loop's shape follows Hugging Face
    transformers' `GenerationMixin` greedy/sample loops and karpathy/nanoGPT's `generate`.

Shape legend (the whole course): T tokens in this step, V vocabulary.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from collections.abc import Iterable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = ROOT / "data" / "shakespeare.txt"

EOS = "<eos>"
UNK = "<unk>"

# A word, optionally with an inner apostrophe ("o'er", "Who's"), or a single punctuation mark, or
# a line break. Runs of spaces and tabs carry no token: decode puts single spaces back.
_TOKEN_RE = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*|\n|[^\sA-Za-z0-9]")
_NO_SPACE_BEFORE = set(".,;:!?)]'-")
_NO_SPACE_AFTER = set("([-")


def is_int(x) -> bool:
    """True for a Python or NumPy integer; False for bool (True is not a count or an id)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    """True for a Python or NumPy int or float; False for bool, complex, str, Fraction, ..."""
    return isinstance(x, (int, float, np.integer, np.floating)) \
        and not isinstance(x, (bool, np.bool_))


def is_finite(x) -> bool:
    """True for a real number (see `is_real`) that is finite; False for NaN, +-inf, and for an
    int too large for a float (10**400): those cannot be compared or scaled as numbers here."""
    if not is_real(x):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


class ParameterError(ValueError):
    """A value that breaks a rule of a request or a configuration. The message names the rule;
    `parameter` names the field it is about (None when no one field is to blame) and `value` is
    what was given, so a caller maps the error without reading its text (S19's server answers
    400 with OpenAI's "param" from it). It is a ValueError, so `except ValueError` still catches
    it. vLLM's `VLLMValidationError(message, parameter=..., value=...)` (vllm/exceptions.py)."""

    def __init__(self, message: str, parameter: str | None = None, value=None):
        super().__init__(message)
        self.parameter, self.value = parameter, value

    def __reduce__(self):   # picklable with its fields (an error may cross a process boundary)
        return type(self), (str(self), self.parameter, self.value)


def check_text(text: str, name: str = "text", parameter: str | None = None) -> None:
    """Raise ParameterError unless `text` is a str that UTF-8 can encode. name: what the
    message calls it; parameter: the parameter the error names (default: name).

    A Python str may hold a lone surrogate (U+D800-U+DFFF), e.g. from `"\\ud800"` or from
    command-line bytes that were not UTF-8 (Python maps them to U+DC80-U+DCFF, PEP 383). Such a
    string is not valid Unicode and has no UTF-8 bytes, so no tokenizer can encode it.
    """
    parameter = name if parameter is None else parameter
    if not isinstance(text, str):
        raise ParameterError(f"{name} must be a str (got {type(text).__name__})", parameter,
                             text)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ParameterError(f"{name} must be valid Unicode without lone surrogates: "
                                 f"{text[err.start]!r} at index {err.start} has no UTF-8 "
                                 "encoding", parameter) from None


def check_seed(seed) -> None:
    """Raise ParameterError unless seed is None or an integer >= 0 (what
    `np.random.default_rng` takes; a bool is not a seed)."""
    if seed is not None and (not is_int(seed) or seed < 0):
        raise ParameterError(f"seed must be None or an integer >= 0 (got {seed!r})", "seed", seed)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

class UnknownWordError(ValueError):
    """Raised by `WordTokenizer.encode(..., unknown="error")` for a word outside the vocabulary."""


class WordTokenizer:
    """A word-level toy tokenizer with an end-of-sequence token.

    Text is split into words, single punctuation marks and line breaks (see `split`). Each piece
    maps to an integer id; id 0 is `<eos>` (end of sequence), id 1 is `<unk>` (any word outside
    the vocabulary). The vocabulary is the `max_vocab - 2` most frequent pieces of the training
    text, ties broken alphabetically so training is deterministic.

    Unknown-word policy: `encode(text)` maps an unknown piece to `<unk>` by default;
    `encode(text, unknown="error")` raises `UnknownWordError` naming the word instead.

    Decoding is lossy by design: the tokenizer keeps words, not spacing, so `decode` rebuilds the
    text with single spaces between words and none before punctuation. `decode(encode(s)) ==
    normalize(s)` for any text whose pieces are all in the vocabulary. S02 replaces this with a
    byte-level tokenizer that round-trips every string exactly.
    """

    def __init__(self, vocab: list[str]):
        if len(vocab) < 2 or vocab[0] != EOS or vocab[1] != UNK:
            raise ValueError(f"vocab must start with {EOS!r}, {UNK!r}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab entries must be unique")
        self.id_to_token: list[str] = list(vocab)
        self.token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(vocab)}
        self.eos_id = 0
        self.unk_id = 1

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    @staticmethod
    def split(text: str) -> list[str]:
        """Split text into word, punctuation and line-break pieces (no vocabulary needed)."""
        return _TOKEN_RE.findall(text)

    @classmethod
    def train(cls, text: str, max_vocab: int = 4096) -> "WordTokenizer":
        """Build a vocabulary of the `max_vocab - 2` most frequent pieces of `text`.

        Raises ValueError if max_vocab < 3 (room for <eos>, <unk> and one word).
        """
        if max_vocab < 3:
            raise ValueError(f"max_vocab must be >= 3 (got {max_vocab})")
        counts = Counter(cls.split(text))
        counts.pop(EOS, None)
        counts.pop(UNK, None)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([EOS, UNK] + [tok for tok, _ in ranked[: max_vocab - 2]])

    def encode(self, text: str, unknown: str = "unk") -> list[int]:
        """Text -> token ids. `unknown` is "unk" (map to <unk>) or "error" (raise).

        The literal strings "<eos>" and "<unk>" in user text are not special: they split into
        punctuation and a word like any other text, so a user cannot inject an end of sequence.
        """
        if unknown not in ("unk", "error"):
            raise ValueError(f"unknown must be 'unk' or 'error' (got {unknown!r})")
        ids = []
        for piece in self.split(text):
            idx = self.token_to_id.get(piece)
            if idx is None or idx < 2:
                if unknown == "error":
                    raise UnknownWordError(f"word {piece!r} is not in the vocabulary")
                idx = self.unk_id
            ids.append(idx)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text. `<eos>` ends nothing here and decodes to nothing; the Engine stops
        before it. Raises ValueError for an id that is not an integer (5.9 is not rounded, True
        is not 1) or lies outside [0, vocab_size)."""
        out: list[str] = []
        for i in ids:
            if not is_int(i):
                raise ValueError(f"token ids must be integers (got {i!r})")
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i == self.eos_id:
                continue
            piece = self.id_to_token[i]
            if out and out[-1] != "\n" and piece != "\n" and piece[0] not in _NO_SPACE_BEFORE \
                    and out[-1][-1] not in _NO_SPACE_AFTER:
                out.append(" ")
            out.append(piece)
        return "".join(out)

    def normalize(self, text: str) -> str:
        """The text `decode(encode(text))` gives back when every word is in the vocabulary."""
        return self.decode(self.token_to_id.get(p, self.unk_id) for p in self.split(text))


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class BigramModel:
    """A NumPy bigram language model: the next token depends only on the current one.

    Training counts, for every pair of adjacent tokens (a, b) in the training ids, how often b
    follows a, adds `alpha` to every count (add-k smoothing, so no continuation has probability
    zero) and stores the log-probabilities as a (V, V) float32 table of logits. `<unk>` is never
    a target: it stands for no particular word, so its logit is -inf in every row.

    `forward(token_ids)` returns logits for every position, shape (T, V), the same contract a
    transformer's forward pass has, so the generation loop does not know it is running a toy.
    Row t is the distribution of the token after token_ids[t].
    """

    def __init__(self, logits_table: np.ndarray, unk_id: int | None = None):
        if logits_table.ndim != 2 or logits_table.shape[0] != logits_table.shape[1]:
            raise ValueError(f"logits_table must be square (V, V), got {logits_table.shape}")
        self.logits_table = logits_table.astype(np.float32, copy=False)  # (V, V)
        self.unk_id = unk_id

    @property
    def vocab_size(self) -> int:
        return self.logits_table.shape[0]

    @classmethod
    def train(cls, token_ids: list[int] | np.ndarray, vocab_size: int, alpha: float = 0.01,
              unk_id: int | None = 1) -> "BigramModel":
        """Count bigrams in `token_ids` (a 1-D int sequence) and smooth them into logits.

        Raises ValueError if alpha is not a finite number > 0, fewer than 2 ids are given, or an
        id is out of range.
        """
        if not is_real(alpha) or not np.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be a finite number > 0 for smoothing (got {alpha!r})")
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size < 2:
            raise ValueError("token_ids must be a 1-D sequence of at least 2 ids")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        # Count pairs with one bincount over flattened (prev, next) indices: O(N), no Python loop.
        pair_index = ids[:-1] * vocab_size + ids[1:]
        counts = np.bincount(pair_index, minlength=vocab_size * vocab_size)
        counts = counts.reshape(vocab_size, vocab_size).astype(np.float64)  # (V, V)
        if unk_id is not None:
            counts[:, unk_id] = 0.0
        smoothed = counts + alpha
        if unk_id is not None:
            smoothed[:, unk_id] = 0.0
        with np.errstate(divide="ignore"):  # log(0) = -inf for the <unk> column, on purpose
            logits = np.log(smoothed / smoothed.sum(axis=1, keepdims=True))
        return cls(logits.astype(np.float32), unk_id=unk_id)

    def forward(self, token_ids: list[int]) -> np.ndarray:
        """Logits for the token after each position.

        token_ids: T >= 1 ints in [0, V). Returns float32 (T, V). Raises ValueError on an empty
        sequence or an out-of-range id.
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("forward needs a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return self.logits_table[ids]  # (T, V): one row per position, like a transformer


def speeches(text: str) -> list[str]:
    """Split the corpus into speeches: blocks of text separated by blank lines.

    Each speech ("Ham.\\nTo be, or not to be...") becomes one training sequence ending in <eos>,
    so the bigram learns where a speech ends and the Engine's EOS stop fires on real text.
    """
    return [block.strip("\n") for block in re.split(r"\n\s*\n", text) if block.strip()]


def build_default(max_vocab: int = 4096,
                  corpus_path: Path = CORPUS_PATH) -> tuple[WordTokenizer, BigramModel]:
    """Train the chapter's tokenizer and bigram model on the bundled corpus (about a second)."""
    if not corpus_path.exists():
        raise FileNotFoundError(f"corpus not found at {corpus_path}; run scripts/build_corpus.py")
    text = corpus_path.read_text(encoding="utf-8")
    tokenizer = WordTokenizer.train(text, max_vocab=max_vocab)
    ids: list[int] = []
    for speech in speeches(text):
        ids.extend(tokenizer.encode(speech))
        ids.append(tokenizer.eos_id)
    model = BigramModel.train(ids, tokenizer.vocab_size, unk_id=tokenizer.unk_id)
    return tokenizer, model


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------

def check_temperature(temperature) -> None:
    """Raise ParameterError unless temperature is a finite int or float (NumPy's too) >= 0.
    A bool is not a temperature: True would silently mean 1."""
    if not is_real(temperature):
        raise ParameterError(f"temperature must be a finite number >= 0 (an int or a float, "
                             f"not a {type(temperature).__name__}; got {temperature!r})",
                             "temperature", temperature)
    if not is_finite(temperature) or temperature < 0:
        raise ParameterError(f"temperature must be a finite number >= 0 (got {temperature!r})",
                             "temperature", temperature)


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Pick the next token id from one row of logits.

    logits: float (V,); each entry finite, or -inf for a token that can never be drawn.
    temperature 0 is greedy: the argmax (the lowest id on a tie). Otherwise the token is drawn
    from softmax(logits / temperature): below 1 sharpens the distribution, above 1 flattens it.
    Each draw consumes exactly one `rng.random()`.

    The weights are computed as exp((logits - max) / temperature): the max is subtracted
    *before* dividing, so every exponent is <= 0 and nothing overflows, whatever the logits and
    the temperature (dividing first turns 1e308 / 0.5, or anything / 1e-310, into inf, and
    inf - inf into NaN). A gap to the max that the division pushes below about -745 gives weight
    exactly 0, which is the true probability to float64 precision, so a temperature far below
    every gap picks the greedy token; tokens tied at the max keep equal weights and share the
    probability, the limit of softmax as temperature -> 0.

    Raises ValueError for a temperature that is not a finite number >= 0 (see
    `check_temperature`), and for a row that is not 1-D and non-empty, holds NaN or +inf (+inf
    has no probability: softmax would be inf / inf; S04's `check_logits` has the same rule), or
    has no finite entry.
    """
    check_temperature(temperature)
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D row (V,), got shape {logits.shape}")
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise ValueError("logits must not contain NaN or +inf")
    if not np.isfinite(logits).any():
        raise ValueError("logits must have at least one finite entry (every token is ruled out)")
    if temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):  # a gap that overflows is -inf: weight 0, as it should be
        scaled = (logits - logits.max()) / temperature  # all <= 0; the max is exactly 0
    weights = np.exp(scaled)  # unnormalised probabilities in [0, 1]; -inf logits get weight 0
    # Inverse-CDF sampling with one uniform number per token: the first id whose cumulative
    # weight exceeds u * total. (numpy's rng.choice(p=...) does the same; doing it by hand keeps
    # one random number per step, so the course's JavaScript simulator can replay it exactly.)
    cdf = np.cumsum(weights)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), cdf.size - 1))


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------
# One engine shape for the whole course. A request becomes a `Sequence` (its state); the loop in
# `Engine.run` advances it one token per step and yields a `RequestOutput` per step; `stream`
# hands those to the caller and `generate` collects them into a `Completion`. Later chapters keep
# this shape and override seams: `model_step` (S05's KV cache, S06's torch model), `sample`
# (S04's SamplingParams, S06's device sampler), `make_detokenizer` and `filter_text` (S02's
# streaming detokenizer and stop strings). The loop and the stop rules are written only here.

FINISH_STOP = "stop"      # the model ended (EOS), or a stop token or stop string matched
FINISH_LENGTH = "length"  # max_tokens reached, or the context window is full


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """What S01's loop needs to know about a request (S04's `SamplingParams` extends it).

    max_tokens  int >= 1: the most tokens to generate (16 by default, as in vLLM).
    temperature finite number >= 0: 0 is greedy; see `sample`.
    seed        None or an int >= 0: the request's own random stream.
    ignore_eos  bool: keep generating after EOS (benchmarks use it to fix the work per request).

    Raises ParameterError naming the field and its rule. Bools are not numbers here.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParameterError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})",
                                 "max_tokens", self.max_tokens)
        check_temperature(self.temperature)
        check_seed(self.seed)
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ParameterError(f"ignore_eos must be a bool (got {self.ignore_eos!r})",
                                 "ignore_eos", self.ignore_eos)


@dataclass
class Stats:
    """What one request cost, pass by pass.

    context_lens[i] is the number of tokens in the context on pass i (S01 runs the model on all
    of them; from S05 on a cache holds all but the new ones). attention_work_uncached is
    sum(n^2) over passes: the query-key scores a transformer computes when every pass recomputes
    the full context; attention_work_cached is sum(n): what it computes when keys and values of
    earlier positions are kept (S05). Units: token pairs (one score each).
    pass_times_s[i]: wall seconds of the model call of pass i (`Engine.model_step`);
    step_times_s[i]: wall seconds of the whole step i (model, sampler, stop rules, text).
    """

    prompt_tokens: int
    context_lens: list[int] = field(default_factory=list)
    pass_times_s: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)

    @property
    def passes(self) -> int:
        return len(self.context_lens)

    @property
    def attention_work_uncached(self) -> int:
        return sum(n * n for n in self.context_lens)

    @property
    def attention_work_cached(self) -> int:
        return sum(self.context_lens)


@dataclass
class Sequence:
    """One request's state while it runs (nano-vllm's `Sequence`, vLLM's `Request`).

    token_ids: prompt then output, the context the model continues; output_ids: the generated
    ids only. num_computed_tokens: how many of token_ids the model has already processed and
    kept (0 here: S01 keeps nothing and recomputes every pass; from S05 on, the positions whose
    keys and values are cached, so the engine knows from this alone whether the next step is a
    prefill or a decode). eos_ids / stop_token_ids: the ids that end the request (EOS is empty
    under ignore_eos; stop tokens arrive in S04). generator: the request's own seeded random
    stream. detokenizer: turns output ids into text (see `make_detokenizer`); stop_matcher:
    S02's stop-string matcher, None without stop strings; sampler: engine-specific sampling
    state (S06 keeps its device-side state here). finish_reason: None while running, then
    "stop" or "length"; stop_reason: the stop token id or stop string that ended it (vLLM's
    meaning; None for EOS and for "length"). text: the shown text, delta by delta.
    """

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    eos_ids: frozenset[int]
    generator: object
    detokenizer: object
    stop_token_ids: frozenset[int] = frozenset()
    stop_matcher: object = None
    sampler: object = None
    token_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matched_stop_string: str | None = None
    logprobs: list | None = None
    text: list[str] = field(default_factory=list)
    stats: Stats = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.stats = Stats(prompt_tokens=len(self.prompt_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_ids.append(token_id)


@dataclass(frozen=True)
class RequestOutput:
    """What one step of a request produced: the unit a stream yields (and, from S09 on, what
    `step()` returns per running request).

    new_token_ids: the ids generated in this step (one per step in Part I). text_delta: the
    text that became safe to show in this step (may be ""; the deltas of a request joined are
    its final text). finished / finish_reason / stop_reason: as in `Completion`, set on the
    request's last output. logprobs: the new tokens' entries of the request's logprobs (S04's
    `TokenLogprobs`, one per id in new_token_ids) when it asked for them, else None.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None


@dataclass
class Completion:
    """The result of a request, the one result type of every engine in the course.

    text: the completion (an EOS or stop token's text is never in it; a stop string is cut off
    with everything after it). token_ids: every generated id, the one that ended generation
    included. finish_reason: "stop" (EOS, a stop token or a stop string) or "length"
    (max_tokens, or the context window is full). stop_reason: the stop token id or stop string
    that matched, else None (vLLM's `stop_reason`). logprobs: one entry per token id when the
    request asked for them (S04), else None. stats: what each pass cost.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list | None
    stats: Stats


class CompletionStream:
    """Iterate for the `RequestOutput`s of one request as they are produced; once the last one
    (finished=True) was yielded, `result` is the `Completion`. Nothing runs until iterated."""

    def __init__(self, outputs: Iterator[RequestOutput], seq: Sequence):
        self._outputs = outputs
        self._seq = seq
        self._error: Exception | None = None

    def __iter__(self) -> "CompletionStream":
        return self

    def __next__(self) -> RequestOutput:
        try:
            return next(self._outputs)
        except StopIteration:
            raise
        except Exception as err:    # remembered, so `result` can say why there is none
            self._error = err
            raise

    def close(self) -> None:
        """Stop the stream now: its source's `close` runs (a Part I generator's, or S09's
        `LLM`'s, which aborts the request and frees its KV). Nothing more is yielded."""
        close = getattr(self._outputs, "close", None)
        if close is not None:
            close()

    @property
    def result(self) -> Completion:
        """The finished request. Raises ValueError while the stream is not exhausted, or when
        it stopped with an error (which the iteration raised)."""
        seq = self._seq
        if self._error is not None:
            raise ValueError(f"the request failed, so it has no result: "
                             f"{type(self._error).__name__}: {self._error}")
        if not seq.finished:
            raise ValueError("the stream is not finished: iterate it to the end first")
        return Completion(seq.request_id, "".join(seq.text), list(seq.output_ids),
                          seq.finish_reason, seq.stop_reason, seq.logprobs, seq.stats)


def run_to_end(stream):
    """Iterate a stream (a `CompletionStream`, S08's `BatchStream`) to its end and return its
    `result`: every engine's `generate` is its `stream` run this way, so the two cannot
    disagree."""
    for _ in stream:
        pass
    return stream.result


class DecodeAtEnd:
    """S01's detokenizer: it shows no text until the request ends, then decodes every output id
    at once. Turning tokens into text as they arrive needs care that S02's
    `StreamingDetokenizer` takes (a token can end inside a character), so S01 does not try."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        return ""

    def flush(self) -> str:
        return self.tokenizer.decode(self.ids)


def stop_rule(seq: Sequence, max_context: int) -> tuple[str, int | str | None] | None:
    """The stop rules, the only place they live, in priority order: (finish_reason,
    stop_reason) for the rule that fires after the last token, or None to go on.

    1. EOS (any of the tokenizer's EOS ids; none under ignore_eos): ("stop", None).
    2. A stop token id (S04): ("stop", that id).
    3. A stop string completed by the new text (S02 sets seq.matched_stop_string): ("stop", it).
    4. max_tokens tokens generated: ("length", None).
    5. The context holds max_context tokens, so another pass would exceed it: ("length", None).
    EOS produced as the last allowed token is an EOS stop: the model chose to end. Rule 5 also
    fires for a prompt of exactly max_context tokens, before any pass.
    Follows vLLM's stop checker (EOS, stop ids, stop strings, length) and nano-vllm's
    `Scheduler.postprocess`.
    """
    if seq.output_ids:
        last = seq.output_ids[-1]
        if last in seq.eos_ids:
            return FINISH_STOP, None
        if last in seq.stop_token_ids:
            return FINISH_STOP, last
        if seq.matched_stop_string is not None:
            return FINISH_STOP, seq.matched_stop_string
        if len(seq.output_ids) >= seq.params.max_tokens:
            return FINISH_LENGTH, None
    if len(seq.token_ids) >= max_context:
        return FINISH_LENGTH, None
    return None


class Engine:
    """The reference generation loop: recompute everything, take the last row, sample, append.

    Every later engine in the course keeps this interface and must produce the same greedy
    tokens as this one on the same model; it is the oracle, so it stays simple.

    model: anything with `forward(token_ids) -> (T, V) logits` and `vocab_size`.
    tokenizer: anything with `encode(text) -> ids`, `decode(ids) -> str` and `eos_id` (or
    `eos_ids`: every one of them then ends a request, as in HF and vLLM).
    max_context: the most tokens (prompt + generated) the model may read in one pass.

    Calls: `generate(prompt, max_tokens=16, temperature=0.0, seed=None, **options)` returns a
    `Completion`; `stream(...)`, with the same arguments, a `CompletionStream`. Instead of
    max_tokens a params object may be passed (S04: `engine.generate(prompt, SamplingParams(...))`);
    `options` are further fields of the engine's params class (here only ignore_eos).
    """

    params_class = GenerationParams

    def __init__(self, model, tokenizer, max_context: int):
        if not is_int(max_context) or max_context < 1:
            raise ParameterError(f"max_context must be an integer >= 1 (got {max_context!r})",
                                 "max_context", max_context)
        # A model that knows its window (S03's config) is never asked to read past it.
        window = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if window is not None and max_context > window:
            raise ParameterError(f"max_context ({max_context}) must be <= the model's "
                                 f"max_position_embeddings ({window})", "max_context",
                                 max_context)
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = int(max_context)
        eos_ids = getattr(tokenizer, "eos_ids", None) or (getattr(tokenizer, "eos_id", None),)
        eos_ids = [i for i in eos_ids if i is not None]
        if any(not is_int(i) or not 0 <= i < model.vocab_size for i in eos_ids):
            raise ValueError(f"the tokenizer's EOS ids must be integers in [0, V="
                             f"{model.vocab_size}) (got {eos_ids!r})")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._request_count = 0

    # --- the public interface, the same for every engine of the course ---------------------

    def generate(self, prompt: str, max_tokens=16, temperature: float | None = None,
                 seed: int | None = None, **options) -> Completion:
        """Generate a completion of `prompt`: the whole `stream`, so the two cannot disagree.

        The loop stops when the model emits EOS (finish_reason "stop"; EOS is in token_ids but
        not in text), when max_tokens tokens were generated ("length"), or when the context
        holds max_context tokens ("length"; a prompt of exactly max_context tokens stops before
        the first pass). temperature None means 0 (greedy) in this call style; seed makes
        sampling reproducible. Raises ValueError for a bad request before any pass.
        """
        return run_to_end(self.stream(prompt, max_tokens, temperature, seed, **options))

    def stream(self, prompt: str, max_tokens=16, temperature: float | None = None,
               seed: int | None = None, **options) -> CompletionStream:
        """Start a request and return its `CompletionStream` (arguments as `generate`).

        The request is checked here, before the first token: a bad one raises ValueError at
        the call, not at the first `next`.
        """
        params = self.make_params(max_tokens, temperature, seed, **options)
        seq = self.add_request(prompt, params)
        return CompletionStream(self.run(seq), seq)

    # --- the loop -------------------------------------------------------------------------

    def run(self, seq: Sequence) -> Iterator[RequestOutput]:
        """The generation loop: one model pass, one sampled token, one output per step."""
        while not seq.finished:
            seq.stats.context_lens.append(len(seq.token_ids))
            start = time.perf_counter()
            logits = self.model_step(seq)            # (V,): the next token's logits
            model_s = time.perf_counter() - start
            token = self.sample(logits, seq)         # one token id
            output = self.postprocess(seq, token)    # append it, stop rules, text to show
            seq.stats.pass_times_s.append(model_s)
            seq.stats.step_times_s.append(time.perf_counter() - start)
            yield output

    # --- seams that later chapters override ----------------------------------------------

    def model_step(self, seq: Sequence):
        """Logits (V,) of the token after seq.token_ids. S01 reruns the model on the whole
        context and keeps only the last row (S05 computes just the new token). Raises
        ValueError when the model's output is not float logits of shape (T, V)."""
        logits = self.model.forward(seq.token_ids)   # (T, V)
        expected = (len(seq.token_ids), self.model.vocab_size)
        if not isinstance(logits, np.ndarray) or logits.shape != expected \
                or not np.issubdtype(logits.dtype, np.floating):
            got = (f"{logits.dtype} {logits.shape}" if isinstance(logits, np.ndarray)
                   else type(logits).__name__)
            raise ValueError(f"model.forward must return float logits of shape (T, V) = "
                             f"{expected} (got {got})")
        return logits[-1]                            # only the last row matters

    def sample(self, logits, seq: Sequence) -> int:
        """One token id from a row of logits (V,) under the request's temperature and seed."""
        return sample(logits, seq.params.temperature, seq.generator)

    def make_detokenizer(self):
        """A fresh detokenizer for one request: `feed(id) -> text`, `flush() -> text`."""
        return DecodeAtEnd(self.tokenizer)

    def filter_text(self, seq: Sequence, text: str) -> str:
        """What of a new piece of text may be shown (S02 cuts stop strings here)."""
        return text

    def end_text(self, seq: Sequence) -> str:
        """The text still held back when the request ends (S02 adds the stop matcher's)."""
        return self.filter_text(seq, seq.detokenizer.flush())

    # --- requests and their steps --------------------------------------------------------

    def make_params(self, max_tokens=16, temperature=None, seed=None, **options):
        """The request's params from the call's arguments: a params object passed in the place
        of max_tokens (converted to this engine's `params_class` when it is another chapter's),
        or the fields as keywords. Raises ParameterError for an unknown option, for keywords next to
        a params object, and for a later chapter's params whose extra fields this engine would
        ignore (S04's top_p given to S01's engine)."""
        if not isinstance(max_tokens, GenerationParams) and not is_int(max_tokens):
            raise ParameterError(f"max_tokens must be an integer >= 1, or a params object "
                                 f"({self.params_class.__name__}) in its place (got "
                                 f"{max_tokens!r})", "max_tokens", max_tokens)
        if isinstance(max_tokens, GenerationParams):
            params = max_tokens
            if temperature is not None or seed is not None or options:
                raise ParameterError("pass either a params object or keyword fields, not both")
            if type(params) is self.params_class:
                return params
            # Another chapter's params: keep what this engine implements. A field it does not
            # implement must still have its default, or it would be silently ignored.
            known = {f.name for f in dataclass_fields(self.params_class)}
            ignored = sorted(f.name for f in dataclass_fields(params)
                             if f.name not in known and getattr(params, f.name) != f.default)
            if ignored:
                raise ParameterError(f"this engine does not implement {ignored} (fields of "
                                     f"{type(params).__name__}): use the engine of the chapter "
                                     "that does, or leave them at their defaults", ignored[0])
            return self.params_class(**{f.name: getattr(params, f.name)
                                        for f in dataclass_fields(params) if f.name in known})
        known = {f.name for f in dataclass_fields(self.params_class)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ParameterError(f"unknown option(s) {unknown}: this engine takes "
                                 f"{sorted(known - {'max_tokens', 'temperature', 'seed'})}",
                                 unknown[0])
        return self.params_class(max_tokens=max_tokens,
                                 temperature=0.0 if temperature is None else temperature,
                                 seed=seed, **options)

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids. A prompt is a non-empty str of valid Unicode (see
        `check_text`) that encodes to at least one token (whether whitespace is a token is the
        tokenizer's business: S01's "\\n" is one, "   " encodes to nothing), or a non-empty
        list of token ids (S09's `add_request` takes both). Either way every id must lie in
        [0, V) of the model (a tokenizer may know more ids than the model has rows) and there
        may be at most max_context of them (no silent truncation). Raises ParameterError
        (parameter "prompt") naming the rule."""
        if isinstance(prompt, np.ndarray):       # token ids as an array: the same ids
            if prompt.ndim != 1:
                raise ParameterError(f"prompt token ids must be 1-D (got an array of shape "
                                     f"{prompt.shape})", "prompt")
            prompt = prompt.tolist()
        ids = isinstance(prompt, (list, tuple)) and all(is_int(i) for i in prompt)
        if not prompt or not (ids or isinstance(prompt, str)):
            got = (repr(prompt) if isinstance(prompt, (str, list, tuple)) and not prompt
                   else f"a {type(prompt).__name__}")
            raise ParameterError(f"prompt must be a non-empty string or a non-empty list of "
                                 f"token ids (got {got})", "prompt")
        if ids:
            prompt_ids = [int(i) for i in prompt]
        else:
            check_text(prompt, "prompt")
            prompt_ids = list(self.tokenizer.encode(prompt))
            if not prompt_ids:
                raise ParameterError("prompt must contain at least one token (the tokenizer "
                                     "encodes it to none)", "prompt")
        if len(prompt_ids) > self.max_context:
            raise ParameterError(
                f"prompt is {len(prompt_ids)} tokens but max_context is {self.max_context}; "
                "shorten the prompt (it is never truncated silently)", "prompt")
        vocab = self.model.vocab_size
        bad = next((i for i in prompt_ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ParameterError(f"prompt token ids must lie in [0, V={vocab}) (got {bad})",
                                 "prompt")
        return prompt_ids

    def add_request(self, prompt: str, params: GenerationParams) -> Sequence:
        """Check a request and make its `Sequence` (a prompt that fills the context is finished
        at once, with finish_reason "length" and no token)."""
        prompt_ids = self.check_prompt(prompt)
        seq = self.make_sequence(str(self._request_count), prompt_ids, params)
        self._request_count += 1
        self.finish_if_stopped(seq)
        return seq

    def make_sequence(self, request_id: str, prompt_ids: list[int],
                      params: GenerationParams) -> Sequence:
        """A new request's state (S02 adds a stop matcher, S04 stop tokens and logprobs)."""
        return Sequence(request_id, prompt_ids, params,
                        eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
                        generator=self.make_generator(params),
                        detokenizer=self.make_detokenizer())

    def make_generator(self, params: GenerationParams):
        """The request's own random stream: NumPy's, seeded by params.seed (S06 draws on the
        device with a torch.Generator of its sampler instead, and keeps none here)."""
        return np.random.default_rng(params.seed)

    def postprocess(self, seq: Sequence, token: int, appended: bool = False) -> RequestOutput:
        """After a token is sampled: append it, turn it into text, apply the stop rules.

        The text of an EOS or stop token is never shown. When the request ends, whatever text
        the detokenizer and the stop matcher still hold is released in the same output.
        appended: the token is already seq's last (S16's async loop appends a step's tokens
        before the next step is launched, and turns them into text while it runs).
        """
        if not appended:
            seq.append(token)
        if token not in seq.eos_ids and token not in seq.stop_token_ids:
            delta = self.filter_text(seq, seq.detokenizer.feed(token))
        else:
            delta = ""
        delta += self.finish_if_stopped(seq)
        seq.text.append(delta)
        return RequestOutput(seq.request_id, [token], delta, seq.finished, seq.finish_reason,
                             seq.stop_reason, None if seq.logprobs is None else seq.logprobs[-1:])

    def finish_if_stopped(self, seq: Sequence) -> str:
        """Apply `stop_rule`; if it fires, finish the request and return its held-back text."""
        stop = stop_rule(seq, self.max_context)
        if stop is None:
            return ""
        return self.finish(seq, *stop)

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: int | str | None = None
               ) -> str:
        """End the request with this reason and return the text it still held back (the
        detokenizer's and the stop matcher's), which may complete a stop string: then the
        request ends as that stop ("stop", the string). The one place a request ends with its
        text released (`stop_rule`'s ends; from S10 on also the scheduler's "length" end)."""
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        if seq.matched_stop_string is not None:
            return ""                          # text after a stop string is never shown
        tail = self.end_text(seq)
        if seq.matched_stop_string is not None:  # the held-back text completed a stop string
            seq.finish_reason, seq.stop_reason = FINISH_STOP, seq.matched_stop_string
        return tail


# ---------------------------------------------------------------------------------------------
# Cost table and main
# ---------------------------------------------------------------------------------------------

def cost_table(stats: Stats) -> list[tuple[int, int, int, int, float]]:
    """Rows (pass, context length n, work without cache n^2, work with cache n, cumulative
    ratio uncached/cached) for every pass, in token pairs (see `Stats`)."""
    rows = []
    total_uncached = total_cached = 0
    for i, n in enumerate(stats.context_lens, start=1):
        total_uncached += n * n
        total_cached += n
        rows.append((i, n, n * n, n, total_uncached / total_cached))
    return rows


def format_cost_table(stats: Stats, max_rows: int = 12) -> str:
    """The cost table as text; long runs show the first and last passes with '...' between."""
    rows = cost_table(stats)
    lines = [f"{'pass':>5} {'context n':>10} {'no cache n^2':>13} {'cache n':>8} "
             f"{'cumulative ratio':>17}"]
    half = max_rows // 2
    shown = rows if len(rows) <= max_rows else rows[:half] + [None] + rows[-half:]
    for row in shown:
        if row is None:
            lines.append(f"{'...':>5}")
            continue
        i, n, uncached, cached, ratio = row
        lines.append(f"{i:>5} {n:>10} {uncached:>13,} {cached:>8,} {ratio:>16.1f}x")
    lines.append(
        f"total over {stats.passes} passes: {stats.attention_work_uncached:,} token pairs "
        f"without a cache, {stats.attention_work_cached:,} with one")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 1: the generation loop on a bigram model.")
    parser.add_argument("--prompt", default="Ham.\nTo be, or not to be",
                        help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=60, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=256, help="context window in tokens (default: %(default)s)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    tokenizer, model = build_default()
    print(f"trained a bigram model: V = {model.vocab_size:,} words, "
          f"{time.perf_counter() - start:.2f} s")
    try:
        engine = Engine(model, tokenizer, max_context=args.max_context)
        result = engine.generate(args.prompt, args.max_tokens, args.temperature, args.seed)
    except ValueError as err:
        parser.error(str(err))
    print("\n--- prompt ---\n" + tokenizer.normalize(args.prompt))
    print("--- completion ---\n" + result.text)
    s = result.stats
    print(f"--- {len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
          f"{s.passes} passes ---\n")
    print(format_cost_table(s))


if __name__ == "__main__":
    main()
