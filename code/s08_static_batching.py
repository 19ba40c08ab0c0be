r"""S08, static batching: many requests in one forward pass; padding, masks and position ids.

What is new since S07
    Part I served one request at a time, so a decode step multiplied every weight matrix by a
    single row. Reading the weights costs the same for one row as for sixty-four, so the cheapest
    way to serve many requests is to stack them: B requests, one forward pass, B new tokens.
    This chapter does that in the simplest way, a *static* batch: B prompts go in together, run
    together until the last one finishes, and come out together.

    - Left padding (`left_pad`): prompts of different lengths become one (B, T) block of ids,
      each row padded on the left up to the longest, with a bool mask of the real tokens. On the
      left, because then the last column holds every row's newest token: one LM-head row per
      request, and decode steps append one column for all rows at once.
    - Position ids from the mask (`position_ids_from_mask`): a row's first real token is at
      position 0, whatever its padding, and each decode step adds 1 per row. With the shared
      column index instead, a padded row's tokens sit at positions shifted by its padding
      (unsloth #3699); RoPE models hide a uniform shift in attention scores, GPT-2's learned
      positions do not, so the tests run both families.
    - The attention mask (`attention_allowed`): causal in columns, and no query ever sees a
      padding key. A padding query sees its own key only, so no softmax row is all -inf (which
      would be NaN) even in a column that is all padding for some row.
    - A batched KV cache (`BatchKVCache`): (L, B, Hkv, S, D), one row (slot) per request, sized
      for this batch when it starts, so no write can run past it (swarmllm #31).
    - `BatchRunner`: S06's `TorchTransformer` run on the (B, T) block: S06's own layer code
      (`qkv`, `finish`, `head`) over the B x T tokens flattened, with batched masked attention
      in between. Prefill is one pass over (B, T); a decode step one pass over (B, 1). Each
      batch makes its own runner and cache (the engine holds only the model), so streams of
      one engine may be advanced in any interleaving, each giving what it gives alone.
    - `Engine.generate(prompts, params)`: one Part I `Sequence` per prompt, made by Part I's
      seams (its detokenizer, stop matcher, stop ids, S06's `DeviceSampler` and seeded
      generator), finished by Part I's `postprocess` and `stop_rule`, returned as Part I's
      `Completion`s, one per prompt, in order. A finished row produces nothing more but keeps
      its slot, and keeps being computed, until the whole batch ends. `BatchStats`
      (`engine.last_batch`) counts that waste step by step: useful token slots, padding slots,
      finished rows idling.
    - Batch variance. A row computed in a batch of B and alone differs in the last bits, because
      a matrix product's summation order depends on how many rows it has (BLAS picks its
      blocking and kernels by shape). `batch_invariant=True` computes every row's products
      alone, with exactly the shapes the single-request S06 engine uses, so a row's logits are
      bitwise those of the request run alone; slow, it is the reference tests check the
      batching logic against exactly. The sibling `s08_batch_variance.py` holds the fast mode
      to it (`follows_batch_rule`: greedy tokens equal up to the first step where the
      reference's top-2 logit gap is under `BATCH_TOLERANCE`) and measures the largest logit
      difference per B (`measure_batch_variance`).
    - The command line every Part II script shares (`add_request_arguments`, its checks, the
      corpus prompts, the table helpers) is the sibling `s08_cli.py`.

What it does not handle yet
    Requests that arrive while a batch runs: they wait for the whole batch (S09 schedules per
    step, continuous batching). A finished row keeps its slot and its compute to the end, and
    padding costs full compute in prefill and masked keys in every decode step: ragged batches
    (S09) remove both. The cache is allocated per batch for its longest possible row (S12
    pages it). One row's error (a NaN row, a penalty overflow) fails the whole batch
    (`RowsRefused`; S09's engine ends that request alone: the failed call leaves every row's
    sampler, random stream included, as it was, so the others sample again as they would have). A request whose prompt already fills the context finishes on arrival
    (Part I's rule: "length", no token) and takes no row.

Run it
    python code/s08_static_batching.py                          # 8 corpus prompts, bundled model
    python code/s08_static_batching.py --prompt "O Romeo, Romeo! wherefore art thou" \
        --prompt "To be, or not" --max-tokens 30
    python code/s08_static_batching.py --batch-invariant --num-prompts 4
    python benchmarks/bench_s08_static_batching.py --quick      # tokens/s against B, vs HF

Tests
    tests/test_s08_static_batching.py: padding, masks and position ids by hand; each row's
    greedy tokens equal to the S05 engine and to HF `generate` alone, and to HF's left-padded
    batched `generate`, on the bundled model and tiny random GPT-2, Qwen3 and Llama, prompt
    lengths 1 to the context limit, B = 1, 2, 3, 8, 32; batch-invariant mode bitwise equal to
    the request alone (logits) and to the S06 engine (whole completions); permuted batches,
    seeds independent of batch mates, a failed step that moves no row's random stream, no NaN
    in padded rows; the waste counts against closed forms; the public bugs E1, E2, E4, F1, F6
    as regression tests; every bad input; streams interleaved, interrupted and closed.
    tests/test_s08_properties.py: hypothesis over prompt lengths, batch compositions, stop
    settings and the interleaving of two streams.
    tests/test_parity.py runs this engine in the parity chain.

References
    Hugging Face transformers `generate()` with `padding_side="left"` and position ids from the
    attention mask (`cumsum(-1) - 1`), the behaviour the tests compare against. Orca (Yu et
    al., OSDI 2022) for iteration-level scheduling, the fix for static batching's idle rows, and
    vLLM (Kwon et al., SOSP 2023) for paged KV memory: S09 and S12. Thinking Machines, "Defeating
    Nondeterminism in LLM Inference" (He et al., 2025) on batch invariance.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size, N = B x T.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

import s01_generation_loop as s01
import s03_transformer as s03
import s06_torch as s06
from s06_sampler import BAD_ROW_ERRORS, BAD_ROW_PARAMETERS, compute_logprobs
from s08_cli import add_request_arguments, check_request_arguments, corpus_prompts, elide

DEFAULT_MAX_BATCH_SIZE = 32


# ---------------------------------------------------------------------------------------------
# The batch as tensors: left padding, position ids, the attention mask
# ---------------------------------------------------------------------------------------------

def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: str | torch.device = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts of token ids as one block, padded on the left to the longest (T tokens).

    Returns ids int64 (B, T) (pad_id in the padding) and mask bool (B, T), True on real tokens.
    Raises ValueError for no prompts or an empty one.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad needs at least one prompt, each with at least one token")
    t_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t_len), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), t_len), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, t_len - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.int64)
        mask[row, t_len - len(prompt):] = True
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids int64 (B, T) from a bool mask (B, T) of real tokens: a row's first real
    token is at 0, the next at 1, ...; padding gets 0 (any valid position would do: it is
    masked). HF's rule in `generate`: cumsum(mask) - 1, padding filled."""
    positions = mask.long().cumsum(-1) - 1                  # (B, T)
    return positions.masked_fill(~mask, 0)


