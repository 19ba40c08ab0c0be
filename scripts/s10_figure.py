"""Draw chapters/figures/s10_scheduler.png from the S10 benchmark's figures (the chapter's plot).

    python benchmarks/bench_s10_scheduler.py --json chapters/figures/s10_scheduler.json
    python scripts/s10_figure.py            # writes chapters/figures/s10_scheduler.png
    python scripts/s10_figure.py --check    # exits 1 when the committed file is not what it draws

Four panels against the KV capacity (tokens), one colour and marker per policy (FCFS,
priority) in every panel, every point one run of benchmarks/bench_s10_scheduler.py: output
tokens/s, with the bound the arrivals set (all output tokens / the last arrival time: the run is
arrival-limited, so every point sits just under it); preemptions (their count depends on the
machine's speed, the arrivals being in seconds); TTFT p50 (solid line, filled markers) and p99
(dotted line, hollow markers); and the end-to-end p99 of each priority class (low dashed, high
dash-dot), where priority's fairness cost shows (its low-priority requests wait behind every
high-priority one). Nothing is drawn by hand: every value is read from the JSON. One legend
below the panels, off the data (tests/legend_check.py checks it).
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
DATA = ROOT / "chapters" / "figures" / "s10_scheduler.json"
OUT = ROOT / "chapters" / "figures" / "s10_scheduler.png"
STYLE = {"fcfs": dict(color="#2b6cb0", marker="o"), "priority": dict(color="#c05621",
                                                                    marker="s")}
PERCENTILE_STYLE = {"p50": dict(linestyle="-"), "p99": dict(linestyle=":", linewidth=2,
                                                            markerfacecolor="white")}
CLASS_STYLE = {"low": dict(linestyle="--"), "high": dict(linestyle="-.")}
BOUND_STYLE = dict(color="0.55", linewidth=5, alpha=0.35, solid_capstyle="butt")
GREY = dict(color="0.35", marker="o")


def series(runs, policy, value):
    mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["kv_capacity"])
    return [r["kv_capacity"] for r in mine], [value(r) for r in mine]


def build_figure(figures: dict):
    runs, config = figures["runs"], figures["config"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.4))
    throughput, preemptions, ttft, by_class = axes
    capacities = sorted({r["kv_capacity"] for r in runs})
    bound = config["arrival_bound_tokens_per_s"]
    throughput.plot([capacities[0], capacities[-1]], [bound, bound], **BOUND_STYLE)
    for policy, style in STYLE.items():
        throughput.plot(*series(runs, policy, lambda r: r["tokens_per_s"]), **style)
        preemptions.plot(*series(runs, policy, lambda r: r["preemptions"]), **style)
        for name, line in PERCENTILE_STYLE.items():
            ttft.plot(*series(runs, policy, lambda r: r["ttft"][f"{name}_ms"]), **style,
                      **line)
        for cls, line in CLASS_STYLE.items():
            by_class.plot(*series(runs, policy, lambda r: r["classes"][cls]["e2e"]["p99_ms"]),
                          **style, **line)
    titles = ("output tokens/s (arrival-limited)", "preemptions", "TTFT (ms): p50 and p99",
              "end-to-end p99 (ms) by class")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("KV capacity (tokens)")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)     # a margin above the highest point
    key = [(Line2D([], [], linestyle="-", **style), policy) for policy, style in STYLE.items()]
    key += [(Line2D([], [], **BOUND_STYLE),
             f"arrival bound: {config['output_tokens']} tokens / last arrival "
             f"{config['last_arrival_s']:.2f} s")]
    key += [(Line2D([], [], **GREY, **line), f"TTFT {name}")
            for name, line in PERCENTILE_STYLE.items()]
    key += [(Line2D([], [], **GREY, **line), f"{cls} priority (e2e)")
            for cls, line in CLASS_STYLE.items()]
    fig.legend(*zip(*key), loc="lower center", ncol=4, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    fig.suptitle(f"S10 scheduler, bundled model: {config['num_requests']} mixed requests, "
                 f"Poisson {config['rate_per_s']:g}/s, max_num_seqs {config['max_num_seqs']}, "
                 f"{config['device']} x {config['threads']} thread "
                 f"(fits everything: {config['fits_everything_tokens']} tokens)", fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.84, bottom=0.29, wspace=0.28)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
