"""Build data/shakespeare.txt, the course corpus, from the public-domain plays in ../shared/data.

The corpus is the concatenation of the works listed in WORKS, in that order, each separated by
two blank lines. Run from the repository root:

    python scripts/build_corpus.py [--source ../shared/data/shakespeare]

It overwrites data/shakespeare.txt and copies the attribution to data/SOURCE.md. The result is
committed, so nobody needs to run this; it exists so the corpus can be rebuilt and audited.
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

# Fifteen well-known works, about 1.9 MB: enough text that a tiny model does not simply memorise
# it, small enough that the bigram of chapter 1 trains in about a second.
WORKS = [
    "hamlet", "macbeth", "lear", "othello", "romeo_and_juliet", "julius_caesar",
    "tempest", "midsummer_nights_dream", "twelfth_night", "much_ado_about_nothing",
    "merchant_of_venice", "as_you_like_it", "richard_iii", "henry_v", "sonnets",
]

ROOT = Path(__file__).resolve().parents[1]


def build(source: Path) -> str:
    parts = []
    for name in WORKS:
        path = source / f"{name}.txt"
        if not path.exists():
            raise FileNotFoundError(f"corpus source missing: {path} (expected one file per work)")
        text = path.read_text(encoding="ascii").replace("\r\n", "\n").strip("\n")
        parts.append(text)
    return "\n\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data" / "shakespeare")
    args = parser.parse_args()
    try:
        corpus = build(args.source)
    except FileNotFoundError as err:
        parser.error(f"{err}; pass --source DIR, the folder of plain-text works (one .txt each)")
    out = ROOT / "data" / "shakespeare.txt"
    out.write_text(corpus, encoding="ascii")
    source_md = (args.source / "SOURCE.md").read_text(encoding="utf-8")
    (ROOT / "data" / "SOURCE.md").write_text(
        source_md.rstrip("\n")
        + "\n\n## This corpus\n\n`data/shakespeare.txt` joins these works, in this order, with two blank lines"
        + " between them, built by `scripts/build_corpus.py`:\n\n"
        + "".join(f"- {w}\n" for w in WORKS),
        encoding="utf-8",
    )
    digest = hashlib.sha256(corpus.encode()).hexdigest()[:16]
    print(f"wrote {out} ({len(corpus):,} bytes, sha256 {digest}...)")


if __name__ == "__main__":
    main()
