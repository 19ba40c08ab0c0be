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
      layout (with the biases each has in transformers' modeling code), for weight bytes =
      parameters x bytes per weight. Another layout: give the weight bytes yourself
      (`weight_bytes`, `--weight-bytes`).
    - `kv_budget(...)` -> `KVBudget`: bytes per token and per block, num_blocks, the tokens
      they hold, how many requests of max_model_len a contiguous cache would hold, how many
      of a given context a paged pool holds (`max_requests_paged`), and vLLM's logged
      "maximum concurrency".
    - `PUBLISHED_CONFIGS`: the fields the calculator reads of three published models
      (Llama-3.1-8B, Qwen3-0.6B, Qwen2.5-7B-Instruct), so no download is needed; `--config`
      and `load_config` take their names (any case) as well as paths.

"auto", the dtype here and in vLLM
    "auto" (the default KV dtype, and the weights' when no weight dtype is given) is the
    config's own dtype: `torch_dtype` (transformers 4) or `dtype` (transformers 5), else
    bfloat16. For a 16-bit config that is what vLLM's `--dtype auto` and `--kv-cache-dtype
    auto` give. For a float32 config it is not: vLLM runs a float32 checkpoint in 16 bits
    (vllm/config/model.py, `_get_and_verify_dtype` and `_resolve_auto_dtype`: the platform's
    first supported dtype, bfloat16 on an NVIDIA GPU of compute capability 8.0 or later per
    `CudaPlatformBase.supported_dtypes` in vllm/platforms/cuda.py; older vLLM chose float16),
    and its KV cache follows the model's dtype, 2 bytes an element where "auto" here counts 4.
    This module keeps the config's float32. The bundled model's config is float32, and the
    chapter's bundled-model output counts its weights and KV in float32, the dtype the
    course's engine runs it in on the CPU (S06's `resolve_device_dtype`; on CUDA S06 picks
    bfloat16, as vLLM would). Pass weight_dtype / kv_dtype "bfloat16" for what vLLM would
    allocate.

What it does not handle
    The reserve for activations, non-torch memory (NCCL, cuBLAS) and CUDA graphs is an input:
    vLLM measures it by profiling a forward pass at startup, and so must you. Sliding-window,
    MLA (DeepSeek), hybrid (Mamba) and mixture-of-experts layouts, tensor parallelism (divide
    Hkv and the weights by the TP size yourself) and quantized weights other than a plain
    bytes-per-weight are not modelled. A multimodal config that nests its text model under
    `text_config` is refused with a ParameterError that says to pass that object instead.

Run it
    python code/s12_kv_budget.py --config llama-3.1-8b --gpu-memory-gb 80 --reserve-gib 2
    python code/s12_kv_budget.py --config data/model --gpu-memory-gb 0.01 \
        --gpu-memory-utilization 1
    It prints the arithmetic (memory, weights, reserve, KV bytes), the budget as a table row
    under a header, and what each column means. The chapter quotes both outputs, and
    tests/test_s12_kv_budget.py checks the quotes against this CLI.

Tests
    tests/test_s12_kv_budget.py: bytes against a real `PagedKVCache` for the bundled model
    (tensor nbytes) and against hand arithmetic from Llama-3.1-8B's published config; the
    parameter count against the bundled model's tensors and HF's count; every bad input named;
    the CLI's --help and the outputs the chapter quotes.

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

# Published architectures, only the fields this module reads, copied from each model's
# config.json on the Hugging Face Hub (main branch; no weights, no download at run time).
PUBLISHED_CONFIGS = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    # (no head_dim there: D = hidden_size / num_attention_heads = 4096 / 32 = 128)
    "Llama-3.1-8B": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=False, attention_bias=False,
                         torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    # (head_dim 128, not hidden_size / heads = 64; tied embeddings)
    "Qwen3-0.6B": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936,
                       max_position_embeddings=40960, tie_word_embeddings=True,
                       attention_bias=False, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
    # (q, k, v biases, as every qwen2 model; 32,768 positions, the base model's config 131,072)
    "Qwen2.5-7B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                                num_attention_heads=28, num_key_value_heads=4,
                                intermediate_size=18944, vocab_size=152064,
                                max_position_embeddings=32768, tie_word_embeddings=False,
                                torch_dtype="bfloat16"),
}


def _exists(path) -> bool:
    """Path(path).exists(), False for a name no file can have (a NUL byte, too long)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def published_config_name(config) -> str | None:
    """The PUBLISHED_CONFIGS key `config` names (a str, any case) when no file or folder of
    that name exists; None otherwise."""
    if not isinstance(config, str) or _exists(config):
        return None
    return next((name for name in PUBLISHED_CONFIGS if name.lower() == config.lower()), None)


def _brief(value) -> str:
    """repr(value), shortened when long (an integer of 400 digits is named by its length)."""
    text = repr(value)
    if len(text) <= 40:
        return text
    if s01.is_int(value):
        return f"an integer of {len(str(abs(value)))} digits"
    return f"{text[:30]}... ({len(text)} characters)"


def dtype_bytes(dtype, parameter: str, auto: bool = False) -> int:
    """Bytes per element of a dtype named as in DTYPE_BYTES (any case, "torch." prefix
    allowed, so a torch.dtype too). ParameterError naming `parameter` for anything else (an
    empty name, None, a number); `auto` adds "auto" to the names the message lists."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        names = (["auto"] if auto else []) + sorted(DTYPE_BYTES)
        raise ParameterError(f"{parameter} must be one of {names} (got {_brief(dtype)})",
                             parameter, dtype)
    return DTYPE_BYTES[name]


def _is_auto(dtype) -> bool:
    return isinstance(dtype, str) and dtype.lower() == "auto"


# ---------------------------------------------------------------------------------------------
# The model's side: its config
# ---------------------------------------------------------------------------------------------

def load_config(config) -> dict:
    """The config as a dict: a Mapping as is, a transformers `PretrainedConfig` by its
    `to_dict()` (which must return a mapping), a str naming a PUBLISHED_CONFIGS entry (any
    case: "llama-3.1-8b"), a str or Path naming a config.json or a folder holding one (read
    locally, never from the Hub; a file or folder wins over a preset of the same name).
    ParameterError("config") otherwise: no such file, a file that cannot be read, is not
    UTF-8 JSON, nests too deeply to parse, or holds no JSON object."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        loaded = config.to_dict()
        if not isinstance(loaded, Mapping):
            raise ParameterError(f"config: {type(config).__name__}.to_dict() must return a "
                                 f"dict (got a {type(loaded).__name__})", "config",
                                 type(config).__name__)
        return dict(loaded)
    preset = published_config_name(config)
    if preset is not None:
        return dict(PUBLISHED_CONFIGS[preset])
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            path = path / "config.json" if path.is_dir() else path
            found = path.is_file()
        except (OSError, ValueError):          # a NUL byte, a name too long
            found = False
        if not found:
            raise ParameterError(f"config: no file {_brief(str(path))} (give a local "
                                 f"config.json, a folder holding one, one of "
                                 f"{list(PUBLISHED_CONFIGS)}, a dict or a PretrainedConfig)",
                                 "config", str(config))
        try:
            loaded = json.loads(path.read_bytes())   # UTF-8 (or a UTF-16/32 BOM), as JSON is
        except OSError as err:
            raise ParameterError(f"config: cannot read {path} ({err.strerror or err})",
                                 "config", str(config)) from None
        except RecursionError:
            raise ParameterError(f"config: {path} nests its JSON too deeply to parse",
                                 "config", str(config)) from None
        except UnicodeDecodeError:
            raise ParameterError(f"config: {path} is not a JSON text (not UTF-8: a binary "
                                 "file?)", "config", str(config)) from None
        except ValueError as err:              # JSONDecodeError, an integer of > 4,300 digits
            raise ParameterError(f"config: {path} is not JSON ({err})", "config",
                                 str(config)) from None
        if not isinstance(loaded, dict):
            raise ParameterError(f"config: {path} holds no JSON object", "config", str(config))
        return loaded
    raise ParameterError(f"config must be a dict, a PretrainedConfig or a path to a "
                         f"config.json (got {type(config).__name__})", "config")


def _check_top_level(cfg: dict) -> None:
    """ParameterError("config") for a config whose text model is nested under text_config
    (a multimodal model: Llava, Qwen2.5-VL, Gemma 3, ...), which this module does not read."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        raise ParameterError(
            f"config: this config (model_type {cfg.get('model_type')!r}) nests its text model "
            "under text_config and has no num_hidden_layers of its own; pass the text_config "
            "object instead (in Python load_config(...)['text_config'], on the command line "
            "that object saved as its own config.json), and give the whole checkpoint's weight "
            "bytes (weight_bytes, --weight-bytes): its other towers are not in text_config",
            "config", cfg.get("model_type"))


def _field(cfg: dict, name: str) -> int:
    value = cfg.get(name)
    if not s01.is_int(value) or value < 1:
        raise ParameterError(f"config: {name} must be an integer >= 1 (got {_brief(value)})",
                             "config", value)
    return int(value)


def _flag(cfg: dict, name: str) -> bool:
    """A boolean field of the config, False when absent (the default of transformers'
    Llama, Mistral, Qwen2 and Qwen3 configs). A string such as "false" is refused, never read
    as true."""
    value = cfg.get(name, False)
    if not isinstance(value, bool):
        raise ParameterError(f"config: {name} must be a boolean, true or false (got "
                             f"{_brief(value)}, a {type(value).__name__})", "config", value)
    return value


def config_dtype(config) -> str:
    """The dtype the config names: torch_dtype (transformers 4) or dtype (transformers 5),
    else "bfloat16". ParameterError("config") for a name DTYPE_BYTES does not know. This is
    what "auto" means here (see the module's docstring: vLLM's "auto" differs for float32)."""
    cfg = load_config(config)
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) is not None:
            name = cfg[key]
            if str(name).removeprefix("torch.").lower() not in DTYPE_BYTES:
                raise ParameterError(f"config: {key} must be one of {sorted(DTYPE_BYTES)} "
                                     f"(got {_brief(name)})", "config", name)
            return str(name).removeprefix("torch.")
    return "bfloat16"


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
    divide exactly. ParameterError("config") naming the field that is missing or wrong, or
    saying that the config nests its text model under text_config."""
    cfg = load_config(config)
    _check_top_level(cfg)
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
    per element of kv_dtype (DTYPE_BYTES: "bfloat16" 2, "fp8" 1, ...; "auto": the config's
    dtype, `config_dtype`, which for a float32 config is 4 bytes where vLLM's auto would
    allocate 2: see the module's docstring). Llama-3.1-8B in bf16: 2 x 32 x 8 x 128 x 2 =
    131,072 bytes (128 KiB). ParameterError("kv_dtype") for an unknown name."""
    cfg = load_config(config)
    shape = kv_shape(cfg)
    per_element = (dtype_bytes(config_dtype(cfg), "config") if _is_auto(kv_dtype)
                   else dtype_bytes(kv_dtype, "kv_dtype", auto=True))
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * per_element


def count_parameters(config) -> int:
    """Parameters of a dense decoder of model_type llama, mistral, qwen2 or qwen3 (no MoE),
    as transformers' modeling_<model_type>.py builds it: the token embedding (V x hidden),
    per layer the q, k, v, o projections, their biases (llama and qwen3: q, k, v and o when
    `attention_bias`; qwen2: q, k and v always; mistral: none), Qwen3's q_norm and k_norm (D
    each), the SwiGLU MLP (3 x hidden x intermediate_size, plus gate, up and down biases when
    a llama config sets `mlp_bias`) and two RMSNorms (hidden each), the final norm, and the
    output head unless tie_word_embeddings. The boolean fields must be JSON booleans (absent:
    false). Llama-3.1-8B: 8,030,261,248. ParameterError("config") for another model_type (give
    `kv_budget` the weight bytes instead), a missing field or a boolean that is not one."""
    cfg = load_config(config)
    _check_top_level(cfg)
    model_type = cfg.get("model_type")
    if model_type not in DENSE_MODEL_TYPES:
        raise ParameterError(f"config: count_parameters knows model_type "
                             f"{list(DENSE_MODEL_TYPES)} (got {_brief(model_type)}); give the "
                             "weight bytes instead (kv_budget's weight_bytes, the command "
                             "line's --weight-bytes)", "config", model_type)
    shape = kv_shape(cfg)
    hidden, vocab = _field(cfg, "hidden_size"), _field(cfg, "vocab_size")
    inter, heads = _field(cfg, "intermediate_size"), _field(cfg, "num_attention_heads")
    q, kv = heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden              # q, k, v, o
    if model_type == "qwen2":
        attention += q + 2 * kv                                        # q, k, v biases
    elif model_type in ("llama", "qwen3") and _flag(cfg, "attention_bias"):
        attention += q + 2 * kv + hidden                               # q, k, v, o biases
    if model_type == "qwen3":
        attention += 2 * shape.head_dim                                # q_norm, k_norm
    mlp = 3 * hidden * inter                                           # gate, up, down
    if model_type == "llama" and _flag(cfg, "mlp_bias"):
        mlp += 2 * inter + hidden                                      # their biases
    layer = attention + mlp + 2 * hidden
    head = 0 if _flag(cfg, "tie_word_embeddings") else vocab * hidden
    return vocab * hidden + shape.num_layers * layer + hidden + head


# ---------------------------------------------------------------------------------------------
# The engine's side: the budget
# ---------------------------------------------------------------------------------------------

# The budget is total x utilization in floating point, as vLLM computes it; a float holds
# every byte count up to 2**53 (about 9 PB) exactly, so that is the most gpu_memory_bytes takes.
MAX_GPU_MEMORY_BYTES = 2**53


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
        return self.num_blocks / -(-self.max_model_len // self.block_size)   # integer cdiv

    def max_requests_paged(self, context_len: int) -> int:
        """Requests the usable blocks hold at once when each holds context_len tokens, so
        cdiv(context_len, block_size) blocks (for a mean context, requests whose lengths
        spread evenly modulo block_size waste about half a block more each). ParameterError
        for context_len not an integer in [1, max_model_len]."""
        if not s01.is_int(context_len) or not 1 <= context_len <= self.max_model_len:
            raise ParameterError(f"context_len must be an integer in [1, max_model_len = "
                                 f"{self.max_model_len:,}] (got {_brief(context_len)})",
                                 "context_len", context_len)
        return (self.num_blocks - 1) // -(-context_len // self.block_size)


class KVShortage(ParameterError):
    """`kv_budget`'s refusal when the KV bytes hold fewer than 2 blocks (the null block and
    one). `parameter` names the one to change (see `shortage_message`); `numbers` holds the
    arithmetic (gpu_memory_bytes, gpu_memory_utilization, budget, weight_bytes,
    reserve_bytes, kv_bytes, bytes_per_token, block_size), so a caller such as the CLI can
    word it in its own flags and units."""

    def __init__(self, message: str, parameter: str | None = None, value=None,
                 numbers: Mapping | None = None):
        super().__init__(message, parameter, value)
        self.numbers = dict(numbers or {})

    def __reduce__(self):
        return type(self), (str(self), self.parameter, self.value, self.numbers)


def _n(count: int) -> str:
    """An integer with thousands separators, or its length when it runs past 30 digits."""
    return f"{count:,}" if abs(count) < 10**30 else f"({_brief(count)})"


def _api_value(name: str, n: Mapping) -> str:
    value = n[name]
    return f"{value:g}" if isinstance(value, float) else _n(value)


def _api_bytes(name: str, count: int) -> str:
    return _n(count)


def shortage_message(n: Mapping, flag=lambda name: name, value=_api_value,
                     amount=_api_bytes) -> tuple[str, str]:
    """(the parameter to blame, the message) for KV bytes that hold fewer than 2 blocks.
    n: KVShortage.numbers. How the message writes a parameter: flag(name) its name,
    value(name, n) its value, amount(name, bytes) a number of bytes in its unit (the CLI
    passes its flags and GB / GiB). Blamed: block_size when two blocks of a smaller size
    would fit; else reserve_bytes when, without it, two blocks would fit; else
    gpu_memory_utilization, as vLLM's own startup error (no memory for the cache blocks),
    with every contributor named with its value."""
    def label(name):
        return f"{flag(name)} {value(name, n)}"

    per_token, size, kv = n["bytes_per_token"], n["block_size"], n["kv_bytes"]
    per_block, weights, reserve = per_token * size, n["weight_bytes"], n["reserve_bytes"]
    blocks = (f"fewer than 2 blocks (the null block and one) of {_n(per_block)} bytes at "
              f"{label('block_size')}")
    memory = (f"{label('gpu_memory_utilization')} x {label('gpu_memory_bytes')} = "
              f"{_n(n['budget'])} bytes")
    if kv >= 2 * per_token:
        return "block_size", (
            f"{label('block_size')} is too large: {memory}, minus {_n(weights)} bytes of "
            f"weights and {label('reserve_bytes')}, leaves {_n(kv)} bytes of KV, {blocks} "
            f"({_n(per_token)} a token); {flag('block_size')} at most "
            f"{_n(kv // (2 * per_token))} fits")
    left = n["budget"] - weights
    if reserve > 0 and left >= 2 * per_block:
        return "reserve_bytes", (
            f"{label('reserve_bytes')} is too large: {memory}, minus {_n(weights)} bytes of "
            f"weights, leaves {_n(left)}, and the reserve leaves {_n(kv)}: {blocks}; "
            f"{flag('reserve_bytes')} at most {amount('reserve_bytes', left - 2 * per_block)} "
            "leaves two")
    return "gpu_memory_utilization", (
        f"no memory for KV blocks: {memory}; the weights ({_n(weights)} bytes) and "
        f"{label('reserve_bytes')} leave {_n(kv)} bytes, {blocks}; raise "
        f"{flag('gpu_memory_utilization')} or {flag('gpu_memory_bytes')}, or lower the "
        "weights or the reserve")


def kv_budget(config, *, gpu_memory_bytes: int, gpu_memory_utilization: float = 0.9,
              weight_bytes: int | None = None, num_params: int | None = None,
              weight_dtype: str | None = None, reserve_bytes: int = 0,
              kv_dtype: str = "auto", block_size: int = 16,
              max_model_len: int | None = None) -> KVBudget:
    """The KV pool of one GPU for the model of `config`, vLLM's startup arithmetic.

    gpu_memory_bytes: the device's total memory (bytes; it, weight_bytes and reserve_bytes at
    most MAX_GPU_MEMORY_BYTES = 2**53).
    gpu_memory_utilization: the share of it the engine may use, in (0, 1] (0.9, the default
    vLLM documented for long, PR #2162; the vllm/config/cache.py read for this course has
    0.92). Weights: weight_bytes, or num_params x bytes of weight_dtype (None: the config's
    dtype, `config_dtype`, float32 for a float32 config where vLLM's auto would load 16 bits:
    see the module's docstring); give exactly one of weight_bytes and num_params
    (`count_parameters` counts them), and weight_dtype only with num_params. reserve_bytes:
    what else the profile run would find (peak activations, non-torch memory, CUDA graphs),
    an assumption here. kv_dtype: the cache's element type ("auto": the config's dtype, as
    for the weights; "bfloat16", "fp16", "fp8", ...). block_size: tokens per block.
    max_model_len: the longest context (None: the config's max_position_embeddings).
    Returns a `KVBudget`. Raises ParameterError naming the parameter: a size that is not a
    positive integer, a utilization outside (0, 1], an unknown dtype, both or neither of
    weight_bytes and num_params, a weight_dtype with weight_bytes, no max_model_len and none
    in the config; and KVShortage (a ParameterError) when the weights and the reserve leave
    less than two blocks (the null block and one), as vLLM refuses to start with no memory
    for cache blocks, naming the parameter to change (`shortage_message`).
    """
    bytes_per_token = kv_bytes_per_token(config, kv_dtype)
    cfg = load_config(config)
    for name, value, least, most in (
            ("gpu_memory_bytes", gpu_memory_bytes, 1, MAX_GPU_MEMORY_BYTES),
            ("block_size", block_size, 1, None),
            ("reserve_bytes", reserve_bytes, 0, MAX_GPU_MEMORY_BYTES)):
        if not s01.is_int(value) or value < least or (most is not None and value > most):
            rule = f">= {least}" if most is None else f"in [{least}, 2**53]"
            raise ParameterError(f"{name} must be an integer {rule} (got {_brief(value)})",
                                 name, value)
    if not s01.is_real(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
        raise ParameterError(f"gpu_memory_utilization must be in (0, 1] (got "
                             f"{_brief(gpu_memory_utilization)})", "gpu_memory_utilization",
                             gpu_memory_utilization)
    if (weight_bytes is None) == (num_params is None):
        raise ParameterError("give exactly one of weight_bytes and num_params (got "
                             f"{_brief(weight_bytes)}, {_brief(num_params)})", "weight_bytes",
                             weight_bytes)
    if weight_bytes is None:
        if not s01.is_int(num_params) or num_params < 1:
            raise ParameterError(f"num_params must be an integer >= 1 (got "
                                 f"{_brief(num_params)})", "num_params", num_params)
        dtype = config_dtype(cfg) if weight_dtype is None else weight_dtype
        weight_bytes = int(num_params) * dtype_bytes(dtype, "weight_dtype")
    elif weight_dtype is not None:
        raise ParameterError(f"weight_dtype applies to num_params only: weight_bytes are bytes "
                             f"already (got weight_dtype {_brief(weight_dtype)} with "
                             f"weight_bytes)", "weight_dtype", weight_dtype)
    elif not s01.is_int(weight_bytes) or not 0 <= weight_bytes <= MAX_GPU_MEMORY_BYTES:
        raise ParameterError(f"weight_bytes must be an integer in [0, 2**53] (got "
                             f"{_brief(weight_bytes)})", "weight_bytes", weight_bytes)
    if max_model_len is None:
        max_model_len = cfg.get("max_position_embeddings")
        if not s01.is_int(max_model_len) or max_model_len < 1:
            raise ParameterError(f"max_model_len: none given, and the config's "
                                 f"max_position_embeddings is no integer >= 1 to default to "
                                 f"(got {_brief(max_model_len)}); give max_model_len",
                                 "max_model_len", None)
    elif not s01.is_int(max_model_len) or max_model_len < 1:
        raise ParameterError(f"max_model_len must be an integer >= 1 (got "
                             f"{_brief(max_model_len)})", "max_model_len", max_model_len)
    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    kv_bytes = budget - int(weight_bytes) - int(reserve_bytes)
    num_blocks = max(kv_bytes, 0) // (bytes_per_token * block_size)
    if num_blocks < 2:
        numbers = dict(gpu_memory_bytes=int(gpu_memory_bytes),
                       gpu_memory_utilization=float(gpu_memory_utilization), budget=budget,
                       weight_bytes=int(weight_bytes), reserve_bytes=int(reserve_bytes),
                       kv_bytes=kv_bytes, bytes_per_token=bytes_per_token,
                       block_size=int(block_size))
        parameter, message = shortage_message(numbers)
        raise KVShortage(message, parameter, numbers[parameter], numbers)
    return KVBudget(bytes_per_token, int(block_size), kv_bytes, int(num_blocks),
                    int(max_model_len))


NAME_WIDTH = 20


def format_header(context_len: int) -> str:
    """The column titles of `format_budget`'s rows (`format_legend` says what each means)."""
    return (f"{'model':<{NAME_WIDTH}} {'KV/token':>11} {'blocks':>10} {'tokens':>11} "
            f"{'max_model_len':>13} {'contiguous':>10} {f'paged@{context_len:,}':>13}")


def format_budget(name: str, b: KVBudget, context_len: int) -> str:
    """One row of the notebook's and the CLI's table, under `format_header(context_len)`."""
    return (f"{name:<{NAME_WIDTH}} {b.bytes_per_token / 1024:>7.1f} KiB {b.num_blocks:>10,} "
            f"{b.num_tokens:>11,} {b.max_model_len:>13,} {b.max_requests_contiguous:>10,} "
            f"{b.max_requests_paged(context_len):>13,}")


def format_legend(block_size: int, context_len: int) -> str:
    """What each column of the table means, one line each."""
    paged = f"paged@{context_len:,}"
    return "\n".join(f"  {column:<14} {meaning}" for column, meaning in (
        ("KV/token", "one token's keys and values in every layer: 2 x L x Hkv x D x bytes each"),
        ("blocks", f"whole blocks of {block_size} tokens in the KV bytes, block 0 (the null "
                   "block) included"),
        ("tokens", f"positions in the usable blocks: (blocks - 1) x {block_size}"),
        ("max_model_len", "the longest context (default: the config's max_position_embeddings)"),
        ("contiguous", "requests a contiguous cache holds, each reserving max_model_len "
                       "positions"),
        (paged, f"requests of {context_len:,} tokens the blocks hold at once, "
                f"cdiv({context_len:,}, {block_size}) blocks each")))


def weight_dtype_of(config, weight_dtype: str | None = None) -> str:
    """The dtype the weights are counted in: weight_dtype unless None, else the config's
    (`config_dtype`), as `kv_budget` does."""
    return config_dtype(config) if weight_dtype is None else weight_dtype


def kv_dtype_of(config, kv_dtype: str = "auto") -> str:
    """The cache's dtype: kv_dtype, or for "auto" the config's (`config_dtype`), as
    `kv_bytes_per_token` does."""
    return config_dtype(config) if _is_auto(kv_dtype) else kv_dtype


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

# The flag that sets each kv_budget parameter (the memory sizes in the CLI's own units).
FLAGS = {"config": "--config", "num_params": "--config", "gpu_memory_bytes": "--gpu-memory-gb",
         "gpu_memory_utilization": "--gpu-memory-utilization", "weight_dtype": "--weight-dtype",
         "weight_bytes": "--weight-bytes", "reserve_bytes": "--reserve-gib",
         "kv_dtype": "--kv-dtype", "block_size": "--block-size",
         "max_model_len": "--max-model-len", "context_len": "--context-len"}
MAX_CLI_AMOUNT = 1e6      # GB or GiB: a petabyte, under MAX_GPU_MEMORY_BYTES


def to_bytes(value: float, flag: str, unit: str, scale: int, least: float) -> int | str:
    """round(value x scale) bytes for a flag in GB or GiB, or the usage error's text when the
    value is not a finite number in [least, MAX_CLI_AMOUNT] (NaN, inf and 1e308 included)."""
    if not s01.is_finite(value) or not least <= value <= MAX_CLI_AMOUNT:
        return (f"argument {flag}: must be a number of {unit} in [{least:g}, "
                f"{MAX_CLI_AMOUNT:g}] (got {value:g})")
    return round(value * scale)


def cli_message(err: ParameterError, args: argparse.Namespace) -> str:
    """A ParameterError of the API, worded for the command line: the flag that sets the
    parameter, and for a KVShortage the flags' own values and units."""
    if isinstance(err, KVShortage):
        values = {"gpu_memory_utilization": f"{args.gpu_memory_utilization:g}",
                  "gpu_memory_bytes": f"{args.gpu_memory_gb:g}",
                  "reserve_bytes": f"{args.reserve_gib:g}", "block_size": _n(args.block_size)}

        def amount(name: str, count: int) -> str:     # bytes in the flag's unit, rounded down
            scale = GIB if name == "reserve_bytes" else 10**9
            return f"{math.floor(count / scale * 1e6) / 1e6:g}"

        return shortage_message(err.numbers, FLAGS.get, lambda name, n: values[name],
                                amount)[1]
    flag, text = FLAGS.get(err.parameter), str(err)
    if flag is None:
        return text
    return f"argument {flag}: {text.removeprefix(f'{err.parameter}: ')}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Chapter 12: how many KV blocks a GPU holds for a model, from its config "
                    "(a published preset or a local config.json; no download, no GPU).")
    presets = ", ".join(PUBLISHED_CONFIGS)
    parser.add_argument("--config", required=True,
                        help=f"a preset name ({presets}; any case), a config.json or the "
                             "folder holding one (default: none, required)")
    parser.add_argument("--gpu-memory-gb", type=float, required=True,
                        help="device memory in GB of 10^9 bytes, in [1e-09, 1e+06]; a card "
                             "reporting 80 GiB is 85.89934592 (default: none, required)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the memory the engine may use, in (0, 1], as vLLM's "
                             "--gpu-memory-utilization (default: %(default)s; recent vLLM: "
                             "0.92)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weight-dtype", default=None,
                         help="dtype the weights are counted in, bytes per parameter (default: "
                              "the config's torch_dtype or dtype, else bfloat16; vLLM runs a "
                              "float32 config in 16 bits)")
    weights.add_argument("--weight-bytes", type=int, default=None,
                         help="the weights' bytes, instead of counting the parameters: for a "
                              "model_type other than llama, mistral, qwen2, qwen3, or "
                              "quantized weights (default: none, counted from the config)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB for activations, non-torch memory and CUDA graphs, in "
                             "[0, 1e+06], which vLLM measures by a profile run; the chapter "
                             "assumes 2 (default: %(default)s)")
    parser.add_argument("--kv-dtype", default="auto",
                        help="the cache's dtype: auto (the config's, as the weights; vLLM's "
                             "auto is 16 bits for a float32 config), bfloat16, fp16, fp8, ... "
                             "(default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest context, what a contiguous cache reserves per "
                             "request (default: the config's max_position_embeddings)")
    parser.add_argument("--context-len", type=int, default=None,
                        help="tokens per request for the paged column (default: "
                             "max-model-len / 64, at least 1)")
    args = parser.parse_args(argv)
    gpu_bytes = to_bytes(args.gpu_memory_gb, "--gpu-memory-gb", "GB (10^9 bytes)", 10**9, 1e-9)
    reserve = to_bytes(args.reserve_gib, "--reserve-gib", "GiB (2^30 bytes)", GIB, 0)
    for checked in (gpu_bytes, reserve):
        if isinstance(checked, str):
            parser.error(checked)
    try:
        preset = published_config_name(args.config)
        cfg = load_config(args.config)
        if args.weight_bytes is None:
            params = count_parameters(cfg)
            weight_dtype = weight_dtype_of(cfg, args.weight_dtype)
            weights_given = dict(num_params=params, weight_dtype=args.weight_dtype)
        else:
            params, weights_given = None, dict(weight_bytes=args.weight_bytes)
        b = kv_budget(cfg, gpu_memory_bytes=gpu_bytes,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      reserve_bytes=reserve, kv_dtype=args.kv_dtype,
                      block_size=args.block_size, max_model_len=args.max_model_len,
                      **weights_given)
        context = (max(1, b.max_model_len // 64) if args.context_len is None
                   else args.context_len)
        b.max_requests_paged(context)              # a bad --context-len is refused here
    except ParameterError as err:
        parser.error(cli_message(err, args))
    path = Path(args.config)
    name = preset or (path.name if path.is_dir() else path.parent.name or path.stem)
    usable = int(gpu_bytes * args.gpu_memory_utilization)
    kv_dtype = kv_dtype_of(cfg, args.kv_dtype)
    if params is None:
        weights = args.weight_bytes
        print(f"{name}: weights given in bytes; {args.gpu_memory_utilization:g} x "
              f"{gpu_bytes:,} bytes of GPU memory")
        how = f"--weight-bytes {weights:,} (given)"
    else:
        per_weight = dtype_bytes(weight_dtype, "weight_dtype")
        weights = params * per_weight
        print(f"{name}: {params:,} parameters; {args.gpu_memory_utilization:g} x "
              f"{gpu_bytes:,} bytes of GPU memory")
        how = f"{params:,} parameters x {per_weight} bytes ({weight_dtype})"
    assert b.kv_bytes == usable - weights - reserve
    print(f"  usable   {usable:>16,} bytes")
    print(f"  weights  {-weights:>16,} bytes  {how}")
    print(f"  reserve  {-reserve:>16,} bytes  --reserve-gib {args.reserve_gib:g} (assumed; vLLM "
          "measures it)")
    print(f"  KV       {b.kv_bytes:>16,} bytes  {b.bytes_per_token:,} a token ({kv_dtype}), "
          f"{b.bytes_per_block:,} a block")
    print()
    print(format_header(context))
    print(format_budget(name, b, context))
    print(format_legend(b.block_size, context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
