"""S09's model side: the ragged batch, KV slots, and the runner that computes a step.

What is here
    code/s09_continuous_batching.py decides which requests run in a step and how many tokens
    each (a `SchedulerOutput`); this module turns that plan into tensors and runs the model
    (vLLM's split: the scheduler in the engine core, the model runner in the worker).

    - `RaggedBatch`, no padding: the new tokens of every scheduled request laid end to end,
      flat input ids (N,) and positions (N,), per-request query starts (`query_start_loc`,
      vLLM's name; `cu_seqlens_q` in flash-attention's), context lengths, each request's KV
      blocks (here its one slot), and which rows sample (each sampling request's last token).
      A new request's whole prompt and the other requests' single decode tokens share one
      step: every weight product sees all N tokens at once.
    - `SlotKVCache`: keys and values (L, num_slots, Hkv, S_max, D), one slot of S_max positions
      per running request. Which request holds which slot is bookkeeping, the KV manager's
      (`SlotKVManager`, code/s09_scheduler.py); the cache only stores. Checked against the
      memory still free on the device before it is allocated.
    - `RaggedRunner.execute_model(plan, requests)`: the batch from the plan (rows in slot
      order, so the decoding rows' slots are one range of the cache whenever no slot in
      between is free), one forward pass, the logits of the rows that sample
      (`ModelRunnerOutput`). Attention over the ragged batch, two ways (`attention=`).
      "loop": S06's single-request `attention` once per request, on its own slot. "masked"
      (default): the decoding requests (one query each, most of every step) in one call of
      S08's `batched_attention` over a view of the slot range they occupy, (B, Hkv, S, D)
      with S the longest context (no keys are copied), each slot's columns past its own
      context masked out (the only padding, and only inside attention: the weight products
      see exactly N rows); a request with several new tokens by S06's `attention` on its own
      slot, with its start offset (so a prompt chunk after cached positions works too).
    - Batch-invariant mode (`batch_invariant=True`), the exact reference: each request that
      samples is computed alone with the shapes S06's engine uses (its prompt in one pass,
      then one token per pass), so its logits are bitwise those of the request run alone,
      whatever ran beside it. A request whose cached positions were not computed that way (a
      prompt that arrived in chunks, S11; a recompute after a preemption, S10) is computed
      again from position 0 with those shapes when it next samples; rows that do not sample
      compute nothing. The fast mode is held to this reference by S08's `follows_batch_rule`.

What it does not handle
    One slot holds S_max positions whatever the request needs (S12 pages KV in blocks, and
    overrides the KV seams here: `kv_index`, `write_kv`, `read_kv`, `_decode_meta`,
    `_decode_attention`). The masked decode reads every slot of the range up to the longest
    context (S17's kernels read only what each request has).

Tests
    tests/test_s09_continuous_batching.py (with the engine).

References
    vLLM's flattened batch metadata (`query_start_loc`, `seq_lens`, `ModelRunnerOutput`),
    nano-vllm's `ModelRunner.prepare_prefill` / `prepare_decode` (flat ids and positions,
    `cu_seqlens_q`).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size; N tokens of a
ragged batch (the sum of each request's T).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

import s01_generation_loop as s01
import s06_torch as s06
import s08_static_batching as s08

RAGGED_ATTENTION = ("masked", "loop")


def available_memory(device: str | torch.device) -> int:
    """Bytes the device can still allocate: a GPU's free memory (`torch.cuda.mem_get_info`,
    what other processes hold counted), or the host's MemAvailable (/proc/meminfo; the
    physical memory where that file does not exist)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
                what: str, parameter: str, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed k and v of `shape`, after checking that both fit the memory still free on the
    device. Zeroed, not empty: a masked-out stale NaN times a probability of 0 is still NaN.
    Raises s01.ParameterError (`parameter`, the setting that sized them; the message says
    what to change, `fix`) when they do not fit or the allocation fails (on a GPU other
    processes hold memory too)."""
    need = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()  # Python ints
    have = available_memory(device)
    if need > have:
        raise s01.ParameterError(
            f"the {what} would take {need / 2**30:,.2f} GiB (2 x {' x '.join(map(str, shape))} "
            f"x {dtype}), more than the {have / 2**30:,.2f} GiB still free on {device}: {fix}",
            parameter)
    try:
        return (torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
    except RuntimeError as err:                         # out of memory after all
        raise s01.ParameterError(f"the {what} of {need / 2**30:,.2f} GiB could not be allocated "
                                 f"on {device}: {fix} ({err})", parameter) from err


# ---------------------------------------------------------------------------------------------
# KV slots and the ragged batch
# ---------------------------------------------------------------------------------------------

class SlotKVCache:
    """Keys and values of up to num_slots running requests: k, v (L, num_slots, Hkv, S_max, D).

    Slot i holds one request's positions 0 .. S_max - 1 at columns 0 .. S_max - 1 (each
    request writes from its own position 0). Which request holds which slot is decided by the
    KV manager (`SlotKVManager`). Raises ValueError for sizes < 1, and s01.ParameterError
    (parameter "max_num_seqs") when the slots would not fit the device's free memory.
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
        self.k, self.v = allocate_kv(shape, dtype, device, "KV slots",   # (L, slots, Hkv, S, D)
                                     "max_num_seqs", "use fewer max_num_seqs or a shorter "
                                     "max_context")

    @classmethod
    def for_model(cls, model: s06.TorchTransformer, num_slots: int, max_seq_len: int
                  ) -> "SlotKVCache":
        """The slots for this model's layers, KV heads, head dim, dtype and device."""
        cfg = model.config
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_seq_len,
                   cfg.head_dim, model.dtype, model.device)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True)
