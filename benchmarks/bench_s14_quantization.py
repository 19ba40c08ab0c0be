"""S14's measurement: what quantized weights and an 8-bit KV cache cost in quality and buy in
memory and speed, every ratio taken within one run.

    python benchmarks/bench_s14_quantization.py --quick                 # a smoke run, < 2 min
    python benchmarks/bench_s14_quantization.py --sections quality,kv   # some sections only
    python benchmarks/bench_s14_quantization.py --out                   # the committed record

A benchmark, not a test: it prints, never asserts (a target missed is printed as "MISSED").
Float32 models, the CPU unless --device cuda (the GEMV section is the CPU's kernels always),
torch threads pinned by --threads (default 1). Sections (--sections, default all, run in this
order):

1. quality: the bundled model (data/model) on its whole validation split (S14's
   `s14_quality.evaluate`, llama.cpp's scoring: chunks of 256 tokens, the second half of each
   scored) against the fp32 model: int8 per channel, int4 g32 symmetric / asymmetric, int4
   g128, Q8_0, Q4_0 on the linear layers (each scheme's default path, the one the engines
   run: fused kernels with bfloat16 activations for int8 / int4 / Q4_0, the reference for
   Q8_0); then int8, int4 g32 and Q4_0 with the token embedding and the tied LM head quantized
   too (`quantize_embedding=True`), and int4 g32 with the embedding/head in int8 (llama.cpp's
   mixes keep the output tensor in more bits; built here by quantizing the embedding after
   `quantize_model`). Reported: PPL, delta PPL (absolute and %), mean KL divergence to fp32,
   same top-1, each with its standard error, and bits per weight of the linear layers. The KV
   cache dtypes (`s14_kv_cache.prefill_logits`: each chunk prefilled through S12's paged pool
   stored in that dtype) against the same paged pool in float32. Beside them llama.cpp's own
   Llama-3-8B table, printed as a static reference (LLAMA_CPP_ANCHOR, theirs, not measured
   here).
2. kernels: batch-1 GEMVs (N, K) = (4096, 1024) and (11008, 4096), S14's `gemv_timings`
   (median of --gemv-repeats, the variants alternating within each repeat): fp32, bf16, int8
   fused, int4 g32 fused, int4 dequantize-then-matmul (the reference path). Targets (from the
   chapter's issue): int8 >= 2x fp32, int4 >= 3x, dequantize-then-matmul slower than fp32.
3. e2e: a seeded random Qwen3-layout model (E2E_SHAPE: hidden 768, 12 layers, vocab 32,000,
   tied embeddings; 100.1M parameters, random_qwen3 of bench_s06_torch), batch 1, greedy,
   --tokens tokens after a 24-token prompt, EOS ignored, through S06's engine (Part I: one
   request, no scheduler, the least overhead per token) for fp32, int8, int4 g32 (linear
   layers; embedding/head fp32, the default) and int8 / int4 with the embedding/head too,
   against Hugging Face `generate()` fp32 on the same weights; the runs alternate (one of
   each in turn, --repeats rounds, after a warm-up round). tokens/s = tokens / the median
   wall seconds of the call (prefill included); decode ms = median of the engine's decode
   forward passes (Stats.pass_times_s); bytes per token = S07's `decode_step_cost` at the
   median decode context (every weight once, K/V) with each quantized tensor's float32 bytes
   replaced by what its kernel reads (`kernel_nbytes`); achieved bandwidth = bytes per token
   / decode time; the floor = bytes / S07's `measure_bandwidth` (STREAM copy, this thread count).
   Targets: int8 >= 2x and int4 >= 3x the fp32 engine's tokens/s. Then the bundled model the
   same way (fp32, int8, int4; HF fp32): 5.8 MB that live in the caches, overhead-bound.
4. batch: the same random model in S14's Part II engine (`s14_quantization.build_engine`:
   S13's paged, chunked engine) at batch 1 and at batch --batch (default 32): all requests
   prefilled, then --batch-steps x --repeats decode steps timed, every engine stepping in
   turn; tokens/s = batch / median step seconds. At batch 32 the fp32 step is closer to the
   compute roof (S07's `roofline_floor_s` with `measure_matmul_flops`), so weight-only
   quantization pays less: its kernels still compute in bf16 and dequantize per call. (The
   compute roof is measured in the same run: on a loaded CPU it is measured low, and a step
   may then beat its "floor"; the record keeps the load.)
5. kv: tokens a pool of --kv-budget-mib holds (`s14_kv_cache.pool_tokens`, block size 16)
   in float32 / bfloat16 / fp8_e4m3 / fp8_per_token_head / int8 for the bundled model, the
   e2e model and Llama-3.1-8B (S12's published config), with section 1's quality cost.

--quick is a smoke run (it checks that everything runs): 8 validation chunks instead of 246,
5 GEMV repeats, 16 tokens x 1 repeat, 2 decode steps; its figures are noisier and not the
committed record's (QUICK_DISCLAIMER is printed before and after).

Flags are checked before any model is built (a usage error, exit status 2, naming the rule):
--threads, --seed and --device as every Part II script (`s08_cli.check_common_arguments`),
every count in the range its help gives. The CPU is shared: `uptime` is recorded before and
after, and each section's 1-minute load average. JSON is written only where asked: --json
PATH, or --out (chapters/figures/s14_quantization.json, the record the chapter quotes).

References: llama.cpp tools/perplexity/README.md ("LLaMA 3 8b Scoreboard", revision
f364eb6f, added in PR #6936 by J. Gaessler); bench_s06_torch.py (HF against S06's engine),
bench_s12_paged_attention.py (alternated decode steps), S07's roofline (code/s07_roofline.py).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06, before NumPy loads

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_roofline as roof  # noqa: E402
import s08_cli  # noqa: E402
import s14_kv_cache as kvq  # noqa: E402
import s14_quality as quality  # noqa: E402
import s14_quantization as q  # noqa: E402
from bench_s06_torch import IdTokenizer, random_qwen3  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402

COMMITTED_JSON = ROOT / "chapters" / "figures" / "s14_quantization.json"
SECTIONS = ("quality", "kernels", "e2e", "batch", "kv")
QUICK_DISCLAIMER = ("--quick: a smoke run (8 validation chunks, 5 GEMV repeats, 16 tokens x 1 "
                    "repeat, 2 decode steps); its figures are noisier than the committed "
                    "record's: chapters/figures/s14_quantization.json")
E2E_SHAPE = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, head_dim=64, vocab_size=32000, rope_theta=10_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
)
GEMV_SHAPES = ((4096, 1024), (11008, 4096))
PROMPT_TOKENS = 24           # the e2e prompt (random ids), as bench_s06_torch
BATCH_PROMPT_TOKENS = 8      # each request's prompt in section 4
MAX_CHUNKS = 246             # the bundled model's validation split: 63,066 tokens // 256
MAX_GEMV_REPEATS = 1000
MAX_TOKENS = 512
MAX_REPEATS = 20
MAX_BATCH = 64
MAX_BATCH_STEPS = 256
MAX_KV_BUDGET_MIB = 1 << 20
TARGETS = {"quality": {"int8_delta_ppl_pct_below": 0.1, "int4_delta_ppl_pct_below": 1.0,
                       "int4_same_top1_at_least": 0.90},
           "kernels": {"int8 fused": 2.0, "int4 fused": 3.0, "int4 dequant+matmul": 1.0},
           "e2e": {"int8": 2.0, "int4": 3.0}}

# (label, quantize_model's scheme and options, the embedding/head's own scheme or None)
WEIGHT_VARIANTS = (
    ("int8", "int8", {}, None),
    ("int4 g32 sym", "int4", {}, None),
    ("int4 g32 asym", "int4", {"symmetric": False}, None),
    ("int4 g128 sym", "int4", {"group_size": 128}, None),
    ("q8_0", "q8_0", {}, None),
    ("q4_0", "q4_0", {}, None),
    ("int8 +emb/head", "int8", {"quantize_embedding": True}, None),
    ("int4 g32 +emb/head", "int4", {"quantize_embedding": True}, None),
    ("q4_0 +emb/head", "q4_0", {"quantize_embedding": True}, None),
    ("int4 g32, emb/head int8", "int4", {}, "int8"),
)
# "bfloat16" is left out: s14_kv_cache's pool fails to write bfloat16 codes (reported)
KV_DTYPES = ("fp8_e4m3", "fp8_per_token_head", "int8")
POOL_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "fp8_per_token_head", "int8")
E2E_VARIANTS = (("fp32", None, {}), ("int8", "int8", {}), ("int4", "int4", {}),
                ("int8 +emb/head", "int8", {"quantize_embedding": True}),
                ("int4 +emb/head", "int4", {"quantize_embedding": True}))

# llama.cpp's own figures, NOT measured here: tools/perplexity/README.md, "LLaMA 3 8b
# Scoreboard" (revision f364eb6f, CUDA backend, 1x RTX 4090, Wikitext-2, against FP16 logits;
# added by PR #6936, J. Gaessler, 2024), no imatrix rows. same_top_p from the README's "LLaMA 2
# vs. LLaMA 3 Quantization comparison" table (no Q4_0 column there: None).
LLAMA_CPP_ANCHOR = {
    "source": "https://github.com/ggml-org/llama.cpp/blob/master/tools/perplexity/README.md "
              "(LLaMA 3 8b Scoreboard, revision f364eb6f; PR #6936)",
    "model": "Llama-3-8B", "base": "f16", "base_ppl": 6.233160, "base_size_gib": 14.97,
    "rows": [
        {"quantization": "q8_0", "size_gib": 7.96, "ppl": 6.234284, "delta_ppl": 0.002650,
         "delta_ppl_se": 0.001006, "kld": 0.001355, "kld_se": 0.000006, "same_top_p": 97.674},
        {"quantization": "q4_K_M", "size_gib": 4.58, "ppl": 6.407115, "delta_ppl": 0.175482,
         "delta_ppl_se": 0.004620, "kld": 0.031273, "kld_se": 0.000238, "same_top_p": 91.901},
        {"quantization": "q4_0", "size_gib": 4.34, "ppl": 6.700147, "delta_ppl": 0.468514,
         "delta_ppl_se": 0.007951, "kld": 0.071940, "kld_se": 0.000491, "same_top_p": None},
    ],
}


def load() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


def verdict(ok: bool) -> str:
    return "pass" if ok else "MISSED"


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def quantize_embedding_only(model: s06.TorchTransformer, scheme: str) -> None:
    """Store the token embedding (and the LM head tied to it, or the untied head) in `scheme`
    after `quantize_model` did the linear layers: llama.cpp's mixes (a 4-bit body with an
    8-bit or 6-bit output tensor). The same `QuantizedTensor` Parameters `quantize_model`
    makes with quantize_embedding=True, at another scheme."""
    def made(w):
        return nn.Parameter(q.QuantizedTensor.from_float(
            w, scheme, path=q.default_path(scheme), dtype=model.dtype), requires_grad=False)
    tied = model.lm_head is model.embed_tokens
    model.embed_tokens = made(model.embed_tokens)
    model.lm_head = model.embed_tokens if tied else made(model.lm_head)


def quantized(make, scheme, options, head_scheme=None):
    """make() -> a fresh full-precision TorchTransformer, quantized as asked (None: fp32)."""
    model = make()
    if scheme is not None:
        q.quantize_model(model, scheme, **options)
    if head_scheme is not None:
        quantize_embedding_only(model, head_scheme)
    return model


def bits_per_weight(model) -> dict:
    """Bits per weight of the linear layers, and the whole model's bytes, as stored."""
    m = q.scheme_memory(model, "")
    return {"linear_bits_per_weight": m.bits_per_weight, "model_bytes": m.model_bytes}


