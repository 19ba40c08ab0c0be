"""Data for the S02 "Try it" simulator (byte-level BPE), exported from the chapter's code at build time.

The page tokenizes whatever the reader types with the project tokenizer (data/tokenizer.json,
loaded by `s02_tokenizer.BPETokenizer.load_hf`), shows the merges inside one pre-token, and
streams the ids through a streaming detokenizer and a stop-string matcher. It reimplements the
arithmetic of `encode_ordinary`/`bpe_merge`, `merge_steps`, `StreamingDetokenizer` and
`StopStringMatcher` in JavaScript; everything it needs to agree with them comes from here:

- every token's bytes, by id, and the special tokens;
- the pre-tokenization pattern, rewritten for JavaScript so that it means exactly what the
  `regex` module makes of it: `\\s`, `\\S`, `\\p{L}`, `\\p{N}` and the case-insensitive
  contraction group become explicit character classes listed from `regex` itself (JavaScript's
  `\\s` and its Unicode tables differ in a few characters, and `(?i:...)` is new there). The
  rewrite is checked here: `regex` running the rewritten pattern must cut a sample of text
  exactly as the tokenizer does;
- reference results (ids, pre-tokens, merge steps, streamed deltas, the ids never fed once the
  request has ended, finish_reason) for a few texts, which the page recomputes on load and
  reports (console error, visible banner) if it disagrees.
"""
from __future__ import annotations

import sys
from pathlib import Path

import regex

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

from s02_tokenizer import (  # noqa: E402  (code/ is not a package)
    TOKENIZER_PATH, BPETokenizer, StopStringMatcher, StreamingDetokenizer,
)

EXAMPLES = ("To be, or not to be: that is the question.",
            "naïve café 😀 12345678",
            "Ham.\n  Good night, sweet prince!\n\n",
            "She'LL say \"we've 3,141 ways\" <|endoftext|>",
            "Здравствуй, мир! 你好，世界。 مرحبا")
REFERENCE_STREAMS = (("naïve café 😀 12345678", ["café"], False),
                     ("Ham.\n  Good night, sweet prince!\n\n", ["\n\n", "sweet"], False),
                     ("To be, or not to be: that is the question.", ["not to be:"], False),
                     ("Good night<|endoftext|>sweet prince", ["prince"], True),
                     ("Good night<|endoftext|>sweet prince", ["prince"], False))
ALL_CHARS = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def ranges(chars: str) -> list[tuple[int, int]]:
    """Sorted code points -> [(first, last), ...] runs."""
    out: list[tuple[int, int]] = []
    for c in sorted(map(ord, chars)):
        if out and c == out[-1][1] + 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


def class_body(chars: str) -> str:
    """The inside of a character class listing `chars`, valid in `regex` and in JavaScript
    (with the u flag): syntax characters and controls escaped, everything else literal."""
    def esc(c: int) -> str:
        ch = chr(c)
        if ch in "\\]^-[":
            return "\\" + ch
        if c < 0x20 or c == 0x7F:
            return f"\\x{c:02x}"
        return ch
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges(chars))


def members(pattern: str) -> str:
    """Every character `pattern` (one class or escape) matches, according to `regex`."""
    return "".join(regex.findall(pattern, ALL_CHARS))


def javascript_pattern(pattern: str) -> str:
    """Rewrite the pre-tokenization pattern with explicit classes (see the module docstring).

    Handles the constructs SPLIT_PATTERN uses: \\s, \\S, \\p{L}, \\p{N}, \\r, \\n, character
    classes, and one case-insensitive group of literal alternatives. Raises ValueError for
    anything else, so a new pattern cannot be exported wrongly without notice.
    """
    bodies = {r"\s": class_body(members(r"\s")), r"\p{L}": class_body(members(r"\p{L}")),
              r"\p{N}": class_body(members(r"\p{N}"))}
    out, i, in_class = [], 0, False
    while i < len(pattern):
        if pattern.startswith("(?i:", i):
            end = pattern.index(")", i)
            alternatives = pattern[i + 4:end].split("|")
            expanded = []
            for alt in alternatives:
                if not regex.fullmatch(r"[A-Za-z']+", alt):
                    raise ValueError(f"case-insensitive group: cannot rewrite {alt!r}")
                expanded.append("".join(
                    c if c == "'" else "[" + class_body(members(f"(?i:{c})")) + "]" for c in alt))
            out.append("(?:" + "|".join(expanded) + ")")
            i = end + 1
            continue
        for escape in (r"\p{L}", r"\p{N}", r"\s", r"\S"):
            if pattern.startswith(escape, i):
                if escape == r"\S":
                    if in_class:
                        raise ValueError("\\S inside a class cannot be rewritten")
                    out.append("[^" + bodies[r"\s"] + "]")
                else:
                    out.append(bodies[escape] if in_class else "[" + bodies[escape] + "]")
                i += len(escape)
                break
        else:
            ch = pattern[i]
            if ch == "\\":
                escape = pattern[i:i + 2]
                if escape not in (r"\r", r"\n"):
                    raise ValueError(f"cannot rewrite the escape {escape!r}")
                out.append(escape)
                i += 2
                continue
            if ch == "[" and not in_class:
                in_class = True
            elif ch == "]" and in_class:
                in_class = False
            out.append(ch)
            i += 1
    return "".join(out)


