"""Train the course's bundled model: a tiny Qwen3-architecture transformer on the corpus.

    python scripts/train_bundled_model.py                 # the checkpoint in data/model/
    python scripts/train_bundled_model.py --layers 1 --threads 1 --out data/draft_model
                                                          # S15's draft model (same tokenizer)
    python scripts/train_bundled_model.py --steps 20 --out /tmp/probe   # a quick timing probe

Data: data/shakespeare.txt, split into speeches (blocks between blank lines, as chapter 1 does),
each encoded with the project tokenizer (data/tokenizer.json, chapter 2) and followed by
<|endoftext|>, so the model learns where a speech ends and the engine's EOS stop fires on real
text. Every 10th speech is held out for validation. Training windows of `--context + 1` tokens
are drawn at random offsets from the joined training speeches.

Model: transformers' Qwen3ForCausalLM (GQA, per-head q/k RMSNorm, RoPE, SwiGLU, tied head), so
the saved checkpoint is a plain Hugging Face one that code/s03_checkpoint.py (into S03's NumPy
transformer) and AutoModelForCausalLM both load. PyTorch does the training here; the course is
about inference.

Optimiser: AdamW (betas 0.9, 0.95, weight decay 0.1 on matrices only), linear warm-up then
cosine decay to 10% of the peak learning rate, gradient clipping at 1.0: the recipe of
nanoGPT / GPT-3 small models. The corpus is small (about 0.6M training tokens), so a run of
many epochs can start to overfit: the weights saved are those of the periodic validation check
with the lowest loss (on the first --eval-windows validation windows). Everything is seeded (torch, the window sampler) and runs on the
CPU with a fixed number of threads; rerunning with the same arguments on the same
torch build reproduces the checkpoint (the float results of multithreaded CPU kernels can
differ in the last bits across machines, so "reproduces" means the same recipe and, in
practice, the same validation loss to about 0.01).

Outputs in --out: config.json, generation_config.json, model.safetensors (float32),
tokenizer.json and tokenizer_config.json (copied from data/), training_log.json (the loss
curve and the final validation loss / perplexity that data/model/README.md reports). The
README.md of each directory is written by hand from that log; the script does not write it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "shakespeare.txt"
TOKENIZER = ROOT / "data" / "tokenizer.json"
TOKENIZER_CONFIG = ROOT / "data" / "tokenizer_config.json"
EOS_TOKEN = "<|endoftext|>"


def speeches(text: str) -> list[str]:
    """Blocks of text between blank lines ("Ham.\\nTo be, or not to be..."), as in S01."""
    return [block.strip("\n") for block in re.split(r"\n\s*\n", text) if block.strip()]


def encode_split(tokenizer: Tokenizer, eos_id: int, val_every: int) -> tuple[np.ndarray, np.ndarray]:
    """Token streams (train, validation): each speech's ids followed by EOS; every
    `val_every`-th speech goes to validation."""
    blocks = speeches(CORPUS.read_text(encoding="utf-8"))
    encoded = tokenizer.encode_batch(blocks)
    train: list[int] = []
    val: list[int] = []
    for i, enc in enumerate(encoded):
        target = val if i % val_every == val_every - 1 else train
        target.extend(enc.ids)
        target.append(eos_id)
    return np.array(train, dtype=np.int64), np.array(val, dtype=np.int64)


def make_model(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.context, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        attention_dropout=0.0, use_cache=True,
    )
    config._attn_implementation = "sdpa"  # training speed; the saved config does not record it
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def evaluate(model, stream: np.ndarray, context: int, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats per token) over consecutive non-overlapping windows
    of `context` tokens of `stream` (the first `max_windows` of them when given)."""
    model.eval()
    n = (len(stream) - 1) // context
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for start in range(0, n, 32):
        idx = np.arange(start, min(n, start + 32))[:, None] * context + np.arange(context + 1)[None]
        batch = torch.from_numpy(stream[idx])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "model")
    parser.add_argument("--steps", type=int, default=800, help="length of the learning-rate schedule")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end after this many steps of the --steps schedule (what a SIGTERM "
                             "during training also does; the log records the step)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step")
    parser.add_argument("--context", type=int, default=256, help="tokens per window (= max_position_embeddings)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=64, help="validation windows per periodic check")
    parser.add_argument("--val-every", type=int, default=10, help="every n-th speech is held out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    # Checked before torch sees it: set_num_threads(0) raises, and after 100000 the first
    # parallel op segfaults (libgomp cannot create the threads). More threads than logical CPUs
    # (S07's bound too) would only take turns on them.
    cores = os.cpu_count() or 1
    if not 1 <= args.threads <= cores:
        parser.error(f"--threads must be an integer in [1, {cores}] (got {args.threads})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise SystemExit(f"{TOKENIZER} has no {EOS_TOKEN} token")
    train, val = encode_split(tokenizer, eos_id, args.val_every)
    print(f"tokens: train {len(train):,}, validation {len(val):,} (vocabulary {tokenizer.get_vocab_size():,})")

    model = make_model(args, tokenizer.get_vocab_size(), eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; {args.steps} steps x {args.batch_size} x {args.context} "
          f"tokens = {args.steps * args.batch_size * args.context / len(train):.1f} epochs")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    sampler = np.random.default_rng(args.seed)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "parameters": n_params, "train_tokens": int(len(train)), "val_tokens": int(len(val)),
           "curve": []}
    best = (math.inf, 0, None)
    stop = {"requested": False}
    # A shared machine can be slower than planned: SIGTERM ends training after the current
    # step and still evaluates and saves. `--stop-after` replays such a run exactly.
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(requested=True))
    last_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(last_step), desc="training", unit="step")
    for step in bar:
        offsets = sampler.integers(0, len(train) - args.context - 1, size=args.batch_size)
        batch = torch.from_numpy(train[offsets[:, None] + np.arange(args.context + 1)[None]])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        stopping = stop["requested"] or step + 1 == last_step
        if (step + 1) % args.eval_every == 0 or stopping:
            val_loss = evaluate(model, val, args.context, args.eval_windows)
            elapsed = time.perf_counter() - start
            log["curve"].append({"step": step + 1, "train_loss": round(loss.item(), 4),
                                 "val_loss": round(val_loss, 4), "elapsed_s": round(elapsed, 1)})
            tqdm.write(f"step {step + 1}: train loss {loss.item():.3f}, val loss {val_loss:.3f} "
                       f"({elapsed / 60:.1f} min)")
            if val_loss < best[0]:  # keep the weights with the best validation loss so far
                best = (val_loss, step + 1, {k: t.clone() for k, t in model.state_dict().items()})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if stopping:
            break
    log["steps_run"] = step + 1
    if step + 1 < args.steps:
        print(f"stopped after {step + 1} of {args.steps} steps (replay: --stop-after {step + 1})")
    train_s = time.perf_counter() - start
    model.load_state_dict(best[2])
    log["best_step"] = best[1]
    print(f"keeping the weights of step {best[1]} (best periodic validation loss {best[0]:.4f})")

    val_loss = evaluate(model, val, args.context)
    log.update(train_seconds=round(train_s, 1),
               tokens_per_s=round((step + 1) * args.batch_size * args.context / train_s, 1),
               final_val_loss=round(val_loss, 4), final_val_perplexity=round(math.exp(val_loss), 2),
               val_windows=(len(val) - 1) // args.context)
    print(f"final validation loss {val_loss:.4f} nats/token, perplexity {math.exp(val_loss):.2f}; "
          f"{train_s / 60:.1f} min, {log['tokens_per_s']:,} tokens/s")

    args.out.mkdir(parents=True, exist_ok=True)
    model.config._attn_implementation = None
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    model.save_pretrained(args.out)
    shutil.copyfile(TOKENIZER, args.out / "tokenizer.json")
    tokenizer_config = json.loads(TOKENIZER_CONFIG.read_text(encoding="utf-8"))
    tokenizer_config.update(model_max_length=args.context, pad_token=EOS_TOKEN)
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
