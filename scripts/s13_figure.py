"""Draw chapters/figures/s13_prefix_caching.png from the S13 benchmark's figures.

    python benchmarks/bench_s13_prefix_caching.py --out  # writes the JSON below
    python scripts/s13_figure.py            # writes chapters/figures/s13_prefix_caching.png
    python scripts/s13_figure.py --check    # exits 1 when the committed file is not what it draws

Two panels, every point the median over the benchmark's repeats, prefix cache on and off:
TTFT against the shared fraction of a system-prompt workload's prompts, each point labelled
with the prompt tokens it computed (the rest were cached); and TTFT of each turn of a
multi-turn chat, each turn labelled with the fraction of its prompt found cached. Nothing is
drawn by hand: every value is read from the JSON. One legend below the panels, off the data
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
DATA = ROOT / "chapters" / "figures" / "s13_prefix_caching.json"
OUT = ROOT / "chapters" / "figures" / "s13_prefix_caching.png"
STYLE = {"on": dict(color="#2b6cb0", marker="o"), "off": dict(color="0.45", marker="s",
                                                              linestyle="--")}
LABELS = {"on": "prefix cache on (S13)", "off": "prefix cache off (S12)"}


def build_figure(figures: dict):
    config, rows, chat = figures["config"], figures["system_prompt"], figures["chat"]
    fig, (shared, turns) = plt.subplots(1, 2, figsize=(12, 4.8))
    x = [r["fraction"] for r in rows]
    for mode in ("on", "off"):
        shared.plot(x, [r["ttft_ms"][mode] for r in rows], **STYLE[mode])
    for r in rows:
        shared.annotate(f"{r['computed_tokens']['on']}", (r["fraction"], r["ttft_ms"]["on"]),
                        textcoords="offset points", xytext=(0, -15), ha="center", fontsize=9,
                        color=STYLE["on"]["color"])
    best = rows[-1]
    shared.set_title(f"shared system prompt, {config['prompt_tokens']}-token prompts: TTFT "
                     f"(ms)\nlabels: tokens computed; at {best['fraction']:g} shared "
                     f"{best['speedup']:.1f}x lower (median of repeats' ratios)", fontsize=11)
    shared.set_xlabel("fraction of the prompt shared with an earlier request")
    shared.set_xticks(x, [f"{f:g}" for f in x])
    t = [c["turn"] for c in chat]
    for mode in ("on", "off"):
        turns.plot(t, [c["ttft_ms"][mode] for c in chat], **STYLE[mode])
    for c in chat:
        turns.annotate(f"{c['shared_fraction']:.2f}", (c["turn"], c["ttft_ms"]["on"]),
                       textcoords="offset points", xytext=(0, -15), ha="center", fontsize=9,
                       color=STYLE["on"]["color"])
    turns.set_title(f"multi-turn chat ({config['user_tokens']}-token messages, "
                    f"{config['answer_tokens']}-token answers): TTFT (ms)\nlabels: fraction "
                    "of the turn's prompt found cached", fontsize=11)
    turns.set_xlabel("turn (its prompt: every earlier turn, then the new message)")
    turns.set_xticks(t, [f"{n}\n({c['prompt_tokens']} tok)" for n, c in zip(t, chat)])
    for ax in (shared, turns):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
        ax.grid(alpha=0.3)
    key = [(Line2D([], [], **STYLE[m]), LABELS[m]) for m in ("on", "off")]
    fig.legend(*zip(*key), loc="lower center", ncol=2, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    shape = config["shape"]
    fig.suptitle(f"S13 prefix caching: random Qwen3 layout (hidden {shape['hidden_size']}, "
                 f"{shape['num_hidden_layers']} layers), block_size {config['block_size']}, "
                 f"{config['device']} x {config['threads']} thread, median of "
                 f"{config['repeats']}; hit rate {figures['hit_rate']['tokens']:.0%} of "
                 "prompt tokens", fontsize=12)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.80, bottom=0.24, wspace=0.2)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
