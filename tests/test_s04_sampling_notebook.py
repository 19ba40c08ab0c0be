"""The S04 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/, Jupyter's usual working directory. Checks: no cell fails, the plots and the
widget are there, and the numbers it prints agree with values worked out here by hand or in
closed form (the penalty-order example, the min-p / top-p order example), not by the code under
test. The notebook runs on whatever `load_demo_model()` returns (the bundled transformer in
data/model/, S02's bigram model without it), so those checks hold for any model. The last two
tests are of another kind: the chapter quotes what the bundled model does (the kept-token
table, the chi-square value, the tour of `python code/s04_sampling.py`), and they check that
those quotes are what the notebook and the engine print now, so a retrained model must come with
an updated chapter. They skip when data/model/ is not there.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import assert_committed_without_outputs, code_source, WIDGET_MIME, execute, outputs as _outputs, stream_text as _text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s04_sampling.ipynb"
CHAPTER = ROOT / "chapters" / "s04-sampling.md"
BUNDLED = ROOT / "data" / "model" / "model.safetensors"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_sampler_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s04_sampling import" in source
    for name in ("Engine", "SamplingParams", "process_logits", "draw", "softmax", "apply_top_p",
                 "apply_top_k", "apply_min_p", "apply_temperature", "load_demo_model"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_shows_plots_and_widget(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the six knobs, kept tokens against top_p / min_p, the draws
    assert any(WIDGET_MIME in o.get("data", {}) for o in _outputs(executed))
    m = re.search(r"widget ready: (\d+) tokens kept at top_k 5", _text(executed))
    assert m and int(m.group(1)) >= 5  # ties at the 5th value may keep more, never fewer


@pytest.mark.slow
def test_penalty_order_example_matches_the_closed_form(executed):
    # logits (2, 1, 0), token 0 penalised by 1, temperature 0.5, worked by hand:
    e = math.exp
    no_penalty = e(4) / (e(4) + e(2) + 1)       # (4, 2, 0)
    ours = e(2) / (e(2) + e(2) + 1)             # ((2 - 1) / 0.5, 1 / 0.5, 0) = (2, 2, 0)
    reversed_order = e(3) / (e(3) + e(2) + 1)   # (4 - 1, 2, 0)
    text = _text(executed)
    assert f"no penalty:                      {no_penalty:.4f}" in text
    assert f"penalty then temperature (ours): {ours:.4f}" in text
    assert f"temperature then penalty:        {reversed_order:.4f}" in text


@pytest.mark.slow
def test_min_p_top_p_order_example_matches_the_hand_computation(executed):
    # p = (0.5, 0.3, 0.2), min_p 0.5, top_p 0.6: min-p first keeps {0}; top-p first keeps {0, 1}.
    text = _text(executed)
    assert "kept, min-p then top-p (this chapter, vLLM): {0}" in text
    assert "kept, top-p then min-p (HF generate):        {0, 1}" in text


@pytest.mark.slow
def test_edges_are_finite_and_the_naive_softmax_is_not(executed):
    text = _text(executed)
    assert "all finite: True" in text
    m = re.search(r"naive softmax\(raw / 1e-6\): nan entries = (\d+)", text)
    assert m and int(m.group(1)) > 0
    assert re.search(r"temperature 1e-6\s+tokens with p > 0:  1, max p = 1.0000", text)
    assert re.search(r"all-equal logits, top_p 0.5\s+tokens with p > 0:  4, max p = 0.2500", text)


@pytest.mark.slow
def test_knob_table_and_sampling_checks(executed):
    text = _text(executed)
    vocab = int(re.search(r"V = ([\d,]+);", text).group(1).replace(",", ""))
    # Temperature alone never removes a token; top_k 5 keeps at least 5.
    assert len(re.findall(rf"temperature 1\.0\s+{vocab}\s+1\.000\s", text)) == 2
    assert all(int(k) >= 5 for k in re.findall(r"top_k 5\s+(\d+)", text))
    m = re.search(r"every draw kept: True\nchi-square statistic ([\d.]+) with (\d+) degrees", text)
    assert m, "the sampling check line is missing"
    chi2, dof = float(m.group(1)), int(m.group(2))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)  # far in the tail would mean a broken sampler
    assert "same tokens both times: True | seed 1 differs: True" in text


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)


def test_prompts_are_the_corpus_own_text():
    # data/shakespeare.txt writes a speaker as `Ham.` on a line of its own, never `HAMLET:`; a
    # prompt in that form is in the format the bundled model learned.
    import ast
    corpus = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    notebook = re.findall(r"^(?:PEAKED_)?PROMPT = (\".*?\")", code_source(NOTEBOOK), re.MULTILINE)
    cli = re.findall(r'"--prompt", default=(".*?")',
                     (ROOT / "code" / "s04_sampling.py").read_text(encoding="utf-8"))
    assert len(notebook) == 2 and len(cli) == 1
    for prompt in map(ast.literal_eval, notebook + cli):
        assert prompt.startswith("Ham.\n") and prompt in corpus, prompt


def _chapter_prose() -> str:
    # Line breaks in the Markdown source are spaces in the text the reader sees.
    return " ".join(CHAPTER.read_text(encoding="utf-8").split())


def _quoted(text: str) -> str:
    return "`" + text.replace("\n", "\\n") + "`"   # the chapter writes a line break as \n


@pytest.mark.slow
@pytest.mark.skipif(not BUNDLED.exists(), reason="data/model/ (the bundled model) is not there")
def test_chapter_quotes_what_the_notebook_measures_on_the_bundled_model(executed):
    text, chapter = _text(executed), _chapter_prose()
    assert "model: bundled model" in text
    (h_flat, top_flat), (h_sharp, top_sharp) = re.findall(
        r"(?:flat|peaked) context: H = ([\d.]+) nats, top p = ([\d.]+)", text)
    assert f"flat (entropy {h_flat} nats" in chapter and f"at {top_flat})" in chapter
    assert f"sharp ({h_sharp} nats" in chapter and f"at {top_sharp})" in chapter
    for name in ("top_k 5", "top_k 50", "top_p 0.5", "top_p 0.9", "min_p 0.05", "min_p 0.1"):
        (k_flat, m_flat), (k_sharp, m_sharp) = re.findall(
            rf"^  {re.escape(name)}\s+(\d+)\s+([\d.]+)\s+[\d.]+$", text, re.MULTILINE)
        row = f"| `{name.replace(' ', '=')}` | {k_flat} | {m_flat} | {k_sharp} | {m_sharp} |"
        assert row in chapter, row
    nan = re.search(r"nan entries = (\d+)", text).group(1)
    assert f"{nan} of the 2,048 logits are positive" in chapter
    assert f"returns NaN for those {nan} tokens" in chapter
    chi2, dof = re.search(r"chi-square statistic ([\d.]+) with (\d+) degrees", text).groups()
    assert f"$X^2 = {chi2}$ with {dof} degrees of freedom" in chapter


@pytest.mark.skipif(not BUNDLED.exists(), reason="data/model/ (the bundled model) is not there")
def test_chapter_quotes_the_tour_on_the_bundled_model():
    # The texts are what `python code/s04_sampling.py` prints with its defaults (20 tokens,
    # seed 0), produced here by the same engine and settings.
    from s04_sampling import DEMO_SETTINGS, Engine, SamplingParams, load_demo_model

    chapter = _chapter_prose()
    model, tokenizer, _ = load_demo_model()
    engine = Engine(model, tokenizer, model.config.max_position_embeddings)
    settings = dict(DEMO_SETTINGS)
    prompt = "Ham.\nTo be, or not to be"

    def run(label, max_tokens=20, eng=engine):
        params = SamplingParams(max_tokens=max_tokens, seed=0, logprobs=3, **settings[label])
        return eng.generate(prompt, params)

    words = "zero one two three four five six seven eight nine ten eleven twelve".split()
    assert chapter.count(f"{words[len(DEMO_SETTINGS)]} settings, seed 0") == 2
    greedy = run("greedy")
    assert greedy.finish_reason == "stop"
    assert f"greedy gives {_quoted(greedy.text)} and stops" in chapter
    assert f"EOS has probability {math.exp(greedy.logprobs[-1].logprob):.2f}" in chapter
    for label in ("greedy, min_tokens 20", "greedy, min_tokens 20, repetition_penalty 1.3",
                  "greedy, min_tokens 20, frequency_penalty 1.0"):
        assert _quoted(run(label).text) in chapter, label
    hot = run("temperature 1.5")
    unlikely = sum(math.exp(lp.logprob) < 0.01 for lp in hot.logprobs)
    assert f"{_quoted(hot.text)}, words" in chapter
    assert f"{unlikely} of the {len(hot.token_ids)} tokens had probability below 0.01" in chapter
    first = run("temperature 1, top_k 5", max_tokens=1)
    sampler = run("temperature 1, top_k 5", max_tokens=1,
                  eng=Engine(model, tokenizer, model.config.max_position_embeddings,
                             logprobs_mode="processed_logprobs"))
    assert (f"the first token {_quoted(tokenizer.decode(first.token_ids))} has probability "
            f"{math.exp(first.logprobs[0].logprob):.3f} under the model and "
            f"{math.exp(sampler.logprobs[0].logprob):.3f} under the sampler") in chapter
