"""The S15 "Try it" speculative decoding simulator, in a real browser, against the engine's runs
and code/s15_rejection.py.

A minimal page (no site build) loads site/static/course.js, this simulator's script and the data
exported by site/simulators/speculative-decoding/export.py (three runs of S15's engine on the
bundled model, and the toy's exact values; held against a fresh engine run and the target alone
in tests/test_s15_simulator_data.py). Playwright drives Debian's Chromium.

- The replay: for every run and every step, chosen with the page's controls, each request's
  row shows that step's drafts, accepted ones marked accepted, the first rejected one
  rejected, the ones after it thrown away, then the target's token marked a correction or a
  bonus, exactly as the exported step says; the running statistics at the last step equal
  the engine's `SpecDecodingStats`.
- The toy: for every preset and k in 1, 2, 4, with N trials and a seed set on the page, the
  page's histogram counts (first emitted token, all tokens), acceptances and tokens per step
  equal code/s15_rejection.py's `rejection_sample` run here on the same uniforms (mulberry32
  written again in Python), for the rule and for the wrong rule (the final token redrawn
  from p); the measured acceptance of draft 1 is within 4.5 standard errors of the exported
  alpha, tokens per step within 4.5 of the exported expectation; the rule's chi-square stays
  below its 0.1% critical value and the wrong rule's lands far above it where q is far from p
  (alpha = 0.5).
- Custom weights (the sliders) give the page's alpha = sum min(p, q) of the normalised
  weights, and the same counts as `rejection_sample` again.
- The self-check banner stays hidden, no console errors, nothing overflows sideways at the
  site's text-column width.
Skipped when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from sim_browser import data_fixture, go_to, page_fixture, skip_without_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]
skip_without_browser()

import s15_rejection as rej  # noqa: E402

data = data_fixture("speculative-decoding", "s15_sim_export_browser")
page = page_fixture("speculative-decoding", ".sd-result-right", "s15-chromium-")


def mulberry32(seed: int):
    """The page's PRNG: uniforms in [0, 1) as multiples of 2**-32."""
    a = seed & 0xFFFFFFFF

    def imul(x: int, y: int) -> int:
        return (x * y) & 0xFFFFFFFF

    while True:
        a = (a + 0x6D2B79F5) & 0xFFFFFFFF
        t = imul(a ^ (a >> 15), 1 | a)
        t = ((t + imul(t ^ (t >> 7), 61 | t)) & 0xFFFFFFFF) ^ t
        yield ((t ^ (t >> 14)) & 0xFFFFFFFF) / 4294967296


def reference(p_weights, q_weights, k: int, trials: int, seed: int) -> dict:
    """Both rules on the page's uniforms, with s15_rejection: per rule the first tokens'
    counts, all tokens' counts, draft 1 accepted, drafts accepted, tokens."""
    p = torch.tensor(p_weights, dtype=torch.float64) / float(sum(p_weights))
    q = torch.tensor(q_weights, dtype=torch.float64) / float(sum(q_weights))
    gen = mulberry32(seed)
    u = torch.tensor([next(gen) for _ in range(trials * (2 * k + 1))],
                     dtype=torch.float64).view(trials, 2 * k + 1)
    v = p.numel()
    drafts = rej.sample_from(q.expand(trials * k, v), u[:, :k].reshape(-1)).view(trials, k)
    tokens, accepted = rej.rejection_sample(
        p.expand(trials, k + 1, v), q.expand(trials, k, v), drafts,
        torch.full((trials,), k, dtype=torch.int64), u[:, k:].contiguous())
    wrong = tokens.clone()
    rejected = accepted < k
    redraw = rej.sample_from(p.expand(trials, v), u[:, 2 * k])
    wrong[rejected, accepted[rejected]] = redraw[rejected]
    out = {}
    for name, toks in (("right", tokens), ("wrong", wrong)):
        emitted = toks[toks >= 0]
        out[name] = {"first": torch.bincount(toks[:, 0], minlength=v).tolist(),
                     "all": torch.bincount(emitted, minlength=v).tolist(),
                     "firstAccepted": int((accepted > 0).sum()),
                     "accepted": int(accepted.sum()), "tokens": int(emitted.numel())}
    return out


