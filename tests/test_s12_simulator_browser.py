"""The S12 "Try it" block allocator, in a real browser, shows what the engine did.

A minimal page (no site build) loads site/static/course.js, this simulator's script and the data
exported by site/simulators/block-allocator/export.py (the exporter the site runs; its data is
held against independent oracles in tests/test_s12_simulator_data.py). Playwright drives
Debian's Chromium. For every exported workload, at the first step, every step with a
preemption or a finish, a middle one and the last:

- the pool grid has one cell per block: block 0 the null block, every block that a request
  holds after the step (its block table in the trace, less those of the requests that finished
  in it) coloured as that request's, with the tokens it holds in that block, and every other
  block free; the free-queue line lists the exported free queue, front first;
- each request's row shows the block table the trace gives it (empty once preempted or
  finished), its tokens, its waste (positions held less tokens) and the slots its scheduled
  tokens were written to;
- the note names each preemption and finish with the blocks it gave back, last block first,
  and says why each preemption happened: which request needed which block, how many were
  free, and that the last admitted was chosen, itself when it was the one that asked;
- the totals line counts the blocks in use and what a contiguous cache would reserve;
- the consistency banner stays hidden and there are no console errors; at a page as narrow as
  the site's text column nothing overflows sideways; the pool's grid is one row when the
  blocks fit, else rows of equal length (no block alone on a row).
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import math

import pytest
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("block-allocator", "s12_sim_export_browser")
page = page_fixture("block-allocator", ".ba-pool", "s12-chromium-")


def held_after(st: dict) -> dict[str, list[int]]:
    """Block tables after the step, from the trace: the scheduled requests' tables, less those
    of the requests that finished in the step."""
    return {rid: t for rid, t in st["block_tables"].items() if rid not in st["left"]}


def test_every_workload_replays_the_engine(page, data):
    assert page.locator(".ba-banner").is_hidden()
    for index, work in enumerate(data["workloads"]):
        page.select_option(".ba-pick", str(index))
        steps, bs = work["steps"], work["block_size"]
        last = len(steps) - 1
        busy = {k for k, st in enumerate(steps) if st["preempted"] or st["left"]}
        assert busy, work["id"]
        for step in sorted({0, last // 2, last, *busy}):
            go_to(page, "ba", step)
            st = steps[step]
            tables = held_after(st)
            tokens = {rid: c + n for rid, c, n in st["scheduled"]}
            cells = page.evaluate("""() => Array.from(document.querySelectorAll('.ba-block')).map(c =>
                [Number(c.dataset.block), c.dataset.owner, c.dataset.fill || null])""")
            assert [c[0] for c in cells] == list(range(work["num_blocks"]))
            owner = {b: (rid, j) for rid, t in tables.items() for j, b in enumerate(t)}
            for block, who, fill in cells:
                if block == data["null_block"]:
                    assert who == "null"
                elif block in owner:
                    rid, j = owner[block]
                    assert who == rid, (work["id"], step, block)
                    assert int(fill) == max(0, min(bs, tokens[rid] - j * bs))
                else:
                    assert who == "" and block in st["free_queue"], (work["id"], step, block)
            queue = page.locator(".ba-queue").inner_text()
            assert queue.endswith(", ".join(map(str, st["free_queue"])) or "empty"), queue
            rows = page.evaluate("""() => Array.from(document.querySelectorAll('.ba-req')).map(r =>
                [r.dataset.rid, r.querySelector('.ba-table-ids').textContent,
                 r.querySelector('.ba-tokens').textContent, r.querySelector('.ba-waste').textContent,
                 r.querySelector('.ba-slots').textContent])""")
            assert [r[0] for r in rows] == [q["id"] for q in work["requests"]]
            for rid, shown, tok, waste, slots in rows:
                table = tables.get(rid, [])
                assert shown == "[" + ", ".join(map(str, table)) + "]", (work["id"], step, rid)
                if table:
                    assert int(tok) == tokens[rid] and len(table) == math.ceil(tokens[rid] / bs)
                    assert int(waste) == len(table) * bs - tokens[rid]
                if rid in st["slot_mapping"]:
                    head = ", ".join(map(str, st["slot_mapping"][rid][:8]))
                    assert head in slots, (rid, slots)
            note = page.locator(".ba-note").inner_text()
            assert note.startswith(f"Step {step}:")
            causes, said = list(st["preemptions"]), 0
            assert [c["victim"] for c in causes] == st["preempted"]
            for kind, rid, ids in st["events"]:
                words = f"block{'s' if len(ids) > 1 else ''} " + ", ".join(map(str, ids))
                if kind == "freed" and rid in st["preempted"]:
                    c = causes.pop(0)
                    assert c["victim"] == rid
                    asked = (f"request {c['by']} needs a {ordinal(c['needed'])} block"
                             if c["needed"] - c["held"] == 1 else
                             f"request {c['by']} needs {c['needed'] - c['held']} more blocks")
                    assert asked in note and f"for {c['tokens']} tokens" in note, note
                    assert ("none is free" if c["free"] == 0 else f"only {c['free']}") in note
                    chosen = ("it is the last admitted, so it preempts itself: " if c["by"] == rid
                              else f"so request {rid}, the last admitted, is preempted: ")
                    phrase = f"{chosen}{words} back to the free queue"
                elif kind == "freed" and rid in st["left"]:
                    phrase = f"request {rid} finished: {words} back"
                elif kind == "allocated":
                    phrase = f"request {rid} takes {words}"
                else:
                    phrase = f"{words} back"
                assert phrase in note[said:], note                 # in the order they happened
                said = note.index(phrase, said) + len(phrase)
            used = work["num_blocks"] - 1 - st["free_blocks"]
            totals = page.locator(".ba-totals").inner_text()
            assert totals.startswith(f"After the step: {used} of {work['num_blocks'] - 1} usable")
            running = len(tables)
            assert f"{running * data['max_context']}." in totals
    assert page.problems == []


def ordinal(n: int) -> str:
    return f"{n}{'th' if 11 <= n % 100 <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def test_a_self_preemption_says_why(page, data):
    # The tight run has a request that needs a block when none is free and is itself the last
    # admitted (S10's rule picks it): the note must say so, not just that it was preempted.
    work = next(w for w in data["workloads"] if w["id"] == "tight")
    page.select_option(".ba-pick", str(data["workloads"].index(work)))
    selves = [(st["step"], c) for st in work["steps"] for c in st["preemptions"]
              if c["by"] == c["victim"]]
    assert selves
    for step, c in selves:
        go_to(page, "ba", step)
        note = page.locator(".ba-note").inner_text()
        assert f"request {c['by']} needs" in note and "it preempts itself" in note, note
    assert ordinal(4) == "4th" and ordinal(12) == "12th" and ordinal(22) == "22nd"
    assert page.problems == []


def test_the_pool_grid_fits_a_row_or_wraps_evenly(page, data):
    try:
        for width in (1280, 760, 420, 300):
            page.set_viewport_size({"width": width, "height": 1400})
            for index, work in enumerate(data["workloads"]):
                page.select_option(".ba-pick", str(index))
                go_to(page, "ba", 0)
                tops = page.evaluate("""() => Array.from(document.querySelectorAll('.ba-block'))
                    .map(c => Math.round(c.getBoundingClientRect().top))""")
                rows = [tops.count(t) for t in sorted(set(tops))]
                assert sum(rows) == work["num_blocks"]
                assert rows[0] == max(rows) and max(rows) - min(rows) <= 1, (width, rows)
                if width >= 760:
                    assert len(rows) == 1, (width, rows)          # 14 or 15 blocks: one row
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []


def test_buttons_move_one_step(page, data):
    page.select_option(".ba-pick", "0")
    last = len(data["workloads"][0]["steps"]) - 1
    page.locator(".ba-end").click()
    assert page.locator(".ba-step-label").inner_text() == f"step {last} of {last}"
    assert page.locator(".ba-next").is_disabled()
    page.locator(".ba-reset").click()
    assert page.locator(".ba-step-label").inner_text() == f"step 0 of {last}"
    assert page.locator(".ba-back").is_disabled()
    page.locator(".ba-next").click()
    assert page.locator(".ba-step-label").inner_text() == f"step 1 of {last}"
    assert page.problems == []


def test_nothing_overflows_at_the_text_column_width(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for index in range(len(data["workloads"])):
            page.select_option(".ba-pick", str(index))
            page.locator(".ba-end").click()
            fits = page.evaluate("""() => {
                const sim = document.querySelector('.ba-sim');
                const box = document.querySelector('.ba-tables');
                return sim.scrollWidth <= sim.clientWidth + 1 && box.scrollWidth <= box.clientWidth + 1;
            }""")
            assert fits, index
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
