"""Tests for chapter S14, weight quantization (code/s14_quantization.py, code/s14_gguf.py).

Oracles: NumPy references written here group by group, with their own bfloat16 rounding
(bit arithmetic on float32), for int8 per channel and int4 group-wise; bytes written by hand
for the nibble order; llama.cpp's own Python package `gguf` (gguf.quants.quantize /
dequantize, itself bit-exact with ggml-quants.c) for Q8_0 and Q4_0; the S01 loop run on the
same quantized model (invariant 1: greedy tokens of S06's engine and of S13's engine, each
request alone); S03's parameter count and byte counts worked out by hand for the memory.

Tolerance of the fused paths (bfloat16 activations). The fused kernels get x rounded to
bfloat16 and operands (scales, zeros) rounded to bfloat16; the reference is F.linear of the
same bfloat16-rounded x, as float32, with the dequantized float32 weight. Per product term
the kernel's weight differs by at most one bfloat16 rounding of each operand term
(unit roundoff u = 2^-8, on |w| + |zero|), the output is rounded to bfloat16 once (<= u |y|
<= u |x|.|w|), and float32 accumulation adds K 2^-24 (< 2^-15 here). So
|fused - reference| <= 2^-7 (|x| @ M^T) per output, M = |W| + |Z| (Z the zero term of an
asymmetric group). Measured: at most 0.14 of that bound.

The fused kernels' edges: torch's CPU int8 kernel reads past a row when K % 16 != 0 (NaN,
garbage or a segmentation fault), so the tests that touch it wrap `_run_kernel` to fail
instead of calling it there; a misaligned activation once crashed the kernel, so that case
runs in a child process. Scale limits are worked by hand from float16's largest value 65504
(values from 65520 round to inf).
"""
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

import s01_generation_loop as s01
import s03_checkpoint
import s03_transformer as s03
import s06_torch as s06
import s14_gguf
import s14_quantization as s14
from engine_testing import drive, greedy
from model_testing import IdTokenizer, build_tiny
from s01_generation_loop import ParameterError
from s14_quantization import QuantizedTensor, quantize_model

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = s03.BUNDLED_MODEL_DIR
bundled = pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(),
                             reason="bundled model not trained yet")
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
MODEL_SCHEMES = [("int8", {}), ("int4", {}), ("int4", {"symmetric": False, "group_size": 64}),
                 ("q8_0", {}), ("q4_0", {})]


# --- NumPy references, group by group -------------------------------------------------------

