"""S06, PyTorch and CUDA: the same model on an accelerator, and what a step costs.

What is new since S05
    The arithmetic moves from NumPy to PyTorch, so it can run on a GPU. `TorchTransformer` is
    S03's transformer (both families: Qwen3 / Llama and GPT-2) written again as a
    `torch.nn.Module`, loaded from the same checkpoints by the same S03 loader (NumPy arrays in,
    tensors on the device out). `KVCache` and `CachedTransformer` are S05's, allocated once, on
    the device, for max_context positions: a decode step writes one position in place instead
    of growing an array. `Engine` keeps S04's interface (`SamplingParams` in, `Completion` out,
    `stream`), with one change that matters on a GPU: the logits never leave the device. S04's
    logits processors and draw run there, ported to torch in the sibling module
    code/s06_sampler.py (`DeviceSampler`, one per request), so per generated token exactly one
    number crosses from the device to the host: the chosen token id (`.item()`), which the host
    needs to check the stop rules and to print text. A (V,) row of float32 logits would be
    600 KB per token for a 150k vocabulary, plus a synchronisation the GPU would wait on.

    Choices the learner makes (`main`, and the keyword arguments of `load`):
    --device cuda|cpu and --dtype float32|bfloat16|float16 (default CUDA with bfloat16 when a
    GPU is there, else CPU with float32), --attention manual|sdpa (the hand-written attention of
    S03, or PyTorch's fused `scaled_dot_product_attention`). Everything runs under
    `torch.inference_mode()`.

    Two ways a step is made cheaper than a line-by-line port of S03. Fewer launches (each torch
    call is one or more kernel launches, microseconds of host time each): q, k and v come from
    one fused projection (one matmul instead of three), and so do the MLP's gate and up
    projections; the q and k heads, side by side in that projection's output, are normalised
    and rotated together (one call each), and a decode step's query heads that share a key head
    are the rows of one matrix (`decode_attention`). Fewer FLOPs: the LM head runs on the last
    position only, all the sampler needs. The norms and the softmax compute in float32
    whatever the weights' dtype, as Hugging Face does, so bfloat16 loses precision only where
    the weights and activations are stored, not in the reductions.

What must match S04, and what cannot
    Greedy decoding is bit-for-bit the same rule (argmax, lowest id on a tie) applied after the
    same min_tokens and penalty steps, so in float32 on the CPU greedy tokens equal the NumPy
    engines' and `transformers`' (tests). Seeded sampling uses a `torch.Generator` on the
    device instead of NumPy's generator, so a seed gives *different* tokens than S04 (and a
    CUDA generator gives different numbers than a CPU one); a seed still makes a request
    reproducible on the same device. What the sampler keeps of S04 exactly (the same token for
    the same uniform number, the same kept sets but at a top_p boundary) is stated and tested
    in code/s06_sampler.py.

What it does not handle yet
    One request at a time (S08 batches), a cache allocated up front for max_context positions
    whatever the request needs (S12 pages it), one Python call per operation per step (S16 captures a
    step in a CUDA graph), one device (S18 shards a model over several).

Run it
    python code/s06_torch.py                                   # bundled model, default device
    python code/s06_torch.py --device cpu --dtype bfloat16 --attention sdpa --max-tokens 80
    python benchmarks/bench_s06_torch.py                       # vs transformers generate()

Tests
    tests/test_s06_torch.py: logits allclose to S03 / `transformers` and greedy tokens equal to
    the S01 loop, the S05 engine and `transformers` `generate()` on S03's tiny random models
    (GPT-2, Qwen3, Llama), both attentions; the same on the bundled model; the Engine's whole
    completions (stop rules, stop strings, logprobs) against S04's engine, and stream ==
    generate; rows S04 refuses flagged on the device; bfloat16 and float16 on the CPU within
    stated tolerances; CUDA tests (marker `gpu`, skipped without a GPU): the same parity, and
    decode steps with every processor on under CUDA's sync-debug mode "error" (no hidden
    host-device waits). The sampler's own tests (each processor and `draw` against S04's) are
    in tests/test_s06_sampler.py.

References
    PyTorch documentation: `torch.nn.functional.scaled_dot_product_attention` (enable_gqa),
    `torch.nn.functional.rms_norm`, `torch.inference_mode`, "CUDA semantics" (asynchronous
    execution, synchronisation); PyTorch's aten/src/ATen/native/transformers/attention.cpp
    (`convert_boolean_attn_mask`, the math backend's GQA expansion).
    Hugging Face transformers v5 modeling_qwen3.py / modeling_llama.py / modeling_gpt2.py
    (float32 norms and softmax under bf16, cos/sin cast to the activations' dtype) and
    `GenerationMixin` (LM head on the last position: `logits_to_keep`). vLLM's fused
    `QKVParallelLinear` and `MergedColumnParallelLinear` for the fused projections. Dao et
    al., "FlashAttention" (2022), for why a fused attention kernel avoids writing the (H, T, S)
    scores to memory. (The sampler's references are in code/s06_sampler.py.)

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size, I MLP size.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
from s06_sampler import BAD_ROW_ERRORS, DeviceSampler, compute_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_IMPLS = ("manual", "sdpa")


# ---------------------------------------------------------------------------------------------
# Device and dtype
# ---------------------------------------------------------------------------------------------

def resolve_device_dtype(device: str | None = None, dtype: str | None = None
                         ) -> tuple[torch.device, torch.dtype]:
    """The device and dtype to run on: the learner's choice, or the best default.

    device: "cuda", "cuda:N", "cpu" or None (CUDA when `torch.cuda.is_available()`, else CPU).
    dtype: "float32", "bfloat16", "float16" or None (bfloat16 on CUDA: half the bytes of
    float32 per weight and the range of float32, so no overflow; float32 on the CPU, the
    dtype of the course's oracles, and the safe choice there: bfloat16 matmuls are fast only
    on CPUs with bfloat16 instructions (AVX-512 BF16, AMX) and are emulated elsewhere).
    Raises ValueError for an unknown name, or for CUDA when no CUDA device is there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda"
                                           or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (got {device!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} needs a CUDA device, and torch finds none "
                         "(use --device cpu)")
    torch_device = torch.device(device)
    if dtype is None:
        dtype = "bfloat16" if torch_device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    return torch_device, DTYPES[dtype]


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when a and b name the same device; "cuda" without an index matches any CUDA
    device index (torch.device("cuda") != torch.device("cuda:0") although tensors created on
    the first land on the second)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished all queued work (CUDA); a no-op on the CPU, where
    every torch call returns only when its work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Building blocks as functions of tensors (S03's, in torch)
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, computed in float32 and returned in x's dtype.

    x: (..., N) any float dtype; weight: (N,), or any shape that broadcasts against x (the
    stacked (H + Hkv, D) q/k weight of `Qwen3Block.qkv`). The mean of squares of a bfloat16
    vector summed in bfloat16 would lose digits, so, like HF's Qwen3RMSNorm, the reduction
    runs in float32 and the result is cast back before the weight multiplies it.
    `F.rms_norm` without a weight is that upcast, reduction and cast back in one torch call
    (bitwise HF's three steps in float32, bfloat16 and float16: tests); the weight stays
    outside it, because with one it would multiply in float32, before the cast.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
               ) -> torch.Tensor:
    """LayerNorm over the last axis in float32, returned in x's dtype. x: (..., N)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def rope_tables(config: s03.TransformerConfig, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every RoPE angle for positions 0 .. max_position_embeddings - 1.

    Computed once in float32 from S03's `rope_inv_freq` (same speeds, same scaling), then cast
    to the activations' dtype as HF does. Returns cos, sin: (max_position_embeddings, D) on the
    device; a step at positions p..p+T-1 slices rows p..p+T-1 (a view, no new memory).
    """
    inv_freq = torch.from_numpy(s03.rope_inv_freq(config.head_dim, config.rope_theta,
                                                  config.rope_scaling))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]        # (P, D/2), float32
    angles = torch.cat([angles, angles], dim=-1)          # (P, D), rotate-half layout
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + D/2]) pair by its angle (S03 `apply_rope`, rotate-half pairing).
    x: (..., D); cos, sin: broadcastable to x, (T, 1, D) for x (T, heads, D) token-major.
    Returns x's shape and dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (..., D)
    return x * cos + rotated * sin


