"""S17's measurement: what tiling saves in memory, what reading the KV pool in place through the
block tables saves per decode step, the bytes each attention backend moves, and (on a GPU) the
Triton kernels against torch's SDPA; every ratio taken within one run.

    python benchmarks/bench_s17_attention.py --quick     # a smoke run, < 20 s (scratch JSON)
    python benchmarks/bench_s17_attention.py             # the full run, ~6 min (scratch JSON)
    python benchmarks/bench_s17_attention.py --record    # the committed record (a quiet machine)
    python benchmarks/bench_s17_attention.py --device cuda --json OUT.json   # the GPU section

A benchmark, not a test: it prints, never asserts (a target missed is printed as "MISS").
Float32 on the CPU unless the GPU section, one torch thread (the C kernel's OpenMP too: it
uses torch's thread count), greedy, random prompt ids (EOS ignored). Shape legend: B batch, T
tokens, S keys, H query heads, Hkv key/value heads, D head dim.

Sections (--sections; default memory,decode,traffic on the CPU, gpu with --device cuda):

1. memory: peak memory of one causal prefill of T tokens of the bundled model's head shape
   (H = 4, Hkv = 2, D = 32, float32) at T = 2048, 4096, 8192, four ways: "naive" (S06's
   `attention`, impl "manual": the (H, T, T) scores in memory, masked, softmaxed), "sdpa math"
   (torch's SDPA held to its math backend: the scores in memory too), "sdpa" (torch's default
   SDPA on this CPU: a fused kernel) and "tiled" (S17's torch reference
   `s17_flash.flash_attention_varlen`, tiles of 128 x 128). Each (method, T) runs in a fresh
   process forked from this one (two at a time: memory is per process, so they do not disturb
   each other's figure; the seconds they print are indicative only; where the platform cannot
   fork, a spawned one; the section runs before any model is built): a tiny call of the same
   method first (its kernels loaded), then q, k, v made, the free C heap given back to the
   system (glibc's malloc_trim, so the call cannot reuse resident pages the parent left), the
   peak resident set reset (Linux's /proc/self/clear_refs "5") and read after the
   one measured call (getrusage's ru_maxrss): peak = that peak - the resident set just before
   the call (without the reset, the peak before the call is the floor instead). Beside it the
   analytic scores bytes H T^2 4 (float32), and each method's max |difference| from the naive
   output (the same seeded q, k, v).
2. decode: the decode step of S12's paged engine with each attention backend ("gather": S12's
   runner, its copy of the blocks then the model's attention; "sdpa": the copy attended by
   torch's SDPA; "paged": code/s17_cpu.py's C kernel walking the block tables) against S11's
   contiguous engine (`s11_chunked_prefill.build_engine`: one slot per request, no paging),
   on two models: the bundled one (6 layers, hidden 128, its 256-token window; contexts 32,
   96, 160) and a seeded random Qwen3 layout (bench_s11's MID_SHAPE, built as
   bench_s12_paged_attention builds it: 8 layers, hidden 512, 8 heads, 4 KV heads, D 64, a
   2048-token window; contexts 128, 512, 1536), both attending with SDPA (attention="sdpa",
   S12's benchmark's choice: the contiguous baseline at its fastest), at B = --batches.
   Each request's prompt is the context drawn +-25 % (seeded; a ragged batch), so the longest
   requests reach about 5/4 of the context, near each model's limit. The mid-size model skips
   the points with B x context over MID_TOKEN_CAP (32768) prompt tokens (B = 32 and 64 at
   1536: their prefill alone would take minutes here); the skipped points are listed. Per
   point: the two engines built (max_num_seqs = B, a context just large enough), the same
   prompts added to both and prefilled in one step (a token budget of all the prompts, so
   every request starts decoding at once); the three backends share the paged engine (its
   runner swapped between steps:
   `s17_attention.use_backend`'s runners over the one pool, so one prefill serves three
   backends). Then one untimed step of each backend, each followed by a contiguous step, and
   --repeats rounds, the backends' order rotated each round, each backend taking --steps
   decode steps, each paged step followed by one contiguous step (so the two engines'
   contexts stay within a token of each other, and the contiguous engine is timed three
   times as often). step ms = the median wall time of `engine.step()`; model ms = the median
   of the runner's share (S09's StepResult.times["model"]: `execute_model`, batch preparation
   included), read by an observer; every timed step is checked to be a pure decode step (B
   tokens). Reported per (model, B, context): each engine's step and model ms, paged /
   contiguous and gather / contiguous, the tokens both engines generated compared (the
   paged engine's tokens come from all three backends in turn), and the verdict of the
   issue's target, paged step <= 1.0x contiguous.
3. traffic: the attention alone, one layer of one decode step, on a pool of random keys and
   values with each decode point's context lengths (the full grid B x context of both
   models: no prefill is needed here), blocks shuffled: "contiguous" (S08's masked SDPA over a
   contiguous (B, Hkv, S, D) tensor, S11's engine's read), "gather" (S12's `gather` copy then
   S06's unfused attention, impl "manual": the traffic model's gather), "sdpa" (the copy,
   then torch's SDPA: also what the engine's gather runs here, its models attending with
   SDPA) and "paged" (`s17_cpu.paged_attention`), alternating, medians of max(3, --repeats x
   --steps) calls; their outputs compared first. Beside each, `s17_attention.
   attention_traffic` (the bytes the algorithm reads and writes per layer per step) and
   bytes / median time = the effective bandwidth, against a copy of one large tensor (S07's
   `measure_bandwidth`). On a CPU the caches hold a small batch's keys, so a small point can
   beat the copy's bandwidth.
4. gpu (--device cuda only, each part skipped with its reason when a piece is missing):
   code/s17_triton.py's `flash_attn_varlen` (a few tile sizes) against
   `F.scaled_dot_product_attention(is_causal=True)` at T = 1k, 4k, 16k (H = 32, Hkv = 8,
   D = 128, bfloat16, one request); `paged_decode_attention` against S12's gather + SDPA at
   contexts 1k, 4k, 16k, 32k, B = 1 and 16 (every request the same context, blocks shuffled)
   with the effective bandwidth of each against the device's copy; split-K's gain at B = 1
   (num_splits 1 against 4, 8, 16) at contexts 4k, 16k, 32k. torch.cuda.Event timing after
   warm-up calls (the compiles), the methods alternating, medians of --gpu-repeats calls;
   outputs compared. The JSON is written after every part, so a run stopped by a time budget
   keeps what it measured; with --budget-s a row starts only if it fits (twice the longest
   row so far), the rows left out named in the JSON's "cut". scripts/gpu_check.sh runs this
   section in its part s17, after S17's gpu-marked tests.

--quick is a smoke run (it checks that everything runs, < 20 s): memory at T = 1024 (naive
and tiled), the bundled model only, B = 1 and 8 at context 64, one round of two steps; on a
GPU T up to 4k and contexts up to 4k. Its figures are not the record's (QUICK_DISCLAIMER is
printed before and after) and it prints no verdicts ("(quick run: no verdict)"; targets []).

What it does not handle: the decode section is the CPU's (the "paged" backend is a CPU
kernel; the GPU section times the kernels alone, not the engine); the mid-size model is
measured on the points MID_TOKEN_CAP allows; the engines run S12's builder (no prefix
caching: random prompts would never hit).

The CPU is shared: `uptime` and os.getloadavg() are recorded before and after, and each
section's 1-minute load. JSON goes to --json (default a scratch file in the temp directory),
or with --record to chapters/figures/s17_attention.json; it is rewritten after each section.

Tests: tests/test_s17_bench.py (flags, one --quick run, the record's consistency).

References: Dao et al., FlashAttention (2022) and FlashAttention-2 (2023) for the memory
argument; Kwon et al., PagedAttention (SOSP 2023); Dao, Haziza, Massa, Sizov, Flash-Decoding
(2023) for split-K; bench_s12_paged_attention.py (the decode timing, the mid-size model) and
bench_s16_host.py (the alternation, the flags, the record).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06, before NumPy loads

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_roofline as roof  # noqa: E402
import s08_cli  # noqa: E402
import s08_static_batching as s08  # noqa: E402
import s11_chunked_prefill as s11  # noqa: E402
import s12_engine as s12  # noqa: E402
import s17_attention as s17a  # noqa: E402
import s17_cpu  # noqa: E402
import s17_flash  # noqa: E402
from bench_s06_torch import IdTokenizer  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402
from bench_s11_chunked_prefill import MID_SHAPE  # noqa: E402
from s09_ragged import context_mask  # noqa: E402

RECORD_JSON = ROOT / "chapters" / "figures" / "s17_attention.json"
DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s17_attention.json"
SECTIONS = ("memory", "decode", "traffic", "gpu")
CPU_SECTIONS = ("memory", "decode", "traffic")
QUICK_DISCLAIMER = ("--quick: a smoke run (memory at T = 1024, the bundled model only, B = 1 "
                    "and 8 at context 64, one round of two steps); its figures are not the "
                    "committed record's: chapters/figures/s17_attention.json")

# 1. memory
MEMORY_T = (2048, 4096, 8192)
QUICK_MEMORY_T = (1024,)
MEMORY_METHODS = ("naive", "sdpa math", "sdpa", "tiled")
QUICK_MEMORY_METHODS = ("naive", "tiled")
MEMORY_HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=32)     # the bundled model's
MEMORY_TILE = 128            # block_m = block_n of the tiled reference
MEMORY_JOBS = 2              # processes at once (memory is per process)
MEMORY_TIMEOUT_S = 600

# 2. decode and 3. traffic
BLOCK_SIZE = 16
ENGINE_BACKENDS = ("gather", "sdpa", "paged")     # on S12's paged engine; S11's is "contiguous"
ENGINES = ("contiguous",) + ENGINE_BACKENDS
KERNELS = ("contiguous", "gather", "sdpa", "paged")   # 3.'s attention alone
JITTER = 0.25                # each prompt is the context +- 25 %
WARMUP = 1                   # untimed steps of each backend (and as many contiguous ones)
MID_TOKEN_CAP = 32768        # the mid-size model's points: B x context prompt tokens at most
BUNDLED_CONTEXTS = (32, 96, 160)
MID_CONTEXTS = (128, 512, 1536)
QUICK_CONTEXTS = (64,)
TARGET = 1.0                 # the issue's: paged step <= 1.0x the contiguous step
MAX_BATCH = 64
MAX_REPEATS = 20
MAX_STEPS = 16

# 4. gpu
GPU_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)
GPU_DTYPE = torch.bfloat16
GPU_FLASH_T = (1024, 4096, 16384)
GPU_TILES = ((16, 16), (32, 32), (64, 32), (64, 64))     # (block_m, block_n) tried
GPU_CONTEXTS = (1024, 4096, 16384, 32768)
GPU_BATCHES = (1, 16)
GPU_SPLITS = (1, 4, 8, 16)
GPU_SPLIT_CONTEXTS = (4096, 16384, 32768)
QUICK_GPU = dict(flash_t=(1024, 4096), contexts=(1024, 4096), split_contexts=(4096,))


def load() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


def verdict(ok: bool | None) -> str:
    return "(quick run: no verdict)" if ok is None else "PASS" if ok else "MISS"


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# ---------------------------------------------------------------------------------------------
# 1. memory: naive against tiled, one process per (method, T)
# ---------------------------------------------------------------------------------------------

def memory_call(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The call a memory child measures, everything it reads made first: q (H, T, D), k, v
    (Hkv, T, D) float32 -> a zero-argument call returning (H, T, D)."""
    n_heads, t_len, head_dim = q.shape
    scale = head_dim ** -0.5
    if method == "naive":
        return lambda: s06.attention(q, k, v, 0, scale, "manual")
    if method in ("sdpa", "sdpa math"):
        from contextlib import nullcontext

        from torch.nn.attention import SDPBackend, sdpa_kernel
        group = n_heads // k.shape[0]            # keys of H heads: no GQA path needed
        qx, kx, vx = q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group,
                                                                                      0)[None]

        def call():
            with sdpa_kernel(SDPBackend.MATH) if method == "sdpa math" else nullcontext():
                return F.scaled_dot_product_attention(qx, kx, vx, is_causal=True,
                                                      scale=scale)[0]
        return call
    assert method == "tiled", method
    qt, kt, vt = (x.transpose(0, 1).contiguous() for x in (q, k, v))       # (T, H|Hkv, D)
    cu = torch.tensor([0, t_len])
    return lambda: s17_flash.flash_attention_varlen(
        qt, kt, vt, cu, cu, scale, block_m=MEMORY_TILE, block_n=MEMORY_TILE).transpose(0, 1)


