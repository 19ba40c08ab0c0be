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
    - `Engine`: S04's engine with its `model_step` seam answered from the cache: the loop's
      `model.forward(ids)[-1]` becomes the single row `decode` returns, and the engine knows
      from its own state (`seq.num_computed_tokens`, the cache's owner) whether to prefill or
      decode.
    - Counted work: `count_work(model)` counts the multiply-adds of every matrix product the
      forward pass runs and the bytes of K and V that attention reads, so the quadratic-vs-linear
      claim is checked by counting (`step_work` and `generation_work` give the closed forms),
      not by a clock. Per pass at context n, the loop without a cache does n tokens of weight
      work and n^2 query-key pairs; the cache does 1 token and n pairs. Both read K and V of n
      positions per pass: the cache removes recomputation, not reading, which is why a decode
      step ends up limited by memory bandwidth rather than arithmetic.
    - `kv_cache_bytes(config, num_tokens)`: the memory formula 2 L Hkv D S x bytes per value.

What it does not handle yet
    One sequence at a time (S08 batches), a cache sized for the worst case up front (S12 pages
    it), no sharing of a common prompt prefix between requests (S13), float32 only in practice
    (S14 quantises), NumPy on the CPU (S06 ports this to PyTorch). A prompt that does not fit in
    the cache is an error, never truncated; when the cache is full the request ends with
    finish_reason "length" (S01's `stop_rule`: a full context).

Run it
    python code/s05_kv_cache.py                        # bundled model: generate, then costs
    python code/s05_kv_cache.py --prompt "Romeo." --max-tokens 100 --model path/to/checkpoint
    python benchmarks/bench_s05_kv_cache.py            # wall-clock: uncached loop vs cache

Tests
    tests/test_s05_kv_cache.py: greedy tokens equal to the S01 loop and to `transformers`
    generate on tiny random GPT-2, Qwen3 and Llama models and on the bundled model, prompts from
    1 token to the context limit; decode logits allclose to HF and S03 at every step; cached
    keys and values equal to those in HF's DynamicCache; sampled tokens equal to S04's engine
    for fixed seeds; the context-full boundary; the cache's errors (a failed step or request
    leaves no half-written state); counted multiply-adds and K/V bytes equal to closed forms
    for both engines.

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

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

import s03_checkpoint
import s03_transformer as s03
import s01_generation_loop as s01
import s04_sampling as s04
from s03_transformer import Transformer, TransformerConfig


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------

def kv_cache_bytes(config: TransformerConfig, num_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of keys and values for `num_tokens` positions of one sequence.

    2 (K and V) x L layers x Hkv heads x D values x num_tokens x dtype_bytes. With GQA only the
    Hkv key/value heads are stored, not the H query heads. dtype_bytes: 4 for float32, 2 for
    float16/bfloat16. Raises ValueError unless num_tokens is an integer >= 0 and dtype_bytes
    an integer >= 1.
    Source: Pope et al., "Efficiently Scaling Transformer Inference" (2022), on KV cache size.
    """
    for name, value, low in (("num_tokens", num_tokens, 0), ("dtype_bytes", dtype_bytes, 1)):
        if not s01.is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")
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
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        shape = (num_layers, num_kv_heads, max_seq_len, head_dim)
        self.k = self.allocate(shape, dtype)  # (L, Hkv, S_max, D)
        self.v = self.allocate(shape, dtype)  # (L, Hkv, S_max, D)
        self.layer_lens = [0] * num_layers    # positions filled in each layer

    def allocate(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """Zeroed storage for keys or values (S06 overrides this to allocate on a device)."""
        if not np.issubdtype(np.dtype(dtype), np.floating):
            raise ValueError(f"dtype must be a floating-point type (got {np.dtype(dtype)})")
        return np.zeros(shape, dtype=dtype)

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

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first num_tokens positions in every layer (the rest is forgotten, not
        zeroed). Used to undo a step that failed half-way; speculative decoding (S15) rolls
        back rejected tokens the same way. Raises ValueError unless num_tokens is an integer
        with 0 <= num_tokens <= the positions filled in the fullest layer."""
        if not s01.is_int(num_tokens) or not 0 <= num_tokens <= self.num_cached_max:
            raise ValueError(f"num_tokens must be an integer in [0, {self.num_cached_max}] "
                             f"(got {num_tokens!r})")
        self.layer_lens = [min(n, num_tokens) for n in self.layer_lens]

    @property
    def num_cached_max(self) -> int:
        """Positions filled in the fullest layer (equal to num_cached between steps)."""
        return max(self.layer_lens)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store the keys and values of T new positions of one layer, after the filled ones.

        layer: in [0, L). k, v: (Hkv, T, D), already rotated to their absolute positions.
        Returns this layer's keys and values for all S = filled + T positions, (Hkv, S, D) each:
        views into the cache, not copies. Raises ValueError for a bad layer or shape, or when
        the T positions do not fit (nothing is written then: the cache never overflows).
        """
        if not s01.is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}) (got {layer!r})")
        hkv, d = self.num_kv_heads, self.head_dim
        if k.ndim != 3 or k.shape[0] != hkv or k.shape[2] != d or v.shape != k.shape:
            raise ValueError(f"k and v must both have shape (Hkv={hkv}, T, D={d}); got "
                             f"{k.shape} and {v.shape}")
        return self.write(layer, k, v)

    def write(self, layer: int, k, v):
        """`append` without its argument checks: store k, v (Hkv, T, D) after the filled
        positions of `layer` and return the layer's (Hkv, S, D) views. Still raises ValueError
        when the T positions do not fit (nothing is written then). S06 calls it directly from
        its hot loop, where the shapes are right by construction."""
        start, t_len = self.layer_lens[layer], k.shape[1]
        if start + t_len > self.max_seq_len:
            raise ValueError(f"KV cache is full: layer {layer} holds {start} of "
                             f"{self.max_seq_len} positions and cannot take {t_len} more")
        end = start + t_len
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        self.layer_lens[layer] = end
        return self.k[layer, :, :end], self.v[layer, :, :end]  # (Hkv, S, D) views


# ---------------------------------------------------------------------------------------------
# Prefill and decode: S03's transformer, step by step against the cache
# ---------------------------------------------------------------------------------------------

class CachedTransformer:
    """S03's `Transformer` run incrementally: each step computes only the new tokens.

    A step takes T new token ids, places them at the next T absolute positions, and in every
    layer computes their q, k, v (S03's `block.qkv`, RoPE at the absolute positions), appends k
    and v to the cache, lets the T queries attend to all S = cached + T keys (S03's `attention`,
    causal by position, GQA by head groups) and finishes the layer (`block.finish`). Exactly the
    arithmetic of S03's forward for these rows, minus the rows already done.

    model: a loaded S03 `Transformer` (Qwen3, Llama or GPT-2). max_seq_len: the cache size in
    positions, default the model's max_position_embeddings; the cache is allocated here, once.
    Raises ValueError when max_seq_len is not in [1, max_position_embeddings].
    """

    def __init__(self, model: Transformer, max_seq_len: int | None = None):
        cfg = model.config
        limit = cfg.max_position_embeddings
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not s01.is_int(max_seq_len) or not 1 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be an integer in [1, max_position_embeddings="
                             f"{limit}] (got {max_seq_len!r})")
        self.model = model
        self.cache = self.make_cache(int(max_seq_len))

    def make_cache(self, max_seq_len: int) -> KVCache:
        """The cache, allocated once (S06 allocates it on the model's device)."""
        cfg = self.model.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def step(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run T new tokens after the cached ones; append their K/V. Returns hidden (T, C).

        token_ids: T >= 1 ids in [0, V). Their positions are num_cached .. num_cached + T - 1.
        Raises ValueError (before anything is computed or written) when the T tokens do not fit
        in the cache, or for ids S03's `check_positions` rejects.
        """
        start, t_len = self.cache.num_cached, len(token_ids)
        if start + t_len > self.cache.max_seq_len:
            raise ValueError(f"KV cache is full: it holds {start} of {self.cache.max_seq_len} "
                             f"positions and cannot take {t_len} more")
        ids, positions = self.model.check_positions(token_ids, np.arange(start, start + t_len))
        x = self.model.embed(ids, positions)                             # (T, C)
        try:
            for layer, block in enumerate(self.model.blocks):
                q, k, v = block.qkv(x, positions)    # q (H, T, D); k, v (Hkv, T, D), RoPE'd
                keys, values = self.cache.append(layer, k, v)            # (Hkv, S, D) each
                scale = block.attention_scale() if hasattr(block, "attention_scale") else None
                # Looked up on the module at call time, so count_work() can wrap it.
                attn = s03.attention(q, keys, values, positions, np.arange(keys.shape[1]), scale)
                x = block.finish(x, attn)                                # (T, C)
        except BaseException:
            self.cache.truncate(start)  # all or nothing: no layer keeps half a step
            raise
        return x

    def prefill(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Start a sequence: run the whole prompt in one step, fill the cache, and return the
        logits of the token after the prompt, float32 (V,).

        Only the last position goes through the LM head: the other rows' logits would only be
        thrown away (the S01 loop computed all T of them). Resets the cache first.
        Raises ValueError for an empty prompt or one longer than the cache (max_seq_len), and
        for ids S03's `check_positions` rejects (None, 2.7, True: never truncated to an id).
        """
        if not hasattr(prompt_ids, "__len__") or isinstance(prompt_ids, (str, bytes)):
            raise ValueError(f"prefill needs a sequence of token ids (got "
                             f"{type(prompt_ids).__name__})")
        if len(prompt_ids) == 0:
            raise ValueError("prefill needs at least one prompt token")
        if len(prompt_ids) > self.cache.max_seq_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens but the KV cache holds "
                             f"{self.cache.max_seq_len} positions (max_seq_len)")
        self.cache.reset()
        hidden = self.step(prompt_ids)                                  # (T, C)
        return self.model.head(hidden[-1:])[0].astype(np.float32, copy=False)  # (V,)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one new token at position num_cached against the cache; return the logits of
        the token after it, float32 (V,). The S01 loop's `forward(ids)[-1]`, for 1 row of work
        instead of len(ids). Raises ValueError when token_id is not an integer in [0, V),
        nothing was prefilled, or the cache is full.
        """
        if not s01.is_int(token_id) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id must be an integer in [0, V={self.vocab_size}) "
                             f"(got {token_id!r})")
        if self.cache.num_cached == 0:
            raise ValueError("decode needs a prefilled cache: call prefill(prompt_ids) first")
        hidden = self.step([int(token_id)])                             # (1, C)
        return self.model.head(hidden)[0].astype(np.float32, copy=False)  # (V,)


# ---------------------------------------------------------------------------------------------
# The engine: S04's, with the model step answered from the cache
# ---------------------------------------------------------------------------------------------

class Engine(s04.Engine):
    """S04's engine (SamplingParams, stop rules, streaming, logprobs) on a KV cache.

    model: an S03 `Transformer`; tokenizer, max_context, logprobs_mode: as in S04. The cache is
    allocated for max_context positions, so a full context ends the request (S01's stop rule,
    finish_reason "length") before the cache could overflow; a prompt longer than max_context
    is a ValueError. Raises ValueError for a model that is not an S03 `Transformer`
    (`model_class`; S06 sets its own) and when max_context exceeds the model's
    max_position_embeddings.

    Only `model_step` changes, and it knows from the engine's own state what to run: the
    request whose keys and values the cache holds (`cache_owner`) and how many of its tokens
    they cover (`seq.num_computed_tokens`). When the cache holds all but the newest token, that
    token is decoded (T = 1); otherwise (a new request, or another request used the cache in
    between) the whole context is prefilled. No id list is compared, so a step costs O(1) on
    the host whatever the length.
    """

    runner_class = CachedTransformer
    model_class = Transformer

    def __init__(self, model: Transformer, tokenizer, max_context: int,
                 logprobs_mode: str = "raw_logprobs"):
        if not isinstance(model, self.model_class):
            raise ValueError(f"model must be a {self.model_class.__name__} (got "
                             f"{type(model).__name__}): the KV cache is filled layer by layer")
        super().__init__(model, tokenizer, max_context, logprobs_mode)
        self.runner = self.runner_class(model, max_seq_len=self.max_context)
        self.cache_owner: s01.Sequence | None = None   # whose K/V the cache holds

    def model_step(self, seq: s01.Sequence):
        """Raw logits (V,) for the token after seq.token_ids, computing only what is not cached."""
        if self.cache_owner is seq and seq.num_computed_tokens == len(seq.token_ids) - 1:
            logits = self.runner.decode(self.decode_input(seq))   # the usual step: one token
        else:
            self.cache_owner = None         # prefill overwrites the cache: if it fails,
            logits = self.runner.prefill(seq.token_ids)   # nobody owns a half-written cache
            self.cache_owner = seq
        seq.num_computed_tokens = len(seq.token_ids)
        return logits

    def decode_input(self, seq: s01.Sequence):
        """The newest token as the runner takes it (S06 keeps it on the device)."""
        return seq.token_ids[-1]


# ---------------------------------------------------------------------------------------------
# Counted work: multiply-adds and K/V bytes, by instrument and by formula
# ---------------------------------------------------------------------------------------------

@dataclass
class Work:
    """Work of one or more forward steps.

    weight_macs: multiply-adds of products with a weight matrix (projections, MLP, LM head).
    attention_macs: multiply-adds of q k^T and probs v (the causal mask is applied after the
    product, so masked pairs are computed too, as in S03 and in HF's eager attention).
    kv_bytes_read: bytes of the keys and values attention read (K and V, every layer).
    One multiply-add is 2 FLOPs.
    """

    weight_macs: int = 0
    attention_macs: int = 0
    kv_bytes_read: int = 0

    @property
    def macs(self) -> int:
        return self.weight_macs + self.attention_macs

    def __add__(self, other: "Work") -> "Work":
        return Work(self.weight_macs + other.weight_macs,
                    self.attention_macs + other.attention_macs,
                    self.kv_bytes_read + other.kv_bytes_read)


def matmul_macs(a_shape: Sequence[int], b_shape: Sequence[int]) -> int:
    """Multiply-adds of np.matmul on arrays of these shapes: (..., M, K) @ (..., K, N) costs
    batch x M x K x N, batch the product of the broadcast leading dimensions. A 1-D operand
    counts as one row (a) or one column (b), as matmul treats it."""
    a_shape = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b_shape = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    return math.prod(batch) * a_shape[-2] * a_shape[-1] * b_shape[-1]


class CountingArray(np.ndarray):
    """A view of an array that adds to a `Work` counter every matrix product it enters.

    NumPy routes `a @ b` through the ufunc np.matmul, which hands control to
    `__array_ufunc__` of a subclass operand: the product is counted, then computed on plain
    arrays, so results are ordinary arrays and nothing downstream is slowed or counted twice.
    Views (`.T`, slices, reshapes) of a CountingArray keep counting into the same counter.
    """

    work: Work | None = None

    def __array_finalize__(self, obj) -> None:
        self.work = getattr(obj, "work", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = tuple(x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, CountingArray) else o
                                  for o in kwargs["out"])
        if ufunc is np.matmul and method == "__call__" and self.work is not None:
            macs = matmul_macs(np.shape(plain[0]), np.shape(plain[1]))
            if any(isinstance(x, KVArray) for x in inputs[:2]):
                self.work.attention_macs += macs
            else:
                self.work.weight_macs += macs
        return getattr(ufunc, method)(*plain, **kwargs)


class KVArray(CountingArray):
    """A CountingArray holding keys or values: its products count as attention work."""


def _counting(array: np.ndarray | None, work: Work, kind: type = CountingArray):
    if array is None:
        return None
    view = array.view(kind)
    view.work = work
    return view


@contextmanager
def count_work(model: Transformer) -> Iterator[Work]:
    """Count the work of every forward pass of `model` run inside the `with` block.

    Yields a `Work` that grows as the model runs, whether through S03's uncached
    `forward` (the S01 loop) or through `CachedTransformer` (this chapter's engine). How: the
    model's weights are swapped for `CountingArray` views (same memory, no copy), and S03's
    `attention` is wrapped to add the bytes of the K and V it is given and to tag them as
    `KVArray`, so its two products count as attention. Everything is restored on exit, even
    after an error. Not thread-safe (it patches a module function); for tests and notebooks.
    """
    work = Work()
    saved_arrays = (model.embed_tokens, model.embed_positions, model.final_norm, model.lm_head)
    saved_block_weights = [block.w for block in model.blocks]
    original_attention = s03.attention

    def counted_attention(q, k, v, *args, **kwargs):
        work.kv_bytes_read += k.nbytes + v.nbytes   # (Hkv, S, D) each: what this step reads
        return original_attention(q, _counting(k, work, KVArray), _counting(v, work, KVArray),
                                  *args, **kwargs)

    try:
        model.embed_tokens = _counting(model.embed_tokens, work)
        model.embed_positions = _counting(model.embed_positions, work)
        model.final_norm = tuple(_counting(a, work) for a in model.final_norm)
        model.lm_head = _counting(saved_arrays[3], work)
        for block in model.blocks:
            block.w = {name: _counting(a, work) for name, a in block.w.items()}
        s03.attention = counted_attention
        yield work
    finally:
        s03.attention = original_attention
        model.embed_tokens, model.embed_positions, model.final_norm, model.lm_head = saved_arrays
        for block, weights in zip(model.blocks, saved_block_weights):
            block.w = weights


def step_work(config: TransformerConfig, new_tokens: int, context_len: int, logit_rows: int,
              dtype_bytes: int = 4) -> Work:
    """Closed-form work of one forward step: T = new_tokens tokens through every layer, their
    queries against S = context_len keys (the T new included), and the LM head on logit_rows
    rows.

    Per token per layer the weights cost C (H + 2 Hkv) D (q, k, v) + H D C (o) + 3 C I (SwiGLU;
    2 C I for GPT-2's MLP) multiply-adds; attention costs 2 H D T S (scores and weighted sum)
    and reads 2 Hkv D S values; the head costs C V per row. Raises ValueError unless
    1 <= new_tokens <= context_len and 0 <= logit_rows <= new_tokens.
    """
    if not 1 <= new_tokens <= context_len:
        raise ValueError(f"need 1 <= new_tokens <= context_len (got {new_tokens}, {context_len})")
    if not 0 <= logit_rows <= new_tokens:
        raise ValueError(f"need 0 <= logit_rows <= new_tokens (got {logit_rows}, {new_tokens})")
    cfg = config
    c, d, h, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    mlp_mats = 2 if cfg.model_type == "gpt2" else 3
    per_token_layer = c * (h + 2 * hkv) * d + h * d * c + mlp_mats * c * cfg.intermediate_size
    layers = cfg.num_hidden_layers
    return Work(weight_macs=layers * new_tokens * per_token_layer + logit_rows * c * cfg.vocab_size,
                attention_macs=layers * 2 * h * d * new_tokens * context_len,
                kv_bytes_read=layers * 2 * hkv * d * context_len * dtype_bytes)


def generation_work(config: TransformerConfig, prompt_len: int, passes: int, cached: bool,
                    dtype_bytes: int = 4) -> list[Work]:
    """Closed-form work of each pass of a generation of `passes` passes after a prompt of
    `prompt_len` tokens. Pass i reads a context of n = prompt_len + i tokens.

    Uncached (the S01 loop): every pass runs all n tokens and the head on all n rows, so the
    weight work grows like n and attention like n^2 per pass. Cached: pass 0 is the prefill
    (n tokens, head on 1 row), every later pass a decode (1 token against n keys).
    Raises ValueError for prompt_len < 1 or passes < 0.
    """
    if prompt_len < 1 or passes < 0:
        raise ValueError(f"need prompt_len >= 1 and passes >= 0 (got {prompt_len}, {passes})")
    work = []
    for i in range(passes):
        n = prompt_len + i
        if not cached:
            work.append(step_work(config, n, n, n, dtype_bytes))
        elif i == 0:
            work.append(step_work(config, n, n, 1, dtype_bytes))
        else:
            work.append(step_work(config, 1, n, 1, dtype_bytes))
    return work


# ---------------------------------------------------------------------------------------------
# The cost comparison and main
# ---------------------------------------------------------------------------------------------

def format_work_table(config: TransformerConfig, prompt_len: int, passes: int,
                      max_rows: int = 16) -> str:
    """Closed-form work per pass and in total, the S01 loop (no cache) next to this engine,
    as aligned text. Shows every pass when there are at most `max_rows`, else the first and the
    last max_rows // 2 with '...' between, as S01's `format_cost_table` does; the totals count
    every pass."""
    uncached = generation_work(config, prompt_len, passes, cached=False)
    cached = generation_work(config, prompt_len, passes, cached=True)
    half = max_rows // 2
    shown = list(range(passes)) if passes <= max_rows else \
        [*range(half), None, *range(passes - half, passes)]
    lines = [f"{'pass':>5} {'context n':>10} {'MACs, no cache':>16} {'MACs, cache':>14} "
             f"{'ratio':>7} {'K/V bytes read (both)':>22}"]
    for i in shown:
        if i is None:
            lines.append(f"{'...':>5}")
            continue
        u, c = uncached[i], cached[i]
        lines.append(f"{i + 1:>5} {prompt_len + i:>10} {u.macs:>16,} {c.macs:>14,} "
                     f"{u.macs / c.macs:>6.1f}x {c.kv_bytes_read:>22,}")
    total_u, total_c = sum(uncached, Work()), sum(cached, Work())
    if passes:
        lines.append(f"{'total':>5} {'':>10} {total_u.macs:>16,} {total_c.macs:>14,} "
                     f"{total_u.macs / total_c.macs:>6.1f}x {total_c.kv_bytes_read:>22,}")
    lines.append("(pass 1 is the prefill; MACs = multiply-adds of all matmuls; both engines read "
                 "the same K/V per pass, the loop without a cache recomputes it first)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 5: generation with a KV cache, and what it saves.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory or Hugging Face hub id (default: bundled model)")
    parser.add_argument("--prompt", default="ROMEO.\n", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="cache size in tokens, at most the model's context window "
                             "(max_position_embeddings) (default: that window, capped at 2048)")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the run without a cache (it can be slow on long outputs)")
    args = parser.parse_args(argv)
    try:
        s01.check_text(args.prompt, "--prompt")  # argv bytes that are not UTF-8: surrogates
    except ValueError as err:
        parser.error(str(err))
    if args.max_context is not None and args.max_context < 1:
        parser.error(f"--max-context must be >= 1 (got {args.max_context})")

    try:
        model, tokenizer = s03_checkpoint.load(args.model)
    except ValueError as err:  # S03's CheckpointError, or a corrupt file's own ValueError
        hint = (" (the bundled model is written by scripts/train_bundled_model.py)"
                if args.model == str(s03.BUNDLED_MODEL_DIR) else "")
        parser.error(f"{err}{hint}")
    cfg = model.config
    if args.max_context is not None and args.max_context > cfg.max_position_embeddings:
        parser.error(f"--max-context must be at most the model's context window, "
                     f"max_position_embeddings = {cfg.max_position_embeddings} "
                     f"(got {args.max_context})")
    max_context = (min(cfg.max_position_embeddings, 2048) if args.max_context is None
                   else args.max_context)
    try:
        params = s04.SamplingParams(temperature=args.temperature, seed=args.seed,
                                    max_tokens=args.max_tokens)
        engine = Engine(model, tokenizer, max_context)
        start = time.perf_counter()
        completion = engine.generate(args.prompt, params)
        cached_s = time.perf_counter() - start
    except ValueError as err:
        parser.error(str(err))
    s = completion.stats
    print(f"{args.model}: {cfg.model_type}, L={cfg.num_hidden_layers}, H={cfg.num_attention_heads}, "
          f"Hkv={cfg.num_key_value_heads}, D={cfg.head_dim}, V={cfg.vocab_size}")
    print(f"KV cache: {kv_cache_bytes(cfg, 1):,} bytes per token (float32), "
          f"{engine.runner.cache.nbytes:,} bytes reserved for {max_context} tokens, "
          f"{kv_cache_bytes(cfg, engine.runner.cache.num_cached):,} used")
    print("--- prompt ---\n" + args.prompt)
    print("--- completion ---\n" + completion.text)
    print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
          f"{s.passes} passes (1 prefill of {s.prompt_tokens} tokens, {max(s.passes - 1, 0)} "
          f"decodes) ---\n")
    if not args.no_compare:
        start = time.perf_counter()
        reference = s04.Engine(model, tokenizer, max_context).generate(args.prompt, params)
        uncached_s = time.perf_counter() - start
        same = "the same tokens" if reference.token_ids == completion.token_ids else \
            "DIFFERENT tokens (a bug: please report it)"
        print(f"wall time: {cached_s:.2f} s with the cache, {uncached_s:.2f} s without "
              f"({uncached_s / cached_s:.1f}x), {same}. (One run, noisy; short contexts "
              "gain little. benchmarks/bench_s05_kv_cache.py measures step by step.)\n")
    print(format_work_table(cfg, s.prompt_tokens, s.passes))


if __name__ == "__main__":
    main()
