"""Draw chapters/figures/s17_attention.png from the S17 benchmark's record.

    python benchmarks/bench_s17_attention.py --record   # writes the JSON below
    python scripts/s17_figure.py            # writes chapters/figures/s17_attention.png
    python scripts/s17_figure.py --check    # exits 1 when the committed file is not what it draws

Five panels, every value read from the JSON (section numbers are the benchmark's), nothing
drawn by hand:

- top left (1, memory): the peak memory of one causal prefill against T, one line per method
  (naive, SDPA held to its math backend, SDPA, S17's tiled reference), log-log, beside the
  dashed line of one float32 score matrix, H x T^2 x 4 bytes (a method that failed at a T has
  no point there);
- top middle and top right (2, decode): for each model, each backend's median decode step as a
  share of S11's contiguous step (paged / contiguous, gather / contiguous, sdpa / contiguous)
  against the batch size, colour by backend, marker and line style by context; dashed: the
  issue's target for the paged step (1.0x); a model the run did not measure says so;
- bottom left, two columns wide (3, traffic): one layer's decode attention alone, the median
  time of each kernel against the bytes `attention_traffic` counts for it, every point of
  both models (filled markers: the bundled model, hollow: the mid-size one), log-log; dotted:
  the time those bytes take at the run's copy bandwidth;
- bottom right (4, gpu): with a GPU section, each kernel's time as a share of its baseline
  against T or the context: the Triton flash forward's best tile over SDPA, the Triton paged
  decode over gather + SDPA at each B, split-K's best split count over one pass at B = 1; a
  record without one says that no GPU measured it, and what that section measures.

Legends sit below the panels, off the data (tests/legend_check.py checks it). A section the
JSON does not have (a run with --sections) leaves its panel saying so.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from figure_io import figure_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s17_attention.json"
OUT = ROOT / "chapters" / "figures" / "s17_attention.png"

MIB = 2 ** 20
# method or backend -> colour; a name not listed gets a grey (a new one still draws)
COLORS = {"naive": "#c53030", "sdpa math": "#dd6b20", "sdpa": "#d69e2e", "tiled": "#319795",
          "contiguous": "#4a5568", "gather": "#805ad5", "paged": "#2b6cb0"}
OTHER_COLOR = "#a0aec0"
DECODE_BACKENDS = ("gather", "sdpa", "paged")
CONTEXT_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))
MODEL_MARKERS = {"bundled": True, "mid": False}          # filled or hollow in panel 3
MODEL_NAMES = {"bundled": "bundled model", "mid": "mid-size model"}
GPU_LINES = {"flash": ("#2b6cb0", "-", "o"), "decode": ("#38a169", "--", "s"),
             "split_k": ("#d53f8c", ":", "^")}
GPU_SECTION = ("the GPU section (--device cuda): Triton's flash forward against SDPA at\n"
               "T = 1k, 4k, 16k; the paged decode kernel against gather + SDPA at contexts\n"
               "1k to 32k, B = 1 and 16; split-K's gain at B = 1")


def color(name: str) -> str:
    return COLORS.get(name, OTHER_COLOR)


def missing(ax, what: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no {what} section in this run", ha="center", va="center",
            transform=ax.transAxes, color="0.4")


def memory_lines(figures: dict) -> list[tuple[str, list[int], list[float]]]:
    """Panel 1's data: [(method, T values, peak MiB)], in the record's method order, the rows
    that failed left out."""
    part = figures["memory"]
    out = []
    for method in part["methods"]:
        rows = sorted((r for r in part["rows"] if r["method"] == method and "error" not in r),
                      key=lambda r: r["T"])
        if rows:
            out.append((method, [r["T"] for r in rows], [r["peak_bytes"] / MIB for r in rows]))
    return out


def scores_line(figures: dict) -> tuple[list[int], list[float]]:
    """The analytic score matrix, H x T^2 x 4 bytes, in MiB, at each T of the record."""
    heads = figures["memory"]["heads"]["num_heads"]
    ts = sorted(figures["memory"]["T"])
    return ts, [heads * t * t * 4 / MIB for t in ts]


def decode_lines(figures: dict, model: str) -> list[tuple[str, int, list[int], list[float]]]:
    """Panels 2's data for one model: [(backend, context, batches, step / contiguous step)]."""
    points = figures["decode"]["models"][model]["points"]
    out = []
    for backend in DECODE_BACKENDS:
        for context in sorted({p["context"] for p in points}):
            rows = sorted((p for p in points if p["context"] == context
                           and backend in p["ratios"]), key=lambda p: p["batch"])
            if rows:
                out.append((backend, context, [p["batch"] for p in rows],
                            [p["ratios"][backend]["step"] for p in rows]))
    return out


def traffic_points(figures: dict) -> list[tuple[str, str, float, float]]:
    """Panel 3's data: [(model, kernel, KiB moved, median microseconds)], every point."""
    out = []
    for model, part in figures["traffic"]["models"].items():
        for point in part["points"]:
            for kernel, row in point["kernels"].items():
                out.append((model, kernel, row["traffic"]["total"] / 1024, row["ms"] * 1e3))
    return out


