"""S12, the KV budget: how many blocks a real engine gets, from a model's config and a GPU.

What is new
    The rest of S12 takes `num_blocks` as given. A serving engine computes it at startup from
    the memory left for KV, and this module does the same arithmetic for any Hugging Face
    config, with no model and no GPU:

        kv_bytes   = gpu_memory_bytes x gpu_memory_utilization - weight_bytes - reserve_bytes
        per token  = 2 (K and V) x L x Hkv x D x bytes per element of the KV dtype
        per block  = per token x block_size
        num_blocks = floor(kv_bytes / per block)      (block 0 the null block, as in S12)

    - `kv_shape(config)`: L, Hkv, D from a config (a dict, a transformers `PretrainedConfig`,
      a config.json or the folder holding one): Hkv is `num_key_value_heads` (grouped-query
      attention; missing means as many as the query heads), D is `head_dim`, else
      hidden_size // num_attention_heads.
    - `kv_bytes_per_token(config, kv_dtype)`.
    - `count_parameters(config)`: the parameters of a dense Llama / Mistral / Qwen2 / Qwen3
      layout, for weight bytes = parameters x bytes per weight.
    - `kv_budget(...)` -> `KVBudget`: bytes per token and per block, num_blocks, the tokens
      they hold, how many requests of max_model_len a contiguous cache would hold, how many
      of a given context a paged pool holds (`max_requests_paged`), and vLLM's logged
      "maximum concurrency".

What it does not handle
    The reserve for activations, non-torch memory (NCCL, cuBLAS) and CUDA graphs is an input:
    vLLM measures it by profiling a forward pass at startup, and so must you. Sliding-window,
    MLA (DeepSeek), hybrid (Mamba) and mixture-of-experts layouts, nested `text_config`s,
    tensor parallelism (divide Hkv and the weights by the TP size yourself) and quantized
    weights other than a plain bytes-per-weight are not modelled.

Run it
    python code/s12_kv_budget.py --config data/model/config.json --gpu-memory-gb 1
    python code/s12_kv_budget.py --config path/to/Llama-3.1-8B/config.json --gpu-memory-gb 80 \
        --reserve-gib 2 --max-model-len 131072 --context-len 2048

Tests
    tests/test_s12_kv_budget.py: bytes against a real `PagedKVCache` for the bundled model
    (tensor nbytes) and against hand arithmetic from Llama-3.1-8B's published config; the
    parameter count against the bundled model's tensors; every bad input named.

References
    vLLM: `Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py: requested memory
    = total x gpu_memory_utilization, minus what the profile run measured: weights, peak
    activations, non-torch memory), `AttentionSpec.page_size_bytes`
    (vllm/v1/kv_cache_interface.py: 2 x block_size x Hkv x D x dtype size, per layer) and
    `get_num_blocks` (vllm/v1/core/kv_cache_utils.py: available // page size // layers).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import s01_generation_loop as s01
from s01_generation_loop import ParameterError

# Bytes per element, by the names vLLM's --kv-cache-dtype and HF's torch_dtype use.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2,
               "float16": 2, "fp16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
GIB = 2**30
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")   # what count_parameters knows


def dtype_bytes(dtype: str, parameter: str) -> int:
    """Bytes per element of a dtype named as in DTYPE_BYTES ("torch." prefix allowed).
    ParameterError naming `parameter` for an unknown name."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise ParameterError(f"{parameter} must be one of {sorted(DTYPE_BYTES)} (got "
                             f"{dtype!r})", parameter, dtype)
    return DTYPE_BYTES[name]


# ---------------------------------------------------------------------------------------------
# The model's side: its config
# ---------------------------------------------------------------------------------------------

