"""The KV budget calculator (code/s12_kv_budget.py) against independent oracles.

Oracles: the bytes of a real S12 `PagedKVCache` allocated for the bundled model (its tensors'
nbytes); hand arithmetic from Llama-3.1-8B's published config.json (written out here, never
by calling the calculator twice); HF transformers' own parameter count (`num_parameters()`) of
the bundled checkpoint and of tiny random Llama, Mistral, Qwen2 and Qwen3 models; and every bad
input named by its parameter.
"""
from __future__ import annotations

import json

import pytest
import torch

import s03_transformer as s03
import s06_torch as s06
import s12_kv_budget as kvb
from s01_generation_loop import ParameterError
from s12_engine import PagedKVCache

# meta-llama/Llama-3.1-8B config.json, the fields the calculator reads (published values).
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 131072, "vocab_size": 128256,
               "tie_word_embeddings": False, "attention_bias": False,
               "torch_dtype": "bfloat16"}      # no head_dim: 4096 / 32 = 128
GIB = 2**30


@pytest.fixture(scope="module")
def bundled():
    model, _ = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    return model


def test_bytes_match_a_real_paged_kv_cache_of_the_bundled_model(bundled):
    per_token = kvb.kv_bytes_per_token(s03.BUNDLED_MODEL_DIR, "float32")
    for num_blocks, block_size in ((2, 1), (9, 16), (33, 8)):
        cache = PagedKVCache.for_model(bundled, num_blocks, block_size, 256)
        assert cache.nbytes == num_blocks * block_size * per_token
    # The budget's num_blocks is the largest pool the KV bytes hold: one block more does not.
    weights = sum(p.numel() * p.element_size() for p in bundled.parameters())
    budget = kvb.kv_budget(s03.BUNDLED_MODEL_DIR, gpu_memory_bytes=20_000_000,
                           gpu_memory_utilization=0.75, weight_bytes=weights,
                           reserve_bytes=1_000_000, kv_dtype="float32", block_size=16)
    assert budget.kv_bytes == 15_000_000 - weights - 1_000_000
    fits = PagedKVCache.for_model(bundled, budget.num_blocks, 16, 256).nbytes
    more = PagedKVCache.for_model(bundled, budget.num_blocks + 1, 16, 256).nbytes
    assert fits <= budget.kv_bytes < more
    assert budget.bytes_per_block == fits // budget.num_blocks


def test_parameter_count_equals_hf_for_the_bundled_checkpoint():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR)
    assert kvb.count_parameters(s03.BUNDLED_MODEL_DIR) == hf.num_parameters()
    weights_from_params = kvb.kv_budget(s03.BUNDLED_MODEL_DIR, gpu_memory_bytes=10**8,
                                        num_params=hf.num_parameters(), kv_dtype="float32")
    assert weights_from_params.kv_bytes == int(10**8 * 0.9) - 4 * hf.num_parameters()


@pytest.mark.parametrize("name", ["Llama", "Mistral", "Qwen2", "Qwen3"])
def test_parameter_count_equals_hf_for_tiny_random_models(name):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{name}Config")(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=(name == "Qwen3"),
        max_position_embeddings=64)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    assert kvb.count_parameters(config) == model.num_parameters(), name
    assert kvb.kv_shape(config) == kvb.KVShape(3, 2, config.head_dim
                                               if getattr(config, "head_dim", None) else 8)


def test_llama_31_8b_on_an_80_gb_gpu_by_hand():
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072 bytes = 128 KiB a token
    assert kvb.kv_bytes_per_token(LLAMA_31_8B) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    # parameters: embeddings and head 2 x 128256 x 4096; per layer q, o 4096^2 each, k, v
    # 4096 x 1024 each, MLP 3 x 4096 x 14336, two norms of 4096; the final norm 4096
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    params = 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert params == 8_030_261_248 == kvb.count_parameters(LLAMA_31_8B)
    b = kvb.kv_budget(LLAMA_31_8B, gpu_memory_bytes=80 * 10**9, num_params=params,
                      reserve_bytes=2 * GIB)
    kv_bytes = 72 * 10**9 - 2 * params - 2 * GIB           # 0.9 x 80 GB - weights - reserve
    assert b.kv_bytes == kv_bytes == 53_791_993_856
    assert b.bytes_per_block == 16 * 131072 == 2 * 2**20  # 2 MiB
    assert b.num_blocks == kv_bytes // (2 * 2**20) == 25_650
    assert b.num_tokens == 25_649 * 16 == 410_384         # "about 400k tokens"
    assert 131072 * 131072 == 16 * GIB                     # one contiguous request: 16 GiB
    assert b.max_requests_contiguous == kv_bytes // (16 * GIB) == 3
    assert b.max_requests_paged(2048) == 25_649 // 128 == 200
    assert b.max_requests_paged(1000) == 25_649 // 63 == 407
    assert b.max_concurrency == pytest.approx(25_650 / 8192)
    fp8 = kvb.kv_budget(LLAMA_31_8B, gpu_memory_bytes=80 * 10**9, num_params=params,
                        reserve_bytes=2 * GIB, kv_dtype="fp8")
    assert fp8.bytes_per_token == 65536 and fp8.num_blocks == kv_bytes // 2**20 == 51_300
    assert fp8.max_requests_contiguous == 6 and fp8.max_requests_paged(2048) == 400


