"""S17, attention backends: the paged engine's attention as a component, four ways.

What is new since S16
    S12's runner reads a request's keys by gathering its blocks into a copy in every layer of
    every step, then runs S08's attention on the copy; prompt chunks go one request at a time.
    This module makes the attention a component the runner calls, `attention_backend`:

    - "gather": S12's runner as it is (the copy, then the model's attention_impl).
    - "sdpa": the same copy, attended by torch's `scaled_dot_product_attention` (the fused
      kernel on a contiguous copy: vLLM's first CPU backend did this).
    - "paged": code/s17_cpu.py's C kernel, which walks the block tables and reads the pool in
      place; one call per layer for the whole ragged batch (decodes and chunks). CPU, float32.
    - "triton": code/s17_triton.py's kernels: the KV written through the slot mapping by a
      kernel, decodes by the paged decode kernel (split-K when asked), prompt chunks by the
      flash-attention forward over their gathered keys. Compiled on CUDA; on a machine without
      CUDA in Triton's interpreter (code/s17_triton.py sets TRITON_INTERPRET=1 when it is the
      first to import triton): correct and very slow, for tests.

    `AttentionMetadata` is what every backend reads, made once per step (vLLM's
    `CommonAttentionMetadata`): query_start_loc, seq_lens, block_table, slot_mapping, the
    decode rows. `KernelRunner` wraps S12's `PagedRunner` (composition, as S16's static runner)
    and runs the layers with the backend's `write_kv` and `attend`; the batch-invariant
    reference stays S09's. `build_engine(attention_backend=...)` builds any paged engine
    (S13's by default: prefix caching and chunked prefill keep working) with it, and S19's
    server takes --attention-backend.

    `attention_traffic` is the analytic count of bytes each backend moves per layer per decode
    step (the chapter's table), to set beside the measured times.

What it does not handle
    S16's static (compiled, graph-captured) step has its own attention: compile and cuda_graphs
    need attention_backend="gather". S16's worker process runs S12's runner only. S14's 8-bit
    KV pool is read by "gather" only. The triton backend's prompt chunks still gather their
    keys (vLLM's Triton backend reads them through the table too).

Run it
    python code/s17_attention.py --attention-backend paged
    python code/s17_attention.py --attention-backend sdpa --max-num-batched-tokens 32
    python code/s17_attention.py --attention-backend triton --max-tokens 4   # interpreted

Tests
    tests/test_s17_attention.py: each backend's greedy tokens equal S05's and HF's alone and
    the gather's; outputs independent of neighbours; chunked prefill, prefix hits and
    preemption under each; the traffic formulas against hand counts; bad input named by rule.

References
    vLLM's attention backends (vllm/v1/attention/backends/: FlashAttentionBackend,
    TritonAttentionBackend, the CPU backend) and `CommonAttentionMetadata`
    (vllm/v1/attention/backends/utils.py) for the split of metadata and kernels; Kwon et al.,
    PagedAttention (SOSP 2023); Dao et al., FlashAttention (2022) and FlashAttention-2 (2023).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S09, before NumPy loads

import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

import s06_torch as s06
import s08_static_batching as s08
import s13_prefix_caching as s13
import s17_cpu
from s01_generation_loop import ParameterError
from s09_ragged import ModelRunnerOutput, RaggedBatch, context_mask, decode_rows
from s12_engine import PagedKVCache, PagedRunner

ATTENTION_BACKENDS = ("gather", "sdpa", "paged", "triton")


# ---------------------------------------------------------------------------------------------
# What every backend reads, once per step
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs (vLLM's `CommonAttentionMetadata`, trimmed).

    query_start_loc: int64 (B + 1,), request b's new tokens are rows query_start_loc[b] ..
    query_start_loc[b + 1] - 1 of the step; seq_lens: int64 (B,), each request's context after
    the step; block_table: int64 (B, M), null-padded; slot_mapping: int64 (N,), each new
    token's pool slot (block * block_size + offset); all on the device. The host copies:
    query_lens, context_lens (B ints); max_seq_len; decodes, the requests with one new token,
    and decode_rows, their rows (int64 on the device, None when every request decodes).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    max_seq_len: int
    decodes: list[int]
    decode_rows: torch.Tensor | None

    @classmethod
    def build(cls, batch: RaggedBatch, slot_mapping: torch.Tensor) -> "AttentionMetadata":
        device = batch.input_ids.device
        as_long = dict(dtype=torch.int64, device=device)
        decodes, rows = decode_rows(batch, device)
        return cls(torch.tensor(batch.query_start_loc, **as_long),
                   torch.tensor(batch.context_lens, **as_long),
                   batch.block_table_tensor, slot_mapping, batch.query_lens(),
                   list(batch.context_lens), max(batch.context_lens), decodes, rows)

    @property
    def all_decode(self) -> bool:
        return len(self.decodes) == len(self.query_lens)


# ---------------------------------------------------------------------------------------------
# The backends: write_kv(layer, k, v, meta) and attend(layer, q, scale, meta) -> (H, N, D)
# ---------------------------------------------------------------------------------------------

class SdpaBackend:
    """The gathered copy attended by torch's SDPA: the decoding requests in one masked call,
    each prompt chunk in its own (bottom-right causal) call."""

    name = "sdpa"

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.cache.write(layer, meta.slot_mapping, k, v)

    def attend(self, layer: int, q: torch.Tensor, scale: float, meta: AttentionMetadata
               ) -> torch.Tensor:
        out = torch.empty_like(q)                                              # (H, N, D)
        gqa = q.shape[0] != self.cache.k.shape[3]
        if meta.decodes:
            lens = [meta.context_lens[b] for b in meta.decodes]
            tables = (meta.block_table if meta.all_decode
                      else meta.block_table[torch.tensor(meta.decodes, device=q.device)])
            s_len, mask = context_mask(lens, q.device, q.dtype)               # (B_d, 1, S)
            keys, values = self.cache.gather(layer, tables, s_len)            # (B_d, Hkv, S, D)
            rows = q if meta.decode_rows is None else q[:, meta.decode_rows]
            att = F.scaled_dot_product_attention(
                rows.transpose(0, 1)[:, :, None], keys, values,
                attn_mask=None if mask is None else mask[:, None], scale=scale,
                enable_gqa=gqa)                                                # (B_d, H, 1, D)
            att = att[:, :, 0].transpose(0, 1)                                # (H, B_d, D)
            if meta.decode_rows is None:
                return att
            out[:, meta.decode_rows] = att
        starts = meta.query_start_loc.tolist()
        for b, (t_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            if t_len > 1:
                a, e = starts[b], starts[b + 1]
                keys, values = self.cache.gather(layer, meta.block_table[b:b + 1], ctx)
                out[:, a:e] = s06.attention(q[:, a:e], keys[0], values[0], ctx - t_len, scale,
                                            "sdpa")
        return out


class PagedCpuBackend:
    """code/s17_cpu.py's C kernel: every row of the step in one call per layer, the pool read
    in place through the block table. CPU, float32."""

    name = "paged"

    def __init__(self, cache: PagedKVCache, num_heads: int):
        if cache.k.device.type != "cpu":
            raise ParameterError("attention_backend='paged' is the CPU's C kernel; on CUDA use "
                                 "'triton'", "attention_backend")
        if cache.k.dtype != torch.float32:
            raise ParameterError(f"attention_backend='paged' reads float32 (the pool is "
                                 f"{cache.k.dtype}): use 'gather' or 'sdpa'",
                                 "attention_backend")
        self.cache = cache
        # the library built (or found) now, not mid-step; the pool's addresses taken once
        self.kernel = s17_cpu.PoolKernel(cache.k, cache.v, num_heads)
        self.meta: AttentionMetadata | None = None

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.cache.write(layer, meta.slot_mapping, k, v)

    def attend(self, layer: int, q: torch.Tensor, scale: float, meta: AttentionMetadata
               ) -> torch.Tensor:
        if meta is not self.meta:                # a new step: its index tensors, once
            self.kernel.set_step(meta.query_start_loc, meta.seq_lens, meta.block_table)
            self.meta = meta
        out = torch.empty_like(q)                                              # (H, N, D)
        self.kernel.attend(layer, q.transpose(0, 1), scale, out.transpose(0, 1))
        return out


class TritonBackend:
    """code/s17_triton.py's kernels: the KV written through the slot mapping, decodes by the
    paged decode kernel (num_splits > 1: split-K), prompt chunks by the flash forward over their
    gathered keys."""

    name = "triton"

    def __init__(self, cache: PagedKVCache, num_heads: int, num_splits: int = 1):
        import s17_triton
        s17_triton.check_triton(cache.k.device)
        s17_triton.check_pool_supported(cache.k[0], cache.v[0], num_heads)
        self.triton, self.cache, self.num_splits = s17_triton, cache, num_splits

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.triton.reshape_and_cache(k.transpose(0, 1), v.transpose(0, 1),
                                      self.cache.k[layer], self.cache.v[layer],
                                      meta.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, scale: float, meta: AttentionMetadata
               ) -> torch.Tensor:
        out = torch.empty_like(q)                                              # (H, N, D)
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        if meta.decodes:
            index = (None if meta.all_decode
                     else torch.tensor(meta.decodes, device=q.device))
            rows = q if index is None else q[:, meta.decode_rows]
            att = self.triton.paged_decode_attention(
                rows.transpose(0, 1).contiguous(), k_pool, v_pool,
                meta.block_table if index is None else meta.block_table[index],
                meta.seq_lens if index is None else meta.seq_lens[index], scale,
                num_splits=self.num_splits)                                    # (B_d, H, D)
            if index is None:
                return att.transpose(0, 1)
            out[:, meta.decode_rows] = att.transpose(0, 1)
        chunks = [b for b, t in enumerate(meta.query_lens) if t > 1]
        if chunks:
            starts = meta.query_start_loc.tolist()
            rows = torch.cat([torch.arange(starts[b], starts[b + 1], device=q.device)
                              for b in chunks])
            keys, values, cu_q, cu_k = [], [], [0], [0]
            for b in chunks:
                ctx = meta.context_lens[b]
                k, v = self.cache.gather(layer, meta.block_table[b:b + 1], ctx)  # (1, Hkv, S, D)
                keys.append(k[0].transpose(0, 1))
                values.append(v[0].transpose(0, 1))
                cu_q.append(cu_q[-1] + meta.query_lens[b])
                cu_k.append(cu_k[-1] + ctx)
            as_long = dict(dtype=torch.int64, device=q.device)
            att = self.triton.flash_attn_varlen(
                q[:, rows].transpose(0, 1).contiguous(), torch.cat(keys).contiguous(),
                torch.cat(values).contiguous(), torch.tensor(cu_q, **as_long),
                torch.tensor(cu_k, **as_long), scale,
                max_seqlen_q=max(meta.query_lens[b] for b in chunks))          # (N_c, H, D)
            out[:, rows] = att.transpose(0, 1)
        return out


def make_backend(name: str, cache: PagedKVCache, num_heads: int, num_splits: int = 1):
    """The backend object of this name over this pool, for a model of num_heads query heads
    ("gather" has none: S12's runner is it). Raises ParameterError naming the rule when this
    machine or pool cannot run it."""
    check_backend_name(name)
    if type(cache) is not PagedKVCache:
        raise ParameterError(f"attention_backend={name!r} reads S12's float pool; S14's 8-bit "
                             f"KV cache is read by 'gather' only (drop kv_cache_dtype)",
                             "attention_backend")
    if name == "sdpa":
        return SdpaBackend(cache)
    if name == "paged":
        return PagedCpuBackend(cache, num_heads)
    assert name == "triton", name
    return TritonBackend(cache, num_heads, num_splits)


def check_backend_name(name) -> None:
    if name not in ATTENTION_BACKENDS:
        raise ParameterError(f"attention_backend must be one of {ATTENTION_BACKENDS} "
                             f"(got {name!r})", "attention_backend")


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

class KernelRunner:
    """S12's `PagedRunner` with its attention done by a backend (composition: inner keeps the
    model, the pool and the batch preparation).

    `execute_model(plan, requests)` as S09's runner: the plan's batch (inner's
    `prepare_inputs`), its `AttentionMetadata` (the slot mapping by inner's `kv_index`), then
    the layers: S06's `qkv`, the backend's `write_kv` and `attend` for every row at once,
    S06's `finish`; the logits of the sampling rows. A batch-invariant engine runs inner's
    steps (S09's exact reference is the oracle every backend is checked against).
    """

    def __init__(self, inner: PagedRunner, backend):
        if not isinstance(inner, PagedRunner):
            raise ParameterError("attention backends need S12's paged runner (block tables "
                                 "and a slot mapping): build with S12-S15's builders",
                                 "attention_backend")
        self.inner, self.backend = inner, backend

    model = property(lambda self: self.inner.model)
    cache = property(lambda self: self.inner.cache)
    vocab_size = property(lambda self: self.inner.vocab_size)
    batch_invariant = property(lambda self: self.inner.batch_invariant)
    attention = property(lambda self: self.inner.attention)
    alone_computed = property(lambda self: self.inner.alone_computed)

    @torch.inference_mode()
    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        if self.inner.batch_invariant:
            return self.inner.execute_model(plan, requests)
        if plan.new_block_ids:
            self.cache.zero_blocks(plan.new_block_ids)
        start = time.perf_counter()
        order, batch = self.inner.prepare_inputs(plan, requests)
        assert max(batch.context_lens) <= self.cache.max_seq_len, "the scheduler stops it there"
        meta = self.metadata(batch)
        prepare_s = time.perf_counter() - start
        logits = self.forward(batch, meta)
        sampled = [b for b, s in enumerate(batch.samples) if s]
        return ModelRunnerOutput([order[b] for b in sampled], logits, batch.num_tokens,
                                 num_draft_tokens=[batch.num_draft_tokens[b] for b in sampled],
                                 prepare_s=prepare_s)

    def metadata(self, batch: RaggedBatch) -> AttentionMetadata:
        """The step's `AttentionMetadata` (the slot mapping is S12's)."""
        seq_of_token = torch.repeat_interleave(
            torch.arange(batch.num_seqs, device=batch.input_ids.device),
            torch.tensor(batch.query_lens(), device=batch.input_ids.device))      # (N,)
        return AttentionMetadata.build(batch, self.inner.kv_index(batch, seq_of_token,
                                                                  batch.positions))

    def forward(self, batch: RaggedBatch, meta: AttentionMetadata) -> torch.Tensor:
        """The N tokens through the layers, every attention row in one backend call per
        layer. Returns float32 (B_s, V), the logits of the sampling rows."""
        model, backend = self.model, self.backend
        x, cos, sin = s08.embed(model, batch.input_ids, batch.positions)           # (N, C)
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv(x, cos, sin)         # q (H, N, D); k, v (Hkv, N, D)
            backend.write_kv(layer, k, v, meta)
            x = block.finish(x, backend.attend(layer, q, block.scale, meta))      # (N, C)
        return model.head(x[batch.sample_rows])                                   # (B_s, V)


def use_backend(engine, name: str, num_splits: int = 1):
    """Give a built paged engine (S12-S15's `build_engine`) this attention backend; returns
    the engine. "gather" leaves it as it is. Raises ParameterError naming the rule."""
    from s09_continuous_batching import LLMEngine
    check_backend_name(name)
    if not isinstance(engine, LLMEngine):
        raise ParameterError("set the attention backend on the S09 engine before async "
                             "scheduling wraps it", "attention_backend")
    if name == "gather":
        return engine
    runner = engine.runner
    if not isinstance(runner, PagedRunner):
        raise ParameterError(f"attention_backend={name!r} replaces S12's paged runner's "
                             f"attention; this engine's runner is {type(runner).__name__} "
                             f"(S16's static step and worker process have their own: use "
                             f"attention_backend='gather' with them)", "attention_backend")
    heads = runner.model.config.num_attention_heads
    engine.runner = KernelRunner(runner, make_backend(name, runner.cache, heads, num_splits))
    return engine


def build_engine(model: s06.TorchTransformer, tokenizer, *, attention_backend: str = "gather",
                 num_splits: int = 1, builder: Callable = s13.build_engine, **options):
    """The engine `builder` makes (a paged one: S12's, S13's (default), S14's, S15's), its
    attention done by attention_backend (one of ATTENTION_BACKENDS; num_splits: the triton
    backend's split-K). options: the builder's. Raises ParameterError naming the rule: an
    unknown backend, one this machine cannot run (paged: a C compiler, a CPU and float32;
    triton: Triton, and on a CPU its interpreter), S14's 8-bit pool with a kernel backend."""
    check_backend_name(attention_backend)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ParameterError(f"num_splits must be an integer >= 1 (got {num_splits!r})",
                             "num_splits")
    if num_splits > 1 and attention_backend != "triton":
        raise ParameterError("num_splits is the triton backend's split-K (flash decoding)",
                             "num_splits")
    if attention_backend == "paged":
        if model.device.type != "cpu":
            raise ParameterError("attention_backend='paged' is the CPU's C kernel; on CUDA use "
                                 "'triton'", "attention_backend")
        if model.dtype != torch.float32:
            raise ParameterError(f"attention_backend='paged' reads float32 (the model is "
                                 f"{model.dtype}): use 'gather' or 'sdpa'", "attention_backend")
    if attention_backend == "triton":
        import s17_triton
        s17_triton.check_triton(model.device)
    return use_backend(builder(model, tokenizer, **options), attention_backend, num_splits)


# ---------------------------------------------------------------------------------------------
# Bytes moved per layer per decode step
# ---------------------------------------------------------------------------------------------

def attention_traffic(backend: str, context_lens: Sequence[int], *, num_heads: int,
                      num_kv_heads: int, head_dim: int, block_size: int = 16,
                      dtype_bytes: int = 4, score_bytes: int = 4) -> dict:
    """Bytes one layer's attention reads and writes in a decode step: the algorithm's own
    traffic, each tensor moved once per pass that touches it (caches ignored: the count a
    GPU's HBM sees when nothing fits in on-chip memory; on a CPU the last-level cache hides
    some of it for small batches).

    backend: "contiguous" (S11's slots: the masked batch reads every request's slot up to the
    longest context S_max, in place, fused: no scores in memory); "gather" (S12: each request's
    first cdiv(S_max, block_size) blocks copied out of the pool, the copy read back by an
    unfused attention whose scores and probabilities go through memory: written, read,
    written, read); "sdpa" (the same copy, a fused kernel); "paged" and "triton" (each
    request's own S_b positions read in place, plus its block-table entries, int64).
    context_lens: each decoding request's context (the new position included). Every backend
    also writes the new keys and values, reads q and writes the output. Returns a dict of
    bytes: read, written, total, and the parts kv_read (keys and values read where they
    live), kv_copy (the gather's copy, written plus read), scores, tables, kv_write, q_out.
    Raises ParameterError for an unknown backend or no context.
    """
    if backend not in ("contiguous",) + ATTENTION_BACKENDS:
        raise ParameterError(f"backend must be 'contiguous' or one of {ATTENTION_BACKENDS} "
                             f"(got {backend!r})", "backend")
    lens = [int(n) for n in context_lens]
    if not lens or min(lens) < 1:
        raise ParameterError("context_lens must be one or more positive lengths",
                             "context_lens")
    batch, longest = len(lens), max(lens)
    per_position = 2 * num_kv_heads * head_dim * dtype_bytes         # a key and a value
    copied = batch * -(-longest // block_size) * block_size          # the gather's positions
    if backend == "contiguous":
        kv_read, copy_written, copy_read = batch * longest * per_position, 0, 0
    elif backend in ("gather", "sdpa"):
        kv_read = copied * per_position
        copy_written, copy_read = copied * per_position, batch * longest * per_position
    else:
        kv_read, copy_written, copy_read = sum(lens) * per_position, 0, 0
    scores = 4 * batch * num_heads * longest * score_bytes if backend == "gather" else 0
    tables = (sum(-(-n // block_size) for n in lens) * 8
              if backend in ("paged", "triton") else 0)
    kv_write = batch * per_position
    q_out = 2 * batch * num_heads * head_dim * dtype_bytes
    read = kv_read + copy_read + scores // 2 + tables + q_out // 2
    written = copy_written + scores // 2 + kv_write + q_out // 2
    return dict(read=read, written=written, total=read + written, kv_read=kv_read,
                kv_copy=copy_written + copy_read, scores=scores, tables=tables,
                kv_write=kv_write, q_out=q_out)


# ---------------------------------------------------------------------------------------------
# The chapter script
# ---------------------------------------------------------------------------------------------

def add_attention_arguments(parser) -> None:
    """--attention-backend (vLLM's flag name) and --num-splits (this script and S19's)."""
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="gather",
                        help="how the paged engine attends: 'gather' (S12: copy the blocks, "
                             "then attention), 'sdpa' (the copy, torch's fused SDPA), 'paged' "
                             "(a C kernel reading the blocks in place; CPU, float32), "
                             "'triton' (Triton kernels; without CUDA in Triton's interpreter, "
                             "very slow) (default: %(default)s)")
    parser.add_argument("--num-splits", type=int, default=1,
                        help="the triton backend's split-K for decode steps: each request's "
                             "keys cut into this many ranges, merged by log-sum-exp "
                             "(default: %(default)s)")


def check_attention_arguments(parser, args) -> None:
    """Usage errors before any model loads, each naming its flag."""
    device = s06.resolve_device_dtype(args.device)[0]
    if args.num_splits < 1:
        parser.error(f"--num-splits must be >= 1 (got {args.num_splits})")
    if args.num_splits > 1 and args.attention_backend != "triton":
        parser.error("--num-splits is the triton backend's split-K: add --attention-backend "
                     "triton")
    if args.attention_backend == "paged":
        if device.type != "cpu":
            parser.error("--attention-backend paged is the CPU's C kernel; on CUDA use "
                         "--attention-backend triton")
        if s17_cpu.find_cc() is None:
            parser.error("--attention-backend paged builds a C kernel at first use and needs "
                         "a C compiler (gcc, cc or clang, or $CC)")
    if args.attention_backend == "triton":
        try:
            import s17_triton
            s17_triton.check_triton(device)
        except ParameterError as err:
            parser.error(f"--attention-backend triton: {err}")
        size = getattr(args, "block_size", 16)
        if size & (size - 1) or not 1 <= size <= 256:
            parser.error(f"--attention-backend triton reads blocks of a power of two between 1 "
                         f"and 256 positions (--block-size {size})")
    if (args.attention_backend != "gather"
            and getattr(args, "kv_cache_dtype", "auto") != "auto"):
        parser.error(f"--attention-backend {args.attention_backend} reads the float KV pool; "
                     f"--kv-cache-dtype {args.kv_cache_dtype} (S14's 8-bit pool) is read by "
                     f"--attention-backend gather only")
    if args.attention_backend != "gather" and (getattr(args, "compile", False)
                                               or getattr(args, "cuda_graphs", False)):
        parser.error("--compile and --cuda-graphs run S16's static step, which has its own "
                     "attention: use them with --attention-backend gather")
    if (args.attention_backend != "gather"
            and getattr(args, "executor_backend", "uni") == "mp"):
        parser.error("--executor-backend mp runs S12's runner in the worker: use it with "
                     "--attention-backend gather")


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace
    import s12_engine as s12

    def add_arguments(parser) -> None:
        add_attention_arguments(parser)
        s12.add_paged_arguments(
            parser, "KV blocks in the pool, block 0 (the null block) included (default: "
                    "max-num-seqs x the context's blocks + 1)")

    def check(parser, args) -> None:
        s12.check_paged_arguments(parser, args)
        check_attention_arguments(parser, args)

    def options(args) -> dict:
        return dict(s12.paged_options(args), enable_kv_cache_events=False,
                    attention_backend=args.attention_backend, num_splits=args.num_splits)

    def describe(engine, tracers) -> str:
        runner = engine.runner
        name = runner.backend.name if isinstance(runner, KernelRunner) else "gather"
        if name == "triton" and runner.backend.triton.interpreted():
            name += " (in Triton's interpreter: correct, very slow)"
        if runner.batch_invariant:
            name += " (unused: --batch-invariant steps are S09's exact reference)"
        cache = runner.cache
        return (f"attention backend {name}; KV pool of {cache.num_blocks} blocks of "
                f"{cache.block_size}; {engine.scheduler.max_num_batched_tokens} tokens per step")

    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 17: attention kernels: the paged engine's attention by S12's gather, torch's "
        "SDPA, a C kernel that walks the block tables, or Triton kernels.",
        build_engine, add_arguments=add_arguments, options=options,
        tracers=lambda engine: [s09_trace.StepTracer()], describe=describe,
        table=lambda run, tracers: s09_trace.format_occupancy_table(tracers[0].records),
        check=check), argv)


if __name__ == "__main__":
    sys.exit(main())