class RaggedBatch:
    """One step's work, every scheduled request's new tokens laid end to end (no padding).

    input_ids, positions: int64 (N,) on the device. query_start_loc: B + 1 host ints, request
    b's tokens are rows query_start_loc[b] .. query_start_loc[b + 1] - 1. context_lens: B host
    ints, request b's positions after this step (its cached ones + its new ones).
    block_tables: B tuples of host ints, each request's KV blocks (S09-S11: its one slot),
    and block_table_tensor the same as int64 (B, longest table) on the device, shorter
    tables padded with block 0 (S12's null block). samples: B bools, whether request b's new
    tokens reach the end of its tokens (its next token is sampled). num_draft_tokens: B ints,
    the draft tokens at the end of request b's new tokens (S15; 0 without speculation).
    sample_rows: int64 (sum over sampling requests of 1 + num_draft_tokens,) on the device,
    the rows whose logits are computed: each sampling request's last token, preceded by its
    drafts' positions when it verifies drafts (S15), in batch order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[tuple[int, ...]]
    block_table_tensor: torch.Tensor
    samples: list[bool]
    sample_rows: torch.Tensor
    num_draft_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_draft_tokens:          # made without drafts: none for any request
            object.__setattr__(self, "num_draft_tokens", [0] * len(self.block_tables))

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def slots(self) -> list[int]:
        """Each request's slot (the first entry of its block table)."""
        return [table[0] for table in self.block_tables]

    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])]

    def query_starts(self) -> list[int]:
        """Each request's first new position (= its cached positions)."""
        return [c - n for c, n in zip(self.context_lens, self.query_lens())]

    @classmethod
    def build(cls, new_tokens: Sequence[Sequence[int]], starts: Sequence[int],
              block_tables: Sequence[Sequence[int]], samples: Sequence[bool] | None = None,
              device: str | torch.device = "cpu",
              num_draft_tokens: Sequence[int] | None = None) -> "RaggedBatch":
        """From each request's new token ids, its first new position, its block table,
        whether it samples (default: every request) and how many of its new tokens are drafts
        to verify (default: none). Raises ValueError for no request, a request with no new
        token, or drafts that are not the end of a sampling request's new tokens."""
        if not new_tokens or any(len(t) == 0 for t in new_tokens):
            raise ValueError("a ragged batch needs at least one request, each with a new token")
        samples = [True] * len(new_tokens) if samples is None else list(samples)
        drafts = [0] * len(new_tokens) if num_draft_tokens is None else list(num_draft_tokens)
        if any(d and (not s or d >= len(t)) for d, s, t in zip(drafts, samples, new_tokens)):
            raise ValueError("a request's draft tokens must be the end of its new tokens, after "
                             "at least one token of its own, and it must sample")
        cu = np.cumsum([0] + [len(t) for t in new_tokens]).tolist()
        ids = [t for tokens in new_tokens for t in tokens]
        positions = [start + i for tokens, start in zip(new_tokens, starts)
                     for i in range(len(tokens))]
        tables = [tuple(t) for t in block_tables]
        width = max(len(t) for t in tables)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(positions), cu,
                   [start + len(t) for t, start in zip(new_tokens, starts)], tables,
                   as_tensor([list(t) + [0] * (width - len(t)) for t in tables]), samples,
                   as_tensor([row for end, s, d in zip(cu[1:], samples, drafts) if s
                              for row in range(end - 1 - d, end)]), drafts)


