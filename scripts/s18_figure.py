"""Draw chapters/figures/s18_tensor_parallel.png from the S18 benchmark's record.

    python benchmarks/bench_s18_tensor_parallel.py --record   # writes the JSON below
    python scripts/s18_figure.py            # writes chapters/figures/s18_tensor_parallel.png
    python scripts/s18_figure.py --check    # exits 1 when the committed file is not what it draws

Three panels, every value read from the JSON (section numbers are the benchmark's), nothing
drawn by hand:

- left (1, allreduce): the median time of one all-reduce between two processes against the
  message size, gloo and shared memory, log-log; dotted verticals at the message sizes of one
  decode step (B x C x 4 bytes) of each model at each B in the record's plan, labelled;
- middle (2, tp): for each (model, B), the speedup TP=1 / TP=2 of the decode step, three bars:
  TP=2 with the shared-memory all-reduce and with gloo against tp1 (one thread), and TP=2
  (shared memory) against tp1_2threads (one process on the same two cores); log scale, the
  dashed line at 1.0 (above it TP=2 is faster);
- right (2, tp): the bytes one rank holds at TP=2 as a share of TP=1's, per model: its
  weights (the executor's count against the whole model's) and its KV pool at the largest B
  (Hkv / 2 heads), each bar labelled with both sizes in MiB; dashed: one half.

Legends sit below the panels, off the data (tests/legend_check.py checks it). A section the
JSON does not have (a run with --sections) leaves its panels saying so.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from figure_io import figure_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
OUT = ROOT / "chapters" / "figures" / "s18_tensor_parallel.png"

MIB = 2 ** 20
COMM_COLORS = {"gloo": "#c53030", "shm": "#2b6cb0"}
OTHER_COLOR = "#a0aec0"
# speedup key -> (label, colour)
SPEEDUPS = (("tp1_over_tp2_shm", "TP=2 shared memory / TP=1, 1 thread", "#2b6cb0"),
            ("tp1_over_tp2_gloo", "TP=2 gloo / TP=1, 1 thread", "#c53030"),
            ("tp1_2threads_over_tp2_shm", "TP=2 shared memory / TP=1, 2 threads", "#319795"))
MEMORY = (("weights", "#4a5568"), ("KV pool", "#d69e2e"))
MODEL_NAMES = {"bundled": "bundled", "mid": "mid-size"}


def size_label(nbytes: float) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def missing(ax, what: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no {what} section in this run", ha="center", va="center",
            transform=ax.transAxes, color="0.4")


def latency_lines(figures: dict) -> list[tuple[str, list[int], list[float]]]:
    """Panel 1's data: [(communicator, message bytes, median microseconds)]."""
    part = figures["allreduce"]
    out = []
    for comm in part["comms"]:
        rows = sorted((r for r in part["rows"] if r["comm"] == comm), key=lambda r: r["bytes"])
        out.append((comm, [r["bytes"] for r in rows], [r["median_us"] for r in rows]))
    return out


def step_messages(figures: dict) -> list[tuple[int, str]]:
    """Panel 1's verticals: [(bytes, "model B=b, ...")], one per distinct message size of the
    plan (models sharing a size share a label)."""
    labels: dict[int, list[str]] = {}
    for p in figures["allreduce"]["plan"]:
        labels.setdefault(p["bytes_each"], []).append(
            f"{MODEL_NAMES.get(p['model'], p['model'])} B={p['batch']}")
    return sorted((b, ", ".join(v)) for b, v in labels.items())


def speedup_bars(figures: dict) -> list[tuple[str, list[float]]]:
    """Panel 2's data: [("model\\nB=b", [each of SPEEDUPS' values])], the record's order."""
    out = []
    for key, part in figures["tp"]["models"].items():
        for p in part["points"]:
            out.append((f"{MODEL_NAMES.get(key, key)}\nB={p['batch']}",
                        [p["speedup"][name] for name, *_ in SPEEDUPS]))
    return out


def memory_bars(figures: dict) -> list[tuple[str, str, float, float]]:
    """Panel 3's data: [(model, "weights" or "KV pool", MiB one rank holds at TP=2, MiB at
    TP=1)]; the pool at the record's largest B."""
    out = []
    for key, part in figures["tp"]["models"].items():
        point = max(part["points"], key=lambda p: p["batch"])
        w, pools = part["weight_bytes"], point["pool_bytes"]
        out.append((key, "weights", w["shard_bytes"][0] / MIB, w["full"] / MIB))
        out.append((key, "KV pool", pools["tp2_shm"] / MIB, pools["tp1"] / MIB))
    return out


