"""S13's measurement: what a cached prefix saves. TTFT and prefill tokens computed against the
fraction of the prompt that is already cached, prefix cache on against off, in one run.

    python benchmarks/bench_s13_prefix_caching.py --quick    # a smoke run, under a minute
    python benchmarks/bench_s13_prefix_caching.py --out      # the chapter's figure's data

A benchmark, not a test: it prints, never asserts speed. What runs (float32, the CPU unless
--device cuda, torch threads pinned by --threads, default 1):
  The model: S11's benchmark model, random weights in a mid-size Qwen3 layout (MID_SHAPE of
  benchmarks/bench_s11_chunked_prefill.py: hidden 512, 8 layers, 2048 positions, about 29M
  parameters; the bundled model's window, 256, is too short), SDPA attention. Random token
  ids, greedy, EOS never ends a request.
  1. A shared system prompt. For each --fractions value f: a prompt of --prompt-tokens
     tokens whose first round(f x prompt-tokens) tokens are a prefix another request has just
     used. A fresh S13 engine (`build_engine`: block_size 16, 2 seats, a budget that holds
     the whole prompt) runs the other request (prefix + its own suffix, 1 token), then the
     measured one (the prefix + a different suffix, 1 token): TTFT from add_request to the
     step that returns its token, and the prompt tokens it computed (from S09's
     `StepTracer`: its scheduled tokens up to the step it sampled; the rest were found
     cached, `RequestOutput.num_cached_tokens`: a whole number of blocks, so f x P rounded
     down to a multiple of 16).
  2. A multi-turn chat. One engine per mode keeps the conversation: turn t's prompt is turn
     t - 1's prompt, its answer (--answer-tokens generated tokens) and a new user message
     (--user-tokens); the first turn starts with a --system-tokens system prompt. TTFT and
     computed tokens per turn; the shared fraction of turn t is what it found cached.
  Cache off is the same engine with enable_prefix_caching=False (S12's engine). A warm-up
  run of each mode comes first and is not kept; then each repeat runs on and off in
  alternating order, and medians over repeats are reported; the speedup (TTFT off / on) is
  the median of each repeat's own ratio. The hit rate is the cache-on
  engines' PrefixCacheStats over every request they ran, the requests that filled the cache
  included (hits / queries, in tokens and in requests): the manager's `stats`
  (`engine.scheduler.kv.stats`). S13's `CacheTracer` is not attached: it snapshots the
  whole free queue every step, which would land inside the measured TTFT; S09's
  `StepTracer` (a few small tuples a step) is, as the engine's own trace was before.

--quick is a smoke run (it checks that everything runs): 512-token prompts, one repeat. Its
speedups are not the chapter's, which come from 1024-token prompts and --repeats 5: at 90%
shared it finds 448 tokens cached and computes 64 of 512 (the chapter's: 912 and 112 of
1024), and one repeat on a shared CPU is noisy (a --quick run at load average 7 gave 4.2x
there; the committed JSON has 6.4x).

Flags are checked before any model is built (a usage error, exit status 2, naming the
rule): --threads, --seed and --device as every Part II script
(`s08_cli.check_common_arguments`), every count in the range its help gives; a count past
its bound is refused, not run.

The CPU is shared: `uptime` is recorded before and after and each run's 1-minute load
average kept; compare rows of one run. Writes JSON to --json (default a scratch file in the
temp directory) or, with --out, to chapters/figures/s13_prefix_caching.json, which
scripts/s13_figure.py draws.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402
import s13_prefix_caching as s13  # noqa: E402
from bench_s06_torch import IdTokenizer, random_qwen3  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402
from bench_s11_chunked_prefill import MID_SHAPE  # noqa: E402
from s09_trace import trace  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s13_prefix_caching.json"
COMMITTED_JSON = ROOT / "chapters" / "figures" / "s13_prefix_caching.json"
BLOCK_SIZE = 16
MODES = ("on", "off")
MAX_PROMPT_TOKENS = MID_SHAPE["max_position_embeddings"] - 1   # and one token of output
MAX_FRACTIONS = 16
MAX_TURNS = 64
MAX_REPEATS = 20


def make_engine(model, tokenizer, on: bool):
    """S13's engine, the prefix cache on or off (off: S12's manager, S12's engine exactly),
    with S09's `StepTracer` attached (for the tokens each request computed)."""
    engine = s13.build_engine(model, tokenizer, max_context=MID_SHAPE["max_position_embeddings"],
                              max_num_seqs=2, block_size=BLOCK_SIZE, enable_prefix_caching=on)
    return engine, trace(engine)


