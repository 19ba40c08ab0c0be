"""The S10 "Try it" stepper in a real browser: it replays the exported runs exactly.

A minimal page loads site/static/course.js, course.css, the stepper's script and the data
exported by site/simulators/scheduler-stepper/export.py (the exporter the site runs; its data
is held against independent oracles in tests/test_s10_simulator_data.py). Playwright drives
Debian's Chromium. For every exported workload, at the first step, every step with a
preemption or a resume, a middle one and the last:

- the grid has one row per request; every shown cell is what the exported trace says of that
  request in that step (absent before it arrives, joined / resumed with its scheduled tokens,
  decoding, preempted, ended by the capacity, waiting, finished), every later cell "not yet";
- the token-budget and KV meters show the trace's tokens scheduled, budget, KV used and
  capacity, and the budget bar has one segment per scheduled request with its tokens;
- the waiting chips are as many as the trace's waiting count, the running chips are the
  scheduled requests (and, only in a step that stopped at a preemption, running ones that
  were not scheduled), and the note names the trace's preempted, joined and resumed ids;
- at the end every request shows the engine's text and finish reason, and its preemption
  count; the consistency banner stays hidden and there are no console errors;
- at a page as narrow as the site's text column, the grid scrolls to the current step, the
  request table fits its box with no completion clipped, and counts of one read singular.
- the configuration line names each workload's context and budget, and the page shows the
  command line that makes the same run.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import re

import pytest
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("scheduler-stepper", "s10_sim_export_browser")
page = page_fixture("scheduler-stepper", ".ss-grid", "s10-chromium-")


def grid(pg) -> list[list[tuple[str, str]]]:
    return [[tuple(c) for c in row] for row in pg.evaluate("""() => Array.from(
        document.querySelectorAll('.ss-grid .ss-grid-row')).map(tr =>
        Array.from(tr.querySelectorAll('.ss-cell')).map(c =>
            [c.className.split(' ')[1], c.textContent]))""")]


def expected_grid(work: dict) -> list[list[set]]:
    """request x step: the set of (class, text) the trace allows (a running request that a
    preemption stopped from being scheduled may show as waiting or as stalled)."""
    trace, cells = work["trace"], []
    for req in work["requests"]:
        rid, row, done = req["id"], [], False
        for k, rec in enumerate(trace):
            tokens = dict(zip(rec["running"], rec["num_scheduled_tokens"]))
            if k < req["arrival"]:
                want = {("ss-absent", "")}
            elif rid in rec["preempted"]:
                want = {("ss-preempt", "\u00d7")}
            elif rid in rec["ended"]:
                want = {("ss-ended", "")}
            elif rid in rec["joined"]:
                want = {("ss-prefill", str(tokens[rid]))}
            elif rid in rec["resumed"]:
                want = {("ss-resume", str(tokens[rid]))}
            elif rid in tokens:
                want = {("ss-decode", "")}
            elif done:
                want = {("ss-done", "")}
            else:
                want = {("ss-wait", ""), ("ss-stall", "")}
            row.append(want)
            done = done or rid in rec["left"]
        cells.append(row)
    return cells


def test_every_workload_replays_the_engine(page, data):
    assert page.locator(".ss-banner").is_hidden()
    for index, work in enumerate(data["workloads"]):
        page.select_option(".ss-pick", str(index))
        trace, want = work["trace"], expected_grid(work)
        last = len(trace) - 1
        events = [k for k, r in enumerate(trace) if r["preempted"] or r["resumed"]]
        assert events, work["id"]                     # the workloads are there to show them
        for step in sorted({0, 1, last // 2, last, *events}):
            go_to(page, "ss", step)
            shown = grid(page)
            assert len(shown) == len(work["requests"])
            for req, allowed, got in zip(work["requests"], want, shown):
                assert len(got) == len(trace)
                for k in range(step + 1):
                    assert got[k] in allowed[k], (work["id"], req["id"], step, k, got[k])
                assert set(got[step + 1:]) <= {("ss-future", "")}
            rec = trace[step]
            budget = page.locator(".ss-meter-budget .ss-meter-label").inner_text()
            assert budget.startswith(f"token budget: {rec['num_tokens']} of "
                                     f"{rec['token_budget']} tokens")
            kv = page.locator(".ss-meter-kv .ss-meter-label").inner_text()
            assert kv.startswith(f"KV: {rec['kv_used_tokens']} of {rec['kv_capacity']} tokens "
                                 f"held, {rec['kv_free_tokens']} free")
            segs = page.evaluate("""() => Array.from(document.querySelectorAll(
                '.ss-bar-budget .ss-seg')).map(s => [s.dataset.req, Number(s.dataset.n)])""")
            assert sorted(map(tuple, segs)) == sorted(zip(rec["running"],
                                                          rec["num_scheduled_tokens"]))
            assert page.locator(".ss-queue-waiting .ss-chip").count() == rec["waiting"]
            running = page.locator(".ss-queue-running .ss-chip").all_inner_texts()
            scheduled = [c.split(" +")[0] for c in running if " +" in c]
            assert sorted(scheduled) == sorted(rec["running"])
            if not rec["preempted"]:
                assert len(running) == len(scheduled)
            note = page.locator(".ss-note").inner_text()
            for field, word in (("preempted", "preempted"), ("joined", "joined"),
                                ("resumed", "resumed")):
                if rec[field]:
                    assert word + " " + rec[field][0] in note, (work["id"], step, note)
                else:
                    assert word + " " not in note
        texts = page.locator(".ss-text").all_inner_texts()
        statuses = page.locator(".ss-status").all_inner_texts()
        counts = page.locator(".ss-pre").all_inner_texts()
        for req, text, status, count in zip(work["requests"], texts, statuses, counts):
            assert text == req["text"].replace("\n", "\u21b5")
            assert status.startswith(f"{len(req['generated'])} token")
            assert f"({req['finish_reason']})" in status
            assert int(count) == req["num_preemptions"]
    assert page.problems == []


def test_buttons_move_one_step_and_find_preemptions(page, data):
    page.select_option(".ss-pick", "0")
    trace = data["workloads"][0]["trace"]
    last = len(trace) - 1
    page.locator(".ss-end").click()
    assert page.locator(".ss-step-label").inner_text() == f"step {last} of {last}"
    assert page.locator(".ss-next").is_disabled()
    page.locator(".ss-reset").click()
    assert page.locator(".ss-step-label").inner_text() == f"step 0 of {last}"
    assert page.locator(".ss-back").is_disabled()
    page.locator(".ss-next").click()
    assert page.locator(".ss-step-label").inner_text() == f"step 1 of {last}"
    first = next(k for k, r in enumerate(trace) if r["preempted"] and k > 1)
    page.locator(".ss-next-preempt").click()
    assert page.locator(".ss-step-label").inner_text() == f"step {first} of {last}"
    assert "preempted" in page.locator(".ss-note").inner_text()
    assert page.problems == []


def test_the_grid_follows_the_step_and_nothing_overflows_or_reads_wrong(page, data):
    """At a page about as wide as the site's text column: the grid scrolls sideways to show
    the current step's column (at the end too), the request table fits its box and shows
    every completion whole, and no count reads "1 requests" or "1 tokens"."""
    page.set_viewport_size({"width": 760, "height": 1200})
    try:
        for index, work in enumerate(data["workloads"]):
            page.select_option(".ss-pick", str(index))
            last = len(work["trace"]) - 1
            for step in sorted({0, last // 2, last}):
                if step == last:
                    page.locator(".ss-end").click()
                else:
                    go_to(page, "ss", step)
                seen = page.evaluate("""() => {
                    const box = document.querySelector('.ss-grid-box').getBoundingClientRect();
                    const now = document.querySelectorAll('.ss-grid tr')[0]
                        .querySelectorAll('th')[%d + 1].getBoundingClientRect();
                    const req = document.querySelector('.ss-requests');
                    return {inView: now.left >= box.left - 0.5 && now.right <= box.right + 0.5,
                            fits: req.scrollWidth <= req.clientWidth,
                            clipped: Array.from(document.querySelectorAll('.ss-text'))
                                .filter(t => t.scrollWidth > t.clientWidth).length,
                            text: document.querySelector('.ss-sim').innerText};
                }""" % step)
                assert seen["inView"], (work["id"], step)
                assert seen["fits"] and seen["clipped"] == 0, (work["id"], step)
                assert not re.search(r"\b1 (requests|tokens)\b", seen["text"]), (work["id"], step)
            single = [k for k, rec in enumerate(work["trace"]) if len(rec["running"]) == 1]
            if single:                                 # a step with one request: singular
                go_to(page, "ss", single[0])
                note = page.locator(".ss-note").inner_text()
                n = work["trace"][single[0]]["num_tokens"]
                assert f"{n} token{'' if n == 1 else 's'} for 1 request;" in note, note
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []


def test_the_page_states_each_workloads_context_and_command(page, data):
    """The configuration line names the context (a KV slot's positions: 64 in "budget", which
    no flag's default gives) and the page shows the command that makes the same run."""
    for index, work in enumerate(data["workloads"]):
        page.select_option(".ss-pick", str(index))
        config = page.locator(".ss-config").inner_text()
        assert f"context {work['max_context']} tokens" in config
        assert f"{work['max_num_batched_tokens']} tokens per step" in config
        assert page.locator(".ss-command code").inner_text() == work["command"]
    budget = next(w for w in data["workloads"] if w["id"] == "budget")
    assert f"{budget['max_context']}-token context" in budget["title"]
    assert "--max-context 64" in budget["command"]
    assert page.problems == []
