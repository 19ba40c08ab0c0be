"""S16's measurement: the host's share of a decode step, and what static buffers, torch.compile
and async scheduling take off it, every ratio taken within one run.

    python benchmarks/bench_s16_host.py --quick      # a smoke run, < 1 min (scratch JSON)
    python benchmarks/bench_s16_host.py              # the full run, < 10 min (scratch JSON)
    python benchmarks/bench_s16_host.py --record     # the committed record (a quiet machine)

A benchmark, not a test: it prints, never asserts (a target missed is printed as "MISS").
Float32, the CPU unless --device cuda, torch threads pinned by --threads (default 1), greedy.
Two models: the bundled one (data/model: 6 layers, hidden 128, 5.8 MB, a 256-token window) and
a seeded random Qwen3 layout of about 100M parameters (S14's E2E_SHAPE, built as S15's
benchmark builds it, once; its window cut to MID_CONTEXT tokens, all this run needs). Every
engine is S13's (paged KV, chunked prefill; prefix caching off, so every request does its own
work) through code/s16_host.py's `build_engine`, one per engine variant (VARIANTS) and model,
built once and reused by every section:

    eager           S13's engine as it is: the baseline
    static          persistent input buffers and batch-size buckets, eager (`make_static`,
                    compile=False): the same step with static shapes
    compiled        the static step under torch.compile, one graph per bucket (compile=True;
                    the buckets are exactly the batch sizes measured: no padding)
    async eager     eager, stepped one plan ahead (`AsyncLLMEngine`: the next step is planned
                    while the forward runs on a worker thread)
    async compiled  compiled and stepped one plan ahead
    mp              eager, the forward in a worker process (executor_backend="mp": S16's
                    `ProcessRunner`, weights and KV pool in shared memory), synchronous: what
                    the hand-off costs
    async mp        the same, stepped one plan ahead: the forward on another core, free of
                    this process's GIL (two processes, one torch thread each)
    graphs, compiled graphs   (CUDA only) the static step captured in CUDA graphs
Another engine variant is one more entry in VARIANTS.

How a decode step is timed (sections A, B, D): B requests with prompts of a fixed length
(random ids), ignore_eos and room for every step, are added to each engine and prefilled, then
--warmup decode steps run untimed; then --rounds rounds, the variants taking turns (the order
rotated each round: ABAB...), each doing one untimed step and --steps timed ones (an async
engine's step in flight is waited for before the next variant starts, so no forward overlaps
another engine's steps). step ms = the median wall time of an `engine.step()` call; forward ms
= the median of the forward (S16's `StepProfiler`: the model call less the batch preparation,
no op counting while timing); host ms = step - forward: for a synchronous loop everything but
the forward, for an async one the host work the forward does not hide (a few tenths of a ms
below 0 where the overlap is complete: two medians of noisy samples); host % = host / step.
Ops per step come from one more step with the profiler counting (S16's `OpCounter`), for the
synchronous in-process eager variants (a compiled step runs eagerly under a dispatch mode, and
a forward on another thread or in another process is not seen). Then the requests are aborted.

Sections (--sections, default all; C runs first, in fresh subprocesses, so that this
process's own compiles are warm, then A, B, D, E; each prints its table and its target lines,
and C's in-process compile seconds come last):

A. host: the host fraction of a decode step at B = --batches (1, 8, 32, 64) on both models,
   for every variant; beside the eager step the worked example: ops per step x the cost of
   one tiny op (`per_op_overhead_s`) against the measured step.
B. compiled: compiled against eager per step on both models at each B (A's runs, or its own
   if A is not run), target "compiled >= 1.5x eager on the bundled model" checked at each B.
   The static step attends over the whole block table (the model's max context), so with short
   contexts the ratio shrinks as B grows: the bundled model is measured again with prompts of
   LONG_PROMPT tokens, contexts about 200 of its 256, where eager attention reads about as much.
   The mid-size model gains little, and the section says why from this run's figures: bytes
   per step (S07's `batched_decode_cost`: every weight once, each request's K/V) / step time =
   GB/s achieved, against S07's measured bandwidth (`measure_bandwidth`, a STREAM copy), and
   the eager step's overhead (its host share, and its forward's ops x one tiny op's cost, A's
   worked example): compiling removes overhead, not the bytes the matmuls must read.
C. compile: compile time per bucket of the bundled model, cold and warm: the compile runs in a
   subprocess with a fresh TORCHINDUCTOR_CACHE_DIR (cold), then in another with the same
   directory (warm: inductor's on-disk caches hit; dynamo still traces). The seconds are the
   runner's `compile_times_s` (each bucket's first call; the first bucket compiled, the
   largest, also pays inductor's start-up). This process then uses the same directory, so
   its own bundled compiles are warm; the mid-size model's compile times in this process
   (cold) are printed beside them.
D. async: at B = --async-batch (16) on the bundled model, each async variant against its
   synchronous twin (async eager and async mp against eager, async compiled against
   compiled), alternating as above; target "async step <= sync step
   x (1 - host_fraction / 2)", host_fraction the synchronous step's, measured in the same
   run; and the same requests (real text, greedy, EOS and a stop string honoured, so requests
   end at different steps) run to the end on both: tokens and finish reasons compared.
E. int4: the mid-size model at batch 1, decode tokens/s of S06's engine (fp32), the S13
   engine fp32 and S14's int4 (g32, `quantize_model`) eager, compiled fp32, compiled int4 (if
   torch.compile cannot trace S14's QuantizedTensor, the error's class is printed and the row
   skipped) and Hugging Face `generate` fp32 (the same weights, greedy, the same prompt and
   tokens), alternating, --repeats rounds after a warm-up round. A row's decode interval =
   the median time between consecutive tokens (the prefill's first token excluded), tokens/s
   = 1 / that. Its bandwidth floor = bytes a token reads (S14 benchmark's `bytes_per_token`:
   S07's decode cost with each quantized weight at what its kernel reads) / the measured
   bandwidth; fraction of the floor = floor / the measured interval.

--quick is a smoke run (it checks that everything runs, well under a minute once inductor's
cache holds its one graph): the bundled model only (E on the bundled model, without the
compiled int4 row), B = 1 and 8, short runs, one compiled bucket (1: the compiled variants
are measured at B = 1 only; D at B = 8 compares the eager pair); C compiles that bucket in a
subprocess with inductor's own cache, warm or not (no cold compile: a cold one alone takes
20-50 s here). Its figures are not the record's (QUICK_DISCLAIMER is printed before and
after) and it prints no verdicts ("(quick run: no verdict)"; targets [] in its JSON).

What it does not handle: a GPU run was not tried when this was written (the CUDA variants and
--device cuda are wired, not checked); on CUDA the step is timed by the wall clock (the
sampler's copy of the tokens to the host waits for the device), while the profiler's forward
is mostly launch time (S16's profiler says why). The mid-size model's context is cut to
MID_CONTEXT, so its static step reads 80 key columns, not 2048. One engine per variant and
model: ratios between variants, not between processes.

The CPU is shared: `uptime` and os.getloadavg() are recorded before and after, and each
section's 1-minute load. JSON goes to --json (default a scratch file in the temp directory),
or with --record to chapters/figures/s16_host.json.

Tests: tests/test_s16_bench.py (flags, one --quick run, the record's consistency).

References: gpt-fast (PyTorch, 2023: a compiled decode step, static KV cache); vLLM's
`cudagraph_capture_sizes` and async scheduling (v0.14); SGLang's overlap scheduler;
bench_s14_quantization.py (the random model, int4, bytes per token), bench_s15_speculative.py
(the alternation, the flags).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06, before NumPy loads

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s01_generation_loop as s01  # noqa: E402
import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_roofline as roof  # noqa: E402
import s07_workloads  # noqa: E402
import s08_cli  # noqa: E402
import s13_prefix_caching as s13  # noqa: E402
import s14_quantization as q  # noqa: E402
import s16_host  # noqa: E402
import s16_profile as prof  # noqa: E402
import s16_static  # noqa: E402
from bench_s06_torch import IdTokenizer, random_qwen3  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402
from bench_s14_quantization import E2E_SHAPE, bytes_per_token  # noqa: E402
from s09_llm import LLM  # noqa: E402

RECORD_JSON = ROOT / "chapters" / "figures" / "s16_host.json"
DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s16_host.json"
SECTIONS = ("host", "compiled", "compile", "async", "int4")
QUICK_DISCLAIMER = ("--quick: a smoke run (the bundled model only, B = 1 and 8, short runs, "
                    "one compiled bucket: B = 1); its figures are not the committed record's: "
                    "chapters/figures/s16_host.json")
SHORT_PROMPT = 16        # tokens: the decode-step prompts (A, B, D)
LONG_PROMPT = 184        # tokens: B's long contexts (184 + the steps: about 200 of 256)
MID_CONTEXT = 80         # the mid-size model's max context: all this run needs, 5 blocks of 16
E_PROMPT = 24            # tokens: E's prompt (random ids, as S14's benchmark)
ROOM = min(256 - LONG_PROMPT, MID_CONTEXT - SHORT_PROMPT)   # decode steps a request may take
COMPILED_TARGET = 1.5    # the issue's: compiled >= 1.5x eager per step on the bundled model
ASYNC_STOP = "\n\n"      # D's token check: a stop string (requests end at different steps)
QUICK_COMPILED = (1,)    # --quick compiles one bucket
MAX_BATCH = 64
MAX_REPEATS = 20
CHILD_TIMEOUT_S = 900    # a compile subprocess that takes longer is reported as failed


def load() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


def verdict(ok: bool | None) -> str:
    return "(quick run: no verdict)" if ok is None else "PASS" if ok else "MISS"


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------
# Engine variants
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One engine variant: its label, what it is, the flags `s16_host.build_engine` gets
    (compile, cuda_graphs, async_scheduling, ...), static (make_static with compile=False:
    S16's buffers and buckets run eagerly), and the devices it runs on."""

    label: str
    what: str
    options: dict = field(default_factory=dict)
    static: bool = False
    devices: tuple = ("cpu", "cuda")

    @property
    def compiles(self) -> bool:
        return bool(self.options.get("compile"))

    @property
    def bucketed(self) -> bool:
        """Its decode steps run S16's static runner (buckets)."""
        return self.static or any(self.options.get(k) for k in ("compile", "cuda_graphs"))

    @property
    def is_async(self) -> bool:
        return bool(self.options.get("async_scheduling"))

    @property
    def counts_ops(self) -> bool:
        """Op counts mean something: a synchronous loop that runs its ops eagerly, here."""
        return not (self.is_async or self.compiles or self.options.get("cuda_graphs")
                    or self.options.get("executor_backend", "uni") != "uni")