def bytes_per_token(model: s06.TorchTransformer, context: int) -> int:
    """What a batch-1 decode step reads: S07's `decode_step_cost` (every weight once, a tied
    head once, K and V of `context` positions, float32) with every quantized tensor's float32
    bytes replaced by what its kernel reads."""
    cost = roof.decode_step_cost(model.config, context, 4).bytes
    for p in q.quantized_weights(model).values():
        cost += p.kernel_nbytes - 4 * p.numel()
    return cost


# ---------------------------------------------------------------------------------------------
# 1. quality
# ---------------------------------------------------------------------------------------------

def section_quality(args) -> dict:
    bundled = s03.BUNDLED_MODEL_DIR

    def make():
        return s06.TorchTransformer.from_pretrained(bundled, args.device, torch.float32)

    reference = make()
    window = reference.config.max_position_embeddings
    weights = []
    print(f"\n1. quality: the bundled model ({s03.parameter_count(reference.config):,} "
          f"parameters), validation split, {args.chunks} chunks of {window} (second halves "
          "scored), against fp32; each scheme's default path")
    print(f"{'weights':<25}{'bits/w':>7}{'PPL':>9}{'dPPL':>17}{'dPPL %':>17}{'mean KLD':>21}"
          f"{'same top-1':>17}")

    def row(label, rep, bits):
        print(f"{label:<25}{bits:>7.3f}{rep.ppl:>9.3f}"
              f"{rep.delta_ppl:>+9.4f} ±{rep.delta_ppl_se:.4f}"
              f"{rep.delta_ppl_pct:>+9.3f} ±{rep.delta_ppl_pct_se:.3f}"
              f"{rep.mean_kld:>11.2e} ±{rep.mean_kld_se:.1e}"
              f"{100 * rep.same_top1:>9.2f} ±{100 * rep.same_top1_se:.2f}")

    for label, scheme, options, head in WEIGHT_VARIANTS:
        model = quantized(make, scheme, options, head)
        rep = quality.evaluate(model, reference, max_chunks=args.chunks)
        memory = bits_per_weight(model)
        weights.append({"label": label, "scheme": scheme, "options": options,
                        "embedding_head": head or ("scheme" if options.get(
                            "quantize_embedding") else "float32"),
                        "path": q.default_path(scheme), **memory, "report": rep.to_dict(),
                        "load_average_1min": load()})
        row(label, rep, memory["linear_bits_per_weight"])
        del model
    fp32 = bits_per_weight(reference)
    ref_ppl, ref_se = weights[0]["report"]["ref_ppl"], weights[0]["report"]["ref_ppl_se"]
    print(f"{'fp32 (the reference)':<25}{fp32['linear_bits_per_weight']:>7.3f}{ref_ppl:>9.3f}"
          f" ± {ref_se:.3f}")

    # The KV cache: every chunk prefilled through S12's pool in each dtype, against float32's.
    def through(kv_dtype):
        return lambda ids: kvq.prefill_logits(reference, ids, kv_dtype)
    kv_rows = []
    print("\nKV cache dtype (the bundled model's fp32 weights; the reference: the same paged "
          "pool in float32)")
    base = through("auto")          # S12's pool in the model's float32
    for name in KV_DTYPES:
        rep = quality.evaluate(through(name), base, context=window, max_chunks=args.chunks)
        bpt = kvq.kv_cache_bytes_per_token(kvq.model_config(reference), name)
        kv_rows.append({"kv_cache_dtype": name, "bytes_per_token": bpt, "report": rep.to_dict(),
                        "load_average_1min": load()})
        cfg = reference.config
        values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        row(name, rep, 8 * bpt / values)
    print("(bits/w of a KV row: bits per cached value, scales included)")

    t = TARGETS["quality"]
    by = {w["label"]: w["report"] for w in weights}
    checks = [
        ("int8 dPPL % < 0.1", abs(by["int8"]["delta_ppl_pct"]) < t["int8_delta_ppl_pct_below"]),
        ("q4_0 dPPL % < 1", by["q4_0"]["delta_ppl_pct"] < t["int4_delta_ppl_pct_below"]),
        ("int4 g32 dPPL % < 1",
         by["int4 g32 sym"]["delta_ppl_pct"] < t["int4_delta_ppl_pct_below"]),
        ("q4_0 same top-1 >= 90 %", by["q4_0"]["same_top1"] >= t["int4_same_top1_at_least"]),
        ("int4 g32 same top-1 >= 90 %",
         by["int4 g32 sym"]["same_top1"] >= t["int4_same_top1_at_least"])]
    ratios = {base_label: by[f"{base_label} +emb/head"]["mean_kld"] / by[
        {"int4 g32": "int4 g32 sym"}.get(base_label, base_label)]["mean_kld"]
        for base_label in ("int8", "int4 g32", "q4_0")}
    print("targets: " + "; ".join(f"{name}: {verdict(ok)}" for name, ok in checks))
    print("quantizing the embedding/head too multiplies the mean KLD by " + ", ".join(
        f"{k} {v:.2f}x" for k, v in ratios.items()))

    a = LLAMA_CPP_ANCHOR
    print(f"\nllama.cpp's table, THEIRS, not measured here ({a['model']}, Wikitext-2, against "
          f"{a['base']}, PPL {a['base_ppl']}):\n  {a['source']}")
    for r in a["rows"]:
        top = "" if r["same_top_p"] is None else f", same top p {r['same_top_p']:.3f} %"
        pct = 100 * r["delta_ppl"] / (r["ppl"] - r["delta_ppl"])
        print(f"  {r['quantization']:<7} {r['size_gib']:>5.2f} GiB  dPPL {r['delta_ppl']:+.6f} "
              f"± {r['delta_ppl_se']:.6f} ({pct:+.2f} %)"
              f", KLD {r['kld']:.6f}{top}")
    return {"model": str(bundled.relative_to(ROOT)), "context": window, "chunks": args.chunks,
            "num_tokens": weights[0]["report"]["num_tokens"], "fp32": fp32,
            "ref_ppl": ref_ppl, "ref_ppl_se": ref_se, "weights": weights, "kv": kv_rows,
            "targets": dict(checks), "embedding_kld_ratio": ratios,
            "llama_cpp_anchor": LLAMA_CPP_ANCHOR}


