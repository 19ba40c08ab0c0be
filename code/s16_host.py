r"""S16, the host side of a step: the chapter script, and the engine with its techniques.

What is new since S15
    A decode step of a small model is a few hundred tiny kernels with Python between them: the
    host, not the device, sets its pace. This chapter measures that (code/s16_profile.py) and
    removes it three ways, each a component of S09's one engine:

    - static shapes (code/s16_static.py): persistent input buffers and batch-size buckets, so
      a decode step is the same graph every time; then `torch.compile` of that step
      (compile=True), and CUDA graph capture and replay per bucket on CUDA (cuda_graphs=True);
    - async scheduling (code/s16_async.py): the next step is planned while the current
      forward runs (async_scheduling=True).

    `build_engine(model, tokenizer, compile=..., cuda_graphs=..., async_scheduling=...,
    cudagraph_capture_sizes=..., executor_backend=..., builder=..., **options)` builds the
    engine of any paged builder (S13's by default: paged KV, prefix caching, chunked prefill)
    and adds them. S19's server takes the same flags (code/s19_server.py).

    The chapter script (`main`, S09's `chapter_main` like every Part II script) runs S13's
    engine with the techniques its flags ask for: --compile, --cuda-graphs, --async-scheduling,
    --cudagraph-capture-sizes (the buckets, vLLM's name), and --static-decode, the static step
    run eagerly, to see what the buffers and buckets do before a compiler touches them. Its
    header says which techniques ran and what the static runner did (static steps by bucket,
    eager steps, each bucket's first call with its compile time); its table has one line per
    step from S16's profiler (`StepProfiles`, which stays right under async scheduling, where
    S09's `StepTracer`, pairing each plan with the next result, would not), and --profile adds
    the profiler's medians by kind and batch size and one decode step's timeline. Flags this
    machine cannot honour are usage errors before a model loads: --cuda-graphs off CUDA,
    --compile with no C++ compiler (CPU) or no Triton (CUDA).

What it does not handle
    Compilation is lazy in the script (a bucket compiles the first time a batch needs it, and
    that step's time shows it); S19's server compiles every bucket at start up. --profile
    counts no ops (`StepProfiler(count_ops=True)` would run a compiled step eagerly, and
    cannot see the async loop's worker thread): count them on an eager synchronous engine, as
    the benchmark does. Per step, the table does not say whether the step ran static (the
    header has the totals by bucket): a decode step of at most the largest bucket's batch did.

Run it
    python code/s16_host.py                                   # S13's engine, eager: the baseline
    python code/s16_host.py --static-decode --profile         # buffers and buckets, eager
    python code/s16_host.py --compile --cudagraph-capture-sizes 1 2 4
    python code/s16_host.py --async-scheduling --profile
    python code/s16_host.py --cuda-graphs --device cuda       # on a CUDA machine
    python code/s19_server.py --async-scheduling --compile    # the server, same flags

Tests
    tests/test_s16_host.py: the script's completions equal S13's engine run in process, plain,
    with --async-scheduling --profile, --static-decode and --compile (one compile); the header's
    counters, the tables and the timeline; its worker thread stopped; every bad flag a usage
    error before a model loads; --help. tests/test_s19_host_flags.py: the server's flags.
    tests/test_s16_static.py, tests/test_s16_async.py, tests/test_s16_profile.py: the pieces.

References
    vLLM: `CompilationConfig.cudagraph_capture_sizes` (vllm/config/compilation.py), the
    `--async-scheduling` flag (PR #19970, 2025; on by default since v0.14.0, off with
    `--no-async-scheduling`). nano-vllm: `enforce_eager` (eager steps, no graphs).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import s06_torch as s06
import s13_prefix_caching as s13
import s16_async
import s16_profile
import s16_static
import s16_worker
from s01_generation_loop import ParameterError


def build_engine(model: s06.TorchTransformer, tokenizer, *, compile: bool = False,
                 cuda_graphs: bool = False, async_scheduling: bool = False,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 executor_backend: str = "uni", builder: Callable = s13.build_engine,
                 **options):
    """The engine `builder` makes (a paged one: S12's, S13's (default), S14's, S15's: steps
    that verify drafts run eagerly), with static decode steps when compile or
    cuda_graphs (`s16_static.make_static`, buckets cudagraph_capture_sizes, default
    `bucket_sizes(max_num_seqs)`) and stepped one plan ahead when async_scheduling
    (`s16_async.AsyncLLMEngine`). executor_backend: "uni", the forward in this process, or
    "mp", in a worker process (`s16_worker.ProcessRunner`; vLLM's names). options: the
    builder's. Raises ParameterError naming the
    rule: compile without a C++ compiler (CPU) or Triton (CUDA), cuda_graphs off CUDA,
    bad capture sizes, a flag that is not a bool."""
    for name, value in (("compile", compile), ("cuda_graphs", cuda_graphs),
                        ("async_scheduling", async_scheduling)):
        if not isinstance(value, bool):
            raise ParameterError(f"{name} must be True or False (got {value!r})", name)
    if executor_backend not in s16_worker.EXECUTOR_BACKENDS:
        raise ParameterError(f"executor_backend must be one of {s16_worker.EXECUTOR_BACKENDS} "
                             f"(got {executor_backend!r})", "executor_backend")
    if cudagraph_capture_sizes is not None:
        cudagraph_capture_sizes = s16_static.check_bucket_sizes(cudagraph_capture_sizes)
        if not (compile or cuda_graphs):
            raise ParameterError("cudagraph_capture_sizes are the buckets of a static decode "
                                 "step: they need compile or cuda_graphs (or s16_static."
                                 "make_static for the static step run eagerly)",
                                 "cudagraph_capture_sizes")
    if compile:
        s16_static.check_compile_available(model.device)
    if cuda_graphs:
        s16_static.check_cuda_graphs_available(model.device)
    engine = builder(model, tokenizer, **options)
    if compile or cuda_graphs:
        s16_static.make_static(engine, compile=compile, cuda_graphs=cuda_graphs,
                               sizes=cudagraph_capture_sizes)
    if executor_backend == "mp":
        s16_worker.make_process(engine)
    if async_scheduling:
        engine = s16_async.AsyncLLMEngine(engine)
    return engine


# ---------------------------------------------------------------------------------------------
# What the engine does, in words
# ---------------------------------------------------------------------------------------------

def static_builder(base: Callable = s13.build_engine, sizes: Sequence[int] | None = None
                   ) -> Callable:
    """A builder for `build_engine`: base's engine with static decode steps run eagerly
    (`s16_static.make_static` without compile or CUDA graphs: persistent buffers and buckets
    `sizes`, default `bucket_sizes(max_num_seqs)`), the step --compile compiles and
    --cuda-graphs captures, measured on its own. Not for compile=True or cuda_graphs=True
    (`build_engine` makes those static itself)."""
    def build(model, tokenizer, **options):
        return s16_static.make_static(base(model, tokenizer, **options), sizes=sizes)
    return build


def inner_engine(engine):
    """The S09 `LLMEngine` doing the work: the engine itself, or the one an
    `s16_async.AsyncLLMEngine` steps."""
    return engine.engine if isinstance(engine, s16_async.AsyncLLMEngine) else engine


def shutdown_engine(engine) -> None:
    """Stop what the engine started beside it: the async loop's worker thread, a worker
    process's forward (waiting for a step in flight), S18's ranks; nothing for a plain engine.
    Idempotent."""
    if isinstance(engine, s16_async.AsyncLLMEngine):
        engine.shutdown()
    runner = getattr(inner_engine(engine), "runner", None)
    if hasattr(runner, "shutdown"):      # S16's worker process, S18's ranks
        runner.shutdown()


def static_settings(runner) -> dict | None:
    """{sizes, compile, cuda_graphs} of the runner's static decode step (in this process, or
    the one a worker process rebuilds), or None when its steps are all eager."""
    if isinstance(runner, s16_static.StaticDecodeRunner):
        return dict(sizes=runner.sizes, compile=runner.compile, cuda_graphs=runner.cuda_graphs)
    if isinstance(runner, s16_worker.ProcessRunner) and runner.static_options:
        return {k: runner.static_options[k] for k in ("sizes", "compile", "cuda_graphs")}
    return None


def describe_techniques(engine) -> str:
    """Which of the chapter's techniques the engine runs, in words: "decode steps static in
    buckets 1, 2, 4, compiled; async scheduling", "eager steps; synchronous"."""
    runner = engine.runner
    static = static_settings(runner)
    if static is not None:
        how = [w for w, on in (("compiled", static["compile"]),
                               ("CUDA graphs", static["cuda_graphs"])) if on] or ["eager"]
        words = (f"decode steps static in buckets {', '.join(map(str, static['sizes']))}, "
                 f"{', '.join(how)}")
    else:
        words = "eager steps"
    if isinstance(runner, s16_worker.ProcessRunner):
        words += ", the forward in a worker process"
    loop = ("async scheduling" if isinstance(engine, s16_async.AsyncLLMEngine)
            else "synchronous")
    return f"{words}; {loop}"