VARIANTS = (
    Variant("eager", "S13's engine as it is (the baseline)"),
    Variant("static", "static buffers and buckets, eager (make_static, compile=False)",
            static=True),
    Variant("compiled", "the static step under torch.compile, a graph per bucket",
            {"compile": True}),
    Variant("async eager", "eager, the next step planned while the forward runs",
            {"async_scheduling": True}),
    Variant("async compiled", "compiled, the next step planned while the forward runs",
            {"compile": True, "async_scheduling": True}),
    Variant("mp", "eager, the forward in a worker process (S16's ProcessRunner), synchronous",
            {"executor_backend": "mp"}),
    Variant("async mp", "eager, the forward in a worker process, the next step planned "
            "while it runs", {"async_scheduling": True, "executor_backend": "mp"}),
    Variant("graphs", "the static step captured in CUDA graphs, eager inside",
            {"cuda_graphs": True}, devices=("cuda",)),
    Variant("compiled graphs", "the compiled step captured in CUDA graphs",
            {"compile": True, "cuda_graphs": True}, devices=("cuda",)),
)
# The flags that make a variant async: its synchronous twin, the engine it is timed against in
# D, has the same flags without them (the forward in a worker process is a way of running
# ahead, so "async mp" is timed against the plain engine; "mp" alone shows its own cost in A).
ASYNC_FLAGS = ("async_scheduling", "executor_backend")


def variants_for(device: str) -> list[Variant]:
    kind = torch.device(device).type
    return [v for v in VARIANTS if kind in v.devices]


def sync_twin(variant: Variant, variants: list[Variant]) -> Variant | None:
    """The synchronous variant with the same flags as an async one (None: not measured)."""
    flags = {k: v for k, v in variant.options.items() if k not in ASYNC_FLAGS}
    return next((v for v in variants if not v.is_async and not v.static
                 and v.options == flags), None)


class Built:
    """One engine of a variant on a model, with its `StepProfiler` (timing only)."""

    def __init__(self, variant: Variant, engine):
        self.variant, self.engine = variant, engine
        self.profiler = prof.StepProfiler()
        engine.observers.append(self.profiler)

    @property
    def runner(self):
        return self.engine.runner


def build(variant: Variant, model, tokenizer, sizes: list[int], **options):
    """The variant's engine: S13's builder (prefix caching off) through S16's `build_engine`,
    static buckets `sizes` where the variant has them."""
    options = dict(enable_prefix_caching=False, **options)
    if variant.static:
        return s16_static.make_static(s13.build_engine(model, tokenizer, **options), sizes=sizes)
    if variant.bucketed:
        options["cudagraph_capture_sizes"] = sizes
    return s16_host.build_engine(model, tokenizer, **variant.options, **options)


def settle(engine) -> None:
    """Wait for an async engine's step in flight (its forward keeps running on the worker
    after `step` returns), so that it does not overlap the next engine's timed steps."""
    launched = getattr(engine, "in_flight", None)
    if launched is not None:
        launched.future.result()


def drain(engine) -> None:
    """Abort every request and step until nothing is left (an async engine's step in flight
    resolves; its rows are dropped)."""
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


