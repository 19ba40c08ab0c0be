"""S11's measurement: a long prompt arrives while other requests decode. How long do the running
requests wait between tokens (ITL), how long does the long one wait for its first token (TTFT),
and what does it cost in throughput, against the chunk size, with chunking off as the baseline.

    python benchmarks/bench_s11_chunked_prefill.py --quick     # 10 to 15 s on 2 cores
    python benchmarks/bench_s11_chunked_prefill.py             # the chapter's figure's data

A benchmark, not a test: it prints, never asserts speed. What runs (float32, the CPU unless
--device cuda, torch threads pinned by --threads, default 1):
  The model: random weights (transformers' own initialisation) in a mid-size Qwen3 layout,
  MID_SHAPE below (hidden 512, 8 layers, 8 query / 4 key-value heads, 2048 positions, about
  29M parameters): the bundled model's window (256) is too short for a long prompt, and
  Qwen3-0.6B's shape is too slow on a shared CPU. SDPA attention. Only the shape matters: the
  tokens are random ids, greedy, EOS never ends a request.
  The workload, the same tokens for every engine (arrivals counted in steps, not seconds, so
  the schedule is deterministic): --running requests of 32-token prompts, --decode-tokens
  output tokens each, start together; after --arrive-after steps (all of them decoding by
  then) one request of a --long-prompt-token prompt arrives, wanting --long-tokens tokens.
  max_num_seqs = running + 1, so nobody waits for a seat.
  Engines: chunking off (S10's `build_engine`, whose default budget holds the whole prompt:
  the long prompt runs in one step beside the decodes) and S11's `build_engine` at each
  --budgets value of max_num_batched_tokens (the chunk is what the decodes leave of it).
  Each repeat runs every engine once, in a rotating order (so a change of load on the
  shared machine falls on all of them); per engine the median over repeats of each figure
  is reported.
  Reported per run, from the time each token reached the caller (step() returned it): over
  every gap between two tokens of a running request, ITL p50 / mean / max (the max is the
  stall), the number of gaps and how many were slow (longer than SLOW_FACTOR x that run's
  p50: the gaps whose steps carried a long chunk or the whole prompt); TTFT of the long
  request (from add_request to its first token), output tokens/s and all tokens/s (prompt +
  output) over the run, steps (the scheduler's count), and the steps that carried a piece
  of the long prompt (those whose step moved its num_computed_tokens, up to its first
  token). No tracer is attached: everything is read from the outputs and from the
  scheduler's and the requests' public state, so the timed steps carry nothing extra. The
  JSON keeps ITL p99 too, but it is not a tail figure here: with about 380 gaps and a
  handful of stalls, S07's interpolated p99 falls between the largest normal gap and the
  stall, and moves with the number of gaps.

Flags are checked before any model is built (a usage error, exit status 2, naming the
rule): --threads, --seed and --device as every Part II script
(`s08_cli.check_common_arguments`), every count in the range its help gives; a count past
its bound is refused, not run.

The CPU is shared with other jobs: `uptime` is printed before and after, and each run's
1-minute load average is kept; compare rows of one run. Writes its figures as JSON to --json
(default a scratch file in the system's temp directory); scripts/s11_figure.py draws
chapters/figures/s11_chunked_prefill.png from chapters/figures/s11_chunked_prefill.json.
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
import s10_scheduler as s10  # noqa: E402
import s11_chunked_prefill as s11  # noqa: E402
from bench_s06_torch import IdTokenizer, random_qwen3  # noqa: E402
from bench_s10_scheduler import check_json, int_list, uptime, write_json  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s11_chunked_prefill.json"
# A mid-size Qwen3 layout (Qwen3-0.6B's proportions, narrower and shallower), long context.
MID_SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=8192, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
)
SHORT_PROMPT_TOKENS = 32
OFF = "off"
SLOW_FACTOR = 2       # a gap longer than this x the run's median gap is slow
MAX_RUNNING = 64
MAX_REPEATS = 20
MAX_BUDGETS = 16


def dist_ms(values) -> dict:
    values = list(values)
    d = s07.Distribution.of(values)
    return {"p50_ms": d.p50 * 1e3, "p99_ms": d.p99 * 1e3, "mean_ms": d.mean * 1e3,
            "max_ms": max(values) * 1e3, "num_gaps": len(values),
            "slow_gaps": sum(v > SLOW_FACTOR * d.p50 for v in values)}


def make_engine(model, tokenizer, budget, args):
    """Chunking off: S10's engine (its default budget holds every prompt whole). Else S11's
    with max_num_batched_tokens = budget."""
    shape = dict(max_context=MID_SHAPE["max_position_embeddings"], max_num_seqs=args.running + 1)
    if budget == OFF:
        return s10.build_engine(model, tokenizer, **shape)
    return s11.build_engine(model, tokenizer, max_num_batched_tokens=budget, **shape)


def one_run(model, tokenizer, prompts, long_prompt, budget, args) -> dict:
    engine = make_engine(model, tokenizer, budget, args)
    warm = s04.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(prompts[0], warm)              # one-off costs outside the run
    while engine.has_unfinished_requests():
        engine.step()
    steps_before = engine.scheduler.num_steps
    short = s04.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    long = s04.SamplingParams(temperature=0.0, max_tokens=args.long_tokens, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    s06.synchronize(model.device)
    start = time.perf_counter()
    running = [engine.add_request(p, short) for p in prompts]
    long_id, long_added, calls, prefill_steps = None, None, 0, 0
    while long_id is None or engine.has_unfinished_requests():
        if calls == args.arrive_after:
            long_added = time.perf_counter()
            long_id = engine.add_request(long_prompt, long)
        long_request = engine.requests.get(long_id)
        computed = long_request.num_computed_tokens if long_request else None
        outputs = engine.step()
        calls += 1
        now = time.perf_counter()
        if long_request is not None and long_id not in stamps:   # its prompt still going in
            prefill_steps += long_request.num_computed_tokens > computed   # scheduled
        for o in outputs:
            if o.new_token_ids:
                stamps.setdefault(o.request_id, []).append(now)
    wall_s = time.perf_counter() - start
    gaps = [b - a for rid in running for a, b in zip(stamps[rid], stamps[rid][1:])]
    out_tokens = sum(len(v) for v in stamps.values())
    prompt_tokens = len(prompts) * SHORT_PROMPT_TOKENS + args.long_prompt_tokens
    return {"budget": budget, "itl": dist_ms(gaps),
            "ttft_long_ms": (stamps[long_id][0] - long_added) * 1e3,
            "output_tokens_per_s": out_tokens / wall_s,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / wall_s,
            "wall_s": wall_s, "output_tokens": out_tokens,
            "steps": engine.scheduler.num_steps - steps_before,
            "long_prefill_steps": prefill_steps, "load_average_1min": os.getloadavg()[0]}


def summarise(runs: list[dict]) -> dict:
    """The median over repeats of every figure of one engine."""
    med = statistics.median
    return {"budget": runs[0]["budget"], "repeats": len(runs),
            "itl": {k: med(r["itl"][k] for r in runs) for k in runs[0]["itl"]},
            "ttft_long_ms": med(r["ttft_long_ms"] for r in runs),
            "output_tokens_per_s": med(r["output_tokens_per_s"] for r in runs),
            "total_tokens_per_s": med(r["total_tokens_per_s"] for r in runs),
            "itl_max_ms_of_repeats": [r["itl"]["max_ms"] for r in runs],
            "output_tokens_per_s_of_repeats": [r["output_tokens_per_s"] for r in runs],
            "steps": runs[0]["steps"], "long_prefill_steps": runs[0]["long_prefill_steps"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="S11 benchmark: ITL of running requests and "
                                     "TTFT of a long prompt against the chunk size.")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter long prompt, fewer budgets, one repeat (10 to 15 s "
                             "on 2 cores)")
    context = MID_SHAPE["max_position_embeddings"]
    parser.add_argument("--running", type=int, default=4,
                        help=f"requests decoding when the long prompt arrives, 1 to "
                             f"{MAX_RUNNING} (default: %(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help=f"output tokens of each running request, 1 to "
                             f"{context - SHORT_PROMPT_TOKENS} (default: 96, --quick 48)")
    parser.add_argument("--long-prompt-tokens", type=int, default=None,
                        help=f"tokens of the long prompt, 1 to the context ({context}) less "
                             "--long-tokens (default: 1536, --quick 768)")
    parser.add_argument("--long-tokens", type=int, default=16,
                        help=f"output tokens of the long request, 1 to {context - 1} (default: "
                             "%(default)s)")
    parser.add_argument("--arrive-after", type=int, default=8,
                        help="steps before the long prompt arrives, 1 to --decode-tokens (the "
                             "running requests still decode) (default: %(default)s)")
    parser.add_argument("--budgets", type=int_list, default=None,
                        help=f"max_num_batched_tokens values of the chunked runs, comma-"
                             f"separated, at most {MAX_BUDGETS}, each from max_num_seqs "
                             f"(--running + 1) to the context ({context}) (default: "
                             "32,64,128,256,512, --quick 64,256)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs of each engine, alternating; medians reported, 1 to "
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
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    if args.decode_tokens is None:
        args.decode_tokens = 48 if args.quick else 96
    if args.long_prompt_tokens is None:
        args.long_prompt_tokens = 768 if args.quick else 1536
    if args.budgets is None:
        args.budgets = [64, 256] if args.quick else [32, 64, 128, 256, 512]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    check = s07.check_count
    check(parser, "--running", args.running, 1, MAX_RUNNING)
    check(parser, "--decode-tokens", args.decode_tokens, 1, context - SHORT_PROMPT_TOKENS)
    check(parser, "--long-tokens", args.long_tokens, 1, context - 1)
    check(parser, "--long-prompt-tokens", args.long_prompt_tokens, 1,
          context - args.long_tokens)
    check(parser, "--arrive-after", args.arrive_after, 1, args.decode_tokens)
    check(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    if not 1 <= len(args.budgets) <= MAX_BUDGETS:
        parser.error(f"--budgets must list 1 to {MAX_BUDGETS} values (got {len(args.budgets)})")
    for budget in args.budgets:
        check(parser, "--budgets: each budget", budget, args.running + 1, context)
    check_json(parser, args.json)
    torch.set_num_threads(args.threads)
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}")
    build = time.perf_counter()
    hf = random_qwen3(MID_SHAPE, args.seed)
    config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
    model = s06.TorchTransformer(config, hf.state_dict(), args.device, torch.float32, "sdpa")
    del hf
    tokenizer = IdTokenizer(MID_SHAPE["vocab_size"])
    rng = np.random.default_rng(args.seed)
    def as_text(n: int) -> str:
        return " ".join(map(str, rng.integers(1, MID_SHAPE["vocab_size"], size=n)))

    prompts = [as_text(SHORT_PROMPT_TOKENS) for _ in range(args.running)]
    long_prompt = as_text(args.long_prompt_tokens)
    print(f"mid-size Qwen3 layout, random weights, {s03.parameter_count(config) / 1e6:.0f}M "
          f"parameters (built in {time.perf_counter() - build:.0f} s), context {context}\n"
          f"{args.running} requests of {SHORT_PROMPT_TOKENS}-token prompts decode "
          f"{args.decode_tokens} tokens each; after {args.arrive_after} steps a "
          f"{args.long_prompt_tokens}-token prompt arrives ({args.long_tokens} tokens); "
          f"{args.repeats} repeat(s), alternating, medians shown")
    budgets = [OFF] + args.budgets
    results: dict = {b: [] for b in budgets}
    for repeat in range(args.repeats):
        order = budgets[repeat % len(budgets):] + budgets[:repeat % len(budgets)]
        for budget in order:
            results[budget].append(one_run(model, tokenizer, prompts, long_prompt, budget,
                                           args))
    summary = [summarise(results[b]) for b in budgets]
    base = summary[0]
    print(f"\n{'budget':>7} {'ITL p50':>8} {'max':>8} {'slow':>9} {'TTFT long':>10} "
          f"{'out tok/s':>9} {'all tok/s':>9} {'max vs off':>10} {'tok/s vs off':>12}   (ms; "
          f"slow: gaps > {SLOW_FACTOR} x p50, of all)")
    for s in summary:
        slow = f"{s['itl']['slow_gaps']:g}/{s['itl']['num_gaps']:g}"
        print(f"{str(s['budget']):>7} {s['itl']['p50_ms']:>8.1f} {s['itl']['max_ms']:>8.1f} "
              f"{slow:>9} {s['ttft_long_ms']:>10.0f} "
              f"{s['output_tokens_per_s']:>9.1f} {s['total_tokens_per_s']:>9.0f} "
              f"{base['itl']['max_ms'] / s['itl']['max_ms']:>9.1f}x "
              f"{s['output_tokens_per_s'] / base['output_tokens_per_s'] - 1:>+11.1%}")
    after = uptime()
    print(f"\nafter: {after}")
    figures = {"config": {"shape": MID_SHAPE, "parameters": s03.parameter_count(config),
                          "attention": "sdpa", "running": args.running,
                          "short_prompt_tokens": SHORT_PROMPT_TOKENS,
                          "decode_tokens": args.decode_tokens,
                          "long_prompt_tokens": args.long_prompt_tokens,
                          "long_tokens": args.long_tokens, "arrive_after": args.arrive_after,
                          "budgets": args.budgets, "repeats": args.repeats, "seed": args.seed,
                          "slow_factor": SLOW_FACTOR,
                          "device": args.device, "threads": args.threads, "quick": args.quick,
                          "torch": torch.__version__},
               "summary": summary, "runs": [r for b in budgets for r in results[b]],
               "uptime_before": before, "uptime_after": after}
    write_json(args.json, figures)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
