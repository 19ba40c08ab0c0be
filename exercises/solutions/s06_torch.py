"""S06 exercises, reference solutions: bfloat16 by hand, the bytes of a decode step, and a
greedy loop with one device-to-host transfer per request.

Try the stubs in exercises/s06_torch.py first; grade these with
`python exercises/grade.py --solutions s06`.

Sources followed: the bfloat16 format (the top 16 bits of an IEEE-754 float32: sign, 8 exponent
bits, 7 mantissa bits) with round-to-nearest-even, as in PyTorch's float32 -> bfloat16
conversion (c10/util/BFloat16.h, `round_to_nearest_even`); Hugging Face `config.json` field
names and defaults of LlamaConfig / Qwen3Config; the memory-bound decode step of the roofline
model (Williams et al., "Roofline", CACM 2009); and the host/device split of PyTorch's "CUDA
semantics" notes (a copy to the host waits for the device).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from s06_torch import CachedTransformer


# Exercise 1: bfloat16 by hand -----------------------------------------------------------------

def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Each float32 value rounded to the nearest bfloat16, returned as float32."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError("x must be a float32 NumPy array")
    bits = x.view(np.uint32).astype(np.uint64)        # room for the carry out of bit 31
    keep_odd = (bits >> 16) & 1                        # ties go to the even neighbour
    rounded = ((bits + 0x7FFF + keep_odd) & 0xFFFF0000).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    nan = np.isnan(x)
    out[nan] = x[nan]                                  # rounding could turn a NaN into inf
    return out


# Exercise 2: the bytes of a decode step -------------------------------------------------------

def _size(config: Mapping, name: str, default=None) -> int:
    value = config.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"config has no {name}")
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    return int(value)


def decode_step_bytes(hf_config: Mapping, context_len: int, dtype_bytes: int = 2) -> int:
    """Bytes one decode step of batch 1 must read: its weights and the cached K and V."""
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise ValueError("biases are not supported")
    c = _size(hf_config, "hidden_size")
    inter = _size(hf_config, "intermediate_size")
    layers = _size(hf_config, "num_hidden_layers")
    heads = _size(hf_config, "num_attention_heads")
    vocab = _size(hf_config, "vocab_size")
    kv_heads = _size(hf_config, "num_key_value_heads", heads)
    if hf_config.get("head_dim") is None and c % heads:
        raise ValueError(f"hidden_size ({c}) must be a multiple of num_attention_heads ({heads})")
    head_dim = _size(hf_config, "head_dim", c // heads)
    for name, value in (("context_len", context_len), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    per_layer = (c * heads * head_dim                  # q_proj
                 + 2 * c * kv_heads * head_dim         # k_proj, v_proj
                 + heads * head_dim * c                # o_proj
                 + 3 * c * inter                       # gate, up, down
                 + 2 * c)                              # two RMSNorm weights
    if hf_config.get("model_type") == "qwen3":
        per_layer += 2 * head_dim                      # q_norm, k_norm
    weights = layers * per_layer + c + vocab * c       # final norm, LM head (whole matrix)
    if not hf_config.get("tie_word_embeddings", False):
        weights += c                                   # one row of a separate embedding table
    kv = 2 * layers * kv_heads * head_dim * context_len
    return (weights + kv) * int(dtype_bytes)


def decode_floor_s(hf_config: Mapping, context_len: int, dtype_bytes: int,
                   bandwidth_bytes_per_s: float) -> float:
    """The shortest a decode step can take when reading memory is all it does."""
    if not bandwidth_bytes_per_s > 0 or not np.isfinite(bandwidth_bytes_per_s):
        raise ValueError(f"bandwidth_bytes_per_s must be a finite number > 0 "
                         f"(got {bandwidth_bytes_per_s!r})")
    return decode_step_bytes(hf_config, context_len, dtype_bytes) / bandwidth_bytes_per_s


# Exercise 3: one transfer per request ---------------------------------------------------------

@torch.inference_mode()
def generate_greedy_on_device(runner: CachedTransformer, prompt_ids: Sequence[int],
                              max_tokens: int, eos_id: int | None = None) -> list[int]:
    """Greedy tokens after prompt_ids, sampled and fed back on the device, read once."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
    needed = len(prompt_ids) + max_tokens - 1
    if needed > runner.cache.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) need "
                         f"{needed} positions, which do not fit in the KV cache "
                         f"({runner.cache.max_seq_len})")
    logits = runner.prefill(prompt_ids)                                # (V,) on the device
    out = torch.empty(max_tokens, dtype=torch.int64, device=logits.device)
    for i in range(max_tokens):
        token = torch.argmax(logits).view(1)                           # (1,), stays there
        out[i:i + 1] = token
        if i + 1 < max_tokens:
            logits = runner.decode(token)
    tokens = out.tolist()                                              # the one transfer
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[:tokens.index(eos_id) + 1]
    return tokens
