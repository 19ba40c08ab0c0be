"""S09, continuous batching: iteration-level scheduling over ragged batches.

What is new since S08
    A static batch runs until its last row finishes: a short request that is done keeps its
    row, and a request that arrives waits for the whole batch. Here the engine schedules per
    step (Orca's iteration-level scheduling): after every step, finished requests leave and
    waiting ones join, so a row never idles while someone waits.

    - The engine is step-based, with the field's names (`LLMEngine`): `add_request(prompt,
      params, request_id=None) -> request_id`, `step() -> list[RequestOutput]` (one per
      request that made a token in the step, plus the last word of requests that ended
      without one), `abort(request_id)`, `has_unfinished_requests()`. Part I's
      `generate(prompt, ...)` / `stream(prompt, ...)` and S08's `generate(prompts, params)`
      are thin loops over them and return the same results.
    - Admission (`schedule`): plain FIFO, up to `max_num_seqs` requests running. S10 replaces
      it with a scheduler that has a token budget.
    - A ragged batch (`RaggedBatch`), no padding: the new tokens of every running request laid
      end to end, flat input ids (N,) and positions (N,), per-request query starts
      (`query_start_loc`, vLLM's name; `cu_seqlens_q` in flash-attention's), context lengths,
      the KV slot of each request, and the rows whose logits are sampled (each request's last
      token). A new request's whole prompt and the other requests' single decode tokens share
      one step: every weight product sees all N tokens at once.
    - KV in per-slot storage (`SlotKVCache`): (L, max_num_seqs, Hkv, S_max, D), one slot per
      running request, from a free list; a slot is freed when its request finishes or is
      aborted, and the next waiting request takes it.
    - Attention over the ragged batch, two ways (`attention=`). "loop": S06's single-request
      `attention` once per request, on its own slot. "masked" (default): the decoding
      requests (one query each, most of every step) in one call of S08's
      `batched_attention` over a view of the slot range they occupy, (B, Hkv, S, D) with S
      the longest context (no keys are copied; the running requests are kept in slot
      order), each slot's columns past its own context masked out (the only padding, and
      only inside attention: the weight products see exactly N rows); a prompt (several
      queries) by S06's `attention` on its own slot. The benchmark measures both: "loop"
      pays one attention call per request per layer.
    - Batch-invariant mode (`batch_invariant=True`): each request runs alone through S06's
      layers with the shapes S06's engine uses, so its logits are bitwise those of the request
      run alone; the fast mode is held to it by S08's `follows_batch_rule`.
    - Every request keeps Part I's state and machinery: its `Sequence` (now with `status`
      waiting / running / finished and a `slot`), its seeded sampler, detokenizer and stop
      matcher, finished by Part I's `postprocess` and `stop_rule`; "abort" joins "stop" and
      "length" as a finish_reason.
    - `engine.trace`: one `StepRecord` per forward step (who ran, joined, left, tokens, free
      slots), the occupancy table `main` prints. Its sibling code/s09_arrivals.py runs S07's
      harness (TTFT, ITL) with requests arriving at given times, through `add_request` and
      `step`.

What it does not handle yet
    No token budget per step and no preemption: a step takes every running request's new
    tokens, so one long prompt makes one long step for everyone (S10). A prompt is prefilled
    in one piece (S11 chunks it). Each slot holds max_context positions whatever the request
    needs (S12 pages KV in blocks). One bad row (NaN logits, a penalty overflow) raises from
    `step()` for the whole batch, its message prefixed "request '<id>': "; the caller may abort
    that request and go on (S08's `sample_batch` puts back the random streams the failed step
    drew from, so a seeded request beside it still equals itself alone). `generate` / `stream`
    run the engine for their own requests only, so they and `add_request` take turns: a
    stream refuses while requests queued with `add_request` are unfinished, and `add_request`
    refuses while a stream runs (S19's server takes requests while others stream).

Run it
    python code/s09_continuous_batching.py                          # 8 corpus prompts, staggered
    python code/s09_continuous_batching.py --arrival-every 2 --max-num-seqs 3 --num-prompts 6
    python code/s09_continuous_batching.py --prompt "O Romeo, Romeo! wherefore art thou" \\
        --prompt "To be, or not"
    python benchmarks/bench_s09_continuous_batching.py --quick      # vs S08 and HF, TTFT / ITL

Tests
    tests/test_s09_continuous_batching.py: every request's greedy tokens equal S05 and HF
    `generate` alone whatever the arrival order, max_num_seqs and companions (two copies of a
    prompt beside a third), on the bundled model and tiny random GPT-2, Qwen3, Llama; seeded
    sampling and whole completions equal S06 alone; one token per running request per step;
    no request waits while a slot is free; every slot free at the end; streams join to the
    final text; the public bugs G4 and G5 (aborts free slots); every bad input.
    tests/test_s09_properties.py: hypothesis over arrivals, aborts, lengths and stop settings.
    tests/test_parity.py runs this engine in the parity chain; tests/test_s09_arrivals.py the
    sibling.

References
    Orca (Yu et al., OSDI 2022): iteration-level scheduling. vLLM (Kwon et al., SOSP 2023) and
    its `LLMEngine` (`add_request`, `step`, `abort_request`, `has_unfinished_requests`) and
    flattened batch metadata (`query_start_loc`, `seq_lens`). nano-vllm's engine loop
    (`LLMEngine.step`: schedule, run the model, postprocess) and `ModelRunner.prepare_prefill`
    / `prepare_decode` (flat ids and positions, `cu_seqlens_q`).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size; N tokens of a
ragged batch (the sum of each request's T).
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import bisect
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s06_torch as s06
import s08_static_batching as s08

DEFAULT_MAX_NUM_SEQS = 32
MAX_REQUESTS_PER_CALL = 4096   # prompts one generate(prompts) call may queue
RAGGED_ATTENTION = ("masked", "loop")
FINISH_ABORT = "abort"
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


# ---------------------------------------------------------------------------------------------
# KV slots and the ragged batch
# ---------------------------------------------------------------------------------------------

class SlotKVCache:
    """Keys and values of up to num_slots running requests: k, v (L, num_slots, Hkv, S_max, D).

    Slot i holds one request's positions 0 .. S_max - 1 at columns 0 .. S_max - 1 (no padding:
    each request writes from its own position 0). `allocate` hands out the lowest free slot,
    `free` gives one back; `free_slots` is kept sorted. Raises ValueError for sizes < 1, for
    allocating with no slot free, and for freeing a slot that is not in use.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots),
                            ("num_kv_heads", num_kv_heads), ("max_seq_len", max_seq_len),
                            ("head_dim", head_dim)):
            if not s01.is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # Zeroed, as S08's: a masked-out stale NaN times a probability of 0 would still be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # (L, slots, Hkv, S_max, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.free_slots: list[int] = list(range(num_slots))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def allocate(self) -> int:
        if not self.free_slots:
            raise ValueError(f"no KV slot is free (all {self.num_slots} are in use)")
        return self.free_slots.pop(0)

    def free(self, slot: int) -> None:
        if not s01.is_int(slot) or not 0 <= slot < self.num_slots or slot in self.free_slots:
            raise ValueError(f"slot {slot!r} is not in use, so it cannot be freed")
        bisect.insort(self.free_slots, int(slot))