def load_config(config) -> dict:
    """The config as a dict: a Mapping as is, a transformers `PretrainedConfig` by its
    `to_dict()`, a str or Path naming a config.json or a folder holding one (read locally,
    never from the Hub). ParameterError("config") otherwise."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ParameterError(f"config: no file {path} (give a local config.json, a folder "
                                 "holding one, a dict or a PretrainedConfig)", "config",
                                 str(config))
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ParameterError(f"config: {path} is not JSON ({err})", "config",
                                 str(config)) from None
        if not isinstance(loaded, dict):
            raise ParameterError(f"config: {path} holds no JSON object", "config", str(config))
        return loaded
    raise ParameterError(f"config must be a dict, a PretrainedConfig or a path to a "
                         f"config.json (got {type(config).__name__})", "config")


def _field(cfg: dict, name: str) -> int:
    value = cfg.get(name)
    if not s01.is_int(value) or value < 1:
        raise ParameterError(f"config: {name} must be an integer >= 1 (got {value!r})",
                             "config", value)
    return int(value)


@dataclass(frozen=True)
class KVShape:
    """What one token's keys and values are made of: num_layers (L), num_kv_heads (Hkv),
    head_dim (D)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_shape(config) -> KVShape:
    """L, Hkv, D from a config (see `load_config`). Hkv: num_key_value_heads, or
    num_attention_heads when absent or null (HF's default: a model without grouped-query
    attention); it must divide num_attention_heads. D: head_dim when given (Qwen3 sets it
    apart from hidden_size / heads), else hidden_size // num_attention_heads, which must
    divide exactly. ParameterError("config") naming the field that is missing or wrong."""
    cfg = load_config(config)
    layers, heads = _field(cfg, "num_hidden_layers"), _field(cfg, "num_attention_heads")
    kv_heads = heads if cfg.get("num_key_value_heads") is None else _field(
        cfg, "num_key_value_heads")
    if heads % kv_heads:
        raise ParameterError(f"config: num_key_value_heads ({kv_heads}) must divide "
                             f"num_attention_heads ({heads})", "config", kv_heads)
    if cfg.get("head_dim") is not None:
        head_dim = _field(cfg, "head_dim")
    else:
        hidden = _field(cfg, "hidden_size")
        if hidden % heads:
            raise ParameterError(f"config: no head_dim, and hidden_size ({hidden}) is not a "
                                 f"multiple of num_attention_heads ({heads})", "config",
                                 hidden)
        head_dim = hidden // heads
    return KVShape(layers, kv_heads, head_dim)


def kv_bytes_per_token(config, kv_dtype: str = "auto") -> int:
    """Bytes of KV cache one token takes in every layer: 2 (K and V) x L x Hkv x D x bytes
    per element of kv_dtype (DTYPE_BYTES: "bfloat16" 2, "fp8" 1, ...; "auto", vLLM's
    default: the config's torch_dtype or dtype, else bfloat16). Llama-3.1-8B in bf16:
    2 x 32 x 8 x 128 x 2 = 131,072 bytes (128 KiB)."""
    cfg = load_config(config)
    shape = kv_shape(cfg)
    if kv_dtype == "auto":
        kv_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return (2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
            * dtype_bytes(kv_dtype, "kv_dtype"))


def count_parameters(config) -> int:
    """Parameters of a dense decoder of model_type llama, mistral, qwen2 or qwen3 (no MoE):
    the token embedding (V x hidden), per layer the q, k, v, o projections (q and k/v biases
    when `attention_bias` is true, and always for qwen2), Qwen3's q_norm and k_norm (D each),
    the SwiGLU MLP (3 x hidden x intermediate_size) and two RMSNorms (hidden each), the final
    norm, and the output head unless tie_word_embeddings. Llama-3.1-8B: 8,030,261,248.
    ParameterError("config") for another model_type or a missing field."""
    cfg = load_config(config)
    model_type = cfg.get("model_type")
    if model_type not in DENSE_MODEL_TYPES:
        raise ParameterError(f"config: count_parameters knows model_type "
                             f"{list(DENSE_MODEL_TYPES)} (got {model_type!r}); give the weight "
                             "bytes instead", "config", model_type)
    shape = kv_shape(cfg)
    hidden, vocab = _field(cfg, "hidden_size"), _field(cfg, "vocab_size")
    inter, heads = _field(cfg, "intermediate_size"), _field(cfg, "num_attention_heads")
    q, kv = heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden              # q, k, v, o
    if cfg.get("attention_bias") or model_type == "qwen2":
        attention += q + 2 * kv
    if model_type == "qwen3":
        attention += 2 * shape.head_dim                                # q_norm, k_norm
    layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + shape.num_layers * layer + hidden + head


