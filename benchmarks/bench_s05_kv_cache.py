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

Model: the bundled model (data/model) when it exists; otherwise a random model with the
bundled model's Qwen3 shape (scripts/train_bundled_model.py defaults), and the output says so.
Timing does not depend on the weights' values, only on the shapes. The bundled model was
trained on 256-token windows; to time 1,000+ token contexts its position limit is raised here
(RoPE has no table, so this only means the text quality past 256 tokens is untrained, which a
timing does not look at).

The uncached loop is the slow one (each pass costs about as much as a whole prefill), so by
default it generates only --uncached-tokens (100) tokens, about a minute; tokens per second
are compared over what each engine ran, and per-step times at the context lengths both
reached.

BLAS threads are pinned to 1 (OPENBLAS_NUM_THREADS etc., unless already set) so the figures do
not depend on how busy the other cores are. Numbers vary from machine to machine and run to run.
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

import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
from s05_kv_cache import Engine, kv_cache_bytes, step_work  # noqa: E402

CORPUS = ROOT / "data" / "shakespeare.txt"
TOKENIZER_JSON = ROOT / "data" / "tokenizer.json"


def bundled_shape(vocab_size: int, max_positions: int) -> s03.TransformerConfig:
    """The bundled model's architecture (scripts/train_bundled_model.py defaults)."""
    return s03.TransformerConfig(
        model_type="qwen3", vocab_size=vocab_size, hidden_size=192, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=512,
        max_position_embeddings=max_positions, norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=10000.0, qk_norm=True)


def load_model(model_dir: Path | None, positions: int):
    """(model, tokenizer, description). Raises s03.CheckpointError for a bad --model."""
    directory = model_dir or s03.BUNDLED_MODEL_DIR
    if model_dir is not None or (directory / "model.safetensors").exists():
        config = s03.TransformerConfig.from_pretrained(directory)
        note = ""
        if config.max_position_embeddings < positions:
            note = (f"; position limit raised from {config.max_position_embeddings} to "
                    f"{positions} for timing")
            config = dataclasses.replace(config, max_position_embeddings=positions)
        model = s03.Transformer(config, s03.load_state_dict(directory))
        tokenizer = s03.CheckpointTokenizer(directory / "tokenizer.json", config.eos_token_ids)
        return model, tokenizer, f"{directory} ({config.model_type}{note})"
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(TOKENIZER_JSON)).token_to_id("<|endoftext|>")
    tokenizer = s03.CheckpointTokenizer(TOKENIZER_JSON, [eos])
    config = bundled_shape(tokenizer.vocab_size, positions)
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(shape, np.float32) if "norm" in name else
                      rng.normal(0.0, 0.02, shape).astype(np.float32))
               for name, shape in s03.expected_tensors(config).items()}
    return (s03.Transformer(config, weights), tokenizer,
            "NOT the bundled model (data/model does not exist yet): a random model of its "
            "Qwen3 shape")


def prompt_of(tokenizer, n_tokens: int) -> str:
    """The first ~n_tokens tokens of the corpus, as text."""
    text = CORPUS.read_text(encoding="utf-8")[: 40 * n_tokens]
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])


def median_step_ms(times_s: list[float], index: int, window: int = 5) -> float:
    """Median of the step times around `index` (steps are noisy one by one), in ms."""
    lo, hi = max(1, index - window), min(len(times_s), index + window + 1)
    return 1e3 * float(np.median(times_s[lo:hi]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=300)
    parser.add_argument("--uncached-tokens", type=int, default=100,
                        help="tokens the (slow) uncached loop generates")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory")
    args = parser.parse_args(argv)

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

    cached_engine = Engine(model, tokenizer, max_context=positions)
    uncached_engine = s04.Engine(model, tokenizer, max_context=positions)
    runs = {}
    for label, engine, n_new in (("KV cache", cached_engine, args.new_tokens),
                                 ("no cache", uncached_engine, args.uncached_tokens)):
        params = s04.SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
        start = time.perf_counter()
        completion = engine.generate(prompt, params)
        runs[label] = (completion, time.perf_counter() - start)
        print(f"ran {label}: {len(completion.token_ids)} tokens in {runs[label][1]:.1f} s")
    cached, cached_s = runs["KV cache"]
    uncached, uncached_s = runs["no cache"]
    k = len(uncached.token_ids)
    same = cached.token_ids[:k] == uncached.token_ids
    print(f"first {k} tokens equal in both runs: {'yes' if same else 'NO (a bug)'}\n")

    ct, ut = cached.stats.pass_times_s, uncached.stats.pass_times_s
    print(f"{'':<28} {'no cache':>12} {'KV cache':>12}")
    print(f"{'tokens generated':<28} {len(ut):>12} {len(ct):>12}")
    print(f"{'first pass (prefill), s':<28} {ut[0]:>12.3f} {ct[0]:>12.3f}")
    print(f"{'later steps, ms each (mean)':<28} {1e3 * np.mean(ut[1:]):>12.1f} "
          f"{1e3 * np.mean(ct[1:]):>12.2f}")
    print(f"{'tokens/s, all passes':<28} {len(ut) / sum(ut):>12.2f} {len(ct) / sum(ct):>12.2f}")
    print(f"{'tokens/s, after the prefill':<28} {(len(ut) - 1) / sum(ut[1:]):>12.2f} "
          f"{(len(ct) - 1) / sum(ct[1:]):>12.2f}")
    print(f"{f'first {k} tokens, s':<28} {sum(ut):>12.2f} {sum(ct[:k]):>12.2f}"
          f"   speed-up {sum(ut) / sum(ct[:k]):.1f}x")

    print("\nper-step time along the context (median of ~10 steps around it) and the step's "
          "closed-form multiply-adds:")
    print(f"{'context n':>10} {'no cache ms':>12} {'MACs':>14} {'KV cache ms':>12} {'MACs':>12}")
    steps = sorted({1, len(ut) // 2, len(ut) - 1, *range(0, len(ct), max(1, len(ct) // 6)),
                    len(ct) - 1} - {0})
    for i in steps:
        n = p_len + i
        cached_macs = step_work(cfg, 1, n, 1).macs
        if i < len(ut):
            u_ms, u_macs = f"{median_step_ms(ut, i):.1f}", f"{step_work(cfg, n, n, n).macs:,}"
        else:
            u_ms, u_macs = "-", f"{step_work(cfg, n, n, n).macs:,}"
        print(f"{n:>10} {u_ms:>12} {u_macs:>14} {median_step_ms(ct, i):>12.2f} {cached_macs:>12,}")

    total = p_len + len(ct)
    print(f"\nKV cache memory (float32): {kv_cache_bytes(cfg, 1):,} bytes per token = 2 x "
          f"L={cfg.num_hidden_layers} x Hkv={cfg.num_key_value_heads} x D={cfg.head_dim} x 4 B; "
          f"{kv_cache_bytes(cfg, total):,} bytes for this {total}-token context; "
          f"{cached_engine.runner.cache.nbytes:,} reserved for max_context={positions}")


if __name__ == "__main__":
    main()
