"""S08, the command line: the flags, checks and table helpers every Part II script shares.

What is here
    What each chapter script from S08 on would otherwise repeat, kept once so the scripts agree.
    `add_request_arguments` declares the flags of the requests (which model, which prompts, how
    to sample them, where to run); `check_request_arguments` checks them before any model
    loads, pins torch's threads and returns the requests' `SamplingParams`; a broken rule is a
    usage error (argparse's `parser.error`, exit status 2) whose message names the flag and the
    rule, e.g. "--threads must be an integer in [1, 2] (got 0)". `check_common_arguments` is
    the part of those checks benchmarks share too (--threads, --seed, --device, --num-prompts,
    each only where the script has the flag). `corpus_prompts` cuts the default prompts from
    the corpus (S07's "chat" workload). Two helpers print tables: `elide`, the one way a long
    table drops its middle rows, and `fit_ids`, a list of request ids cut to a column's width.

What it does not handle
    Engine flags: each chapter adds its own (S08's --max-batch-size, S10's scheduler, ...)
    and checks them itself. Configuration files and environment variables: everything comes
    from the command line. --num-prompts stops at `MAX_NUM_PROMPTS`.

Run it
    Through any Part II script: python code/s08_static_batching.py --help

Tests
    tests/test_s08_cli.py: every rule of `check_common_arguments` and its message, `elide`,
    `fit_ids`; tests/test_cli_help.py: every script's --help gives each flag a help text and
    its default; tests/test_s08_static_batching.py runs S08's main through these checks.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06

# The most corpus prompts one run may ask for. The chapter scripts print every request and
# show no progress while a batch runs; a run larger than this needs progress output (and a
# benchmark's summary instead of every completion), which they do not have: S07's harness and
# the benchmarks are the tools for that.
MAX_NUM_PROMPTS = 4096


# ---------------------------------------------------------------------------------------------
# The flags
# ---------------------------------------------------------------------------------------------

def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line every Part II script keeps (S08 on): which model, which requests, how to
    sample them, where to run. Each chapter adds its own engine flags beside these."""
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory or hub id (default: the bundled model)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt; repeat the flag for more, each one a request (default: "
                             "--num-prompts prompts cut from the corpus)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="corpus prompts when no --prompt is given, at most %d "
                             "(default: %%(default)s)" % MAX_NUM_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=40,
                        help="most tokens to generate per request (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of every request's sampling, and of which corpus prompts "
                             "are drawn when no --prompt is given (default: %(default)s)")
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default=None, choices=list(s06.DTYPES),
                        help="parameter and cache dtype (default: bfloat16 on CUDA, float32 on "
                             "the CPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 1 to the logical cores (%d) (default: "
                             "%%(default)s, as S06)" % (os.cpu_count() or 1))


