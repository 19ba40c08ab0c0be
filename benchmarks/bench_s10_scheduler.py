"""S10's measurements: throughput, TTFT and end-to-end latency against the KV capacity, with the
preemption count, and FCFS against the priority policy with the latency of each class.

    python benchmarks/bench_s10_scheduler.py --quick          # bundled model, a few minutes
    python benchmarks/bench_s10_scheduler.py                  # the chapter's figure's data

A benchmark, not a test: it prints, never asserts speed. What runs (bundled model, float32, the
CPU unless --device cuda, torch threads pinned by --threads, default 1):
  The workload: --num-requests requests of S07's "mixed" workload (corpus prompts of 4 to 192
  tokens, outputs of 4 to 64 tokens, seeded; greedy, EOS ignored, so every run does the same
  tokens), arriving as a Poisson process at --rate requests/s (s09_arrivals, S07's harness:
  TTFT counts from the arrival, so the queueing is in it). A seeded --high-share of them are
  "high" priority (0), the rest "low" (1).
  Engines: S10's engine (`s10_scheduler.build_engine`) with max_num_seqs = --max-num-seqs
  and, for each KV capacity (tokens: the --capacities fractions of max_num_seqs x 256, "fits
  everything" = 1, never below the longest request), both policies: "fcfs" (priorities
  ignored) and "priority" (high first; low-priority requests can wait behind every high
  one: starvation shows in their p99). --repeats runs of each, one after the other; the
  one with the lowest mean end-to-end latency (the least disturbed by other jobs: the
  arrivals fix the tokens/s, see below, so it cannot tell them apart) is kept, and every
  repeat's tokens/s and mean e2e are recorded.
  The offered load bounds the throughput: a run cannot end before its last arrival, so its
  output tokens/s is at most all output tokens / the last arrival time (printed, and in the
  JSON as arrival_bound_tokens_per_s); where the engine keeps up, every capacity and policy
  lands just under it and only the latencies tell them apart. Preemption counts depend on the
  machine's speed too: arrivals are in seconds, so a slower step means more requests running
  at once and more of them preempted.
  Reported per run: output tokens/s over the run, TTFT and e2e p50 / p99 (all, and per
  class, and each class's longest TTFT: its longest wait), preemptions (the scheduler's
  count), recomputed tokens (prompt + outputs of every resumed request, from S09's
  `StepTracer` records: the tokens each resumed request was scheduled in the step it came
  back), steps (the records, one per step that did something).

Flags are checked before any model loads (a usage error, exit status 2, naming the rule):
--threads, --seed and --device as every Part II script (`s08_cli.check_common_arguments`),
every count in the range its help gives; a count past its bound is refused, not run.

The CPU is shared with other jobs: `uptime` is printed before and after; compare rows of one
run. Writes its figures as JSON to --json (default a scratch file in the system's temp
directory); scripts/s10_figure.py draws chapters/figures/s10_scheduler.png from it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_workloads  # noqa: E402
import s08_cli  # noqa: E402
import s09_arrivals  # noqa: E402
import s10_scheduler as s10  # noqa: E402
from s09_trace import trace  # noqa: E402
from s10_scheduler import POLICIES  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s10_scheduler.json"
CLASSES = {"high": 0, "low": 1}
MAX_NUM_SEQS = 256       # the slots' KV: max_num_seqs x 256 positions of the bundled model
MAX_REPEATS = 20
MAX_RATE = 10_000.0      # requests/s


def float_list(low: float, high: float, what: str):
    """An argparse type: comma-separated numbers each in (low, high] ("1,0.5" -> [1.0,
    0.5]); argparse's usage error, naming the rule, otherwise."""
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(low < v <= high for v in values):   # nan and inf fail too
            raise argparse.ArgumentTypeError(
                f"must be comma-separated {what} in ({low:g}, {high:g}] (got {text!r})")
        return values
    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("64,256" -> [64, 256]); argparse's usage
    error otherwise (the caller checks their range, naming its flag)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (got {text!r})"
                                         ) from None


def check_json(parser: argparse.ArgumentParser, path) -> None:
    """--json names a file the figures can be written to (S07's rule), checked before the
    run spends minutes."""
    try:
        s07.check_output_file(path)
    except ValueError as err:
        parser.error(f"--json: {err}")


def write_json(path, figures: dict, indent: int = 2) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=indent) + "\n")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


