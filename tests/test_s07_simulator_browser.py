"""The S07 "Try it" calculator in a real browser: the page's numbers are the course's Python's.

A minimal page loads site/static/course.js, the simulator's script and the data exported by
site/simulators/roofline-calculator/export.py (the exporter the site runs; its data is checked
against code/s07_roofline.py, S03's counts and the committed results in
tests/test_s07_simulator_data.py). Playwright drives Debian's Chromium. The oracle is Python:
every value the page computes for the exported grid, and every value it shows after the controls
are set (each step, the batch sweep, the ridge batch), is compared with code/s07_roofline.py's
answer to relative 1e-9; bad input is refused; no console errors. Skipped when Playwright or
Chromium is missing.
"""
from __future__ import annotations


import pytest
from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

REL = 1e-9
STEP_KEYS = ("flops", "bytes", "intensity", "bytes_s", "flops_s", "floor_s", "tokens_per_s")


@pytest.fixture(scope="module")
def exporter():
    module = load_exporter("roofline-calculator", "s07_sim_export_browser")
    return module


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("sim_page"), "roofline-calculator", data,
                      css=False)
    with open_page(html, ".rl-results [data-key='floor_s']", "s07-chromium-") as pg:
        yield pg


def close(got, want) -> bool:
    if isinstance(want, str) or want is None:
        return got == want
    return abs(got - want) <= REL * abs(want)


def python_answer(exporter, config: str, machine: str, dtype: str, context: int, batches):
    (m,) = [c for c in exporter.configs() if c["id"] == config]
    (roofs,) = [r for r in exporter.machines() if r["id"] == machine]
    p = exporter.peaks(roofs, dtype)
    cfg, b = m["config"], exporter.DTYPES[dtype]
    return {"ridge": p.ridge_intensity,
            "ridge_batch": exporter.compute_bound_batch(cfg, context, b, p),
            "limit_intensity": exporter.limit_intensity(cfg, context, b),
            "steps": [exporter.step(cfg, B, context, dtype, p) for B in batches]}


def set_controls(pg, config, machine, dtype, context, batch):
    pg.select_option("select.rl-config", config)
    pg.select_option("select.rl-machine", machine)
    pg.select_option("select.rl-dtype", dtype)
    pg.fill("input.rl-context", str(context))
    pg.fill("input.rl-batch", str(batch))


def shown(pg) -> dict:
    out = {}
    for node in pg.locator(".rl-results [data-key]").all():
        value = node.get_attribute("data-value")
        out[node.get_attribute("data-key")] = (None if value == "null" else
                                               value if value in ("compute", "bandwidth")
                                               else float(value))
    return out


def test_page_loads_and_its_self_check_covers_the_grid(page, data):
    check = page.evaluate("document.querySelector('.course-sim').rlSim.check")
    assert check["bad"] == []
    per_setting = 3 + sum(len(s) for s in data["reference"][0]["steps"])
    assert check["checked"] == len(data["reference"]) * per_setting
    assert "reproduces all" in page.locator(".rl-check").inner_text()
    assert page.problems == []


def test_every_grid_setting_equals_python(page, data, exporter):
    for ref in data["reference"]:
        batches = [s["batch"] for s in ref["steps"]]
        got = page.evaluate(
            "s => document.querySelector('.course-sim').rlSim.compute(s)",
            {k: ref[k] for k in ("config", "machine", "dtype", "context")} | {"batches": batches})
        want = python_answer(exporter, ref["config"], ref["machine"], ref["dtype"],
                             ref["context"], batches)
        for key in ("ridge", "ridge_batch", "limit_intensity"):
            assert close(got[key], want[key]), (ref["config"], ref["machine"], key)
        for g, w in zip(got["steps"], want["steps"]):
            for key in STEP_KEYS + ("bound",):
                assert close(g[key], w[key]), (ref["config"], ref["machine"], g["batch"], key)
    assert page.problems == []


@pytest.mark.parametrize("config, machine, dtype, context, batch", [
    ("qwen3-0.6b", "cpu-run1", "float32", 512, 1),       # the chapter's 60.9 ms
    ("qwen3-0.6b", "cpu-run1", "float32", 512, 15),      # the chapter's ridge on this CPU
    ("qwen3-0.6b", "h100-sxm", "bfloat16", 1, 304),      # exercise 2's boundary
    ("qwen3-0.6b", "h100-sxm", "bfloat16", 512, 1024),   # never compute-bound
    ("llama-3-8b", "h200-sxm", "bfloat16", 8192, 37),    # a setting outside the grid
    ("bundled", "cpu-run1-after", "float32", 200, 3),
    ("llama-3-8b", "cpu-run2", "float32", 2048, 65536),  # the largest batch the page accepts
])
def test_controls_show_the_python_values(page, exporter, data, config, machine, dtype, context,
                                         batch):
    set_controls(page, config, machine, dtype, context, batch)
    want = python_answer(exporter, config, machine, dtype, context, [batch] + data["sweep"])
    got = shown(page)
    step = want["steps"][0]
    for key in STEP_KEYS + ("bound",):
        assert close(got[key], step[key]), key
    assert close(got["ridge_batch"], want["ridge_batch"])
    assert f"{step['flops']:,}" == page.locator(".rl-results [data-key='flops']").inner_text()
    assert page.locator(".rl-results [data-key='bound']").inner_text() == f"{step['bound']}-bound"
    rows = page.locator(".rl-sweep tr[data-batch]")
    assert rows.count() == len(data["sweep"])
    for i, sweep_step in enumerate(want["steps"][1:]):
        row = rows.nth(i)
        assert int(row.get_attribute("data-batch")) == data["sweep"][i]
        for key in ("floor_s", "tokens_per_s", "bound"):
            value = row.locator(f"[data-key='{key}']").get_attribute("data-value")
            assert close(value if key == "bound" else float(value), sweep_step[key]), (i, key)
    assert page.locator(".rl-point").count() == 1
    assert page.locator(".rl-sweep-point").count() == len(data["sweep"])
    assert page.problems == []


