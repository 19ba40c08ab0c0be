"""Data for the S08 "Try it" simulator: real static batches, replayed step by step.

The page replays one static batch of the bundled model at a time, rows by cache columns: the
left padding, each prompt, the tokens generated step by step, and the rows that have finished
and are still computed until the longest one ends. The batches are run here, at build time, by
the chapter's engine (`code/s08_static_batching.py`'s `Engine`, fast mode, greedy, EOS on, on
CPU in float32), on prompts cut from the corpus by S07's "chat" workload (`corpus_prompts`):

- BATCHES: the script's default batch (8 prompts, seed 0, at most 40 tokens: what
  `python code/s08_static_batching.py` prints), a batch whose requests ask for very different
  max_tokens, and a batch of 16;
- per batch: each request's prompt tokens (as text pieces), its padding, every generated token
  (text piece and id, from the engine's stream, step by step), its finish reason; and the
  engine's own `BatchStats`: one `StepWaste` per step (rows, columns, useful, padding, idle,
  masked keys; the timings are left out, they differ run to run) and `timeline()`.

The page computes every count itself from the prompt and output lengths and checks on load that
its counts equal the exported `StepWaste`s (console error and a visible banner otherwise);
tests/test_s08_simulator_browser.py compares what it shows with these values, and
tests/test_s08_simulator_data.py holds this data against independent oracles.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_cli  # noqa: E402
import s08_static_batching as s08  # noqa: E402

# (id, title, number of corpus prompts, workload seed, max_tokens of each request)
BATCHES = (
    ("default", "the script's default: 8 prompts, max_tokens 40", 8, 0, [40] * 8),
    ("mixed", "6 prompts asking for 4 to 48 tokens", 6, 3, [48, 4, 12, 30, 8, 20]),
    ("sixteen", "16 prompts, max_tokens 24", 16, 5, [24] * 16),
)
WASTE_FIELDS = ("kind", "rows", "columns", "useful", "padding", "idle", "masked_keys")


def run_batch(engine: s08.Engine, tokenizer, prompts: list[str], max_tokens: list[int]) -> dict:
    """One static batch through the engine's stream; everything the page shows."""
    params = [s04.SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    stream = engine.stream(prompts, params)
    by_request: dict[str, list[list]] = {}                  # request id: [step, id, piece]
    for step, outputs in enumerate(stream, start=1):
        for out in outputs:
            for token in out.new_token_ids:
                by_request.setdefault(out.request_id, []).append(
                    [step, token, tokenizer.decode([token])])
    completions = stream.result
    stats = stream.stats
    generated = [by_request.get(c.request_id, []) for c in completions]
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = tokenizer.encode(prompt)
        if [g[1] for g in generated[i]] != completion.token_ids:
            raise RuntimeError(f"row {i}: streamed tokens differ from the completion")
        rows.append({"prompt_ids": ids, "prompt_pieces": [tokenizer.decode([t]) for t in ids],
                     "padding": stats.padding[i], "max_tokens": max_tokens[i],
                     "generated": generated[i], "text": completion.text,
                     "finish_reason": completion.finish_reason})
    return {"rows": rows,
            "steps": [{f: getattr(s, f) for f in WASTE_FIELDS} for s in stats.steps],
            "timeline": stats.timeline(),
            "totals": {"slots": stats.slots, "useful": stats.useful,
                       "padding": stats.padding_slots, "idle": stats.idle,
                       "idle_row_steps": stats.idle_row_steps,
                       "decode_row_steps": stats.decode_row_steps}}


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the static-batch simulator replays batches of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    max_context = min(model.config.max_position_embeddings, 4096)
    data = {"source": "code/s08_static_batching.py (Engine.stream, BatchStats) on the bundled "
                      "model, greedy, EOS on, float32 on the CPU",
            "eos_id": min(engine_eos(model, tokenizer)), "batches": []}
    for key, title, num, seed, max_tokens in BATCHES:
        prompts = s08_cli.corpus_prompts(tokenizer, num, seed, max_context)
        engine = s08.Engine(model, tokenizer, max_context)
        data["batches"].append({"id": key, "title": title, "seed": seed,
                                **run_batch(engine, tokenizer, prompts, max_tokens)})
    return data


def engine_eos(model, tokenizer) -> list[int]:
    return sorted(s08.Engine(model, tokenizer).eos_ids)


if __name__ == "__main__":  # print the size of what the page downloads
    import json
    print(f"{len(json.dumps(export(), separators=(',', ':'))):,} bytes")
