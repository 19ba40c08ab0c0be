"""The KV budget calculator (code/s12_kv_budget.py) against independent oracles.

Oracles: the bytes of a real S12 `PagedKVCache` allocated for the bundled model (its tensors'
nbytes); hand arithmetic from Llama-3.1-8B's published config.json (written out here, never
by calling the calculator twice); HF transformers' own parameter count (`num_parameters()`) of
the bundled checkpoint, of tiny random Llama, Mistral, Qwen2 and Qwen3 models (with and without
the attention and MLP biases) and of the published presets; every bad input named by its
parameter (unreadable configs, booleans given as strings, sizes past what a float holds, the
parameter responsible when no two blocks fit), never replaced by a default; on the command line
the same as usage errors (exit status 2) naming the flag and its unit; --help (a text and a
default for every flag); and the CLI's output against what the chapter quotes of it.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

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
ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("name, extra", [
    ("Llama", {}), ("Mistral", {}), ("Qwen2", {}), ("Qwen3", {}),
    # the biases each layout has in transformers' modeling_<type>.py: Llama's attention_bias
    # puts one on q, k, v and o, its mlp_bias on gate, up and down; Qwen3's attention_bias on
    # q, k, v and o; Mistral has none whatever the config says; Qwen2 q, k and v always
    ("Llama", dict(attention_bias=True)), ("Llama", dict(mlp_bias=True)),
    ("Llama", dict(attention_bias=True, mlp_bias=True)), ("Qwen3", dict(attention_bias=True)),
    ("Mistral", dict(attention_bias=True)), ("Qwen2", dict(attention_bias=True)),
])
def test_parameter_count_equals_hf_for_tiny_random_models(name, extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{name}Config")(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=(name == "Qwen3"),
        max_position_embeddings=64, **extra)
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
    ("no\0such", "no file"),                          # a NUL byte: no file can have it
    ("x" * 5000, "no file"),                          # a name too long for the OS
    ({"model_type": "llava", "text_config": {"num_hidden_layers": 2}}, "text_config"),
])
def test_bad_configs_name_the_config(config, match):
    with pytest.raises(ParameterError, match=match) as err:
        kvb.kv_shape(config)
    assert err.value.parameter == "config"


def test_count_parameters_refuses_an_unknown_layout():
    with pytest.raises(ParameterError, match="model_type") as err:
        kvb.count_parameters({**LLAMA_31_8B, "model_type": "deepseek_v3"})
    assert err.value.parameter == "config"
    assert "weight_bytes" in str(err.value) and "--weight-bytes" in str(err.value)


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", None),
    ("tie_word_embeddings", 0), ("attention_bias", "false"), ("mlp_bias", "true"),
])
def test_boolean_fields_must_be_booleans(field, value):
    # "false" is a true value in Python: read as one it would tie the embeddings or add biases
    with pytest.raises(ParameterError, match=f"{field} must be a boolean") as err:
        kvb.count_parameters({**LLAMA_31_8B, field: value})
    assert err.value.parameter == "config"


def test_a_config_nesting_its_text_model_says_what_to_pass(tmp_path):
    nested = {"model_type": "llava", "torch_dtype": "bfloat16", "text_config": LLAMA_31_8B}
    for call in (kvb.kv_shape, kvb.count_parameters, kvb.kv_bytes_per_token):
        with pytest.raises(ParameterError, match="nests its text model under text_config") as err:
            call(nested)
        assert err.value.parameter == "config" and "pass the text_config" in str(err.value)
    assert kvb.count_parameters(kvb.load_config(nested)["text_config"]) == 8_030_261_248


class ToDictReturns:
    def __init__(self, value):
        self.value = value

    def to_dict(self):
        return self.value


def deep_json(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    return tmp_path / "deep.json"


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "bin.json", "not UTF-8"),
    (lambda d: d / "bom.json", "is not JSON"),
    (deep_json, "too deeply"),
    (lambda d: d / "list.json", "no JSON object"),
    (lambda d: d / "digits.json", "is not JSON"),     # an integer past Python's 4,300 digits
    (lambda d: ToDictReturns([("num_hidden_layers", 2)]), r"to_dict\(\) must return a dict"),
    (lambda d: ToDictReturns(None), "must return a dict"),
])
def test_unreadable_configs_are_parameter_errors(tmp_path, make, match):
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\xff\xfe\x00")
    (tmp_path / "bom.json").write_bytes(b"\xff\xfe")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "digits.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    with pytest.raises(ParameterError, match=match) as err:
        kvb.kv_shape(make(tmp_path))
    assert err.value.parameter == "config"


def test_auto_is_the_configs_dtype_and_says_how_vllm_differs():
    # The bundled model's config is float32: "auto" counts 4 bytes an element, as the course's
    # engine runs it (and as the chapter's quoted output shows); vLLM's auto would run it in
    # 16 bits, which is what "bfloat16" gives.
    per_token = 2 * 6 * 2 * 32
    assert kvb.config_dtype(s03.BUNDLED_MODEL_DIR) == "float32"
    assert kvb.kv_dtype_of(s03.BUNDLED_MODEL_DIR) == "float32"
    assert kvb.kv_bytes_per_token(s03.BUNDLED_MODEL_DIR) == 4 * per_token
    assert kvb.kv_bytes_per_token(s03.BUNDLED_MODEL_DIR, "AUTO") == 4 * per_token
    assert kvb.kv_bytes_per_token(s03.BUNDLED_MODEL_DIR, "bfloat16") == 2 * per_token
    assert kvb.config_dtype({}) == "bfloat16"
    for bad in ("float64", "", 4):                   # the config's dtype, read for "auto"
        with pytest.raises(ParameterError, match="torch_dtype must be one of") as err:
            kvb.kv_bytes_per_token({**LLAMA_31_8B, "torch_dtype": bad})
        assert err.value.parameter == "config"
    doc = " ".join(kvb.__doc__.split())
    assert "_resolve_auto_dtype" in doc and "float32 config" in doc


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
    (dict(gpu_memory_bytes=10**400), "gpu_memory_bytes"),   # past a float: 2**53 at most
    (dict(gpu_memory_bytes=2**53 + 1), "gpu_memory_bytes"),
    (dict(reserve_bytes=10**400), "reserve_bytes"),
    (dict(num_params=None, weight_bytes=10**400), "weight_bytes"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization"),
    (dict(weight_dtype=0), "weight_dtype"),                 # never the config's dtype instead
    (dict(weight_dtype=""), "weight_dtype"),
    (dict(kv_dtype=""), "kv_dtype"),
    (dict(kv_dtype=None), "kv_dtype"),
    (dict(num_params=None, weight_bytes=10**9, weight_dtype="fp8"), "weight_dtype"),  # unused
    (dict(max_model_len=10**400, block_size=10**400), "block_size"),  # no OverflowError
])
def test_bad_budgets_name_the_parameter(kwargs, parameter):
    args = dict(gpu_memory_bytes=80 * 10**9, num_params=8_030_261_248)
    with pytest.raises(ParameterError) as err:
        kvb.kv_budget(LLAMA_31_8B, **{**args, **kwargs})
    assert err.value.parameter == parameter, err.value


def test_max_model_len_errors_give_their_own_reason():
    args = dict(gpu_memory_bytes=80 * 10**9, num_params=8_030_261_248)
    with pytest.raises(ParameterError) as given:
        kvb.kv_budget(LLAMA_31_8B, **args, max_model_len=0)
    assert "max_position_embeddings" not in str(given.value) and "(got 0)" in str(given.value)
    no_default = {k: v for k, v in LLAMA_31_8B.items() if k != "max_position_embeddings"}
    with pytest.raises(ParameterError, match="max_position_embeddings") as missing:
        kvb.kv_budget(no_default, **args)
    assert missing.value.parameter == "max_model_len"
    huge = kvb.kv_budget(LLAMA_31_8B, **args, max_model_len=10**400)   # ints, no float overflow
    assert huge.max_concurrency == 0.0 and huge.max_requests_contiguous == 0


@pytest.mark.parametrize("kwargs, parameter, named", [
    # the weights (16.06 GB) fill 0.9 x 17 GB: the memory is named, with every contributor
    (dict(gpu_memory_bytes=17 * 10**9), "gpu_memory_utilization",
     ["gpu_memory_utilization 0.9", "gpu_memory_bytes 17,000,000,000", "16,060,522,496",
      "reserve_bytes 0", "block_size 16"]),
    # 56 GB of KV, but a block of 10**12 tokens takes 131 PB: the block size is the cause
    (dict(block_size=10**12), "block_size",
     ["block_size 1,000,000,000,000 is too large", "block_size at most 213,392 fits"]),
    # without the reserve there is room: the reserve is the cause
    (dict(reserve_bytes=10**11), "reserve_bytes",
     ["reserve_bytes 100,000,000,000 is too large", "reserve_bytes at most 55,935,283,200"]),
])
def test_too_little_memory_names_the_parameter_responsible(kwargs, parameter, named):
    args = dict(gpu_memory_bytes=80 * 10**9, num_params=8_030_261_248)
    with pytest.raises(kvb.KVShortage) as err:
        kvb.kv_budget(LLAMA_31_8B, **{**args, **kwargs})
    assert err.value.parameter == parameter and "fewer than 2 blocks" in str(err.value)
    for text in named:
        assert text in str(err.value), text
    # the largest value the message offers does fit, one more does not
    if parameter == "block_size":
        assert kvb.kv_budget(LLAMA_31_8B, **args, block_size=213_392).num_blocks == 2
    if parameter == "reserve_bytes":
        assert kvb.kv_budget(LLAMA_31_8B, **args, reserve_bytes=55_935_283_200).num_blocks == 2
        with pytest.raises(kvb.KVShortage):
            kvb.kv_budget(LLAMA_31_8B, **args, reserve_bytes=55_935_283_201)


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
    header, row = next((line, out.splitlines()[i + 1])
                       for i, line in enumerate(out.splitlines()) if line.startswith("model  "))
    assert header.split() == ["model", "KV/token", "blocks", "tokens", "max_model_len",
                              "contiguous", "paged@4"]          # 256 // 64 by default
    per_token = 2 * 6 * 2 * 32 * 4                               # 6 layers, 2 KV heads of 32
    kv = 10**7 - 4 * 1_443_840                                   # float32 weights
    assert row.split() == ["model", "3.0", "KiB", f"{kv // (16 * per_token):,}",
                           f"{(kv // (16 * per_token) - 1) * 16:,}", "256",
                           str(kv // (256 * per_token)), str(kv // (16 * per_token) - 1)]
    for column in ("KV/token", "blocks", "tokens", "max_model_len", "contiguous", "paged@4"):
        assert re.search(rf"^  {re.escape(column)} +\S", out, re.M), column   # its legend
    for argv, message in (
            (["--gpu-memory-gb", "0.001"], "fewer than 2 blocks"),
            (["--gpu-memory-gb", "0.01", "--context-len", "257"], "context_len must be"),
            (["--gpu-memory-gb", "0.01", "--kv-dtype", "fp4"], "kv_dtype must be")):
        with pytest.raises(SystemExit) as stop:
            kvb.main(["--config", str(s03.BUNDLED_MODEL_DIR), *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv
    assert torch.get_default_dtype() == torch.float32


BAD_GB = "argument --gpu-memory-gb: must be a number of GB (10^9 bytes) in [1e-09, 1e+06]"
BAD_GIB = "argument --reserve-gib: must be a number of GiB (2^30 bytes) in [0, 1e+06]"


@pytest.mark.parametrize("argv, messages", [
    (["--gpu-memory-gb", "nan"], [BAD_GB, "(got nan)"]),
    (["--gpu-memory-gb", "inf"], [BAD_GB]),
    (["--gpu-memory-gb", "1e308"], [BAD_GB]),
    (["--gpu-memory-gb", "-1"], [BAD_GB, "(got -1)"]),
    (["--gpu-memory-gb", "0"], [BAD_GB]),
    (["--gpu-memory-gb", "1", "--reserve-gib", "nan"], [BAD_GIB]),
    (["--gpu-memory-gb", "1", "--reserve-gib", "inf"], [BAD_GIB]),
    (["--gpu-memory-gb", "1", "--reserve-gib", "-1"], [BAD_GIB]),
    (["--gpu-memory-gb", "0.01", "--gpu-memory-utilization", "nan"],
     ["argument --gpu-memory-utilization: ", "must be in (0, 1] (got nan)"]),
    (["--gpu-memory-gb", "0.01", "--context-len", "0"],       # never the default instead
     ["argument --context-len: context_len must be an integer in [1, max_model_len = 256]"]),
    (["--gpu-memory-gb", "0.01", "--weight-dtype", ""],
     ["argument --weight-dtype: weight_dtype must be one of", "(got '')"]),
    (["--gpu-memory-gb", "0.01", "--kv-dtype", ""], ["argument --kv-dtype: "]),
    (["--gpu-memory-gb", "0.01", "--max-model-len", "0"],
     ["argument --max-model-len: max_model_len must be an integer >= 1 (got 0)"]),
    (["--gpu-memory-gb", "0.01", "--block-size", "0"], ["argument --block-size: "]),
    (["--gpu-memory-gb", "0.01", "--weight-bytes", "-1"],
     ["argument --weight-bytes: weight_bytes must be an integer in [0, 2**53] (got -1)"]),
    (["--gpu-memory-gb", "0.01", "--weight-bytes", "1", "--weight-dtype", "fp8"],
     ["not allowed with argument --weight-bytes"]),
    # too little memory, in the flags' own names and units
    (["--gpu-memory-gb", "0.001"],
     ["no memory for KV blocks: --gpu-memory-utilization 0.9 x --gpu-memory-gb 0.001 = "
      "900,000 bytes", "--reserve-gib 0", "at --block-size 16",
      "raise --gpu-memory-utilization or --gpu-memory-gb"]),
    (["--gpu-memory-gb", "0.01", "--block-size", "1000000000000"],
     ["--block-size 1,000,000,000,000 is too large", "--block-size at most 524 fits"]),
    (["--gpu-memory-gb", "0.01", "--reserve-gib", "0.005"],
     ["--reserve-gib 0.005 is too large", "--reserve-gib at most 0.002911 leaves two"]),
])
def test_cli_bad_input_is_a_usage_error_naming_the_flag(capsys, argv, messages):
    with pytest.raises(SystemExit) as stop:
        kvb.main(["--config", str(s03.BUNDLED_MODEL_DIR), *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    for message in messages:
        assert message in err, (message, err)
    for api_name in ("gpu_memory_bytes", "reserve_bytes", "max_position_embeddings"):
        assert api_name not in err, (api_name, err)


def test_cli_bad_config_files_are_usage_errors(tmp_path, capsys):
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\xff\xfe\x00")
    (tmp_path / "deep.json").write_text("{\"a\": " * 100_000)
    for path, message in ((tmp_path / "bin.json", "not UTF-8"),
                          (tmp_path / "deep.json", "too deeply")):
        with pytest.raises(SystemExit) as stop:
            kvb.main(["--config", str(path), "--gpu-memory-gb", "1"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"argument --config: {path}" in err and message in err


def test_cli_weight_bytes_for_a_layout_it_cannot_count(tmp_path, capsys):
    # A dense config of a model_type count_parameters does not know: its KV shape is read, the
    # weights are given. 2 layers x 2 KV heads x 16 dims, bf16: 2 x 2 x 2 x 16 x 2 = 256 bytes
    # a token, 4,096 a block of 16; 10**6 x 0.9 - 100,000 = 800,000 bytes: 195 blocks.
    config = {"model_type": "gemma", "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64, "max_position_embeddings": 128,
              "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--config", str(tmp_path), "--gpu-memory-gb", "0.001"]
    with pytest.raises(SystemExit) as stop:
        kvb.main(argv)
    assert stop.value.code == 2 and "--weight-bytes" in capsys.readouterr().err
    kvb.main([*argv, "--weight-bytes", "100000"])
    out = capsys.readouterr().out
    assert "-100,000 bytes  --weight-bytes 100,000 (given)" in out
    assert "800,000 bytes  256 a token (bfloat16), 4,096 a block" in out
    lines = out.splitlines()
    row = lines[next(i for i, line in enumerate(lines) if line.startswith("model ")) + 1]
    name, _, _, blocks, tokens = row.split()[:5]
    assert (name, blocks, tokens) == (tmp_path.name, "195", f"{194 * 16:,}")


# --- The presets, --help, and the outputs the chapter quotes ---------------------------------

def test_published_configs_are_the_hand_copy_and_count_as_hf_does():
    # The oracle for Llama is the hand copy at the top of this file; for all three, HF
    # transformers' own model class built from the preset (on the meta device: no memory).
    assert kvb.PUBLISHED_CONFIGS["Llama-3.1-8B"] == LLAMA_31_8B
    assert list(kvb.PUBLISHED_CONFIGS) == ["Llama-3.1-8B", "Qwen3-0.6B", "Qwen2.5-7B-Instruct"]
    transformers = pytest.importorskip("transformers")
    published = {"Llama-3.1-8B": 8_030_261_248, "Qwen3-0.6B": 596_049_920,   # 8.03 B, 0.6 B
                 "Qwen2.5-7B-Instruct": 7_615_616_512}                       # 7.61 B (card)
    for name, preset in kvb.PUBLISHED_CONFIGS.items():
        family = {"llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2"}[preset["model_type"]]
        config = getattr(transformers, f"{family}Config")(
            **{k: v for k, v in preset.items() if k != "model_type"})
        with torch.device("meta"):
            model = getattr(transformers, f"{family}ForCausalLM")(config)
        assert kvb.count_parameters(preset) == model.num_parameters() == published[name], name
        assert kvb.kv_shape(preset) == kvb.kv_shape(config), name
    assert kvb.kv_shape("qwen3-0.6b") == kvb.KVShape(28, 8, 128)        # head_dim, not 64
    assert kvb.kv_shape("QWEN2.5-7B-INSTRUCT") == kvb.KVShape(28, 4, 128)


def test_config_takes_a_preset_name_in_any_case_and_a_file_wins(tmp_path, monkeypatch):
    for name in ("Llama-3.1-8B", "llama-3.1-8b", "LLAMA-3.1-8B"):
        assert kvb.load_config(name) == LLAMA_31_8B
    kvb.load_config("llama-3.1-8b")["num_hidden_layers"] = 1     # a copy: the preset is safe
    assert kvb.PUBLISHED_CONFIGS["Llama-3.1-8B"]["num_hidden_layers"] == 32
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3.1-8b").mkdir()
    (tmp_path / "llama-3.1-8b" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    assert kvb.kv_shape("llama-3.1-8b") == kvb.KVShape(2, 4, 16)  # the folder, not the preset
    with pytest.raises(ParameterError, match="Qwen3-0.6B") as err:   # the presets are named
        kvb.load_config("llama-3.1-9b")
    assert err.value.parameter == "config"


def test_help_gives_every_flag_a_text_and_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as stop:
        kvb.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"\n\nChapter 12: \S", out)
    entries = dict(re.findall(r"^  (--[\w-]+) [A-Z_]+\s+(.*?)(?=^  -|\Z)", out, re.M | re.S))
    assert set(entries) == {"--config", "--gpu-memory-gb", "--gpu-memory-utilization",
                            "--weight-dtype", "--weight-bytes", "--reserve-gib", "--kv-dtype",
                            "--block-size", "--max-model-len", "--context-len"}
    for flag, text in entries.items():
        assert "(default: " in " ".join(text.split()), flag
    text = {flag: " ".join(t.split()) for flag, t in entries.items()}
    assert "(default: 0.9;" in text["--gpu-memory-utilization"]
    assert "(default: 16)" in text["--block-size"]
    assert "(default: the config's max_position_embeddings)" in text["--max-model-len"]
    assert "(default: max-model-len / 64, at least 1)" in text["--context-len"]
    assert "(default: 0.0)" in text["--reserve-gib"] and "assumes 2" in text["--reserve-gib"]
    assert all(name in text["--config"] for name in kvb.PUBLISHED_CONFIGS)


def chapter_quotes() -> list[tuple[str, str]]:
    """(command, quoted output): every ```bash block of the chapter that runs the calculator
    followed directly by a ```text block."""
    chapter = (ROOT / "chapters" / "s12-paged-attention.md").read_text()
    return re.findall(r"```bash\n(python code/s12_kv_budget\.py [^\n]*)\n```\n\n```text\n"
                      r"(.*?)\n```", chapter, re.S)


def test_the_chapter_quotes_what_the_cli_prints(capsys, monkeypatch):
    quotes = chapter_quotes()
    commands = [command for command, _ in quotes]
    assert ("python code/s12_kv_budget.py --config llama-3.1-8b --gpu-memory-gb 80 "
            "--reserve-gib 2") in commands           # the worked table's command
    assert any("--config data/model" in command for command in commands)
    monkeypatch.chdir(ROOT)                          # the chapter's commands run from the root
    for command, quoted in quotes:
        kvb.main(shlex.split(command)[2:])
        assert capsys.readouterr().out.rstrip("\n") == quoted, command
    # The worked table's numbers are in the Llama output, as the hand arithmetic above has them.
    llama = dict(quotes)["python code/s12_kv_budget.py --config llama-3.1-8b --gpu-memory-gb 80 "
                         "--reserve-gib 2"]
    for number in ("72,000,000,000", "-16,060,522,496", "-2,147,483,648", "53,791,993,856",
                   "25,650", "410,384", "131,072", "paged@2,048"):
        assert number in llama, number
