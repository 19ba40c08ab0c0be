"""Graded tests for the S14 exercises (see exercises/s14_quantization.py).

Oracles, none of them the solution: the chapter's quantizer (code/s14_quantization.py's
`quantize_int4` with float32 scales, and `dequantize_int4`) on every linear weight of the
bundled model; values worked by hand; llama.cpp's own Python package `gguf`
(`gguf.quants.quantize(w, Q4_0)`), byte for byte, with the scales and codes read back from
its bytes and its dequantizer; the bytes the chapter's `QuantizedTensor` stores and
`scheme_memory` counts on models quantized for real (the bundled model and a tiny random
Qwen3); and, for the design question, the bundled model quantized tensor by tensor with your
plan (`QuantizedTensor.from_float`: `quantize_model` takes one scheme for the whole model),
its bits counted by `scheme_memory` and its quality measured by code/s14_quality.py's
`evaluate` (mean KL divergence from the float32 model) on the first 8 chunks of the held-out
split, against all-int4 and the rule of thumb the stub states. The second model of that
question is the bundled model with 16 channels of block 2's MLP rescaled (up_proj rows / 32,
down_proj columns x 32: the same function, SmoothQuant's equivalence run backwards), which
makes block 2's down_proj the hardest weight to hold in 4 bits.
"""
import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from exercise_loader import load_exercise

import s03_transformer as s03  # noqa: E402  (code/ is on the path once the loader ran)

ex = load_exercise("s14_quantization")

import s06_torch as s06  # noqa: E402
import s14_quality  # noqa: E402
import s14_quantization as s14  # noqa: E402

BUNDLED = s03.BUNDLED_MODEL_DIR
SCORED_CHUNKS = 8                 # held-out chunks of 256 tokens the plans are scored on
CALIBRATION_TOKENS = 512          # training tokens handed to choose_precisions
needs_model = pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")


@functools.lru_cache(maxsize=1)
def bundled() -> s06.TorchTransformer:
    torch.set_num_threads(1)
    return s06.TorchTransformer.from_pretrained(BUNDLED, "cpu", torch.float32)


def linear_names(model) -> list[str]:
    return [f"blocks.{i}.{n}" for i in range(len(model.blocks))
            for n in s14.linear_weight_names(model)]


def bundled_weights() -> dict[str, np.ndarray]:
    model = bundled()
    return {n: model.get_parameter(n).detach().numpy().copy() for n in linear_names(model)}


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_int4_by_hand():
    row = np.zeros((1, 32), np.float32)
    row[0, :5] = [0.7, 0.26, -0.35, 0.04, -0.7]
    codes, scales, zeros = ex.quantize_int4(row, 32, True)
    assert zeros is None and codes.dtype == np.uint8 and scales.dtype == np.float32
    assert codes.shape == (1, 32) and scales.shape == (1, 1)
    assert scales[0, 0] == np.float32(0.7) / np.float32(7)
    # 0.26 / 0.1 = 2.6 -> 3; -0.35 / 0.1 = -3.5 -> -4 (half to even); the rest 0 -> code 8
    assert codes[0, :5].tolist() == [15, 11, 4, 8, 1] and (codes[0, 5:] == 8).all()
    back = ex.dequantize_int4(codes, scales, None, 32)
    assert back.dtype == np.float32 and back.shape == (1, 32)
    assert np.allclose(back[0, :5], [0.7, 0.3, -0.4, 0.0, -0.7], atol=1e-7)
    # Asymmetric: lo = -0.1, hi = 1.4, scale 0.1, zero point 1.
    row = np.zeros((1, 32), np.float32)
    row[0, :3] = [-0.1, 1.4, 0.52]
    codes, scales, zeros = ex.quantize_int4(row, 32, False)
    assert scales[0, 0] == (np.float32(1.4) - np.float32(-0.1)) / np.float32(15)
    assert zeros.dtype == np.uint8 and zeros.tolist() == [[1]]
    assert codes[0, :3].tolist() == [0, 15, 6] and (codes[0, 3:] == 1).all()
    # A row of zeros: scale 1, codes = the zero point, weights back exactly 0, no NaN.
    for symmetric, code in ((True, 8), (False, 0)):
        codes, scales, zeros = ex.quantize_int4(np.zeros((2, 64), np.float32), 32, symmetric)
        assert (scales == 1).all() and (codes == code).all()
        assert (ex.dequantize_int4(codes, scales, zeros, 32) == 0).all()
    # A constant group: every weight on the grid's edge, exactly.
    const = np.full((1, 64), -0.3, np.float32)
    for symmetric in (True, False):
        c, s, z = ex.quantize_int4(const, 64, symmetric)
        assert np.allclose(ex.dequantize_int4(c, s, z, 64), const, rtol=0, atol=1e-7)
    for bad in ((np.zeros((2, 48), np.float32), 32), (np.zeros((2, 64), np.float32), 16),
                (np.zeros(64, np.float32), 32)):
        with pytest.raises(ValueError):
            ex.quantize_int4(*bad)


