"""S14, quantization: int8 and int4 weights with group-wise scales, llama.cpp's blocks, fused
kernels; memory measured.

What is new since S13
    Decode streams every weight once per token, so the bytes per weight set its speed. This
    chapter stores the linear layers' weights in fewer bits and runs every engine unchanged:
    quantization is a model transform (`quantize_model`), not an engine.

    - Quantizers (torch, any device), round to nearest:
      int8 per output channel, symmetric: scale_n = absmax_n / 127, q = round(w / scale)
      in [-127, 127], w ~ q * scale. int4 group-wise along the input axis (groups of 32, 64
      or 128 weights of a row, each with its own scale), as unsigned 4-bit codes u in 0..15
      with w ~ (u - z) * scale: symmetric, z = 8 and u in 1..15 (signed codes -7..7,
      scale = absmax / 7: the grid is symmetric, 0 is exact and every weight is within
      scale / 2 of its level; the 16th level, -8, is left unused, the price of that bound;
      llama.cpp's Q4_0 uses it with its signed-max trick and pays |d| on the other side);
      or asymmetric, z an integer zero point in 0..15 per group, scale = (max' - min') / 15
      with min' = min(min, 0), max' = max(max, 0) (so 0 stays exact), z = round(-min' /
      scale). A scale that would be 0 (a row or group of zeros) is 1 instead: the codes are
      then 0 (z), the dequantized weights exactly 0, and nothing divides by zero. Scales are
      stored in `scale_dtype` (int8: float32, int4: bfloat16 by default), rounded *up* to
      it, never down, so the stored grid still covers the group: every weight is within
      scale / 2 of its dequantized value with the stored scale (tests).
      Two 4-bit codes per byte (`pack_int4`): element 2j in the low nibble, 2j + 1 in the
      high one (low nibble first, as llama.cpp; llama.cpp pairs j with j + 16 inside its
      32-blocks, code/s14_gguf.py).
    - llama.cpp's Q8_0 and Q4_0 blocks, byte-identical to the `gguf` package: the sibling
      code/s14_gguf.py.
    - `QuantizedTensor`: a weight (N, K) held as codes and scales, a torch tensor subclass
      (torchao's AffineQuantizedTensor idea) that S06's model uses where it used the
      Parameter: `F.linear(x, w, b)` and `F.embedding(ids, w)` are caught in
      `__torch_function__`, every other op refused with a message. Two paths: "reference"
      dequantizes the weight to the activations' dtype and calls F.linear (exact to the
      dequantized weight, slow: it writes a full-precision copy every call); "fused" calls
      torch's weight-only kernels, which dequantize inside the product: int8 ->
      `torch._weight_int8pack_mm` (one scale per output channel); int4 and Q4_0 ->
      `torch._weight_int4pack_mm_for_cpu` on the CPU, `torch._weight_int4pack_mm` on CUDA
      (tinygemm), both computing w = (u - 8) * scale + zero per group, so symmetric codes
      take zero = 0 and a zero point z takes zero = (8 - z) * scale (computed exactly in
      float32, then rounded to bfloat16 like every kernel operand: within the fused
      tolerance). Q4_0 is symmetric with d per 32: the int4 g32 kernel with scale d (rounded
      from float16 to bfloat16), zero 0. Q8_0 has no fused kernel here (torch's int8 GEMM
      takes one scale per row, Q8_0 one per 32). Each kernel has a shape rule
      (`fused_support`): the CPU int8 kernel needs K % 16 == 0 (it has no tail loop and
      reads past the row otherwise: garbage or a crash), the int4 kernels N % 16 (CPU) or
      N % 8 and K % 128 (CUDA). path="fused" is refused for a weight that breaks it, and
      every fused weight is checked at quantize time by a trial product of a nonzero x
      against the dequantized weight. Scales stored in float16 (Q8_0 / Q4_0's d, or
      scale_dtype=torch.float16) overflow past 65504: such a weight is refused, named by row
      and block, not stored as inf.
    - `quantize_model(model, scheme)`: S06's `TorchTransformer`, in place (torchao's
      `quantize_` convention: no second copy of the weights; load the model again for a
      full-precision oracle; path=None picks the fused path per weight where the kernel's
      shape rule holds, else the reference): the four linear weights of every block (Qwen3 /
      Llama: qkv_proj, o_proj, gate_up_proj, down_proj; GPT-2: c_attn, c_proj, c_fc,
      mlp_proj); the token
      embedding and the LM head (tied or not) stay in full precision unless
      quantize_embedding=True (llama.cpp's 4-bit mixes keep the output head at Q6_K: its
      errors land directly on the logits). GPT-2's learned positions, norms and biases always stay.
    - Memory accounting (`model_memory`, `memory_table`): bytes and bits per weight of every
      parameter as stored (codes + scales + zero points), per layer and whole model, against
      float32 and bfloat16; `kernel_nbytes`, what the fused kernel reads per token;
      `resident_nbytes`, what the weight holds in memory (the fused int4 path keeps the
      kernel's repacked copy beside the stored nibbles: about 2x the stored bytes).
    - `build_engine`: S13's `build_engine` (paged KV, chunked prefill, prefix caching) on a
      quantized model, its KV pool in `kv_cache_dtype` (code/s14_kv_cache.py: "int8",
      "fp8_e4m3", ...); Part I's `s06_torch.Engine` takes a quantized model as it is.

What it does not handle yet
    Round to nearest only: GPTQ and AWQ choose codes (and scales) that minimise the layer's
    output error on calibration data instead. No activation quantization (W8A8), no fp8
    weights, no K-quants, no outlier handling (LLM.int8). The fused int4 path keeps the
    kernel's repacked copy of the codes beside the canonical nibbles (so `dequantize` stays
    readable), so its resident memory is about twice the stored bytes `model_memory`
    reports; production keeps one (torchao's TensorCoreTiledLayout). A quantized model
    cannot change device or dtype (`.to()`, `.half()`, `.cuda()` are refused before anything
    is converted): quantize it where it runs. The KV cache in 8 bits is
    code/s14_kv_cache.py, perplexity code/s14_quality.py.

Run it
    python code/s14_quantization.py --quantize int4 --group-size 32
    python code/s14_quantization.py --quantize q4_0 --prompt "Romeo." --max-tokens 40
    python code/s14_quantization.py --quantize int8 --kv-cache-dtype int8   # 8-bit KV too

Tests
    tests/test_s14_quantization.py: round trips within scale / 2 against a NumPy reference
    written group by group; zero rows and constant groups; packing against hand-made bytes;
    Q8_0 / Q4_0 bytes equal `gguf.quants.quantize` on every 2-D tensor of the bundled model
    and on adversarial arrays; fused paths within the stated tolerance of the reference; the
    quantized model's greedy tokens in S06's engine equal the S01 loop on the same quantized
    model (both families), and each request in S13's engine equals it alone; memory against
    the bytes written out by hand; every refusal: the int8 kernel's K % 16 rule (never
    running it where it would read past a row) and the default path's fallback to the
    reference there, a misbehaving kernel caught by the trial product, scales past float16
    named by row and block, stored values off the format, a dtype or device change of a
    quantized model refused before anything is converted, the command line's flags.

References
    Dettmers et al., "LLM.int8()" (2022); Frantar et al., "GPTQ" (2022); Lin et al., "AWQ"
    (2023) for what round to nearest leaves. torchao: AffineQuantizedTensor,
    choose_qparams_affine (preserve_zero), the tinygemm int4 layout
    (TensorCoreTiledLayout, `_convert_weight_to_int4pack`, scales_and_zeros (K/g, N, 2));
    PyTorch's test_linalg.py (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu);
    llama.cpp ggml-quants.c and gguf-py (code/s14_gguf.py).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size, I MLP size;
N output features and K input features of a weight (N, K), g the group size.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06, before NumPy loads

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import s01_generation_loop as s01
import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s14_gguf
import s14_kv_cache
ParameterError = s01.ParameterError

SCHEMES = ("int8", "int4", "q8_0", "q4_0")
GROUP_SIZES = (32, 64, 128)         # int4 groups the CPU and CUDA int4 kernels both take
PATHS = ("reference", "fused")
INT8_MAX = 127
INT4_SYM_MAX = 7                    # signed codes -7..7 (unsigned 1..15, zero point 8)
INT4_LEVELS = 15                    # unsigned codes 0..15
DEFAULT_SCALE_DTYPE = {"int8": torch.float32, "int4": torch.bfloat16}
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what int8 / int4 scales take
# The fused kernels' activation dtype, whatever the model's: on the CPU, torch's int8 and int4
# weight-only GEMMs are fast only in bfloat16 (with float32 activations they were 3-10x
# *slower* than a float32 F.linear at batch 1, measured: see gemv_timings), and CUDA's
# tinygemm takes bfloat16 only. A float32 model's activations are cast to bfloat16 for the
# product and its output cast back.
KERNEL_DTYPE = torch.bfloat16
LINEAR_WEIGHTS = {"qwen3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                  "gpt2": ("c_attn", "c_proj", "c_fc", "mlp_proj")}


# ---------------------------------------------------------------------------------------------
# Quantizers and dequantizers (torch, on the weight's device)
# ---------------------------------------------------------------------------------------------

def _check_weight(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) floating point and finite, as float32. Raises ParameterError ("weight")."""
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point() \
            or 0 in w.shape:
        raise ParameterError(f"weight must be a non-empty 2-D floating-point tensor (N, K) "
                             f"(got {type(w).__name__} {getattr(w, 'shape', '')})", "weight")
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ParameterError("weight must be finite: a NaN or inf has no code", "weight")
    return w