def causal_mask(q_start: int, t_len: int, device) -> torch.Tensor:
    """bool (T, S), S = q_start + T: True where query t (at position q_start + t) sees key s
    (s <= q_start + t). The same for every layer: a caller with many layers makes it once."""
    s_len = q_start + t_len
    return (torch.arange(s_len, device=device)[None, :]
            <= torch.arange(q_start, s_len, device=device)[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
              impl: str = "manual", causal: torch.Tensor | None = None) -> torch.Tensor:
    """Causal grouped-query attention of T queries against S keys and values.

    q: (H, T, D) at absolute positions q_start .. q_start + T - 1; k, v: (Hkv, S, D) at
    positions 0 .. S - 1 (the cache), S = q_start + T. Query t sees key s when s <= q_start + t;
    a decode step (T = 1) sees every key, so it needs no mask at all (`decode_attention`).
    Query head h reads key head h // (H / Hkv), HF's repeat_kv order.
    impl "manual": S03's computation, scores in the activations' dtype, softmax in float32 (as
    HF's eager attention). impl "sdpa": `torch.nn.functional.scaled_dot_product_attention`,
    which may run a fused kernel (flash or memory-efficient) that never stores the (H, T, S)
    scores. causal: None, or `causal_mask(q_start, T)` made once by a caller that runs many
    layers (S09's runner, per step). Returns (H, T, D). Raises ValueError for an unknown impl
    or inconsistent shapes.
    """
    n_heads, t_len, head_dim = q.shape
    n_kv_heads, s_len, _ = k.shape
    if n_heads % n_kv_heads or s_len != q_start + t_len:
        raise ValueError(f"attention needs H % Hkv == 0 and S == q_start + T (got H={n_heads}, "
                         f"Hkv={n_kv_heads}, S={s_len}, q_start={q_start}, T={t_len})")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS} (got {impl!r})")
    if t_len == 1:
        return decode_attention(q[None], k[None], v[None], scale, impl)[0]  # (H, 1, D)
    if impl == "sdpa" and q_start == 0:
        # A prompt from position 0 is SDPA's own is_causal case, which lets CUDA pick its
        # fastest (flash) kernel: an explicit mask would rule it out.
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=scale,
            enable_gqa=n_heads != n_kv_heads)                        # (1, H, T, D)
        return out[0]
    if causal is None:
        causal = causal_mask(q_start, t_len, q.device)                 # (T, S): True: visible
    if impl == "sdpa":  # a chunk after cached positions: the mask's diagonal is offset
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=causal, scale=scale,
            enable_gqa=n_heads != n_kv_heads)                        # (1, H, T, D)
        return out[0]
    group = n_heads // n_kv_heads
    q_grouped = q.reshape(n_kv_heads, group, t_len, head_dim)              # (Hkv, H/Hkv, T, D)
    scores = (q_grouped @ k[:, None].transpose(-1, -2)) * scale           # (Hkv, H/Hkv, T, S)
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = probs @ v[:, None]                                              # (Hkv, H/Hkv, T, D)
    return out.reshape(n_heads, t_len, head_dim)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     impl: str = "manual", mask: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per head (a decode step) against S keys, for B sequences.

    q: (B, H, 1, D); k, v: (B, Hkv, S, D); B = 1 for a single request. mask: None (every key
    visible: a single request, or a batch without padding), or an additive float mask in q's
    dtype broadcastable to (B, 1, 1, S), 0 on a visible key and -inf on a hidden one.

    Why the query groups are stacked as rows: the G = H / Hkv query heads that share key head
    j all read the same keys, so they are viewed as the G rows of one (G, D) matrix, q
    reshaped to (B, Hkv, G, D) (a view: heads j G .. j G + G - 1 are adjacent). Each key head
    then meets its queries in one (G, D) x (D, S) product, and SDPA sees plain attention with
    Hkv heads of G query rows: no GQA broadcast of the keys to H heads (`enable_gqa`), and the
    mask is the same for every row. Softmax normalises each row on its own, so the rows compute
    the H heads' attention, in HF's repeat_kv order (the products' summation may differ in the
    last bits from H separate heads'). With `enable_gqa`, SDPA's math backend first expands the
    keys and values to H heads; a bool mask it converts to this additive form on every call.
    impl as `attention`; the "manual" path adds the mask to the scores (a key at -inf gets
    probability 0). Returns (B, H, 1, D).
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads = k.shape[1]
    rows = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)   # (B, Hkv, G, D)
    if impl == "sdpa":
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    else:
        scores = (rows @ k.transpose(-1, -2)) * scale                      # (B, Hkv, G, S)
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = probs @ v                                                    # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, 1, head_dim)


