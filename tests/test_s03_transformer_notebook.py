"""The S03 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/, Jupyter's usual working directory. Checks: no cell fails (the notebook asserts
nothing itself, it prints; the checks are here), its plots are there, and the numbers it prints
agree with oracles computed here, not by the code under test: parameter counts of the same
architecture built by `transformers`, closed forms for RoPE periods, KV bytes and GPT-2's size,
and, on the bundled model, `transformers`' logits and greedy tokens (which the notebook compares
and this test reads back).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import assert_committed_without_outputs, code_source, execute, outputs as _outputs, stream_text as _text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s03_transformer.ipynb"
BUNDLED = ROOT / "data" / "model" / "model.safetensors"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_model_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s03_transformer import" in source and "from s01_generation_loop import Engine" in source
    for name in ("Transformer", "Qwen3Block", "GPT2Block", "attention", "attention_probs", "rope",
                 "apply_rope", "rms_norm", "swiglu_mlp", "load", "cost_breakdown", "Engine"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_shows_its_plots(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # heat maps, RoPE, breakdown, FLOP shares, distributions, timing
    text = _text(executed)
    assert "forward by hand == model.forward: True" in text
    assert "GQA by reshape == MHA on repeated K/V: True" in text
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for o in _outputs(executed))
    assert re.search(r"explorer ready: \d+ tokens, layer 0, head 0", text)


def _dims(text: str) -> dict[str, float]:
    m = re.search(r"C = (\d+), L = (\d+), H = (\d+), Hkv = (\d+), D = (\d+), I = (\d+), V = (\d+), "
                  r"context (\d+), rope_theta ([\d.e+]+)", text)
    assert m, "the dimensions line is missing"
    keys = ("C", "L", "H", "Hkv", "D", "I", "V", "context")
    dims = {k: int(v) for k, v in zip(keys, m.groups()[:8])}
    dims["theta"] = float(m.group(9))
    return dims


@pytest.mark.slow
def test_printed_parameter_count_equals_transformers(executed):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    text = _text(executed)
    d = _dims(text)
    printed = int(re.search(r"qwen3: ([\d,]+) parameters", text).group(1).replace(",", ""))
    config = Qwen3Config(vocab_size=d["V"], hidden_size=d["C"], num_hidden_layers=d["L"],
                         num_attention_heads=d["H"], num_key_value_heads=d["Hkv"],
                         head_dim=d["D"], intermediate_size=d["I"], tie_word_embeddings=True)
    with torch.device("meta"):  # shapes only: nothing is allocated or initialised
        hf = Qwen3ForCausalLM(config)
    assert printed == sum(p.numel() for p in hf.parameters())


@pytest.mark.slow
def test_printed_rope_and_kv_numbers_follow_their_closed_forms(executed):
    text = _text(executed)
    d = _dims(text)
    slowest = d["theta"] ** (-(d["D"] - 2) / d["D"])
    assert f"period {2 * math.pi:.1f} positions" in text  # the fastest pair turns 1 rad/position
    assert f"period {2 * math.pi / slowest:,.0f} positions" in text
    kv = 2 * d["Hkv"] * d["D"] * 4 * d["L"]
    assert f"per token (float32, all layers): {kv:,} bytes; {kv * d['H'] // d['Hkv']:,} without GQA" in text
    spread = float(re.search(r"along any diagonal m - n = const: ([\d.e+-]+)", text).group(1))
    assert spread < 1e-4


@pytest.mark.slow
def test_printed_gpt2_size_is_the_hand_count(executed):
    # GPT-2 small: V = 50257, 1024 positions, C = 768, 12 layers; per layer 12 C^2 + 13 C
    # (c_attn 3C^2 + 3C, c_proj C^2 + C, MLP 8C^2 + 5C, two LayerNorms 4C), final LayerNorm 2C.
    v, p, c, n_layers = 50257, 1024, 768, 12
    total = v * c + p * c + n_layers * (12 * c * c + 13 * c) + 2 * c
    assert total == 124_439_808
    assert re.search(rf"GPT-2\s+{total:,} parameters", _text(executed))


@pytest.mark.slow
@pytest.mark.skipif(not BUNDLED.exists(), reason="data/model/ (the bundled model) is not there yet")
def test_bundled_model_matches_transformers_in_the_notebook(executed):
    text = _text(executed)
    assert "model: bundled" in text
    diff = float(re.search(r"max \|logits - transformers\| over \d+ positions x \d+ tokens: "
                           r"([\d.e+-]+)", text).group(1))
    assert diff < 1e-4
    assert re.search(r"greedy tokens equal to transformers generate: True \((\d+) tokens\)", text)


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)


@pytest.mark.skipif(not BUNDLED.exists(), reason="data/model/ (the bundled model) is not there yet")
def test_chapter_quotes_what_the_bundled_model_does():
    # The prose quotes the bundled model's size, validation loss and completions; a retrained
    # model must come with an updated chapter. Sizes are counted by transformers, the text is
    # produced by the S01 loop on the chapter's model.
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from s01_generation_loop import Engine
    from s03_checkpoint import load

    chapter = (ROOT / "chapters" / "s03-transformer.md").read_text(encoding="utf-8")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED.parent))
    assert f"**{sum(p.numel() for p in hf.parameters()):,}**" in chapter
    log = json.loads((BUNDLED.parent / "training_log.json").read_text())
    assert f"its loss is {log['final_val_loss']:.2f} nats per token" in chapter
    assert f"a perplexity of {log['final_val_perplexity']:.1f}" in chapter
    model, tokenizer = load(BUNDLED.parent)
    engine = Engine(model, tokenizer, max_context=model.config.max_position_embeddings)
    greedy = engine.generate("Romeo.\n", 60)
    assert f"```text\n{greedy.text}\n```" in chapter
    assert f"{len(greedy.token_ids)} tokens in all, EOS included" in " ".join(chapter.split())
    sampled = engine.generate("Juliet.\n", 60, 0.8, 1)
    assert f"`{sampled.text}`" in chapter
    sampled = engine.generate("Romeo.\n", 40, 0.8, 1)
    assert f"```text\n{sampled.text}\n```" in chapter


@pytest.mark.skipif(not BUNDLED.exists(), reason="data/model/ (the bundled model) is not there yet")
def test_chapter_figure_and_quiz_state_the_bundled_dimensions():
    # The walkthrough, the cost table, the figure and a quiz question use the bundled model's
    # dimensions; they must be those of data/model/config.json (a retrained model of another
    # size must come with updated prose).
    import json

    from s03_checkpoint import load_config
    from s03_transformer import bytes_per_token, flops_per_token

    cfg = load_config(BUNDLED.parent)
    c, n_layers, h, hkv, d, i = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    chapter = " ".join((ROOT / "chapters" / "s03-transformer.md").read_text().split())
    assert (f"$C = {c}$, $L = {n_layers}$ layers, $H = {h}$ query heads and $H_{{kv}} = {hkv}$ "
            f"key/value heads of $D = {d}$ dimensions, an MLP of inner width $I = {i}$, a "
            f"vocabulary of $V = " + f"{cfg.vocab_size:,}".replace(",", "{,}") + "$") in chapter
    assert f"**{flops_per_token(cfg, 1):,}** | **{bytes_per_token(cfg, 1):,}**" in chapter
    figure = (ROOT / "chapters" / "figures" / "s03-block.svg").read_text()
    assert (f"bundled model: C = {c}, H = {h}, Hkv = {hkv}, D = {d}, I = {i}, L = {n_layers}, "
            f"V = {cfg.vocab_size}") in figure
    quiz = json.loads((ROOT / "site" / "quizzes" / "s03-transformer.json").read_text())
    assert any(f"(C = {c}, H = {h}, Hkv = {hkv}, D = {d}, I = {i})" in q["question"]
               for q in quiz["questions"])
