"""Draw chapters/figures/s15_speculative.png from the S15 benchmark's record.

    python benchmarks/bench_s15_speculative.py --record   # writes the JSON below
    python scripts/s15_figure.py            # writes chapters/figures/s15_speculative.png
    python scripts/s15_figure.py --check    # exits 1 when the committed file is not what it draws

Three panels, every value read from the JSON, nothing drawn by hand:

- left: acceptance by draft position (section A at its largest k), one line per proposer
  (n-gram prompt lookup, the 1-layer draft, the target's int4 copy) and workload: solid on
  the corpus workload, dashed on the copy workload, dash-dotted on the loop workload;
- middle: tokens per verifying forward against k (section A): measured (markers) and
  Leviathan's Equation 1 with alpha = the measured acceptance at draft position 1 (lines), per
  proposer and workload (the same line styles);
- right: wall-clock speed-up at batch 1 (section B's three workloads, and section C's random
  100M model): each of our speculating engines against our plain engine, Hugging Face's
  assisted generation and prompt lookup against Hugging Face's plain generate; the dashed line
  is 1 (no gain).

Legends sit below the panels, off the data (tests/legend_check.py checks it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from figure_io import figure_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s15_speculative.json"
OUT = ROOT / "chapters" / "figures" / "s15_speculative.png"
PROPOSER = {"ngram": ("#2b6cb0", "n-gram prompt lookup"), "draft": ("#dd6b20", "1-layer draft"),
            "int4": ("#38a169", "int4 copy of the target")}
# each workload's line style and whether its markers are filled
WORKLOAD = {"corpus": ("-", True), "copy": ("--", False), "loop": ("-.", True)}
MARKER = {"corpus": "o", "copy": "o", "loop": "s"}
# the bars of the right panel: (workload's row label, its colour, the legend's name)
BARS = [("ours ngram", "#2b6cb0", "ours: n-gram"), ("ours draft", "#dd6b20", "ours: 1-layer draft"),
        ("ours int4", "#38a169", "ours: int4 copy of the target"),
        ("HF assisted (draft)", "#c05621", "HF assisted, 1-layer draft"),
        ("HF prompt lookup", "#2c5282", "HF prompt lookup")]
RANDOM_BARS = [("int4 draft", "#38a169"), ("int8 draft", "#276749")]


def rows_by(figures: dict, workload: str, proposer: str) -> list[dict]:
    """Section A's rows of one workload and proposer, by k."""
    rows = figures["acceptance"]["workloads"][workload]["rows"]
    return sorted((r for r in rows if r["proposer"] == proposer), key=lambda r: r["k"])


def acceptance_curves(figures: dict) -> dict:
    """{(workload, proposer): acceptance per draft position at the largest k}."""
    k_max = max(figures["acceptance"]["k"])
    out = {}
    for workload in WORKLOAD:
        for proposer in PROPOSER:
            row = [r for r in rows_by(figures, workload, proposer) if r["k"] == k_max]
            if row and row[0]["acceptance_per_position"]:
                out[(workload, proposer)] = row[0]["acceptance_per_position"]
    return out


def tokens_curves(figures: dict) -> dict:
    """{(workload, proposer): (ks, measured tokens per verify, predicted)}, rows with drafts."""
    out = {}
    for workload in WORKLOAD:
        for proposer in PROPOSER:
            rows = [r for r in rows_by(figures, workload, proposer) if r["num_drafts"]]
            if rows:
                out[(workload, proposer)] = ([r["k"] for r in rows],
                                             [r["tokens_per_verify"] for r in rows],
                                             [r["predicted_tokens_per_forward"] for r in rows])
    return out


def speedup_bars(figures: dict) -> list[tuple[str, list[tuple[str, str, float]]]]:
    """[(group label, [(bar label, colour, speed-up)])]: section B's workloads, then C."""
    groups = []
    for workload, part in figures["wallclock"]["workloads"].items():
        rows = part["rows"]
        groups.append((f"bundled model,\n{workload}",
                       [(label, color, rows[label]["speedup"]) for label, color, _ in BARS
                        if label in rows]))
    if "random" in figures:
        rows = figures["random"]["rows"]
        millions = figures["random"]["parameters"] / 1e6
        groups.append((f"random {millions:.0f}M\nmodel",
                       [(label, color, rows[label]["speedup"]) for label, color in RANDOM_BARS
                        if label in rows]))
    return groups