# ---------------------------------------------------------------------------------------------
# 2. kernels
# ---------------------------------------------------------------------------------------------

def gemv_bytes(n: int, k: int) -> dict:
    """Bytes each GEMV variant reads for its weight (N, K): the fused kernels' operands
    (`kernel_nbytes`); dequantize-then-matmul reads the codes and scales, writes a float32
    copy and reads it again."""
    w = torch.zeros(n, k)
    int8 = q.QuantizedTensor.from_float(w, "int8", path="fused")
    int4 = q.QuantizedTensor.from_float(w, "int4", group_size=32, path="fused")
    return {"fp32": 4 * n * k, "bf16": 2 * n * k, "int8 fused": int8.kernel_nbytes,
            "int4 fused": int4.kernel_nbytes,
            "int4 dequant+matmul": int4.quantized_nbytes + 4 * n * k * 2}


def section_kernels(args) -> dict:
    print(f"\n2. kernels: batch-1 GEMV x (1, K) @ W^T on the CPU, median of "
          f"{args.gemv_repeats}, variants alternating (S14's gemv_timings)")
    before = load()
    timings = q.gemv_timings(GEMV_SHAPES, repeats=args.gemv_repeats, seed=args.seed)
    rows, checks = [], []
    for (n, k), t in timings.items():
        moved = gemv_bytes(n, k)
        speed = {name: t["fp32"] / s for name, s in t.items()}
        print(f"  W {n} x {k}: " + ", ".join(
            f"{name} {s * 1e3:.3f} ms ({speed[name]:.2f}x, {moved[name] / s / 1e9:.1f} GB/s)"
            for name, s in t.items()))
        for name, target in TARGETS["kernels"].items():
            ok = speed[name] >= target if name != "int4 dequant+matmul" else speed[name] < 1
            checks.append({"shape": [n, k], "variant": name, "speedup": speed[name],
                           "target": (f">= {target}x" if name != "int4 dequant+matmul"
                                      else "< 1x (slower than fp32)"), "pass": ok})
        rows.append({"n": n, "k": k, "median_s": t, "speedup_vs_fp32": speed,
                     "weight_bytes": moved})
    print("  targets: " + "; ".join(f"{c['shape'][0]}x{c['shape'][1]} {c['variant']} "
                                    f"{c['speedup']:.2f}x {c['target']}: {verdict(c['pass'])}"
                                    for c in checks))
    print("  (bytes: the weight's as the kernel reads it; dequant+matmul also writes and reads "
          "a float32 copy)")
    return {"shapes": rows, "targets": checks, "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# 3. e2e at batch 1, and 4. batch 32
# ---------------------------------------------------------------------------------------------

class E2EModel:
    """The seeded random Qwen3-layout model: HF's, and a maker of fresh TorchTransformers."""

    def __init__(self, args):
        start = time.perf_counter()
        self.hf = random_qwen3(E2E_SHAPE, args.seed)
        self.config = s03_checkpoint.config_from_hf_dict(self.hf.config.to_dict())
        self.state = self.hf.state_dict()
        self.device = args.device
        self.params = s03.parameter_count(self.config)
        self.build_s = time.perf_counter() - start

    def make(self) -> s06.TorchTransformer:
        return s06.TorchTransformer(self.config, self.state, self.device, torch.float32, "sdpa")


def run_batch1(models: dict, hf, tokenizer, prompt: list[int], args, peaks) -> dict:
    """S06's engine on each model and HF generate on hf, alternating, --repeats of each."""
    n = args.tokens
    text = " ".join(map(str, prompt)) if isinstance(tokenizer, IdTokenizer) \
        else tokenizer.decode(prompt)
    assert tokenizer.encode(text) == prompt
    params = s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engines = {label: s06.Engine(m, tokenizer, max_context=len(prompt) + n)
               for label, m in models.items()}
    ids = torch.tensor([prompt], device=args.device)
    if hf is not None:
        hf = hf.to(args.device)
        hf.generation_config.eos_token_id = None    # never stop early: exactly n tokens
        hf.generation_config.pad_token_id = 0
    hf_kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                     pad_token_id=0)
    wall = {label: [] for label in [*engines, "HF generate fp32"]}
    decode = {label: [] for label in engines}
    tokens = {}
    with torch.inference_mode():
        def run(label):
            s06.synchronize(torch.device(args.device))
            start = time.perf_counter()
            if label in engines:
                c = engines[label].generate(text, params)
                out, passes = c.token_ids, c.stats.pass_times_s[1:]
            else:
                out, passes = hf.generate(ids, **hf_kwargs)[0, len(prompt):].tolist(), None
            s06.synchronize(torch.device(args.device))
            return time.perf_counter() - start, out, passes

        for label in wall:                                   # warm-up, not kept
            if label in engines or hf is not None:
                run(label)
        for _ in range(args.repeats):
            for label in wall:
                if label not in engines and hf is None:
                    continue
                seconds, out, passes = run(label)
                assert len(out) == n, (label, len(out))
                wall[label].append(seconds)
                tokens[label] = out
                if passes is not None:
                    decode[label].extend(passes)
    context = statistics.median_low(range(len(prompt) + 1, len(prompt) + n))
    rows = {}
    for label, seconds in wall.items():
        if not seconds:
            continue
        row = {"tokens_per_s": n / statistics.median(seconds), "wall_s": seconds}
        if label in engines:
            moved = bytes_per_token(models[label], context)
            dec = statistics.median(decode[label])
            row.update(decode_ms=dec * 1e3, bytes_per_token=moved,
                       achieved_bytes_per_s=moved / dec,
                       floor_ms=moved / peaks.bandwidth_bytes_per_s * 1e3,
                       greedy_equal_to_fp32=sum(a == b for a, b in zip(tokens[label],
                                                                       tokens["fp32"])))
        rows[label] = row
    fp32 = rows["fp32"]["tokens_per_s"]
    for row in rows.values():
        row["speedup_vs_fp32"] = row["tokens_per_s"] / fp32
    return {"context_for_bytes": context, "rows": rows}


