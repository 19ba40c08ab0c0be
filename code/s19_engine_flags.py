r"""S19, serving: Part III's flags on the server's command line, turned into the engine served.

What is new
    code/s19_server.py serves one builder (`s19_server.ENGINE_BUILDER`, S13's `build_engine`).
    Every Part III chapter (S14-S18) makes the same engine's steps cheaper behind a few flags,
    without changing how it is served. This module is the assembly from those flags to the
    builder the server calls: `add_engine_arguments` (the flags), `check_engine_arguments`
    (every rule that needs no model, as usage errors naming the flag, before a model loads
    or a process starts), `engine_builder` (the builder and its options) and
    `describe_engine` (the start-up line's words). Each layer is the chapter's own
    `build_engine` given the builder it wraps (`functools.partial(..., builder=base)`, which
    `builder_name` spells out), built inside out:

    - --quantize, --group-size, --kv-cache-dtype: S14's `build_engine` replaces the base.
    - --speculative (ngram or draft), --num-speculative-tokens, --prompt-lookup-min/max,
      --draft-model: S15's over it (`speculative_builder`).
    - --attention-backend, --num-splits: S17's over that (`attention_builder`).
    - --tensor-parallel-size N > 1 (with --distributed-backend, --threads-per-rank,
      --disable-custom-all-reduce): S18's over the same (`parallel_builder`): the model split
      over N ranks, N - 1 spawned processes, each reading its own slices of the served
      checkpoint directory, S17's attention backend on every rank; rank 0 (the server's
      process) keeps the scheduler, the sampler and S15's n-gram drafts.
    - --compile, --cuda-graphs, --cudagraph-capture-sizes, --async-scheduling,
      --executor-backend: S16's outermost (`host_builder`).

What it does not handle
    Combinations the chapters do not run: S16's async scheduling with S15's drafts, S16's
    static steps with S14's 8-bit KV pool, S17's kernels with S16's static step (S17's
    rule), and under N > 1 ranks S16's techniques, S14's quantized weights or KV pool and
    S15's draft model (S18 splits none of them). Each is a usage error (exit status 2) naming
    the flags. Rank 0 loads the whole model once before its share (the server reads the
    config, device and dtype from it) and drops it when the engine is built.

Run it
    python code/s19_server.py --tensor-parallel-size 2      # S18: two ranks on this machine
    python code/s19_server.py --quantize int8 --speculative ngram --attention-backend sdpa

Tests
    tests/test_s19_speculative.py, tests/test_s19_host_flags.py and tests/test_s19_server.py
    start the server through `s19_server.main` with these flags (S14's, S15's, S16's, S17's);
    tests/test_s19_tensor_parallel.py with --tensor-parallel-size 2 (greedy text equal to
    S05's alone, no rank process left after the server stops) and S18's refusals.

References
    vLLM's `EngineArgs` (vllm/engine/arg_utils.py: one place that turns the command line
    into the engine's configuration; its flag names); each chapter's module for its builder.
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable

import s03_transformer as s03
import s14_kv_cache
import s14_quantization as s14
import s15_speculative as s15
import s16_host
import s17_attention
import s18_tensor_parallel as s18
from s01_generation_loop import ParameterError

QUANTIZED_BUILDER = s14.build_engine  # with --quantize / --kv-cache-dtype: S14's, over S13's
FLAGS = {"scheme": "--quantize", "group_size": "--group-size", "symmetric": "--quantize",
         "path": "--quantize", "kv_cache_dtype": "--kv-cache-dtype",     # S14's names -> flags
         "speculative": "--speculative", "num_speculative_tokens": "--num-speculative-tokens",
         "prompt_lookup_min": "--prompt-lookup-min", "prompt_lookup_max": "--prompt-lookup-max",
         "draft_model": "--draft-model",                                 # S15's
         "compile": "--compile", "cuda_graphs": "--cuda-graphs",         # S16's
         "async_scheduling": "--async-scheduling",
         "cudagraph_capture_sizes": "--cudagraph-capture-sizes",
         "executor_backend": "--executor-backend",
         "attention_backend": "--attention-backend", "num_splits": "--num-splits",  # S17's
         "tensor_parallel_size": "--tensor-parallel-size",               # S18's
         "distributed_backend": "--distributed-backend",
         "threads_per_rank": "--threads-per-rank"}


def flag_message(err: ParameterError) -> str:
    """A builder's ParameterError as a usage error: "--flag: message" when the parameter it
    names (`err.parameter`, never its text) was set by one of these flags."""
    flag = FLAGS.get(err.parameter)
    return f"{flag}: {err}" if flag else str(err)


def builder_name(builder: Callable) -> str:
    """"module.function" of an engine builder; a layer of this module's spells out what it
    wraps: "s15_speculative.build_engine over s13_prefix_caching.build_engine"."""
    if isinstance(builder, functools.partial):      # a chapter's build_engine over a base
        return f"{builder_name(builder.func)} over {builder_name(builder.keywords['builder'])}"
    return f"{builder.__module__}.{builder.__qualname__}"


def speculative_builder(base: Callable) -> Callable:
    """S15's `build_engine` speculating on `base`: its options (speculative,
    num_speculative_tokens, prompt_lookup_min/max, draft_model) go to S15, the rest to the
    base. A step's `RequestOutput` may then carry several tokens (the accepted drafts and one
    more); the server counts tokens, not steps, so its answers are the same, only sooner."""
    return functools.partial(s15.build_engine, builder=base)


def attention_builder(base: Callable) -> Callable:
    """S17's `build_engine` over `base`: its options (attention_backend, num_splits) go to
    S17, the rest to the base. The same answers; each step's attention on that backend."""
    return functools.partial(s17_attention.build_engine, builder=base)


