"""The S04 "Try it" simulator in a real browser: the page's pipeline is S04's pipeline.

A minimal page loads site/static/course.js, the simulator's script and the data exported by
site/simulators/sampler-playground/export.py (the bundled model's logits rows and the hand-made
rows). Playwright drives Debian's Chromium and types settings into the page's fields; for every
row and every setting of a grid (greedy, top_k=1, top_p=0 and a top_p on either side of the
float32 edge where a head's mass rounds to 1 - top_p, min_p=1, ties, the penalties, min_tokens)
the page's state is compared with S04's own functions:

- every stage's kept set exactly, and every stage's float32 row bit for bit;
- every stage's probabilities within the exported tolerance (the page takes softmax in float64,
  S04's `softmax` in float32);
- the greedy token (`s04.sample`), and SamplingParams' or process_logits' ValueError message.

The page must also have replayed the exporter's reference cases without a mismatch, show the
numbers it computed, and log no console error. Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser, pytest.mark.slow]
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "site" / "simulators" / "sampler-playground"
sys.path.insert(0, str(ROOT / "code"))
import s04_sampling as s04  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "min_tokens")
GRID = (  # settings as typed; the Python side reads the same text (int if integer text)
    {}, {"temperature": "0"}, {"temperature": "0.35"}, {"temperature": "1.7"},
    {"temperature": "1e-07"}, {"top_k": "1"}, {"top_k": "3"}, {"top_k": "64"},
    {"top_k": "5000"}, {"top_p": "0"}, {"top_p": "0.3"}, {"top_p": "0.95"},
    {"min_p": "0.2"}, {"min_p": "1"}, {"min_p": "0.01", "top_p": "0.8", "temperature": "0.9"},
    {"temperature": "0.6", "top_k": "12", "top_p": "0.75", "min_p": "0.04"},
    {"repetition_penalty": "1.5"}, {"repetition_penalty": "0.7", "temperature": "0"},
    {"frequency_penalty": "0.8", "temperature": "0"}, {"presence_penalty": "-1.2"},
    {"presence_penalty": "2", "frequency_penalty": "-2", "top_p": "0.5"},
    {"min_tokens": "5", "temperature": "0"}, {"min_tokens": "20", "top_k": "4"},
    {"repetition_penalty": "1e-300"},            # a positive seen logit becomes +inf: refused
    {"top_p": "1.01"}, {"top_k": "2.5"}, {"temperature": "101"}, {"min_tokens": "-3"},
    {"repetition_penalty": "0"}, {"frequency_penalty": "nan"},
)


def load_exporter():
    spec = importlib.util.spec_from_file_location("s04_sim_export_browser", SIM / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exporter():
    return load_exporter()


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("s04_sim_page")
    shutil.copy(ROOT / "site" / "static" / "course.js", folder / "course.js")
    shutil.copy(ROOT / "site" / "static" / "course.css", folder / "course.css")
    shutil.copy(SIM / "simulator.js", folder / "simulator.js")
    (folder / "data.js").write_text(
        f"CourseSim.setData('sampler-playground', {json.dumps(data, allow_nan=False)});\n")
    (folder / "index.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<link rel='stylesheet' href='course.css'></head><body>"
        "<div class='course-sim' data-sim='sampler-playground'></div>"
        "<script src='course.js'></script><script src='simulator.js'></script>"
        "<script src='data.js'></script></body></html>")
    profile = tempfile.mkdtemp(prefix="s04-chromium-")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                       headless=True, args=ARGS)
        pg = context.new_page()
        pg.problems = []
        pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: pg.problems.append(str(e)))
        pg.goto((folder / "index.html").as_uri())
        pg.wait_for_selector(".sp-table")
        yield pg
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


def typed(text: str):
    """What Python receives for a typed field: an int for integer text, else a float."""
    t = text.strip()
    return int(t) if t.lstrip("+-").isdigit() else float(t)


def set_fields(page, data, settings: dict) -> None:
    """Type the settings (defaults elsewhere) into the page's fields: each changed field gets
    its text and an input event, as typing does, in one round trip."""
    texts = {name: settings.get(name, str(data["defaults"][name])) for name in FIELDS}
    page.evaluate("""(texts) => {
      for (const [name, text] of Object.entries(texts)) {
        const input = document.querySelector('.sp-' + name);
        if (input.value === text) continue;
        input.value = text;
        input.dispatchEvent(new Event('input', {bubbles: true}));
      }
    }""", texts)


def page_state(page) -> dict:
    """The page's last result; rows travel as the bytes of a Float32Array / Float64Array (exact,
    and much faster than JSON lists of 2,048 numbers)."""
    state = page.evaluate("""() => {
      const r = document.querySelector('.course-sim').spSim.last;
      const bytes = (a) => { const u = new Uint8Array(a.buffer); let s = "";
        for (let i = 0; i < u.length; i++) s += String.fromCharCode(u[i]); return btoa(s); };
      return {error: r.error, greedy: r.greedy,
              stages: r.stages.map(s => ({name: s.name, skipped: s.skipped, kept: s.kept,
                logits: s.logits && bytes(Float32Array.from(s.logits)),
                probs: s.probs && bytes(Float64Array.from(s.probs))}))};
    }""")
    for stage in state["stages"]:
        if stage["logits"] is not None:
            stage["logits"] = np.frombuffer(base64.b64decode(stage["logits"]), dtype="<f4")
            stage["probs"] = np.frombuffer(base64.b64decode(stage["probs"]), dtype="<f8")
    return state


def oracle(exporter, row: dict, settings: dict):
    """S04's answer: ('error', message) or (stages, greedy token or None)."""
    logits = np.array(row["logits"], dtype=np.float32)
    values = {name: typed(text) for name, text in settings.items()}
    try:
        params = exporter.params_for(values)
        steps = exporter.stages(logits, params, row["prompt_ids"], row["output_ids"],
                                row["eos_ids"])
    except ValueError as err:
        return "error", str(err)
    final = s04.process_logits(logits, params, row["prompt_ids"], row["output_ids"],
                               row["eos_ids"])
    greedy = s04.sample(logits, params, np.random.default_rng(0), row["prompt_ids"],
                        row["output_ids"], row["eos_ids"]) if params.greedy else None
    return (steps, final), greedy