@dataclass(frozen=True)
class RaggedBatch:
    """One step's work, every running request's new tokens laid end to end (no padding).

    input_ids, positions: int64 (N,) on the device. query_start_loc: B + 1 host ints, request
    b's tokens are rows query_start_loc[b] .. query_start_loc[b + 1] - 1. context_lens: B host
    ints, request b's positions after this step (its cached ones + its new ones). slots: B host
    ints, each request's KV slot. sample_rows: int64 (B,) on the device, the row of each
    request's last token, whose logits are sampled.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: list[int]
    context_lens: list[int]
    slots: list[int]
    sample_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])]

    def query_starts(self) -> list[int]:
        """Each request's first new position (= its cached positions)."""
        return [c - n for c, n in zip(self.context_lens, self.query_lens())]

    @classmethod
    def build(cls, new_tokens: Sequence[Sequence[int]], starts: Sequence[int],
              slots: Sequence[int], device: str | torch.device = "cpu") -> "RaggedBatch":
        """From each request's new token ids, its first new position and its slot. Raises
        ValueError for no request, or a request with no new token."""
        if not new_tokens or any(len(t) == 0 for t in new_tokens):
            raise ValueError("a ragged batch needs at least one request, each with a new token")
        cu = np.cumsum([0] + [len(t) for t in new_tokens]).tolist()
        ids = [t for tokens in new_tokens for t in tokens]
        positions = [start + i for tokens, start in zip(new_tokens, starts)
                     for i in range(len(tokens))]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(positions), cu,
                   [start + len(t) for t, start in zip(new_tokens, starts)], list(slots),
                   as_tensor([end - 1 for end in cu[1:]]))


# ---------------------------------------------------------------------------------------------
# The model on a ragged batch
# ---------------------------------------------------------------------------------------------

