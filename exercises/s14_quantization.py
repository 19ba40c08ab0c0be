"""S14 exercises: group-wise int4, llama.cpp's Q4_0 nibbles, bits per weight with the scales,
and which layers to keep in 8 bits.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s14

The chapter's code is code/s14_quantization.py (int8 per channel, int4 group-wise,
QuantizedTensor, quantize_model, model_memory) and code/s14_gguf.py (llama.cpp's Q8_0 and
Q4_0 blocks). The graded tests hold your answers against the chapter's quantizer, against
llama.cpp's own Python package `gguf` byte for byte, against the bytes `model_memory` counts
on models quantized for real, and, for the design question, against the perplexity tool of
code/s14_quality.py run on the bundled model quantized with your plan. Reference solutions are
in exercises/solutions/ -- try first, peek later.

Vocabulary (the chapter's): a weight W (N, K) has N output features (rows) and K input
features; a group is a run of g = group_size consecutive weights of one row (K / g groups per
row), each with its own scale (and, asymmetric, its own zero point). A code u is an integer;
the dequantized weight is (u - zero) * scale. "Bits per weight" counts everything stored:
codes, scales and zero points, divided by the number of weights.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np


# Exercise 1: group-wise int4 (3 points) -------------------------------------------------------
# The chapter's `quantize_int4`, in NumPy, with float32 scales (the chapter stores them in
# bfloat16, rounded up; here no rounding of the scale at all, so your scales must equal
# `s14_quantization.quantize_int4(w, g, symmetric, scale_dtype=torch.float32)` exactly).

def quantize_int4(w: np.ndarray, group_size: int = 32, symmetric: bool = True
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest int4 of w float32 (N, K), one scale per group of group_size weights
    of a row. Returns (codes uint8 (N, K) in 0..15, scales float32 (N, K / g), zeros).

    Every operation in float32 (NumPy float32 arithmetic), rounding half to even (np.round):
    - symmetric: scale = absmax / 7 (absmax: the group's largest |w|), codes
      round(w / scale) + 8, clipped to 1..15 (signed -7..7 around the zero point 8);
      zeros is None.
    - asymmetric: lo = min(group min, 0), hi = max(group max, 0) (0 stays exactly
      representable), scale = (hi - lo) / 15, zero = round(-lo / scale) clipped to 0..15,
      codes = round(w / scale) + zero, clipped to 0..15; zeros uint8 (N, K / g).
    A scale that comes out 0 (a group of zeros) is 1 instead: no division by zero, and the
    group's codes are its zero point.
    Example: one group of 32 whose largest |w| is 0.7 (the rest smaller): scale 0.1, and
    w = 0.26 gets code round(2.6) + 8 = 11, dequantized to (11 - 8) * 0.1 = 0.3.
    Raises ValueError for w not 2-D, group_size not one of 32, 64, 128, or a K that
    group_size does not divide.
    """
    raise NotImplementedError("exercise 1")


def dequantize_int4(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                    group_size: int) -> np.ndarray:
    """(codes - zero) * scale as float32 (N, K); zero is 8 when zeros is None. codes uint8
    (N, K), scales float32 (N, K / g), zeros uint8 (N, K / g) or None."""
    raise NotImplementedError("exercise 1")


# Exercise 2: llama.cpp's Q4_0 nibbles (2 points) ----------------------------------------------
# A Q4_0 block is 18 bytes for 32 weights: its scale d as float16 (2 bytes, little-endian), then
# 16 bytes holding 32 codes 0..15, two per byte. llama.cpp does NOT pair neighbours (the
# chapter's `pack_int4` puts elements 2j and 2j + 1 in byte j): in each block of 32, byte j
# holds element j in its low nibble and element j + 16 in its high nibble
# (ggml-quants.c, quantize_row_q4_0_ref: y[i].qs[j] = xi0 | (xi1 << 4), xi1 from x[16 + j]).

def pack_q4_0(codes: np.ndarray) -> np.ndarray:
    """codes uint8 (..., K) in 0..15, K a multiple of 32 -> uint8 (..., K / 2): for each block
    of 32 codes c[0..31], 16 bytes c[j] | c[j + 16] << 4, j = 0..15.
    Example: codes 0, 1, ..., 31 % 16 (c[j] = j % 16) -> bytes 0x00, 0x11, 0x22, ..., 0xFF.
    Raises ValueError for a K that is not a multiple of 32 or a code above 15."""
    raise NotImplementedError("exercise 2")


def unpack_q4_0(packed: np.ndarray) -> np.ndarray:
    """`pack_q4_0`'s inverse: uint8 (..., K / 2), K / 2 a multiple of 16 -> codes uint8
    (..., K) in element order."""
    raise NotImplementedError("exercise 2")