def test_page_replays_the_reference_cases_without_a_mismatch(page, data):
    assert page.evaluate("document.querySelector('.course-sim').spSim.mismatches") == 0
    assert page.locator(".course-error:visible").count() == 0
    assert len(data["reference"]) > 100
    assert page.problems == []


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # penalty 1e-300 -> 0
def test_every_stage_equals_s04_on_a_grid_of_settings(page, data, exporter):
    tolerance = data["prob_tolerance"]
    worst, compared = 0.0, 0
    for index, row in enumerate(data["rows"]):
        page.select_option(".sp-row-select", str(index))
        grid = list(GRID)
        if row["kind"] == "model":
            logits = np.array(row["logits"], dtype=np.float32)
            for head in (3, 25):
                edges = exporter.top_p_boundaries(logits, head)
                assert len(edges) == 2, (row["label"], head)
                grid += [{"top_p": repr(p), "min_tokens": "0"} for p in edges]
        for settings in grid:
            set_fields(page, data, settings)
            got = page_state(page)
            want, greedy = oracle(exporter, row, settings)
            case = (row["label"], settings)
            if want == "error":
                assert got["error"] == greedy, case
                assert page.inner_text(".sp-error") == f"ValueError: {greedy}", case
                continue
            assert got["error"] is None, (case, got["error"])
            steps, final = want
            assert [s["name"] for s in got["stages"]] == [name for name, _ in steps], case
            for stage, (name, expected) in zip(got["stages"], steps):
                if expected is None:                   # greedy skips the stage
                    assert stage["skipped"] and stage["kept"] == [greedy], case
                    continue
                assert stage["kept"] == np.flatnonzero(np.isfinite(expected)).tolist(), (case, name)
                assert np.array_equal(stage["logits"], expected), (case, name)
                p = s04.softmax(expected).astype(np.float64)
                diff = float(np.max(np.abs(stage["probs"] - p)))
                worst, compared = max(worst, diff), compared + 1
                assert diff <= tolerance, (case, name, diff)
            last = [s for s in got["stages"] if not s["skipped"]][-1]
            assert np.array_equal(last["logits"], final), case
            assert got["greedy"] == greedy, case
    print(f"\n{compared} stage distributions compared; largest |page - S04 softmax| = {worst:.3g}")
    assert page.problems == []


def test_top_p_edge_keeps_one_more_token_one_step_above(page, data, exporter):
    """On a real row, the float32 edge of top_p: the page keeps the head-th token exactly when
    S04 does, on both sides of a gap between two adjacent float64 values of top_p."""
    index = next(i for i, r in enumerate(data["rows"]) if r["kind"] == "model")
    row = data["rows"][index]
    page.select_option(".sp-row-select", str(index))
    below, above = exporter.top_p_boundaries(np.array(row["logits"], dtype=np.float32), 10)
    assert np.nextafter(below, 1.0) == above or above - below < 1e-15
    counts = []
    for value in (below, above):
        set_fields(page, data, {"top_p": repr(value)})
        counts.append(len(page_state(page)["stages"][-1]["kept"]))
        assert page.inner_text(".sp-stage[data-stage='top_p'] .sp-kept") == \
            f"{counts[-1]} of {len(row['logits'])}"
    assert counts == [9, 10]


def test_the_table_shows_the_computed_numbers_and_the_stepper_hides_stages(page, data, exporter):
    index = [r["kind"] for r in data["rows"]].index("hand")      # p = (0.4, 0.3, 0.15, 0.1, 0.05)
    row = data["rows"][index]
    page.select_option(".sp-row-select", str(index))
    page.click(".sp-step-all")
    set_fields(page, data, {})
    page.fill(".sp-temperature", "0.5")                          # typed, key by key
    page.fill(".sp-top_k", "2")
    (steps, _), _ = oracle(exporter, row, {"temperature": "0.5", "top_k": "2"})
    cells = page.evaluate("""() => Array.from(document.querySelectorAll('tr.sp-token-row')).map(
        tr => [Number(tr.dataset.id), Array.from(tr.querySelectorAll('td.sp-p')).map(td => td.textContent)])""")
    for token, texts in cells:
        columns = [np.array(row["logits"], dtype=np.float32)] + [r for _, r in steps]
        want = ["\u00d7" if np.isneginf(z[token]) else f"{s04.softmax(z)[token]:.4f}" for z in columns]
        assert texts == want, token
    # The worked example of the chapter: T = 0.5 gives 0.5614, 0.3158, ... before top-k.
    assert [texts[3] for _, texts in cells] == ["0.5614", "0.3158", "0.0789", "0.0351", "0.0088"]
    assert [texts[-1] for _, texts in cells] == ["0.6400", "0.3600", "\u00d7", "\u00d7", "\u00d7"]
    page.click(".sp-step-back")
    page.click(".sp-step-back")
    assert page.locator("table.sp-table th.sp-col-top_p").count() == 0
    assert page.locator("table.sp-table th.sp-col-min_p").count() == 1
    assert "After 4 min-p: 5 of 5 tokens" in page.inner_text(".sp-summary")
    page.click(".sp-reset")
    page.click(".sp-step-all")
    assert page.input_value(".sp-temperature") == "1"
    assert page.problems == []
