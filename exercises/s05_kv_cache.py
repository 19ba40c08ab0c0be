"""S05 exercises: a cache memory calculator, a sliding-window cache, and reuse across turns.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s05

Everything you need is in code/s05_kv_cache.py and code/s03_transformer.py (imported below):
`Engine` (this chapter's engine: S01's loop with the `model_step(seq)` seam answered from the
cache; `self.runner` is its `CachedTransformer`; `seq` is S01's `Sequence`, with `token_ids`,
`num_computed_tokens` and `stats`), `CachedTransformer.step(ids)` (runs T new tokens after the
cached ones and returns their hidden states (T, C)), `KVCache.truncate(n)`, and from S03 a
model's `check_positions`, `embed`, `blocks[i].qkv`, `blocks[i].finish`, `head`, and the free
function `s03.attention(q, k, v, q_positions, k_positions, scale)`. Reference solutions are in
exercises/solutions/ -- try first, peek later.

Shape legend: T tokens in this step, S key/value length, H query heads, Hkv key/value heads,
D head dim, V vocabulary, L layers, W window.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

import s03_transformer as s03  # noqa: F401  (s03.attention)
from s03_transformer import Transformer
from s05_kv_cache import Engine


# Exercise 1: a cache memory calculator (3 points) ---------------------------------------------
# Before a server takes a request it must know whether the request's keys and values fit. The
# formula is the chapter's: 2 (K and V) x L x Hkv x D x bytes per value, per token. The catch
# is reading it out of a real config.json, whose field names and defaults vary by family.

def kv_bytes_per_token(hf_config: Mapping, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token occupies in the KV cache of the model `hf_config` describes.

    hf_config: the dict of a Hugging Face config.json. Read, with these fallbacks:
      - layers: "num_hidden_layers", else GPT-2's "n_layer";
      - query heads: "num_attention_heads", else "n_head";
      - key/value heads: "num_key_value_heads"; absent (GPT-2, older Llama) means one per
        query head (multi-head attention);
      - head dim: "head_dim"; absent means hidden size / query heads, the hidden size being
        "hidden_size", else "n_embd".
    A key present with the value None counts as absent. dtype_bytes: bytes per stored value
    (2 for bfloat16/float16, the usual serving dtype; 4 for float32; 1 for fp8).

    Raises ValueError: "config has no num_hidden_layers" (neither layer key),
    "config has no num_attention_heads", "config has no head_dim and no hidden_size",
    "hidden_size (...) must be a multiple of num_attention_heads (...)", and
    "<name> must be an integer >= 1" for any size or dtype_bytes that is not a positive int.
    Example: GPT-2 small (n_layer 12, n_head 12, n_embd 768) -> 2 x 12 x 12 x 64 x 2 = 36,864.
    """
    raise NotImplementedError("exercise 1a")


def max_cached_tokens(hf_config: Mapping, memory_bytes: int, dtype_bytes: int = 2) -> int:
    """How many whole tokens' K and V fit in memory_bytes (floor division).

    ValueError "memory_bytes must be an integer >= 0" for a negative or non-int budget; the
    config is read by `kv_bytes_per_token` (and its errors pass through).
    Example: Llama 3 8B (L 32, Hkv 8, D 128) in bf16 is 131,072 bytes per token, so 1 GiB
    holds exactly 8,192 tokens.
    """
    raise NotImplementedError("exercise 1b")


def max_concurrent_requests(hf_config: Mapping, memory_bytes: int, tokens_per_request: int,
                            dtype_bytes: int = 2) -> int:
    """How many requests of tokens_per_request tokens each (prompt + output) can hold their
    whole cache in memory_bytes at the same time: max_cached_tokens // tokens_per_request.

    This is the number vLLM logs at start-up as "Maximum concurrency for N tokens per request".
    ValueError "tokens_per_request must be an integer >= 1" otherwise.
    """
    raise NotImplementedError("exercise 1c")


# Exercise 2: a sliding-window cache (4 points) ------------------------------------------------
# Mistral 7B and some layers of Gemma 2 and 3 and gpt-oss let each token attend only to the last W
# positions (itself included). Then the cache never needs more than W positions: write each new
# key into slot position % W of a ring buffer, over the oldest one, and memory stays constant
# however long the text gets.

def window_visible(q_positions: Sequence[int], k_positions: Sequence[int], window: int
                   ) -> np.ndarray:
    """The sliding-window causal mask: bool (T, S), True where query t may read key s, that is
    0 <= q_positions[t] - k_positions[s] < window (W keys, the query's own position included;
    the same convention as Hugging Face's sliding-window mask).

    ValueError "window must be an integer >= 1" otherwise.
    Example: q = [5], k = [0..5], window 3 -> [[F, F, F, T, T, T]].
    """
    raise NotImplementedError("exercise 2a")


