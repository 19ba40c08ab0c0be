"""Graded tests for the S03 exercises (see exercises/s03_transformer.py).

Oracles, none of them the solution: values worked out by hand from the definition of RoPE;
the chapter's tested `rope` / `apply_rope` (pinned to transformers by tests/test_s03_transformer.py);
transformers' own `repeat_kv`; PyTorch's `scaled_dot_product_attention`; the `safetensors`
package; and the parameter count of models built by `transformers` from the same configs.
"""
import math

import numpy as np
import pytest
import torch

from exercise_loader import load_exercise
from s03_transformer import apply_rope, rope, rope_inv_freq

ex = load_exercise("s03_transformer")
RNG = np.random.default_rng(3)


# Exercise 1: RoPE ----------------------------------------------------------------------------

@pytest.mark.points(1)
def test_rope_by_hand():
    # D = 2: one pair, turned by exactly `position` radians (theta ** 0 = 1), whatever theta is.
    x = np.array([[[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]]], dtype=np.float32)  # (1, 3, 2)
    got = ex.rope_rotate(x, [0, 1, 2], theta=10_000.0)
    expected = [[1.0, 0.0], [math.cos(1), math.sin(1)], [-2 * math.sin(2), 2 * math.cos(2)]]
    np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-6)
    # D = 4, theta = 100: pairs (0, 2) and (1, 3) turn by p * 1 and p * 100 ** (-1/2) = p * 0.1.
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]], dtype=np.float32)
    got = ex.rope_rotate(x, [1], theta=100.0)[0, 0]
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)
    np.testing.assert_allclose(got, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1,
                                     4 * c2 + 2 * s2], rtol=1e-6)
    with pytest.raises(ValueError, match="even"):
        ex.rope_rotate(np.zeros((1, 1, 3), np.float32), [0], 10_000.0)
    with pytest.raises(ValueError, match="one position per row"):
        ex.rope_rotate(np.zeros((1, 2, 4), np.float32), [0], 10_000.0)


@pytest.mark.points(1)
def test_rope_scores_depend_only_on_distance():
    q = RNG.standard_normal((1, 1, 16)).astype(np.float32)
    k = RNG.standard_normal((1, 1, 16)).astype(np.float32)

    def score(m, n):
        return float(ex.rope_rotate(q, [m], 500.0).ravel() @ ex.rope_rotate(k, [n], 500.0).ravel())

    for distance in (0, 1, 7):
        scores = [score(start + distance, start) for start in (0, 3, 40, 200)]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-4, atol=1e-4)
    assert abs(score(5, 0) - score(0, 0)) > 1e-3  # and the distance does matter


@pytest.mark.points(1)
def test_rope_matches_the_chapter_code():
    x = RNG.standard_normal((3, 5, 32)).astype(np.float32)
    positions = [0, 1, 9, 57, 255]
    for theta in (10_000.0, 1e6):
        expected = apply_rope(x, *rope(positions, rope_inv_freq(32, theta)))
        np.testing.assert_allclose(ex.rope_rotate(x, positions, theta), expected,
                                   rtol=1e-4, atol=1e-5)


# Exercise 2: GQA -----------------------------------------------------------------------------

@pytest.mark.points(1)
def test_repeat_kv_matches_transformers():
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    k = RNG.standard_normal((2, 5, 3)).astype(np.float32)
    for n_rep in (1, 3):
        expected = hf_repeat_kv(torch.from_numpy(k)[None], n_rep)[0].numpy()  # (1, Hkv, S, D) in
        got = ex.repeat_kv(k, n_rep)
        assert got.shape == (2 * n_rep, 5, 3)
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError):
        ex.repeat_kv(k, 0)


def sdpa_reference(q, k, v, mask):
    """PyTorch's attention on key/value heads expanded by transformers' repeat_kv."""
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    n_rep = q.shape[0] // k.shape[0]
    kt = hf_repeat_kv(torch.from_numpy(k)[None], n_rep)
    vt = hf_repeat_kv(torch.from_numpy(v)[None], n_rep)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q)[None], kt, vt, attn_mask=torch.from_numpy(mask))
    return out[0].numpy()


