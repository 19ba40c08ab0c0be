"""S09's measurements: continuous batching against S08's static batch and HF's continuous
batching on a long-tail workload, the two ragged attentions, and TTFT / ITL under Poisson
arrivals. Prints; writes nothing unless --json is given.

    python benchmarks/bench_s09_continuous_batching.py --quick      # bundled model, a few minutes
    python benchmarks/bench_s09_continuous_batching.py --skip-hf-batch --repeats 5

A benchmark, not a test: it prints, never asserts speed. What runs (bundled model, float32,
the CPU unless --device cuda, torch threads pinned by --threads, default 1):
  The long-tail workload: --num-requests prompts of S07's "chat" workload (corpus prompts of
  8 to 32 tokens, seeded); each request's output length drawn (seeded) from 8 to 32 tokens,
  except a --straggler-share of them that make --straggler-tokens tokens. EOS is ignored, so
  every engine does exactly the same work. All requests are there at the start, in order.
  Engines, the same requests at the same maximum batch (--max-batch), alternated in every
  repeat, best run kept:
    s08 static   S08's Engine, one static batch after another of --max-batch requests in
                 order, each running until its longest request is done (its fast mode);
    s09 masked   this chapter's engine (`build_engine`, max_num_seqs = --max-batch,
                 attention "masked"), driven by `LLM(engine).generate(prompts, params)`;
    s09 loop     the same with attention "loop" (S06's attention once per request);
    hf cb        transformers' continuous batching (`ContinuousBatchingManager`, the engine
                 under `generate_batch`), max_requests_per_batch = --max-batch, a per-request
                 max_new_tokens, its KV pool sized like ours (num_blocks blocks of page_size
                 256 tokens, 2 per slot), HF's default max_batch_tokens (8192); greedy, no EOS;
    hf batch     `model.generate_batch(...)` as its docstring calls it, one max_new_tokens for
                 all (the workload's mean, rounded: about the same number of tokens overall,
                 not the same requests), with a ContinuousBatchingConfig that sets only the KV pool:
                 the same as hf cb's (2 x --max-batch blocks of 256 tokens); everything else
                 is HF's default (max_requests_per_batch from its workload hints, up to 1024;
                 max_batch_tokens 8192). Left alone, HF sizes its pool from the machine's
                 memory (on a CPU, 60 % of the machine's RAM less what this process holds): a --quick run then took 7.7 GiB and
                 four minutes, most of them in this one row. Once per run (its first call),
                 unless --skip-hf-batch.
  tokens/s = generated tokens / wall seconds of the whole call; CPU s = this process's CPU
  seconds (time.process_time), steadier on a shared machine. Every engine's tokens are
  compared with s09 masked's (rows equal).
  Uniform: 32 chat prompts x 64 tokens at batch 32: S08, S09, HF `generate` on the
  left-padded block, HF's continuous batching sized like ours, and `generate_batch`
  configured as above; --repeats warm runs each, alternated, every run printed with the load
  average (generate_batch: its first call only). Rows this close move with the machine's load
  from run to run: read them as a spread, not a ranking.
  Arrivals: S07's "chat" workload (--arrival-requests requests, 16 to 64 tokens each),
  arriving as a Poisson process at each --rates rate, served by S09's engine through
  `run_arrivals` (S07's harness driving add_request and step): TTFT (from arrival, so the
  queueing is in it) and ITL, p50 / p90 / p99, and tokens/s over the run.

Flags are checked before any model loads (a usage error, exit status 2, naming the rule):
--threads, --seed and --device as every Part II script (`s08_cli.check_common_arguments`),
every count in the range its help gives; a count past its bound is refused, not run (the
time grows with --num-requests, --arrival-requests and --repeats; the default run takes a
few minutes). --quick took 70 s and peaked at 1.3 GB of resident memory here (load average
about 2).

The CPU is shared with other jobs: `uptime` is printed before and after; compare rows of one
run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
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
import s08_static_batching as s08  # noqa: E402
import s09_arrivals  # noqa: E402
import s09_continuous_batching as s09  # noqa: E402
from s09_llm import LLM  # noqa: E402

PAGE_SIZE = 256          # tokens per block of both HF runs' KV pool
BLOCKS_PER_SLOT = 2      # blocks of it per request of --max-batch
MAX_REPEATS = 20
MAX_BATCH = 128          # HF's KV pool and attention mask grow with the batch
MAX_RATE = 10_000.0      # requests/s, far above what any engine here serves


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def long_tail(tokenizer, num: int, seed: int, share: float, long_tokens: int, context: int):
    """(prompts, output lengths): S07 chat prompts; lengths 8-32, `share` of them long."""
    workload = s07_workloads.make_workload("chat", tokenizer, num, seed, context)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(8, 33, size=num)
    stragglers = rng.choice(num, size=max(1, round(share * num)), replace=False)
    lengths[stragglers] = long_tokens
    return [r.prompt for r in workload.requests], [int(n) for n in lengths]


def params_for(lengths):
    return [s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


def run_s08(model, tokenizer, prompts, lengths, batch):
    engine = s08.Engine(model, tokenizer, max_batch_size=batch)
    params = params_for(lengths)
    out = []
    for i in range(0, len(prompts), batch):
        out += engine.generate(prompts[i:i + batch], params[i:i + batch])
    return [c.token_ids for c in out]


def run_s09(model, tokenizer, prompts, lengths, batch, attention):
    engine = s09.build_engine(model, tokenizer, max_num_seqs=batch, attention=attention)
    return [c.token_ids for c in LLM(engine).generate(prompts, params_for(lengths))]


def hf_cb_config(batch: int, **fields):
    """HF's `ContinuousBatchingConfig` with the KV pool both HF runs get, BLOCKS_PER_SLOT
    blocks of PAGE_SIZE tokens per request of the batch (ours: one slot of the model's
    window, 256 tokens, per request), and `fields`; HF's defaults otherwise."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    return ContinuousBatchingConfig(num_blocks=BLOCKS_PER_SLOT * batch, page_size=PAGE_SIZE,
                                    **fields)


