"""Tests for chapter S05: the KV cache, prefill and decode, and the counted work.

Oracles: HF `transformers` (decode logits at every step against a full forward, the keys and
values in its DynamicCache, and greedy `generate`), the S01 loop running S03's uncached forward
(greedy tokens), S04's engine (sampled tokens with a fixed seed), and closed-form counts of
multiply-adds and K/V bytes worked out by hand in this file (never taken from the module under
test). The engine's loop is S01's; this chapter overrides its `model_step`, so whether a step
prefills or decodes is checked by counting the runner's calls (a `runner_class` subclass).
"""
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s04_sampling as s04
from engine_testing import counting_engine, run_in_turns
from model_testing import (
    EOS_UNUSED, PAD, TINY, V, IdTokenizer, build_tiny, first_difference, hf_greedy, hf_logits,
)
from s01_generation_loop import Engine as LoopEngine
from s03_transformer import Transformer, TransformerConfig
from s05_kv_cache import (
    CachedTransformer, CountingArray, Engine, KVCache, Work, count_work, generation_work,
    kv_cache_bytes, main, matmul_macs, step_work,
)

CONTEXT = 96       # max_position_embeddings of every tiny model
N_GENERATE = 36


def greedy(max_tokens=N_GENERATE, **kwargs) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def prompt_text(ids) -> str:
    return " ".join(map(str, ids))


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    """(name, HF model, our S03 Transformer loaded from its checkpoint)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(request.param, directory)
    return request.param, hf, Transformer.from_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_by_name(tmp_path_factory):
    """name -> (HF model, our S03 Transformer), each tiny model built once per module."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            hf = build_tiny(name, directory)
            built[name] = (hf, Transformer.from_pretrained(directory))
        return built[name]
    return get


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


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8), max_seq_len=st.integers(1, 20))
def test_cache_holds_exactly_the_appended_positions_in_order(chunks, max_seq_len):
    """Any sequence of appends: each fits iff the total stays within max_seq_len; the filled
    part is the concatenation of what fitted; a refused append changes nothing."""
    cache = KVCache(1, 2, max_seq_len, 3)
    stored, rng = [], np.random.default_rng(len(chunks))
    for t_len in chunks:
        k = rng.standard_normal((2, t_len, 3)).astype(np.float32)
        if len(stored) + t_len <= max_seq_len:
            cache.append(0, k, 2 * k)
            stored.extend(k.transpose(1, 0, 2))              # one (Hkv, D) slice per position
        else:
            with pytest.raises(ValueError, match="KV cache is full"):
                cache.append(0, k, 2 * k)
        assert cache.num_cached == len(stored)
    if stored:
        expected = np.stack(stored, axis=1)                   # (Hkv, S, D)
        np.testing.assert_array_equal(cache.k[0, :, :len(stored)], expected)
        np.testing.assert_array_equal(cache.v[0, :, :len(stored)], 2 * expected)


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
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
        kv_cache_bytes(cfg, -1)
    with pytest.raises(ValueError, match="dtype_bytes must be an integer >= 1"):
        kv_cache_bytes(cfg, 1, dtype_bytes=0)


def test_cache_nbytes_is_what_it_reserves():
    cache = KVCache(3, 2, 10, 4)                       # float32
    assert cache.nbytes == 2 * 3 * 2 * 10 * 4 * 4      # 1,920 bytes
    assert KVCache(3, 2, 10, 4, dtype=np.float16).nbytes == 960


# --- prefill and decode against HF and the uncached forward ---------------------------------

