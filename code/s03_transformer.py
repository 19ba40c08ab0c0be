"""S03, opening the box: a transformer forward pass in NumPy that runs real checkpoints.

What is new since S02
    The model. Chapter 1's loop ran a bigram table; here `Transformer.forward(token_ids)` is a
    real decoder-only transformer, written in NumPy float32 from its parts, in the order data
    flows: token embeddings, then L blocks of (norm, attention, residual, norm, MLP, residual),
    then a final norm and the LM head that turns the last hidden state into V logits. It keeps
    the S01 contract, `forward(token_ids) -> logits (T, V)`, so `Engine` runs it unchanged.

    Two architecture families, the two shapes nearly every open checkpoint takes:
    - Qwen3 / Llama: RMSNorm, rotary position embeddings (RoPE) with the checkpoint's theta
      (and Llama 3's frequency scaling), grouped-query attention (fewer K/V heads than query
      heads), Qwen3's per-head RMSNorm on q and k, SwiGLU MLP, tied or untied LM head.
    - GPT-2: LayerNorm with bias, learned position embeddings, one fused QKV projection stored
      as GPT-2 stores it (input-major "Conv1D" weights), GELU (tanh approximation) MLP, LM head
      tied to the token embeddings.
    `parameter_count`, `flops_per_token` and `bytes_per_token` compute the model's size and the
    cost of one token from the config alone. This file is the model; its sibling
    code/s03_checkpoint.py reads Hugging Face checkpoints into it (safetensors, config.json,
    tokenizer.json, a hub id) and checks them: `s03_checkpoint.load(dir_or_hub_id)` gives the
    model and its tokenizer, `Transformer.from_pretrained` the model alone.

What it does not handle yet
    Every pass still recomputes the whole context: S05 adds the KV cache (this file already
    splits a block into `qkv` -> `attention` -> `finish` so a cache can be slotted between the
    steps, and `rope` takes explicit absolute positions). One sequence at a time (S08 batches).
    No sliding-window attention, no rope scaling other than "linear" and "llama3", no biases
    on q/k/v alone (Qwen2), no mixture of experts, no quantised weights (S14), no GPU (S06).
    No position past max_position_embeddings: a longer input is refused, not extrapolated.

Run it
    python code/s03_transformer.py --prompt "Romeo." --max-tokens 60
    python code/s03_transformer.py --model path/to/checkpoint_dir   (or a hub id when online)

Tests
    tests/test_s03_transformer.py: tiny random GPT-2, Llama and Qwen3 models (GQA, tied and
    untied heads, qk-norm, rope theta, llama3 rope scaling) built with `transformers`, saved,
    loaded; logits allclose to transformers at every position and greedy tokens through the
    S01 loop equal to `generate(do_sample=False)`. The same on the bundled model. Parameter
    counts against transformers, FLOPs against torch's FLOP counter, RoPE, RMSNorm and
    attention against closed forms, and every error message (the loading tests are listed in
    code/s03_checkpoint.py).

References
    Vaswani et al., "Attention Is All You Need" (2017); Radford et al., "Language Models are
    Unsupervised Multitask Learners" (GPT-2, 2019); Zhang & Sennrich, "Root Mean Square Layer
    Normalization" (2019); Su et al., "RoFormer: Enhanced Transformer with Rotary Position
    Embedding" (2021); Shazeer, "GLU Variants Improve Transformer" (2020); Ainslie et al., "GQA"
    (2023); Touvron et al., "LLaMA" (2023); Qwen team, "Qwen3 Technical Report" (2025);
    Kaplan et al., "Scaling Laws for Neural Language Models" (2020) for the 2 FLOPs per
    parameter per token count. Followed for the exact conventions (rotate-half RoPE, GQA head
    order, where each norm sits): Hugging Face transformers' modeling_gpt2.py,
    modeling_llama.py, modeling_qwen3.py and modeling_rope_utils.py (v5).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C is the hidden size
(`hidden_size`) and I the MLP's inner size (`intermediate_size`).
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

import s01_generation_loop as s01

# Loading (safetensors, config.json, tokenizer.json) is in the sibling module s03_checkpoint,
# which imports this one for TransformerConfig and Transformer. The few places here that need
# it (the weight check in Transformer.__init__, from_pretrained, main, and raising its
# UnsupportedArchitectureError) import it inside the function, when they run: an import at the
# top would be circular, and this file would no longer read without the other.

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL_DIR = ROOT / "data" / "model"

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "qwen3")


# ---------------------------------------------------------------------------------------------
# Config: the architecture, with Hugging Face's field names
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerConfig:
    """Everything the forward pass needs to know about a checkpoint, with HF field names.

    model_type: "qwen3", "llama" or "gpt2". head_dim is D; num_key_value_heads is Hkv (equal
    to num_attention_heads H without GQA). norm_eps is rms_norm_eps (Qwen3/Llama) or
    layer_norm_epsilon (GPT-2). rope_theta / rope_scaling are None for GPT-2, which learns its
    positions instead. eos_token_ids come from generation_config.json when it names them.
    A checkpoint's config.json becomes one through `s03_checkpoint.load_config`.
    Raises ValueError when the numbers are inconsistent (heads that do not divide, a missing
    rope theta, ...), UnsupportedArchitectureError (s03_checkpoint) for another model_type.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float | None = None
    rope_scaling: Mapping[str, float] | None = field(default=None, hash=False)
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    scale_attn_weights: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            from s03_checkpoint import UnsupportedArchitectureError  # on use (see the imports)
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported (this chapter implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if not s01.is_finite(self.norm_eps) or self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be a finite number > 0 (got {self.norm_eps!r}): it "
                             "keeps the norm's division away from zero")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.model_type == "gpt2":
            if self.num_attention_heads * self.head_dim != self.hidden_size:
                raise ValueError("GPT-2 needs n_embd == n_head * head_dim")
        elif (not s01.is_finite(self.rope_theta)
              or self.rope_theta <= 0):
            raise ValueError(f"{self.model_type} uses RoPE and needs a finite rope_theta > 0 "
                             f"(got {self.rope_theta})")
        if self.model_type != "gpt2" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: head_dim must be even "
                             f"(got {self.head_dim})")
        for eos in self.eos_token_ids:
            if not s01.is_int(eos) or not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos_token_id {eos!r} must be a token id in "
                                 f"[0, vocab_size={self.vocab_size})")

    @property
    def is_rope(self) -> bool:
        """True for the Qwen3 / Llama family (rotary positions), False for GPT-2."""
        return self.model_type != "gpt2"