def hf_manager_run(hf, ids, lengths, batch):
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(lengths),
                              pad_token_id=0)
    cb = hf_cb_config(batch, max_requests_per_batch=batch)
    manager = hf.init_continuous_batching(generation_config=config,
                                          continuous_batching_config=cb)
    manager.start()
    try:
        rids = [manager.add_request(x, max_new_tokens=n) for x, n in zip(ids, lengths)]
        done = {}
        while len(done) < len(rids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result.generated_tokens
            elif result is None and not manager.is_running():
                raise RuntimeError("HF's continuous batching thread stopped")
    finally:
        manager.stop(block=True, timeout=10)
    return [list(done[r]) for r in rids]


@torch.inference_mode()
def hf_padded_run(hf, ids, max_new_tokens):
    """HF's own static batch: `generate` on the left-padded block (S08's comparison)."""
    block, mask = s08.left_pad(ids, 0, hf.device)
    out = hf.generate(block, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, block.shape[1]:].tolist()


def hf_batch_run(hf, ids, max_new_tokens, batch):
    """`generate_batch` as its docstring calls it, its KV pool set (`hf_cb_config`), nothing
    else: left to HF, the pool takes 60 % of the machine's memory less the process's own on a
    CPU (see the module docstring)."""
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_new_tokens,
                              pad_token_id=0)
    out = hf.generate_batch(ids, generation_config=config,
                            continuous_batching_config=hf_cb_config(batch))
    return [list(r.generated_tokens) for r in out.values()]


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def throughput(model, tokenizer, hf, args):
    context = model.config.max_position_embeddings
    prompts, lengths = long_tail(tokenizer, args.num_requests, args.seed, args.straggler_share,
                                 args.straggler_tokens, context)
    ids = [tokenizer.encode(p) for p in prompts]
    total = sum(lengths)
    print(f"\n== long-tail workload: {len(prompts)} requests, {total:,} tokens "
          f"({sum(n == args.straggler_tokens for n in lengths)} stragglers of "
          f"{args.straggler_tokens}, the rest 8-32), max batch {args.max_batch} ==")
    engines = {
        "s08 static": lambda p, n: run_s08(model, tokenizer, p, n, args.max_batch),
        "s09 masked": lambda p, n: run_s09(model, tokenizer, p, n, args.max_batch, "masked"),
        "s09 loop": lambda p, n: run_s09(model, tokenizer, p, n, args.max_batch, "loop"),
    }
    if hf is not None:
        engines["hf cb"] = lambda p, n: hf_manager_run(
            hf, [tokenizer.encode(x) for x in p], n, args.max_batch)
    best: dict[str, tuple[float, float]] = {}
    tokens: dict[str, list] = {}
    warm = 2 * args.max_batch
    for name, fn in engines.items():   # warm-up: first calls pay one-off costs
        fn(prompts[:warm], lengths[:warm])
    for _ in range(args.repeats):
        for name, fn in engines.items():
            out, wall, cpu = timed(lambda: fn(prompts, lengths))
            tokens[name] = out
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], wall), min(old[1], cpu))
    rows = {name: (total, wall, cpu) for name, (wall, cpu) in best.items()}
    if hf is not None and not args.skip_hf_batch:
        mean = round(total / len(prompts))
        out, wall, cpu = timed(lambda: hf_batch_run(hf, ids, mean, args.max_batch))
        rows["hf batch"] = (mean * len(prompts), wall, cpu)
        tokens["hf batch"] = None
    ref = tokens["s09 masked"]
    print(f"{'engine':<12} {'tokens':>7} {'wall s':>8} {'tokens/s':>9} {'CPU s':>7} "
          f"{'x s08':>6} {'x hf cb':>8} {'x hf bat':>9} {'rows equal':>11}")
    results = {}
    for name, (n, wall, cpu) in rows.items():
        tps = n / wall
        results[name] = dict(tokens=n, wall_s=wall, cpu_s=cpu, tokens_per_s=tps)
    def ratio(name, other):
        if other not in results:
            return "-"
        return f"{results[name]['tokens_per_s'] / results[other]['tokens_per_s']:.2f}"

    for name, r in results.items():
        equal = ("-" if tokens[name] is None else
                 f"{sum(a == b for a, b in zip(tokens[name], ref))}/{len(ref)}")
        print(f"{name:<12} {r['tokens']:>7,} {r['wall_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['cpu_s']:>7.2f} {ratio(name, 's08 static'):>6} {ratio(name, 'hf cb'):>8} "
              f"{ratio(name, 'hf batch'):>9} {equal:>11}")
    return results