def cache_stats(engine) -> dict | None:
    """The prefix cache's counts so far (`PrefixCacheStats`), None when the cache is off."""
    stats = getattr(engine.scheduler.kv, "stats", None)
    return None if stats is None else vars(stats).copy()


def first_token(engine, tracer, ids: list[int], params) -> tuple[float, int, int, list]:
    """Run one request alone to its end: (TTFT s, prompt tokens it computed before its first
    token, tokens found cached, its output ids)."""
    s06.synchronize(engine.model.device)
    start = time.perf_counter()
    rid = engine.add_request(" ".join(map(str, ids)), params)
    steps_before, ttft, out, cached = len(tracer.records), None, [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            out.extend(o.new_token_ids)
            if o.request_id == rid and cached is None:
                cached = o.num_cached_tokens
    steps = tracer.records[steps_before:]
    first = next(k for k, r in enumerate(steps) if rid in r.sampled)
    computed = sum(r.num_scheduled_tokens[r.running.index(rid)] for r in steps[:first + 1]
                   if rid in r.running)
    return ttft, computed, cached, out


def system_prompt_run(model, tokenizer, prefix, suffixes, on: bool) -> dict:
    engine, tracer = make_engine(model, tokenizer, on)
    one = s04.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first_token(engine, tracer, prefix + suffixes[0], one)      # the request that caches it
    ttft, computed, cached, _ = first_token(engine, tracer, prefix + suffixes[1], one)
    return {"ttft_ms": ttft * 1e3, "computed_tokens": computed, "cached_tokens": cached,
            "stats": cache_stats(engine), "load_average_1min": os.getloadavg()[0]}


def chat_run(model, tokenizer, system, users, answer_tokens, on: bool
             ) -> tuple[list[dict], dict | None]:
    engine, tracer = make_engine(model, tokenizer, on)
    params = s04.SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    history, turns = list(system), []
    for user in users:
        prompt = history + user
        ttft, computed, cached, answer = first_token(engine, tracer, prompt, params)
        turns.append({"prompt_tokens": len(prompt), "ttft_ms": ttft * 1e3,
                      "computed_tokens": computed, "cached_tokens": cached})
        history = prompt + answer
    return turns, cache_stats(engine)


def fraction_list(text: str) -> list[float]:
    """--fractions' type: comma-separated numbers in [0, 1) ("0,0.5" -> [0.0, 0.5]);
    argparse's usage error otherwise (the measured prompt has a suffix of its own)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= f < 1 for f in values):      # nan and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be comma-separated fractions in [0, 1) (got {text!r}): the measured prompt "
            "has a suffix of its own")
    return values


def med_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def paired(row: dict) -> dict:
    """The speedup off / on of each repeat (its on and off ran one after the other, so a
    change of load on the shared machine falls on both), and their median: steadier than the
    ratio of the two medians when the load drifts between repeats."""
    ratios = [b / a for a, b in zip(row["ttft_ms_of_repeats"]["on"],
                                    row["ttft_ms_of_repeats"]["off"])]
    return {"speedup_of_repeats": ratios, "speedup": statistics.median(ratios)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="S13 benchmark: TTFT and prefill tokens "
                                     "against the cached fraction of the prompt, prefix "
                                     "cache on and off.")
    context = MID_SHAPE["max_position_embeddings"]
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run, not the chapter's figures: shorter prompts, three "
                             "fractions, two chat turns, one repeat")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help=f"tokens of the system-prompt workload's prompts, 1 to "
                             f"{MAX_PROMPT_TOKENS} (default: 1024, --quick 512)")
    parser.add_argument("--fractions", type=fraction_list, default=None,
                        help=f"shared fractions, each in [0, 1), comma-separated, at most "
                             f"{MAX_FRACTIONS} (default: 0,0.25,0.5,0.75,0.9, --quick "
                             "0,0.5,0.9)")
    parser.add_argument("--system-tokens", type=int, default=256,
                        help="the chat's system prompt, >= 0 (default: %(default)s)")
    parser.add_argument("--user-tokens", type=int, default=96,
                        help="tokens of each user message, >= 1 (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=32,
                        help="tokens of each answer, >= 1 (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=None,
                        help=f"chat turns, 1 to {MAX_TURNS}; the whole chat (system prompt + "
                             f"turns x (user + answer tokens)) fits the context ({context}) "
                             "(default: 6, --quick 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs of each mode, alternating; medians reported, 1 to "
                             f"{MAX_REPEATS} (default: 3, --quick 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model and prompt seed, >= 0 (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--json", default=str(DEFAULT_JSON),
                        help="where to write the figures (default: %(default)s)")
    parser.add_argument("--out", action="store_true",
                        help=f"write {COMMITTED_JSON.relative_to(ROOT)} instead (default: off)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    if args.prompt_tokens is None:
        args.prompt_tokens = 512 if args.quick else 1024
    if args.fractions is None:
        args.fractions = [0, 0.5, 0.9] if args.quick else [0, 0.25, 0.5, 0.75, 0.9]
    if args.turns is None:
        args.turns = 2 if args.quick else 6
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    check = s07.check_count
    check(parser, "--prompt-tokens", args.prompt_tokens, 1, MAX_PROMPT_TOKENS)
    check(parser, "--turns", args.turns, 1, MAX_TURNS)
    check(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    check(parser, "--system-tokens", args.system_tokens, 0, context)
    check(parser, "--user-tokens", args.user_tokens, 1, context)
    check(parser, "--answer-tokens", args.answer_tokens, 1, context)
    if len(args.fractions) > MAX_FRACTIONS:
        parser.error(f"--fractions must list at most {MAX_FRACTIONS} values (got "
                     f"{len(args.fractions)})")
    if any(round(f * args.prompt_tokens) >= args.prompt_tokens for f in args.fractions):
        parser.error(f"every fraction of --prompt-tokens ({args.prompt_tokens}) must leave a "
                     "suffix of at least one token: the measured prompt has one of its own")
    chat_len = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    if chat_len > context:
        parser.error(f"the chat ({chat_len} tokens: --system-tokens + --turns x "
                     f"(--user-tokens + --answer-tokens)) must fit the context ({context})")
    if not args.out:
        check_json(parser, args.json)
    torch.set_num_threads(args.threads)
    smoke = ("--quick: a smoke run; its ratios are not the chapter's (those: 1024-token "
             "prompts, --repeats 5, the committed JSON)") if args.quick else None
    if smoke:
        print(smoke)
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}")
    hf = random_qwen3(MID_SHAPE, args.seed)
    config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
    model = s06.TorchTransformer(config, hf.state_dict(), args.device, torch.float32, "sdpa")
    del hf
    tokenizer = IdTokenizer(MID_SHAPE["vocab_size"])
    rng = np.random.default_rng(args.seed)

    def ids(n: int) -> list[int]:
        return rng.integers(1, MID_SHAPE["vocab_size"], size=n).tolist()

    print(f"mid-size Qwen3 layout, random weights, {s03.parameter_count(config) / 1e6:.0f}M "
          f"parameters, context {context}, block_size {BLOCK_SIZE}; {args.repeats} repeat(s), "
          "on and off alternating, medians shown")
    cases = []
    for f in args.fractions:
        shared = round(f * args.prompt_tokens)
        rest = args.prompt_tokens - shared
        cases.append((f, ids(shared), [ids(rest), ids(rest)]))
    system = ids(args.system_tokens)
    users = [ids(args.user_tokens) for _ in range(args.turns)]
    sys_runs = {(f, m): [] for f, _, _ in cases for m in MODES}
    chat_runs = {m: [] for m in MODES}
    stats_on = []
    for m in MODES:                  # one-off costs (first calls, allocations) outside the runs
        system_prompt_run(model, tokenizer, *cases[0][1:], m == "on")
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for f, prefix, suffixes in cases:
            for m in order:
                run = system_prompt_run(model, tokenizer, prefix, suffixes, m == "on")
                sys_runs[(f, m)].append(run)
                if m == "on":
                    stats_on.append(run["stats"])
        for m in order:
            turns, stats = chat_run(model, tokenizer, system, users, args.answer_tokens,
                                    m == "on")
            chat_runs[m].append(turns)
            if m == "on":
                stats_on.append(stats)
    summary = []
    print(f"\nshared system prompt, {args.prompt_tokens}-token prompts")
    print(f"{'shared':>7} {'cached':>7} {'computed on/off':>16} {'TTFT on':>9} {'TTFT off':>9} "
          f"{'off/on':>7}   (ms)")
    for f, prefix, _ in cases:
        on, off = sys_runs[(f, "on")], sys_runs[(f, "off")]
        row = {"fraction": f, "shared_tokens": len(prefix), "prompt_tokens": args.prompt_tokens,
               "cached_tokens": on[0]["cached_tokens"],
               "computed_tokens": {"on": on[0]["computed_tokens"],
                                   "off": off[0]["computed_tokens"]},
               "ttft_ms": {"on": med_of(on, "ttft_ms"), "off": med_of(off, "ttft_ms")},
               "ttft_ms_of_repeats": {"on": [r["ttft_ms"] for r in on],
                                      "off": [r["ttft_ms"] for r in off]}}
        row.update(paired(row))
        summary.append(row)
        print(f"{f:>7.2f} {row['cached_tokens']:>7} "
              f"{row['computed_tokens']['on']:>8}/{row['computed_tokens']['off']:<7} "
              f"{row['ttft_ms']['on']:>9.1f} {row['ttft_ms']['off']:>9.1f} "
              f"{row['speedup']:>6.1f}x")
    chat = []
    print(f"\nmulti-turn chat: {args.system_tokens}-token system prompt, {args.user_tokens}-"
          f"token user messages, {args.answer_tokens}-token answers")
    print(f"{'turn':>5} {'prompt':>7} {'cached':>7} {'shared':>7} {'TTFT on':>9} "
          f"{'TTFT off':>9} {'off/on':>7}")
    for t in range(args.turns):
        on = [runs[t] for runs in chat_runs["on"]]
        off = [runs[t] for runs in chat_runs["off"]]
        row = {"turn": t + 1, "prompt_tokens": on[0]["prompt_tokens"],
               "cached_tokens": on[0]["cached_tokens"],
               "shared_fraction": on[0]["cached_tokens"] / on[0]["prompt_tokens"],
               "computed_tokens": {"on": on[0]["computed_tokens"],
                                   "off": off[0]["computed_tokens"]},
               "ttft_ms": {"on": med_of(on, "ttft_ms"), "off": med_of(off, "ttft_ms")},
               "ttft_ms_of_repeats": {"on": [r["ttft_ms"] for r in on],
                                      "off": [r["ttft_ms"] for r in off]}}
        row.update(paired(row))
        chat.append(row)
        print(f"{t + 1:>5} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
              f"{row['shared_fraction']:>7.2f} {row['ttft_ms']['on']:>9.1f} "
              f"{row['ttft_ms']['off']:>9.1f} {row['speedup']:>6.1f}x")
    hits = sum(s["hits"] for s in stats_on)
    queries = sum(s["queries"] for s in stats_on)
    requests = sum(s["requests"] for s in stats_on)
    hit_requests = sum(s["hit_requests"] for s in stats_on)
    print(f"\nprefix cache hit rate (cache-on engines, every request): {hits}/{queries} tokens "
          f"= {hits / queries:.1%}; {hit_requests}/{requests} requests had a hit")
    after = uptime()
    print(f"after: {after}")
    if smoke:
        print(smoke)
    figures = {"config": {"shape": MID_SHAPE, "parameters": s03.parameter_count(config),
                          "attention": "sdpa", "block_size": BLOCK_SIZE,
                          "prompt_tokens": args.prompt_tokens, "fractions": args.fractions,
                          "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
                          "answer_tokens": args.answer_tokens, "turns": args.turns,
                          "repeats": args.repeats, "seed": args.seed, "device": args.device,
                          "threads": args.threads, "quick": args.quick,
                          "torch": torch.__version__},
               "system_prompt": summary, "chat": chat,
               "hit_rate": {"hits": hits, "queries": queries, "tokens": hits / queries,
                            "requests": requests, "hit_requests": hit_requests},
               "load_average_1min": [r["load_average_1min"] for runs in sys_runs.values()
                                     for r in runs],
               "uptime_before": before, "uptime_after": after}
    path = COMMITTED_JSON if args.out else Path(args.json)
    write_json(path, figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
