"""The S05 "Try it" simulator in a real browser: its numbers are S05's closed forms, exactly.

A minimal page loads site/static/course.js, the simulator's script and the data exported by
site/simulators/kv-cache/export.py (the same exporter the site runs; its values are checked
against the work S05's count_work counts on the bundled model in
tests/test_s05_simulator_data.py). Playwright drives Debian's Chromium:

- for every setting of the exported grid (four model shapes, float32 and bfloat16, cache on and
  off), the page's own arithmetic gives the Python values at the exported passes, and the
  totals, as exact integers; so does the crossover context;
- driving the controls (model, dtype, prompt, new tokens, the cache toggle, the pass buttons and
  slider) shows those values in the table, digit for digit;
- in the setting count_work measured, the "counted" column equals the measured work;
- no console errors. Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json

import pytest
from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()



@pytest.fixture(scope="module")
def data():
    module = load_exporter("kv-cache", "s05_sim_export_browser")
    return module.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("kv_sim_page"), "kv-cache", data)
    with open_page(html, ".kv-table td", "s05-chromium-") as pg:
        yield pg


def shown(pg, column: str) -> dict[str, str]:
    """{row key: exact integer as digits} of one table column ("pass", "total", "counted")."""
    cells = pg.locator(f".kv-table tr[data-row] td[data-k='{column}']").all()
    rows = pg.locator(".kv-table tr[data-row]").all()
    out = {}
    for row in rows:
        cell = row.locator(f"td[data-k='{column}'] .kv-exact")
        if cell.count():
            out[row.get_attribute("data-row")] = cell.inner_text().replace(",", "")
    assert cells, f"no {column} column"
    return out


def choose(pg, config: str, dtype: int, prompt: int, tokens: int, cached: bool) -> None:
    pg.select_option(".kv-model", config)
    pg.select_option(".kv-dtype", str(dtype))
    pg.fill(".kv-prompt", str(prompt))
    pg.dispatch_event(".kv-prompt", "change")
    pg.fill(".kv-tokens", str(tokens))
    pg.dispatch_event(".kv-tokens", "change")
    if pg.is_checked(".kv-cache-toggle") != cached:
        pg.click(".kv-cache-toggle")


def go_to_pass(pg, i: int) -> None:
    pg.eval_on_selector(".kv-slider", "(s, i) => { s.value = String(i); "
                        "s.dispatchEvent(new Event('input')); }", i)


def test_the_page_computes_every_exported_value(page, data):
    assert data["cases"], "the export has no reference settings"
    for case in data["cases"]:
        got = page.evaluate("c => document.querySelector('.kv-sim').kvSim.reference("
                            "c.config, c.dtype_bytes, c.prompt_len, c.new_tokens, c.cached)", case)
        expected = {k: case[k] for k in ("passes", "shown", "totals")}
        assert got == expected, {k: case[k] for k in ("config", "dtype_bytes", "prompt_len",
                                                       "new_tokens", "cached")}
    for config, by_dtype in data["crossover"].items():
        for dtype, n in by_dtype.items():
            assert page.evaluate(f"document.querySelector('.kv-sim').kvSim.crossover("
                                 f"{json.dumps(config)}, {dtype})") == str(n)
    assert page.problems == []


@pytest.mark.parametrize("setting", [
    ("bundled", 4, 16, 160, False), ("bundled", 4, 1, 1, True), ("bundled", 4, 250, 20, True),
    ("bundled", 2, 200, 56, True), ("qwen3-0.6b", 2, 10000, 800, True),
    ("qwen3-0.6b", 2, 1, 40960, False), ("gpt2", 4, 100, 50, False),
    ("llama3-8b", 2, 4096, 512, True)], ids=str)
def test_the_table_shows_the_exported_values(page, data, setting):
    keys = ("config", "dtype_bytes", "prompt_len", "new_tokens", "cached")
    case = next((c for c in data["cases"] if tuple(c[k] for k in keys) == setting), None)
    if case is None:
        pytest.skip(f"{setting} is not exported (no bundled model in this checkout)")
    choose(page, case["config"], case["dtype_bytes"], case["prompt_len"], case["new_tokens"],
           case["cached"])
    assert page.get_attribute(".kv-sim", "data-passes") == str(case["passes"])
    for ref in case["shown"]:
        go_to_pass(page, ref["pass"])
        assert page.inner_text(".kv-pass-label").startswith(f"pass {ref['pass'] + 1:,} of ")
        assert shown(page, "pass") == ref["values"]
        assert shown(page, "total") == ref["cumulative"]
    assert page.problems == []


def test_buttons_step_pass_by_pass_and_the_toggle_keeps_the_pass(page, data):
    case = next(c for c in data["cases"] if c["config"] == data["configs"][0]["id"]
                and c["cached"] and c["passes"] >= 4)
    choose(page, case["config"], case["dtype_bytes"], case["prompt_len"], case["new_tokens"], True)
    go_to_pass(page, 3)
    page.click(".kv-first")
    assert page.is_disabled(".kv-prev") and page.is_disabled(".kv-first")
    page.click(".kv-next")
    assert shown(page, "pass") == case["shown"][1]["values"]            # pass 2: a decode
    assert shown(page, "pass")["fed"] == "1"
    page.click(".kv-prev")
    assert shown(page, "pass") == case["shown"][0]["values"]            # pass 1: the prefill
    page.click(".kv-last")
    assert page.is_disabled(".kv-next")
    assert shown(page, "total") == case["totals"]
    off = next(c for c in data["cases"] if all(c[k] == case[k] for k in
               ("config", "dtype_bytes", "prompt_len", "new_tokens")) and not c["cached"])
    page.click(".kv-cache-toggle")                                       # off, same last pass
    assert shown(page, "total") == off["totals"]
    assert shown(page, "pass")["kv_written"] == "0"
    assert page.problems == []


def test_a_full_context_and_a_bad_prompt_are_reported(page, data):
    cfg = next(c for c in data["configs"] if c["id"] == "gpt2")
    choose(page, "gpt2", 4, cfg["max_context"] - 3, 10, True)
    assert page.get_attribute(".kv-sim", "data-passes") == "3"
    assert 'finish_reason "length"' in page.inner_text(".kv-status")
    choose(page, "gpt2", 4, cfg["max_context"], 10, True)
    assert page.get_attribute(".kv-sim", "data-passes") == "0"
    assert "no pass is run" in page.inner_text(".kv-status")
    choose(page, "gpt2", 4, cfg["max_context"] + 1, 10, True)
    assert "refused" in page.inner_text(".kv-status")
    assert page.locator(".kv-table td").count() == 0
    assert page.problems == []


def test_the_counted_column_is_the_work_count_work_measured(page, data):
    measured = data["measured"]
    if measured is None:
        pytest.skip("no bundled model in this checkout, so nothing was counted")
    assert "every weight FLOP, attention FLOP and K/V byte is equal" in \
        page.inner_text(".kv-check-note")
    for cached, mode in ((True, "on"), (False, "off")):
        choose(page, measured["config"], measured["dtype_bytes"], measured["prompt_len"],
               measured["new_tokens"], cached)
        for i in (0, 1, measured["new_tokens"] - 1):
            go_to_pass(page, i)
            counted = shown(page, "counted")
            assert [counted[k] for k in ("weight_flops", "attention_flops", "kv_bytes_read")] \
                == measured["runs"][mode][i]
            this_pass = shown(page, "pass")
            assert [this_pass[k] for k in ("weight_flops", "attention_flops", "kv_bytes_read")] \
                == measured["runs"][mode][i]
    assert page.problems == []


def nav_state(pg) -> dict:
    return pg.evaluate("""() => ({
      label: document.querySelector('.kv-pass-label').textContent,
      crossover: document.querySelector('.kv-crossover').textContent,
      compare: document.querySelector('.kv-compare').textContent,
      bars: document.querySelector('.kv-bars').textContent,
      cells: document.querySelectorAll('.kv-table td').length,
      disabled: Array.from(document.querySelectorAll('.kv-nav button, .kv-slider'))
                     .map(b => b.disabled)})""")


def test_an_error_clears_every_result_and_turns_navigation_off(page, data):
    qwen = next(c for c in data["configs"] if c["id"] == "qwen3-0.6b")
    gpt2 = next(c for c in data["configs"] if c["id"] == "gpt2")
    assert gpt2["max_context"] < 10390 <= qwen["max_context"]
    choose(page, "qwen3-0.6b", 2, 10390, 160, True)
    go_to_pass(page, 6)
    before = nav_state(page)
    assert before["label"] == "pass 7 of 160 (decode)" and before["crossover"]
    assert before["disabled"] == [False, False, False, False, False]
    page.select_option(".kv-model", "gpt2")                    # the prompt no longer fits
    assert "refused" in page.inner_text(".kv-status")
    after = nav_state(page)
    assert after == {"label": "", "crossover": "", "compare": "", "bars": "", "cells": 0,
                     "disabled": [True] * 5}
    choose(page, "gpt2", 2, 100, 160, True)                    # valid again: all back
    again = nav_state(page)
    assert again["label"] == "pass 1 of 160 (prefill)" and again["cells"] > 0
    assert again["crossover"] and again["disabled"] == [True, True, False, False, False]
    choose(page, "gpt2", 2, gpt2["max_context"], 10, True)     # no pass at all
    assert nav_state(page)["disabled"] == [True] * 5 and nav_state(page)["crossover"] == ""
    assert page.problems == []


def test_the_pass_slider_has_a_name(page):
    assert page.get_by_role("slider", name="pass").count() == 1


def si(n: int, unit: str) -> str:
    """3 significant digits and the SI prefix that keeps them under 1,000, as the page should."""
    for k, prefix in enumerate("kMGTPEZYRQ", start=1):
        text = f"{n / 1000 ** k:#.3g}".rstrip(".")
        if float(text) < 1000:
            return f"{text} {prefix}{'B' if unit == 'byte' else 'FLOP'}"
    raise AssertionError(n)


def test_sizes_read_with_si_prefixes_and_ratios_with_separators(page, data):
    """The longest uncached run of Qwen3-0.6B passes 10^18 FLOPs: EFLOP, not 6.25e+3 PFLOP;
    and its ratio to the cached run is written 25,924.8, not 25924.8."""
    choose(page, "qwen3-0.6b", 2, 1, 40960, False)
    page.click(".kv-last")
    units = {"flop": ("weight_flops", "attention_flops", "flops"),
             "byte": ("weight_bytes", "kv_bytes_read", "kv_bytes_written", "cache_used")}
    cells = page.evaluate("""() => Array.from(document.querySelectorAll('.kv-table td'))
      .filter(td => td.querySelector('.kv-exact')).map(td => [td.parentNode.dataset.row,
        td.querySelector('.kv-exact').textContent,
        td.querySelector('.kv-approx') ? td.querySelector('.kv-approx').textContent : null])""")
    seen = []
    for unit, keys in units.items():
        for key, exact_text, approx in cells:
            if key not in keys:
                continue
            n = int(exact_text.replace(",", ""))
            assert approx == (None if n < 1000 else f" ({si(n, unit)})"), (key, n)
            seen.append(approx or "")
    assert len(seen) == 13                  # cache_used has no total column
    assert any("EFLOP" in t for t in seen) and not any("e+" in t for t in seen)
    compare = page.inner_text(".kv-compare")
    import re
    off, on, ratio = re.search(r"without the cache ([\d,]+) matmul FLOPs, with it ([\d,]+) "
                               r"\(([\d,]+\.\d) times fewer\)", compare).groups()
    assert ratio == f"{int(off.replace(',', '')) / int(on.replace(',', '')):,.1f}"
    assert "," in ratio
    assert page.problems == []


def test_one_pass_and_one_decode_step_read_as_such(page, data):
    M = next(c for c in data["configs"] if c["id"] == "gpt2")["max_context"]
    choose(page, "gpt2", 4, M - 1, 10, True)
    assert page.get_attribute(".kv-sim", "data-passes") == "1"
    status = page.inner_text(".kv-status")
    assert status.startswith(f"Cache on: pass 1 is the prefill of {M - 1:,} tokens, and the only "
                             "pass: no decode step runs.") and "0 decode" not in status
    choose(page, "gpt2", 4, M - 2, 10, True)
    assert "then 1 decode step of one token." in page.inner_text(".kv-status")
    choose(page, "gpt2", 4, M - 1, 10, False)
    assert page.inner_text(".kv-status").startswith(
        "Cache off (the S01 loop): the one pass runs the whole context.")
    assert page.problems == []
