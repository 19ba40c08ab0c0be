"""Data for the S05 "Try it" simulator: the KV cache on and off, pass by pass, as counted work.

The page lets the reader pick a model shape, a dtype, a prompt length and a number of new
tokens, switch the cache on or off, and step through the generation one pass at a time. It
computes every number itself, in exact integer arithmetic (BigInt), from the shape alone; this
file gives it the shapes and the Python values it must equal:

- the shapes, each made by the course's own config code: the bundled model's from
  `s03_checkpoint.load_config(data/model)`, and three released models from their published
  config.json fields through `s03_checkpoint.config_from_hf_dict` (the function that reads a
  checkpoint's config.json);
- reference values for a grid of settings, computed by the chapter's closed forms: per pass
  S05's `generation_work` (weight and attention multiply-adds, K/V bytes read, one multiply-add
  = 2 FLOPs), S05's `kv_cache_bytes` (K/V written, cache memory), and S03's `cost_breakdown` for
  the bytes of weights a pass reads (`weight_bytes` below);
- the work *counted* by S05's `count_work` while the bundled model ran one generation pass by
  pass, both engines (S03's uncached forward, as the S01 loop calls it, and S05's
  `CachedTransformer`), which the page recomputes on load and reports (console error, visible
  banner) if it disagrees.

How many passes a request gets is S01's rule (`stop_rule`), for a cache of
`max_position_embeddings` positions: min(new tokens, max_context - prompt length), since the
last sampled token is never run; a prompt longer than the context is refused.

Integers beyond 2**53 do not survive a JavaScript number, so every count is written as a
decimal string. Before returning, `export()` checks the chapter's two closed forms against each
other: for every decode pass shown, 2 x S05's multiply-adds equal S03's `flops_per_token` and S05's K/V
bytes plus `weight_bytes` equal S03's `bytes_per_token`.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
from s03_checkpoint import config_from_hf_dict, load, load_config  # noqa: E402
from s05_kv_cache import (  # noqa: E402
    CachedTransformer, Work, count_work, generation_work, kv_cache_bytes,
)

# Published config.json fields (the hub's files; only what the forward pass reads).
RELEASED = {
    "qwen3-0.6b": ("Qwen3-0.6B", {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
        "eos_token_id": 151645}),
    "gpt2": ("GPT-2 small", {
        "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        "bos_token_id": 50256, "eos_token_id": 50256}),
    "llama3-8b": ("Llama 3 8B", {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 128000,
        "eos_token_id": 128001}),
}
DTYPES = (4, 2)                     # float32, bfloat16
# (config id, dtype bytes, prompt length, new tokens): short and long prompts, one pass, a
# request that runs into a full context, the chapter's 16 + 160 on the bundled model and the
# setting count_work measures (MEASURED).
GRID = (
    ("bundled", 4, 16, 32), ("bundled", 4, 16, 160), ("bundled", 4, 1, 1), ("bundled", 4, 250, 20),
    ("bundled", 2, 200, 56), ("bundled", 4, 256, 5),
    ("qwen3-0.6b", 2, 16, 160), ("qwen3-0.6b", 2, 10000, 800), ("qwen3-0.6b", 4, 40000, 2000),
    ("qwen3-0.6b", 2, 1, 40960),
    ("gpt2", 4, 100, 50), ("gpt2", 2, 1000, 100),
    ("llama3-8b", 2, 4096, 512), ("llama3-8b", 2, 7000, 5000),
)
MEASURED = {"config": "bundled", "dtype_bytes": 4, "new_tokens": 32,
            "text": "ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east"}
MEASURED_PROMPT_LEN = 16


def shape(cfg: s03.TransformerConfig) -> dict:
    """The fields the page's arithmetic reads (HF names in the comments)."""
    return {"model_type": cfg.model_type, "L": cfg.num_hidden_layers, "C": cfg.hidden_size,
            "H": cfg.num_attention_heads, "Hkv": cfg.num_key_value_heads, "D": cfg.head_dim,
            "I": cfg.intermediate_size, "V": cfg.vocab_size,
            "max_context": cfg.max_position_embeddings, "tied": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
            "qk_norm": cfg.qk_norm, "parameters": s03.parameter_count(cfg)}