def shown(pg) -> dict:
    return pg.evaluate("""() => {
        const out = {};
        for (const name of ['right', 'wrong']) {
            const d = document.querySelector('.sd-result-' + name).dataset;
            out[name] = {first: JSON.parse(d.first), all: JSON.parse(d.all),
                         firstAccepted: Number(d.firstAccepted), accepted: Number(d.accepted),
                         tests: Number(d.tests), tokens: Number(d.tokens), chi2: Number(d.chi2),
                         df: Number(d.df), trials: Number(d.trials), k: Number(d.k),
                         seed: Number(d.seed)};
        }
        out.alpha = Number(document.querySelector('.sd-toy-summary').dataset.alpha);
        return out;
    }""")


def set_toy(pg, preset, k: int, trials: int, seed: int) -> None:
    pg.select_option(".sd-preset", str(preset))
    pg.select_option(".sd-k", str(k))
    pg.locator(".sd-trials").fill(str(trials))
    pg.locator(".sd-seed").fill(str(seed))
    pg.locator(".sd-run").click()
    pg.wait_for_function(
        f"""() => {{ const d = document.querySelector('.sd-result-right').dataset;
                   return d.k === '{k}' && d.trials === '{trials}' && d.seed === '{seed}'; }}""")


def expected_statuses(row: dict) -> list[tuple[int, str]]:
    if row["kind"] != "verify":
        return [(t, "plain") for t in row["emitted"]]
    a, e, d = row["accepted"], row["emitted"], row["drafts"]
    out = [(t, "accepted" if j < a and j < len(e) else "dropped" if j < a
            else "rejected" if j == a else "unchecked") for j, t in enumerate(d)]
    if len(e) == a + 1:
        out.append((e[a], "correction" if a < len(d) else "bonus"))
    return out


def test_the_replay_shows_every_step_as_the_engine_ran_it(page, data):
    assert page.locator(".sd-banner").is_hidden()
    kinds = set()
    for r, run in enumerate(data["runs"]):
        page.select_option(".sd-pick", str(r))
        for step in run["steps"]:
            go_to(page, "sd", step["step"])
            got = page.evaluate("""() => Array.from(document.querySelectorAll('tr.sd-req')).map(tr => ({
                id: tr.dataset.request,
                chips: Array.from(tr.querySelectorAll('.sd-chip')).map(c => [Number(c.dataset.token), c.dataset.status]),
                outcome: tr.querySelector('.sd-outcome').textContent}))""")
            assert [g["id"] for g in got] == [q["id"] for q in run["requests"]]
            rows = {row["id"]: row for row in step["rows"]}
            for g in got:
                row = rows.get(g["id"])
                want = expected_statuses(row) if row else []
                assert [tuple(c) for c in g["chips"]] == want, (run["id"], step["step"], g["id"])
                kinds.update(s for _, s in want)
                if row and row["kind"] == "verify":
                    assert g["outcome"].startswith(f"{row['accepted']} of {len(row['drafts'])} "
                                                   "accepted"), g["outcome"]
        stats = run["stats"]
        text = page.locator(".sd-stats").inner_text()
        assert (f"{stats['num_accepted_tokens']} of {stats['num_draft_tokens']} draft tokens "
                f"accepted") in text
        assert f"{stats['tokens_per_forward']:.2f} tokens per request" in text
        assert float(page.locator(".sd-stats").get_attribute("data-acceptance")) == \
            pytest.approx(stats["acceptance_rate"], abs=1e-12)
    assert {"accepted", "rejected", "correction", "bonus", "plain"} <= kinds
    assert page.problems == []


