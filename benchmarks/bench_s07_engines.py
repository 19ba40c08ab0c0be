"""S07's comparison: the course's engines and `transformers` generate(), same weights, same
workloads, batch 1, measured with S07's harness against this machine's roofline.

    python benchmarks/bench_s07_engines.py --skip-qwen --requests 3   # a quick look
    python benchmarks/bench_s07_engines.py                   # the whole comparison, ~10 min
    python benchmarks/bench_s07_engines.py --replace-results # ... replacing results/'s run

Where it writes: by default results/scratch/s07_engines.json and results/scratch/
s07_roofline_<model>.png (git ignores results/scratch/, and nothing reads it), so a run of
your own never changes the committed run that the chapter, its notebook and their tests quote.
--out PATH writes the JSON to PATH (the plots beside it); --replace-results writes
results/s07_engines.json and results/s07_roofline_<model>.png, the committed files.

A benchmark, not a test: it prints and writes, never asserts speed. What runs:
  Engines (all greedy, EOS ignored so every engine makes exactly the requested tokens, float32,
  on the CPU unless --device cuda), each driven through its public stream by S07's
  `StreamClient` (HF generate() by `HFGenerateClient`, with a streamer):
    S01 loop      code/s01_generation_loop.py's Engine on S03's NumPy model: no cache, every
                  token recomputes the whole context. Only on the short-output workload.
    S05 NumPy     code/s05_kv_cache.py's Engine: NumPy, KV cache.
    S06 torch     code/s06_torch.py's Engine: torch, KV cache, once per --attentions entry
                  (default both: "manual", S03's attention in torch, and "sdpa", PyTorch's
                  fused scaled_dot_product_attention), with --threads torch threads; and
                  once more with SDPA and 1 thread (on a shared machine a parallel region
                  can wait milliseconds for its second thread: this row shows what that costs).
    HF generate   transformers' model.generate(), its own DynamicCache, SDPA attention; with
                  --threads threads, and once more with 1 thread, for the same reason.
  Models:
    bundled       data/model (the course's tiny Qwen3-architecture model); while it has not
                  been trained, a random model of its shape, said in the output and the JSON.
    qwen3-0.6b    random weights in Qwen3-0.6B's shape (its published config.json: hidden 1024,
                  MLP 3072, 28 layers, 16 query / 8 key-value heads of 128, vocabulary 151,936,
                  tied embeddings): 596M parameters, 2.4 GB in float32. Built here with
                  transformers (seeded), no download. Few requests, few tokens.
  Workloads (S07 `make_workload`, seeded, prompts from data/shakespeare.txt, encoded with the
  project tokenizer data/tokenizer.json, whose 2,048 ids are valid ids of both models):
    chat-short    chat prompts with outputs of at most --short-tokens: every engine, S01 too;
    chat, long, mixed                                       : S05, S06, HF (bundled model);
    the 0.6B shape runs chat-short (--qwen-requests x at most --qwen-tokens) and one long
    request (a prefill of 128-192 tokens: the compute-bound end of the roofline).
  The roofline: this machine's copy bandwidth and float32 matmul FLOP/s (S07
  `measure_peaks`), every engine's decode step (ITL p50) against the floor
  bytes moved / bandwidth, and a plot per model beside the JSON.
  Where the S06 step's time goes on the 0.6B shape: its model time vs the rest of the step
  (the engine's own Stats), a torch.profiler table of a few decode steps (--profile-steps)
  per attention, and one decode-shaped attention call timed alone at 1 and at --threads
  threads (`attention_call_s`).

The CPU is shared with other jobs: the 1-minute load average before and after is in the
JSON; compare rows of one run, and treat p99 values as the machine's noise as much as the
engine's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s01_generation_loop as s01  # noqa: E402
import s03_checkpoint as ckpt  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s05_kv_cache as s05  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_roofline as roof  # noqa: E402
from s07_workloads import Request, Workload, make_workload  # noqa: E402

TOKENIZER_JSON = ROOT / "data" / "tokenizer.json"
COMMITTED_JSON = ROOT / "results" / "s07_engines.json"    # written only with --replace-results
SCRATCH_JSON = ROOT / "results" / "scratch" / "s07_engines.json"   # git-ignored: the default
EOS_ID = 2047            # <|endoftext|> in data/tokenizer.json
MAX_CONTEXT = 256        # the bundled model's context window; every workload fits in it

# Qwen/Qwen3-0.6B config.json (published values; only the shape matters here).
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
)
# scripts/train_bundled_model.py defaults: the bundled model's shape before it is trained.
BUNDLED_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=2048, rope_theta=10000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=256,
)


def random_qwen3(shape: dict, seed: int):
    """transformers' Qwen3ForCausalLM of `shape` with HF's own random initialisation (seeded),
    float32, SDPA attention, eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(**shape, eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def load_models(name: str, seed: int, device: torch.device, attentions: list[str]):
    """(note, config, NumPy S03 model, {attention: S06 torch model}, HF model), all on the
    same weights."""
    bundled = s03.BUNDLED_MODEL_DIR
    if name == "bundled" and (bundled / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32).eval()
        config = ckpt.load_config(bundled)
        weights = ckpt.load_state_dict(bundled)
        digest = hashlib.sha256((bundled / "model.safetensors").read_bytes()).hexdigest()
        note = f"trained checkpoint data/model (model.safetensors sha256 {digest[:16]}...)"
    else:
        start = time.perf_counter()
        hf = random_qwen3(BUNDLED_SHAPE if name == "bundled" else QWEN3_0_6B, seed)
        config = ckpt.config_from_hf_dict(hf.config.to_dict())
        weights = {k: v.detach().numpy() for k, v in hf.state_dict().items()}  # shares memory
        note = (f"random weights (transformers' init, seed {seed}), built in "
                f"{time.perf_counter() - start:.0f} s")
        if name == "bundled":
            note += "; data/model was not trained yet"
    numpy_model = s03.Transformer(config, weights)
    torch_models = {impl: s06.TorchTransformer(config, weights, device, torch.float32, impl)
                    for impl in attentions}
    hf = hf.to(device)
    return note, config, numpy_model, torch_models, hf


class WithThreads:
    """A client of the harness run with `threads` torch threads (restored after each
    request): the same engine, to show what the thread count does to a step on this machine."""

    def __init__(self, name: str, client: s07.BenchClient, threads: int):
        self.name, self.client, self.threads = name, client, threads

    def measure(self, request: Request, clock: s07.Clock) -> s07.TimedRequest:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.client.measure(request, clock)
        finally:
            torch.set_num_threads(before)


def renamed(workload: Workload, name: str) -> Workload:
    return dataclasses.replace(workload, name=name)


def agreement(runs: list[s07.BenchmarkRun], reference: str) -> dict[str, str]:
    """For each run, whether its greedy token ids equal those of `reference`'s run on the same
    workload, request by request: 'equal' or where the first difference is."""
    by_key = {(r.engine, r.workload): r for r in runs}
    out = {}
    for run in runs:
        ref = by_key.get((reference, run.workload))
        if ref is None or run.engine == reference:
            continue
        verdict = "equal"
        for mine, theirs in zip(run.requests, ref.requests):
            if mine.token_ids != theirs.token_ids:
                i = next((k for k, (a, b) in enumerate(zip(mine.token_ids, theirs.token_ids))
                          if a != b), min(len(mine.token_ids), len(theirs.token_ids)))
                verdict = (f"request {mine.request_id}: first {i} tokens equal, then "
                           f"{mine.token_ids[i:i + 1]} vs {theirs.token_ids[i:i + 1]}")
                break
        out[f"{run.engine} / {run.workload}"] = verdict
    return out


def profile_decode(engine: s06.Engine, prompt_ids: list[int], steps: int, top: int = 12
                   ) -> dict:
    """torch.profiler over `steps` decode steps of the S06 engine's runner (after a prefill):
    the ops with the most self CPU time; the shares of the weight matrix products (aten::mm /
    addmm: projections, MLP, LM head) and of attention (the q k^T and p v products, aten::bmm,
    softmax, or SDPA's fused kernel); and the bandwidth the weight products reach: every
    weight matrix is read once per step (float32), so weight bytes / their seconds per step."""
    from torch.profiler import ProfilerActivity, profile
    runner = engine.runner
    with torch.inference_mode():
        logits = runner.prefill(prompt_ids)
        token = torch.argmax(logits).view(1)
        runner.decode(token)                           # one unprofiled step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                token = torch.argmax(runner.decode(token)).view(1)
            s06.synchronize(engine.model.device)
            wall = time.perf_counter() - start
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    weight_ops = {"aten::mm", "aten::addmm"}
    attention_ops = {"aten::bmm", "aten::_softmax", "aten::_safe_softmax",
                     "aten::_scaled_dot_product_flash_attention_for_cpu",
                     "aten::_scaled_dot_product_flash_attention",
                     "aten::_scaled_dot_product_efficient_attention"}
    matmul_us = sum(e.self_cpu_time_total for e in rows if e.key in weight_ops)
    attention_us = sum(e.self_cpu_time_total for e in rows if e.key in attention_ops)
    cfg = engine.model.config
    weight_bytes = s03.bytes_per_token(cfg, 1) - 2 * cfg.num_hidden_layers * \
        cfg.num_key_value_heads * cfg.head_dim * 4        # S03's bytes, minus one token's K/V
    return {"steps": steps, "wall_s_per_step_profiled": wall / steps,
            "matmul_s_per_step": matmul_us / steps * 1e-6,
            "matmul_weight_bytes_per_s": weight_bytes / (matmul_us / steps * 1e-6),
            "self_cpu_us_per_step_total": total / steps,
            "matmul_share_of_self_cpu": matmul_us / total,
            "attention_share_of_self_cpu": attention_us / total,
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                         "self_cpu_us_per_step": e.self_cpu_time_total / steps,
                         "share": e.self_cpu_time_total / total} for e in rows[:top]]}