def _check_scale_dtype(scale_dtype, scheme: str) -> None:
    """scale_dtype for int8 / int4: one of SCALE_DTYPES (a torch.dtype, not its name); for
    q8_0 / q4_0 it must be None (llama.cpp's blocks store a float16 d). Raises
    ParameterError ("scale_dtype")."""
    if scheme in ("q8_0", "q4_0"):
        if scale_dtype is not None:
            raise ParameterError(f"{scheme} stores llama.cpp's float16 d per block of "
                                 f"{s14_gguf.QK}: scale_dtype must be None (got "
                                 f"{scale_dtype!r})", "scale_dtype")
        return
    if not isinstance(scale_dtype, torch.dtype) or scale_dtype not in SCALE_DTYPES:
        raise ParameterError(f"scale_dtype must be one of torch.float32, torch.bfloat16, "
                             f"torch.float16 (got {scale_dtype!r})", "scale_dtype")


def _check_scales_fit(stored: torch.Tensor, scale: torch.Tensor, rule: str) -> None:
    """Refuse a stored scale that is not finite: absmax / qmax past the scale dtype's largest
    value (float16: 65504, so |w| above about 8.3e6 for int8 and 4.6e5 for symmetric int4), or
    an asymmetric group whose max - min overflows float32. Raises ParameterError ("weight")
    naming the row (and group) and the limit."""
    bad = (~torch.isfinite(stored)).nonzero()
    if not len(bad):
        return
    where = tuple(int(i) for i in bad[0])
    place = f"row {where[0]}" + (f", group {where[1]}" if len(where) > 1 else "")
    dtype, name = stored.dtype, str(stored.dtype)[6:]
    if not bool(torch.isfinite(scale[where])):
        raise ParameterError(
            f"weight out of range: {place} has max - min past float32's largest value "
            f"({torch.finfo(torch.float32).max:.4g}), so its scale {rule} is inf; "
            f"{len(bad)} scale(s) over. Scale the weight down", "weight")
    raise ParameterError(
        f"weight out of range for {name} scales: {place} has scale = {rule} = "
        f"{float(scale[where]):.4g}, and {name} holds at most {torch.finfo(dtype).max:.4g}; "
        f"{len(bad)} scale(s) over. Use scale_dtype=torch.float32 or torch.bfloat16, or a "
        "weight within range", "weight")


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive float32 scales stored in dtype, rounded up where rounding to nearest went
    down (the next representable value: +1 on the bit pattern of a positive float), so
    |w| / stored scale never exceeds the grid's edge."""
    stored = scale.to(dtype)
    if dtype == torch.float32:
        return stored
    below = stored.float() < scale
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    bumped = (stored.view(bits) + 1).view(dtype)
    return torch.where(below, bumped, stored)


