"""S05, the KV cache: prefill once, then decode one token at a time, from quadratic to linear.

What is new since S04
    Every pass of the S01 loop runs the model on the whole context and throws away all but the
    last row of logits. Yet the keys and values a layer computes for position t depend only on
    tokens 0..t, so they are the same in every later pass: the loop recomputes what it already
    knew. This chapter keeps them.

    - `KVCache`: per layer, keys and values of shape (Hkv, S, D), preallocated for a maximum
      context, with the number of positions filled. Only K and V are kept: a query is used once,
      by its own position, while a key and a value are read by every later position.
    - `CachedTransformer`: S03's transformer run step by step against the cache.
      `prefill(prompt_ids)` runs the whole prompt once (T = prompt length), fills the cache and
      returns the last position's logits only; `decode(token_id)` runs one new token (T = 1) at
      its absolute position, appends its K and V, and attends to everything cached. RoPE is
      applied at the token's absolute position before K goes in the cache, so a cached key never
      needs rotating again; grouped-query heads read their shared cached K/V head.
    - `Engine`: S04's engine with its `next_logits(ids)` hook answered from the cache: the loop's
      `model.forward(ids)[-1]` becomes the single row `decode` returns.
    - Counted work: `count_work(model)` counts the multiply-adds of every matrix product the
      forward pass runs and the bytes of K and V that attention reads, so the quadratic-vs-linear
      claim is checked by counting (`predicted_work` gives the closed forms), not by a clock.
    - `kv_cache_bytes(config, num_tokens)`: the memory formula 2 L Hkv D S x bytes per value.

What it does not handle yet
    One sequence at a time (S08 batches), a cache sized for the worst case up front (S12 pages
    it), no sharing of a common prompt prefix between requests (S13), float32 only in practice
    (S14 quantises), NumPy on the CPU (S06 ports this to PyTorch). A prompt that does not fit in
    the cache is an error, never truncated; when the cache is full the request ends with
    finish_reason "length" (stop_reason "context_full").

Run it
    python code/s05_kv_cache.py                        # bundled model: generate, then costs
    python code/s05_kv_cache.py --prompt "Romeo." --max-tokens 100 --model path/to/checkpoint
    python benchmarks/bench_s05_kv_cache.py            # wall-clock: uncached loop vs cache

Tests
    tests/test_s05_kv_cache.py: greedy tokens equal to the S01 loop and to `transformers`
    generate on tiny random GPT-2, Qwen3 and Llama models and on the bundled model, prompts from
    1 token to the context limit; decode logits allclose to HF and S03 at every step; sampled
    tokens equal to S04's engine for fixed seeds; the context-full boundary; the cache's
    errors; counted multiply-adds and K/V bytes equal to closed forms for both engines.

References
    The cache is as old as autoregressive transformer decoding: Vaswani et al., "Attention Is
    All You Need" (2017) and the tensor2tensor / fairseq incremental decoders; Pope et al.,
    "Efficiently Scaling Transformer Inference" (2022) for prefill vs decode cost and the cache
    memory formula; Ainslie et al., "GQA" (2023) for cache size with shared K/V heads. Followed
    for layout and names: Hugging Face transformers' `DynamicCache` / `StaticCache`
    (cache_utils.py: per layer (Hkv, S, D), keys stored after RoPE) and vLLM's
    prefill / decode vocabulary.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C is the hidden size.
"""
from __future__ import annotations

import argparse
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

import s03_transformer as s03
import s04_sampling as s04
from s03_transformer import Transformer, TransformerConfig


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------

def kv_cache_bytes(config: TransformerConfig, num_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of keys and values for `num_tokens` positions of one sequence.

    2 (K and V) x L layers x Hkv heads x D values x num_tokens x dtype_bytes. With GQA only the
    Hkv key/value heads are stored, not the H query heads. dtype_bytes: 4 for float32, 2 for
    float16/bfloat16. Raises ValueError for num_tokens < 0 or dtype_bytes < 1.
    Source: Pope et al. 2022, section 3 (the KV cache size formula).
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0 (got {num_tokens})")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1 (got {dtype_bytes})")
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * num_tokens * dtype_bytes


class KVCache:
    """Keys and values of one sequence, per layer, preallocated for `max_seq_len` positions.

    k, v: arrays (L, Hkv, max_seq_len, D) of `dtype`; layer l's keys are k[l], shape
    (Hkv, max_seq_len, D), of which the first `num_cached` positions are filled. Keys are
    stored after RoPE, at their absolute positions, so they are written once and never touched
    again. `append(layer, k, v)` writes the next positions of one layer and returns that layer's
    filled keys and values (Hkv, S, D): what attention of this step reads.

    The memory is allocated once, up front, for the worst case: that is simple and never
    reallocates, and it is exactly the waste paged attention (S12) removes.
    Raises ValueError for sizes < 1 or a non-floating dtype.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: np.dtype | type = np.float32):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if not np.issubdtype(np.dtype(dtype), np.floating):
            raise ValueError(f"dtype must be a floating-point type (got {np.dtype(dtype)})")
        shape = (num_layers, num_kv_heads, max_seq_len, head_dim)
        self.k = np.zeros(shape, dtype=dtype)  # (L, Hkv, S_max, D)
        self.v = np.zeros(shape, dtype=dtype)  # (L, Hkv, S_max, D)
        self.layer_lens = [0] * num_layers     # positions filled in each layer

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def num_cached(self) -> int:
        """Positions whose K and V are stored in every layer (all layers agree between steps)."""
        return min(self.layer_lens)

    @property
    def num_free(self) -> int:
        """Positions that can still be appended before the cache is full."""
        return self.max_seq_len - self.num_cached

    @property
    def nbytes(self) -> int:
        """Bytes reserved for keys and values (all max_seq_len positions, filled or not)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every position (a new sequence starts); the memory is kept and reused."""
        self.layer_lens = [0] * self.num_layers

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store the keys and values of T new positions of one layer, after the filled ones.

        layer: in [0, L). k, v: (Hkv, T, D), already rotated to their absolute positions.
        Returns this layer's keys and values for all S = filled + T positions, (Hkv, S, D) each:
        views into the cache, not copies. Raises ValueError for a bad layer or shape, or when
        the T positions do not fit (nothing is written then: the cache never overflows).
        """
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}) (got {layer!r})")
        hkv, d = self.num_kv_heads, self.head_dim
        if k.ndim != 3 or k.shape[0] != hkv or k.shape[2] != d or v.shape != k.shape:
            raise ValueError(f"k and v must both have shape (Hkv={hkv}, T, D={d}); got "
                             f"{k.shape} and {v.shape}")
        start, t_len = self.layer_lens[layer], k.shape[1]
        if start + t_len > self.max_seq_len:
            raise ValueError(f"KV cache is full: layer {layer} holds {start} of "
                             f"{self.max_seq_len} positions and cannot take {t_len} more")
        end = start + t_len
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        self.layer_lens[layer] = end
        return self.k[layer, :, :end], self.v[layer, :, :end]  # (Hkv, S, D) views