def bf16_round_up(x: np.ndarray) -> np.ndarray:
    """float32 positives -> the bfloat16 value (as float32) rounded to nearest even, then
    moved one step up where that went below x (the module's rule for stored scales)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    nearest = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    up = np.where(nearest.astype(np.uint32).view(np.float32) < x, nearest + (1 << 16), nearest)
    return up.astype(np.uint32).view(np.float32)


def ref_int8(w: np.ndarray):
    codes, scales = np.zeros(w.shape, np.int8), np.zeros(w.shape[0], np.float32)
    for n, row in enumerate(w):
        s = np.float32(np.abs(row).max()) / np.float32(127)
        s = np.float32(1) if s == 0 else s
        codes[n] = np.clip(np.round(row / s), -127, 127)
        scales[n] = s
    return codes, scales


def ref_int4(w: np.ndarray, g: int, symmetric: bool):
    """Unsigned codes (N, K), scales (N, K/g) as float32 values of bfloat16, zeros or None."""
    n_rows, k = w.shape
    codes = np.zeros(w.shape, np.uint8)
    scales = np.zeros((n_rows, k // g), np.float32)
    zeros = None if symmetric else np.zeros((n_rows, k // g), np.uint8)
    for n in range(n_rows):
        for j in range(k // g):
            grp = w[n, j * g:(j + 1) * g]
            if symmetric:
                s = bf16_round_up(np.float32(np.abs(grp).max()) / np.float32(7))
                s = np.float32(1) if s == 0 else s
                codes[n, j * g:(j + 1) * g] = np.clip(np.round(grp / s), -7, 7) + 8
            else:
                lo, hi = min(grp.min(), 0), max(grp.max(), 0)
                s = bf16_round_up((np.float32(hi) - np.float32(lo)) / np.float32(15))
                s = np.float32(1) if s == 0 else s
                z = np.clip(np.round(-lo / s), 0, 15)
                codes[n, j * g:(j + 1) * g] = np.clip(np.round(grp / s) + z, 0, 15)
                zeros[n, j] = z
            scales[n, j] = s
    return codes, scales, zeros


def weights(seed=0, shape=(24, 256), offset=0.0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05 + offset
    w[3] = 0.0                                 # a zero row
    w[5, :64] = 0.37                           # constant groups
    w[6, :32] = -2.5                           # a negative constant group
    return w


# --- int8 and int4 --------------------------------------------------------------------------

def test_int8_equals_the_numpy_reference_and_stays_within_half_a_scale():
    w = weights()
    codes, scales = s14.quantize_int8(torch.from_numpy(w))
    ref_codes, ref_scales = ref_int8(w)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    assert scales[3] == 1 and (codes[3] == 0).all()        # zero row: scale 1, no 0 / 0
    deq = s14.dequantize_int8(codes, scales).numpy()
    assert (deq[3] == 0).all()
    err = np.abs(w - deq)
    assert (err <= ref_scales[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_equals_the_numpy_reference_and_stays_within_half_a_scale(group_size, symmetric):
    w = weights(group_size, offset=0.0 if symmetric else 0.02)
    codes, scales, zeros = s14.quantize_int4(torch.from_numpy(w), group_size, symmetric)
    ref_codes, ref_scales, ref_zeros = ref_int4(w, group_size, symmetric)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    assert scales.dtype == torch.bfloat16
    np.testing.assert_array_equal(scales.float().numpy(), ref_scales)
    if symmetric:
        assert zeros is None and codes.min() >= 1 and codes.max() <= 15   # -7..7 + 8
        zero = np.float32(8)
    else:
        np.testing.assert_array_equal(zeros.numpy(), ref_zeros)
        zero = np.repeat(ref_zeros.astype(np.float32), group_size, axis=1)
    deq = s14.dequantize_int4(codes, scales, zeros, group_size).numpy()
    expected = (ref_codes.astype(np.float32) - zero) * np.repeat(ref_scales, group_size, axis=1)
    np.testing.assert_allclose(deq, expected, rtol=0, atol=0)
    bound = np.repeat(ref_scales, group_size, axis=1) / 2 * (1 + 1e-6)
    assert (np.abs(w - deq) <= bound).all()
    assert (deq[3] == 0).all()                               # zeros stay exactly 0
    # a constant group is one level: symmetric hits +-7 exactly up to the scale's rounding
    assert np.abs(deq[5, :64] - 0.37).max() <= bound[5, 0]


def test_int4_zero_point_keeps_zero_exact_and_the_scale_rounds_up():
    w = np.zeros((16, 32), np.float32)
    w[0] = np.linspace(0.1, 1.6, 32)           # all positive: min' = 0, zero point 0
    w[1] = np.linspace(-3.0, -0.2, 32)         # all negative: zero point 15
    codes, scales, zeros = s14.quantize_int4(torch.from_numpy(w), 32, symmetric=False)
    assert zeros[0, 0] == 0 and zeros[1, 0] == 15
    # 1.6 / 15 and 3.0 / 15 are not bfloat16 values: stored one step above, never below
    assert scales[0, 0].item() >= np.float32(1.6) / 15 and scales[1, 0].item() >= np.float32(3) / 15
    deq = s14.dequantize_int4(codes, scales, zeros, 32)
    assert (deq[2:] == 0).all()


def test_nibbles_are_packed_low_first_and_unpack_back():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = s14.pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    rand = torch.from_numpy(np.random.default_rng(1).integers(0, 16, (7, 64)).astype(np.uint8))
    assert torch.equal(s14.unpack_int4(s14.pack_int4(rand)), rand)
    with pytest.raises(ParameterError, match="even last axis"):
        s14.pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ParameterError, match="0..15"):
        s14.pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))


# --- GGUF blocks against the gguf package ----------------------------------------------------

def adversarial_arrays():
    rng = np.random.default_rng(14)
    tie = np.tile(np.array([1.0, -1.0], np.float32), 16)
    halfway = ((np.arange(64, dtype=np.float32) - 32) + 0.5) * np.float32(0.01)
    big = rng.standard_normal((4, 96)).astype(np.float32) * 1e4
    tiny = rng.standard_normal((4, 64)).astype(np.float32) * 1e-30
    return {
        "zeros": np.zeros((3, 64), np.float32), "constant": np.full((2, 32), -0.7, np.float32),
        "+max -max tie": np.stack([tie, -tie]), "halfway": halfway[None],
        "big": big, "tiny": tiny, "one hot": np.eye(32, dtype=np.float32),
        "float16 input": rng.standard_normal((5, 128)).astype(np.float16),
        "3-D": rng.standard_normal((2, 3, 64)).astype(np.float32),
        "random": rng.standard_normal((33, 256)).astype(np.float32),
    }


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_gguf_blocks_are_byte_identical_to_the_gguf_package_on_adversarial_arrays(scheme):
    for name, a in adversarial_arrays().items():
        ours, theirs = s14_gguf.QUANTIZE[scheme](a), gguf.quants.quantize(a, GGML[scheme])
        assert ours.dtype == np.uint8 and ours.shape == theirs.shape, name
        assert np.array_equal(ours, theirs), name
        np.testing.assert_array_equal(s14_gguf.DEQUANTIZE[scheme](ours),
                                      gguf.quants.dequantize(theirs, GGML[scheme]))


@bundled
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_gguf_blocks_are_byte_identical_on_every_tensor_of_the_bundled_model(scheme):
    state = s03_checkpoint.load_state_dict(BUNDLED)
    matrices = {k: v for k, v in state.items() if v.ndim == 2}
    assert len(matrices) == 1 + 6 * 7                      # embedding + 7 per layer
    for name, w in matrices.items():
        ours = s14_gguf.QUANTIZE[scheme](w)
        assert np.array_equal(ours, gguf.quants.quantize(w, GGML[scheme])), name
        # the torch dequantizer (what the model runs) equals the package's too
        qt = QuantizedTensor.from_float(torch.from_numpy(w), scheme)
        assert np.array_equal(qt.qdata["blocks"].numpy(), ours)
        np.testing.assert_array_equal(qt.dequantize(torch.float32).numpy(),
                                      gguf.quants.dequantize(ours, GGML[scheme]))


def test_q4_0_error_is_half_a_step_except_where_the_signed_max_clips_the_other_side():
    w = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    data = s14_gguf.quantize_q4_0(w)
    d16 = np.repeat(s14_gguf.q4_0_scales(data), 32, axis=1)     # the stored float16 d
    blocks = w.reshape(-1, 32)
    signed_max = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    d32 = np.repeat((signed_max / np.float32(-8)).reshape(64, -1), 32, axis=1)
    err = np.abs(w - s14_gguf.dequantize_q4_0(data))
    fp16_part = 8 * np.abs(d32 - d16)
    clipped = w / d32 > 7.5                                     # beyond code 15
    assert (err[~clipped] <= np.abs(d16[~clipped]) / 2 + fp16_part[~clipped] + 1e-7).all()
    assert (err[clipped] <= np.abs(d16[clipped]) + fp16_part[clipped] + 1e-7).all()
    assert clipped.any()     # it happens on real data: the price of using all 16 levels


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_gguf_refuses_non_finite_weights_and_widths_off_the_block(scheme, bad):
    a = np.zeros((2, 32), np.float32)
    a[1, 7] = bad
    with pytest.raises(ParameterError, match="finite") as err:
        s14_gguf.QUANTIZE[scheme](a)
    assert err.value.parameter == "weight"
    with pytest.raises(ParameterError, match="multiple of 32"):
        s14_gguf.QUANTIZE[scheme](np.zeros((2, 48), np.float32))
    with pytest.raises(ParameterError, match="multiple of"):
        s14_gguf.DEQUANTIZE[scheme](np.zeros((2, 35), np.uint8))


# --- fused paths against the reference -------------------------------------------------------

FUSED = [("int8", {}), ("int4", {"group_size": 32}), ("int4", {"group_size": 64}),
         ("int4", {"group_size": 128}), ("int4", {"symmetric": False}),
         ("int4", {"symmetric": False, "group_size": 128}), ("q4_0", {})]


def fused_bound(ref_tensor: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """2^-7 (|x| @ M^T), M = |W| + |Z| (see the module docstring)."""
    m = ref_tensor.dequantize(torch.float32).abs()
    if ref_tensor.scheme == "int4" and not ref_tensor.symmetric:
        _, scales, zeros = ref_tensor.int4_codes()
        m = m + ((8 - zeros.float()) * scales).repeat_interleave(ref_tensor.group_size, 1).abs()
    return 2.0 ** -7 * (x.abs() @ m.T)


@pytest.mark.parametrize("scheme, options", FUSED, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_path_equals_the_reference_within_the_stated_rule(scheme, options, dtype):
    gen = torch.Generator().manual_seed(len(str(options)))
    w = torch.randn(48, 256, generator=gen) * 0.05 + (0.0 if options.get("symmetric", True)
                                                      else 0.03)
    x = torch.randn(2, 5, 256, generator=gen).to(dtype)        # (..., K): any leading shape
    bias = torch.randn(48, generator=gen).to(dtype)
    fused = QuantizedTensor.from_float(w.to(dtype), scheme, path="fused", **options)
    ref = QuantizedTensor.from_float(w.to(dtype), scheme, path="reference", **options)
    assert fused.dtype == dtype and fused.shape == (48, 256)
    assert torch.equal(fused.dequantize(), ref.dequantize())  # one format, two paths
    out = F.linear(x, fused, bias)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    x16 = x.bfloat16().float()
    expected = F.linear(x16, ref.dequantize(torch.float32)) + bias.float()
    slack = 2.0 ** -8 * expected.abs() if dtype == torch.bfloat16 else 0   # out in bf16 too
    assert ((out.float() - expected).abs() <= fused_bound(ref, x16) + slack + 1e-6).all()
    # and the reference path is F.linear of the dequantized weight, exactly
    assert torch.equal(F.linear(x, ref, bias), F.linear(x, ref.dequantize(), bias))


def test_int4_kernel_convention_is_code_minus_8_times_scale_plus_zero():
    """The CPU kernel read with hand-set operands: codes 9 and 3, scale 0.5, zero 0.25."""
    codes = torch.zeros(16, 32, dtype=torch.int32)
    codes[0, 0], codes[0, 1] = 9, 3
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.zeros(1, 16, 2)
    sz[..., 0], sz[..., 1] = 0.5, 0.25
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 1, 10
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz.bfloat16())
    # (9 - 8) * 0.5 + 0.25 = 0.75, (3 - 8) * 0.5 + 0.25 = -2.25: 0.75 + 10 * -2.25 = -21.75
    assert out[0, 0].item() == -21.75


@pytest.mark.gpu
@pytest.mark.parametrize("scheme, options", FUSED, ids=lambda v: str(v))
def test_cuda_fused_path_equals_the_reference_within_the_stated_rule(scheme, options):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=gen) * 0.05).cuda()
    x = torch.randn(5, 256, generator=gen).cuda()
    fused = QuantizedTensor.from_float(w, scheme, path="fused", **options)
    ref = QuantizedTensor.from_float(w, scheme, path="reference", **options)
    x16 = x.bfloat16().float()
    expected = F.linear(x16, ref.dequantize(torch.float32))
    assert ((F.linear(x, fused) - expected).abs() <= fused_bound(ref, x16) + 1e-6).all()


# --- the model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("s14_gpt2")
    build_tiny("gpt2", directory)
    return directory


def s01_loop_tokens(model, tokenizer, prompt, n):
    return s01.Engine(model, tokenizer, model.config.max_position_embeddings).generate(
        prompt, n).token_ids


@bundled
@pytest.mark.parametrize("scheme, options", MODEL_SCHEMES, ids=lambda v: str(v))
def test_bundled_quantized_engine_equals_the_s01_loop_on_the_same_quantized_model(scheme,
                                                                                 options):
    model, tokenizer = s06.load(BUNDLED, "cpu", "float32")
    assert quantize_model(model, scheme, **options) is model           # in place
    quantized = s14.quantized_weights(model)
    assert len(quantized) == 6 * 4                                      # 4 per block
    assert not isinstance(model.embed_tokens, QuantizedTensor)          # kept by default
    prompt = "Ham.\nTo be, or not to be"
    ours = s06.Engine(model, tokenizer).generate(prompt, greedy(24))
    loop = s01_loop_tokens(model, tokenizer, prompt, 24)
    assert ours.token_ids == loop, (ours.token_ids, loop)
    # quality on a fixed subset, against float32: the same next token at most positions
    fp32, _ = s06.load(BUNDLED, "cpu", "float32")
    ids = tokenizer.encode("Romeo.\nBut soft! what light through yonder window breaks? It is "
                           "the east, and Juliet is the sun.")
    same_top1 = (model.forward(ids).argmax(-1) == fp32.forward(ids).argmax(-1)).mean()
    assert same_top1 >= (0.95 if scheme in ("int8", "q8_0") else 0.8), same_top1


@pytest.mark.parametrize("scheme, options", [("int8", {}), ("int4", {}), ("q4_0", {}),
                                             ("int4", {"symmetric": False})],
                         ids=lambda v: str(v))
def test_gpt2_family_quantized_engine_equals_the_s01_loop(gpt2_dir, scheme, options):
    model = s06.TorchTransformer.from_pretrained(gpt2_dir)
    quantize_model(model, scheme, quantize_embedding=scheme == "int8", **options)
    names = set(s14.quantized_weights(model))
    assert {f"blocks.0.{n}" for n in ("c_attn", "c_proj", "c_fc", "mlp_proj")} <= names
    assert ("embed_tokens" in names) == (scheme == "int8")
    assert not isinstance(model.embed_positions, QuantizedTensor)
    prompt = "5 17 42 8 63"
    ours = s06.Engine(model, IdTokenizer()).generate(prompt, greedy(20))
    assert ours.token_ids == s01_loop_tokens(model, IdTokenizer(), prompt, 20)


@bundled
def test_quantized_tied_embedding_is_one_tensor_and_its_rows_are_dequantized():
    model, tokenizer = s06.load(BUNDLED, "cpu", "float32")
    fp32 = model.embed_tokens.detach().clone()
    quantize_model(model, "int8", quantize_embedding=True)
    assert model.lm_head is model.embed_tokens and isinstance(model.lm_head, QuantizedTensor)
    assert len(s14.quantized_weights(model)) == 6 * 4 + 1              # the tied pair once
    ids = torch.tensor([[3, 7], [2047, 0]])
    rows = F.embedding(ids, model.embed_tokens)                         # (2, 2, C)
    codes, scales = s14.quantize_int8(fp32)
    assert torch.equal(rows[1, 0], codes[2047].float() * scales[2047])
    with pytest.raises(ValueError, match=r"token id must be an integer in \[0, V=2048\)"):
        model.run(torch.tensor([5, 2048]), 0)     # past check_ids: the lookup's own error
    ours = s06.Engine(model, tokenizer).generate("Romeo.\n", greedy(16))
    assert ours.token_ids == s01_loop_tokens(model, tokenizer, "Romeo.\n", 16)


@bundled
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_part_two_engine_gives_each_request_its_tokens_alone(scheme):
    """S13's engine (paged, chunked prefill of 8 tokens, prefix caching) on the quantized
    model: every request's greedy tokens equal the S01 loop on it alone (invariant 7)."""
    model, tokenizer = s06.load(BUNDLED, "cpu", "float32")
    shared = "Romeo.\nBut soft! what light through yonder window breaks?\n"
    prompts = [shared + "Jul.\n", shared + "Ham.\nTo be", "First Citizen.\nBefore we"]
    engine = s14.build_engine(model, tokenizer, quantize=scheme, block_size=8,
                              max_num_batched_tokens=8, enable_prefix_caching=True,
                              max_num_seqs=3, max_context=128)
    outputs, _ = drive(engine, [(p, greedy(12)) for p in prompts], [0, 1, 1])
    assert engine.scheduler.kv.stats.hits > 0                           # the prefix was reused
    for i, prompt in enumerate(prompts):
        got = [t for o in outputs[i] for t in o.new_token_ids]
        assert got == s01_loop_tokens(model, tokenizer, prompt, 12), i


