"""Draw chapters/figures/s14_quantization.png from the S14 benchmark's record.

    python benchmarks/bench_s14_quantization.py --out   # writes the JSON below
    python scripts/s14_figure.py            # writes chapters/figures/s14_quantization.png
    python scripts/s14_figure.py --check    # exits 1 when the committed file is not what it draws

Four panels, every value read from the JSON, nothing drawn by hand:

- top: quality on the bundled model's whole validation split against bits per weight of the
  whole model (8 x its bytes / its parameters: codes, scales, and the embedding in whatever
  it is stored): the change in perplexity (%, with its standard error) and the mean KL
  divergence to float32 (log scale), one point per weight scheme;
- bottom left: the two batch-1 GEMVs, median time against the bytes the weight takes as the
  kernel reads it (log-log), with the line of float32's own bandwidth through each float32
  point: a variant on its line moves its bytes as fast as float32 does;
- bottom right: decode at batch 1 of the 100M-parameter random Qwen3 model through S06's
  engine, the median decode step against the bytes a step reads (each quantized weight at the
  bytes its kernel reads: int4 g32 at 5 bits), with the same kind of line.

Legends sit below the panels, off the data (tests/legend_check.py checks it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from figure_io import figure_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s14_quantization.json"
OUT = ROOT / "chapters" / "figures" / "s14_quantization.png"
FAMILY = {"int8": "#2b6cb0", "q8_0": "#805ad5", "int4": "#dd6b20", "q4_0": "#38a169"}
GEMV = {"fp32": "o", "bf16": "s", "int8 fused": "^", "int4 fused": "v",
        "int4 dequant+matmul": "X"}
SHAPE_COLOR = ["#2b6cb0", "#c53030"]
# where each quality label sits, in points from its marker (default (8, -4)): only placement,
# so that labels of schemes at the same bits per weight do not overlap
LABEL_OFFSETS = {
    "int8": {"dppl": (-8, 6)}, "q8_0": {"dppl": (8, -10)},
    "int4 g32 sym": {"kld": (8, -10)}, "int4 g128 sym": {"kld": (-8, 2)},
    "q4_0": {"kld": (-8, -8)},
    "q4_0 +emb/head": {"dppl": (8, 4)}, "int4 g32, emb/head int8": {"dppl": (8, -10)},
}


def quality_points(figures: dict) -> list[dict]:
    """One point per weight scheme: label, colour, filled (embedding/head in float32) or not,
    whole-model bits per weight, delta PPL % and its standard error, mean KL divergence."""
    q = figures["quality"]
    params = q["fp32"]["model_bytes"] / 4
    points = []
    for w in q["weights"]:
        r = w["report"]
        points.append({"label": w["label"], "color": FAMILY[w["scheme"]],
                       "filled": w["embedding_head"] == "float32",
                       "bits": 8 * w["model_bytes"] / params, "dppl": r["delta_ppl_pct"],
                       "dppl_se": r["delta_ppl_pct_se"], "kld": r["mean_kld"]})
    return points


def draw_quality(dppl, kld, points) -> None:
    for p in points:
        face = p["color"] if p["filled"] else "white"
        dppl.errorbar(p["bits"], p["dppl"], yerr=p["dppl_se"], fmt="o", color=p["color"],
                      mfc=face, ms=7, capsize=3)
        kld.plot(p["bits"], p["kld"], "o", color=p["color"], mfc=face, ms=7)
    for ax, key in ((dppl, "dppl"), (kld, "kld")):
        for p in points:
            dx, dy = LABEL_OFFSETS.get(p["label"], {}).get(key, (8, -4))
            ax.annotate(p["label"], (p["bits"], p[key]), textcoords="offset points",
                        xytext=(dx, dy), fontsize=8, color=p["color"],
                        ha="left" if dx >= 0 else "right")
        ax.set_xlabel("bits per weight of the whole model (scales and embedding counted)")
        ax.grid(alpha=0.3)
        ax.set_xlim(3.5, 15.5)
    dppl.axhline(0, color="0.5", lw=0.8)
    dppl.set_title("change in perplexity against float32 (%, ± 1 s.e.)", fontsize=11)
    kld.set_yscale("log")
    kld.set_title("mean KL divergence to float32 (log scale)", fontsize=11)


def draw_gemv(ax, kernels: dict) -> None:
    for color, shape in zip(SHAPE_COLOR, kernels["shapes"]):
        for name, marker in GEMV.items():
            ax.plot(shape["weight_bytes"][name] / 1e6, shape["median_s"][name] * 1e3, marker,
                    color=color, ms=8, mfc="white" if name == "int4 dequant+matmul" else color)
        fp32_bw = shape["weight_bytes"]["fp32"] / shape["median_s"]["fp32"]   # bytes/s
        xs = [1.5, 500.0]
        ax.plot(xs, [x * 1e6 / fp32_bw * 1e3 for x in xs], "--", color=color, lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MB the weight takes as the kernel reads it")
    ax.set_title("batch-1 GEMV: median time (ms), CPU, 1 thread\ndashed: float32's bandwidth "
                 "through its own point", fontsize=11)
    ax.grid(alpha=0.3, which="both")


def draw_decode(ax, e2e: dict) -> None:
    rows = e2e["rows"]
    fp32 = rows["fp32"]
    bw = fp32["bytes_per_token"] / (fp32["decode_ms"] / 1e3)
    xs = [50.0, 450.0]
    ax.plot(xs, [x * 1e6 / bw * 1e3 for x in xs], "--", color="0.4", lw=1)
    for label, r in rows.items():
        if "decode_ms" not in r:
            continue
        scheme = label.split()[0]
        color = FAMILY.get(scheme, "0.2")
        ax.plot(r["bytes_per_token"] / 1e6, r["decode_ms"], "o", color=color, ms=8,
                mfc="white" if "emb/head" in label else color)
        left = label == "fp32"
        ax.annotate(f"{label}: {r['speedup_vs_fp32']:.2f}x tok/s", (r["bytes_per_token"] / 1e6,
                    r["decode_ms"]), textcoords="offset points", xytext=(-8 if left else 8, -4),
                    fontsize=8, color=color, ha="right" if left else "left")
    ax.set_xlim(0, 470)
    ax.set_ylim(0, fp32["decode_ms"] * 1.15)
    ax.set_xlabel("MB a decode step reads (weights as their kernels read them, and K/V)")
    ax.set_title("decode at batch 1, random Qwen3 100M: median step (ms)\nlabels: wall tokens/s "
                 "against fp32; dashed: fp32's bandwidth", fontsize=11)
    ax.grid(alpha=0.3)


def build_figure(figures: dict):
    fig, ((dppl, kld), (gemv, decode)) = plt.subplots(2, 2, figsize=(13, 10))
    draw_quality(dppl, kld, quality_points(figures))
    draw_gemv(gemv, figures["kernels"])
    draw_decode(decode, figures["e2e"])
    schemes = [(Line2D([], [], marker="o", ls="", color=c, ms=7), name)
               for name, c in FAMILY.items()]
    heads = [(Line2D([], [], marker="o", ls="", color="0.3", ms=7), "embedding/head float32"),
             (Line2D([], [], marker="o", ls="", color="0.3", mfc="white", ms=7),
              "embedding/head quantized too")]
    fig.legend(*zip(*(schemes + heads)), loc="center", ncol=6, frameon=False,
               bbox_to_anchor=(0.5, 0.505), fontsize=9)
    shapes = [(Line2D([], [], ls="--", color=c), f"W {s['n']} x {s['k']}")
              for c, s in zip(SHAPE_COLOR, figures["kernels"]["shapes"])]
    kinds = [(Line2D([], [], marker=m, ls="", color="0.3", ms=7,
                     mfc="white" if n == "int4 dequant+matmul" else "0.3"), n)
             for n, m in GEMV.items()]
    fig.legend(*zip(*(shapes + kinds)), loc="lower center", ncol=7, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=9)
    config, q = figures["config"], figures["quality"]
    fig.suptitle(f"S14 quantization: quality on the bundled model ({q['num_tokens']:,} scored "
                 f"tokens, fp32 PPL {q['ref_ppl']:.2f}); speed on the CPU, {config['threads']} "
                 f"thread, {config['logical_cores']} shared cores", fontsize=12)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.91, bottom=0.1, hspace=0.42, wspace=0.18)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
