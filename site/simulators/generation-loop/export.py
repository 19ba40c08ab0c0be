"""Data for the S01 "Try it" simulator, exported from the chapter's own code at site build time.

The simulator on the S01 page steps `Engine.generate` over a bigram model. It runs in the browser,
so it needs the model and the random numbers; it reimplements only the loop's bookkeeping and the
sampling arithmetic of `s01_generation_loop.sample`. Everything else comes from here:

- the tokenizer's vocabulary (the JavaScript tokenizer splits text with the same pattern),
- the bigram logits table of `build_default(max_vocab=MAX_VOCAB)`, trained by the chapter's code
  on the bundled corpus. The shipped model has V = 4,096 (a 64 MiB table); the page uses a
  V = 512 model built by the same function. Rows are sparse: in a row of an add-k smoothed
  bigram every unseen continuation has the same logit, so a row is stored as that shared value,
  the -inf columns (`<unk>` is never a target), and the distinct observed values with the
  columns that carry each one. Values are float32, written as the shortest decimal that reads
  back to the same float32 (checked below), so the browser sees exactly the engine's logits,
- the first `UNIFORMS_PER_SEED` draws of `np.random.default_rng(seed).random()` for a few seeds:
  `sample` consumes exactly one such draw per sampled token (inverse-CDF sampling), so replaying
  them makes the page pick the same tokens as the Python engine for the same seed,
- a few reference traces run by `Engine.generate`, which the page re-runs when it loads and
  reports (console error, visible banner) if it disagrees.

`export()` checks the sparse table against the dense one before returning: a table that does not
reconstruct exactly is an error, never a silently different model.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

from s01_generation_loop import Engine, build_default  # noqa: E402  (code/ is not a package)

MAX_VOCAB = 512
MAX_CONTEXT = 256          # the CLI's default context window
SEEDS = (42, 0, 1, 2, 3)    # the first is the page's default
UNIFORMS_PER_SEED = MAX_CONTEXT  # a run has at most MAX_CONTEXT - 1 passes, one draw each
# Every word of these is in the V = 512 vocabulary (no <unk>); the page also takes any text.
PROMPTS = ("Ham.\nTo be, or not to be", "QUEEN.\nGood night, sweet lord", "O, what a noble mind",
           "Enter the King and Queen")
REFERENCE_RUNS = ((PROMPTS[0], 40, 0.0, 0), (PROMPTS[0], 40, 0.8, 42), (PROMPTS[1], 60, 1.0, 1),
                  (PROMPTS[2], 30, 1.5, 3), ("Mac.\nIf it were done", 255, 0.7, 2))


def float32_text(x: np.float32) -> str:
    """The shortest decimal that reads back (as a float64, then rounded to float32, which is what
    JavaScript's Math.fround(Number(s)) does) to exactly x. Raises ValueError for a non-finite x."""
    if not np.isfinite(x):
        raise ValueError(f"only finite values are written as text (got {x})")
    text = np.format_float_positional(np.float32(x), unique=True, trim="-")
    if np.float32(float(text)) != x:  # double rounding could differ; fall back to 17 digits
        text = repr(float(x))
    return text


def sparse_row(row: np.ndarray) -> dict:
    """One float32 row (V,) -> {"d": shared value, "ninf": [cols], "v": [[value, [cols]], ...]}.

    The shared value `d` is the most common finite value (the smoothed logit of an unseen pair).
    Columns in each list are increasing.
    """
    finite = np.isfinite(row)
    if np.isnan(row).any() or (~finite & (row > 0)).any():
        raise ValueError("a logits row may hold finite values and -inf only")
    values, counts = np.unique(row[finite], return_counts=True)
    shared = values[np.argmax(counts)]
    groups = []
    for value in values:
        if value == shared:
            continue
        groups.append([float32_text(value), np.flatnonzero(row == value).tolist()])
    return {"d": float32_text(shared), "ninf": np.flatnonzero(~finite).tolist(), "v": groups}


def dense_from_sparse(rows: list[dict], vocab_size: int) -> np.ndarray:
    """Rebuild the (V, V) float32 table the way the JavaScript does (the export's self-check)."""
    table = np.empty((vocab_size, vocab_size), dtype=np.float32)
    for r, row in enumerate(rows):
        table[r, :] = np.float32(float(row["d"]))
        table[r, row["ninf"]] = -np.inf
        for value, cols in row["v"]:
            table[r, cols] = np.float32(float(value))
    return table


def export() -> dict:
    """Build the V = 512 model with the chapter's code and return the simulator's data (JSON-able).

    Raises RuntimeError if the sparse table does not rebuild the model's table bit for bit.
    """
    tokenizer, model = build_default(max_vocab=MAX_VOCAB)
    table = model.logits_table  # (V, V) float32
    rows = [sparse_row(row) for row in table]
    if not np.array_equal(dense_from_sparse(rows, model.vocab_size), table):
        raise RuntimeError("the sparse bigram export does not reproduce the model's logits exactly")

    uniforms = {}
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        # repr() of a float64 is the shortest text that reads back to the same double.
        uniforms[str(seed)] = [float(rng.random()) for _ in range(UNIFORMS_PER_SEED)]

    engine = Engine(model, tokenizer, max_context=MAX_CONTEXT)
    traces = []
    for prompt, max_tokens, temperature, seed in REFERENCE_RUNS:
        gen = engine.generate(prompt, max_tokens, temperature=temperature, seed=seed)
        traces.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                       "seed": seed, "token_ids": gen.token_ids, "text": gen.text,
                       "finish_reason": gen.finish_reason,
                       "context_lens": gen.stats.context_lens})

    return {
        "source": "code/s01_generation_loop.py: build_default(max_vocab=%d)" % MAX_VOCAB,
        "vocab": tokenizer.id_to_token,
        "eos_id": tokenizer.eos_id,
        "unk_id": tokenizer.unk_id,
        "max_context": MAX_CONTEXT,
        "rows": rows,
        "seeds": list(SEEDS),
        "uniforms": uniforms,
        "prompts": list(PROMPTS),
        "traces": traces,
    }


if __name__ == "__main__":  # print the size of what the page downloads
    import json
    data = export()
    print(f"V = {len(data['vocab'])}, {len(json.dumps(data, separators=(',', ':'))):,} bytes of JSON")
