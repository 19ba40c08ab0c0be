"""The S15 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it runs the chapter's engine (`s15.build_engine`,
`SpecDecodingStats`, `load_draft_model`) and the chapter's rule and formulas
(`rejection_sample`, `sample_from`, `residual`, `acceptance_rate`, `expected_tokens_per_step`,
`expected_speedup`) and defines none of them; its plots are there and no legend covers data
(tests/legend_check.py); and its numbers say what the chapter says:

- greedy speculative output equals the target alone for every proposer (the notebook asserts
  it and prints so); acceptance by draft position lies in [0, 1], the int4 copy's first-draft
  acceptance above the 1-layer draft's, above n-gram lookup's on corpus prompts; it says
  whether the benchmark record was used;
- speedup against k: each predicted value is `expected_speedup(alpha, k, c)` and each
  predicted tokens per forward `expected_tokens_per_step(alpha, k)` for the alpha and c it
  prints (recomputed here); measured tokens per forward >= 1 and never above k + 1; times are
  printed, never asserted;
- the distribution test: alpha = 0.5 for its toy; the rule's chi-square stays below the 0.1%
  critical value and the wrong sampler's is above it thirtyfold; the wrong sampler's exact
  distribution is min(p, q) + (1 - alpha) p, worked here; tokens per step with k = 3 within
  0.05 of (1 - alpha^4) / (1 - alpha).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

import s15_rejection as rej  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s15_speculative.ipynb"
NUM = r"([-\d.]+)"

pytestmark = pytest.mark.skipif(
    not (ROOT / "data" / "model" / "model.safetensors").is_file()
    or not (ROOT / "data" / "draft_model" / "model.safetensors").is_file(),
    reason="data/model or data/draft_model has no model")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=300)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_chapter_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "import s15_speculative as s15" in source
    assert ("from s15_rejection import (acceptance_rate, expected_speedup, "
            "expected_tokens_per_step,") in source
    for call in ("s15.build_engine(", "s15.SpecDecodingStats()", "s15.load_draft_model(",
                 "rejection_sample(", "sample_from(", "residual(p, q)", "acceptance_rate(p, q)",
                 "expected_speedup(alpha,", "expected_tokens_per_step(alpha,"):
        assert call in source, call
    for name in ("build_engine", "ngram_propose", "NgramProposer", "DraftModelProposer",
                 "RejectionSampler", "SpecDecodingStats", "load_draft_model", "speculate",
                 "rejection_sample", "greedy_verify", "sample_from", "residual",
                 "acceptance_rate", "expected_tokens_per_step", "expected_speedup",
                 "optimal_k", "explain_step"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3
    assert figures_checked(executed) >= 3
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_acceptance_by_position(executed):
    text = stream_text(executed)
    assert "greedy output identical to the target alone for every proposer: True" in text
    rows = {m[0].strip(): [float(x) for x in m[1:]] for m in re.findall(
        rf"^(1-layer draft|int4 copy|n-gram lookup)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}"
        rf"\s+{NUM}$", text, re.M)}
    assert set(rows) == {"1-layer draft", "int4 copy", "n-gram lookup"}, text[:2000]
    for label, (*per_pos, accepted, tokens) in rows.items():
        assert all(0 <= a <= 1 for a in per_pos) and 0 <= accepted <= 1, label
        assert 1 <= tokens <= 5, label
        assert min(per_pos) <= accepted <= max(per_pos) + 1e-3, label
    assert rows["int4 copy"][0] > rows["1-layer draft"][0] > rows["n-gram lookup"][0]
    assert ("benchmark record chapters/figures/s15_speculative.json" in text
            or "the plot shows the live run only" in text)


@pytest.mark.slow
def test_speedup_against_k_is_the_formula(executed):
    text = stream_text(executed)
    m = re.search(rf"measured alpha \(first draft, k = 1\): {NUM}; c \(draft step / target "
                  rf"step\): {NUM}", text)
    assert m, text[-3000:]
    alpha, c = float(m.group(1)), float(m.group(2))
    assert 0 < alpha < 1 and 0 < c < 1.5
    rows = re.findall(rf"^\s*(\d)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$", text, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6], text[-3000:]
    for k, accepted, tokens, pred_tokens, speedup, pred_speedup in rows:
        k = int(k)
        assert float(pred_tokens) == pytest.approx(rej.expected_tokens_per_step(alpha, k),
                                                   abs=2e-3)
        assert float(pred_speedup) == pytest.approx(rej.expected_speedup(alpha, k, c),
                                                    abs=3e-3)
        assert 1 <= float(tokens) <= k + 1
        assert 0 <= float(accepted) <= 1 and float(speedup) > 0
    assert float(rows[0][1]) == pytest.approx(alpha, abs=1e-3)


@pytest.mark.slow
def test_the_distribution_test(executed):
    text = stream_text(executed)
    assert "alpha = sum min(p, q) = 0.5000" in text
    assert "residual max(p - q, 0) normalised: [0.0, 0.2, 0.3, 0.3, 0.1, 0.1]" in text
    stats = dict(re.findall(r"^(rule|wrong) \(.*?\)\s+chi-square\s+([\d.]+) \(df 5\)", text,
                            re.M))
    crit = 20.515
    assert float(stats["rule"]) < crit
    assert float(stats["wrong"]) > 30 * crit
    p = [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]
    q = [0.7, 0.1, 0.05, 0.05, 0.05, 0.05]
    wrong = [round(min(a, b) + 0.5 * a, 4) for a, b in zip(p, q)]
    assert f"min(p, q) + (1 - alpha) p: {wrong}" in text
    m = re.search(rf"k = 3: {NUM} tokens per step, expected {NUM}", text)
    assert float(m.group(2)) == pytest.approx(rej.expected_tokens_per_step(0.5, 3), abs=1e-4)
    assert abs(float(m.group(1)) - float(m.group(2))) < 0.05