class PriorityClient:
    """The engine as S07's harness sees it (add_request, step, has_unfinished_requests), with
    the i-th request added at the i-th priority: a client that tags its requests, not a patch."""

    def __init__(self, engine, priorities: list[int]):
        self.engine, self.priorities, self.added = engine, priorities, 0

    def add_request(self, prompt, params):
        priority = self.priorities[self.added]
        self.added += 1
        return self.engine.add_request(prompt, params, priority=priority)

    def step(self):
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()


def dist_ms(values) -> dict:
    values = list(values)
    d = s07.Distribution.of(values)
    return {"p50_ms": d.p50 * 1e3, "p99_ms": d.p99 * 1e3, "mean_ms": d.mean * 1e3,
            "max_ms": max(values) * 1e3}


def one_run(model, tokenizer, workload, arrivals, priorities, capacity, policy, args) -> dict:
    engine = s10.build_engine(model, tokenizer, max_num_seqs=args.max_num_seqs,
                              kv_capacity=capacity, policy=policy)
    warm = s04.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(workload.requests[0].prompt, warm)    # one-off costs outside the run
    while engine.has_unfinished_requests():
        engine.step()
    preempted_before = engine.scheduler.num_preemptions
    tracer = trace(engine)               # the measured run's steps only
    run = s09_arrivals.run_arrivals(PriorityClient(engine, priorities), workload, arrivals,
                                    name=f"s10 {policy}", model="bundled", warmup=False)
    steps = tracer.records
    recomputed = sum(n for r in steps for rid, n in zip(r.running, r.num_scheduled_tokens)
                     if rid in r.resumed)
    classes = {}
    for name, value in CLASSES.items():
        mine = [r for r, p in zip(run.requests, priorities) if p == value]
        if mine:
            classes[name] = {"requests": len(mine),
                             "ttft": dist_ms(r.ttft_s for r in mine),
                             "e2e": dist_ms(r.e2e_s for r in mine)}
    return {"policy": policy, "kv_capacity": capacity,
            "tokens_per_s": run.output_tokens_per_s, "wall_s": run.wall_s,
            "output_tokens": sum(r.output_tokens for r in run.requests),
            "ttft": dist_ms(r.ttft_s for r in run.requests),
            "e2e": dist_ms(r.e2e_s for r in run.requests),
            "preemptions": engine.scheduler.num_preemptions - preempted_before,
            "recomputed_tokens": recomputed, "steps": len(steps), "classes": classes,
            "load_average_1min": run.load_average_1min}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="S10 benchmark: KV capacity, preemption "
                                     "and the scheduling policy under Poisson arrivals.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests and capacities (a few minutes on 2 cores)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests of the mixed workload, 1 to {s07.MAX_REQUESTS} "
                             "(default: 96, --quick 40)")
    parser.add_argument("--rate", type=float, default=25.0,
                        help=f"Poisson arrival rate, requests/s in (0, {MAX_RATE:g}] (default: "
                             "%(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each capacity and policy, the lowest mean e2e latency "
                             f"kept, 1 to {MAX_REPEATS} (default: 3, --quick 1)")
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help=f"most requests running at once, 1 to {MAX_NUM_SEQS} (default: "
                             "%(default)s)")
    parser.add_argument("--capacities", type=float_list(0, 1, "fractions"), default=None,
                        help="KV capacities as fractions of max-num-seqs x 256 tokens, each in "
                             "(0, 1], comma-separated (default: 1,0.5,0.35,0.25,0.18, --quick "
                             "1,0.35,0.18)")
    parser.add_argument("--high-share", type=float, default=0.5,
                        help="share of high-priority requests, 0 to 1 (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed, >= 0 (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--json", default=str(DEFAULT_JSON),
                        help="where to write the figures (default: %(default)s)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    if args.num_requests is None:
        args.num_requests = 40 if args.quick else 96
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.capacities is None:
        args.capacities = [1, 0.35, 0.18] if args.quick else [1, 0.5, 0.35, 0.25, 0.18]
    s07.check_count(parser, "--num-requests", args.num_requests, 1, s07.MAX_REQUESTS)
    s07.check_count(parser, "--max-num-seqs", args.max_num_seqs, 1, MAX_NUM_SEQS)
    s07.check_count(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    if not 0 < args.rate <= MAX_RATE:
        parser.error(f"--rate must be a number in (0, {MAX_RATE:g}] (got {args.rate})")
    if not 0 <= args.high_share <= 1:
        parser.error(f"--high-share must be a number in [0, 1] (got {args.high_share})")
    check_json(parser, args.json)
    if not (s03.BUNDLED_MODEL_DIR / "config.json").exists():
        parser.error("the bundled model is missing: python scripts/train_bundled_model.py")
    torch.set_num_threads(args.threads)
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, device=args.device, dtype="float32")
    context = model.config.max_position_embeddings
    workload = s07_workloads.make_workload("mixed", tokenizer, args.num_requests, args.seed,
                                           context)
    arrivals = s09_arrivals.poisson_arrivals(args.num_requests, args.rate, args.seed)
    rng = np.random.default_rng(args.seed + 2)
    high = set(rng.choice(args.num_requests, size=round(args.high_share * args.num_requests),
                          replace=False).tolist())
    priorities = [CLASSES["high"] if i in high else CLASSES["low"]
                  for i in range(args.num_requests)]
    fits = args.max_num_seqs * context
    floor = workload.max_context
    capacities = sorted({max(floor, int(f * fits)) for f in args.capacities}, reverse=True)
    total = sum(r.max_tokens for r in workload.requests)
    print(f"\n== mixed workload: {args.num_requests} requests ({len(high)} high priority), "
          f"{total:,} output tokens, prompts {min(r.prompt_tokens for r in workload.requests)}"
          f"-{max(r.prompt_tokens for r in workload.requests)} tokens, Poisson "
          f"{args.rate:g}/s, max_num_seqs {args.max_num_seqs}; KV capacity in tokens "
          f"(fits everything: {fits}; longest request {floor}) ==\n"
          f"arrival-limited: the last request arrives at {arrivals[-1]:.2f} s, so no run "
          f"exceeds {total / arrivals[-1]:.0f} output tok/s ({total} tokens / that time)")
    print(f"{'KV cap':>7} {'policy':<9} {'tok/s':>6} {'TTFT p50':>9} {'p99':>7} "
          f"{'e2e p50':>8} {'p99':>7} {'preempt':>7} {'recomp':>7} | {'low e2e p99':>11} "
          f"{'high e2e p99':>12} {'low TTFT max':>12}   (ms)")
    runs = []
    for capacity in capacities:
        for policy in POLICIES:
            tries = [one_run(model, tokenizer, workload, arrivals, priorities, capacity,
                             policy, args) for _ in range(args.repeats)]
            r = min(tries, key=lambda t: t["e2e"]["mean_ms"])   # the least disturbed run
            r["tokens_per_s_of_repeats"] = [t["tokens_per_s"] for t in tries]
            r["e2e_mean_ms_of_repeats"] = [t["e2e"]["mean_ms"] for t in tries]
            runs.append(r)
            low, hi = r["classes"].get("low"), r["classes"].get("high")
            print(f"{capacity:>7} {policy:<9} {r['tokens_per_s']:>6.0f} "
                  f"{r['ttft']['p50_ms']:>9.0f} {r['ttft']['p99_ms']:>7.0f} "
                  f"{r['e2e']['p50_ms']:>8.0f} {r['e2e']['p99_ms']:>7.0f} "
                  f"{r['preemptions']:>7} {r['recomputed_tokens']:>7} | "
                  f"{low['e2e']['p99_ms'] if low else float('nan'):>11.0f} "
                  f"{hi['e2e']['p99_ms'] if hi else float('nan'):>12.0f} "
                  f"{low['ttft']['max_ms'] if low else float('nan'):>12.0f}")
    after = uptime()
    print(f"\nafter: {after}")
    figures = {"config": {"num_requests": args.num_requests, "rate_per_s": args.rate,
                          "max_num_seqs": args.max_num_seqs, "high_share": args.high_share,
                          "seed": args.seed, "device": args.device, "threads": args.threads,
                          "repeats": args.repeats,
                          "workload": "mixed", "fits_everything_tokens": fits,
                          "longest_request_tokens": floor, "output_tokens": total,
                          "last_arrival_s": arrivals[-1],
                          "arrival_bound_tokens_per_s": total / arrivals[-1],
                          "torch": torch.__version__},
               "runs": runs, "uptime_before": before, "uptime_after": after}
    write_json(args.json, figures)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