class RaggedRunner:
    """S06's `TorchTransformer` run on a `RaggedBatch` against a `SlotKVCache`.

    `forward(batch)` returns float32 (B, V) on the device, the logits after each request's
    last new token. Fast mode: the N tokens go through S06's layer code together (`qkv`,
    `finish`: every weight product sees N rows); each layer writes its keys and values into
    the slots (one index_copy_, slot and position per token), then attends as `attention`
    says ("masked" or "loop", see the module docstring). Batch-invariant mode:
    each request runs alone, with S06's shapes, bitwise the request alone. Raises ValueError
    for sizes out of range, an unknown attention, or a batch that writes past a slot.
    """

    embed = s08.BatchRunner._embed   # S08's embedding at explicit positions: (N,) -> (N, C)

    def __init__(self, model: s06.TorchTransformer, max_num_seqs: int,
                 max_seq_len: int | None = None, batch_invariant: bool = False,
                 attention: str = "masked"):
        limit = model.config.max_position_embeddings
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not s01.is_int(max_seq_len) or not 1 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be an integer in [1, max_position_embeddings="
                             f"{limit}] (got {max_seq_len!r})")
        if attention not in RAGGED_ATTENTION:
            raise ValueError(f"attention must be one of {RAGGED_ATTENTION} (got {attention!r})")
        self.model, self.batch_invariant, self.attention = model, bool(batch_invariant), attention
        self.cache = self.make_cache(max_num_seqs, max_seq_len)

    def make_cache(self, max_num_seqs: int, max_seq_len: int) -> SlotKVCache:
        """The KV storage (the seam S12 overrides with its block pool's)."""
        cfg, model = self.model.config, self.model
        return SlotKVCache(cfg.num_hidden_layers, max_num_seqs, cfg.num_key_value_heads,
                           max_seq_len, cfg.head_dim, model.dtype, model.device)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        if max(batch.context_lens) > self.cache.max_seq_len:
            raise ValueError(f"a request would reach {max(batch.context_lens)} positions but a "
                             f"KV slot holds {self.cache.max_seq_len} (max_seq_len)")
        if self.batch_invariant:
            return self._seqs_alone(batch)
        return self._batched(batch)

    def _batched(self, batch: RaggedBatch) -> torch.Tensor:
        model = self.model
        device = model.device
        seq_of_token = torch.repeat_interleave(
            torch.arange(batch.num_seqs, device=device),
            torch.tensor(batch.query_lens(), device=device))
        slot_of_token = torch.tensor(batch.slots, device=device)[seq_of_token]      # (N,)
        where = self.kv_index(slot_of_token, batch.positions)
        requests = list(zip(batch.query_start_loc, batch.query_start_loc[1:], batch.slots,
                            batch.context_lens))
        meta = self._decode_meta(batch) if self.attention == "masked" else None
        alone = [r for r in requests if meta is None or r[1] - r[0] > 1]  # attended one by one
        x, cos, sin = self.embed(batch.input_ids, batch.positions)                # (N, C)
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv(x, cos, sin)         # q (H, N, D); k, v (Hkv, N, D)
            self.write_kv(layer, k, v, where)
            if meta is not None and meta["rows"] is None:    # every request decodes
                attn = self._decode_attention(layer, q, block.scale, meta)          # (H, N, D)
            else:
                attn = torch.empty_like(q)                                         # (H, N, D)
                if meta is not None:
                    attn[:, meta["rows"]] = self._decode_attention(
                        layer, q[:, meta["rows"]], block.scale, meta)
                for a, e, slot, ctx in alone:
                    attn[:, a:e] = s06.attention(q[:, a:e], *self.read_kv(layer, slot, ctx),
                                                 ctx - (e - a), block.scale,
                                                 model.attention_impl)
            x = block.finish(x, attn)                                              # (N, C)
        return model.head(x[batch.sample_rows])                                   # (B, V)

    # The KV seams (S12 overrides them with block tables and a slot mapping).

    def kv_index(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where each new token's keys and values go, worked out once per step for every
        layer: slot_of_token, positions int64 (N,) -> int64 (Hkv N,), the row of each (key
        head, token) in a layer's cache seen as (slots Hkv S_max, D), so one index_copy_
        writes the whole step."""
        n_kv, s_max = self.cache.k.shape[2], self.cache.max_seq_len
        heads = torch.arange(n_kv, device=positions.device)[:, None]               # (Hkv, 1)
        return ((slot_of_token[None, :] * n_kv + heads) * s_max
                + positions[None, :]).reshape(-1)                                 # (Hkv N,)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 where: torch.Tensor) -> None:
        """k, v (Hkv, N, D) of the new tokens into the layer's cache at `kv_index`'s rows."""
        d = k.shape[-1]
        self.cache.k[layer].view(-1, d).index_copy_(0, where, k.reshape(-1, d))  # (Hkv N, D)
        self.cache.v[layer].view(-1, d).index_copy_(0, where, v.reshape(-1, d))

    def read_kv(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values of one request, positions 0 .. length - 1: two
        (Hkv, length, D) views of its slot."""
        return self.cache.k[layer, slot, :, :length], self.cache.v[layer, slot, :, :length]

    def _decode_meta(self, batch: RaggedBatch) -> dict | None:
        """The masked formulation's index work, done once per step for every layer. The
        decoding requests (one query each) attend over a view of the slot range they span,
        lo .. hi, never a gathered copy: slot lo + i gets query i of `order` (None when the
        requests sit in those slots in order), a slot in the range that no decoding request
        holds sees its first key only (a finite softmax row nobody reads), and each slot's
        columns past its context are masked. None when no request decodes."""
        device = self.model.device
        lens = batch.query_lens()
        decodes = [b for b, n in enumerate(lens) if n == 1]
        if not decodes:
            return None
        slots = [batch.slots[b] for b in decodes]
        lo, hi = min(slots), max(slots)
        ctx = [1] * (hi - lo + 1)
        for b, slot in zip(decodes, slots):
            ctx[slot - lo] = batch.context_lens[b]
        s_len = max(ctx)
        allowed = None     # every key of every slot is real when the contexts are equal
        if min(ctx) < s_len:   # made additive here, once per step, not in every layer
            allowed = s08.additive_mask(torch.arange(s_len, device=device)[None, :]
                                        < torch.tensor(ctx, device=device)[:, None],
                                        self.model.dtype)[:, None]          # (span, 1, S)
        in_order = slots == list(range(lo, hi + 1))
        rows = (None if len(decodes) == len(lens) else
                torch.tensor([batch.query_start_loc[b] for b in decodes], device=device))
        return dict(span=slice(lo, hi + 1), s_len=s_len, allowed=allowed, rows=rows,
                    order=None if in_order else torch.tensor([s - lo for s in slots],
                                                             device=device))

    def _decode_attention(self, layer: int, q: torch.Tensor, scale: float, meta: dict
                          ) -> torch.Tensor:
        """q (H, B_d, D), one query per decoding request -> (H, B_d, D): S08's
        `batched_attention` over the slot range's keys (see `_decode_meta`)."""
        keys = self.cache.k[layer, meta["span"], :, :meta["s_len"]]      # (span, Hkv, S, D)
        values = self.cache.v[layer, meta["span"], :, :meta["s_len"]]
        queries = q.transpose(0, 1)[:, :, None]                          # (B_d, H, 1, D)
        order = meta["order"]
        if order is not None:    # to the requests' slots; the other slots' queries are 0
            queries = queries.new_zeros((keys.shape[0],) + queries.shape[1:]).index_copy_(
                0, order, queries)                                       # (span, H, 1, D)
        out = s08.batched_attention(queries, keys, values, meta["allowed"], scale,
                                    self.model.attention_impl)           # (span, H, 1, D)
        if order is not None:
            out = out[order]                                             # (B_d, H, 1, D)
        return out[:, :, 0].transpose(0, 1)                               # (H, B_d, D)

    def _seqs_alone(self, batch: RaggedBatch) -> torch.Tensor:
        model = self.model
        logits = torch.empty((batch.num_seqs, self.vocab_size), dtype=torch.float32,
                             device=model.device)
        for b, (a, e) in enumerate(zip(batch.query_start_loc, batch.query_start_loc[1:])):
            slot, end = batch.slots[b], batch.context_lens[b]
            start = end - (e - a)
            x, cos, sin = self.embed(batch.input_ids[a:e], batch.positions[a:e])   # (T_b, C)
            where = self.kv_index(torch.full((e - a,), slot, device=model.device),
                                  batch.positions[a:e])
            for layer, block in enumerate(model.blocks):
                q, k, v = block.qkv(x, cos, sin)
                self.write_kv(layer, k, v, where)
                x = block.finish(x, s06.attention(q, *self.read_kv(layer, slot, end), start,
                                                  block.scale, model.attention_impl))
            logits[b] = model.head(x[-1:])[0]
        return logits


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

class StepTrace(list):
    """`engine.trace`: the `StepRecord`s in step order. limit: None (the default: every step
    kept, as every chapter's tables need) or how many of the latest to keep (a long-running
    server caps it; S19). num_dropped counts records dropped from the front, so
    `num_recorded` (dropped + kept) is the number the next step's record gets."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit, self.num_dropped = limit, 0

    @property
    def num_recorded(self) -> int:
        return self.num_dropped + len(self)

    def append(self, record) -> None:
        super().append(record)
        if self.limit is not None and len(self) > self.limit:
            excess = len(self) - self.limit
            del self[:excess]
            self.num_dropped += excess


@dataclass(frozen=True)
class StepRecord:
    """One forward step: `step` its number from 0; running the request ids in the batch, in
    order, and their slots; joined: ids admitted at its start; left: ids that finished in it
    or were aborted since the step before; num_tokens: N (prefill_tokens of them prompt
    tokens); waiting / free_slots: the queue and free slots right after admission;
    model_s / step_s: wall seconds of the forward pass / of the whole step."""

    step: int
    running: tuple[str, ...]
    slots: tuple[int, ...]
    joined: tuple[str, ...]
    left: tuple[str, ...]
    num_tokens: int
    prefill_tokens: int
    waiting: int
    free_slots: int
    model_s: float
    step_s: float


class LLMEngine(s08.Engine):
    """S08's engine made step-based: requests join and leave the batch at every step.

    model, tokenizer, max_context, logprobs_mode, sync_timing, pad_id: as S08 (pad_id is never
    written here: a ragged batch has no padding). max_num_seqs: the most requests running at
    once (the KV slots). batch_invariant: each request computed alone (the exact reference).
    attention: how the fast mode attends over the ragged batch, "masked" or "loop".

    `add_request` checks everything before it takes anything (ValueError naming the rule);
    `step` admits waiting requests FIFO into free slots, runs one forward over every running
    request, samples, applies Part I's stop rules, frees the slots of finished requests and
    returns the `RequestOutput`s (in slot order). A request that ends without a token
    (aborted, or a prompt that fills the context) gets one last output with no token in the
    next `step`.
    `generate` / `stream` take Part I's single prompt or S08's list (any number, queued) and
    loop over `step`, keeping only their own requests' outputs, so the two kinds of caller
    take turns: `generate` / `stream` raise ValueError while requests added with
    `add_request` are unfinished (step or abort those first), and `add_request` raises while a
    stream runs (until its requests have finished, or it is closed or dropped). A stream
    holds its request ids from the call until it ends or is closed; closing it early, or a
    failure, aborts its requests and drops their last outputs. State: `waiting` (deque),
    `running` (list), `requests` (unfinished, by id), `trace` (`StepRecord`s),
    `runner.cache` (the slots).
    """

    def __init__(self, model: s06.TorchTransformer, tokenizer, max_context: int | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, batch_invariant: bool = False,
                 attention: str = "masked", logprobs_mode: str = "raw_logprobs",
                 sync_timing: bool = False, pad_id: int | None = None):
        if not s01.is_int(max_num_seqs) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1 (got {max_num_seqs!r})")
        super().__init__(model, tokenizer, max_context, MAX_REQUESTS_PER_CALL, batch_invariant,
                         logprobs_mode, sync_timing, pad_id)
        self.max_num_seqs = int(max_num_seqs)
        self.runner = self.make_ragged_runner(model, batch_invariant, attention)
        self.waiting: deque[s01.Sequence] = deque()
        self.running: list[s01.Sequence] = []
        self.requests: dict[str, s01.Sequence] = {}
        self.trace: StepTrace = StepTrace()    # every step (its limit: S19 caps it)
        self._final: list[s01.RequestOutput] = []   # last outputs of requests without a token
        self._aborted: list[str] = []               # aborted since the last forward step
        self._inboxes: dict[str, deque] = {}        # outputs kept for generate / stream
        self._stream_ids: dict[str, s01.Sequence] = {}   # ids held by streams -> requests

    def make_ragged_runner(self, model: s06.TorchTransformer, batch_invariant: bool,
                           attention: str) -> RaggedRunner:
        """The runner and its KV storage (the seam S12 overrides with its paged one)."""
        return RaggedRunner(model, self.max_num_seqs, self.max_context, batch_invariant,
                            attention)

    @property
    def num_free_slots(self) -> int:
        return self.runner.cache.num_free

    def check_prompt(self, prompt: str) -> list[int]:
        """Part I's prompt rules and S03's id rules (every id in [0, V)): a bad id is refused
        by add_request, not by a later step that other requests share."""
        prompt_ids = super().check_prompt(prompt)
        self.model.check_ids(prompt_ids)
        return prompt_ids

    # --- the step-based interface --------------------------------------------------------

    def add_request(self, prompt: str, params=None, request_id: str | None = None) -> str:
        """Queue a request; returns its id. params: a SamplingParams (default: Part I's
        defaults, 16 tokens greedy) or max_tokens as an int. request_id: a non-empty str not
        used by an unfinished request or held by a stream (default: the next free number).
        Raises ValueError, before anything is queued or an id taken, for a bad id, prompt or
        params, and while a stream is running: a stream's steps keep only its own requests'
        outputs, so they would take this request's. A stream (`stream`, or the one inside
        `generate`) runs from the `stream` call (before it is first iterated too) until each
        of its requests has finished (it takes no step after that, even before it is
        exhausted) or it is closed, failed or dropped unread; its ids stay held until it is
        exhausted, closed or dropped."""
        if any(not seq.finished for seq in self._stream_ids.values()):
            raise ValueError("add_request while a stream is running: the stream's steps would "
                             "take this request's outputs; finish or close the stream first")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string (got {request_id!r})")
        if request_id in self.requests or request_id in self._stream_ids:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished "
                             "request or held by a stream")
        params = self.make_params(16 if params is None else params)
        prompt_ids = self.check_prompt(prompt)
        auto = request_id is None
        if auto:
            while self._id_taken(str(self._request_count)):
                self._request_count += 1
            request_id = str(self._request_count)
        seq = self.make_sequence(request_id, prompt_ids, params)
        self._request_count += auto
        self.finish_if_stopped(seq)             # a prompt that fills the context: done at once
        self._enqueue(seq)
        return request_id

    def step(self) -> list[s01.RequestOutput]:
        """Admit, run one forward over every running request, sample, stop, free. Returns the
        step's outputs: the last outputs of requests that ended without a token first, then
        one per running request, in batch (slot) order ([] when there is nothing to do)."""
        outputs, self._final = self._final, []
        joined = self.schedule()
        if self.running:
            try:
                outputs += self._forward_step(joined)
            except BaseException:      # a failed step loses nothing: the last outputs wait
                self._final = outputs + self._final     # for the next step
                raise
        for output in outputs:
            inbox = self._inboxes.get(output.request_id)
            if inbox is not None:
                inbox.append(output)
        return outputs

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request now with finish_reason "abort": its slot is free
        before this returns; its last output (no token) comes with the next `step`. Returns
        False, doing nothing, for an id that is unknown or already finished (vLLM's
        `abort_request` also ignores those: a request may finish while its abort is on the
        way). Raises ValueError for an id that is not a string."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string (got {request_id!r})")
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status == WAITING:
            self._drop_waiting(seq)
        else:
            self._release(seq)
        self.requests.pop(request_id)
        seq.status, seq.finish_reason, seq.stop_reason = FINISHED, FINISH_ABORT, None
        seq.text.append("")
        self._final.append(s01.RequestOutput(request_id, [], "", True, FINISH_ABORT, None))
        self._aborted.append(request_id)
        return True

    def _drop_waiting(self, seq: s01.Sequence) -> None:
        """An aborted request that never ran leaves the waiting queue (the seam S10 routes
        through its scheduler, so every scheduler subclass sees the request go)."""
        self.waiting.remove(seq)

    def _id_taken(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self._stream_ids

    def has_unfinished_requests(self) -> bool:
        """True while a request waits or runs, or a last output is still to be returned."""
        return bool(self.waiting or self.running or self._final)

    def schedule(self) -> list[str]:
        """FIFO admission: waiting requests take free slots (the lowest first), oldest
        request first. Returns their ids. `running` is kept in slot order, so the batch's
        slots are one range (one view of the cache) whenever no slot in between is free."""
        joined = []
        while self.waiting and self.runner.cache.num_free:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.runner.cache.allocate(), RUNNING
            self.running.append(seq)
            joined.append(seq.request_id)
        if joined:
            self.running.sort(key=lambda seq: seq.slot)
        return joined

    # --- one step ------------------------------------------------------------------------

    def make_batch(self, rows: list[s01.Sequence]) -> RaggedBatch:
        """Each running request's tokens not yet computed: the whole prompt on its first step,
        then the one token sampled last."""
        return RaggedBatch.build([seq.token_ids[seq.num_computed_tokens:] for seq in rows],
                                 [seq.num_computed_tokens for seq in rows],
                                 [seq.slot for seq in rows], self.model.device)

    def rows_to_sample(self, rows: list[s01.Sequence]) -> list[bool]:
        """Which rows of the step sample a token: here every one (each row's new tokens end
        its context). S11 overrides it: a prompt chunk that does not reach the end samples
        nothing."""
        return [True] * len(rows)

    def execute_model(self, batch: RaggedBatch) -> torch.Tensor:
        """The model seam (vLLM's name): raw logits float32 (B, V) on the device."""
        return self.runner.forward(batch)

    def _forward_step(self, joined: list[str], rows: list[s01.Sequence] | None = None
                      ) -> list[s01.RequestOutput]:
        rows = list(self.running) if rows is None else rows   # S10 passes the scheduled ones
        waiting, free = len(self.waiting), self.runner.cache.num_free
        start = time.perf_counter()
        batch = self.make_batch(rows)
        logits = self.execute_model(batch)                                   # (B, V)
        if self.sync_timing:
            s06.synchronize(self.model.device)
        model_s = time.perf_counter() - start
        active = self.rows_to_sample(rows)
        try:
            sampled, _ = self.sample_batch(logits, rows, active)
        except ValueError as err:      # S04 refused a row: say whose, so it can be aborted
            bad = self._refused_row(logits, rows, active)
            if bad is None:
                raise
            raise ValueError(f"request {rows[bad].request_id!r}: {err}") from err
        outputs = []
        for seq, token, on in zip(rows, sampled, active):
            if not on:          # nothing to sample for this row in this step (S11's chunks)
                continue
            seq.stats.context_lens.append(len(seq.token_ids))
            outputs.append(self.postprocess(seq, token))
            seq.num_computed_tokens = len(seq.token_ids) - 1
            seq.stats.pass_times_s.append(model_s)
        step_s = time.perf_counter() - start
        left = [seq.request_id for seq in rows if seq.finished]
        for seq, on in zip(rows, active):
            if on:
                seq.stats.step_times_s.append(step_s)
            if seq.finished:
                self._release(seq)
                self.requests.pop(seq.request_id)
                seq.status = FINISHED
        prefill = sum(n for n, seq in zip(batch.query_lens(), rows) if seq.stats.passes == 1)
        self.trace.append(StepRecord(
            self.trace.num_recorded, tuple(s.request_id for s in rows), tuple(batch.slots),
            tuple(joined), tuple(self._aborted + left), batch.num_tokens, prefill, waiting,
            free, model_s, step_s))
        self._aborted = []
        return outputs

    def _refused_row(self, logits: torch.Tensor, rows: list[s01.Sequence],
                     active: list[bool]) -> int | None:
        """After `sample_batch` raised: the row it raised for, the first in its order (plain
        greedy rows, then the others; only rows that sampled) whose raw logits, or row after
        the penalties, have no finite maximum (NaN, +inf, or every entry -inf: each flag S06's
        sampler raises for)."""
        sampled = [i for i in range(len(rows)) if active[i]]
        plain = [i for i in sampled if self.plain_greedy(rows[i])]
        for i in plain + [i for i in sampled if i not in plain]:
            penalized = None if i in plain else rows[i].sampler.penalized
            for row in (logits[i], penalized):
                if row is not None and not math.isfinite(float(row.max())):
                    return i
        return None

    def _enqueue(self, seq: s01.Sequence) -> None:
        seq.slot = None
        if seq.finished:      # finished on arrival: no slot, one last output
            seq.status = FINISHED
            self._final.append(s01.RequestOutput(seq.request_id, [], "", True,
                                                 seq.finish_reason, seq.stop_reason))
            return
        seq.status = WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def _release(self, seq: s01.Sequence) -> None:
        self.runner.cache.free(seq.slot)
        seq.slot = None
        self.running.remove(seq)

    # --- Part I's and S08's calls, as loops over step -------------------------------------

    def add_requests(self, prompts, params=None, temperature=None, seed=None, **options):
        """S08's checks and Sequences (everything checked first), with ids no unfinished
        request uses. The Sequences are queued when their loop (`run_batch`) starts."""
        count = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        while any(self._id_taken(str(self._request_count + i)) for i in range(count)):
            self._request_count += 1
        return super().add_requests(prompts, params, temperature, seed, **options)

    def stream(self, prompts, params=None, temperature: float | None = None,
               seed: int | None = None, **options):
        """Part I's `CompletionStream` for a str prompt, S08's `BatchStream` for a list (its
        `stats` is None: nothing idles here to count). Arguments as S08's. The request ids are
        held from this call until the stream ends, is closed or is dropped (the requests are
        queued when it is first iterated). Raises ValueError, before anything is taken, while
        requests added with `add_request` are unfinished: the stream's steps would take their
        outputs; and `add_request` refuses while the stream runs, for the same reason.
        (S08's `generate` is this stream run to its end, so the same holds for it.)"""
        others = ({rid for rid in self.requests if rid not in self._stream_ids}
                  | {o.request_id for o in self._final if o.request_id not in self._stream_ids})
        if others:
            raise ValueError(f"generate() runs the engine to the end of its own requests: "
                             f"{len(others)} requests added with add_request are unfinished; "
                             f"step() or abort() them first")
        single = isinstance(prompts, str)
        seqs = self.add_requests([prompts] if single else prompts, params, temperature, seed,
                                 **options)
        self._stream_ids.update((seq.request_id, seq) for seq in seqs)
        if single:
            return s01.CompletionStream(_HeldSteps(self.run(seqs[0]), self, seqs), seqs[0])
        return s08.BatchStream(_HeldSteps(self.run_batch(seqs), self, seqs), seqs, None)

    def _let_go(self, seqs: list[s01.Sequence]) -> None:
        """A stream is over: its ids are free and its requests' pending last outputs (aborts,
        prompts that filled the context) are dropped: nobody is left to read them."""
        ids = {seq.request_id for seq in seqs if self._stream_ids.get(seq.request_id) is seq}
        self._final = [o for o in self._final if o.request_id not in ids]
        for request_id in ids:      # only ids this stream still holds: a later request may
            del self._stream_ids[request_id]        # use one, once the stream let it go

    def run(self, seq: s01.Sequence, stats=None) -> Iterator[s01.RequestOutput]:
        """Part I's loop for one request: its outputs that carry a token."""
        for outputs in self.run_batch([seq]):
            yield from (o for o in outputs if o.new_token_ids)

    def run_batch(self, seqs: list[s01.Sequence], stats=None
                  ) -> Iterator[list[s01.RequestOutput]]:
        """Queue the requests, then step until all have finished, yielding their outputs of
        each step (other requests may run in the same steps). Closed or failed before the
        end, it aborts those still unfinished, so their slots are freed; at its end their
        pending last outputs are dropped and their ids let go (see `stream`)."""
        inboxes = {seq.request_id: deque() for seq in seqs}
        self._inboxes.update(inboxes)
        for seq in seqs:
            self._enqueue(seq)
        try:
            while True:
                ready = [inboxes[seq.request_id].popleft() for seq in seqs
                         for _ in range(len(inboxes[seq.request_id]))]
                if ready:
                    yield ready
                if all(seq.finished for seq in seqs) and not any(inboxes.values()):
                    return
                self.step()
        finally:
            for seq in seqs:
                self._inboxes.pop(seq.request_id, None)
                if not seq.finished:
                    self.abort(seq.request_id)
            self._let_go(seqs)


class _HeldSteps:
    """A stream's steps (`run` or `run_batch`), which let the stream's request ids go when
    closed, or dropped, even before the first step (a generator closed or collected before it
    starts runs no code, so its `finally` cannot)."""

    def __init__(self, steps: Iterator, engine: LLMEngine, seqs: list[s01.Sequence]):
        self._steps, self._engine, self._seqs = steps, engine, seqs
        self._unstarted = True

    def __iter__(self) -> "_HeldSteps":
        return self

    def __next__(self):
        self._unstarted = False       # from here `run_batch`'s finally lets the ids go
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()
        self._engine._let_go(self._seqs)

    def __del__(self) -> None:
        # Dropped unread: nothing else would let the ids go. (Dropped once started, the
        # generator's own close, which follows, runs `run_batch`'s finally.)
        if self._unstarted:
            self._engine._let_go(self._seqs)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def format_occupancy_table(trace: Sequence[StepRecord], max_rows: int = 40) -> str:
    """The trace as aligned text, one line per step (first and last max_rows // 2 when
    longer): step, tokens in the step (prompt tokens), running ids, joined, left, waiting."""
    lines = [f"{'step':>5} {'tokens':>9} {'running':<28} {'joined':<10} {'left':<10} "
             f"{'waiting':>7}"]
    half = max_rows // 2
    shown = list(trace) if len(trace) <= max_rows else [*trace[:half], None, *trace[-half:]]
    for r in shown:
        if r is None:
            lines.append(f"{'...':>5}")
            continue
        tokens = f"{r.num_tokens}" + (f" ({r.prefill_tokens}p)" if r.prefill_tokens else "")
        running = ",".join(r.running)
        lines.append(f"{r.step:>5} {tokens:>9} {running[:28]:<28} {','.join(r.joined):<10} "
                     f"{','.join(r.left):<10} {r.waiting:>7}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 9: continuous batching, requests join and leave at every step.")
    s08.add_request_arguments(parser)
    parser.add_argument("--arrival-every", type=int, default=3,
                        help="steps between two arrivals; 0 = all at once (default: "
                             "%(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="most requests running at once (KV slots) (default: %(default)s)")
    parser.add_argument("--attention", default="masked", choices=RAGGED_ATTENTION,
                        help="attention over the ragged batch (default: %(default)s)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every request alone: slow, bitwise equal to each request "
                             "run alone")
    args = parser.parse_args(argv)
    params = s08.check_request_arguments(parser, args)
    for flag, value, low in (("--max-num-seqs", args.max_num_seqs, 1),
                             ("--arrival-every", args.arrival_every, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low} (got {value})")
    try:
        model, tokenizer = s06.load(args.model, args.device, args.dtype)
        max_context = min(model.config.max_position_embeddings, 4096)
        prompts = args.prompt or s08.corpus_prompts(tokenizer, args.num_prompts, args.seed,
                                                    max_context)
        engine = LLMEngine(model, tokenizer, max_context, args.max_num_seqs,
                           args.batch_invariant, args.attention)
        for prompt in prompts:   # every prompt checked before the first step
            engine.check_prompt(prompt)
        ids, texts, reasons, made, calls = [], {}, {}, 0, 0
        start = time.perf_counter()
        while len(ids) < len(prompts) or engine.has_unfinished_requests():
            if len(ids) < len(prompts) and calls >= len(ids) * args.arrival_every:
                ids.append(engine.add_request(prompts[len(ids)], params))
                continue
            calls += 1
            for out in engine.step():
                texts.setdefault(out.request_id, []).append(out.text_delta)
                made += len(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        wall_s = time.perf_counter() - start
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device} in "
          f"{str(model.dtype).removeprefix('torch.')}; {len(prompts)} requests, one arriving "
          f"every {args.arrival_every} steps, at most {args.max_num_seqs} running")
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens) ---\n"
              f"{prompt}\n--- completion (finish_reason={reasons[rid]}) ---\n"
              f"{''.join(texts.get(rid, []))}")
    print(f"\n--- {made} tokens in {len(engine.trace)} steps, {wall_s:.2f} s "
          f"({made / wall_s:.0f} tokens/s, first call: one-off costs included) ---")
    print(format_occupancy_table(engine.trace))


if __name__ == "__main__":
    sys.exit(main())
