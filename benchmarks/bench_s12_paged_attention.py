"""S12's measurement: what paging the KV cache buys (memory) and what it costs (the gather).

    python benchmarks/bench_s12_paged_attention.py --quick   # about 30 s on 2 shared cores
    python benchmarks/bench_s12_paged_attention.py           # the chapter's figure's data
    python benchmarks/bench_s12_paged_attention.py --out     # ... and replace the committed JSON

A benchmark, not a test: it prints, never asserts speed. Float32, the CPU unless --device cuda,
torch threads pinned by --threads (default 1). One workload for parts 1 and 3: --requests
requests, all arriving at once, prompts and outputs drawn uniformly from
[--min-tokens, --max-tokens] each (seeded), within a context of --context tokens (the longest
a request may reach, what a contiguous slot reserves); greedy on random ids, EOS ignored.

1. KV memory at a fixed budget of --kv-slots x --context token positions. Contiguous: S11's
   engine (`build_engine`) with --kv-slots slots of --context positions (each running request
   reserves a whole one). Paged: S12's engine with the same positions in blocks of
   --block-size (plus the null block), up to --max-num-seqs running: KV is the only limit.
   Both with the same token budget per step (--budget, chunked prefill). Per step, as the
   scheduler left it after planning (S09's `StepTracer` records, and `KVReserved`, an
   observer here that reads the KV manager at the same moment): requests running (scheduled
   in the step), KV token positions reserved (contiguous: slots held x context; paged:
   blocks held x block_size, the pool's capacity less its free blocks) and used (tokens
   held, `kv_used_tokens`). Reported: the most requests running, the mean while the waiting
   queue is not empty (the engine full) and over the whole run, the utilisation (used /
   reserved, summed over steps), the steps, the preemptions (the paged engine admits while
   blocks are free and preempts when the running requests outgrow them). The model is tiny
   (TINY_SHAPE) because only the schedule matters here.
2. Decode step time, paged against contiguous, on the same batch: --decode-batch requests of
   --decode-context-token prompts (varied +-25 %) in each engine, prefilled, then decode steps
   timed alternately, paged, contiguous, paged, ... (--decode-steps each, per --repeats);
   the model is S11's mid-size Qwen3 layout (MID_SHAPE of bench_s11_chunked_prefill), SDPA.
   Reported: the median forward time (StepRecord.model_s, S09's `StepTracer`: cheap, and
   on the timed steps as the engine's own trace was before) and step time of each, and their
   ratio (the gather's overhead: the paged engine copies each decoding request's blocks into a
   contiguous tensor in every layer).
3. Internal waste against block size (1, 4, 8, 16, 32, 64): over the workload's requests and
   every context length each passes through (prompt, then one more token per output), the
   unused positions of its last block, ceil(t / b) * b - t, as a share of the positions
   allocated (computed from the workload, a closed form; the paged run of part 1 measures it
   at --block-size: reserved - used over its steps).

--quick is a smoke run (it checks that everything runs): 48 requests, a decode batch of about
256-token contexts, 6 timed steps, one repeat. Its decode-step ratio is not comparable with the
committed run's (512-token contexts, 16 steps x 3 repeats): what the gather copies grows with
the context, and one repeat on a shared CPU is noisy (one --quick run at load average 1.0 to 1.5
gave 1.15x; the committed JSON has 1.29x). It says so in one line (`QUICK_DISCLAIMER`) before
and after its figures.

Flags are checked before any model is built (a usage error, exit status 2, naming the
rule): --threads, --seed and --device as every Part II script
(`s08_cli.check_common_arguments`), every count in the range its help gives; a count past
its bound is refused, not run.

The CPU is shared: `uptime` is recorded before and after. Writes JSON to --json (default a
scratch file in the temp directory) or, with --out, to
chapters/figures/s12_paged_attention.json, which scripts/s12_figure.py draws.
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
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402
import s11_chunked_prefill as s11  # noqa: E402
import s12_engine as s12  # noqa: E402
from bench_s06_torch import IdTokenizer, random_qwen3  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402
from bench_s11_chunked_prefill import MID_SHAPE  # noqa: E402
from s09_trace import trace  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s12_paged_attention.json"
QUICK_DISCLAIMER = ("--quick: a smoke run; its paged / contiguous decode-step ratio (contexts of "
                    "about 256 tokens, 6 steps, 1 repeat) is not comparable with the committed "
                    "run's (512 tokens, 16 steps x 3 repeats: "
                    "chapters/figures/s12_paged_attention.json)")
COMMITTED_JSON = ROOT / "chapters" / "figures" / "s12_paged_attention.json"
WASTE_BLOCK_SIZES = (1, 4, 8, 16, 32, 64)
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=10_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
)
MAX_REQUESTS = 1000
MAX_NUM_SEQS = 256       # of part 1's engines (--kv-slots too): the tiny model's KV is small
MAX_DECODE_BATCH = 64    # part 2's contiguous slots: 32 MB each at the mid-size shape
MAX_DECODE_STEPS = 256
MAX_REPEATS = 20


class KVReserved:
    """An observer: the KV token positions reserved when each planned step is scheduled (the
    moment S09's `StepTracer` reads the manager's used and free tokens, so its records line
    up with these). Contiguous (S09's slots, `engine.scheduler.kv.slots`): slots held x
    slot size; paged (S12's blocks): the pool's capacity less its free blocks' positions."""

    def __init__(self):
        self.reserved: list[int] = []

    def on_plan(self, engine, plan) -> None:
        if plan.planned:
            kv = engine.scheduler.kv
            slots = getattr(kv, "slots", None)     # S09's SlotKVManager and S10's TokenKVPool
            self.reserved.append(len(slots) * kv.slot_size if slots is not None
                                 else kv.capacity - kv.num_free_tokens)

    def on_step(self, engine, result) -> None:
        pass


def build(shape: dict, seed: int, device: str):
    hf = random_qwen3(shape, seed)
    config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
    return s06.TorchTransformer(config, hf.state_dict(), device, torch.float32, "sdpa")


def run_workload(engine, prompts, outputs) -> dict:
    """All requests at once, stepped to the end; per step running, reserved and used KV."""
    for prompt, n in zip(prompts, outputs):
        engine.add_request(prompt, s04.SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True))
    tracer, kv = trace(engine), KVReserved()
    engine.observers.append(kv)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall_s = time.perf_counter() - start
    assert len(kv.reserved) == len(tracer.records), "one of each per planned step"
    kept = [(r, k) for r, k in zip(tracer.records, kv.reserved) if r.running]
    steps, reserved = [r for r, _ in kept], [k for _, k in kept]
    used = [r.kv_used_tokens for r in steps]
    running = [len(r.running) for r in steps]
    queued = [n for n, r in zip(running, steps) if r.waiting]   # while someone waits
    return {"running": running, "reserved_tokens": reserved, "used_tokens": used,
            "max_running": max(running), "mean_running": statistics.mean(running),
            "mean_running_while_queued": statistics.mean(queued), "steps_queued": len(queued),
            "utilisation": sum(used) / sum(reserved), "steps": len(steps),
            "preemptions": engine.scheduler.num_preemptions, "wall_s": wall_s}


def waste(prompt_lens, output_lens, block_size: int) -> dict:
    """Part 3's closed form: over every context length t each request holds (its prompt,
    then one more per output token but the last), ceil(t / b) * b - t unused positions."""
    wasted = allocated = 0
    for p, n in zip(prompt_lens, output_lens):
        t = np.arange(p, p + n)                    # tokens held in each of its decode steps
        blocks = -(-t // block_size) * block_size
        wasted += int((blocks - t).sum())
        allocated += int(blocks.sum())
    return {"block_size": block_size, "waste_share": wasted / allocated,
            "mean_waste_tokens": wasted / sum(output_lens)}


def decode_timing(args) -> dict:
    """Part 2: the same batch in both engines, decode steps timed alternately."""
    model = build(MID_SHAPE, args.seed, args.device)
    tokenizer = IdTokenizer(MID_SHAPE["vocab_size"])
    rng = np.random.default_rng(args.seed + 1)
    lens = rng.integers(int(args.decode_context * 0.75), int(args.decode_context * 1.25) + 1,
                        size=args.decode_batch)
    prompts = [" ".join(map(str, rng.integers(1, MID_SHAPE["vocab_size"], size=n)))
               for n in lens]
    context = MID_SHAPE["max_position_embeddings"]
    total = args.repeats * args.decode_steps + args.decode_batch + 2   # prefill steps too
    assert int(args.decode_context * 1.25) + total <= context, "main checks --decode-context"
    kw = dict(max_context=context, max_num_seqs=args.decode_batch,   # a whole prompt a step
              max_num_batched_tokens=max(int(lens.max()), args.decode_batch))
    engines = {"paged": s12.build_engine(model, tokenizer, block_size=args.block_size, **kw),
               "contiguous": s11.build_engine(model, tokenizer, **kw)}
    params = s04.SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    tracers = {}
    for name, engine in engines.items():
        for p in prompts:
            engine.add_request(p, params)
        while not all(r.output_ids for r in engine.requests.values()):   # prefills
            engine.step()
        tracers[name] = trace(engine, limit=1)      # the latest step's record
    times = {name: {"model_s": [], "step_s": []} for name in engines}
    for _ in range(args.repeats * args.decode_steps):
        for name, engine in engines.items():           # alternating, step by step
            engine.step()
            record = tracers[name].records[-1]
            assert record.num_tokens == args.decode_batch, ("not a pure decode step", name, record)
            times[name]["model_s"].append(record.model_s)
            times[name]["step_s"].append(record.step_s)
    med = {name: {k: statistics.median(v) * 1e3 for k, v in t.items()}
           for name, t in times.items()}
    return {"decode_batch": args.decode_batch, "context_lens": lens.tolist(),
            "steps_each": args.repeats * args.decode_steps,
            "paged_model_ms": med["paged"]["model_s"],
            "contiguous_model_ms": med["contiguous"]["model_s"],
            "paged_step_ms": med["paged"]["step_s"],
            "contiguous_step_ms": med["contiguous"]["step_s"],
            "model_ratio": med["paged"]["model_s"] / med["contiguous"]["model_s"],
            "step_ratio": med["paged"]["step_s"] / med["contiguous"]["step_s"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="S12 benchmark: KV memory reserved against "
                                     "used, contiguous against paged; the gather's cost; "
                                     "internal waste against block size.")
    window = MID_SHAPE["max_position_embeddings"]
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (about 30 s on 2 cores): fewer requests, shorter "
                             "contexts and decode steps; its step-time ratio is not the "
                             "committed run's (default: off)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests in the workload, 1 to {MAX_REQUESTS} (default: 96, "
                             "--quick 48)")
    parser.add_argument("--min-tokens", type=int, default=16,
                        help="shortest prompt and output, 1 to --max-tokens (default: "
                             "%(default)s)")
    parser.add_argument("--max-tokens", type=int, default=384,
                        help="longest prompt and output, at most half of --context (default: "
                             "%(default)s)")
    parser.add_argument("--context", type=int, default=1024,
                        help=f"longest context, what a contiguous slot reserves, 2 to {window} "
                             "(default: %(default)s)")
    parser.add_argument("--kv-slots", type=int, default=8,
                        help=f"the KV budget in contiguous slots of --context positions, 1 to "
                             f"{MAX_NUM_SEQS} (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help=f"most requests the paged engine runs, 1 to {MAX_NUM_SEQS} "
                             "(default: %(default)s)")
    parser.add_argument("--budget", type=int, default=512,
                        help="max_num_batched_tokens of both engines, from the larger of "
                             "--max-num-seqs and --kv-slots to --max-num-seqs x --context "
                             "(default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per block of the paged engine, 1 to --context (default: "
                             "%(default)s)")
    parser.add_argument("--decode-batch", type=int, default=8,
                        help=f"requests in the timed decode batch, 1 to {MAX_DECODE_BATCH} "
                             "(default: %(default)s)")
    parser.add_argument("--decode-context", type=int, default=None,
                        help="mean prompt tokens of the timed batch, >= 2, its longest "
                             f"prompt (+25 %%) and every decode step within {window} "
                             "(default: 512, --quick 256)")
    parser.add_argument("--decode-steps", type=int, default=None,
                        help=f"timed decode steps per engine per repeat, 1 to "
                             f"{MAX_DECODE_STEPS} (default: 16, --quick 6)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"repeats of the decode timing, 1 to {MAX_REPEATS} (default: 3, "
                             "--quick 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model and workload seed, >= 0 (default: %(default)s)")
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
    if args.requests is None:
        args.requests = 48 if args.quick else 96
    if args.decode_steps is None:
        args.decode_steps = 6 if args.quick else 16
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.decode_context is None:
        args.decode_context = 256 if args.quick else 512
    check = s07.check_count
    check(parser, "--requests", args.requests, 1, MAX_REQUESTS)
    check(parser, "--context", args.context, 2, window)
    check(parser, "--max-tokens", args.max_tokens, 1, args.context // 2)
    check(parser, "--min-tokens", args.min_tokens, 1, args.max_tokens)
    check(parser, "--kv-slots", args.kv_slots, 1, MAX_NUM_SEQS)
    check(parser, "--max-num-seqs", args.max_num_seqs, 1, MAX_NUM_SEQS)
    check(parser, "--budget", args.budget, max(args.max_num_seqs, args.kv_slots),
          args.max_num_seqs * args.context)
    check(parser, "--block-size", args.block_size, 1, args.context)
    check(parser, "--decode-batch", args.decode_batch, 1, MAX_DECODE_BATCH)
    check(parser, "--decode-steps", args.decode_steps, 1, MAX_DECODE_STEPS)
    check(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    decode_tokens = args.repeats * args.decode_steps + args.decode_batch + 2
    check(parser, "--decode-context", args.decode_context, 2,
          int((window - decode_tokens) / 1.25))
    if not args.out:
        check_json(parser, args.json)
    torch.set_num_threads(args.threads)
    if args.quick:
        print(QUICK_DISCLAIMER)
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}")
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests)
    output_lens = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests)
    prompts = [" ".join(map(str, rng.integers(1, TINY_SHAPE["vocab_size"], size=n)))
               for n in prompt_lens]
    tiny = build(TINY_SHAPE, args.seed, args.device)
    tokenizer = IdTokenizer(TINY_SHAPE["vocab_size"])
    budget_tokens = args.kv_slots * args.context
    contiguous = s11.build_engine(tiny, tokenizer, max_context=args.context,
                                  max_num_seqs=args.kv_slots, max_num_batched_tokens=args.budget)
    paged = s12.build_engine(tiny, tokenizer, max_context=args.context,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                             block_size=args.block_size,
                             num_blocks=budget_tokens // args.block_size + 1)
    memory = {"contiguous": run_workload(contiguous, prompts, output_lens.tolist()),
              "paged": run_workload(paged, prompts, output_lens.tolist())}
    c, p = memory["contiguous"], memory["paged"]
    print(f"\n1. KV budget {budget_tokens} token positions; {args.requests} requests, prompts "
          f"and outputs {args.min_tokens}-{args.max_tokens} tokens, context {args.context}")
    print(f"{'':>11} {'max running':>11} {'mean':>6} {'mean, queue not empty':>21} "
          f"{'utilisation':>11} {'steps':>6} {'preempted':>9}")
    for name, m in memory.items():
        print(f"{name:>11} {m['max_running']:>11} {m['mean_running']:>6.1f} "
              f"{m['mean_running_while_queued']:>21.1f} {m['utilisation']:>11.1%} "
              f"{m['steps']:>6} {m['preemptions']:>9}")
    ratio = p["mean_running_while_queued"] / c["mean_running_while_queued"]
    print(f"paged runs {p['max_running'] / c['max_running']:.1f}x the most concurrent "
          f"requests, {ratio:.1f}x the mean while requests wait, "
          f"{p['mean_running'] / c['mean_running']:.1f}x the mean over the whole run "
          f"(its tail, the last few requests finishing, included)")
    wastes = [waste(prompt_lens, output_lens, b) for b in WASTE_BLOCK_SIZES]
    measured = 1 - p["utilisation"]
    print("\n3. internal waste (closed form over the workload): " + ", ".join(
        f"b={w['block_size']}: {w['waste_share']:.1%}" for w in wastes)
        + f"; measured in the paged run at b={args.block_size}: {measured:.1%}")
    decode = decode_timing(args)
    print(f"\n2. decode step, {args.decode_batch} requests of about {args.decode_context} "
          f"tokens, mid-size Qwen3 layout, {decode['steps_each']} steps each, alternating: "
          f"forward paged {decode['paged_model_ms']:.1f} ms, contiguous "
          f"{decode['contiguous_model_ms']:.1f} ms ({decode['model_ratio']:.2f}x); whole step "
          f"{decode['paged_step_ms']:.1f} / {decode['contiguous_step_ms']:.1f} ms "
          f"({decode['step_ratio']:.2f}x)")
    after = uptime()
    print(f"\nafter: {after}")
    if args.quick:
        print(QUICK_DISCLAIMER)
    figures = {"config": {k: getattr(args, k) for k in (
        "requests", "min_tokens", "max_tokens", "context", "kv_slots", "max_num_seqs",
        "budget", "block_size", "decode_batch", "decode_context", "decode_steps", "repeats",
        "seed", "device", "threads", "quick")} | {
            "kv_budget_tokens": budget_tokens, "tiny_shape": TINY_SHAPE,
            "decode_shape": MID_SHAPE, "torch": torch.__version__},
        "workload": {"prompt_lens": prompt_lens.tolist(), "output_lens": output_lens.tolist()},
        "memory": memory, "concurrency_ratio_while_queued": ratio,
        "concurrency_ratio_mean": p["mean_running"] / c["mean_running"],
        "concurrency_ratio_max": p["max_running"] / c["max_running"],
        "waste": wastes, "measured_waste_share": measured, "decode": decode,
        "uptime_before": before, "uptime_after": after}
    target = COMMITTED_JSON if args.out else Path(args.json)
    write_json(target, figures, indent=1)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