def test_the_toy_equals_rejection_sample_on_the_same_uniforms(page, data):
    toy = data["toy"]
    for i, preset in enumerate(toy["presets"]):
        for k in (1, 2, 4):
            trials, seed = 3000, 11 + k
            set_toy(page, i, k, trials, seed)
            got = shown(page)
            want = reference(preset["p_weights"], preset["q_weights"], k, trials, seed)
            case = (preset["id"], k)
            for rule in ("right", "wrong"):
                for field in ("first", "all", "firstAccepted", "accepted", "tokens"):
                    assert got[rule][field] == want[rule][field], (case, rule, field)
            alpha = preset["alpha"]
            assert got["alpha"] == pytest.approx(alpha, abs=1e-12)
            right = got["right"]
            se = math.sqrt(alpha * (1 - alpha) / trials)
            assert abs(right["firstAccepted"] / trials - alpha) <= 4.5 * se + 1e-12, case
            mean = preset["expected_tokens"][k]
            # tokens per step: 1 + a truncated geometric count; its variance is at most k^2 / 4
            sd = math.sqrt(sum((j + 1 - mean) ** 2 * (alpha ** j * (1 - alpha) if j < k
                                                     else alpha ** k) for j in range(k + 1)))
            assert abs(right["tokens"] / trials - mean) <= 4.5 * sd / math.sqrt(trials) + 1e-12
            crit = toy["chi2_critical_0_001"][right["df"] - 1]
            assert right["chi2"] <= crit, case
            if alpha <= 0.5:                 # far from p: the wrong rule is caught
                assert got["wrong"]["chi2"] > 3 * crit, case
            if alpha == 1.0:
                assert got["wrong"] == {**right, "chi2": got["wrong"]["chi2"]}
    assert page.locator(".sd-banner").is_hidden()
    assert page.problems == []


def test_custom_weights(page, data):
    set_toy(page, 0, 3, 2000, 5)
    sliders_p = page.locator(".sd-w-p")
    sliders_q = page.locator(".sd-w-q")
    p_weights, q_weights = [5, 0, 40, 10, 25, 20], [50, 10, 0, 20, 10, 10]
    for i, (wp, wq) in enumerate(zip(p_weights, q_weights)):
        sliders_p.nth(i).fill(str(wp))
        sliders_q.nth(i).fill(str(wq))
    assert page.locator(".sd-preset").input_value() == "custom"
    got = shown(page)
    p = torch.tensor(p_weights, dtype=torch.float64) / sum(p_weights)
    q = torch.tensor(q_weights, dtype=torch.float64) / sum(q_weights)
    assert got["alpha"] == pytest.approx(rej.acceptance_rate(p, q), abs=1e-12)
    want = reference(p_weights, q_weights, 3, 2000, 5)
    for rule in ("right", "wrong"):
        for field in ("first", "all", "firstAccepted", "accepted", "tokens"):
            assert got[rule][field] == want[rule][field], (rule, field)
    assert got["right"]["first"][1] == 0                      # p = 0: never emitted
    assert got["right"]["df"] == 4
    assert page.problems == []


def test_the_wrong_rule_toggle_draws_its_bars(page, data):
    set_toy(page, 1, 1, 4000, 1)
    page.locator(".sd-show-wrong").set_checked(False)
    assert page.locator("rect.sd-bar-wrong").count() == 0
    page.locator(".sd-show-wrong").set_checked(True)
    v = len(data["toy"]["vocab"])
    assert page.locator("rect.sd-bar-wrong").count() == v
    assert page.locator("rect.sd-bar-right").count() == v
    p = [float(page.locator("rect.sd-bar-p").nth(i).get_attribute("data-value")) for i in range(v)]
    assert p == pytest.approx(data["toy"]["presets"][1]["p"], abs=1e-15)
    wrong = json.loads(page.locator(".sd-result-wrong").get_attribute("data-first"))
    expected = data["toy"]["presets"][1]["wrong"]
    # the wrong rule follows min(p, q) + (1 - alpha) p, not p
    for count, e in zip(wrong, expected):
        assert abs(count / 4000 - e) <= 4.5 * math.sqrt(e * (1 - e) / 4000)
    assert page.problems == []


def test_nothing_overflows_at_the_text_column_width(page, data):
    page.set_viewport_size({"width": 760, "height": 1400})
    try:
        for r in range(len(data["runs"])):
            page.select_option(".sd-pick", str(r))
            for step in (0, len(data["runs"][r]["steps"]) // 2):
                go_to(page, "sd", step)
                fits = page.evaluate("""() => {
                    const sim = document.querySelector('.sd-sim');
                    return sim.scrollWidth <= sim.clientWidth + 1;
                }""")
                assert fits, (r, step)
    finally:
        page.set_viewport_size({"width": 1280, "height": 720})
    assert page.problems == []