@bundled
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_with_an_int8_kv_cache_give_each_request_its_tokens_alone(scheme):
    """The two transforms composed through `build_engine(quantize=, kv_cache_dtype=)`:
    quantized linear weights and S14's int8 KV pool in S13's engine (chunked prefill of 8
    tokens, prefix caching). Oracle: the same engine built the same way, each request alone
    (invariant 3; the KV is rounded, so the S01 loop on the fp32 pool is no oracle here)."""
    import s14_kv_cache
    model, tokenizer = s06.load(BUNDLED, "cpu", "float32")
    shared = "Romeo.\nBut soft! what light through yonder window breaks?\n"
    prompts = [shared + "Jul.\n", shared + "Ham.\nTo be", "First Citizen.\nBefore we"]
    options = dict(kv_cache_dtype="int8", block_size=8, max_num_batched_tokens=8,
                   enable_prefix_caching=True, max_num_seqs=3, max_context=128)
    engine = s14.build_engine(model, tokenizer, quantize=scheme, **options)
    assert isinstance(engine.runner.cache, s14_kv_cache.QuantizedPagedKVCache)
    assert len(s14.quantized_weights(model)) == 6 * 4
    outputs, _ = drive(engine, [(p, greedy(12)) for p in prompts], [0, 1, 1])
    assert engine.scheduler.kv.stats.hits > 0                           # the prefix was reused
    for i, prompt in enumerate(prompts):
        alone = s14.build_engine(model, tokenizer, **options)          # already quantized
        want, _ = drive(alone, [(prompt, greedy(12))], [0])
        got = [t for o in outputs[i] for t in o.new_token_ids]
        assert got == [t for o in want[0] for t in o.new_token_ids], i