def weight_bytes(cfg: s03.TransformerConfig, tokens: int, dtype_bytes: int) -> int:
    """Bytes of weights a pass of `tokens` tokens reads at batch 1: every matrix, bias and
    norm once (S03's `cost_breakdown`, the LM head's V x C included, tied or not), and one
    embedding row per token (two for GPT-2: token and position), which is how S03 counts a
    lookup. For tokens = 1 this is S03's `bytes_per_token` without the K/V term."""
    fixed, lookup = _weight_bytes_parts(cfg, dtype_bytes)
    return fixed + tokens * lookup


@lru_cache(maxsize=None)
def _weight_bytes_parts(cfg: s03.TransformerConfig, dtype_bytes: int) -> tuple[int, int]:
    """(bytes read once per pass, bytes read per token) from S03's cost_breakdown."""
    rows = s03.cost_breakdown(cfg, 1, dtype_bytes)
    lookup = sum(r.bytes for r in rows if r.part in ("embedding", "position embedding"))
    attention = next(p.bytes for p in s03.layer_breakdown(cfg, 1, dtype_bytes)
                     if p.part.startswith("attention"))
    fixed = sum(r.bytes for r in rows) - lookup - cfg.num_hidden_layers * attention
    return fixed, lookup


def passes_for(cfg: s03.TransformerConfig, prompt_len: int, new_tokens: int) -> int:
    """S01's stop rules for a cache of max_position_embeddings positions (EOS ignored)."""
    limit = cfg.max_position_embeddings
    if not 1 <= prompt_len <= limit or new_tokens < 1:
        raise ValueError(f"need 1 <= prompt_len <= {limit} and new_tokens >= 1")
    return min(new_tokens, limit - prompt_len)


def pass_values(cfg, prompt_len: int, i: int, work: Work, cached: bool, dtype_bytes: int) -> dict:
    """Everything the page shows for pass i (0-based; context n = prompt_len + i)."""
    n = prompt_len + i
    fed = (prompt_len if i == 0 else 1) if cached else n
    return {"fed": fed, "context": n, "kv_computed": fed, "kv_written": fed if cached else 0,
            "kv_read": n, "pairs": fed * n, "head_rows": 1 if cached else n,
            "weight_flops": 2 * work.weight_macs, "attention_flops": 2 * work.attention_macs,
            "flops": 2 * work.macs, "weight_bytes": weight_bytes(cfg, fed, dtype_bytes),
            "kv_bytes_read": work.kv_bytes_read,
            "kv_bytes_written": kv_cache_bytes(cfg, fed, dtype_bytes) if cached else 0,
            "cache_used": kv_cache_bytes(cfg, n, dtype_bytes) if cached else 0}


CUMULATIVE = ("fed", "kv_computed", "kv_written", "pairs", "weight_flops", "attention_flops",
              "flops", "weight_bytes", "kv_bytes_read", "kv_bytes_written")


def as_text(values: dict) -> dict:
    return {k: str(v) for k, v in values.items()}


