"""Draw chapters/figures/s11_chunked_prefill.png from the S11 benchmark's figures.

    python benchmarks/bench_s11_chunked_prefill.py --json chapters/figures/s11_chunked_prefill.json
    python scripts/s11_figure.py            # writes chapters/figures/s11_chunked_prefill.png
    python scripts/s11_figure.py --check    # exits 1 when the committed file is not what it draws

Three panels against the token budget (max_num_batched_tokens, log scale; the long prompt's
chunk is what the running decodes leave of it), every point the median over the benchmark's
repeats, chunking off (S10's engine) drawn as a flat grey line of the same style in each panel:
the running requests' inter-token latency p50 and max (log scale, a marker each; the max is
the stall the long prompt causes), each max labelled with how many of the run's gaps were slow
(longer than the benchmark's slow_factor x that run's p50) out of all; the long request's
TTFT; output tokens/s over the run. No p99: with a handful of stalls in about 380 gaps it is an
interpolation between a normal gap and a stall, not a tail. Nothing is drawn by hand: every
value is read from the JSON. One legend below the panels, off the data (tests/legend_check.py
checks it).
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
DATA = ROOT / "chapters" / "figures" / "s11_chunked_prefill.json"
OUT = ROOT / "chapters" / "figures" / "s11_chunked_prefill.png"
CHUNKED = dict(color="#2b6cb0", marker="o")
OFF = dict(color="0.45")
ITL_STYLE = {"p50": dict(linestyle="-", marker="o"),
             "max": dict(linestyle=":", linewidth=2.2, marker="^", markersize=8)}


def slow_label(summary: dict) -> str:
    """"k/N": the median run's slow gaps k of its N gaps."""
    return f"{summary['itl']['slow_gaps']:g}/{summary['itl']['num_gaps']:g}"


def build_figure(figures: dict):
    config, summary = figures["config"], figures["summary"]
    off = next(s for s in summary if s["budget"] == "off")
    chunked = sorted((s for s in summary if s["budget"] != "off"), key=lambda s: s["budget"])
    budgets = [s["budget"] for s in chunked]
    span = [budgets[0], budgets[-1]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    itl, ttft, throughput = axes
    for name, line in ITL_STYLE.items():
        itl.plot(budgets, [s["itl"][f"{name}_ms"] for s in chunked],
                 **{**CHUNKED, **line})
        itl.plot(span, [off["itl"][f"{name}_ms"]] * 2, **OFF,
                 **{k: v for k, v in line.items() if not k.startswith("marker")})
    for s in chunked:
        itl.annotate(slow_label(s), (s["budget"], s["itl"]["max_ms"]), textcoords="offset points",
                     xytext=(0, 9), ha="center", fontsize=9, color=CHUNKED["color"])
    itl.annotate(f"off: {slow_label(off)}", (span[0], off["itl"]["max_ms"]),
                 textcoords="offset points", xytext=(2, -13), ha="left", fontsize=9,
                 color=OFF["color"])
    ttft.plot(budgets, [s["ttft_long_ms"] for s in chunked], **CHUNKED)
    ttft.plot(span, [off["ttft_long_ms"]] * 2, **OFF)
    throughput.plot(budgets, [s["output_tokens_per_s"] for s in chunked], **CHUNKED)
    throughput.plot(span, [off["output_tokens_per_s"]] * 2, **OFF)
    itl.set_yscale("log")
    factor = config["slow_factor"]
    titles = (f"running requests' inter-token latency (ms);\nk/N: gaps > {factor:g} x p50, of all",
              f"TTFT of the {config['long_prompt_tokens']}-token prompt (ms)",
              "output tokens/s over the run")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=11)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlim(budgets[0] / 1.3, budgets[-1] * 1.3)     # room for the end labels
        ax.set_xlabel("token budget per step (max_num_batched_tokens)")
        ax.grid(alpha=0.3)
    for ax in (ttft, throughput):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    key = [(Line2D([], [], **CHUNKED), "chunked prefill (S11)"),
           (Line2D([], [], **OFF), "chunking off (S10: the prompt in one step)")]
    key += [(Line2D([], [], color="0.2", **line), f"ITL {name}")
            for name, line in ITL_STYLE.items()]
    fig.legend(*zip(*key), loc="lower center", ncol=4, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    shape = config["shape"]
    fig.suptitle(f"S11 chunked prefill: {config['running']} requests decoding, a "
                 f"{config['long_prompt_tokens']}-token prompt arrives; random Qwen3 layout "
                 f"(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers), "
                 f"{config['device']} x {config['threads']} thread, median of "
                 f"{config['repeats']}", fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.82, bottom=0.25, wspace=0.25)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