# ---------------------------------------------------------------------------------------------
# The models
# ---------------------------------------------------------------------------------------------

class Subject:
    """A model under test, its tokenizer, max context, the engines built on it (one per
    variant, built on first use and kept) and their bucket sizes."""

    def __init__(self, key: str, name: str, model, tokenizer, max_context: int,
                 compiled_sizes: list[int], static_sizes: list[int], variants: list[Variant],
                 hf=None, state=None):
        self.key, self.name, self.model, self.tokenizer = key, name, model, tokenizer
        self.max_context = max_context
        self.compiled_sizes, self.static_sizes = compiled_sizes, static_sizes
        self.variants = {v.label: v for v in variants}
        self.hf, self.state = hf, state
        self.params = s03.parameter_count(model.config)
        self.engines: dict[str, Built] = {}

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def sizes(self, variant: Variant) -> list[int]:
        return self.compiled_sizes if variant.compiles else self.static_sizes

    def engine(self, label: str) -> Built:
        if label not in self.engines:
            variant = self.variants[label]
            sizes = self.sizes(variant)
            engine = build(variant, self.model, self.tokenizer, sizes,
                           max_num_seqs=max(self.static_sizes), max_context=self.max_context)
            self.engines[label] = Built(variant, engine)
        return self.engines[label]

    def measurable(self, label: str, batch: int) -> bool:
        """A compiled variant runs a batch only at a bucket it compiled (no padding)."""
        variant = self.variants.get(label)
        return variant is not None and (not variant.bucketed or batch in self.sizes(variant))

    def prompts(self, batch: int, length: int, seed: int) -> list[list[int]]:
        """batch prompts of `length` random ids (1 .. V - 1), distinct, seeded."""
        rng = np.random.default_rng([seed, batch, length])
        return rng.integers(1, self.vocab_size, size=(batch, length)).tolist()

    def close(self) -> None:
        """Stop the engines' worker threads and processes."""
        for built in self.engines.values():
            s16_host.shutdown_engine(built.engine)


def bundled_subject(args, variants) -> Subject:
    model, tok = s06.load(s03.BUNDLED_MODEL_DIR, args.device, "float32")
    window = model.config.max_position_embeddings
    assert window - LONG_PROMPT >= ROOM, "ROOM assumes the bundled model's 256-token window"
    static = sorted(set(args.batches) | {args.async_batch})
    compiled = sorted(set(QUICK_COMPILED) if args.quick else static)
    return Subject("bundled", "the bundled model", model, tok, window, compiled, static,
                   variants)


def mid_subject(args, variants) -> Subject:
    """The seeded random Qwen3 layout (E2E_SHAPE), HF's model kept for E."""
    start = time.perf_counter()
    hf = random_qwen3(E2E_SHAPE, args.seed)
    config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
    state = hf.state_dict()
    model = s06.TorchTransformer(config, state, torch.device(args.device), torch.float32, "sdpa")
    sizes = sorted(set(args.batches) | {1})
    subject = Subject("mid", "the mid-size random model", model,
                      IdTokenizer(E2E_SHAPE["vocab_size"]), MID_CONTEXT, sizes, sizes, variants,
                      hf=hf, state=state)
    subject.build_s = time.perf_counter() - start
    return subject


# ---------------------------------------------------------------------------------------------
# Timing decode steps
# ---------------------------------------------------------------------------------------------

def measure(subject: Subject, labels: list[str], batch: int, prompt_len: int, args) -> dict:
    """Decode steps of each variant in labels at this batch, alternating (module docstring):
    {label: row}. Each row: step_ms, forward_ms, host_ms, host_fraction (medians, see the
    docstring), profiler_host_fraction (the profiler's own median), step_ms_all (every timed
    step), steps; forwards (the forwards the rounds ran: each round's untimed step and its
    timed ones) and static_forwards (those the static runner ran: all of them for a bucketed
    variant, none for the others); ops and model_ops (one counting step; None where they mean
    nothing); context (the mean context length over the timed steps)."""
    labels = [label for label in labels if subject.measurable(label, batch)]
    built = {label: subject.engine(label) for label in labels}
    prompts = subject.prompts(batch, prompt_len, args.seed)
    params = s04.SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=subject.max_context - prompt_len)
    walls = {label: [] for label in labels}
    profiles = {label: [] for label in labels}
    static = {label: 0 for label in labels}
    contexts = {label: [] for label in labels}

    def context(b: Built) -> int:
        return max(len(r.token_ids) for r in b.engine.requests.values())

    with torch.inference_mode():
        for b in built.values():
            for p in prompts:
                b.engine.add_request(p, params)
            for _ in range(1 + args.warmup):       # the prefill, then untimed decode steps
                b.engine.step()
            settle(b.engine)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                b = built[label]
                counted = getattr(b.runner, "num_static_steps", 0)
                b.engine.step()                    # untimed: resolves what settle waited for
                b.profiler.profiles.clear()
                contexts[label].append(context(b))
                for _ in range(args.steps):
                    start = time.perf_counter()
                    b.engine.step()
                    walls[label].append(time.perf_counter() - start)
                settle(b.engine)
                contexts[label].append(context(b))
                static[label] += getattr(b.runner, "num_static_steps", 0) - counted
                profiles[label] += b.profiler.profiles
        rows = {}
        for label, b in built.items():
            steps = profiles[label]
            bad = [(p.kind, p.num_seqs) for p in steps if (p.kind, p.num_seqs) != ("decode", batch)]
            if bad or len(steps) != len(walls[label]):
                raise RuntimeError(f"{label}: timed steps were not {batch}-row decode steps: "
                                   f"{bad[:3]} ({len(steps)} profiles, {len(walls[label])} "
                                   "steps)")
            ops = model_ops = None
            if b.variant.counts_ops:
                counter = prof.StepProfiler(count_ops=True)
                b.engine.observers.append(counter)
                try:
                    b.engine.step()
                finally:
                    b.engine.observers.remove(counter)
                    counter.close()
                ops, model_ops = counter.profiles[-1].ops, counter.profiles[-1].model_ops
            drain(b.engine)
            step = median(walls[label])
            forward = median(p.forward_s for p in steps)
            rows[label] = {
                "step_ms": step * 1e3, "forward_ms": forward * 1e3,
                "host_ms": (step - forward) * 1e3, "host_fraction": (step - forward) / step,
                "profiler_host_fraction": median(p.host_fraction for p in steps),
                "steps": len(walls[label]), "forwards": args.rounds * (args.steps + 1),
                "static_forwards": static[label],
                "step_ms_all": [w * 1e3 for w in walls[label]],
                "ops": ops, "model_ops": model_ops,
                "context": statistics.mean(contexts[label])}
    return rows


