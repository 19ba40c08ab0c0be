"""The S04 "Try it" simulator's data is the bundled model's and S04's own answers.

site/simulators/sampler-playground/export.py exports real logits rows of the bundled model and
reference results for a grid of settings, which the page replays on load. Checked here without
a browser (tests/test_s04_simulator_browser.py drives the page):

- every prompt is text of the corpus, and each model row is the logits `Transformer.forward`
  gives after prompt + output, bit for bit once read back as float32; the output is the
  greedy continuation S04's Engine generates;
- every reference case equals S04's functions recomputed here: the ValueError message, or per
  stage the kept count, id sum and logit sum, the greedy token (`s04.sample`) and the final
  probabilities (`s04.softmax` of `process_logits`);
- the grid holds the edge cases the page must get right (greedy, top_k=1, top_p=0, min_p=1, a
  top_p on each side of a float32 edge, ties, penalties, min_tokens, refused settings);
- without data/model/ the export says why and keeps the hand-made rows.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "site" / "simulators" / "sampler-playground" / "export.py"
sys.path.insert(0, str(ROOT / "code"))
import s04_sampling as s04  # noqa: E402
from s03_transformer import BUNDLED_MODEL_DIR  # noqa: E402

HAVE_MODEL = (BUNDLED_MODEL_DIR / "model.safetensors").is_file()


def exporter(model_dir: Path | None = None):
    spec = importlib.util.spec_from_file_location("s04_sim_export_under_test", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if model_dir is not None:
        module.BUNDLED_MODEL_DIR = model_dir
    return module


@pytest.fixture(scope="module")
def exported():
    module = exporter()
    return module, module.export()


def test_export_is_json_and_its_rows_read_back_as_float32(exported):
    _, data = exported
    json.dumps(data, allow_nan=False)
    assert data["stages"] == ["min_tokens", "penalties", "temperature", "min_p", "top_k", "top_p"]
    for row in data["rows"]:
        assert all(np.isfinite(v) for v in row["logits"]), row["label"]
        # Each number is the shortest decimal of a float32 (or, where reading it back through
        # float64 would round wrongly, the float32's exact value): Math.fround gives the bits.
        for v in row["logits"]:
            x = np.float32(v)
            assert v in (float(str(x)), float(x)), (row["label"], v)


@pytest.mark.skipif(not HAVE_MODEL, reason="data/model/ holds no bundled model")
def test_model_rows_are_the_bundled_models_logits(exported):
    import s03_checkpoint
    module, data = exported
    model, tokenizer = s03_checkpoint.load(BUNDLED_MODEL_DIR)
    corpus = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    engine = s04.Engine(model, tokenizer, model.config.max_position_embeddings)
    rows = [r for r in data["rows"] if r["kind"] == "model"]
    assert len(rows) == len(module.MODEL_ROWS) >= 3
    assert data["model"]["V"] == model.vocab_size == len(data["model"]["vocab"])
    for row, (_, prompt, n_out) in zip(rows, module.MODEL_ROWS):
        assert row["prompt"] == prompt and prompt in corpus, prompt   # speakers are `Ham.`
        assert row["prompt_ids"] == tokenizer.encode(prompt)
        params = s04.SamplingParams(temperature=0.0, max_tokens=max(n_out, 1), min_tokens=n_out)
        greedy = engine.generate(prompt, params).token_ids[:n_out]
        assert row["output_ids"] == list(greedy)
        want = model.forward(row["prompt_ids"] + row["output_ids"])[-1].astype(np.float32)
        assert np.array_equal(np.array(row["logits"], dtype=np.float32), want), prompt
        assert row["eos_ids"] == sorted(tokenizer.eos_ids)
    # The penalties' row: greedy would repeat a token of the output, so a penalty can act.
    repeat = rows[3]
    assert int(np.argmax(repeat["logits"])) in repeat["output_ids"]
    # The min_tokens row: EOS is the most likely token there.
    assert int(np.argmax(rows[2]["logits"])) in rows[2]["eos_ids"]


def recompute(row: dict, settings: dict) -> dict:
    """One reference case from S04's functions, independently of the exporter's `reference`."""
    logits = np.array(row["logits"], dtype=np.float32)
    args = (row["prompt_ids"], row["output_ids"], row["eos_ids"])
    try:
        params = s04.SamplingParams(**settings)      # max_tokens at its default, 16
        final = s04.process_logits(logits, params, *args)
    except ValueError as err:
        return {"error": str(err)}
    out = {}
    if params.greedy:
        out["greedy"] = s04.sample(logits, params, np.random.default_rng(0), *args)
    else:
        p = s04.softmax(final)
        top = sorted(range(p.size), key=lambda i: (-p[i], i))[:8]
        out["top"] = [[i, float(p[i])] for i in top if p[i] > 0]
    out["final"] = final
    return out


def fingerprint(row: np.ndarray) -> list:
    kept = [i for i in range(row.size) if np.isfinite(row[i])]
    total = 0.0
    for i in kept:                       # in index order, as the page adds them
        total += float(row[i])
    return [len(kept), sum(kept), total]


def test_reference_cases_are_s04s_answers(exported):
    module, data = exported
    rows = data["rows"]
    for case in data["reference"]:
        row, settings = rows[case["row"]], case["settings"]
        want = recompute(row, settings)
        if "error" in want:
            assert case == {"row": case["row"], "settings": settings, "error": want["error"]}
            continue
        last = [s for s in case["stages"] if s is not None][-1]
        assert last == fingerprint(want["final"]), (row["label"], settings)
        assert case.get("greedy") == want.get("greedy"), settings
        assert case.get("top") == want.get("top"), settings
        # Every stage fingerprint is S04's processor applied to the stage before.
        steps = module.stages(np.array(row["logits"], dtype=np.float32),
                              module.params_for(settings), row["prompt_ids"], row["output_ids"],
                              row["eos_ids"])
        assert case["stages"] == [None if r is None else fingerprint(r) for _, r in steps]


def test_the_grid_holds_the_edge_cases(exported):
    _, data = exported
    cases = data["reference"]
    settings = [c["settings"] for c in cases]
    for edge in ({"temperature": 0.0}, {"top_k": 1}, {"top_p": 0.0}, {"min_p": 1.0},
                 {"min_tokens": 8}, {"repetition_penalty": 1.3}, {"frequency_penalty": 1.0}):
        assert edge in settings, edge
    assert sum("error" in c for c in cases) >= 9
    # min_tokens above max_tokens (16, the default the page uses) is refused, as S04 refuses it.
    assert data["max_tokens"] == s04.SamplingParams().max_tokens
    above = [c for c in cases if c["settings"] == {"min_tokens": data["max_tokens"] + 1}]
    assert above and all(c["error"] == "min_tokens must be an int in [0, max_tokens=16] "
                                       "(got 17)" for c in above)
    # A top_p pair on each side of a float32 edge: the same row keeps one token more above it.
    pairs = 0
    for a, b in zip(cases, cases[1:]):
        sa, sb = a["settings"], b["settings"]
        if list(sa) == list(sb) == ["top_p"] and a["row"] == b["row"] and \
                0 < sb["top_p"] - sa["top_p"] < 1e-12:
            assert b["stages"][-1][0] == a["stages"][-1][0] + 1
            pairs += 1
    assert pairs == (len([r for r in data["rows"] if r["kind"] == "model"]) if HAVE_MODEL else 0)
    # Hand-made rows: top_p at an exact decimal head (0.7 on the five-token row) and ties.
    five = next(i for i, r in enumerate(data["rows"]) if r["label"].startswith("hand-made: p = (0.4"))
    assert any(c["row"] == five and c["settings"] == {"top_p": 0.7} for c in cases)
    ties = next(i for i, r in enumerate(data["rows"]) if "equal logits" in r["label"])
    half = next(c for c in cases if c["row"] == ties and c["settings"] == {"top_p": 0.5})
    assert half["stages"][-1][:2] == [4, 0 + 1 + 2 + 3]     # the lowest ids win a tie


def test_without_a_model_the_export_says_so_and_keeps_the_hand_rows(tmp_path):
    data = exporter(tmp_path / "nothing_here").export()
    assert data["model"]["available"] is False and "data/model" in data["model"]["reason"]
    assert data["rows"] and all(r["kind"] == "hand" for r in data["rows"])
    assert any("error" in c for c in data["reference"])
    json.dumps(data, allow_nan=False)
