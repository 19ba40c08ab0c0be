"""The S11 "Try it" step timeline in a real browser: it replays the exported runs exactly.

A minimal page loads site/static/course.js, course.css, the timeline's script and the data
exported by site/simulators/step-timeline/export.py (the exporter the site runs; its data is
held against independent oracles in tests/test_s11_simulator_data.py). Playwright drives
Debian's Chromium. For every exported workload, both runs, at the first step, every step where
the long prompt is scheduled, a middle one and the last:

- each run's grid has one row per request; every shown cell is what the exported trace says of
  that request in that step (absent before it arrives, a prompt chunk with its tokens, the last
  chunk that samples, a decode, waiting, finished), every later cell "not yet", and cells past
  the end of a shorter run blank;
- the work chart has one column per step so far, as tall as the trace's tokens computed in it,
  split into the decode tokens and the prompt tokens the trace's kinds give;
- the note names each chunk's tokens and how far it got, and whether it samples;
- the summary line of each run shows the worst gap and the long prompt's first-token step that
  the exporter computed from the trace; at the end every request shows the engine's text,
  finish reason and first-token step;
- the consistency banner stays hidden and there are no console errors; at a page as narrow as
  the site's text column the grids scroll to the current step and the request tables fit.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import re

import pytest
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("step-timeline", "s11_sim_export_browser")
page = page_fixture("step-timeline", ".st-grid", "s11-chromium-")


def grids(pg) -> list[list[list[tuple[str, str]]]]:
    return pg.evaluate("""() => Array.from(document.querySelectorAll('.st-panel')).map(p =>
        Array.from(p.querySelectorAll('.st-grid .st-grid-row')).map(tr =>
            Array.from(tr.querySelectorAll('.st-cell')).map(c =>
                [c.className.split(' ')[1], c.textContent])))""")


def expected_cell(run: dict, req: dict, k: int) -> tuple[str, str]:
    trace = run["trace"]
    if k >= len(trace):
        return ("st-after", "")
    if k < req["arrival"]:
        return ("st-absent", "")
    rec = trace[k]
    if req["id"] in rec["running"]:
        at = rec["running"].index(req["id"])
        if rec["kinds"][at] == "decode":
            return ("st-decode", "")
        n = str(rec["num_scheduled_tokens"][at])
        return ("st-last-chunk", n) if req["id"] in rec["sampled"] else ("st-chunk", n)
    left_before = any(req["id"] in r["left"] for r in trace[:k])
    return ("st-done", "") if left_before else ("st-wait", "")


def test_every_workload_replays_the_engine(page, data):
    assert page.locator(".st-banner").is_hidden()
    for index, work in enumerate(data["workloads"]):
        page.select_option(".st-pick", str(index))
        runs = work["runs"]
        last = max(len(r["trace"]) for r in runs) - 1
        long_steps = {k for r in runs for k, rec in enumerate(r["trace"])
                      if work["long_id"] in rec["running"]
                      and rec["kinds"][rec["running"].index(work["long_id"])] == "prefill"}
        assert long_steps, work["id"]
        for step in sorted({0, last // 2, last, *long_steps}):
            go_to(page, "st", step)
            shown = grids(page)
            assert len(shown) == 2
            notes = page.locator(".st-note").all_inner_texts()
            for run, grid, note in zip(runs, shown, notes):
                assert len(grid) == len(run["requests"])
                for req, row in zip(run["requests"], grid):
                    assert len(row) == last + 1
                    for k in range(step + 1):
                        assert tuple(row[k]) == expected_cell(run, req, k), (
                            work["id"], run["label"], req["id"], step, k, row[k])
                    assert {tuple(c) for c in row[step + 1:]} <= {("st-future", "")}
                if step < len(run["trace"]):
                    rec = run["trace"][step]
                    assert note.startswith(f"Step {step}: {rec['num_tokens']} of "
                                           f"{rec['token_budget']} tokens"), note
                    for rid, n, kind, start, total in zip(
                            rec["running"], rec["num_scheduled_tokens"], rec["kinds"],
                            rec["num_computed_tokens"], rec["request_num_tokens"]):
                        if kind == "prefill":
                            word = ("complete: samples its first token" if rid in rec["sampled"]
                                    else "samples nothing")
                            assert (f"request {rid} computes {n} prompt token"
                                    f"{'' if n == 1 else 's'}, {start + n} of {total}, {word}"
                                    ) in note, (work["id"], step, note)
            cols = page.evaluate("""() => Array.from(document.querySelectorAll('.st-panel')).map(p =>
                Array.from(p.querySelectorAll('.st-chart .st-col')).map(c =>
                    [c.dataset.tokens || null, c.querySelector('.st-seg-decode') ?
                     c.querySelector('.st-seg-decode').style.height : null,
                     c.querySelector('.st-seg-prefill') ?
                     c.querySelector('.st-seg-prefill').style.height : null]))""")
            tallest = max(rec["num_tokens"] for r in runs for rec in r["trace"])
            for run, chart in zip(runs, cols):
                assert len(chart) == last + 1
                for k, (tokens, dec_h, pre_h) in enumerate(chart):
                    if k > step or k >= len(run["trace"]):
                        assert tokens is None
                        continue
                    rec = run["trace"][k]
                    dec = sum(n for n, kind in zip(rec["num_scheduled_tokens"], rec["kinds"])
                              if kind == "decode")
                    assert int(tokens) == rec["num_tokens"]
                    assert float(dec_h.rstrip("%")) == pytest.approx(100 * dec / tallest, abs=1e-3)
                    assert float(pre_h.rstrip("%")) == pytest.approx(
                        100 * (rec["num_tokens"] - dec) / tallest, abs=1e-3)
        summaries = page.locator(".st-summary").all_inner_texts()
        for run, text in zip(runs, summaries):
            worst = run["summary"]["worst_gap"]
            assert (f"Worst gap between two tokens of one request: {worst['tokens']} tokens "
                    f"computed (request {worst['request']}, step {worst['step']})") in text
            first = run["summary"]["first_token_step"][work["long_id"]]
            arrival = next(r["arrival"] for r in run["requests"] if r["id"] == work["long_id"])
            assert f"first token in step {first}, {first - arrival} step" in text, text
        go_to(page, "st", last)
        texts = page.locator(".st-text").all_inner_texts()
        statuses = page.locator(".st-status").all_inner_texts()
        firsts = page.locator(".st-first").all_inner_texts()
        reqs = [(run, req) for run in runs for req in run["requests"]]
        assert len(texts) == len(reqs)
        for (run, req), text, status, first in zip(reqs, texts, statuses, firsts):
            assert text == req["text"].replace("\n", "\u21b5")
            assert status.startswith(f"{len(req['generated'])} token")
            assert f"({req['finish_reason']})" in status
            assert first == f"step {run['summary']['first_token_step'][req['id']]}"
    assert page.problems == []


def test_buttons_move_one_step(page, data):
    page.select_option(".st-pick", "0")
    last = max(len(r["trace"]) for r in data["workloads"][0]["runs"]) - 1
    page.locator(".st-end").click()
    assert page.locator(".st-step-label").inner_text() == f"step {last} of {last}"
    assert page.locator(".st-next").is_disabled()
    page.locator(".st-reset").click()
    assert page.locator(".st-step-label").inner_text() == f"step 0 of {last}"
    assert page.locator(".st-back").is_disabled()
    page.locator(".st-next").click()
    assert page.locator(".st-step-label").inner_text() == f"step 1 of {last}"
    assert page.problems == []


def test_the_grids_follow_the_step_and_nothing_overflows_or_reads_wrong(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for index, work in enumerate(data["workloads"]):
            page.select_option(".st-pick", str(index))
            last = max(len(r["trace"]) for r in work["runs"]) - 1
            for step in sorted({0, last // 2, last}):
                if step == last:
                    page.locator(".st-end").click()
                else:
                    go_to(page, "st", step)
                seen = page.evaluate("""() => {
                    const out = [];
                    for (const p of document.querySelectorAll('.st-panel')) {
                        const box = p.querySelector('.st-grid-box').getBoundingClientRect();
                        const now = p.querySelectorAll('.st-grid tr')[0]
                            .querySelectorAll('th')[%d + 1].getBoundingClientRect();
                        const req = p.querySelector('.st-requests');
                        out.push({inView: now.left >= box.left - 0.5 && now.right <= box.right + 0.5,
                                  fits: req.scrollWidth <= req.clientWidth});
                    }
                    return {panels: out, text: document.querySelector('.st-sim').innerText};
                }""" % step)
                for panel in seen["panels"]:
                    assert panel["inView"] and panel["fits"], (work["id"], step)
                assert not re.search(r"\b1 (requests|tokens|steps|decodes)\b", seen["text"])
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
