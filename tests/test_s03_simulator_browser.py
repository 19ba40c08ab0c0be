"""The S03 "Try it" simulator in a real browser: it draws exactly the exported numbers.

A minimal page loads site/static/course.js, the simulator's script and data exported by
site/simulators/transformer-attention/export.py from a small random Qwen3 checkpoint (the same
exporter the site runs; its data is checked against `transformers` in
tests/test_s03_simulator_data.py). Playwright drives Debian's Chromium: the heat map has one row
per token and a coloured cell exactly where the causal mask allows; clicking a row, changing
layer, head and temperature shows that position's attention weights and next-token
probabilities as exported; no console errors. Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sim_browser import load_exporter, open_page, skip_without_browser, write_page
import torch

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("tiny_qwen3_browser")
    config = Qwen3Config(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=2047, eos_token_id=2047, pad_token_id=2047)
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    shutil.copy(ROOT / "data" / "tokenizer.json", directory / "tokenizer.json")
    module = load_exporter("transformer-attention", "s03_sim_export_browser")
    module.BUNDLED_MODEL_DIR = directory
    return module.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("sim_page"), "transformer-attention", data,
                      css=False)
    with open_page(html, ".ta-map", "s03-chromium-") as pg:
        yield pg


def bars(pg, selector: str) -> list[tuple[str, float]]:
    rows = pg.locator(selector).all()
    return [(r.locator(".ta-bar-label").inner_text(), float(r.locator(".ta-bar-value").inner_text()))
            for r in rows]


def show(token: str) -> str:
    return token.replace("\n", "\u21b5").replace(" ", "\u2423")


def test_heat_map_follows_the_causal_mask(page, data):
    tokens = data["prompts"][0]["tokens"]
    rows = page.locator(".ta-map tr[data-query]")
    assert rows.count() == len(tokens)
    for t in (0, len(tokens) - 1):
        cells = rows.nth(t).locator("td.ta-cell").all()
        coloured = [bool(c.get_attribute("style")) for c in cells]
        assert coloured == [s <= t for s in range(len(tokens))]
    assert page.problems == []


def test_clicking_a_row_shows_its_weights_and_next_token_distribution(page, data):
    prompt = data["prompts"][1]
    page.select_option(".ta-row select >> nth=0", "1")
    page.select_option(".ta-row select >> nth=1", "1")      # layer 1
    page.select_option(".ta-row select >> nth=2", "3")      # head 3
    t = 5
    page.locator(f".ta-map tr[data-query='{t}'] th").click()
    flat = prompt["attn"][1][3]
    weights = flat[t * (t + 1) // 2: t * (t + 1) // 2 + t + 1]
    shown = bars(page, ".ta-attn .ta-bar-row")
    expected = sorted(range(t + 1), key=lambda s: -weights[s])[:6]
    assert [float(v) for _, v in shown] == pytest.approx([weights[s] for s in expected], abs=5e-5)
    assert [label for label, _ in shown] == [f"{s} {show(prompt['tokens'][s])}" for s in expected]

    page.select_option(".ta-row select >> nth=3", "0.5")
    shown = bars(page, ".ta-side > .ta-bar-row")
    exported = prompt["next"][t]["0.5"]
    assert [v for _, v in shown] == pytest.approx([p for _, p in exported], abs=5e-5)
    assert [label for label, _ in shown] == [show(tok) for tok, _ in exported]

    page.select_option(".ta-row select >> nth=3", "greedy")
    assert show(prompt["next"][t]["greedy"]) in page.locator(".ta-side").inner_text()
    assert page.problems == []