def _safe_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored scale: rounded up to dtype, and 1 where it is 0 (an all-zero row or group,
    or an underflow), so nothing divides by zero and the codes come out 0."""
    stored = _round_scale_up(scale, dtype)
    return torch.where(stored == 0, torch.ones_like(stored), stored)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output channel (row).

    w: (N, K) float. Returns codes int8 (N, K) in [-127, 127] and scales (N,) in scale_dtype
    (one of SCALE_DTYPES): scale_n = absmax_n / 127 (1 for a row of zeros), codes =
    round(w / scale) (half to even, torch.round). |w - codes * scale| <= scale / 2 per
    element. Raises ParameterError: "weight" not 2-D floating point, not finite, or with a
    scale its dtype cannot hold (float16: absmax above about 8.3e6, named by row);
    "scale_dtype" not one of SCALE_DTYPES. Source: LLM.int8()'s vector-wise absmax
    quantization (without its outliers); torchao's int8 weight-only."""
    _check_scale_dtype(scale_dtype, "int8")
    w = _check_weight(w)
    raw = w.abs().amax(dim=1) / INT8_MAX                                         # (N,)
    scales = _safe_scale(raw, scale_dtype)
    _check_scales_fit(scales, raw, "absmax / 127")
    codes = torch.round(w / scales.float()[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes int8 (N, K), scales (N,) -> (N, K) in dtype (computed in float32)."""
    return (codes.float() * scales.float()[:, None]).to(dtype)


def _check_group(k: int, group_size: int) -> None:
    if not s01.is_int(group_size) or group_size not in GROUP_SIZES:
        raise ParameterError(f"group_size must be one of {GROUP_SIZES} (got {group_size!r})",
                             "group_size")
    if k % group_size:
        raise ParameterError(f"group_size must divide the input width K: {k} is not a "
                             f"multiple of {group_size}", "group_size")


def quantize_int4(w: torch.Tensor, group_size: int = 32, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int4 group-wise along the input axis: each run of group_size weights of a row has its
    own scale (and zero point).

    w: (N, K) float, K % group_size == 0, group_size an int in GROUP_SIZES. Returns codes
    uint8 (N, K) in 0..15 (unpacked: `pack_int4` halves them), scales (N, K/g) in scale_dtype
    (one of SCALE_DTYPES) and zeros: None when symmetric (the zero point is 8, codes 1..15),
    else uint8 (N, K/g) in 0..15. w ~ (codes - zero) * scale, within scale / 2 per element.
    symmetric (True or False): scale = absmax / 7. Asymmetric: scale = (max' - min') / 15
    over the group widened to include 0, zero = round(-min' / scale). Raises ParameterError
    naming the parameter: "weight" (not 2-D floating point, not finite, or a scale its dtype
    cannot hold: float16 above 65504, named by row and group; an asymmetric group whose
    max - min overflows float32), "group_size", "symmetric", "scale_dtype".
    Source: torchao choose_qparams_affine /
    quantize_affine (preserve_zero=True; its symmetric int4 uses -8..7 with absmax / 7.5,
    which breaks the scale / 2 bound at +7.5: this course keeps -7..7)."""
    if not isinstance(symmetric, bool):
        raise ParameterError(f"symmetric must be True or False (got {symmetric!r})",
                             "symmetric")
    _check_scale_dtype(scale_dtype, "int4")
    w = _check_weight(w)
    n, k = w.shape
    _check_group(k, group_size)
    groups = w.view(n, k // group_size, group_size)                             # (N, K/g, g)
    if symmetric:
        raw = groups.abs().amax(dim=2) / INT4_SYM_MAX                            # (N, K/g)
        scales = _safe_scale(raw, scale_dtype)
        _check_scales_fit(scales, raw, "absmax / 7")
        signed = torch.round(groups / scales.float()[..., None]).clamp(-INT4_SYM_MAX,
                                                                       INT4_SYM_MAX)
        return (signed + 8).to(torch.uint8).view(n, k), scales, None
    low = groups.amin(dim=2).clamp(max=0.0)                                     # min'
    high = groups.amax(dim=2).clamp(min=0.0)                                    # max'
    raw = (high - low) / INT4_LEVELS                                             # (N, K/g)
    scales = _safe_scale(raw, scale_dtype)
    _check_scales_fit(scales, raw, "(max' - min') / 15")
    zeros = torch.round(-low / scales.float()).clamp(0, INT4_LEVELS)             # (N, K/g)
    codes = (torch.round(groups / scales.float()[..., None]) + zeros[..., None]
             ).clamp(0, INT4_LEVELS)
    return codes.to(torch.uint8).view(n, k), scales, zeros.to(torch.uint8)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 (N, K) in 0..15, scales (N, K/g), zeros uint8 (N, K/g) or None (8) ->
    (codes - zero) * scale, (N, K) in dtype (computed in float32)."""
    n, k = codes.shape
    groups = codes.view(n, k // group_size, group_size).float()                 # (N, K/g, g)
    zero = 8.0 if zeros is None else zeros.float()[..., None]
    return ((groups - zero) * scales.float()[..., None]).view(n, k).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: codes uint8 (..., K) in 0..15, K even -> uint8 (..., K/2),
    byte j = codes[2j] | codes[2j + 1] << 4 (low nibble first). Raises ParameterError
    ("codes") for a non-tensor, another dtype, an odd K or a code above 15."""
    if not isinstance(codes, torch.Tensor):
        raise ParameterError(f"codes must be a uint8 torch tensor (got {type(codes).__name__})",
                             "codes")
    if codes.dtype != torch.uint8 or codes.ndim < 1 or codes.shape[-1] % 2:
        raise ParameterError(f"codes must be uint8 with an even last axis (got {codes.dtype}, "
                             f"shape {tuple(codes.shape)})", "codes")
    if (codes > 15).any():
        raise ParameterError("a 4-bit code must lie in 0..15", "codes")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 (..., K/2) -> uint8 (..., K) in 0..15. Raises
    ParameterError ("packed") for a non-tensor, another dtype or a 0-d tensor."""
    if not isinstance(packed, torch.Tensor):
        raise ParameterError(f"packed must be a uint8 torch tensor (got "
                             f"{type(packed).__name__})", "packed")
    if packed.dtype != torch.uint8 or packed.ndim < 1:
        raise ParameterError(f"packed codes must be uint8 (got {packed.dtype})", "packed")
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=-1)                   # (..., K/2, 2)
    return pairs.flatten(-2)


def _gguf_bytes(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    n = blocks.shape[0]
    return blocks.reshape(n, -1, block_bytes)                    # (N, K/32, block bytes)


def dequantize_gguf(blocks: torch.Tensor, scheme: str, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """llama.cpp blocks as torch uint8 (N, K/32 * bytes) -> (N, K) in dtype, on their device:
    Q8_0 code * d, Q4_0 (u - 8) * d (the torch twin of s14_gguf's NumPy dequantizers)."""
    b = _gguf_bytes(blocks, s14_gguf.BLOCK_BYTES[scheme])
    d = b[..., :2].contiguous().view(torch.float16).float()                     # (N, K/32, 1)
    if scheme == "q8_0":
        values = b[..., 2:].contiguous().view(torch.int8).float()                # (N, K/32, 32)
    else:
        values = _q4_0_codes(blocks).view(b.shape[0], b.shape[1], -1).float() - 8
    return (values * d).view(blocks.shape[0], -1).to(dtype)


def _q4_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 bytes (N, K/32 * 18) -> codes uint8 (N, K) in element order."""
    b = _gguf_bytes(blocks, s14_gguf.Q4_0_BLOCK_BYTES)[..., 2:]                 # (N, K/32, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1).view(blocks.shape[0], -1)


def _q4_0_scales(blocks: torch.Tensor) -> torch.Tensor:
    b = _gguf_bytes(blocks, s14_gguf.Q4_0_BLOCK_BYTES)
    return b[..., :2].contiguous().view(torch.float16).float()[..., 0]          # (N, K/32)


# ---------------------------------------------------------------------------------------------
# The quantized weight
# ---------------------------------------------------------------------------------------------

# The tensors each scheme stores, and their shapes for a weight (N, K) with groups of g.
LAYOUT = {
    "int8": lambda n, k, g: {"codes": ((n, k), torch.int8), "scales": ((n,), None)},
    "int4": lambda n, k, g: {"packed": ((n, k // 2), torch.uint8),
                             "scales": ((n, k // g), None), "zeros": ((n, k // g), torch.uint8)},
    "q8_0": lambda n, k, g: {"blocks": ((n, k // 32 * s14_gguf.Q8_0_BLOCK_BYTES), torch.uint8)},
    "q4_0": lambda n, k, g: {"blocks": ((n, k // 32 * s14_gguf.Q4_0_BLOCK_BYTES), torch.uint8)},
}


def _fused_kernel_error(err: Exception, scheme: str, device: torch.device, shape
                        ) -> ParameterError:
    return ParameterError(
        f"path='fused' needs torch's {scheme} weight-only kernel for "
        f"{str(KERNEL_DTYPE)[6:]} activations on {device.type} and a weight of shape "
        f"{tuple(shape)}, and torch "
        f"refused ({str(err).splitlines()[0][:160]}); use path='reference', another dtype, "
        "or another device", "path")


class QuantizedTensor(torch.Tensor):
    """A weight (N, K) stored as codes and scales that S06's model uses through `F.linear`
    and `F.embedding`. Its shape is (N, K) and its dtype the activations' (the model's
    dtype); it holds no full-precision values.

    scheme: "int8" | "int4" | "q8_0" | "q4_0"; group_size: weights per scale (K for int8,
    g for int4, 32 for the GGUF blocks); symmetric; path: "reference" | "fused".
    qdata: the stored tensors (`LAYOUT`): int8 codes (N, K) int8 + scales (N,); int4 packed
    uint8 (N, K/2) + scales (N, K/g) + zeros uint8 (N, K/g) (asymmetric only); q8_0 / q4_0
    blocks uint8 (N, K/32 * 34 | 18), llama.cpp's bytes. kernel: the fused kernel's operands
    in KERNEL_DTYPE (empty on the reference path). Memory: `quantized_nbytes` is the format's
    bytes; on the fused int4 / q4_0 path the kernel keeps its own repacked copy of the codes
    (and bfloat16 scales and zeros) beside them, so the weight's resident bytes
    (`resident_nbytes`) are about twice the stored ones (int8's kernel shares the codes and
    adds bfloat16 scales).
    Build with `from_float` or `from_parts`; raises ParameterError naming the rule.
    """

    @staticmethod
    def __new__(cls, shape, dtype, device, **_):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=False)

    def __init__(self, shape, dtype, device, *, scheme: str, group_size: int,
                 symmetric: bool, qdata: dict, path: str, kernel: dict):
        self.scheme, self.group_size, self.symmetric = scheme, group_size, symmetric
        self.qdata, self.path, self.kernel = qdata, path, kernel

    # --- building -----------------------------------------------------------------------

    @classmethod
    def from_parts(cls, scheme: str, shape: tuple[int, int], qdata: dict, *,
                   group_size: int | None = None, symmetric: bool = True,
                   dtype: torch.dtype = torch.float32, path: str = "reference"
                   ) -> "QuantizedTensor":
        """Wrap stored tensors (see the class docstring) as a weight of `shape` (N, K) used with
        activations of `dtype`. Checks every tensor's shape and dtype against `LAYOUT` (a
        packed tensor of the wrong shape is refused, not misread) and its values (int8 codes
        in [-127, 127]; int8 / int4 scales finite and > 0, in one of SCALE_DTYPES; int4 zero
        points in 0..15; GGUF d finite). For path="fused": refuses a weight the kernel's shape
        rule excludes (`fused_support`: int8 on the CPU needs K % 16 == 0, else torch's kernel
        reads past the row), prepares the kernel's operands and runs a trial product of a
        fixed nonzero x (3, K) against the dequantized weight, within the fused tolerance
        2^-7 (|x| @ (|W| + |Z|)^T) (tests/test_s14_quantization.py derives it), so a device,
        dtype or shape torch's kernel lacks, or gets wrong, is refused here, not in the
        middle of a step. Raises ParameterError naming the parameter ("scheme", "shape",
        "group_size", "qdata", "path", "symmetric", "dtype")."""
        if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2
                and all(s01.is_int(d) and d >= 1 for d in shape)):
            raise ParameterError(f"shape must be (N, K), two integers >= 1 (got {shape!r})",
                                 "shape")
        n, k = (int(d) for d in shape)
        scheme, group_size = _check_scheme(scheme, group_size, symmetric, k)
        if path not in PATHS:
            raise ParameterError(f"path must be one of {PATHS} (got {path!r})", "path")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ParameterError(f"dtype (the activations') must be a floating-point torch "
                                 f"dtype (got {dtype!r})", "dtype")
        expected = LAYOUT[scheme](n, k, group_size)
        if scheme == "int4" and symmetric:
            expected.pop("zeros")
        if not isinstance(qdata, dict) or set(qdata) != set(expected):
            raise ParameterError(f"{scheme} stores a dict of {sorted(expected)} (got "
                                 f"{sorted(qdata) if isinstance(qdata, dict) else qdata!r})",
                                 "qdata")
        if not all(isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor)
                   for t in qdata.values()):
            raise ParameterError(f"{scheme} qdata must hold torch tensors (got "
                                 f"{ {name: type(t).__name__ for name, t in qdata.items()} })",
                                 "qdata")
        device = next(iter(qdata.values())).device
        for name, (want_shape, want_dtype) in expected.items():
            t = qdata[name]
            bad_dtype = (t.dtype != want_dtype if want_dtype is not None
                         else t.dtype not in SCALE_DTYPES)
            if tuple(t.shape) != want_shape or bad_dtype or t.device != device:
                raise ParameterError(
                    f"{scheme} {name} of a ({n}, {k}) weight must be "
                    f"{str(want_dtype)[6:] if want_dtype else 'float32, bfloat16 or float16'} "
                    f"of shape {want_shape} on one device (got {t.dtype} {tuple(t.shape)} on "
                    f"{t.device})", "qdata")
        _check_stored_values(scheme, qdata)
        if path == "fused":
            why = fused_support(scheme, (n, k), device)
            if why is not None:
                raise ParameterError(f"path='fused' cannot take this {scheme} weight ({n}, {k}) "
                                     f"on {device.type}: {why}; use path='reference' "
                                     "(quantize_model's default path picks it for such a "
                                     "weight)", "path")
        tensor = cls(torch.Size((n, k)), dtype, device, scheme=scheme, group_size=group_size,
                     symmetric=symmetric, qdata=dict(qdata), path=path, kernel={})
        if path == "fused":
            try:
                kernel = _prepare_kernel(scheme, qdata, device)
                _trial_product(tensor, kernel)
            except RuntimeError as err:     # what torch raises for a missing kernel or shape
                raise _fused_kernel_error(err, scheme, device, (n, k)) from err
            tensor.kernel = kernel
        return tensor

    @classmethod
    def from_float(cls, w: torch.Tensor, scheme: str, *, group_size: int | None = None,
                   symmetric: bool = True, path: str = "reference",
                   dtype: torch.dtype | None = None, scale_dtype: torch.dtype | None = None
                   ) -> "QuantizedTensor":
        """Quantize w (N, K) with `scheme` on w's device. dtype: the activations' dtype
        (default w's); scale_dtype: int8 / int4 only, one of SCALE_DTYPES (default int8
        float32, int4 bfloat16); None for q8_0 / q4_0 (float16, fixed by the format).
        group_size: None for the scheme's (int8: the row, int4 and GGUF: 32).
        Raises ParameterError as `from_parts`, the quantizers and s14_gguf ("scale_dtype"
        given for a GGUF scheme or not one of SCALE_DTYPES)."""
        if isinstance(w, QuantizedTensor):
            raise ParameterError("this weight is already quantized: quantize the "
                                 "full-precision weight, once", "weight")
        dtype = w.dtype if dtype is None and isinstance(w, torch.Tensor) else dtype
        scheme, group_size = _check_scheme(scheme, group_size, symmetric,
                                           w.shape[1] if isinstance(w, torch.Tensor)
                                           and w.ndim == 2 else 0)
        if scheme in ("int8", "int4"):
            scale_dtype = DEFAULT_SCALE_DTYPE[scheme] if scale_dtype is None else scale_dtype
        _check_scale_dtype(scale_dtype, scheme)
        if scheme == "int8":
            codes, scales = quantize_int8(w, scale_dtype)
            qdata = {"codes": codes, "scales": scales}
        elif scheme == "int4":
            codes, scales, zeros = quantize_int4(w, group_size, symmetric, scale_dtype)
            qdata = {"packed": pack_int4(codes), "scales": scales}
            if zeros is not None:
                qdata["zeros"] = zeros
        else:
            blocks = s14_gguf.QUANTIZE[scheme](_check_weight(w).cpu().numpy())
            qdata = {"blocks": torch.from_numpy(blocks).to(w.device)}
        return cls.from_parts(scheme, tuple(w.shape), qdata, group_size=group_size,
                              symmetric=symmetric, dtype=dtype, path=path)

    # --- reading ------------------------------------------------------------------------

    def int4_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """int4 and q4_0: codes uint8 (N, K) in 0..15, scales float32 (N, K/g), zeros uint8
        (N, K/g) or None (8): w ~ (codes - zero) * scale."""
        if self.scheme == "q4_0":
            blocks = self.qdata["blocks"]
            return _q4_0_codes(blocks), _q4_0_scales(blocks), None
        if self.scheme != "int4":
            raise ValueError(f"int4_codes needs an int4 or q4_0 weight (this one is {self.scheme})")
        return (unpack_int4(self.qdata["packed"]), self.qdata["scales"].float(),
                self.qdata.get("zeros"))

    def dequantize(self, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The weight's values (N, K) in dtype (default the activations'), computed in
        float32; rows: int64 indices to dequantize only those rows (an embedding lookup)."""
        dtype = self.dtype if dtype is None else dtype
        q = self.qdata if rows is None else {name: t[rows] for name, t in self.qdata.items()}
        if self.scheme == "int8":
            return dequantize_int8(q["codes"], q["scales"], dtype)
        if self.scheme == "int4":
            return dequantize_int4(unpack_int4(q["packed"]), q["scales"], q.get("zeros"),
                                   self.group_size, dtype)
        return dequantize_gguf(q["blocks"], self.scheme, dtype)

    @property
    def quantized_nbytes(self) -> int:
        """Bytes the format stores: codes, scales and zero points (llama.cpp's bytes for the
        GGUF blocks)."""
        return sum(t.numel() * t.element_size() for t in self.qdata.values())

    @property
    def resident_nbytes(self) -> int:
        """Bytes the weight holds in memory: the stored tensors and the fused kernel's
        operands, each storage once (int8's kernel shares the stored codes; int4's repacks
        them: about 2x `quantized_nbytes` on the fused int4 / q4_0 path)."""
        seen, total = set(), 0
        for t in list(self.qdata.values()) + list(self.kernel.values()):
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    @property
    def kernel_nbytes(self) -> int:
        """Bytes a product reads: the fused kernel's operands, or on the reference path the
        stored format (which it then expands into an (N, K) full-precision copy)."""
        source = self.kernel if self.kernel else self.qdata
        return sum(t.numel() * t.element_size() for t in source.values())

    def describe(self) -> str:
        """e.g. "int4 g32 sym" or "q4_0"."""
        if self.scheme == "int8":
            return "int8 per-channel"
        if self.scheme == "int4":
            return f"int4 g{self.group_size} {'sym' if self.symmetric else 'asym'}"
        return self.scheme

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantizedTensor({self.describe()}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, path={self.path})")

    # --- the products -------------------------------------------------------------------

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) @ W^T + bias -> (..., N) in x's dtype. Reference: dequantize to x's dtype,
        then F.linear. Fused: x cast to KERNEL_DTYPE (bfloat16) into a 64-byte-aligned buffer
        (the CPU int8 kernel's aligned vector loads fault on a view that starts elsewhere),
        the kernel, the output cast back to x's dtype, then the bias. Raises TypeError for
        integer activations, ValueError for a K that does not match."""
        n, k = self.shape
        if not x.is_floating_point():
            raise TypeError(f"F.linear with a quantized weight takes floating-point "
                            f"activations (got {x.dtype})")
        if x.shape[-1] != k:
            raise ValueError(f"linear: x has {x.shape[-1]} features, the weight takes {k}")
        if not self.kernel:
            return F.linear(x, self.dequantize(x.dtype), bias)
        rows = _aligned(x.reshape(-1, k).to(KERNEL_DTYPE).contiguous())          # (M, K)
        out = _run_kernel(self.scheme, self.kernel, rows, self.group_size)      # (M, N)
        out = out.to(x.dtype).view(*x.shape[:-1], n)
        return out if bias is None else out + bias

    def _shallow_copy(self) -> "QuantizedTensor":
        return QuantizedTensor(self.shape, self.dtype, self.device, scheme=self.scheme,
                               group_size=self.group_size, symmetric=self.symmetric,
                               qdata=self.qdata, path=self.path, kernel=self.kernel)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if isinstance(x, QuantizedTensor) or not isinstance(w, QuantizedTensor):
                raise TypeError("F.linear takes a quantized weight, not quantized activations")
            return w.linear(x, bias)
        if func is F.embedding:
            ids, w = args[0], args[1]
            if not isinstance(w, QuantizedTensor) or any(
                    v not in (None, False, 2.0) for v in list(args[2:]) + list(kwargs.values())):
                raise TypeError("a quantized embedding takes F.embedding(ids, weight) only")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
                raise IndexError("index out of range in self")   # F.embedding's own error
            return w.dequantize(rows=ids.reshape(-1)).view(*ids.shape, w.shape[1])
        if func is torch.Tensor.detach:        # nn.Parameter(w) calls it: share the codes
            return args[0]._shallow_copy()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)       # metadata (shape, dtype, device, ...) only

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]._shallow_copy()
        raise TypeError(f"{func} is not defined on a QuantizedTensor: it holds codes and "
                        "scales, not values (use F.linear, F.embedding or .dequantize())")


def _check_scheme(scheme: str, group_size: int | None, symmetric: bool, k: int
                  ) -> tuple[str, int]:
    """The scheme's name and its group size (None -> the scheme's); raises ParameterError
    for an unknown scheme, a group size the scheme does not take or that does not divide K,
    or an asymmetric scheme other than int4."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ParameterError(f"scheme must be one of {', '.join(SCHEMES)} (got {scheme!r}): "
                             "8 and 4 bits are supported", "scheme")
    if not isinstance(symmetric, bool):
        raise ParameterError(f"symmetric must be True or False (got {symmetric!r})",
                             "symmetric")
    if not symmetric and scheme != "int4":
        raise ParameterError(f"{scheme} is symmetric only (asymmetric int4 has a zero point; "
                             "llama.cpp's asymmetric block is Q4_1)", "symmetric")
    if group_size is not None and not s01.is_int(group_size):
        raise ParameterError(f"group_size must be an integer or None (got {group_size!r})",
                             "group_size")
    if scheme == "int8":
        if group_size is not None and group_size != k:
            raise ParameterError("int8 has one scale per output channel: group_size must be "
                                 f"None (got {group_size!r})", "group_size")
        return scheme, k
    if scheme in ("q8_0", "q4_0"):
        if group_size not in (None, s14_gguf.QK):
            raise ParameterError(f"{scheme} blocks hold {s14_gguf.QK} weights: group_size "
                                 f"must be None or 32 (got {group_size!r})", "group_size")
        if k % s14_gguf.QK:
            raise ParameterError(f"group_size must divide the input width K: {k} is not a "
                                 f"multiple of {scheme}'s block of {s14_gguf.QK}", "group_size")
        return scheme, s14_gguf.QK
    group_size = 32 if group_size is None else group_size
    _check_group(k, group_size)
    return scheme, group_size


