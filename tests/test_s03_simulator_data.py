"""The S03 "Try it" simulator shows what the model computes: its exported data against transformers.

site/simulators/transformer-attention/export.py computes, with code/s03_transformer.py, the
attention weights of every layer and head and the next-token distributions that the page draws.
The oracle here is Hugging Face `transformers` on the same checkpoint: `output_attentions=True`
with the eager implementation gives the attention weights, and its logits give the
distributions. The checkpoint is a small random Qwen3 (with the project tokenizer) saved in a
temporary folder, so the test does not depend on the bundled model; the exporter is pointed at
it. Without a checkpoint the exporter must say so rather than export anything.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "site" / "simulators" / "transformer-attention" / "export.py"


def exporter(model_dir: Path):
    spec = importlib.util.spec_from_file_location("s03_sim_export_under_test", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.BUNDLED_MODEL_DIR = model_dir
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("tiny_qwen3")
    config = Qwen3Config(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=2047, eos_token_id=2047, pad_token_id=2047)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # spread-out attention, so a wrong weight would show
    model.save_pretrained(directory)
    shutil.copy(ROOT / "data" / "tokenizer.json", directory / "tokenizer.json")
    return directory, model


def test_export_without_a_model_says_so(tmp_path):
    data = exporter(tmp_path / "nothing_here").export()
    assert data["available"] is False and "data/model" in data["reason"]


@pytest.mark.slow
def test_exported_attention_and_distributions_equal_transformers(checkpoint):
    directory, hf = checkpoint
    module = exporter(directory)
    data = module.export()
    json.dumps(data, allow_nan=False)  # what the site writes must be valid JSON
    assert data["available"] is True
    assert data["model"]["L"] == 2 and data["model"]["H"] == 4 and data["model"]["Hkv"] == 2
    assert data["model"]["parameters"] == sum(p.numel() for p in hf.parameters())

    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for prompt, exported in zip(module.PROMPTS, data["prompts"]):
        ids = tokenizer.encode(prompt).ids
        assert len(exported["tokens"]) == len(ids)
        assert "".join(exported["tokens"]) == prompt
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_attentions=True)
        t_len = len(ids)
        for layer, heads in enumerate(exported["attn"]):
            ref = out.attentions[layer][0].numpy()  # (H, T, T)
            for head, flat in enumerate(heads):
                lower = np.concatenate([ref[head, t, :t + 1] for t in range(t_len)])
                np.testing.assert_allclose(flat, lower, atol=6e-5)  # rounded to 4 decimals
        logits = out.logits[0].double().numpy()  # (T, V)
        for t, dists in enumerate(exported["next"]):
            for temperature in module.TEMPERATURES:
                z = logits[t] / temperature
                p = np.exp(z - z.max())
                p /= p.sum()
                top = np.sort(p)[::-1][:module.TOP_K]
                got = [prob for _, prob in dists[f"{temperature:.1f}"]]
                np.testing.assert_allclose(got, top, atol=6e-5)
            greedy = int(np.argmax(logits[t]))
            assert dists["greedy"] == tokenizer.decode([greedy], skip_special_tokens=False) \
                or greedy == 2047