def describe_runs(engine) -> str:
    """What the static runner did so far: static decode steps by bucket, eager steps, and the
    seconds each bucket's first (compiling) call took; "" for an engine without one."""
    runner = engine.runner
    if isinstance(runner, s16_worker.ProcessRunner) and runner.static_options:
        return f"{runner.num_static_steps} static decode steps (in the worker process)"
    if not isinstance(runner, s16_static.StaticDecodeRunner):
        return ""
    buckets = ", ".join(f"{b}: {n}" for b, n in sorted(runner.steps_by_bucket.items()))
    words = (f"{runner.num_static_steps} static decode steps"
             f"{f' (by bucket {buckets})' if buckets else ''}, {runner.num_eager_steps} eager "
             "(prefill, mixed, larger batches)")
    if runner.compile_times_s:
        times = ", ".join(f"bucket {b} {s:.1f} s"
                          for b, s in sorted(runner.compile_times_s.items()))
        words += f"; first call per bucket, compile included: {times}"
    return words


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

class StepProfiles(s16_profile.StepProfiler):
    """S16's profiler as the chapter script's first tracer: `records` are its profiles (one
    per step that ran the model; what `s08_cli.chapter_main` counts as the run's steps).
    Unlike S09's `StepTracer`, which pairs each plan with the next result, a profile is made
    from the step's own `StepResult` (its plan included), so it stays right when async
    scheduling plans step N + 1 before step N's result."""

    @property
    def records(self) -> list[s16_profile.StepProfile]:
        return self.profiles