@pytest.mark.parametrize("prompt_len", [1, 37])
def test_decode_logits_match_hf_and_the_uncached_forward_at_every_step(tiny, prompt_len):
    """Prefill prompt_len tokens, then decode the rest of a 90-token sequence one at a time:
    the row returned at position t equals HF's (and S03's) logits row t of a full forward."""
    name, hf, model = tiny
    ids = np.random.default_rng(1).integers(0, V, size=90).tolist()
    runner = CachedTransformer(model)
    rows = [runner.prefill(ids[:prompt_len])] + [runner.decode(t) for t in ids[prompt_len:-1]]
    got = np.stack(rows)                                     # (90 - prompt_len, V)
    assert got.dtype == np.float32 and got.shape == (90 - prompt_len, V)
    assert runner.cache.num_cached == 89
    np.testing.assert_allclose(got, hf_logits(hf, ids)[prompt_len - 1:-1], rtol=1e-4, atol=2e-5,
                               err_msg=name)
    np.testing.assert_allclose(got, model.forward(ids)[prompt_len - 1:-1], rtol=1e-4, atol=2e-5,
                               err_msg=name)


def test_cached_keys_and_values_equal_hfs_cache(tiny):
    """After a prefill of 7 tokens and 5 decodes, our cache holds, layer by layer, the keys
    (rotated at their absolute positions) and values HF's DynamicCache holds for the same 12
    tokens run at once: Hkv heads of (S, D), nothing for the H - Hkv query heads."""
    name, hf, model = tiny
    ids = [11, 3, 58, 20, 7, 91, 44, 5, 5, 60, 2, 33]
    runner = CachedTransformer(model)
    runner.prefill(ids[:7])
    for token in ids[7:]:
        runner.decode(token)
    with torch.no_grad():
        hf_cache = hf(torch.tensor([ids]), use_cache=True).cache
    for layer in range(model.config.num_hidden_layers):
        hf_k = hf_cache.layers[layer].keys[0].numpy()       # (Hkv, S, D)
        hf_v = hf_cache.layers[layer].values[0].numpy()
        assert hf_k.shape == (runner.cache.num_kv_heads, 12, runner.cache.head_dim)
        np.testing.assert_allclose(runner.cache.k[layer, :, :12], hf_k, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name} keys, layer {layer}")
        np.testing.assert_allclose(runner.cache.v[layer, :, :12], hf_v, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name} values, layer {layer}")


def test_prefill_starts_over_and_decode_needs_a_prefill(tiny):
    name, hf, model = tiny
    runner = CachedTransformer(model, max_seq_len=10)
    with pytest.raises(ValueError, match="decode needs a prefilled cache"):
        runner.decode(3)
    runner.prefill([4, 5, 6])
    again = runner.prefill([7, 8])           # a new sequence: nothing of [4, 5, 6] remains
    assert runner.cache.num_cached == 2
    np.testing.assert_allclose(again, hf_logits(hf, [7, 8])[-1], rtol=1e-4, atol=2e-5)


def test_prompt_too_long_and_a_full_cache_are_errors_that_write_nothing(tiny):
    name, hf, model = tiny
    runner = CachedTransformer(model, max_seq_len=6)
    with pytest.raises(ValueError, match="prefill needs at least one prompt token"):
        runner.prefill([])
    with pytest.raises(ValueError, match=r"prompt is 7 tokens but the KV cache holds 6 "
                                         r"positions \(max_seq_len\)"):
        runner.prefill([1] * 7)
    runner.prefill([1, 2, 3, 4, 5])
    runner.decode(6)                          # fills the 6th and last position
    before = (runner.cache.k.copy(), runner.cache.v.copy())
    with pytest.raises(ValueError, match="KV cache is full: it holds 6 of 6 positions and "
                                         "cannot take 1 more"):
        runner.decode(7)
    assert runner.cache.num_cached == 6 and runner.cache.layer_lens == [6] * len(model.blocks)
    np.testing.assert_array_equal(runner.cache.k, before[0])
    np.testing.assert_array_equal(runner.cache.v, before[1])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        CachedTransformer(model).prefill([1, V])