def attention_allowed(key_is_real: torch.Tensor, q_start: int, t_len: int) -> torch.Tensor:
    """Which key column each query may see: bool (B, T, S), S = q_start + T.

    key_is_real: bool (B, S'), S' >= S, True where a column holds a real token (padding is
    False). Queries are columns q_start .. q_start + T - 1. A query sees key s when s is not
    after it (causal) and s is real; it always sees itself, so a padding query has one key
    and its softmax row is finite (all -inf would give NaN, transformers #25790's setting).
    """
    s_len = q_start + t_len
    device = key_is_real.device
    q_cols = torch.arange(q_start, s_len, device=device)[:, None]    # (T, 1)
    k_cols = torch.arange(s_len, device=device)[None, :]             # (1, S)
    causal = k_cols <= q_cols                                        # (T, S)
    return causal[None] & (key_is_real[:, None, :s_len] | (k_cols == q_cols)[None])  # (B, T, S)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`attention_allowed`'s bool mask as what attention adds to the scores: 0 where a key is
    visible, -inf where it is hidden, in `dtype` (the activations'). SDPA turns a bool mask
    into this on every call, so a step builds it once and hands it to every layer."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float, impl: str = "manual") -> torch.Tensor:
    """Grouped-query attention of B rows with an explicit mask.

    q: (B, H, T, D); k, v: (B, Hkv, S, D); allowed: bool (B, T, S) from `attention_allowed`,
    or that mask as `additive_mask` made it (in q's dtype), or None when every query may see
    every key (a decode step in a batch without padding).
    impl "manual": S06's hand-written attention with a batch axis (scores in the activations'
    dtype, softmax in float32); the H / Hkv query heads that share a key head are stacked
    along T, so each (row, key head) is one matrix product and no key is copied per group.
    "sdpa": `scaled_dot_product_attention` with the mask. A decode step (T = 1) is S06's
    `decode_attention`, the query groups stacked as rows, for both. Query head h reads key head
    h // (H / Hkv), HF's repeat_kv order. Returns (B, H, T, D).
    """
    batch, n_heads, t_len, head_dim = q.shape
    n_kv_heads = k.shape[1]
    mask = allowed
    if mask is not None and mask.dtype == torch.bool:
        mask = additive_mask(allowed, q.dtype)                           # (B, T, S)
    if t_len == 1:
        return s06.decode_attention(q, k, v, scale, impl,
                                    None if mask is None else mask[:, None])  # (B, 1, 1, S)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, None], scale=scale,
            enable_gqa=n_heads != n_kv_heads)                            # mask (B, 1, T, S)
    group = n_heads // n_kv_heads
    q_stacked = q.reshape(batch, n_kv_heads, group * t_len, head_dim)   # (B, Hkv, H/Hkv T, D)
    scores = (q_stacked @ k.transpose(-1, -2)) * scale                  # (B, Hkv, H/Hkv T, S)
    scores = scores.view(batch, n_kv_heads, group, t_len, -1)           # (B, Hkv, H/Hkv, T, S)
    if mask is not None:
        scores = scores + mask[:, None, None]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = probs.view(batch, n_kv_heads, group * t_len, -1) @ v          # (B, Hkv, H/Hkv T, D)
    return out.view(batch, n_heads, t_len, head_dim)


def embed(model: s06.TorchTransformer, ids: torch.Tensor, positions: torch.Tensor):
    """S06's embedding for tokens at explicit positions: ids, positions int64 (N,). Returns
    x (N, C) and the RoPE cos, sin (N, D) (None, None for GPT-2, which adds learned positions
    instead). Raises ValueError for an id outside [0, V) (on the CPU, before anything is
    cached; CUDA asserts on the device instead)."""
    x = model.embed_ids(ids)                                               # (N, C)
    if model.embed_positions is not None:
        return x + model.embed_positions[positions], None, None
    return x, model.cos[positions], model.sin[positions]


# ---------------------------------------------------------------------------------------------
# The batched KV cache: one row (slot) per request
# ---------------------------------------------------------------------------------------------