@bundled
def test_a_refused_kv_cache_dtype_leaves_the_model_unquantized():
    model, tokenizer = s06.load(BUNDLED, "cpu", "float32")
    for kwargs, parameter in ((dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
                              (dict(kv_cache_dtype="int8", kv_scale=0.5), "kv_scale")):
        with pytest.raises(ParameterError) as err:
            s14.build_engine(model, tokenizer, quantize="int8", **kwargs)
        assert err.value.parameter == parameter
        assert not s14.quantized_weights(model)                         # checked at the door


# --- memory ----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme, options, nbytes", [
    ("int8", {}, 64 * 256 + 64 * 4),                                    # codes + fp32 scales
    ("int4", {}, 64 * 128 + 64 * 8 * 2),                                # nibbles + bf16 / 32
    ("int4", {"symmetric": False}, 64 * 128 + 64 * 8 * 2 + 64 * 8),     # + a byte zero point
    ("int4", {"group_size": 128}, 64 * 128 + 64 * 2 * 2),
    ("q8_0", {}, 64 * 8 * 34), ("q4_0", {}, 64 * 8 * 18)])
def test_bytes_per_weight_include_scales_and_zero_points(scheme, options, nbytes):
    w = QuantizedTensor.from_float(torch.randn(64, 256), scheme, **options)
    assert w.quantized_nbytes == nbytes
    bits = {"int8": 8.125, "q8_0": 8.5, "q4_0": 4.5}.get(
        scheme, {32: 4.5 if options.get("symmetric", True) else 4.75, 128: 4.125}[
            options.get("group_size", 32)])
    assert 8 * nbytes / (64 * 256) == bits