def test_chapter_figures_appear_as_text(page):
    set_controls(page, "qwen3-0.6b", "cpu-run1", "float32", 512, 8)
    assert page.locator(".rl-results [data-key='floor_s']").inner_text() == "80.9 ms"
    assert page.locator(".rl-results [data-key='tokens_per_s']").inner_text() == "98.9"
    assert page.locator(".rl-results [data-key='ridge_batch']").inner_text() == "B = 15"
    set_controls(page, "qwen3-0.6b", "h100-sxm", "bfloat16", 512, 8)
    ridge = page.locator(".rl-results [data-key='ridge_batch']")
    assert ridge.inner_text() == "never at this context"
    assert "22.3 FLOP/byte" in page.locator(".rl-results").inner_text()
    assert page.problems == []


def test_bad_input_is_refused_and_cpu_roofs_have_no_bfloat16(page, data):
    set_controls(page, "bundled", "cpu-run1", "float32", 28, 1)
    page.fill("input.rl-context", "257")                   # the bundled model holds 256
    assert "from 1 to 256" in page.locator(".rl-error").inner_text()
    assert page.locator(".course-sim").get_attribute("data-valid") == "false"
    page.fill("input.rl-context", "28")
    page.fill("input.rl-batch", "2.5")
    assert "whole number" in page.locator(".rl-error").inner_text()
    page.fill("input.rl-batch", str(data["max_batch"] + 1))
    assert "batch size" in page.locator(".rl-error").inner_text()
    page.fill("input.rl-batch", "1")
    assert page.locator(".rl-error").inner_text() == ""
    assert page.locator(".course-sim").get_attribute("data-valid") == "true"
    assert page.locator("select.rl-dtype option[value='bfloat16']").is_disabled()
    assert "L3 cache" in page.locator(".rl-machine-note").inner_text()
    page.select_option("select.rl-machine", "h100-sxm")
    assert not page.locator("select.rl-dtype option[value='bfloat16']").is_disabled()
    page.select_option("select.rl-dtype", "bfloat16")
    page.select_option("select.rl-machine", "cpu-run2")     # no bfloat16 roof: float32
    assert page.locator("select.rl-dtype").input_value() == "float32"
    page.select_option("select.rl-config", "llama-3-8b")
    page.fill("input.rl-context", "8192")
    page.select_option("select.rl-config", "bundled")       # S clamped to 256
    assert page.locator("input.rl-context").input_value() == "256"
    assert page.locator(".course-sim").get_attribute("data-valid") == "true"
    assert page.problems == []


def duration(seconds: float) -> str:
    """3 significant digits in the unit that keeps them in [1, 1000) (s from 1 s on)."""
    r = float(f"{seconds:.3g}")
    scale, unit = next(((f, u) for f, u in ((1, "s"), (1e-3, "ms"), (1e-6, "\u00b5s"))
                        if r >= f), (1e-9, "ns"))
    v = r / scale
    return f"{seconds / scale:,.{0 if v >= 100 else 1 if v >= 10 else 2}f} {unit}"


@pytest.mark.parametrize("config, machine, dtype, context, batch", [
    ("qwen3-0.6b", "h100-sxm", "bfloat16", 1, 1),     # FLOPs / peak: about 1.2 µs
    ("bundled", "cpu-run1", "float32", 28, 1),        # the bundled model's floor: microseconds
    ("bundled", "h100-sxm", "bfloat16", 1, 1),        # nanoseconds
    ("qwen3-0.6b", "cpu-run1", "float32", 512, 64),   # 443 ms
    ("llama-3-8b", "cpu-run2", "float32", 2048, 65536),   # seconds
])
def test_times_show_three_significant_digits_in_a_fitting_unit(page, exporter, data, config,
                                                               machine, dtype, context, batch):
    set_controls(page, config, machine, dtype, context, batch)
    step = python_answer(exporter, config, machine, dtype, context, [batch])["steps"][0]
    for key in ("bytes_s", "flops_s", "floor_s"):
        text = page.locator(f".rl-results [data-key='{key}']").inner_text()
        assert text == duration(step[key]), (key, step[key])
        digits = text.split()[0].replace(",", "").replace(".", "").lstrip("0")
        assert len(digits) == 3 or step[key] >= 1000, text
    for row in page.locator(".rl-sweep tr[data-batch]").all():
        cell = row.locator("[data-key='floor_s']")
        assert cell.inner_text() == duration(float(cell.get_attribute("data-value")))
    assert page.problems == []