# ---------------------------------------------------------------------------------------------
# The KV cache, preallocated on the device
# ---------------------------------------------------------------------------------------------

class KVCache(s05.KVCache):
    """S05's `KVCache` in torch: keys and values of one sequence, preallocated on the device.

    k, v: tensors (L, Hkv, max_seq_len, D) of `dtype` on `device`, allocated once; layer l's
    filled positions are k[l, :, :layer_lens[l]]. The lengths are host-side ints: the host
    always knows how long the sequence is, so reading them never waits for the device.
    Everything but the storage is S05's (num_cached, num_free, reset, truncate); `append`
    writes T new positions of one layer in place (a copy into a slice of the preallocated
    tensor, no new memory) and returns that layer's filled keys and values, (Hkv, S, D) views.
    Raises ValueError for sizes < 1 or a dtype that is not floating point.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        super().__init__(num_layers, num_kv_heads, max_seq_len, head_dim, dtype)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed storage on the cache's device."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype (got {dtype!r})")
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes reserved on the device for keys and values (all max_seq_len positions)."""
        return 2 * self.k.numel() * self.k.element_size()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """S05's `write`: store T new positions of one layer after its filled ones (k, v:
        (Hkv, T, D), already rotated) and return the layer's (Hkv, S, D) views; ValueError when
        they do not fit. S05's shape checks are skipped: the only caller is
        `TorchTransformer.run`, where every check is host work in the hot loop and the shapes
        are right by construction."""
        return self.write(layer, k, v)


# ---------------------------------------------------------------------------------------------
# The model as torch modules
# ---------------------------------------------------------------------------------------------

def _param(array: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype
           ) -> nn.Parameter:
    tensor = torch.as_tensor(array).to(device=device, dtype=dtype)
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