@bundled
def test_model_memory_per_layer_and_whole_model():
    model = s06.TorchTransformer.from_pretrained(BUNDLED)
    cfg = model.config
    rows = s14.model_memory(model)
    assert sum(r.numel for r in rows) == s03.parameter_count(cfg)      # tied head once
    assert sum(r.nbytes for r in rows) == 4 * s03.parameter_count(cfg)
    quantize_model(model, "q4_0")
    rows = s14.model_memory(model)
    per_layer = s14.memory_by_layer(rows)
    c, i, qkv = cfg.hidden_size, cfg.intermediate_size, (4 + 2 + 2) * 32
    linear = qkv * c + c * c + 2 * i * c + c * i                        # weights per block
    norms = 2 * c + 2 * 32                                              # + q/k norms, fp32
    assert per_layer[0] == (linear + norms, linear // 32 * 18 + 4 * norms)
    line = s14.scheme_memory(model, "q4_0")
    assert line.bits_per_weight == 4.5 and line.linear_weights == 6 * linear


# --- refusals --------------------------------------------------------------------------------

def test_bad_requests_are_refused_naming_the_rule(gpt2_dir):
    model = s06.TorchTransformer.from_pretrained(gpt2_dir)              # C = 64
    cases = [
        (dict(scheme="int4", group_size=128), "group_size", "must divide the input width"),
        (dict(scheme="int4", group_size=48), "group_size", r"one of \(32, 64, 128\)"),
        (dict(scheme="int3"), "scheme", "8 and 4 bits are supported"),
        (dict(scheme="int8", symmetric=False), "symmetric", "symmetric only"),
        (dict(scheme="int8", group_size=32), "group_size", "per output channel"),
        (dict(scheme="q8_0", path="fused"), "path", "no fused kernel"),
        (dict(scheme="int4", path="fast"), "path", "path must be one of"),
        # the tiny vocabulary (97 rows) is no shape for the CPU int4 kernel (N % 16)
        (dict(scheme="int4", quantize_embedding=True, path="fused"), "path", "N % 16 == 0"),
        (dict(scheme="int4", group_size=32.0), "group_size", "integer or None"),
        (dict(scheme="int4", group_size=True), "group_size", "integer or None"),
        (dict(scheme="q4_0", group_size=32.0), "group_size", "integer or None"),
        (dict(scheme="int8", scale_dtype=torch.float64), "scale_dtype",
         "torch.float32, torch.bfloat16, torch.float16"),
        (dict(scheme="int4", scale_dtype="bfloat16"), "scale_dtype", "one of torch.float32"),
        (dict(scheme="int4", scale_dtype=torch.int32), "scale_dtype", "one of torch.float32"),
        (dict(scheme="int4", scale_dtype=torch.float8_e4m3fn), "scale_dtype",
         "one of torch.float32"),
        (dict(scheme="q4_0", scale_dtype=torch.float32), "scale_dtype", "must be None"),
    ]
    for kwargs, parameter, message in cases:
        with pytest.raises(ParameterError, match=message) as err:
            quantize_model(model, **kwargs)
        assert err.value.parameter == parameter, kwargs
        assert not s14.quantized_weights(model)                         # nothing replaced
    # the default path takes the reference for that one weight, fused for the rest
    quantize_model(model, "int4", quantize_embedding=True)
    paths = {name: w.path for name, w in s14.quantized_weights(model).items()}
    assert paths.pop("embed_tokens") == "reference" and set(paths.values()) == {"fused"}
    model = s06.TorchTransformer.from_pretrained(gpt2_dir)
    quantize_model(model, "int8")
    with pytest.raises(ParameterError, match="already quantized") as err:
        quantize_model(model, "int4")
    assert err.value.parameter == "model"
    with pytest.raises(ParameterError, match="already quantized"):
        QuantizedTensor.from_float(model.blocks[0].c_fc, "int4")


def test_packed_tensors_of_the_wrong_shape_and_other_ops_are_refused():
    good = QuantizedTensor.from_float(torch.randn(16, 64), "int4")
    packed, scales = good.qdata["packed"], good.qdata["scales"]
    with pytest.raises(ParameterError, match=r"packed of a \(16, 64\) weight must be uint8 of "
                                             r"shape \(16, 32\)") as err:
        QuantizedTensor.from_parts("int4", (16, 64), {"packed": s14.unpack_int4(packed),
                                                      "scales": scales})
    assert err.value.parameter == "qdata"
    with pytest.raises(ParameterError, match="stores"):
        QuantizedTensor.from_parts("int4", (16, 64), {"packed": packed})
    with pytest.raises(ParameterError, match="blocks"):
        QuantizedTensor.from_parts("q4_0", (16, 64), {"blocks": torch.zeros(16, 34,
                                                                            dtype=torch.uint8)})
    with pytest.raises(ParameterError, match="finite"):
        QuantizedTensor.from_float(torch.tensor([[float("nan")] * 32]), "int8")
    for op in (lambda: good.sum(), lambda: torch.matmul(torch.randn(2, 16), good)):
        with pytest.raises(TypeError, match="not defined on a QuantizedTensor"):
            op()
    assert "int4 g32 sym" in repr(good)


# --- the fused kernels' shape rule, the trial product, the stored values -------------------------

def no_unsafe_int8_kernel(monkeypatch):
    """Make any call of the CPU int8 kernel with K % 16 != 0 fail the test instead of running
    (it reads past the row: NaN, garbage or a segmentation fault of the test process)."""
    run_kernel = s14._run_kernel

    def guarded(scheme, kernel, x, group_size):
        if scheme == "int8" and x.device.type == "cpu" and x.shape[1] % 16:
            pytest.fail(f"the CPU int8 kernel was called with K = {x.shape[1]}")
        return run_kernel(scheme, kernel, x, group_size)
    monkeypatch.setattr(s14, "_run_kernel", guarded)


@pytest.mark.parametrize("k", [8, 24, 72, 100, 16, 128])
def test_int8_fused_is_refused_where_the_cpu_kernel_would_read_past_the_row(k, monkeypatch):
    """torch's CPU `_weight_int8pack_mm` steps 16 values at a time with no tail: K % 16 != 0
    gave NaN or garbage (K = 8, 24, 72) or a crash (K = 100). Refused at the door, the kernel
    never called; K = 16 and 128 run and stay within the fused tolerance."""
    no_unsafe_int8_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(k)
    w, x = torch.randn(32, k, generator=gen), torch.randn(3, k, generator=gen)
    ref = QuantizedTensor.from_float(w, "int8", path="reference")
    if k % 16:
        with pytest.raises(ParameterError, match="multiple of 16") as err:
            QuantizedTensor.from_float(w, "int8", path="fused")
        assert err.value.parameter == "path"
        assert s14.default_path("int8", (32, k), "cpu") == "reference"
        return
    fused = QuantizedTensor.from_float(w, "int8", path="fused")
    x16 = x.bfloat16().float()
    expected = F.linear(x16, ref.dequantize(torch.float32))
    assert ((F.linear(x, fused) - expected).abs() <= fused_bound(ref, x16) + 1e-6).all()


@pytest.fixture(scope="module")
def odd_width_dir(tmp_path_factory):
    """A tiny Qwen3 whose MLP width I = 72 (down_proj's K) the CPU int8 kernel cannot take."""
    from model_testing import TINY
    cls, make_config = TINY["qwen3_gqa_tied"]
    config = make_config()
    config.intermediate_size = 72
    torch.manual_seed(72)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("s14_i72")
    hf.save_pretrained(directory)
    return directory


def test_default_path_is_the_reference_for_the_weights_the_kernel_cannot_take(odd_width_dir,
                                                                            monkeypatch):
    no_unsafe_int8_kernel(monkeypatch)
    model = s06.TorchTransformer.from_pretrained(odd_width_dir)
    with pytest.raises(ParameterError, match=r"K = 72") as err:
        quantize_model(model, "int8", path="fused")
    assert err.value.parameter == "path" and not s14.quantized_weights(model)
    quantize_model(model, "int8")
    paths = {name.split(".")[-1]: w.path for name, w in s14.quantized_weights(model).items()}
    assert paths == {"qkv_proj": "fused", "o_proj": "fused", "gate_up_proj": "fused",
                     "down_proj": "reference"}
    prompt = "5 17 42 8 63"
    ours = s06.Engine(model, IdTokenizer()).generate(prompt, greedy(16))
    assert ours.token_ids == s01_loop_tokens(model, IdTokenizer(), prompt, 16)
    # and the values: every position's logits within the fused tolerance's reach of a
    # float32 model holding the dequantized weights
    plain = s06.TorchTransformer.from_pretrained(odd_width_dir)
    for block, qblock in zip(plain.blocks, model.blocks):
        for name in paths:
            getattr(block, name).data = getattr(qblock, name).dequantize(torch.float32)
    ids = [5, 17, 42, 8, 63, 1, 2, 3]
    assert np.isfinite(model.forward(ids)).all()
    assert np.abs(model.forward(ids) - plain.forward(ids)).max() < 0.5


@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_0"])
def test_a_kernel_that_misbehaves_is_caught_by_the_trial_product(scheme, monkeypatch):
    """The trial product runs a nonzero x against the dequantized weight: a kernel off by a
    factor, or returning one NaN, is refused at quantize time (an all-zero x showed
    neither)."""
    run_kernel = s14._run_kernel
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    for wrong in (lambda out: 2 * out, lambda out: out.index_fill(1, torch.tensor([5]), math.nan)):
        monkeypatch.setattr(s14, "_run_kernel", lambda *a, wrong=wrong: wrong(run_kernel(*a)))
        with pytest.raises(ParameterError, match="trial product") as err:
            QuantizedTensor.from_float(w, scheme, path="fused")
        assert err.value.parameter == "path"
    monkeypatch.setattr(s14, "_run_kernel", run_kernel)
    assert QuantizedTensor.from_float(w, scheme, path="fused").path == "fused"


def test_activations_at_an_unaligned_address_reach_the_kernel_aligned():
    """A contiguous bfloat16 view starting 2 bytes into its buffer: the CPU int8 kernel's
    aligned loads faulted on it (a segmentation fault), so it runs in a child process; the
    product must equal the same values at an aligned address."""
    code = (
        "import sys, torch, torch.nn.functional as F; sys.path.insert(0, 'code')\n"
        "import s14_quantization as q\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = q.QuantizedTensor.from_float(torch.randn(16, 64, generator=g), 'int8',\n"
        "                                 path='fused', dtype=torch.bfloat16)\n"
        "buf = torch.randn(1 + 64, generator=g).bfloat16()\n"
        "x = buf[1:].view(1, 64)\n"
        "assert x.is_contiguous() and x.data_ptr() % 64\n"
        "print(torch.equal(F.linear(x, w), F.linear(x.clone(), w)))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("scheme, options, w, where", [
    # float16's largest value is 65504 (values from 65520 round to inf): by hand, int8 rows
    # above 65520 x 127 = 8.32e6, int4 groups above 65520 x 7 = 4.59e5, Q8_0 blocks above
    # 8.32e6, Q4_0 blocks above 65520 x 8 = 5.24e5
    ("int8", {"scale_dtype": torch.float16}, (1, 0, 8.4e6), "row 1"),
    ("int4", {"scale_dtype": torch.float16}, (2, 40, 4.6e5), "row 2, group 1"),
    ("int4", {"symmetric": False}, (0, 3, 3e38), "row 0, group 0"),   # max - min: 6e38
    ("q8_0", {}, (1, 70, -8.4e6), "block 2 of row 1"),
    ("q4_0", {}, (3, 33, 5.3e5), "block 1 of row 3"),
])
def test_scales_past_their_dtype_are_refused_not_stored_as_inf(scheme, options, w, where):
    row, col, value = w
    weight = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    weight[row, col] = value
    if not options.get("symmetric", True):
        weight[row, col + 1] = -value
    with pytest.raises(ParameterError, match=where) as err:
        QuantizedTensor.from_float(weight, scheme, **options)
    assert err.value.parameter == "weight"
    # just inside the limit: finite scales, and the GGUF bytes are still gguf's own
    weight[row, col] = value / 1.02 if scheme != "int4" or options.get("symmetric", True) else 1.0
    weight[row, col + 1] = 0.0
    qt = QuantizedTensor.from_float(weight, scheme, **options)
    assert torch.isfinite(qt.dequantize()).all()
    if scheme in GGML:
        assert np.array_equal(qt.qdata["blocks"].numpy(),
                              gguf.quants.quantize(weight.numpy(), GGML[scheme]))


