"""Graded tests for the S06 exercises (see exercises/s06_torch.py).

Oracles, none of them the solution: PyTorch's own float32 -> bfloat16 conversion and values
rounded by hand (exercise 1); parameter counts worked out by hand from published config.json
values (Qwen3-0.6B, Llama 3 8B) and counted by `transformers` on tiny models it builds
(exercise 2); `transformers` `generate()` and the chapter's tested `Engine` for the greedy
tokens, and a count of the host reads the chapter's `Engine` makes (one per token) to show the
counter works (exercise 3).
"""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from exercise_loader import load_exercise
import s03_checkpoint
from s04_sampling import SamplingParams
from s06_torch import CachedTransformer, Engine, TorchTransformer

ex = load_exercise("s06_torch")

# Published config.json fields of Qwen/Qwen3-0.6B and meta-llama/Meta-Llama-3-8B.
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "attention_bias": False}
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False, "mlp_bias": False}


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_bfloat16_by_hand():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0,
                  0.1, 65504.0, 3.4028235e38, -3.4028235e38, 0.0, -0.0], np.float32)
    # 1 + 2^-8 is the exact midpoint of 1 and 1 + 2^-7: even wins (1). 1 + 3 * 2^-8 is the
    # midpoint of 1 + 2^-7 (odd last bit) and 1 + 2^-6 (even): 1 + 2^-6. Just above a midpoint
    # rounds up. 0.1 is 0x3DCCCCCD: the low half 0xCCCD is above 0x8000, so 0x3DCD = 0.10009765625.
    # 65504 = 0x477FE000: low half 0xE000 rounds up to 0x4780, 65536. float32's largest value
    # lies past the last bfloat16 by more than half a step: inf.
    expected = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -1.0, 3.0, 0.10009765625, 65536.0,
                         np.inf, -np.inf, 0.0, -0.0], np.float32)
    out = ex.round_to_bfloat16(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_array_equal(bits(out), bits(expected))        # -0.0 keeps its sign bit
    assert bits(ex.round_to_bfloat16(np.array([0.1], np.float32)))[0] == 0x3DCD0000
    assert np.array_equal(x, np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20,
                                       -(1 + 2**-8), 3.0, 0.1, 65504.0, 3.4028235e38,
                                       -3.4028235e38, 0.0, -0.0], np.float32))  # input untouched


@pytest.mark.points(1)
def test_bfloat16_matches_torch_on_every_kind_of_value():
    rng = np.random.default_rng(6)
    normal = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-40, 37, 50_000)).astype(np.float32)
    patterns = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array([np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754944e-38], np.float32)
    for x in (normal, patterns, special, normal.reshape(100, 500)):
        out = ex.round_to_bfloat16(x)
        ref = torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
        assert out.shape == x.shape
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(out), nan), "NaN must stay NaN and nothing else become NaN"
        np.testing.assert_array_equal(bits(out)[~nan], bits(ref)[~nan])


@pytest.mark.points(1)
def test_bfloat16_rejects_other_input():
    for bad in (np.ones(3, np.float64), np.ones(3, np.float16), [1.0, 2.0], torch.ones(3)):
        with pytest.raises(ValueError, match="x must be a float32 NumPy array"):
            ex.round_to_bfloat16(bad)


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_decode_bytes_of_published_models_by_hand():
    # Qwen3-0.6B, per layer: q 1024*16*128 = 2,097,152; k and v 2*1024*8*128 = 2,097,152;
    # o 2,097,152; MLP 3*1024*3072 = 9,437,184; norms 2*1024 + q/k norms 2*128: 15,730,944.
    # 28 layers: 440,466,432; + final norm 1,024 + head 151,936*1,024 = 155,582,464:
    # 596,049,920 (tied: the embedding is the head). KV at 1,024: 2*28*8*128*1024 = 58,720,256.
    assert ex.decode_step_bytes(QWEN3_0_6B, 1, dtype_bytes=1) == 596_049_920 + 2 * 28 * 8 * 128
    assert ex.decode_step_bytes(QWEN3_0_6B, 1024) == 2 * (596_049_920 + 58_720_256)
    assert ex.decode_step_bytes(QWEN3_0_6B, 1024) == 1_309_540_352
    # Llama 3 8B (no head_dim: 4096/32 = 128), per layer: q 16,777,216; k, v 2*4096*8*128 =
    # 8,388,608; o 16,777,216; MLP 3*4096*14336 = 176,160,768; norms 8,192: 218,112,000.
    # 32 layers: 6,979,584,000; + norm 4,096 + head 128,256*4,096 = 525,336,576 + one embedding
    # row 4,096: 7,504,928,768 of its 8,030,261,248 parameters (the rest of the table is unread).
    weights = 7_504_928_768
    assert weights == 8_030_261_248 - 128_256 * 4096 + 4096
    assert ex.decode_step_bytes(LLAMA3_8B, 8192) == 2 * (weights + 2 * 32 * 8 * 128 * 8192)
    assert ex.decode_step_bytes(dict(LLAMA3_8B, num_key_value_heads=None), 1, 4) == \
        4 * (weights + 32 * 2 * 4096 * (32 - 8) * 128 + 2 * 32 * 32 * 128)   # MHA: 32 K/V heads


