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

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser, pytest.mark.slow]
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "site" / "simulators" / "transformer-attention"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


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
    spec = importlib.util.spec_from_file_location("s03_sim_export_browser", SIM / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.BUNDLED_MODEL_DIR = directory
    return module.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sim_page")
    shutil.copy(ROOT / "site" / "static" / "course.js", folder / "course.js")
    shutil.copy(SIM / "simulator.js", folder / "simulator.js")
    (folder / "data.js").write_text(
        f"CourseSim.setData('transformer-attention', {json.dumps(data, allow_nan=False)});\n")
    (folder / "index.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'></head><body>"
        "<div class='course-sim' data-sim='transformer-attention'></div>"
        "<script src='course.js'></script><script src='simulator.js'></script>"
        "<script src='data.js'></script></body></html>")
    profile = tempfile.mkdtemp(prefix="s03-chromium-")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                       headless=True, args=ARGS)
        pg = context.new_page()
        pg.problems = []
        pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: pg.problems.append(str(e)))
        pg.goto((folder / "index.html").as_uri())
        pg.wait_for_selector(".ta-map")
        yield pg
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


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