def print_rows(title: str, rows: dict, per_op_s: float | None = None) -> None:
    print(title)
    print(f"  {'variant':<16}{'step ms':>9}{'fwd ms':>9}{'host ms':>9}{'host %':>8}"
          f"{'vs eager':>9}{'ops':>7}{'static':>8}")
    base = rows.get("eager", {}).get("step_ms")
    for label, r in rows.items():
        ops = "-" if r["ops"] is None else str(r["ops"])
        speed = f"{base / r['step_ms']:>8.2f}x" if base else f"{'-':>9}"
        print(f"  {label:<16}{r['step_ms']:>9.3f}{r['forward_ms']:>9.3f}{r['host_ms']:>9.3f}"
              f"{r['host_fraction'] * 100:>8.1f}{speed}{ops:>7}"
              f"{r['static_forwards']:>4}/{r['forwards']:<3}")
    eager = rows.get("eager")
    if eager and eager["ops"] is not None and per_op_s:
        estimate = eager["ops"] * per_op_s * 1e3
        print(f"  worked example: {eager['ops']} ops x {per_op_s * 1e6:.2f} us per tiny op = "
              f"{estimate:.2f} ms, against the measured eager step {eager['step_ms']:.2f} ms "
              f"({estimate / eager['step_ms']:.0%} of it)")


ROWS_LEGEND = ("  (step: median wall ms per engine.step(); fwd: the forward, the profiler's; "
               "host = step - fwd (async: the host work the forward does not hide); ops: one "
               "counting step (synchronous in-process eager loops only); static: forwards "
               "the static runner ran / forwards in the rounds)")


# ---------------------------------------------------------------------------------------------
# A. the host fraction, by variant and batch
# ---------------------------------------------------------------------------------------------

def section_host(args, subjects: list[Subject], per_op_s: float) -> dict:
    before = load()
    out = {"variants": {v.label: v.what for v in variants_for(args.device)},
           "per_op_overhead_s": per_op_s, "models": {}}
    print(f"\nA. host: the host fraction of a decode step, by batch and engine variant; "
          f"{SHORT_PROMPT}-token prompts, {args.warmup} warm-up steps, then {args.rounds} "
          f"alternating rounds of {args.steps} timed steps per variant")
    for subject in subjects:
        part = {"name": subject.name, "parameters": subject.params,
                "max_context": subject.max_context, "prompt_tokens": SHORT_PROMPT,
                "compiled_sizes": subject.compiled_sizes, "batches": {}}
        for batch in args.batches:
            rows = measure(subject, list(subject.variants), batch, SHORT_PROMPT, args)
            part["batches"][str(batch)] = rows
            print_rows(f"  {subject.name} ({subject.params / 1e6:.1f}M parameters), B = "
                       f"{batch}, context about {rows['eager']['context']:.0f} of "
                       f"{subject.max_context}", rows, per_op_s)
        out["models"][subject.key] = part
    print(ROWS_LEGEND)
    out["load_average_1min"] = [before, load()]
    return out


# ---------------------------------------------------------------------------------------------
# B. compiled against eager; the bandwidth explanation
# ---------------------------------------------------------------------------------------------

def ratio_rows(by_batch: dict) -> dict:
    """{batch: eager_ms, compiled_ms, ratio} where both were measured."""
    out = {}
    for batch, rows in by_batch.items():
        if "eager" in rows and "compiled" in rows:
            e, c = rows["eager"]["step_ms"], rows["compiled"]["step_ms"]
            out[batch] = {"eager_ms": e, "compiled_ms": c, "ratio": e / c,
                          "context": rows["eager"]["context"]}
    return out


def section_compiled(args, subjects: list[Subject], host: dict | None, bandwidth: float,
                     per_op_s: float) -> dict:
    before = load()
    labels = ["eager", "compiled"]
    out = {"target": COMPILED_TARGET, "short": {}, "long": {}, "bandwidth": {}}
    print(f"\nB. compiled: the compiled bucketed step against eager, per step (the ratio of "
          f"median steps); target: compiled >= {COMPILED_TARGET}x eager on the bundled model")
    for subject in subjects:
        if host is not None:
            by_batch = host["models"][subject.key]["batches"]
        else:
            by_batch = {str(b): measure(subject, labels, b, SHORT_PROMPT, args)
                        for b in args.batches}
        out["short"][subject.key] = ratio_rows(by_batch)
    bundled = subjects[0]
    long_batches = [b for b in args.batches if bundled.measurable("compiled", b)]
    out["long"]["bundled"] = ratio_rows({str(b): measure(bundled, labels, b, LONG_PROMPT, args)
                                         for b in long_batches})
    print(f"  {'model':<36}{'context':>8}{'B':>4}{'eager ms':>10}{'compiled ms':>12}"
          f"{'ratio':>8}")
    for name, part in (("short", out["short"]), ("long", out["long"])):
        for key, rows in part.items():
            subject = next(s for s in subjects if s.key == key)
            for batch, r in rows.items():
                print(f"  {subject.name + ' (' + name + ')':<36}{r['context']:>8.0f}{batch:>4}"
                      f"{r['eager_ms']:>10.3f}{r['compiled_ms']:>12.3f}{r['ratio']:>7.2f}x")
    targets = []
    for name in ("short", "long"):
        for batch, r in out[name].get("bundled", {}).items():
            ok = None if args.quick else r["ratio"] >= COMPILED_TARGET
            targets.append({"name": f"compiled >= {COMPILED_TARGET}x eager on the bundled "
                                    f"model, B = {batch}, {name} context",
                            "context": name, "batch": int(batch), "ratio": r["ratio"],
                            "target": COMPILED_TARGET, "pass": ok})
    out["checks"] = targets
    for t in targets:
        print(f"  {verdict(t['pass'])}: {t['name']}: {t['ratio']:.2f}x")
    out["holds_at"] = {name: [t["batch"] for t in targets
                              if t["context"] == name and t["ratio"] >= COMPILED_TARGET]
                       for name in ("short", "long")}
    contexts = [r["context"] for r in out["long"]["bundled"].values()]
    print("  the target holds on the bundled model at B = "
          + (", ".join(map(str, out["holds_at"]["short"])) or "none")
          + " with short contexts, and at B = "
          + (", ".join(map(str, out["holds_at"]["long"])) or "none") + " with contexts about "
          + f"{median(contexts):.0f} of {bundled.max_context}")
    print(f"  bandwidth: bytes per step (every weight once, each request's K/V) / step time, "
          f"against S07's measured {bandwidth / 1e9:.1f} GB/s")
    print(f"  {'model':<36}{'B':>4}{'MB/step':>9}{'eager GB/s':>11}{'of bw':>7}"
          f"{'compiled GB/s':>14}{'of bw':>7}")
    for subject in subjects:
        rows = {}
        for batch, r in out["short"][subject.key].items():
            cost = roof.batched_decode_cost(subject.config, int(batch), round(r["context"]))
            e, c = cost.bytes / (r["eager_ms"] / 1e3), cost.bytes / (r["compiled_ms"] / 1e3)
            rows[batch] = {"bytes_per_step": cost.bytes, "eager_bytes_per_s": e,
                           "compiled_bytes_per_s": c, "eager_of_bandwidth": e / bandwidth,
                           "compiled_of_bandwidth": c / bandwidth}
            print(f"  {subject.name:<36}{batch:>4}{cost.bytes / 1e6:>9.1f}{e / 1e9:>11.2f}"
                  f"{e / bandwidth:>7.0%}{c / 1e9:>14.2f}{c / bandwidth:>7.0%}")
        out["bandwidth"][subject.key] = rows
    out["explanation"] = explain(subjects, out, bandwidth, host, per_op_s)
    print(f"  why: {out['explanation']}")
    out["load_average_1min"] = [before, load()]
    return out