class BatchKVCache:
    """Keys and values of B sequences that advance together: k, v (L, B, Hkv, S_max, D).

    Column c of every row holds the token that column c of the batch held: with left padding
    the first columns of a short row are padding (never read: the mask hides them). All rows
    have the same number of filled columns (`num_cols`), since a static batch adds one column
    to every row per step. Sized once, for the batch's longest possible run; `write` refuses
    to go past it (nothing is written then). Raises ValueError for sizes < 1.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_cols: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size),
                            ("num_kv_heads", num_kv_heads), ("max_cols", max_cols),
                            ("head_dim", head_dim)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        shape = (num_layers, batch_size, num_kv_heads, max_cols, head_dim)
        # Zeroed, not empty: a column is always written before it is read, but stale NaN bits
        # in memory times a probability of 0 would still be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # (L, B, Hkv, S_max, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)   # (L, B, Hkv, S_max, D)
        self.layer_cols = [0] * num_layers

    @property
    def max_cols(self) -> int:
        return self.k.shape[3]

    @property
    def num_cols(self) -> int:
        """Columns filled in every layer (all layers agree between steps)."""
        return min(self.layer_cols)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: slice | int = slice(None),
              start: int | None = None) -> None:
        """Store keys and values of T columns from column `start` (default: after the filled
        ones): k, v (B, Hkv, T, D) for all rows, or (Hkv, T, D) for one row. Raises ValueError
        when the columns do not fit."""
        start = self.layer_cols[layer] if start is None else start
        end = start + k.shape[-2]
        if end > self.max_cols:
            raise ValueError(f"batch KV cache is full: layer {layer} has {self.max_cols} columns "
                             f"and cannot take columns {start}..{end - 1}")
        self.k[layer, rows, :, start:end] = k
        self.v[layer, rows, :, start:end] = v

    def advance(self, layer: int, num_cols: int) -> None:
        """Mark `num_cols` more columns of `layer` as filled."""
        self.layer_cols[layer] += num_cols


# ---------------------------------------------------------------------------------------------
# The model on a batch
# ---------------------------------------------------------------------------------------------

class BatchRunner:
    """S06's `TorchTransformer` run on B sequences at once, against a `BatchKVCache`.

    `prefill(prompts, max_new_tokens)` left-pads the prompts to (B, T), allocates the cache for
    T + max_new_tokens - 1 columns, runs the block and returns the logits of each row's next
    token, float32 (B, V) on the device. `decode(tokens)` runs one token per row, int64 (B,)
    on the device, at each row's next position, and returns (B, V) again.

    Fast mode: the B x T tokens go through S06's own layer code flattened to N = B x T rows
    (`qkv`, `finish`, `head`: every weight product sees N rows), with `batched_attention` in
    between. Batch-invariant mode (`batch_invariant=True`): each row runs alone, its real tokens
    only, through the same layer code and S06's single-request `attention` on its own cached
    keys, with exactly the shapes S06's engine uses, so its logits are bitwise those of the
    request run alone; rows in `active` False are skipped (their logits are zeros: nobody reads
    them). max_seq_len: the most positions a row may reach (the engine's max_context).
    """

    def __init__(self, model: s06.TorchTransformer, max_seq_len: int | None = None,
                 batch_invariant: bool = False, pad_id: int = 0):
        limit = model.config.max_position_embeddings
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not s01.is_int(max_seq_len) or not 1 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be an integer in [1, max_position_embeddings="
                             f"{limit}] (got {max_seq_len!r})")
        self.model = model
        self.max_seq_len = int(max_seq_len)
        self.batch_invariant = bool(batch_invariant)
        self.pad_id = pad_id
        self.cache: BatchKVCache | None = None
        self.key_is_real: torch.Tensor | None = None   # bool (B, S_max)
        self.pad_lens: list[int] = []                   # padding columns per row
        self.unpadded = True                            # no row has padding
        self.positions: torch.Tensor | None = None      # int64 (B,): each row's last position

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                active: Sequence[bool] | None = None) -> torch.Tensor:
        """Start a batch: B prompts (token id lists), each row allowed up to max_new_tokens
        generated tokens. Returns float32 (B, V) on the device. Raises ValueError for a bad
        id, a prompt longer than max_seq_len, or max_new_tokens < 1."""
        model = self.model
        if not s01.is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
        for prompt in prompts:
            if len(prompt) > self.max_seq_len:
                raise ValueError(f"prompt is {len(prompt)} tokens but a row holds "
                                 f"{self.max_seq_len} positions (max_seq_len)")
            model.check_ids(prompt)       # S03's id rules, before anything runs
        ids, mask = left_pad(prompts, self.pad_id, model.device)            # (B, T) each
        batch, t_len = ids.shape
        cfg = model.config
        self.cache = BatchKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads,
                                  t_len + max_new_tokens - 1, cfg.head_dim, model.dtype,
                                  model.device)
        self.key_is_real = torch.ones((batch, self.cache.max_cols), dtype=torch.bool,
                                      device=model.device)
        self.key_is_real[:, :t_len] = mask
        self.pad_lens = [t_len - len(p) for p in prompts]
        self.unpadded = not any(self.pad_lens)
        positions = position_ids_from_mask(mask)                             # (B, T)
        self.positions = positions[:, -1].clone()
        return self.step(ids, positions, active)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, active: Sequence[bool] | None = None) -> torch.Tensor:
        """One token per row (int64 (B,) on the device) at each row's next position. A row may
        be past its last position (a finished row idling): its position stays at the model's
        last one, so the lookup stays in range; nobody reads its logits. Returns (B, V)."""
        if self.cache is None:
            raise ValueError("decode needs a prefilled batch: call prefill(prompts) first")
        limit = self.model.config.max_position_embeddings
        self.positions = (self.positions + 1).clamp_(max=limit - 1)
        return self.step(tokens[:, None], self.positions[:, None], active)

    def release(self) -> None:
        """Forget the batch: its cache and per-row state go (the runner can prefill again)."""
        self.cache = self.key_is_real = self.positions = None
        self.pad_lens, self.unpadded = [], True

    def step(self, ids: torch.Tensor, positions: torch.Tensor,
             active: Sequence[bool] | None) -> torch.Tensor:
        """ids, positions: int64 (B, T) for the next T columns. Returns float32 (B, V)."""
        if self.batch_invariant:
            return self._rows_alone(ids, positions, active)
        return self._batched(ids, positions)

    def _batched(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        model, cache = self.model, self.cache
        batch, t_len = ids.shape
        cfg = model.config
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        start = cache.num_cols
        end = start + t_len
        if t_len > 1:
            allowed = attention_allowed(self.key_is_real, start, t_len)      # (B, T, S)
        else:   # a decode query is the newest column: it may see every real key
            allowed = None if self.unpadded else self.key_is_real[:, None, :end]   # (B, 1, S)
        if allowed is not None:   # once per step, not once per layer inside SDPA
            allowed = additive_mask(allowed, model.dtype)
        x, cos, sin = embed(model, ids.reshape(-1), positions.reshape(-1))         # (N, C)
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv(x, cos, sin)           # q (H, N, D); k, v (Hkv, N, D)
            cache.write(layer, k.reshape(hkv, batch, t_len, d).transpose(0, 1),
                        v.reshape(hkv, batch, t_len, d).transpose(0, 1))
            cache.advance(layer, t_len)
            attn = batched_attention(q.reshape(h, batch, t_len, d).transpose(0, 1),
                                     cache.k[layer, :, :, :end], cache.v[layer, :, :, :end],
                                     allowed, block.scale, model.attention_impl)  # (B, H, T, D)
            attn = attn.transpose(1, 2).reshape(batch * t_len, h, d).transpose(0, 1)  # (H, N, D)
            x = block.finish(x, attn)                                        # (N, C)
        return model.head(x.view(batch, t_len, -1)[:, -1])                  # (B, V)

    def _rows_alone(self, ids: torch.Tensor, positions: torch.Tensor,
                    active: Sequence[bool] | None) -> torch.Tensor:
        model, cache = self.model, self.cache
        batch, t_len = ids.shape
        start = cache.num_cols
        end = start + t_len
        logits = torch.zeros((batch, self.vocab_size), dtype=torch.float32, device=model.device)
        for row in range(batch):
            if active is not None and not active[row]:
                continue
            pad = self.pad_lens[row]
            first = max(start, pad)              # the row's first real column in this step
            x, cos, sin = embed(model, ids[row, first - start:], positions[row, first - start:])
            for layer, block in enumerate(model.blocks):
                q, k, v = block.qkv(x, cos, sin)   # q (H, T_row, D); k, v (Hkv, T_row, D)
                cache.write(layer, k, v, rows=row, start=first)
                keys = cache.k[layer, row, :, pad:end]                      # (Hkv, S_row, D)
                values = cache.v[layer, row, :, pad:end]
                attn = s06.attention(q, keys, values, first - pad, block.scale,
                                     model.attention_impl)                  # (H, T_row, D)
                x = block.finish(x, attn)
            logits[row] = model.head(x[-1:])[0]
        for layer in range(len(model.blocks)):
            cache.advance(layer, t_len)
        return logits


# ---------------------------------------------------------------------------------------------
# What a static batch wastes, step by step
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepWaste:
    """One forward pass of a static batch, in token slots (one slot = one row x one column
    computed). kind "prefill" (B x T slots) or "decode" (B x 1). useful: slots of requests
    still running; padding: slots of left padding; idle: slots of rows already finished.
    masked_keys: in a decode step, the padding key columns the fast mode's attention reads and
    masks out, summed over rows (every decode step reads all of a row's padding columns again,
    so it is sum(BatchStats.padding)); 0 in the prefill, whose padding is counted in `padding`
    as whole slots instead. model_s / step_s: wall seconds of the forward pass / of the whole
    step (sampling, stop rules, text included)."""

    kind: str
    rows: int
    columns: int
    useful: int
    padding: int
    idle: int
    masked_keys: int
    model_s: float
    step_s: float

    @property
    def slots(self) -> int:
        return self.rows * self.columns


@dataclass
class BatchStats:
    """The waste table of one static batch (`Engine.last_batch`, `BatchStream.stats`).

    prompt_tokens[i], output_tokens[i]: row i's prompt and generated lengths; padding[i]: its
    left-padding columns (T - prompt_tokens[i]); steps: one `StepWaste` per forward pass, the
    prefill first. Rows are the requests that entered the forward pass, in order (a request
    finished on arrival takes no row). Totals are sums over steps; `useful_fraction` is the
    share of computed token slots that belonged to a running request.
    """

    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    padding: list[int] = field(default_factory=list)
    steps: list[StepWaste] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.prompt_tokens)

    @property
    def slots(self) -> int:
        return sum(s.slots for s in self.steps)

    @property
    def useful(self) -> int:
        return sum(s.useful for s in self.steps)

    @property
    def padding_slots(self) -> int:
        return sum(s.padding for s in self.steps)

    @property
    def idle(self) -> int:
        return sum(s.idle for s in self.steps)

    @property
    def useful_fraction(self) -> float:
        return self.useful / self.slots if self.slots else 1.0

    @property
    def decode_row_steps(self) -> int:
        """Row-steps of all decode passes (B per pass)."""
        return sum(s.rows for s in self.steps if s.kind == "decode")

    @property
    def idle_row_steps(self) -> int:
        """Decode row-steps spent on rows that had already finished."""
        return sum(s.idle for s in self.steps if s.kind == "decode")

    def timeline(self) -> list[str]:
        """One string per row over the cache columns the batch computed: '.' padding, 'P' a
        prompt token, 'G' a generated token fed back, '-' a column computed for a finished row.
        (The last generated token of each row is never fed back, so it has no column.)"""
        decode_steps = sum(1 for s in self.steps if s.kind == "decode")
        return ["." * pad + "P" * n_prompt + "G" * (n_out - 1) + "-" * (decode_steps - n_out + 1)
                for pad, n_prompt, n_out in zip(self.padding, self.prompt_tokens,
                                                self.output_tokens)]


def format_waste_table(stats: BatchStats, max_rows: int = 12) -> str:
    """The waste table as aligned text: every step when there are at most max_rows, else the
    first and last max_rows // 2 with '...' between (`elide`); totals over all steps. Raises
    ValueError for max_rows that is not an integer >= 2."""
    lines = [f"{'step':>5} {'kind':<8} {'rows':>5} {'cols':>5} {'useful':>7} {'padding':>8} "
             f"{'idle':>6} {'masked keys':>12} {'model ms':>9}"]
    for item in elide(list(enumerate(stats.steps, start=1)), max_rows):
        if item is None:
            lines.append(f"{'...':>5}")
            continue
        i, s = item
        lines.append(f"{i:>5} {s.kind:<8} {s.rows:>5} {s.columns:>5} {s.useful:>7,} "
                     f"{s.padding:>8,} {s.idle:>6,} {s.masked_keys:>12,} {s.model_s * 1e3:>9.2f}")
    if stats.steps:
        lines.append(f"{'total':>5} {'':<8} {'':>5} {'':>5} {stats.useful:>7,} "
                     f"{stats.padding_slots:>8,} {stats.idle:>6,} "
                     f"{sum(s.masked_keys for s in stats.steps):>12,} "
                     f"{sum(s.model_s for s in stats.steps) * 1e3:>9.2f}")
        lines.append(f"{stats.slots:,} token slots computed: {stats.useful_fraction:.1%} useful, "
                     f"{stats.padding_slots / stats.slots:.1%} padding, "
                     f"{stats.idle / stats.slots:.1%} finished rows idling "
                     f"({stats.idle_row_steps:,} of {stats.decode_row_steps:,} decode row-steps)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

class BatchStream:
    """Iterate for one list of `RequestOutput`s per step of a static batch (the rows that made
    a token in that step, in row order); once exhausted, `result` is the list of
    `Completion`s, one per prompt, in order, and `stats` the batch's `BatchStats`.

    The batch owns its runner and cache, so streams of one engine may be advanced in any
    interleaving. `close()` ends the batch early (as a generator's close) and frees its cache.
    A batch that stopped on an error, on an interrupt (KeyboardInterrupt) or by `close()`
    before every row finished has no result, and says so; iterating it again yields nothing.
    """

    def __init__(self, steps: Iterator[list[s01.RequestOutput]], seqs: list[s01.Sequence],
                 stats: BatchStats):
        self._steps = steps
        self._seqs = seqs
        self.stats = stats
        self._error: BaseException | None = None
        self._closed = False

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> list[s01.RequestOutput]:
        if self._closed or self._error is not None:
            raise StopIteration
        try:
            return next(self._steps)
        except StopIteration:
            raise
        except BaseException as err:   # KeyboardInterrupt too: the batch cannot resume
            self._error = err
            raise

    def close(self) -> None:
        """End the batch now: no more steps run and its cache is freed (a no-op once done)."""
        self._closed = True
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self._seqs)

    @property
    def result(self) -> list[s01.Completion]:
        """S01's `CompletionStream.result` for each request. Raises ValueError while the batch
        is not finished, or when it stopped with an error, an interrupt or `close()` first."""
        if self._error is not None:
            err = self._error
            stopped = "failed" if isinstance(err, Exception) else "was interrupted"
            detail = type(err).__name__ + (f": {err}" if str(err) else "")
            raise ValueError(f"the batch {stopped}, so it has no result: {detail}")
        if self._closed and not self.finished:
            raise ValueError("the batch was closed before it finished, so it has no result")
        return [s01.CompletionStream(iter(()), seq).result for seq in self._seqs]


class RowsRefused(ValueError):
    """`Engine.sample_batch` refused some rows (S04's rules: NaN or +inf logits, every token
    ruled out, a penalty pushed past float32's range). errors: {row index: its
    `ParameterError`, whose parameter names the request field to blame, or None when the
    model's logits are}. The message is the first refused row's (plain greedy rows first)."""

    def __init__(self, errors: dict[int, s01.ParameterError]):
        super().__init__(str(next(iter(errors.values()))))
        self.errors = errors


class Engine(s06.Engine):
    """S06's engine for many requests at once: a static batch.

    model, tokenizer, max_context, logprobs_mode, sync_timing: as S06 (max_context is the most
    positions any one row may reach). max_batch_size: the most prompts one call may take.
    batch_invariant: compute every row alone (the exact reference, see `BatchRunner`).
    pad_id: the id written into padding (default the config's pad_token_id, else the first EOS
    id, as HF checkpoints do; it never matters, since padding is masked and never read as
    output: transformers #25790, optimum-habana #1539).

    Calls: `generate(prompts, params)` -> list of `Completion`, one per prompt, in order;
    `stream(prompts, params)` -> `BatchStream` of per-step output lists. params: one
    SamplingParams for all prompts, a list of one per prompt, or Part I's call style
    (max_tokens as an int, temperature=, seed=, any SamplingParams field as a keyword).
    A single prompt (a str) is Part I's call: `generate` returns one `Completion`, `stream` a
    `CompletionStream`, run as a batch of one. `last_batch` is the `BatchStats` of the batch
    most recently started: set when `stream` (or `generate`) is called, filled in as it runs.
    The engine holds the model, not a cache: each batch makes its own `BatchRunner`
    (`make_runner`, kept by its rows as `seq.batch_runner`) and frees its cache when it ends,
    so any number of streams can be advanced in turns, each giving what it gives alone.
    Raises ValueError, before any forward pass or request id, for an empty list, more prompts
    than max_batch_size, a prompt Part I refuses (empty, or longer than max_context: "prompt
    i: ..."), params that are not SamplingParams, not one per prompt, or that Part I refuses
    ("params[i]: ..." for a list); and S06's errors for bad rows.
    """

    runner_class = BatchRunner

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, batch_invariant: bool = False,
                 logprobs_mode: str = "raw_logprobs", sync_timing: bool = False,
                 pad_id: int | None = None):
        if not s01.is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1 (got {max_batch_size!r})")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool (got {batch_invariant!r})")
        super().__init__(model, tokenizer, max_context, logprobs_mode, sync_timing)
        if pad_id is None:
            pad_id = model.config.pad_token_id
        if pad_id is None:
            pad_id = min(self.eos_ids) if self.eos_ids else 0
        if not s01.is_int(pad_id) or not 0 <= pad_id < model.vocab_size:
            raise ValueError(f"pad_id must be an integer in [0, V={model.vocab_size}) "
                             f"(got {pad_id!r})")
        self.max_batch_size = int(max_batch_size)
        self.batch_invariant = batch_invariant
        self.pad_id = int(pad_id)
        self.runner = None   # S05's one shared runner: here each batch has its own (make_runner)
        self.last_batch: BatchStats | None = None

    def make_runner(self) -> BatchRunner:
        """A fresh `BatchRunner` (and so a fresh cache) for one batch."""
        return self.runner_class(self.model, self.max_context,
                                 batch_invariant=self.batch_invariant, pad_id=self.pad_id)

    # --- the public interface ------------------------------------------------------------

    def generate(self, prompts, params=None, temperature: float | None = None,
                 seed: int | None = None, **options):
        """Run the prompts as one static batch; one `Completion` per prompt, in order (one
        `Completion` for a single str prompt). See the class docstring for params."""
        return s01.run_to_end(self.stream(prompts, params, temperature, seed, **options))

    def stream(self, prompts, params=None, temperature: float | None = None,
               seed: int | None = None, **options):
        """Check every request (nothing runs on a bad one) and return a `BatchStream` (a
        `CompletionStream` for a single str prompt). Arguments as `generate`."""
        single = isinstance(prompts, str)
        seqs = self.add_requests([prompts] if single else prompts, params, temperature, seed,
                                 **options)
        stats = self.last_batch = BatchStats()
        if single:
            return s01.CompletionStream(self.run(seqs[0], stats), seqs[0])
        return BatchStream(self.run_batch(seqs, stats), seqs, stats)

    def add_requests(self, prompts, params=None, temperature=None, seed=None, **options
                     ) -> list[s01.Sequence]:
        """One `Sequence` per prompt, in order, made as Part I's `add_request` makes one.
        Every prompt and every row's params are checked before the first `Sequence` is made,
        so a bad request raises ValueError naming the rule and its index (see the class
        docstring) with nothing computed and no request id used."""
        if not isinstance(prompts, (list, tuple)):
            raise s01.ParameterError(f"prompts must be a list of strings (or one string); "
                                     f"got {type(prompts).__name__}", "prompt")
        if not prompts:
            raise s01.ParameterError("prompts must hold at least one prompt (got an empty "
                                     "list)", "prompt")
        if len(prompts) > self.max_batch_size:
            raise s01.ParameterError(f"a batch holds at most max_batch_size="
                                     f"{self.max_batch_size} prompts (got {len(prompts)}): "
                                     "split them or raise the limit", "prompt")
        all_params = self.make_batch_params(len(prompts), params, temperature, seed, options)
        prompt_ids = []
        for i, prompt in enumerate(prompts):   # every prompt checked before any Sequence
            try:
                prompt_ids.append(self.check_prompt(prompt))
            except s01.ParameterError as err:
                raise s01.ParameterError(f"prompt {i}: {err}", err.parameter, err.value) \
                    from None
        seqs = []
        for i, (ids, p) in enumerate(zip(prompt_ids, all_params)):
            try:   # the rules that need the model (stop ids in [0, V), ...): no id taken yet
                seqs.append(self.make_sequence(str(self._request_count + i), ids, p))
            except s01.ParameterError as err:
                shared = not isinstance(params, (list, tuple))
                raise s01.ParameterError(str(err) if shared else f"params[{i}]: {err}",
                                         err.parameter, err.value) from None
        self._request_count += len(seqs)
        for seq in seqs:
            self.finish_if_stopped(seq)        # a prompt that fills the context: done at once
        return seqs

    def make_batch_params(self, num_prompts: int, params, temperature, seed, options) -> list:
        """The params of each of num_prompts requests (see the class docstring)."""
        if isinstance(params, (list, tuple)):
            if temperature is not None or seed is not None or options:
                raise s01.ParameterError("pass either a list of params objects or keyword "
                                         "fields, not both", "params")
            if len(params) != num_prompts:
                raise s01.ParameterError(f"params must be one SamplingParams for all prompts "
                                         f"or a list of exactly one per prompt (got "
                                         f"{len(params)} for {num_prompts} prompts)", "params")
            made = []
            for i, p in enumerate(params):
                if not isinstance(p, s01.GenerationParams):
                    raise s01.ParameterError(f"params[{i}] must be a SamplingParams (got "
                                             f"{type(p).__name__})", "params")
                try:
                    made.append(self.make_params(p))
                except s01.ParameterError as err:
                    raise s01.ParameterError(f"params[{i}]: {err}", err.parameter,
                                             err.value) from None
            return made
        if params is None:
            params = options.pop("max_tokens", 16)
        elif "max_tokens" in options:
            raise s01.ParameterError("max_tokens was given twice (as params and as a "
                                     "keyword)", "max_tokens")
        if not isinstance(params, s01.GenerationParams) and not s01.is_int(params):
            raise s01.ParameterError(f"params must be a SamplingParams, a list of one per "
                                     f"prompt, or max_tokens as an int (got "
                                     f"{type(params).__name__})", "params")
        return [self.make_params(params, temperature, seed, **options)] * num_prompts

    # --- the loop ----------------------------------------------------------------------

    def model_step(self, seq: s01.Sequence):
        """Part I's one-request seam has no meaning here: a step runs the whole batch
        (`model_step_batch`). Raises NotImplementedError."""
        raise NotImplementedError("S08 steps whole batches: see Engine.model_step_batch")

    def run(self, seq: s01.Sequence, stats: BatchStats | None = None
            ) -> Iterator[s01.RequestOutput]:
        """Part I's loop for one request: a static batch of one."""
        for outputs in self.run_batch([seq], stats):
            yield from outputs

    def run_batch(self, seqs: list[s01.Sequence], stats: BatchStats | None = None
                  ) -> Iterator[list[s01.RequestOutput]]:
        """The static batch: one prefill of every running request, then decode steps of one
        token per row until every row has finished. Yields, per step, the outputs of the rows
        that made a token. Rows that finished keep their slot and are computed to the end;
        `stats` (default a new `BatchStats`, then kept as `last_batch`) counts that waste. The
        batch has its own runner and cache, freed when it ends, fails or is closed."""
        if stats is None:
            stats = self.last_batch = BatchStats()
        rows = [seq for seq in seqs if not seq.finished]  # finished on arrival: no row
        if not rows:
            return
        if len(rows) > self.max_batch_size:
            raise ValueError(f"a batch holds at most max_batch_size={self.max_batch_size} "
                             f"rows (got {len(rows)})")
        # The most tokens any row can make: its max_tokens, or what is left of its context.
        max_new = max(min(seq.params.max_tokens, self.max_context - len(seq.prompt_ids))
                      for seq in rows)
        t_len = max(len(seq.prompt_ids) for seq in rows)
        stats.prompt_tokens = [len(seq.prompt_ids) for seq in rows]
        stats.padding = [t_len - n for n in stats.prompt_tokens]
        stats.output_tokens = [0] * len(rows)
        runner = self.make_runner()        # this batch's own cache: streams never share one
        for seq in rows:
            seq.batch_runner = runner
        tokens = None
        try:
            while True:
                active = [not seq.finished for seq in rows]
                start = time.perf_counter()
                logits = self.model_step_batch(rows, tokens, active, max_new)   # (B, V)
                if self.sync_timing:
                    s06.synchronize(self.model.device)
                model_s = time.perf_counter() - start
                sampled, tokens = self.sample_batch(logits, rows, active)
                outputs = []
                for i, (seq, token) in enumerate(zip(rows, sampled)):
                    if token is None:
                        continue
                    seq.stats.context_lens.append(len(seq.token_ids))
                    outputs.append(self.postprocess(seq, token))
                    seq.num_computed_tokens = len(seq.token_ids) - 1
                    seq.stats.pass_times_s.append(model_s)
                    stats.output_tokens[i] += 1
                step_s = time.perf_counter() - start
                for seq, token in zip(rows, sampled):
                    if token is not None:
                        seq.stats.step_times_s.append(step_s)
                stats.steps.append(self.step_waste(stats, active, len(stats.steps) > 0,
                                                   model_s, step_s))
                yield outputs
                if all(seq.finished for seq in rows):
                    return
        finally:   # done, failed, interrupted or closed: the cache goes with the batch
            runner.release()

    def step_waste(self, stats: BatchStats, active: list[bool], decode: bool, model_s: float,
                   step_s: float) -> StepWaste:
        """The `StepWaste` of the step just run (active: rows running at its start)."""
        rows = len(active)
        if not decode:
            t_len = stats.prompt_tokens[0] + stats.padding[0]
            return StepWaste("prefill", rows, t_len, sum(stats.prompt_tokens),
                             sum(stats.padding), 0, 0, model_s, step_s)
        busy = sum(active)
        return StepWaste("decode", rows, 1, busy, 0, rows - busy, sum(stats.padding),
                         model_s, step_s)

    # --- seams ---------------------------------------------------------------------------

    def model_step_batch(self, rows: list[s01.Sequence], tokens: torch.Tensor | None,
                         active: list[bool], max_new_tokens: int) -> torch.Tensor:
        """Raw logits float32 (B, V), on the device, of each row's next token: the prefill of
        every prompt when tokens is None, else a decode step of tokens (int64 (B,)), on the
        rows' own runner (`seq.batch_runner`, set by `run_batch`)."""
        runner = rows[0].batch_runner
        if tokens is None:
            return runner.prefill([seq.prompt_ids for seq in rows], max_new_tokens, active)
        return runner.decode(tokens, active)

    @staticmethod
    def plain_greedy(seq: s01.Sequence) -> bool:
        """True when S06's pipeline would leave the row's logits unchanged and take their
        argmax: greedy, no penalties, min_tokens reached. Such rows are decided together."""
        sampler = seq.sampler
        return (seq.params.greedy and sampler.seen is None and sampler.counts is None
                and len(seq.output_ids) >= seq.params.min_tokens)

    @torch.inference_mode()
    def sample_batch(self, logits: torch.Tensor, rows: list[s01.Sequence], active: list[bool]
                     ) -> tuple[list[int | None], torch.Tensor]:
        """One token per running row from logits (B, V): (host ids, None for finished rows;
        the next step's input, int64 (B,) on the device: pad_id for a finished row, whose
        logits are never read, so a bad finished row can neither fail the batch nor feed a
        flag back as an id).

        Plain greedy rows (`plain_greedy`) take one batched argmax; every other row runs its
        own S06 `DeviceSampler` (its own seeded generator, so its draws do not depend on its
        batch mates). One device-to-host copy per step brings all B ids. Rows S04 refuses
        (NaN or +inf, no finite entry, ...) raise `RowsRefused`, a ValueError with S04's
        message that names every refused row. Every row has drawn by then (the flags ride on
        that one copy), so a failed call puts each generator back as it was (`get_state`
        before the draw, `set_state` on failure; both on the host, no wait for the device) and
        updates no history or logprobs: after the error every row's sampler is as before the
        call, so a caller that drops the refused rows and samples the others again gets the
        draws they would have had anyway (S09's engine does: one bad request fails alone).
        """
        plain, own = [], []
        for i, seq in enumerate(rows):
            if active[i]:
                (plain if self.plain_greedy(seq) else own).append(i)
        # Plain greedy rows: the argmax of every row at once while every row is plain greedy
        # and running (no index is built); else of the plain rows only, the rest pad_id.
        every_row = len(plain) == len(rows)
        tokens = None if every_row else torch.full((len(rows),), self.pad_id, dtype=torch.int64,
                                                   device=logits.device)
        if plain:
            index = None if every_row else torch.tensor(plain, dtype=torch.int64,
                                                        device=logits.device)
            top, argmax = (logits if every_row else logits[index]).max(dim=-1)  # first max on a tie
            # S06 DeviceSampler's flags for a row it would leave unchanged: NaN or +inf -> -2,
            # no finite entry -> -3.
            flagged = torch.where(torch.isnan(top) | (top == float("inf")), -2,
                                  torch.where(top == float("-inf"), -3, argmax))
            if every_row:
                tokens = flagged
            else:
                tokens[index] = flagged
        processed, saved = {}, []
        try:
            for i in own:
                sampler, n = rows[i].sampler, len(rows[i].output_ids)
                if sampler.generator is not None:    # a copy on the host, even for CUDA's
                    saved.append((sampler.generator, sampler.generator.get_state()))
                processed[i] = sampler.process(logits[i], n)
                tokens[i:i + 1] = sampler.draw(processed[i], n, logits[i])
            host = tokens.tolist()                       # the one device -> host copy
            bad = {i: host[i] for i in plain + own if host[i] < 0}
            if bad:
                raise RowsRefused({i: s01.ParameterError(BAD_ROW_ERRORS[flag],
                                                         BAD_ROW_PARAMETERS.get(flag))
                                   for i, flag in bad.items()})
        except BaseException:   # nothing is updated yet: put the random streams back too
            for generator, state in saved:
                generator.set_state(state)
            raise
        sampled: list[int | None] = [None] * len(rows)
        for i in plain + own:
            token = host[i]
            sampled[i] = token
            seq = rows[i]
            if i in processed:
                seq.sampler.update(tokens[i:i + 1])
            if seq.logprobs is not None:
                source = (logits[i] if self.logprobs_mode == "raw_logprobs" or i not in processed
                          else processed[i])
                seq.logprobs.append(compute_logprobs(source, token, seq.params.logprobs))
        return sampled, tokens


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 8: static batching, many prompts in one forward pass.")
    add_request_arguments(parser)
    parser.add_argument("--attention", default="manual", choices=s06.ATTENTION_IMPLS,
                        help="attention implementation (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="most prompts in one batch (default: %(default)s)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every row alone: slow, bitwise equal to each request run "
                             "alone")
    args = parser.parse_args(argv)
    params = check_request_arguments(parser, args)
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1 (got {args.max_batch_size})")
    num_requests = len(args.prompt) if args.prompt else args.num_prompts
    if num_requests > args.max_batch_size:   # before the model loads
        given = "--prompt flags" if args.prompt else "--num-prompts"
        parser.error(f"{num_requests} requests ({given}) do not fit one batch of "
                     f"--max-batch-size {args.max_batch_size}: raise it or ask for fewer")
    try:
        model, tokenizer = s06.load(args.model, args.device, args.dtype, args.attention)
        max_context = min(model.config.max_position_embeddings, 4096)
        prompts = args.prompt or corpus_prompts(tokenizer, args.num_prompts, args.seed,
                                                max_context)
        engine = Engine(model, tokenizer, max_context, max_batch_size=args.max_batch_size,
                        batch_invariant=args.batch_invariant)
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        wall_s = time.perf_counter() - start
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    mode = "batch-invariant (every row alone)" if args.batch_invariant else "fast (one pass)"
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device} in "
          f"{str(model.dtype).removeprefix('torch.')}; {len(prompts)} requests in one static "
          f"batch, {mode} mode")
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        print(f"\n--- request {i}: prompt ({len(tokenizer.encode(prompt))} tokens) ---\n{prompt}")
        print(f"--- completion ({len(completion.token_ids)} tokens, finish_reason="
              f"{completion.finish_reason}) ---\n{completion.text}")
    stats = engine.last_batch
    generated = sum(len(c.token_ids) for c in completions)
    print(f"\n--- the batch: {generated} tokens in {wall_s:.2f} s "
          f"({generated / wall_s:.0f} tokens/s, first call: one-off costs included) ---")
    if not args.batch_invariant:
        print(format_waste_table(stats))
        legend = "'.' padding, 'P' prompt, 'G' generated, '-' finished, still computed"
    else:   # `BatchRunner._rows_alone`: the running rows' real tokens only, so no waste to count
        print(f"{stats.useful:,} token slots computed in {len(stats.steps)} steps "
              f"({sum(s.model_s for s in stats.steps) * 1e3:.2f} ms in the model), all useful: "
              "each row ran alone, its real tokens only, and finished rows were skipped, so no "
              "padding or idle slot was computed")
        legend = ("'P' prompt, 'G' generated; '.' padding and '-' finished: columns left empty, "
                  "not computed")
    if stats.batch_size and len(stats.timeline()[0]) <= 100:
        print(f"\nrows over cache columns ({legend}):")
        for i, line in enumerate(stats.timeline()):
            print(f"{i:>4} {line}")


if __name__ == "__main__":
    sys.exit(main())