def test_q4_0_blocks_too_small_for_a_float32_reciprocal_store_the_codes_of_zero():
    """|max| below 8 / FLT_MAX (2.35e-38): 1 / d overflows, and llama.cpp's codes are a cast
    of inf / NaN (undefined). Stored: d as gguf stores it (float16 0) and codes 8 (0x88 per
    byte), so the block dequantizes to exactly 0 as gguf's does; a block just above keeps
    gguf's bytes."""
    w = np.zeros((2, 64), np.float32)
    w[0, :32] = np.linspace(-2e-38, 1e-38, 32, dtype=np.float32)       # |max| 2e-38 < 2.35e-38
    w[1, :32] = np.linspace(-1e-30, 1e-30, 32, dtype=np.float32)       # defined: 1 / d finite
    with np.errstate(all="ignore"):                  # gguf's cast of inf / NaN warns
        ours, theirs = s14_gguf.quantize_q4_0(w), gguf.quants.quantize(w, GGML["q4_0"])
    assert (ours[0, :2] == theirs[0, :2]).all() and (ours[0, 2:18] == 0x88).all()
    assert np.array_equal(ours[1], theirs[1]) and np.array_equal(ours[0, 18:], theirs[0, 18:])
    assert (s14_gguf.dequantize_q4_0(ours)[0] == 0).all()


