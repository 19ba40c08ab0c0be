"""The S08 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/, Jupyter's usual working directory. Checks: no cell fails; it imports the S08
engine and defines none of it; the three plots are there (tokens/s against B, the waste picture,
batch variance) and no legend covers data (tests/legend_check.py); the toy batch's padding,
mask and position ids equal values written here by hand; every batched row equals the request
run alone and HF's batched `generate`; the waste totals equal the closed form worked here from
the printed lengths; the fast mode follows the batch rule. Timings are printed, never asserted.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s08_static_batching.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s08_static_batching import" in source
    for name in ("Engine", "BatchRunner", "BatchKVCache", "BatchStats", "StepWaste", "left_pad",
                 "position_ids_from_mask", "attention_allowed", "batched_attention",
                 "measure_batch_variance", "follows_batch_rule", "format_waste_table"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3                  # tokens/s, waste picture, batch variance
    assert figures_checked(executed) >= 3
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_toy_batch_by_hand(executed):
    text = stream_text(executed)
    # Prompts of 3, 5 and 2 tokens, padded on the left to 5 with pad id 0.
    assert "[[0, 0, 11, 12, 13], [21, 22, 23, 24, 25], [0, 0, 0, 31, 32]]" in text
    assert "[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]" in text
    assert "[[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]" in text
    # Row 2: three padding queries see only themselves; real queries see real keys up to them.
    row2 = [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert str(row2) in text


@pytest.mark.slow
def test_batched_rows_equal_each_request_alone_and_hf(executed):
    text = stream_text(executed)
    assert "each row equals its prompt run alone (S06 engine): True" in text
    rows = re.findall(r"B=\s*(\d+): ours .*? rows equal (\d+)/(\d+)", text)
    assert [int(b) for b, _, _ in rows] == [1, 2, 4, 8, 16, 32]
    assert all(int(eq) == int(b) == int(n) for b, eq, n in rows)


@pytest.mark.slow
def test_waste_totals_equal_the_closed_form_worked_here(executed):
    text = stream_text(executed)
    lengths = ast.literal_eval(re.search(r"prompt lengths: (\[[\d, ]+\])", text).group(1))
    m = re.search(r"([\d,]+) token slots computed: .*?\(([\d,]+) of ([\d,]+) decode row-steps\)",
                  text)
    assert m, "the waste summary line is missing"
    slots, idle, decode = (int(g.replace(",", "")) for g in m.groups())
    batch, t_len = len(lengths), max(lengths)
    steps = decode // batch                                  # decode steps of B rows each
    assert decode == batch * steps
    assert slots == batch * t_len + batch * steps
    total = re.search(r"^total\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)", text, re.MULTILINE)
    useful, padding, idle_slots = (int(g.replace(",", "")) for g in total.groups())
    assert padding == sum(t_len - n for n in lengths)
    assert idle_slots == idle and useful + padding + idle == slots
    assert "the engine's counts equal the closed form: True" in text


@pytest.mark.slow
def test_batch_variance_follows_the_rule(executed):
    text = stream_text(executed)
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)/(\d+)\s+(True|False)$",
                      text, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32]
    for b, steps, diff, gap, flips, equal, n, rule in rows:
        assert int(steps) == 16 * int(b)
        assert rule == "True"
        assert float(diff) < 1e-3                            # far below the tolerance


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in stream_text(probe)