def format_step_table(profiles: Sequence[s16_profile.StepProfile], max_rows: int = 40) -> str:
    """One line per step: its number, kind, B, T, the whole step and the forward in ms, and
    the host's share (everything but the forward). A longer trace shows its first and last
    max_rows // 2 steps."""
    from s08_cli import render_table
    return render_table(
        f"{'step':>5} {'kind':<8}{'B':>4}{'T':>6}{'step ms':>10}{'fwd ms':>10}{'host %':>8}",
        profiles, lambda p: (f"{p.step:>5} {p.kind:<8}{p.num_seqs:>4}{p.num_tokens:>6}"
                             f"{p.step_s * 1e3:>10.3f}{p.forward_s * 1e3:>10.3f}"
                             f"{p.host_fraction * 100:>8.1f}"), max_rows)


def timeline_step(profiles: Sequence[s16_profile.StepProfile]
                  ) -> s16_profile.StepProfile | None:
    """The decode step to draw: among the decode steps of the largest batch, the one with the
    median step time (a bucket's first, compiling, step is never it unless it is alone);
    None when no decode step ran."""
    decodes = [p for p in profiles if p.kind == s16_profile.DECODE]
    if not decodes:
        return None
    widest = max(p.num_seqs for p in decodes)
    group = sorted((p for p in decodes if p.num_seqs == widest), key=lambda p: p.step_s)
    return group[(len(group) - 1) // 2]


def add_technique_arguments(parser, static_decode: bool = True) -> None:
    """The techniques' flags, vLLM's names where vLLM has them (this script and S19's server):
    --compile, --cuda-graphs, --cudagraph-capture-sizes, --async-scheduling, and (static_decode)
    --static-decode, the static step without either."""
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each bucket's decode step (fullgraph, static "
                             "shapes): seconds per bucket on the CPU, whose inductor needs a "
                             "C++ compiler (Triton on CUDA)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="capture each bucket's decode step in a CUDA graph at start and "
                             "replay it (CUDA only)")
    if static_decode:
        parser.add_argument("--static-decode", action="store_true",
                            help="decode steps through persistent buffers padded to the "
                                 "buckets, run eagerly: the step --compile compiles and "
                                 "--cuda-graphs captures, on its own (implied by either)")
    parser.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                        metavar="N",
                        help="the batch sizes a decode step is padded to, each in [1, "
                             f"{s16_static.MAX_BUCKET}] (vLLM's name); a larger batch runs "
                             "eagerly (default: 1, 2, 4, 8, then multiples of 16, up to the "
                             "first that holds --max-num-seqs)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="plan step N + 1 while step N's forward runs (vLLM's "
                             "--async-scheduling); the outputs are the same")
    parser.add_argument("--executor-backend", choices=s16_worker.EXECUTOR_BACKENDS,
                        default="uni",
                        help="where the forward runs: 'uni', this process (with "
                             "--async-scheduling, on a worker thread), or 'mp', a worker "
                             "process (vLLM's names): on a CPU only a process overlaps the "
                             "host's work with the forward")


