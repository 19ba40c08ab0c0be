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
import sys
from pathlib import Path

import numpy as np
import pytest
from sim_browser import load_exporter, open_page, skip_without_browser, write_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
import s04_sampling as s04  # noqa: E402

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
    {"min_tokens": "5", "temperature": "0"}, {"min_tokens": "16", "top_k": "4"},
    {"min_tokens": "17"}, {"min_tokens": "20", "top_k": "4"},     # above max_tokens=16: refused
    {"repetition_penalty": "1e-300"},            # a positive seen logit becomes +inf: refused
    {"top_p": "1.01"}, {"top_k": "2.5"}, {"temperature": "101"}, {"min_tokens": "-3"},
    {"repetition_penalty": "0"}, {"frequency_penalty": "nan"},
)


@pytest.fixture(scope="module")
def exporter():
    return load_exporter("sampler-playground", "s04_sim_export_browser")


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


@pytest.fixture(scope="module")
def page(data, tmp_path_factory):
    html = write_page(tmp_path_factory.mktemp("s04_sim_page"), "sampler-playground", data)
    with open_page(html, ".sp-table", "s04-chromium-") as pg:
        yield pg


def typed(text: str):
    """What Python receives for a typed field: an int for integer text, else a float, and the
    text itself where float() refuses it (SamplingParams then names the string)."""
    t = text.strip()
    if t.lstrip("+-").isdigit():
        return int(t)
    try:
        return float(t)
    except ValueError:
        return text


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


TYPED = (  # (field, text): odd text, refused or read as Python's int() / float() read it
    ("min_tokens", "17"), ("min_tokens", "20"), ("min_tokens", "99999999999999999999"),
    ("min_tokens", "+007"), ("min_tokens", "16"), ("top_k", "1e3"), ("top_k", "abc"),
    ("temperature", ""), ("temperature", "abc"), ("temperature", "1,5"), ("temperature", "0x10"),
    ("temperature", "  "), ("temperature", "inf"), ("temperature", "-Infinity"),
    ("temperature", " 0.5 "), ("temperature", ".5e1"), ("top_p", "it's"), ("min_p", "NaN"),
    ("repetition_penalty", "1" + "0" * 400),     # an int too large for a float
)


@pytest.mark.parametrize("field, text", TYPED, ids=[f"{f}={t[:24]!r}" for f, t in TYPED])
def test_typed_text_is_read_and_refused_as_s04_does(page, data, exporter, field, text):
    """SamplingParams' own message for what was typed (the string itself where Python's
    float() refuses it, never a NaN the page made up); the slider follows only a number."""
    index = [r["kind"] for r in data["rows"]].index("hand")
    page.select_option(".sp-row-select", str(index))
    set_fields(page, data, {})
    set_fields(page, data, {field: text})
    want, message = oracle(exporter, data["rows"][index], {field: text})
    if want == "error":               # textContent: inner_text would collapse the spaces
        assert page.text_content(".sp-error") == f"ValueError: {message}"
    else:
        assert page.evaluate("document.querySelector('.course-sim').spSim.last.error") is None
        value = typed(text)
        assert f"{field}={value!r}" in page.inner_text(".sp-snippet")
    value, slider = typed(text), float(page.input_value(f".sp-range-{field}"))
    lo, hi = (float(page.get_attribute(f".sp-range-{field}", k)) for k in ("min", "max"))
    if not s04.s01.is_finite(value):          # text, nan, inf, an int past float's range
        assert slider == float(data["defaults"][field]), "the slider moved on text"
    else:
        assert slider == min(max(value, lo), hi)
    assert page.problems == []


def test_min_tokens_slider_ends_at_max_tokens(page, data):
    assert data["max_tokens"] == s04.SamplingParams().max_tokens == 16
    assert page.get_attribute(".sp-range-min_tokens", "max") == str(data["max_tokens"])
    with pytest.raises(ValueError, match=r"max_tokens=16\] \(got 17\)"):
        s04.SamplingParams(min_tokens=17)


def test_stage_cards_name_what_each_stage_removed(page, data, exporter):
    """The graveyard row under repetition_penalty=1e308 loses seen tokens, not EOS; the EOS row
    under min_tokens loses EOS: each card's note says which, with S04's count."""
    rows = {r["label"]: i for i, r in enumerate(data["rows"])}
    graveyard = next((i for label, i in rows.items() if "graveyard" in label), None)
    eos_row = next((i for label, i in rows.items() if label.startswith("EOS likely")), None)
    if graveyard is None:
        pytest.skip("no bundled model in this checkout")
    page.click(".sp-step-all")
    for index, settings, eos in ((graveyard, {"repetition_penalty": "1e308"}, False),
                                 (eos_row, {"min_tokens": "4"}, True)):
        row = data["rows"][index]
        page.select_option(".sp-row-select", str(index))
        set_fields(page, data, settings)
        (steps, _), _ = oracle(exporter, row, settings)
        kept = [int(np.isfinite(z).sum()) for _, z in steps]
        V = len(row["logits"])
        notes = {s: page.inner_text(f".sp-stage[data-stage='{s}'] .sp-stage-note")
                 for s in ("min_tokens", "penalties")}
        if eos:
            assert V - kept[0] == len(row["eos_ids"]) and notes["min_tokens"] == "rules out EOS"
            assert notes["penalties"] == "off"
        else:
            removed = kept[0] - kept[1]
            assert removed > 1 and notes["min_tokens"] == "off"
            assert notes["penalties"] == f"removes {removed} seen tokens"
            assert page.inner_text(".sp-stage[data-stage='penalties'] .sp-kept") == \
                f"{kept[1]} of {V}"
    assert page.problems == []