def gpu_lines(figures: dict) -> list[tuple[str, str, list[int], list[float]]]:
    """Panel 4's data: [(part, label, sizes, time / baseline)]: the flash forward's best tile
    over SDPA against T; the paged kernel over gather + SDPA against the context, per B (the
    first B drawn with hollow markers); split-K's best split count over one pass (B = 1)
    against the context."""
    gpu = figures["gpu"]
    out = []
    rows = gpu.get("flash", {}).get("rows", [])
    ts = sorted({r["T"] for r in rows})
    best = [min(r["over_sdpa"] for r in rows if r["T"] == t and r["method"] != "sdpa")
            for t in ts if any(r["T"] == t and r["method"] != "sdpa" for r in rows)]
    if best:
        out.append(("flash", "flash forward / SDPA, best tile (x: T)", ts, best))
    rows = gpu.get("decode", {}).get("rows", [])
    for batch in sorted({r["batch"] for r in rows}):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        out.append(("decode", f"paged decode / gather + SDPA, B = {batch} (x: context)",
                    [r["context"] for r in mine], [r["ratio"] for r in mine]))
    rows = [r for r in gpu.get("split_k", {}).get("rows", []) if r["num_splits"] > 1]
    contexts = sorted({r["context"] for r in rows})
    if contexts:
        out.append(("split_k", "split-K, best splits / one pass, B = 1 (x: context)",
                    contexts, [1 / max(r["gain"] for r in rows if r["context"] == c)
                               for c in contexts]))
    return out


def gpu_fills(lines) -> list[str | None]:
    """Marker faces of panel 4's lines: the first decode line (the smallest B) hollow."""
    first = next((i for i, (part, *_) in enumerate(lines) if part == "decode"), None)
    return ["white" if i == first and sum(p == "decode" for p, *_ in lines) > 1 else None
            for i in range(len(lines))]


def draw_memory(ax, figures: dict) -> None:
    if "memory" not in figures:
        return missing(ax, "memory (1)")
    for method, ts, mib in memory_lines(figures):
        ax.plot(ts, mib, "-o", color=color(method), ms=5)
    ts, scores = scores_line(figures)
    ax.plot(ts, scores, "--", marker="x", color="0.2", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25"
                                               else ""))
    ax.set_xticks(ts, [f"{t:,}" for t in ts])
    ax.set_xlim(ts[0] / 1.4, ts[-1] * 1.4)
    ax.set_xlabel("T, tokens of one causal prefill")
    ax.set_ylabel("peak memory of the call, MiB")
    heads = figures["memory"]["heads"]
    ax.set_title(f"1. memory of one prefill (H = {heads['num_heads']}, D = {heads['head_dim']},"
                 f" float32)\n(dashed: one score matrix, H x T^2 x 4 bytes)", fontsize=10)
    ax.grid(alpha=0.3, which="both")


def draw_decode(ax, figures: dict, model: str) -> None:
    if "decode" not in figures:
        return missing(ax, "decode (2)")
    if model not in figures["decode"]["models"]:
        return missing(ax, f"{MODEL_NAMES.get(model, model)} decode")
    part = figures["decode"]["models"][model]
    contexts = sorted({p["context"] for p in part["points"]})
    top = 1.0
    for backend, context, batches, ratios in decode_lines(figures, model):
        style, marker = CONTEXT_STYLES[contexts.index(context) % len(CONTEXT_STYLES)]
        ax.plot(batches, ratios, style, marker=marker, color=color(backend), ms=5)
        top = max(top, *ratios)
    ax.axhline(1.0, color="#c53030", ls="--", lw=1)
    batches = sorted({p["batch"] for p in part["points"]}) or [1]
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlim(batches[0] / 1.4, batches[-1] * 1.4)
    ax.set_ylim(0, top * 1.12)
    ax.set_xlabel("B, requests decoding in the step")
    ax.set_ylabel("decode step / contiguous step")
    skipped = len(part.get("skipped", []))
    note = f", {skipped} points skipped" if skipped else ""
    ax.set_title(f"2. decode step / S11's contiguous step, {MODEL_NAMES.get(model, model)}\n"
                 f"({part['num_layers']} layers, window {part['limit']}{note}; dashed: the "
                 f"paged target)", fontsize=10)
    ax.grid(alpha=0.3)


def draw_traffic(ax, figures: dict) -> None:
    if "traffic" not in figures:
        return missing(ax, "traffic (3)")
    points = traffic_points(figures)
    for model, kernel, kib, us in points:
        filled = MODEL_MARKERS.get(model, True)
        ax.plot([kib], [us], "o", ms=6, color=color(kernel),
                mfc=color(kernel) if filled else "white", mew=1.5)
    if points:
        lo, hi = min(p[2] for p in points) / 1.5, max(p[2] for p in points) * 1.5
        bandwidth = figures["traffic"]["bandwidth_bytes_per_s"]
        ax.plot([lo, hi], [lo * 1024 / bandwidth * 1e6, hi * 1024 / bandwidth * 1e6], ":",
                color="0.2", lw=1)
        ax.set_xlim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes one layer's decode attention moves (attention_traffic), KiB")
    ax.set_ylabel("median time of the call, microseconds")
    bandwidth = figures["traffic"]["bandwidth_bytes_per_s"] / 1e9
    ax.set_title("3. one layer's decode attention alone: time against the bytes it moves\n"
                 f"(dotted: those bytes at the copy's {bandwidth:.1f} GB/s; filled: bundled "
                 "model, hollow: mid-size)", fontsize=10)
    ax.grid(alpha=0.3, which="both")


