"""Data for the S04 "Try it" simulator: real logits rows of the bundled model and S04's answers.

The page runs S04's pipeline (code/s04_sampling.py, `process_logits`) in JavaScript, one
processor at a time in S04's order: min_tokens, penalties (repetition, then presence and
frequency), temperature, min-p, top-k, top-p; at temperature 0 it stops after the penalties
and takes the argmax, as `process_logits` and `draw` do. Everything it needs comes from here,
computed at site build time:

- a few rows of logits (V,) of the bundled model (data/model, loaded by code/s03_checkpoint.py,
  run by code/s03_transformer.py) after prompts from the corpus (which writes speakers as
  `Ham.`), some of them followed by a greedy continuation from S04's `Engine`; that
  continuation is the `output_ids` the presence and frequency penalties count (the repetition
  penalty sees prompt and output). Values are float32, written as the shortest decimal that
  reads back to the same float32 (checked here), so the page starts from the model's bits;
- a few hand-made rows: the chapter's worked examples (five tokens, the penalty rows, the
  order examples, ties, a top-p head that equals top_p exactly);
- reference results of S04's own functions for a grid of settings on every row (`REFERENCE`):
  per stage the number of tokens kept, the sum of their ids, and the float64 sum of their
  logits in index order (the page's float32 arithmetic must reproduce S04's bit for bit to
  give the same sum), the greedy token, the probabilities of the final distribution's most
  likely tokens (S04's `softmax`), or the ValueError message S04 raises. The page replays them
  on load and says so if it disagrees.

`stages()` is the step-by-step pipeline the page shows; it raises RuntimeError if its last row
is not `process_logits`' output. Without data/model/ the model rows are left out (the page
says why) and the hand-made rows remain.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s04_sampling as s04  # noqa: E402  (code/ is not a package)
from s03_transformer import BUNDLED_MODEL_DIR, parameter_count  # noqa: E402

STAGES = ("min_tokens", "penalties", "temperature", "min_p", "top_k", "top_p")

# (label, prompt, greedy output tokens that follow it). The greedy continuation of
# "Ham.\nTo be, or not to be" is " a man. I am not a man. ..."; after its first 3 tokens the
# model puts most of its mass on EOS (min_tokens' row), after 6 it repeats " a" (the penalties').
MODEL_ROWS = (
    ("speaker line: who speaks first", "Ham.\n", 0),
    ("a flat row: Hamlet's famous line", "Ham.\nTo be, or not to be", 0),
    ("EOS likely: after the greedy ' a man.'", "Ham.\nTo be, or not to be", 3),
    ("a repeat: after the greedy ' a man. I am not'", "Ham.\nTo be, or not to be", 6),
    ("a sharper row: the graveyard",
     "Ham.\nLet me see. [Takes the skull.] Alas, poor Yorick!--I knew him,\nHoratio", 0),
)

# (label, logits, prompt_ids, output_ids): the chapter's examples, token i named "t<i>".
HAND_ROWS = (
    ("hand-made: p = (0.4, 0.3, 0.15, 0.1, 0.05), Five tokens by hand",
     np.log([0.4, 0.3, 0.15, 0.1, 0.05]), (), ()),
    ("hand-made: z = (3, 1, -1), output [0, 0, 2], the penalties by hand",
     [3.0, 1.0, -1.0], (), (0, 0, 2)),
    ("hand-made: z = (2, 1, 0), output [0], penalties before temperature",
     [2.0, 1.0, 0.0], (), (0,)),
    ("hand-made: p = (0.5, 0.3, 0.2), min-p before top-p", np.log([0.5, 0.3, 0.2]), (), ()),
    ("hand-made: eight equal logits, ties", [0.0] * 8, (), ()),
    ("hand-made: p = (0.1, 0.3, 0.6), a head equal to top_p", np.log([0.1, 0.3, 0.6]), (), ()),
)

MODEL_GRID = (
    {}, {"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 1.5},
    {"temperature": 1e-6}, {"temperature": 100.0},
    {"top_k": 1}, {"top_k": 5}, {"top_k": 50}, {"top_k": -1},
    {"top_p": 0.0}, {"top_p": 0.5}, {"top_p": 0.9},
    {"min_p": 0.05}, {"min_p": 0.1}, {"min_p": 1.0},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.3, "top_p": 0.6, "min_p": 0.02},
    {"repetition_penalty": 1.3}, {"temperature": 0.0, "repetition_penalty": 1.3},
    {"frequency_penalty": 1.0}, {"temperature": 0.0, "frequency_penalty": 0.5},
    {"presence_penalty": 1.5, "frequency_penalty": -0.5, "top_k": 20},
    {"repetition_penalty": 0.8, "presence_penalty": -1.0, "min_p": 0.1},
    {"min_tokens": 8}, {"temperature": 0.0, "min_tokens": 8},
    {"repetition_penalty": 1e-38},       # float32 overflow on a positive seen logit: S04 refuses
)
HAND_GRID = {
    0: ({"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_k": 10},
        {"top_p": 0.8}, {"top_p": 0.0}, {"top_p": 0.7}, {"min_p": 0.3}, {"min_p": 0.5},
        {"temperature": 0.0}),
    1: ({"repetition_penalty": 2.0}, {"frequency_penalty": 0.25, "presence_penalty": 0.5},
        {"temperature": 0.0, "repetition_penalty": 2.0}),
    2: ({"temperature": 0.5}, {"temperature": 0.5, "frequency_penalty": 1.0},
        {"temperature": 2.0, "frequency_penalty": 1.0}),
    3: ({"min_p": 0.5}, {"top_p": 0.6}, {"min_p": 0.5, "top_p": 0.6}),
    4: ({"top_p": 0.5}, {"top_k": 3}, {"min_p": 1.0}, {"temperature": 0.0}),
    5: ({"top_p": 0.9}, {"top_p": 0.6}, {"top_p": 0.4}),
}
# Settings S04 refuses, with the message the page must show (SamplingParams' own).
INVALID = ({"top_p": 1.5}, {"temperature": 150.0}, {"top_k": -2}, {"repetition_penalty": 0.0},
           {"frequency_penalty": 2.5}, {"min_p": -0.1}, {"min_tokens": -1},
           {"min_tokens": s04.SamplingParams().max_tokens + 1},
           {"temperature": 1e-05, "presence_penalty": -3.0})
TOP_SHOWN = 8           # final probabilities per reference case
PROB_TOLERANCE = 1e-6   # |page - S04's float32 softmax|, see the chapter's Try it


def params_for(settings: dict) -> s04.SamplingParams:
    """SamplingParams with these fields and every other at its default (so max_tokens is 16 and
    min_tokens above it is refused, as the page refuses it)."""
    return s04.SamplingParams(**settings)


def stages(logits, params: s04.SamplingParams, prompt_ids=(), output_ids=(), eos_ids=()):
    """S04's processors one at a time, in `process_logits`' order.

    Returns [(stage name, float32 row (V,) after it, or None where greedy skips it)] for STAGES.
    Raises ValueError where `process_logits` does (with its message), RuntimeError if the last
    row differs from `process_logits`' output by a single bit.
    """
    final = s04.process_logits(logits, params, prompt_ids, output_ids, eos_ids)
    row = s04.check_logits(logits)
    stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
    row = s04.apply_min_tokens(row, len(output_ids), params.min_tokens, stop_ids)
    out = [("min_tokens", row)]
    row = s04.apply_repetition_penalty(row, [*prompt_ids, *output_ids], params.repetition_penalty)
    row = s04.apply_presence_frequency_penalties(row, output_ids, params.presence_penalty,
                                                 params.frequency_penalty)
    out.append(("penalties", row))
    for name, step, value in (("temperature", s04.apply_temperature, params.temperature),
                              ("min_p", s04.apply_min_p, params.min_p),
                              ("top_k", s04.apply_top_k, params.top_k),
                              ("top_p", s04.apply_top_p, params.top_p)):
        if params.greedy:
            out.append((name, None))
            continue
        row = step(row, value)
        out.append((name, row))
    if not np.array_equal(row, final):
        raise RuntimeError("the step-by-step pipeline does not reproduce process_logits")
    return out


def fingerprint(row: np.ndarray) -> list:
    """[kept tokens, sum of their ids, float64 sum of their logits in index order]."""
    kept = np.flatnonzero(np.isfinite(row))
    total = float(np.cumsum(row[kept].astype(np.float64))[-1]) if kept.size else 0.0
    return [int(kept.size), int(kept.sum()), total]


def reference(row: dict, settings: dict) -> dict:
    """S04's answer for one row and one setting (what the page must reproduce)."""
    case = {"row": row["index"], "settings": settings}
    logits = np.array(row["logits"], dtype=np.float32)
    try:
        params = params_for(settings)
        steps = stages(logits, params, row["prompt_ids"], row["output_ids"], row["eos_ids"])
    except ValueError as err:
        case["error"] = str(err)
        return case
    case["stages"] = [None if r is None else fingerprint(r) for _, r in steps]
    final = steps[-1][1] if not params.greedy else steps[1][1]
    if params.greedy:
        case["greedy"] = s04.draw(final, params, np.random.default_rng(0))
        return case
    p = s04.softmax(final)
    top = np.argsort(-p, kind="stable")[:TOP_SHOWN]
    case["top"] = [[int(i), float(p[i])] for i in top if p[i] > 0]
    return case


