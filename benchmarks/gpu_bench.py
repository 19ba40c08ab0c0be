"""The GPU benchmarks that scripts/gpu_check.sh runs: tokens/s and memory bandwidth on a device.

    python benchmarks/gpu_bench.py bandwidth --json OUT/bandwidth.json
    python benchmarks/gpu_bench.py s06 --json OUT/bench_s06.json --bandwidth-json OUT/bandwidth.json
    python benchmarks/gpu_bench.py s08 --json OUT/bench_s08.json --budget-s 60
    python benchmarks/gpu_bench.py s12 --device cpu --shape tiny --json /tmp/s12.json  # smoke run
    python benchmarks/gpu_bench.py s14 --json OUT/bench_s14.json --bandwidth-json OUT/bandwidth.json
    python benchmarks/gpu_bench.py s15 --json OUT/bench_s15.json --budget-s 30

A benchmark, not a test: it prints and writes JSON, never asserts speed. Each part is its own
process, so scripts/gpu_check.sh can stop it at its time budget; the JSON file is rewritten
(atomically) after every measured row, so a part stopped early leaves what it had measured,
and `--budget-s` makes a part leave out the rows it has no time left for (said in the JSON).

The model: random weights in Qwen3-0.6B's shape (bench_s06_torch's `QWEN3_0_6B`, its
published config.json: 596M parameters), built by `transformers` from --seed directly on the
device (nothing is downloaded), in bfloat16 by default; our `TorchTransformer` holds the same
weights. Prompts are random token ids, every request greedy with EOS ignored, so each makes
exactly the tokens asked for. `--shape tiny` swaps in a 0.1M-parameter model and a few tokens
per part so that the whole path runs on a CPU in seconds (figures meaningless there).

Parts, each against the copy bandwidth measured by the `bandwidth` part (`--bandwidth-json`;
without it the part measures its own):
  bandwidth  the device's copy bandwidth (S07's `measure_bandwidth`: a large tensor copied
             device to device, bytes read + written, best of 10) and its bfloat16 matmul rate.
  s06        batch 1: S06's `Engine` against HF `generate()` on the same weights.
  s08        static batches of B = 1 .. 64: S08's `Engine` against HF's padded `generate()`.
  s09        a mixed-length workload: S09's continuous batching (`build_engine`, driven by
             `LLM`) against S08's static batches of the same size, in arrival order.
  s12        decode steps of one batch: S12's paged engine against S09's contiguous slots,
             steps alternated between the two.
  s14        S14's weight-only quantization against the bf16 model: the fused int8 and int4
             (g32) GEMVs (torch's `_weight_int8pack_mm`, tinygemm's `_weight_int4pack_mm`)
             and int4 dequantize-then-matmul against a bf16 F.linear, at the issue's 4096x1024
             and 11008x4096; then S06's `Engine` at batch 1 on the model in bf16, with its
             linear weights in int8 and in int4 g32 (`quantize_model`; embedding and tied
             head kept in bf16), tokens/s and the bandwidth of the bytes the step reads (the
             kernels' operands, scales included). Where torch has no CUDA int4 kernel for
             the device, the int4 rows say why (S14's refusal) and the part goes on.
  s15        S15's speculative decoding at batch 1, greedy, EOS ignored: the served engine
             (`s15_speculative.build_engine`: S14's engine, S13's paged KV and prefix
             caching, no quantization) plain, with n-gram prompt lookup (k = 4) and with the
             target's own int4 g32 copy as the draft (k = 4), on the bundled model (a
             Shakespeare prompt) and on a seeded random Qwen3-layout model of 100.1M
             parameters (bench_s14_quantization's E2E_SHAPE: hidden 768, 12 layers, vocab
             32,000; random prompt ids), each in the device's dtype: tokens/s (best of the
             repeats, the three engines interleaved), speedup over plain, acceptance rate and
             tokens per target forward (`SpecDecodingStats`), and the greedy ids against
             plain (the verify pass computes k + 1 positions at once, so in bf16 a near-tie
             may round the other way: reported, not asserted). A draft the device refuses
             (no int4 kernel) is a row that says why. The shape flag does not change the
             models here, only the tokens (tiny: a random model of the tiny shape instead of
             the 100M one).

How the figures are made. tokens/s: generated tokens / wall seconds of the whole call
(prefill included), the device synchronised before and after, best of the repeats, the engines'
runs interleaved. Decode step (s06, s08): (t(N tokens) - t(1 token)) / (N - 1), the same call
made twice, so each engine is timed through its public call with no instrument inside it. Decode
step (s09, s12): the engine's own step time (an observer's `StepResult.step_s`) over the steps
in which every scheduled request decodes one token. Bytes of a decode step: S07's
`decode_step_cost` / `batched_decode_cost` (every weight read once, plus each request's K and
V), at the step's context (s14: with each quantized weight's bytes replaced by what its
kernel reads, `QuantizedTensor.kernel_nbytes`); GEMV (s14): the median over alternated rounds
of `iters` back-to-back calls timed between two synchronisations, bytes = the weight as the
kernel reads it plus x and y; achieved bandwidth = bytes / decode step seconds, reported next to
the measured copy bandwidth as a fraction of it. A decode step far below 100 % of the copy is
limited not by memory but by the host: kernel launches and Python, step by step.

What it leaves out: HF's own continuous batching as S09's peer (bench_s09_continuous_batching.py
has it), prefill throughput on its own, S13's prefix caching and S19's server (no GPU part yet),
S15 at batch > 1 and with the 1-layer trained draft (CPU figures: S15's own benchmark);
S14's q8_0 / q4_0 (q4_0 runs int4 g32's kernel; q8_0 has no fused kernel), its 8-bit KV
cache and its perplexity (CPU figures: benchmarks/bench_s14_quantization.py).

Tests: tests/test_gpu_check.py runs every part here with --device cpu --shape tiny (the code
paths, not the figures) and checks that a failing part still writes its JSON with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("bandwidth", "s06", "s08", "s09", "s12", "s14", "s15")
H200_COPY_BYTES_PER_S = 4.3e12   # device-to-device copy measured on H200s (bytes read + written)

# The tiny shape: the 0.6B code path on a CPU in seconds (Qwen3 layout, GQA 4:2, tied head).
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=1024,
)
# S15's random target: bench_s14_quantization's E2E_SHAPE (100.1M parameters), written out here
# so that this script imports no other benchmark than bench_s06_torch (tests/test_gpu_check.py
# checks the two are equal).
S15_RANDOM_SHAPE = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, head_dim=64, vocab_size=32000, rope_theta=10_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
)
S15_PROMPT = "HAMLET.\nTo be, or not to be, that is the question:\n"   # the bundled model's
# What each part runs, per shape. tokens: new tokens per request; prompt: prompt tokens.
WORKLOADS = {
    "qwen3-0.6b": dict(
        s06=dict(prompt=32, tokens=128, repeats=3),
        s08=dict(prompt=32, tokens=64, batch_sizes=(1, 8, 32, 64), repeats=2),
        s09=dict(prompt=32, requests=64, max_num_seqs=16, min_tokens=8, max_tokens=64),
        s12=dict(prompt=512, batch=16, steps=32, warmup=3, block_size=16),
        s14=dict(prompt=32, tokens=64, repeats=3, group_size=32,
                 gemv_shapes=((4096, 1024), (11008, 4096)), gemv_iters=100, gemv_rounds=7),
        s15=dict(prompt=32, tokens=48, k=4, repeats=3, random_shape="S15_RANDOM_SHAPE"),
        bandwidth=dict(nbytes=4 * 2**30, matmul_n=8192)),
    "tiny": dict(
        s06=dict(prompt=8, tokens=4, repeats=1),
        s08=dict(prompt=8, tokens=4, batch_sizes=(3,), repeats=1),
        s09=dict(prompt=8, requests=5, max_num_seqs=2, min_tokens=2, max_tokens=6),
        s12=dict(prompt=16, batch=3, steps=3, warmup=1, block_size=4),
        s14=dict(prompt=8, tokens=4, repeats=1, group_size=32,
                 gemv_shapes=((128, 64), (256, 128)), gemv_iters=2, gemv_rounds=2),
        s15=dict(prompt=8, tokens=6, k=2, repeats=1, random_shape="TINY"),
        bandwidth=dict(nbytes=16 * 2**20, matmul_n=128)),
}


class Stopped(Exception):
    """SIGTERM or SIGINT (scripts/gpu_check.sh's `timeout`): save what was measured, leave."""


def _on_term(signum, frame):
    raise Stopped(f"stopped by signal {signum} (the part's time budget)")


class Report:
    """A part's JSON, rewritten atomically after every row (`save`), with the part's deadline.

    data["key"] holds the few figures the summary quotes; data["cut"] names rows left out
    for lack of time; data["status"] is "running" until the part ends."""

    def __init__(self, path: Path | None, part: str, budget_s: float | None):
        self.path, self.start = path, time.perf_counter()
        self.deadline = None if budget_s is None else self.start + budget_s
        self.data = {"part": part, "status": "running", "budget_s": budget_s, "key": {},
                     "rows": [], "cut": []}

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def fits(self, what: str, need_s: float) -> bool:
        """Whether `need_s` more seconds fit the budget; if not, the row is recorded as cut."""
        if need_s <= self.time_left():
            return True
        self.data["cut"].append(f"{what}: needs about {need_s:.0f} s, "
                                f"{max(self.time_left(), 0):.0f} s left")
        print(f"  cut (budget): {self.data['cut'][-1]}", flush=True)
        return False

    def save(self) -> None:
        if self.path is None:
            return
        self.data["seconds"] = round(time.perf_counter() - self.start, 3)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------
# Set-up shared by the parts (torch and the course's modules are imported here, on use, so
# that --help and the pure-CPU helpers work where torch or CUDA is missing)
# ---------------------------------------------------------------------------------------------

def course_imports():
    for sub in ("code", "benchmarks"):
        if str(ROOT / sub) not in sys.path:
            sys.path.insert(0, str(ROOT / sub))
    import torch
    import bench_s06_torch
    return torch, bench_s06_torch


def resolve(args):
    """(torch device, torch dtype) from --device / --dtype, S06's rules."""
    import s06_torch as s06
    return s06.resolve_device_dtype(args.device, args.dtype)


def build_model(args, device, dtype, report: Report, with_hf: bool = True):
    """(HF model in `dtype` or None, our TorchTransformer, IdTokenizer, S03 config): random
    weights from args.seed, made by transformers on the device itself (faster than on the
    host; a build that fails there is made on the host and moved, said in the report)."""
    torch, bench06 = course_imports()
    import s03_checkpoint
    import s03_transformer as s03
    import s06_torch as s06
    shape = bench06.QWEN3_0_6B if args.shape == "qwen3-0.6b" else TINY
    start = time.perf_counter()
    try:
        with torch.device(device):
            hf = bench06.random_qwen3(shape, args.seed)
        built_on = str(device)
    except (RuntimeError, TypeError) as err:     # an image whose HF cannot init on a device
        print(f"  HF model could not be built on {device} ({err}); building on the host")
        hf = bench06.random_qwen3(shape, args.seed).to(device)
        built_on = "cpu, then moved"
    config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
    ours = s06.TorchTransformer(config, hf.state_dict(), device, dtype, args.attention)
    if with_hf:
        hf = hf.to(dtype=dtype)
        hf.generation_config.eos_token_id = None   # never stop early: exactly N tokens
        hf.generation_config.pad_token_id = 0
    else:
        hf = None
    s06.synchronize(device)
    report.data["model"] = {
        "shape": args.shape, "config": shape, "parameters": s03.parameter_count(config),
        "dtype": str(dtype).removeprefix("torch."), "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "attention": args.attention, "seed": args.seed, "built_on": built_on,
        "build_s": round(time.perf_counter() - start, 2)}
    print(f"  model: {args.shape} shape, {s03.parameter_count(config) / 1e6:.1f}M parameters, "
          f"{report.data['model']['dtype']} on {device}, built in "
          f"{report.data['model']['build_s']:.1f} s", flush=True)
    return hf, ours, bench06.IdTokenizer(config.vocab_size), config


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random ids in [1, V) (0 is the EOS / pad id of these models)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab_size, size=(n, length)).tolist()