@pytest.mark.points(1)
def test_decode_bytes_agree_with_transformers_parameter_counts():
    for tied in (True, False):
        for cls, config in (
                (Qwen3ForCausalLM, Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80,
                                               num_hidden_layers=3, num_attention_heads=6,
                                               num_key_value_heads=2, head_dim=16,
                                               tie_word_embeddings=tied)),
                (LlamaForCausalLM, LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=80,
                                               num_hidden_layers=3, num_attention_heads=4,
                                               num_key_value_heads=2, tie_word_embeddings=tied))):
            model = cls(config)
            total = sum(p.numel() for p in model.parameters())   # a tied matrix counted once
            read = total if tied else total - 101 * 48 + 48        # untied: one embedding row
            d = config.head_dim or 48 // config.num_attention_heads
            kv = 2 * 3 * 2 * d * 7
            assert ex.decode_step_bytes(config.to_dict(), 7, 4) == 4 * (read + kv), (cls, tied)


@pytest.mark.points(1)
def test_decode_floor_and_errors():
    assert ex.decode_floor_s(QWEN3_0_6B, 1024, 2, 1e12) == pytest.approx(1.309540352e-3, rel=1e-12)
    # float32 weights, context 1: (596,049,920 + 57,344) * 4 bytes at 2.4e11 B/s.
    assert ex.decode_floor_s(QWEN3_0_6B, 1, 4, 2.4e11) == pytest.approx(
        (596_049_920 + 57_344) * 4 / 2.4e11, rel=1e-12)
    with pytest.raises(ValueError, match="config has no intermediate_size"):
        ex.decode_step_bytes({k: v for k, v in QWEN3_0_6B.items() if k != "intermediate_size"}, 1)
    with pytest.raises(ValueError, match="context_len must be an integer >= 1"):
        ex.decode_step_bytes(QWEN3_0_6B, 0)
    with pytest.raises(ValueError, match="dtype_bytes must be an integer >= 1"):
        ex.decode_step_bytes(QWEN3_0_6B, 1, 0)
    with pytest.raises(ValueError, match=r"hidden_size \(100\) must be a multiple of "
                                         r"num_attention_heads \(16\)"):
        ex.decode_step_bytes(dict(QWEN3_0_6B, hidden_size=100, head_dim=None), 1)
    with pytest.raises(ValueError, match="biases are not supported"):
        ex.decode_step_bytes(dict(QWEN3_0_6B, attention_bias=True), 1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be a finite number > 0"):
        ex.decode_floor_s(QWEN3_0_6B, 1, 2, 0)


# Exercise 3 ----------------------------------------------------------------------------------

class IdTokenizer:
    """Prompts as ids written out ("5 17 3"): the tiny model has no tokenizer. vocab_size is the
    tiny model's V (the engine checks that the tokenizer covers its ids)."""

    vocab_size = 97

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class CountHostReads(TorchFunctionMode):
    """Counts calls that bring a tensor's value to the host (each one waits for a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


PROMPT = [5, 17, 42, 8, 63, 2]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(config).eval()
    ours = TorchTransformer(s03_checkpoint.config_from_hf_dict(config.to_dict()), hf.state_dict())
    return hf, ours


def hf_greedy(hf, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.points(2)
def test_greedy_tokens_equal_transformers_and_the_engine(tiny):
    hf, ours = tiny
    expected = hf_greedy(hf, 20)
    tokens = ex.generate_greedy_on_device(CachedTransformer(ours, 40), PROMPT, 20)
    assert tokens == expected and all(type(t) is int for t in tokens)
    # With an EOS id that the greedy run produces: cut after its first occurrence, as the
    # Engine (which stops there) reports it.
    eos = expected[6]
    engine = Engine(ours, IdTokenizer(eos), max_context=40)
    ref = engine.generate(" ".join(map(str, PROMPT)), SamplingParams(temperature=0.0, max_tokens=20))
    assert ref.finish_reason == "stop" and ref.token_ids == expected[:expected.index(eos) + 1]
    assert ex.generate_greedy_on_device(CachedTransformer(ours, 40), PROMPT, 20, eos) == ref.token_ids
    assert ex.generate_greedy_on_device(CachedTransformer(ours, 40), PROMPT, 1) == expected[:1]
    assert ex.generate_greedy_on_device(CachedTransformer(ours, 40), PROMPT, 20, 96) == \
        (expected if 96 not in expected else expected[:expected.index(96) + 1])


@pytest.mark.points(1)
def test_host_reads_do_not_grow_with_the_number_of_tokens(tiny):
    _, ours = tiny
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with CountHostReads() as engine_count:  # the chapter's Engine: one .item() per token
        Engine(ours, IdTokenizer(0), max_context=40).generate(" ".join(map(str, PROMPT)), params)
    assert engine_count.reads >= 12, "the counter should see the Engine's per-token reads"
    counts = []
    for n in (4, 12):
        runner = CachedTransformer(ours, 40)
        with CountHostReads() as count:
            ex.generate_greedy_on_device(runner, PROMPT, n)
        counts.append(count.reads)
    assert counts[0] == counts[1] <= 2, f"host reads for 4 and 12 tokens: {counts}"


@pytest.mark.points(1)
def test_bad_requests_fail_before_any_work(tiny):
    _, ours = tiny
    runner = CachedTransformer(ours, 10)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
            ex.generate_greedy_on_device(runner, PROMPT, bad)
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        ex.generate_greedy_on_device(runner, PROMPT, 6)      # 6 + 6 - 1 = 11 > 10 positions
    assert runner.cache.num_cached == 0                       # refused before the prefill
    assert len(ex.generate_greedy_on_device(runner, PROMPT, 5)) == 5   # 10 positions fit
