"""The S13 "Try it" prefix cache in a real browser: it replays the exported runs exactly.

A minimal page loads site/static/course.js, course.css, the page's script and the data
exported by site/simulators/prefix-cache/export.py (the exporter the site runs; its data is held
against independent oracles in tests/test_s13_simulator_data.py). Playwright drives Debian's
Chromium. For every exported workload, at the first step, every step with a hit, an eviction or
a finish, a middle one and the last:

- the pool shows one cell per block; each cell's reference count is the number of block tables
  the trace says hold it after the step (the scheduled ones, less those that finished), its
  name is the trace's cached name, and its kind follows from both (null, held, shared, free
  and still cached, free with no name), and a held block with a name is marked apart from one
  without; the blocks the trace hit, evicted or cached in the step are marked;
- the legend names every mark the pool uses: held without and with a name, shared, free and
  cached, free, the null block, hit, evicted and named in this step, and each swatch carries the
  classes of the cells it explains;
- the free queue, front first, is the trace's;
- the note names each admission with its cached / total tokens, the evicted blocks and each
  finished request's blocks in the order given back; the request table shows each admitted
  request's cached / total tokens and its block table with the shared blocks' counts;
- the consistency banner stays hidden and there are no console errors; at the last step every
  request shows the engine's text and finish reason; at a page as narrow as the site's text
  column the pool wraps and the request table fits its box.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import re

import pytest
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("prefix-cache", "s13_sim_export_browser")
page = page_fixture("prefix-cache", ".pc-grid", "s13-chromium-")


def expected_pool(work: dict, k: int) -> list[tuple[str, int, str]]:
    """(kind, ref_cnt, name) of every block after step k, from the trace alone."""
    rec = work["trace"][k]
    refs = [0] * work["num_blocks"]
    for rid, table in zip(rec["running"], rec["block_tables"]):
        if rid not in rec["left"]:
            for b in table:
                refs[b] += 1
    names = {b: h for b, h in rec["cached_blocks"]}
    out = []
    for b in range(work["num_blocks"]):
        if b == 0:
            kind = "pc-null"
        elif refs[b] > 1:
            kind = "pc-shared"
        elif refs[b] == 1:
            kind = "pc-held"
        else:
            kind = "pc-cached-free" if b in names else "pc-free"
        out.append((kind, refs[b], names.get(b, "")))
    return out


def marked(work: dict, k: int, kind: str) -> set[int]:
    return {b for ev, _, ids in work["trace"][k]["block_events"] if ev == kind for b in ids}


def test_every_workload_replays_the_engine(page, data):
    assert page.locator(".pc-banner").is_hidden()
    for index, work in enumerate(data["workloads"]):
        page.select_option(".pc-pick", str(index))
        trace = work["trace"]
        last = len(trace) - 1
        busy = {k for k, rec in enumerate(trace) if rec["cache_hits"] or rec["left"] or any(
            ev == "evicted" for ev, _, _ in rec["block_events"])}
        assert busy, work["id"]
        for k in sorted({0, last // 2, last, *busy}):
            go_to(page, "pc", k)
            cells = page.evaluate("""() => Array.from(document.querySelectorAll('.pc-grid .pc-block'))
                .map(c => [c.className, Number(c.dataset.block), Number(c.dataset.ref), c.dataset.name])""")
            want = expected_pool(work, k)
            assert [c[1] for c in cells] == list(range(work["num_blocks"]))
            for (cls, b, ref, name), (kind, want_ref, want_name) in zip(cells, want):
                classes = cls.split()
                assert kind in classes and ref == want_ref and name == want_name, (
                    work["id"], k, b, cls, ref, name)
                assert ("pc-named" in classes) == (b > 0 and want_ref > 0 and want_name != ""), (
                    work["id"], k, b, cls)                  # held and named: the green bar
                for ev, mark in (("hit", "pc-hit-now"), ("evicted", "pc-evicted-now"),
                                 ("cached", "pc-cached-now")):
                    assert (mark in classes) == (b in marked(work, k, ev)), (work["id"], k, b, ev)
            queue = page.evaluate("""() => Array.from(document.querySelectorAll('.pc-queue .pc-chip'))
                .map(c => Number(c.dataset.block))""")
            assert queue == trace[k]["free_queue"]
            note = page.locator(".pc-note").inner_text()
            assert note.startswith(f"Step {k}: {trace[k]['num_tokens']} token")
            for rid, hit, total in trace[k]["cache_hits"]:
                assert f"request {rid} admitted: {hit} of {total} tokens found cached" in note
            evicted = [b for ev, _, ids in trace[k]["block_events"] if ev == "evicted" for b in ids]
            if evicted:
                assert ", ".join(map(str, evicted)) + " evicted" in note, note
            for ev, rid, ids in trace[k]["block_events"]:
                if ev == "freed":
                    assert (f"request {rid} finished: gives back {', '.join(map(str, ids))} "
                            "(last block first)") in note, note
            found = page.locator(".pc-found").all_inner_texts()
            seen = {rid: (n, t) for rec in trace[:k + 1] for rid, n, t in rec["cache_hits"]}
            for req, text in zip(work["requests"], found):
                want_text = f"{seen[req['id']][0]} of {seen[req['id']][1]}" if req["id"] in seen \
                    else "not yet"
                assert text == want_text, (work["id"], k, req["id"])
            tables = page.evaluate("""() => Array.from(document.querySelectorAll('.pc-table'))
                .map(td => Array.from(td.querySelectorAll('.pc-chip')).map(c => c.textContent))""")
            for req, chips in zip(work["requests"], tables):
                if req["id"] in trace[k]["running"] and req["id"] not in trace[k]["left"]:
                    at = trace[k]["running"].index(req["id"])
                    want_chips = [f"{b}\u00d7{want[b][1]}" if want[b][1] > 1 else str(b)
                                  for b in trace[k]["block_tables"][at]]
                    assert chips == want_chips, (work["id"], k, req["id"], chips)
        go_to(page, "pc", last)
        texts = page.locator(".pc-text").all_inner_texts()
        statuses = page.locator(".pc-status").all_inner_texts()
        assert len(texts) == len(work["requests"])
        for req, text, status in zip(work["requests"], texts, statuses):
            assert text == req["text"].replace("\n", "\u21b5")
            assert status.startswith(f"{len(req['generated'])} token")
            assert f"({req['finish_reason']})" in status
    assert page.problems == []


def test_the_legend_explains_every_mark(page, data):
    items = page.evaluate("""() => Array.from(document.querySelectorAll('.pc-legend .pc-legend-item'))
        .map(i => [i.querySelector('.pc-swatch').className, i.textContent])""")
    legend = {text: set(cls.split()) - {"pc-swatch"} for cls, text in items}
    want = {"held by one request, no name yet": {"pc-held"},
            "held and named": {"pc-held", "pc-named"},
            "held by several": {"pc-shared", "pc-named"},
            "free, still cached": {"pc-cached-free"}, "free, no name": {"pc-free"},
            "the null block": {"pc-null"}, "hit in this step": {"pc-hit-now"},
            "name evicted in this step": {"pc-evicted-now"},
            "named in this step (dark-green dot)": {"pc-cached-now"}}
    for words, classes in want.items():
        assert [c for text, c in legend.items() if words in text] == [classes], (words, legend)
    # The marks differ on the page: a held block with a name shows the bar, one without none.
    bars = page.evaluate("""() => ['pc-held', 'pc-held pc-named'].map(k => {
        const s = document.querySelector('.pc-legend .pc-swatch.' + k.split(' ').join('.') +
                                          (k === 'pc-held' ? ':not(.pc-named)' : ''));
        return getComputedStyle(s, '::before').content; })""")
    assert bars[0] in ("none", "normal") and bars[1] not in ("none", "normal"), bars
    dot = page.evaluate("""() => getComputedStyle(
        document.querySelector('.pc-legend .pc-swatch.pc-cached-now'), '::after').content""")
    assert dot not in ("none", "normal"), dot
    assert page.problems == []


def test_buttons_move_one_step(page, data):
    page.select_option(".pc-pick", "0")
    last = len(data["workloads"][0]["trace"]) - 1
    page.locator(".pc-end").click()
    assert page.locator(".pc-step-label").inner_text() == f"step {last} of {last}"
    assert page.locator(".pc-next").is_disabled()
    page.locator(".pc-reset").click()
    assert page.locator(".pc-step-label").inner_text() == f"step 0 of {last}"
    assert page.locator(".pc-back").is_disabled()
    page.locator(".pc-next").click()
    assert page.locator(".pc-step-label").inner_text() == f"step 1 of {last}"
    assert page.problems == []


def test_nothing_overflows_or_reads_wrong_on_a_narrow_page(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for index, work in enumerate(data["workloads"]):
            page.select_option(".pc-pick", str(index))
            last = len(work["trace"]) - 1
            for step in sorted({0, last // 2, last}):
                go_to(page, "pc", step)
                seen = page.evaluate("""() => {
                    const body = document.querySelector('.pc-body');
                    const req = document.querySelector('.pc-requests');
                    const grid = document.querySelector('.pc-grid');
                    return {fits: req.scrollWidth <= req.clientWidth,
                            wraps: grid.scrollWidth <= body.clientWidth + 1,
                            text: document.querySelector('.pc-sim').innerText};
                }""")
                assert seen["fits"] and seen["wraps"], (work["id"], step)
                assert not re.search(r"\b1 (requests|tokens|steps|blocks|admissions)\b",
                                     seen["text"])
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