def parallel_builder(base: Callable) -> Callable:
    """S18's `build_engine` over `base`: its options (tensor_parallel_size, checkpoint,
    distributed_backend, threads_per_rank, disable_custom_all_reduce, and S17's
    attention_backend, num_splits, which every rank runs) go to S18, the rest to the base.
    The engine's runner is then a `TPRunner` whose executor owns the ranks:
    `s16_host.shutdown_engine` (the server's `EngineLoop.stop`) or exit stops them."""
    return functools.partial(s18.build_engine, builder=base)


def host_builder(base: Callable) -> Callable:
    """S16's `build_engine` over `base`: its options (compile, cuda_graphs, async_scheduling,
    cudagraph_capture_sizes, executor_backend) go to S16, the rest to the base. With
    async_scheduling the engine is an `s16_async.AsyncLLMEngine`: the same `step`, `abort`,
    `add_request` the engine thread calls, its forward on a worker thread (stopped with the
    engine loop)."""
    return functools.partial(s16_host.build_engine, builder=base)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """S14's --quantize, --group-size, --kv-cache-dtype; S15's, S16's, S17's and S18's flags
    (their chapters' own argument functions)."""
    parser.add_argument("--quantize", default=None, choices=s14.SCHEMES,
                        help="store the linear weights as S14's int8 (per channel), int4 "
                             "(group-wise) or llama.cpp's q8_0 / q4_0, the engine built by "
                             f"{builder_name(QUANTIZED_BUILDER)} (default: none, the "
                             "checkpoint's weights)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="--quantize int4: weights per scale, one of "
                             f"{', '.join(map(str, s14.GROUP_SIZES))} (default: 32)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                        choices=list(s14_kv_cache.KV_CACHE_DTYPES),
                        help="how the paged KV cache stores keys and values, vLLM's names "
                             f"(S14): one of {', '.join(s14_kv_cache.KV_CACHE_DTYPES)}; auto "
                             "= the model's dtype, int8 and fp8 one byte per value with "
                             "their scales (default: %(default)s)")
    s15.add_speculative_arguments(parser)   # S15: --speculative, --num-speculative-tokens, ...
    # S16: --compile, --cuda-graphs, --cudagraph-capture-sizes, --async-scheduling
    s16_host.add_technique_arguments(parser, static_decode=False)
    s17_attention.add_attention_arguments(parser)   # S17: --attention-backend, --num-splits
    # S18: --tensor-parallel-size, --distributed-backend, --threads-per-rank, ...
    s18.add_parallel_arguments(parser)