def as_text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def copy_bandwidth(args, device) -> tuple[float, str]:
    """The copy bandwidth to compare against: --bandwidth-json's, else measured here."""
    if args.bandwidth_json is not None:
        try:
            data = json.loads(Path(args.bandwidth_json).read_text(encoding="utf-8"))
            return float(data["key"]["copy_bytes_per_s"]), f"from {args.bandwidth_json}"
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"  {args.bandwidth_json} unreadable ({err}): measuring the copy here")
    import s07_roofline
    nbytes = WORKLOADS[args.shape]["bandwidth"]["nbytes"] // 4
    value, method = s07_roofline.measure_bandwidth(nbytes, 5, str(device))
    return value, method


def bandwidth_figures(moved_bytes: int, step_s: float, copy_bytes_per_s: float) -> dict:
    """Achieved bytes/s of a decode step and its fraction of the copy bandwidth (None when
    the step time came out <= 0: t(N) within t(1)'s noise, on a model too small to time)."""
    if step_s <= 0:
        return {"bytes_per_decode_step": moved_bytes, "achieved_bytes_per_s": None,
                "fraction_of_copy": None}
    achieved = moved_bytes / step_s
    return {"bytes_per_decode_step": moved_bytes, "achieved_bytes_per_s": achieved,
            "fraction_of_copy": achieved / copy_bytes_per_s}