class Qwen3Block(nn.Module):
    """S03's Qwen3 / Llama layer in torch, with fused projections.

    qkv_proj: (H D + 2 Hkv D, C), q_proj, k_proj and v_proj stacked row-wise, so one matmul
    makes q, k and v; gate_up_proj: (2 I, C), gate_proj over up_proj. Split after the matmul,
    the numbers are the three (two) separate products. Same qkv -> attention -> finish split.
    """

    def __init__(self, config: s03.TransformerConfig, w: Mapping[str, np.ndarray],
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = config
        cat = np.concatenate
        self.input_norm = _param(w["input_layernorm.weight"], device, dtype)
        self.post_attention_norm = _param(w["post_attention_layernorm.weight"], device, dtype)
        self.qkv_proj = _param(cat([w[f"self_attn.{n}_proj.weight"] for n in "qkv"]), device, dtype)
        self.qkv_bias = (_param(cat([w[f"self_attn.{n}_proj.bias"] for n in "qkv"]), device, dtype)
                         if config.attention_bias else None)
        self.o_proj = _param(w["self_attn.o_proj.weight"], device, dtype)
        self.o_bias = _param(w["self_attn.o_proj.bias"], device, dtype) if config.attention_bias else None
        if config.qk_norm:
            self.q_norm = _param(w["self_attn.q_norm.weight"], device, dtype)
            self.k_norm = _param(w["self_attn.k_norm.weight"], device, dtype)
            # q_norm repeated for the H query heads over k_norm for the Hkv key heads: the
            # weight of one norm over all of them (see `qkv`). A buffer, not a Parameter: a
            # copy of the two above, so the parameter count stays the checkpoint's.
            self.register_buffer("qk_norm_stacked", torch.cat([
                self.q_norm.expand(config.num_attention_heads, -1),
                self.k_norm.expand(config.num_key_value_heads, -1)]), persistent=False)
        self.gate_up_proj = _param(cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
                                   device, dtype)
        self.gate_up_bias = (_param(cat([w["mlp.gate_proj.bias"], w["mlp.up_proj.bias"]]), device, dtype)
                             if config.mlp_bias else None)
        self.down_proj = _param(w["mlp.down_proj.weight"], device, dtype)
        self.down_bias = _param(w["mlp.down_proj.bias"], device, dtype) if config.mlp_bias else None
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        self.scale = config.head_dim ** -0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (T, C); cos, sin: (T, D) of the tokens' positions.
        Returns q (H, T, D), k (Hkv, T, D) rotated, v (Hkv, T, D): views, no copy.

        The fused output is viewed token-major, (T, H + 2 Hkv, D): per token its H query heads,
        then its Hkv key heads, then its Hkv value heads. The q and k heads are then one slice,
        so the q/k norm (one weight stacked over the heads) and RoPE each run once for both;
        the head-major views callers take transpose it, copying nothing (the cache write and
        attention read them as they are).
        """
        cfg = self.config
        t_len, n_q, n_kv = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads
        h = rms_norm(x, self.input_norm, cfg.norm_eps)
        heads = F.linear(h, self.qkv_proj, self.qkv_bias).view(t_len, n_q + 2 * n_kv, -1)
        qk, v = heads[:, :n_q + n_kv], heads[:, n_q + n_kv:]      # (T, H+Hkv, D), (T, Hkv, D)
        if cfg.qk_norm:
            qk = rms_norm(qk, self.qk_norm_stacked, cfg.norm_eps)
        qk = apply_rope(qk, cos[:, None], sin[:, None])           # (T, H+Hkv, D)
        q, k = qk[:, :n_q], qk[:, n_q:]                           # (T, H, D), (T, Hkv, D)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual. x: (T, C); attn: (H, T, D). Returns (T, C)."""
        t_len = x.shape[0]
        h = x + F.linear(attn.transpose(0, 1).reshape(t_len, -1), self.o_proj, self.o_bias)
        m = rms_norm(h, self.post_attention_norm, self.config.norm_eps)
        gate, up = F.linear(m, self.gate_up_proj, self.gate_up_bias).chunk(2, dim=-1)  # (T, I) each
        return h + F.linear(F.silu(gate) * up, self.down_proj, self.down_bias)


class GPT2Block(nn.Module):
    """S03's GPT-2 layer in torch. GPT-2 stores its weights input-major, (in, out); they are
    transposed once here to torch's (out, in) so every product is `F.linear`."""

    def __init__(self, config: s03.TransformerConfig, w: Mapping[str, np.ndarray],
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = config
        p = lambda name: _param(w[name], device, dtype)            # noqa: E731
        pt = lambda name: _param(w[name].T, device, dtype)         # noqa: E731
        self.ln_1, self.ln_1_bias = p("ln_1.weight"), p("ln_1.bias")
        self.ln_2, self.ln_2_bias = p("ln_2.weight"), p("ln_2.bias")
        self.c_attn, self.c_attn_bias = pt("attn.c_attn.weight"), p("attn.c_attn.bias")  # (3C, C)
        self.c_proj, self.c_proj_bias = pt("attn.c_proj.weight"), p("attn.c_proj.bias")  # (C, C)
        self.c_fc, self.c_fc_bias = pt("mlp.c_fc.weight"), p("mlp.c_fc.bias")            # (I, C)
        self.mlp_proj, self.mlp_proj_bias = pt("mlp.c_proj.weight"), p("mlp.c_proj.bias")  # (C, I)
        self.scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0

    def qkv(self, x: torch.Tensor, cos=None, sin=None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (H, T, D) from x (T, C); GPT-2 has no rotation (cos, sin are ignored)."""
        cfg = self.config
        t_len = x.shape[0]
        h = layer_norm(x, self.ln_1, self.ln_1_bias, cfg.norm_eps)
        fused = F.linear(h, self.c_attn, self.c_attn_bias)                 # (T, 3C)
        heads = fused.view(t_len, 3, cfg.num_attention_heads, cfg.head_dim)
        q, k, v = heads.permute(1, 2, 0, 3).unbind(0)                      # (H, T, D) each
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual. x: (T, C); attn: (H, T, D). Returns (T, C)."""
        t_len = x.shape[0]
        h = x + F.linear(attn.transpose(0, 1).reshape(t_len, -1), self.c_proj, self.c_proj_bias)
        m = layer_norm(h, self.ln_2, self.ln_2_bias, self.config.norm_eps)
        inner = F.gelu(F.linear(m, self.c_fc, self.c_fc_bias), approximate="tanh")
        return h + F.linear(inner, self.mlp_proj, self.mlp_proj_bias)


class TorchTransformer(nn.Module):
    """S03's decoder-only transformer (Qwen3, Llama or GPT-2) as a torch module on a device.

    Build it from S03's `TransformerConfig` and a state dict of NumPy arrays or tensors with HF
    names (checked by S03's `check_state_dict`), or with `TorchTransformer.from_pretrained`.
    `forward(token_ids)` is S01's model contract (logits float32 (T, V) as a NumPy array, all
    positions recomputed), so S01's loop runs it unchanged; `run` is the pass on the device,
    with or without a `KVCache`, used by `CachedTransformer` (S05's prefill / decode).
    attention: "manual" or "sdpa" (see `attention`). Raises ValueError for an unknown
    attention or dtype, and S03's CheckpointError for a state dict that does not fit the config.
    """

    def __init__(self, config: s03.TransformerConfig, state_dict: Mapping[str, np.ndarray],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention: str = "manual"):
        super().__init__()
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS} (got {attention!r})")
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of torch.{', torch.'.join(DTYPES)} (got {dtype})")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.attention_impl = attention
        w = s03_checkpoint.check_state_dict(config, {k: (t.detach().cpu().float().numpy()
                                              if isinstance(t, torch.Tensor) else t)
                                          for k, t in state_dict.items()})
        dev = self.device
        if config.model_type == "gpt2":
            self.embed_tokens = _param(w["transformer.wte.weight"], dev, dtype)       # (V, C)
            self.embed_positions = _param(w["transformer.wpe.weight"], dev, dtype)    # (P, C)
            self.blocks = nn.ModuleList(
                GPT2Block(config, s03_checkpoint.strip_prefix(w, f"transformer.h.{i}."), dev,
                          dtype) for i in range(config.num_hidden_layers))
            self.final_norm = _param(w["transformer.ln_f.weight"], dev, dtype)
            self.final_norm_bias = _param(w["transformer.ln_f.bias"], dev, dtype)
            self.cos = self.sin = None
        else:
            self.embed_tokens = _param(w["model.embed_tokens.weight"], dev, dtype)    # (V, C)
            self.embed_positions = None
            self.blocks = nn.ModuleList(
                Qwen3Block(config, s03_checkpoint.strip_prefix(w, f"model.layers.{i}."), dev,
                           dtype) for i in range(config.num_hidden_layers))
            self.final_norm = _param(w["model.norm.weight"], dev, dtype)
            self.final_norm_bias = None
            self.cos, self.sin = rope_tables(config, dev, dtype)
        # A tied head is the embedding Parameter itself: one tensor in memory, counted once.
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param(w["lm_head.weight"], dev, dtype))

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, attention: str = "manual"
                        ) -> "TorchTransformer":
        """Load a checkpoint directory or hub id with S03's loader (config.json and safetensors
        read into NumPy float32, then copied to the device in `dtype`). Raises S03's
        CheckpointError, UnsupportedArchitectureError."""
        checkpoint_dir = s03_checkpoint.resolve_checkpoint(name_or_path)
        config = s03_checkpoint.load_config(checkpoint_dir)
        return cls(config, s03_checkpoint.load_state_dict(checkpoint_dir), device, dtype, attention)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def run(self, token_ids: torch.Tensor, start: int, cache: KVCache | None = None
            ) -> torch.Tensor:
        """The layers on the device: T tokens at positions start .. start + T - 1.

        token_ids: int64 (T,) on the device. With a cache, every layer appends the step's keys
        and values to it and attention reads all cached positions; without one, the tokens
        attend only to each other (start must then be 0). Returns hidden states (T, C) in the
        model's dtype, before the final norm (`head` does the rest).
        """
        t_len = token_ids.shape[0]
        x = self.embed_ids(token_ids)                                        # (T, C)
        if self.embed_positions is not None:
            x = x + self.embed_positions[start:start + t_len]
            cos = sin = None
        else:
            cos, sin = self.cos[start:start + t_len], self.sin[start:start + t_len]  # (T, D) views
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, cos, sin)
            if cache is not None:
                k, v = cache.append(layer, k, v)                             # (Hkv, S, D) views
            x = block.finish(x, attention(q, k, v, start, block.scale, self.attention_impl))
        return x

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding: int64 (T,) on the device -> (T, C). Raises ValueError for an id
        outside [0, V) on the CPU (CUDA asserts on the device). A method, so a model split over
        ranks (S18) can look up its own share and sum."""
        try:
            return F.embedding(token_ids, self.embed_tokens)
        except IndexError as err:  # CPU only (CUDA asserts on the device): nothing is cached yet
            raise ValueError(f"token id must be an integer in [0, V={self.vocab_size})") from err

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden (T, C) -> logits float32 (T, V), on the device."""
        if self.config.model_type == "gpt2":
            x = layer_norm(x, self.final_norm, self.final_norm_bias, self.config.norm_eps)
        else:
            x = rms_norm(x, self.final_norm, self.config.norm_eps)
        return F.linear(x, self.lm_head).float()

    def check_ids(self, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Validate T ids placed at positions start .. start + T - 1 and move them to the device.
        token_ids: a list, tuple or range of ints (Python, NumPy, or 0-d integer arrays or
        tensors), or a 1-D integer array or tensor. Returns int64 (T,). Raises ValueError, with
        S03's rule and messages (`check_positions`), for an empty or non-1-D sequence, an id
        that is not an integer (2.7 is not truncated, True is not 1, '7' and None are not ids),
        an id outside [0, V), or a position beyond max_position_embeddings."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.cpu().numpy()           # S03 checks an array by its dtype
        elif isinstance(token_ids, (list, tuple, range)):
            # S03 checks Python values one by one (S01 `is_int`); a 0-d array or tensor is
            # judged by the value it holds.
            token_ids = [v.item() if isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim == 0
                         else v for v in token_ids]
        ids = s03.integers_in_range(token_ids, self.vocab_size, "token ids", "forward needs a "
                                     "non-empty 1-D sequence of token ids",
                                     f"[0, {self.vocab_size})")
        limit = self.config.max_position_embeddings
        if start + ids.size > limit:
            raise ValueError(f"positions must lie in [0, max_position_embeddings={limit}): "
                             f"{ids.size} tokens from position {start} do not fit")
        return torch.from_numpy(ids).to(self.device)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """S01's contract: logits float32 (T, V), a NumPy array on the host, for every position,
        recomputing everything (no cache). Raises ValueError as `check_ids`."""
        return self.head(self.run(self.check_ids(token_ids), 0)).cpu().numpy()


class CachedTransformer(s05.CachedTransformer):
    """S05's `CachedTransformer` in torch: a `TorchTransformer` run step by step against a
    `KVCache` preallocated on the model's device for max_seq_len positions (default the
    model's max_position_embeddings; S05's checks and properties).

    prefill(prompt_ids) resets the cache, runs the prompt in one step and returns the last
    position's logits; decode(token) runs one token at position num_cached. Both return float32
    (V,) *device* tensors: the logits stay where they were computed. Only the last position
    goes through the LM head. Raises ValueError when max_seq_len is not in
    [1, max_position_embeddings].
    """

    def make_cache(self, max_seq_len: int) -> KVCache:
        cfg = self.model.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq_len,
                       cfg.head_dim, self.model.dtype, self.model.device)

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Start a sequence: reset the cache, run the prompt (T ids) in one step, and return the
        logits of the token after it, float32 (V,) on the device. Raises ValueError for a bad or
        empty prompt or one longer than the cache."""
        ids = self.model.check_ids(prompt_ids)   # first: len() of None or 5 is a TypeError
        if ids.numel() > self.cache.max_seq_len:
            raise ValueError(f"prompt is {ids.numel()} tokens but the KV cache holds "
                             f"{self.cache.max_seq_len} positions (max_seq_len)")
        self.cache.reset()
        hidden = self.model.run(ids, 0, self.cache)                        # (T, C)
        return self.model.head(hidden[-1:])[0]                             # (V,)

    @torch.inference_mode()
    def decode(self, token: int | torch.Tensor) -> torch.Tensor:
        """One token at position num_cached; returns the logits of the token after it, float32
        (V,) on the device.

        token: a host int, or an int64 (1,) tensor. An int, or a tensor on another device than
        the model's (a CPU tensor for a CUDA model), is checked on the host, where it is, and
        then copied to the device. A tensor already on the model's device (what `draw` returns)
        is used as it is, never read: on CUDA that would be a synchronisation per step, and
        `draw` only returns ids in [0, V). On the CPU an id out of range then fails in the
        embedding lookup, before anything is cached, and `TorchTransformer.run` turns that into
        the ValueError; on CUDA it would be a device-side assert, which is why host ids are
        checked before they go there.
        Raises ValueError for an id that is not an integer in [0, V), when nothing was
        prefilled, or when the cache is full.
        """
        token = self._token_on_device(token)
        start = self.cache.num_cached
        if start == 0:
            raise ValueError("decode needs a prefilled cache: call prefill(prompt_ids) first")
        hidden = self.model.run(token, start, self.cache)                  # (1, C)
        return self.model.head(hidden)[0]                                  # (V,)

    def _token_on_device(self, token: int | torch.Tensor) -> torch.Tensor:
        """`decode`'s token as int64 (1,) on the model's device, checked on the host when it
        is there (see `decode`)."""
        vocab, device = self.vocab_size, self.model.device
        message = f"token id must be an integer in [0, V={vocab})"
        if isinstance(token, torch.Tensor):
            if token.dtype != torch.int64 or token.shape != (1,):   # metadata: free to read
                raise ValueError(f"{message}, as an int64 tensor of shape (1,) "
                                 f"(got {token.dtype}, shape {tuple(token.shape)})")
            if same_device(token.device, device):
                return token                 # as `draw` left it: never read back (see decode)
            token_id = int(token.cpu()[0])   # a host tensor for a model elsewhere
        elif s01.is_int(token):
            token_id = int(token)
        else:
            raise ValueError(f"{message} (got {token!r})")
        if not 0 <= token_id < vocab:
            raise ValueError(f"{message} (got {token_id})")
        if isinstance(token, torch.Tensor):
            return token.to(device)
        return torch.tensor([token_id], dtype=torch.int64, device=device)


def load(name_or_path: str | Path = s03.BUNDLED_MODEL_DIR, device: str | None = None,
         dtype: str | None = None, attention: str = "manual"
         ) -> tuple[TorchTransformer, s03_checkpoint.CheckpointTokenizer]:
    """Model (on the chosen device and dtype, see `resolve_device_dtype`) and tokenizer of a
    checkpoint directory or hub id. Raises ValueError (CheckpointError included)."""
    torch_device, torch_dtype = resolve_device_dtype(device, dtype)
    checkpoint_dir = s03_checkpoint.resolve_checkpoint(name_or_path)
    model = TorchTransformer.from_pretrained(checkpoint_dir, torch_device, torch_dtype, attention)
    return model, s03_checkpoint.CheckpointTokenizer.from_pretrained(checkpoint_dir)


# ---------------------------------------------------------------------------------------------
# Engine: S05's, with the model and the sampler on the device
# ---------------------------------------------------------------------------------------------

class Engine(s05.Engine):
    """S05's engine (S04's interface, prefill then decode against a preallocated `KVCache`)
    on a `TorchTransformer`, with the logits never leaving the device.

    Five seams change. `runner_class` is this chapter's `CachedTransformer` (cache on the
    device). `sample` runs S04's pipeline on the device (`DeviceSampler`, one per request, made
    in `make_sequence`) and brings the one token id to the host (`.item()`); a row with NaN or
    +inf, or with no finite entry, is S04's ValueError, flagged on the device (see
    `DeviceSampler.draw`). `decode_input` hands the runner that token as the device tensor it
    already is, so nothing crosses back; `model_step` adds the optional device sync
    (sync_timing). The loop, stop rules and text are S01's and S02's;
    greedy tokens equal S04's / S05's on the same model (float32).

    model: a TorchTransformer. tokenizer: as S04. max_context: positions in the cache (default
    and maximum: the model's max_position_embeddings). logprobs_mode: as S04. sync_timing:
    wait for the device after every model call, so Stats.pass_times_s is the model's real time
    (on CUDA the kernels run asynchronously: without it pass_times_s holds only the time to
    launch them, and the wait lands in the `.item()`, in the rest of the step).
    Raises ValueError for a model that is not a TorchTransformer or a max_context beyond the
    model's.
    """

    runner_class = CachedTransformer
    model_class = TorchTransformer

    def __init__(self, model: TorchTransformer, tokenizer, max_context: int | None = None,
                 logprobs_mode: str = "raw_logprobs", sync_timing: bool = False):
        if max_context is None:   # S05 checks the model's type first, S01 the window
            max_context = getattr(getattr(model, "config", None), "max_position_embeddings", 0)
        super().__init__(model, tokenizer, max_context, logprobs_mode)
        self.sync_timing = sync_timing

    def make_generator(self, params) -> None:
        """None: the request's random stream is its `DeviceSampler`'s torch.Generator."""
        return None

    @torch.inference_mode()
    def make_sequence(self, request_id, prompt_ids, params) -> s01.Sequence:
        seq = super().make_sequence(request_id, prompt_ids, params)
        seq.sampler = DeviceSampler(params, prompt_ids, tuple(seq.eos_ids),
                                    self.model.vocab_size, self.model.device)
        return seq

    @torch.inference_mode()
    def model_step(self, seq: s01.Sequence) -> torch.Tensor:
        """S05's prefill-or-decode rule; raw logits (V,) float32, on the device."""
        logits = super().model_step(seq)
        if self.sync_timing:
            synchronize(self.model.device)
        return logits

    def decode_input(self, seq: s01.Sequence) -> torch.Tensor:
        return seq.sampler.last_token               # int64 (1,), never left the device

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seq: s01.Sequence) -> int:
        """S04's pipeline on the device; the token id is the one number copied to the host."""
        sampler, n = seq.sampler, len(seq.output_ids)
        processed = sampler.process(logits, n)                  # (V,), on the device
        token_dev = sampler.draw(processed, n, logits)          # (1,) int64, on the device
        token = token_dev.item()                                # the one device -> host copy
        if token < 0:                                           # the device flagged the row
            raise ValueError(BAD_ROW_ERRORS[token])
        sampler.update(token_dev)
        if seq.logprobs is not None:
            source = logits if self.logprobs_mode == "raw_logprobs" else processed
            seq.logprobs.append(compute_logprobs(source, token, seq.params.logprobs))
        return token