def memory_inputs(t_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded q (H, T, D), k, v (Hkv, T, D) of MEMORY_HEADS, float32."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d = MEMORY_HEADS["num_heads"], MEMORY_HEADS["num_kv_heads"], MEMORY_HEADS["head_dim"]
    return (torch.randn(h, t_len, d, generator=g), torch.randn(hkv, t_len, d, generator=g),
            torch.randn(hkv, t_len, d, generator=g))


def rss_bytes() -> int | None:
    """This process's resident set now (Linux's /proc/self/statm; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def maxrss_bytes() -> int:
    """getrusage's ru_maxrss in bytes (KiB on Linux, bytes on macOS)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024)


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's malloc_trim), so that the
    measured call's allocations cannot reuse pages already resident: a forked child inherits
    its parent's free heap. False where there is no glibc."""
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0)) or True
    except (OSError, AttributeError):
        return False


def memory_child(method: str, t_len: int, seed: int, out: str) -> None:
    """In a fresh (forked) process: a tiny call of the method (its kernels loaded), the inputs,
    the free heap given back (`trim_heap`), the peak resident set reset (Linux's clear_refs
    "5"), one call, the peak read again.
    Writes the output to out + ".pt" and the figures to out + ".json"."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        memory_call(method, *memory_inputs(2 * MEMORY_TILE, seed + 1))()
        call = memory_call(method, *memory_inputs(t_len, seed))
        gc.collect()
        trimmed = trim_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")              # reset the peak resident set (Linux >= 4.0)
            reset = True
        except OSError:
            reset = False
        rss_before, maxrss_before = rss_bytes(), maxrss_bytes()
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
        maxrss_after = maxrss_bytes()
        torch.save(result.contiguous().clone(), out + ".pt")
    floor = (rss_before if reset and rss_before is not None
             else max(maxrss_before, rss_before or 0))
    Path(out + ".json").write_text(json.dumps({
        "method": method, "T": t_len, "peak_bytes": max(0, maxrss_after - floor),
        "rss_before_bytes": rss_before, "maxrss_before_bytes": maxrss_before,
        "maxrss_after_bytes": maxrss_after, "peak_reset": reset, "heap_trimmed": trimmed,
        "seconds": seconds}))


def memory_children(jobs: list[tuple[str, int]], seed: int, out_dir: Path) -> list[dict]:
    """`memory_child` for each (method, T) in its own process (forked where the platform
    can: no second import of torch), MEMORY_JOBS at a time; one dict per job, in order, with
    "output" (the saved tensor's path), or "error" where the child failed."""
    import multiprocessing
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    results: list[dict] = [{} for _ in jobs]
    pending, running = list(enumerate(jobs)), []
    while pending or running:
        while pending and len(running) < MEMORY_JOBS:
            i, (method, t_len) = pending.pop(0)
            out = str(out_dir / f"{method.replace(' ', '_')}_{t_len}")
            proc = context.Process(target=memory_child, args=(method, t_len, seed, out))
            proc.start()
            running.append((i, proc, out, time.perf_counter()))
        time.sleep(0.02)
        for entry in list(running):
            i, proc, out, started = entry
            if proc.is_alive() and time.perf_counter() - started < MEMORY_TIMEOUT_S:
                continue
            if proc.is_alive():
                proc.kill()
            proc.join()
            running.remove(entry)
            method, t_len = jobs[i]
            if proc.exitcode == 0 and Path(out + ".json").exists():
                results[i] = dict(json.loads(Path(out + ".json").read_text()),
                                  output=out + ".pt")
            else:
                results[i] = {"method": method, "T": t_len,
                              "error": f"the child ended with exit code {proc.exitcode}"}
    return results


def section_memory(args) -> dict:
    heads = MEMORY_HEADS
    ts = QUICK_MEMORY_T if args.quick else MEMORY_T
    methods = QUICK_MEMORY_METHODS if args.quick else MEMORY_METHODS
    before = load()
    print(f"\n1. memory: one causal prefill of T tokens, H = {heads['num_heads']}, Hkv = "
          f"{heads['num_kv_heads']}, D = {heads['head_dim']} (the bundled model's heads), "
          f"float32; peak resident memory of the call in a fresh process ({MEMORY_JOBS} at a "
          f"time); tiled: S17's reference, tiles {MEMORY_TILE} x {MEMORY_TILE}")
    jobs = [(m, t) for t in ts for m in methods]
    with tempfile.TemporaryDirectory(prefix="bench_s17_memory_") as tmp:
        results = memory_children(jobs, args.seed, Path(tmp))
        rows = []
        for t_len in ts:
            by = {r["method"]: r for r in results if r["T"] == t_len}
            naive = by.get("naive")
            reference = (torch.load(naive["output"]) if naive and "error" not in naive
                         else None)
            for method in methods:
                r = dict(by[method])
                r["scores_bytes"] = heads["num_heads"] * t_len * t_len * 4
                if "error" not in r and reference is not None:
                    out = torch.load(r["output"])
                    r["max_abs_diff_vs_naive"] = float((out - reference).abs().max())
                r.pop("output", None)
                rows.append(r)
    print(f"  {'T':>6} {'method':<10} {'peak MiB':>9} {'scores MiB':>10} {'peak/scores':>11} "
          f"{'seconds':>8} {'max |diff| vs naive':>19}")
    for r in rows:
        if "error" in r:
            print(f"  {r['T']:>6} {r['method']:<10} failed: {r['error'][:120]}")
            continue
        diff = r.get("max_abs_diff_vs_naive")
        print(f"  {r['T']:>6} {r['method']:<10} {r['peak_bytes'] / 2**20:>9.1f} "
              f"{r['scores_bytes'] / 2**20:>10.1f} {r['peak_bytes'] / r['scores_bytes']:>11.2f} "
              f"{r['seconds']:>8.2f} {'-' if diff is None else f'{diff:.1e}':>19}")
    if not all(r.get("peak_reset", True) for r in rows):
        print("  (the peak could not be reset here: peak = the high-water mark after the call "
              "less the larger of the high-water mark and the resident set before it)")
    print("  (scores: H x T^2 x 4 bytes, one float32 matrix of scores; peak/scores: about how "
          "many such matrices the call held at once; seconds: one call, indicative)")
    return {"heads": heads, "tile": MEMORY_TILE, "T": list(ts), "methods": list(methods),
            "rows": rows, "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# 2. decode: the paged engine's backends against S11's contiguous engine
# ---------------------------------------------------------------------------------------------

@dataclass
class Subject:
    """A model the decode and traffic sections measure: key ("bundled", "mid"), its name, the
    TorchTransformer, its head shape and layers, its context limit (tokens), the contexts and
    the prompt-token cap of its decode points (None: no cap)."""

    key: str
    name: str
    model: object
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    limit: int
    contexts: tuple
    token_cap: int | None
    build_s: float = 0.0

    @property
    def heads(self) -> dict:
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim)

    def affordable(self, batch: int, context: int) -> bool:
        """The decode section runs this point (the mid-size model's prefill is capped)."""
        return self.token_cap is None or batch * context <= self.token_cap


def subject_of(key: str, model, config, contexts, token_cap, build_s: float = 0.0) -> Subject:
    name = {"bundled": "bundled model", "mid": "mid-size random Qwen3"}[key]
    return Subject(key, name, model, config.num_attention_heads, config.num_key_value_heads,
                   config.head_dim, config.num_hidden_layers, config.max_position_embeddings,
                   tuple(contexts), token_cap, build_s)


def bundled_subject(args) -> Subject:
    start = time.perf_counter()
    model, _ = s06.load(attention="sdpa")
    contexts = QUICK_CONTEXTS if args.quick else BUNDLED_CONTEXTS
    return subject_of("bundled", model, model.config, contexts, None,
                      time.perf_counter() - start)


def mid_subject(args) -> Subject | str:
    """The mid-size model (bench_s12's `build`: transformers' random Qwen3, then S06's
    TorchTransformer with SDPA), or the reason it cannot be built here."""
    try:
        from bench_s12_paged_attention import build
        start = time.perf_counter()
        model = build(MID_SHAPE, args.seed, "cpu")
    except ImportError as err:
        return f"the mid-size model needs transformers ({err})"
    return subject_of("mid", model, model.config, MID_CONTEXTS, MID_TOKEN_CAP,
                      time.perf_counter() - start)


def point_lens(seed: int, subject_key: str, batch: int, context: int) -> list[int]:
    """The prompt lengths of a decode point: context +- JITTER, seeded by the point (the
    decode and traffic sections draw the same)."""
    rng = np.random.default_rng([seed, {"bundled": 0, "mid": 1}[subject_key], batch, context])
    low, high = int(context * (1 - JITTER)), int(context * (1 + JITTER))
    return [int(n) for n in rng.integers(max(low, 1), high + 1, size=batch)]


def steps_each(args) -> int:
    """Decode steps each engine takes after its prefill at a decode point."""
    return len(ENGINE_BACKENDS) * (WARMUP + args.repeats * args.steps)


class LastStep:
    """An observer: the latest `StepResult` (its times["model"] and num_tokens)."""

    def __init__(self):
        self.result = None

    def on_plan(self, engine, plan) -> None:
        pass

    def on_step(self, engine, result) -> None:
        self.result = result


def decode_point(args, subject: Subject, batch: int, context: int) -> dict:
    """One (model, B, context) point: both engines prefilled with the same prompts, then the
    decode steps alternated (see the module docstring)."""
    model = subject.model
    lens = point_lens(args.seed, subject.key, batch, context)
    rng = np.random.default_rng([args.seed, 7, batch, context])
    vocab = model.vocab_size
    prompts = [[int(t) for t in rng.integers(1, vocab, size=n)] for n in lens]
    more = steps_each(args)
    max_context = min(subject.limit, cdiv(max(lens) + more + 2, BLOCK_SIZE) * BLOCK_SIZE)
    assert max(lens) + more + 1 <= max_context, "parse_args keeps the steps within the window"
    tokenizer = IdTokenizer(vocab)
    # every prompt in one prefill step: no request decodes before the last one has its first
    # token, so all start the timed steps at their prompt + 1
    options = dict(max_context=max_context, max_num_seqs=batch, max_num_batched_tokens=sum(lens))
    paged = s17a.build_engine(model, tokenizer, attention_backend="gather",
                              builder=s12.build_engine, block_size=BLOCK_SIZE, **options)
    contiguous = s11.build_engine(model, tokenizer, **options)
    runners = {"gather": paged.runner}
    for name in ENGINE_BACKENDS[1:]:        # each backend's runner over the one paged pool
        runners[name] = s17a.use_backend(paged, name).runner
        paged.runner = runners["gather"]
    engines = {"paged": paged, "contiguous": contiguous}
    watchers = {key: LastStep() for key in engines}
    params = s04.SamplingParams(temperature=0.0, max_tokens=more + 2, ignore_eos=True)
    ids, prefill_s = {}, {}
    for key, engine in engines.items():
        engine.observers.append(watchers[key])
        ids[key] = [engine.add_request(p, params) for p in prompts]
        start = time.perf_counter()
        while not all(r.output_ids for r in engine.requests.values()):
            engine.step()
        prefill_s[key] = time.perf_counter() - start
    samples = {name: {"step_ms": [], "model_ms": []} for name in ENGINES}

    def step(name: str, timed: bool) -> None:
        engine = contiguous if name == "contiguous" else paged
        if name != "contiguous":
            paged.runner = runners[name]
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        result = watchers["contiguous" if name == "contiguous" else "paged"].result
        assert result.num_tokens == batch, ("not a pure decode step", name, result.num_tokens)
        if timed:
            a, e = result.times["model"]
            samples[name]["step_ms"].append(wall * 1e3)
            samples[name]["model_ms"].append((e - a) * 1e3)

    for name in ENGINE_BACKENDS:
        step(name, False)
        step("contiguous", False)
    for r in range(args.repeats):
        k = r % len(ENGINE_BACKENDS)
        for name in ENGINE_BACKENDS[k:] + ENGINE_BACKENDS[:k]:
            for _ in range(args.steps):
                step(name, True)
                step("contiguous", True)
    paged.runner = runners["gather"]
    outputs = {key: [engines[key].requests[rid].output_ids for rid in ids[key]]
               for key in engines}
    same = sum(a == b for a, b in zip(outputs["paged"], outputs["contiguous"]))
    tokens = len(outputs["paged"][0])
    med = {name: {k: median(v) for k, v in s.items()} for name, s in samples.items()}
    c = med["contiguous"]
    ratios = {name: {"step": med[name]["step_ms"] / c["step_ms"],
                     "model": med[name]["model_ms"] / c["model_ms"]}
              for name in ENGINE_BACKENDS}
    ok = None if args.quick else ratios["paged"]["step"] <= TARGET
    return {"batch": batch, "context": context, "context_lens": lens,
            "max_context": max_context, "steps_each": more, "tokens_each": tokens,
            "prefill_s": prefill_s, "samples": samples, "median": med, "ratios": ratios,
            "same_tokens": same, "target": TARGET, "pass": ok}


def section_decode(args, subjects: list[Subject]) -> dict:
    before = load()
    print(f"\n2. decode step: S12's paged engine with each attention backend against S11's "
          f"contiguous engine, both SDPA models, float32, blocks of {BLOCK_SIZE}; prompts the "
          f"context +-{JITTER:.0%}; {args.repeats} round(s) x {args.steps} step(s) per "
          f"backend, alternating (contiguous after every paged step); medians")
    models = {}
    for subject in subjects:
        points, skipped = [], []
        print(f"\n  {subject.name} ({subject.num_layers} layers, H {subject.num_heads}, Hkv "
              f"{subject.num_kv_heads}, D {subject.head_dim}, window {subject.limit}"
              + (f", built in {subject.build_s:.1f} s" if subject.build_s else "") + ")")
        print(f"  {'B':>3} {'ctx':>5} | step ms: {'contig':>7} {'gather':>7} {'sdpa':>7} "
              f"{'paged':>7} | {'paged/c':>7} {'gather/c':>8} | model ms: {'contig':>7} "
              f"{'paged':>7} {'paged/c':>7} | same | verdict (paged <= {TARGET:.1f}x)")
        for batch in args.batches:
            for context in subject.contexts:
                if not subject.affordable(batch, context):
                    skipped.append({"batch": batch, "context": context})
                    continue
                p = decode_point(args, subject, batch, context)
                gc.collect()                  # the point's engines and pools, now
                points.append(p)
                m, r = p["median"], p["ratios"]
                print(f"  {batch:>3} {context:>5} | {'':9}{m['contiguous']['step_ms']:>7.2f} "
                      f"{m['gather']['step_ms']:>7.2f} {m['sdpa']['step_ms']:>7.2f} "
                      f"{m['paged']['step_ms']:>7.2f} | {r['paged']['step']:>6.2f}x "
                      f"{r['gather']['step']:>7.2f}x | {'':10}"
                      f"{m['contiguous']['model_ms']:>7.2f} {m['paged']['model_ms']:>7.2f} "
                      f"{r['paged']['model']:>6.2f}x | {p['same_tokens']:>2}/{batch:<2}| "
                      f"{verdict(p['pass'])}", flush=True)
        if skipped:
            print(f"  skipped (B x context over {subject.token_cap} prompt tokens): "
                  + ", ".join(f"B {s['batch']} ctx {s['context']}" for s in skipped))
        models[subject.key] = {"name": subject.name, "heads": subject.heads,
                               "num_layers": subject.num_layers, "limit": subject.limit,
                               "contexts": list(subject.contexts),
                               "token_cap": subject.token_cap, "points": points,
                               "skipped": skipped}
    print("  (ctx: the mean prompt; each request's context is its prompt plus the steps taken, "
          "up to " f"{steps_each(args) + 1} more; same: requests whose tokens are equal in "
          "both engines, the paged engine's from all three backends in turn)")
    return {"models": models, "backends": list(ENGINE_BACKENDS), "block_size": BLOCK_SIZE,
            "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# 3. traffic: the attention alone per layer, and the bytes it moves
# ---------------------------------------------------------------------------------------------

def attention_kernels(heads: dict, lens: list[int], seed: int) -> tuple[dict, dict]:
    """One layer's decode attention four ways on one random pool (see the module docstring):
    ({name: a zero-argument call returning (B, H, D)}, {name: max |output - contiguous's|})."""
    n_heads, n_kv, head_dim = heads["num_heads"], heads["num_kv_heads"], heads["head_dim"]
    batch, s_len = len(lens), max(lens)
    g = torch.Generator().manual_seed(seed)
    blocks = [cdiv(n, BLOCK_SIZE) for n in lens]
    cache = s12.PagedKVCache(1, sum(blocks) + 1, BLOCK_SIZE, n_kv, head_dim, s_len)
    cache.k[:, 1:] = torch.randn(cache.k[:, 1:].shape, generator=g)
    cache.v[:, 1:] = torch.randn(cache.v[:, 1:].shape, generator=g)
    order = (torch.randperm(sum(blocks), generator=g) + 1).tolist()    # shuffled blocks
    tables = torch.zeros(batch, max(blocks), dtype=torch.int64)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    keys, values = cache.gather(0, tables, s_len)                      # (B, Hkv, S, D)
    keys, values = keys.contiguous(), values.contiguous()             # S11's slots, read in place
    q = torch.randn(batch, n_heads, head_dim, generator=g)             # (B, H, D)
    q4 = q[:, :, None]                                                 # (B, H, 1, D)
    _, mask = context_mask(lens, "cpu", torch.float32)                 # (B, 1, S) or None
    scale = head_dim ** -0.5
    query_start_loc = torch.arange(batch + 1, dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    out = torch.empty(batch, n_heads, head_dim)

    def sdpa():
        k, v = cache.gather(0, tables, s_len)
        return F.scaled_dot_product_attention(
            q4, k, v, attn_mask=None if mask is None else mask[:, None], scale=scale,
            enable_gqa=n_heads != n_kv)[:, :, 0]

    kernels = {
        "contiguous": lambda: s08.batched_attention(q4, keys, values, mask, scale,
                                                    "sdpa")[:, :, 0],
        "gather": lambda: s08.batched_attention(q4, *cache.gather(0, tables, s_len), mask,
                                                scale, "manual")[:, :, 0],
        "sdpa": sdpa,
        "paged": lambda: s17_cpu.paged_attention(q, cache.k[0], cache.v[0], query_start_loc,
                                                 seq_lens, tables, scale, out, check=False),
    }
    with torch.inference_mode():
        reference = kernels["contiguous"]().clone()
        diffs = {name: float((fn() - reference).abs().max()) for name, fn in kernels.items()}
    return kernels, diffs


def time_kernels(kernels: dict, calls: int) -> dict[str, list[float]]:
    """Each kernel called once untimed, then `calls` rounds, the order rotated each round;
    milliseconds per call."""
    names = list(kernels)
    times = {name: [] for name in names}
    with torch.inference_mode():
        for fn in kernels.values():
            fn()
        for i in range(calls):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                kernels[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def section_traffic(args, subjects: list[Subject], decoded: dict | None) -> dict:
    before = load()
    mib = 64 if args.quick else 256
    bandwidth, method = roof.measure_bandwidth(mib * 2**20, 5, "cpu")
    calls = max(3, args.repeats * args.steps)
    print(f"\n3. traffic: one layer's decode attention alone on a random pool (blocks of "
          f"{BLOCK_SIZE}, shuffled), the decode points' context lengths; medians of {calls} "
          f"calls, alternating; bytes = s17_attention.attention_traffic per layer per step "
          f"(float32); GB/s = bytes / time")
    print(f"  copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({method})")
    models = {}
    for subject in subjects:
        heads = subject.heads
        print(f"\n  {subject.name} (H {heads['num_heads']}, Hkv {heads['num_kv_heads']}, D "
              f"{heads['head_dim']})")
        print(f"  {'B':>3} {'ctx':>5} | " + " | ".join(
            f"{name:>10}: {'us':>7} {'KiB':>8} {'GB/s':>6}" for name in KERNELS)
              + " | paged/contig")
        points = []
        for batch in args.batches:
            for context in subject.contexts:
                lens = point_lens(args.seed, subject.key, batch, context)
                kernels, diffs = attention_kernels(heads, lens, args.seed)
                times = time_kernels(kernels, calls)
                rows = {}
                for name in KERNELS:
                    traffic = s17a.attention_traffic(name, lens, block_size=BLOCK_SIZE,
                                                     **heads)
                    ms = median(times[name])
                    rows[name] = {"ms": ms, "samples_ms": times[name], "traffic": traffic,
                                  "bytes_per_s": traffic["total"] / (ms / 1e3),
                                  "max_abs_diff_vs_contiguous": diffs[name]}
                ran = bool(decoded) and any(
                    p["batch"] == batch and p["context"] == context
                    for p in decoded["models"].get(subject.key, {}).get("points", []))
                points.append({"batch": batch, "context": context, "context_lens": lens,
                               "in_decode_section": ran, "kernels": rows,
                               "paged_over_contiguous": rows["paged"]["ms"]
                               / rows["contiguous"]["ms"]})
                print(f"  {batch:>3} {context:>5} | " + " | ".join(
                    f"{'':>10}  {rows[n]['ms'] * 1e3:>7.1f} "
                    f"{rows[n]['traffic']['total'] / 2**10:>8.0f} "
                    f"{rows[n]['bytes_per_s'] / 1e9:>6.1f}" for n in KERNELS)
                      + f" | {points[-1]['paged_over_contiguous']:>5.2f}x", flush=True)
        models[subject.key] = {"name": subject.name, "heads": heads, "points": points}
    print("  (KiB: bytes read + written per layer per step by the traffic model: contiguous "
          "reads every slot to the longest context; gather and sdpa copy whole blocks, then "
          "read the copy, gather also moving its unfused scores; paged reads each request's "
          "own positions and its block-table entries)")
    worst = max((abs(r["max_abs_diff_vs_contiguous"]) for m in models.values()
                 for p in m["points"] for r in p["kernels"].values()), default=0.0)
    print(f"  outputs: every kernel within {worst:.1e} of the contiguous one")
    return {"bandwidth_bytes_per_s": bandwidth, "bandwidth_method": method, "calls": calls,
            "models": models, "max_abs_diff": worst, "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# 4. gpu: the Triton kernels against torch's SDPA
# ---------------------------------------------------------------------------------------------

class Budget:
    """--budget-s for the gpu section: a row starts only when the time left is at least
    twice the longest row so far (and MIN_ROW_S); what is left out is named in `cut`."""

    MIN_ROW_S = 5.0

    def __init__(self, seconds: float | None, started: float):
        self.deadline = None if seconds is None else started + seconds
        self.longest, self.cut = 0.0, []

    def allows(self, what: str) -> bool:
        if self.deadline is None:
            return True
        left = self.deadline - time.perf_counter()
        if left >= max(self.MIN_ROW_S, 2 * self.longest):
            return True
        self.cut.append(f"{what}: {left:.0f} s left of --budget-s")
        print(f"  (cut: {self.cut[-1]})", flush=True)
        return False

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def cuda_times(fns: dict, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Milliseconds per call of each function by torch.cuda.Event, after `warmup` calls each
    (Triton compiles on the first), `repeats` rounds, the order rotated each round."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def gpu_flash(args, triton_mod, device, budget: Budget) -> dict:
    """The Triton flash forward (each tile size of GPU_TILES) against SDPA's causal kernel."""
    h, hkv, d = GPU_HEADS["num_heads"], GPU_HEADS["num_kv_heads"], GPU_HEADS["head_dim"]
    rows, refused = [], {}
    print(f"\n  4a. flash forward, one causal prompt of T tokens, H {h}, Hkv {hkv}, D {d}, "
          f"{str(GPU_DTYPE).removeprefix('torch.')}: Triton (block_m x block_n) against "
          f"SDPA(is_causal=True)")
    print(f"  {'T':>6} {'method':<22} {'ms':>9} {'TFLOP/s':>8} {'vs SDPA':>8} {'max |diff|':>10}")
    for t_len in (QUICK_GPU["flash_t"] if args.quick else GPU_FLASH_T):
        if not budget.allows(f"flash T {t_len}"):
            continue
        row_start = time.perf_counter()
        rows += flash_rows(args, triton_mod, device, t_len, refused)
        torch.cuda.empty_cache()              # the row's tensors died with flash_rows
        budget.took(time.perf_counter() - row_start)
    for name, why in refused.items():
        print(f"  {name}: refused: {why}")
    return {"heads": GPU_HEADS, "tiles": [list(t) for t in GPU_TILES], "rows": rows,
            "refused": refused}


def flash_rows(args, triton_mod, device, t_len: int, refused: dict) -> list[dict]:
    """4a at one T: SDPA and each tile size that compiles (a refused one is named in
    refused), timed alternately; one row each."""
    h, hkv, d = GPU_HEADS["num_heads"], GPU_HEADS["num_kv_heads"], GPU_HEADS["head_dim"]
    scale = d ** -0.5
    g = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(t_len, h, d, device=device, dtype=GPU_DTYPE, generator=g)   # (T, H, D)
    k = torch.randn(t_len, hkv, d, device=device, dtype=GPU_DTYPE, generator=g)
    v = torch.randn(t_len, hkv, d, device=device, dtype=GPU_DTYPE, generator=g)
    cu = torch.tensor([0, t_len], dtype=torch.int32, device=device)
    qs, ks, vs = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))   # (1, H, T, D)

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                              enable_gqa=True)
    fns = {"sdpa": sdpa}
    for bm, bn in GPU_TILES:
        name = f"triton {bm}x{bn}"
        fn = (lambda bm=bm, bn=bn: triton_mod.flash_attn_varlen(
            q, k, v, cu, cu, scale, block_m=bm, block_n=bn, max_seqlen_q=t_len))
        try:
            fn()
            torch.cuda.synchronize()
            fns[name] = fn
        except Exception as err:               # a tile this GPU cannot hold: say so, go on
            refused[f"{name} T {t_len}"] = f"{type(err).__name__}: {str(err)[:200]}"
    times = cuda_times(fns, args.gpu_repeats)
    reference = sdpa()[0].transpose(0, 1).float()                          # (T, H, D)
    flops = 4 * h * t_len * t_len * d / 2                                 # causal: half
    base = median(times["sdpa"])
    rows = []
    for name, fn in fns.items():
        ms = median(times[name])
        out = fn()
        out = (out[0].transpose(0, 1) if name == "sdpa" else out).float()
        diff = float((out - reference).abs().max())
        rows.append({"T": t_len, "method": name, "ms": ms, "samples_ms": times[name],
                     "tflops": flops / (ms / 1e3) / 1e12, "over_sdpa": ms / base,
                     "max_abs_diff_vs_sdpa": diff})
        print(f"  {t_len:>6} {name:<22} {ms:>9.3f} {rows[-1]['tflops']:>8.1f} "
              f"{ms / base:>7.2f}x {diff:>10.1e}", flush=True)
    return rows


def gpu_pool(lens: list[int], seed: int, device):
    """A GPU_DTYPE pool of GPU_HEADS holding each request's positions in shuffled blocks:
    (cache, tables int32 (B, M), seq_lens int32 (B,))."""
    hkv, d = GPU_HEADS["num_kv_heads"], GPU_HEADS["head_dim"]
    blocks = [cdiv(n, BLOCK_SIZE) for n in lens]
    cache = s12.PagedKVCache(1, sum(blocks) + 1, BLOCK_SIZE, hkv, d, max(lens),
                             GPU_DTYPE, device)
    g = torch.Generator(device=device).manual_seed(seed)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    order = torch.randperm(sum(blocks), device="cpu") + 1
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start:start + n]
        start += n
    return (cache, tables.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def gpu_decode(args, triton_mod, device, bandwidth: float, budget: Budget
               ) -> tuple[dict, dict]:
    """Paged decode (Triton, num_splits 1) against gather + SDPA at each context and B; and
    at B = 1, split-K's num_splits against one split."""
    h, hkv, d = GPU_HEADS["num_heads"], GPU_HEADS["num_kv_heads"], GPU_HEADS["head_dim"]
    contexts = QUICK_GPU["contexts"] if args.quick else GPU_CONTEXTS
    split_contexts = QUICK_GPU["split_contexts"] if args.quick else GPU_SPLIT_CONTEXTS
    rows, splits = [], []
    print(f"\n  4b. paged decode, one step, H {h}, Hkv {hkv}, D {d}, "
          f"{str(GPU_DTYPE).removeprefix('torch.')}, blocks of {BLOCK_SIZE} shuffled, every "
          f"request the same context: Triton's paged_decode_attention against S12's gather + "
          f"SDPA; GB/s = attention_traffic bytes / time (copy: {bandwidth / 1e9:.0f} GB/s)")
    print(f"  {'ctx':>6} {'B':>3} {'triton ms':>10} {'gather+sdpa ms':>15} {'ratio':>7} "
          f"{'triton GB/s':>12} {'sdpa GB/s':>10} {'max |diff|':>10}")
    for context in contexts:
        for batch in GPU_BATCHES:
            if not budget.allows(f"paged decode context {context} B {batch}"):
                continue
            row_start = time.perf_counter()
            row, split_rows = decode_rows(args, triton_mod, device, context, batch,
                                          batch == 1 and context in split_contexts)
            rows.append(row)
            splits += split_rows
            torch.cuda.empty_cache()          # the pool died with decode_rows
            budget.took(time.perf_counter() - row_start)
    if splits:
        print("\n  4c. split-K at B = 1 (flash decoding): the context's keys cut into "
              "num_splits ranges, merged by log-sum-exp; gain = one split's time / this")
        print(f"  {'ctx':>6} " + " ".join(f"{f'splits {n}':>16}" for n in GPU_SPLITS))
        for context in sorted({s["context"] for s in splits}):
            cells = [s for s in splits if s["context"] == context]
            print(f"  {context:>6} " + " ".join(
                f"{s['ms']:>8.3f} ms {s['gain']:>4.1f}x" for s in cells))
    return ({"heads": GPU_HEADS, "batches": list(GPU_BATCHES), "contexts": list(contexts),
             "rows": rows},
            {"splits": list(GPU_SPLITS), "contexts": list(split_contexts), "rows": splits})


def decode_rows(args, triton_mod, device, context: int, batch: int, split_k: bool
                ) -> tuple[dict, list[dict]]:
    """4b at one (context, B): Triton's paged decode against gather + SDPA, alternately; with
    split_k also 4c, each of GPU_SPLITS. Returns (the 4b row, the 4c rows)."""
    h, d = GPU_HEADS["num_heads"], GPU_HEADS["head_dim"]
    scale = d ** -0.5
    lens = [context] * batch
    cache, tables, seq_lens = gpu_pool(lens, args.seed, device)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    q = torch.randn(batch, h, d, device=device, dtype=GPU_DTYPE, generator=g)   # (B, H, D)
    tables64 = tables.long()                    # index_select's index (S12's gather)

    def gather_sdpa():
        k, v = cache.gather(0, tables64, context)                          # (B, Hkv, S, D)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,
                                              enable_gqa=True)[:, :, 0]

    def paged(num_splits=1):
        return triton_mod.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens,
                                                 scale, num_splits=num_splits)
    times = cuda_times({"triton": paged, "gather+sdpa": gather_sdpa}, args.gpu_repeats)
    reference = gather_sdpa().float()
    diff = float((paged().float() - reference).abs().max())
    traffic = {name: s17a.attention_traffic(name, lens, block_size=BLOCK_SIZE, dtype_bytes=2,
                                            **GPU_HEADS)
               for name in ("triton", "sdpa")}
    t_ms, s_ms = median(times["triton"]), median(times["gather+sdpa"])
    row = {"context": context, "batch": batch, "triton_ms": t_ms, "sdpa_ms": s_ms,
           "samples_ms": times, "ratio": t_ms / s_ms, "traffic": traffic,
           "triton_bytes_per_s": traffic["triton"]["total"] / (t_ms / 1e3),
           "sdpa_bytes_per_s": traffic["sdpa"]["total"] / (s_ms / 1e3), "max_abs_diff": diff}
    print(f"  {context:>6} {batch:>3} {t_ms:>10.3f} {s_ms:>15.3f} {row['ratio']:>6.2f}x "
          f"{row['triton_bytes_per_s'] / 1e9:>12.0f} {row['sdpa_bytes_per_s'] / 1e9:>10.0f} "
          f"{diff:>10.1e}", flush=True)
    splits = []
    if split_k:
        times = cuda_times({f"splits {n}": (lambda n=n: paged(n)) for n in GPU_SPLITS},
                           args.gpu_repeats)
        one = median(times["splits 1"])
        for n in GPU_SPLITS:
            ms = median(times[f"splits {n}"])
            splits.append({"context": context, "num_splits": n, "ms": ms,
                           "samples_ms": times[f"splits {n}"], "gain": one / ms,
                           "max_abs_diff": float((paged(n).float() - reference).abs().max())})
    return row, splits


def section_gpu(args, figures: dict, write, started: float) -> dict:
    """Part 4 (see the module docstring); each part's figures written as soon as it ends."""
    device = torch.device(args.device)
    gpu: dict = {"device": torch.cuda.get_device_name(device), "skipped": {}}
    figures["gpu"] = gpu
    print(f"\n4. gpu: {gpu['device']}, torch {torch.__version__}")
    try:
        import triton
        gpu["triton"] = triton.__version__
        import s17_triton
        s17_triton.check_triton(device)
    except Exception as err:          # missing, or the module not importable: say which
        why = f"{type(err).__name__}: {err}"
        print(f"  skipped: the Triton kernels cannot run here ({why})")
        gpu["skipped"]["all"] = why
        return gpu
    print(f"  triton {gpu['triton']}, {args.gpu_repeats} timed calls per method")
    bandwidth, method = roof.measure_bandwidth(2**30, 5, str(device))
    gpu["bandwidth_bytes_per_s"], gpu["bandwidth_method"] = bandwidth, method
    print(f"  copy bandwidth: {bandwidth / 1e9:.0f} GB/s ({method})")
    budget = Budget(args.budget_s, started)
    figures["cut"] = budget.cut                 # scripts/gpu_check_report.py reads "cut"
    for part, run in (("flash", lambda: gpu_flash(args, s17_triton, device, budget)),
                      ("decode", lambda: gpu_decode(args, s17_triton, device, bandwidth,
                                                    budget))):
        try:
            result = run()
        except Exception as err:       # one part failing leaves the others' figures
            why = f"{type(err).__name__}: {str(err)[:400]}"
            print(f"  {part}: failed: {why}")
            gpu["skipped"][part] = why
            continue
        if part == "decode":
            gpu["decode"], gpu["split_k"] = result
        else:
            gpu[part] = result
        write()
    return gpu


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def batch_list(text: str) -> list[int]:
    """--batches' type: comma-separated distinct integers in [1, MAX_BATCH], sorted."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or len(set(values)) != len(values) or not all(
            1 <= v <= MAX_BATCH for v in values):
        raise argparse.ArgumentTypeError(f"--batches takes distinct comma-separated integers "
                                         f"in [1, {MAX_BATCH}] (got {text!r})")
    return sorted(values)


def section_list(text: str) -> list[str]:
    """--sections' type: comma-separated names of SECTIONS, run in SECTIONS' order."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--sections takes comma-separated names from "
                                         f"{','.join(SECTIONS)} (got {text!r})")
    return [s for s in SECTIONS if s in names]