def check_technique_arguments(parser, args) -> None:
    """Usage errors (exit status 2) before any model loads, each naming its flag:
    --cuda-graphs off CUDA; --compile where this machine cannot compile (no C++ compiler for
    the CPU, no Triton for CUDA); --cudagraph-capture-sizes out of range or without a static
    step to pad; a static step with --batch-invariant (which never runs one), where the
    script has that flag. --device must be checked already (S08's rule)."""
    device = s06.resolve_device_dtype(args.device)[0]
    if args.cuda_graphs and device.type != "cuda":
        parser.error(f"--cuda-graphs needs a CUDA device (the model would run on {device}): "
                     "CUDA graphs record GPU kernel launches; drop the flag, or use "
                     "--device cuda")
    if args.compile:
        try:
            s16_static.check_compile_available(device)
        except ParameterError as err:
            parser.error(f"--compile: {err}")
    has_static_decode = hasattr(args, "static_decode")
    static = args.compile or args.cuda_graphs or getattr(args, "static_decode", False)
    names = ("--compile, --cuda-graphs or --static-decode" if has_static_decode
             else "--compile or --cuda-graphs")
    sizes = args.cudagraph_capture_sizes
    if sizes is not None:
        if not static:
            parser.error(f"--cudagraph-capture-sizes needs {names} (the sizes are the static "
                         "decode step's buckets)")
        bad = [s for s in sizes if not 1 <= s <= s16_static.MAX_BUCKET]
        if bad:
            parser.error(f"--cudagraph-capture-sizes must be integers in [1, "
                         f"{s16_static.MAX_BUCKET}] (got {bad[0]})")
    if args.executor_backend == "mp" and getattr(args, "batch_invariant", False):
        parser.error("--executor-backend mp runs the fast mode only: --batch-invariant reads "
                     "every request's whole history each step; use --executor-backend uni")
    if static and getattr(args, "batch_invariant", False):
        parser.error(f"{names.replace(' or ', ' and ')} need the fast mode: --batch-invariant "
                     "computes every request alone with S06's shapes, so no step would be "
                     "static")


