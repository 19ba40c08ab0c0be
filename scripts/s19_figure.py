"""Draw chapters/figures/s19_server.png from the S19 benchmark's figures.

    python benchmarks/bench_s19_server.py --out chapters/figures/s19_server.json
    python scripts/s19_figure.py            # writes chapters/figures/s19_server.png
    python scripts/s19_figure.py --check    # exits 1 when the committed file is not what it draws

Four panels against the number of requests in flight (concurrency, log scale), every point the
median over the benchmark's repeats: TTFT p50 and p99, ITL p50 and p99 (log scales), output
tokens/s, each for the server (HTTP, SSE, the engine thread) and for the same engine driven in
process; and the ratios server / in-process of TTFT p50, ITL p50 and throughput (each the
median over repeats of the ratio within a repeat), with 1 (no overhead) as a grey line. Nothing is drawn by hand: every value is read from the JSON. One
legend below the panels, off the data (tests/legend_check.py checks it).
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
DATA = ROOT / "chapters" / "figures" / "s19_server.json"
OUT = ROOT / "chapters" / "figures" / "s19_server.png"
WAYS = {"server": dict(color="#2b6cb0"), "in-process": dict(color="#c05621")}
STATS = {"p50": dict(linestyle="-", marker="o"),
         "p99": dict(linestyle=":", linewidth=2.0, marker="^", markersize=7)}
RATIOS = {"ttft_p50": ("TTFT p50", dict(color="#6b46c1", marker="s")),
          "itl_p50": ("ITL p50", dict(color="#2f855a", marker="D")),
          "output_tokens_per_s": ("output tokens/s", dict(color="#b7791f", marker="v"))}


def build_figure(figures: dict):
    config, summary = figures["config"], figures["summary"]
    levels = config["concurrency"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.6))
    ttft, itl, throughput, ratio = axes
    for way, colour in WAYS.items():
        rows = sorted((s for s in summary if s["way"] == way), key=lambda s: s["concurrency"])
        xs = [s["concurrency"] for s in rows]
        for name, line in STATS.items():
            ttft.plot(xs, [s["ttft"][f"{name}_ms"] for s in rows], **colour, **line)
            itl.plot(xs, [s["itl"][f"{name}_ms"] for s in rows], **colour, **line)
        throughput.plot(xs, [s["output_tokens_per_s"] for s in rows], **colour,
                        **STATS["p50"])
    ratio.plot([levels[0], levels[-1]], [1, 1], color="0.6", linewidth=1)
    for key, (_, style) in RATIOS.items():
        ratio.plot([r["concurrency"] for r in figures["ratios"]],
                   [r[key] for r in figures["ratios"]], **style)
    titles = ("time to first token (ms)", "inter-token latency (ms)",
              "output tokens/s over the run", "server / in-process")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=11)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlim(levels[0] / 1.3, levels[-1] * 1.3)
        ax.set_xlabel("requests in flight (concurrency)")
        ax.grid(alpha=0.3)
    ttft.set_yscale("log")
    itl.set_yscale("log")
    throughput.set_ylim(0, throughput.get_ylim()[1] * 1.08)
    ratio.set_ylim(0, max(ratio.get_ylim()[1], 1.2) * 1.08)
    key = [(Line2D([], [], **style, **STATS["p50"]), f"{way}") for way, style in WAYS.items()]
    key += [(Line2D([], [], color="0.2", **line), name) for name, line in STATS.items()]
    key += [(Line2D([], [], **style), f"ratio of {label}") for label, style in RATIOS.values()]
    fig.legend(*zip(*key), loc="lower center", ncol=7, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    fig.suptitle(f"S19 server vs the same engine in process: {config['requests']} requests x "
                 f"{config['max_tokens']} tokens, {config['model']} "
                 f"({config['parameters']:,} parameters), max_num_seqs "
                 f"{config['max_num_seqs']}, {config['device']} x {config['threads']} thread, "
                 f"median of {config['repeats']}", fontsize=12)
    fig.subplots_adjust(left=0.04, right=0.99, top=0.85, bottom=0.25, wspace=0.27)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