@pytest.mark.points(1)
def test_gqa_attention_prefill_matches_pytorch():
    q = RNG.standard_normal((6, 7, 8)).astype(np.float32)   # H = 6, T = 7
    k = RNG.standard_normal((2, 7, 8)).astype(np.float32)   # Hkv = 2, S = 7
    v = RNG.standard_normal((2, 7, 8)).astype(np.float32)
    causal = np.tril(np.ones((7, 7), dtype=bool))
    np.testing.assert_allclose(ex.gqa_attention(q, k, v), sdpa_reference(q, k, v, causal),
                               rtol=1e-5, atol=1e-5)
    # The first query sees only the first key: its output is exactly that key's value.
    np.testing.assert_allclose(ex.gqa_attention(q, k, v)[:3, 0], np.repeat(v[:1, 0], 3, axis=0),
                               rtol=1e-6)


@pytest.mark.points(1)
def test_gqa_attention_decode_shape_and_errors():
    q = RNG.standard_normal((4, 2, 8)).astype(np.float32)   # the last 2 of 9 positions
    k = RNG.standard_normal((1, 9, 8)).astype(np.float32)   # Hkv = 1: multi-query attention
    v = RNG.standard_normal((1, 9, 8)).astype(np.float32)
    mask = np.arange(9)[None, :] <= np.array([7, 8])[:, None]  # query t sits at position 7 + t
    np.testing.assert_allclose(ex.gqa_attention(q, k, v), sdpa_reference(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        ex.gqa_attention(np.zeros((3, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32),
                         np.zeros((2, 1, 8), np.float32))
    with pytest.raises(ValueError, match="more queries"):
        ex.gqa_attention(np.zeros((2, 3, 8), np.float32), np.zeros((2, 2, 8), np.float32),
                         np.zeros((2, 2, 8), np.float32))


# Exercise 3: safetensors header --------------------------------------------------------------

@pytest.fixture()
def checkpoint(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5).to(torch.bfloat16),
               "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "d.half": torch.randn(2, 2, 2).to(torch.float16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


@pytest.mark.points(1)
def test_read_header_names_dtypes_shapes(checkpoint):
    from safetensors import safe_open

    path, _ = checkpoint
    header = ex.read_header(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(header) == set(f.keys())  # "__metadata__" is not a tensor
        for name in f.keys():
            dtype, shape, _ = header[name]
            assert shape == tuple(f.get_slice(name).get_shape())
            assert dtype == f.get_slice(name).get_dtype()
    assert header["b.bias"][0] == "BF16" and header["c.ids"][0] == "I64"


@pytest.mark.points(1)
def test_read_header_byte_ranges_hold_the_tensors(checkpoint, tmp_path):
    path, tensors = checkpoint
    raw = path.read_bytes()
    for name, (_, _, (begin, end)) in ex.read_header(path).items():
        expected = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        assert raw[begin:end] == expected, name
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="too short"):
        ex.read_header(short)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="too short"):
        ex.read_header(truncated)


# Exercise 4: parameter count -----------------------------------------------------------------

def hf_count(config) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter


@pytest.mark.points(1)
def test_count_parameters_qwen3():
    from transformers import Qwen3Config

    for tied, kv_heads, head_dim in ((True, 2, 24), (False, 4, 16)):
        config = Qwen3Config(vocab_size=101, hidden_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=kv_heads,
                             head_dim=head_dim, intermediate_size=96,
                             tie_word_embeddings=tied)
        assert ex.count_parameters(config.to_dict()) == hf_count(config)


@pytest.mark.points(1)
def test_count_parameters_llama_with_biases():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=77, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=3, intermediate_size=80, attention_bias=True,
                         mlp_bias=True, tie_word_embeddings=False)
    d = config.to_dict()
    d.pop("head_dim", None)  # absent from the file: C // H
    assert ex.count_parameters(d) == hf_count(config)
    with pytest.raises(ValueError):
        ex.count_parameters({"model_type": "gpt2"})