# ---------------------------------------------------------------------------------------------
# The engine's side: the budget
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVBudget:
    """The KV pool a GPU leaves for a model (bytes, tokens, requests).

    bytes_per_token: one token's K and V in every layer. bytes_per_block: block_size of them.
    kv_bytes: the memory left for KV (budget minus weights minus reserve). num_blocks: whole
    blocks in it, the null block included (S12's and vLLM's count). num_tokens: positions of
    the usable blocks, (num_blocks - 1) x block_size. max_model_len: the longest context.
    max_requests_contiguous: requests a contiguous cache holds when each reserves
    max_model_len positions, kv_bytes // (max_model_len x bytes_per_token).
    max_concurrency: vLLM's startup log line, num_blocks / cdiv(max_model_len, block_size).
    """

    bytes_per_token: int
    block_size: int
    kv_bytes: int
    num_blocks: int
    max_model_len: int

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_requests_contiguous(self) -> int:
        return self.kv_bytes // (self.max_model_len * self.bytes_per_token)

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / math.ceil(self.max_model_len / self.block_size)

    def max_requests_paged(self, context_len: int) -> int:
        """Requests the usable blocks hold at once when each holds context_len tokens, so
        cdiv(context_len, block_size) blocks (for a mean context, requests whose lengths
        spread evenly modulo block_size waste about half a block more each). ParameterError
        for context_len not an integer in [1, max_model_len]."""
        if not s01.is_int(context_len) or not 1 <= context_len <= self.max_model_len:
            raise ParameterError(f"context_len must be an integer in [1, max_model_len = "
                                 f"{self.max_model_len}] (got {context_len!r})",
                                 "context_len", context_len)
        return (self.num_blocks - 1) // math.ceil(context_len / self.block_size)