def share(row: dict) -> str:
    """The row's achieved bandwidth as printed: GB/s and its fraction of the copy."""
    achieved = row.get("achieved_bytes_per_s", row.get("median_achieved_bytes_per_s"))
    if achieved is None:
        return "bandwidth not measurable (step time <= 0)"
    return f"{achieved / 1e9:,.0f} GB/s = {row['fraction_of_copy']:.1%} of the copy"


def best_times(report: Report, what: str, runs: dict, repeats: int, device, bench06
               ) -> tuple[dict, dict]:
    """({name: best wall seconds}, {name: what its last run returned}): one warm-up each, then `repeats` rounds of every run in
    turn (interleaved, so all see the same conditions). runs: {name: zero-argument call}.
    Stops early (keeping what it has) when the budget runs out."""
    for fn in runs.values():
        fn()                                                    # warm-up
    best = {name: float("inf") for name in runs}
    outputs = {}
    for r in range(repeats):
        round_start = time.perf_counter()
        for name, fn in runs.items():
            wall, _, outputs[name] = bench06.timed(fn, device)
            best[name] = min(best[name], wall)
        if r + 1 < repeats and not report.fits(f"{what}: repeat {r + 2}",
                                               time.perf_counter() - round_start):
            break
    return best, outputs


# ---------------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------------

def setup(args, report: Report, part: str, with_hf: bool = True):
    """What every model benchmark starts with: the device and dtype, the part's workload, the
    measured copy bandwidth (recorded in the report), the model (and HF's, with_hf) built
    from the seed, the report saved once. Returns (torch, bench06, device, dtype, work, copy,
    hf, ours, tokenizer, config)."""
    torch, bench06 = course_imports()
    device, dtype = resolve(args)
    work = WORKLOADS[args.shape][part]
    copy, copy_how = copy_bandwidth(args, device)
    report.data.update(workload=work, copy_bytes_per_s=copy, copy_source=copy_how)
    hf, ours, tokenizer, config = build_model(args, device, dtype, report, with_hf=with_hf)
    report.save()
    return torch, bench06, device, dtype, work, copy, hf, ours, tokenizer, config


def part_bandwidth(args, report: Report) -> None:
    torch, _ = course_imports()
    import s07_roofline
    device, _ = resolve(args)
    work = WORKLOADS[args.shape]["bandwidth"]
    value, method = s07_roofline.measure_bandwidth(work["nbytes"], 10, str(device))
    report.data["key"].update(copy_bytes_per_s=value)
    report.data["copy_method"] = method
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if "H200" in name:
        report.data["key"]["expected_h200_copy_bytes_per_s"] = H200_COPY_BYTES_PER_S
    print(f"  copy: {value / 1e9:,.0f} GB/s ({method})", flush=True)
    report.save()
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    flops, method = s07_roofline.measure_matmul_flops(work["matmul_n"], 5, str(device), dtype)
    report.data["key"][f"matmul_{dtype}_flops_per_s"] = flops
    report.data["matmul_method"] = method
    print(f"  matmul: {flops / 1e12:,.1f} TFLOP/s ({method})", flush=True)