def bundled_room(args) -> int:
    """Decode steps the bundled model's window leaves its longest prompt at its longest
    context."""
    contexts = QUICK_CONTEXTS if args.quick else BUNDLED_CONTEXTS
    return 256 - int(max(contexts) * (1 + JITTER)) - 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="S17 benchmark: naive against tiled attention's "
                                     "memory; the paged decode step against the contiguous one "
                                     "and the gather; the bytes each backend moves; on a GPU, "
                                     "the Triton kernels against SDPA.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (< 20 s on the CPU): memory at T = 1024, the bundled "
                             "model only, B = 1 and 8, one short round (default: off)")
    parser.add_argument("--sections", type=section_list, default=None,
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: "
                             f"{','.join(CPU_SECTIONS)} on the CPU, gpu with --device cuda)")
    parser.add_argument("--batches", type=batch_list, default=None,
                        help=f"batch sizes of the decode and traffic sections, each 1 to "
                             f"{MAX_BATCH} (default: 1,8,32,64, --quick 1,8)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"alternating rounds of decode steps, 1 to {MAX_REPEATS} (default: "
                             f"3, --quick 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed decode steps per backend per round, 1 to {MAX_STEPS} "
                             f"(default: 4, --quick 2)")
    parser.add_argument("--gpu-repeats", type=int, default=None,
                        help="timed calls per method in the gpu section, 1 to 100 (default: "
                             "10, --quick 3)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take; the gpu section leaves out the "
                             "rows that would not fit and names them in the JSON's \"cut\" "
                             "(scripts/gpu_check.sh gives its part's budget) (default: none)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts, the pools and the random model, >= 0 "
                             "(default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N; cuda runs the gpu section (default: "
                             "%(default)s)")
    parser.add_argument("--json", default=None,
                        help=f"write the figures to this JSON file (default: {DEFAULT_JSON})")
    parser.add_argument("--record", action="store_true",
                        help=f"write {RECORD_JSON.relative_to(ROOT)}, the committed record "
                             "(default: off)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --seed, --device
    on_cuda = torch.device(args.device).type == "cuda"
    if args.sections is None:
        args.sections = ["gpu"] if on_cuda else list(CPU_SECTIONS)
    if "gpu" in args.sections and not on_cuda:
        parser.error("the gpu section runs with --device cuda")
    if on_cuda and set(args.sections) & set(CPU_SECTIONS):
        parser.error("the memory, decode and traffic sections measure the CPU: run them with "
                     "--device cpu (the default)")
    if args.batches is None:
        args.batches = [1, 8] if args.quick else [1, 8, 32, 64]
    for name, full, small, high in (("repeats", 3, 1, MAX_REPEATS), ("steps", 4, 2, MAX_STEPS),
                                    ("gpu_repeats", 10, 3, 100)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
        s07.check_count(parser, "--" + name.replace("_", "-"), getattr(args, name), 1, high)
    need = steps_each(args) + 1
    if "decode" in args.sections and need > bundled_room(args):
        parser.error(f"{len(ENGINE_BACKENDS)} x ({WARMUP} + --repeats x --steps) + 1 decode "
                     f"steps per request must fit the {bundled_room(args)} tokens the bundled "
                     f"model's longest prompts leave (got {need})")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be a number of seconds > 0 (got {args.budget_s})")
    if args.record and args.json is not None:
        parser.error("--record writes the committed record; give --json or --record, not both")
    if args.record and args.quick:
        parser.error("--record takes a full run, not --quick")
    if args.record and args.sections != list(CPU_SECTIONS):
        parser.error(f"--record takes every CPU section ({','.join(CPU_SECTIONS)}) on the CPU; "
                     "a GPU run's figures go to --json (scripts/gpu_check.sh's folder)")
    if args.json is not None:
        check_json(parser, args.json)
    if not (s03.BUNDLED_MODEL_DIR / "config.json").exists() and {"decode", "traffic"} & set(
            args.sections):
        parser.error(f"the bundled model is not in {s03.BUNDLED_MODEL_DIR} yet: train it with "
                     "python scripts/train_bundled_model.py")
    if "decode" in args.sections and s17_cpu.find_cc() is None:
        parser.error("the paged backend is a C kernel built at first use: it needs a C "
                     "compiler (gcc, cc or clang, or $CC)")
    return args


def key_figures(figures: dict) -> dict:
    """The headline figures (scripts/gpu_check_report.py reads "key")."""
    key = {}
    for model, part in figures.get("decode", {}).get("models", {}).items():
        ratios = [p["ratios"]["paged"]["step"] for p in part["points"]]
        if ratios:
            key[f"{model}_paged_over_contiguous_step_max"] = max(ratios)
            key[f"{model}_paged_over_contiguous_step_min"] = min(ratios)
    for model, part in figures.get("traffic", {}).get("models", {}).items():
        ratios = [p["paged_over_contiguous"] for p in part["points"]]
        if ratios:
            key[f"{model}_paged_attention_over_contiguous_max"] = max(ratios)
    gpu = figures.get("gpu", {})
    for r in gpu.get("flash", {}).get("rows", []):
        if r["method"] != "sdpa":
            name = f"flash_best_over_sdpa_T{r['T']}"
            key[name] = min(key.get(name, math.inf), r["over_sdpa"])
    for r in gpu.get("decode", {}).get("rows", []):
        key[f"paged_over_gather_sdpa_ctx{r['context']}_B{r['batch']}"] = r["ratio"]
    for r in gpu.get("split_k", {}).get("rows", []):
        if r["num_splits"] > 1:
            name = f"split_k_best_gain_ctx{r['context']}"
            key[name] = max(key.get(name, 0.0), r["gain"])
    return key


def targets(figures: dict) -> list[dict]:
    """Every verdict of the run, [] in a --quick run (no verdicts)."""
    out = []
    for model, part in figures.get("decode", {}).get("models", {}).items():
        for p in part["points"]:
            if p["pass"] is not None:
                out.append({"section": "decode", "name": f"paged step <= {TARGET:.1f}x "
                            f"contiguous, {model}, B {p['batch']}, context {p['context']}",
                            "value": p["ratios"]["paged"]["step"], "bound": TARGET,
                            "pass": p["pass"]})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        print(QUICK_DISCLAIMER)
    started = time.perf_counter()
    before, load_start = uptime(), list(os.getloadavg())
    print(f"before: {before}\ntorch {torch.__version__}, 1 thread, device {args.device}; "
          f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} logical cores, Python "
          f"{platform.python_version()}; sections: {','.join(args.sections)}")
    target = RECORD_JSON if args.record else Path(args.json or DEFAULT_JSON)
    config = {"quick": args.quick, "sections": args.sections, "batches": args.batches,
              "repeats": args.repeats, "steps": args.steps, "gpu_repeats": args.gpu_repeats,
              "seed": args.seed, "device": args.device, "threads": 1,
              "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "cpu": cpu_name(),
              "logical_cores": os.cpu_count(), "block_size": BLOCK_SIZE, "jitter": JITTER,
              "warmup": WARMUP, "mid_shape": MID_SHAPE, "mid_token_cap": MID_TOKEN_CAP}
    figures: dict = {"config": config, "load_average": {"start": load_start}}
    section_s: dict = {}

    def write() -> None:
        figures["section_s"] = section_s
        figures["targets"] = targets(figures)
        figures["key"] = key_figures(figures)
        write_json(target, figures, indent=1)

    subjects: list[Subject] = []
    for name in args.sections:
        mark = time.perf_counter()
        if name in ("decode", "traffic") and not subjects:   # after memory's forks
            subjects.append(bundled_subject(args))
            if not args.quick:
                mid = mid_subject(args)
                if isinstance(mid, str):
                    print(f"(the mid-size model is skipped: {mid})")
                    figures["mid_skipped"] = mid
                else:
                    subjects.append(mid)
        if name == "memory":
            figures["memory"] = section_memory(args)
        elif name == "decode":
            figures["decode"] = section_decode(args, subjects)
        elif name == "traffic":
            figures["traffic"] = section_traffic(args, subjects, figures.get("decode"))
        else:
            section_gpu(args, figures, write, started)
        section_s[name] = time.perf_counter() - mark
        write()
    after, load_end = uptime(), list(os.getloadavg())
    elapsed = time.perf_counter() - started
    summary(figures, args)
    print(f"\nafter: {after}\ntotal {elapsed:.0f} s")
    if args.quick:
        print(QUICK_DISCLAIMER)
    figures["load_average"]["end"] = load_end
    figures.update(uptime_before=before, uptime_after=after, elapsed_s=elapsed)
    write()
    print(f"wrote {target}")
    return figures


def summary(figures: dict, args) -> None:
    """The verdicts and the headline ratios again, at the end of the output."""
    print("\nsummary")
    if "memory" in figures:
        for r in figures["memory"]["rows"]:
            if "error" not in r and r["method"] in ("naive", "tiled"):
                print(f"  memory T {r['T']} {r['method']}: {r['peak_bytes'] / 2**20:.1f} MiB "
                      f"(scores {r['scores_bytes'] / 2**20:.0f} MiB)")
    for model, part in figures.get("decode", {}).get("models", {}).items():
        print(f"  paged / contiguous per step, {model}: " + ", ".join(
            f"B {p['batch']} ctx {p['context']} {p['ratios']['paged']['step']:.2f}x"
            for p in part["points"]))
    for t in figures.get("targets", targets(figures)):
        print(f"  {verdict(t['pass'])}: {t['name']}: {t['value']:.2f}x")
    if figures.get("key"):
        gpu_keys = {k: v for k, v in key_figures(figures).items() if "over_contiguous" not in k}
        for k, v in gpu_keys.items():
            print(f"  {k}: {v:.2f}x")
    if args.quick:
        print("  (quick run: no verdicts)")


if __name__ == "__main__":
    main()
