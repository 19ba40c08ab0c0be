"""The S01 notebook runs top to bottom headless and shows what it promises.

It is executed with nbclient on a temporary copy (the notebook in the repository is never
written), with Jupyter's usual working directory, notebooks/, from which its first cell finds
code/. The checks: no cell fails (the notebook has its own asserts, e.g. that the replayed passes
match `Stats`), the plots and the widget are there, and the numbers it prints agree with values
worked out here by closed form, not by the code under test.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import assert_committed_without_outputs, code_source, WIDGET_MIME, execute, outputs as _outputs, stream_text as _text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s01_generation_loop.ipynb"


def sum_sq(m: int) -> int:
    return m * (m + 1) * (2 * m + 1) // 6


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engine_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s01_generation_loop import" in source
    for name in ("Engine", "Stats", "WordTokenizer", "BigramModel", "sample", "build_default"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_with_no_errors(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]


@pytest.mark.slow
def test_notebook_shows_its_plots_and_widget(executed):
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # counted work, measured time, temperature
    assert any(WIDGET_MIME in o.get("data", {}) for o in _outputs(executed))
    assert re.search(r"widget ready: \d+ passes recorded, showing pass 2", _text(executed))


@pytest.mark.slow
def test_notebook_prints_the_closed_form_totals_of_its_long_run(executed):
    # Greedy from the 10-token prompt for 500 passes: contexts 10, 11, ..., 509.
    p, k = 10, 500
    uncached = sum_sq(p + k - 1) - sum_sq(p - 1)
    cached = k * (2 * p + k - 1) // 2
    assert (uncached, cached) == (44_086_750, 129_750)  # worked by hand as a check on the formula
    text = _text(executed)
    assert f"total over {k} passes: {uncached:,} token pairs without a cache, {cached:,} with one" in text
    assert "row 4 == row 9: True" in text  # a bigram row depends on one token only


@pytest.mark.slow
def test_notebook_accounts_for_every_greedy_start_token(executed):
    # Every ordinary token (V = 4096 minus <eos> and <unk>) either reaches EOS or enters a cycle.
    m = re.search(r"greedy paths from ([\d,]+) start tokens: (\d+) reach <eos>, ([\d,]+) fall into a cycle",
                  _text(executed))
    assert m, "the greedy-cycle census line is missing"
    starts, eos, cyc = (int(g.replace(",", "")) for g in m.groups())
    assert starts == 4096 - 2 and eos + cyc == starts


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    # Jupyter started at the repository root (not in notebooks/) must work as well.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)
