"""The S14 quantization playground's exported rows and results, held against independent
oracles.

site/simulators/quantization-playground/export.py exports real weight rows of the bundled
model and, for every setting the page offers (int8 per row; int4 in groups of 32, 64, 128,
symmetric and asymmetric), what the chapter's quantizers (code/s14_quantization.py) make of
them; the page recomputes them and tests/test_s14_simulator_browser.py compares. Here:

- each exported row is the model file's row, read with safetensors from data/model (q, k, v
  stacked as S06's qkv_proj, gate over up as its gate_up_proj), bit for bit;
- a NumPy quantizer written here group by group (scales rounded up to bfloat16 as "the
  smallest bfloat16 >= the float32 scale", found by truncating the bit pattern) gives the
  same codes, scales, zero points and float32 errors, every one;
- every error is within half a step (|w - dequant| <= scale / 2), every code in its range;
- the bytes are the format's, counted by hand (codes + scales + zero points) and as the
  chapter's `QuantizedTensor` stores a one-row weight;
- quantizing the whole weight with `quantize_model` stores the exported scales for that row
  (groups do not cross rows);
- the rows show what they are there to show: K = 384 (three groups of 128) among them, one
  row with an outlier (absmax / RMS above 4), and int4's error above int8's on every row.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import s03_transformer as s03
import s06_torch as s06
import s14_quantization as s14
from sim_browser import load_exporter

pytestmark = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                reason="data/model has no bundled model")


@pytest.fixture(scope="module")
def data():
    return load_exporter("quantization-playground", "s14_sim_export_data").export()


def file_weight(name: str) -> np.ndarray:
    """S06's weight `name` (blocks.i.attr) read straight from the safetensors file."""
    from safetensors.numpy import load_file
    tensors = load_file(str(s03.BUNDLED_MODEL_DIR / "model.safetensors"))
    _, layer, attr = name.split(".")
    p = f"model.layers.{layer}."
    parts = {"qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "o_proj": ["self_attn.o_proj"], "gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
             "down_proj": ["mlp.down_proj"]}[attr]
    return np.concatenate([tensors[p + part + ".weight"] for part in parts], axis=0)


def bf16_at_least(x: np.float32) -> np.float32:
    """The smallest bfloat16 value >= x (x > 0, finite), as float32."""
    bits = np.array([x], np.float32).view(np.uint32)[0]
    low = np.array([bits & 0xFFFF0000], np.uint32).view(np.float32)[0]   # truncated: <= x
    if low >= x:
        return low
    return np.array([(bits & 0xFFFF0000) + 0x10000], np.uint32).view(np.float32)[0]


def reference(row: np.ndarray, bits: int, group_size: int | None, symmetric: bool):
    """(codes, scales, zeros, error) of one float32 row, group by group, in NumPy float32."""
    k = row.size
    g = k if bits == 8 else group_size
    codes, scales, zeros, error = [], [], [], []
    for start in range(0, k, g):
        part = row[start:start + g]
        if bits == 8:
            scale, zero = np.float32(np.abs(part).max() / np.float32(127)), 0
        elif symmetric:
            scale, zero = bf16_at_least(np.float32(np.abs(part).max() / np.float32(7))), 8
        else:
            lo, hi = min(part.min(), np.float32(0)), max(part.max(), np.float32(0))
            scale = bf16_at_least(np.float32((hi - lo) / np.float32(15))) if hi > lo else 0
        if scale == 0:
            scale = np.float32(1)
        if bits == 4 and not symmetric:
            zero = int(np.clip(np.rint(-lo / scale), 0, 15))
        q = np.rint(part / scale)                                  # half to even
        if bits == 8:
            c = np.clip(q, -127, 127)
        elif symmetric:
            c = np.clip(q, -7, 7) + 8
        else:
            c = np.clip(q + zero, 0, 15)
        codes += c.astype(int).tolist()
        back = ((c - zero).astype(np.float32) * scale).astype(np.float32)
        error += (part - back).astype(np.float32).tolist()
        scales.append(float(scale))
        zeros.append(zero)
    return codes, scales, zeros, error