def attention_call_s(config: s03.TransformerConfig, context_len: int, threads: int, impl: str,
                     repeats: int = 30) -> float:
    """Median seconds of one S06 `attention` call shaped like a decode step of `config`
    (q (H, 1, D) against K, V (Hkv, S, D) views of a preallocated cache), with `threads` torch
    threads. The thread count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q = torch.randn(h, 1, d)
        cache = torch.randn(2, hkv, MAX_CONTEXT, d)
        k, v = cache[0, :, :context_len], cache[1, :, :context_len]   # (Hkv, S, D) views
        call = lambda: s06.attention(q, k, v, context_len - 1, d ** -0.5, impl)  # noqa: E731
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return float(np.median(times))
    finally:
        torch.set_num_threads(before)


def measure_at_threads(device: str, threads: int) -> dict[int, roof.MachinePeaks]:
    """S07 `measure_peaks` at 1 thread and at `threads` threads (restored afterwards)."""
    before = torch.get_num_threads()
    try:
        out = {}
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            out[t] = roof.measure_peaks(device)
        return out
    finally:
        torch.set_num_threads(before)


def workloads_for(name: str, tokenizer, n_requests: int, short_tokens: int, seed: int
                  ) -> list[Workload]:
    """The workloads of one model (see the module docstring). Raises ValueError (S07's
    `make_workload`) for lengths that do not fit MAX_CONTEXT."""
    workloads = [renamed(make_workload("chat", tokenizer, n_requests, seed, MAX_CONTEXT,
                                       max_output_tokens=short_tokens), "chat-short")]
    if name == "bundled":
        workloads += [make_workload(kind, tokenizer, n_requests, seed, MAX_CONTEXT)
                      for kind in ("chat", "long", "mixed")]
    else:
        workloads.append(make_workload("long", tokenizer, 1, seed, MAX_CONTEXT,
                                       max_output_tokens=short_tokens))
    return workloads


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, every rule checked before a model is built or a request sent: each
    broken one is a usage error (exit status 2) naming it."""
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (S06 and HF; NumPy is CPU)")
    parser.add_argument("--attentions", default="manual,sdpa",
                        help="S06 attentions to run, comma-separated (manual, sdpa)")
    parser.add_argument("--threads", type=int, default=min(2, cores),
                        help=f"torch intra-op threads, 1 to the logical cores ({cores}); "
                             "default 2 (1 on a one-core machine)")
    parser.add_argument("--requests", type=int, default=8,
                        help=f"requests per bundled workload, 1 to {s07.MAX_REQUESTS}")
    parser.add_argument("--short-tokens", type=int, default=16,
                        help="most output tokens in chat-short (the S01 loop's workload), >= 1")
    parser.add_argument("--qwen-requests", type=int, default=2,
                        help=f"chat-short requests on the 0.6B shape, 1 to {s07.MAX_REQUESTS}")
    parser.add_argument("--qwen-tokens", type=int, default=8,
                        help="most output tokens on the 0.6B shape, >= 1")
    parser.add_argument("--profile-steps", type=int, default=4,
                        help="decode steps profiled on the 0.6B shape, 0 to skip the profile")
    parser.add_argument("--skip-qwen", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads, >= 0")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", default=None,
                       help=f"the JSON to write, plots beside it (default: "
                            f"{SCRATCH_JSON.relative_to(ROOT)}, git-ignored)")
    where.add_argument("--replace-results", action="store_true",
                       help=f"write the committed {COMMITTED_JSON.relative_to(ROOT)} and its "
                            "plots (the chapter and its notebook quote them)")
    args = parser.parse_args(argv)

    check = s07.check_count
    check(parser, "--threads", args.threads, 1, cores)
    check(parser, "--requests", args.requests, 1, s07.MAX_REQUESTS)
    check(parser, "--qwen-requests", args.qwen_requests, 1, s07.MAX_REQUESTS)
    check(parser, "--short-tokens", args.short_tokens, 1)
    check(parser, "--qwen-tokens", args.qwen_tokens, 1)
    check(parser, "--profile-steps", args.profile_steps, 0)
    check(parser, "--seed", args.seed, 0)
    args.attentions = [a for a in args.attentions.split(",") if a]
    if not args.attentions or any(a not in s06.ATTENTION_IMPLS for a in args.attentions):
        parser.error(f"--attentions must list some of {s06.ATTENTION_IMPLS}")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device: {err}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda (got {args.device!r})")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    args.out = Path(COMMITTED_JSON if args.replace_results else args.out or SCRATCH_JSON)
    try:
        s07.check_output_file(args.out)
    except ValueError as err:
        parser.error(f"--out: {err}")
    tokenizer = ckpt.CheckpointTokenizer(TOKENIZER_JSON, [EOS_ID])
    args.plan = [("bundled", args.requests, args.short_tokens)]
    if not args.skip_qwen:
        args.plan.append(("qwen3-0.6b", args.qwen_requests, args.qwen_tokens))
    try:   # the workloads are cheap: make them now, so a length that does not fit stops here
        args.workloads = {name: workloads_for(name, tokenizer, n, short, args.seed)
                          for name, n, short in args.plan}
    except ValueError as err:
        parser.error(str(err))
    args.tokenizer = tokenizer
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    attentions = args.attentions
    facts = s07.machine_facts(args.device)
    print(f"{facts['cpu_model']}, {facts['usable_cores']} usable cores, torch {facts['torch']} "
          f"({facts['torch_threads']} threads), numpy {facts['numpy']}, transformers "
          f"{facts['transformers']}; load average {facts['load_average_1min']:.1f}")
    shown_out = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    print(f"writing to {shown_out}" + ("" if args.replace_results else
                                       " (--replace-results writes the committed run)"))
    peaks_before = measure_at_threads(args.device, args.threads)
    out_dir = args.out.parent
    measured = []   # (name, note, cfg, runs, workloads) per model
    profiles = {}

    for name, _, _ in args.plan:
        note, cfg, numpy_model, torch_models, hf = load_models(name, args.seed, device,
                                                               attentions)
        print(f"== {name}: {s03.parameter_count(cfg):,} parameters, {note}")
        tokenizer = args.tokenizer
        workloads = args.workloads[name]
        s06_engines = {impl: s06.Engine(m, tokenizer, MAX_CONTEXT)
                       for impl, m in torch_models.items()}
        clients = [s07.StreamClient("S01 loop (no cache)",
                                    s01.Engine(numpy_model, tokenizer, MAX_CONTEXT)),
                   s07.StreamClient("S05 NumPy + cache",
                                    s05.Engine(numpy_model, tokenizer, MAX_CONTEXT))]
        clients += [s07.StreamClient(f"S06 torch ({impl})", engine)
                    for impl, engine in s06_engines.items()]
        if args.threads != 1 and "sdpa" in s06_engines:
            clients.append(WithThreads("S06 torch (sdpa, 1 thread)",
                                       s07.StreamClient("", s06_engines["sdpa"]), 1))
        hf_client = s07.HFGenerateClient("HF generate()", hf, tokenizer, pad_token_id=EOS_ID)
        clients.append(hf_client)
        if args.threads != 1:
            clients.append(WithThreads("HF generate() (1 thread)", hf_client, 1))
        runs = []
        for workload in workloads:
            for client in clients:
                if client.name.startswith("S01") and workload.name != "chat-short":
                    continue
                # One warm-up per engine and model (its first workload): later workloads
                # find the engine warm already, and a warm-up prefill of 0.6B is seconds.
                runs.append(s07.run_benchmark(client, workload, model=name,
                                              warmup=workload is workloads[0]))
        if name != "bundled" and args.profile_steps > 0:
            prompt_ids = tokenizer.encode(workloads[0].requests[0].prompt)
            context = len(prompt_ids) + 2
            profiles[name] = {"attention_call_context_len": context, "attention_call_s": {
                f"{impl}, {threads} thread(s)": attention_call_s(cfg, context, threads, impl)
                for impl in attentions for threads in sorted({1, args.threads})}}
            for impl, engine in s06_engines.items():
                profiles[name][impl] = profile_decode(engine, prompt_ids, args.profile_steps)
        measured.append((name, note, cfg, runs, workloads))
        del numpy_model, torch_models, hf, clients, s06_engines
        gc.collect()

    # The machine's limits, measured before and after the runs, each at 1 and at --threads
    # threads; the floors use the best of them (a floor is what the machine can do at best,
    # and other jobs come and go).
    peaks_after = measure_at_threads(args.device, args.threads)
    measurements = {f"{when}, {t} thread(s)": m for when, at in (("before", peaks_before),
                                                                 ("after", peaks_after))
                    for t, m in at.items()}
    best_bw = max(measurements, key=lambda k: measurements[k].bandwidth_bytes_per_s)
    best_mm = max(measurements, key=lambda k: measurements[k].matmul_flops_per_s)
    peaks = roof.MachinePeaks(
        measurements[best_bw].bandwidth_bytes_per_s, measurements[best_mm].matmul_flops_per_s,
        f"best of {len(measurements)} measurements (before / after the runs, 1 / "
        f"{args.threads} threads), here {best_bw}: {measurements[best_bw].bandwidth_method}",
        f"best of {len(measurements)} measurements (before / after the runs, 1 / "
        f"{args.threads} threads), here {best_mm}: {measurements[best_mm].matmul_method}")
    print()
    for key, m in measurements.items():
        print(f"{key:<22} bandwidth {m.bandwidth_bytes_per_s / 1e9:6.2f} GB/s, matmul "
              f"{m.matmul_flops_per_s / 1e9:6.1f} GFLOP/s")
    print(f"used: bandwidth {peaks.bandwidth_bytes_per_s / 1e9:.2f} GB/s, matmul "
          f"{peaks.matmul_flops_per_s / 1e9:.1f} GFLOP/s, ridge {peaks.ridge_intensity:.1f} "
          f"FLOP/byte\n")
    all_runs: list[s07.BenchmarkRun] = []
    models_info, workloads_info, agreements = {}, {}, {}
    for name, note, cfg, runs, workloads in measured:
        params = s03.parameter_count(cfg)
        for run in runs:
            roof.attach_floor(run, cfg, peaks)
        print(f"== {name}: {params:,} parameters, {note}")
        print(s07.format_table(runs))
        agreements[name] = agreement(runs, "S05 NumPy + cache")
        for key, verdict in agreements[name].items():
            print(f"  greedy tokens vs S05, {key}: {verdict}")

        # The roofline: decode steps (ITL p50, chat-short) and prefills (TTFT p50, long).
        points = []
        for run in runs:
            if run.engine.startswith("S01"):
                continue   # an uncached pass is neither a decode step nor a prefill
            if run.workload == "chat-short" and run.itl_s is not None:
                cost = roof.decode_step_cost(cfg, run.decode_context_len)
                points.append((f"{run.engine} decode (S={run.decode_context_len})", cost,
                               run.itl_s.p50))
            if run.workload == "long":
                prompt = int(np.median([r.prompt_tokens for r in run.requests]))
                points.append((f"{run.engine} prefill (T={prompt}, TTFT)",
                               roof.prefill_cost(cfg, prompt), run.ttft_s.p50))
        plot = roof.plot_roofline(peaks, points, out_dir / f"s07_roofline_{name}.png",
                                 title=f"{name} ({params / 1e6:.1f}M parameters, float32, "
                                       f"batch 1) on {facts['cpu_model']}")
        shown = plot.relative_to(ROOT) if plot.is_relative_to(ROOT) else plot
        print(f"  roofline plot: {shown}")
        decode = roof.decode_step_cost(cfg, 32)
        models_info[name] = {
            "note": note, "parameters": params, "config": dataclasses.asdict(cfg),
            "weights_bytes_float32": params * 4,
            "decode_step_at_32": dataclasses.asdict(decode) | {"intensity": decode.intensity},
            "roofline_plot": str(shown),
            "roofline_points": [{"label": label, "flops": c.flops, "bytes": c.bytes,
                                 "intensity": c.intensity, "measured_s": t,
                                 "achieved_flops_per_s": c.flops / t}
                                for label, c, t in points]}
        workloads_info[name] = [
            {"name": w.name, "seed": w.seed,
             "requests": [{"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens}
                          for r in w.requests]} for w in workloads]
        for s06_run in (r for r in runs if r.engine.startswith("S06")
                        and r.workload == "chat-short" and r.model_step_s is not None):
            step, model = s06_run.itl_s.p50, s06_run.model_step_s.p50
            print(f"  {s06_run.engine} decode step (chat-short): ITL p50 {step * 1e3:.1f} ms = "
                  f"{s06_run.decode_vs_floor:.2f}x the floor of "
                  f"{s06_run.decode_floor_s * 1e3:.1f} ms; model p50 {model * 1e3:.1f} ms "
                  f"({model / step:.0%} of the step)")
        if name in profiles:
            prof = profiles[name]
            print(f"  one decode-shaped attention call (S={prof['attention_call_context_len']}), "
                  "median: " + ", ".join(f"{k} {v * 1e6:.0f} us"
                                         for k, v in prof["attention_call_s"].items()))
            for impl in attentions:
                p = prof[impl]
                print(f"  profile of {p['steps']} S06 ({impl}) decode steps: matmuls are "
                      f"{p['matmul_share_of_self_cpu']:.0%} of self CPU time "
                      f"({p['matmul_s_per_step'] * 1e3:.0f} ms/step, reading weights at "
                      f"{p['matmul_weight_bytes_per_s'] / 1e9:.1f} GB/s), attention "
                      f"{p['attention_share_of_self_cpu']:.0%}; top ops:")
                for op in p["top_ops"][:5]:
                    print(f"    {op['op']:<50} {op['self_cpu_us_per_step'] / 1e3:8.2f} ms/step "
                          f"{op['share']:6.1%}  ({op['calls_per_step']:.0f} calls/step)")
        print()
        all_runs += runs

    facts_after = s07.machine_facts(args.device)
    results = s07.results_json(all_runs, facts, peaks, extra={
        "command": " ".join(["python benchmarks/bench_s07_engines.py", *argv]),
        "load_average_1min_after": facts_after["load_average_1min"],
        "roofline_measurements": {k: dataclasses.asdict(m) for k, m in measurements.items()},
        "peak_memory_end": s07.peak_memory(),
        "numpy_blas_threads_env": {k: os.environ.get(k) for k in
                                   ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
        "models": models_info, "workloads": workloads_info,
        "greedy_agreement_vs_s05": agreements, "s06_decode_profile": profiles,
        "notes": ["greedy, EOS ignored, float32, batch 1, one request after another",
                  "timed through each engine's stream: a stamp per output as it arrives; ITL "
                  "is the gap between outputs (one token per output here), e2e ends at the "
                  "last output",
                  "ITL/floor: ITL p50 / (bytes a decode step moves at the run's median decode "
                  "context / measured copy bandwidth)",
                  "peak memory is the process's peak so far when the run ended (ru_maxrss)",
                  "the machine is shared with other jobs: see the load averages"]})
    path = s07.write_results(args.out, results)
    print(f"load average after: {facts_after['load_average_1min']:.1f}; written {path}")


if __name__ == "__main__":
    main()
