r"""S16, static shapes: persistent input buffers, batch-size buckets, a compiled decode step
and CUDA graphs.

What is new since S15
    A decode step of the bundled model is some 400 small torch ops; on a CPU each costs a few
    microseconds of Python and dispatch before any arithmetic, so the host, not the matmuls,
    sets the pace (code/s16_profile.py measures it). Removing that cost needs the step to have
    the same shapes every time, so it can be traced once and replayed: this module makes a
    decode step static.

    - `bucket_sizes(max_num_seqs)`: the batch sizes a decode step is padded to, nano-vllm's
      1, 2, 4, 8, 16, 32, 48, ... (vLLM's `cudagraph_capture_sizes` are 1, 2, 4 and then
      multiples of 8); `pick_bucket(sizes, n)` the smallest that holds n.
    - `StaticDecodeRunner`: a runner component wrapped around S12's `PagedRunner` (composition:
      prefill, chunked and mixed steps, speculative steps, the batch-invariant reference and
      batches larger than the largest bucket all run the inner runner, eagerly). A step in which
      every request decodes one token goes through persistent buffers instead: input ids,
      positions, slot mapping, context lengths and block tables, allocated once for the largest
      bucket and overwritten in place each step (vLLM's persistent `InputBatch`). The rows past
      the batch are padding: token 0 at position 0, a block table of null blocks, context
      length 1, writing their keys and values into slot 0 of the null block (block 0, never
      handed out and only ever read under a mask), so a padded row never changes a real row or a
      real request's KV.
    - `decode_step`, the static forward over those buffers: every layer writes its keys and
      values through the slot mapping and attends over the whole block table (S = blocks per
      table x block_size, the model's context rounded up to blocks), columns past each row's
      context masked. One shape per bucket, whatever the positions: nothing to recompile as
      requests grow. Two formulations of the attention: "gather" (S12's: copy the table's
      blocks out, then S06's decode attention, two matmuls: best eager) and "fused" (the same
      arithmetic as a broadcast multiply and a sum over the gathered keys: eager it would
      materialise a (B, S, Hkv, G, D) product, but inductor fuses the block-table gather into
      one loop that reads each key once: best compiled on the CPU).
    - compile=True: `torch.compile(fullgraph=True, dynamic=False)` of `decode_step`, one graph
      per bucket, compiled the first time a bucket is used (or all at once: `warmup()`), with no
      graph break (fullgraph) and no recompile across positions or steps (tests check dynamo's
      counters). Inductor generates C++ on the CPU, so it needs a C++ compiler
      (`check_compile_available`), and Triton on CUDA.
    - cuda_graphs=True (CUDA only): each bucket's step captured once in a `torch.cuda.CUDAGraph`
      and replayed, largest bucket first so the smaller ones reuse its memory from one shared
      pool (nano-vllm's `capture_cudagraph`); with compile=True the compiled step is captured.
    - `make_static(engine, compile=..., cuda_graphs=...)` puts the runner into a built paged
      engine (S12 to S15's builders); code/s16_host.py's `build_engine` and the S19 server use it.

What it does not handle
    Only pure decode steps are static: a step with a prompt chunk runs eagerly (vLLM's
    piecewise CUDA graphs keep attention out of the graph to capture mixed steps too). S14's
    8-bit KV pool and S15's draft verification run eagerly. The static step reads the whole
    block table every step, so a short context pays for the model's longest; a real kernel
    stops at each row's length (S17). Compilation and capture cost seconds per bucket, paid once
    per process (inductor's on-disk cache makes a second process faster).

Run it
    python code/s16_host.py --compile                       # the chapter script
    python benchmarks/bench_s16_host.py --quick             # eager vs static vs compiled

Tests
    tests/test_s16_static.py: bucket rules; every static step's logits within 1e-4 of the
    eager paged runner's on the same plan and KV, and greedy tokens equal S05 and S06 alone,
    eager, compiled (one compile per module) and on CUDA graphs (marked gpu); padded rows
    inert (real rows bitwise unchanged whatever they hold; only real slots and block 0
    written); no graph break, no recompile over a 64-token decode; fallbacks; bad options.

References
    nano-vllm `ModelRunner.capture_cudagraph` and `run_model` (batch sizes, largest first,
    shared pool, eager prefill). vLLM `CompilationConfig.cudagraph_capture_sizes`,
    `CUDAGraphMode`, `InputBatch` (vllm/v1/worker/gpu_input_batch.py). PyTorch: torch.compile
    (dynamo + inductor), "CUDA Graphs" in the CUDA semantics notes. gpt-fast (PyTorch, 2023):
    a static KV cache and a compiled decode step.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; M blocks per block table.
"""
from __future__ import annotations

