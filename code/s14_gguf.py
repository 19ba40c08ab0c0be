"""S14, llama.cpp's GGUF blocks Q8_0 and Q4_0, byte for byte (the sibling of
code/s14_quantization.py).

What is here
    The two oldest block formats of llama.cpp (ggml-quants.c, `quantize_row_q8_0_ref`,
    `quantize_row_q4_0_ref`, `dequantize_row_q8_0`, `dequantize_row_q4_0`), written in NumPy.
    A row of K weights (K a multiple of QK = 32) is cut into K / 32 blocks; each block is
    stored on its own, its scale first:

    - Q8_0, 34 bytes per block (8.5 bits per weight): d = absmax / 127 as float16 (2 bytes,
      little-endian), then the 32 codes q = round(x / d) as int8, rounded half away from
      zero (C's `roundf`). x ~ q * d.
    - Q4_0, 18 bytes per block (4.5 bits per weight): d = max / -8 as float16, where max is
      the block's value of largest magnitude *with its sign* (the first one on a tie), then
      32 unsigned 4-bit codes u = min(15, trunc(x / d + 8.5)), two per byte: byte j holds
      element j in its low nibble and element j + 16 in its high nibble. x ~ (u - 8) * d.
      The signed max lands exactly on code 0 (-8 d), so all 16 levels are used; the price is
      that the other side reaches only +7 d, and a value near -max there is clipped to code
      15 (error up to |d|, not |d| / 2).

    The codes are computed with the float32 scale, and the scale is then rounded to float16
    (llama.cpp's order): dequantizing multiplies by the float16 d, so a code is off by at most
    |q| * |d32 - d16| on top of the rounding error (tests state the bound).

    Rounding, exactly as the `gguf` package (llama.cpp's own Python, gguf-py/gguf/quants.py,
    checked byte for byte on every tensor of the bundled model and on adversarial arrays):
    Q8_0 multiplies by the float32 reciprocal 1 / d and rounds half away from zero; Q4_0
    computes x * (1 / d) + 8.5 in float64, rounds that once to float32 (what a fused
    multiply-add does in C: gguf-py's comment calls Q4_0's reference rounding "cursed" because
    it depends on FMA), then truncates. A block of zeros gets d = 0 and the inverse 0, so no
    division by zero: Q8_0 stores codes 0, Q4_0 codes 8.

    Where byte identity is claimed: every block whose float16 d is finite and whose float32
    1 / d is finite, i.e. absmax from 127 / FLT_MAX (about 3.7e-37) to below 65520 x 127
    (about 8.3e6) for Q8_0, |max| from 8 / FLT_MAX (about 2.4e-38) to below 65520 x 8 (about
    5.2e5) for Q4_0, and blocks of zeros. Outside it:
      - too large: d rounds to float16 inf (llama.cpp and gguf-py store inf, and the block
        dequantizes to inf / NaN). Refused here (ParameterError "weight", naming the row and
        block and the limit).
      - too small (nonzero): 1 / d overflows float32, x / d is inf or NaN, and llama.cpp's
        and gguf-py's codes are a cast of inf / NaN to an integer (undefined in C; NumPy's
        result depends on the platform). The stored float16 d is 0 there (|d| < 2^-25), so
        every code dequantizes to 0 anyway; this module stores the codes of 0 (Q8_0 0, Q4_0
        8), defined, and may differ from gguf-py's bytes in those codes only.

What it does not handle
    Non-finite weights (refused: gguf-py would store garbage codes), and blocks whose float16
    d overflows (above); the K-quants (Q4_K, Q6_K:
    super-blocks of 256 with quantized scales), Q4_1 / Q5_*; importance matrices. Reading and
    writing whole .gguf files (the `gguf` package's GGUFReader / GGUFWriter do that).

Run it
    python code/s14_quantization.py --quantize q4_0      # runs the bundled model in Q4_0

Tests
    tests/test_s14_quantization.py: bytes equal `gguf.quants.quantize` on every 2-D tensor of
    the bundled model and on random and adversarial arrays (zeros, constants, +-max ties,
    values exactly halfway between codes); dequantized values equal `gguf.quants.dequantize`;
    NaN and inf refused.

References
    ggml/src/ggml-quants.c (quantize_row_q8_0_ref, quantize_row_q4_0_ref), ggml-common.h
    (block_q8_0, block_q4_0); gguf-py/gguf/quants.py (Q8_0, Q4_0, np_roundf), gguf 0.17.1.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; N output features, K input
features of a weight (N, K).
"""
from __future__ import annotations

import numpy as np

from s01_generation_loop import ParameterError

