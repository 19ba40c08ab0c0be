"""The S08 "Try it" simulator in a real browser: it replays the exported batches exactly.

A minimal page loads site/static/course.js, course.css, the simulator's script and the data
exported by site/simulators/static-batch/export.py (the same exporter the site runs; its data is
held against independent oracles in tests/test_s08_simulator_data.py). Playwright drives
Debian's Chromium. For every exported batch, at the prefill, a middle step and the last step:

- the grid has one row per request and one cell per cache column, and every computed cell has
  the class of the exported `BatchStats.timeline()` character, every later one "not yet";
- the counters of the step equal the exported `StepWaste` (kind, rows, columns, useful,
  padding, idle, masked keys), and the running totals equal its sums;
- each row's status says how many tokens it has made, and at the last step every row shows the
  engine's completion text and finish reason;
- the page's own consistency banner stays hidden and there are no console errors.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations


import pytest
import sim_browser
from sim_browser import data_fixture, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

CLASSES = {".": "sb-pad", "P": "sb-prompt", "G": "sb-gen", "-": "sb-idle"}
FIELDS = ("kind", "rows", "columns", "useful", "padding", "idle", "masked_keys")


data = data_fixture("static-batch", "s08_sim_export_browser")
page = page_fixture("static-batch", ".sb-grid", "s08-chromium-")


def go_to(pg, step: int) -> None:
    sim_browser.go_to(pg, "sb", step)


def grid_classes(pg) -> list[list[str]]:
    return pg.evaluate("""() => Array.from(document.querySelectorAll('.sb-grid-row')).map(tr =>
        Array.from(tr.querySelectorAll('.sb-cell')).map(c => c.className.split(' ')[1]))""")


def counters(pg, row: str) -> dict:
    return pg.evaluate(f"""() => Object.fromEntries(Array.from(document.querySelectorAll(
        '.{row} td[data-field]')).map(td => [td.dataset.field, td.textContent]))""")


def test_every_batch_replays_the_engine_step_by_step(page, data):
    assert page.locator(".sb-banner").is_hidden()
    for index, batch in enumerate(data["batches"]):
        page.select_option(".sb-pick", str(index))
        steps, timeline = batch["steps"], batch["timeline"]
        t_len = max(len(r["prompt_ids"]) for r in batch["rows"])
        outputs = [len(r["generated"]) for r in batch["rows"]]
        for step in sorted({1, 2, len(steps) // 2, len(steps)} - {0}):
            go_to(page, step)
            computed = t_len + step - 1                       # columns computed by this step
            shown = grid_classes(page)
            assert len(shown) == len(timeline)
            for line, cells in zip(timeline, shown):
                assert len(cells) == len(line)
                assert cells[:computed] == [CLASSES[ch] for ch in line[:computed]]
                assert set(cells[computed:]) <= {"sb-future"}
            now = counters(page, "sb-this-step")
            exported = steps[step - 1]
            assert now["kind"] == exported["kind"]
            for field in FIELDS[1:]:
                assert int(now[field]) == exported[field], (batch["id"], step, field)
            assert int(now["slots"]) == exported["rows"] * exported["columns"]
            so_far = counters(page, "sb-so-far")
            for field in ("useful", "padding", "idle"):
                assert int(so_far[field]) == sum(s[field] for s in steps[:step])
            assert int(so_far["slots"]) == sum(s["rows"] * s["columns"] for s in steps[:step])
            statuses = page.locator(".sb-status").all_inner_texts()
            for status, n in zip(statuses, outputs):
                made = min(step, n)
                assert status.startswith(f"{made} token")
                assert ("finished" in status) == (made == n)
        texts = page.evaluate("() => Array.from(document.querySelectorAll('.sb-text'))"
                              ".map(td => td.textContent)")
        statuses = page.locator(".sb-status").all_inner_texts()
        for row, text, status in zip(batch["rows"], texts, statuses):
            assert text == row["text"].replace("\n", "\u21b5")
            assert f"({row['finish_reason']})" in status
        totals = counters(page, "sb-so-far")
        assert int(totals["idle"]) == batch["totals"]["idle"]
        assert int(totals["slots"]) == batch["totals"]["slots"]
    assert page.problems == []


def test_buttons_move_one_step_and_stop_at_the_ends(page, data):
    page.select_option(".sb-pick", "0")
    last = len(data["batches"][0]["steps"])
    go_to(page, last)
    page.locator(".sb-reset").click()
    assert page.locator(".sb-step-label").inner_text().startswith(f"step 1 of {last} (prefill)")
    assert page.locator(".sb-back").is_disabled()
    page.locator(".sb-next").click()
    assert page.locator(".sb-step-label").inner_text() == f"step 2 of {last} (decode)"
    page.locator(".sb-end").click()
    assert page.locator(".sb-step-label").inner_text().startswith(f"step {last} of {last}")
    assert page.locator(".sb-next").is_disabled()
    assert "The batch is done" in page.locator(".sb-note").inner_text()
    assert page.problems == []