def test_config_forms_and_head_dim(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    for form in (LLAMA_31_8B, path, str(path), tmp_path):
        assert kvb.kv_shape(form) == kvb.KVShape(32, 8, 128)
    transformers = pytest.importorskip("transformers")
    assert kvb.kv_shape(transformers.LlamaConfig(**LLAMA_31_8B)) == kvb.KVShape(32, 8, 128)
    # head_dim given wins over hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128)
    qwen3 = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "hidden_size": 1024, "head_dim": 128}
    assert kvb.kv_bytes_per_token(qwen3) == 2 * 28 * 8 * 128 * 2
    # no num_key_value_heads (or null): one KV head per query head
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kvb.kv_shape(mha) == kvb.KVShape(2, 4, 16)
    assert kvb.kv_shape({**mha, "num_key_value_heads": None}) == kvb.KVShape(2, 4, 16)
    assert kvb.kv_bytes_per_token(mha, "fp16") == 2 * 2 * 4 * 16 * 2
    assert kvb.kv_bytes_per_token(mha, "torch.float32") == 2 * 2 * 4 * 16 * 4


@pytest.mark.parametrize("config, match", [
    ({"num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 66}, "multiple"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
      "hidden_size": 64}, "divide"),
    ({"num_hidden_layers": 2.0, "num_attention_heads": 4, "hidden_size": 64}, "integer"),
    (42, "must be a dict"),
    ("/no/such/config.json", "no file"),
])
def test_bad_configs_name_the_config(config, match):
    with pytest.raises(ParameterError, match=match) as err:
        kvb.kv_shape(config)
    assert err.value.parameter == "config"


def test_count_parameters_refuses_an_unknown_layout():
    with pytest.raises(ParameterError, match="model_type") as err:
        kvb.count_parameters({**LLAMA_31_8B, "model_type": "deepseek_v3"})
    assert err.value.parameter == "config"


@pytest.mark.parametrize("kwargs, parameter", [
    (dict(gpu_memory_bytes=0), "gpu_memory_bytes"),
    (dict(gpu_memory_bytes=8e10), "gpu_memory_bytes"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.2), "gpu_memory_utilization"),
    (dict(block_size=0), "block_size"),
    (dict(reserve_bytes=-1), "reserve_bytes"),
    (dict(kv_dtype="fp4"), "kv_dtype"),
    (dict(weight_dtype="int3"), "weight_dtype"),
    (dict(num_params=None), "weight_bytes"),                # neither
    (dict(weight_bytes=10**9), "weight_bytes"),             # both
    (dict(num_params=0), "num_params"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(gpu_memory_bytes=17 * 10**9), "gpu_memory_utilization"),   # weights fill it
])
def test_bad_budgets_name_the_parameter(kwargs, parameter):
    args = dict(gpu_memory_bytes=80 * 10**9, num_params=8_030_261_248)
    with pytest.raises(ParameterError) as err:
        kvb.kv_budget(LLAMA_31_8B, **{**args, **kwargs})
    assert err.value.parameter == parameter, err.value


def test_paged_count_refuses_a_context_past_max_model_len():
    b = kvb.kv_budget(LLAMA_31_8B, gpu_memory_bytes=80 * 10**9, num_params=8_030_261_248,
                      max_model_len=8192)
    assert b.max_requests_paged(8192) == (b.num_blocks - 1) // 512
    for bad in (0, 8193, 2.5):
        with pytest.raises(ParameterError) as err:
            b.max_requests_paged(bad)
        assert err.value.parameter == "context_len"


def test_cli_prints_the_bundled_model(capsys):
    kvb.main(["--config", str(s03.BUNDLED_MODEL_DIR), "--gpu-memory-gb", "0.01",
              "--gpu-memory-utilization", "1", "--block-size", "16"])
    out = capsys.readouterr().out
    assert "model" in out and "blocks" in out and "KiB/token" in out
    with pytest.raises(SystemExit):
        kvb.main(["--config", str(s03.BUNDLED_MODEL_DIR), "--gpu-memory-gb", "0.001"])
    assert torch.get_default_dtype() == torch.float32
