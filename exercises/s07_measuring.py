"""S07 exercises: the arithmetic intensity of a batched decode step, the batch size at which
decoding stops being bandwidth-bound, and latency numbers with percentiles written by hand.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s07

You need `TransformerConfig` from code/s03_transformer.py (imported below): its fields are the
Hugging Face names, `hidden_size` (C), `intermediate_size` (I), `num_hidden_layers` (L),
`num_attention_heads` (H), `num_key_value_heads` (Hkv), `head_dim` (D), `vocab_size` (V),
`tie_word_embeddings`, `qk_norm` (Qwen3's q_norm and k_norm), `model_type`. Build one from a
config.json dict with `config_from_hf_dict(d)` from code/s03_checkpoint.py. Reference
solutions are in exercises/solutions/ -- try first, peek later.

Shape legend: B batch, T tokens in this step, S key/value length, H query heads, Hkv key/value
heads, D head dim, V vocabulary, L layers; C hidden size, I MLP size.
"""
from __future__ import annotations

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
    raise NotImplementedError("exercise 1a")


def arithmetic_intensity(config: TransformerConfig, batch_size: int, context_len: int,
                         dtype_bytes: int = 4) -> float:
    """FLOPs per byte moved of that step: decode_step_cost's flops / bytes (its errors pass
    through). Example: Qwen3-0.6B, batch 1, S = 1024, float32: 0.5448 FLOP/byte."""
    raise NotImplementedError("exercise 1b")


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
    raise NotImplementedError("exercise 2")


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
    raise NotImplementedError("exercise 3a")


def request_latencies(start_s: float, output_times_s: Sequence[float],
                      tokens_per_output: Sequence[int]) -> dict:
    """The latencies of one request from the harness's stamps, in seconds, as vLLM's
    `benchmark_serving.py` defines them.

    start_s: when the request was sent. output_times_s: when each output of the stream arrived,
    in order. tokens_per_output: how many tokens each output carried (1 each for Part I's
    engines; several when an engine yields several tokens per step). Returns a dict with
      - "ttft_s": time to first token, output_times_s[0] - start_s;
      - "itl_s": the inter-token latencies, one per output after the first: the gaps between
        consecutive outputs, however many tokens each carried (len(output_times_s) - 1 of
        them; empty for one output);
      - "e2e_s": end-to-end latency, start to the last output, output_times_s[-1] - start_s;
      - "tpot_s": time per output token after the first, (e2e_s - ttft_s) / (n - 1) for n
        tokens in all, None when n == 1.
    Example: start 10.0, outputs at 10.5, 10.6, 10.8 of one token each: ttft 0.5, itl [0.1,
    0.2] (up to float rounding), e2e 0.8, tpot 0.15. The same times carrying 2, 3 and 1
    tokens: the same ttft, itl and e2e, and tpot 0.3 / 5 = 0.06.
    Raises ValueError "a request needs at least one token" for no output, "tokens_per_output
    must hold one integer >= 1 per output" when the lists differ in length or a count is not
    an integer >= 1 (bools are not integers), and "timestamps must be in order: start <=
    first output <= ... <= last output" otherwise.
    """
    raise NotImplementedError("exercise 3b")