def print_batch1(title: str, result: dict, peaks) -> None:
    print(title)
    print(f"  {'engine':<22}{'tokens/s':>9}{'vs fp32':>8}{'decode ms':>10}{'MB/token':>9}"
          f"{'GB/s':>7}{'floor ms':>9}{'of bw':>7}")
    for label, r in result["rows"].items():
        if "decode_ms" in r:
            print(f"  {label:<22}{r['tokens_per_s']:>9.1f}{r['speedup_vs_fp32']:>7.2f}x"
                  f"{r['decode_ms']:>10.2f}{r['bytes_per_token'] / 1e6:>9.1f}"
                  f"{r['achieved_bytes_per_s'] / 1e9:>7.1f}{r['floor_ms']:>9.2f}"
                  f"{r['achieved_bytes_per_s'] / peaks.bandwidth_bytes_per_s:>7.0%}")
        else:
            print(f"  {label:<22}{r['tokens_per_s']:>9.1f}{r['speedup_vs_fp32']:>7.2f}x")


def section_e2e(args, e2e: E2EModel, models: dict, peaks) -> dict:
    tokenizer = IdTokenizer(E2E_SHAPE["vocab_size"])
    prompt = np.random.default_rng(args.seed).integers(1, E2E_SHAPE["vocab_size"],
                                                       size=PROMPT_TOKENS).tolist()
    before = load()
    result = run_batch1(models, e2e.hf, tokenizer, prompt, args, peaks)
    print_batch1(f"\n3. e2e, batch 1: random Qwen3 layout, {e2e.params / 1e6:.1f}M parameters "
                 f"(hidden {E2E_SHAPE['hidden_size']}, {E2E_SHAPE['num_hidden_layers']} layers, "
                 f"vocab {E2E_SHAPE['vocab_size']:,}, tied), S06's engine, {args.tokens} tokens "
                 f"after {PROMPT_TOKENS}, median of {args.repeats}; floor = bytes / "
                 f"{peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s (S07)", result, peaks)
    checks = []
    for label in ("int8", "int4", "int8 +emb/head", "int4 +emb/head"):
        target = TARGETS["e2e"][label.split()[0]]
        speed = result["rows"][label]["speedup_vs_fp32"]
        checks.append({"variant": label, "speedup": speed, "target": target,
                       "pass": speed >= target})
    print("  targets (tokens/s against the fp32 engine): " + "; ".join(
        f"{c['variant']} {c['speedup']:.2f}x >= {c['target']:g}x: {verdict(c['pass'])}"
        for c in checks))
    result.update(targets=checks, load_average_1min=[before, load()])

    # The bundled model: overhead-bound, the same engines.
    bundled = s03.BUNDLED_MODEL_DIR
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32).eval()
    tok = s03_checkpoint.CheckpointTokenizer.from_pretrained(bundled)
    small = {label: quantized(lambda: s06.TorchTransformer.from_pretrained(
        bundled, args.device, torch.float32), scheme, opts)
        for label, scheme, opts in E2E_VARIANTS[:3]}
    ids = tok.encode("HAMLET.\nTo be, or not to be, that is the question:\n")
    before = load()
    small_result = run_batch1(small, hf, tok, ids, args, peaks)
    print_batch1(f"  the bundled model ({s03.parameter_count(small['fp32'].config) / 1e6:.1f}M "
                 f"parameters, 5.8 MB in float32: it lives in the caches, so each step costs "
                 f"its per-operation overheads, not its bytes)", small_result, peaks)
    small_result["load_average_1min"] = [before, load()]
    result["bundled"] = small_result
    return result


