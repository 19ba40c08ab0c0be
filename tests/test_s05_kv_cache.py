"""Tests for chapter S05: the KV cache, prefill and decode, and the counted work.

Oracles: HF `transformers` (decode logits at every step against a full forward, and greedy
`generate`), the S01 loop running S03's uncached forward (greedy tokens), S04's engine (sampled
tokens with a fixed seed), and closed-form counts of multiply-adds and K/V bytes worked out by
hand in this file (never taken from the module under test).
"""
import numpy as np
import pytest

from s03_transformer import TransformerConfig
from s05_kv_cache import KVCache, kv_cache_bytes


# --- the cache itself -----------------------------------------------------------------------

def test_cache_layout_and_append_returns_filled_views():
    cache = KVCache(num_layers=2, num_kv_heads=3, max_seq_len=8, head_dim=4)
    assert cache.k.shape == cache.v.shape == (2, 3, 8, 4)
    assert cache.num_cached == 0 and cache.num_free == 8
    k1 = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3, 5, 4)
    keys, values = cache.append(0, k1, -k1)
    assert keys.shape == values.shape == (3, 5, 4)
    np.testing.assert_array_equal(keys, k1)
    np.testing.assert_array_equal(values, -k1)
    assert np.shares_memory(keys, cache.k)  # a view, not a copy
    assert cache.num_cached == 0            # layer 1 has not been written yet
    cache.append(1, k1, k1)
    assert cache.num_cached == 5 and cache.num_free == 3
    k2 = np.full((3, 1, 4), 7.0, dtype=np.float32)
    keys, _ = cache.append(0, k2, k2)
    assert keys.shape == (3, 6, 4)
    np.testing.assert_array_equal(keys[:, :5], k1)   # old positions untouched
    np.testing.assert_array_equal(keys[:, 5], np.full((3, 4), 7.0))
    cache.reset()
    assert cache.num_cached == 0 and cache.layer_lens == [0, 0]


def test_cache_never_writes_past_its_end():
    cache = KVCache(1, 1, 4, 2)
    block = np.ones((1, 3, 2), dtype=np.float32)
    cache.append(0, block, block)
    before = cache.k.copy()
    with pytest.raises(ValueError, match="KV cache is full: layer 0 holds 3 of 4 positions "
                                         "and cannot take 2 more"):
        cache.append(0, np.ones((1, 2, 2), np.float32), np.ones((1, 2, 2), np.float32))
    np.testing.assert_array_equal(cache.k, before)
    assert cache.num_cached == 3
    cache.append(0, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32))
    assert cache.num_free == 0


@pytest.mark.parametrize("args, message", [
    ((0, 1, 4, 2), "num_layers must be an integer >= 1"),
    ((1, 1, 0, 2), "max_seq_len must be an integer >= 1"),
    ((1, 2.0, 4, 2), "num_kv_heads must be an integer >= 1"),
    ((1, 1, 4, True), "head_dim must be an integer >= 1"),
])
def test_cache_rejects_bad_sizes(args, message):
    with pytest.raises(ValueError, match=message):
        KVCache(*args)


def test_cache_rejects_bad_dtype_layer_and_shapes():
    with pytest.raises(ValueError, match="dtype must be a floating-point type"):
        KVCache(1, 1, 4, 2, dtype=np.int32)
    cache = KVCache(2, 2, 4, 3)
    good = np.zeros((2, 1, 3), np.float32)
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\)"):
        cache.append(2, good, good)
    with pytest.raises(ValueError, match=r"k and v must both have shape \(Hkv=2, T, D=3\)"):
        cache.append(0, np.zeros((1, 1, 3), np.float32), np.zeros((1, 1, 3), np.float32))
    with pytest.raises(ValueError, match="k and v must both have shape"):
        cache.append(0, good, np.zeros((2, 2, 3), np.float32))


def qwen3_0_6b_config() -> TransformerConfig:
    """Qwen3-0.6B's published shape: L=28, H=16, Hkv=8, D=128 (config.json on the hub)."""
    return TransformerConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
                             norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6, qk_norm=True)


def test_kv_cache_bytes_by_hand():
    cfg = qwen3_0_6b_config()
    # 2 (K, V) * 28 layers * 8 heads * 128 dims * 2 bytes (bf16) = 114,688 bytes per token
    assert kv_cache_bytes(cfg, 1, dtype_bytes=2) == 114_688
    # the whole 40,960-token window in bf16: 114,688 * 40,960 = 4,697,620,480 bytes (4.4 GiB)
    assert kv_cache_bytes(cfg, 40_960, dtype_bytes=2) == 4_697_620_480
    assert kv_cache_bytes(cfg, 0) == 0
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv_cache_bytes(cfg, -1)
    with pytest.raises(ValueError, match="dtype_bytes must be >= 1"):
        kv_cache_bytes(cfg, 1, dtype_bytes=0)


def test_cache_nbytes_is_what_it_reserves():
    cache = KVCache(3, 2, 10, 4)                       # float32
    assert cache.nbytes == 2 * 3 * 2 * 10 * 4 * 4      # 1,920 bytes
    assert KVCache(3, 2, 10, 4, dtype=np.float16).nbytes == 960
