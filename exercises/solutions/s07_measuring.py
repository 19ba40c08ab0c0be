"""S07 exercises, reference solutions: the arithmetic intensity of a batched decode step, the batch size at which
decoding stops being bandwidth-bound, and latency numbers with percentiles written by hand.

Graded with `python exercises/grade.py --solutions s07`.

You need `TransformerConfig` from code/s03_transformer.py (imported below): its fields are the
Hugging Face names, `hidden_size` (C), `intermediate_size` (I), `num_hidden_layers` (L),
`num_attention_heads` (H), `num_key_value_heads` (Hkv), `head_dim` (D), `vocab_size` (V),
`tie_word_embeddings`, `qk_norm` (Qwen3's q_norm and k_norm), `model_type`. Build one from a
config.json dict with `config_from_hf_dict(d)` from code/s03_checkpoint.py.

Shape legend: B batch, T tokens in this step, S key/value length, H query heads, Hkv key/value
heads, D head dim, V vocabulary, L layers; C hidden size, I MLP size.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

from s03_transformer import TransformerConfig


# Exercise 1: FLOPs and bytes of a batched decode step (4 points) ------------------------------
# At batch 1 a decode step reads every weight to do about two FLOPs with it: about 0.5 FLOP per
# float32 byte. Batching B requests reads the weights once for all B tokens, so the FLOPs grow
# with B and the weight bytes do not. The K and V each request reads are its own, though.

def decode_step_cost(config: TransformerConfig, batch_size: int, context_len: int,
                     dtype_bytes: int = 4) -> tuple[int, int]:
    """(FLOPs, bytes) of one decode step of `batch_size` requests, each one new token attending
    to S = context_len positions (its own included), with a KV cache, for a Llama or Qwen3
    model (model_type "llama" or "qwen3", no biases).

    FLOPs, per request, as S03's `flops_per_token`: 2 per weight of every matrix the token
    goes through (per layer q_proj C*H*D, k_proj and v_proj C*Hkv*D each, o_proj H*D*C,
    gate_proj, up_proj, down_proj C*I each; and the LM head, V*C) plus attention, 4*H*D*S per
    layer (2*H*D*S for the scores q k^T, 2*H*D*S for the weighted sum of V). Norms, RoPE,
    softmax and activations count 0. Total: B times that.
    Bytes, in values of dtype_bytes bytes each:
      - read once per step, whatever B: every layer's matrices and norm weights (two RMSNorm
        weights of C, plus q_norm and k_norm of D each when config.qk_norm), the final norm (C)
        and the LM head matrix (V*C, tied to the embedding or not);
      - per request: one embedding row (C values) and, in every layer, K and V of S positions
        (S - 1 read from the cache and the new one written): 2*L*Hkv*D*S values.
    At batch 1 this is S03's `flops_per_token(config, S)` and `bytes_per_token(config, S,
    dtype_bytes)`.

    Returns (flops, bytes) as Python ints.
    Raises ValueError "batch_size must be an integer >= 1" (likewise "context_len must be an
    integer >= 1", "dtype_bytes must be an integer >= 1"; bools are not integers), and
    "only llama and qwen3 models without biases are supported" otherwise.
    Example: Qwen3-0.6B (C 1024, I 3072, L 28, H 16, Hkv 8, D 128, V 151936, tied, q/k norms)
    at batch 1, S = 1024, float32: 1,426,849,792 FLOPs and 2,619,084,800 bytes (0.545 FLOP per
    byte); at batch 64, 91,318,386,688 FLOPs and 17,416,847,360 bytes (5.24 FLOP per byte).
    """
    for name, value in (("batch_size", batch_size), ("context_len", context_len),
                        ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    cfg = config
    if cfg.model_type not in ("llama", "qwen3") or cfg.attention_bias or cfg.mlp_bias:
        raise ValueError("only llama and qwen3 models without biases are supported "
                         f"(got {cfg.model_type!r})")
    c, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    h_d, kv_d = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer_matrices = c * h_d + 2 * c * kv_d + h_d * c + 3 * c * cfg.intermediate_size
    layer_norms = 2 * c + (2 * d if cfg.qk_norm else 0)
    head = cfg.vocab_size * c
    flops_per_request = 2 * (layers * layer_matrices + head) + 4 * h_d * context_len * layers
    shared_values = layers * (layer_matrices + layer_norms) + c + head
    per_request_values = c + 2 * layers * kv_d * context_len
    return (batch_size * flops_per_request,
            (shared_values + batch_size * per_request_values) * dtype_bytes)


def arithmetic_intensity(config: TransformerConfig, batch_size: int, context_len: int,
                         dtype_bytes: int = 4) -> float:
    """FLOPs per byte moved of that step: decode_step_cost's flops / bytes (its errors pass
    through). Example: Qwen3-0.6B, batch 1, S = 1024, float32: 0.5448 FLOP/byte."""
    flops, moved = decode_step_cost(config, batch_size, context_len, dtype_bytes)
    return flops / moved


# Exercise 2: when does batching make decode compute-bound? (3 points) -------------------------
# A step is bandwidth-bound while its intensity is below the machine's ridge point (peak FLOP/s
# divided by bandwidth). Batching raises the intensity, but only up to a limit: the K/V bytes
# grow with B as fast as the FLOPs do.

def ridge_batch_size(config: TransformerConfig, context_len: int, dtype_bytes: int,
                     ridge_flop_per_byte: float) -> int | None:
    """The smallest batch size B >= 1 whose decode step (exercise 1) reaches the ridge:
    flops(B) / bytes(B) >= ridge_flop_per_byte. None when no batch size does, because the
    intensity only tends, as B grows, to (FLOPs per request) / (per-request bytes), which can
    be below the ridge at long contexts.

    Decide with exact arithmetic where you can (the FLOPs and bytes are integers): the answer
    must be right at the boundary, where flops(B) / bytes(B) equals the ridge exactly.
    Raises ValueError "ridge_flop_per_byte must be a finite number > 0" (and exercise 1's
    errors pass through).
    Example: Qwen3-0.6B in bfloat16 (dtype_bytes 2) against a ridge of 295 FLOP/byte (a GPU
    with about 989 TFLOP/s of bfloat16 matmul and 3.35 TB/s): at S = 1 the answer is 304; at
    S = 1024 it is None (the limit is 12.1 FLOP/byte).
    """
    if isinstance(ridge_flop_per_byte, bool) or not isinstance(ridge_flop_per_byte, (int, float)) \
            or not math.isfinite(ridge_flop_per_byte) or ridge_flop_per_byte <= 0:
        raise ValueError(f"ridge_flop_per_byte must be a finite number > 0 (got {ridge_flop_per_byte!r})")
    # flops(B) = B f and bytes(B) = W + B k, so B f >= r (W + B k)  <=>  B (f - r k) >= r W.
    f1, bytes1 = decode_step_cost(config, 1, context_len, dtype_bytes)
    f2, bytes2 = decode_step_cost(config, 2, context_len, dtype_bytes)
    k = bytes2 - bytes1                      # per-request bytes
    w = bytes1 - k                           # bytes read once per step
    r = Fraction(ridge_flop_per_byte)        # exact: a float is a binary fraction
    slope = f1 - r * k
    if slope <= 0:
        return None                          # the limit f / k is at or below the ridge
    return max(1, math.ceil(r * w / slope))


# Exercise 3: the numbers users feel, and percentiles by hand (3 points) -----------------------

def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile of values, by linear interpolation between closest ranks (NumPy's
    default, `np.percentile(values, p)`): sort the n values into x_0 <= ... <= x_{n-1}; the
    fractional index is i = p / 100 * (n - 1); the result is x_floor(i) + (i - floor(i)) *
    (x_ceil(i) - x_floor(i)). Write it without np.percentile, np.quantile or statistics.
    Example: percentile([4, 1, 3, 2], 50) == 2.5; percentile([1, 2, 3, 4, 100], 90) is 61.6
    up to float rounding.
    Raises ValueError "values must not be empty" and "p must be between 0 and 100".
    """
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("values must not be empty")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be between 0 and 100 (got {p})")
    index = p / 100 * (len(xs) - 1)
    lo, hi = math.floor(index), math.ceil(index)
    return xs[lo] + (index - lo) * (xs[hi] - xs[lo])


def request_latencies(start_s: float, output_times_s: Sequence[float],
                      tokens_per_output: Sequence[int]) -> dict:
    """See the stub in exercises/s07_measuring.py for the specification."""
    times = [float(t) for t in output_times_s]
    if not times:
        raise ValueError("a request needs at least one token")
    counts = list(tokens_per_output)
    if len(counts) != len(times) or any(isinstance(k, bool) or not isinstance(k, int) or k < 1
                                        for k in counts):
        raise ValueError("tokens_per_output must hold one integer >= 1 per output")
    if not (start_s <= times[0] and all(a <= b for a, b in zip(times, times[1:]))):
        raise ValueError("timestamps must be in order: start <= first output <= ... <= last "
                         "output")
    n = sum(counts)
    ttft, e2e = times[0] - start_s, times[-1] - start_s
    return {"ttft_s": ttft, "itl_s": [b - a for a, b in zip(times, times[1:])], "e2e_s": e2e,
            "tpot_s": None if n == 1 else (e2e - ttft) / (n - 1)}