def test_stored_values_off_the_format_and_other_bad_inputs_are_refused():
    codes, ones = torch.zeros(4, 32, dtype=torch.int8), torch.ones(4)
    bad_parts = [
        ("int8", {"codes": codes, "scales": torch.full((4,), math.nan)}, {}, "finite and > 0"),
        ("int8", {"codes": codes, "scales": -ones}, {}, "finite and > 0"),
        ("int8", {"codes": codes, "scales": torch.zeros(4)}, {}, "finite and > 0"),
        ("int8", {"codes": torch.full((4, 32), -128, dtype=torch.int8), "scales": ones}, {},
         r"\[-127, 127\]"),
        ("int8", {"codes": codes, "scales": ones.double()}, {}, "float32, bfloat16 or float16"),
        ("int8", {"codes": codes.tolist(), "scales": ones}, {}, "torch tensors"),
        ("int4", {"packed": torch.zeros(4, 16, dtype=torch.uint8), "scales": ones[:, None],
                  "zeros": torch.full((4, 1), 16, dtype=torch.uint8)}, {"symmetric": False},
         "0..15"),
        ("q4_0", {"blocks": torch.tensor([0x00, 0x7E] + [0x88] * 16, dtype=torch.uint8)[None]},
         {}, "d must be finite"),                                     # float16 0x7E00: NaN
    ]
    for scheme, qdata, options, message in bad_parts:
        shape = (1, 32) if scheme == "q4_0" else (4, 32)
        with pytest.raises(ParameterError, match=message) as err:
            QuantizedTensor.from_parts(scheme, shape, qdata, **options)
        assert err.value.parameter == "qdata", message
    for shape in ((-4, 32), (4, 32, 1), (4.0, 32)):
        with pytest.raises(ParameterError, match=r"shape must be \(N, K\)"):
            QuantizedTensor.from_parts("int8", shape, {"codes": codes, "scales": ones})
    for call, parameter in ((lambda: s14.pack_int4([1, 2]), "codes"),
                            (lambda: s14.unpack_int4([1, 2]), "packed"),
                            (lambda: s14.quantize_int4(torch.randn(4, 64), symmetric="no"),
                             "symmetric"),
                            (lambda: s14.quantize_int4(torch.randn(4, 64), group_size=32.0),
                             "group_size"),
                            (lambda: s14.quantize_int8(torch.randn(4, 64), torch.float64),
                             "scale_dtype")):
        with pytest.raises(ParameterError) as err:
            call()
        assert err.value.parameter == parameter
    for path in ("reference", "fused"):
        w = QuantizedTensor.from_float(torch.randn(16, 64), "int4", path=path)
        with pytest.raises(TypeError, match="floating-point activations"):
            F.linear(torch.ones(2, 64, dtype=torch.int64), w)


