"""S14, an 8-bit KV cache: S12's paged pool storing keys and values in one byte each.

What is new since S13
    Weight quantization (code/s14_quantization.py) makes each decode step read fewer weight
    bytes; this module makes each cached token take fewer bytes, so the same pool holds more
    tokens (more requests at once, or longer ones). The pool keeps S12's layout and its block
    tables; only what a slot holds changes.

    - `KV_CACHE_DTYPES`, vLLM's `kv_cache_dtype` names (vllm/config/cache.py `CacheDType`):
      "auto" (the model's dtype: S12's `PagedKVCache` itself); "bfloat16" / "float16" (a cast,
      no scale); "fp8" = "fp8_e4m3" (float8_e4m3fn codes, one scale per layer for K and one
      for V, 1.0 unless given: vLLM's default k_scale = v_scale = 1.0 without calibration);
      "fp8_per_token_head" (e4m3 codes, a float32 scale per (token, kv head): absmax / 448);
      "int8" = "int8_per_token_head" (symmetric int8, a float32 scale per (token, kv head):
      absmax / 127).
    - `quantize_kv` / `dequantize_kv`: the two directions, in float32.
    - `QuantizedPagedKVCache`: S12's `PagedKVCache` interface (slot_mapping, write, gather,
      zero_blocks, nbytes): `write` quantizes the step's K and V into the slots, `gather`
      dequantizes only the blocks it reads to the model's dtype, so S12's `PagedRunner` and its
      attention run unchanged.
    - `build_engine(..., kv_cache_dtype="int8")`: S13's engine (prefix caching as S13 decides)
      over this pool; "auto" is S13's engine exactly. fp8 is refused where the device has no
      fp8 (`check_kv_cache_dtype`).
    - `kv_cache_bytes_per_token`, `pool_tokens`: bytes a token takes with its scales, and the
      tokens a pool of a given byte budget holds, for every dtype.
    - `prefill_logits(model, token_ids, kv_cache_dtype)`: every position's logits of one prompt
      prefilled through a quantized pool (the evaluator's hook for perplexity).
    - `kv_roundtrip_error`: the error of each choice on a model's real K and V.

Which scale (measured on the bundled model, 240 and 256 tokens of Shakespeare, 1 thread)
    e4m3 keeps 3 mantissa bits over exponents 2^-6 .. 2^8 (max 448), so a value in that normal
    range comes back within 2^-4 of itself, relative, whatever the scale: a scale only moves
    the window. The bundled model's keys reach |5.2| and its values |2.7|, far below 448, so
    vLLM's fixed scale of 1.0 never overflows here; 1.4-8 % of the values fall under 2^-6
    (subnormal, steps of 2^-9) and 0.17 % flush to 0 (absolute error <= 2^-10). Round trip of
    K and V, relative RMS error (`python code/s14_kv_cache.py`):

        fp8_e4m3, scale 1.0 (vLLM's default)       2.65e-2   768 bytes/token
        fp8_e4m3, scale absmax/448 (calibrated)    2.65e-2   768
        fp8_per_token_head                         2.3e-2    864
        int8 (per token and kv head)               0.6e-2    864

    Through the engine (logits of 256 held-out tokens against the fp32 pool): int8 KL 1.9e-5,
    same top-1 99.6 %, perplexity +0.015 %; fp8_e4m3 KL 9.6e-4, 98.4 %, +0.21 %;
    fp8_per_token_head KL 5.2e-4, 96.9 %, -0.05 %. Greedy tokens of 8 requests x 48 equal to
    the fp32 pool's at 100 % of positions (int8), 80 % (fp8_e4m3), 91 % (per token head).
    The choice: calibrating fp8's per-tensor scale buys nothing measurable (the 3-bit mantissa
    sets the error, not the window), so "fp8_e4m3" keeps vLLM's per-tensor 1.0 and exactly
    half of bf16's bytes; a per-row scale buys about 10 % on the round trip for 12.5 % more
    bytes (4 per 32 values at this D; 3 % at D = 128). For the same 864 bytes, int8 with a
    scale per (token, kv head) (llama.cpp's q8_0 idea, per row instead of per 32) is 4x more
    exact, as K and V rows have no outliers that would waste its uniform steps: int8 is this
    chapter's 8-bit KV; fp8 is what a GPU with fp8 attention kernels reads without a
    dequantize step (not this course's CPU gather).

What it does not handle
    The gather dequantizes each read into a new tensor of the model's dtype (a fused kernel
    reads the codes in place: vLLM's FlashAttention-3 fp8 path; S17's kernels read float
    pools only). No calibration run: a per-tensor scale is given by hand (kv_scale). No e5m2,
    no 4-bit KV, no per-channel key scales (KIVI's).

Run it
    python code/s14_kv_cache.py            # bytes per token, tokens per budget, error table

Tests
    tests/test_s14_kv_cache.py.

References
    vLLM: `CacheConfig.cache_dtype` (vllm/config/cache.py), `get_kv_quant_mode` (per-tensor
    fp8 vs "*_per_token_head" with float32 scales), the quantized KV cache docs
    (docs/features/quantization/quantized_kvcache.md: scales 1.0 uncalibrated), and the
    saturating e4m3 conversion of its cache kernels (`__NV_SATFINITE`). llama.cpp's q8_0 KV
    cache type (ggml-quants.c `quantize_row_q8_0_ref`: d = amax / 127, an fp16 d per 32
    values). Micikevicius et al., "FP8 Formats for Deep Learning" (2022) for e4m3. Hooper et
    al., "KVQuant" (2024) and Liu et al., "KIVI" (2024) for finer KV scales.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import numpy as np
import torch

import s01_generation_loop as s01
import s06_torch as s06
import s09_continuous_batching as s09
from s01_generation_loop import ParameterError
from s09_ragged import RaggedBatch, allocate_kv
from s12_engine import PagedKVCache, PagedRunner, paged_engine
from s12_kv_budget import kv_bytes_per_token, load_config
from s12_paged_attention import CacheConfig, cdiv, check_pool_sizes
from s13_prefix_caching import kv_manager_class

SCALE_BYTES = 4         # a float32 scale per (token, kv head), for K and again for V


@dataclass(frozen=True)
class KVCacheSpec:
    """How one kv_cache_dtype stores a value: code_dtype (the pool's element type),
    granularity ("per_tensor": one scale per layer for K and one for V, none per token;
    "per_token_head": a float32 scale per (token, kv head), absmax / qmax), qmax (the largest
    code: 448 for e4m3, 127 for int8, the float's max for a cast)."""

    name: str
    code_dtype: torch.dtype
    granularity: str
    qmax: float

    @property
    def code_bytes(self) -> int:
        return torch.empty((), dtype=self.code_dtype).element_size()

    @property
    def is_fp8(self) -> bool:
        return self.code_dtype == torch.float8_e4m3fn


_E4M3 = torch.float8_e4m3fn
KV_CACHE_DTYPES: dict[str, KVCacheSpec | None] = {
    "auto": None,                                    # the model's dtype: S12's pool
    "bfloat16": KVCacheSpec("bfloat16", torch.bfloat16, "per_tensor",
                            torch.finfo(torch.bfloat16).max),
    "float16": KVCacheSpec("float16", torch.float16, "per_tensor", torch.finfo(torch.float16).max),
    "fp8": KVCacheSpec("fp8_e4m3", _E4M3, "per_tensor", torch.finfo(_E4M3).max),
    "fp8_e4m3": KVCacheSpec("fp8_e4m3", _E4M3, "per_tensor", torch.finfo(_E4M3).max),
    "fp8_per_token_head": KVCacheSpec("fp8_per_token_head", _E4M3, "per_token_head",
                                      torch.finfo(_E4M3).max),
    "int8": KVCacheSpec("int8", torch.int8, "per_token_head", 127.0),
    "int8_per_token_head": KVCacheSpec("int8", torch.int8, "per_token_head", 127.0),
}
# Codes move as integers of their own width (CPU torch has no index_copy_ for float8):
# 1-byte codes (e4m3, int8) as uint8, 2-byte ones (bfloat16, float16) as int16.
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16}
MIN_FP8_CAPABILITY = (8, 9)      # Ada (sm_89) and Hopper (sm_90) convert to e4m3 in hardware


# ---------------------------------------------------------------------------------------------
# The door: which dtype, on which device
# ---------------------------------------------------------------------------------------------

def fp8_support(device: str | torch.device, capability: tuple[int, int] | None = None
                ) -> str | None:
    """None when the device can store e4m3 codes, else why not (one phrase). CPU: torch's
    float8_e4m3fn casts there (torch >= 2.1). CUDA: compute capability >= 8.9 (Ada, Hopper:
    the `cvt.rn.satfinite.e4m3x2.f32` conversion; below it torch would convert in software,
    correct but slow, and this course refuses rather than run a slow path silently);
    capability: (major, minor) to judge instead of asking the device (a test of the rule
    without such a GPU). Anything else (mps, xpu, ...): no."""
    device = torch.device(device)
    if not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no float8_e4m3fn"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        major, minor = capability or torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_FP8_CAPABILITY:
            return (f"{device} has compute capability {major}.{minor}, fp8 needs "
                    f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]} or later (Ada, Hopper)")
        return None
    return f"fp8 is not supported on {device.type} here"