import os
import shutil
import sysconfig
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

import s06_torch as s06
import s08_static_batching as s08
from s01_generation_loop import ParameterError
from s09_ragged import ModelRunnerOutput
from s12_engine import PagedKVCache, PagedRunner
from s12_paged_attention import cdiv

MAX_BUCKET = 512            # nano-vllm's and vLLM's largest captured decode batch
ATTENTION_FORMS = ("gather", "fused")


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------

def bucket_sizes(max_num_seqs: int, largest: int = MAX_BUCKET) -> list[int]:
    """The batch sizes a decode step is padded to: 1, 2, 4, 8, then every multiple of 16
    (nano-vllm's list), up to the first that holds max_num_seqs (a batch never outgrows the
    list) and at most `largest`. Raises ParameterError for max_num_seqs < 1."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ParameterError(f"max_num_seqs must be an integer >= 1 (got {max_num_seqs!r})",
                             "max_num_seqs")
    sizes, size = [], 1
    while size < 16:
        sizes.append(size)
        size *= 2
    sizes += range(16, max(16, max_num_seqs + 15) // 16 * 16 + 1, 16)
    top = min(largest, pick_bucket(sizes, min(max_num_seqs, largest)))
    return [s for s in sizes if s <= top]


def check_bucket_sizes(sizes) -> list[int]:
    """sizes as a sorted list without repeats; ParameterError ("cudagraph_capture_sizes")
    unless it is a non-empty sequence of integers in [1, MAX_BUCKET]."""
    if not isinstance(sizes, (str, bytes)) and hasattr(sizes, "__iter__"):
        sizes = list(sizes)                  # once: an iterator is read a single time
    if (not isinstance(sizes, list) or not sizes
            or any(not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= MAX_BUCKET
                   for s in sizes)):
        raise ParameterError(f"cudagraph_capture_sizes must be a non-empty list of integers in "
                             f"[1, {MAX_BUCKET}] (got {sizes!r:.80})", "cudagraph_capture_sizes")
    return sorted(set(sizes))


def pick_bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest size in sizes (sorted) that holds n rows, or None when n is larger than
    every size (the step then runs eagerly)."""
    for size in sizes:
        if size >= n:
            return size
    return None


# ---------------------------------------------------------------------------------------------
# The static decode step
# ---------------------------------------------------------------------------------------------

