"""Data for the S03 "Try it" simulator: the bundled model's attention and next-token distributions.

Everything is computed at site build time by the chapter's own code (code/s03_transformer.py,
loaded by code/s03_checkpoint.py) on the bundled checkpoint in data/model/, for a few fixed
prompts:

- the prompt's tokens, as the text each one decodes to;
- for every layer and query head, the causal attention weights (T, T) that `attention_probs`
  computes inside `Transformer.forward` (taken from each block's `qkv`, exactly as the forward
  pass does), stored as the lower triangle row by row, rounded to 4 decimals;
- for every position, the top `TOP_K` tokens of the model's next-token distribution at a few
  temperatures (softmax(logits / T) over the whole vocabulary, computed here in float64), and
  the greedy token.

`export()` checks before returning that the per-layer recomputation reproduces
`Transformer.forward`'s logits (so the weights shown are the ones the model used) and that every
attention row sums to 1. When data/model/ is absent (a checkout where the bundled model is being
retrained), it returns {"available": false, ...} and the page says so instead of showing numbers
from some other model.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

from s03_checkpoint import load  # noqa: E402  (code/ is not a package)
from s03_transformer import (  # noqa: E402
    BUNDLED_MODEL_DIR, attention, attention_probs, parameter_count,
)

PROMPTS = (
    "Romeo.\nBut soft, what light through yonder window breaks?",
    "Ham.\nTo be, or not to be, that is the question.",
    "First Citizen.\nBefore we proceed any further, hear me speak.",
)
TEMPERATURES = (0.5, 0.8, 1.0, 1.5)
TOP_K = 10


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    p = np.exp(z)
    return p / p.sum()


def trace(model, token_ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Run the forward pass block by block, keeping every layer's attention weights.

    Returns ([probs of layer l: float32 (H, T, T)], logits float32 (T, V)). Uses the blocks'
    own qkv / finish and the module's attention_probs / attention, as Transformer.forward does.
    """
    ids, pos = model.check_positions(token_ids, None)
    x = model.embed(ids, pos)                                   # (T, C)
    per_layer = []
    for block in model.blocks:
        q, k, v = block.qkv(x, pos)                             # (H, T, D), (Hkv, T, D) x 2
        scale = block.attention_scale() if hasattr(block, "attention_scale") else None
        per_layer.append(attention_probs(q, k, pos, pos, scale))
        x = block.finish(x, attention(q, k, v, pos, pos, scale))
    return per_layer, model.head(x).astype(np.float32)


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError if the block-by-block trace does
    not reproduce `Transformer.forward` or an attention row does not sum to 1."""
    if not (BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        return {"available": False,
                "reason": "data/model/ has no model.safetensors: the bundled model is missing "
                          "from this build (python scripts/train_bundled_model.py trains it)."}
    model, tokenizer = load(BUNDLED_MODEL_DIR)
    cfg = model.config
    prompts = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        probs, logits = trace(model, ids)
        if not np.allclose(logits, model.forward(ids), rtol=1e-5, atol=1e-5):
            raise RuntimeError("the block-by-block trace does not reproduce Transformer.forward")
        attn = []
        for layer in probs:                                     # (H, T, T)
            if not np.allclose(layer.sum(axis=-1), 1.0, atol=1e-4):
                raise RuntimeError("an attention row does not sum to 1")
            attn.append([[round(float(p), 4) for t in range(len(ids)) for p in head[t, :t + 1]]
                         for head in layer])
        nexts = []
        for row in logits.astype(np.float64):
            dists = {}
            for temperature in TEMPERATURES:
                p = _softmax(row / temperature)
                top = np.argsort(-p, kind="stable")[:TOP_K]
                dists[f"{temperature:.1f}"] = [[tokenizer.decode([int(i)]) if int(i) not in
                                            tokenizer.eos_ids else "<|endoftext|>",
                                            round(float(p[i]), 4)] for i in top]
            greedy = int(np.argmax(row))
            dists["greedy"] = tokenizer.decode([greedy]) if greedy not in tokenizer.eos_ids \
                else "<|endoftext|>"
            nexts.append(dists)
        prompts.append({"text": text, "tokens": [tokenizer.decode([i]) for i in ids],
                        "attn": attn, "next": nexts})
    return {
        "available": True,
        "source": "code/s03_transformer.py on data/model (the bundled model)",
        "model": {"L": cfg.num_hidden_layers, "H": cfg.num_attention_heads,
                  "Hkv": cfg.num_key_value_heads, "D": cfg.head_dim, "C": cfg.hidden_size,
                  "V": cfg.vocab_size, "parameters": parameter_count(cfg)},
        "temperatures": list(TEMPERATURES),
        "prompts": prompts,
    }


if __name__ == "__main__":  # print the size of what the page downloads
    import json
    print(f"{len(json.dumps(export(), separators=(',', ':'))):,} bytes")