@needs_model
@pytest.mark.points(1)
def test_int4_equals_the_chapters_quantizer_on_every_linear_weight():
    for name, w in bundled_weights().items():
        for group_size in (32, 64, 128):
            for symmetric in (True, False):
                case = f"{name} {w.shape}, group_size={group_size}, symmetric={symmetric}"
                codes, scales, zeros = ex.quantize_int4(w, group_size, symmetric)
                want = s14.quantize_int4(torch.from_numpy(w), group_size, symmetric,
                                         scale_dtype=torch.float32)
                assert np.asarray(scales).dtype == np.float32, case
                np.testing.assert_array_equal(scales, want[1].numpy(), err_msg=case)
                np.testing.assert_array_equal(codes, want[0].numpy(), err_msg=case)
                if symmetric:
                    assert zeros is None, case
                else:
                    np.testing.assert_array_equal(zeros, want[2].numpy(), err_msg=case)


@needs_model
@pytest.mark.points(1)
def test_int4_round_trip_within_half_a_step():
    rng = np.random.default_rng(1401)
    weights = list(bundled_weights().values())[:8]
    weights.append((rng.standard_t(3, size=(16, 256)) * 0.05).astype(np.float32))  # heavy tails
    for w in weights:
        for group_size in (32, 128):
            for symmetric in (True, False):
                codes, scales, zeros = ex.quantize_int4(w, group_size, symmetric)
                back = ex.dequantize_int4(codes, scales, zeros, group_size)
                want = s14.dequantize_int4(torch.from_numpy(codes), torch.from_numpy(scales),
                                           None if zeros is None else torch.from_numpy(zeros),
                                           group_size)
                np.testing.assert_array_equal(back, want.numpy())
                step = np.repeat(scales, group_size, axis=1)
                # half a step, and a float32 rounding or two of slack
                assert (np.abs(w - back) <= step / 2 * (1 + 1e-6) + 1e-12).all()


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_q4_0_nibbles_by_hand_and_back():
    codes = (np.arange(32) % 16).astype(np.uint8)
    assert ex.pack_q4_0(codes).tolist() == [0x11 * j for j in range(16)]
    codes = np.zeros(32, np.uint8)
    codes[0], codes[16], codes[1] = 3, 12, 15
    assert ex.pack_q4_0(codes)[:2].tolist() == [0xC3, 0x0F]     # element 16 is byte 0's high
    rng = np.random.default_rng(1402)
    many = rng.integers(0, 16, size=(5, 96), dtype=np.uint8)
    packed = ex.pack_q4_0(many)
    assert packed.shape == (5, 48) and packed.dtype == np.uint8
    np.testing.assert_array_equal(ex.unpack_q4_0(packed), many)
    # Not the chapter's pack_int4 order (neighbours in one byte), which llama.cpp does not use.
    assert not np.array_equal(packed, s14.pack_int4(torch.from_numpy(many)).numpy())
    for bad in (np.zeros(48, np.uint8), np.full(32, 16, np.uint8)):
        with pytest.raises(ValueError):
            ex.pack_q4_0(bad)


def gguf_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(1403)
    arrays = [rng.standard_normal((4, 96)).astype(np.float32),
              np.zeros((2, 64), np.float32),                             # d = 0: codes 8
              np.tile(np.float32([-1.0, 1.0]), (3, 16)),                  # a tie: the first
              np.linspace(-2, 3, 64, dtype=np.float32).reshape(1, 64)]
    if (BUNDLED / "model.safetensors").is_file():
        model = bundled()
        arrays += [p.detach().numpy() for _, p in model.named_parameters()
                   if p.ndim == 2 and p.shape[1] % 32 == 0]
    return arrays


@pytest.mark.points(1)
def test_q4_0_blocks_are_byte_identical_to_the_gguf_package():
    import gguf
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    for w in gguf_arrays():
        theirs = gguf.quants.quantize(w, q4_0)                          # (..., K/32 * 18)
        blocks = theirs.reshape(-1, 18)
        d = blocks[:, :2].copy().view("<f2")[:, 0]                      # float16 (nb,)
        values = gguf.quants.dequantize(theirs, q4_0).reshape(-1, 32)   # (u - 8) * d, exact
        d32 = d.astype(np.float32)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            codes = np.where(d32 != 0, np.round(values / d32) + 8, 8).astype(np.uint8)
        ours = ex.q4_0_blocks(d.reshape(*w.shape[:-1], -1), codes.reshape(w.shape))
        assert ours.dtype == np.uint8 and ours.shape == theirs.shape, (ours.shape, theirs.shape)
        assert np.array_equal(ours, theirs), f"bytes differ on an array of shape {w.shape}"


