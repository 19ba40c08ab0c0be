"""S06 exercises: bfloat16 by hand, the bytes of a decode step, and a greedy loop with one
device-to-host transfer per request.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s06

Everything you need is in code/s06_torch.py (imported below): `CachedTransformer` (its
`prefill(prompt_ids)` returns the logits of the token after the prompt, float32 (V,) on the
model's device; `decode(token)` takes that token as an int64 (1,) tensor *on the device* and
returns the next logits, (V,) on the device; `cache.max_seq_len` is the positions it holds).
Reference solutions are in exercises/solutions/ -- try first, peek later.

Shape legend: T tokens in this step, S key/value length, H query heads, Hkv key/value heads,
D head dim, V vocabulary, L layers; C hidden size, I MLP size.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch  # noqa: F401  (torch.argmax, torch.empty, ...)

from s06_torch import CachedTransformer


# Exercise 1: bfloat16 by hand (3 points) ------------------------------------------------------
# bfloat16 is float32 with the low 16 bits of the mantissa cut off: same sign bit, same 8
# exponent bits (so the same range), 7 mantissa bits instead of 23 (so about 3 significant
# decimal digits). Converting is rounding the 32-bit pattern to its top 16 bits.

def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Each value of x rounded to the nearest bfloat16 value, returned as float32.

    x: a float32 NumPy array of any shape. Work on the bit patterns (`x.view(np.uint32)`):
    keep the top 16 bits, rounding to the nearest representable value; an exact tie (the low
    16 bits are 0x8000) goes to the neighbour whose kept pattern is even (round half to even,
    what PyTorch's `.to(torch.bfloat16)` does). Consequences to get right:
      - 1 + 2**-8 lies exactly half way between 1 and 1 + 2**-7: the result is 1.0;
      - a finite value past the largest bfloat16, (2 - 2**-7) * 2**127, by at least half a step
        rounds to +-inf (float32's largest value does);
      - +-inf stay +-inf, +-0 stay +-0, NaN stays NaN (a naive carry could turn a NaN into inf).
    Returns a new float32 array of x's shape whose every value is exactly representable in
    bfloat16 (its low 16 bits are 0, except for NaN).
    Raises ValueError "x must be a float32 NumPy array" for anything else.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the bytes of a decode step (3 points) --------------------------------------------
# At batch size 1 a decode step reads every weight once to produce one token, plus the cached
# keys and values; it does about one multiply-add per weight read, far too little arithmetic
# to keep a GPU's compute units busy. So its speed is set by memory bandwidth.

def decode_step_bytes(hf_config: Mapping, context_len: int, dtype_bytes: int = 2) -> int:
    """Bytes one decode step (batch size 1) must read from memory, for a Llama / Qwen3 model.

    hf_config: the dict of a Hugging Face config.json of the Llama family (Llama, Qwen3).
    Read "hidden_size" (C), "intermediate_size" (I), "num_hidden_layers" (L),
    "num_attention_heads" (H), "vocab_size" (V), "num_key_value_heads" (Hkv; absent or None
    means H), "head_dim" (D; absent or None means C / H), "tie_word_embeddings" (absent means
    False, the default of LlamaConfig and Qwen3Config), "model_type".
    Count, in values of dtype_bytes bytes each:
      - per layer: q_proj C*H*D, k_proj and v_proj C*Hkv*D each, o_proj H*D*C, the MLP's
        gate_proj, up_proj and down_proj C*I each, two RMSNorm weights of C; for model_type
        "qwen3" also q_norm and k_norm, D each;
      - the final norm, C, and the LM head, the whole (V, C) matrix (it scores every token);
      - the input embedding: a lookup reads one row, C values. With tied embeddings that row
        belongs to the LM head's matrix, which is already counted: add nothing;
      - K and V of context_len positions in every layer: 2 * L * Hkv * D * context_len.
    context_len: the positions attention reads in this step (the new one included), >= 1.
    Returns the total in bytes.

    Raises ValueError: "config has no <name>" for a missing required size; "<name> must be an
    integer >= 1" for a size, context_len or dtype_bytes that is not a positive int;
    "hidden_size (...) must be a multiple of num_attention_heads (...)" when D must be derived
    and cannot be; "biases are not supported" when "attention_bias" or "mlp_bias" is true.
    Example: Qwen3-0.6B has 596,049,920 parameters, all of them read (tied embeddings); in
    bfloat16 at context 1,024 the step reads 1,309,540,352 bytes.
    """
    raise NotImplementedError("exercise 2a")


def decode_floor_s(hf_config: Mapping, context_len: int, dtype_bytes: int,
                   bandwidth_bytes_per_s: float) -> float:
    """The time a decode step takes if reading its bytes were the only cost: decode_step_bytes
    / bandwidth_bytes_per_s, in seconds. No real step is faster; 1 / floor is the ceiling on
    tokens per second of one request. Raises ValueError "bandwidth_bytes_per_s must be a finite
    number > 0" otherwise (and decode_step_bytes's errors pass through).
    Example: the Qwen3-0.6B step above at 1e12 bytes/s takes 1.30954 ms: at most 763.6 tokens/s.
    """
    raise NotImplementedError("exercise 2b")


# Exercise 3: one transfer per request (4 points) ----------------------------------------------
# The chapter's Engine reads each token on the host (`.item()`) to check the stop rules, and on
# a GPU that read waits for the device every step. When the host does not need to look at
# every token (here: greedy, a fixed budget, EOS checked afterwards), the tokens can stay on the
# device, each fed straight into the next decode step, and come over once, at the end.

def generate_greedy_on_device(runner: CachedTransformer, prompt_ids: Sequence[int],
                              max_tokens: int, eos_id: int | None = None) -> list[int]:
    """Greedy tokens after prompt_ids, with no device-to-host transfer until the end.

    runner: a CachedTransformer (any device). Prefill the prompt, then repeat max_tokens times:
    pick the token with `torch.argmax` on the logits (on the device; lowest id on a tie, the
    Engine's greedy rule), store it in a preallocated int64 tensor of max_tokens ids on the
    device, and, except after the last one, decode it (as an int64 (1,) device tensor) to get
    the next logits. Never read a token on the host inside the loop (no `.item()`, `.tolist()`,
    `.cpu()`, `int(...)`, `bool(...)` on a tensor, no `if` on a tensor): the number of such
    reads must not grow with max_tokens. Bring all the ids over at the end, then, on the host,
    when eos_id is not None and occurs, cut the list after its first occurrence (EOS included,
    as the Engine's `token_ids`). The price: steps run after EOS are wasted work.
    Returns the ids as a list of Python ints: the Engine's greedy `token_ids` for the same
    prompt and max_tokens (with eos_id its EOS).

    Raises ValueError "max_tokens must be an integer >= 1", and a ValueError containing "do not
    fit in the KV cache" when len(prompt_ids) + max_tokens - 1 positions exceed
    runner.cache.max_seq_len (checked before any work is done).
    """
    raise NotImplementedError("exercise 3")