def q4_0_blocks(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_0 bytes of a row-major tensor from its scales and codes:
    d float16 (..., K / 32), one per block; codes uint8 (..., K) in 0..15. Returns uint8
    (..., K / 32 * 18): for each block, the 2 bytes of its float16 d (little-endian) then its
    16 bytes of `pack_q4_0`. (The codes and d are what llama.cpp's quantizer chose; the test
    takes them from the `gguf` package and compares your bytes with its bytes.)"""
    raise NotImplementedError("exercise 2")


# Exercise 3: bits per weight, scales and zero points included (2 points) ---------------------
# What each format stores for a weight (N, K) (the chapter's `QuantizedTensor.quantized_nbytes`):
#   int8 (per channel)   N * K int8 codes + N float32 scales
#   int4 g (symmetric)   N * K / 2 bytes of packed codes + N * K / g bfloat16 scales
#   int4 g (asymmetric)  the same + N * K / g uint8 zero points
#   q8_0, q4_0           N * K / 32 blocks of 34 and 18 bytes
# float32 and bfloat16 (not quantized) store 4 and 2 bytes per weight.

def tensor_bytes(shape: tuple[int, int], scheme: str, group_size: int | None = None,
                 symmetric: bool = True) -> int:
    """Bytes stored for a weight of shape (N, K) in scheme: "float32", "bfloat16", "int8",
    "int4" (group_size None means 32), "q8_0" or "q4_0".
    Example: tensor_bytes((256, 128), "int4") -> 256 * 64 + 256 * 4 * 2 = 18,432 (4.5 bits
    per weight). Raises ValueError for an unknown scheme, or a group size (or GGUF block of 32)
    that does not divide K."""
    raise NotImplementedError("exercise 3")


def linear_bits_per_weight(config: Mapping, scheme: str, group_size: int | None = None,
                           symmetric: bool = True) -> float:
    """Bits per weight of the linear layers of a Qwen3 / Llama-layout model quantized with
    `quantize_model(model, scheme, group_size=..., symmetric=...)`: 8 x (bytes of every
    linear weight) / (their number of weights).

    config: the model's config.json fields (hidden_size C, intermediate_size I,
    num_hidden_layers L, num_attention_heads H, num_key_value_heads Hkv, head_dim D (when
    absent, C / H)). Each of the L blocks has four linear weights, as S06 stores them:
    qkv_proj (H D + 2 Hkv D, C), o_proj (C, H D), gate_up_proj (2 I, C), down_proj (C, I).
    The embedding and the LM head are not linear weights here (quantize_model keeps them).
    Example: the bundled model (C 128, I 384, H 4, Hkv 2, D 32) in int4 g32 -> 4.5.
    Raises ValueError as `tensor_bytes`."""
    raise NotImplementedError("exercise 3")


# Exercise 4: which layers keep 8 bits (3 points) ----------------------------------------------
# All-int4 costs the bundled model's linear layers 4.5 bits per weight and some quality; all-int8
# costs 8.2 bits and almost none. In between, some weights in int8 and the rest in int4: which?
# Not every layer is as sensitive (llama.cpp's Q4_K_M, for one, gives more bits to some
# attention and feed-forward tensors of some layers). Choose a plan for a budget.

def choose_precisions(model, budget_bits_per_weight: float, calibration_ids: np.ndarray
                      ) -> dict[str, str]:
    """A plan {name: "int8" | "int4"} for every linear weight of `model` (S06's
    TorchTransformer, float32; names as `model.named_parameters()` gives them, e.g.
    "blocks.0.qkv_proj", for the four linear weights of every block), such that the model
    quantized with it (int8 per channel for "int8"; int4, groups of 32, symmetric, for
    "int4"; embedding and head kept in float32) loses as little quality as you can manage
    with its linear weights stored in at most budget_bits_per_weight bits per weight
    (counted as exercise 3 counts them, scales included).

    calibration_ids: int64 (n,) token ids of text to measure with, n a multiple of the
    model's 256-token window (the graded tests pass training text; they score your plan on
    held-out text). Do not change `model` (copy it, or put every weight back).
    Quality is the mean KL divergence of the quantized model's next-token distribution from
    the float32 model's, over the second half of each 256-token chunk of held-out text
    (s14_quality.evaluate). Graded on the bundled model at two budgets and on a second model
    whose hardest layer is elsewhere (a plan written down in advance will not do): your plan
    must fit the budget, have at most 0.75 of all-int4's KL on the bundled model (0.5 on the
    second model) and beat by 10% the rule of thumb
    "int8 for the first and last blocks' weights first" (block 0, then the last, then 1, the
    second to last, ...; down_proj, qkv_proj, o_proj, gate_up_proj within a block; each
    weight taken if it still fits). The test gives your function a few seconds per call: a
    handful of forward passes per weight is affordable, a search over plans is not.
    """
    raise NotImplementedError("exercise 4")
