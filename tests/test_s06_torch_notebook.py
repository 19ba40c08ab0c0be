"""The S06 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/, Jupyter's usual working directory. Checks: no cell fails; the plots are there
(the step split of the bundled model, its operations, and the split of both benchmark models);
the torch engine's greedy tokens equal the S05 NumPy engine's; the bytes that would cross to the
host per step, worked out here by hand from the vocabulary sizes; and the committed benchmark
figures it prints, recomputed here from results/s06_torch_cpu.json. Timings are printed by the
notebook but never asserted.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import assert_committed_without_outputs, code_source, execute, outputs as _outputs, stream_text as _text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s06_torch.ipynb"
RESULTS = ROOT / "results" / "s06_torch_cpu.json"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s06_torch import" in source
    for name in ("Engine", "TorchTransformer", "CachedTransformer", "KVCache", "StepTimes",
                 "DeviceSampler", "attention", "draw", "resolve_device_dtype", "load"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


def test_committed_results_have_both_models_and_engines():
    results = json.loads(RESULTS.read_text())
    assert len(results["models"]) == 2
    assert "Qwen3-0.6B shape" in results["models"][1]["model"]
    for entry in results["models"]:
        assert set(entry["engines"]) == {"ours (S06)", "HF generate()"}
        assert entry["greedy_agreement"].startswith("all ")


@pytest.mark.slow
def test_notebook_runs_headless_and_shows_its_plots(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # live step split, operations per step, both benchmark models


@pytest.mark.slow
def test_same_tokens_as_numpy_and_bytes_by_hand(executed):
    text = _text(executed)
    assert re.search(r"40 tokens; same greedy tokens as the S05 NumPy engine: True", text)
    vocab = int(re.search(r"V=(\d+);", text).group(1))
    # One int64 id is 8 bytes; a float32 row of logits is 4 V bytes: 4 * 151,936 = 607,744.
    assert f"token id 8 bytes per step; float32 logits row {4 * vocab:,} bytes" in text
    assert "Qwen3-0.6B: token id 8 bytes per step; float32 logits row 607,744 bytes" in text
    m = re.search(r"greedy tokens agree for the first (\d+) of 40", text)
    assert m
    if "NOT the bundled model" not in text:   # random weights have near-ties everywhere
        assert int(m.group(1)) >= 4           # the bfloat16 prefix the S06 tests state


@pytest.mark.slow
def test_printed_benchmark_figures_are_the_committed_ones(executed):
    text = _text(executed)
    results = json.loads(RESULTS.read_text())
    for entry in results["models"]:
        ours, hf = entry["engines"]["ours (S06)"], entry["engines"]["HF generate()"]
        wall = ours["tokens_per_s"] / hf["tokens_per_s"]
        cpu = hf["cpu_ms_per_token"] / ours["cpu_ms_per_token"]
        assert (f"ours {ours['tokens_per_s']:.1f} tokens/s, HF {hf['tokens_per_s']:.1f} tokens/s: "
                f"ratio {wall:.2f}x by wall time, {cpu:.2f}x by CPU time") in text
    # bfloat16 floor of Qwen3-0.6B's weights, 596,049,920 x 2 bytes at 1e12 B/s = 1.192 ms.
    assert "bfloat16 weights at 1 TB/s: floor 1.192 ms per step" in text


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)