def _check_stored_values(scheme: str, qdata: dict) -> None:
    """The values `from_parts` accepts: int8 codes in [-127, 127] (-128 is not on the
    symmetric grid); int8 / int4 scales finite and > 0 (the quantizers store 1 for a zero
    group, never 0); int4 zero points in 0..15; a GGUF block's float16 d finite. Raises
    ParameterError ("qdata")."""
    def refuse(rule: str):
        raise ParameterError(f"{scheme} qdata: {rule}", "qdata")
    if scheme == "int8" and bool((qdata["codes"] == -128).any()):
        refuse("int8 codes must lie in [-127, 127] (symmetric: -128 is off the grid)")
    if "scales" in qdata:
        scales = qdata["scales"].float()
        if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
            refuse("scales must be finite and > 0")
    if "zeros" in qdata and bool((qdata["zeros"] > INT4_LEVELS).any()):
        refuse("zero points must lie in 0..15 (4-bit codes)")
    if "blocks" in qdata:
        b = _gguf_bytes(qdata["blocks"], s14_gguf.BLOCK_BYTES[scheme])
        d = b[..., :2].contiguous().view(torch.float16)
        if not bool(torch.isfinite(d).all()):
            refuse("every block's float16 d must be finite")


def fused_support(scheme: str, shape: tuple[int, int], device: str | torch.device
                  ) -> str | None:
    """None when path="fused" can take a (N, K) weight of `scheme` on `device`, else why not
    (the kernel's shape rule, one phrase). q8_0: no kernel here. int8 on the CPU: K % 16 == 0
    (torch's `_weight_int8pack_mm` CPU kernel steps through a row 16 bfloat16 values at a
    time with aligned 32-byte loads (AVX-512; 8 with AVX2 or NEON) and has no tail: with
    another K it reads past the row, measured: NaN, inf, garbage or a segmentation fault;
    its CUDA kernel is a plain loop, no rule). int4 / q4_0: on the CPU N % 16 == 0
    (`_convert_weight_to_int4pack_for_cpu`), on CUDA N % 8 == 0 and K % 128 == 0 (tinygemm's
    n-tiles of 8 and 8 inner k-tiles of 16); torch checks these itself. Other devices: no
    rule known here (torch's refusal, or the trial product, decides)."""
    device = torch.device(device)
    n, k = shape
    if scheme == "q8_0":
        return ("q8_0 has no fused kernel here (torch's int8 GEMM takes one scale per output "
                "channel, Q8_0 one per 32 weights)")
    if scheme == "int8":
        if device.type == "cpu" and k % 16:
            return (f"torch's CPU int8 kernel needs the input width K to be a multiple of 16 "
                    f"(K = {k}: it would read past each row)")
        return None
    if device.type == "cpu" and n % 16:
        return f"torch's CPU int4 kernel needs N % 16 == 0 (N = {n})"
    if device.type == "cuda" and (n % 8 or k % 128):
        return f"torch's CUDA int4 kernel (tinygemm) needs N % 8 == 0 and K % 128 == 0 " \
               f"(N = {n}, K = {k})"
    return None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a fresh copy (torch allocates 64-byte aligned) where t starts off a 64-byte
    boundary: a contiguous view with an offset would make the CPU int8 kernel's aligned
    loads fault. Inside torch.compile (S16) there is no address to test while tracing, and
    none is needed: t is then the fresh output of the cast before it, which inductor
    allocates whole from torch's allocator (its default plan reuses whole buffers, never at
    an offset)."""
    if torch.compiler.is_compiling():
        return t
    return t.clone() if t.numel() and t.data_ptr() % 64 else t


def _trial_input(k: int, device: torch.device) -> torch.Tensor:
    """A fixed nonzero x (3, K) in KERNEL_DTYPE, exact there: ((7k + 3m) mod 17 - 8) / 8."""
    cols = torch.arange(k, device=device)[None, :]
    rows = torch.arange(3, device=device)[:, None]
    return (((7 * cols + 3 * rows) % 17 - 8) / 8).to(KERNEL_DTYPE)


def _trial_product(weight: "QuantizedTensor", kernel: dict) -> None:
    """The fused kernel on `_trial_input` against x @ W^T with the dequantized float32
    weight: every output finite and within 2^-7 (|x| @ (|W| + |Z|)^T) (Z: an asymmetric
    group's zero term (8 - z) * scale), the fused tolerance the tests derive (one bfloat16
    rounding of each operand term and of the output). Raises ParameterError ("path")
    otherwise: a kernel that misreads the layout or reads past a row is refused at quantize
    time, with all-zero input it would not have shown."""
    n, k = weight.shape
    x = _trial_input(k, weight.device)
    out = _run_kernel(weight.scheme, kernel, x, weight.group_size).float()          # (3, N)
    w = weight.dequantize(torch.float32)                                            # (N, K)
    expected = x.float() @ w.T
    m = w.abs()
    if weight.scheme == "int4" and not weight.symmetric:
        _, scales, zeros = weight.int4_codes()
        m = m + ((8 - zeros.float()) * scales).repeat_interleave(weight.group_size, 1).abs()
    bound = 2.0 ** -7 * (x.float().abs() @ m.T)
    error = (out - expected).abs()
    if not bool(torch.isfinite(out).all()) or bool((error > bound).any()):
        worst = float(torch.nan_to_num(error / bound.clamp(min=torch.finfo(torch.float32).tiny),
                                       nan=float("inf")).max())
        raise ParameterError(
            f"path='fused': torch's {weight.scheme} kernel on {weight.device.type} disagrees "
            f"with the dequantized ({n}, {k}) weight on a trial product (error up to "
            f"{worst:.3g} x the fused tolerance 2^-7 (|x| @ |W|^T), or not finite): use "
            "path='reference'", "path")


def _prepare_kernel(scheme: str, qdata: dict, device: torch.device) -> dict:
    """The fused kernel's operands, once, in KERNEL_DTYPE.
    int8: codes (N, K) int8 (the stored tensor itself when contiguous and 64-byte aligned)
    and scales (N,). int4 / q4_0: the kernel's packed weight and scales_and_zeros
    (K/g, N, 2), w = (u - 8) * scale + zero (checked numerically in the tests), so
    zero = (8 - z) * scale for a zero point z (computed in float32, where it is exact: a
    small integer times a bfloat16-or-float16 scale, then rounded once to bfloat16 like every
    kernel operand), 0 for symmetric codes."""
    if scheme == "int8":
        return {"codes": _aligned(qdata["codes"].contiguous()),
                "scales": qdata["scales"].to(KERNEL_DTYPE)}
    if scheme == "q4_0":
        codes, scales = _q4_0_codes(qdata["blocks"]), _q4_0_scales(qdata["blocks"])
        zero = torch.zeros_like(scales)
    else:
        codes, scales = unpack_int4(qdata["packed"]), qdata["scales"].float()
        zeros = qdata.get("zeros")
        zero = torch.zeros_like(scales) if zeros is None else (8 - zeros.float()) * scales
    scales_and_zeros = torch.stack([scales.T, zero.T], dim=-1).to(KERNEL_DTYPE).contiguous()
    if device.type == "cuda":
        # tinygemm wants the high nibble first and 8 inner k-tiles (torchao's layout).
        high_first = (codes[:, 0::2] << 4) | codes[:, 1::2]                      # (N, K/2)
        weight = torch._convert_weight_to_int4pack(high_first.contiguous(), 8)
    else:
        weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return {"weight": weight, "scales_and_zeros": scales_and_zeros}


def _run_kernel(scheme: str, kernel: dict, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (M, K) -> (M, N) through the fused kernel."""
    if scheme == "int8":
        return torch._weight_int8pack_mm(x, kernel["codes"], kernel["scales"])
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, kernel["weight"], group_size,
                                         kernel["scales_and_zeros"])
    return torch._weight_int4pack_mm_for_cpu(x, kernel["weight"], group_size,
                                             kernel["scales_and_zeros"])


