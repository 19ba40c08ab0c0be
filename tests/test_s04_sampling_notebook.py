"""The S04 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/, Jupyter's usual working directory. Checks: no cell fails, the plots and the
widget are there, and the numbers it prints agree with values worked out here by hand or in
closed form (the penalty-order example, the min-p / top-p order example), not by the code under
test. The notebook runs on whatever `load_demo_model()` returns (the bundled transformer once it
is trained, S02's bigram model before), so nothing here depends on one model's numbers.
"""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s04_sampling.ipynb"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    copy = tmp_path_factory.mktemp("nb") / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails
    nbformat.write(nb, copy)
    return nb


def _outputs(nb):
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def _text(nb) -> str:
    return "\n".join(out.get("text", "") for out in _outputs(nb) if out.output_type == "stream")


def test_committed_notebook_is_valid_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def test_notebook_imports_the_sampler_and_does_not_redefine_it():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "from s04_sampling import" in source
    for name in ("Engine", "SamplingParams", "process_logits", "draw", "softmax", "apply_top_p",
                 "apply_top_k", "apply_min_p", "apply_temperature", "load_demo_model"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_shows_plots_and_widget(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the six knobs, kept tokens against top_p / min_p, the draws
    assert any(WIDGET_MIME in o.get("data", {}) for o in _outputs(executed))
    m = re.search(r"widget ready: (\d+) tokens kept at top_k 5", _text(executed))
    assert m and int(m.group(1)) >= 5  # ties at the 5th value may keep more, never fewer


@pytest.mark.slow
def test_penalty_order_example_matches_the_closed_form(executed):
    # logits (2, 1, 0), token 0 penalised by 1, temperature 0.5, worked by hand:
    e = math.exp
    no_penalty = e(4) / (e(4) + e(2) + 1)       # (4, 2, 0)
    ours = e(2) / (e(2) + e(2) + 1)             # ((2 - 1) / 0.5, 1 / 0.5, 0) = (2, 2, 0)
    reversed_order = e(3) / (e(3) + e(2) + 1)   # (4 - 1, 2, 0)
    text = _text(executed)
    assert f"no penalty:                      {no_penalty:.4f}" in text
    assert f"penalty then temperature (ours): {ours:.4f}" in text
    assert f"temperature then penalty:        {reversed_order:.4f}" in text


@pytest.mark.slow
def test_min_p_top_p_order_example_matches_the_hand_computation(executed):
    # p = (0.5, 0.3, 0.2), min_p 0.5, top_p 0.6: min-p first keeps {0}; top-p first keeps {0, 1}.
    text = _text(executed)
    assert "kept, min-p then top-p (this chapter, vLLM): {0}" in text
    assert "kept, top-p then min-p (HF generate):        {0, 1}" in text


@pytest.mark.slow
def test_edges_are_finite_and_the_naive_softmax_is_not(executed):
    text = _text(executed)
    assert "all finite: True" in text
    m = re.search(r"naive softmax\(raw / 1e-6\): nan entries = (\d+)", text)
    assert m and int(m.group(1)) > 0
    assert re.search(r"temperature 1e-6\s+tokens with p > 0:  1, max p = 1.0000", text)
    assert re.search(r"all-equal logits, top_p 0.5\s+tokens with p > 0:  4, max p = 0.2500", text)


@pytest.mark.slow
def test_knob_table_and_sampling_checks(executed):
    text = _text(executed)
    vocab = int(re.search(r"V = ([\d,]+);", text).group(1).replace(",", ""))
    # Temperature alone never removes a token; top_k 5 keeps at least 5.
    assert len(re.findall(rf"temperature 1\.0\s+{vocab}\s+1\.000\s", text)) == 2
    assert all(int(k) >= 5 for k in re.findall(r"top_k 5\s+(\d+)", text))
    m = re.search(r"every draw kept: True\nchi-square statistic ([\d.]+) with (\d+) degrees", text)
    assert m, "the sampling check line is missing"
    chi2, dof = float(m.group(1)), int(m.group(2))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)  # far in the tail would mean a broken sampler
    assert "same tokens both times: True | seed 1 differs: True" in text


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)