def explain(subjects: list[Subject], out: dict, bandwidth: float, host: dict | None,
            per_op_s: float) -> str:
    """The contrast in words, from this run's figures at the smallest B measured: what share
    of the eager step is overhead (the host phases, and the forward's ops at one tiny op's
    cost each: what compiling can remove) and what share is moving bytes (which it cannot)."""
    parts = []
    for subject in subjects:
        rows = out["short"][subject.key]
        if not rows:
            continue
        batch = min(rows, key=int)
        r, bw = rows[batch], out["bandwidth"][subject.key][batch]
        text = f"{subject.name} at B = {batch}: the eager step takes {r['eager_ms']:.2f} ms"
        eager = (host or {}).get("models", {}).get(subject.key, {}).get(
            "batches", {}).get(batch, {}).get("eager")
        if eager is not None and eager["model_ops"] is not None:
            ops_ms = eager["model_ops"] * per_op_s * 1e3
            text += (f", of which {eager['host_fraction']:.0%} is host work around the forward "
                     f"and its {eager['model_ops']} ops at {per_op_s * 1e6:.2f} us each cost "
                     f"about {ops_ms:.2f} ms ({ops_ms / r['eager_ms']:.0%})")
        text += (f"; its {bw['bytes_per_step'] / 1e6:.1f} MB per step move at "
                 f"{bw['eager_bytes_per_s'] / 1e9:.1f} GB/s ({bw['eager_of_bandwidth']:.0%} of the "
                 f"measured {bandwidth / 1e9:.1f} GB/s copy); compiled {r['ratio']:.2f}x")
        parts.append(text)
    return ("; ".join(parts) + ". Compiling removes overhead (Python, dispatch, a kernel per "
            "op, activations written and read back between them): where that is most of the "
            "step, the step shrinks; where the step is mostly matmuls reading every weight "
            "(hundreds of MB per step, the overhead a few percent), the weights still have to "
            "be read, compiled or not, and little is left to gain.")


# ---------------------------------------------------------------------------------------------
# C. compile time, cold and warm
# ---------------------------------------------------------------------------------------------

CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_s16_host as b; "
         "print(json.dumps(b.child_compile(json.loads(sys.argv[2]))))")


def child_compile(spec: dict) -> dict:
    """In a fresh process (section C): the bundled model, a compiled engine with buckets
    spec["sizes"], every bucket compiled (`warmup`); returns the seconds."""
    start = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    model, tok = s06.load(s03.BUNDLED_MODEL_DIR, spec["device"], "float32")
    engine = s16_host.build_engine(model, tok, compile=True,
                                   cudagraph_capture_sizes=spec["sizes"],
                                   max_num_seqs=spec["max_num_seqs"],
                                   max_context=spec["max_context"], enable_prefix_caching=False)
    ready = time.perf_counter()
    times = engine.runner.warmup()
    return {"compile_times_s": {str(k): v for k, v in times.items()},
            "setup_s": ready - start, "compile_s": time.perf_counter() - ready,
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def run_child(spec: dict, cache_dir: str | None) -> dict:
    """child_compile in a subprocess with TORCHINDUCTOR_CACHE_DIR = cache_dir (None: as this
    process has it): its figures and the process's wall seconds, or {"error": ...}."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "benchmarks"),
                               json.dumps(spec)], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": f"exit status {done.returncode}: {done.stderr.strip()[-500:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def section_compile(args, bundled: Subject, cache_dir: str | None) -> dict:
    before = load()
    sizes = bundled.compiled_sizes
    spec = {"sizes": sizes, "device": args.device, "threads": args.threads,
            "max_num_seqs": max(bundled.static_sizes), "max_context": bundled.max_context}
    print(f"\nC. compile: the bundled model's compiled step, buckets {sizes}, each compiled "
          f"in a fresh process (the engine's compile_times_s: each bucket's first call)")
    if args.quick:     # no cold compile: the cache is inductor's own, warm or not
        cold = {"skipped": "--quick runs no cold compile"}
        print("  (quick run: no cold compile; warm means inductor's own cache, as this machine "
              "has it)")
    else:
        cold = run_child(spec, cache_dir)
    warm = run_child(spec, cache_dir)
    out = {"sizes": sizes, "cold": cold, "warm": warm}
    for name, r in (("cold", cold), ("warm", warm)):
        if "error" in r:
            print(f"  {name}: the compile failed: {r['error']}")
    runs = [(name, r) for name, r in (("cold", cold), ("warm", warm))
            if "error" not in r and "skipped" not in r]
    if runs:
        print(f"  {'bucket':>8}" + "".join(f"{name + ' s':>9}" for name, _ in runs))
        for size in sorted(sizes, reverse=True):
            print(f"  {size:>8}" + "".join(f"{r['compile_times_s'][str(size)]:>9.2f}"
                                          for _, r in runs))
        print(f"  {'all':>8}" + "".join(f"{r['compile_s']:>9.2f}" for _, r in runs)
              + "   (process wall: " + ", ".join(f"{r['process_s']:.1f} s {name}"
                                                 for name, r in runs)
              + "; import and model load included)")
        if not args.quick:
            print("  cold: a fresh TORCHINDUCTOR_CACHE_DIR; warm: the same directory again "
                  "(inductor's caches hit, dynamo still traces); the largest bucket, compiled "
                  "first, also pays the compiler's start-up")
    out["load_average_1min"] = [before, load()]
    return out


def in_process_compile_times(subjects: list[Subject]) -> dict:
    """Each compiled engine's compile_times_s in this process (a bucket another engine of the
    same model compiled first is a dynamo cache hit: about 0)."""
    return {s.key: {label: {str(k): v for k, v in b.runner.compile_times_s.items()}
                    for label, b in s.engines.items() if b.variant.compiles}
            for s in subjects}


# ---------------------------------------------------------------------------------------------
# D. async scheduling
# ---------------------------------------------------------------------------------------------

def token_check(subject: Subject, sync_label: str, async_label: str, batch: int,
                max_tokens: int) -> dict:
    """The same requests (held-out-free real text, greedy, EOS and ASYNC_STOP honoured) run to
    the end on both engines: requests with identical tokens and finish reasons."""
    text = s07_workloads.CORPUS_PATH.read_text(encoding="utf-8")
    prompts = [s[:20 + 9 * i] for i, s in enumerate(s01.speeches(text)[:batch])]
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=[ASYNC_STOP])
    done = {}
    with torch.inference_mode():
        for label in (sync_label, async_label):
            out = LLM(subject.engine(label).engine).generate(prompts, params)
            done[label] = [(c.token_ids, c.finish_reason) for c in out]
    a, b = done[sync_label], done[async_label]
    return {"sync": sync_label, "async": async_label, "requests": len(a),
            "identical_tokens": sum(x[0] == y[0] for x, y in zip(a, b)),
            "identical_finish_reasons": sum(x[1] == y[1] for x, y in zip(a, b)),
            "finish_reasons": sorted({reason for _, reason in a}),
            "tokens": sum(len(t) for t, _ in a)}


def section_async(args, bundled: Subject) -> dict:
    before = load()
    batch = args.async_batch
    variants = list(bundled.variants.values())
    pairs = [(sync_twin(v, variants), v) for v in variants if v.is_async]
    pairs = [(s, a) for s, a in pairs if s is not None and bundled.measurable(s.label, batch)
             and bundled.measurable(a.label, batch)]
    labels = list(dict.fromkeys(label for s, a in pairs for label in (s.label, a.label)))
    print(f"\nD. async: {bundled.name} at B = {batch}, {SHORT_PROMPT}-token prompts, each "
          f"async variant against its synchronous twin, alternating")
    rows = measure(bundled, labels, batch, SHORT_PROMPT, args)
    print_rows(f"  B = {batch}", rows)
    checks = []
    for s, a in pairs:
        sync, asyn = rows[s.label], rows[a.label]
        hf = sync["profiler_host_fraction"]
        bound = sync["step_ms"] * (1 - hf / 2)
        checks.append({"sync": s.label, "async": a.label, "sync_step_ms": sync["step_ms"],
                       "async_step_ms": asyn["step_ms"], "host_fraction": hf,
                       "bound_ms": bound, "speedup": sync["step_ms"] / asyn["step_ms"],
                       "pass": None if args.quick else asyn["step_ms"] <= bound})
    print("  (the bound's host fraction is the profiler's median share of the synchronous "
          "step, every phase but the forward;\n   the table's host % is median step - median "
          "forward over the median step: two medians, close but not the same)")
    for c in checks:
        print(f"  {verdict(c['pass'])}: {c['async']} step {c['async_step_ms']:.3f} ms <= "
              f"{c['sync']} step {c['sync_step_ms']:.3f} ms x (1 - {c['host_fraction']:.3f} / 2)"
              f" = {c['bound_ms']:.3f} ms ({c['speedup']:.2f}x)")
    tokens = [token_check(bundled, s.label, a.label, batch, args.async_tokens) for s, a in pairs]
    for t in tokens:
        same = (t["identical_tokens"] == t["requests"]
                and t["identical_finish_reasons"] == t["requests"])
        print(f"  tokens {t['sync']} vs {t['async']}: {t['identical_tokens']}/{t['requests']} "
              f"requests identical, finish reasons {t['identical_finish_reasons']}/"
              f"{t['requests']} ({', '.join(t['finish_reasons'])}; {t['tokens']} tokens)"
              + ("" if same else "  DIFFERENT"))
    return {"batch": batch, "rows": rows, "checks": checks, "tokens": tokens,
            "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# E. int4 and the bandwidth floor at batch 1
# ---------------------------------------------------------------------------------------------

class Stamps:
    """HF's streamer interface: the time each new token arrived (the prompt's put skipped)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_s06(engine, text: str, params) -> tuple[list[float], list[int]]:
    stamps, tokens = [], []
    for out in engine.stream(text, params):
        if out.new_token_ids:
            stamps.append(time.perf_counter())
            tokens += out.new_token_ids
    return stamps, tokens