# Exercise 3 ----------------------------------------------------------------------------------

SCHEMES = [("int8", None, True), ("int4", None, True), ("int4", 32, False), ("int4", 64, True),
           ("int4", 128, False), ("q8_0", None, True), ("q4_0", None, True)]


@pytest.mark.points(1)
def test_tensor_bytes_equal_what_the_chapter_stores():
    assert ex.tensor_bytes((256, 128), "int4") == 18_432
    rng = torch.Generator().manual_seed(1404)
    for shape in ((256, 128), (128, 384), (96, 64), (7, 256), (3, 32)):
        w = torch.randn(*shape, generator=rng)
        assert ex.tensor_bytes(shape, "float32") == w.numel() * 4
        assert ex.tensor_bytes(shape, "bfloat16") == w.numel() * 2
        for scheme, group_size, symmetric in SCHEMES:
            if scheme == "int4" and shape[1] % (group_size or 32):
                with pytest.raises(ValueError):
                    ex.tensor_bytes(shape, scheme, group_size, symmetric)
                continue
            stored = s14.QuantizedTensor.from_float(w, scheme, group_size=group_size,
                                                    symmetric=symmetric).quantized_nbytes
            got = ex.tensor_bytes(shape, scheme, group_size, symmetric)
            assert got == stored, (shape, scheme, group_size, symmetric, got, stored)
    for bad in (((128, 48), "q4_0", None), ((128, 96), "int4", 64), ((8, 32), "int3", None)):
        with pytest.raises(ValueError):
            ex.tensor_bytes(*bad)


@pytest.mark.points(1)
def test_linear_bits_per_weight_of_real_quantized_models(tmp_path):
    import json

    from model_testing import build_tiny
    build_tiny("qwen3_gqa_tied", tmp_path)                     # C 64, H 4, Hkv 2, D 24, I 96
    folders = [tmp_path] + ([BUNDLED] if (BUNDLED / "model.safetensors").is_file() else [])
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        for scheme, group_size, symmetric in SCHEMES:
            model = s06.TorchTransformer.from_pretrained(folder, "cpu", torch.float32)
            try:
                s14.quantize_model(model, scheme, group_size=group_size, symmetric=symmetric,
                                   path="reference")
            except ValueError:                 # a group that does not divide a weight's K
                with pytest.raises(ValueError):
                    ex.linear_bits_per_weight(config, scheme, group_size, symmetric)
                continue
            want = s14.scheme_memory(model, scheme).bits_per_weight
            got = ex.linear_bits_per_weight(config, scheme, group_size, symmetric)
            assert got == pytest.approx(want, rel=1e-12), (folder.name, scheme, group_size,
                                                           symmetric, got, want)
        plain = s06.TorchTransformer.from_pretrained(folder, "cpu", torch.float32)
        assert ex.linear_bits_per_weight(config, "float32") == 32.0 == \
            s14.scheme_memory(plain, "float32").bits_per_weight


# Exercise 4 ----------------------------------------------------------------------------------

def rescaled(model, layer=2, channels=range(0, 384, 24), alpha=32.0):
    """The same function with block `layer`'s down_proj columns c x alpha and up_proj rows
    c / alpha (up feeds down through silu(gate) * up, linear in up)."""
    import copy
    out = copy.deepcopy(model)
    block = out.blocks[layer]
    inter = block.down_proj.shape[1]
    with torch.no_grad():
        for c in channels:
            block.gate_up_proj[inter + c] /= alpha
            block.down_proj[:, c] *= alpha
    return out


def quantized(model, plan: dict) -> s06.TorchTransformer:
    import copy
    out = copy.deepcopy(model)
    for name in linear_names(out):
        _, layer, attr = name.split(".")
        block = out.blocks[int(layer)]
        w = getattr(block, attr).detach()
        setattr(block, attr, nn.Parameter(s14.QuantizedTensor.from_float(
            w, plan[name], path="reference"), requires_grad=False))
    return out