def part_s06(args, report: Report) -> None:
    import s07_roofline
    torch, bench06, device, dtype, work, copy, hf, ours, tokenizer, config = setup(
        args, report, "s06")
    prompt = random_prompts(1, work["prompt"], config.vocab_size, args.seed)[0]
    n = work["tokens"]
    engines = {"ours": bench06.OurEngine(ours, tokenizer, prompt, n),
               "ours_1": bench06.OurEngine(ours, tokenizer, prompt, 1),
               "hf": bench06.HFEngine(hf, prompt, n, device),
               "hf_1": bench06.HFEngine(hf, prompt, 1, device)}
    with torch.inference_mode():
        best, outputs = best_times(report, "s06", {k: e.once for k, e in engines.items()},
                                   work["repeats"], device, bench06)
    moved = s07_roofline.decode_step_cost(config, len(prompt) + n // 2,
                                          torch.empty((), dtype=dtype).element_size()).bytes
    for name in ("ours", "hf"):
        step_s = (best[name] - best[f"{name}_1"]) / (n - 1)
        row = {"engine": "S06 Engine" if name == "ours" else "HF generate()",
               "batch_size": 1, "prompt_tokens": len(prompt), "generated_tokens": n,
               "tokens_per_s": n / best[name], "wall_s": best[name],
               "one_token_wall_s": best[f"{name}_1"], "decode_step_s": step_s,
               **bandwidth_figures(moved, step_s, copy)}
        report.data["rows"].append(row)
        print(f"  {row['engine']:<14} {row['tokens_per_s']:9.1f} tokens/s, decode step "
              f"{step_s * 1e3:.2f} ms, {share(row)}", flush=True)
    mine, theirs = report.data["rows"]
    report.data["key"].update(
        ours_tokens_per_s=mine["tokens_per_s"], hf_tokens_per_s=theirs["tokens_per_s"],
        ours_decode_fraction_of_copy=mine["fraction_of_copy"],
        hf_decode_fraction_of_copy=theirs["fraction_of_copy"],
        greedy_agreement=bench06.agreement(outputs["ours"], outputs["hf"]))
    print(f"  greedy ids ours vs HF: {report.data['key']['greedy_agreement']}")


