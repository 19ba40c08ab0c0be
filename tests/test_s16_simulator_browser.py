"""The S16 step-overlap simulator in a real browser draws exactly the Python schedule.

A minimal page (no site build) loads site/static/course.js, this simulator's script and the data
exported by site/simulators/step-overlap/export.py (windows of decode steps of S13's engine on
the bundled model, timed by code/s16_profile.py's StepProfiler; the data's rules are checked in
tests/test_s16_simulator_data.py). Playwright drives Debian's Chromium:

- on load the page reproduces every exported reference schedule (no banner, no console error);
- for every run (B = 1, 8, 16, 64), chosen with the page's control, and 1, 2, 5 and all of the
  recorded steps, every box drawn in every mode and lane (its phase, step, data-start and
  data-end) is a box of export.py's `schedule` on those steps, box for box and in order, with
  the same outputs-ready marks; with all the steps, the boxes are the exported reference
  schedule itself; the totals table shows `summary`'s numbers; a box that takes time is at
  least 1 px wide and boxes stand in time order on the page;
- the graph rows name where their forward came from (the record, or the static step run
  eagerly), and the measured line carries the exported measurements;
- with a benchmark record (the data rewritten as export.py writes it when the record holds the
  compiled forward), the graph rows say "graph replay", draw the record's forward box for box,
  and the record's async figures are listed;
- nothing overflows sideways at the site's text-column width.
Skipped when Playwright, Chromium or the bundled model is missing.
"""
from __future__ import annotations

import pytest
import copy

from sim_browser import (data_fixture, load_exporter, page_fixture, skip_without_browser,
                         write_page)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

so = load_exporter("step-overlap", "s16_sim_export_browser_rules")
data = data_fixture("step-overlap", "s16_sim_export_browser")
page = page_fixture("step-overlap", ".so-timeline", "s16-chromium-")

DRAWN = """() => Array.from(document.querySelectorAll('rect.so-box')).map(r => [
  r.dataset.mode, r.dataset.lane, r.dataset.phase, Number(r.dataset.step),
  Number(r.dataset.start), Number(r.dataset.end), Number(r.getAttribute('x')),
  Number(r.getAttribute('width'))])"""
MARKS = """() => Array.from(document.querySelectorAll('line.so-out')).map(l => [
  l.dataset.mode, Number(l.dataset.step), Number(l.dataset.at)])"""
TOTALS = """() => Array.from(document.querySelectorAll('tr.so-total')).map(tr => [
  tr.dataset.mode, Number(tr.dataset.end), Number(tr.dataset.perStep),
  Number(tr.dataset.hostBusy), Number(tr.dataset.workerBusy)])"""


def show(pg, run: int, steps: int) -> None:
    pg.select_option(".so-run", str(run))
    pg.select_option(".so-steps", str(steps))
    pg.wait_for_function(
        f"""() => document.querySelectorAll('line.so-out').length === {4 * steps} &&
                  document.querySelector('.so-run').value === '{run}'""")


def assert_draws(pg, expected: dict) -> None:
    """expected: {mode: schedule}; the page's boxes, marks and totals against it."""
    drawn = pg.evaluate(DRAWN)
    for mode, result in expected.items():
        for lane in ("host", "worker"):
            got = [d for d in drawn if d[0] == mode and d[1] == lane]
            want = result["lanes"][lane]
            assert [tuple(d[2:6]) for d in got] == [tuple(b) for b in want], (mode, lane)
            xs = [d[6] for d in got]
            assert xs == sorted(xs), (mode, lane)                 # in time order on the page
            assert all(d[7] >= 1 for d in got if d[5] > d[4]), (mode, lane)
    assert len(drawn) == sum(len(r["lanes"][ln]) for r in expected.values()
                             for ln in ("host", "worker"))
    marks = pg.evaluate(MARKS)
    for mode, result in expected.items():
        assert [m[2] for m in marks if m[0] == mode] == result["outputs_at"], mode
    n = len(next(iter(expected.values()))["outputs_at"])
    totals = {row[0]: row[1:] for row in pg.evaluate(TOTALS)}
    for mode, result in expected.items():
        s = so.summary(result, n)
        assert totals[mode] == pytest.approx([s["end"], s["per_step"], s["host_busy"],
                                              s["worker_busy"]], rel=1e-12, abs=1e-15), mode


