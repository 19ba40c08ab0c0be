"""S01, the generation loop: how a language model writes text, one token per pass.

What is here
    Everything an inference engine does, at its smallest: a word-level toy tokenizer, a NumPy
    bigram "language model" trained from the bundled Shakespeare corpus in about a second, a
    sampler, and `Engine.generate`, the loop that runs the model on the whole context, takes the
    logits of the last position, samples a token, appends it and repeats until a stop rule fires.
    `Stats` records what every pass cost, so the quadratic growth of an engine without a cache is
    visible before we build one.

What it does not handle yet
    Real tokenization (S02: byte-level BPE), a real transformer (S03), the sampling controls that
    serving APIs expose (S04), and any caching: every pass recomputes the whole context, which is
    exactly the waste S05's KV cache removes. This loop stays the course's oracle: every later
    engine must produce the same greedy tokens on the same model.

Run it
    python code/s01_generation_loop.py --prompt "To be, or not to be" --max-tokens 40

Tests
    tests/test_s01_generation_loop.py (tokenizer, model, sampler, every stop reason at its
    boundary, bad input, the cost table against closed-form sums).

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
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

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


def check_seed(seed) -> None:
    """Raise ValueError unless seed is None or an integer >= 0 (what `np.random.default_rng`
    takes; a bool is not a seed)."""
    if seed is not None and (not is_int(seed) or seed < 0):
        raise ValueError(f"seed must be None or an integer >= 0 (got {seed!r})")


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

    def __init__(self, vocab: Sequence[str]):
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
    def train(cls, token_ids: Sequence[int] | np.ndarray, vocab_size: int, alpha: float = 0.01,
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

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
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
    """Raise ValueError unless temperature is a finite int or float (NumPy's too) >= 0.
    A bool is not a temperature: True would silently mean 1."""
    if not is_real(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (an int or a float, not a "
                         f"{type(temperature).__name__}; got {temperature!r})")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (got {temperature!r})")


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

STOP_EOS = "eos"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"


@dataclass
class Stats:
    """What one `generate` call did, pass by pass.

    context_lens[i] is the number of tokens the model read on pass i (the whole context, since
    nothing is cached). attention_work_uncached is sum(n^2) over passes: the query-key scores a
    transformer computes when every pass recomputes the full context; attention_work_cached is
    sum(n): what it computes when keys and values of earlier positions are kept (S05).
    Units: token pairs (one score each). pass_times_s are wall seconds per forward pass.
    """

    prompt_tokens: int
    context_lens: list[int] = field(default_factory=list)
    pass_times_s: list[float] = field(default_factory=list)
    tokens_out: int = 0
    stop_reason: str | None = None

    @property
    def passes(self) -> int:
        return len(self.context_lens)

    @property
    def attention_work_uncached(self) -> int:
        return sum(n * n for n in self.context_lens)

    @property
    def attention_work_cached(self) -> int:
        return sum(self.context_lens)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM name: "stop" for an end-of-sequence token, "length" for the token
        budget or a full context window."""
        if self.stop_reason is None:
            return None
        return "stop" if self.stop_reason == STOP_EOS else "length"


@dataclass
class Generation:
    """The result of `Engine.generate`: completion text (EOS excluded), the generated ids (EOS
    included when produced) and the per-pass stats."""

    text: str
    token_ids: list[int]
    stats: Stats


class Engine:
    """The reference generation loop: recompute everything, take the last row, sample, append.

    Every later engine in the course must produce the same greedy tokens as this one on the same
    model; it is the oracle, so it stays simple.

    model: anything with `forward(token_ids) -> (T, V) logits` and `vocab_size`.
    tokenizer: anything with `encode(text) -> ids`, `decode(ids) -> str` and `eos_id`.
    max_context: the most tokens (prompt + generated) the model may read in one pass.
    """

    def __init__(self, model, tokenizer, max_context: int):
        if not is_int(max_context) or max_context < 1:
            raise ValueError(f"max_context must be an integer >= 1 (got {max_context!r})")
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = int(max_context)

    def check_request(self, prompt: str, max_tokens: int, temperature: float,
                      seed: int | None = None) -> list[int]:
        """Validate one request and return the prompt's token ids.

        Raises ValueError naming the rule: prompt must be a non-empty str and must encode to at
        least one token (whether whitespace is a token is the tokenizer's business: S01's "\\n"
        is one, "   " encodes to nothing); max_tokens must be an integer >= 1; temperature must
        be a finite number >= 0; seed must be None or an integer >= 0; the prompt may not be
        longer than max_context tokens (no silent truncation). Bools are not numbers here.
        """
        if not isinstance(prompt, str) or not prompt:
            got = "''" if isinstance(prompt, str) else f"a {type(prompt).__name__}"
            raise ValueError(f"prompt must be a non-empty string (got {got})")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
        check_temperature(temperature)
        check_seed(seed)
        prompt_ids = list(self.tokenizer.encode(prompt))
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token (the tokenizer encodes "
                             "it to none)")
        if len(prompt_ids) > self.max_context:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens but max_context is {self.max_context}; "
                "shorten the prompt (it is never truncated silently)")
        return prompt_ids

    def stop_reason(self, token_id: int, tokens_out: int, max_tokens: int) -> str | None:
        """The stop rule after a token was sampled, in priority order: EOS, then the budget.

        EOS produced as the last allowed token is an EOS stop: the model chose to end.
        """
        if token_id == self.tokenizer.eos_id:
            return STOP_EOS
        if tokens_out >= max_tokens:
            return STOP_MAX_TOKENS
        return None

    def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> Generation:
        """Generate up to `max_tokens` tokens after `prompt`.

        Each pass runs the model on the whole context (prompt + everything generated so far),
        keeps only the last row of logits and samples one token. The loop stops when the model
        emits EOS (stop_reason "eos"; EOS is in token_ids but not in text), when max_tokens tokens
        were generated ("max_tokens"), or when the context holds max_context tokens and another
        pass would exceed it ("context_full"; a prompt of exactly max_context tokens stops before
        the first pass). seed makes sampling reproducible (unused when temperature is 0).
        Raises ValueError for a bad request before any pass (see `check_request`).
        """
        ids = self.check_request(prompt, max_tokens, temperature, seed)
        rng = np.random.default_rng(seed)
        stats = Stats(prompt_tokens=len(ids))
        out: list[int] = []
        while stats.stop_reason is None:
            if len(ids) >= self.max_context:
                stats.stop_reason = STOP_CONTEXT_FULL
                break
            start = time.perf_counter()
            logits = self.model.forward(ids)            # (T, V): a row for every position
            stats.pass_times_s.append(time.perf_counter() - start)
            stats.context_lens.append(len(ids))
            next_id = sample(logits[-1], temperature, rng)  # only the last row matters
            ids.append(next_id)
            out.append(next_id)
            stats.tokens_out = len(out)
            stats.stop_reason = self.stop_reason(next_id, len(out), max_tokens)
        text_ids = out[:-1] if out and out[-1] == self.tokenizer.eos_id else out
        return Generation(text=self.tokenizer.decode(text_ids), token_ids=out, stats=stats)


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 1: the generation loop on a bigram model.")
    parser.add_argument("--prompt", default="Ham.\nTo be, or not to be", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=60, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--max-context", type=int, default=256, help="context window in tokens")
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
    print(f"--- {s.tokens_out} tokens, stop_reason={s.stop_reason} "
          f"(finish_reason={s.finish_reason}), {s.passes} passes ---\n")
    print(format_cost_table(s))


if __name__ == "__main__":
    main()
