"""The S09 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it imports the S08 engine and builds S09's with its
`build_engine` (driven by its own calls and by `LLM`), reads its steps from S09's tracer (never
an `engine.trace`), and defines none of their code; both plots are there (the Gantt chart,
throughput against the tail) and no legend covers data (tests/legend_check.py); both engines
made the same tokens; the static step count equals the closed form worked here (each batch of
4 runs its longest request's steps) and the continuous one lies between its lower bounds and
the static count; every slot is free at the end; the tail sweep printed one line per tail
length. Timings are printed, never asserted.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s09_continuous_batching.ipynb"
LENGTHS = [40, 6, 9, 4, 12, 5, 8, 7, 10, 4, 6, 11]     # the notebook's requests, written here


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_engines_and_does_not_redefine_them():
    source = code_source(NOTEBOOK)
    assert "from s09_continuous_batching import build_engine" in source
    assert "from s09_llm import LLM" in source
    assert "from s09_trace import format_occupancy_table, trace" in source
    assert ".trace" not in source
    for name in ("LLMEngine", "Engine", "RaggedBatch", "RaggedRunner", "SlotKVCache",
                 "StepRecord", "format_occupancy_table"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert f"LENGTHS = {LENGTHS}" in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert figures_checked(executed) >= 2
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_step_counts_against_closed_forms(executed):
    text = stream_text(executed)
    assert "same tokens in both engines: True" in text
    assert "every slot free at the end: True" in text
    m = 4
    static = sum(max(LENGTHS[lo:lo + m]) for lo in range(0, len(LENGTHS), m))
    assert f"static steps: {static} " in text
    cont = int(re.search(r"continuous steps: (\d+);", text).group(1))
    assert max(max(LENGTHS), -(-sum(LENGTHS) // m)) <= cont <= static


@pytest.mark.slow
def test_the_tail_sweep_measured_every_length(executed):
    rows = re.findall(r"^tail\s+(\d+): static\s+\d+ tok/s, continuous\s+\d+ tok/s",
                      stream_text(executed), re.MULTILINE)
    assert [int(t) for t in rows] == [8, 32, 64, 128]