def part_s08(args, report: Report) -> None:
    import s04_sampling as s04
    import s07_roofline
    import s08_static_batching as s08
    torch, bench06, device, dtype, work, copy, hf, ours, tokenizer, config = setup(
        args, report, "s08")
    n, width = work["tokens"], torch.empty((), dtype=dtype).element_size()
    prompts = random_prompts(max(work["batch_sizes"]), work["prompt"], config.vocab_size,
                             args.seed)

    @torch.inference_mode()
    def hf_batch(batch, tokens):
        ids, mask = s08.left_pad(batch, 0, device)
        hf.generate(ids, attention_mask=mask.long(), max_new_tokens=tokens, do_sample=False,
                    pad_token_id=0)

    last_s = 0.0
    for b in work["batch_sizes"]:
        if not report.fits(f"batch size {b}", 2 * last_s):
            break
        start = time.perf_counter()
        batch = prompts[:b]
        texts = [as_text(p) for p in batch]
        engine = s08.Engine(ours, tokenizer, max_context=work["prompt"] + n, max_batch_size=b)
        params = {t: s04.SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
                  for t in (n, 1)}
        runs = {"ours": lambda: engine.generate(texts, params[n]),
                "ours_1": lambda: engine.generate(texts, params[1]),
                "hf": lambda: hf_batch(batch, n), "hf_1": lambda: hf_batch(batch, 1)}
        best, _ = best_times(report, f"batch size {b}", runs, work["repeats"], device, bench06)
        moved = s07_roofline.batched_decode_cost(config, b, work["prompt"] + n // 2, width).bytes
        for name in ("ours", "hf"):
            step_s = (best[name] - best[f"{name}_1"]) / (n - 1)
            row = {"engine": "S08 Engine" if name == "ours" else "HF generate() padded",
                   "batch_size": b, "prompt_tokens": work["prompt"], "generated_tokens": b * n,
                   "tokens_per_s": b * n / best[name], "wall_s": best[name],
                   "decode_step_s": step_s, **bandwidth_figures(moved, step_s, copy)}
            report.data["rows"].append(row)
            print(f"  B={b:<3} {row['engine']:<21} {row['tokens_per_s']:9.1f} tokens/s, "
                  f"decode step {step_s * 1e3:.2f} ms, {share(row)}", flush=True)
        report.save()
        last_s = time.perf_counter() - start
    rows = report.data["rows"]
    for name, engine in (("ours", "S08 Engine"), ("hf", "HF generate() padded")):
        mine = [r for r in rows if r["engine"] == engine]
        if mine:
            top = max(mine, key=lambda r: r["tokens_per_s"])
            report.data["key"][f"{name}_best_tokens_per_s"] = top["tokens_per_s"]
            report.data["key"][f"{name}_best_batch_size"] = top["batch_size"]
            report.data["key"][f"{name}_batch1_decode_fraction_of_copy"] = mine[0][
                "fraction_of_copy"] if mine[0]["batch_size"] == 1 else None


class DecodeSteps:
    """An engine observer (`on_plan`, `on_step`, S09's seam) that keeps, for every step in which
    each scheduled request computes exactly one token, (batch size, mean context, step_s,
    model_s)."""

    def __init__(self):
        self.steps: list[tuple[int, float, float, float]] = []

    def on_plan(self, engine, plan) -> None:
        pass

    def on_step(self, engine, result) -> None:
        plan = result.plan
        counts = plan.num_scheduled_tokens
        if counts and all(c == 1 for c in counts.values()):
            contexts = [plan.num_computed_tokens[rid] + 1 for rid in counts]
            self.steps.append((len(contexts), sum(contexts) / len(contexts), result.step_s,
                               result.model_s))


def decode_summary(steps, config, width: int, copy: float) -> dict:
    """Median decode step and the median achieved bandwidth over `DecodeSteps.steps`."""
    import s07_roofline
    if not steps:
        return {"decode_steps": 0}
    achieved = [s07_roofline.batched_decode_cost(config, b, max(1, round(ctx)), width).bytes
                / step_s for b, ctx, step_s, _ in steps]
    median = statistics.median(achieved)
    return {"decode_steps": len(steps),
            "median_decode_batch": statistics.median(b for b, _, _, _ in steps),
            "median_decode_step_s": statistics.median(s for _, _, s, _ in steps),
            "median_decode_model_s": statistics.median(m for _, _, _, m in steps),
            "median_achieved_bytes_per_s": median, "fraction_of_copy": median / copy}


def part_s09(args, report: Report) -> None:
    import numpy as np
    import s04_sampling as s04
    import s08_static_batching as s08
    import s09_continuous_batching as s09
    from s09_llm import LLM
    torch, bench06, device, dtype, work, copy, _, ours, tokenizer, config = setup(
        args, report, "s09", with_hf=False)
    width = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(work["min_tokens"], work["max_tokens"] + 1,
                           size=work["requests"]).tolist()
    texts = [as_text(p) for p in random_prompts(work["requests"], work["prompt"],
                                                 config.vocab_size, args.seed)]
    params = [s04.SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True) for t in lengths]
    seqs, context = work["max_num_seqs"], work["prompt"] + work["max_tokens"]
    useful = sum(lengths)
    static = s08.Engine(ours, tokenizer, max_context=context, max_batch_size=seqs)
    engine = s09.build_engine(ours, tokenizer, max_context=context, max_num_seqs=seqs)
    observer = DecodeSteps()
    engine.observers.append(observer)
    llm = LLM(engine)

    def run_static():
        return [c for i in range(0, len(texts), seqs)
                for c in static.generate(texts[i:i + seqs], params[i:i + seqs])]

    def run_continuous():
        return llm.generate(texts, params)

    with torch.inference_mode():
        static.generate(texts[:1], params[:1])                # warm-up of both paths
        llm.generate(texts[:1], params[:1])
        for name, fn in (("S08 static batches", run_static), ("S09 continuous", run_continuous)):
            if report.data["rows"] and not report.fits(name, 1.5 * report.data["rows"][-1][
                    "wall_s"]):
                break
            observer.steps.clear()
            wall, _, done = bench06.timed(fn, device)
            assert [len(c.token_ids) for c in done] == lengths, "every request its max_tokens"
            row = {"engine": name, "requests": len(texts), "max_num_seqs": seqs,
                   "generated_tokens": useful, "tokens_per_s": useful / wall, "wall_s": wall}
            if name.startswith("S09"):
                row.update(decode_summary(observer.steps, config, width, copy))
            report.data["rows"].append(row)
            print(f"  {name:<20} {row['tokens_per_s']:9.1f} tokens/s ({useful} tokens in "
                  f"{wall:.2f} s)" + (f", median decode step "
                                     f"{row['median_decode_step_s'] * 1e3:.2f} ms at B="
                                     f"{row['median_decode_batch']:g}, {share(row)}"
                                     if row.get("decode_steps") else ""), flush=True)
            report.save()
    rows = {r["engine"]: r for r in report.data["rows"]}
    report.data["key"] = {f"{'static' if k.startswith('S08') else 'continuous'}_tokens_per_s":
                          r["tokens_per_s"] for k, r in rows.items()}
    if "S09 continuous" in rows:
        report.data["key"]["continuous_decode_fraction_of_copy"] = rows["S09 continuous"].get(
            "fraction_of_copy")


def part_s12(args, report: Report) -> None:
    import numpy as np
    import s04_sampling as s04
    import s09_continuous_batching as s09
    import s12_engine as s12
    torch, bench06, device, dtype, work, copy, _, ours, tokenizer, config = setup(
        args, report, "s12", with_hf=False)
    width = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(args.seed)
    b, p = work["batch"], work["prompt"]
    lens = rng.integers(int(p * 0.75), int(p * 1.25) + 1, size=b).tolist()   # +-25 %
    prompts = [rng.integers(1, config.vocab_size, size=n).tolist() for n in lens]
    steps = work["warmup"] + work["steps"]
    context = max(lens) + steps + 4
    params = s04.SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    options = dict(max_context=context, max_num_seqs=b, sync_timing=True)
    engines = {"S09 contiguous slots": s09.build_engine(ours, tokenizer, **options),
               f"S12 paged, block {work['block_size']}": s12.build_engine(
                   ours, tokenizer, block_size=work["block_size"], **options)}
    observers = {}
    with torch.inference_mode():
        for name, engine in engines.items():
            observers[name] = DecodeSteps()
            engine.observers.append(observers[name])
            for ids in prompts:
                engine.add_request(as_text(ids), params)
            while any(len(r.output_ids) == 0 for r in engine.requests.values()):
                engine.step()                                  # the prefill steps
        for _ in range(work["warmup"]):
            for engine in engines.values():
                engine.step()
        for observer in observers.values():
            observer.steps.clear()
        for i in range(work["steps"]):                         # alternated, step by step
            for engine in engines.values():
                engine.step()
            if i % 8 == 7 and report.time_left() < 5:
                report.data["cut"].append(f"decode steps after {i + 1}: budget")
                break
        for engine in engines.values():
            for rid in list(engine.requests):
                engine.abort(rid)
    for name, observer in observers.items():
        row = {"engine": name, "batch_size": b, "prompt_tokens": lens,
               **decode_summary(observer.steps, config, width, copy)}
        if row["decode_steps"]:
            row["tokens_per_s"] = row["median_decode_batch"] / row["median_decode_step_s"]
            print(f"  {name:<22} decode step {row['median_decode_step_s'] * 1e3:.2f} ms "
                  f"(forward {row['median_decode_model_s'] * 1e3:.2f} ms), "
                  f"{row['tokens_per_s']:.0f} tokens/s, {share(row)}", flush=True)
        report.data["rows"].append(row)
    contiguous, paged = report.data["rows"]
    if contiguous["decode_steps"] and paged["decode_steps"]:
        report.data["key"] = {
            "paged_decode_step_s": paged["median_decode_step_s"],
            "contiguous_decode_step_s": contiguous["median_decode_step_s"],
            "paged_over_contiguous": (paged["median_decode_step_s"]
                                      / contiguous["median_decode_step_s"]),
            "paged_fraction_of_copy": paged["fraction_of_copy"],
            "contiguous_fraction_of_copy": contiguous["fraction_of_copy"]}