def test_rows_are_the_model_files_rows(data):
    for row in data["rows"]:
        w = file_weight(row["name"])
        assert list(w.shape) == row["shape"] and row["k"] == w.shape[1]
        np.testing.assert_array_equal(np.float32(row["values"]), w[row["row"]])


def test_every_result_equals_a_numpy_quantizer_written_here(data):
    settings = {(s["bits"], s["group_size"], s["symmetric"]) for s in data["settings"]}
    assert settings == {(8, None, True)} | {(4, g, s) for g in (32, 64, 128) for s in (True, False)}
    for row in data["rows"]:
        values = np.float32(row["values"])
        assert len(row["results"]) == len(settings)
        for res in row["results"]:
            g = res["group_size"] if res["bits"] == 4 else None
            codes, scales, zeros, error = reference(values, res["bits"], g, res["symmetric"])
            case = (row["name"], row["row"], res["id"])
            assert res["codes"] == codes, case
            assert res["scales"] == scales, case
            assert res["zeros"] == zeros, case
            assert res["error"] == error, case


def test_errors_within_half_a_step_and_codes_in_range(data):
    for row in data["rows"]:
        for res in row["results"]:
            g = res["group_size"]
            step = np.repeat(res["scales"], g)
            assert (np.abs(res["error"]) <= step / 2).all(), (row["name"], res["id"])
            lo, hi = (-127, 127) if res["bits"] == 8 else (0, 15)
            assert lo <= min(res["codes"]) and max(res["codes"]) <= hi
            if res["bits"] == 4 and res["symmetric"]:
                assert min(res["codes"]) >= 1                     # -8 is never used
            assert all(0 <= z <= 15 for z in res["zeros"])


def test_bytes_by_hand_and_as_the_chapter_stores_them(data):
    for row in data["rows"]:
        k = row["k"]
        w = torch.tensor([row["values"]], dtype=torch.float32)
        for res in row["results"]:
            if res["bits"] == 8:
                want = k + 4                                     # codes + one float32 scale
                stored = s14.QuantizedTensor.from_float(w, "int8").quantized_nbytes
            else:
                groups = k // res["group_size"]
                want = k // 2 + 2 * groups + (0 if res["symmetric"] else groups)
                stored = s14.QuantizedTensor.from_float(
                    w, "int4", group_size=res["group_size"],
                    symmetric=res["symmetric"]).quantized_nbytes
            assert res["total_bytes"] == sum(res["bytes"].values()) == want == stored, res["id"]


def test_the_whole_weight_quantized_stores_the_exported_scales(data):
    for symmetric in (True, False):
        model = s06.TorchTransformer.from_pretrained(s03.BUNDLED_MODEL_DIR, "cpu", torch.float32)
        s14.quantize_model(model, "int4", group_size=32, symmetric=symmetric, path="reference")
        for row in data["rows"]:
            res = next(r for r in row["results"]
                       if r["bits"] == 4 and r["group_size"] == 32 and r["symmetric"] == symmetric)
            codes, scales, zeros = model.get_parameter(row["name"]).int4_codes()
            assert scales[row["row"]].tolist() == res["scales"]
            assert codes[row["row"]].tolist() == res["codes"]
            if not symmetric:
                assert zeros[row["row"]].tolist() == res["zeros"]


def test_the_rows_show_what_they_are_for(data):
    rows = data["rows"]
    assert {r["k"] for r in rows} >= {128, 384}
    assert max(r["absmax_over_rms"] for r in rows) > 4
    for row in rows:
        rms = {r["id"]: float(np.sqrt(np.mean(np.square(r["error"])))) for r in row["results"]}
        assert all(rms["int8"] < v for key, v in rms.items() if key != "int8"), row["name"]
        # smaller groups, smaller error (the grid follows each group's own range)
        assert rms["int4 g32 sym"] <= rms["int4 g128 sym"], row["name"]
