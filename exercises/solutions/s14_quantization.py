"""S14 exercises, reference solutions: group-wise int4, llama.cpp's Q4_0 nibbles, bits per
weight with the scales, and which layers to keep in 8 bits.

Try the stubs in exercises/s14_quantization.py first; grade these with
`python exercises/grade.py --solutions s14`.

Sources followed: torchao's choose_qparams_affine / quantize_affine (group-wise affine int4,
preserve_zero) as code/s14_quantization.py transcribes it; llama.cpp ggml-quants.c
(quantize_row_q4_0_ref, block_q4_0 in ggml-common.h: d then qs[16], x[j] in the low nibble of
qs[j], x[j + 16] in the high one); mixed precision by measured sensitivity, as llama.cpp's
quantize chooses more bits for some tensors (llama_tensor_get_type) and HAWQ (Dong et al.,
2019) / the "one layer at a time" sensitivity analyses rank layers, solved here as a 0/1
knapsack over the bytes int8 adds.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch

GROUP_SIZES = (32, 64, 128)
QK = 32


# Exercise 1: group-wise int4 -----------------------------------------------------------------

def _groups(w: np.ndarray, group_size: int) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K) (got shape {w.shape})")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} (got {group_size})")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    return w.reshape(n, k // group_size, group_size)                     # (N, K/g, g)


def quantize_int4(w: np.ndarray, group_size: int = 32, symmetric: bool = True
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    groups = _groups(w, group_size)
    n, ng, g = groups.shape
    if symmetric:
        scales = np.abs(groups).max(axis=2) / np.float32(7)                 # (N, K/g)
        scales = np.where(scales == 0, np.float32(1), scales).astype(np.float32)
        signed = np.clip(np.round(groups / scales[..., None]), -7, 7)
        return (signed + 8).astype(np.uint8).reshape(n, ng * g), scales, None
    lo = np.minimum(groups.min(axis=2), np.float32(0))
    hi = np.maximum(groups.max(axis=2), np.float32(0))
    scales = (hi - lo) / np.float32(15)
    scales = np.where(scales == 0, np.float32(1), scales).astype(np.float32)
    zeros = np.clip(np.round(-lo / scales), 0, 15)
    codes = np.clip(np.round(groups / scales[..., None]) + zeros[..., None], 0, 15)
    return codes.astype(np.uint8).reshape(n, ng * g), scales, zeros.astype(np.uint8)


def dequantize_int4(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                    group_size: int) -> np.ndarray:
    n, k = codes.shape
    groups = codes.reshape(n, k // group_size, group_size).astype(np.float32)
    zero = np.float32(8) if zeros is None else zeros.astype(np.float32)[..., None]
    return ((groups - zero) * scales.astype(np.float32)[..., None]).reshape(n, k)


# Exercise 2: llama.cpp's Q4_0 nibbles --------------------------------------------------------

def pack_q4_0(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.ndim < 1 or codes.shape[-1] % QK:
        raise ValueError(f"the last axis must be a multiple of {QK} (got {codes.shape})")
    if (codes > 15).any() or (codes < 0).any():
        raise ValueError("a 4-bit code lies in 0..15")
    blocks = codes.astype(np.uint8).reshape(-1, QK)                        # (nb, 32)
    packed = blocks[:, :16] | (blocks[:, 16:] << np.uint8(4))              # (nb, 16)
    return packed.reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def unpack_q4_0(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8)
    if packed.ndim < 1 or packed.shape[-1] % (QK // 2):
        raise ValueError(f"the last axis must be a multiple of {QK // 2} (got {packed.shape})")
    blocks = packed.reshape(-1, QK // 2)
    codes = np.concatenate([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def q4_0_blocks(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    d = np.asarray(d, dtype=np.float16).reshape(-1, 1)                     # (nb, 1)
    nibbles = pack_q4_0(codes).reshape(-1, QK // 2)                        # (nb, 16)
    if d.shape[0] != nibbles.shape[0]:
        raise ValueError(f"one d per block of {QK}: {d.shape[0]} scales for "
                         f"{nibbles.shape[0]} blocks")
    d_bytes = d.astype("<f2").view(np.uint8)                               # (nb, 2)
    out = np.concatenate([d_bytes, nibbles], axis=1)                       # (nb, 18)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] // QK * 18)


# Exercise 3: bits per weight ------------------------------------------------------------------

def tensor_bytes(shape: tuple[int, int], scheme: str, group_size: int | None = None,
                 symmetric: bool = True) -> int:
    n, k = shape
    if scheme == "float32":
        return 4 * n * k
    if scheme == "bfloat16":
        return 2 * n * k
    if scheme == "int8":
        return n * k + 4 * n
    if scheme == "int4":
        g = 32 if group_size is None else group_size
        if k % g:
            raise ValueError(f"group_size {g} does not divide K = {k}")
        groups = n * k // g
        return n * k // 2 + 2 * groups + (0 if symmetric else groups)
    if scheme in ("q8_0", "q4_0"):
        if k % QK:
            raise ValueError(f"a GGUF block of {QK} does not divide K = {k}")
        return n * k // QK * (34 if scheme == "q8_0" else 18)
    raise ValueError(f"unknown scheme {scheme!r}")


def linear_shapes(config: Mapping) -> list[tuple[int, int]]:
    """The four linear weights of each block, (N, K), for a Qwen3 / Llama config."""
    c, i = config["hidden_size"], config["intermediate_size"]
    h = config["num_attention_heads"]
    hkv = config.get("num_key_value_heads") or h
    d = config.get("head_dim") or c // h
    block = [(h * d + 2 * hkv * d, c), (c, h * d), (2 * i, c), (c, i)]
    return block * config["num_hidden_layers"]


def linear_bits_per_weight(config: Mapping, scheme: str, group_size: int | None = None,
                           symmetric: bool = True) -> float:
    shapes = linear_shapes(config)
    stored = sum(tensor_bytes(s, scheme, group_size, symmetric) for s in shapes)
    return 8 * stored / sum(n * k for n, k in shapes)


# Exercise 4: which layers keep 8 bits ----------------------------------------------------------

def _int4_values(w: torch.Tensor) -> torch.Tensor:
    """w after an int4 g32 symmetric round trip, float32: what the model computes with when
    this weight is stored in int4 (the chapter's quantizer, bfloat16 scales rounded up)."""
    import s14_quantization as s14
    codes, scales, zeros = s14.quantize_int4(w, 32, True)
    return s14.dequantize_int4(codes, scales, zeros, 32, torch.float32)


@torch.inference_mode()
def _sensitivities(model, names: list[str], ids: np.ndarray, window: int) -> dict[str, float]:
    """Per weight: the mean KL(float32 || this weight alone in int4) over the second half of
    each calibration chunk (as s14_quality scores), the other weights left in float32."""
    chunks = [torch.from_numpy(np.asarray(c, dtype=np.int64))
              for c in np.split(ids[:len(ids) // window * window], len(ids) // window)]
    first = window // 2

    def logprobs():
        return [torch.log_softmax(model.head(model.run(c, 0)[first:-1]).double(), -1)
                for c in chunks]

    reference = logprobs()
    out = {}
    for name in names:
        weight = model.get_parameter(name)
        kept = weight.detach().clone()
        weight.copy_(_int4_values(kept))
        try:
            kl = [(p.exp() * (p - q)).sum(-1) for p, q in zip(reference, logprobs())]
        finally:
            weight.copy_(kept)                    # the model as it was given
        out[name] = float(torch.cat(kl).mean())
    return out


def choose_precisions(model, budget_bits_per_weight: float, calibration_ids: np.ndarray
                      ) -> dict[str, str]:
    """Measure each weight's sensitivity (the KL its int4 round trip alone costs on the
    calibration text), then choose the int8 weights that save the most of it within the bytes
    the budget leaves over all-int4: a 0/1 knapsack, solved exactly by dynamic programming
    over the bytes rounded up to units of 1/4000 of what is spare (so the plan never exceeds
    the budget). Sensitivities nearly add up here (the sum of the 24 single-weight KLs is
    within 10% of all-int4's), which is what makes a per-weight ranking work."""
    import s14_quantization as s14
    names = [f"blocks.{i}.{n}" for i in range(len(model.blocks))
             for n in s14.linear_weight_names(model)]
    shapes = {n: tuple(model.get_parameter(n).shape) for n in names}
    total = sum(a * b for a, b in shapes.values())
    spare = budget_bits_per_weight * total / 8 - sum(tensor_bytes(s, "int4")
                                                     for s in shapes.values())
    plan = {n: "int4" for n in names}
    if spare <= 0:
        return plan
    cost = {n: tensor_bytes(shapes[n], "int8") - tensor_bytes(shapes[n], "int4") for n in names}
    window = model.config.max_position_embeddings
    gain = _sensitivities(model, names, np.asarray(calibration_ids), window)
    unit = max(1.0, spare / 4000)
    capacity = int(spare // unit)
    best = [(0.0, ())] * (capacity + 1)           # best[c]: (KL saved, weights) within c units
    for n in names:
        c = math.ceil(cost[n] / unit)
        for room in range(capacity, c - 1, -1):
            saved = best[room - c][0] + gain[n]
            if saved > best[room][0]:
                best[room] = (saved, best[room - c][1] + (n,))
    for n in max(best)[1]:
        plan[n] = "int8"
    return plan
