"""Data for the S14 "Try it" quantization playground: real weight rows of the bundled model, and
what the chapter's quantizers make of them.

The page quantizes one row of a linear weight of the bundled model (data/model, loaded with
S06's `TorchTransformer.from_pretrained` in float32) with the chapter's round-to-nearest
quantizers, code/s14_quantization.py:

- int8, one scale per row (`quantize_int8`, float32 scale = absmax / 127, codes -127..127);
- int4 in groups of 32, 64 or 128 weights (`quantize_int4`), symmetric (scale = absmax / 7,
  unsigned codes 1..15 around the zero point 8) or asymmetric (scale = (max' - min') / 15 over
  the group widened to include 0, an integer zero point 0..15 per group), the scales stored in
  bfloat16 rounded *up* (never down, so every weight stays within scale / 2 of its level).

and shows the codes, the scales and zero points, the dequantized row, its error and the bytes
it takes. The JavaScript (simulator.js) recomputes all of it in float32 (Math.fround after
every operation, bfloat16 rounding on the bit pattern, round half to even as torch.round);
on load it checks every row and setting against the Python results exported here (codes,
scales, zero points, the float32 error of every weight, bytes), and shows a banner if one
differs. tests/test_s14_simulator_browser.py compares what the page shows with these values;
tests/test_s14_simulator_data.py holds them against an independent NumPy quantizer and the
model file itself.

Rows: the first row of block 0's down_proj (K = 384: three groups of 128, twelve of 32), the
first row of block 5's qkv_proj (K = 128), and, over every linear weight of the model, the row
with the largest absmax / RMS (a row with an outlier: its int8 scale, set by one weight, is
coarse for all the others; groups confine the damage to one group).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s06_torch as s06  # noqa: E402
import s14_quantization as s14  # noqa: E402

# (bits, group_size, symmetric): every setting the page offers (int8 is per row, symmetric)
SETTINGS = [(8, None, True)] + [(4, g, s) for g in s14.GROUP_SIZES for s in (True, False)]


def setting_id(bits: int, group_size: int | None, symmetric: bool) -> str:
    """"int8", or e.g. "int4 g32 sym" (QuantizedTensor.describe's words)."""
    return "int8" if bits == 8 else f"int4 g{group_size} {'sym' if symmetric else 'asym'}"


def quantize_row(row: torch.Tensor, bits: int, group_size: int | None, symmetric: bool) -> dict:
    """The chapter's quantizer on one row (1, K): codes, scales, zero points (the integer each
    code is measured from: 0 for int8, 8 for symmetric int4), the float32 error w - dequant of
    every weight, and the bytes the row takes (codes + scales + zero points)."""
    k = row.shape[1]
    if bits == 8:
        codes, scales = s14.quantize_int8(row)
        back = s14.dequantize_int8(codes, scales)
        zeros = [0]
        nbytes = {"codes": k, "scales": 4, "zeros": 0}
    else:
        codes, scales, zero_points = s14.quantize_int4(row, group_size, symmetric)
        back = s14.dequantize_int4(codes, scales, zero_points, group_size)
        zeros = ([8] * (k // group_size) if zero_points is None
                 else zero_points[0].tolist())
        nbytes = {"codes": k // 2, "scales": 2 * (k // group_size),
                  "zeros": 0 if symmetric else k // group_size}
    error = (row - back)[0]                                             # float32 (K,)
    return {"id": setting_id(bits, group_size, symmetric), "bits": bits,
            "group_size": group_size or k, "symmetric": symmetric,
            "codes": codes[0].tolist(), "scales": scales.float().reshape(-1).tolist(),
            "zeros": zeros, "error": error.tolist(), "bytes": nbytes,
            "total_bytes": sum(nbytes.values())}


def pick_rows(model: s06.TorchTransformer) -> list[tuple[str, int]]:
    """(weight name, row index) of the rows the page offers (see the module docstring)."""
    names = [f"blocks.{i}.{n}" for i in range(len(model.blocks))
             for n in s14.linear_weight_names(model)]
    last = len(model.blocks) - 1
    best, where = -1.0, None
    for name in names:
        w = model.get_parameter(name).detach()
        ratio = w.abs().amax(dim=1) / w.pow(2).mean(dim=1).sqrt()           # (N,)
        row = int(ratio.argmax())
        if float(ratio[row]) > best:
            best, where = float(ratio[row]), (name, row)
    rows = [("blocks.0.down_proj", 0), (f"blocks.{last}.qkv_proj", 0)]
    return rows + ([where] if where not in rows else [])


def export(model_dir: Path = s03.BUNDLED_MODEL_DIR) -> dict:
    model = s06.TorchTransformer.from_pretrained(model_dir, "cpu", torch.float32)
    rows = []
    for name, index in pick_rows(model):
        weight = model.get_parameter(name).detach()
        row = weight[index:index + 1].clone()                               # (1, K) float32
        rms = float(row.pow(2).mean().sqrt())
        rows.append({
            "name": name, "row": index, "shape": list(weight.shape), "k": row.shape[1],
            "values": row[0].tolist(),            # float32 values, exact as JSON doubles
            "absmax_over_rms": float(row.abs().max()) / rms,
            "results": [quantize_row(row, *s) for s in SETTINGS]})
    return {"model": "the bundled model (data/model, Qwen3 layout, float32)",
            "settings": [{"id": setting_id(*s), "bits": s[0], "group_size": s[1],
                          "symmetric": s[2]} for s in SETTINGS],
            "group_sizes": list(s14.GROUP_SIZES), "int8_max": s14.INT8_MAX,
            "int4_sym_max": s14.INT4_SYM_MAX, "int4_levels": s14.INT4_LEVELS,
            "int4_scale_dtype": "bfloat16", "int8_scale_dtype": "float32",
            "rows": rows}


if __name__ == "__main__":
    import json
    data = export()
    print(json.dumps({k: v for k, v in data.items() if k != "rows"}, indent=1))
    for r in data["rows"]:
        print(r["name"], r["row"], r["k"], f"absmax/rms {r['absmax_over_rms']:.2f}",
              [(x["id"], x["total_bytes"], max(map(abs, x["error"]))) for x in r["results"]])
