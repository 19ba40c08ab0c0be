"""The S09 "Try it" simulator in a real browser: it replays the exported runs exactly.

A minimal page loads site/static/course.js, course.css, the simulator's script and the data
exported by site/simulators/continuous-batch/export.py (the exporter the site runs; its data is
held against independent oracles in tests/test_s09_simulator_data.py). Playwright drives
Debian's Chromium. For every exported workload, at the first, a middle and the last step:

- the continuous grid has one row per slot; every computed cell shows the request the exported
  S09 trace put in that slot at that step (orange on the step it joined), every other computed
  cell is an empty slot, every later cell "not yet";
- the static grid shows the exported S08 batches in order: request b*M + s in slot s for the
  batch's steps (S08's `BatchStats` count), red once the request has made its tokens;
- both counter rows equal sums worked here from the trace and the output lengths, the note
  names the trace's joined and left ids, and at the end every request shows the engine's text;
- the page's consistency banner stays hidden and there are no console errors.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations


import pytest
import sim_browser
from sim_browser import data_fixture, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("continuous-batch", "s09_sim_export_browser")
page = page_fixture("continuous-batch", ".cb-grid-cont", "s09-chromium-")


def go_to(pg, step: int) -> None:
    sim_browser.go_to(pg, "cb", step)


def grid(pg, which: str) -> list[list[tuple[str, str]]]:
    return [[tuple(c) for c in row] for row in pg.evaluate(f"""() => Array.from(
        document.querySelectorAll('.cb-grid-{which} .cb-grid-row')).map(tr =>
        Array.from(tr.querySelectorAll('.cb-cell')).map(c =>
            [c.className.split(' ')[1], c.textContent]))""")]


def counters(pg, which: str) -> dict:
    return pg.evaluate(f"""() => Object.fromEntries(Array.from(document.querySelectorAll(
        '.cb-stats-{which} td[data-field]')).map(td => [td.dataset.field, td.textContent]))""")


def expected_continuous(work: dict) -> list[list[tuple[str, str]]]:
    """slot x step cells from the exported trace: (class, request id or '')."""
    m = work["max_batch"]
    cells = [[("cb-free", "")] * len(work["trace"]) for _ in range(m)]
    for k, rec in enumerate(work["trace"]):
        for rid, slot in zip(rec["running"], rec["slots"]):
            cells[slot][k] = ("cb-prefill" if rid in rec["joined"] else "cb-run", rid)
    return cells


def expected_static(work: dict) -> list[list[tuple[str, str]]]:
    m, outputs = work["max_batch"], [len(r["generated"]) for r in work["requests"]]
    cells = [[] for _ in range(m)]
    for batch in work["static"]["batches"]:
        for s in range(m):
            rid = batch["requests"][s] if s < len(batch["requests"]) else None
            for k in range(1, batch["steps"] + 1):
                if rid is None:
                    cells[s].append(("cb-free", ""))
                else:
                    kind = "cb-prefill" if k == 1 else (
                        "cb-run" if k <= outputs[int(rid)] else "cb-idle")
                    cells[s].append((kind, rid))
    return cells


def sums(cells, step: int) -> dict:
    seen = [c for row in cells for c in row[:step]]
    return {"tokens": sum(c[0] in ("cb-prefill", "cb-run") for c in seen),
            "idle": sum(c[0] == "cb-idle" for c in seen),
            "free": sum(c[0] == "cb-free" for c in seen)}


def test_every_workload_replays_both_engines(page, data):
    assert page.locator(".cb-banner").is_hidden()
    for index, work in enumerate(data["workloads"]):
        page.select_option(".cb-pick", str(index))
        cont, static = expected_continuous(work), expected_static(work)
        last = max(len(cont[0]), len(static[0]))
        assert sum(b["steps"] for b in work["static"]["batches"]) == len(static[0])
        for step in sorted({1, 2, len(work["trace"]) // 2, len(work["trace"]), last}):
            go_to(page, step)
            for which, cells in (("cont", cont), ("static", static)):
                shown = grid(page, which)
                assert len(shown) == work["max_batch"]
                for want, got in zip(cells, shown):
                    assert len(got) == len(want)
                    assert got[:step] == want[:step], (work["id"], which, step)
                    assert {c for c in got[step:]} <= {("cb-future", "")}
                now = counters(page, which)
                for field, value in sums(cells, step).items():
                    assert int(now[field]) == value, (work["id"], which, step, field)
                assert now["step"] == f"{min(step, len(cells[0]))} of {len(cells[0])}"
            if step <= len(work["trace"]):
                rec = work["trace"][step - 1]
                note = page.locator(".cb-note").inner_text()
                assert f"{rec['num_tokens']} tokens in the ragged batch" in note
                assert f"joined: {', '.join(rec['joined']) or 'none'}" in note
                assert f"left: {', '.join(rec['left']) or 'none'}" in note
        texts = page.locator(".cb-text").all_inner_texts()
        statuses = page.locator(".cb-status").all_inner_texts()
        for req, text, status in zip(work["requests"], texts, statuses):
            assert text == req["text"].replace("\n", "\u21b5")
            assert status.startswith(f"{len(req['generated'])} token")
            assert f"({req['finish_reason']})" in status
        totals = counters(page, "cont")
        assert int(totals["tokens"]) == sum(len(r["generated"]) for r in work["requests"])
        assert int(totals["idle"]) == 0
    assert page.problems == []


def test_buttons_move_one_step_and_stop_at_the_ends(page, data):
    page.select_option(".cb-pick", "0")
    work = data["workloads"][0]
    last = max(len(work["trace"]), sum(b["steps"] for b in work["static"]["batches"]))
    go_to(page, last)
    page.locator(".cb-reset").click()
    assert page.locator(".cb-step-label").inner_text() == f"step 1 of {last}"
    assert page.locator(".cb-back").is_disabled()
    page.locator(".cb-next").click()
    assert page.locator(".cb-step-label").inner_text() == f"step 2 of {last}"
    page.locator(".cb-end").click()
    assert page.locator(".cb-next").is_disabled()
    assert "Both are done" in page.locator(".cb-note").inner_text()
    assert page.problems == []