def draw_gpu(ax, figures: dict) -> None:
    lines = gpu_lines(figures) if "gpu" in figures else []
    if not lines:
        ax.set_axis_off()
        why = figures.get("gpu", {}).get("skipped", {}).get("all")
        head = f"the GPU section was skipped: {why[:60]}" if why else "no GPU in this run"
        ax.text(0.5, 0.5, f"4. {head}\n\n{GPU_SECTION}", ha="center", va="center",
                transform=ax.transAxes, color="0.3", fontsize=9)
        return
    top = 1.0
    sizes = set()
    for (part, label, xs, ratios), mfc in zip(lines, gpu_fills(lines)):
        c, style, marker = GPU_LINES[part]
        ax.plot(xs, ratios, style, marker=marker, color=c, ms=5, mfc=mfc)
        top = max(top, *ratios)
        sizes.update(xs)
    ax.axhline(1.0, color="0.3", ls=":", lw=1)
    sizes = sorted(sizes)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s // 1024}k" if s >= 1024 else str(s) for s in sizes])
    ax.set_xlim(sizes[0] / 1.4, sizes[-1] * 1.4)
    ax.set_ylim(0, top * 1.12)
    ax.set_xlabel("T (flash) or context (decode, split-K)")
    ax.set_ylabel("time / the baseline's")
    ax.set_title(f"4. Triton kernels on {figures['gpu']['device']}\n(dotted: as fast as the "
                 "baseline; lower is faster)", fontsize=10)
    ax.grid(alpha=0.3)


def build_figure(figures: dict):
    fig = plt.figure(figsize=(18, 11.5))
    grid = fig.add_gridspec(2, 3, hspace=0.42, wspace=0.28)
    memory, bundled, mid = (fig.add_subplot(grid[0, i]) for i in range(3))
    traffic, gpu = fig.add_subplot(grid[1, :2]), fig.add_subplot(grid[1, 2])
    draw_memory(memory, figures)
    draw_decode(bundled, figures, "bundled")
    draw_decode(mid, figures, "mid")
    draw_traffic(traffic, figures)
    draw_gpu(gpu, figures)
    names = []
    if "memory" in figures:
        names += [m for m, *_ in memory_lines(figures)]
    if "decode" in figures:
        names += [b for b in DECODE_BACKENDS if b not in names]
    if "traffic" in figures:
        names += [k for _, k, *_ in traffic_points(figures) if k not in names]
    handles = [(Line2D([], [], color=color(n), marker="o", ls="-"), n)
               for n in dict.fromkeys(names)]
    handles.append((Line2D([], [], color="0.2", ls="--"), "1: one score matrix"))
    fig.legend(*zip(*handles), loc="lower center", ncol=4, frameon=False,
               bbox_to_anchor=(0.25, 0.0), fontsize=9, title="colour: method, backend or kernel",
               title_fontsize=9)
    contexts = []
    for model in ("bundled", "mid"):
        for p in figures.get("decode", {}).get("models", {}).get(model, {}).get("points", []):
            if (model, p["context"]) not in contexts:
                contexts.append((model, p["context"]))
    styles = []
    for model in ("bundled", "mid"):
        mine = sorted(c for m, c in contexts if m == model)
        for i, context in enumerate(mine):
            style, marker = CONTEXT_STYLES[i % len(CONTEXT_STYLES)]
            styles.append((Line2D([], [], color="0.3", ls=style, marker=marker),
                           f"{MODEL_NAMES[model]}, context {context}"))
    if styles:
        fig.legend(*zip(*styles), loc="lower center", ncol=2, frameon=False,
                   bbox_to_anchor=(0.6, 0.0), fontsize=9, title="2: line style",
                   title_fontsize=9)
    lines = gpu_lines(figures) if "gpu" in figures else []
    if lines:
        gpu_handles = [(Line2D([], [], color=GPU_LINES[part][0], ls=GPU_LINES[part][1],
                               marker=GPU_LINES[part][2], mfc=mfc), label)
                       for (part, label, *_), mfc in zip(lines, gpu_fills(lines))]
        fig.legend(*zip(*gpu_handles), loc="lower center", ncol=1, frameon=False,
                   bbox_to_anchor=(0.87, 0.0), fontsize=8, title="4", title_fontsize=9)
    config = figures["config"]
    fig.suptitle(f"S17, attention kernels: memory of tiled attention, the paged decode step, "
                 f"bytes moved; {config['device']}, torch {config['torch']}, "
                 f"{config['threads']} thread, {config['logical_cores']} logical cores"
                 + (" (a --quick run: not the record)" if config.get("quick") else ""),
                 fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.91, bottom=0.16)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