def kv_budget(config, *, gpu_memory_bytes: int, gpu_memory_utilization: float = 0.9,
              weight_bytes: int | None = None, num_params: int | None = None,
              weight_dtype: str | None = None, reserve_bytes: int = 0,
              kv_dtype: str = "auto", block_size: int = 16,
              max_model_len: int | None = None) -> KVBudget:
    """The KV pool of one GPU for the model of `config`, vLLM's startup arithmetic.

    gpu_memory_bytes: the device's total memory (bytes). gpu_memory_utilization: the share
    of it the engine may use, in (0, 1] (vLLM's default 0.9). Weights: weight_bytes, or
    num_params x bytes of weight_dtype (default: the config's torch_dtype or dtype, else
    bfloat16); give exactly one of weight_bytes and num_params (`count_parameters` counts
    them). reserve_bytes: what else the profile run would find (peak activations, non-torch
    memory, CUDA graphs), an assumption here. kv_dtype: the cache's element type ("auto": the
    model's, as vLLM's default; "bfloat16", "fp16", "fp8", ...). block_size: tokens per
    block. max_model_len: the longest context (default: the config's
    max_position_embeddings).
    Returns a `KVBudget`. Raises ParameterError naming the parameter: a size that is not a
    positive integer, a utilization outside (0, 1], an unknown dtype, both or neither of
    weight_bytes and num_params, and (gpu_memory_utilization) a budget the weights and the
    reserve leave less than two blocks of (the null block and one), as vLLM refuses to start
    with no memory for cache blocks.
    """
    bytes_per_token = kv_bytes_per_token(config, kv_dtype)
    cfg = load_config(config)
    for name, value, least in (("gpu_memory_bytes", gpu_memory_bytes, 1),
                               ("block_size", block_size, 1),
                               ("reserve_bytes", reserve_bytes, 0)):
        if not s01.is_int(value) or value < least:
            raise ParameterError(f"{name} must be an integer >= {least} (got {value!r})",
                                 name, value)
    if not s01.is_real(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
        raise ParameterError(f"gpu_memory_utilization must be in (0, 1] (got "
                             f"{gpu_memory_utilization!r})", "gpu_memory_utilization",
                             gpu_memory_utilization)
    if (weight_bytes is None) == (num_params is None):
        raise ParameterError("give exactly one of weight_bytes and num_params (got "
                             f"{weight_bytes!r}, {num_params!r})", "weight_bytes",
                             weight_bytes)
    if weight_bytes is None:
        if not s01.is_int(num_params) or num_params < 1:
            raise ParameterError(f"num_params must be an integer >= 1 (got {num_params!r})",
                                 "num_params", num_params)
        dtype = weight_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        weight_bytes = int(num_params) * dtype_bytes(dtype, "weight_dtype")
    elif not s01.is_int(weight_bytes) or weight_bytes < 0:
        raise ParameterError(f"weight_bytes must be an integer >= 0 (got {weight_bytes!r})",
                             "weight_bytes", weight_bytes)
    if max_model_len is None:
        max_model_len = cfg.get("max_position_embeddings")
    if not s01.is_int(max_model_len) or max_model_len < 1:
        raise ParameterError(f"max_model_len must be an integer >= 1 (got {max_model_len!r};"
                             " the config has no max_position_embeddings to default to)",
                             "max_model_len", max_model_len)
    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    kv_bytes = budget - int(weight_bytes) - int(reserve_bytes)
    num_blocks = max(kv_bytes, 0) // (bytes_per_token * block_size)
    if num_blocks < 2:
        raise ParameterError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {gpu_memory_bytes:,} bytes "
            f"is {budget:,}; weights ({int(weight_bytes):,}) and reserve "
            f"({int(reserve_bytes):,}) leave {kv_bytes:,} bytes, fewer than 2 blocks of "
            f"{bytes_per_token * block_size:,} (the null block and one)",
            "gpu_memory_utilization", gpu_memory_utilization)
    return KVBudget(bytes_per_token, int(block_size), kv_bytes, int(num_blocks),
                    int(max_model_len))


def format_budget(name: str, b: KVBudget, context_len: int) -> str:
    """One line of the notebook's and the CLI's table."""
    return (f"{name:<14} {b.bytes_per_token / 1024:>7.1f} KiB/token {b.num_blocks:>8,} blocks "
            f"{b.num_tokens:>10,} tokens  contiguous@{b.max_model_len:,}: "
            f"{b.max_requests_contiguous:>4}  paged@{context_len:,}: "
            f"{b.max_requests_paged(context_len):>6,}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="S12: how many KV blocks a GPU holds for a "
                                                 "model (a local config.json, no download).")
    parser.add_argument("--config", required=True, help="config.json or the folder holding it")
    parser.add_argument("--gpu-memory-gb", type=float, required=True,
                        help="device memory in GB (10^9 bytes)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--weight-dtype", default=None,
                        help="bytes per weight by dtype (default: the config's)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="activations, non-torch memory and graphs, in GiB (default 0)")
    parser.add_argument("--kv-dtype", default="auto",
                        help="the cache's dtype: auto (the model's), bfloat16, fp16, fp8, ...")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--context-len", type=int, default=None,
                        help="tokens per request for the paged count (default: max-model-len "
                             "/ 64, at least 1)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        b = kv_budget(cfg, gpu_memory_bytes=int(args.gpu_memory_gb * 1e9),
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      num_params=count_parameters(cfg), weight_dtype=args.weight_dtype,
                      reserve_bytes=int(args.reserve_gib * GIB), kv_dtype=args.kv_dtype,
                      block_size=args.block_size, max_model_len=args.max_model_len)
        context = args.context_len or max(1, b.max_model_len // 64)
        path = Path(args.config)
        name = path.name if path.is_dir() else path.parent.name or path.stem
        print(format_budget(name, b, context))
    except ParameterError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