def float32_text(x) -> float:
    """The shortest decimal that reads back (float64, then float32: JavaScript's
    Math.fround(Number(s))) to exactly x, as a float for JSON. ValueError if x is not finite."""
    x = np.float32(x)
    if not np.isfinite(x):
        raise ValueError(f"only finite logits are exported (got {x})")
    value = float(str(x))
    if np.float32(value) != x:
        value = float(x)      # exact, 17 digits at most
    return value


def top_p_boundaries(logits: np.ndarray, head: int) -> list[float]:
    """Two top_p values on either side of the float32 edge where `apply_top_p` stops keeping
    the `head`-th most likely token of a row (the mass rounds exactly to float32(1 - top_p)
    there). Found by bisection on S04's own function; [] if none is found."""
    def kept(top_p: float) -> int:
        return int(np.isfinite(s04.apply_top_p(logits, top_p)).sum())
    lo, hi = 0.0, 1.0 - 1e-12
    if kept(lo) >= head or kept(hi) < head:
        return []
    for _ in range(80):                     # kept() is monotone in top_p
        mid = (lo + hi) / 2
        if kept(mid) >= head:
            hi = mid
        else:
            lo = mid
    return [lo, hi] if kept(lo) == head - 1 and kept(hi) >= head else []


def load_model_rows() -> tuple[dict, list[dict]]:
    """(model description, rows) from the bundled model, or ({"available": False, ...}, [])."""
    if not (BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        return {"available": False,
                "reason": "data/model/ has no model.safetensors: the bundled model is missing "
                          "from this build (python scripts/train_bundled_model.py trains it)."}, []
    import s03_checkpoint
    model, tokenizer = s03_checkpoint.load(BUNDLED_MODEL_DIR)
    cfg = model.config
    engine = s04.Engine(model, tokenizer, cfg.max_position_embeddings)
    eos_ids = sorted(int(i) for i in tokenizer.eos_ids)
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    vocab = [names.get(i, tokenizer.decode([i])) for i in range(cfg.vocab_size)]
    rows = []
    for label, prompt, n_out in MODEL_ROWS:
        prompt_ids = tokenizer.encode(prompt)
        output_ids = []
        if n_out:
            params = s04.SamplingParams(temperature=0.0, max_tokens=n_out, min_tokens=n_out)
            output_ids = list(engine.generate(prompt, params).token_ids)
        logits = model.forward(prompt_ids + output_ids)[-1].astype(np.float32)   # (V,)
        rows.append({"label": label, "kind": "model", "prompt": prompt,
                     "prompt_ids": prompt_ids, "output_ids": output_ids, "eos_ids": eos_ids,
                     "logits": logits})
    return {"available": True, "V": cfg.vocab_size, "parameters": parameter_count(cfg),
            "model_type": cfg.model_type, "vocab": vocab, "eos_ids": eos_ids,
            "source": "data/model via code/s03_checkpoint.py"}, rows


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError if a logits row does not read back
    bit for bit or the step-by-step pipeline differs from `process_logits`."""
    model, rows = load_model_rows()
    for label, logits, prompt_ids, output_ids in HAND_ROWS:
        z = np.asarray(logits, dtype=np.float32)
        rows.append({"label": label, "kind": "hand", "prompt": None, "prompt_ids": list(prompt_ids),
                     "output_ids": list(output_ids), "eos_ids": [], "logits": z,
                     "tokens": [f"t{i}" for i in range(z.size)]})
    cases = []
    first_hand = len(rows) - len(HAND_ROWS)
    for index, row in enumerate(rows):
        row["index"] = index
        text = [float32_text(v) for v in row["logits"]]
        if not np.array_equal(np.array(text, dtype=np.float32), row["logits"]):
            raise RuntimeError("an exported logits row does not read back bit for bit")
        if row["kind"] == "model":
            grid = list(MODEL_GRID)
            grid += [{"top_p": p} for p in top_p_boundaries(row["logits"], 10)]
            grid += [dict(s) for s in INVALID] if index == 0 else []
        else:
            grid = list(HAND_GRID[index - first_hand])
        cases += [reference(row, dict(settings)) for settings in grid]
        row["logits"] = text
    if not rows[0]["kind"] == "model":
        cases += [reference(rows[0], dict(s)) for s in INVALID]
    for row in rows:
        row.pop("index")
    return {
        "source": "code/s04_sampling.py (process_logits, its processors, softmax, draw)",
        "stages": list(STAGES),
        "defaults": {name: getattr(s04.SamplingParams(), name) for name in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "min_tokens")},
        "max_tokens": s04.SamplingParams().max_tokens,   # min_tokens' upper bound on the page
        "prob_tolerance": PROB_TOLERANCE,
        "model": model,
        "rows": rows,
        "reference": cases,
    }


if __name__ == "__main__":  # print the size of what the page downloads
    import json
    data = export()
    print(f"{len(data['rows'])} rows, {len(data['reference'])} reference cases, "
          f"{len(json.dumps(data, separators=(',', ':'))):,} bytes")