def draw_latency(ax, figures: dict) -> None:
    if "allreduce" not in figures:
        return missing(ax, "allreduce (1)")
    lines = latency_lines(figures)
    top = max(max(us) for _, _, us in lines)
    for nbytes, label in step_messages(figures):
        ax.axvline(nbytes, color="0.55", ls=":", lw=1)
        ax.text(nbytes * 1.08, top * 1.6, label, rotation=90, va="top", ha="left",
                fontsize=7, color="0.35")
    for comm, sizes, us in lines:
        ax.plot(sizes, us, "-o", color=COMM_COLORS.get(comm, OTHER_COLOR), ms=4)
    sizes = figures["allreduce"]["bytes"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sizes[::2] if len(sizes) > 8 else sizes
    ax.set_xticks(ticks, [size_label(s) for s in ticks], rotation=45, ha="right")
    ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
    ax.set_ylim(top=top * 2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("message, bytes of float32")
    ax.set_ylabel("median time of one all-reduce, microseconds")
    part = figures["allreduce"]
    ax.set_title(f"1. one all-reduce between {part['world_size']} processes (1 thread each)\n"
                 "(dotted: one decode step's messages, B x C x 4 bytes)", fontsize=10)
    ax.grid(alpha=0.3, which="both")


def draw_speedup(ax, figures: dict) -> None:
    if "tp" not in figures:
        return missing(ax, "tp (2)")
    groups = speedup_bars(figures)
    width = 0.8 / len(SPEEDUPS)
    values = [v for _, vs in groups for v in vs]
    for i, (_, _, color) in enumerate(SPEEDUPS):
        xs = [g + (i - (len(SPEEDUPS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [vs[i] for _, vs in groups], width, color=color)
    ax.axhline(1.0, color="0.2", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(min(values + [1.0]) / 1.6, max(values + [1.0]) * 1.6)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if f"{v:.0e}"[0] in "25"
                                               else ""))   # the leading digit: 0.2, 0.5, 2, 5
    ax.set_xticks(range(len(groups)), [label for label, _ in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel("speedup = TP=1 decode step / TP=2 step")
    tp = figures["tp"]
    ax.set_title(f"2. decode step, TP=2 against TP=1 ({tp['prompt_tokens']}-token prompts)\n"
                 "(dashed: as fast; above it TP=2 is faster)", fontsize=10)
    ax.grid(alpha=0.3, axis="y", which="both")


def draw_memory(ax, figures: dict) -> None:
    if "tp" not in figures:
        return missing(ax, "tp (2)")
    bars = memory_bars(figures)
    models = list(dict.fromkeys(key for key, *_ in bars))
    colors = dict(MEMORY)
    width = 0.8 / len(MEMORY)
    for key, what, tp2, tp1 in bars:
        i = [name for name, _ in MEMORY].index(what)
        x = models.index(key) + (i - (len(MEMORY) - 1) / 2) * width
        ax.bar([x], [tp2 / tp1], width, color=colors[what])
        ax.text(x, tp2 / tp1 + 0.02, f"{tp2:.3g} of\n{tp1:.3g} MiB", ha="center",
                va="bottom", fontsize=8, color="0.25")
    ax.axhline(0.5, color="0.2", ls="--", lw=1)
    ax.set_xticks(range(len(models)), [MODEL_NAMES.get(k, k) for k in models])
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.set_ylim(0, 0.8)
    ax.set_ylabel("bytes one rank holds at TP=2 / at TP=1")
    batch = max(figures["tp"]["batches"])
    ax.set_title(f"3. memory per rank: weights, and the KV pool at B={batch}\n"
                 "(dashed: half; norms are whole on every rank)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")


def build_figure(figures: dict):
    fig = plt.figure(figsize=(18, 7.2))
    grid = fig.add_gridspec(1, 3, width_ratios=(1.1, 1.2, 0.8), wspace=0.28)
    latency, speedup, memory = (fig.add_subplot(grid[0, i]) for i in range(3))
    draw_latency(latency, figures)
    draw_speedup(speedup, figures)
    draw_memory(memory, figures)
    if "allreduce" in figures:
        handles = [(Line2D([], [], color=COMM_COLORS.get(c, OTHER_COLOR), marker="o"),
                    {"gloo": "gloo (torch.distributed, loopback TCP)",
                     "shm": "shared memory (ShmCommunicator)"}.get(c, c))
                   for c in figures["allreduce"]["comms"]]
        fig.legend(*zip(*handles), loc="lower center", ncol=1, frameon=False,
                   bbox_to_anchor=(0.2, 0.0), fontsize=9, title="1: all-reduce",
                   title_fontsize=9)
    if "tp" in figures:
        fig.legend([Patch(color=color) for *_, color in SPEEDUPS],
                   [label for _, label, _ in SPEEDUPS], loc="lower center", ncol=1,
                   frameon=False, bbox_to_anchor=(0.53, 0.0), fontsize=9,
                   title="2: speedup of", title_fontsize=9)
        fig.legend([Patch(color=color) for _, color in MEMORY], [n for n, _ in MEMORY],
                   loc="lower center", ncol=2, frameon=False, bbox_to_anchor=(0.84, 0.0),
                   fontsize=9, title="3: bytes", title_fontsize=9)
    config = figures["config"]
    fig.suptitle(f"S18, tensor parallelism: the cost of an all-reduce and the decode step of "
                 f"TP=2; {config['device']}, torch {config['torch']}, 1 thread per rank, "
                 f"{config['logical_cores']} logical cores"
                 + (" (a --quick run: not the record)" if config.get("quick") else ""),
                 fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.86, bottom=0.27)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