@pytest.mark.parametrize("token_id", [3.7, 3.0, True, "3", -1, V, 10**20, np.int64(V)])
def test_decode_takes_one_integer_id_in_the_vocabulary(tiny_by_name, token_id):
    """decode(3.7) used to run (as token 3) and decode(10**20) ended in an OverflowError."""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    runner = CachedTransformer(model, max_seq_len=8)
    runner.prefill([1, 2])
    with pytest.raises(ValueError, match=r"token_id must be an integer in \[0, V=97\)"):
        runner.decode(token_id)
    assert runner.cache.num_cached == 2                      # nothing was written
    np.testing.assert_allclose(runner.decode(np.int64(3)), hf_logits(hf, [1, 2, 3])[-1],
                               rtol=1e-4, atol=2e-5)


def test_kv_cache_bytes_and_truncate_take_integers(tiny_by_name):
    hf, model = tiny_by_name("qwen3_gqa_tied")
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
        kv_cache_bytes(model.config, 2.5)
    with pytest.raises(ValueError, match="dtype_bytes must be an integer >= 1"):
        kv_cache_bytes(model.config, 2, dtype_bytes=True)
    runner = CachedTransformer(model, max_seq_len=8)
    runner.prefill([1, 2, 3])
    for bad in (1.5, True, "1"):
        with pytest.raises(ValueError, match=r"num_tokens must be an integer in \[0, 3\]"):
            runner.cache.truncate(bad)
    assert runner.cache.num_cached == 3


def test_cache_size_must_fit_the_models_positions(tiny):
    name, hf, model = tiny
    with pytest.raises(ValueError, match=r"max_seq_len must be an integer in "
                                         r"\[1, max_position_embeddings=96\]"):
        CachedTransformer(model, max_seq_len=97)
    with pytest.raises(ValueError, match=r"max_context \(97\) must be <= the model's "
                                         r"max_position_embeddings \(96\)"):
        Engine(model, IdTokenizer(), max_context=CONTEXT + 1)   # named as the caller wrote it
    runner = CachedTransformer(model)
    cfg = model.config
    assert runner.cache.k.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, CONTEXT,
                                    cfg.head_dim)


def test_engine_refuses_a_model_without_layers_to_cache():
    # S01's bigram has forward() but no layers: an S05 engine cannot stand on it (S04's can).
    tokenizer, bigram = s01.build_default()
    with pytest.raises(ValueError, match="model must be a Transformer \\(got BigramModel\\)"):
        Engine(bigram, tokenizer, max_context=64)


# --- the engine: greedy parity with the S01 loop and HF generate ----------------------------

@pytest.mark.parametrize("prompt_len", [1, 60, 90, 95])
def test_greedy_tokens_equal_s01_loop_and_hf_generate(tiny, prompt_len):
    """Prompts from one token to one short of the context: 90 and 95 hit the context limit
    (6 and 1 new tokens, finish_reason "length" from a full context). The prompt is the first
    random one after which HF's greedy run does not produce EOS_UNUSED, so every step compares."""
    name, hf, model = tiny
    new = min(N_GENERATE, CONTEXT - prompt_len)
    for seed in range(20):
        prompt = np.random.default_rng([prompt_len, seed]).integers(2, V, size=prompt_len).tolist()
        expected = hf_greedy(hf, prompt, new, eos_id=EOS_UNUSED)
        if len(expected) == new:
            break
    assert len(expected) == new, "no prompt without an early EOS found"
    loop = LoopEngine(model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), N_GENERATE)
    ours = Engine(model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), greedy())
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    assert ours.token_ids == loop.token_ids, first_difference(ours.token_ids, loop.token_ids)
    assert ours.finish_reason == loop.finish_reason == "length"
    assert ours.stop_reason is loop.stop_reason is None
    assert len(ours.token_ids) == new        # the budget, or what fits: prompt + new = context
    assert ours.stats.context_lens == loop.stats.context_lens


def test_s01_call_style_is_greedy_and_gives_the_s01_loops_ids(tiny_by_name):
    """`generate(prompt, 12)`, S01's call, on the cached engine: greedy, S01's and HF's ids."""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    prompt = [5, 17, 42, 8, 63]
    loop = LoopEngine(model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), 12)
    ours = Engine(model, IdTokenizer(), CONTEXT).generate(prompt_text(prompt), 12)
    assert ours.token_ids == loop.token_ids, first_difference(ours.token_ids, loop.token_ids)
    assert ours.token_ids == hf_greedy(hf, prompt, 12, eos_id=EOS_UNUSED)
    assert ours.stats.context_lens == loop.stats.context_lens == list(range(5, 17))