# ---------------------------------------------------------------------------------------------
# Where a step's time goes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepTimes:
    """Mean seconds per decode step (prefill excluded), split in two: `model_s` (the forward
    pass) and `other_s` (sampling, the token's trip to the host, stop checks, detokenising;
    on CUDA without sync_timing also the wait for the device). tokens_per_s counts every
    generated token over the whole request, prefill included."""

    model_s: float
    other_s: float
    tokens_per_s: float

    @classmethod
    def from_stats(cls, stats: s01.Stats) -> "StepTimes":
        """Raises ValueError when the request made fewer than two steps (no decode step)."""
        if len(stats.step_times_s) < 2:
            raise ValueError("step times need at least two steps (a prefill and a decode)")
        model = float(np.mean(stats.pass_times_s[1:]))
        step = float(np.mean(stats.step_times_s[1:]))
        return cls(model_s=model, other_s=step - model,
                   tokens_per_s=len(stats.step_times_s) / sum(stats.step_times_s))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 6: the transformer in PyTorch, on CUDA or the CPU.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory or hub id (default: the bundled model)")
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="parameter and cache dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--attention", default="manual", choices=ATTENTION_IMPLS,
                        help="attention implementation (default: %(default)s)")
    parser.add_argument("--prompt", default="Romeo.\n", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=60,
                        help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling, 1.0 = off (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed for sampling (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="positions in the preallocated KV cache (default: the model's "
                             "context window, at most 4096)")
    # One thread by default, as S07: on ops this small, torch's own choice (one per core) has
    # threads wait for each other on every op; on a busy 2-core machine that made steps 14-35x
    # slower than the chapter's table.
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 1 to the logical cores (%d); more pay off "
                             "only for large models (default: %%(default)s, as S07: for the "
                             "tiny bundled model threads wait for each other on every small "
                             "op)" % (os.cpu_count() or 1))
    parser.add_argument("--sync-timing", action="store_true",
                        help="wait for the device after each model call (true model time on CUDA)")
    args = parser.parse_args(argv)
    try:
        s01.check_text(args.prompt, "--prompt")  # argv bytes that are not UTF-8: surrogates
    except ValueError as err:
        parser.error(str(err))
    # Checked before torch sees it: set_num_threads(0) raises, and after 100000 the first
    # parallel op segfaults (libgomp cannot create the threads). More threads than logical
    # CPUs (S07's bound too) would only take turns on them.
    cores = os.cpu_count() or 1
    if not 1 <= args.threads <= cores:
        parser.error(f"--threads must be an integer in [1, {cores}] (got {args.threads})")
    torch.set_num_threads(args.threads)
    bundled = s03.BUNDLED_MODEL_DIR
    if Path(args.model) == bundled and not (bundled / "config.json").exists():
        parser.error(f"the bundled model is not in {bundled} yet: train it with "
                     "python scripts/train_bundled_model.py, or pass --model DIR")
    try:
        model, tokenizer = load(args.model, args.device, args.dtype, args.attention)
        params = s04.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    max_tokens=args.max_tokens, seed=args.seed)
        # The cache is allocated up front for max_context positions: Qwen3-0.6B's full window
        # (40,960) would reserve 4.7 GB in bfloat16, so the demo asks for less by default.
        max_context = (min(model.config.max_position_embeddings, 4096)
                       if args.max_context is None else args.max_context)
        engine = Engine(model, tokenizer, max_context, sync_timing=args.sync_timing)
        # The first request pays one-off costs (allocator, kernel choice, on CUDA the context
        # and cuBLAS set-up); a short warm-up request takes them, so the figures below show
        # the steady state.
        start = time.perf_counter()
        engine.generate(args.prompt, s04.SamplingParams(temperature=0.0, max_tokens=2))
        warmup_s = time.perf_counter() - start
        completion = engine.generate(args.prompt, params)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device} in "
          f"{str(model.dtype).removeprefix('torch.')}, attention {model.attention_impl}, KV cache "
          f"{engine.runner.cache.nbytes / 2**20:.1f} MiB preallocated for {engine.max_context} "
          "positions")
    print("--- prompt ---\n" + args.prompt)
    print("--- completion ---\n" + completion.text)
    stats = completion.stats
    print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason} ---")
    print(f"warm-up request (2 tokens, one-off costs included): {warmup_s * 1e3:.1f} ms")
    if len(stats.step_times_s) >= 2:
        t = StepTimes.from_stats(stats)
        step = t.model_s + t.other_s
        print(f"prefill of {stats.prompt_tokens} tokens: {stats.step_times_s[0] * 1e3:.2f} ms; "
              f"decode step: {step * 1e3:.2f} ms = model {t.model_s * 1e3:.2f} ms "
              f"({t.model_s / step:.0%}) + everything else {t.other_s * 1e3:.2f} ms; "
              f"{t.tokens_per_s:.1f} tokens/s")
        if model.device.type == "cuda" and not args.sync_timing:
            print("(CUDA runs asynchronously: without --sync-timing the model time is the time to "
                  "launch its kernels, and the wait for them is counted in 'everything else')")


if __name__ == "__main__":
    sys.exit(main())