def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, mask: torch.Tensor, scale: float,
                           form: str = "gather", impl: str = "manual") -> torch.Tensor:
    """One query per row against the keys and values its block table names.

    q: (H, B, D); k_pool, v_pool: one layer's pool (num_blocks, block_size, Hkv, D);
    block_tables: int64 (B, M); mask: additive (B, S) in q's dtype, S = M block_size, 0 on a
    row's positions and -inf past them. form "gather": S12's gather of whole blocks, then
    S06's `decode_attention` (impl as S06's). "fused": scores and output as broadcast
    products summed over D and over S, the gather left to the compiler to fuse (the query
    heads that share a key head stacked as G = H / Hkv rows, HF's repeat_kv order).
    Returns (H, B, D)."""
    n_heads, batch, head_dim = q.shape
    num_blocks, block_size, n_kv, _ = k_pool.shape
    s_len = block_tables.shape[1] * block_size
    if form == "gather":
        ids = block_tables.reshape(-1)                                         # (B M,)
        keys = (k_pool.view(num_blocks, -1).index_select(0, ids)
                .view(batch, s_len, n_kv, head_dim).transpose(1, 2))           # (B, Hkv, S, D)
        values = (v_pool.view(num_blocks, -1).index_select(0, ids)
                  .view(batch, s_len, n_kv, head_dim).transpose(1, 2))
        out = s06.decode_attention(q.transpose(0, 1)[:, :, None], keys, values, scale, impl,
                                   mask[:, None, None])                        # (B, H, 1, D)
        return out[:, :, 0].transpose(0, 1)                                    # (H, B, D)
    keys = k_pool[block_tables].view(batch, s_len, n_kv, 1, head_dim)          # (B, S, Hkv, 1, D)
    values = v_pool[block_tables].view(batch, s_len, n_kv, 1, head_dim)
    rows = q.transpose(0, 1).reshape(batch, 1, n_kv, n_heads // n_kv, head_dim)  # (B, 1, Hkv, G, D)
    scores = (rows * keys).sum(-1) * scale + mask[:, :, None, None]           # (B, S, Hkv, G)
    probs = torch.softmax(scores, dim=1, dtype=torch.float32).to(q.dtype)
    out = (probs[..., None] * values).sum(1)                                   # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, head_dim).transpose(0, 1)               # (H, B, D)


def decode_step(model: s06.TorchTransformer, k_cache: torch.Tensor,
                v_cache: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, slot_mapping: torch.Tensor,
                context_lens: torch.Tensor, block_tables: torch.Tensor,
                form: str = "gather") -> torch.Tensor:
    """One decode step of B rows with static shapes (a bucket's). input_ids, positions,
    slot_mapping, context_lens: int64 (B,); block_tables: int64 (B, M); k_cache, v_cache: the
    pool (L, num_blocks, block_size, Hkv, D), written at slot_mapping (one index_put_ per
    layer) and read through the block tables. Returns float32 (B, V), the logits of every
    row (padded rows' too). No host sync, no data-dependent shape: it can be compiled into
    one graph and captured."""
    x, cos, sin = s08.embed(model, input_ids, positions)                       # (B, C)
    block_size = k_cache.shape[2]
    block_ids, offsets = slot_mapping // block_size, slot_mapping % block_size   # (B,)
    s_len = block_tables.shape[1] * block_size
    visible = (torch.arange(s_len, device=input_ids.device)[None, :]
               < context_lens[:, None])                                        # (B, S)
    mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(
        ~visible, float("-inf"))                                               # (B, S)
    for layer, block in enumerate(model.blocks):
        q, k, v = block.qkv(x, cos, sin)                 # q (H, B, D); k, v (Hkv, B, D)
        # written into the whole pool, not into a view of it: a compiled graph turns an
        # in-place write into a view of an input into a copy of the whole input
        layers = torch.full_like(block_ids, layer)
        k_cache.index_put_((layers, block_ids, offsets), k.transpose(0, 1))
        v_cache.index_put_((layers, block_ids, offsets), v.transpose(0, 1))
        k_pool, v_pool = k_cache[layer], v_cache[layer]
        attn = paged_decode_attention(q, k_pool, v_pool, block_tables, mask, block.scale,
                                      form, model.attention_impl)              # (H, B, D)
        x = block.finish(x, attn)                                              # (B, C)
    return model.head(x)                                                       # (B, V)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

CXX_NAMES = ("g++", "c++", "clang++")


def find_cxx() -> str | None:
    """The C++ compiler inductor would call on the CPU: $CXX if set, else the first of g++,
    c++, clang++ on PATH (None: none)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else list(CXX_NAMES)
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def check_compile_available(device: torch.device) -> None:
    """Raise ParameterError ("compile") when torch.compile could not build a step here: on
    the CPU inductor writes C++ that includes Python.h and needs a compiler and Python's
    headers; on CUDA it writes Triton kernels."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ParameterError("compile on CUDA needs Triton (inductor writes Triton "
                                 "kernels): pip install triton, or run without compile",
                                 "compile") from None
        return
    if find_cxx() is None:
        raise ParameterError("compile on the CPU needs a C++ compiler (inductor generates C++ "
                             "and builds it with g++ or clang++; none found on PATH or in "
                             "$CXX): install one, or run without compile", "compile")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        raise ParameterError(f"compile on the CPU needs Python's C headers (inductor's C++ "
                             f"includes Python.h; not found at {headers}): install your "
                             f"Python's development package (e.g. python3-dev), or run "
                             f"without compile", "compile")


def check_cuda_graphs_available(device: torch.device) -> None:
    """Raise ParameterError ("cuda_graphs") unless the model is on a CUDA device."""
    if device.type != "cuda":
        raise ParameterError(f"cuda_graphs needs the model on a CUDA device (it is on "
                             f"{device}): CUDA graphs record GPU kernel launches; run without "
                             f"cuda_graphs, or with --device cuda", "cuda_graphs")


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

class StaticDecodeRunner:
    """S12's `PagedRunner` with static-shape decode steps (see the module docstring).

    inner: the engine's `PagedRunner` (its cache a float `PagedKVCache`). sizes: the bucket
    sizes (default `bucket_sizes` of max_num_seqs). compile: torch.compile each bucket's step.
    cuda_graphs: capture and replay each bucket's step (CUDA only; captured at construction,
    largest first). form: the attention formulation, default "fused" when compiling on the
    CPU, else "gather". max_num_seqs: for the default sizes.

    `execute_model(plan, requests)` as S09's runner: a plan in which every request decodes
    one token, with no draft and at most the largest bucket of requests, runs the static step
    (counted in `num_static_steps`, by bucket in `steps_by_bucket`); any other plan runs
    inner's (`num_eager_steps`). `warmup()` compiles or captures every bucket now;
    `compile_times_s` holds the seconds each bucket's first call took. Raises ParameterError
    for bad sizes, a pool this step cannot write (S14's 8-bit one), a runner that is not
    S12's, and compile or cuda_graphs where this machine cannot do them.
    """

    def __init__(self, inner: PagedRunner, sizes: Sequence[int] | None = None, *,
                 compile: bool = False, cuda_graphs: bool = False, form: str | None = None,
                 max_num_seqs: int | None = None):
        if not isinstance(inner, PagedRunner):
            raise ParameterError("static decode steps need S12's paged runner (block tables "
                                 "and a slot mapping): build the engine with S12-S15's "
                                 "builders", "runner")
        cache = inner.cache
        if type(cache) is not PagedKVCache:
            raise ParameterError("static decode steps write the float KV pool directly; S14's "
                                 "8-bit KV cache runs eagerly only (drop kv_cache_dtype)",
                                 "kv_cache_dtype")
        model = inner.model
        if compile:
            check_compile_available(model.device)
        if cuda_graphs:
            check_cuda_graphs_available(model.device)
        if form is None:
            form = "fused" if compile and model.device.type == "cpu" else "gather"
        if form not in ATTENTION_FORMS:
            raise ParameterError(f"form must be one of {ATTENTION_FORMS} (got {form!r})", "form")
        self.inner, self.form = inner, form
        self.compile, self.cuda_graphs = bool(compile), bool(cuda_graphs)
        self.sizes = (check_bucket_sizes(sizes) if sizes is not None
                      else bucket_sizes(max_num_seqs or 1))
        device, largest = model.device, self.sizes[-1]
        self.blocks_per_table = cdiv(cache.max_seq_len, cache.block_size)            # M
        as_long = dict(dtype=torch.int64, device=device)
        # the persistent buffers (vLLM's InputBatch), each sized for the largest bucket
        self.input_ids = torch.zeros(largest, **as_long)
        self.positions = torch.zeros(largest, **as_long)
        self.slot_mapping = torch.zeros(largest, **as_long)       # padded rows: null block
        self.context_lens = torch.ones(largest, **as_long)
        self.block_tables = torch.zeros(largest, self.blocks_per_table, **as_long)
        self.step_fn = decode_step
        if self.compile:
            # one graph per bucket (and per model in a process), all of them one code
            # object's: dynamo's default limit is 8 graphs per function, and with fullgraph the
            # ninth shape is an error (FailOnRecompileLimitHit)
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64, 4 * len(self.sizes))
            self.step_fn = torch.compile(decode_step, fullgraph=True, dynamic=False)
        self.compile_times_s: dict[int, float] = {}
        self.steps_by_bucket: dict[int, int] = {}
        self.num_static_steps = self.num_eager_steps = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        if self.cuda_graphs:
            self.capture()

    # --- what the engine and the other components read ----------------------------------

    @property
    def model(self) -> s06.TorchTransformer:
        return self.inner.model

    @property
    def cache(self) -> PagedKVCache:
        return self.inner.cache

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def batch_invariant(self) -> bool:
        return self.inner.batch_invariant

    @property
    def attention(self) -> str:
        return self.inner.attention

    @property
    def alone_computed(self) -> dict[str, int]:
        return self.inner.alone_computed

    # --- a step --------------------------------------------------------------------------

    def static_rows(self, plan, requests: Mapping) -> list[str] | None:
        """The plan's request ids when it can run the static step (every request computes
        exactly its last token, nothing drafted, a bucket holds them, the fast mode), else
        None."""
        if (self.batch_invariant or plan.scheduled_spec_decode_tokens
                or pick_bucket(self.sizes, len(plan.num_scheduled_tokens)) is None):
            return None
        for rid, n in plan.num_scheduled_tokens.items():
            if n != 1 or plan.num_computed_tokens[rid] + 1 != len(requests[rid].token_ids):
                return None
        return list(plan.num_scheduled_tokens)

    def execute_model(self, plan, requests: Mapping) -> ModelRunnerOutput:
        """Run the plan (see the class docstring)."""
        rows = self.static_rows(plan, requests) if plan.num_scheduled_tokens else None
        if rows is None:
            self.num_eager_steps += 1
            return self.inner.execute_model(plan, requests)
        with torch.inference_mode():
            start = time.perf_counter()
            if plan.new_block_ids:
                self.cache.zero_blocks(plan.new_block_ids)
            bucket = self.prepare(plan, requests, rows)
            prepare_s = time.perf_counter() - start
            logits = self.run_bucket(bucket)[:len(rows)]                          # (B, V)
        self.num_static_steps += 1
        self.steps_by_bucket[bucket] = self.steps_by_bucket.get(bucket, 0) + 1
        return ModelRunnerOutput(rows, logits, len(rows), num_draft_tokens=[0] * len(rows),
                                 prepare_s=prepare_s)

    def prepare(self, plan, requests: Mapping, rows: list[str]) -> int:
        """Write the rows' inputs into the persistent buffers, and padding after them up to
        the bucket; returns the bucket. One host tensor, one copy per buffer."""
        bucket = pick_bucket(self.sizes, len(rows))
        block_size, width = self.cache.block_size, self.blocks_per_table
        host = []                     # per row: id, position, slot, context, M table entries
        for rid in rows:
            position = plan.num_computed_tokens[rid]
            table = plan.block_tables[rid]
            assert len(table) <= width, "a table holds at most max_context positions"
            host.append([requests[rid].token_ids[position], position,
                         table[position // block_size] * block_size + position % block_size,
                         position + 1, *table, *[0] * (width - len(table))])
        pad = [0, 0, 0, 1] + [0] * width                   # null block, context 1
        host += [pad] * (bucket - len(rows))
        values = torch.tensor(host, dtype=torch.int64).to(self.input_ids.device,
                                                          non_blocking=True)  # (bucket, 4 + M)
        self.input_ids[:bucket].copy_(values[:, 0])
        self.positions[:bucket].copy_(values[:, 1])
        self.slot_mapping[:bucket].copy_(values[:, 2])
        self.context_lens[:bucket].copy_(values[:, 3])
        self.block_tables[:bucket].copy_(values[:, 4:])
        return bucket

    def inputs(self, bucket: int) -> tuple:
        """The step's arguments for a bucket: views of the buffers' first rows (the same
        addresses every step, which a CUDA graph needs)."""
        return (self.model, self.cache.k, self.cache.v, self.input_ids[:bucket],
                self.positions[:bucket], self.slot_mapping[:bucket],
                self.context_lens[:bucket], self.block_tables[:bucket], self.form)

    def run_bucket(self, bucket: int) -> torch.Tensor:
        """The step on the buffers' first `bucket` rows: a graph replay, or the (compiled)
        step. Returns float32 (bucket, V)."""
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1].clone()       # the next replay writes the same memory
        first = self.compile and bucket not in self.compile_times_s
        start = time.perf_counter()
        logits = self.step_fn(*self.inputs(bucket))
        if first:
            self.compile_times_s[bucket] = time.perf_counter() - start
        return logits

    @torch.inference_mode()
    def warmup(self) -> dict[int, float]:
        """Compile (or capture) every bucket now, largest first, on padding rows only (they
        write the null block). Returns compile_times_s."""
        for bucket in sorted(self.sizes, reverse=True):
            self.prepare_padding(bucket)
            self.run_bucket(bucket)
        return dict(self.compile_times_s)

    def prepare_padding(self, bucket: int) -> None:
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].zero_()
        self.context_lens[:bucket].fill_(1)
        self.block_tables[:bucket].zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's step in a CUDA graph, largest first, all in one memory pool
        (a smaller graph's tensors fit in what the largest one left): each is run a few times
        on a side stream first (compiling it, and letting lazy CUDA initialisation happen
        outside the capture), then recorded on padding rows."""
        for bucket in sorted(self.sizes, reverse=True):
            self.prepare_padding(bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.run_bucket(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = self.step_fn(*self.inputs(bucket))
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize()


def make_static(engine, *, compile: bool = False, cuda_graphs: bool = False,
                sizes: Sequence[int] | None = None, form: str | None = None):
    """Give a built paged engine (S12-S15's `build_engine`) a `StaticDecodeRunner` around its
    runner; returns the engine. Raises ParameterError as the runner does, and for anything
    but an S09 `LLMEngine` (make the steps static before async scheduling wraps it)."""
    from s09_continuous_batching import LLMEngine
    if not isinstance(engine, LLMEngine):
        raise ParameterError("make_static takes an S09 LLMEngine (make its steps static "
                             "before make_async wraps the engine)", "engine")
    engine.runner = StaticDecodeRunner(engine.runner, sizes, compile=compile,
                                       cuda_graphs=cuda_graphs, form=form,
                                       max_num_seqs=engine.config.max_num_seqs)
    return engine
