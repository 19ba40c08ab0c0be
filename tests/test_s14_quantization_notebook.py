"""The S14 notebook runs top to bottom headless and shows what it promises.

Executed with nbclient on a temporary copy (the notebook in the repository is never written),
from notebooks/. Checks: no cell fails; it quantizes with the chapter's `quantize_model` and
`QuantizedTensor`, measures with `s14_quality.evaluate`, `gemv_timings` and
`s14_kv_cache.pool_tokens`, and defines none of their code; its plots are there and no legend
covers data (tests/legend_check.py); and its numbers are ordered as the arithmetic says:

- bits per weight of each scheme, worked by hand here for the bundled model's linear weights
  (int8: 8 + 32 / K per row of K; int4: 4 + 16 / g, + 8 / g with zero points; Q8_0 and Q4_0:
  34 and 18 bytes per 32 weights);
- quality: int8 and Q8_0 cost less KL than every 4-bit format; smaller groups less than larger
  ones; a zero point less than none at the same group size; the same-top-1 rate follows;
- rounding error: int4's never above half a step (round to nearest), Q4_0's above it (its
  clipped level) but within one step; int8's mean error below int4 g32's, below int4 g128's,
  in every block;
- the GEMV's bytes read: 4, 2, about 1 and 0.625 bytes per weight (float32, bfloat16, int8,
  int4 fused: codes + bfloat16 scale and zero per 32), dequantize-then-multiply more than
  float32 (it writes and reads a float32 copy); times are printed, never asserted;
- KV: bytes per token of the bundled model by hand (2 x L 6 x Hkv 2 x D 32 x bytes, int8 plus
  a float32 scale per token and head) and Llama-3.1-8B's, the tokens each budget holds by
  S12's block arithmetic, fp8 >= int8 >= bfloat16 >= float32 at every budget.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from notebook_testing import (assert_committed_without_outputs, code_source, execute,  # noqa: E402
                              figures_checked, legend_coverings, outputs, stream_text)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s14_quantization.ipynb"
# The bundled model's linear weights per block: qkv (256, 128), o (128, 128), gate_up (768, 128),
# down (128, 384); the same in all 6 blocks.
SHAPES = [(256, 128), (128, 128), (768, 128), (128, 384)]
NUMEL = sum(n * k for n, k in SHAPES)


def hand_bits(scheme: str) -> float:
    stored = 0.0
    for n, k in SHAPES:
        if scheme == "int8":
            stored += n * k + 4 * n
        elif scheme in ("q8_0", "q4_0"):
            stored += n * k / 32 * (34 if scheme == "q8_0" else 18)
        else:
            g = int(re.search(r"g(\d+)", scheme).group(1))
            stored += n * k / 2 + 2 * n * k / g + (n * k / g if "asym" in scheme else 0)
    return 8 * stored / NUMEL


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"), timeout=900)


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_chapter_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s14_quantization import QuantizedTensor, quantize_model, scheme_memory" in source
    assert "quality.evaluate(model, reference, max_chunks=MAX_CHUNKS)" in source
    assert "s14.gemv_timings(" in source and "kv.pool_tokens(" in source
    assert "MAX_CHUNKS = 60" in source
    for name in ("quantize_int8", "quantize_int4", "dequantize_int4", "pack_int4",
                 "quantize_q4_0", "QuantizedTensor", "quantize_model", "model_memory",
                 "scheme_memory", "evaluate", "gemv_timings", "pool_tokens",
                 "kv_cache_bytes_per_token"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_and_its_legends_cover_no_data(executed):
    assert not [o for o in outputs(executed) if o.output_type == "error"]
    images = [o for o in outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 4
    assert figures_checked(executed) >= 4
    assert legend_coverings(executed) == []


@pytest.mark.slow
def test_quality_against_bits_is_ordered(executed):
    text = stream_text(executed)
    rows = {m[0].strip(): tuple(map(float, m[1:])) for m in re.findall(
        r"^((?:int8|q8_0|int4 g\d+ a?sym|q4_0)\s*?)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)\s+"
        r"([\d.e+-]+)\s+([\d.]+)%$", text, re.M)}
    assert set(rows) == {"int8", "q8_0", "int4 g32 sym", "int4 g32 asym", "int4 g64 sym",
                         "int4 g128 sym", "int4 g128 asym", "q4_0"}, text[:2000]
    for label, (bits, ppl, delta, kld, top1) in rows.items():
        assert bits == pytest.approx(hand_bits(label), abs=5e-4), label
        assert kld >= 0 and 0 < top1 <= 100
    kld = {label: r[3] for label, r in rows.items()}
    top1 = {label: r[4] for label, r in rows.items()}
    four_bit = [label for label in rows if label.startswith(("int4", "q4_0"))]
    for label in four_bit:
        assert max(kld["int8"], kld["q8_0"]) < kld[label] / 10, label
        assert min(top1["int8"], top1["q8_0"]) > top1[label], label
    assert kld["int4 g32 sym"] < kld["int4 g64 sym"] < kld["int4 g128 sym"]
    assert kld["int4 g32 asym"] < kld["int4 g32 sym"]
    assert kld["int4 g128 asym"] < kld["int4 g128 sym"]
    m = re.search(r"float32 perplexity on 7,620 scored tokens: ([\d.]+)", text)
    assert m and 20 < float(m.group(1)) < 200


@pytest.mark.slow
def test_rounding_error_per_layer(executed):
    text = stream_text(executed)
    rows = re.findall(r"^(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.e+-]+)\s+([\d.e+-]+)\s+"
                      r"([\d.e+-]+)\s+([\d.e+-]+)$", text, re.M)
    assert [int(r[0]) for r in rows] == list(range(6)), text[-3000:]
    for _, int4_max, q4_max, q4_over, int8, g32, g128, q4 in rows:
        assert float(int4_max) <= 0.5                     # round to nearest, scale rounded up
        assert 0.5 < float(q4_max) <= 1.01                # Q4_0's clipped side: up to a step
        assert 0 < float(q4_over) < 5
        assert float(int8) < float(g32) < float(g128)
        assert float(int8) * 5 < float(q4)


@pytest.mark.slow
def test_gemv_bytes_are_ordered(executed):
    text = stream_text(executed)
    blocks = re.split(r"^W \((\d+), (\d+)\):$", text, flags=re.M)
    shapes = list(zip(blocks[1::3], blocks[2::3], blocks[3::3]))
    assert [(int(n), int(k)) for n, k, _ in shapes] == [(1024, 1024), (4096, 1024), (4096, 4096)]
    for n, k, body in shapes:
        got = {name: (int(b.replace(",", "")), float(per)) for name, b, per in re.findall(
            r"^\s+(fp32|bf16|int8 fused|int4 fused|int4 dequant\+matmul)\s+([\d,]+) bytes\s+"
            r"([\d.]+) B/weight", body, re.M)}
        weights = int(n) * int(k)
        assert got["fp32"][0] == 4 * weights and got["bf16"][0] == 2 * weights
        assert got["int8 fused"][0] == weights + 2 * int(n)      # codes + a bf16 scale per row
        assert got["int4 fused"][0] == weights // 2 + weights // 32 * 4   # + (scale, zero) bf16
        assert got["fp32"][0] > got["bf16"][0] > got["int8 fused"][0] > got["int4 fused"][0]
        assert got["int4 dequant+matmul"][0] > got["fp32"][0]
        assert re.search(r"fp32\s+[\d,]+ bytes.*ms\s+1\.00x fp32", body)


@pytest.mark.slow
def test_kv_capacity(executed):
    text = stream_text(executed)
    assert "bundled model: bytes per token float32 3,072, bfloat16 1,536, int8 864, fp8_e4m3 768" in text
    # Llama-3.1-8B: L 32, Hkv 8, D 128; int8 adds a 4-byte scale per token, layer, K/V and head
    assert ("Llama-3.1-8B: bytes per token float32 262,144, bfloat16 131,072, int8 67,584, "
            "fp8_e4m3 65,536") in text
    per_token = {"bundled": [3072, 1536, 864, 768], "Llama-3.1-8B": [262144, 131072, 67584, 65536]}
    rows = re.findall(r"^(bundled model|Llama-3.1-8B)\s+(\d+) MiB\s+([\d,]+)\s+([\d,]+)\s+"
                      r"([\d,]+)\s+([\d,]+)$", text, re.M)
    assert len(rows) == 12
    for name, mib, *tokens in rows:
        tokens = [int(t.replace(",", "")) for t in tokens]
        budget = int(mib) * 2**20
        want = [max(budget // (b * 16) - 1, 0) * 16 for b in per_token[name.split()[0]]]
        assert tokens == want, (name, mib)
        assert tokens[0] <= tokens[1] <= tokens[2] <= tokens[3]
        if tokens[1] >= 160:
            assert 1.9 <= tokens[3] / tokens[1] <= 2.1                 # 8 bits: twice bf16