def section_batch(args, e2e: E2EModel, models: dict, peaks) -> dict:
    tokenizer = IdTokenizer(E2E_SHAPE["vocab_size"])
    rng = np.random.default_rng(args.seed + 1)
    steps = args.batch_steps * args.repeats
    context = BATCH_PROMPT_TOKENS + steps + 2
    sizes = sorted({1, args.batch})
    engines, prompts = {}, {}
    for size in sizes:
        prompts[size] = [" ".join(map(str, rng.integers(1, E2E_SHAPE["vocab_size"],
                                                        size=BATCH_PROMPT_TOKENS)))
                         for _ in range(size)]
        for label, model in models.items():
            engines[(label, size)] = q.build_engine(
                model, tokenizer, max_context=context, max_num_seqs=size,
                max_num_batched_tokens=size * BATCH_PROMPT_TOKENS, block_size=16)
    params = s04.SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    before = load()
    with torch.inference_mode():
        for (label, size), engine in engines.items():
            for p in prompts[size]:
                engine.add_request(p, params)
            while not all(r.output_ids for r in engine.requests.values()):   # prefills
                engine.step()
        times = {key: [] for key in engines}
        for _ in range(steps):
            for key, engine in engines.items():          # alternating, step by step
                s06.synchronize(torch.device(args.device))
                start = time.perf_counter()
                outs = engine.step()
                s06.synchronize(torch.device(args.device))
                times[key].append(time.perf_counter() - start)
                assert sum(len(o.new_token_ids) for o in outs) == key[1], "a pure decode step"
    rows = []
    for size in sizes:
        fp32 = statistics.median(times[("fp32", size)])
        cost = roof.batched_decode_cost(e2e.config, size, BATCH_PROMPT_TOKENS + steps // 2)
        for label in models:
            med = statistics.median(times[(label, size)])
            rows.append({"variant": label, "batch": size, "step_ms": med * 1e3,
                         "step_ms_all": [t * 1e3 for t in times[(label, size)]],
                         "tokens_per_s": size / med, "speedup_vs_fp32": fp32 / med})
        rows[-len(models)]["fp32_floor_ms"] = {
            "bandwidth": roof.bandwidth_floor_s(cost, peaks) * 1e3,
            "roofline": roof.roofline_floor_s(cost, peaks) * 1e3,
            "intensity_flop_per_byte": cost.intensity}
    print(f"\n4. batch: the same model in S14's Part II engine (S13's paged engine), "
          f"{BATCH_PROMPT_TOKENS}-token prompts, {steps} decode steps each, alternating; "
          f"median step")
    print(f"  {'variant':<18}" + "".join(f"{'batch ' + str(s) + ' tok/s':>16}{'vs fp32':>8}"
                                       for s in sizes))
    for label in models:
        cells = [next(r for r in rows if r["variant"] == label and r["batch"] == s)
                 for s in sizes]
        print(f"  {label:<18}" + "".join(f"{c['tokens_per_s']:>16.1f}{c['speedup_vs_fp32']:>7.2f}x"
                                         for c in cells))
    for size in sizes:
        f = next(r for r in rows if r["variant"] == "fp32" and r["batch"] == size)
        floor = f["fp32_floor_ms"]
        print(f"  fp32 at batch {size}: step {f['step_ms']:.1f} ms; S07's floors: bandwidth "
              f"{floor['bandwidth']:.1f} ms, roofline {floor['roofline']:.1f} ms "
              f"({floor['intensity_flop_per_byte']:.1f} FLOP/byte; ridge "
              f"{peaks.ridge_intensity:.1f})")
    return {"prompt_tokens": BATCH_PROMPT_TOKENS, "decode_steps": steps, "rows": rows,
            "load_average_1min": [before, load()]}


# ---------------------------------------------------------------------------------------------
# 5. kv
# ---------------------------------------------------------------------------------------------

def section_kv(args, kv_quality: list | None) -> dict:
    budget = args.kv_budget_mib * 2**20
    bundled = kvq.model_config(s06.TorchTransformer.from_pretrained(
        s03.BUNDLED_MODEL_DIR, "cpu", torch.float32))
    configs = {"bundled model": bundled,
               "e2e model": dict(E2E_SHAPE, model_type="qwen3", torch_dtype="float32"),
               "Llama-3.1-8B": "Llama-3.1-8B"}
    print(f"\n5. kv: tokens a {args.kv_budget_mib} MiB pool holds (block size 16, the null block "
          "excluded), bytes per token in brackets")
    print(f"  {'model':<15}" + "".join(f"{d:>26}" for d in POOL_DTYPES))
    rows = []
    for name, cfg in configs.items():
        cells = {d: (kvq.pool_tokens(cfg, d, budget), kvq.kv_cache_bytes_per_token(cfg, d))
                 for d in POOL_DTYPES}
        rows.append({"model": name, "tokens": {d: c[0] for d, c in cells.items()},
                     "bytes_per_token": {d: c[1] for d, c in cells.items()}})
        print(f"  {name:<15}" + "".join(f"{f'{t:,} ({b:,})':>26}" for t, b in cells.values()))
    if kv_quality:
        print("  quality cost (section 1, the bundled model): " + "; ".join(
            f"{r['kv_cache_dtype']} dPPL {r['report']['delta_ppl_pct']:+.3f} %, KLD "
            f"{r['report']['mean_kld']:.1e}" for r in kv_quality))
    return {"budget_mib": args.kv_budget_mib, "block_size": 16, "rows": rows}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def section_list(text: str) -> list[str]:
    """--sections' type: comma-separated names of SECTIONS, run in SECTIONS' order."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--sections takes comma-separated names from "
                                         f"{','.join(SECTIONS)} (got {text!r})")
    return [s for s in SECTIONS if s in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="S14 benchmark: quantized weights and KV "
                                     "cache; quality, GEMV speed, end-to-end tokens/s at batch "
                                     "1 and 32, KV capacity.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (under 2 minutes): 8 chunks, 5 GEMV repeats, 16 "
                             "tokens x 1 repeat, 2 decode steps (default: off)")
    parser.add_argument("--sections", type=section_list, default=list(SECTIONS),
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--chunks", type=int, default=None,
                        help=f"validation chunks scored in section 1, 1 to {MAX_CHUNKS} "
                             f"(default: {MAX_CHUNKS}, the whole split; --quick 8)")
    parser.add_argument("--gemv-repeats", type=int, default=None,
                        help=f"timed calls of each GEMV variant, 1 to {MAX_GEMV_REPEATS} "
                             "(default: 50, --quick 5)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens generated per e2e request, 1 to {MAX_TOKENS} (default: "
                             "64, --quick 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"e2e runs of each engine and decode-step rounds of section 4, 1 "
                             f"to {MAX_REPEATS} (default: 5, --quick 1)")
    parser.add_argument("--batch", type=int, default=32,
                        help=f"requests decoding at once in section 4, 1 to {MAX_BATCH} "
                             "(default: %(default)s)")
    parser.add_argument("--batch-steps", type=int, default=None,
                        help=f"timed decode steps per engine per repeat in section 4, 1 to "
                             f"{MAX_BATCH_STEPS} (default: 8, --quick 2)")
    parser.add_argument("--kv-budget-mib", type=int, default=1024,
                        help=f"the KV pool's byte budget in section 5, MiB, 1 to "
                             f"{MAX_KV_BUDGET_MIB} (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights and prompts, >= 0 (default: "
                             "%(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s; the GEMVs run on "
                             "the CPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--json", default=None,
                        help="also write the figures to this JSON file (default: none)")
    parser.add_argument("--out", action="store_true",
                        help=f"write {COMMITTED_JSON.relative_to(ROOT)}, the committed record "
                             "(default: off)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --threads, --seed, --device
    quick = args.quick
    for name, full, small in (("chunks", MAX_CHUNKS, 8), ("gemv_repeats", 50, 5),
                              ("tokens", 64, 16), ("repeats", 5, 1), ("batch_steps", 8, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    check = s07.check_count
    check(parser, "--chunks", args.chunks, 1, MAX_CHUNKS)
    check(parser, "--gemv-repeats", args.gemv_repeats, 1, MAX_GEMV_REPEATS)
    check(parser, "--tokens", args.tokens, 1, MAX_TOKENS)
    check(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    check(parser, "--batch", args.batch, 1, MAX_BATCH)
    check(parser, "--batch-steps", args.batch_steps, 1, MAX_BATCH_STEPS)
    check(parser, "--kv-budget-mib", args.kv_budget_mib, 1, MAX_KV_BUDGET_MIB)
    if args.out and args.json is not None:
        parser.error("--out writes the committed record; give --json or --out, not both")
    if args.json is not None:
        check_json(parser, args.json)
    bundled = s03.BUNDLED_MODEL_DIR
    if ({"quality", "e2e", "kv"} & set(args.sections)) and not (bundled / "config.json").exists():
        parser.error(f"the bundled model is not in {bundled} yet: train it with "
                     "python scripts/train_bundled_model.py")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        print(QUICK_DISCLAIMER)
    started = time.perf_counter()
    before = uptime()
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), device "
          f"{args.device} ({platform.machine()}, {os.cpu_count()} logical cores); sections: "
          f"{','.join(args.sections)}")
    figures: dict = {}
    peaks = None
    if {"e2e", "batch"} & set(args.sections):
        small = args.quick
        peaks = roof.measure_peaks(args.device, bandwidth_bytes=(64 if small else 256) * 2**20,
                                   matmul_n=1024 if small else 2048)
        figures["machine"] = {"bandwidth_bytes_per_s": peaks.bandwidth_bytes_per_s,
                              "bandwidth_method": peaks.bandwidth_method,
                              "matmul_flops_per_s": peaks.matmul_flops_per_s,
                              "matmul_method": peaks.matmul_method}
        print(f"S07's roofs: {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s ("
              f"{peaks.bandwidth_method}); {peaks.matmul_flops_per_s / 1e9:.1f} GFLOP/s")
    section_s = {}
    if "quality" in args.sections:
        mark = time.perf_counter()
        figures["quality"] = section_quality(args)
        section_s["quality"] = time.perf_counter() - mark
    if "kernels" in args.sections:
        mark = time.perf_counter()
        figures["kernels"] = section_kernels(args)
        section_s["kernels"] = time.perf_counter() - mark
    if {"e2e", "batch"} & set(args.sections):
        e2e = E2EModel(args)
        models = {label: quantized(e2e.make, scheme, opts)
                  for label, scheme, opts in E2E_VARIANTS}
        figures["e2e_model"] = {"shape": E2E_SHAPE, "parameters": e2e.params,
                                "fp32_bytes": 4 * e2e.params,
                                "variants": {label: bits_per_weight(m)
                                             for label, m in models.items()}}
        if "e2e" in args.sections:
            mark = time.perf_counter()
            figures["e2e"] = section_e2e(args, e2e, models, peaks)
            section_s["e2e"] = time.perf_counter() - mark
        if "batch" in args.sections:
            mark = time.perf_counter()
            figures["batch"] = section_batch(args, e2e, models, peaks)
            section_s["batch"] = time.perf_counter() - mark
        del models, e2e
    if "kv" in args.sections:
        figures["kv"] = section_kv(args, figures.get("quality", {}).get("kv"))
    after = uptime()
    elapsed = time.perf_counter() - started
    print(f"\nafter: {after}\ntotal {elapsed:.0f} s")
    if args.quick:
        print(QUICK_DISCLAIMER)
    figures = {"config": {k: getattr(args, k) for k in (
        "quick", "sections", "chunks", "gemv_repeats", "tokens", "repeats", "batch",
        "batch_steps", "kv_budget_mib", "seed", "device", "threads")} | {
            "torch": torch.__version__, "machine": platform.machine(),
            "logical_cores": os.cpu_count()},
        **figures, "uptime_before": before, "uptime_after": after, "elapsed_s": elapsed,
        "section_s": section_s}
    target = COMMITTED_JSON if args.out else (Path(args.json) if args.json else None)
    if target is not None:
        write_json(target, figures, indent=1)
        print(f"wrote {target}")
    return figures


if __name__ == "__main__":
    main()