def part_s14(args, report: Report) -> None:
    """S14 on the device: fused GEMVs, then batch-1 decode of S06's engine, bf16 vs int8 vs
    int4 (see the module docstring). A scheme torch has no kernel for here is a row with
    "refused" (S14's ParameterError, naming the rule), not a failed part."""
    import s06_torch as s06
    import s07_roofline
    import s14_quantization as s14q
    import torch.nn.functional as F
    from s01_generation_loop import ParameterError
    torch, bench06 = course_imports()
    device, dtype = resolve(args)
    base_label = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
    work = WORKLOADS[args.shape]["s14"]
    copy, copy_how = copy_bandwidth(args, device)
    report.data.update(workload=work, copy_bytes_per_s=copy, copy_source=copy_how)
    width = torch.empty((), dtype=dtype).element_size()
    g = work["group_size"]
    schemes = {"int8": dict(scheme="int8"), f"int4 g{g}": dict(scheme="int4", group_size=g)}
    report.data["gemv"], report.data["refused"] = [], {}

    # --- the GEMVs: one token's product x (1, K) @ W^T, W (N, K) ----------------------------
    generator = torch.Generator().manual_seed(args.seed)
    for n, k in work["gemv_shapes"]:
        w = (torch.randn(n, k, generator=generator) * 0.02).to(device)
        x = torch.randn(1, k, generator=generator).to(device, dtype)
        variants = {base_label: (lambda w16=w.to(dtype): F.linear(x, w16), n * k * width)}
        for label, options in [*schemes.items(), (f"int4 g{g} dequant+matmul",
                                                  dict(scheme="int4", group_size=g,
                                                       path="reference"))]:
            options = dict(path="fused") | options
            try:
                q = s14q.QuantizedTensor.from_float(w, dtype=dtype, **options)
            except ParameterError as err:
                report.data["refused"][f"gemv {n}x{k} {label}"] = str(err)
                print(f"  {n}x{k} {label}: refused ({err})", flush=True)
                continue
            variants[label] = (lambda q=q: F.linear(x, q), q.kernel_nbytes)
        iters = work["gemv_iters"]
        with torch.inference_mode():
            rounds = {name: device_rounds(fn, iters, device) for name, (fn, _) in
                      variants.items()}
            eager = {name: [] for name in variants}
            graph = {name: [] for name, (_, how) in rounds.items() if how != "eager"}
            for _ in range(work["gemv_rounds"]):                        # alternated rounds
                for name, (fn, _) in variants.items():
                    eager[name].append(seconds(lambda: [fn() for _ in range(iters)], device)
                                       / iters)
                    if name in graph:
                        graph[name].append(seconds(rounds[name][0], device) / iters)
        measured = graph if len(graph) == len(variants) else eager
        base = statistics.median(measured[base_label])
        for name, (_, nbytes) in variants.items():
            t = statistics.median(measured[name])
            moved = nbytes + (k + n) * width                            # weight + x + y
            row = {"shape": [n, k], "variant": name, "seconds_per_call": t,
                   "timed": rounds[name][1] if measured is graph else "eager",
                   "eager_seconds_per_call": statistics.median(eager[name]),
                   "speedup_over_base": base / t, "bytes_per_call": moved,
                   "achieved_bytes_per_s": moved / t, "fraction_of_copy": moved / t / copy}
            report.data["gemv"].append(row)
            print(f"  GEMV {n}x{k} {name:<24} {t * 1e6:9.1f} us  x{base / t:5.2f} vs "
                  f"{base_label}, {moved / t / 1e9:,.0f} GB/s "
                  f"({row['fraction_of_copy']:.1%} of the copy); eager "
                  f"{row['eager_seconds_per_call'] * 1e6:.1f} us", flush=True)
        if measured is eager and graph != {}:
            report.data["gemv_timing_note"] = "some variants could not be captured in a CUDA " \
                                              "graph: every variant timed eagerly"
        report.save()

    key = report.data["key"]                  # the largest shape's speedups over base_label
    for row in report.data["gemv"]:
        if row["shape"] == report.data["gemv"][-1]["shape"] and row["variant"] != base_label:
            n, k = row["shape"]
            key[f"gemv_{n}x{k}_{row['variant'].replace(' ', '_')}_speedup"] = \
                row["speedup_over_base"]
    if report.data["refused"]:
        key["refused"] = sorted(report.data["refused"])
    report.save()

    # --- batch-1 decode: S06's engine on the model as built, and quantized copies ----------
    if not report.fits("batch-1 decode", 15):
        return
    hf, base_model, tokenizer, config = build_model(args, device, dtype, report)
    state = hf.state_dict()
    models = {base_label: base_model}
    for label, options in schemes.items():
        copy_model = s06_model(config, state, device, dtype, args.attention)
        try:
            models[label] = s14q.quantize_model(copy_model, **options)
        except ParameterError as err:
            report.data["refused"][f"decode {label}"] = str(err)
            print(f"  decode {label}: refused ({err})", flush=True)
    del hf, state
    report.save()
    prompt = random_prompts(1, work["prompt"], config.vocab_size, args.seed)[0]
    n = work["tokens"]
    runs = {}
    for label, model in models.items():
        runs[label] = bench06.OurEngine(model, tokenizer, prompt, n).once
        runs[f"{label}_1"] = bench06.OurEngine(model, tokenizer, prompt, 1).once
    with torch.inference_mode():
        best, outputs = best_times(report, "s14 decode", runs, work["repeats"], device, bench06)
    full = s07_roofline.decode_step_cost(config, len(prompt) + n // 2, width).bytes
    for label, model in models.items():
        quantized = s14q.quantized_weights(model).values()
        moved = full - sum(q.numel() * width - q.kernel_nbytes for q in quantized)
        step_s = (best[label] - best[f"{label}_1"]) / (n - 1)
        row = {"engine": f"S06 Engine, {label}", "weights": label, "batch_size": 1,
               "prompt_tokens": len(prompt), "generated_tokens": n,
               "tokens_per_s": n / best[label], "wall_s": best[label],
               "one_token_wall_s": best[f"{label}_1"], "decode_step_s": step_s,
               "greedy_vs_" + base_label: bench06.agreement(outputs[label],
                                                            outputs[base_label]),
               **bandwidth_figures(moved, step_s, copy)}
        report.data["rows"].append(row)
        print(f"  {row['engine']:<22} {row['tokens_per_s']:9.1f} tokens/s, decode step "
              f"{step_s * 1e3:.2f} ms, {moved / 1e6:,.0f} MB read per step, {share(row)}",
              flush=True)
    report.save()
    key = report.data["key"]
    rows = {r["weights"]: r for r in report.data["rows"]}
    for label, row in rows.items():
        tag = label.replace(" ", "_")
        key[f"decode_{tag}_tokens_per_s"] = row["tokens_per_s"]
        key[f"decode_{tag}_fraction_of_copy"] = row["fraction_of_copy"]
        if label != base_label:
            key[f"decode_{tag}_speedup"] = (row["tokens_per_s"]
                                            / rows[base_label]["tokens_per_s"])
    if report.data["refused"]:
        key["refused"] = sorted(report.data["refused"])


def part_s15(args, report: Report) -> None:
    """S15 on the device: plain, n-gram and int4-draft speculation at batch 1 on two models
    (see the module docstring). Rows are saved after each model; a model that does not fit
    the budget is cut, said in "cut"."""
    import s03_checkpoint
    import s03_transformer as s03
    import s04_sampling as s04
    import s06_torch as s06
    import s15_speculative as s15
    from s01_generation_loop import ParameterError
    from s09_llm import LLM
    torch, bench06 = course_imports()
    device, dtype = resolve(args)
    work = WORKLOADS[args.shape]["s15"]
    report.data.update(workload=work, models=[], refused={})
    n, k = work["tokens"], work["k"]
    methods = {"plain": dict(speculative=None),
               f"ngram k={k}": dict(speculative="ngram", num_speculative_tokens=k),
               f"draft int4 g32 k={k}": dict(speculative="draft", draft_model="int4",
                                             num_speculative_tokens=k)}

    def bundled():
        model = s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR, device, dtype,
                                                     args.attention)
        tokenizer = s03_checkpoint.CheckpointTokenizer.from_pretrained(s03.BUNDLED_MODEL_DIR)
        return "bundled", model, tokenizer, S15_PROMPT

    def random_target():
        shape = globals()[work["random_shape"]]
        try:
            with torch.device(device):
                hf = bench06.random_qwen3(shape, args.seed)
        except (RuntimeError, TypeError):        # as build_model: made on the host, moved
            hf = bench06.random_qwen3(shape, args.seed).to(device)
        config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
        model = s06.TorchTransformer(config, hf.state_dict(), device, dtype, args.attention)
        del hf
        ids = random_prompts(1, work["prompt"], config.vocab_size, args.seed)[0]
        label = f"random {s03.parameter_count(config) / 1e6:.1f}M"
        return label, model, bench06.IdTokenizer(config.vocab_size), as_text(ids)

    params = s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    key = report.data["key"]
    last_s = 0.0
    for make in (bundled, random_target):
        if not report.fits(f"model {make.__name__}", 1.5 * last_s):
            break
        start = time.perf_counter()
        label, model, tokenizer, prompt = make()
        prompt_len = len(tokenizer.encode(prompt))
        report.data["models"].append({
            "label": label, "parameters": s03.parameter_count(model.config),
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "prompt_tokens": prompt_len, "build_s": round(time.perf_counter() - start, 2)})
        runs, stats = {}, {}
        for name, options in methods.items():
            try:
                engine = s15.build_engine(model, tokenizer, max_num_seqs=1,
                                          max_context=prompt_len + n + k + 2, **options)
            except ParameterError as err:            # e.g. no int4 kernel on this device
                report.data["refused"][f"{label} {name}"] = str(err)
                print(f"  {label} {name}: refused ({err})", flush=True)
                continue
            llm, stats[name] = LLM(engine), s15.SpecDecodingStats()

            def run(llm=llm, engine=engine, name=name):
                observed = s15.SpecDecodingStats()
                engine.observers.append(observed)
                try:
                    done = llm.generate(prompt, params)
                finally:
                    engine.observers.remove(observed)
                stats[name] = observed
                return done.token_ids
            runs[name] = run
        with torch.inference_mode():
            best, outputs = best_times(report, f"s15 {label}", runs, work["repeats"], device,
                                       bench06)
        for name in runs:
            st = stats[name]
            row = {"model": label, "engine": name, "batch_size": 1, "prompt_tokens": prompt_len,
                   "generated_tokens": n, "tokens_per_s": n / best[name], "wall_s": best[name],
                   "speedup_over_plain": best["plain"] / best[name],
                   "acceptance_rate": st.acceptance_rate if name != "plain" else None,
                   "acceptance_per_position": st.acceptance_per_position,
                   "tokens_per_target_forward": (st.tokens_per_forward if name != "plain"
                                                 else 1.0),
                   "num_draft_tokens": st.num_draft_tokens,
                   "num_accepted_tokens": st.num_accepted_tokens,
                   "greedy_vs_plain": bench06.agreement(outputs[name], outputs["plain"])}
            report.data["rows"].append(row)
            tag = f"{label.split()[0]}_{name.split()[0]}"
            key[f"{tag}_tokens_per_s"] = row["tokens_per_s"]
            if name != "plain":
                key[f"{tag}_speedup"] = row["speedup_over_plain"]
                key[f"{tag}_acceptance"] = row["acceptance_rate"]
            print(f"  {label:<13} {name:<20} {row['tokens_per_s']:9.1f} tokens/s  "
                  f"x{row['speedup_over_plain']:.2f}" + (
                      f", acceptance {st.acceptance_rate:.1%}, "
                      f"{st.tokens_per_forward:.2f} tokens/forward" if name != "plain" else "")
                  + f", greedy vs plain: {row['greedy_vs_plain']}", flush=True)
        report.save()
        del model, runs
        last_s = time.perf_counter() - start
    if report.data["refused"]:
        key["refused"] = sorted(report.data["refused"])