CHAPTER = ROOT / "chapters" / "s04-sampling.md"


def chapter_section(title: str) -> str:
    text = CHAPTER.read_text(encoding="utf-8")
    start = text.index(title)
    return text[start:text.index("\n#", start + len(title))]


def numbers(text: str) -> list[str]:
    return [x.strip() for x in text.split(",")]


def last_column(page) -> dict[int, str]:
    return dict(page.evaluate("""() => Array.from(document.querySelectorAll('tr.sp-token-row'))
        .map(tr => { const td = tr.querySelectorAll('td.sp-p'); return [Number(tr.dataset.id),
                     td[td.length - 1].textContent]; })"""))


def test_try_it_reproduces_each_line_of_five_tokens_by_hand(page, data):
    """Try it's first bullet: one knob at a time from the defaults (T = 1 for the filters), as
    the chapter's lines are; the page's last column then shows the chapter's numbers."""
    import re
    by_hand = " ".join(chapter_section("### Five tokens, by hand").split())
    try_it = " ".join(chapter_section("## Try it").split())
    assert f"*{page.inner_text('.sp-reset')}*" in try_it        # the button the bullet names
    t05 = re.search(r"\*\*Temperature 0\.5\.\*\*.*?= \(([0-9., ]+)\)\. \$\$", by_hand).group(1)
    t2 = re.search(r"At \$T = 2\$ .*?\$\(([0-9., ]+)\)\$", by_hand).group(1)
    k2 = re.search(r"\*\*top_k = 2\.\*\*.*?\$\(([0-9., ]+)\)\$", by_hand).group(1)
    p08 = re.search(r"\*\*top_p = 0\.8\.\*\*.*?Renormalised: \$\(([0-9., ]+)\)\$", by_hand).group(1)
    assert "the same set as top-p 0.8" in by_hand and "`min_p=0.5` sets the bar at 0.2 and keeps " \
        "tokens 0 and 1" in by_hand and "`top_k=10` on five tokens keeps all five" in by_hand
    cases = [({"temperature": "0.5"}, numbers(t05)), ({"temperature": "2"}, numbers(t2)),
             ({"top_k": "2"}, numbers(k2) + ["\u00d7"] * 3),
             ({"top_k": "10"}, [f"{p:.4f}" for p in (0.4, 0.3, 0.15, 0.1, 0.05)]),
             ({"top_p": "0.8"}, numbers(p08) + ["\u00d7"] * 2),
             ({"min_p": "0.3"}, numbers(p08) + ["\u00d7"] * 2),
             ({"min_p": "0.5"}, numbers(k2) + ["\u00d7"] * 3),
             ({"top_p": "0.7"}, numbers(k2) + ["\u00d7"] * 3),      # token 2 dropped
             ({"top_p": "0"}, ["1.0000"] + ["\u00d7"] * 4)]
    index = [r["kind"] for r in data["rows"]].index("hand")
    assert data["rows"][index]["label"].startswith("hand-made: p = (0.4, 0.3, 0.15, 0.1, 0.05)")
    page.select_option(".sp-row-select", str(index))
    page.click(".sp-step-all")
    for settings, want in cases:
        page.click(".sp-reset")
        (name, text), = settings.items()
        page.fill(f".sp-{name}", text)
        assert [last_column(page)[i] for i in range(5)] == want, settings
    assert page.problems == []


def test_ties_keep_what_s04_keeps_and_try_it_says_so(page, data, exporter):
    """On eight equal logits top_k and min_p keep ties, top_p breaks them by id: the page shows
    S04's counts, and Try it's question and answer name the same settings."""
    index = next(i for i, r in enumerate(data["rows"]) if "equal logits" in r["label"])
    row = data["rows"][index]
    page.select_option(".sp-row-select", str(index))
    page.click(".sp-step-all")
    kept = {}
    for name, text in (("top_k", "1"), ("top_p", "0"), ("min_p", "1")):
        page.click(".sp-reset")
        page.fill(f".sp-{name}", text)
        (steps, _), _ = oracle(exporter, row, {name: text})
        want = np.flatnonzero(np.isfinite(steps[-1][1])).tolist()
        assert page.evaluate("document.querySelector('.course-sim').spSim.last.stages[5].kept") \
            == want
        kept[f"`{name}={text}`"] = len(want)
    assert kept == {"`top_k=1`": 8, "`top_p=0`": 1, "`min_p=1`": 8}
    try_it = " ".join(chapter_section("## Try it").split())
    all_eight = [k for k, n in kept.items() if n == 8]
    one = [k for k, n in kept.items() if n == 1]
    assert f"{' and '.join(all_eight)} keep all eight" in try_it
    assert f"{one[0]} keeps one" in try_it
    assert page.problems == []
