"""The S17 tiled-attention simulator in a real browser: offline, equal to the Python replay and
to the references, and never showing a number that is not finite.

The page (site/simulators/tiled-attention/simulator.js) gets the data of
site/simulators/tiled-attention/export.py (code/s17_flash.py's trace; its numbers are held to
independent oracles in tests/test_s17_simulator_data.py). Playwright drives Debian's Chromium:

- on load the page recomputes every tile visit and the paged walk and finds them equal to the
  torch trace (no banner, no console error), and it loaded nothing but its own files;
- for every case and every (block_m, block_n), stepped to the end, the tiles drawn are
  `tile_states`' with every visited tile folded in, and for the first and last rows
  the table shows `replay_tiles`' m, rescale, l and output after each of the row's tiles
  (doubles, to 1e-12) and a final output equal to the exported torch.softmax(scores) @ v; the
  paged walk, stepped to the end, reads `replay_paged`'s blocks and ends equal to the exported
  gather + SDPA;
- controls set to values they do not offer (a case, a tile size, a row that does not exist,
  the sliders past either end), and the "large" case whose scores would overflow e^score in
  float32: the page stays on a valid setting and every number it shows or carries is finite;
  nothing overflows sideways at the text column's width.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json
import math

import pytest

from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser]
skip_without_browser()

ta = load_exporter("tiled-attention", "s17_sim_export_browser")

STATE = """() => ({
  tiles: Array.from(document.querySelectorAll('rect.fa-tile')).map(r => [
    Number(r.dataset.i0), Number(r.dataset.j0), r.dataset.state, r.dataset.status]),
  visits: Array.from(document.querySelectorAll('tr.fa-visit')).map(tr => ({
    j0: Number(tr.dataset.j0), seen: Number(tr.dataset.seen), m: Number(tr.dataset.m),
    l: Number(tr.dataset.l), alpha: Number(tr.dataset.alpha), out: JSON.parse(tr.dataset.out)})),
  final: Object.assign({}, document.querySelector('.fa-final').dataset),
  label: document.querySelector('.fa-step-label').textContent,
  row: document.querySelector('.fa-qrow').value})"""
WALK = """() => ({
  blocks: Array.from(document.querySelectorAll('tr.pw-block')).map(tr => ({
    j: Number(tr.dataset.j), block: Number(tr.dataset.block), n: Number(tr.dataset.n),
    m: Number(tr.dataset.m), l: Number(tr.dataset.l), alpha: Number(tr.dataset.alpha),
    out: JSON.parse(tr.dataset.out)})),
  final: Object.assign({}, document.querySelector('.pw-final').dataset),
  current: Array.from(document.querySelectorAll('rect.pw-slot')).filter(
    r => r.dataset.kind === 'current').map(
    r => [Number(r.dataset.block), Number(r.dataset.offset)])})"""
NUMBERS = """() => {
  const sim = document.querySelector('.fa-sim');
  const attrs = [];
  sim.querySelectorAll('*').forEach(node => {
    for (const [k, v] of Object.entries(node.dataset || {})) attrs.push([k, v]);
  });
  return {text: sim.innerText, attrs: attrs,
          step: document.querySelector('.fa-step-label').textContent,
          fits: sim.scrollWidth <= sim.clientWidth + 1};
}"""


@pytest.fixture(scope="module")
def data():
    return json.loads(ta.text(ta.export()))


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("tiled_attention_page"), "tiled-attention", data)
    with open_page(html, ".fa-grid", "s17-chromium-") as pg:
        yield pg


def close(a: float, b: float, rel: float = 1e-12) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


SHOW = """([settings, state]) => {
  for (const [selector, value, event] of settings) {
    const node = document.querySelector(selector);
    node.value = value;
    node.dispatchEvent(new Event(event));
  }
  return (""" + STATE + """)();
}"""


def show(pg, case: int, bm: int, bn: int, row: int | None = None) -> dict:
    """Case (index), block_m and block_n (sizes), stepped to the end (the slider set past its
    last step: a range input clamps), then row (index); one round trip, as a reader's choices
    fire change and input events."""
    settings = [[".fa-case", str(case), "change"], [".fa-bm", str(bm), "change"],
                [".fa-bn", str(bn), "change"], [".fa-slider", "1000", "input"]]
    if row is not None:
        settings.append([".fa-qrow", str(row), "change"])
    return pg.evaluate(SHOW, [settings, None])


def test_the_page_loads_offline_and_reproduces_the_trace(page, data):
    assert page.locator(".fa-banner").is_hidden()
    visits = sum(len(s["visits"]) for c in data["cases"] for s in c["settings"])
    text = page.locator(".fa-check").inner_text()
    assert f"recomputed all {visits} tile visits of the 18 settings" in text
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.reload()                                  # every request of a load, recorded
    page.wait_for_selector(".fa-grid")
    assert len(requests) >= 4 and all(r.startswith("file://") for r in requests), requests
    assert page.locator(".fa-banner").is_hidden()
    first = page.evaluate(STATE)                             # the defaults, before any tile
    assert first["row"] == str(data["defaults"]["row"]) and first["label"].startswith("tile 0 of")
    assert first["visits"] == [] and first["final"]["finished"] == "false"
    assert page.problems == []


def test_stepping_to_the_end_gives_the_replay_and_the_reference(page, data):
    tol = data["tolerance"]
    for c, case in enumerate(data["cases"]):
        for setting in case["settings"]:
            bm, bn = setting["block_m"], setting["block_n"]
            replay = ta.replay_tiles(case["scores"], case["values"], bm, bn)
            states = ta.tile_states(case["t_len"], case["s_len"], bm, bn)
            order = {(v["i0"], v["j0"]): k for k, v in enumerate(replay)}
            rows = [0, case["t_len"] - 1]
            for n, row in enumerate(rows):
                got = show(page, c, bm, bn, row)
                assert got["label"] == f"tile {len(replay)} of {len(replay)}"
                if n == 0:
                    want_tiles = [[a * bm, b * bn, s,
                                   "skipped" if s == "skipped" else
                                   "current" if order[a * bm, b * bn] == len(replay) - 1
                                   else "done"]
                                  for a, line in enumerate(states) for b, s in enumerate(line)]
                    assert got["tiles"] == want_tiles, (case["id"], bm, bn)
                r = row % bm
                mine = [(v["j0"], v["rows"][r]) for v in replay if v["i0"] == row - r]
                assert len(got["visits"]) == len(mine), (case["id"], bm, bn, row)
                for shown, (j0, want) in zip(got["visits"], mine):
                    assert shown["j0"] == j0 and shown["seen"] == want["seen"]
                    assert shown["m"] == want["m"]
                    assert close(shown["alpha"], want["alpha"]) and close(shown["l"], want["l"])
                    out = [a / want["l"] for a in want["acc"]]
                    assert all(close(x, y) for x, y in zip(shown["out"], out))
                final = got["final"]
                assert final["finished"] == "true"
                assert json.loads(final["reference"]) == case["reference"][row]
                assert all(abs(x - y) <= tol * (1 + abs(y)) for x, y in
                           zip(json.loads(final["out"]), case["reference"][row]))
                assert float(final["diff"]) <= tol
    pg = data["paged"]
    page.click(".pw-end")
    walk = page.evaluate(WALK)
    replay = ta.replay_paged(pg["q"], pg["k_pool"], pg["v_pool"], pg["block_table"],
                             pg["seq_len"], pg["block_size"], data["scale"])
    assert [(b["j"], b["block"], b["n"]) for b in walk["blocks"]] == \
        [(w["j"], w["block"], w["n"]) for w in replay]
    for shown, want in zip(walk["blocks"], replay):
        assert shown["m"] == want["m"] and close(shown["l"], want["l"])
        assert close(shown["alpha"], want["alpha"])
        assert all(close(x, a / want["l"]) for x, a in zip(shown["out"], want["acc"]))
    last = replay[-1]
    assert sorted(walk["current"]) == [[last["block"], o] for o in range(last["n"])]
    assert walk["final"]["finished"] == "true" and float(walk["final"]["diff"]) <= tol
    assert all(abs(x - y) <= tol * (1 + abs(y))
               for x, y in zip(json.loads(walk["final"]["out"]), pg["reference"]))
    assert page.locator(".fa-banner").is_hidden()
    assert page.problems == []


def assert_all_finite(pg) -> None:
    got = pg.evaluate(NUMBERS)
    for word in ("NaN", "Infinity", "undefined"):
        assert word not in got["text"], word
    for key, value in got["attrs"]:
        for x in value.replace("[", " ").replace("]", " ").replace(",", " ").split():
            try:
                number = float(x)
            except ValueError:
                continue
            assert math.isfinite(number), (key, value)
    step, last = (int(x) for x in got["step"].split()[1::2])
    assert 0 <= step <= last
    assert got["fits"], "the simulator overflows the text column sideways"


def test_bad_and_extreme_controls_show_only_finite_numbers(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        large = [c["id"] for c in data["cases"]].index("large")
        for bm in data["block_ms"]:
            got = show(page, large, bm, data["block_ns"][0], 0)
            assert got["final"]["finished"] == "true"
            assert_all_finite(page)
            for fill in ("-5", "3", "1000"):
                page.locator(".fa-slider").fill(fill)
                assert_all_finite(page)
        # values no option offers: the page falls back to a valid choice
        for selector, value in ((".fa-case", "7"), (".fa-bm", "-1"), (".fa-bn", "3"),
                                (".fa-qrow", "99"), (".fa-case", "abc")):
            page.evaluate("""([selector, value]) => {
                const s = document.querySelector(selector);
                const o = document.createElement('option');
                o.value = value;
                o.textContent = 'bad';
                s.appendChild(o);
                s.value = value;
                s.dispatchEvent(new Event('change'));
            }""", [selector, value])
            assert page.locator(selector).input_value() != value, selector
            assert_all_finite(page)
        show(page, large, 4, 8, 11)                   # past the rows of a shorter case
        page.select_option(".fa-case", value=str([c["id"] for c in data["cases"]].index("chunk")))
        assert page.locator(".fa-qrow").input_value() == "5"
        assert_all_finite(page)
        for fill in ("-1", "2", "99"):
            page.locator(".pw-slider").fill(fill)
            assert_all_finite(page)
        page.click(".pw-reset")
        assert_all_finite(page)
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.locator(".fa-banner").is_hidden()
    assert page.problems == []
