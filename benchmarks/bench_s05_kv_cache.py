"""Wall-clock cost of generation without and with the KV cache, side by side in one run.

    python benchmarks/bench_s05_kv_cache.py [--prompt-tokens 1000] [--new-tokens 300]
                                            [--uncached-tokens 60] [--model DIR]

A benchmark, not a test: it prints, never asserts speed. Both engines run the same model on
the same prompt (the first --prompt-tokens tokens of data/shakespeare.txt), greedy, EOS
ignored so both run their full budget, and their tokens are checked equal where both ran:
  - "no cache": S04's engine, the S01 loop (every pass runs the model on the whole context);
  - "KV cache": S05's engine (one prefill, then one decode per token).
It prints tokens per second, the time per step at several context lengths for both (the cached
step should stay nearly flat, the uncached one grows with the context), the closed-form
multiply-adds of each step beside it, and the cache's memory for this model and context.

Model: the bundled model (data/model) when it exists; otherwise a random Qwen3 model of the
default shape of scripts/train_bundled_model.py, and the output says so.
Timing does not depend on the weights' values, only on the shapes. The bundled model was
trained on 256-token windows; to time 1,000+ token contexts its position limit is raised here
(RoPE has no table, so this only means the text quality past 256 tokens is untrained, which a
timing does not look at).

The uncached loop is the slow one (each pass costs about as much as a whole prefill), so by
default it generates only --uncached-tokens (100) tokens, about a minute; tokens per second
are compared over what each engine ran, and per-step times at the context lengths both
reached.

BLAS threads are pinned to 1 (OPENBLAS_NUM_THREADS etc., unless already set), and every pass
is timed twice: wall seconds (what a user waits) and CPU seconds of this thread (the work done,
which other jobs on a shared machine disturb much less). Numbers vary from machine to machine
and run to run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402

import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
from s05_kv_cache import Engine, kv_cache_bytes, step_work  # noqa: E402

CORPUS = ROOT / "data" / "shakespeare.txt"
TOKENIZER_JSON = ROOT / "data" / "tokenizer.json"
MAX_TOKENS = 8192    # per count flag: the uncached loop's time grows with the square of it


def bundled_shape(vocab_size: int, max_positions: int) -> s03.TransformerConfig:
    """The default architecture of scripts/train_bundled_model.py (a stand-in for data/model)."""
    return s03.TransformerConfig(
        model_type="qwen3", vocab_size=vocab_size, hidden_size=192, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=512,
        max_position_embeddings=max_positions, norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=10000.0, qk_norm=True)


def load_model(model_dir: Path | None, positions: int):
    """(model, tokenizer, description). Raises s03_checkpoint.CheckpointError for a bad
    --model."""
    directory = model_dir or s03.BUNDLED_MODEL_DIR
    if model_dir is not None or (directory / "model.safetensors").exists():
        config = s03_checkpoint.load_config(directory)
        note = ""
        if config.max_position_embeddings < positions:
            note = (f"; position limit raised from {config.max_position_embeddings} to "
                    f"{positions} for timing")
            config = dataclasses.replace(config, max_position_embeddings=positions)
        model = s03.Transformer(config, s03_checkpoint.load_state_dict(directory))
        tokenizer = s03_checkpoint.CheckpointTokenizer(directory / "tokenizer.json",
                                                       config.eos_token_ids)
        return model, tokenizer, f"{directory} ({config.model_type}{note})"
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(TOKENIZER_JSON)).token_to_id("<|endoftext|>")
    tokenizer = s03_checkpoint.CheckpointTokenizer(TOKENIZER_JSON, [eos])
    config = bundled_shape(tokenizer.vocab_size, positions)
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(shape, np.float32) if "norm" in name else
                      rng.normal(0.0, 0.02, shape).astype(np.float32))
               for name, shape in s03_checkpoint.expected_tensors(config).items()}
    return (s03.Transformer(config, weights), tokenizer,
            "NOT the bundled model (data/model does not exist yet): a random Qwen3 model of "
            "the training script's default shape")


def prompt_of(tokenizer, n_tokens: int) -> str:
    """The first ~n_tokens tokens of the corpus, as text."""
    text = CORPUS.read_text(encoding="utf-8")[: 40 * n_tokens]
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])


def median_step_ms(times_s: list[float], index: int, window: int = 5) -> float:
    """Median of the step times around `index` (steps are noisy one by one), in ms."""
    lo, hi = max(1, index - window), min(len(times_s), index + window + 1)
    return 1e3 * float(np.median(times_s[lo:hi]))


def cpu_timed(engine_class: type) -> type:
    """A subclass of `engine_class` whose `model_step` (one forward pass: the seam S01's loop
    calls once per step, the same call Stats.pass_times_s times by the wall clock) also records
    its CPU seconds in `cpu_s`. With BLAS on one thread they count the work done in this thread
    only: a fairer figure than wall time on a machine shared with other jobs."""

    class CpuTimed(engine_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cpu_s: list[float] = []

        def model_step(self, seq):
            start = time.thread_time()
            logits = super().model_step(seq)
            self.cpu_s.append(time.thread_time() - start)
            return logits

    return CpuTimed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help=f"prompt tokens, 1 to {MAX_TOKENS}")
    parser.add_argument("--new-tokens", type=int, default=300,
                        help=f"tokens the cached engine generates, 1 to {MAX_TOKENS}")
    parser.add_argument("--uncached-tokens", type=int, default=100,
                        help=f"tokens the (slow) uncached loop generates, 1 to {MAX_TOKENS}")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory")
    args = parser.parse_args(argv)
    for flag in ("--prompt-tokens", "--new-tokens", "--uncached-tokens"):   # before any load
        value = getattr(args, flag[2:].replace("-", "_"))
        if not 1 <= value <= MAX_TOKENS:
            parser.error(f"{flag} must be an integer in [1, {MAX_TOKENS}] (got {value})")

    positions = args.prompt_tokens + args.new_tokens + 16
    model, tokenizer, description = load_model(args.model, positions)
    cfg = model.config
    prompt = prompt_of(tokenizer, args.prompt_tokens)
    p_len = len(tokenizer.encode(prompt))
    print(f"model: {description}")
    print(f"  L={cfg.num_hidden_layers}, C={cfg.hidden_size}, H={cfg.num_attention_heads}, "
          f"Hkv={cfg.num_key_value_heads}, D={cfg.head_dim}, I={cfg.intermediate_size}, "
          f"V={cfg.vocab_size}; NumPy float32, BLAS threads "
          f"{os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"prompt: {p_len} tokens of data/shakespeare.txt; greedy, EOS ignored\n")

    cached_engine = cpu_timed(Engine)(model, tokenizer, max_context=positions)
    uncached_engine = cpu_timed(s04.Engine)(model, tokenizer, max_context=positions)
    runs = {}
    for label, engine, n_new in (("KV cache", cached_engine, args.new_tokens),
                                 ("no cache", uncached_engine, args.uncached_tokens)):
        params = s04.SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
        start = time.perf_counter()
        completion = engine.generate(prompt, params)
        runs[label] = (completion.token_ids, completion.stats.pass_times_s, engine.cpu_s)
        print(f"ran {label}: {len(completion.token_ids)} tokens in "
              f"{time.perf_counter() - start:.1f} s")
    cached_ids, ct, cc = runs["KV cache"]          # token ids, wall s per pass, CPU s per pass
    uncached_ids, ut, uc = runs["no cache"]
    k = len(uncached_ids)
    same = cached_ids[:k] == uncached_ids
    print(f"first {k} tokens equal in both runs: {'yes' if same else 'NO (a bug)'}\n")

    print(f"{'':<30} {'no cache':>19} {'KV cache':>19}")
    print(f"{'':<30} {'wall':>9} {'CPU':>9} {'wall':>9} {'CPU':>9}")

    def row(label: str, u: tuple[float, float], c: tuple[float, float], fmt: str) -> None:
        print(f"{label:<30} {u[0]:>9{fmt}} {u[1]:>9{fmt}} {c[0]:>9{fmt}} {c[1]:>9{fmt}}")

    print(f"{'tokens generated':<30} {len(ut):>19} {len(ct):>19}")
    row("first pass (prefill), s", (ut[0], uc[0]), (ct[0], cc[0]), ".3f")
    row("later steps, ms (median)", (1e3 * np.median(ut[1:]), 1e3 * np.median(uc[1:])),
        (1e3 * np.median(ct[1:]), 1e3 * np.median(cc[1:])), ".2f")
    row("tokens/s, all passes", (len(ut) / sum(ut), len(uc) / sum(uc)),
        (len(ct) / sum(ct), len(cc) / sum(cc)), ".2f")
    row("tokens/s, after the prefill", ((len(ut) - 1) / sum(ut[1:]), (len(uc) - 1) / sum(uc[1:])),
        ((len(ct) - 1) / sum(ct[1:]), (len(cc) - 1) / sum(cc[1:])), ".2f")
    row(f"first {k} tokens, s", (sum(ut), sum(uc)), (sum(ct[:k]), sum(cc[:k])), ".2f")
    print(f"speed-up on the first {k} tokens: {sum(ut) / sum(ct[:k]):.1f}x wall, "
          f"{sum(uc) / sum(cc[:k]):.1f}x CPU")

    print("\nper-step time along the context (median of ~10 steps around it), ms, and the "
          "step's closed-form multiply-adds:")
    print(f"{'context n':>10} {'no cache wall':>14} {'CPU':>8} {'MACs':>14} "
          f"{'KV cache wall':>14} {'CPU':>6} {'MACs':>10}")
    steps = sorted({1, len(ut) // 2, len(ut) - 1, *range(0, len(ct), max(1, len(ct) // 6)),
                    len(ct) - 1} - {0})
    for i in steps:
        n = p_len + i
        if i < len(ut):
            u_wall, u_cpu = f"{median_step_ms(ut, i):.1f}", f"{median_step_ms(uc, i):.1f}"
        else:
            u_wall, u_cpu = "-", "-"
        print(f"{n:>10} {u_wall:>14} {u_cpu:>8} {step_work(cfg, n, n, n).macs:>14,} "
              f"{median_step_ms(ct, i):>14.2f} {median_step_ms(cc, i):>6.2f} "
              f"{step_work(cfg, 1, n, 1).macs:>10,}")

    total = p_len + len(ct)
    print(f"\nKV cache memory (float32): {kv_cache_bytes(cfg, 1):,} bytes per token = 2 x "
          f"L={cfg.num_hidden_layers} x Hkv={cfg.num_key_value_heads} x D={cfg.head_dim} x 4 B; "
          f"{kv_cache_bytes(cfg, total):,} bytes for this {total}-token context; "
          f"{cached_engine.runner.cache.nbytes:,} reserved for max_context={positions}")


if __name__ == "__main__":
    main()
