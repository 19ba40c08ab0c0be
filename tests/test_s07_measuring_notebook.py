"""The S07 notebook runs top to bottom headless, and the chapter's quoted figures are the
committed run's.

The notebook is executed with nbclient on a temporary copy (the notebook in the repository is
never written), from notebooks/ as Jupyter would. Checks: no cell fails, the five plots are
there, the live harness gives S05 and S06 the same tokens, the percentile example prints the
values worked out by hand, the printed floor ratios are the JSON's, and the batch trade-off
saturates at peak FLOP/s over the FLOPs of one token counted by hand. The chapter's numbers
(tables, roofs, floor factors, batch trade-off) are checked against results/s07_engines.json
read here directly, and against closed forms worked out by hand from Qwen3-0.6B's config.
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
NOTEBOOK = ROOT / "notebooks" / "s07_measuring.ipynb"
CHAPTER = ROOT / "chapters" / "s07-measuring.md"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RESULTS = json.loads((ROOT / "results" / "s07_engines.json").read_text())
RUN2 = json.loads((ROOT / "results" / "s07_engines_run2.json").read_text())

# Qwen3-0.6B by hand (see tests/exercises/test_ex_s07_measuring.py for the derivation): FLOPs
# of one token at context S, values read once per step, values each request adds at context S.
QWEN_FLOPS = lambda s: 1_191_968_768 + 229_376 * s          # noqa: E731
QWEN_SHARED_VALUES = 596_049_920
QWEN_PER_REQUEST_VALUES = lambda s: 1_024 + 57_344 * s      # noqa: E731


def run_of(model: str, engine: str, workload: str, results: dict = RESULTS) -> dict:
    (run,) = [r for r in results["runs"]
              if (r["model"], r["engine"], r["workload"]) == (model, engine, workload)]
    return run["summary"]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_harness_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s07_measuring import" in source
    for name in ("run_benchmark", "Distribution", "StreamClient", "TimedRequest",
                 "stamp_stream", "make_workload", "measure_peaks", "decode_step_cost",
                 "prefill_cost", "MachinePeaks", "Engine"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name
    assert "bench_s07_engines" not in source.replace("bench_s07_engines.py`", "")  # never reruns it


@pytest.mark.slow
def test_notebook_runs_headless_and_shows_its_plots(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # rooflines, ITL CDFs, TTFT, floor ratios, batch trade-off
    assert any(WIDGET_MIME in o.get("data", {}) for o in _outputs(executed))
    pairs = {(r["model"], r["workload"]) for r in RESULTS["runs"]}
    assert f"widget ready: {len(pairs)} model/workload pairs" in _text(executed)


@pytest.mark.slow
def test_live_run_and_percentile_example(executed):
    text = _text(executed)
    assert "S05 and S06 tokens equal: True" in text
    # 99 gaps of 10 ms and one of 1,000 ms. Mean (990 + 1000) / 100 = 19.9 ms. Linear
    # percentiles at fractional index p/100 * 99: p50 -> 49.5 and p90 -> 89.1 (both between
    # two 10 ms values: 10 ms); p99 -> 98.01, 10 + 0.01 * 990 = 19.9 ms.
    assert "mean 19.90 ms   p50 10.00 ms   p90 10.00 ms   p99 19.90 ms" in text


@pytest.mark.slow
def test_notebook_prints_the_committed_floor_ratios(executed):
    text = _text(executed)
    for run in RESULTS["runs"]:
        if run["model"] == "qwen3-0.6b" and run["workload"] == "chat-short":
            ratio = run["summary"]["decode_vs_floor"]
            assert re.search(rf"{re.escape(run['engine'])}\s+ITL p50\s+[\d.]+ ms =\s+{ratio:5.2f}x",
                             text), run["engine"]


@pytest.mark.slow
def test_notebook_prints_both_runs_side_by_side(executed):
    text = _text(executed)
    for run in RESULTS["runs"]:
        if run["model"] == "qwen3-0.6b" and run["workload"] == "chat-short":
            other = run_of("qwen3-0.6b", run["engine"], "chat-short", RUN2)
            assert re.search(rf"{re.escape(run['engine'])}\s+[\d.]+ ms\s+{run['summary']['decode_vs_floor']:.2f}x"
                             rf"\s+[\d.]+ ms\s+{other['decode_vs_floor']:.2f}x", text), run["engine"]


@pytest.mark.slow
def test_batch_trade_off_saturates_at_the_compute_roof(executed):
    peak = RESULTS["roofline"]["matmul_flops_per_s"]
    ceiling = peak / QWEN_FLOPS(512)              # tokens/s once every step is compute-bound
    assert "B=1024: step" in _text(executed)
    line = re.search(r"B=1024: step\s+[\d.]+ ms,\s+([\d.]+) tokens/s", _text(executed))
    assert float(line.group(1)) == pytest.approx(ceiling, abs=0.05)


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)


# The chapter's numbers ----------------------------------------------------------------------

def _row(chapter: str, label: str) -> list[str]:
    line = next(l for l in chapter.splitlines() if l.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def test_chapter_tables_are_the_committed_run():
    chapter = CHAPTER.read_text()
    engines = {"S01 loop (no cache)": "S01 loop (no cache)",
               "S05 NumPy + cache": "S05 NumPy + cache",
               "S06 torch (manual attention)": "S06 torch (manual)",
               "S06 torch (sdpa)": "S06 torch (sdpa)",
               "S06 torch (sdpa, 1 thread)": "S06 torch (sdpa, 1 thread)",
               "HF `generate()`": "HF generate()",
               "HF `generate()` (1 thread)": "HF generate() (1 thread)"}
    bundled_table, qwen_table = chapter.split("| Engine | TTFT p50 (long)")
    for label, engine in engines.items():
        s = run_of("bundled", engine, "chat-short")
        # No ITL / floor for the bundled model: its weights fit in the L3 cache, so the DRAM
        # bandwidth floor is the wrong yardstick (the Qwen3-0.6B shape keeps the column).
        assert _row(bundled_table, label) == [
            ms(s["ttft_s"]["p50"]), ms(s["itl_s"]["p50"]), ms(s["itl_s"]["p99"]),
            f"{s['output_tokens_per_s']:.1f}"], label
        s = run_of("qwen3-0.6b", engine, "chat-short")
        ttft_long = "-" if engine.startswith("S01") else ms(
            run_of("qwen3-0.6b", engine, "long")["ttft_s"]["p50"])
        assert _row("| Engine | TTFT p50 (long)" + qwen_table, label) == [
            ttft_long, ms(s["itl_s"]["p50"]), f"{s['output_tokens_per_s']:.1f}",
            f"{s['decode_vs_floor']:.2f}x"], label


def test_chapter_roofs_floor_and_factors_are_the_committed_run():
    text = " ".join(CHAPTER.read_text().split())
    roof, meas, machine = RESULTS["roofline"], RESULTS["roofline_measurements"], RESULTS["machine"]
    gbs = lambda x: f"{x / 1e9:.1f} GB/s"                       # noqa: E731
    assert f"{gbs(roof['bandwidth_bytes_per_s'])} and {roof['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s" in text
    assert f"ridge of the course's CPU, from the same run, is {roof['ridge_intensity_flop_per_byte']:.2f} FLOP/byte" in text
    assert f"copy ran at {gbs(meas['after, 2 thread(s)']['bandwidth_bytes_per_s'])} (2 threads) and " \
           f"{gbs(meas['after, 1 thread(s)']['bandwidth_bytes_per_s'])} (1 thread)" in text
    assert (f"load average {machine['load_average_1min']:.2f} at the start, "
            f"{RESULTS['load_average_1min_after']:.2f} at the end") in text
    best = run_of("qwen3-0.6b", "S06 torch (sdpa, 1 thread)", "chat-short")
    step_bytes = best["decode_floor_s"] * roof["bandwidth_bytes_per_s"]
    assert f"**{best['decode_vs_floor']:.2f} times the bandwidth floor** of {ms(best['decode_floor_s'])} ms" in text
    assert f"The step moved {step_bytes / 1e9:.2f} GB in {ms(best['itl_s']['p50'])} ms, " \
           f"{step_bytes / best['itl_s']['p50'] / 1e9:.1f} GB/s" in text
    after = [best["itl_s"]["p50"] / (step_bytes / meas[k]["bandwidth_bytes_per_s"])
             for k in ("after, 2 thread(s)", "after, 1 thread(s)")]
    assert f"the same step is {after[0]:.2f} and {after[1]:.2f} times its floor" in text
    # The decode step's bytes at its median context, counted by hand.
    s = best["decode_context_len"]
    assert step_bytes == pytest.approx((QWEN_SHARED_VALUES + QWEN_PER_REQUEST_VALUES(s)) * 4, rel=1e-12)
    assert f"{(QWEN_SHARED_VALUES + QWEN_PER_REQUEST_VALUES(s)) * 4:,} bytes" in text


def test_chapter_batch_trade_off_follows_from_the_roofs():
    text = " ".join(CHAPTER.read_text().split())
    bw, peak = (RESULTS["roofline"][k] for k in ("bandwidth_bytes_per_s", "matmul_flops_per_s"))
    s = 512

    def step_s(b: int) -> float:
        return max((QWEN_SHARED_VALUES + b * QWEN_PER_REQUEST_VALUES(s)) * 4 / bw,
                   b * QWEN_FLOPS(s) / peak)

    for b in (1, 8, 64):
        assert f"{step_s(b) * 1e3:.1f} ms for {b / step_s(b):.1f} tokens/s at $B = {b}$" in text
    # First B whose FLOPs time reaches its bytes time: B f / peak >= (W + B k) / bw.
    ridge_b = next(b for b in range(1, 10_000)
                   if b * QWEN_FLOPS(s) / peak >= (QWEN_SHARED_VALUES + b * QWEN_PER_REQUEST_VALUES(s)) * 4 / bw)
    assert f"the ridge is crossed from $B = {ridge_b}$" in text
    assert f"{QWEN_FLOPS(s):,}" in text.replace("{,}", ",")


def test_chapter_prose_figures_are_the_committed_run():
    text = " ".join(CHAPTER.read_text().split())
    models = RESULTS["models"]

    def point(model: str, prefix: str) -> dict:
        return next(p for p in models[model]["roofline_points"] if p["label"].startswith(prefix))

    b_dec, b_pre = point("bundled", "S05 NumPy + cache decode"), point("bundled", "S05 NumPy + cache prefill")
    q_dec, q_pre = point("qwen3-0.6b", "S05 NumPy + cache decode"), point("qwen3-0.6b", "S05 NumPy + cache prefill")
    assert (f"a decode step of the bundled model at context 28 does {b_dec['intensity']:.2f} FLOP/byte, "
            f"a prefill of 169 tokens {b_pre['intensity']:.1f}; for the Qwen3-0.6B shape, "
            f"{q_dec['intensity']:.2f} and {q_pre['intensity']:.1f} at 183 tokens") in text
    sdpa2 = point("qwen3-0.6b", "S06 torch (sdpa) prefill")
    peak = RESULTS["roofline"]["matmul_flops_per_s"]
    assert (f"{sdpa2['flops']:,} FLOPs at {sdpa2['intensity']:.1f} FLOP/byte, far right of the ridge: "
            f"S06 with SDPA did it in {sdpa2['measured_s'] * 1e3:,.1f} ms, "
            f"{sdpa2['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s, "
            f"{sdpa2['achieved_flops_per_s'] / peak:.0%}".replace("%", " %")) in text
    sdpa1 = point("qwen3-0.6b", "S06 torch (sdpa, 1 thread) prefill")
    assert (f"S06 with SDPA took {sdpa2['measured_s'] * 1e3:,.1f} ms at two threads, "
            f"{sdpa1['measured_s'] * 1e3:,.1f} ms at one") in text
    best_decode = point("qwen3-0.6b", "S06 torch (sdpa, 1 thread) decode")
    floor_flops = best_decode["flops"] / run_of("qwen3-0.6b", "S06 torch (sdpa, 1 thread)",
                                               "chat-short")["decode_floor_s"]
    assert (f"The step ran at {best_decode['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s; running at "
            f"its floor would take {floor_flops / 1e9:.1f} GFLOP/s") in text
    # Two threads against one on the bundled model's chat-short, ITL p50.
    itl = lambda e: run_of("bundled", e, "chat-short")["itl_s"]["p50"]   # noqa: E731
    assert (f"a factor of {itl('S06 torch (sdpa)') / itl('S06 torch (sdpa, 1 thread)'):.1f} in ITL p50 "
            f"for our engine and {itl('HF generate()') / itl('HF generate() (1 thread)'):.1f}") in text
    assert f"{models['bundled']['weights_bytes_float32'] / 1e6:.1f} MB of weights" in text
    assert "The table has no ITL / floor column, on purpose." in text
    prof = RESULTS["s06_decode_profile"]["qwen3-0.6b"]
    manual, sdpa = prof["manual"], prof["sdpa"]
    shares = {o["op"]: o["share"] for o in manual["top_ops"]}
    assert (f"{manual['wall_s_per_step_profiled'] * 1e3:,.0f} ms per hand-written step, "
            f"{shares['aten::copy_']:.0%} of the CPU time in `aten::copy_` and "
            f"{shares['aten::bmm']:.0%} in `aten::bmm`, and {sdpa['wall_s_per_step_profiled'] * 1e3:.0f} ms "
            f"per SDPA step, {sdpa['attention_share_of_self_cpu']:.0%} of it").replace("%", " %") in text
    assert (f"in the run itself the same SDPA engine's ITL p50 was "
            f"{ms(run_of('qwen3-0.6b', 'S06 torch (sdpa)', 'chat-short')['itl_s']['p50'])} ms") in text
    calls = prof["attention_call_s"]
    assert (f"{calls['manual, 2 thread(s)'] * 1e6:.0f} µs (hand-written) or "
            f"{calls['sdpa, 2 thread(s)'] * 1e6:.0f} µs (SDPA) at two threads") in text
    assert all(v == "equal" for m in RESULTS["greedy_agreement_vs_s05"].values() for v in m.values())


def test_chapter_second_run_paragraph_is_run2():
    text = " ".join(CHAPTER.read_text().split())
    roof2, roof1 = RUN2["roofline"], RESULTS["roofline"]
    assert (f"at a lower load ({RUN2['machine']['load_average_1min']:.1f} at the start, "
            f"{RUN2['load_average_1min_after']:.1f} at the end)") in text
    assert (f"came out at {roof2['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s and "
            f"{roof2['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, the matmul roof at "
            f"{roof2['matmul_flops_per_s'] / roof1['matmul_flops_per_s']:.0%}".replace("%", " %")) in text
    s05 = run_of("qwen3-0.6b", "S05 NumPy + cache", "chat-short", RUN2)
    s06 = run_of("qwen3-0.6b", "S06 torch (sdpa, 1 thread)", "chat-short", RUN2)
    hf = run_of("qwen3-0.6b", "HF generate() (1 thread)", "chat-short", RUN2)
    step_bytes = s05["decode_floor_s"] * roof2["bandwidth_bytes_per_s"]
    assert (f"the S05 NumPy step took {ms(s05['itl_s']['p50'])} ms, {s05['decode_vs_floor']:.2f} times "
            f"its floor, moving the weights at {step_bytes / s05['itl_s']['p50'] / 1e9:.1f} GB/s") in text
    assert (f"S06 with SDPA at one thread took {ms(s06['itl_s']['p50'])} ms ({s06['decode_vs_floor']:.2f} "
            f"times) and `generate()` at one thread {ms(hf['itl_s']['p50'])} ms "
            f"({hf['decode_vs_floor']:.2f} times)") in text
    one = {e: run_of("qwen3-0.6b", e, "chat-short") for e in ("S05 NumPy + cache", "S06 torch (sdpa, 1 thread)")}
    assert (f"In this run the S05 step took {ms(one['S05 NumPy + cache']['itl_s']['p50'])} ms and S06's "
            f"{ms(one['S06 torch (sdpa, 1 thread)']['itl_s']['p50'])} ms") in text
    prof = RUN2["s06_decode_profile"]["qwen3-0.6b"]["sdpa"]
    assert f"weight matmuls at {prof['matmul_weight_bytes_per_s'] / 1e9:.1f} GB/s" in text
    assert f"With {s05['itl_s']['count']} gaps per row" in text
    best1 = min(r["summary"]["decode_vs_floor"] for r in RESULTS["runs"]
                if r["model"] == "qwen3-0.6b" and r["workload"] == "chat-short")
    best2 = min(r["summary"]["decode_vs_floor"] for r in RUN2["runs"]
                if r["model"] == "qwen3-0.6b" and r["workload"] == "chat-short")
    assert f"came within {best2:.2f} to {best1:.2f} times bytes over bandwidth" in text
