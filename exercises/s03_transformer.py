"""S03 exercises: RoPE, grouped-query attention, the safetensors header, counting parameters.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s03

You may use anything in code/s03_transformer.py and code/s03_checkpoint.py (imported below)
except the function an exercise asks you to write: the point is to write RoPE, GQA and the header
reader yourself. Reference solutions are in exercises/solutions/ -- try first, peek later.

Shape legend: H query heads, Hkv key/value heads, T queries in this step, S keys, D head dim.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np  # noqa: F401  (you will want it)

from s03_checkpoint import CheckpointError  # noqa: F401
from s03_transformer import TransformerConfig  # noqa: F401


# Exercise 1: RoPE from scratch (3 points) -------------------------------------------------------
# Pair i of a head (dimensions i and i + D/2, the "rotate half" layout of HF Llama/Qwen
# checkpoints) is turned by the angle  position * theta ** (-2 i / D),  i = 0 .. D/2 - 1.

def rope_rotate(x: np.ndarray, positions: Sequence[int], theta: float) -> np.ndarray:
    """Rotate every head of x by its position, rotate-half pairing.

    x: float32 (H, T, D), D even; positions: T ints (absolute positions of the T rows);
    theta: the checkpoint's rope_theta (> 0). Returns float32 (H, T, D) where, for each pair i,
    with a = positions[t] * theta ** (-2 i / D):
        out[..., i]       = x[..., i] * cos(a) - x[..., i + D/2] * sin(a)
        out[..., i + D/2] = x[..., i + D/2] * cos(a) + x[..., i] * sin(a)
    Raise ValueError if D is odd ("even") or len(positions) != T ("one position per row").
    Compute the angles yourself (do not call the chapter's rope / apply_rope / rope_inv_freq).
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: grouped-query attention (3 points) -------------------------------------------------

def repeat_kv(k: np.ndarray, n_rep: int) -> np.ndarray:
    """Repeat each key/value head n_rep times, in Hugging Face's order.

    k: (Hkv, S, D). Returns (Hkv * n_rep, S, D) where rows j * n_rep ... j * n_rep + n_rep - 1
    are copies of head j (so query head h reads head h // n_rep). n_rep = 1 returns k unchanged.
    Raise ValueError if n_rep < 1.
    """
    raise NotImplementedError("exercise 2a")


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal scaled dot-product attention with grouped-query heads.

    q: float32 (H, T, D); k, v: float32 (Hkv, S, D), with H a multiple of Hkv and T <= S. The T
    queries are the LAST T positions of the S keys (query t sits at position S - T + t), as in a
    decode step with a cache: query t may read keys 0 .. S - T + t. Scores are q k^T / sqrt(D).
    Returns float32 (H, T, D).
    Raise ValueError if H is not a multiple of Hkv ("multiple") or T > S ("more queries").
    """
    raise NotImplementedError("exercise 2b")


# Exercise 3: read a safetensors header (2 points) -----------------------------------------------
# Layout: 8 bytes, little-endian unsigned length N; N bytes of JSON; then the tensor bytes. The
# JSON maps each tensor name to {"dtype": "F32" | "BF16" | ..., "shape": [...],
# "data_offsets": [begin, end]} (offsets counted from the first byte AFTER the header), and may
# hold a "__metadata__" entry, which is not a tensor.

def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """Every tensor of a .safetensors file: name -> (dtype tag, shape, (begin, end)).

    begin and end are ABSOLUTE byte positions in the file (so the tensor's bytes are
    file_bytes[begin:end]). "__metadata__" is left out. Read only the header, not the tensors.
    Raise ValueError if the file is shorter than 8 bytes or the header runs past its end
    ("too short").
    """
    raise NotImplementedError("exercise 3")


# Exercise 4: count the parameters (2 points) ----------------------------------------------------

def count_parameters(config: Mapping) -> int:
    """Number of parameters of a Qwen3 or Llama model, from its config.json as a dict.

    Fields: vocab_size V, hidden_size C, num_hidden_layers L, num_attention_heads H,
    num_key_value_heads Hkv, head_dim D (when absent: C // H), intermediate_size I,
    tie_word_embeddings, attention_bias (q, k, v AND o projections get biases), mlp_bias
    (Llama only: gate, up and down get biases). Per layer: the four attention projections, the
    three MLP matrices, two RMSNorm weights of C, and for Qwen3 the per-head q_norm and k_norm
    (D each). Plus the embedding, the final norm, and the LM head unless it is tied.
    Raise ValueError for a model_type other than "qwen3" or "llama".
    """
    raise NotImplementedError("exercise 4")