def test_the_page_reproduces_the_reference_schedules_on_load(page, data):
    assert page.locator(".so-banner").is_hidden()
    text = page.locator(".so-check").inner_text()
    assert f"reproduces all {len(data['runs']) * len(so.MODES)} reference schedules" in text
    run = data["runs"][data["defaults"]["run"]]
    n = data["defaults"]["steps"]
    assert page.locator(".so-steps").input_value() == str(n)
    assert_draws(page, {m: so.schedule(m, run["steps"][:n], run["graph"]["forward_ms"])
                        for m in so.MODES})
    assert page.problems == []


def test_every_run_and_window_is_drawn_box_for_box(page, data):
    for r, run in enumerate(data["runs"]):
        steps, g = run["steps"], run["graph"]["forward_ms"]
        for n in (1, 2, 5, len(steps)):
            show(page, r, n)
            expected = {m: so.schedule(m, steps[:n], g) for m in so.MODES}
            if n == len(steps):
                assert expected == run["reference"]            # the export's own schedules
            assert_draws(page, expected)
        titles = page.locator("text.so-mode-title").all_text_contents()
        graph_words = ("graph replay" if run["graph"]["source"] == "record"
                       else "static step, eager")
        assert graph_words in titles[1], titles
        measured = page.locator(".so-measured")
        assert float(measured.get_attribute("data-eager")) == run["measured"]["eager"]["step_ms"]
        assert float(measured.get_attribute("data-async")) == run["measured"]["async"]["step_ms"]
    sources = page.locator(".so-sources").inner_text()
    assert data["record"]["path"] in sources
    for run in data["runs"]:
        assert run["graph"]["label"] in sources
    assert page.locator(".so-banner").is_hidden()
    assert page.problems == []


def test_nothing_overflows_at_the_text_column_width(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for r in range(len(data["runs"])):
            show(page, r, len(data["runs"][r]["steps"]))
            fits = page.evaluate("""() => {
                const sim = document.querySelector('.so-sim');
                return sim.scrollWidth <= sim.clientWidth + 1;
            }""")
            assert fits, r
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []


def test_with_a_record_the_graph_rows_replay_its_forward(page, data, tmp_path):
    recorded = copy.deepcopy(data)
    for run in recorded["runs"]:
        forward = round(run["eager_forward_ms"] / 3, 6)           # any figure the record gives
        run["graph"] = {"forward_ms": forward, "source": "record",
                        "label": f"the compiled step at B = {run['batch_size']}, test record"}
        run["reference"] = {m: so.schedule(m, run["steps"], forward) for m in so.MODES}
    recorded["record"] = {"path": data["record"]["path"], "present": True, "used": True,
                          "async": {"batch": 16, "rows": {"eager": 3.25, "async eager": 2.5}}}
    html = write_page(tmp_path, "step-overlap", recorded)
    original = page.url                     # the module's page, on the recorded data meanwhile
    try:
        page.goto(html.as_uri())
        page.wait_for_selector(".so-timeline")
        assert page.locator(".so-banner").is_hidden()
        for r, run in enumerate(recorded["runs"]):
            show(page, r, len(run["steps"]))
            assert_draws(page, run["reference"])
            titles = page.locator("text.so-mode-title").all_text_contents()
            assert titles[1].startswith("graph replay") and "graph replay" in titles[3]
            assert "compiled forward" in page.locator(".so-verdict").inner_text()
        sources = page.locator(".so-sources").inner_text()
        assert "present and used" in sources
        assert "async eager 2.50 ms" in sources and "B = 16" in sources
    finally:
        page.goto(original)
        page.wait_for_selector(".so-timeline")
    assert page.problems == []
