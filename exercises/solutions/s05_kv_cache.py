"""S05 exercises, reference solutions: cache memory, a sliding-window cache, reuse across turns.

Try the stubs in exercises/s05_kv_cache.py first; grade these with
`python exercises/grade.py --solutions s05`.

Sources followed: Hugging Face `config.json` field names and defaults (GPT-2's n_layer / n_head /
n_embd; head_dim = hidden_size / num_attention_heads when absent; MHA when num_key_value_heads is
absent); vLLM's "maximum concurrency" (tokens that fit in the KV cache / tokens per request);
sliding-window attention as in Mistral 7B (Jiang et al., 2023) and HF's sliding-window mask
(a query sees the `window` positions ending at itself); and vLLM's prefix reuse, done here for
one sequence.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

import s03_transformer as s03
from s03_transformer import Transformer
from s05_kv_cache import Engine


# Exercise 1: a cache memory calculator --------------------------------------------------------

def _get(config: Mapping, *names: str):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    return int(value)


def kv_bytes_per_token(hf_config: Mapping, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that one token occupies in the cache of the model in `hf_config`."""
    dtype_bytes = _positive_int(dtype_bytes, "dtype_bytes")
    layers = _get(hf_config, "num_hidden_layers", "n_layer")
    heads = _get(hf_config, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        missing = "num_hidden_layers" if layers is None else "num_attention_heads"
        raise ValueError(f"config has no {missing}")
    layers = _positive_int(layers, "num_hidden_layers")
    heads = _positive_int(heads, "num_attention_heads")
    kv_heads = _get(hf_config, "num_key_value_heads")
    kv_heads = heads if kv_heads is None else _positive_int(kv_heads, "num_key_value_heads")
    head_dim = _get(hf_config, "head_dim")
    if head_dim is None:
        hidden = _get(hf_config, "hidden_size", "n_embd")
        if hidden is None:
            raise ValueError("config has no head_dim and no hidden_size")
        hidden = _positive_int(hidden, "hidden_size")
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of "
                             f"num_attention_heads ({heads})")
        head_dim = hidden // heads
    head_dim = _positive_int(head_dim, "head_dim")
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def max_cached_tokens(hf_config: Mapping, memory_bytes: int, dtype_bytes: int = 2) -> int:
    """Whole tokens whose K and V fit in `memory_bytes`."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, np.integer)) \
            or memory_bytes < 0:
        raise ValueError(f"memory_bytes must be an integer >= 0 (got {memory_bytes!r})")
    return int(memory_bytes) // kv_bytes_per_token(hf_config, dtype_bytes)


def max_concurrent_requests(hf_config: Mapping, memory_bytes: int, tokens_per_request: int,
                            dtype_bytes: int = 2) -> int:
    """Requests of `tokens_per_request` tokens each whose caches fit in `memory_bytes` at once."""
    tokens_per_request = _positive_int(tokens_per_request, "tokens_per_request")
    return max_cached_tokens(hf_config, memory_bytes, dtype_bytes) // tokens_per_request


# Exercise 2: a sliding-window cache -----------------------------------------------------------

def window_visible(q_positions: Sequence[int], k_positions: Sequence[int], window: int
                   ) -> np.ndarray:
    """bool (T, S): query t may read key s iff 0 <= q_positions[t] - k_positions[s] < window."""
    window = _positive_int(window, "window")
    distance = np.asarray(q_positions)[:, None] - np.asarray(k_positions)[None, :]  # (T, S)
    return (distance >= 0) & (distance < window)


class RingKVCache:
    """Keys and values of the last `window` positions of one sequence, in a ring buffer."""

    def __init__(self, num_layers: int, num_kv_heads: int, window: int, head_dim: int):
        sizes = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "window": window,
                 "head_dim": head_dim}
        for name, value in sizes.items():
            _positive_int(value, name)
        shape = (num_layers, num_kv_heads, window, head_dim)
        self.window = window
        self.k = np.zeros(shape, dtype=np.float32)                   # (L, Hkv, W, D)
        self.v = np.zeros(shape, dtype=np.float32)                   # (L, Hkv, W, D)
        self.positions = np.full((num_layers, window), -1, np.int64)  # (L, W); -1 = empty slot
        self.layer_lens = [0] * num_layers                            # positions seen per layer

    @property
    def num_seen(self) -> int:
        return min(self.layer_lens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.positions[:] = -1
        self.layer_lens = [0] * len(self.layer_lens)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, position: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        num_layers, hkv, window, d = self.k.shape
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < num_layers:
            raise ValueError(f"layer must be an integer in [0, {num_layers}) (got {layer!r})")
        if k.shape != (hkv, 1, d) or v.shape != k.shape:
            raise ValueError(f"k and v must both have shape (Hkv={hkv}, 1, D={d}); got "
                             f"{k.shape} and {v.shape}")
        if position != self.layer_lens[layer]:
            raise ValueError(f"positions must be appended in order: layer {layer} expects "
                             f"position {self.layer_lens[layer]} (got {position})")
        slot = position % window                   # the oldest position's slot, once full
        self.k[layer, :, slot] = k[:, 0]
        self.v[layer, :, slot] = v[:, 0]
        self.positions[layer, slot] = position
        self.layer_lens[layer] = position + 1
        filled = min(position + 1, window)         # slots 0..filled-1 hold data
        return (self.k[layer, :, :filled], self.v[layer, :, :filled],
                self.positions[layer, :filled])


class SlidingWindowRunner:
    """S03's transformer with sliding-window attention over a RingKVCache, one token a step."""

    def __init__(self, model: Transformer, window: int):
        cfg = model.config
        self.model = model
        self.cache = RingKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, window,
                                 cfg.head_dim)

    def _step(self, token_id: int) -> np.ndarray:
        position = self.cache.num_seen
        ids, positions = self.model.check_positions([token_id], [position])
        x = self.model.embed(ids, positions)                               # (1, C)
        for layer, block in enumerate(self.model.blocks):
            q, k, v = block.qkv(x, positions)      # q (H, 1, D); k, v (Hkv, 1, D)
            keys, values, key_positions = self.cache.append(layer, k, v, position)
            scale = block.attention_scale() if hasattr(block, "attention_scale") else None
            # The ring holds only the last `window` positions, so S03's causal mask is the
            # window mask here; the slot order does not matter, each key carries its position.
            attn = s03.attention(q, keys, values, positions, key_positions, scale)
            x = block.finish(x, attn)                                      # (1, C)
        return self.model.head(x)[0].astype(np.float32, copy=False)        # (V,)

    def prefill(self, prompt_ids: Sequence[int]) -> np.ndarray:
        if len(prompt_ids) == 0:
            raise ValueError("prefill needs at least one prompt token")
        self.cache.reset()
        for token_id in prompt_ids:
            logits = self._step(int(token_id))
        return logits

    def decode(self, token_id: int) -> np.ndarray:
        if self.cache.num_seen == 0:
            raise ValueError("decode needs a prefilled cache: call prefill(prompt_ids) first")
        return self._step(int(token_id))


# Exercise 3: reusing the cache across turns ---------------------------------------------------

def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixReuseEngine(Engine):
    """S05's Engine that keeps the cached prefix a new request shares with the previous one."""

    def __init__(self, model: Transformer, tokenizer, max_context: int, **kwargs):
        super().__init__(model, tokenizer, max_context, **kwargs)
        self.cached_ids: list[int] = []       # whose K/V the cache holds, across requests
        self.computed_tokens: list[int] = []

    def model_step(self, seq) -> np.ndarray:
        ids = seq.token_ids
        # At least the last id must run: the cache stores K/V, not the logits they led to.
        keep = min(common_prefix_len(self.cached_ids, ids), len(ids) - 1)
        self.runner.cache.truncate(keep)
        self.cached_ids = self.cached_ids[:keep]
        new = ids[keep:]
        hidden = self.runner.step(new)                                     # (T_new, C)
        self.cached_ids = list(ids)
        seq.num_computed_tokens = len(ids)
        self.computed_tokens.append(len(new))
        return self.runner.model.head(hidden[-1:])[0].astype(np.float32, copy=False)  # (V,)
