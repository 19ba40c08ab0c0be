"""Draw chapters/figures/s12_paged_attention.png from the S12 benchmark's figures.

    python benchmarks/bench_s12_paged_attention.py --out   # writes the JSON it draws
    python scripts/s12_figure.py            # writes chapters/figures/s12_paged_attention.png
    python scripts/s12_figure.py --check    # exits 1 when the committed file is not what it draws

Three panels from one run of the benchmark's workload at one KV budget (drawn as a grey line):
KV token positions over the steps, reserved (dashed) and used (solid), for the contiguous
engine (S11: each running request reserves a whole context) and the paged one (S12: blocks as
requests grow); the requests running in each step for both; and the internal waste (unused
positions of each request's last block, as a share of those allocated) against block size,
the closed form over the workload with the paged run's measured value as one marker. Every
value is read from the JSON; one legend below the panels, off the data
(tests/legend_check.py checks it).
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
DATA = ROOT / "chapters" / "figures" / "s12_paged_attention.json"
OUT = ROOT / "chapters" / "figures" / "s12_paged_attention.png"
STYLE = {"contiguous": dict(color="#c05621"), "paged": dict(color="#2b6cb0")}
LABEL = {"contiguous": "contiguous (S11: a whole context per request)",
         "paged": "paged (S12: blocks on demand)"}
BUDGET = dict(color="0.55", linewidth=1.2)


def build_figure(figures: dict):
    config, memory = figures["config"], figures["memory"]
    fig, (kv, running, waste) = plt.subplots(1, 3, figsize=(14, 4.6))
    for name, m in memory.items():
        steps = range(len(m["used_tokens"]))
        kv.plot(steps, m["reserved_tokens"], linestyle="--", **STYLE[name])
        kv.plot(steps, m["used_tokens"], linestyle="-", **STYLE[name])
        running.plot(steps, m["running"], **STYLE[name])
    longest = max(len(m["used_tokens"]) for m in memory.values())
    kv.plot([0, longest - 1], [config["kv_budget_tokens"]] * 2, **BUDGET)
    sizes = [w["block_size"] for w in figures["waste"]]
    waste.plot(sizes, [100 * w["waste_share"] for w in figures["waste"]], marker="o",
               **STYLE["paged"])
    waste.plot([config["block_size"]], [100 * figures["measured_waste_share"]], marker="D",
               markersize=10, linestyle="none", markerfacecolor="none",
               markeredgecolor="black")
    waste.set_xscale("log", base=2)
    waste.set_xticks(sizes, [str(b) for b in sizes])
    c, p = memory["contiguous"], memory["paged"]
    titles = ("KV token positions over the steps",
              f"requests running (most: {c['max_running']} contiguous, {p['max_running']} "
              "paged)",
              "internal waste: unused positions of last blocks (%)")
    for ax, title in zip((kv, running, waste), titles):
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    kv.set_xlabel("engine step")
    running.set_xlabel("engine step")
    waste.set_xlabel("block size (tokens)")
    key = [(Line2D([], [], **STYLE[name]), LABEL[name]) for name in memory]
    key += [(Line2D([], [], color="0.2", linestyle="--"), "reserved"),
            (Line2D([], [], color="0.2", linestyle="-"), "used"),
            (Line2D([], [], **BUDGET), f"KV budget ({config['kv_budget_tokens']} positions)"),
            (Line2D([], [], marker="D", linestyle="none", markerfacecolor="none",
                    markeredgecolor="black"), f"measured, block size {config['block_size']}")]
    fig.legend(*zip(*key), loc="lower center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    fig.suptitle(
        f"S12 paged attention: {config['requests']} requests, prompts and outputs "
        f"{config['min_tokens']}-{config['max_tokens']} tokens, context {config['context']}\n"
        f"KV utilisation {100 * c['utilisation']:.0f}% contiguous, {100 * p['utilisation']:.0f}% "
        f"paged; {figures['concurrency_ratio_while_queued']:.1f}x the requests running while "
        "others wait", fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.80, bottom=0.27, wspace=0.22)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
