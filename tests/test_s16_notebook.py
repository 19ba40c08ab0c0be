"""The S16 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it runs the chapter's pieces (`StepProfiler`,
`summarize`, `per_op_overhead_s`, `overhead_estimate`, `profile_step`, `make_static`,
`AsyncLLMEngine`) and defines none of them, and it never compiles (the compiled figures come
from the benchmark record); its plots are there and no legend covers data
(tests/legend_check.py); and its printed numbers keep their arithmetic (times are printed,
never asserted):

- host against model time at B = 1, 4, 16, 64: every phase positive, host below the step,
  the per-token column the step over B;
- the worked example: ops x the tiny op's time is the printed estimate, the ratio to the
  measured model call and the measured cost per op follow from the printed figures, and the
  model call dispatches fewer ops than the whole step;
- the static step's bucket is `pick_bucket(bucket_sizes(B), B)` and its ratio the printed
  forwards'; the record: its compile speedups printed as the file has them, or the notebook
  says the file is absent; the cell's reader, run here on a record shaped as
  benchmarks/bench_s16_host.py writes it, returns its ratios (so the record branch is checked
  before the record exists);
- async scheduling gives the same tokens and text as the synchronous loop (the notebook
  asserts it and prints so), and both timelines are drawn from the profiler's segments.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

import nbformat  # noqa: E402
from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

import s16_static  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s16_host.ipynb"
RECORD = ROOT / "chapters" / "figures" / "s16_host.json"
NUM = r"([-\d.]+)"

pytestmark = pytest.mark.skipif(not (ROOT / "data" / "model" / "model.safetensors").is_file(),
                                reason="data/model has no bundled model")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=300)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_uses_the_chapter_and_does_not_redefine_or_compile_it():
    source = code_source(NOTEBOOK)
    for line in ("import s16_profile as p16", "import s16_static", "import s16_async",
                 "import s13_prefix_caching as s13"):
        assert line in source, line
    for call in ("p16.StepProfiler(", "p16.summarize(", "p16.per_op_overhead_s(",
                 "p16.overhead_estimate(", "p16.profile_step(", "s16_static.make_static(",
                 "s16_async.AsyncLLMEngine(", "s16_static.pick_bucket("):
        assert call in source, call
    for name in ("StepProfiler", "StepProfile", "OpCounter", "profile_step", "summarize",
                 "per_op_overhead_s", "overhead_estimate", "make_static", "StaticDecodeRunner",
                 "AsyncLLMEngine", "AsyncScheduler", "bucket_sizes", "pick_bucket",
                 "build_engine"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert "torch.compile" not in source and "compile=True" not in source


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3
    assert figures_checked(executed) >= 3
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_host_against_model_time_by_batch_size(executed):
    text = stream_text(executed)
    rows = re.findall(r"^\s*(\d+)" + rf"\s+{NUM}" * 10 + r" ms$", text, re.M)
    assert [int(r[0]) for r in rows] == [1, 4, 16, 64], text[:2000]
    for b, step, forward, *phases, host, share, per_token in rows:
        b, step, forward, host = int(b), float(step), float(forward), float(host)
        assert all(float(p) > 0 for p in phases) and 0 < forward < step
        assert 0 < host < step and 0 < float(share) < 100
        assert float(per_token) == pytest.approx(step / b, abs=2e-3)


@pytest.mark.slow
def test_the_worked_example_is_ops_times_the_tiny_op(executed):
    text = stream_text(executed)
    tiny = float(re.search(rf"one tiny op \(1-element add\): {NUM} µs", text).group(1))
    lines = re.findall(rf"B = (\d+): (\d+) ops in the step, (\d+) in the model call; x {NUM} µs "
                       rf"= {NUM} ms, {NUM} of the measured model call \({NUM} ms\); measured "
                       rf"per op {NUM} µs, {NUM}x the tiny op", text)
    assert [int(m[0]) for m in lines] == [1, 64], text[-4000:]
    for b, ops, model_ops, per_op, estimate, ratio, measured, cost, times in lines:
        ops, model_ops = int(ops), int(model_ops)
        assert 100 < model_ops < ops
        assert float(per_op) == tiny
        assert float(estimate) == pytest.approx(model_ops * tiny / 1e3, rel=0.01, abs=2e-3)
        assert float(ratio) == pytest.approx(float(estimate) / float(measured), abs=0.01)
        assert float(cost) == pytest.approx(float(measured) * 1e3 / model_ops, rel=0.01)
        assert float(times) == pytest.approx(float(cost) / tiny, rel=0.02, abs=0.1)


@pytest.mark.slow
def test_the_static_step_and_the_record(executed):
    text = stream_text(executed)
    rows = re.findall(rf"^\s*(\d+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}$", text, re.M)
    assert [int(r[0]) for r in rows] == [1, 4, 16, 64], text[-4000:]
    for b, bucket, eager, static, ratio in rows:
        assert int(bucket) == s16_static.pick_bucket(s16_static.bucket_sizes(int(b)), int(b))
        assert float(ratio) == pytest.approx(float(static) / float(eager), abs=0.01)
    if RECORD.is_file():
        record = json.loads(RECORD.read_text())
        if "benchmark record chapters/figures/s16_host.json: compile speedups" in text:
            for context, models in record["compiled"].items():
                if context not in ("short", "long"):
                    continue
                for by_batch in models.values():
                    for b, row in by_batch.items():
                        assert f"B = {b}: {row['ratio']:.2f}x" in text
        else:
            assert "has no compile rows this notebook can read" in text
    else:
        assert "chapters/figures/s16_host.json is absent: the plot shows the static step" in text


def test_the_record_reader_reads_the_benchmarks_shape():
    """The notebook's compile_rows, taken from its cell, on a record shaped as
    benchmarks/bench_s16_host.py's section B writes it."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code"
                and "def compile_rows(" in c.source)
    tree = ast.parse(cell)
    function = next(n for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == "compile_rows")
    namespace: dict = {}
    exec(compile(ast.Module([function], []), str(NOTEBOOK), "exec"), namespace)
    record = {"host": {"models": {"bundled": {"name": "the bundled model"},
                                  "mid": {"name": "the random 100.0M model"}}},
              "compiled": {"target": 1.5,
                           "short": {"bundled": {"8": {"ratio": 1.7}, "1": {"ratio": 2.2}},
                                     "mid": {"1": {"ratio": 1.05}}},
                           "long": {"bundled": {"1": {"ratio": 2.7}}},
                           "bandwidth": {"bundled": {"1": {"bytes_per_step": 5}}}}}
    assert namespace["compile_rows"](record) == {
        "the bundled model, short contexts": [(1, 2.2), (8, 1.7)],
        "the random 100.0M model, short contexts": [(1, 1.05)],
        "the bundled model, long contexts": [(1, 2.7)]}
    assert namespace["compile_rows"]({"config": {}}) == {}


@pytest.mark.slow
def test_the_async_overlap(executed):
    text = stream_text(executed)
    assert "async outputs identical to sync (tokens and text): True" in text
    periods = {name: float(ms) for name, ms in re.findall(
        rf"^\s*(sync|async): a decode step every {NUM} ms \(median\)", text, re.M)}
    assert set(periods) == {"sync", "async"} and all(v > 0 for v in periods.values())
    assert re.search(rf"host work async could hide under the forward .*: {NUM} ms per step",
                     text)
    assert "drawn: 4 sync steps and 4 async steps, from the profiler's segments" in text