@dataclass
class ModelRunnerOutput:
    """What a runner returns for a step (vLLM's `ModelRunnerOutput`, trimmed): req_ids, the
    requests whose next token is sampled, in batch order; logits float32 (B_s, V) on the
    device, their raw logits in that order (with speculative decoding, S15: 1 +
    num_draft_tokens[i] rows for request i, one per position it verifies, then its bonus
    position); num_tokens, the tokens the step computed; model_s, wall seconds of the run
    (the engine sets it, and model_start, the perf_counter reading it began at);
    num_draft_tokens, per request in req_ids (empty: none drafted); prepare_s, wall seconds
    of the host's batch preparation inside the run (`prepare_inputs`: S16's profiler)."""

    req_ids: list[str]
    logits: torch.Tensor
    num_tokens: int
    model_s: float = 0.0
    num_draft_tokens: list[int] = field(default_factory=list)
    prepare_s: float = 0.0
    model_start: float = 0.0


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

def decode_rows(batch: RaggedBatch, device) -> tuple[list[int], torch.Tensor | None]:
    """The decoding requests of a batch (one query each) by batch index, and their rows in the
    flat token order: int64 (B_d,) on device, None when every request decodes (row b is
    then request b)."""
    lens = batch.query_lens()
    decodes = [b for b, n in enumerate(lens) if n == 1]
    rows = (None if len(decodes) == len(lens) else
            torch.tensor([batch.query_start_loc[b] for b in decodes], device=device))
    return decodes, rows


def context_mask(context_lens: Sequence[int], device, dtype: torch.dtype
                 ) -> tuple[int, torch.Tensor | None]:
    """(S, the longest context; the additive mask (R, 1, S) of dtype that hides each row's
    columns past its own context, or None when every context is S and every key is real).
    Made once per step, not in every layer."""
    s_len = max(context_lens)
    if min(context_lens) == s_len:
        return s_len, None
    allowed = (torch.arange(s_len, device=device)[None, :]
               < torch.tensor(context_lens, device=device)[:, None])
    return s_len, s08.additive_mask(allowed, dtype)[:, None]