def uniform(model, tokenizer, hf, args):
    """32 chat prompts x 64 tokens, batch 32: every engine warm, --repeats runs alternated
    (HF's generate_batch: its first call only), each run's tokens/s and 1-minute load kept."""
    prompts = s08_cli.corpus_prompts(tokenizer, 32, args.seed,
                                     model.config.max_position_embeddings)
    ids = [tokenizer.encode(p) for p in prompts]
    lengths = [64] * len(prompts)
    print("\n== uniform: 32 requests x 64 tokens, batch 32 ==")
    runs = {"s08 static": lambda: run_s08(model, tokenizer, prompts, lengths, 32),
            "s09 masked": lambda: run_s09(model, tokenizer, prompts, lengths, 32, "masked")}
    if hf is not None:
        runs["hf generate"] = lambda: hf_padded_run(hf, ids, 64)
        runs["hf cb"] = lambda: hf_manager_run(hf, ids, lengths, 32)
        if not args.skip_hf_batch:
            runs["hf batch"] = lambda: hf_batch_run(hf, ids, 64, 32)
    for name, fn in runs.items():
        if name != "hf batch":
            fn()                     # warm
    results = {}
    for repeat in range(args.repeats):   # engines alternated in every repeat, as above
        for name, fn in runs.items():
            if name == "hf batch" and repeat:
                continue                 # its first call only
            load = os.getloadavg()[0]
            out, wall, cpu = timed(fn)
            r = results.setdefault(name, dict(tokens=32 * 64, runs=[]))
            r["runs"].append(dict(wall_s=wall, cpu_s=cpu, tokens_per_s=32 * 64 / wall,
                                  load_average_1min=load))
            print(f"{name:<12} {32 * 64 / wall:>9.0f} tokens/s  ({wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU, load {load:.2f})")
    for r in results.values():           # the best run, as the long-tail table keeps
        best = min(r["runs"], key=lambda run: run["wall_s"])
        r.update(wall_s=best["wall_s"], cpu_s=min(run["cpu_s"] for run in r["runs"]),
                 tokens_per_s=best["tokens_per_s"])
    return results


def arrivals(model, tokenizer, args):
    print(f"\n== Poisson arrivals: {args.arrival_requests} chat requests (16-64 tokens), "
          f"max_num_seqs {args.max_batch}, S09's engine through S07's harness ==")
    context = model.config.max_position_embeddings
    workload = s07_workloads.make_workload("chat", tokenizer, args.arrival_requests, args.seed,
                                           context)
    print(f"{'rate/s':>7} {'tokens/s':>9} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
          f"{'ITL p50':>8} {'p90':>7} {'p99':>7}   (ms)")
    results = {}
    for rate in args.rates:
        engine = s09.build_engine(model, tokenizer, max_num_seqs=args.max_batch)
        times = s09_arrivals.poisson_arrivals(len(workload.requests), rate, args.seed)
        run = s09_arrivals.run_arrivals(engine, workload, times, name="s09", model="bundled")
        ttft, itl = run.ttft_s, run.itl_s
        print(f"{rate:>7g} {run.output_tokens_per_s:>9.0f} {ttft.p50 * 1e3:>9.1f} "
              f"{ttft.p90 * 1e3:>7.1f} {ttft.p99 * 1e3:>7.1f} {itl.p50 * 1e3:>8.2f} "
              f"{itl.p90 * 1e3:>7.2f} {itl.p99 * 1e3:>7.2f}")
        results[str(rate)] = run.summary()
    return results


