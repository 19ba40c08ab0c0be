"""Graded tests for the S05 exercises (see exercises/s05_kv_cache.py).

Oracles, none of them the solution: sizes worked out by hand from published config.json values
(GPT-2, Qwen3-0.6B, Llama 3 8B, Mistral 7B); the chapter's tested `kv_cache_bytes` on configs
saved by `transformers`; HF transformers' Qwen3 with `use_sliding_window` (its own
sliding-window mask, eager attention) for the logits at every position; and the chapter's tested
`Engine`, S01 loop and `step_work` closed form for the reuse engine's tokens and counted work.
"""
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from exercise_loader import load_exercise
from s01_generation_loop import Engine as LoopEngine
from s03_checkpoint import load_config
from s03_transformer import Transformer
from s04_sampling import SamplingParams
from s05_kv_cache import Engine, count_work, kv_cache_bytes, step_work

ex = load_exercise("s05_kv_cache")
GiB = 1024 ** 3

# Published config.json fields (only those the formula reads, plus a few it must ignore).
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
QWEN3_0_6B = {"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 1024}
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "hidden_size": 4096}           # no head_dim: 4096 / 32
MISTRAL_7B = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": None,
              "sliding_window": 4096}


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_bytes_per_token_by_hand():
    assert ex.kv_bytes_per_token(GPT2) == 36_864                 # 2*12*12*64*2, MHA
    assert ex.kv_bytes_per_token(GPT2, dtype_bytes=4) == 73_728
    assert ex.kv_bytes_per_token(QWEN3_0_6B) == 114_688          # 2*28*8*128*2; 128 != 1024/16
    assert ex.kv_bytes_per_token(LLAMA3_8B) == 131_072           # 2*32*8*128*2
    assert ex.kv_bytes_per_token(MISTRAL_7B, dtype_bytes=1) == 65_536  # fp8; None = absent
    # The same Llama 3 shape with one K/V head per query head (no GQA) would need 4x as much.
    mha = dict(LLAMA3_8B, num_key_value_heads=None)
    assert ex.kv_bytes_per_token(mha) == 4 * 131_072


@pytest.mark.points(1)
def test_budgets_by_hand():
    assert ex.max_cached_tokens(LLAMA3_8B, GiB) == 8_192          # 2**30 / 2**17 exactly
    assert ex.max_cached_tokens(LLAMA3_8B, GiB - 1) == 8_191
    assert ex.max_cached_tokens(QWEN3_0_6B, GiB) == 9_362         # 1,073,741,824 / 114,688
    assert ex.max_cached_tokens(GPT2, 0) == 0
    # 16 GiB for the cache of Llama 3 8B, requests of 8,192 tokens: 131,072 tokens, 16 at once.
    assert ex.max_concurrent_requests(LLAMA3_8B, 16 * GiB, 8_192) == 16
    assert ex.max_concurrent_requests(LLAMA3_8B, 16 * GiB, 8_193) == 15
    assert ex.max_concurrent_requests(QWEN3_0_6B, 10 * GiB, 40_960) == 2   # 93,622 // 40,960