QK = 32                          # weights per block (ggml's QK8_0 == QK4_0 == 32)
Q8_0_BLOCK_BYTES = 2 + QK        # float16 d + 32 int8
Q4_0_BLOCK_BYTES = 2 + QK // 2   # float16 d + 16 bytes of nibbles
BLOCK_BYTES = {"q8_0": Q8_0_BLOCK_BYTES, "q4_0": Q4_0_BLOCK_BYTES}


def _blocks(weight: np.ndarray) -> np.ndarray:
    """weight (..., K) as float32 blocks (n_blocks, 32), row-major (block b of row r is row
    r * K/32 + b). Raises ParameterError (parameter "weight") for a non-float array, a last
    axis that is not a positive multiple of 32, or a NaN / inf."""
    weight = np.asarray(weight)
    if weight.ndim < 1 or not np.issubdtype(weight.dtype, np.floating):
        raise ParameterError(f"weight must be a floating-point array of at least 1 dimension "
                             f"(got {weight.dtype}, shape {weight.shape})", "weight")
    if weight.shape[-1] == 0 or weight.shape[-1] % QK:
        raise ParameterError(f"a GGUF block holds {QK} weights: the last axis must be a "
                             f"positive multiple of {QK} (got shape {weight.shape})", "weight")
    weight = weight.astype(np.float32, copy=False)
    if not np.isfinite(weight).all():
        raise ParameterError("weight must be finite: a NaN or inf has no code (llama.cpp "
                             "would store garbage)", "weight")
    return weight.reshape(-1, QK)


def _float16_scales(d: np.ndarray, weight_shape: tuple, scheme: str, rule: str,
                    limit: float) -> np.ndarray:
    """The float32 scales d (n_blocks, 1) rounded to float16, as llama.cpp stores them.
    Raises ParameterError ("weight") for a block whose d overflows float16 (|d| >= 65520
    rounds to inf: llama.cpp and gguf-py would store inf), naming its row and block."""
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    bad = np.flatnonzero(~np.isfinite(d16))
    if bad.size:
        per_row = weight_shape[-1] // QK
        row, block = divmod(int(bad[0]), per_row)
        raise ParameterError(
            f"weight too large for {scheme}: block {block} of row {row} (weights {block * QK}.."
            f"{block * QK + QK - 1}) has d = {rule} = {float(d.flat[bad[0]]):.4g}, past "
            f"float16's largest value 65504: {scheme} takes |w| below about {limit:.3g} "
            f"({len(bad)} block(s) over); llama.cpp would store d = inf", "weight")
    return d16


def _inverse_or_none(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's id = d ? 1 / d : 0 in float32, and where that overflowed (a nonzero |d| below
    1 / FLT_MAX, about 2.9e-39): there x * id is inf or NaN, llama.cpp's code a cast of it."""
    with np.errstate(over="ignore", divide="ignore"):
        inverse = _reciprocal(d)
    return inverse, ~np.isfinite(inverse)


def _byte_rows(data: np.ndarray, block_bytes: int, name: str) -> np.ndarray:
    """data (..., K/32 * block_bytes) uint8 as blocks (n_blocks, block_bytes). Raises
    ParameterError (parameter "data") for another dtype or a last axis that is not a positive
    multiple of the block's bytes."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim < 1 or data.shape[-1] == 0 \
            or data.shape[-1] % block_bytes:
        raise ParameterError(f"{name} data must be uint8 with a last axis that is a positive "
                             f"multiple of {block_bytes} bytes (one block per {QK} weights; "
                             f"got {data.dtype}, shape {data.shape})", "data")
    return data.reshape(-1, block_bytes)


def round_half_away_from_zero(x: np.ndarray) -> np.ndarray:
    """C's `roundf`, exact: |x| rounded to the nearest integer, ties away from zero, the sign
    put back. (floor(|x| + 0.5) would not do: |x| + 0.5 can round up in float32.)"""
    magnitude = np.abs(x)
    whole = np.floor(magnitude)
    return np.sign(x) * (whole + (magnitude - whole >= 0.5))   # the difference is exact


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, 0 where d == 0 (ggml: id = d ? 1.0f/d : 0.0f)."""
    inverse = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inverse, where=d != 0)
    return inverse