def run_engine(engine, ids: list[int], params) -> tuple[list[float], list[int]]:
    stamps, tokens = [], []
    engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        new = [t for o in outs for t in o.new_token_ids]
        if new:
            stamps.append(time.perf_counter())
            tokens += new
    return stamps, tokens


def run_hf(hf, ids: list[int], n: int, device) -> tuple[list[float], list[int]]:
    x = torch.tensor([ids], device=device)
    stamps = Stamps()
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                      pad_token_id=0, streamer=stamps)
    return stamps.times, out[0, len(ids):].tolist()


def section_int4(args, subject: Subject, bandwidth: float) -> dict:
    before = load()
    n = args.tokens
    rng = np.random.default_rng(args.seed + 7)
    if isinstance(subject.tokenizer, IdTokenizer):
        ids = rng.integers(1, subject.vocab_size, size=E_PROMPT).tolist()
        text = subject.tokenizer.decode(ids)
    else:                                   # --quick: the bundled model, a real prompt
        text = "HAMLET.\nTo be, or not to be, that is the question:\n"
        ids = subject.tokenizer.encode(text)
    assert subject.tokenizer.encode(text) == ids
    assert len(ids) + n <= subject.max_context, "E's request must fit the engines' context"
    device = torch.device(args.device)
    params = s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    print(f"\nE. int4: {subject.name} at batch 1, {len(ids)}-token prompt, {n} tokens, greedy; "
          f"decode = median time between tokens over {args.repeats} alternating round(s); "
          f"floor = bytes per token / {bandwidth / 1e9:.1f} GB/s (S07)")
    # S14's int4 (g32, symmetric, fused kernels where they apply) on a fresh copy
    int4 = s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR, device, torch.float32) \
        if subject.state is None else \
        s06.TorchTransformer(subject.config, subject.state, device, torch.float32, "sdpa")
    q.quantize_model(int4, "int4")
    int4_subject = Subject(subject.key + " int4", subject.name + " (int4)", int4,
                           subject.tokenizer, subject.max_context, [1], [1],
                           [subject.variants["eager"], subject.variants["compiled"]])
    skipped, int4_compile = {}, {}
    if args.quick:                          # a cold compile of its own: not in a smoke run
        skipped["compiled int4"] = {"error": None, "message": "--quick compiles no int4 step"}
    else:
        try:
            with torch.inference_mode():
                int4_compile = {str(k): v for k, v in
                                int4_subject.engine("compiled").runner.warmup().items()}
            print(f"  (compiled int4: compiled in {sum(int4_compile.values()):.1f} s)")
        except Exception as err:           # torch.compile cannot trace it: say so, skip
            int4_subject.engines.pop("compiled", None)
            first = (str(err).strip().splitlines() or [""])[0]
            skipped["compiled int4"] = {"error": type(err).__name__, "message": first[:300]}
    hf = subject.hf
    if hf is None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, dtype=torch.float32)
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None       # exactly n tokens, as ignore_eos
    hf.generation_config.pad_token_id = 0
    s06_engine = s06.Engine(subject.model, subject.tokenizer, max_context=subject.max_context)
    runners = {
        "S06 fp32": lambda: run_s06(s06_engine, text, params),
        "S13 fp32 eager": lambda: run_engine(subject.engine("eager").engine, ids, params),
        "S13 int4 eager": lambda: run_engine(int4_subject.engine("eager").engine, ids, params),
        "compiled fp32": lambda: run_engine(subject.engine("compiled").engine, ids, params),
        "compiled int4": lambda: run_engine(int4_subject.engine("compiled").engine, ids,
                                            params),
        "HF generate fp32": lambda: run_hf(hf, ids, n, device),
    }
    for label in skipped:
        del runners[label]
    weights = {label: int4 if "int4" in label else subject.model for label in runners}
    labels = list(runners)
    intervals = {label: [] for label in labels}
    tokens = {}
    with torch.inference_mode():
        for label in labels:                                  # warm-up round, not kept
            runners[label]()
        for r in range(args.repeats):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                stamps, out = runners[label]()
                if len(out) != n:
                    raise RuntimeError(f"{label} made {len(out)} tokens, not {n}")
                intervals[label] += np.diff(stamps).tolist()
                tokens[label] = out
    context = statistics.median_low(range(len(ids) + 1, len(ids) + n))
    rows = {}
    for label in labels:
        interval = median(intervals[label])
        moved = bytes_per_token(weights[label], context)
        floor = moved / bandwidth
        rows[label] = {"decode_ms": interval * 1e3, "tokens_per_s": 1 / interval,
                       "intervals_ms": [t * 1e3 for t in intervals[label]],
                       "bytes_per_token": moved, "floor_ms": floor * 1e3,
                       "fraction_of_floor": floor / interval,
                       "same_tokens_as_s06": sum(a == b for a, b in
                                                 zip(tokens[label], tokens["S06 fp32"]))}
    for row in rows.values():
        row["speedup_vs_s06"] = row["tokens_per_s"] / rows["S06 fp32"]["tokens_per_s"]
    print(f"  {'engine':<18}{'tok/s':>8}{'vs S06':>8}{'decode ms':>10}{'MB/token':>9}"
          f"{'floor ms':>9}{'of floor':>9}{'same':>7}")
    for label, r in rows.items():
        print(f"  {label:<18}{r['tokens_per_s']:>8.1f}{r['speedup_vs_s06']:>7.2f}x"
              f"{r['decode_ms']:>10.2f}{r['bytes_per_token'] / 1e6:>9.2f}{r['floor_ms']:>9.2f}"
              f"{r['fraction_of_floor']:>9.0%}{r['same_tokens_as_s06']:>4}/{n}")
    for label, why in skipped.items():
        print(f"  {label}: skipped, " + (f"torch.compile failed with {why['error']}: "
                                          if why["error"] else "") + why["message"][:160])
    print("  (of floor: the bandwidth floor / the measured decode interval; same: tokens equal "
          "to S06 fp32's, position by position: int4 changes the weights)")
    int4_subject.close()
    return {"model": subject.key, "name": subject.name, "prompt_tokens": len(ids), "tokens": n,
            "repeats": args.repeats, "context_for_bytes": context,
            "bandwidth_bytes_per_s": bandwidth, "rows": rows, "skipped": skipped,
            "int4_compile_times_s": int4_compile,
            "load_average_1min": [before, load()]}


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