@pytest.mark.points(1)
def test_config_errors_and_agreement_with_the_chapter(tmp_path):
    with pytest.raises(ValueError, match="config has no num_hidden_layers"):
        ex.kv_bytes_per_token({"num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="config has no num_attention_heads"):
        ex.kv_bytes_per_token({"num_hidden_layers": 2, "hidden_size": 64})
    with pytest.raises(ValueError, match="config has no head_dim and no hidden_size"):
        ex.kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4})
    with pytest.raises(ValueError, match=r"hidden_size \(66\) must be a multiple of "
                                         r"num_attention_heads \(4\)"):
        ex.kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4,
                               "hidden_size": 66})
    with pytest.raises(ValueError, match="dtype_bytes must be an integer >= 1"):
        ex.kv_bytes_per_token(GPT2, dtype_bytes=0)
    with pytest.raises(ValueError, match="memory_bytes must be an integer >= 0"):
        ex.max_cached_tokens(GPT2, -1)
    with pytest.raises(ValueError, match="tokens_per_request must be an integer >= 1"):
        ex.max_concurrent_requests(GPT2, GiB, 0)
    # A config.json written by transformers, read by the chapter's tested code: same bytes.
    import json
    config = Qwen3Config(hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=12, intermediate_size=64, vocab_size=50)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    ours = load_config(tmp_path)
    for dtype_bytes in (1, 2, 4):
        assert ex.kv_bytes_per_token(raw, dtype_bytes) == kv_cache_bytes(ours, 1, dtype_bytes)


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_window_mask_and_ring_by_hand():
    mask = ex.window_visible([5], list(range(6)), 3)
    np.testing.assert_array_equal(mask, [[False, False, False, True, True, True]])
    mask = ex.window_visible([0, 1, 2, 3], [0, 1, 2, 3], 2)        # a band of width 2
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    assert ex.window_visible([9], [9, 2], 1).tolist() == [[True, False]]
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        ex.window_visible([0], [0], 0)

    ring = ex.RingKVCache(num_layers=2, num_kv_heads=1, window=3, head_dim=2)
    assert ring.k.shape == ring.v.shape == (2, 1, 3, 2) and ring.nbytes == 2 * 2 * 3 * 2 * 4
    assert ring.positions.tolist() == [[-1, -1, -1]] * 2 and ring.num_seen == 0
    for p in range(5):                                              # positions 0..4 in layer 0
        kv = np.full((1, 1, 2), float(p), np.float32)
        keys, values, key_positions = ring.append(0, kv, -kv, p)
    # Slots hold p % 3: position 3 in slot 0, 4 in slot 1, 2 in slot 2.
    assert key_positions.tolist() == [3, 4, 2]
    np.testing.assert_array_equal(keys[0, :, 0], [3.0, 4.0, 2.0])
    np.testing.assert_array_equal(values[0, :, 0], [-3.0, -4.0, -2.0])
    assert ring.num_seen == 0                                       # layer 1 saw nothing yet
    zero = np.zeros((1, 1, 2), np.float32)
    _, _, first = ring.append(1, zero, zero, 0)
    assert first.tolist() == [0] and ring.num_seen == 1
    assert ring.nbytes == 2 * 2 * 3 * 2 * 4                         # it never grows
    with pytest.raises(ValueError, match="positions must be appended in order"):
        ring.append(1, np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32), 3)
    with pytest.raises(ValueError, match="k and v must both have shape"):
        ring.append(1, np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.float32), 1)
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\)"):
        ring.append(2, np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32), 0)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        ex.RingKVCache(1, 1, 0, 2)
    ring.reset()
    assert ring.num_seen == 0 and ring.positions.max() == -1


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=48, vocab_size=41, max_position_embeddings=128,
            tie_word_embeddings=True, eos_token_id=0, pad_token_id=1)
WINDOW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF Qwen3 with a sliding window of 6 in every layer, HF Qwen3 without one, our S03
    Transformer): the same random weights, N(0, 0.3^2) so the logits are spread."""
    torch.manual_seed(5)
    plain = Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("tiny_qwen3_s05")
    plain.save_pretrained(directory)
    config = Qwen3Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=0)
    config._attn_implementation = "eager"
    windowed = Qwen3ForCausalLM(config).eval()
    windowed.load_state_dict(plain.state_dict())
    plain.config._attn_implementation = "eager"
    return windowed, plain, Transformer.from_pretrained(directory)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


IDS = np.random.default_rng(7).integers(2, 41, size=40).tolist()


@pytest.mark.points(1)
@pytest.mark.parametrize("prompt_len", [3, 20])
def test_sliding_window_logits_match_hf_at_every_position(models, prompt_len):
    """A prompt shorter than the window, then one longer: the rows from prefill and every
    decode up to position 39 equal HF's sliding-window logits, and differ from full attention
    once the text is longer than the window (so the window is really applied)."""
    windowed, plain, model = models
    runner = ex.SlidingWindowRunner(model, WINDOW)
    rows = [runner.prefill(IDS[:prompt_len])] + [runner.decode(t) for t in IDS[prompt_len:]]
    got = np.stack(rows)                                           # (41 - prompt_len, V)
    assert got.shape == (41 - prompt_len, 41) and got.dtype == np.float32
    expected = hf_logits(windowed, IDS)[prompt_len - 1:]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5)
    full = hf_logits(plain, IDS)[prompt_len - 1:]
    assert np.abs(got[-1] - full[-1]).max() > 1e-2
    assert runner.cache.nbytes == 2 * 2 * 2 * WINDOW * 8 * 4       # L=2, Hkv=2, W, D=8: constant
    assert runner.cache.num_seen == 40


@pytest.mark.points(1)
def test_sliding_window_runner_errors_and_restart(models):
    windowed, _, model = models
    runner = ex.SlidingWindowRunner(model, WINDOW)
    with pytest.raises(ValueError, match="decode needs a prefilled cache"):
        runner.decode(3)
    with pytest.raises(ValueError, match="prefill needs at least one prompt token"):
        runner.prefill([])
    runner.prefill(IDS[:15])
    again = runner.prefill(IDS[20:24])                             # a new sequence from position 0
    np.testing.assert_allclose(again, hf_logits(windowed, IDS[20:24])[-1], rtol=1e-4, atol=2e-5)


# Exercise 3 ----------------------------------------------------------------------------------

class IdTokenizer:
    """Prompts are token ids written as text: exact ids, no tokenizer in the way. vocab_size is
    the tiny model's V (the engine checks that the tokenizer covers its ids)."""

    eos_id = 0
    vocab_size = 41

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def text(ids):
    return " ".join(map(str, ids))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.points(1)