def check_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules of the flags Part II's scripts and benchmarks share, each checked only when
    `args` has that flag (and, for --device, when it is given): --threads in [1, the logical
    cores] (torch fails on 0 or a negative count, and crashes on a huge one), --seed >= 0,
    --device "cpu", "cuda" or "cuda:N" naming a CUDA device torch finds (S06's rule),
    --num-prompts in [1, MAX_NUM_PROMPTS]. A broken rule is `parser.error` (exit status 2)
    naming the flag and the rule, before any model loads. Pins nothing."""
    cores = os.cpu_count() or 1
    threads = getattr(args, "threads", None)
    if threads is not None and not 1 <= threads <= cores:
        parser.error(f"--threads must be an integer in [1, {cores}] (got {threads})")
    seed = getattr(args, "seed", None)
    if seed is not None and seed < 0:
        parser.error(f"--seed must be an integer >= 0 (got {seed})")
    device = getattr(args, "device", None)
    if device is not None:
        try:   # S06's rule and message ("device must be ..."), named by its flag
            s06.resolve_device_dtype(device)
        except ValueError as err:
            parser.error(f"--{err}")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            parser.error(f"--device {device} names CUDA device {index}, and torch finds "
                         f"{torch.cuda.device_count()} (cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1})")
    num_prompts = getattr(args, "num_prompts", None)
    if num_prompts is not None and not 1 <= num_prompts <= MAX_NUM_PROMPTS:
        parser.error(f"--num-prompts must be an integer in [1, {MAX_NUM_PROMPTS}] "
                     f"(got {num_prompts})")


def check_request_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace
                            ) -> s04.SamplingParams:
    """Check the flags of `add_request_arguments` before any model loads (parser.error, exit 2,
    on a broken rule), pin torch's threads, and return the requests' SamplingParams."""
    check_common_arguments(parser, args)
    try:
        for prompt in args.prompt or []:
            s01.check_text(prompt, "--prompt")
            if not prompt:
                parser.error("--prompt must be a non-empty string")
        params = s04.SamplingParams(temperature=args.temperature, seed=args.seed,
                                    max_tokens=args.max_tokens)
    except ValueError as err:
        parser.error(str(err))
    bundled = s03.BUNDLED_MODEL_DIR
    if Path(args.model) == bundled and not (bundled / "config.json").exists():
        parser.error(f"the bundled model is not in {bundled} yet: train it with "
                     "python scripts/train_bundled_model.py, or pass --model DIR")
    torch.set_num_threads(args.threads)
    return params


def corpus_prompts(tokenizer, num_prompts: int, seed: int, max_context: int) -> list[str]:
    """num_prompts prompts cut from the corpus (S07's "chat" workload: 8 to 32 tokens)."""
    import s07_workloads
    workload = s07_workloads.make_workload("chat", tokenizer, num_prompts, seed, max_context)
    return [r.prompt for r in workload.requests]


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def elide(rows: list, max_rows: int) -> list:
    """The rows a table shows: all of them when there are at most max_rows, else the first
    max_rows // 2, None (where the table says rows were left out), and the last max_rows // 2.
    Raises ValueError for max_rows that is not an integer >= 2."""
    if not s01.is_int(max_rows) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2 (got {max_rows!r}): the table "
                         "shows the first and the last steps")
    rows = list(rows)
    if len(rows) <= max_rows:
        return rows
    half = max_rows // 2
    return rows[:half] + [None] + rows[-half:]


def render_table(header: str, rows: Sequence, render: Callable, max_rows: int = 40) -> str:
    """A table of steps as text: the header, then render(row) for each row `elide` keeps and,
    where it left rows out, a line saying how many; trailing spaces stripped. Raises
    ValueError for max_rows that is not an integer >= 2."""
    rows = list(rows)
    lines = [header]
    for row in elide(rows, max_rows):
        lines.append(f"{'…':>5} {len(rows) - 2 * (max_rows // 2)} steps not shown"
                     if row is None else render(row))
    return "\n".join(line.rstrip() for line in lines)


def fit_ids(ids: Sequence[str], width: int) -> str:
    """ids comma-separated, or, when that is wider than width, their count and the first
    ones that fit, cut with "…": "12: 0,1,2,…" (never wider than a width >= 8)."""
    text = ",".join(ids)
    if len(text) <= width:
        return text
    head, shown = f"{len(ids)}: ", []
    for rid in ids:
        if len(head + ",".join([*shown, rid]) + ",…") > width:
            break
        shown.append(rid)
    return head + ",".join(shown) + (",…" if shown else "…")


# ---------------------------------------------------------------------------------------------
# The chapter scripts of S09 on: requests arriving at a step engine
# ---------------------------------------------------------------------------------------------

def describe_arrivals(every: int) -> str:
    """The arrival schedule of `run_every_n_steps` in words, for the scripts' header."""
    words = {0: "all at once", 1: "one before each step"}.get(every, f"one every {every} steps")
    return words if every <= 1 else words + " (sooner when the engine is idle)"


def priority_list(text: str) -> list[int]:
    """--priorities' type: "1,0,1" -> [1, 0, 1]; argparse's usage error otherwise."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--priorities needs comma-separated integers, one per request (got {text!r})"
        ) from None


@dataclass
class ArrivalRun:
    """What `run_every_n_steps` saw: ids in arrival order; texts (deltas), tokens made and
    finish reasons by id; requests, the engine's `Request` of each id; tokens made; wall
    seconds."""

    ids: list[str] = field(default_factory=list)
    texts: dict[str, list[str]] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    made: int = 0
    wall_s: float = 0.0


def run_every_n_steps(engine, prompts: Sequence, params, priorities: Sequence[int],
                      arrival_every: int) -> ArrivalRun:
    """Add one prompt every arrival_every calls of `engine.step` (0: all before the first
    step) and step until everything has finished. An engine with nothing to do gets the next
    request at once rather than a step that computes nothing, so every `step` call runs a
    batch and the trace's step numbers count the calls. Every request is made, and so
    checked, before the first step (`engine.make_request`), so a bad prompt stops the run
    before anything runs; each is queued when it arrives (`engine.queue`)."""
    made = [engine.make_request(prompt, params, priority=priority)
            for prompt, priority in zip(prompts, priorities)]
    run, calls, start = ArrivalRun(), 0, time.perf_counter()
    while len(run.ids) < len(prompts) or engine.has_unfinished_requests():
        due = calls >= len(run.ids) * arrival_every or not engine.has_unfinished_requests()
        if len(run.ids) < len(prompts) and due:
            request = made[len(run.ids)]
            run.ids.append(engine.queue(request))
            run.requests[request.request_id] = request
            continue
        calls += 1
        for out in engine.step():
            run.texts.setdefault(out.request_id, []).append(out.text_delta)
            run.made += len(out.new_token_ids)
            run.num_tokens[out.request_id] = (run.num_tokens.get(out.request_id, 0)
                                              + len(out.new_token_ids))
            if out.finished:
                run.reasons[out.request_id] = out.finish_reason
    run.wall_s = time.perf_counter() - start
    return run


def add_engine_arguments(parser: argparse.ArgumentParser, default_arrival_every: int = 1
                         ) -> None:
    """The step engine's flags (S09 on): arrivals, seats, context, attention, exact mode."""
    parser.add_argument("--arrival-every", type=int, default=default_arrival_every,
                        help="steps between two arrivals (sooner when the engine is idle); "
                             "0 = all at once (default: "
                             "%(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="most requests running at once (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the longest context a request may reach, at most the model's "
                             "window (default: that window, at most 4096)")
    parser.add_argument("--attention", default="masked", choices=("masked", "loop"),
                        help="attention over the ragged batch in the fast mode (default: "
                             "%(default)s)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every request alone with S06's shapes: slow, bitwise "
                             "equal to each request run alone")


@dataclass
class Chapter:
    """What a chapter script of S09 on adds to `chapter_main`: its description; its
    `build_engine`; add_arguments(parser), its engine flags beside the request and engine
    flags; options(args) -> build_engine's keyword arguments for them; tracers(engine) -> the
    observers to attach (S09's `StepTracer` first); describe(engine, tracers) -> the header's
    words on the engine; note(rid, run, tracers) -> words on one request (or None); table(run,
    tracers) -> the trace as text; check(parser, args), extra flag rules (or None);
    prompts(tokenizer, prompts, args) -> the prompts to run (or None: as given or drawn);
    arrival_every: the default of --arrival-every."""

    description: str
    build_engine: Callable
    add_arguments: Callable
    options: Callable
    tracers: Callable
    describe: Callable
    table: Callable
    note: Callable | None = None
    check: Callable | None = None
    prompts: Callable | None = None
    arrival_every: int = 1


def chapter_main(chapter: Chapter, argv: Sequence[str] | None = None) -> None:
    """The one main of the S09-S13 scripts: parse and check the flags (usage errors before
    any model loads), load the model and the prompts, build the chapter's engine, attach its
    tracers, run the requests as they arrive, then print each request, a summary and the
    chapter's table. A rule an engine's config breaks is a usage error too (its message)."""
    parser = argparse.ArgumentParser(description=chapter.description)
    add_request_arguments(parser)
    add_engine_arguments(parser, chapter.arrival_every)
    chapter.add_arguments(parser)
    args = parser.parse_args(argv)
    params = check_request_arguments(parser, args)
    if args.arrival_every < 0:
        parser.error(f"--arrival-every must be >= 0 (got {args.arrival_every})")
    if chapter.check is not None:
        chapter.check(parser, args)
    try:
        model, tokenizer = s06.load(args.model, args.device, args.dtype)
        window = model.config.max_position_embeddings
        max_context = min(window, 4096) if args.max_context is None else args.max_context
        prompts = args.prompt or corpus_prompts(tokenizer, args.num_prompts, args.seed,
                                                min(window, 4096))
        if chapter.prompts is not None:
            prompts = chapter.prompts(tokenizer, prompts, args)
        priorities = getattr(args, "priorities", None) or [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"--priorities needs one value per request ({len(prompts)})")
        engine = chapter.build_engine(
            model, tokenizer, max_context=max_context, max_num_seqs=args.max_num_seqs,
            batch_invariant=args.batch_invariant, attention=args.attention,
            **chapter.options(args))
        tracers = chapter.tracers(engine)
        engine.observers.extend(tracers)
        run = run_every_n_steps(engine, prompts, params, priorities, args.arrival_every)
    except ValueError as err:
        parser.error(str(err))
    cfg = model.config
    print(f"{cfg.model_type}, {s03.parameter_count(cfg):,} parameters on {model.device}; "
          f"{len(prompts)} requests, {describe_arrivals(args.arrival_every)}, at most "
          f"{args.max_num_seqs} running, context {max_context}; "
          f"{chapter.describe(engine, tracers)}")
    for rid, prompt in zip(run.ids, prompts):
        note = chapter.note(rid, run, tracers) if chapter.note else None
        print(f"\n--- request {rid}: prompt ({len(tokenizer.encode(prompt))} tokens)"
              f"{', ' + note if note else ''} ---\n{prompt}\n--- completion "
              f"({run.num_tokens.get(rid, 0)} tokens, finish_reason={run.reasons[rid]}) ---\n"
              f"{''.join(run.texts.get(rid, []))}")
    steps = tracers[0].records
    print(f"\n--- {run.made} tokens in {len(steps)} steps, {run.wall_s:.2f} s "
          f"({run.made / run.wall_s:.0f} tokens/s, first call: one-off costs included) ---")
    print(chapter.table(run, tracers))