# flag: (full default, --quick default, low, high)
# Many short rounds rather than a few long ones: on a shared machine the load changes within
# seconds, and the more often the variants take turns, the more evenly it falls on each.
COUNTS = {"steps": (4, 4, 1, ROOM), "rounds": (8, 2, 1, MAX_REPEATS),
          "warmup": (3, 2, 1, ROOM), "async_batch": (16, 8, 1, MAX_BATCH),
          "async_tokens": (24, 12, 1, 64), "tokens": (32, 8, 2, MID_CONTEXT - E_PROMPT),
          "repeats": (3, 1, 1, MAX_REPEATS)}
HELP = {"steps": "timed decode steps per variant per round (A, B, D)",
        "rounds": "alternating rounds (A, B, D)",
        "warmup": "untimed decode steps after the prefill (A, B, D)",
        "async_batch": "requests decoding at once in D",
        "async_tokens": "max_tokens of D's token check",
        "tokens": "tokens generated per run in E",
        "repeats": "alternating rounds in E (after a warm-up round)"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="S16 benchmark: the host's share of a decode "
                                     "step; static buffers, torch.compile and async scheduling "
                                     "against S13's eager engine; int4 and the bandwidth floor.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (under a minute): the bundled model only, B = 1 and "
                             "8, short runs, one compiled bucket (default: off)")
    parser.add_argument("--sections", type=section_list, default=list(SECTIONS),
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--batches", type=batch_list, default=None,
                        help=f"batch sizes of A and B, comma-separated, each 1 to {MAX_BATCH} "
                             "(default: 1,8,32,64, --quick 1,8)")
    for name, (full, small, low, high) in COUNTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"{HELP[name]}, {low} to {high} (default: {full}, --quick "
                                 f"{small})")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts and the random model, >= 0 (default: "
                             "%(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--json", default=None,
                        help=f"write the figures to this JSON file (default: {DEFAULT_JSON})")
    parser.add_argument("--record", action="store_true",
                        help=f"write {RECORD_JSON.relative_to(ROOT)}, the committed record "
                             "(default: off)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    if args.batches is None:
        args.batches = [1, 8] if args.quick else [1, 8, 32, 64]
    for name, (full, small, low, high) in COUNTS.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
        s07.check_count(parser, "--" + name.replace("_", "-"), getattr(args, name), low, high)
    need = args.warmup + args.rounds * (args.steps + 1) + 2
    if need > ROOM:
        parser.error(f"--warmup + --rounds x (--steps + 1) + 2 decode steps per request must "
                     f"fit the {ROOM} tokens the longest prompts leave (got {need})")
    if args.record and args.json is not None:
        parser.error("--record writes the committed record; give --json or --record, not both")
    if args.record and args.quick:
        parser.error("--record takes a full run, not --quick")
    if args.json is not None:
        check_json(parser, args.json)
    if not (s03.BUNDLED_MODEL_DIR / "config.json").exists():
        parser.error(f"the bundled model is not in {s03.BUNDLED_MODEL_DIR} yet: train it with "
                     "python scripts/train_bundled_model.py")
    device = torch.device(args.device)
    try:
        s16_static.check_compile_available(device)
    except s01.ParameterError as err:
        parser.error(f"--device {args.device}: the compiled variants need torch.compile: {err}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        print(QUICK_DISCLAIMER)
    started = time.perf_counter()
    before, load_start = uptime(), list(os.getloadavg())
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), device "
          f"{args.device} ({platform.machine()}, {os.cpu_count()} logical cores); sections: "
          f"{','.join(args.sections)}")
    # A fresh inductor cache for this run: C's cold compile is cold, this process reuses what
    # C's subprocesses compiled, and nothing is left behind (removed at the end). --quick
    # keeps inductor's own cache (a cold compile alone would take most of its minute).
    saved_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cache_dir = None
    if not args.quick:
        cache_dir = tempfile.mkdtemp(prefix="bench_s16_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    # Every bucket of every model is one graph of one code object (s16_static.decode_step):
    # past dynamo's recompile limit the next would run eagerly without a word.
    dynamo = torch._dynamo.config
    saved_limits = (dynamo.recompile_limit, dynamo.accumulated_recompile_limit)
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 512)
    subjects: list[Subject] = []
    try:
        figures = run_sections(args, subjects, cache_dir)
    finally:
        for subject in subjects:
            subject.close()
        dynamo.recompile_limit, dynamo.accumulated_recompile_limit = saved_limits
        if saved_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_env
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    after, load_end = uptime(), list(os.getloadavg())
    elapsed = time.perf_counter() - started
    summary(figures, args)
    print(f"\nafter: {after}\ntotal {elapsed:.0f} s")
    if args.quick:
        print(QUICK_DISCLAIMER)
    config = {name: getattr(args, name) for name in ("quick", "sections", "batches", *COUNTS,
                                                     "seed", "device", "threads")}
    config.update(torch=torch.__version__, machine=platform.machine(),
                  logical_cores=os.cpu_count(), short_prompt=SHORT_PROMPT,
                  long_prompt=LONG_PROMPT, mid_context=MID_CONTEXT, e_prompt=E_PROMPT,
                  mid_shape=E2E_SHAPE)
    figures = {"config": config, **figures,
               "load_average": {"start": load_start, "end": load_end},
               "uptime_before": before, "uptime_after": after, "elapsed_s": elapsed}
    target = RECORD_JSON if args.record else Path(args.json or DEFAULT_JSON)
    write_json(target, figures, indent=1)
    print(f"wrote {target}")
    return figures


