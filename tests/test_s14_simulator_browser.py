"""The S14 "Try it" quantization playground, in a real browser, equals the chapter's quantizers.

A minimal page (no site build) loads site/static/course.js, this simulator's script and the data
exported by site/simulators/quantization-playground/export.py (real rows of the bundled model
and the chapter's results for each; held against independent oracles in
tests/test_s14_simulator_data.py). Playwright drives Debian's Chromium. For every row and every
setting (int8; int4 with groups of 32, 64, 128, symmetric and asymmetric), chosen with the
page's controls:

- every code cell shows the exported code and carries the exported float32 error, bit for bit;
- every group's chip carries the exported scale and zero point, one chip per group;
- the bytes shown are the exported bytes (codes + scales + zero points), and the largest
  |error| / scale the page reports is at most 0.5;
- the detail table lists the picked group's weights (clicking a chip picks it);
- "add an outlier" (weight 3 set to 8 x the row's largest |w|) gives what the chapter's
  `quantize_int8` / `quantize_int4` give for that row, computed here;
- the self-check banner stays hidden, there are no console errors, and nothing overflows
  sideways at the site's text-column width.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import pytest
import torch
from sim_browser import data_fixture, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

import s14_quantization as s14  # noqa: E402

data = data_fixture("quantization-playground", "s14_sim_export_browser")
page = page_fixture("quantization-playground", ".qp-codes", "s14-chromium-")


def choose(pg, row: int, bits: int, group_size: int | None, symmetric: bool,
           outlier: bool = False) -> None:
    pg.select_option(".qp-row", str(row))
    pg.select_option(".qp-bits", str(bits))
    if bits == 4:
        pg.select_option(".qp-group", str(group_size))
        pg.select_option(".qp-sym", "sym" if symmetric else "asym")
    pg.locator(".qp-outlier").set_checked(outlier)


def shown(pg) -> dict:
    return pg.evaluate("""() => ({
        codes: Array.from(document.querySelectorAll('.qp-code')).map(c => Number(c.dataset.code)),
        errors: Array.from(document.querySelectorAll('.qp-code')).map(c => Number(c.dataset.error)),
        scales: Array.from(document.querySelectorAll('.qp-scale')).map(c => Number(c.dataset.scale)),
        zeros: Array.from(document.querySelectorAll('.qp-scale')).map(c => Number(c.dataset.zero)),
        bytes: Number(document.querySelector('.qp-bytes').dataset.bytes),
        worst: Number(document.querySelector('.qp-errors').dataset.worst),
        summary: document.querySelector('.qp-summary').textContent,
        detail: document.querySelectorAll('.qp-detail-row').length})""")


def test_every_row_and_setting_equals_the_export(page, data):
    assert page.locator(".qp-banner").is_hidden()
    for i, row in enumerate(data["rows"]):
        for res in row["results"]:
            choose(page, i, res["bits"], res["group_size"], res["symmetric"])
            got = shown(page)
            case = (row["name"], row["row"], res["id"])
            assert got["codes"] == res["codes"], case
            assert got["errors"] == res["error"], case
            assert got["scales"] == res["scales"], case
            assert got["zeros"] == res["zeros"], case
            assert got["bytes"] == res["total_bytes"], case
            assert f"{res['total_bytes']} bytes = " in got["summary"]
            assert 0 < got["worst"] <= 0.5, case
            assert got["detail"] == res["group_size"], case
    assert page.problems == []


def test_clicking_a_chip_lists_that_group(page, data):
    row = max(range(len(data["rows"])), key=lambda i: data["rows"][i]["k"])
    choose(page, row, 4, 32, True)
    page.locator(".qp-scale").nth(2).click()
    title = page.locator(".qp-detail-title").inner_text()
    assert title.startswith("Group 2: weights 64 to 95")
    first = page.locator(".qp-detail-row").first.locator("td").first.inner_text()
    assert first == "64"
    assert page.problems == []


def test_an_outlier_matches_the_chapters_quantizer(page, data):
    for i, row in enumerate(data["rows"]):
        w = torch.tensor([row["values"]], dtype=torch.float32)
        w[0, 3] = torch.sign(w[0, 3]) * 8 * w.abs().max() if w[0, 3] != 0 else 8 * w.abs().max()
        for bits, group_size, symmetric in ((8, None, True), (4, 32, True), (4, 128, False)):
            choose(page, i, bits, group_size, symmetric, outlier=True)
            got = shown(page)
            if bits == 8:
                codes, scales = s14.quantize_int8(w)
                back, zeros = s14.dequantize_int8(codes, scales), [0]
            else:
                codes, scales, z = s14.quantize_int4(w, group_size, symmetric)
                back = s14.dequantize_int4(codes, scales, z, group_size)
                zeros = [8] * scales.shape[1] if z is None else z[0].tolist()
            assert got["codes"] == codes[0].tolist(), (row["name"], bits, group_size)
            assert got["scales"] == scales.float().reshape(-1).tolist()
            assert got["zeros"] == zeros
            assert got["errors"] == (w - back)[0].tolist()
    choose(page, 0, 4, 32, True, outlier=False)
    assert page.problems == []


def test_nothing_overflows_at_the_text_column_width(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for i in range(len(data["rows"])):
            for bits, group_size in ((8, None), (4, 128), (4, 32)):
                choose(page, i, bits, group_size, False)
                fits = page.evaluate("""() => {
                    const sim = document.querySelector('.qp-sim');
                    return sim.scrollWidth <= sim.clientWidth + 1;
                }""")
                assert fits, (i, bits, group_size)
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