def draw_acceptance(ax, figures: dict) -> None:
    for (workload, proposer), per_pos in acceptance_curves(figures).items():
        color = PROPOSER[proposer][0]
        style, filled = WORKLOAD[workload]
        ax.plot(range(1, len(per_pos) + 1), per_pos, style, marker=MARKER[workload], ms=5,
                color=color, mfc=color if filled else "white")
    ax.set_ylim(-0.03, 1.03)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted")
    ax.set_title(f"acceptance by draft position (k = {max(figures['acceptance']['k'])})",
                 fontsize=11)
    ax.grid(alpha=0.3)


def draw_tokens(ax, figures: dict) -> None:
    top = 1.0
    for (workload, proposer), (ks, measured, predicted) in tokens_curves(figures).items():
        color = PROPOSER[proposer][0]
        style, filled = WORKLOAD[workload]
        ax.plot(ks, predicted, style, color=color, lw=1.2)
        ax.plot(ks, measured, MARKER[workload], color=color, ms=5,
                mfc=color if filled else "white")
        top = max(top, *measured, *predicted)
    ks = figures["acceptance"]["k"]
    ax.plot(ks, [k + 1 for k in ks], ":", color="0.5", lw=1)
    ax.set_ylim(0.8, top * 1.08)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("k, draft tokens per step")
    ax.set_ylabel("tokens per forward that verified drafts")
    ax.set_title("measured (markers) against Equation 1 (lines)\ndotted: k + 1, all accepted",
                 fontsize=11)
    ax.grid(alpha=0.3)


def draw_speedups(ax, figures: dict) -> None:
    groups = speedup_bars(figures)
    width = 0.15
    ticks = []
    for g, (label, bars) in enumerate(groups):
        left = g - width * (len(bars) - 1) / 2
        for i, (name, color, speedup) in enumerate(bars):
            x = left + i * width
            ax.bar(x, speedup, width * 0.9, color=color,
                   hatch="//" if name.startswith("HF") else None, edgecolor="white")
            ax.annotate(f"{speedup:.2f}", (x, speedup), textcoords="offset points",
                        xytext=(0, 2), ha="center", fontsize=7)
        ticks.append(label)
    ax.axhline(1.0, color="0.3", ls="--", lw=1)
    ax.set_xticks(range(len(groups)), ticks, fontsize=9)
    top = max(s for _, bars in groups for _, _, s in bars)
    ax.set_ylim(0, max(1.2, top * 1.15))
    ax.set_ylabel("speed-up over the same engine without speculation")
    ax.set_title("wall clock at batch 1, CPU, 1 thread\nhatched: Hugging Face generate",
                 fontsize=11)
    ax.grid(alpha=0.3, axis="y")


def build_figure(figures: dict):
    fig, (acc, tok, wall) = plt.subplots(1, 3, figsize=(18, 6.5),
                                         gridspec_kw={"width_ratios": [1, 1, 1.35]})
    draw_acceptance(acc, figures)
    draw_tokens(tok, figures)
    draw_speedups(wall, figures)
    proposers = [(Line2D([], [], color=c, marker="o", ms=6), name)
                 for c, name in PROPOSER.values()]
    workloads = [(Line2D([], [], color="0.3", ls=WORKLOAD[w][0], marker=MARKER[w], ms=6,
                         mfc="0.3" if WORKLOAD[w][1] else "white"), f"{w} workload")
                 for w in WORKLOAD]
    fig.legend(*zip(*(proposers + workloads)), loc="lower center", ncol=3, frameon=False,
               bbox_to_anchor=(0.32, 0.0), fontsize=9)
    bars = [(Patch(color=c, hatch="//" if n.startswith("HF") else None), n)
            for _, c, n in BARS] + [(Patch(color=RANDOM_BARS[1][1]),
                                     "ours: int8 copy (random model)")]
    fig.legend(*zip(*bars), loc="lower center", ncol=3, frameon=False,
               bbox_to_anchor=(0.81, 0.0), fontsize=8)
    config = figures["config"]
    fig.suptitle(f"S15 speculative decoding: the bundled model (6 layers) at batch 1, greedy; "
                 f"CPU, {config['threads']} thread, {config['logical_cores']} shared cores",
                 fontsize=12)
    fig.subplots_adjust(left=0.045, right=0.99, top=0.86, bottom=0.25, wspace=0.22)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