def rule_of_thumb(model, budget: float) -> dict:
    """int8 for block 0, the last, 1, the second to last, ...; down, qkv, o, gate_up in a block;
    each taken if it still fits (bytes as the chapter stores them)."""
    names, n_layers = linear_names(model), len(model.blocks)
    order = [i for pair in zip(range(n_layers), reversed(range(n_layers))) for i in pair]
    order = list(dict.fromkeys(order))
    stored = {n: {s: s14.QuantizedTensor.from_float(model.get_parameter(n).detach(), s)
                  .quantized_nbytes for s in ("int8", "int4")} for n in names}
    spare = budget * sum(model.get_parameter(n).numel() for n in names) / 8 \
        - sum(b["int4"] for b in stored.values())
    plan = dict.fromkeys(names, "int4")
    for i in order:
        for attr in ("down_proj", "qkv_proj", "o_proj", "gate_up_proj"):
            name = f"blocks.{i}.{attr}"
            extra = stored[name]["int8"] - stored[name]["int4"]
            if extra <= spare:
                plan[name], spare = "int8", spare - extra
    return plan


@functools.lru_cache(maxsize=1)
def splits() -> tuple[np.ndarray, np.ndarray]:
    """(calibration: the first training tokens, scored: the held-out split), both as the
    bundled model's training script cut them."""
    from tokenizers import Tokenizer
    script = s14_quality._training_script()
    tokenizer = Tokenizer.from_file(str(script.TOKENIZER))
    train, _ = script.encode_split(tokenizer, tokenizer.token_to_id(script.EOS_TOKEN),
                                   s14_quality.VAL_EVERY)
    return train[:CALIBRATION_TOKENS].copy(), s14_quality.validation_token_ids()


@functools.lru_cache(maxsize=None)
def case(which: str, budget: float) -> dict:
    """Your plan for one model and budget, with what it costs and what it measures."""
    model = bundled() if which == "bundled" else rescaled(bundled())
    calibration, scored = splits()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = ex.choose_precisions(model, budget, calibration.copy())
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    names = linear_names(model)
    out = {"plan": dict(plan), "unchanged": unchanged, "names": names}
    if set(plan) != set(names) or not set(plan.values()) <= {"int8", "int4"}:
        return out
    ref_logits = {}

    def reference(ids):                                      # the float32 model, once per chunk
        key = tuple(ids)
        if key not in ref_logits:
            with torch.inference_mode():
                ref_logits[key] = model.head(model.run(torch.tensor(ids), 0)).float()
        return ref_logits[key]

    def kl(p):
        q = quantized(model, p)
        return s14_quality.evaluate(q, reference, token_ids=scored,
                                    max_chunks=SCORED_CHUNKS).mean_kld, \
            s14.scheme_memory(q, "plan").bits_per_weight

    out["kl"], out["bits"] = kl(plan)
    out["all_int4"], _ = kl(dict.fromkeys(names, "int4"))
    out["rule"], _ = kl(rule_of_thumb(model, budget))
    return out


CASES = [("bundled", 5.0), ("bundled", 6.0), ("rescaled", 5.5)]


def check_plan(result: dict, budget: float) -> None:
    assert set(result["plan"]) == set(result["names"]), \
        f"the plan must name every linear weight, {result['names'][:2]}..., and nothing else"
    assert set(result["plan"].values()) <= {"int8", "int4"}, set(result["plan"].values())
    assert result["unchanged"], "choose_precisions changed the model it was given"
    assert result["bits"] <= budget + 1e-9, \
        f"{result['bits']:.4f} bits per weight over the budget of {budget}"


@needs_model
@pytest.mark.points(1)
def test_the_plan_names_every_linear_weight_and_fits_the_budget():
    for which, budget in CASES:
        check_plan(case(which, budget), budget)


@needs_model
@pytest.mark.points(1)
def test_the_plan_beats_int4_and_the_rule_of_thumb_on_the_bundled_model():
    for budget in (5.0, 6.0):
        r = case("bundled", budget)
        check_plan(r, budget)
        summary = (f"budget {budget}: your plan KL {r['kl']:.3g} at {r['bits']:.3f} bits, "
                   f"all-int4 {r['all_int4']:.3g}, rule of thumb {r['rule']:.3g}")
        assert r["kl"] <= 0.75 * r["all_int4"], summary
        assert r["kl"] <= 0.9 * r["rule"], summary


@needs_model
@pytest.mark.points(1)
def test_the_plan_finds_the_hardest_weight_of_a_rescaled_model():
    r = case("rescaled", 5.5)
    check_plan(r, 5.5)
    summary = (f"your plan KL {r['kl']:.3g} at {r['bits']:.3f} bits, all-int4 "
               f"{r['all_int4']:.3g}, rule of thumb {r['rule']:.3g}")
    assert r["kl"] <= 0.5 * r["all_int4"], summary
    assert r["kl"] <= 0.9 * r["rule"], summary
    assert math.isfinite(r["kl"])