def technique_options(args) -> dict:
    """`build_engine`'s compile, cuda_graphs, async_scheduling, cudagraph_capture_sizes and
    executor_backend from the flags; with --static-decode alone, a `static_builder` as its
    builder."""
    options = dict(compile=args.compile, cuda_graphs=args.cuda_graphs,
                   async_scheduling=args.async_scheduling,
                   cudagraph_capture_sizes=args.cudagraph_capture_sizes,
                   executor_backend=args.executor_backend)
    if getattr(args, "static_decode", False) and not (args.compile or args.cuda_graphs):
        options["builder"] = static_builder(sizes=options.pop("cudagraph_capture_sizes"))
    return options


def add_host_arguments(parser) -> None:
    """The chapter script's flags: the techniques', --profile, and S12's paged engine's (with
    S11's budget and S10's policy)."""
    add_technique_arguments(parser)
    parser.add_argument("--profile", action="store_true",
                        help="after the run, the profiler's medians by kind and batch size "
                             "(each host phase against the forward) and one decode step's "
                             "timeline")
    import s12_engine as s12
    s12.add_paged_arguments(
        parser, "KV blocks in the pool, block 0 (the null block) included; small values force "
                "preemptions (default: max-num-seqs x the context's blocks + 1)")


def check_host_arguments(parser, args) -> None:
    """The chapter script's usage errors before any model loads: the paged engine's rules
    (S10-S12), then the techniques' (`check_technique_arguments`)."""
    import s12_engine as s12
    s12.check_paged_arguments(parser, args)
    check_technique_arguments(parser, args)


def host_options(args) -> dict:
    """`build_engine`'s arguments from the chapter script's flags (the paged ones S12's; the
    pool keeps no events: no block tracer reads them here)."""
    import s12_engine as s12
    return dict(s12.paged_options(args), enable_kv_cache_events=False,
                **technique_options(args))


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    built, shown = [], {}

    def check(parser, args) -> None:
        check_host_arguments(parser, args)
        shown["profile"] = args.profile

    def build(model, tokenizer, **options):
        engine = build_engine(model, tokenizer, **options)
        built.append(engine)                   # shut down below, whatever happens next
        return engine

    def describe(engine, tracers) -> str:
        runs = describe_runs(engine)
        return (f"{engine.scheduler.max_num_batched_tokens} tokens per step; "
                f"{describe_techniques(engine)}{'; ' + runs if runs else ''}")

    def profile_tables(profiles) -> str:
        step = timeline_step(profiles)
        return ("\n\n--- medians by kind and batch size (ms; host = every phase but the "
                "forward) ---\n" + s16_profile.format_profile_table(
                    s16_profile.summarize(profiles))
                + "\n\n--- one decode step (the median of the largest batch) ---\n"
                + (s16_profile.format_timeline(step) if step else "no decode step ran"))

    def table(run, tracers) -> str:
        profiles = tracers[0].profiles
        text = format_step_table(profiles)
        if built and isinstance(built[-1], s16_async.AsyncLLMEngine):
            text += ("\n(async scheduling: a step's time runs from its launch to its report, "
                     "across the next step's plan\n and the caller's own work, so its host % is "
                     "not the synchronous loop's; compare the run's\n tokens/s, or the "
                     "benchmark's wall time per step. A request's last row is computed and\n "
                     "dropped one step after it ends, so the run takes more steps; with a "
                     "worker thread on a CPU\n there is no overlap at all: --executor-backend "
                     "mp gives the forward its own process)")
        return text if not shown.get("profile") else text + profile_tables(profiles)

    try:
        s08_cli.chapter_main(s08_cli.Chapter(
            "Chapter 16: the host side of a step: static decode steps in batch-size buckets, "
            "torch.compile, CUDA graphs and async scheduling, and a profiler that shows where "
            "a step's time goes.",
            build, add_arguments=add_host_arguments, options=host_options,
            tracers=lambda engine: [StepProfiles()], describe=describe, table=table,
            check=check, arrival_every=0), argv)
    finally:
        for engine in built:
            shutdown_engine(engine)            # the forward's worker thread or process


if __name__ == "__main__":
    sys.exit(main())