class RingKVCache:
    """Keys and values of the last `window` positions of one sequence, per layer.

    __init__(num_layers, num_kv_heads, window, head_dim): allocate, once,
      - self.k, self.v: float32 zeros (L, Hkv, W, D);
      - self.positions: int64 (L, W), the absolute position held by each slot, -1 when empty;
      - self.layer_lens: a list of L ints, positions appended so far per layer (all 0);
      - self.window = window.
    Every size must be an int >= 1, else ValueError "<name> must be an integer >= 1".

    num_seen (property): positions appended in every layer, min(layer_lens).
    nbytes (property): bytes of self.k plus self.v; it never grows.
    reset(): forget everything (positions -1, layer_lens 0); keep the memory.

    append(layer, k, v, position) -> (keys, values, key_positions):
      layer: int in [0, L) (else ValueError "layer must be an integer in [0, L)");
      k, v: float32 (Hkv, 1, D), one new position, already rotated by RoPE (else ValueError
        "k and v must both have shape (Hkv=.., 1, D=..)");
      position: must equal layer_lens[layer] (else ValueError "positions must be appended in
        order"): positions arrive one at a time, 0, 1, 2, ...
      Writes k, v and position into slot position % W, then returns the filled slots: keys and
      values (Hkv, n, D) and key_positions (n,), n = min(position + 1, W), in slot order (not
      position order: attention does not care about the order of keys, only about the position
      each one carries).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, window: int, head_dim: int):
        raise NotImplementedError("exercise 2b")

    @property
    def num_seen(self) -> int:
        raise NotImplementedError("exercise 2b")

    @property
    def nbytes(self) -> int:
        raise NotImplementedError("exercise 2b")

    def reset(self) -> None:
        raise NotImplementedError("exercise 2b")

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, position: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError("exercise 2b")


class SlidingWindowRunner:
    """S03's transformer with sliding-window attention, one token per step, over a RingKVCache.

    __init__(model, window): keep the model in self.model and build self.cache, a RingKVCache
    with the model's L, Hkv and D.

    A step for one token at position p = cache.num_seen: check it with
    model.check_positions([token_id], [p]), embed it, and in every layer take q, k, v from
    block.qkv, append k and v to the ring, attend with
    s03.attention(q, keys, values, positions, key_positions, scale) (scale is
    block.attention_scale() when the block has that method, GPT-2, else None), then
    block.finish. Because the ring holds exactly the last W positions, S03's causal mask *is*
    the window mask here. Logits: model.head of the last hidden row, float32 (V,).

    prefill(prompt_ids) -> logits (V,) after the prompt: reset the cache, then run the prompt
    one token at a time (a multi-token step would need window_visible inside attention; one at
    a time keeps S03's attention unchanged). ValueError "prefill needs at least one prompt
    token" for an empty prompt.
    decode(token_id) -> logits (V,): one step. ValueError "decode needs a prefilled cache" when
    nothing was prefilled. Positions are limited only by the model's max_position_embeddings,
    not by the cache: that is the point.
    """

    def __init__(self, model: Transformer, window: int):
        raise NotImplementedError("exercise 2c")

    def prefill(self, prompt_ids: Sequence[int]) -> np.ndarray:
        raise NotImplementedError("exercise 2c")

    def decode(self, token_id: int) -> np.ndarray:
        raise NotImplementedError("exercise 2c")


# Exercise 3: reusing the cache across turns (3 points) ----------------------------------------
# In a chat, turn 2's prompt is turn 1's prompt, turn 1's answer and the new message. The
# chapter's Engine prefills all of it again. The cache already holds most of it.

def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share. Example: [1, 2, 3], [1, 2, 4, 5] -> 2."""
    raise NotImplementedError("exercise 3a")


class PrefixReuseEngine(Engine):
    """S05's Engine that keeps the part of the cache a new request shares with what it holds.

    __init__(model, tokenizer, max_context, **kwargs): as Engine, plus
    self.cached_ids = [] (the ids whose K/V the cache holds, whichever request put them there)
    and self.computed_tokens = [] (one entry per model step: how many tokens it ran).

    Override one seam, model_step(seq) -> raw logits (V,) for the token after ids =
    seq.token_ids (the chapter's Engine asks "does this request own the cache?"; this one asks
    "how much of these ids does the cache hold?", whoever asked before):
      1. keep = common_prefix_len(self.cached_ids, ids), but at most len(ids) - 1: the last id
         must always run, because the cache stores keys and values, not the logits that
         followed them (a request repeating the cached ids exactly still runs one token).
      2. Forget the rest: self.runner.cache.truncate(keep) and self.cached_ids[:keep].
      3. Run only ids[keep:] with self.runner.step(...), take the LM head
         (self.runner.model.head) of the last hidden row; append len(ids) - keep to
         self.computed_tokens; now self.cached_ids = list(ids) and
         seq.num_computed_tokens = len(ids).
    An ordinary decode step is the special case keep = len(ids) - 1. If step raises (a bad id,
    a full cache), the cache and self.cached_ids must still agree (step already rolls the
    cache back to `keep` positions).
    Greedy tokens must equal Engine's, request after request: reuse changes cost, not meaning.
    """

    def __init__(self, model: Transformer, tokenizer, max_context: int, **kwargs):
        raise NotImplementedError("exercise 3b")

    def model_step(self, seq) -> np.ndarray:
        raise NotImplementedError("exercise 3b")