def quantize_q8_0(weight: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of weight (..., K), K % 32 == 0, any float dtype (computed in float32).

    Returns uint8 (..., K/32 * 34): per block its float16 d = absmax / 127 (little-endian),
    then 32 int8 codes round_half_away(x / d) (via the float32 reciprocal, as ggml).
    Byte-identical to `gguf.quants.quantize(weight, GGMLQuantizationType.Q8_0)` within the
    range the module docstring states (codes 0 for a block whose 1 / d overflows). Raises
    ParameterError ("weight") as `_blocks`, and for a block with absmax / 127 past float16
    (|w| above about 8.3e6). Source: ggml-quants.c quantize_row_q8_0_ref."""
    blocks = _blocks(weight)                                    # (nb, 32) float32
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)   # (nb, 1) float32
    d16 = _float16_scales(d, np.shape(weight), "Q8_0", "absmax / 127", 65520 * 127)
    inverse, overflow = _inverse_or_none(d)
    inverse[overflow] = 0                       # too small: the codes of 0 (d16 is 0 there)
    codes = round_half_away_from_zero(blocks * inverse).astype(np.int8)
    out = np.concatenate([d16.view(np.uint8),                           # (nb, 2)
                          codes.view(np.uint8)], axis=1)                # (nb, 34)
    return out.reshape(*np.shape(weight)[:-1], -1)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 bytes (..., K/32 * 34) -> float32 (..., K): code * d. Raises ParameterError as
    `_byte_rows`. Source: ggml-quants.c dequantize_row_q8_0."""
    blocks = _byte_rows(data, Q8_0_BLOCK_BYTES, "Q8_0")
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)       # (nb, 1)
    codes = blocks[:, 2:].view(np.int8).astype(np.float32)              # (nb, 32)
    return (codes * d).reshape(*data.shape[:-1], -1)


def quantize_q4_0(weight: np.ndarray) -> np.ndarray:
    """Q4_0 blocks of weight (..., K), K % 32 == 0, any float dtype (computed in float32).

    Returns uint8 (..., K/32 * 18): per block its float16 d = max / -8 (max: the value of
    largest magnitude, with its sign, the first on a tie), then 16 bytes; byte j holds code
    u_j in its low nibble and u_{j+16} in its high nibble, u = min(15, trunc(x / d + 8.5))
    (x * (1/d) + 8.5 in float64, rounded to float32 once, then truncated: gguf-py's emulation of
    C's fused multiply-add). Byte-identical to `gguf.quants.quantize(weight,
    GGMLQuantizationType.Q4_0)` within the range the module docstring states (codes 8 for a
    block whose 1 / d overflows). Raises ParameterError ("weight") as `_blocks`, and for a
    block with |max| / 8 past float16 (|w| above about 5.2e5).
    Source: ggml-quants.c quantize_row_q4_0_ref."""
    blocks = _blocks(weight)                                            # (nb, 32) float32
    first_largest = np.abs(blocks).argmax(axis=1)[:, None]              # first on a tie
    signed_max = np.take_along_axis(blocks, first_largest, axis=1)      # (nb, 1)
    d = signed_max / np.float32(-8)
    d16 = _float16_scales(d, np.shape(weight), "Q4_0", "max / -8", 65520 * 8)
    inverse, overflow = _inverse_or_none(d)
    inverse[overflow] = 0                       # too small: codes 8, the value 0 (d16 is 0)
    shifted = (blocks.astype(np.float64) * inverse.astype(np.float64) + 8.5
               ).astype(np.float32)                                     # in [0.5, 16.5]
    codes = np.minimum(np.floor(shifted), 15).astype(np.uint8)          # (nb, 32) in 0..15
    nibbles = codes[:, :QK // 2] | (codes[:, QK // 2:] << np.uint8(4))  # (nb, 16)
    out = np.concatenate([d16.view(np.uint8), nibbles], axis=1)         # (nb, 18)
    return out.reshape(*np.shape(weight)[:-1], -1)


def unpack_q4_0_codes(data: np.ndarray) -> np.ndarray:
    """The 4-bit codes of Q4_0 bytes (..., K/32 * 18): uint8 (..., K) in 0..15, in element
    order (low nibbles are elements 0..15 of a block, high nibbles 16..31)."""
    blocks = _byte_rows(data, Q4_0_BLOCK_BYTES, "Q4_0")
    nibbles = blocks[:, 2:]                                             # (nb, 16)
    codes = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=1)
    return codes.reshape(*data.shape[:-1], -1)


def q4_0_scales(data: np.ndarray) -> np.ndarray:
    """The float16 d of each block of Q4_0 bytes (..., K/32 * 18) -> float32 (..., K/32)."""
    blocks = _byte_rows(data, Q4_0_BLOCK_BYTES, "Q4_0")
    return blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(
        *data.shape[:-1], -1)


def dequantize_q4_0(data: np.ndarray) -> np.ndarray:
    """Q4_0 bytes (..., K/32 * 18) -> float32 (..., K): (u - 8) * d. Raises ParameterError as
    `_byte_rows`. Source: ggml-quants.c dequantize_row_q4_0."""
    codes = unpack_q4_0_codes(data).reshape(-1, QK).astype(np.float32) - 8   # (nb, 32)
    d = q4_0_scales(data).reshape(-1, 1)                                      # (nb, 1)
    return (codes * d).reshape(*data.shape[:-1], -1)


QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
DEQUANTIZE = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0}