def check_engine_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2, `parser.error`) before a model loads or a rank starts,
    each naming its flags: S14's group size, S15's, S16's and S17's own rules, S18's (N that
    does not divide the model's heads, MLP or vocabulary, more ranks x threads than cores,
    NCCL without CUDA; reading the checkpoint's config.json, not its weights), and the
    combinations no chapter runs (see the module docstring). --device and --model as the
    server has them (--model None: the bundled model)."""
    if args.group_size is not None and args.quantize != "int4":
        parser.error("--group-size needs --quantize int4 (int4's weights per scale; int8 "
                     "has one scale per channel, q8_0 / q4_0 blocks of 32)")
    if args.group_size is not None and args.group_size not in s14.GROUP_SIZES:
        parser.error(f"--group-size must be one of {', '.join(map(str, s14.GROUP_SIZES))} "
                     f"(got {args.group_size})")
    s15.check_speculative_arguments(parser, args)   # the rules that need no model
    s18.check_parallel_arguments(parser, args)      # S18's (the served model's divisibility)
    s16_host.check_technique_arguments(parser, args)   # S16's rules that need no model
    s17_attention.check_attention_arguments(parser, args)   # S17's
    if args.async_scheduling and args.speculative:
        parser.error("--async-scheduling does not run with --speculative: the proposer drafts "
                     "from the tokens of the step in flight, which are not sampled yet when "
                     "the next step is planned; drop one of them")
    if (args.compile or args.cuda_graphs) and args.kv_cache_dtype != "auto":
        parser.error(f"--compile and --cuda-graphs write the float KV pool; --kv-cache-dtype "
                     f"{args.kv_cache_dtype} (S14's 8-bit pool) runs eagerly only: drop one "
                     "of them")


def engine_builder(args: argparse.Namespace, base: Callable,
                   checkpoint) -> tuple[Callable, dict]:
    """(builder, options) for the checked flags: `base` (the server's ENGINE_BUILDER) or
    S14's, then S15's, S17's or S18's, S16's over it as the module docstring says, and the
    options those layers take (none when no flag is given: base alone). checkpoint: the
    served model's directory, which each of S18's ranks reads its slices from. The server's
    `make_engine` adds max_context, max_num_seqs and max_num_batched_tokens."""
    options: dict = {}
    if args.quantize is not None or args.kv_cache_dtype != "auto":
        # S14's build_engine: the KV dtype checked, then the weights quantized
        base = QUANTIZED_BUILDER
        options.update(quantize=args.quantize, group_size=args.group_size,
                       kv_cache_dtype=args.kv_cache_dtype)
    speculative = s15.speculative_options(args)
    # S15's over it: the draft loaded, then the base built
    builder = speculative_builder(base) if speculative else base
    options.update(speculative)
    attention = ({} if args.attention_backend == "gather" and args.num_splits == 1 else
                 dict(attention_backend=args.attention_backend, num_splits=args.num_splits))
    if args.tensor_parallel_size > 1:      # S18 runs S17's backend on every rank itself
        builder = parallel_builder(builder)
        options.update(attention, tensor_parallel_size=args.tensor_parallel_size,
                       checkpoint=str(checkpoint), distributed_backend=args.distributed_backend,
                       threads_per_rank=args.threads_per_rank,
                       disable_custom_all_reduce=args.disable_custom_all_reduce)
    elif attention:
        builder = attention_builder(builder)
        options.update(attention)
    if args.compile or args.cuda_graphs or args.async_scheduling or \
            args.executor_backend != "uni":
        # S16's outermost: static decode steps, then the async loop around them
        builder = host_builder(builder)
        options.update(s16_host.technique_options(args))
    return builder, options


def describe_speculation(engine) -> str:
    """The served engine's proposer in words: "ngram k=4 (n-grams 1..4)", "draft k=3 (1
    layer, 459,200 parameters)", "draft k=4 (int4 g32 sym copy of the target)"."""
    proposer = engine.proposer
    k = proposer.num_speculative_tokens
    if isinstance(proposer, s15.NgramProposer):
        return (f"ngram k={k} (n-grams {proposer.prompt_lookup_min}.."
                f"{proposer.prompt_lookup_max})")
    draft = proposer.model
    weights = s14.quantized_weights(draft)
    what = (f"{next(iter(weights.values())).describe()} copy of the target" if weights else
            f"{draft.config.num_hidden_layers} layer"
            f"{'s' if draft.config.num_hidden_layers != 1 else ''}, "
            f"{s03.parameter_count(draft.config):,} parameters")
    return f"draft k={k} ({what})"


def describe_parallel(engine) -> str:
    """The ranks in words: "tensor parallel 2 ranks (gloo, all-reduce by shared memory),
    weights per rank 1.3 MiB of 2.5 MiB"."""
    return f"tensor parallel {s16_host.inner_engine(engine).runner.executor.describe()}"


def describe_engine(engine, model, args: argparse.Namespace) -> str:
    """What the flags changed, for the start-up line: ", weights int8 per-channel, KV cache
    int8, speculative ngram k=4 (...), attention backend paged, tensor parallel 2 ranks (...),
    eager steps; async scheduling" (empty for the plain engine). model: the one loaded."""
    weights = s14.quantized_weights(model)
    words = (f", weights {next(iter(weights.values())).describe()}" if weights else "") + (
        f", KV cache {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")
    if args.speculative:
        words += f", speculative {describe_speculation(engine)}"
    if args.attention_backend != "gather" or args.num_splits != 1:
        words += f", attention backend {args.attention_backend}" + (
            f" (split-K {args.num_splits})" if args.num_splits > 1 else "")
    if args.tensor_parallel_size > 1:
        words += f", {describe_parallel(engine)}"
    if args.compile or args.cuda_graphs or args.async_scheduling or \
            args.executor_backend != "uni":
        words += f", {s16_host.describe_techniques(engine)}"
    return words