def test_eos_stop_equals_hf_generate(tiny):
    name, hf, model = tiny
    prompt = [5, 17, 42, 8, 63]
    free_run = hf_greedy(hf, prompt, N_GENERATE, eos_id=EOS_UNUSED)
    eos = next(t for t in free_run[3:] if t not in (PAD, EOS_UNUSED))
    expected = hf_greedy(hf, prompt, N_GENERATE, eos_id=eos)
    ours = Engine(model, IdTokenizer(eos), CONTEXT).generate(prompt_text(prompt), greedy())
    assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
    assert ours.finish_reason == "stop" and ours.stop_reason is None  # EOS: no stop named
    assert ours.token_ids[-1] == eos and eos not in ours.token_ids[:-1]


def test_context_boundaries(tiny):
    name, hf, model = tiny
    engine = Engine(model, IdTokenizer(), CONTEXT)
    full = engine.generate(prompt_text([3] * CONTEXT), greedy())
    assert full.token_ids == [] and full.stop_reason is None
    assert full.finish_reason == "length" and full.stats.passes == 0
    with pytest.raises(ValueError, match="prompt is 97 tokens but max_context is 96"):
        engine.generate(prompt_text([3] * (CONTEXT + 1)), greedy())
    small = Engine(model, IdTokenizer(), max_context=8)       # a cache smaller than the model's
    out = small.generate(prompt_text([3, 4, 5]), greedy(ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"   # 5 of a budget of 36
    assert small.runner.cache.num_cached == 7  # the 8th token was sampled, never run


# --- sampling: the cache changes speed, not meaning -----------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_tokens_and_logprobs_equal_s04_engine(tiny, seed):
    name, hf, model = tiny
    params = s04.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1,
                                max_tokens=30, seed=seed, logprobs=2)
    prompt = prompt_text([5, 17, 42, 8, 63])
    reference = s04.Engine(model, IdTokenizer(), CONTEXT).generate(prompt, params)
    ours = Engine(model, IdTokenizer(), CONTEXT).generate(prompt, params)
    assert ours.token_ids == reference.token_ids, first_difference(ours.token_ids,
                                                                   reference.token_ids)
    np.testing.assert_allclose([lp.logprob for lp in ours.logprobs],
                               [lp.logprob for lp in reference.logprobs], rtol=1e-4, atol=1e-5)


CountingEngine = counting_engine(Engine)


def test_a_request_prefills_once_then_decodes_one_token_per_step(tiny_by_name):
    """From the engine's own state: the first step of a request prefills its prompt, every
    later one decodes the newest token at the next position. 12 tokens: 1 prefill, 11 decodes."""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    engine = CountingEngine(model, IdTokenizer(), CONTEXT)
    out = engine.generate(prompt_text([5, 17, 42]), greedy(12))
    assert out.token_ids == hf_greedy(hf, [5, 17, 42], 12, eos_id=EOS_UNUSED)   # the oracle
    assert engine.runner.calls == [("prefill", 3)] + [("decode", n) for n in range(3, 14)]
    assert engine.runner.cache.num_cached == 14    # the 12th token was sampled, never run
    engine.runner.calls.clear()
    again = engine.generate(prompt_text([5, 17, 42]), greedy(12))   # a new request: prefill
    assert again.token_ids == out.token_ids
    assert engine.runner.calls == [("prefill", 3)] + [("decode", n) for n in range(3, 14)]


def test_interleaved_streams_on_one_engine_each_equal_their_solo_run(tiny_by_name):
    """Two requests streamed alternately share one cache. The engine knows the cache holds the
    other request's keys, so every step prefills the whole context again (never decodes on the
    wrong keys), and both results equal their solo runs and HF's. A request left alone again
    goes back to decoding."""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    engine = CountingEngine(model, IdTokenizer(), CONTEXT)
    prompt_ids = [[5, 17, 42], [9, 9, 1, 60]]
    prompts = [prompt_text(ids) for ids in prompt_ids]
    solo = [engine.generate(p, greedy(12)).token_ids for p in prompts]
    assert solo == [hf_greedy(hf, ids, 12, eos_id=EOS_UNUSED) for ids in prompt_ids]  # oracle
    assert solo[0] != solo[1]                                 # else the test could not fail
    engine.runner.calls.clear()
    results = run_in_turns([engine.stream(p, greedy(12)) for p in prompts])
    assert [r.token_ids for r in results] == solo
    expected = [("prefill", len(ids) + step) for step in range(12) for ids in prompt_ids]
    assert engine.runner.calls == expected

    # A runs 3 steps, B runs to the end, then A continues: one prefill of A's whole context
    # (prompt + 3 tokens), then decodes again.
    engine.runner.calls.clear()
    a, b = (engine.stream(p, greedy(12)) for p in prompts)
    for _ in range(3):
        next(a)
    list(b)
    mark = len(engine.runner.calls)
    list(a)
    assert (a.result.token_ids, b.result.token_ids) == (solo[0], solo[1])
    assert engine.runner.calls[mark:] == [("prefill", 3 + 3)] + [("decode", n)
                                                                 for n in range(6, 14)]


def test_a_failed_request_does_not_corrupt_another_ones_cache(tiny_by_name, monkeypatch):
    """A request whose prefill fails half way (a layer raises), after the cache was reset:
    the request streamed before it must then prefill again, not decode on the wrong cache.
    (A prompt id outside the vocabulary no longer gets that far: the engine refuses it at
    the door, `check_prompt`.)"""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    engine = CountingEngine(model, IdTokenizer(), CONTEXT)
    prompt = prompt_text([5, 17, 42])
    solo = engine.generate(prompt, greedy(10)).token_ids
    assert solo == hf_greedy(hf, [5, 17, 42], 10, eos_id=EOS_UNUSED)    # the oracle
    stream = engine.stream(prompt, greedy(10))
    next(stream), next(stream)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, V=97\)"):
        engine.generate(prompt_text([5, 500]), greedy(3))
    with monkeypatch.context() as patched, pytest.raises(ZeroDivisionError):
        patched.setattr(model.blocks[1], "finish", lambda x, attn: 1 / 0)
        engine.generate(prompt_text([5, 6]), greedy(3))
    mark = len(engine.runner.calls)
    list(stream)
    assert stream.result.token_ids == solo
    assert engine.runner.calls[mark] == ("prefill", 3 + 2)   # prompt and the 2 tokens so far