def test_common_prefix_len_by_hand():
    assert ex.common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert ex.common_prefix_len([], [1]) == 0
    assert ex.common_prefix_len([7, 8], [7, 8, 9]) == 2
    assert ex.common_prefix_len([7, 8, 9], [7, 8]) == 2
    assert ex.common_prefix_len([4], [5]) == 0


@pytest.mark.points(1)
def test_second_turn_runs_only_its_new_tokens(models):
    """Turn 1: prompt P1, 12 greedy tokens C1. Turn 2: P1 + C1 + P2. The cache holds P1 and all
    of C1 but its last token (sampled, never run), so turn 2's first pass runs len(P2) + 1
    tokens against a context of len(P1 + C1 + P2): counted work equal to the chapter's closed
    form, and the tokens of both turns equal the plain Engine's and the S01 loop's."""
    _, _, model = models
    p1, p2 = IDS[:9], IDS[30:35]
    reuse = ex.PrefixReuseEngine(model, IdTokenizer(), max_context=128)
    plain = Engine(model, IdTokenizer(), max_context=128)
    turn1 = reuse.generate(text(p1), GREEDY)
    assert turn1.token_ids == plain.generate(text(p1), GREEDY).token_ids
    ids2 = p1 + turn1.token_ids + p2
    reuse.computed_tokens.clear()
    with count_work(model) as work:
        turn2 = reuse.generate(text(ids2), SamplingParams(temperature=0.0, max_tokens=1))
    assert reuse.computed_tokens == [len(p2) + 1]
    expected = step_work(model.config, len(p2) + 1, len(ids2), 1)
    assert (work.weight_macs, work.attention_macs) == (expected.weight_macs,
                                                       expected.attention_macs)
    full = reuse.generate(text(ids2), GREEDY).token_ids            # again: now 1 token to run
    assert reuse.computed_tokens[1] == 1
    assert full == plain.generate(text(ids2), GREEDY).token_ids
    assert full == LoopEngine(model, IdTokenizer(), 128).generate(text(ids2), 12).token_ids
    assert turn2.token_ids == full[:1]


@pytest.mark.points(1)
def test_a_diverging_prompt_truncates_the_cache(models, monkeypatch):
    """Turn 2 edits token 4 of turn 1's prompt: only 4 positions can be kept. Then a request
    whose step fails half way (a layer raises, after the cache was truncated to the common
    prefix) must leave the cache and cached_ids agreeing. (An id outside the vocabulary no
    longer gets that far: the engine refuses it at the door.)"""
    _, _, model = models
    reuse = ex.PrefixReuseEngine(model, IdTokenizer(), max_context=128)
    plain = Engine(model, IdTokenizer(), max_context=128)
    first = IDS[:10]
    reuse.generate(text(first), GREEDY)
    edited = first[:4] + [(first[4] + 1) % 41] + first[5:]
    reuse.computed_tokens.clear()
    out = reuse.generate(text(edited), GREEDY)
    assert reuse.computed_tokens[0] == len(edited) - 4 and set(reuse.computed_tokens[1:]) == {1}
    assert out.token_ids == plain.generate(text(edited), GREEDY).token_ids
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, V=41\)"):
        reuse.generate(text(first[:6] + [99]), GREEDY)
    with monkeypatch.context() as patched, pytest.raises(ZeroDivisionError):
        patched.setattr(model.blocks[1], "finish", lambda x, attn: 1 / 0)
        reuse.generate(text(first[:6] + [7]), GREEDY)
    assert reuse.runner.cache.num_cached == len(reuse.cached_ids) == 4   # the common prefix
    again = reuse.generate(text(first), GREEDY)
    assert again.token_ids == plain.generate(text(first), GREEDY).token_ids
