"""The S06 "Try it" timeline in a real browser: it draws exactly the Python schedule.

A minimal page loads site/static/course.js, the simulator's script and the data that
site/simulators/host-device-timeline/export.py exports (counts and measured costs from the S06
engine on the bundled model). Playwright drives Debian's Chromium: for every exported reference
setting, and for the default settings of both model shapes, the controls are set as a learner
would, and every segment drawn on the host and device lanes (its data-start / data-end) and the
reported totals must equal `timeline` / `summary` in export.py within 1e-9 relative; the page
says it reproduced the reference schedules, and logs no console error. Skipped when Playwright,
Chromium or the bundled model is missing.

Drawing is bounded: a run of one step's segments narrower than 3 px is drawn as one block, so
each drawn block names the segments it holds (data-first, data-count) and the checks below
expand the blocks back into the schedule. Further tests drive the fields' limits (refused with a
message, old results faded), the largest allowed setting (drawn in well under a second), the
extreme allowed values (no NaN, Infinity or undefined anywhere) and a setting that takes no time.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

REL = 1e-9
MERGE_PX = 3                   # simulator.js's MERGE_PX
FIELDS = ((".hd-kernels", "model_launches"), (".hd-launch", "launch_us"),
          (".hd-kernel", "kernel_us"), (".hd-post", "post_us"),
          (".hd-host-sampler", "host_sampler_us"))

hd = load_exporter("host-device-timeline", "s06_sim_export_browser")
if not (Path(hd.BUNDLED_MODEL_DIR) / "model.safetensors").exists():
    pytest.skip("the bundled model (data/model) is missing", allow_module_level=True)


@pytest.fixture(scope="module")
def data():
    return hd.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("s06_sim_page"), "host-device-timeline", data,
                      css=False)
    with open_page(html, ".hd-timeline", "s06-chromium-") as pg:
        yield pg


DRAWN = """() => Array.from(document.querySelectorAll('.hd-seg')).map(r => [
  r.getAttribute('data-lane'), r.getAttribute('data-kind'), Number(r.getAttribute('data-step')),
  Number(r.getAttribute('data-start')), Number(r.getAttribute('data-end')),
  Number(r.getAttribute('data-first')), Number(r.getAttribute('data-count')),
  Number(r.getAttribute('data-busy')), Number(r.getAttribute('width'))])"""
GEOMETRY = """() => { const s = document.querySelector('.hd-timeline');
  return [Number(s.getAttribute('data-view')), Number(s.getAttribute('width'))]; }"""
# Time one input event, forcing style and layout of what it drew.
TIMED_INPUT = """([selector, value]) => { const e = document.querySelector(selector); e.value = value;
  const t0 = performance.now(); e.dispatchEvent(new Event('input'));
  document.querySelector('.hd-timeline').getBBox(); document.body.offsetHeight;
  return performance.now() - t0; }"""
NOT_FINITE = """() => { const bad = [];
  const numeric = new Set(['x', 'y', 'width', 'height', 'x1', 'x2', 'y1', 'y2', 'fill-opacity']);
  document.querySelectorAll('.hd-sim svg, .hd-sim svg *, .hd-metrics').forEach(el => {
    for (const a of el.attributes) {
      const isNumber = numeric.has(a.name) ||
        (a.name.startsWith('data-') && !['data-lane', 'data-kind'].includes(a.name));
      if (isNumber && !Number.isFinite(Number(a.value))) bad.push(el.tagName + ' ' + a.name + '=' + a.value);
      if (a.name === 'viewBox' && !a.value.split(' ').every(v => Number.isFinite(Number(v))))
        bad.push('viewBox=' + a.value);
    }
  });
  return bad; }"""
TEXT = """() => document.querySelector('.hd-sim').innerText + ' ' +
  Array.from(document.querySelectorAll('.hd-sim svg text, .hd-sim svg title')).map(t => t.textContent).join(' ')"""
STALE = """() => ['.hd-metrics', '.hd-verdict', '.hd-svg-wrap', '.hd-caption'].map(
  s => document.querySelector(s).classList.contains('hd-stale'))"""
METRICS = """() => { const m = document.querySelector('.hd-metrics');
  return ['data-end', 'data-per-token', 'data-idle', 'data-wait'].map(a => Number(m.getAttribute(a))); }"""


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-300)


def set_controls(pg, setting: dict, zoom: str = "all") -> None:
    pg.select_option(".hd-zoom", zoom)
    pg.select_option(".hd-policy", setting["policy"])
    pg.select_option(".hd-steps", str(setting["steps"]))
    for selector, key in FIELDS:
        pg.fill(selector, repr(setting[key]))


def setting_of(policy, steps, n, launch, kernel, post, sampler_us, data):
    return {"policy": policy, "steps": steps, "model_launches": n,
            "sampler_launches": data["counts"]["bfloat16"]["sampler"], "launch_us": launch,
            "kernel_us": kernel, "post_us": post, "host_sampler_us": sampler_us}


def expected_blocks(segments, drawn, view, plot, zoom):
    """Check that the drawn blocks of one lane are the lane's segments, in order, merged only
    as the page says; segments: [(kind, step, start, end)]."""
    shown = segments if zoom == "all" else [x for x in segments if x[2] < view]
    at = 0
    for _, kind, step, start, end, first, count, busy, width in drawn:
        assert first == at and count >= 1, (first, at)
        members = shown[first:first + count]
        assert len(members) == count and {m[1] for m in members} == {step}
        assert close(start, members[0][2]) and close(end, members[-1][3])
        assert close(busy, sum(m[3] - m[2] for m in members))
        time: dict[str, float] = {}
        for m in members:
            time[m[0]] = time.get(m[0], 0.0) + m[3] - m[2]
        assert kind == max(time, key=time.get)        # the kind taking most of its time
        if count > 1:                                 # merged only when narrower than MERGE_PX
            assert (min(end, view) - start) / view * plot <= MERGE_PX * (1 + 1e-9)
            assert all((m[3] - m[2]) / view * plot < MERGE_PX for m in members)
        at += count
    assert at == len(shown)


def assert_page_draws(pg, schedule: dict, zoom: str = "all") -> None:
    drawn = pg.evaluate(DRAWN)
    view, width = pg.evaluate(GEOMETRY)
    plot = width - 72
    host = [d for d in drawn if d[0] == "host"]
    device = [d for d in drawn if d[0] == "device"]
    expected_blocks(schedule["host"], host, view, plot, zoom)
    expected_blocks([("kernel", *k) for k in schedule["device"]], device, view, plot, zoom)
    assert all(d[8] >= 1 for d in device if d[7] > 0)    # a kernel that takes time: >= 1 px
    summary = hd.summary(schedule)
    shown = pg.evaluate(METRICS)
    expected = [summary["end"], summary["per_token"], summary["device_idle_fraction"],
                summary["host_wait"]]
    assert all(close(a, b) for a, b in zip(shown, expected)), (shown, expected)


def test_page_replays_the_reference_schedules_on_load(page, data):
    text = page.locator(".hd-check").inner_text()
    assert f"reproduces all {len(data['reference'])} reference schedules" in text
    assert page.problems == []


def test_controls_reproduce_every_reference_setting(page, data):
    for ref in data["reference"]:
        set_controls(page, ref["setting"])
        assert_page_draws(page, ref["schedule"])
    assert page.problems == []


@pytest.mark.parametrize("shape", ["bundled", "qwen3-0.6b"])
def test_each_model_shape_at_its_counted_launches(page, data, shape):
    page.select_option(".hd-shape", shape)
    page.select_option(".hd-policy", "step")
    page.select_option(".hd-steps", "3")
    page.fill(".hd-launch", repr(data["illustrative"]["launch_us"]))
    page.fill(".hd-post", repr(data["measured"]["post_us"]))
    assert page.input_value(".hd-kernels") == str(data["shapes"][shape]["model_launches"])
    for policy in hd.POLICIES:
        page.select_option(".hd-policy", policy)
        schedule = hd.timeline(policy, 3, data["shapes"][shape]["model_launches"],
                               data["counts"]["bfloat16"]["sampler"],
                               data["illustrative"]["launch_us"],
                               data["shapes"][shape]["roofline_kernel_us"],
                               data["measured"]["post_us"],
                               float(page.get_attribute(".hd-host-sampler", "data-value")))
        assert_page_draws(page, schedule)
    assert page.problems == []


def test_fields_show_rounded_values_but_compute_exactly(page, data):
    page.select_option(".hd-shape", "qwen3-0.6b")
    page.select_option(".hd-shape", "bundled")
    exact = data["shapes"]["bundled"]["roofline_kernel_us"]
    assert float(page.input_value(".hd-kernel")) == float(f"{exact:.4g}") != exact
    assert float(page.get_attribute(".hd-kernel", "data-value")) == exact
    page.get_by_role("button", name=re.compile("measured tiny op")).click()
    assert float(page.input_value(".hd-launch")) == float(f"{data['measured']['tiny_op_us']:.4g}")
    assert float(page.get_attribute(".hd-launch", "data-value")) == data["measured"]["tiny_op_us"]
    page.fill(".hd-kernel", "0.5")                       # typed: used as typed
    assert page.get_attribute(".hd-kernel", "data-value") == "0.5"
    page.select_option(".hd-steps", "1")
    assert "1 step:" in page.locator(".hd-metrics").inner_text()
    assert "1 steps" not in page.locator(".hd-metrics").inner_text()
    assert page.problems == []


@pytest.mark.parametrize("selector,key", FIELDS)
def test_values_beyond_the_limits_are_refused_and_the_results_fade(page, data, selector, key):
    ref = data["reference"][0]["setting"]
    set_controls(page, ref)
    assert page.get_attribute(".hd-sim", "data-valid") == "true"
    assert page.evaluate(STALE) == [False] * 4
    before = page.locator(".hd-metrics").inner_text()
    limit = data["limits"][key]
    for value in (f"{limit * 1.5:g}", "1e308", "1e6" if limit < 1e6 else "1e7", "-1", "",
                  "1e-7" if key != "model_launches" else "2.5"):
        elapsed = page.evaluate(TIMED_INPUT.replace(
            "document.querySelector('.hd-timeline').getBBox(); ", ""), [selector, value])
        assert elapsed < 500, (value, elapsed)
        error = page.locator(".hd-error").inner_text()
        assert f"{limit:,.0f}" in error and "must be" in error, (value, error)
        assert page.get_attribute(".hd-sim", "data-valid") == "false"
        assert page.evaluate(STALE) == [True] * 4
        assert page.locator(".hd-metrics").inner_text() == before     # the last valid results
    page.fill(selector, repr(ref[key]))
    assert page.locator(".hd-error").inner_text() == ""
    assert page.evaluate(STALE) == [False] * 4
    assert_page_draws(page, data["reference"][0]["schedule"])
    assert page.problems == []


def test_a_setting_that_takes_no_time_is_refused(page, data):
    ref = data["reference"][0]["setting"]
    for policy in hd.POLICIES:
        set_controls(page, ref | {"policy": policy})
        for selector in (".hd-launch", ".hd-kernel", ".hd-post", ".hd-host-sampler"):
            page.fill(selector, "0")
        assert "nothing to measure" in page.locator(".hd-error").inner_text()
        assert page.evaluate(STALE) == [True] * 4
        assert not re.search(r"NaN|Infinity|undefined", page.evaluate(TEXT))
        page.fill(".hd-post", "2")                  # only the host's work: measurable again
        schedule = hd.timeline(policy, ref["steps"], ref["model_launches"],
                               ref["sampler_launches"], 0.0, 0.0, 2.0, 0.0)
        assert_page_draws(page, schedule)
        assert "no time" in page.locator(".hd-verdict").inner_text() or policy == "kernel"
    assert page.problems == []


@pytest.mark.parametrize("policy", hd.POLICIES)
def test_the_largest_setting_draws_quickly_and_exactly(page, data, policy):
    lim = data["limits"]
    setting = setting_of(policy, lim["steps"], lim["model_launches"], 4.5, 0.0025, 7.5, 12.0,
                         data)
    schedule = hd.timeline(**setting)
    set_controls(page, setting | {"model_launches": 1})
    for zoom in ("all", "step", "launches"):
        page.select_option(".hd-zoom", zoom)
        elapsed = page.evaluate(TIMED_INPUT, [".hd-kernels", str(lim["model_launches"])])
        assert elapsed < 1000, (zoom, elapsed)
        blocks = int(page.get_attribute(".hd-caption", "data-blocks"))
        assert blocks <= 3 * 1100 // MERGE_PX + 100, blocks       # ~1,200 for 240,000 segments
        assert_page_draws(page, schedule, zoom)
        page.fill(".hd-kernels", "1")
    assert page.problems == []


@pytest.mark.parametrize("policy", hd.POLICIES)
def test_extreme_allowed_values_show_only_finite_numbers(page, data, policy):
    lim, tiny = data["limits"], data["min_nonzero_us"]
    for n, launch, kernel, post, sampler_us in (
            (lim["model_launches"], lim["launch_us"], lim["kernel_us"], lim["post_us"],
             lim["host_sampler_us"]),
            (1, tiny, tiny, tiny, tiny), (1, tiny, 0.0, 0.0, 0.0),
            (lim["model_launches"], tiny, lim["kernel_us"], 0.0, tiny)):
        setting = setting_of(policy, lim["steps"], n, launch, kernel, post, sampler_us, data)
        for zoom in ("all", "step", "launches"):
            set_controls(page, setting, zoom)
            assert page.get_attribute(".hd-sim", "data-valid") == "true", setting
            assert page.evaluate(NOT_FINITE) == [], (setting, zoom)
            assert not re.search(r"NaN|Infinity|undefined", page.evaluate(TEXT)), (setting, zoom)
            assert_page_draws(page, hd.timeline(**setting), zoom)
    assert page.problems == []
