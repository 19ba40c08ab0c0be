"""The S19 "Try it" SSE stream in a real browser: it shows the recorded stream line for line
and reads it as the official client did.

A minimal page loads site/static/course.js, course.css, the simulator's script and the data
exported by site/simulators/sse-stream/export.py (held against independent oracles in
tests/test_s19_simulator_data.py). Playwright drives Debian's Chromium. For every scenario, at
every position (before any step, after each engine step, after the last one):

- the wire pane shows exactly the lines sent so far, in order, those of the current position
  marked new; "(nothing sent yet)" when there are none;
- the step table has one row per engine step, the current one marked and the later ones
  marked future, each past row with its count of chunks; the note says how many chunks the
  step sent, or why it sent none;
- the client pane shows, per choice, the text joined from the lines so far (worked out here
  from the exported lines with json), its finish_reason once sent, the usage once sent, and
  [DONE] only at the end, where the texts are the exported "expected" ones;
- the wire pane (which scrolls) shows its newest line at every position, and at the end the
  usage chunk and [DONE];
- the consistency banner stays hidden and there are no console errors; the buttons move one
  position; at a page as narrow as the site's text column nothing overflows sideways.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json

import pytest
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()


data = data_fixture("sse-stream", "s19_sim_export_browser", requires=("openai",))
page = page_fixture("sse-stream", ".sse-lines", "s19-chromium-")


def positions(sc: dict) -> list[list[str]]:
    return [sc["start"]] + [s["lines"] for s in sc["steps"]] + [sc["end"]]


def client_view(lines: list[str], n: int) -> tuple[list[str], list[str], dict | None, bool]:
    texts, reasons, usage, done = [""] * n, ["null (still streaming)"] * n, None, False
    for line in lines:
        data = line[len("data: "):].strip()
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            texts[c["index"]] += (c["delta"].get("content") or "") if "delta" in c \
                else c["text"]
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, usage, done


def test_every_position_shows_the_stream_and_the_client_reading(page, data):
    assert page.locator(".sse-banner").is_hidden()
    for index, sc in enumerate(data["scenarios"]):
        page.select_option(".sse-pick", str(index))
        pos = positions(sc)
        n = len(sc["choice_ids"])
        for k in range(len(pos)):
            go_to(page, "sse", k, label="label", ends_with=f"({k + 1} of {len(pos)})")
            sent = [line for p in pos[:k + 1] for line in p]
            shown = page.evaluate("""() => Array.from(document.querySelectorAll('.sse-line'))
                .map(e => [e.textContent, e.classList.contains('sse-new')])""")
            assert [s for s, _ in shown] == [line.rstrip("\n") for line in sent], (sc["id"], k)
            assert [new for _, new in shown] == [False] * (len(sent) - len(pos[k])) + [
                True] * len(pos[k])
            if not sent:
                assert page.locator(".sse-empty").inner_text() == "(nothing sent yet)"
            rows = page.evaluate("""() => Array.from(document.querySelectorAll('tr.sse-step'))
                .map(r => [r.className, r.querySelector('.sse-count').textContent])""")
            assert len(rows) == len(sc["steps"])
            for j, (cls, chunk_count) in enumerate(rows):
                assert ("sse-now" in cls) == (j + 1 == k) and ("sse-future" in cls) == (j + 1 > k)
                assert chunk_count == (str(len(sc["steps"][j]["lines"])) if j + 1 <= k else "")
            note = page.locator(".sse-note").inner_text()
            if 1 <= k <= len(sc["steps"]):
                s = sc["steps"][k - 1]
                assert note.startswith(f"Step {s['step']} computed {s['num_tokens']} of "
                                       f"{s['token_budget']} tokens"), note
                m = len(s["lines"])
                assert (f"the server sends {m} chunk{'' if m == 1 else 's'}" in note) == (m > 0)
                mine = [x for x in s["scheduled"] if x["id"] in sc["choice_ids"]]
                if not m and mine:
                    assert "nothing is sent: no row of this request sampled" in note
            texts, reasons, usage, done = client_view(sent, n)
            assert page.locator(".sse-text").all_inner_texts() == [json.dumps(t) for t in texts]
            assert page.locator(".sse-reason").all_inner_texts() == reasons
            usage_text = page.locator(".sse-usage").inner_text()
            if usage:
                assert usage_text == (f"usage: {usage['prompt_tokens']} prompt + "
                                      f"{usage['completion_tokens']} completion = "
                                      f"{usage['total_tokens']} tokens")
            elif "stream_options" in sc["request"]:
                assert usage_text == "usage: not yet (it comes last)"
            else:
                assert usage_text == "usage: not asked for (stream_options.include_usage)"
            assert page.locator(".sse-done").inner_text().startswith(
                "[DONE] received" if done else "[DONE] not received")
        assert texts == [c["text"] for c in sc["expected"]["choices"]]
        assert done and k == len(pos) - 1
    assert page.problems == []


def test_the_wire_pane_scrolls_to_its_newest_line(page, data):
    # At every position the last line sent so far is inside the pane's visible box, and at
    # the end the last two lines are the usage chunk (when asked for) and [DONE]; at least
    # one scenario's stream is taller than the pane, so the pane really had to scroll.
    scrolled = 0
    for index, sc in enumerate(data["scenarios"]):
        page.select_option(".sse-pick", str(index))
        pos = positions(sc)
        for k in range(len(pos)):
            go_to(page, "sse", k, label="label", ends_with=f"({k + 1} of {len(pos)})")
            box = page.evaluate("""() => {
                const pane = document.querySelector('.sse-lines');
                const lines = pane.querySelectorAll('.sse-line');
                if (!lines.length) return null;
                const last = lines[lines.length - 1].getBoundingClientRect();
                const view = pane.getBoundingClientRect();
                return {top: last.top - view.top, bottom: view.bottom - last.bottom,
                        overflow: pane.scrollHeight - pane.clientHeight,
                        scrollTop: pane.scrollTop, text: lines[lines.length - 1].textContent};
            }""")
            if box is None:
                continue
            assert box["top"] >= -1 and box["bottom"] >= -1, (sc["id"], k, box)
            if k == len(pos) - 1:
                assert box["text"] == "data: [DONE]"
                if box["overflow"] > 0:
                    scrolled += 1
                    assert box["scrollTop"] > 0
        shown = page.locator(".sse-line").all_inner_texts()
        if sc["expected"]["usage"] is not None:
            assert '"usage": {' in shown[-2] and '"choices": []' in shown[-2]
            usage_line = page.locator(".sse-line").nth(len(shown) - 2).bounding_box()
            pane = page.locator(".sse-lines").bounding_box()
            assert usage_line["y"] >= pane["y"] - 1, sc["id"]      # the usage chunk is in view
    assert scrolled >= 1, "no stream outgrew the pane: the scroll went untested"
    assert page.problems == []


def test_buttons_move_one_position(page, data):
    page.select_option(".sse-pick", "0")
    total = len(positions(data["scenarios"][0]))
    page.locator(".sse-end").click()
    assert page.locator(".sse-label").inner_text().endswith(f"({total} of {total})")
    assert page.locator(".sse-next").is_disabled()
    page.locator(".sse-reset").click()
    assert page.locator(".sse-label").inner_text() == f"request accepted (1 of {total})"
    assert page.locator(".sse-back").is_disabled()
    page.locator(".sse-next").click()
    step = data["scenarios"][0]["steps"][0]["step"]
    assert page.locator(".sse-label").inner_text() == f"step {step} (2 of {total})"
    assert page.problems == []


def test_nothing_overflows_at_the_text_column_width(page, data):
    page.set_viewport_size({"width": 700, "height": 1400})
    try:
        for index, sc in enumerate(data["scenarios"]):
            page.select_option(".sse-pick", str(index))
            page.locator(".sse-end").click()
            fits = page.evaluate("""() => {
                const sim = document.querySelector('.sse-sim');
                return sim.scrollWidth <= sim.clientWidth + 1 &&
                       document.documentElement.scrollWidth <= window.innerWidth + 1;
            }""")
            assert fits, sc["id"]
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