def seconds(fn, device) -> float:
    """Wall seconds of fn(), the device synchronised before and after."""
    import s06_torch as s06
    s06.synchronize(device)
    start = time.perf_counter()
    fn()
    s06.synchronize(device)
    return time.perf_counter() - start


def device_rounds(fn, iters: int, device) -> tuple:
    """(a zero-argument call that runs fn() iters times as one CUDA graph replay, its
    description), or (None, "eager") on the CPU or where the capture fails (the reason
    printed). A replay launches the recorded kernels without Python in between, so it times
    the device's work, not the host's: at 4096x1024 a bf16 GEMV takes a few microseconds on
    the device, less than the host needs to launch it through F.linear and S14's
    __torch_function__ (the eager time, reported beside it). Warm-up on a side stream
    first, as torch.cuda.graphs' documentation asks."""
    import torch
    for _ in range(2):
        fn()                                                            # warm-up, eager
    if device.type != "cuda":
        return None, "eager"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()                                                  # its own warm-up
        return graph.replay, f"CUDA graph of {iters} calls, replayed"
    except Exception as err:     # a capture torch refuses: time it eagerly, say why
        print(f"  (no CUDA graph: {type(err).__name__}: {str(err).splitlines()[0][:120]})")
        return None, "eager"


def s06_model(config, state, device, dtype, attention):
    """Another S06 model holding the same weights (a quantized copy needs its own: S14's
    `quantize_model` works in place)."""
    import s06_torch as s06
    return s06.TorchTransformer(config, state, device, dtype, attention)


