"""Train the project tokenizer on data/shakespeare.txt and save it as data/tokenizer.json.

    python scripts/train_tokenizer.py            # sweep, then write data/tokenizer.json
    python scripts/train_tokenizer.py --no-save  # only print the sweep

Training is deterministic (ties between equally frequent pairs are broken by their bytes), so
running this again rewrites byte-identical files. It takes a few seconds.

How the vocabulary size was chosen. The sweep trains once on the first 90% of the corpus (cut
at a line break) and measures, on the held-out last 10%, how many bytes one token covers, and,
on the training part, how many merged tokens occur fewer than 10 times there (tokens a small
model sees too rarely to learn an embedding for). A larger vocabulary shortens sequences (fewer
passes per line of text, more text per context window) but costs an embedding row and an
output-logit column per token, and spreads the same corpus over more, rarer tokens. For the
course's bundled model (1-5 M parameters, hidden size 128-256, about 2 MB of text) 2048 is the
knee. Measured (held-out bytes/token; merged tokens seen < 10 times): 1024: 2.52, 5;
2048: 2.92, 75; 4096: 3.30, 447; 8192: 3.62, 3287. Going from 1024 to 2048 shortens sequences
by 14%; going on to 4096 shortens them by another 11% but doubles the embedding table (to about
a fifth of a 5 M-parameter model at hidden size 256) and sextuples the rarely-seen tokens.

Outputs: data/tokenizer.json (HF `tokenizers` format, read by `BPETokenizer.load_hf`,
`tokenizers.Tokenizer.from_file` and `transformers.AutoTokenizer.from_pretrained("data")`) and
data/tokenizer_config.json (the few fields `transformers` wants beside it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

from s02_tokenizer import (  # noqa: E402
    EOT, BPETokenizer, bytes_per_token, split_held_out, train_bpe, truncate_vocab,
)

VOCAB_SIZE = 2048          # 2047 byte-level tokens + <|endoftext|> (id 2047)
SWEEP = (257, 512, 1024, 2048, 4096, 8192)   # 257: the bytes alone + <|endoftext|>
RARE = 10                  # "rare": fewer than this many occurrences in the training text


def sweep(text: str, sizes=SWEEP) -> list[tuple[int, float, float, int]]:
    """Rows (vocab size, held-out bytes/token, held-out tokens per 1000 bytes, rare merged
    tokens) for each size; one training run serves all sizes (BPE is greedy)."""
    train, held_out = split_held_out(text)
    largest = train_bpe(train, max(sizes), special_tokens=(EOT,))
    rows = []
    for size in sizes:
        tok = truncate_vocab(largest, size - 1)          # -1: room for <|endoftext|>
        counts = Counter(tok.encode_ordinary(train))
        rare = sum(1 for i in range(256, size - 1) if counts[i] < RARE)
        bpt = bytes_per_token(tok, held_out)
        rows.append((size, bpt, 1000 / bpt, rare))
    return rows


def save(tokenizer: BPETokenizer, out_dir: Path, model_max_length: int = 1024) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_hf(out_dir / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT,
        "bos_token": None,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n",
                                                   encoding="utf-8")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "shakespeare.txt")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                        help="total vocabulary, special token included")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "data")
    parser.add_argument("--no-save", action="store_true", help="print the sweep only")
    args = parser.parse_args(argv)
    text = args.corpus.read_text(encoding="utf-8")

    start = time.perf_counter()
    rows = sweep(text)
    print(f"sweep (trained on 90% of {args.corpus.name}, measured on the last 10%), "
          f"{time.perf_counter() - start:.1f} s")
    rare_header = f"merged tokens seen <{RARE}x"
    print(f"{'vocab':>6} {'bytes/token':>12} {'tokens/kB':>10} {rare_header:>24}")
    for size, bpt, per_kb, rare in rows:
        print(f"{size:>6} {bpt:>12.3f} {per_kb:>10.1f} {rare:>24}")

    start = time.perf_counter()
    tokenizer = train_bpe(text, args.vocab_size, special_tokens=(EOT,))
    ids = tokenizer.encode_ordinary(text)
    assert tokenizer.decode(ids) == text, "round trip failed"
    print(f"\nfinal: V = {tokenizer.vocab_size} on the whole corpus in "
          f"{time.perf_counter() - start:.1f} s; {len(text.encode()):,} bytes -> {len(ids):,} "
          f"tokens ({len(text.encode()) / len(ids):.3f} bytes/token); eos_id = {tokenizer.eos_id}")
    if not args.no_save:
        save(tokenizer, args.out_dir)
        print(f"wrote {args.out_dir / 'tokenizer.json'} and tokenizer_config.json")


if __name__ == "__main__":
    main()