def test_a_step_that_fails_half_way_leaves_the_cache_as_it_was(tiny_by_name, monkeypatch):
    hf, model = tiny_by_name("llama_gqa_rope_scaling")
    runner = CachedTransformer(model)
    runner.prefill([4, 8, 15])
    with monkeypatch.context() as patched:          # layer 0 appends, then layer 1 fails
        patched.setattr(model.blocks[1], "finish", lambda x, attn: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            runner.decode(16)
    assert runner.cache.layer_lens == [3, 3]
    np.testing.assert_allclose(runner.decode(16), hf_logits(hf, [4, 8, 15, 16])[-1],
                               rtol=1e-4, atol=2e-5)
    runner.cache.truncate(2)
    assert runner.cache.num_cached == 2
    with pytest.raises(ValueError, match=r"num_tokens must be an integer in \[0, 2\]"):
        runner.cache.truncate(3)


# --- counted work: quadratic vs linear, by counting --------------------------------------------

def by_hand(cfg, new_tokens, context_len, logit_rows):
    """The closed form, written out here: per token per layer the q, k, v, o projections
    (C H D + 2 C Hkv D + H D C) and the MLP (3 C I, or 2 C I for GPT-2); the head C V per
    logits row; attention 2 H D per query-key pair; K and V reads 2 Hkv D x 4 bytes per key."""
    c, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    h, hkv, layers, vocab = (cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.num_hidden_layers, cfg.vocab_size)
    per_token = c * h * d + 2 * c * hkv * d + h * d * c + (2 if cfg.model_type == "gpt2" else 3) * c * i
    return (layers * new_tokens * per_token + logit_rows * c * vocab,
            layers * 2 * h * d * new_tokens * context_len,
            layers * 2 * hkv * d * context_len * 4)


def as_tuple(work: Work):
    return work.weight_macs, work.attention_macs, work.kv_bytes_read


def test_matmul_counting_by_hand():
    work = Work()
    a = np.ones((3, 4), np.float32).view(CountingArray)
    a.work = work
    b = np.ones((4, 5), np.float32)
    np.testing.assert_array_equal(a @ b, np.full((3, 5), 4.0))
    assert work.weight_macs == 3 * 4 * 5                    # 60
    out = np.ones((2, 3, 4), np.float32) @ a.T    # a view counts too: 2 x (3, 4) @ (4, 3) = 72
    assert work.weight_macs == 60 + 72 and type(out) is np.ndarray   # results are plain arrays
    np.testing.assert_array_equal(np.ones(3) * a[0, :3], np.ones(3))  # elementwise, not counted
    assert work.weight_macs == 132
    assert matmul_macs((4,), (4, 6)) == 24
    assert matmul_macs((7, 1, 2, 3), (5, 3, 8)) == 7 * 5 * 2 * 3 * 8  # broadcast batch 7 x 5


def test_one_prefill_and_one_decode_counted_by_hand(tiny_by_name):
    """llama_linear_tied: C=32, L=2, H=Hkv=4, D=8, I=64, V=97. One decode at context 6:
    weights 2 x (32*32 + 2*32*32 + 32*32 + 3*32*64) + 32*97 = 2 x 10,240 + 3,104 = 23,584;
    attention 2 layers x 2 x 4 heads x 8 x 1 query x 6 keys = 768; K/V 2 x 2 x 4 x 8 x 6 x 4 B
    = 3,072 bytes. The prefill of those 5 tokens: 5 x 20,480 + 3,104 = 105,504; 2*2*4*8*5*5 =
    3,200; 2*2*4*8*5*4 = 2,560."""
    hf, model = tiny_by_name("llama_linear_tied")
    runner = CachedTransformer(model)
    with count_work(model) as prefill:
        runner.prefill([1, 2, 3, 4, 5])
    with count_work(model) as decode:
        runner.decode(6)
    assert as_tuple(prefill) == (105_504, 3_200, 2_560)
    assert as_tuple(decode) == (23_584, 768, 3_072)
    assert as_tuple(step_work(model.config, 1, 6, 1)) == (23_584, 768, 3_072)
    with pytest.raises(ZeroDivisionError), count_work(model):
        1 / 0
    # the instrument is gone afterwards, even after an error: plain weights, S03's attention
    assert type(model.lm_head) is np.ndarray and s03.attention.__name__ == "attention"
    assert all(type(w) is np.ndarray for block in model.blocks for w in block.w.values())


@pytest.mark.parametrize("prompt_len, max_tokens", [(1, 20), (12, 30)])
def test_counted_work_equals_closed_forms_for_both_engines(tiny, prompt_len, max_tokens):
    """The S01 loop (S03's forward on the whole context every pass) against the cached
    engine, counted while they run: per pass n = prompt_len + i tokens of context, the loop does
    n tokens of weight work and n^2 query-key pairs, the cache 1 token and n pairs (after a
    prefill of prompt_len tokens and prompt_len^2 pairs). Both read K and V of n positions."""
    name, hf, model = tiny
    cfg = model.config
    prompt = prompt_text(np.arange(2, 2 + prompt_len) % V)
    with count_work(model) as loop_work:
        loop = LoopEngine(model, IdTokenizer(), CONTEXT).generate(prompt, max_tokens)
    with count_work(model) as cached_work:
        cached = Engine(model, IdTokenizer(), CONTEXT).generate(prompt, greedy(max_tokens))
    assert loop.token_ids == cached.token_ids and loop.stats.passes == max_tokens
    contexts = [prompt_len + i for i in range(max_tokens)]
    expected_loop = np.sum([by_hand(cfg, n, n, n) for n in contexts], axis=0)
    expected_cached = np.sum([by_hand(cfg, prompt_len, prompt_len, 1)]
                             + [by_hand(cfg, 1, n, 1) for n in contexts[1:]], axis=0)
    assert as_tuple(loop_work) == tuple(expected_loop), name
    assert as_tuple(cached_work) == tuple(expected_cached), name
    assert as_tuple(sum(generation_work(cfg, prompt_len, max_tokens, cached=False), Work())) \
        == tuple(expected_loop)
    assert as_tuple(sum(generation_work(cfg, prompt_len, max_tokens, cached=True), Work())) \
        == tuple(expected_cached)


def test_quadratic_vs_linear_attention_pairs_from_the_counts(tiny_by_name):
    """From a 1-token prompt over m passes the loop scores sum(n^2) = m(m+1)(2m+1)/6 query-key
    pairs per head and layer, the cache sum(n) = m(m+1)/2: 2,870 vs 210 for m = 20."""
    hf, model = tiny_by_name("qwen3_gqa_tied")
    cfg = model.config
    per_pair = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * cfg.head_dim
    with count_work(model) as loop_work:
        LoopEngine(model, IdTokenizer(), CONTEXT).generate("7", 20)
    with count_work(model) as cached_work:
        Engine(model, IdTokenizer(), CONTEXT).generate("7", greedy(20))
    assert loop_work.attention_macs == 2_870 * per_pair
    assert cached_work.attention_macs == 210 * per_pair


def test_closed_form_arguments_are_checked(tiny_by_name):
    cfg = tiny_by_name("gpt2")[1].config
    with pytest.raises(ValueError, match="need 1 <= new_tokens <= context_len"):
        step_work(cfg, 5, 4, 1)
    with pytest.raises(ValueError, match="need 0 <= logit_rows <= new_tokens"):
        step_work(cfg, 2, 4, 3)
    with pytest.raises(ValueError, match="need prompt_len >= 1 and passes >= 0"):
        generation_work(cfg, 0, 3, cached=True)


# --- the bundled model (skipped until scripts/train_bundled_model.py has written data/model) --

bundled = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists(),
                             reason="bundled model not trained yet (scripts/train_bundled_model.py)")