PART_FUNCTIONS = {"bandwidth": part_bandwidth, "s06": part_s06, "s08": part_s08,
                  "s09": part_s09, "s12": part_s12, "s14": part_s14, "s15": part_s15}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Parts: " + ", ".join(PARTS) + ". See the module docstring for what each runs.")
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the figures here (rewritten after every row)")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: bfloat16 on CUDA, float32 on the CPU (S06's rule)")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=tuple(WORKLOADS),
                        help="the model and workload sizes (tiny: a CPU smoke run)")
    parser.add_argument("--attention", default="sdpa", choices=("manual", "sdpa"),
                        help="our engines' attention (HF uses SDPA)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds this part may take: rows that would not fit are cut")
    parser.add_argument("--bandwidth-json", type=Path, default=None,
                        help="the bandwidth part's JSON: its copy bandwidth is the reference")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    report = Report(args.json, args.part, args.budget_s)
    report.data["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    previous = signal.signal(signal.SIGTERM, _on_term)
    print(f"gpu_bench {args.part}: device {args.device}, shape {args.shape}, budget "
          f"{'none' if args.budget_s is None else f'{args.budget_s:.0f} s'}", flush=True)
    try:
        torch, _ = course_imports()
        if args.device == "cpu":
            torch.set_num_threads(1)     # a CPU rehearsal: one thread, as every CPU timing here
        PART_FUNCTIONS[args.part](args, report)
        report.data["status"] = "ok"
        return 0
    except (Stopped, KeyboardInterrupt) as stop:
        stop = stop if isinstance(stop, Stopped) else Stopped("stopped by SIGINT")
        report.data["status"], report.data["reason"] = "timeout", str(stop)
        print(f"  {stop}: partial figures kept", flush=True)
        return 124
    except Exception as err:   # any failure: record it, keep the rows measured before it
        report.data["status"] = "failed"
        report.data["reason"] = f"{type(err).__name__}: {err}"
        report.data["traceback"] = traceback.format_exc()
        traceback.print_exc()
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        report.save()


if __name__ == "__main__":
    sys.exit(main())
