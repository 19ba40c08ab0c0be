"""The S05 simulator's exported data is the work S05's engines do, counted while they run.

site/simulators/kv-cache/export.py writes, for a grid of settings, the closed forms of the
chapter (S05's `generation_work` and `kv_cache_bytes`, S03's `cost_breakdown` for weight bytes)
that the page must reproduce (tests/test_s05_simulator_browser.py). Here they are held against
independent measurements:

- on the bundled model, S05's cached `Engine` and S04's uncached one (the S01 loop with S04's
  sampling) generate each float32 setting of the grid under `count_work`: the passes they run
  (S01's stop rules, a full context included) and the FLOPs and K/V bytes they are counted
  doing equal the exported totals;
- the exported per-pass work that count_work measured equals the exported closed form pass by
  pass, and re-measuring it here gives the same counts;
- weight bytes per pass equal the bytes of the loaded model's own arrays (every matrix, bias
  and norm once, one embedding row per token), and cache memory equals a `KVCache`'s nbytes;
- the released shapes are the published models: their parameter counts are the figures their
  authors publish (Qwen3-0.6B 0.6B with 0.44B outside the embedding, GPT-2 small 124,439,808,
  Llama 3 8B 8,030,261,248), and K/V per token is 2 L Hkv D x bytes by hand.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import s03_transformer as s03
import s04_sampling as s04
from s05_kv_cache import Engine, KVCache, count_work

ROOT = Path(__file__).resolve().parents[1]
HAVE_MODEL = (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="data/model has no bundled model "
                                 "(python scripts/train_bundled_model.py trains it)")


def load_exporter():
    spec = importlib.util.spec_from_file_location("s05_sim_export_data",
                                                  ROOT / "site" / "simulators" / "kv-cache" / "export.py")
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
def bundled():
    if not HAVE_MODEL:
        pytest.skip("no bundled model")
    import s03_checkpoint
    return s03_checkpoint.load(s03.BUNDLED_MODEL_DIR)[0]


class IdTokenizer:
    """Prompts as ids written out ("5 17 3"), so a prompt has exactly the length asked for."""

    def __init__(self, vocab_size: int, eos_id: int):
        self.vocab_size, self.eos_id = vocab_size, eos_id

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def case(data, config, dtype_bytes, prompt_len, new_tokens, cached):
    keys = ("config", "dtype_bytes", "prompt_len", "new_tokens", "cached")
    found = [c for c in data["cases"] if tuple(c[k] for k in keys) ==
             (config, dtype_bytes, prompt_len, new_tokens, cached)]
    assert len(found) == 1
    return found[0]


@needs_model
@pytest.mark.parametrize("prompt_len, new_tokens", [(16, 160), (1, 1), (250, 20), (256, 5)])
def test_engines_counted_equal_the_exported_totals(data, bundled, prompt_len, new_tokens):
    cfg = bundled.config
    tokenizer = IdTokenizer(cfg.vocab_size, cfg.eos_token_ids[0])
    prompt = " ".join(str(3 + (7 * i) % 2000) for i in range(prompt_len))
    params = s04.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    limit = cfg.max_position_embeddings
    for cached, engine_class in ((True, Engine), (False, s04.Engine)):
        ref = case(data, "bundled", 4, prompt_len, new_tokens, cached)
        with count_work(bundled) as work:
            completion = engine_class(bundled, tokenizer, limit).generate(prompt, params)
        assert completion.stats.passes == ref["passes"]
        totals = ref["totals"]
        assert 2 * work.weight_macs == int(totals["weight_flops"]), cached
        assert 2 * work.attention_macs == int(totals["attention_flops"]), cached
        assert work.kv_bytes_read == int(totals["kv_bytes_read"]), cached
        assert int(totals["fed"]) == (prompt_len + ref["passes"] - 1 if cached and ref["passes"]
                                      else sum(prompt_len + i for i in range(ref["passes"])))
        if ref["passes"] < new_tokens:
            assert completion.finish_reason == "length"


@needs_model
def test_measured_work_is_the_closed_form_pass_by_pass(data, exporter, bundled):
    measured = data["measured"]
    assert measured is not None
    prompt_ids = bundled_prompt(exporter, measured)
    for cached, mode in ((True, "on"), (False, "off")):
        again = exporter.measure(bundled, prompt_ids, measured["new_tokens"], cached)
        assert [[str(2 * w.weight_macs), str(2 * w.attention_macs), str(w.kv_bytes_read)]
                for w in again] == measured["runs"][mode]
        ref = case(data, "bundled", 4, measured["prompt_len"], measured["new_tokens"], cached)
        for shown in ref["shown"]:
            row = measured["runs"][mode][shown["pass"]]
            assert row == [shown["values"][k] for k in ("weight_flops", "attention_flops",
                                                        "kv_bytes_read")]
    # the first decode at context 17, by hand: 2 x (6 x 196,608 + 128 x 2,048) weight FLOPs,
    # 2 x 6 x 2 x 4 x 32 x 17 attention FLOPs, 6 x 2 x 2 x 32 x 17 x 4 bytes of K and V
    assert measured["runs"]["on"][1] == [str(2 * (6 * 196_608 + 128 * 2_048)),
                                         str(2 * 6 * 2 * 4 * 32 * 17), str(6 * 2 * 2 * 32 * 17 * 4)]


def bundled_prompt(exporter, measured):
    import s03_checkpoint
    tokenizer = s03_checkpoint.load(s03.BUNDLED_MODEL_DIR)[1]
    return tokenizer.encode(measured["text"])[:measured["prompt_len"]]


@needs_model
def test_weight_bytes_and_cache_memory_are_the_model_s_own_arrays(data, bundled):
    cfg = bundled.config
    matrices = sum(a.nbytes for block in bundled.blocks for a in block.w.values())
    matrices += sum(a.nbytes for a in bundled.final_norm if a is not None) + bundled.lm_head.nbytes
    row = bundled.embed_tokens[0].nbytes                 # one looked-up row: C float32 values
    ref = case(data, "bundled", 4, 16, 160, True)
    first, second = ref["shown"][0]["values"], ref["shown"][1]["values"]
    assert int(first["weight_bytes"]) == matrices + 16 * row        # the prefill: 16 lookups
    assert int(second["weight_bytes"]) == matrices + row            # a decode: one
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, 17, cfg.head_dim)
    assert int(second["cache_used"]) == cache.nbytes                # 17 positions after pass 2
    off = case(data, "bundled", 4, 16, 160, False)["shown"][1]["values"]
    assert off["cache_used"] == "0" and off["kv_written"] == "0"
    assert int(off["weight_bytes"]) == matrices + 17 * row


def test_released_shapes_are_the_published_models(data):
    configs = {c["id"]: c for c in data["configs"]}
    assert configs["gpt2"]["parameters"] == 124_439_808
    assert configs["llama3-8b"]["parameters"] == 8_030_261_248
    qwen = configs["qwen3-0.6b"]
    # Qwen's model card: 0.6B parameters, 0.44B of them outside the (tied) embedding
    assert round(qwen["parameters"] / 1e9, 1) == 0.6
    assert round((qwen["parameters"] - qwen["V"] * qwen["C"]) / 1e9, 2) == 0.44
    ref = case(data, "qwen3-0.6b", 2, 16, 160, True)
    decode = ref["shown"][1]["values"]
    assert int(decode["kv_bytes_written"]) == 2 * 28 * 8 * 128 * 2     # 114,688 bytes
    assert int(decode["kv_bytes_read"]) == 17 * 2 * 28 * 8 * 128 * 2
    # bf16 weights read by one decode: every parameter once plus the looked-up embedding row
    assert int(decode["weight_bytes"]) == 2 * qwen["parameters"] + 2 * qwen["C"]


def test_crossover_is_where_kv_bytes_pass_weight_bytes(data):
    for c in data["cases"]:
        if not c["cached"]:
            continue
        n_star = data["crossover"][c["config"]][str(c["dtype_bytes"])]
        for shown in c["shown"]:
            v = shown["values"]
            if shown["pass"] == 0:
                continue
            kv_wins = int(v["kv_bytes_read"]) > int(v["weight_bytes"])
            assert kv_wins == (int(v["context"]) >= n_star), (c["config"], v["context"])
    # the chapter's figure for Qwen3-0.6B: the crossing lies just above 10,394 tokens
    assert data["crossover"]["qwen3-0.6b"] == {"4": 10_395, "2": 10_395}


def test_export_is_json_with_counts_as_strings(data):
    import json
    text = json.dumps(data, allow_nan=False)
    assert len(text) < 200_000
    for c in data["cases"]:
        for shown in c["shown"]:
            assert all(isinstance(x, str) and x.isdigit() for x in shown["values"].values())
    big = int(case(data, "qwen3-0.6b", 2, 1, 40960, False)["totals"]["flops"])
    assert big > 2 ** 53          # why counts travel as strings and the page uses BigInt
    np.testing.assert_equal(len(data["configs"]), 4 if HAVE_MODEL else 3)