@bundled
@pytest.mark.slow
def test_bundled_greedy_equals_s01_loop_and_hf_generate():
    """A short prompt and a corpus prompt 12 tokens short of the context window."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(s03.BUNDLED_MODEL_DIR, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    model, tokenizer = s03_checkpoint.load()
    context = model.config.max_position_embeddings
    corpus = (s03.ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    long_ids = tokenizer.encode(corpus[:20 * context])[:context - 12]
    ids_tokenizer = IdTokenizer(tokenizer.eos_id)
    ids_tokenizer.vocab_size = model.vocab_size   # the bundled model's V, not the tiny models'
    for prompt in (tokenizer.encode("ROMEO.\n"), long_ids):
        expected = hf_greedy(hf, prompt, min(40, context - len(prompt)), eos_id=tokenizer.eos_id)
        loop = LoopEngine(model, ids_tokenizer, context).generate(prompt_text(prompt), 40)
        ours = Engine(model, ids_tokenizer, context).generate(prompt_text(prompt), greedy(40))
        assert ours.token_ids == expected, first_difference(ours.token_ids, expected)
        assert ours.token_ids == loop.token_ids, first_difference(ours.token_ids, loop.token_ids)
        assert (ours.finish_reason, ours.stop_reason) == (loop.finish_reason, loop.stop_reason)
    # The long prompt ends by EOS or by filling the context, 12 tokens after it.
    assert ours.finish_reason == "stop" or len(long_ids) + len(ours.token_ids) == context


# --- main -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    """A tiny random Qwen3 over the project's tokenizer (data/tokenizer.json), EOS <|endoftext|>."""
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("qwen3_with_tokenizer")
    tokenizer_json = s03.ROOT / "data" / "tokenizer.json"
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    config = Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=vocab,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         eos_token_id=vocab - 1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    shutil.copy(tokenizer_json, directory / "tokenizer.json")
    return directory