# ---------------------------------------------------------------------------------------------
# The model transform
# ---------------------------------------------------------------------------------------------

def default_path(scheme: str, shape: tuple[int, int] | None = None,
                 device: str | torch.device = "cpu") -> str:
    """The path `quantize_model` takes when none is given, per weight: "fused" where the
    scheme has a kernel and the kernel's shape rule holds for a (N, K) weight on device
    (`fused_support`; shape None: the rule is not checked), else "reference" (always for
    q8_0)."""
    if scheme == "q8_0":
        return "reference"
    if shape is not None and fused_support(scheme, tuple(shape), device) is not None:
        return "reference"
    return "fused"


def linear_weight_names(model: s06.TorchTransformer) -> tuple[str, ...]:
    """The linear weights of each block `quantize_model` quantizes (by S06's block class)."""
    block = model.blocks[0]
    return LINEAR_WEIGHTS["gpt2" if isinstance(block, s06.GPT2Block) else "qwen3"]


def quantized_weights(model: nn.Module) -> dict[str, QuantizedTensor]:
    """{parameter name: weight} of every quantized parameter (a tied head once)."""
    return {name: p for name, p in model.named_parameters() if isinstance(p, QuantizedTensor)}


def quantize_model(model: s06.TorchTransformer, scheme: str, *, group_size: int | None = None,
                   symmetric: bool = True, quantize_embedding: bool = False,
                   path: str | None = None, scale_dtype: torch.dtype | None = None
                   ) -> s06.TorchTransformer:
    """Quantize S06's model IN PLACE and return it: every block's linear weights
    (`linear_weight_names`) become `QuantizedTensor` Parameters; with quantize_embedding the
    token embedding and the LM head too (a tied head stays one tensor, quantized once).
    Everything else (norms, biases, GPT-2's positions, RoPE tables) is untouched, and so is
    every method of the model: Part I's and Part II's engines run it as they are.

    scheme: "int8" (per channel), "int4" (group_size 32, 64 or 128; symmetric or not),
    "q8_0", "q4_0" (llama.cpp's blocks of 32). path: "fused", "reference" or None: per
    weight, `default_path` (fused where the scheme has a kernel whose shape rule holds for
    that weight, `fused_support`, else the reference: e.g. an int8 weight with K % 16 != 0 on
    the CPU, or a 97-row embedding in int4, runs on the reference path while the rest is
    fused); an explicit "fused" is refused for any weight the rule excludes. scale_dtype:
    int8 / int4's (SCALE_DTYPES), None for the GGUF schemes. The activations' dtype is the
    model's. Every weight is quantized before any is replaced, so a refusal leaves the model
    as it was.
    Afterwards the model cannot change dtype or device: `model.to(torch.bfloat16)`,
    `.half()`, `.double()`, `.cuda()` (on it or any of its modules) raise TypeError before
    anything is converted (each module's `_apply` is guarded on the instance; S06's classes
    are untouched); quantize the model where and in the dtype it will run.
    Raises ParameterError naming the parameter: "model" (not S06's model, or already
    quantized: quantizing twice would quantize codes), "scheme", "group_size" (not one the
    scheme takes, or not dividing a weight's input width K), "symmetric", "path" (not a
    path, q8_0 fused, a shape the fused kernel's rule excludes, or a fused kernel torch
    lacks or gets wrong on the trial product for this device / dtype / shape),
    "quantize_embedding", "scale_dtype", "weight" (a scale its dtype cannot hold)."""
    if not isinstance(model, s06.TorchTransformer):
        raise ParameterError(f"model must be S06's TorchTransformer (got "
                             f"{type(model).__name__})", "model")
    if quantized_weights(model):
        raise ParameterError("model is already quantized: quantize the full-precision model, "
                             "once (load it again)", "model")
    if not isinstance(quantize_embedding, bool):
        raise ParameterError(f"quantize_embedding must be True or False (got "
                             f"{quantize_embedding!r})", "quantize_embedding")
    if not isinstance(scheme, str) or scheme not in SCHEMES:   # before default_path reads it
        _check_scheme(scheme, group_size, symmetric, 0)
    _check_scale_dtype(DEFAULT_SCALE_DTYPE[scheme] if scale_dtype is None
                       and scheme in DEFAULT_SCALE_DTYPE else scale_dtype, scheme)
    if path is not None and path not in PATHS:
        raise ParameterError(f"path must be one of {PATHS} (got {path!r})", "path")
    if path == "fused" and scheme == "q8_0":
        raise ParameterError(f"path='fused': {fused_support(scheme, (1, 32), 'cpu')}; use "
                             "path='reference'", "path")
    names = linear_weight_names(model)
    targets = [(block, name) for block in model.blocks for name in names]
    if quantize_embedding:
        targets.append((model, "embed_tokens"))
        if model.lm_head is not model.embed_tokens:
            targets.append((model, "lm_head"))
    made = []
    for owner, name in targets:
        w = getattr(owner, name)
        made.append(nn.Parameter(QuantizedTensor.from_float(
            w, scheme, group_size=group_size, symmetric=symmetric,
            path=default_path(scheme, tuple(w.shape), w.device) if path is None else path,
            dtype=model.dtype, scale_dtype=scale_dtype), requires_grad=False))
    tied = model.lm_head is model.embed_tokens
    for (owner, name), weight in zip(targets, made):
        setattr(owner, name, weight)
    if tied and quantize_embedding:
        model.lm_head = model.embed_tokens    # one tensor, as S06 keeps a tied head
    for module in model.modules():
        module._apply = _GuardedApply(module)  # an instance attribute: S06's classes untouched
    return model