# ---------------------------------------------------------------------------------------------
# The building blocks, as functions of arrays
# ---------------------------------------------------------------------------------------------

def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T + b with W stored (out, in), the torch.nn.Linear layout of HF checkpoints.
    x: float32 (T, in). Returns float32 (T, out). This is where a transformer's FLOPs are."""
    y = x @ weight.T
    return y if bias is None else y + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * weight, over the last axis.

    No mean subtraction and no bias, unlike LayerNorm. x: float32 (..., N); weight (N,).
    Returns float32 (..., N). As in HF's LlamaRMSNorm / Qwen3RMSNorm.
    """
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm (Ba et al., 2016): (x - mean) / sqrt(var + eps) * weight + bias, last axis,
    biased variance as torch.nn.LayerNorm. x: float32 (..., N). Returns float32 (..., N)."""
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True)
    return centered / np.sqrt(variance + eps) * weight + bias


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, float] | None = None
                  ) -> np.ndarray:
    """The RoPE rotation speeds: inv_freq[i] = theta^(-2i / D) radians per position, i < D/2.

    Dimension pair i turns by angle position * inv_freq[i]: the first pairs spin fast (fine
    position), the last slowly (coarse position). A larger theta slows all of them, which is
    how long-context checkpoints (theta 1e6 in Qwen3) keep far positions apart.
    rope_scaling: None, {"rope_type": "linear", "factor": f} (every speed divided by f), or
    Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}: wavelengths longer than original/low_freq_factor are
    divided by factor, shorter than original/high_freq_factor kept, and the band between
    interpolated. Returns float32 (D/2,). Follows HF modeling_rope_utils
    (_compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
    _compute_llama3_parameters).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope_type != "default":
        from s03_checkpoint import UnsupportedArchitectureError  # on use (see the imports)
        raise UnsupportedArchitectureError(f"rope_type {rope_type!r} is not supported")
    return inv_freq.astype(np.float32)


def rope(positions: np.ndarray | Sequence[int], inv_freq: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle for the given absolute positions.

    positions: ints (T,), the token's index in its sequence (0 for the first prompt token),
    not its index in this step: a decode step at position 57 passes [57]. inv_freq: (D/2,).
    Returns cos, sin: float32 (T, D), the D/2 angles written twice, matching the rotate-half
    layout of `apply_rope`.
    """
    angles = np.outer(np.asarray(positions, dtype=np.float32), inv_freq)  # (T, D/2)
    angles = np.concatenate([angles, angles], axis=-1)                    # (T, D)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x[i], x[i + D/2]) pair of every head by its angle (RoFormer, 2021).

    The "rotate half" pairing (dimension i with i + D/2) is the one HF Llama/Qwen checkpoints
    are trained with; the paper pairs neighbours (2i, 2i + 1), which gives different numbers on
    the same weights. x: float32 (H, T, D); cos, sin: (T, D) from `rope`. Returns (H, T, D).
    Because q and k are both rotated by their own position, q.k depends only on the distance.
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # (H, T, D)
    return x * cos + rotated * sin


