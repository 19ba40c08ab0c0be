"""Greedy generation at batch size 1: the S06 engine vs Hugging Face `generate()`, same weights.

    python benchmarks/bench_s06_torch.py                      # CUDA + bf16 if present, else CPU fp32
    python benchmarks/bench_s06_torch.py --device cpu --threads 2 --qwen-tokens 8
    python benchmarks/bench_s06_torch.py --skip-qwen          # the bundled model only
    python benchmarks/bench_s06_torch.py --json out.json      # also save the figures

A benchmark, not a test: it prints, never asserts speed. Two models, each run by both engines
in the same process, on the same weights, device and dtype:
  (a) the bundled model (data/model); while it has not been trained yet, a model of the same
      shape (scripts/train_bundled_model.py's defaults) with random weights, said in the output;
  (b) a model with Qwen3-0.6B's shape, from its published config.json (hidden_size 1024,
      intermediate_size 3072, 28 layers, 16 query heads, 8 key/value heads, head_dim 128,
      vocab_size 151936, rope_theta 1e6, tied embeddings, rms_norm_eps 1e-6), random weights
      built here with `transformers` (no download): 596M parameters, 2.4 GB in float32.
Both engines generate exactly the same number of tokens (EOS ignored: `ignore_eos` for ours,
no eos_token_id for HF), greedy, from the same prompt ids; the script checks and prints whether
the token ids agree.

What is printed, per model and engine:
  tokens/s       generated tokens / wall seconds of the whole call (prefill included), best of
                 --repeats runs without any instrumentation, the two engines' runs interleaved
                 so that both see the same load.
  CPU ms         this process's CPU seconds per generated token (time.process_time), least of
                 the same runs. On a shared CPU it is the steadier figure: wall time also
                 counts the time the scheduler gave to other jobs. On CUDA it is the host's
                 work per token, waiting for the device included.
  ms/step        wall seconds / generated tokens of the fastest of --repeats instrumented runs
                 (interleaved as well), split into
  model ms       the forward passes (ours: `Stats.pass_times_s`; HF: forward hooks on the
                 model), with the device synchronised after every forward (CUDA; a no-op on
                 the CPU), so the model's time is its real time, not its launch time; and
  other ms       everything else: sampling, stop checks, detokenising (ours), cache and
                 input bookkeeping, logits processors and stopping criteria (HF), the token's
                 trip to the host, and each call's one-off set-up spread over its tokens.
  ratio          ours / HF tokens per second, and HF / ours CPU time per token.

The CPU is shared with other jobs while these figures are taken: compare rows of one run, and
expect run-to-run changes of tens of percent. --threads (default 1) sets torch's intra-op
threads for both engines.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402

MAX_BUNDLED_TOKENS = 224    # the bundled model's window (256) less 32: the prompt is 17 or 24
MAX_QWEN_TOKENS = 1024
MAX_REPEATS = 20

# Qwen/Qwen3-0.6B config.json (published values; only the shape matters here).
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
)
# scripts/train_bundled_model.py defaults, the shape of data/model/config.json (a test checks
# the two agree): used with random weights when the bundled model is not trained yet.
BUNDLED_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=2048, rope_theta=10000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=256,
)


class IdTokenizer:
    """Prompts as ids written out ("5 17 3"); the random models have no tokenizer of their own.
    vocab_size: the model's V (the engine checks that the tokenizer covers every id)."""

    eos_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


@dataclass
class Run:
    """One engine on one model. Plain runs give the speed, instrumented runs the split."""

    wall_s: list[float] = field(default_factory=list)  # plain runs, wall seconds each
    cpu_s: list[float] = field(default_factory=list)   # plain runs, this process's CPU seconds
    step_ms: float = float("inf")   # fastest instrumented run: wall ms per generated token
    model_ms: float = 0.0           # ... of which in forward passes
    token_ids: list[int] = field(default_factory=list)

    def keep_split(self, step_ms: float, model_ms: float, token_ids: list[int]) -> None:
        """Record an instrumented run if it is the fastest so far."""
        if step_ms < self.step_ms:
            self.step_ms, self.model_ms, self.token_ids = step_ms, model_ms, token_ids

    def tokens_per_s(self, n_tokens: int) -> float:
        return n_tokens / min(self.wall_s)

    def cpu_ms_per_token(self, n_tokens: int) -> float:
        return min(self.cpu_s) / n_tokens * 1e3

    @property
    def other_ms(self) -> float:
        return self.step_ms - self.model_ms