def rate_list(text: str) -> list[float]:
    """--rates' type: "20,80" -> [20.0, 80.0]; argparse's usage error otherwise."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(0 < r <= MAX_RATE for r in rates):   # nan and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be comma-separated numbers in (0, {MAX_RATE:g}] requests/s (got {text!r})")
    return rates


def bundled_window() -> int | None:
    """The bundled model's window from its config.json (None when it is not trained yet)."""
    config = s03.BUNDLED_MODEL_DIR / "config.json"
    return json.loads(config.read_text())["max_position_embeddings"] if config.exists() else None


def main(argv=None) -> None:
    limit = s07.MAX_REQUESTS
    parser = argparse.ArgumentParser(description="S09 benchmark: continuous vs static "
                                     "batching vs HF, and latency under arrivals.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests and repeats (a few minutes on 2 cores, about "
                             "1.3 GB of memory)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests of the long-tail workload, 1 to {limit} (default: 256, "
                             "--quick 192)")
    parser.add_argument("--max-batch", type=int, default=s09.DEFAULT_MAX_NUM_SEQS,
                        help=f"max batch of every engine, S08's and S09's default, 1 to "
                             f"{MAX_BATCH} (HF's KV pool and its attention mask grow with it: "
                             "about 1.3 GB at 32) (default: %(default)s)")
    parser.add_argument("--straggler-share", type=float, default=0.05,
                        help="share of long requests, 0 to 1 (default: %(default)s)")
    parser.add_argument("--straggler-tokens", type=int, default=192,
                        help="tokens of a long request, 1 to the model's window less the "
                             "longest prompt (32) (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per engine, best kept, 1 to {MAX_REPEATS} (default: "
                             "3, --quick 2)")
    parser.add_argument("--arrival-requests", type=int, default=None,
                        help=f"requests of the arrivals run, 1 to {limit} (default: 96, "
                             "--quick 48)")
    parser.add_argument("--rates", type=rate_list, default=[20.0, 80.0],
                        help=f"Poisson arrival rates, requests/s in (0, {MAX_RATE:g}], comma-"
                             "separated (default: 20,80)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out both HF runs")
    parser.add_argument("--skip-hf-batch", "--skip-hf-default", action="store_true",
                        help="leave out HF generate_batch (hf batch: its defaults but the KV "
                             "pool, which is set to hf cb's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed, >= 0 (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--json", default=None,
                        help="write the figures to this file (default: nothing written)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    if args.num_requests is None:
        args.num_requests = 192 if args.quick else 256
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.arrival_requests is None:
        args.arrival_requests = 48 if args.quick else 96
    s07.check_count(parser, "--num-requests", args.num_requests, 1, limit)
    s07.check_count(parser, "--max-batch", args.max_batch, 1, MAX_BATCH)
    s07.check_count(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    s07.check_count(parser, "--arrival-requests", args.arrival_requests, 1, limit)
    if not 0 <= args.straggler_share <= 1:
        parser.error(f"--straggler-share must be a number in [0, 1] (got {args.straggler_share})")
    window = bundled_window()
    if window is None:
        parser.error("the bundled model is missing: python scripts/train_bundled_model.py")
    s07.check_count(parser, "--straggler-tokens", args.straggler_tokens, 1, window - 32)
    if args.json is not None:
        try:
            s07.check_output_file(args.json)
        except ValueError as err:
            parser.error(f"--json: {err}")
    torch.set_num_threads(args.threads)
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}")
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, device=args.device, dtype="float32")
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR,
                                                  dtype=torch.float32).to(args.device).eval()
    figures = {"long_tail": throughput(model, tokenizer, hf, args),
               "uniform": uniform(model, tokenizer, hf, args),
               "arrivals": arrivals(model, tokenizer, args), "uptime_before": before}
    figures["uptime_after"] = uptime()
    print(f"\nafter: {figures['uptime_after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