def stream(tokenizer: BPETokenizer, text: str, stops: list[str], allowed_special: bool) -> dict:
    """What the page's streaming view shows for `text`, fed as S02's `Engine.postprocess` feeds
    generated ids: per id, the naive decode([id]), the detokenizer's delta and what the
    stop-string matcher lets through; an EOS id is not fed (fed: False) and ends the request;
    then the two flushes (`end_text`), unless a stop string ended it (`s01.stop_rule`: nothing
    is fed after it). Also the ids never fed and the finish_reason / stop_reason; running out
    of ids stands for max_tokens ("length")."""
    ids = tokenizer.encode(text, allowed_special="all" if allowed_special else ())
    detok, matcher, rows = StreamingDetokenizer(tokenizer), StopStringMatcher(stops), []
    finish, reason, k = "length", None, len(ids)
    for k, token_id in enumerate(ids):
        fed = token_id != tokenizer.eos_id
        delta = detok.feed(token_id) if fed else ""
        rows.append({"id": token_id, "naive": tokenizer.decode([token_id]), "fed": fed,
                     "delta": delta, "shown": matcher.feed(delta) if fed else "",
                     "held": matcher.held, "stopped": matcher.stopped})
        if not fed or matcher.stopped:
            finish, reason = "stop", matcher.matched
            break
    if not matcher.stopped:
        tail = detok.flush()
        rows.append({"id": None, "naive": "", "fed": True, "delta": tail,
                     "shown": matcher.feed(tail), "held": matcher.held,
                     "stopped": matcher.stopped})
        rows.append({"id": None, "naive": "", "fed": True, "delta": "", "shown": matcher.flush(),
                     "held": "", "stopped": matcher.stopped})
        if matcher.stopped:
            finish, reason = "stop", matcher.matched
    return {"rows": rows, "not_fed": ids[k + 1:], "finish_reason": finish, "stop_reason": reason}


def export() -> dict:
    """Load data/tokenizer.json with the chapter's code and return the simulator's data.

    Raises RuntimeError when the rewritten pattern cuts the check text differently from the
    tokenizer.
    """
    tokenizer = BPETokenizer.load_hf(TOKENIZER_PATH)
    pattern = javascript_pattern(tokenizer.pattern)
    check = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:300_000] \
        + "".join(EXAMPLES) + " \u0085\u00a0\ufeff\x1c ſ's 'S 'ſ 1²³ ½ Ⅻ \t\r\n x  \n"
    if regex.findall(pattern, check) != tokenizer.pre_tokenize(check):
        raise RuntimeError("the JavaScript form of the pre-tokenization pattern cuts text differently")
    references = []
    for text in EXAMPLES:
        pieces = tokenizer.pre_tokenize(text)
        word = max(pieces, key=lambda p: len(p.encode("utf-8")))
        references.append({
            "text": text, "ids": tokenizer.encode_ordinary(text), "pre_tokens": pieces,
            "ids_special": tokenizer.encode(text, allowed_special="all"),
            "word": word, "merge_steps": [[list(part) for part in step]
                                          for step in tokenizer.merge_steps(word)]})
    streams = [{"text": t, "stop": s, "allowed_special": a, **stream(tokenizer, t, s, a)}
               for t, s, a in REFERENCE_STREAMS]
    ordinary = set(tokenizer.ranks.values())
    return {
        "source": "code/s02_tokenizer.py: BPETokenizer.load_hf('data/tokenizer.json')",
        "tokens": [list(tokenizer.id_to_bytes[i]) if i in ordinary else None
                   for i in range(tokenizer.vocab_size)],
        "special_tokens": tokenizer.special_tokens,
        "eos_id": tokenizer.eos_id,
        "pattern": pattern,
        "examples": list(EXAMPLES),
        "references": references,
        "streams": streams,
    }


if __name__ == "__main__":
    import json
    import time
    start = time.perf_counter()
    data = export()
    print(f"V = {len(data['tokens'])}, {len(json.dumps(data, ensure_ascii=False)):,} characters of "
          f"JSON, pattern {len(data['pattern']):,} characters, {time.perf_counter() - start:.1f} s")