def reference(cfg, prompt_len: int, new_tokens: int, cached: bool, dtype_bytes: int) -> dict:
    """Per-pass and cumulative values at a few passes, and the totals, as decimal strings."""
    passes = passes_for(cfg, prompt_len, new_tokens)
    work = generation_work(cfg, prompt_len, passes, cached, dtype_bytes)
    shown = sorted({0, 1, passes // 2, passes - 1} & set(range(passes)))
    totals = dict.fromkeys(CUMULATIVE, 0)
    out = []
    for i, w in enumerate(work):
        values = pass_values(cfg, prompt_len, i, w, cached, dtype_bytes)
        for k in CUMULATIVE:
            totals[k] += values[k]
        if i in shown:
            out.append({"pass": i, "values": as_text(values), "cumulative": as_text(totals)})
        if cached and i > 0 and i in shown:     # the two closed forms agree on a decode step
            if 2 * w.macs != s03.flops_per_token(cfg, values["context"]):
                raise RuntimeError("S05's step_work and S03's flops_per_token disagree")
            if values["weight_bytes"] + w.kv_bytes_read != s03.bytes_per_token(
                    cfg, values["context"], dtype_bytes):
                raise RuntimeError("S05's K/V bytes plus weight bytes are not S03's bytes_per_token")
    return {"passes": passes, "shown": out, "totals": as_text(totals)}


def crossover(cfg, dtype_bytes: int) -> int:
    """The smallest context n at which a decode step reads more K/V bytes than weight bytes."""
    per_position = kv_cache_bytes(cfg, 1, dtype_bytes)
    n = weight_bytes(cfg, 1, dtype_bytes) // per_position + 1
    assert kv_cache_bytes(cfg, n, dtype_bytes) > weight_bytes(cfg, 1, dtype_bytes) \
        >= kv_cache_bytes(cfg, n - 1, dtype_bytes)
    return n


def measure(model, prompt_ids: list[int], passes: int, cached: bool) -> list[Work]:
    """Work counted by `count_work`, pass by pass, on greedy tokens (EOS ignored): the S01
    loop's `model.forward(ids)` on the whole context, or S05's prefill then decodes."""
    ids, out = list(prompt_ids), []
    runner = CachedTransformer(model) if cached else None
    for i in range(passes):
        with count_work(model) as work:
            if not cached:
                logits = model.forward(ids)[-1]
            elif i == 0:
                logits = runner.prefill(ids)
            else:
                logits = runner.decode(ids[-1])
        out.append(work)
        ids.append(int(np.argmax(logits)))
    return out


def configs() -> tuple[dict, dict]:
    """{id: TransformerConfig} and {id: display name}; the bundled model's only when
    data/model/config.json exists."""
    cfgs, names = {}, {}
    if (s03.BUNDLED_MODEL_DIR / "config.json").is_file():
        cfgs["bundled"] = load_config(s03.BUNDLED_MODEL_DIR)
        names["bundled"] = "the bundled model (data/model)"
    for key, (name, hf) in RELEASED.items():
        cfgs[key], names[key] = config_from_hf_dict(hf), name
    return cfgs, names


def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError when S05's and S03's closed forms
    disagree, or when the counted work is not the closed form."""
    cfgs, names = configs()
    data = {
        "source": "code/s05_kv_cache.py (generation_work, kv_cache_bytes, count_work) and "
                  "code/s03_transformer.py (cost_breakdown)",
        "configs": [{"id": key, "name": names[key], **shape(cfg)} for key, cfg in cfgs.items()],
        "crossover": {key: {str(b): crossover(cfg, b) for b in DTYPES} for key, cfg in cfgs.items()},
        "cases": [],
        "measured": None,
    }
    for key, dtype_bytes, prompt_len, new_tokens in GRID:
        if key not in cfgs:
            continue
        for cached in (False, True):
            data["cases"].append({"config": key, "dtype_bytes": dtype_bytes,
                                  "prompt_len": prompt_len, "new_tokens": new_tokens,
                                  "cached": cached,
                                  **reference(cfgs[key], prompt_len, new_tokens, cached,
                                              dtype_bytes)})
    if (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        model, tokenizer = load(s03.BUNDLED_MODEL_DIR)
        prompt_ids = tokenizer.encode(MEASURED["text"])[:MEASURED_PROMPT_LEN]
        if len(prompt_ids) != MEASURED_PROMPT_LEN:
            raise RuntimeError("the measured prompt encodes to fewer tokens than it needs")
        cfg = model.config
        measured = {**MEASURED, "prompt_len": MEASURED_PROMPT_LEN, "runs": {}}
        for cached in (False, True):
            counted = measure(model, prompt_ids, MEASURED["new_tokens"], cached)
            formula = generation_work(cfg, MEASURED_PROMPT_LEN, MEASURED["new_tokens"], cached)
            if [(w.weight_macs, w.attention_macs, w.kv_bytes_read) for w in counted] != \
                    [(w.weight_macs, w.attention_macs, w.kv_bytes_read) for w in formula]:
                raise RuntimeError("count_work on the bundled model differs from generation_work")
            measured["runs"]["on" if cached else "off"] = [
                [str(2 * w.weight_macs), str(2 * w.attention_macs), str(w.kv_bytes_read)]
                for w in counted]
        data["measured"] = measured
    return data


if __name__ == "__main__":  # print the size of what the page downloads
    import json
    print(f"{len(json.dumps(export(), separators=(',', ':'))):,} bytes")
