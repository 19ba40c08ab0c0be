"""Reference solutions for the S03 exercises. Try exercises/s03_transformer.py first."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


# Exercise 1 -----------------------------------------------------------------------------------

def rope_rotate(x: np.ndarray, positions: Sequence[int], theta: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    n_heads, t_len, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs: the head dimension must be even (got {head_dim})")
    pos = np.asarray(positions, dtype=np.float64)
    if pos.shape != (t_len,):
        raise ValueError(f"one position per row: expected {t_len}, got {pos.shape}")
    half = head_dim // 2
    freqs = theta ** (-2.0 * np.arange(half) / head_dim)   # (D/2,) radians per position
    angles = pos[:, None] * freqs[None, :]                  # (T, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[..., :half], x[..., half:]            # (H, T, D/2) each
    out = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(np.float32)


# Exercise 2 -----------------------------------------------------------------------------------

def repeat_kv(k: np.ndarray, n_rep: int) -> np.ndarray:
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1 (got {n_rep})")
    return np.repeat(k, n_rep, axis=0)  # head j -> rows j*n_rep .. j*n_rep + n_rep - 1


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    n_heads, t_len, head_dim = q.shape
    n_kv_heads, s_len, _ = k.shape
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads "
                         f"({n_kv_heads})")
    if t_len > s_len:
        raise ValueError(f"more queries ({t_len}) than keys ({s_len})")
    keys = repeat_kv(k, n_heads // n_kv_heads).astype(np.float64)      # (H, S, D)
    values = repeat_kv(v, n_heads // n_kv_heads).astype(np.float64)    # (H, S, D)
    scores = q.astype(np.float64) @ keys.transpose(0, 2, 1) / math.sqrt(head_dim)  # (H, T, S)
    query_pos = np.arange(s_len - t_len, s_len)
    scores = np.where(np.arange(s_len)[None, :] <= query_pos[:, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ values).astype(np.float32)                          # (H, T, D)


# Exercise 3 -----------------------------------------------------------------------------------

def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        n = int.from_bytes(prefix, "little")
        raw = f.read(n)
        if len(raw) < n:
            raise ValueError(f"{path}: too short for its header of {n} bytes")
    header = json.loads(raw)
    start = 8 + n
    return {name: (info["dtype"], tuple(info["shape"]),
                   (start + info["data_offsets"][0], start + info["data_offsets"][1]))
            for name, info in header.items() if name != "__metadata__"}


# Exercise 4 -----------------------------------------------------------------------------------

def count_parameters(config: Mapping) -> int:
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "llama"):
        raise ValueError(f"model_type must be 'qwen3' or 'llama' (got {model_type!r})")
    v, c = config["vocab_size"], config["hidden_size"]
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or c // heads
    i_size = config["intermediate_size"]
    q_out, kv_out = heads * d, kv_heads * d
    attn = c * q_out + 2 * c * kv_out + q_out * c
    if config.get("attention_bias", False):
        attn += q_out + 2 * kv_out + c
    mlp = 3 * c * i_size
    if model_type == "llama" and config.get("mlp_bias", False):
        mlp += 2 * i_size + c
    norms = 2 * c + (2 * d if model_type == "qwen3" else 0)
    total = v * c + n_layers * (attn + mlp + norms) + c
    if not config.get("tie_word_embeddings", False):
        total += v * c
    return total