def test_main_generates_with_the_cache_and_prints_the_comparison(checkpoint_with_tokenizer, capsys):
    main(["--model", str(checkpoint_with_tokenizer), "--max-tokens", "8", "--prompt", "ROMEO."])
    out = capsys.readouterr().out
    # 2 x 2 layers x 2 heads x 8 dims x 4 bytes = 256 bytes per token; 64 tokens reserved
    assert "KV cache: 256 bytes per token (float32), 16,384 bytes reserved for 64 tokens" in out
    assert "the same tokens" in out and "DIFFERENT" not in out
    assert "pass 1 is the prefill" in out and "total" in out


def test_main_reports_bad_input_as_usage_errors(checkpoint_with_tokenizer, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(checkpoint_with_tokenizer), "--max-tokens", "0"])
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err
    for argv, message in [
            (["--max-context", "0"], "--max-context must be >= 1 (got 0)"),   # was: the default
            (["--max-context", "-3"], "--max-context must be >= 1 (got -3)"),
            (["--max-context", "65"], "--max-context must be at most the model's context "
                                      "window, max_position_embeddings = 64 (got 65)"),
            (["--prompt", "ab\udcff"],                                   # PEP 383 bytes
             "--prompt must be valid Unicode without lone surrogates")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(checkpoint_with_tokenizer), "--max-tokens", "2", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_main_reports_a_corrupt_checkpoint_as_a_usage_error(checkpoint_with_tokenizer, tmp_path,
                                                            capsys):
    """A corrupt file's own ValueError (here json's) used to escape as a traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint_with_tokenizer, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(broken), "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "config.json" in err
    assert "train_bundled_model" not in err       # the hint is for the bundled model only
    (broken / "config.json").write_text((checkpoint_with_tokenizer / "config.json").read_text())
    (broken / "tokenizer.json").write_text("{bad")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(broken), "--max-tokens", "2"])
    assert exit_info.value.code == 2 and "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("passes, rows", [
    (15, list(range(1, 16))),                       # short: every pass
    (16, list(range(1, 17))),                       # exactly max_rows
    (17, [1, 2, 3, 4, 5, 6, 7, 8, "...", 10, 11, 12, 13, 14, 15, 16, 17]),   # one left out
    (200, [1, 2, 3, 4, 5, 6, 7, 8, "...", 193, 194, 195, 196, 197, 198, 199, 200]),
])
def test_format_work_table_shows_every_pass_of_a_short_run_and_marks_what_it_leaves_out(
        passes, rows):
    # As S01's cost table: a long run shows its first and last passes with '...' between.
    from s05_kv_cache import format_work_table
    lines = format_work_table(qwen3_0_6b_config(), 5, passes).splitlines()
    first = [line.split()[0] for line in lines[1:-2]]
    assert [word if word == "..." else int(word) for word in first] == rows
    assert lines[-2].startswith("total")
    context = {int(line.split()[0]): int(line.split()[1]) for line in lines[1:-2]
               if line.split()[0] != "..."}
    assert all(n == 5 + i - 1 for i, n in context.items())   # pass i runs at context 5 + i - 1


def test_format_work_table_totals_count_the_passes_it_leaves_out():
    from s05_kv_cache import format_work_table, generation_work
    config = qwen3_0_6b_config()
    total = format_work_table(config, 5, 200).splitlines()[-2].split()
    macs = sum(w.macs for w in generation_work(config, 5, 200, cached=True))
    assert int(total[2].replace(",", "")) == macs