def attention_probs(q: np.ndarray, k: np.ndarray, q_positions: np.ndarray,
                    k_positions: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal attention weights softmax(q k^T * scale), with grouped-query head sharing.

    q: float32 (H, T, D); k: float32 (Hkv, S, D) with H a multiple of Hkv. Query head h reads
    key head h // (H / Hkv) (HF's repeat_kv order). q_positions (T,), k_positions (S,) are
    absolute positions: query t may read key s only when k_positions[s] <= q_positions[t]
    (causal mask). scale defaults to 1 / sqrt(D). Returns float32 (H, T, S), rows summing to 1.
    Raises ValueError when the head counts do not divide or a query can see no key.
    """
    n_heads, t_len, head_dim = q.shape
    n_kv_heads, s_len, _ = k.shape
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads "
                         f"({n_kv_heads})")
    scale = head_dim ** -0.5 if scale is None else scale
    group = n_heads // n_kv_heads
    q_grouped = q.reshape(n_kv_heads, group, t_len, head_dim)       # (Hkv, H/Hkv, T, D)
    scores = q_grouped @ k[:, None].transpose(0, 1, 3, 2) * scale   # (Hkv, H/Hkv, T, S)
    visible = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]  # (T, S)
    if not visible.any(axis=1).all():
        raise ValueError("every query needs at least one key at or before its position")
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)  # softmax is shift-invariant; no overflow
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs.reshape(n_heads, t_len, s_len).astype(np.float32, copy=False)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
              k_positions: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal scaled dot-product attention with grouped-query heads (Vaswani 2017; GQA 2023).

    q: float32 (H, T, D); k, v: float32 (Hkv, S, D); positions as in `attention_probs`. The keys
    and values may be longer than the queries (S > T): that is how a KV cache (S05) hands a
    decode step the past. Returns float32 (H, T, D): each query's weighted mix of the values.
    """
    probs = attention_probs(q, k, q_positions, k_positions, scale)  # (H, T, S)
    n_heads, t_len, s_len = probs.shape
    n_kv_heads = v.shape[0]
    group = n_heads // n_kv_heads
    out = probs.reshape(n_kv_heads, group, t_len, s_len) @ v[:, None]  # (Hkv, H/Hkv, T, D)
    return out.reshape(n_heads, t_len, v.shape[-1])


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: x * sigmoid(x). Elementwise, float32."""
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel, 2016), as GPT-2 was trained ("gelu_new"):
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Elementwise, float32."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + 0.044715 * x ** 3)))


def swiglu_mlp(x: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray,
               down_proj: np.ndarray) -> np.ndarray:
    """SwiGLU MLP (Shazeer, 2020): down(silu(gate(x)) * up(x)).

    x: float32 (T, C); gate_proj, up_proj: (I, C); down_proj: (C, I). Returns (T, C). Three
    matmuls of C x I each: two thirds of a Llama/Qwen layer's weights live here.
    """
    return linear(silu(linear(x, gate_proj)) * linear(x, up_proj), down_proj)


def gpt2_mlp(x: np.ndarray, c_fc_w: np.ndarray, c_fc_b: np.ndarray, c_proj_w: np.ndarray,
             c_proj_b: np.ndarray) -> np.ndarray:
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), weights as GPT-2 stores them, input-major.

    x: float32 (T, C); c_fc_w: (C, I); c_proj_w: (I, C) (GPT-2's "Conv1D" keeps W as (in, out),
    so the product is x @ W, not x @ W^T). Returns (T, C).
    """
    return gelu_tanh(x @ c_fc_w + c_fc_b) @ c_proj_w + c_proj_b


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """(T, n_heads * D) -> (n_heads, T, D): one matrix per head."""
    t_len = x.shape[0]
    return x.reshape(t_len, n_heads, -1).transpose(1, 0, 2)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(n_heads, T, D) -> (T, n_heads * D), the inverse of `split_heads`."""
    n_heads, t_len, head_dim = x.shape
    return x.transpose(1, 0, 2).reshape(t_len, n_heads * head_dim)


# ---------------------------------------------------------------------------------------------
# Blocks: qkv -> attention -> finish, so a KV cache can sit between the steps
# ---------------------------------------------------------------------------------------------

class Qwen3Block:
    """One Qwen3 / Llama decoder layer (pre-norm), weights from an HF checkpoint.

        h = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))  with q, k, v from
                                                            q/k/v_proj(rms_norm(x))
        out = h + swiglu_mlp(rms_norm(h))

    Llama is the same layer without q_norm / k_norm (Qwen3 added them to keep attention logits
    in range), so one class serves both; `config.qk_norm` says which. Weights (HF names, layout
    (out, in)): self_attn.{q,k,v,o}_proj.weight [(+ .bias when attention_bias)],
    self_attn.{q,k}_norm.weight (D,) for Qwen3, mlp.{gate,up,down}_proj.weight,
    input_layernorm.weight, post_attention_layernorm.weight (C,).

    The forward pass is split in three so S05 can cache keys and values between them:
    `qkv` (new tokens -> q, k, v at their positions), `attention` (a free function: q against
    any K/V), `finish` (output projection, residual, MLP).
    """

    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.w = dict(weights)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def qkv(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries, keys and values of the tokens in x, rotated to their absolute positions.

        x: float32 (T, C), the residual stream entering the layer; positions: ints (T,).
        Returns q (H, T, D), k (Hkv, T, D), v (Hkv, T, D), float32.
        """
        cfg = self.config
        h = rms_norm(x, self.w["input_layernorm.weight"], cfg.norm_eps)
        q = split_heads(self._proj(h, "self_attn.q_proj"), cfg.num_attention_heads)  # (H, T, D)
        k = split_heads(self._proj(h, "self_attn.k_proj"), cfg.num_key_value_heads)  # (Hkv, T, D)
        v = split_heads(self._proj(h, "self_attn.v_proj"), cfg.num_key_value_heads)  # (Hkv, T, D)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's D dims, before the rotation
            q = rms_norm(q, self.w["self_attn.q_norm.weight"], cfg.norm_eps)
            k = rms_norm(k, self.w["self_attn.k_norm.weight"], cfg.norm_eps)
        cos, sin = rope(positions, self.inv_freq)  # (T, D) each
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """The rest of the layer after attention: output projection, residual, MLP, residual.
        x: float32 (T, C), the layer's input; attn: (H, T, D) from `attention`. Returns (T, C)."""
        cfg = self.config
        h = x + self._proj(merge_heads(attn), "self_attn.o_proj")
        m = rms_norm(h, self.w["post_attention_layernorm.weight"], cfg.norm_eps)
        if cfg.mlp_bias:
            return h + linear(silu(self._proj(m, "mlp.gate_proj")) * self._proj(m, "mlp.up_proj"),
                              self.w["mlp.down_proj.weight"], self.w["mlp.down_proj.bias"])
        return h + swiglu_mlp(m, self.w["mlp.gate_proj.weight"], self.w["mlp.up_proj.weight"],
                              self.w["mlp.down_proj.weight"])

    def attention_scale(self) -> float:
        """1/sqrt(D), the softmax temperature of q.k (same method on `GPT2Block`)."""
        return self.config.head_dim ** -0.5

    def forward(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The whole layer without a cache: every token attends to the tokens of x up to itself.
        x: float32 (T, C); positions: ints (T,). Returns float32 (T, C)."""
        q, k, v = self.qkv(x, positions)
        return self.finish(x, attention(q, k, v, positions, positions, self.attention_scale()))


LlamaBlock = Qwen3Block  # the same layer; config.qk_norm is False for Llama


class GPT2Block:
    """One GPT-2 decoder layer (pre-norm), weights as GPT-2 checkpoints store them.

        h = x + c_proj(attention(split(c_attn(layer_norm_1(x)))))
        out = h + gpt2_mlp(layer_norm_2(h))

    c_attn is one fused projection producing q, k and v side by side (C -> 3C), and every
    weight is stored input-major (in, out) ("Conv1D"). No rotary positions: GPT-2 adds a
    learned position vector to the embedding instead, so `qkv` ignores positions beyond
    passing them through. Same qkv -> attention -> finish split as `Qwen3Block`.
    """

    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.w = dict(weights)

    def qkv(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v (H, T, D) each from x (T, C); positions are unused (see the class docstring)."""
        cfg = self.config
        h = layer_norm(x, self.w["ln_1.weight"], self.w["ln_1.bias"], cfg.norm_eps)
        fused = h @ self.w["attn.c_attn.weight"] + self.w["attn.c_attn.bias"]  # (T, 3C)
        q, k, v = np.split(fused, 3, axis=-1)                                   # (T, C) each
        heads = cfg.num_attention_heads
        return split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)

    def finish(self, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """Output projection, residual, MLP, residual. x: (T, C); attn: (H, T, D). Returns (T, C)."""
        cfg = self.config
        h = x + merge_heads(attn) @ self.w["attn.c_proj.weight"] + self.w["attn.c_proj.bias"]
        m = layer_norm(h, self.w["ln_2.weight"], self.w["ln_2.bias"], cfg.norm_eps)
        return h + gpt2_mlp(m, self.w["mlp.c_fc.weight"], self.w["mlp.c_fc.bias"],
                            self.w["mlp.c_proj.weight"], self.w["mlp.c_proj.bias"])

    def attention_scale(self) -> float:
        """1/sqrt(D), or 1 when the checkpoint was trained with scale_attn_weights=False."""
        return self.config.head_dim ** -0.5 if self.config.scale_attn_weights else 1.0

    def forward(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The whole layer without a cache. x: float32 (T, C); positions (T,). Returns (T, C)."""
        q, k, v = self.qkv(x, positions)
        return self.finish(x, attention(q, k, v, positions, positions, self.attention_scale()))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

class Transformer:
    """A decoder-only transformer in NumPy float32: Qwen3, Llama or GPT-2 weights.

    forward(token_ids) -> logits (T, V), the S01 model contract. Build it with
    `Transformer.from_pretrained(dir_or_hub_id)` or from a config and a state dict (HF tensor
    names; see `s03_checkpoint.expected_tensors`). Attributes: config, blocks (L blocks with
    qkv/finish/forward), and the embedding and head tensors. Raises s03_checkpoint's
    CheckpointError (MissingTensorError included) for a state dict that does not fit the
    config (see `s03_checkpoint.check_state_dict`).
    """

    def __init__(self, config: TransformerConfig, state_dict: Mapping[str, np.ndarray]):
        from s03_checkpoint import check_state_dict, strip_prefix  # on use (see the imports)
        self.config = config
        w = check_state_dict(config, state_dict)
        if config.model_type == "gpt2":
            self.embed_tokens = w["transformer.wte.weight"]    # (V, C)
            self.embed_positions = w["transformer.wpe.weight"]  # (max_position_embeddings, C)
            self.blocks = [GPT2Block(config, strip_prefix(w, f"transformer.h.{i}."))
                           for i in range(config.num_hidden_layers)]
            self.final_norm = (w["transformer.ln_f.weight"], w["transformer.ln_f.bias"])
        else:
            self.embed_tokens = w["model.embed_tokens.weight"]  # (V, C)
            self.embed_positions = None
            self.blocks = [Qwen3Block(config, strip_prefix(w, f"model.layers.{i}."))
                           for i in range(config.num_hidden_layers)]
            self.final_norm = (w["model.norm.weight"],)
        # A tied head reuses the embedding matrix: the same (V, C) numbers read in reverse.
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else w["lm_head.weight"]

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> "Transformer":
        """Load config.json (+ generation_config.json) and the safetensors weights from a
        checkpoint directory or a hub id, with s03_checkpoint. Raises its CheckpointError (see
        `resolve_checkpoint`, `load_config`, `load_state_dict`, `check_state_dict`) or
        UnsupportedArchitectureError."""
        from s03_checkpoint import (  # on use (see the imports)
            CheckpointError, load_config, load_state_dict, resolve_checkpoint,
        )
        checkpoint_dir = resolve_checkpoint(name_or_path)
        config = load_config(checkpoint_dir)
        state_dict = load_state_dict(checkpoint_dir)
        try:
            return cls(config, state_dict)
        except CheckpointError as err:  # keep the subclass, name the checkpoint
            raise type(err)(f"{checkpoint_dir}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def check_positions(self, token_ids: Sequence[int], positions: Sequence[int] | None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Validate a step's input. Returns ids and positions as int64 (T,).
        Raises ValueError for an empty or non-1-D sequence, an id or position that is not an
        integer (1.5 or True is never truncated to an id), an id outside [0, V) (however large:
        2**63 is out of range, not an overflow), positions of another length, a position
        outside [0, max_position_embeddings), or, without positions (token t at position t),
        more than max_position_embeddings tokens."""
        ids = integers_in_range(token_ids, self.vocab_size, "token ids", "forward needs a "
                                 "non-empty 1-D sequence of token ids", f"[0, {self.vocab_size})")
        limit = self.config.max_position_embeddings
        if positions is None:
            if ids.size > limit:  # RoPE would run on past the trained window; GPT-2 has no row
                raise ValueError(
                    f"{ids.size} tokens do not fit the context window: token t sits at position "
                    f"t, and positions must lie in [0, max_position_embeddings={limit})")
            return ids, np.arange(ids.size)
        pos = integers_in_range(positions, limit, "positions", "positions must be a 1-D sequence",
                                 f"[0, max_position_embeddings={limit})")
        if pos.shape != ids.shape:
            raise ValueError(f"positions must have one entry per token ({ids.size}), got {pos.shape}")
        return ids, pos

    def embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Token embedding rows (plus GPT-2's learned position rows). Returns float32 (T, C)."""
        x = self.embed_tokens[token_ids]
        if self.embed_positions is not None:
            x = x + self.embed_positions[positions]
        return x

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm, then the LM head: hidden states (T, C) -> logits float32 (T, V)."""
        if self.config.model_type == "gpt2":
            x = layer_norm(x, *self.final_norm, self.config.norm_eps)
        else:
            x = rms_norm(x, *self.final_norm, self.config.norm_eps)
        return x @ self.lm_head.T

    def forward(self, token_ids: Sequence[int], positions: Sequence[int] | None = None
                ) -> np.ndarray:
        """Logits for the token after each position, recomputing everything (no cache).

        token_ids: T ints in [0, V); positions: their absolute positions, default 0..T-1.
        Returns float32 (T, V). Raises ValueError as `check_positions`.
        """
        ids, pos = self.check_positions(token_ids, positions)
        x = self.embed(ids, pos)  # (T, C)
        for block in self.blocks:
            x = block.forward(x, pos)
        return self.head(x).astype(np.float32, copy=False)


def integers_in_range(values: Sequence[int], limit: int, what: str, shape_rule: str,
                       bounds: str) -> np.ndarray:
    """values as int64 (T,), after checking they are a non-empty 1-D run of integers in
    [0, limit). NumPy alone would truncate 1.5 to 1, read True as 1, overflow on 2**63 or turn
    [3, 2**63] into floats, hence the explicit checks (Python values one by one, arrays by
    dtype). Raises ValueError with `shape_rule`, or naming `what` and `bounds`."""
    if isinstance(values, (list, tuple)):
        if not values or any(isinstance(v, (list, tuple, np.ndarray)) for v in values):
            raise ValueError(shape_rule)
        if not all(s01.is_int(v) for v in values):
            bad = next(v for v in values if not s01.is_int(v))
            raise ValueError(f"{what} must be integers (got {bad!r})")
        if not all(0 <= v < limit for v in values):
            raise ValueError(f"{what} must lie in {bounds}")
        return np.array(values, dtype=np.int64)
    raw = np.asarray(values)
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError(shape_rule)
    if raw.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers (got dtype {raw.dtype})")
    if raw.min() < 0 or raw.max() >= limit:
        raise ValueError(f"{what} must lie in {bounds}")
    return raw.astype(np.int64, copy=False)



# ---------------------------------------------------------------------------------------------
# Size and cost from the config: parameters, FLOPs and bytes per token
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PartCost:
    """One row of `cost_breakdown`: a part of the model, its parameters, and what it costs for
    one token that attends to `context_len` positions (itself included).

    flops: floating-point operations of the part's matrix products (a multiply-add is 2).
    bytes: bytes read from memory for one decode step at batch 1 with a KV cache: every weight
    of the part once, plus, for attention, the cached K and V of the context (and the new K, V
    written). Activations are not counted: at these sizes they are a rounding error.
    """

    part: str
    params: int
    flops: int
    bytes: int


def _check_cost_args(context_len: int, dtype_bytes: int) -> None:
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1 (got {context_len})")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1 (got {dtype_bytes})")


def layer_breakdown(config: TransformerConfig, context_len: int = 1, dtype_bytes: int = 4
                    ) -> list[PartCost]:
    """The anatomy of one decoder layer for one token attending to S = context_len positions.

    Rows:
    - "q, k, v, o projections": C x (H + 2 Hkv) D in, H D x C out; 2 FLOPs per weight.
    - "attention (q k^T, p v)": no weights; 2 H D S FLOPs for the scores and 2 H D S for the
      weighted sum of values; reads the cached K and V of S - 1 positions and writes the new
      token's (2 Hkv D values each).
    - "mlp": 3 matrices of C x I (SwiGLU) or 2 (GPT-2), plus biases where the model has them.
    - "norms": RMSNorm / LayerNorm weights (Qwen3's q/k norms included); O(C) work, counted as
      0 FLOPs like RoPE, softmax and activations.
    Raises ValueError for context_len < 1 or dtype_bytes < 1.
    """
    _check_cost_args(context_len, dtype_bytes)
    cfg = config
    c, i_size, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h_d, kv_d = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gpt2 = cfg.model_type == "gpt2"
    proj_weights = c * h_d + 2 * c * kv_d + h_d * c
    proj_params = proj_weights + ((h_d + 2 * kv_d + c) if cfg.attention_bias else 0)
    mlp_weights = (2 if gpt2 else 3) * c * i_size
    mlp_params = mlp_weights + ((i_size + c) if gpt2 else ((2 * i_size + c) if cfg.mlp_bias else 0))
    norm_params = (4 * c) if gpt2 else (2 * c + (2 * d if cfg.qk_norm else 0))
    kv_bytes = 2 * kv_d * (context_len - 1) * dtype_bytes + 2 * kv_d * dtype_bytes  # read + write
    return [
        PartCost("q, k, v, o projections", proj_params, 2 * proj_weights, proj_params * dtype_bytes),
        PartCost("attention (q k^T, p v)", 0, 2 * 2 * h_d * context_len, kv_bytes),
        PartCost("mlp", mlp_params, 2 * mlp_weights, mlp_params * dtype_bytes),
        PartCost("norms", norm_params, 0, norm_params * dtype_bytes),
    ]


def cost_breakdown(config: TransformerConfig, context_len: int = 1, dtype_bytes: int = 4
                   ) -> list[PartCost]:
    """Parameters, FLOPs and bytes of one token's forward pass, part by part, from the config.

    Rows: "embedding" (and "position embedding" for GPT-2), "layer 0" ... "layer L-1" (each
    the sum of `layer_breakdown`), "final norm", "lm head" (0 parameters when tied to the
    embedding, but its 2 C V FLOPs and its V x C read are still there). An embedding lookup
    moves one row (C values) and does no FLOPs. Raises ValueError for context_len < 1 or
    dtype_bytes < 1. Counting conventions: Kaplan et al. 2020 (2 FLOPs per parameter per
    token) plus the attention term.
    """
    _check_cost_args(context_len, dtype_bytes)
    cfg = config
    c, v = cfg.hidden_size, cfg.vocab_size
    gpt2 = cfg.model_type == "gpt2"
    parts = layer_breakdown(cfg, context_len, dtype_bytes)
    rows = [PartCost("embedding", v * c, 0, c * dtype_bytes)]
    if gpt2:
        rows.append(PartCost("position embedding", cfg.max_position_embeddings * c, 0, c * dtype_bytes))
    for layer in range(cfg.num_hidden_layers):
        rows.append(PartCost(f"layer {layer}", sum(p.params for p in parts),
                             sum(p.flops for p in parts), sum(p.bytes for p in parts)))
    final_norm = 2 * c if gpt2 else c
    rows.append(PartCost("final norm", final_norm, 0, final_norm * dtype_bytes))
    head_params = 0 if cfg.tie_word_embeddings else v * c
    rows.append(PartCost("lm head", head_params, 2 * c * v, v * c * dtype_bytes))
    return rows


def parameter_count(config: TransformerConfig) -> int:
    """Number of parameters (a tied embedding / LM head matrix counted once)."""
    return sum(row.params for row in cost_breakdown(config))


def flops_per_token(config: TransformerConfig, context_len: int) -> int:
    """Matmul FLOPs of one token's forward pass when it attends to context_len positions
    (see `cost_breakdown`). About 2 x (parameters outside the embedding) plus 4 L H D S."""
    return sum(row.flops for row in cost_breakdown(config, context_len))


def bytes_per_token(config: TransformerConfig, context_len: int, dtype_bytes: int = 4) -> int:
    """Bytes a decode step moves at batch 1 with a KV cache of context_len - 1 positions:
    all weights (the tied head counted as read once for the head and one row for the lookup)
    plus K and V of every layer (see `cost_breakdown`). dtype_bytes: 4 for float32, 2 for
    bf16. FLOPs / bytes is the step's arithmetic intensity, about 0.5 FLOP per byte in float32:
    far below what any processor needs to be compute-bound, hence decode is bandwidth-bound."""
    return sum(row.bytes for row in cost_breakdown(config, context_len, dtype_bytes))


def format_cost_table(config: TransformerConfig, context_len: int) -> str:
    """The per-part breakdown, then one layer's anatomy, as aligned text tables."""
    def table(rows: list[PartCost], title: str) -> list[str]:
        total_p = sum(r.params for r in rows) or 1
        total_f = sum(r.flops for r in rows) or 1
        lines = [f"{title:<24} {'parameters':>12} {'share':>6} {'FLOPs/token':>13} {'share':>6} "
                 f"{'bytes/token':>13}"]
        for r in rows:
            lines.append(f"{r.part:<24} {r.params:>12,} {r.params / total_p:>6.1%} "
                         f"{r.flops:>13,} {r.flops / total_f:>6.1%} {r.bytes:>13,}")
        lines.append(f"{'total':<24} {sum(r.params for r in rows):>12,} {'':>6} "
                     f"{sum(r.flops for r in rows):>13,} {'':>6} {sum(r.bytes for r in rows):>13,}")
        return lines

    rows = cost_breakdown(config, context_len)
    flops, moved = sum(r.flops for r in rows), sum(r.bytes for r in rows)
    lines = table(rows, "part")
    lines.append("")
    lines += table(layer_breakdown(config, context_len), "inside one layer")
    lines.append(f"\n(one token attending to {context_len} positions, float32 weights, batch 1 with a "
                 f"KV cache: {flops / moved:.2f} FLOP per byte moved)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    from s03_checkpoint import CheckpointError, load  # on use (see the imports)

    parser = argparse.ArgumentParser(
        description="Chapter 3: a NumPy transformer running real checkpoints in the S01 loop.")
    parser.add_argument("--model", default=str(BUNDLED_MODEL_DIR),
                        help="checkpoint directory or Hugging Face hub id (default: bundled model)")
    parser.add_argument("--prompt", default="Romeo.\n", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=60, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    args = parser.parse_args(argv)
    try:  # a command line in another encoding arrives as lone surrogates (surrogateescape)
        s01.check_text(args.prompt, "--prompt")
    except ValueError as err:
        parser.error(str(err))

    try:
        model, tokenizer = load(args.model)
    except CheckpointError as err:  # every loading problem is one, naming the file
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}: {parameter_count(cfg):,} parameters, L={cfg.num_hidden_layers}, "
          f"C={cfg.hidden_size}, H={cfg.num_attention_heads}, Hkv={cfg.num_key_value_heads}, "
          f"D={cfg.head_dim}, V={cfg.vocab_size}")
    engine = s01.Engine(model, tokenizer, max_context=cfg.max_position_embeddings)
    try:
        result = engine.generate(args.prompt, args.max_tokens, args.temperature, args.seed)
    except ValueError as err:
        parser.error(str(err))
    s = result.stats
    print("--- prompt ---\n" + args.prompt)
    print("--- completion ---\n" + result.text)
    print(f"--- {len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
          f"{s.passes} passes (no cache: every pass recomputes the context), "
          f"{sum(s.pass_times_s):.2f} s ---\n")
    context = s.prompt_tokens + len(result.token_ids)
    print(format_cost_table(cfg, context_len=context))


if __name__ == "__main__":
    sys.exit(main())