class _GuardedApply:
    """`nn.Module._apply` for one module of a quantized model (set on the instance by
    `quantize_model`). Every conversion (`.to`, `.half`, `.bfloat16`, `.double`, `.cuda`,
    `.cpu`, ...) goes through `_apply(fn)`, which torch runs child by child, converting
    full-precision parameters as it goes; a QuantizedTensor refuses only when its turn comes,
    after block 0's norms were converted (a half-converted model that still runs). So fn is
    first tried on every quantized weight below this module: a no-op (the dtype and device
    they already have) returns the weight itself and the conversion proceeds; anything else
    raises TypeError here, before any tensor changed. A plain object, so the model still
    pickles (torch.save)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        for name, weight in quantized_weights(self.module).items():
            try:
                fn(weight)
            except TypeError:
                raise TypeError(
                    f"a quantized model cannot change dtype or device ({name} is "
                    f"{weight.describe()} codes for {str(weight.dtype)[6:]} activations on "
                    f"{weight.device}); nothing was converted. Load the model in the dtype "
                    "and on the device it will run on, then quantize_model it") from None
        return type(self.module)._apply(self.module, fn, recurse)


def build_engine(model: s06.TorchTransformer | str | Path, tokenizer=None, *,
                 quantize: str | None = None, group_size: int | None = None,
                 symmetric: bool = True, quantize_embedding: bool = False,
                 path: str | None = None, device: str | None = None, dtype: str | None = None,
                 kv_cache_dtype: str = "auto", kv_scale: float | None = None,
                 **engine_options):
    """S13's engine (paged KV, chunked prefill, prefix caching; engine_options are
    `s13_prefix_caching.build_engine`'s) on a quantized model, its KV pool stored as
    kv_cache_dtype. model: S06's model
    (quantized in place when quantize is given) or a checkpoint directory / hub id (loaded
    with S06's `load` on device, dtype; its tokenizer used when tokenizer is None).
    quantize: None (the model as it is) or a scheme; the other arguments are
    `quantize_model`'s. kv_cache_dtype, kv_scale: code/s14_kv_cache.py's (vLLM's
    `kv_cache_dtype` names: "auto", the model's dtype, is S13's engine exactly; "int8",
    "fp8_e4m3", ...): the engine is `s14_kv_cache.build_engine`'s, which hands S12's
    `paged_engine` its pool maker (make_cache=), so the two transforms compose, weights and
    KV cache, with one assembly. Returns S09's `LLMEngine`. Raises ParameterError as
    `quantize_model`, `s14_kv_cache.build_engine` and S13's `build_engine`; kv_cache_dtype
    and kv_scale are checked before the model is touched (a refusal leaves it unquantized)."""
    if isinstance(model, (str, Path)):
        model, loaded = s06.load(model, device, dtype)
        tokenizer = loaded if tokenizer is None else tokenizer
    spec = s14_kv_cache.check_kv_cache_dtype(kv_cache_dtype, model.device)   # at the door
    s14_kv_cache.check_kv_scale(spec, kv_scale)
    if quantize is not None:
        quantize_model(model, quantize, group_size=group_size, symmetric=symmetric,
                       quantize_embedding=quantize_embedding, path=path)
    return s14_kv_cache.build_engine(model, tokenizer, kv_cache_dtype=kv_cache_dtype,
                                     kv_scale=kv_scale, **engine_options)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorMemory:
    """One parameter's memory: name (S06's), layer (block index, None outside the blocks),
    shape, format ("float32", "bfloat16", or a QuantizedTensor's `describe()`), numel
    (weights), nbytes (as stored: codes + scales + zero points), kernel_nbytes (what a
    product reads per call; the fused kernel's operands)."""

    name: str
    layer: int | None
    shape: tuple[int, ...]
    format: str
    numel: int
    nbytes: int
    kernel_nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel


def model_memory(model: nn.Module) -> list[TensorMemory]:
    """A `TensorMemory` per parameter of the model (a tied head once, as named_parameters
    yields it; buffers such as RoPE tables and the stacked q/k norm, copies the checkpoint
    does not store, are left out). nbytes is the format as stored; a fused int4 / q4_0
    weight also keeps the kernel's repacked copy in memory (its kernel_nbytes), so what it
    holds resident is about twice nbytes (`QuantizedTensor.resident_nbytes`)."""
    rows = []
    for name, p in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if isinstance(p, QuantizedTensor):
            rows.append(TensorMemory(name, layer, tuple(p.shape), p.describe(), p.numel(),
                                     p.quantized_nbytes, p.kernel_nbytes))
        else:
            nbytes = p.numel() * p.element_size()
            rows.append(TensorMemory(name, layer, tuple(p.shape), str(p.dtype)[6:], p.numel(),
                                     nbytes, nbytes))
    return rows


def memory_by_layer(rows: Sequence[TensorMemory]) -> dict[int | None, tuple[int, int]]:
    """{layer (None: outside the blocks): (weights, bytes)}."""
    out: dict[int | None, tuple[int, int]] = {}
    for r in rows:
        numel, nbytes = out.get(r.layer, (0, 0))
        out[r.layer] = (numel + r.numel, nbytes + r.nbytes)
    return out


@dataclass(frozen=True)
class SchemeMemory:
    """One line of the memory table: the scheme, the linear weights' count, bytes and bits
    per weight, and the whole model's bytes (embedding, norms, ... as kept)."""

    scheme: str
    linear_weights: int
    linear_bytes: int
    model_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.linear_bytes / self.linear_weights


def scheme_memory(model: s06.TorchTransformer, label: str) -> SchemeMemory:
    """The memory line of a (quantized or not) model, the linear weights being those
    `quantize_model` quantizes."""
    names = linear_weight_names(model)
    rows = model_memory(model)
    linear = [r for r in rows if r.layer is not None and r.name.split(".")[-1] in names]
    return SchemeMemory(label, sum(r.numel for r in linear), sum(r.nbytes for r in linear),
                        sum(r.nbytes for r in rows))


TABLE_SCHEMES = (("float32", None, {}), ("bfloat16", None, {}), ("int8", "int8", {}),
                 ("int4 g32 sym", "int4", {}), ("int4 g32 asym", "int4", {"symmetric": False}),
                 ("int4 g128 sym", "int4", {"group_size": 128}),
                 ("q8_0", "q8_0", {}), ("q4_0", "q4_0", {}))


def memory_table(model_dir: str | Path = s03.BUNDLED_MODEL_DIR,
                 schemes=TABLE_SCHEMES) -> list[SchemeMemory]:
    """Each scheme's memory line, measured on the model loaded fresh from model_dir (float32
    weights on the CPU; "bfloat16" loaded in bfloat16) and quantized on the reference path
    (the stored format is the same on both paths). A scheme a weight's width does not allow
    (group 128 on K = 64) is skipped."""
    lines = []
    for label, scheme, options in schemes:
        dtype = torch.bfloat16 if label == "bfloat16" else torch.float32
        model = s06.TorchTransformer.from_pretrained(model_dir, "cpu", dtype)
        if scheme is not None:
            try:
                quantize_model(model, scheme, path="reference", **options)
            except ParameterError:
                continue
        lines.append(scheme_memory(model, label))
    return lines


def format_memory_table(lines: Sequence[SchemeMemory]) -> str:
    """The table as text: bytes and bits per weight of the linear layers, the whole model's
    bytes, and each against float32."""
    base = lines[0]
    out = [f"{'scheme':<15}{'linear bytes':>14}{'bits/weight':>13}{'model bytes':>14}"
           f"{'vs float32':>12}"]
    for m in lines:
        out.append(f"{m.scheme:<15}{m.linear_bytes:>14,}{m.bits_per_weight:>13.3f}"
                   f"{m.model_bytes:>14,}{m.model_bytes / base.model_bytes:>11.1%}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# A GEMV, measured (for the benchmark)
# ---------------------------------------------------------------------------------------------

def gemv_timings(shapes: Sequence[tuple[int, int]] = ((4096, 1024), (11008, 4096)),
                 repeats: int = 50, group_size: int = 32, seed: int = 0
                 ) -> dict[tuple[int, int], dict[str, float]]:
    """Median seconds of one batch-1 product x (1, K) @ W^T for each weight shape (N, K), on
    the CPU with the calling thread count, x float32 as a float32 model hands it: "fp32"
    (F.linear, float32 W), "bf16" (F.linear, x and W in bfloat16), "int8 fused", "int4
    fused" (x cast to bfloat16 for the kernel, the output cast back: `QuantizedTensor.linear`),
    "int4 dequant+matmul" (the reference path: dequantize W to float32, then F.linear). The
    variants alternate within each repeat (one of each, in turn), so a change of load hits
    them alike; one warm-up call each first. Weights N(0, 0.02^2), seeded."""
    generator = torch.Generator().manual_seed(seed)
    results = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=generator) * 0.02
        x = torch.randn(1, k, generator=generator)
        w16, x16 = w.bfloat16(), x.bfloat16()
        int8 = QuantizedTensor.from_float(w, "int8", path="fused")
        int4 = QuantizedTensor.from_float(w, "int4", group_size=group_size, path="fused")
        int4_ref = QuantizedTensor.from_float(w, "int4", group_size=group_size,
                                              path="reference")
        variants = {"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(x16, w16),
                    "int8 fused": lambda: F.linear(x, int8),
                    "int4 fused": lambda: F.linear(x, int4),
                    "int4 dequant+matmul": lambda: F.linear(x, int4_ref)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        with torch.inference_mode():
            for run in variants.values():      # warm-up: first-call costs out of the medians
                run()
            for _ in range(repeats):
                for name, run in variants.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
        results[(n, k)] = {name: statistics.median(t) for name, t in times.items()}
    return results


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

# quantize_model's / build_engine's parameter names -> this command line's flags
CLI_FLAGS = {"scheme": "--quantize", "group_size": "--group-size", "symmetric": "--asymmetric",
             "quantize_embedding": "--quantize-embedding", "path": "--path",
             "kv_cache_dtype": "--kv-cache-dtype", "model": "--model", "dtype": "--dtype",
             "device": "--device"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 14: quantization. Runs the model with its linear weights in "
                    "int8, int4, Q8_0 or Q4_0 (and its KV cache in 8 bits with "
                    "--kv-cache-dtype) through S13's engine and prints the memory of every "
                    "scheme.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory or hub id (default: the bundled model)")
    parser.add_argument("--quantize", default="int8", choices=SCHEMES,
                        help="weight format of the linear layers: int8 per channel, int4 "
                             "group-wise, llama.cpp's q8_0 or q4_0 blocks of 32 (default: "
                             "%(default)s)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4: weights per scale, one of 32, 64, 128 (default: 32; int8 "
                             "is per channel, q8_0 / q4_0 blocks are 32)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="int4 with a zero point per group (unsigned codes 0..15)")
    parser.add_argument("--quantize-embedding", action="store_true",
                        help="also quantize the token embedding and the LM head")
    parser.add_argument("--path", default=None, choices=PATHS,
                        help="fused: torch's weight-only kernels; reference: dequantize, then "
                             "matmul (default: fused, reference for q8_0)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                        choices=list(s14_kv_cache.KV_CACHE_DTYPES),
                        help="how the paged KV cache stores keys and values, vLLM's names "
                             f"(code/s14_kv_cache.py), one of "
                             f"{', '.join(s14_kv_cache.KV_CACHE_DTYPES)}: auto = the model's "
                             "dtype; int8 and fp8_per_token_head with a scale per token and kv "
                             "head; fp8 = fp8_e4m3 with one scale per layer (default: "
                             "%(default)s)")
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default=None, choices=list(s06.DTYPES),
                        help="activation dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--prompt", default="Romeo.\n", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=40,
                        help="most tokens to generate, greedy (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 1 to the logical cores (%d) (default: "
                             "%%(default)s, as S06)" % (os.cpu_count() or 1))
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if not 1 <= args.threads <= cores:
        parser.error(f"--threads must be an integer in [1, {cores}] (got {args.threads})")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be an integer >= 1 (got {args.max_tokens})")
    try:
        s01.check_text(args.prompt, "--prompt")
    except ValueError as err:
        parser.error(str(err))
    # the flags' own rules, before the model is loaded
    if args.group_size is not None:
        if args.quantize == "int8":
            parser.error("--group-size does not apply to --quantize int8 (one scale per "
                         "output channel)")
        allowed = GROUP_SIZES if args.quantize == "int4" else (s14_gguf.QK,)
        if args.group_size not in allowed:
            parser.error(f"--group-size must be one of {', '.join(map(str, allowed))} for "
                         f"--quantize {args.quantize} (got {args.group_size})")
    if args.asymmetric and args.quantize != "int4":
        parser.error(f"--asymmetric needs --quantize int4 ({args.quantize} is symmetric only)")
    torch.set_num_threads(args.threads)
    bundled = s03.BUNDLED_MODEL_DIR
    if Path(args.model) == bundled and not (bundled / "config.json").exists():
        parser.error(f"the bundled model is not in {bundled} yet: train it with "
                     "python scripts/train_bundled_model.py, or pass --model DIR")
    from s09_llm import LLM
    try:
        model, tokenizer = s06.load(args.model, args.device, args.dtype)
        # S13's engine, one request: the weights quantized in place, then the pool in
        # --kv-cache-dtype (both checked before the model is touched).
        engine = build_engine(model, tokenizer, quantize=args.quantize,
                              group_size=args.group_size, symmetric=not args.asymmetric,
                              quantize_embedding=args.quantize_embedding, path=args.path,
                              kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=1,
                              max_context=min(model.config.max_position_embeddings, 4096))
        start = time.perf_counter()
        completion = LLM(engine).generate(args.prompt, s04.SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens))
        elapsed = time.perf_counter() - start
        lines = memory_table(args.model) if Path(args.model).is_dir() else []
        if lines:      # the table's schemes keep the embedding; this run as it was asked
            lines.append(scheme_memory(model, "this run, +emb" if args.quantize_embedding
                                       else "this run"))
    except ValueError as err:
        flag = CLI_FLAGS.get(getattr(err, "parameter", None))
        parser.error(f"argument {flag}: {err}" if flag else str(err))
    weights = quantized_weights(model)
    first = next(iter(weights.values()))
    paths = [w.path for w in weights.values()]
    shown = (f"{paths[0]} path" if len(set(paths)) == 1 else
             f"fused path for {paths.count('fused')}, reference for "
             f"{paths.count('reference')}: the fused kernel's shape rule")
    config = s14_kv_cache.model_config(model)
    print(f"{model.config.model_type}, {len(weights)} weights in {first.describe()} "
          f"({shown}), activations {str(model.dtype)[6:]} on {model.device}")
    print(f"KV cache {args.kv_cache_dtype}: "
          f"{s14_kv_cache.kv_cache_bytes_per_token(config, args.kv_cache_dtype):,} bytes per "
          f"token ({s14_kv_cache.kv_cache_bytes_per_token(config, 'auto'):,} in "
          f"{str(model.dtype)[6:]}); engine: S13's, through s14_quantization.build_engine")
    print("--- prompt ---\n" + args.prompt)
    print("--- completion (greedy) ---\n" + completion.text)
    print(f"--- {len(completion.token_ids)} tokens in {elapsed:.2f} s, finish_reason="
          f"{completion.finish_reason} ---")
    if lines:
        print("\nMemory of the weights as stored (bytes; bits per weight of the linear "
              "layers, scales and zero points included; the embedding and norms as kept):")
        print(format_memory_table(lines))


if __name__ == "__main__":
    sys.exit(main())
