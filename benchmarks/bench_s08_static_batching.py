"""S08's measurements: tokens/s against batch size, ours next to HF's padded `generate()`, the
waste of a static batch, and batch variance. Prints; writes nothing unless --json is given.

    python benchmarks/bench_s08_static_batching.py --quick          # bundled model, a few minutes
    python benchmarks/bench_s08_static_batching.py                  # both shapes, B = 1 .. 64
    python benchmarks/bench_s08_static_batching.py --shapes qwen3-0.6b --qwen-batch-sizes 1,16

A benchmark, not a test: it prints, never asserts speed. What runs:
  Models (float32, the CPU unless --device cuda), each run by both engines on the same weights:
    bundled      data/model, the course's tiny Qwen3-architecture model (a model of its shape
                 with random weights while it is not trained, said in the output);
    qwen3-0.6b   random weights in Qwen3-0.6B's shape (its published config.json), built here
                 with transformers (seeded), no download: 596M parameters, 2.4 GB in float32.
  Requests: S07's "chat" workload (seeded corpus prompts of 8 to 32 tokens, the project
  tokenizer's ids, valid ids of both models). For batch size B the first B requests form one
  batch; every request makes exactly --max-tokens tokens (EOS ignored), greedy.
  Engines, alternated (ours, HF, ours, HF, ...) --repeats times per batch size, best run kept:
    ours         code/s08_static_batching.py's Engine (fast mode), `generate(prompts, params)`;
    HF           transformers `generate()` on the same left-padded (B, T) ids and attention
                 mask, SDPA attention, its own DynamicCache, `max_new_tokens`, no EOS.
  tokens/s = B x max_tokens / wall seconds of the whole call (prefill included), best run;
  CPU ms/tok = this process's CPU seconds per generated token (time.process_time), least of
  the runs: on a shared CPU the steadier figure, since wall time also counts the time the
  scheduler gave to other jobs; CPU ratio = HF's / ours. torch threads are pinned (--threads,
  default 1) for both. The rows-equal column counts rows whose ids
  agree between the two engines (float32: a near-tie may flip, see the variance table).
  Waste: a mixed-output-length workload with EOS on (each request's max_tokens drawn from
  S07's chat range, 16 to 64), one static batch per B: token slots computed, of which useful,
  padding and finished-idle, and the idle share of decode row-steps (a continuous batch, S09,
  would not compute those rows).
  Batch variance (bundled model): `measure_batch_variance` (code/s08_batch_variance.py), the
  fast mode against the batch-invariant reference per B: the largest logit difference, the
  smallest top-2 gap, and whether any greedy token flipped.

The CPU is shared with other jobs: the load average before and after is printed; compare rows
of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import s02_tokenizer as s02  # noqa: E402
import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s07_workloads  # noqa: E402
import s08_batch_variance  # noqa: E402
import s08_cli  # noqa: E402
import s08_static_batching as s08  # noqa: E402

# Qwen/Qwen3-0.6B config.json (published values; only the shape matters here), and the shape
# of data/model (scripts/train_bundled_model.py's defaults), as in bench_s06_torch.py.
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
)
BUNDLED_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=2048, rope_theta=10000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=256,
)
PAD_ID = 0
MAX_BATCH = 256              # the workload's requests: the first B of them form a batch
MAX_BUNDLED_TOKENS = 224     # the bundled model's window (256) less the longest prompt (32)
MAX_QWEN_TOKENS = 1024
MAX_REPEATS = 20


class IdTokenizer:
    """Prompts as ids written out ("5 17 3"), for the random 0.6B shape, whose ids above the
    project tokenizer's 2,048 have no text."""

    eos_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def load_uptime() -> str:
    """The 1, 5 and 15-minute load averages, as `uptime` prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def random_qwen3(shape: dict, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(**shape, eos_token_id=PAD_ID, pad_token_id=PAD_ID, bos_token_id=None)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def load_shape(name: str, device: torch.device, attention: str, seed: int):
    """(label, HF model, our TorchTransformer, our tokenizer, ids of each prompt, text of each
    prompt for our tokenizer, the prompts' text as the project tokenizer wrote them)."""
    bundled = s03.BUNDLED_MODEL_DIR
    if name == "bundled" and (bundled / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
        ours = s06.TorchTransformer.from_pretrained(bundled, device, torch.float32, attention)
        tokenizer = s03_checkpoint.CheckpointTokenizer.from_pretrained(bundled)
        label = f"bundled model ({s03.parameter_count(ours.config) / 1e6:.1f}M parameters)"
    else:
        start = time.perf_counter()
        hf = random_qwen3(BUNDLED_SHAPE if name == "bundled" else QWEN3_0_6B, seed)
        config = s03_checkpoint.config_from_hf_dict(hf.config.to_dict())
        ours = s06.TorchTransformer(config, hf.state_dict(), device, torch.float32, attention)
        tokenizer = IdTokenizer(config.vocab_size)
        label = (f"{'bundled-model shape' if name == 'bundled' else 'Qwen3-0.6B shape'}, random "
                 f"weights ({s03.parameter_count(config) / 1e6:.0f}M parameters, built in "
                 f"{time.perf_counter() - start:.0f} s)")
    hf = hf.to(device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = PAD_ID
    return label, hf, ours, tokenizer


def workload_ids(num: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompt ids, drawn max_tokens) of S07's chat workload with the project tokenizer."""
    project = s02.BPETokenizer.load_hf(s02.TOKENIZER_PATH)
    workload = s07_workloads.make_workload("chat", project, num, seed, 256)
    return ([project.encode(r.prompt) for r in workload.requests],
            [r.max_tokens for r in workload.requests])


def as_text(tokenizer, ids: list[int]) -> str:
    text = " ".join(map(str, ids)) if isinstance(tokenizer, IdTokenizer) else tokenizer.decode(ids)
    assert tokenizer.encode(text) == ids
    return text


@torch.inference_mode()
def hf_batch(hf, prompts: list[list[int]], max_new_tokens: int, device) -> list[list[int]]:
    ids, mask = s08.left_pad(prompts, PAD_ID, device)
    out = hf.generate(ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
    return out[:, ids.shape[1]:].tolist()


def timed(fn, device):
    """(wall seconds, this process's CPU seconds, result) of fn()."""
    s06.synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    s06.synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu, result


def throughput(label, hf, ours, tokenizer, prompts, batch_sizes, n_tokens, repeats, device):
    texts = [as_text(tokenizer, p) for p in prompts]
    print(f"\n== tokens/s against batch size: {label}; {n_tokens} tokens per request, "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens ==")
    print(f"{'B':>4} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'vs B=1':>7} "
          f"{'ours CPU ms/tok':>16} {'HF CPU ms/tok':>14} {'CPU ratio':>10} {'rows equal':>11}")
    params = s04.SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    rows, base = [], None
    for batch_size in batch_sizes:
        engine = s08.Engine(ours, tokenizer, max_context=min(ours.config.max_position_embeddings,
                                                             1024),
                            max_batch_size=batch_size, pad_id=PAD_ID)
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        batch_texts = [texts[i % len(texts)] for i in range(batch_size)]
        engine.generate(batch_texts[:1], s04.SamplingParams(temperature=0.0, max_tokens=2))
        hf_batch(hf, batch[:1], 2, device)                              # warm-up, both
        ours_s, hf_s, ours_cpu, hf_cpu = [], [], [], []
        for _ in range(repeats):
            wall, cpu, done = timed(lambda: engine.generate(batch_texts, params), device)
            ours_s.append(wall)
            ours_cpu.append(cpu)
            ours_ids = [c.token_ids for c in done]
            wall, cpu, hf_ids = timed(lambda: hf_batch(hf, batch, n_tokens, device), device)
            hf_s.append(wall)
            hf_cpu.append(cpu)
        tokens = batch_size * n_tokens
        ours_tps, hf_tps = tokens / min(ours_s), tokens / min(hf_s)
        ours_ms, hf_ms = min(ours_cpu) / tokens * 1e3, min(hf_cpu) / tokens * 1e3
        base = ours_tps if base is None else base
        equal = sum(a == b for a, b in zip(ours_ids, hf_ids))
        print(f"{batch_size:>4} {ours_tps:>11,.0f} {hf_tps:>10,.0f} {ours_tps / hf_tps:>7.2f}x "
              f"{ours_tps / base:>6.1f}x {ours_ms:>16.3f} {hf_ms:>14.3f} {hf_ms / ours_ms:>9.2f}x "
              f"{equal:>5}/{batch_size:<5}", flush=True)
        rows.append(dict(batch_size=batch_size, ours_tokens_per_s=ours_tps,
                         hf_tokens_per_s=hf_tps, ours_cpu_ms_per_token=ours_ms,
                         hf_cpu_ms_per_token=hf_ms, rows_equal=equal))
    return rows


def waste(ours, tokenizer, prompts, max_tokens, batch_sizes):
    """Static batches of the first B requests with their own max_tokens and EOS on."""
    texts = [as_text(tokenizer, p) for p in prompts]
    print("\n== waste of a static batch: mixed output lengths (max_tokens 16-64 drawn per "
          "request), EOS on, greedy ==")
    print(f"{'B':>4} {'slots':>8} {'useful':>8} {'padding':>8} {'idle':>8} {'useful %':>9} "
          f"{'idle row-steps':>15} {'out tokens':>11}")
    rows = []
    for batch_size in batch_sizes:
        engine = s08.Engine(ours, tokenizer, max_batch_size=batch_size)
        params = [s04.SamplingParams(temperature=0.0, max_tokens=m)
                  for m in max_tokens[:batch_size]]
        done = engine.generate(texts[:batch_size], params)
        st = engine.last_batch
        print(f"{batch_size:>4} {st.slots:>8,} {st.useful:>8,} {st.padding_slots:>8,} "
              f"{st.idle:>8,} {st.useful_fraction:>8.1%} "
              f"{st.idle_row_steps:>6,}/{st.decode_row_steps:<8,} "
              f"{sum(len(c.token_ids) for c in done):>11,}")
        rows.append(dict(batch_size=batch_size, slots=st.slots, useful=st.useful,
                         padding=st.padding_slots, idle=st.idle,
                         idle_row_steps=st.idle_row_steps, decode_row_steps=st.decode_row_steps))
    return rows


def batch_list(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated list of batch sizes, each in [1, MAX_BATCH]; a usage error otherwise."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers (got {text!r})")
    for size in sizes:
        s07.check_count(parser, f"{flag}: each batch size", size, 1, MAX_BATCH)
    return sizes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="bundled,qwen3-0.6b",
                        help="comma-separated: bundled, qwen3-0.6b (default: %(default)s)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64",
                        help=f"batch sizes on the bundled model, each 1 to {MAX_BATCH} "
                             "(default: %(default)s)")
    parser.add_argument("--qwen-batch-sizes", default="1,4,16",
                        help=f"batch sizes on the 0.6B shape, each 1 to {MAX_BATCH} (default: "
                             "%(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help=f"tokens per request, bundled model, 1 to {MAX_BUNDLED_TOKENS} "
                             "(default: %(default)s)")
    parser.add_argument("--qwen-tokens", type=int, default=8,
                        help=f"tokens per request, 0.6B shape, 1 to {MAX_QWEN_TOKENS} "
                             "(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help=f"runs per engine and batch size, best kept, 1 to {MAX_REPEATS} "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads for both engines, 1 to the logical cores "
                             f"({os.cpu_count() or 1}) (default: %(default)s)")
    parser.add_argument("--attention", default="sdpa", choices=s06.ATTENTION_IMPLS,
                        help="our attention implementation (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed, >= 0 (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="bundled model only, B in 1,8,32,64, 32 tokens, 1 repeat")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)   # --threads, --seed, --device
    if args.quick:
        args.shapes, args.batch_sizes, args.max_tokens, args.repeats = "bundled", "1,8,32,64", 32, 1
    s07.check_count(parser, "--max-tokens", args.max_tokens, 1, MAX_BUNDLED_TOKENS)
    s07.check_count(parser, "--qwen-tokens", args.qwen_tokens, 1, MAX_QWEN_TOKENS)
    s07.check_count(parser, "--repeats", args.repeats, 1, MAX_REPEATS)
    batch_sizes = batch_list(parser, "--batch-sizes", args.batch_sizes)
    qwen_batch_sizes = batch_list(parser, "--qwen-batch-sizes", args.qwen_batch_sizes)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    prompts, drawn = workload_ids(max(batch_sizes + qwen_batch_sizes), args.seed)
    report = dict(load_before=os.getloadavg(), threads=args.threads, attention=args.attention)
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {device}, our attention "
          f"{args.attention}; load average before: {load_uptime()}")
    for shape in args.shapes.split(","):
        label, hf, ours, tokenizer = load_shape(shape, device, args.attention, args.seed)
        sizes = batch_sizes if shape == "bundled" else qwen_batch_sizes
        n_tokens = args.max_tokens if shape == "bundled" else args.qwen_tokens
        report[shape] = dict(label=label, throughput=throughput(
            label, hf, ours, tokenizer, prompts, sizes, n_tokens, args.repeats, device))
        if shape == "bundled":
            report[shape]["waste"] = waste(ours, tokenizer, prompts, drawn, batch_sizes)
            texts = [as_text(tokenizer, p) for p in prompts]
            print("\n== batch variance: fast mode vs the batch-invariant reference, greedy, "
                  "16 tokens per request ==")
            table = s08_batch_variance.measure_batch_variance(ours, tokenizer, texts,
                                                              batch_sizes, 16)
            print(s08_batch_variance.format_variance_table(table))
            print(f"(tolerance of the rule: {table[0].tolerance:g}; a flip needs a top-2 gap "
                  "under twice the largest difference)")
            report[shape]["variance"] = [vars(r) | {"can_flip": r.can_flip} for r in table]
        del hf, ours
    report["load_after"] = os.getloadavg()
    print(f"\nload average after: {load_uptime()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