def timed(fn, device: torch.device) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result) of fn(), the device synchronised
    before and after so queued work is neither missed nor counted twice."""
    s06.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    s06.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def random_qwen3(shape: dict, seed: int):
    """A transformers Qwen3ForCausalLM with `shape`, random weights (HF's own initialisation,
    normal with std 0.02), float32, on the CPU, in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(**shape, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def prepare(name: str, device: torch.device, dtype: torch.dtype, attention: str, seed: int):
    """(label, HF model on device/dtype, our TorchTransformer, tokenizer, prompt ids)."""
    bundled = s03.BUNDLED_MODEL_DIR
    if name == "bundled" and (bundled / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32).eval()
        ours = s06.TorchTransformer.from_pretrained(bundled, device, dtype, attention)
        tokenizer = s03_checkpoint.CheckpointTokenizer.from_pretrained(bundled)
        prompt = tokenizer.encode("HAMLET.\nTo be, or not to be, that is the question:\n")
        label = f"bundled model ({s03.parameter_count(ours.config) / 1e6:.1f}M parameters)"
    else:
        shape = BUNDLED_SHAPE if name == "bundled" else QWEN3_0_6B
        start = time.perf_counter()
        hf = random_qwen3(shape, seed)
        config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
        ours = s06.TorchTransformer(config, hf.state_dict(), device, dtype, attention)
        tokenizer = IdTokenizer(shape["vocab_size"])
        prompt = np.random.default_rng(seed).integers(1, shape["vocab_size"], size=24).tolist()
        label = (f"{'bundled-model shape' if name == 'bundled' else 'Qwen3-0.6B shape'}, random "
                 f"weights ({s03.parameter_count(config) / 1e6:.0f}M parameters; built in "
                 f"{time.perf_counter() - start:.0f} s)")
        if name == "bundled":
            label += " [data/model not trained yet]"
    hf = hf.to(device=device, dtype=dtype)
    hf.generation_config.eos_token_id = None   # never stop early: both make exactly N tokens
    hf.generation_config.pad_token_id = 0
    return label, hf, ours, tokenizer, prompt


class OurEngine:
    """The S06 engine on one model: `once()` is one plain greedy request, `split()` one request
    with the device synchronised after every forward (sync_timing), for the time split."""

    def __init__(self, model: s06.TorchTransformer, tokenizer, prompt: list[int], n_tokens: int):
        is_ids = isinstance(tokenizer, IdTokenizer)
        self.text = " ".join(map(str, prompt)) if is_ids else tokenizer.decode(prompt)
        assert tokenizer.encode(self.text) == prompt
        self.params = s04.SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
        # The cache is preallocated: size it for this request (40,960 positions of the Qwen3
        # shape would reserve 940 MB in float32); HF's DynamicCache grows as it goes instead.
        context = len(prompt) + n_tokens
        self.engine = s06.Engine(model, tokenizer, max_context=context)
        self.timed_engine = s06.Engine(model, tokenizer, max_context=context, sync_timing=True)
        self.n_tokens = n_tokens

    def once(self) -> list[int]:
        return self.engine.generate(self.text, self.params).token_ids

    def split(self, run: Run) -> None:
        start = time.perf_counter()
        completion = self.timed_engine.generate(self.text, self.params)
        wall = time.perf_counter() - start
        assert len(completion.token_ids) == self.n_tokens
        run.keep_split(wall / self.n_tokens * 1e3,
                       sum(completion.stats.pass_times_s) / self.n_tokens * 1e3,
                       completion.token_ids)


class HFEngine:
    """transformers `generate()` on the same weights: `once()` plain, `split()` with forward
    hooks on the model that synchronise the device and time every forward pass."""

    def __init__(self, hf, prompt: list[int], n_tokens: int, device: torch.device):
        self.hf, self.device, self.n_tokens, self.prompt_len = hf, device, n_tokens, len(prompt)
        self.ids = torch.tensor([prompt], device=device)
        self.kwargs = dict(attention_mask=torch.ones_like(self.ids), do_sample=False,
                           max_new_tokens=n_tokens, pad_token_id=0)

    @torch.inference_mode()
    def once(self) -> list[int]:
        out = self.hf.generate(self.ids, **self.kwargs)
        return out[0, self.prompt_len:].tolist()

    def split(self, run: Run) -> None:
        forward_s: list[float] = []
        began: list[float] = []

        def before(module, args, kwargs):
            s06.synchronize(self.device)
            began.append(time.perf_counter())

        def after(module, args, kwargs, output):
            s06.synchronize(self.device)
            forward_s.append(time.perf_counter() - began[-1])

        hooks = [self.hf.register_forward_pre_hook(before, with_kwargs=True),
                 self.hf.register_forward_hook(after, with_kwargs=True)]
        try:
            wall, _, token_ids = timed(self.once, self.device)
        finally:
            for hook in hooks:
                hook.remove()
        assert len(token_ids) == self.n_tokens == len(forward_s)
        run.keep_split(wall / self.n_tokens * 1e3, sum(forward_s) / self.n_tokens * 1e3, token_ids)


def agreement(ours: list[int], theirs: list[int]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"first {i} of {len(ours)} equal, then {a} vs {b}"
    return f"all {len(ours)} equal"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default=None, choices=list(s06.DTYPES),
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--attention", default="sdpa", choices=s06.ATTENTION_IMPLS,
                        help="our engine's attention (HF uses SDPA)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads (CPU), 1 to the logical cores "
                             f"({os.cpu_count() or 1})")
    parser.add_argument("--bundled-tokens", type=int, default=64,
                        help=f"tokens generated on the bundled model, 1 to {MAX_BUNDLED_TOKENS}")
    parser.add_argument("--qwen-tokens", type=int, default=16,
                        help=f"tokens generated on the 0.6B shape, 1 to {MAX_QWEN_TOKENS}")
    parser.add_argument("--repeats", type=int, default=3,
                        help=f"plain runs per engine (best kept), 1 to {MAX_REPEATS}")
    parser.add_argument("--skip-qwen", action="store_true", help="only the bundled model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights, >= 0")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures to this JSON file (for the notebook)")
    args = parser.parse_args(argv)

    # Checked before torch sees it: set_num_threads(0) raises, and after 100000 the first
    # parallel op segfaults (libgomp cannot create the threads). More threads than logical CPUs
    # (S07's bound too) would only take turns on them. --seed and --device: Part II's rules.
    s08_cli.check_common_arguments(parser, args)
    s07.check_count(parser, "--bundled-tokens", args.bundled_tokens, 1, MAX_BUNDLED_TOKENS)
    s07.check_count(parser, "--qwen-tokens", args.qwen_tokens, 1, MAX_QWEN_TOKENS)
    s07.check_count(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    torch.set_num_threads(args.threads)
    try:
        device, dtype = s06.resolve_device_dtype(args.device, args.dtype)
    except ValueError as err:
        parser.error(str(err))
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible")
    print(f"torch {torch.__version__}, device {device} ({where}), "
          f"{str(dtype).removeprefix('torch.')}, {args.threads} thread(s), our attention "
          f"{args.attention}; load average before: {os.getloadavg()[0]:.1f}")
    print("The machine is shared: figures vary from run to run; compare rows of one run.\n")
    header = (f"{'engine':<16} {'tokens/s':>9} {'CPU ms':>8} {'ms/step':>8} {'model ms':>9} "
              f"{'other ms':>9} {'other %':>8}")
    report = {"torch": torch.__version__, "device": str(device), "device_name": where,
              "dtype": str(dtype).removeprefix("torch."), "threads": args.threads,
              "attention": args.attention, "load_average_before": os.getloadavg()[0],
              "models": []}
    models = [("bundled", args.bundled_tokens)] + ([] if args.skip_qwen else [("qwen", args.qwen_tokens)])
    for name, n_tokens in models:
        label, hf, ours, tokenizer, prompt = prepare(name, device, dtype, args.attention, args.seed)
        print(f"== {label}: {len(prompt)} prompt tokens, {n_tokens} generated, greedy, batch 1")
        engines = {"ours (S06)": OurEngine(ours, tokenizer, prompt, n_tokens),
                   "HF generate()": HFEngine(hf, prompt, n_tokens, device)}
        runs = {key: Run() for key in engines}
        with torch.inference_mode():
            for engine in engines.values():
                engine.once()                                   # warm-up
            for _ in range(args.repeats):                       # interleaved: same conditions
                for key, engine in engines.items():
                    wall, cpu, _ = timed(engine.once, device)
                    runs[key].wall_s.append(wall)
                    runs[key].cpu_s.append(cpu)
            for _ in range(args.repeats):                       # the split: fastest run kept
                for key, engine in engines.items():
                    engine.split(runs[key])
        print(header)
        for key, r in runs.items():
            print(f"{key:<16} {r.tokens_per_s(n_tokens):>9.1f} {r.cpu_ms_per_token(n_tokens):>8.1f} "
                  f"{r.step_ms:>8.2f} {r.model_ms:>9.2f} {r.other_ms:>9.2f} "
                  f"{r.other_ms / r.step_ms:>8.0%}")
        mine, theirs = runs["ours (S06)"], runs["HF generate()"]
        report["models"].append({
            "model": label, "prompt_tokens": len(prompt), "generated_tokens": n_tokens,
            "greedy_agreement": agreement(mine.token_ids, theirs.token_ids),
            "engines": {key: {"tokens_per_s": r.tokens_per_s(n_tokens),
                              "cpu_ms_per_token": r.cpu_ms_per_token(n_tokens),
                              "step_ms": r.step_ms, "model_ms": r.model_ms,
                              "other_ms": r.other_ms} for key, r in runs.items()}})
        print(f"ratio ours / HF: {mine.tokens_per_s(n_tokens) / theirs.tokens_per_s(n_tokens):.2f}x "
              f"tokens/s (wall), {theirs.cpu_ms_per_token(n_tokens) / mine.cpu_ms_per_token(n_tokens):.2f}x "
              f"by CPU time; greedy token ids: {agreement(mine.token_ids, theirs.token_ids)}\n")
        del hf, ours, engines
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json is not None:
        report["load_average_after"] = os.getloadavg()[0]
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