def test_a_quantized_model_refuses_a_dtype_or_device_change_before_converting_anything(
        gpt2_dir):
    import io
    model = s06.TorchTransformer.from_pretrained(gpt2_dir)
    quantize_model(model, "int8")
    ids = torch.tensor([5, 17, 42, 8])
    before = model.head(model.run(ids, 0))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    for convert in (lambda: model.to(torch.bfloat16), lambda: model.half(),
                    lambda: model.double(), lambda: model.blocks[0].bfloat16(),
                    lambda: model.blocks.to(torch.float16)):
        with pytest.raises(TypeError, match="nothing was converted"):
            convert()
        assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
    assert torch.equal(model.head(model.run(ids, 0)), before)
    assert model.to("cpu") is model and model.float() is model          # no-ops still pass
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.head(loaded.run(ids, 0)), before)
    with pytest.raises(TypeError, match="nothing was converted"):
        loaded.half()


# --- command line ----------------------------------------------------------------------------

@bundled
def test_command_line_prints_a_generation_and_the_memory_table(capsys):
    s14.main(["--quantize", "q4_0", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert "q4_0 (fused path)" in out and "--- completion (greedy) ---" in out
    table = out[out.index("scheme"):]
    for label, bits in [("float32", "32.000"), ("bfloat16", "16.000"), ("q8_0", "8.500"),
                        ("q4_0", "4.500"), ("int4 g32 asym", "4.750")]:
        assert any(line.startswith(label) and bits in line for line in table.splitlines()), label


@bundled
def test_the_memory_table_ends_with_this_run_as_it_was_asked(capsys):
    """The last line is the run's own model: q4_0 as asked is the table's q4_0 line (stored
    the same on the fused path as on the reference path the table uses); with the embedding
    quantized too, the whole model is smaller than the table's line for the same scheme."""
    rows = {}
    for argv in (["--quantize", "q4_0"], ["--quantize", "int4", "--quantize-embedding"]):
        s14.main(argv + ["--max-tokens", "2"])
        table = capsys.readouterr().out.split("scheme", 1)[1].splitlines()[1:]
        rows[argv[1]] = {line[:15].strip(): line[15:].split() for line in table if line}
    assert rows["q4_0"]["this run"] == rows["q4_0"]["q4_0"]
    bytes_of = lambda cells: int(cells[2].replace(",", ""))  # noqa: E731
    assert bytes_of(rows["int4"]["this run, +emb"]) < bytes_of(rows["int4"]["int4 g32 sym"])


@bundled
def test_command_line_runs_quantized_weights_over_an_int8_kv_cache(capsys):
    s14.main(["--quantize", "int4", "--kv-cache-dtype", "int8", "--max-tokens", "6"])
    out = capsys.readouterr().out
    # bytes per token by hand: 2 (K, V) x 6 layers x 2 kv heads x (32 codes + a 4-byte scale)
    assert "KV cache int8: 864 bytes per token (3,072 in float32)" in out
    assert "int4 g32 sym (fused path)" in out and "--- completion (greedy) ---" in out


def test_command_line_usage_errors_exit_2_naming_the_flag_before_loading_the_model(capsys):
    # --model names no checkpoint: the flags' rules are checked before it would be loaded
    for argv, message in (
            (["--quantize", "int4", "--group-size", "48"],
             "--group-size must be one of 32, 64, 128 for --quantize int4 (got 48)"),
            (["--quantize", "int8", "--group-size", "32"], "--group-size does not apply"),
            (["--quantize", "q4_0", "--group-size", "64"], "--group-size must be one of 32"),
            (["--quantize", "q8_0", "--asymmetric"], "--asymmetric needs --quantize int4")):
        with pytest.raises(SystemExit) as done:
            s14.main(argv + ["--model", str(ROOT / "no-such-checkpoint")])
        assert done.value.code == 2
        assert message in capsys.readouterr().err, argv
