"""The S08 simulator's exported batches are what the engines do, held against independent oracles.

site/simulators/static-batch/export.py runs a few static batches of corpus prompts through S08's
`Engine` and records each request's tokens step by step and the engine's waste counters, which
the page replays (tests/test_s08_simulator_browser.py). Here:

- every row's generated ids, text and finish reason equal S06's single-request engine run on
  that prompt alone with the same max_tokens (greedy, EOS on): batching changed nothing;
- each token is recorded at the step that made it (token k of a row at step k + 1), and each
  row's prompt ids are the tokenizer's encoding of a corpus prompt;
- the per-step counts and the timeline equal a closed form written out here from the prompt
  and output lengths alone (prefill B x T; then one decode column per row until the longest
  output; a row is useful while it still has tokens to make);
- the default batch is the one `python code/s08_static_batching.py` prints: the same timeline,
  and the chapter figure is scripts/s08_figure.py's drawing of it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s08_static_batching as s08

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")]


@pytest.fixture(scope="module")
def exporter():
    spec = importlib.util.spec_from_file_location(
        "s08_sim_export_data", ROOT / "site" / "simulators" / "static-batch" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


def test_each_row_equals_its_request_run_alone(data):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    single = s06.Engine(model, tokenizer, model.config.max_position_embeddings)
    for batch in data["batches"]:
        for row in batch["rows"]:
            prompt = tokenizer.decode(row["prompt_ids"])
            assert tokenizer.encode(prompt) == row["prompt_ids"]
            alone = single.generate(prompt, s04.SamplingParams(temperature=0.0,
                                                               max_tokens=row["max_tokens"]))
            assert [g[1] for g in row["generated"]] == alone.token_ids
            assert row["text"] == alone.text and row["finish_reason"] == alone.finish_reason
            assert [g[0] for g in row["generated"]] == list(range(1, len(alone.token_ids) + 1))
            assert [g[2] for g in row["generated"]] == [tokenizer.decode([t])
                                                        for t in alone.token_ids]


def test_counts_and_timeline_equal_the_closed_form(data):
    for batch in data["batches"]:
        prompts = [len(r["prompt_ids"]) for r in batch["rows"]]
        outputs = [len(r["generated"]) for r in batch["rows"]]
        b, t_len, longest = len(prompts), max(prompts), max(outputs)
        assert [r["padding"] for r in batch["rows"]] == [t_len - p for p in prompts]
        expected = [dict(kind="prefill", rows=b, columns=t_len, useful=sum(prompts),
                         padding=sum(t_len - p for p in prompts), idle=0, masked_keys=0)]
        for s in range(2, longest + 1):
            busy = sum(n >= s for n in outputs)
            expected.append(dict(kind="decode", rows=b, columns=1, useful=busy, padding=0,
                                 idle=b - busy, masked_keys=sum(t_len - p for p in prompts)))
        assert batch["steps"] == expected
        assert batch["timeline"] == [
            "." * (t_len - p) + "P" * p + "G" * (n - 1) + "-" * (longest - n)
            for p, n in zip(prompts, outputs)]
        idle = sum(longest - n for n in outputs)
        assert batch["totals"] == dict(
            slots=b * t_len + b * (longest - 1), useful=sum(prompts) + sum(n - 1 for n in outputs),
            padding=sum(t_len - p for p in prompts), idle=idle, idle_row_steps=idle,
            decode_row_steps=b * (longest - 1))


def test_the_default_batch_is_the_scripts(data):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        s08.main(["--device", "cpu"])
    printed = out.getvalue().split("still computed):\n", 1)[1].splitlines()
    timeline = [line.split()[1] for line in printed if line.strip()]
    assert timeline == data["batches"][0]["timeline"]
    assert data["batches"][0]["id"] == "default"


def test_the_chapter_figure_is_what_the_s08_code_draws():
    """chapters/figures/s08-static-batch.svg is scripts/s08_figure.py's drawing of the same
    default batch (rerun the script after changing the engine or the model)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "s08_figure.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