def check_kv_cache_dtype(kv_cache_dtype: str, device: str | torch.device = "cpu",
                         capability: tuple[int, int] | None = None) -> KVCacheSpec | None:
    """The `KVCacheSpec` of kv_cache_dtype (None for "auto"), checked once at the door.
    Raises ParameterError naming kv_cache_dtype: a name not in KV_CACHE_DTYPES, or an fp8
    one on a device without fp8 (`fp8_support`; capability as there)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ParameterError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (got "
                             f"{kv_cache_dtype!r})", "kv_cache_dtype", kv_cache_dtype)
    spec = KV_CACHE_DTYPES[kv_cache_dtype]
    if spec is not None and spec.is_fp8:
        why = fp8_support(device, capability)
        if why is not None:
            raise ParameterError(f"kv_cache_dtype={kv_cache_dtype!r} needs fp8 on the device: "
                                 f"{why}; use kv_cache_dtype='int8' instead",
                                 "kv_cache_dtype", kv_cache_dtype)
    return spec


# kv_scale's range: the pool stores it in float32, and a code of 448 times it must stay finite
KV_SCALE_MIN = float(torch.finfo(torch.float32).tiny)                  # 2^-126, about 1.2e-38
KV_SCALE_MAX = float(torch.finfo(torch.float32).max) / float(torch.finfo(_E4M3).max)  # 7.6e35


def check_kv_scale(spec: KVCacheSpec | None, kv_scale: float | None) -> float:
    """The per-tensor scale to use, as the pool stores it (float32): kv_scale rounded to
    float32, or 1.0 (vLLM's uncalibrated default) when None. The value is checked after that
    rounding, so what passes is what is stored. Raises ParameterError naming kv_scale: not a
    real number; not, as float32, a normal number in [KV_SCALE_MIN, KV_SCALE_MAX] (2^-126 ..
    FLT_MAX / 448, about 1.2e-38 .. 7.6e35: 1e39 would be float32 inf, 1e-46 would be 0, and
    above the top 448 x kv_scale, a saturated code dequantized, overflows); or given for a
    dtype whose scales are not per tensor (they are computed per row, or there are none)."""
    if kv_scale is None:
        return 1.0
    if spec is None or not spec.is_fp8 or spec.granularity != "per_tensor":
        raise ParameterError("kv_scale is the per-tensor scale of kv_cache_dtype 'fp8' / "
                             f"'fp8_e4m3' only (got it with "
                             f"{spec.name if spec else 'auto'!r})", "kv_scale", kv_scale)
    with np.errstate(over="ignore"):               # 1e39 becomes inf: refused below
        stored = float(np.float32(kv_scale)) if s01.is_real(kv_scale) else math.nan
    if not math.isfinite(stored) or not KV_SCALE_MIN <= stored <= KV_SCALE_MAX:
        raise ParameterError(f"kv_scale must be a finite number > 0, in [{KV_SCALE_MIN:.3g}, "
                             f"{KV_SCALE_MAX:.3g}] once stored as float32 (got {kv_scale!r}"
                             + ("" if not s01.is_real(kv_scale) or stored == kv_scale
                                or math.isnan(stored)
                                else f", {stored!r} in float32") + ")", "kv_scale", kv_scale)
    return stored


# ---------------------------------------------------------------------------------------------
# Quantize and dequantize
# ---------------------------------------------------------------------------------------------

def quantize_kv(x: torch.Tensor, spec: KVCacheSpec, scale: float | torch.Tensor = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) of any float dtype -> (codes (..., D) of spec.code_dtype, scales float32).

    per_token_head: scales (...,) = absmax over D / qmax (a row of zeros gets scale 0 and
    codes 0, no division by zero); codes = x / scale, rounded to nearest (int8: half away from
    zero is not used, torch.round is half to even) and clamped to [-qmax, qmax]. per_tensor:
    the given scale (a float or a 0-d tensor), returned as a 0-d tensor; codes = x / scale
    clamped to [-qmax, qmax] then cast (e4m3: round to nearest even; the clamp is vLLM's
    saturating conversion, __NV_SATFINITE, so a value past 448 x scale stores +-448, never
    NaN). The bound: int8 |x - code x scale| <= scale / 2; e4m3 relative 2^-4 for
    |x| / scale in [2^-6, 448], absolute 2^-10 x scale below."""
    x32 = x.float()
    if spec.granularity == "per_token_head":
        scales = x32.abs().amax(-1) / spec.qmax                                    # (...,)
        y = x32 / torch.where(scales > 0, scales, 1.0)[..., None]
    else:
        scales = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        y = x32 / scales
    y = y.clamp(-spec.qmax, spec.qmax)
    if spec.code_dtype == torch.int8:
        y = y.round()
    return y.to(spec.code_dtype), scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                  ) -> torch.Tensor:
    """codes (..., D), scales (...,) per row or 0-d per tensor -> codes x scale (..., D) in
    dtype, the product taken in float32."""
    s = scales[..., None] if scales.dim() else scales
    return (codes.float() * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------

class QuantizedPagedKVCache(PagedKVCache):
    """S12's pool with K and V stored as codes of kv_cache_dtype and their scales.

    k, v: codes (L, num_blocks, block_size, Hkv, D) of the spec's code_dtype, zeroed.
    k_scale, v_scale: float32, (L, num_blocks, block_size, Hkv) for per_token_head, or (L,)
    per tensor (every layer kv_scale, default 1.0, vLLM's `_k_scale` / `_v_scale`). dtype:
    the compute dtype `gather` returns (the model's). The interface is `PagedKVCache`'s, so
    `PagedRunner` runs on it unchanged: `write(layer, slots, k, v)` quantizes, `gather(layer,
    tables, length)` dequantizes what it reads, `zero_blocks` clears codes and scales.
    nbytes counts codes and scales. Writes move the codes through an integer view of their
    width (uint8 for 1-byte codes, int16 for bfloat16 / float16: CPU torch has no index_copy_
    for float8). Raises ValueError / ParameterError as `PagedKVCache` does, and
    ParameterError naming kv_cache_dtype ("auto" is S12's `PagedKVCache`; unknown; fp8 on a
    device without it) or kv_scale (`check_kv_scale`).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, max_seq_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", sized_by: str = "num_blocks", *,
                 kv_cache_dtype: str = "int8", kv_scale: float | None = None,
                 capability: tuple[int, int] | None = None):
        spec = check_kv_cache_dtype(kv_cache_dtype, device, capability)
        if spec is None:
            raise ParameterError("kv_cache_dtype='auto' stores the model's dtype: that pool is "
                                 "S12's PagedKVCache", "kv_cache_dtype", kv_cache_dtype)
        scale = check_kv_scale(spec, kv_scale)
        check_pool_sizes(num_blocks, block_size)
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_seq_len", max_seq_len)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        self.spec, self.dtype = spec, dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        fix = "use fewer num_blocks or a smaller block_size"
        self.k, self.v = allocate_kv(shape, spec.code_dtype, device, "KV pool",
                                     sized_by, fix)               # (L, blocks, bs, Hkv, D)
        if spec.granularity == "per_token_head":
            self.k_scale, self.v_scale = allocate_kv(shape[:-1], torch.float32, device,
                                                     "KV pool's scales", sized_by, fix)
        else:
            self.k_scale, self.v_scale = (torch.full((num_layers,), scale, dtype=torch.float32,
                                                     device=device) for _ in range(2))
        self.block_size, self.max_seq_len = int(block_size), int(max_seq_len)

    @classmethod
    def for_model(cls, model: s06.TorchTransformer, num_blocks: int, block_size: int,
                  max_seq_len: int, sized_by: str = "num_blocks", *,
                  kv_cache_dtype: str = "int8", kv_scale: float | None = None
                  ) -> "QuantizedPagedKVCache":
        """The pool for this model's layers, KV heads, head dim, dtype and device."""
        cfg = model.config
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                   cfg.head_dim, max_seq_len, model.dtype, model.device, sized_by,
                   kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)

    @property
    def per_token_head(self) -> bool:
        return self.spec.granularity == "per_token_head"

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.numel() * self.k_scale.element_size()
        return 2 * (self.k.numel() * self.k.element_size() + scales)

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the codes (and per-row scales) of these blocks in every layer: code 0 is 0.0
        in int8 and in e4m3, so a masked read of a fresh block meets zeros, never stale NaN."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.k.device)
        for codes in (self.k, self.v):
            codes.view(torch.uint8).index_fill_(1, ids, 0)
        if self.per_token_head:
            self.k_scale.index_fill_(1, ids, 0)
            self.v_scale.index_fill_(1, ids, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """k, v (Hkv, N, D) in the model's dtype, quantized, to the slots (int64 (N,)) of the
        layer's pool; per_token_head writes each row's scale to the same slot."""
        raw = _RAW_DTYPES[self.spec.code_bytes]       # an integer dtype of the code's width
        for codes, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            n_kv, d = codes.shape[-2:]
            q, s = quantize_kv(new.transpose(0, 1), self.spec,
                               scales[layer])                    # (N, Hkv, D), (N, Hkv)
            codes[layer].view(raw).view(-1, n_kv, d).index_copy_(0, slots, q.view(raw))
            if self.per_token_head:
                scales[layer].view(-1, n_kv).index_copy_(0, slots, s)

    def gather(self, layer: int, tables: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """S12's gather (positions 0 .. length - 1 of each table's request, two (B, Hkv,
        length, D) tensors, past a request's own positions whatever its blocks hold, masked
        by the caller), dequantized to the pool's dtype: only the blocks read are."""
        n = cdiv(length, self.block_size)
        ids = tables[:, :n].reshape(-1)                                           # (B n,)
        _, num_blocks, bs, n_kv, d = self.k.shape
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            blocks = (codes[layer].view(torch.uint8).view(num_blocks, -1).index_select(0, ids)
                      .view(self.spec.code_dtype)
                      .view(len(tables), n * bs, n_kv, d)[:, :length])    # (B, S, Hkv, D)
            if self.per_token_head:
                s = (scales[layer].view(num_blocks, -1).index_select(0, ids)
                     .view(len(tables), n * bs, n_kv)[:, :length])        # (B, S, Hkv)
            else:
                s = scales[layer]
            out.append(dequantize_kv(blocks, s, self.dtype).transpose(1, 2))  # (B, Hkv, S, D)
        return out[0], out[1]


def make_kv_cache(kv_cache_dtype: str = "auto", kv_scale: float | None = None):
    """The pool factory S12's `paged_engine` calls, (model, num_blocks, block_size,
    max_seq_len, sized_by) -> pool: `PagedKVCache.for_model` for "auto", else
    `QuantizedPagedKVCache.for_model` with this dtype and scale."""
    if kv_cache_dtype == "auto":
        check_kv_scale(None, kv_scale)
        return PagedKVCache.for_model
    return partial(QuantizedPagedKVCache.for_model, kv_cache_dtype=kv_cache_dtype,
                   kv_scale=kv_scale)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

def build_engine(model: s06.TorchTransformer, tokenizer, *, kv_cache_dtype: str = "auto",
                 kv_scale: float | None = None, enable_prefix_caching: bool | None = None,
                 block_size: int = 16, num_blocks: int | None = None,
                 enable_kv_cache_events: bool = False,
                 max_num_batched_tokens: int | None = None, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, **options) -> s09.LLMEngine:
    """S13's engine with its KV pool stored as kv_cache_dtype (see KV_CACHE_DTYPES; vLLM's
    option of the same name). "auto": S13's engine exactly (S12's pool in the model's
    dtype). kv_scale: the per-tensor scale of "fp8" / "fp8_e4m3" (default 1.0). The other
    arguments are S13's (enable_prefix_caching) and S12's (the pool, the scheduler) and S09's
    `EngineConfig` fields. num_blocks counts blocks as before: a quantized block takes fewer
    bytes (`pool_tokens` for a byte budget). Raises ParameterError naming the option:
    kv_cache_dtype unknown or fp8 on a device without it, kv_scale, and S13's and S12's."""
    check_kv_cache_dtype(kv_cache_dtype, model.device)        # at the door, before anything
    make_cache = make_kv_cache(kv_cache_dtype, kv_scale)
    manager = kv_manager_class(enable_prefix_caching, options.get("batch_invariant", False))
    return paged_engine(model, tokenizer, manager,
                        CacheConfig(block_size, num_blocks, enable_kv_cache_events),
                        max_num_batched_tokens, policy, long_prefill_token_threshold, options,
                        make_cache)


# ---------------------------------------------------------------------------------------------
# Bytes and capacity
# ---------------------------------------------------------------------------------------------

def kv_cache_bytes_per_token(config, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V take in every layer with kv_cache_dtype, scales included:
    2 x L x Hkv x (D x code bytes + 4 for a per_token_head float32 scale). "auto" and plain
    dtypes ("float32", "bfloat16", ...) as S12's `kv_bytes_per_token`. Per-tensor scales (8
    bytes per layer) are not per token. config: as S12's `load_config`. Llama-3.1-8B
    (L 32, Hkv 8, D 128): bf16 131,072; fp8_e4m3 65,536; int8 2 x 32 x 8 x 132 = 67,584.
    Raises ParameterError naming kv_cache_dtype for an unknown name."""
    spec = KV_CACHE_DTYPES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if spec is None:                      # "auto", or a plain dtype S12 knows
        try:
            return kv_bytes_per_token(config, kv_cache_dtype)
        except ParameterError as err:
            if err.parameter != "kv_dtype":
                raise
            raise ParameterError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} or "
                                 f"a dtype name such as 'float32' (got {kv_cache_dtype!r})",
                                 "kv_cache_dtype", kv_cache_dtype) from None
    cfg = load_config(config)
    codes = kv_bytes_per_token(cfg, "int8") * spec.code_bytes       # 2 L Hkv D x code bytes
    if spec.granularity != "per_token_head":
        return codes
    layers, kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or cfg[
        "num_attention_heads"]
    return codes + 2 * layers * kv_heads * SCALE_BYTES


def pool_tokens(config, kv_cache_dtype: str, budget_bytes: int, block_size: int = 16) -> int:
    """Token positions a pool of budget_bytes holds: num_blocks = budget // (bytes per token x
    block_size) blocks, block 0 the null block, so (num_blocks - 1) x block_size (S12's count;
    0 when fewer than 2 blocks fit). Raises ParameterError naming budget_bytes or block_size
    for one that is not an integer >= 1, and as `kv_cache_bytes_per_token`."""
    for name, value in (("budget_bytes", budget_bytes), ("block_size", block_size)):
        if not s01.is_int(value) or value < 1:
            raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})", name, value)
    num_blocks = budget_bytes // (kv_cache_bytes_per_token(config, kv_cache_dtype) * block_size)
    return max(num_blocks - 1, 0) * block_size


# ---------------------------------------------------------------------------------------------
# Quality hooks: a prompt through a quantized pool, and the round-trip error of K and V
# ---------------------------------------------------------------------------------------------

def _check_prompt(model: s06.TorchTransformer, token_ids) -> list[int]:
    """token_ids as a list of Python ints: a sequence, NumPy array or 1-D torch tensor of
    integers (not bool, not float), 1 to max_position_embeddings of them, each in [0, V).
    Raises ParameterError ("token_ids")."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype == bool \
                or not np.issubdtype(token_ids.dtype, np.integer):
            raise ParameterError(f"token_ids must be a 1-D sequence of integer token ids "
                                 f"(got an array of {token_ids.dtype}, shape "
                                 f"{token_ids.shape})", "token_ids")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ParameterError(f"token_ids must be a sequence of integer token ids (got "
                             f"{type(token_ids).__name__})", "token_ids")
    ids = list(token_ids)
    window, vocab = model.config.max_position_embeddings, model.config.vocab_size
    if not 1 <= len(ids) <= window:
        raise ParameterError(f"token_ids must hold 1 to max_position_embeddings={window} "
                             f"tokens (got {len(ids)})", "token_ids")
    bad = next((t for t in ids if not s01.is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ParameterError(f"token_ids must be integers in [0, V={vocab}) (got {bad!r})",
                             "token_ids")
    return [int(t) for t in ids]


@torch.inference_mode()
def prefill_logits(model: s06.TorchTransformer, token_ids: Sequence[int],
                   kv_cache_dtype: str = "auto", kv_scale: float | None = None,
                   block_size: int = 16) -> torch.Tensor:
    """The logits float32 (T, V) of every position of token_ids (T >= 1), the prompt
    prefilled in one pass by S12's `PagedRunner` over a pool of kv_cache_dtype: each layer
    writes the prompt's K and V into the pool and attends over what it reads back, so the
    quantization error is in every position's logits as in the engine (row t predicts token
    t + 1: perplexity is exp of the mean cross-entropy of rows 0 .. T - 2 against tokens 1 ..
    T - 1). "auto" is S12's pool in the model's dtype (S06's logits, up to the matmul shapes).
    token_ids: 1 to max_position_embeddings integer ids in [0, V) (a list, NumPy array or
    1-D tensor). Raises ParameterError naming the parameter: "token_ids" (empty, too long,
    not integers, outside [0, V)), "block_size" (not an integer >= 1), and as
    `check_kv_cache_dtype` / `check_kv_scale`."""
    ids = _check_prompt(model, token_ids)
    if not s01.is_int(block_size) or block_size < 1:
        raise ParameterError(f"block_size must be an integer >= 1 (got {block_size!r})",
                             "block_size", block_size)
    num_blocks = cdiv(len(ids), block_size) + 1                         # the null block too
    cache = make_kv_cache(kv_cache_dtype, kv_scale)(model, num_blocks, block_size, len(ids),
                                                    "num_blocks")
    runner = PagedRunner(model, cache)
    batch = RaggedBatch.build([ids], [0], [list(range(1, num_blocks))], device=model.device)
    every_row = torch.arange(len(ids), device=model.device)
    return runner.forward(RaggedBatch(**{**batch.__dict__, "sample_rows": every_row}))


@dataclass(frozen=True)
class RoundTripError:
    """K and V of one model and prompt through quantize / dequantize: kv_cache_dtype,
    kv_scale (per tensor; None per row); rel_rms_k, rel_rms_v: ||x - x^|| / ||x|| over every
    layer; max_abs_k, max_abs_v: the largest |x - x^|; flushed: the share of nonzero values
    that came back 0 (underflow); bytes_per_token."""

    kv_cache_dtype: str
    kv_scale: float | None
    rel_rms_k: float
    rel_rms_v: float
    max_abs_k: float
    max_abs_v: float
    flushed: float
    bytes_per_token: int


@torch.inference_mode()
def model_kv(model: s06.TorchTransformer, token_ids: Sequence[int]
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V (Hkv, T, D) of a prompt run through S06's layers in the model's
    dtype (no quantization anywhere): the values a KV cache is asked to store. Raises
    ParameterError ("token_ids") as `prefill_logits`."""
    import s08_static_batching as s08
    ids = torch.tensor(_check_prompt(model, token_ids), dtype=torch.int64, device=model.device)
    x, cos, sin = s08.embed(model, ids, torch.arange(len(ids), device=model.device))
    out = []
    for block in model.blocks:
        q, k, v = block.qkv(x, cos, sin)
        out.append((k, v))
        x = block.finish(x, s06.attention(q, k, v, 0, block.scale, model.attention_impl))
    return out


def kv_roundtrip_error(model: s06.TorchTransformer, token_ids: Sequence[int],
                       kv_cache_dtype: str, kv_scale: float | None = None) -> RoundTripError:
    """The round-trip error of the model's own K and V for this prompt (`model_kv`) through
    kv_cache_dtype's quantizer (see `RoundTripError`). Raises as `check_kv_cache_dtype`,
    `check_kv_scale` and `model_kv`."""
    spec = check_kv_cache_dtype(kv_cache_dtype, model.device)
    if spec is None:
        raise ParameterError("kv_cache_dtype='auto' stores the model's values exactly: no "
                             "round trip to measure", "kv_cache_dtype", kv_cache_dtype)
    scale = check_kv_scale(spec, kv_scale)
    sums = {"k": [0.0, 0.0, 0.0], "v": [0.0, 0.0, 0.0]}         # err^2, x^2, max |err|
    nonzero = flushed = 0
    for k, v in model_kv(model, token_ids):
        for name, x in (("k", k.float()), ("v", v.float())):
            back = dequantize_kv(*quantize_kv(x, spec, scale), torch.float32)
            err = x - back
            acc = sums[name]
            acc[0] += float((err ** 2).sum())
            acc[1] += float((x ** 2).sum())
            acc[2] = max(acc[2], float(err.abs().max()))
            nonzero += int((x != 0).sum())
            flushed += int(((x != 0) & (back == 0)).sum())
    return RoundTripError(kv_cache_dtype, scale if spec.granularity == "per_tensor" else None,
                          math.sqrt(sums["k"][0] / sums["k"][1]),
                          math.sqrt(sums["v"][0] / sums["v"][1]), sums["k"][2], sums["v"][2],
                          flushed / nonzero, kv_cache_bytes_per_token(model_config(model),
                                                                      kv_cache_dtype))


def model_config(model: s06.TorchTransformer) -> dict:
    """The fields `kv_cache_bytes_per_token` reads, from a loaded model's config, the dtype
    as the model holds it."""
    cfg = model.config
    return {"num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads":
            cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "torch_dtype": str(model.dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    import os

    import s03_transformer as s03
    import s08_cli
    parser = argparse.ArgumentParser(description="Chapter 14: an 8-bit KV cache, its bytes and "
                                                 "its error on the bundled model.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--budget-mib", type=float, default=1.0,
                        help="the pool's byte budget for the capacity table, in MiB, > 0 "
                             "(default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=240,
                        help="prompt tokens measured, 1 to the model's max_position_embeddings "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 1 to the logical cores (%d) (default: "
                             "%%(default)s, as S06)" % (os.cpu_count() or 1))
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)                 # --threads
    if not (math.isfinite(args.budget_mib) and args.budget_mib > 0):
        parser.error(f"--budget-mib must be a number > 0 (got {args.budget_mib})")
    if args.tokens < 1:
        parser.error(f"--tokens must be an integer >= 1 (got {args.tokens})")
    torch.set_num_threads(args.threads)
    try:
        model, tokenizer = s06.load(args.model)
    except ValueError as err:
        parser.error(str(err))
    window = model.config.max_position_embeddings
    if args.tokens > window:
        parser.error(f"--tokens must be an integer in [1, {window}] (the model's "
                     f"max_position_embeddings; got {args.tokens})")
    cfg = model_config(model)
    budget = int(args.budget_mib * 2**20)
    print(f"{'kv_cache_dtype':<20} {'bytes/token':>11} {'tokens in ' + str(args.budget_mib):>14}"
          " MiB")
    for name in ("float32", "bfloat16", "fp8_e4m3", "fp8_per_token_head", "int8"):
        print(f"{name:<20} {kv_cache_bytes_per_token(cfg, name):>11,} "
              f"{pool_tokens(cfg, name, budget):>14,}")
    text = (s03.ROOT / "data" / "shakespeare.txt").read_text()[5000:20000]
    ids = tokenizer.encode(text)[:args.tokens]
    amax = max(float(t.abs().max()) for kv in model_kv(model, ids) for t in kv)
    print(f"\nround trip of the model's K and V over {len(ids)} tokens (absmax {amax:.3g})")
    print(f"{'kv_cache_dtype':<20} {'kv_scale':>9} {'rel rms K':>10} {'rel rms V':>10} "
          f"{'max |err|':>10} {'flushed':>8}")
    for name, scale in (("fp8_e4m3", None), ("fp8_e4m3", amax / 448),
                        ("fp8_per_token_head", None), ("int8", None)):
        e = kv_roundtrip_error(model, ids, name, scale)
        shown = "row" if e.kv_scale is None else f"{e.kv_scale:.3g}"
        print(f"{name:<20} {shown:>9} {e.rel_rms_k:>10.2e} {e.rel_rms_v:>10.2e} "
              f"{max(e.max_abs_k, e.max_abs_v):>10.2e} {e.flushed:>8.2%}")
    print("rel rms: root-mean-square error over that of the values; flushed: the share of "
          "nonzero values stored as 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