class RaggedRunner:
    """S06's `TorchTransformer` run on a step's plan against a `SlotKVCache`.

    model: the TorchTransformer. cache: its `SlotKVCache` (S12's runner takes a paged one);
    cache.max_seq_len is the longest context a request may reach. batch_invariant: compute
    every sampling request alone (the exact reference, see the module docstring). attention:
    "masked" or "loop" (the fast mode's attention).

    `execute_model(plan, requests)`: plan is a `SchedulerOutput` (num_scheduled_tokens,
    num_computed_tokens and block_tables of each scheduled request), requests the engine's
    requests by id (their token_ids); returns a `ModelRunnerOutput`. Raises ValueError for
    sizes out of range, an unknown attention, or a plan that writes past a slot.
    """

    def __init__(self, model: s06.TorchTransformer, cache, batch_invariant: bool = False,
                 attention: str = "masked"):
        assert attention in RAGGED_ATTENTION, "EngineConfig checks it"
        self.model, self.cache = model, cache
        self.batch_invariant, self.attention = bool(batch_invariant), attention
        self.alone_computed: dict[str, int] = {}   # batch-invariant mode: see `_requests_alone`

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    # --- a step --------------------------------------------------------------------------

    def prepare_inputs(self, plan, requests: Mapping) -> tuple[list[str], RaggedBatch]:
        """The plan as a `RaggedBatch`: each scheduled request's tokens token_ids[start:start
        + n], rows in the order of their first block (S09: their slot, so the decoding slots
        form one range of the cache when they can). Returns (the ids in row order, batch)."""
        order = sorted(plan.num_scheduled_tokens, key=lambda rid: plan.block_tables[rid][0])
        new_tokens, starts, tables, samples, drafts = [], [], [], [], []
        spec = plan.scheduled_spec_decode_tokens
        for rid in order:
            start, n = plan.num_computed_tokens[rid], plan.num_scheduled_tokens[rid]
            token_ids = requests[rid].token_ids + list(spec.get(rid, ()))    # drafts: S15
            new_tokens.append(token_ids[start:start + n])
            starts.append(start)
            tables.append(plan.block_tables[rid])
            samples.append(start + n == len(token_ids))
            drafts.append(len(spec.get(rid, ())))
        return order, RaggedBatch.build(new_tokens, starts, tables, samples, self.model.device,
                                        drafts)

    @torch.inference_mode()
    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        """Run the plan: the logits of the rows that sample (see the class docstring)."""
        start = time.perf_counter()
        order, batch = self.prepare_inputs(plan, requests)
        prepare_s = time.perf_counter() - start
        assert max(batch.context_lens) <= self.cache.max_seq_len, "the scheduler stops it there"
        if self.batch_invariant:
            logits = self._requests_alone(plan, requests, order, batch)
        else:
            logits = self.forward(batch)
        sampled = [b for b, s in enumerate(batch.samples) if s]
        return ModelRunnerOutput([order[b] for b in sampled], logits, batch.num_tokens,
                                 num_draft_tokens=[batch.num_draft_tokens[b] for b in sampled],
                                 prepare_s=prepare_s)

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        """The fast mode: the N tokens through S06's layer code together (`qkv`, `finish`:
        every weight product sees N rows); each layer writes its keys and values into the
        cache (one index_copy_), then attends as `attention` says. Returns float32 (B_s, V),
        the logits of the sampling rows."""
        model = self.model
        device = model.device
        seq_of_token = torch.repeat_interleave(
            torch.arange(batch.num_seqs, device=device),
            torch.tensor(batch.query_lens(), device=device))                        # (N,)
        where = self.kv_index(batch, seq_of_token, batch.positions)
        requests = list(zip(range(batch.num_seqs), batch.query_start_loc,
                            batch.query_start_loc[1:], batch.context_lens))
        meta = self._decode_meta(batch) if self.attention == "masked" else None
        alone = [r for r in requests if meta is None or r[2] - r[1] > 1]  # attended one by one
        masks = {b: s06.causal_mask(ctx - (e - a), e - a, device)      # (T_b, S_b), per step
                 for b, a, e, ctx in alone if e - a > 1}
        x, cos, sin = s08.embed(model, batch.input_ids, batch.positions)           # (N, C)
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
                for b, a, e, ctx in alone:
                    attn[:, a:e] = s06.attention(q[:, a:e], *self.read_kv(layer, batch, b, ctx),
                                                 ctx - (e - a), block.scale,
                                                 model.attention_impl, masks.get(b))
            x = block.finish(x, attn)                                              # (N, C)
        return model.head(x[batch.sample_rows])                                   # (B_s, V)

    # --- the KV seams (S12 overrides them with block tables and a slot mapping) -----------

    def kv_index(self, batch: RaggedBatch, seq_of_token: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Where each new token's keys and values go, worked out once per step for every
        layer: seq_of_token (the token's row b), positions int64 (N,) -> int64 (Hkv N,), the
        row of each (key head, token) in a layer's cache seen as (slots Hkv S_max, D), so one
        index_copy_ writes the whole step."""
        n_kv, s_max = self.cache.k.shape[2], self.cache.max_seq_len
        slot_of_token = batch.block_table_tensor[seq_of_token, 0]                  # (N,)
        heads = torch.arange(n_kv, device=positions.device)[:, None]               # (Hkv, 1)
        return ((slot_of_token[None, :] * n_kv + heads) * s_max
                + positions[None, :]).reshape(-1)                                 # (Hkv N,)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 where: torch.Tensor) -> None:
        """k, v (Hkv, N, D) of the new tokens into the layer's cache at `kv_index`'s rows."""
        d = k.shape[-1]
        self.cache.k[layer].view(-1, d).index_copy_(0, where, k.reshape(-1, d))  # (Hkv N, D)
        self.cache.v[layer].view(-1, d).index_copy_(0, where, v.reshape(-1, d))

    def read_kv(self, layer: int, batch: RaggedBatch, b: int, length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values of request b of the batch, positions 0 .. length - 1:
        two (Hkv, length, D) views of its slot."""
        slot = batch.slots[b]
        return self.cache.k[layer, slot, :, :length], self.cache.v[layer, slot, :, :length]

    def _decode_meta(self, batch: RaggedBatch) -> dict | None:
        """The masked formulation's index work, done once per step for every layer. The
        decoding requests (one query each) attend over a view of the slot range they span,
        lo .. hi, never a gathered copy: slot lo + i gets query i of `order` (None when the
        requests sit in those slots in order), a slot in the range that no decoding request
        holds sees its first key only (a finite softmax row nobody reads), and each slot's
        columns past its context are masked. None when no request decodes."""
        device = self.model.device
        decodes, rows = decode_rows(batch, device)
        if not decodes:
            return None
        slots = [batch.slots[b] for b in decodes]
        lo, hi = min(slots), max(slots)
        ctx = [1] * (hi - lo + 1)
        for b, slot in zip(decodes, slots):
            ctx[slot - lo] = batch.context_lens[b]
        s_len, allowed = context_mask(ctx, device, self.model.dtype)      # (span, 1, S)
        in_order = slots == list(range(lo, hi + 1))
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

    # --- the batch-invariant reference -----------------------------------------------------

    def _requests_alone(self, plan, requests: Mapping, order: list[str],
                        batch: RaggedBatch) -> torch.Tensor:
        """Each sampling request computed alone with S06's shapes (float32 (B_s, V)).

        S06 computes a request's positions 0 .. end - 1 in these passes: the prompt in one,
        then one per token. `alone_computed[rid]` is how many of a request's positions hold
        KV computed by those passes (in the KV it holds now), and only from the prompt's end
        (below it, nothing counts: the prompt is one pass). It counts only while the
        scheduler agrees they are computed: every plan that schedules the request, whether
        it samples or not, lowers the count to that plan's num_computed_tokens. A preemption
        frees the request's KV and sets num_computed_tokens to 0; the recompute may come in
        chunks that do not sample (S11, S12) until num_computed_tokens is past the old count
        again, so checking only when the request samples would be too late. A failed step
        the scheduler took back and a request id used again bring it down too. The
        scheduler's count grows only through plans the runner executes, so the runner sees
        every decrease. A request that samples runs the passes from there to its end:
        usually the one decode token, or its whole prompt; after a prompt that arrived in
        chunks, or a recompute, every pass from position 0 (each pass's KV overwriting what
        was there). A row that does not sample computes nothing: its positions are computed
        when it samples. The count is taken out while its passes run and recorded when they
        are done, so passes that raise leave none: that request is computed again from
        position 0.
        """
        for rid in list(self.alone_computed):
            if rid not in requests:
                del self.alone_computed[rid]
        for rid in order:                  # every scheduled row, the ones that sample or not
            if self.alone_computed.get(rid, 0) > plan.num_computed_tokens[rid]:
                self.alone_computed[rid] = plan.num_computed_tokens[rid]
        model = self.model
        logits = torch.empty((len(batch.sample_rows), self.vocab_size), dtype=torch.float32,
                             device=model.device)
        row = 0
        for b, rid in enumerate(order):
            if not batch.samples[b]:
                continue
            token_ids = requests[rid].token_ids + list(
                plan.scheduled_spec_decode_tokens.get(rid, ()))           # drafts: S15
            end, first = batch.context_lens[b], batch.context_lens[b] - 1 - batch.num_draft_tokens[b]
            prompt = len(requests[rid].prompt_ids)
            done = self.alone_computed.pop(rid, 0)    # lowered to num_computed_tokens
            done = done if done >= prompt else 0
            pieces = ([(0, prompt)] if done == 0 else []) + [
                (p, p + 1) for p in range(max(done, prompt), end)]        # S06's passes
            assert pieces, "a row that samples has at least its last token to compute"
            for a, e in pieces:
                out = self._alone_pass(batch, b, token_ids[a:e], a)
                if e - 1 >= first:         # a position whose logits the step returns
                    logits[row + e - 1 - first] = out
            row += end - first
            self.alone_computed[rid] = end
        return logits

    def _alone_pass(self, batch: RaggedBatch, b: int, token_ids: Sequence[int], start: int
                    ) -> torch.Tensor:
        """One request's tokens at positions start .. start + T - 1 through S06's layers alone
        (its KV written as a step would write it); the logits float32 (V,) of the last."""
        model = self.model
        device = model.device
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(token_ids), device=device)
        x, cos, sin = s08.embed(model, ids, positions)                            # (T, C)
        where = self.kv_index(batch, torch.full((len(token_ids),), b, device=device),
                              positions)
        end = start + len(token_ids)
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv(x, cos, sin)
            self.write_kv(layer, k, v, where)
            x = block.finish(x, s06.attention(q, *self.read_kv(layer, batch, b, end), start,
                                              block.scale, model.attention_impl))
        return model.head(x[-1:])[0]