def run_sections(args, subjects: list[Subject], cache_dir: str | None) -> dict:
    figures: dict = {}
    section_s: dict = {}
    variants = variants_for(args.device)
    needs_bandwidth = {"compiled", "int4"} & set(args.sections)
    bandwidth = None
    if needs_bandwidth:
        bandwidth, method = roof.measure_bandwidth((64 if args.quick else 256) * 2**20, 5,
                                                   args.device)
        print(f"S07's measured bandwidth: {bandwidth / 1e9:.1f} GB/s ({method})")
    per_op_s = prof.per_op_overhead_s(args.device)
    print(f"one tiny op (S16's per_op_overhead_s): {per_op_s * 1e6:.2f} us")
    figures["machine"] = {"bandwidth_bytes_per_s": bandwidth,
                          "bandwidth_method": method if needs_bandwidth else None,
                          "per_op_overhead_s": per_op_s}
    bundled = bundled_subject(args, variants)
    subjects.append(bundled)
    if "compile" in args.sections:          # first: its cold compile fills the fresh cache
        mark = time.perf_counter()
        figures["compile"] = section_compile(args, bundled, cache_dir)
        section_s["compile"] = time.perf_counter() - mark
    if not args.quick and {"host", "compiled", "int4"} & set(args.sections):
        mid = mid_subject(args, variants)
        print(f"\n{mid.name}: a seeded random Qwen3 layout, {mid.params / 1e6:.1f}M parameters "
              f"(S14's E2E_SHAPE: hidden {E2E_SHAPE['hidden_size']}, "
              f"{E2E_SHAPE['num_hidden_layers']} layers, vocab {E2E_SHAPE['vocab_size']:,}), "
              f"max context {MID_CONTEXT}; built in {mid.build_s:.0f} s")
        subjects.append(mid)
    ab = list(subjects)                     # A and B: both models (--quick: the bundled one)
    if "host" in args.sections:
        mark = time.perf_counter()
        figures["host"] = section_host(args, ab, per_op_s)
        section_s["host"] = time.perf_counter() - mark
    if "compiled" in args.sections:
        mark = time.perf_counter()
        figures["compiled"] = section_compiled(args, ab, figures.get("host"), bandwidth,
                                               per_op_s)
        section_s["compiled"] = time.perf_counter() - mark
    if "async" in args.sections:
        mark = time.perf_counter()
        figures["async"] = section_async(args, bundled)
        section_s["async"] = time.perf_counter() - mark
    if "int4" in args.sections:
        mark = time.perf_counter()
        figures["int4"] = section_int4(args, subjects[-1], bandwidth)
        section_s["int4"] = time.perf_counter() - mark
    if "compile" in figures:
        times = in_process_compile_times(subjects)
        figures["compile"]["in_process"] = times
    if "compile" in figures and any(t for e in times.values() for t in e.values()):
        print("\nC (continued). compile seconds per bucket in this process (the bundled model: "
              "warm, after C's subprocesses; the mid-size model: cold; an engine whose step "
              "is one\n another engine already compiled (async compiled) shows ~0 s: the "
              "same graph, reused):")
        for key, engines in times.items():
            for label, by_bucket in engines.items():
                if by_bucket:
                    print(f"  {key:<8}{label:<16}" + ", ".join(
                        f"B {b}: {s:.2f} s" for b, s in by_bucket.items()))
    figures["targets"] = targets(figures)
    figures["section_s"] = section_s
    return figures


def targets(figures: dict) -> list[dict]:
    """Every verdict of the run (B's and D's checks), [] in a --quick run (no verdicts)."""
    out = []
    for t in figures.get("compiled", {}).get("checks", []):
        out.append({"section": "compiled", "name": t["name"], "value": t["ratio"],
                    "bound": t["target"], "pass": t["pass"]})
    for c in figures.get("async", {}).get("checks", []):
        out.append({"section": "async", "name": f"{c['async']} step <= {c['sync']} step x "
                                                f"(1 - host_fraction / 2) at B = "
                                                f"{figures['async']['batch']}",
                    "value": c["async_step_ms"], "bound": c["bound_ms"], "pass": c["pass"]})
    return [t for t in out if t["pass"] is not None]


def summary(figures: dict, args) -> None:
    """The verdicts and the headline ratios again, at the end of the output."""
    print("\nsummary")
    if "compiled" in figures:
        c = figures["compiled"]
        for key, rows in c["short"].items():
            print(f"  compiled / eager per step, {key}: " + ", ".join(
                f"B {b} {r['ratio']:.2f}x" for b, r in rows.items()))
        for t in c["checks"]:
            print(f"  {verdict(t['pass'])}: {t['name']}: {t['ratio']:.2f}x")
    if "async" in figures:
        for ch in figures["async"]["checks"]:
            print(f"  {verdict(ch['pass'])}: {ch['async']} at B "
                  f"{figures['async']['batch']}: {ch['async_step_ms']:.3f} ms vs bound "
                  f"{ch['bound_ms']:.3f} ms")
    if "int4" in figures:
        rows = figures["int4"]["rows"]
        print("  batch 1, tokens/s: " + ", ".join(f"{k} {r['tokens_per_s']:.0f} "
                                                  f"({r['fraction_of_floor']:.0%} of floor)"
                                                  for k, r in rows.items()))
    if args.quick:
        print("  (quick run: no verdicts)")


if __name__ == "__main__":
    main()
